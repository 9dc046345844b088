"""One copy of each concept across the layers: the adapter uses the backend's device rule and precision
table and the SD layer's list of parts, so the panel, the API, the command line and the backend agree."""

from __future__ import annotations

from typing import Any

import pytest

from ov_accelerate_sd.cli import build_parser
from ov_accelerate_sd.openvino_entry import PART_NAMES
from ov_accelerate_sd.parts import PARTS
from ov_accelerate_sd.settings import build_sd_settings
from ov_accelerate_webui.options import PRECISION_LABELS, panel_values
from ov_accelerate_webui.settings import DEFAULTS, FIELD_NAMES, build_settings, from_ui_args, parse_infotext
from ov_backend import build_settings as backend_settings
from ov_backend.devices import check_device
from ov_backend.precision import PRECISION_CONFIG

AVAILABLE = ["CPU", "GPU.0"]


def _choices(option: str) -> tuple[str, ...]:
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]  # noqa: SLF001
    (action,) = [a for a in generate._actions if option in a.option_strings]  # noqa: SLF001
    return tuple(action.choices)


@pytest.mark.parametrize(
    "device",
    ["CPU", "GPU", "GPU.0", "AUTO", "AUTO:GPU,CPU", "HETERO:GPU.0,CPU", "MULTI:CPU,GPU", "BATCH:GPU(4)", "BATCH:CPU",
     "NPU", "GPU.3", "BATCH:NPU(2)", "HETERO:NPU,CPU", "HETERO:"],
)
def test_the_panel_and_the_backend_accept_the_same_devices(device: str) -> None:
    try:
        expected: Any = check_device(device, AVAILABLE)
    except ValueError as err:
        expected = err
    if isinstance(expected, ValueError):
        with pytest.raises(ValueError, match="unknown OpenVINO device"):
            from_ui_args([device], AVAILABLE)
    else:
        assert from_ui_args([device], AVAILABLE).device == expected
        assert from_ui_args([f"{device}: a device label"], AVAILABLE).device == expected


def test_every_layer_names_the_same_precisions_and_gets_the_same_plugin_hint(tmp_path: Any) -> None:
    assert tuple(PRECISION_LABELS) == tuple(PRECISION_CONFIG)  # the panel labels every precision, in order
    assert _choices("--precision") == tuple(PRECISION_CONFIG)
    for name, label in PRECISION_LABELS.items():
        panel = build_settings(panel_values({"precision": label})).backend_choice(str(tmp_path))
        command_line = build_sd_settings({"precision": name, "cache_dir": str(tmp_path)}).backend_choice()
        assert panel == command_line  # one backend for both
        for part in PARTS:
            assert backend_settings(panel.for_part(part).options()).compile_config == PRECISION_CONFIG[
                "auto" if name == "int8" and part != "unet" else name]
        assert build_settings({"precision": name}).precision == name  # the infotext's spelling is the name
    with pytest.raises(ValueError,
                       match=r"Unknown precision 'Full'; choose one of \['auto', 'f32', 'int8', 'int8-weights'\]"):
        build_settings(panel_values({"precision": "Full"}))


def test_every_layer_lists_the_same_parts_in_one_order() -> None:
    assert tuple(PART_NAMES) == PARTS
    assert tuple(name for name in FIELD_NAMES if name in PARTS) == PARTS  # the panel's checkboxes
    assert _choices("--pytorch") == PARTS
    assert DEFAULTS.parts == PARTS == build_sd_settings().accelerate
    assert build_sd_settings({"accelerate": "text_encoder,unet"}).accelerate == ("unet", "text_encoder")
    assert build_settings({"vae": False}).parts == ("unet", "text_encoder")
    assert DEFAULTS.infotext() == "CPU, UNet+VAE+TE, auto"
    assert parse_infotext("CPU, TE+UNet, f32") == ({"unet": True, "vae": False, "text_encoder": True,
                                                    "device": "CPU", "precision": "f32", "step_cache": 1}, [])


def test_booleans_are_booleans() -> None:
    assert build_settings({"unet": False}).unet is False
    with pytest.raises(ValueError, match="'vae' must be true or false"):
        build_settings({"vae": "yes"})
