"""Shared test set-up: offline, CPU, quiet third-party loggers."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_OFFLINE", "1")


#: The benchmark harness's own end-to-end runs (each runs a bench command on tiny models, the short soak against
#: real WebUIs of its own included: about six and a half minutes in all on 2 cores), marked ``bench``: ``.ci/test``
#: leaves them out unless ``OV_TEST_MARKS`` says otherwise (``docs/testing.md``). The bench's unit tests (its
#: report, the soak's bounds on synthetic runs) always run.
BENCH_RUNS = ("tests/bench/test_quick.py", "tests/bench/test_webui_bench.py", "tests/bench/test_batch_bench.py",
              "tests/bench/test_streams_bench.py", "tests/real_webui/test_real_webui_soak.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(BENCH_RUNS):
            item.add_marker(pytest.mark.bench)
