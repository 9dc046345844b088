"""Benchmarks of ov_backend against PyTorch eager, the stock OpenVINO backend and static models.

``python -m bench`` builds full-size SD 1.5 components with random weights (nothing is
downloaded), runs every variant in its own worker process with the variants interleaved
round by round, and writes a JSON file and a markdown table; ``python -m bench --quick``
does the same on small models in seconds (CI runs it). See ``python -m bench --help``.
"""

from bench.settings import BenchSettings, build_settings

__all__ = ["BenchSettings", "build_settings"]
