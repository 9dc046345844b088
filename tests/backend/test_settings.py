"""Settings: defaults, validation errors that name the problem, deprecated variables, immutability."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from ov_backend import BackendSettings, build_settings
from ov_backend.settings import OPTION_NAMES


def test_defaults(monkeypatch):
    for var in ("OPENVINO_TORCH_BACKEND_DEVICE", "OPENVINO_TORCH_MODEL_CACHING", "OPENVINO_TORCH_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    s = build_settings()
    assert s.device == "CPU"
    assert s.model_caching is False
    assert s.aot_autograd is False and s.strict is False
    assert s.cache_dir.is_absolute()
    assert s.cache_dir != Path(os.getcwd())
    assert s.config == () and s.disabled_ops == ()


def test_option_names_are_the_stock_set_plus_ours():
    assert set(OPTION_NAMES) == {"device", "model_caching", "cache_dir", "config", "precision", "decompositions",
                                 "disabled_ops", "aot_autograd", "strict", "min_partition_ops",
                                 "calibration_samples", "shared_shapes", "previous_weights", "rewrites",
                                 "weights_in_file", "check_memory", "cache_max_bytes"}


def test_cache_limit_has_a_default_and_zero_is_no_limit():
    from ov_backend import DEFAULT_CACHE_MAX_BYTES

    assert build_settings().cache_max_bytes == DEFAULT_CACHE_MAX_BYTES == 20 << 30
    assert build_settings({"cache_max_bytes": 0}).cache_max_bytes == 0
    assert build_settings({"cache_max_bytes": "1024"}).cache_max_bytes == 1024
    for bad in (-1, 1.5, "2G", True):
        with pytest.raises(ValueError, match="'cache_max_bytes' must be a whole number >= 0"):
            build_settings({"cache_max_bytes": bad})


def test_rewrites_are_named_and_all_applied_by_default():
    from ov_backend.rewrites import REWRITES

    assert build_settings().rewrites == REWRITES and REWRITES
    assert build_settings({"rewrites": []}).rewrites == ()
    assert build_settings({"rewrites": list(REWRITES)}).rewrites == REWRITES
    # a model converted without a rewrite is another model: the cache keys differ
    assert build_settings({"rewrites": []}).conversion_key() != build_settings().conversion_key()
    with pytest.raises(ValueError, match=r"unknown rewrite\(s\) 'fuse_everything'; known: split_projections"):
        build_settings({"rewrites": ["fuse_everything"]})
    with pytest.raises(ValueError, match="must be a list of rewrite names"):
        build_settings({"rewrites": 3})


def test_unknown_option_is_named():
    with pytest.raises(ValueError, match="'devcie'.*valid options: device"):
        build_settings({"devcie": "CPU"})


def test_unknown_device_lists_available():
    with pytest.raises(ValueError, match=r"unknown OpenVINO device 'TPU'.*available devices: CPU"):
        build_settings({"device": "TPU"})


def test_multi_device_strings():
    assert build_settings({"device": "AUTO"}).device == "AUTO"
    assert build_settings({"device": "HETERO:CPU"}).device == "HETERO:CPU"
    assert build_settings({"device": "MULTI:CPU"}).device == "MULTI:CPU"
    with pytest.raises(ValueError, match="'NPU'"):
        build_settings({"device": "HETERO:NPU,CPU"})


def test_unknown_disabled_op_is_named():
    with pytest.raises(ValueError, match="unknown op 'aten.not_an_op.default'"):
        build_settings({"disabled_ops": ["aten.not_an_op.default"]})
    s = build_settings({"disabled_ops": ["torch.ops.aten.convolution.default"]})
    assert s.disabled_ops == ("aten.convolution.default",)


def test_bad_values():
    with pytest.raises(ValueError, match="'model_caching' must be a boolean"):
        build_settings({"model_caching": "maybe"})
    with pytest.raises(ValueError, match="'config' must be a dict"):
        build_settings({"config": ["INFERENCE_PRECISION_HINT"]})
    with pytest.raises(ValueError, match="not an aten op"):
        build_settings({"decompositions": ["nothing.here"]})


def test_env_variables_are_defaults_and_options_win(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENVINO_TORCH_BACKEND_DEVICE", "AUTO")
    monkeypatch.setenv("OPENVINO_TORCH_MODEL_CACHING", "1")
    monkeypatch.setenv("OPENVINO_TORCH_CACHE_DIR", str(tmp_path))
    with pytest.warns(DeprecationWarning, match="OPENVINO_TORCH_BACKEND_DEVICE"):
        s = build_settings()
    assert (s.device, s.model_caching, s.cache_dir) == ("AUTO", True, tmp_path)
    with pytest.warns(DeprecationWarning):
        s = build_settings({"device": "CPU", "model_caching": False})
    assert (s.device, s.model_caching) == ("CPU", False)


def test_frozen_and_replace():
    s = build_settings({"config": {"INFERENCE_PRECISION_HINT": "f32"}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.device = "GPU"  # type: ignore[misc]
    t = dataclasses.replace(s, strict=True)
    assert t.strict and not s.strict
    assert s.compile_config == {"INFERENCE_PRECISION_HINT": "f32"}
    assert build_settings(t) == t
    assert isinstance(t, BackendSettings)
    assert t.on_cpu and dataclasses.replace(t, device="CPU.0").on_cpu
    assert not dataclasses.replace(t, device="GPU").on_cpu


def test_min_partition_ops():
    assert build_settings().min_partition_ops == 1
    assert build_settings({"min_partition_ops": 3}).min_partition_ops == 3
    assert build_settings({"min_partition_ops": " 4 "}).min_partition_ops == 4
    for bad in (0, -2, 1.5, "two", True):
        with pytest.raises(ValueError, match=r"'min_partition_ops' must be a whole number >= 1 \(partitions with "
                                             r"fewer aten ops run in PyTorch.*got " + re.escape(repr(bad))):
            build_settings({"min_partition_ops": bad})


@pytest.mark.parametrize(
    ("device", "accepted"),
    [
        ("GPU.0", True), ("GPU", True), ("AUTO", True), ("AUTO:GPU,CPU", True), ("HETERO:GPU.0,CPU", True),
        ("MULTI:GPU.0,CPU", True), ("BATCH:GPU(4)", True), ("BATCH:GPU.0", True),
        ("NPU", False), ("GPU.1", False), ("BATCH:NPU", False), ("HETERO:", False), ("HETERO:GPU,,CPU", False),
    ],
)
def test_the_device_rule(device: str, accepted: bool) -> None:
    """The one device rule (OpenVINO's names: generic "GPU" is GPU.0's device, BATCH: takes a batch size)."""
    from ov_backend.devices import check_device

    if accepted:
        assert check_device(device, ["CPU", "GPU.0"]) == device
    else:
        with pytest.raises(ValueError, match=r"unknown OpenVINO device .*available devices: CPU, GPU\.0"):
            check_device(device, ["CPU", "GPU.0"])


def test_precision_names_map_to_the_plugin_hint() -> None:
    f32 = build_settings({"precision": "f32"})
    assert (f32.config, f32.compile_config) == ((), {"INFERENCE_PRECISION_HINT": "f32"})
    assert build_settings({"precision": "auto"}).compile_config == {}
    assert build_settings({}).precision == "auto"
    again = build_settings(build_settings({"precision": "f32"}))
    assert (again.precision, again.compile_config) == ("f32", {"INFERENCE_PRECISION_HINT": "f32"})
    # the settings hold the user's config and the precision's name apart: replace() just works, and is checked
    assert dataclasses.replace(f32, precision="auto").compile_config == {}
    assert dataclasses.replace(f32, precision="auto").result_key() == build_settings({}).result_key()
    with pytest.raises(ValueError, match="INFERENCE_PRECISION_HINT=bf16; give one of them"):
        dataclasses.replace(build_settings({"config": {"INFERENCE_PRECISION_HINT": "bf16"}}), precision="f32")
    with pytest.raises(ValueError,
                       match=r"'precision' must be one of \['auto', 'f32', 'int8', 'int8-weights'\], got 'bf16'"):
        build_settings({"precision": "bf16"})
    with pytest.raises(ValueError, match="INFERENCE_PRECISION_HINT=bf16; give one of them"):
        build_settings({"precision": "f32", "config": {"INFERENCE_PRECISION_HINT": "bf16"}})
    # the precision changes what a compiled model computes, so it is in the cache key
    assert build_settings({"precision": "f32"}).result_key() != build_settings({}).result_key()


def test_format_bytes_uses_binary_units_with_binary_names() -> None:
    from ov_backend.files import format_bytes

    assert [format_bytes(n) for n in (0, 1023, 1024, 1536, 5 << 20, 3 << 30, 2 << 40)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "5.0 MiB", "3.0 GiB", "2.0 TiB"]


def test_per_user_cache_folder(monkeypatch, tmp_path: Path) -> None:
    from ov_backend.settings import default_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "ov_backend"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "ov_backend"
