"""sd-webui-controlnet in the real-host tier: its own WebUI, ControlNet units and ControlNet's X/Y/Z axes.

The test bed holds the extension (``sd-webui-controlnet/``, at 56cec5b2, just after v1.1.455), its
``controlnet_aux`` in the venv and a random ControlNet for the bed's full-size ``sd15-random.safetensors``
(``webui/models/ControlNet/``, made by ``make_controlnet.py``); see ``.ci/build_testbed.py``. The tier's main
WebUI never gets ControlNet: :func:`prepare_controlnet_webui` sets up a data folder of its own, with this
project installed as in the main one, ControlNet copied beside it, and the WebUI started with
``--skip-install`` (ControlNet's ``install.py`` would move the WebUI's pins and reach GitHub; this project's
own ``install.py`` is run first, as the WebUI would).

Over the API a unit is a dict in ``alwayson_scripts`` (:func:`controlnet_unit`, :func:`with_controlnet`);
ControlNet's X/Y/Z axes set ``p.control_net_<field>`` for every unit (:data:`CONTROLNET_AXES`,
:func:`controlnet_xyz_args`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from .test_real_webui_section import script_arg_index, xyz_args
from .webui import WebUI, encode_image

CONTROLNET_EXTENSION = "sd-webui-controlnet"
#: The bed's full-size random SD 1.5 checkpoint: ControlNet's SD 1.5 layout (320 channels, context 768) fits
#: nothing smaller, so every ControlNet test runs on it.
CONTROLNET_CHECKPOINT = "sd15-random.safetensors"
#: The random ControlNet's file in the bed's ``webui/models/ControlNet`` (ControlNet lists it by its stem).
CONTROLNET_MODEL_FILE = "ovtest-controlnet-sd15.safetensors"
#: The API's name of ControlNet's always-on script (``alwayson_scripts``).
CONTROLNET_SCRIPT = "ControlNet"
#: Unit field -> the X/Y/Z axis sd-webui-controlnet adds for it (its ``scripts/xyz_grid_support.py``).
CONTROLNET_AXES = {
    "enabled": "[ControlNet] Enabled",
    "model": "[ControlNet] Model",
    "weight": "[ControlNet] Weight",
    "guidance_start": "[ControlNet] Guidance Start",
    "guidance_end": "[ControlNet] Guidance End",
    "control_mode": "[ControlNet] Control Mode",
    "resize_mode": "[ControlNet] Resize Mode",
    "module": "[ControlNet] Preprocessor",
    "processor_res": "[ControlNet] Pre Resolution",
    "threshold_a": "[ControlNet] Pre Threshold A",
    "threshold_b": "[ControlNet] Pre Threshold B",
}


def controlnet_missing(testbed: Path) -> str | None:
    """What the test bed lacks for ControlNet (None when it has everything): an older bed, built before
    ControlNet was part of it, is rebuilt in place by ``bash .ci/testbed``."""
    needed = [testbed / CONTROLNET_EXTENSION / "scripts" / "controlnet.py",
              testbed / "webui" / "models" / "ControlNet" / CONTROLNET_MODEL_FILE,
              testbed / "webui" / "models" / "Stable-diffusion" / CONTROLNET_CHECKPOINT]
    missing = [str(path) for path in needed if not path.is_file()]
    if not any((testbed / "venv" / "lib").glob("python3.*/site-packages/controlnet_aux")):
        missing.append("controlnet_aux in the venv")
    return f"the test bed has no {', '.join(missing)}: run `bash .ci/testbed`" if missing else None


def prepare_controlnet_webui(ui: WebUI, extra_extensions: list[Path]) -> None:
    """This project and ``extra_extensions`` installed as in the main WebUI (:meth:`WebUI.prepare`, without the
    tiny models), ControlNet copied beside them, the bed's SD 1.5 checkpoint and random ControlNet linked into
    the data folder's models, this project's ``install.py`` run, and the WebUI set to start with
    ``--skip-install`` on the SD 1.5 checkpoint."""
    ui.prepare(extra_extensions, tiny_models=False)
    shutil.copytree(ui.testbed / CONTROLNET_EXTENSION, ui.data_dir / "extensions" / CONTROLNET_EXTENSION,
                    ignore=shutil.ignore_patterns(".git", "__pycache__"), dirs_exist_ok=True)
    for folder, name in (("Stable-diffusion", CONTROLNET_CHECKPOINT), ("ControlNet", CONTROLNET_MODEL_FILE)):
        target = ui.data_dir / "models" / folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.symlink_to(ui.testbed / "webui" / "models" / folder / name)
    ui.run_installer()
    ui.checkpoint = CONTROLNET_CHECKPOINT
    ui.extra_flags = ["--skip-install"]


def controlnet_model_name(ui: WebUI) -> str:
    """The random ControlNet's name as ControlNet lists it (``/controlnet/model_list``): ``"<stem> [<hash>]"``."""
    stem = Path(CONTROLNET_MODEL_FILE).stem
    names = ui.get("/controlnet/model_list")["model_list"]
    found = [name for name in names if name.split(" [")[0] == stem]
    assert len(found) == 1, f"{stem} is not among ControlNet's models: {names}"
    return found[0]


def control_image(width: int = 64, height: int = 64) -> Image.Image:
    """A control image as a user would draw one for module "none": white shapes on black."""
    image = Image.new("RGB", (width, height), "black")
    draw = ImageDraw.Draw(image)
    draw.rectangle((width // 8, height // 8, width // 2, height // 2), fill="white")
    draw.ellipse((width // 2, height // 2, width - width // 8, height - height // 16), fill="white")
    draw.line((0, height - 1, width - 1, 0), fill="white", width=max(1, width // 32))
    return image


def controlnet_unit(
    model: str,
    image: Image.Image | None = None,
    *,
    enabled: bool = True,
    weight: float = 1.0,
    guidance_start: float = 0.0,
    guidance_end: float = 1.0,
    control_mode: str = "Balanced",
    resize_mode: str = "Crop and Resize",
    processor_res: int = 512,
    module: str = "none",
    save_detected_map: bool = False,
) -> dict[str, Any]:
    """One ControlNet unit for the API (``image`` defaults to :func:`control_image` at 64x64). ``control_mode``
    is "Balanced", "My prompt is more important" or "ControlNet is more important"; ``resize_mode``
    "Just Resize", "Crop and Resize" or "Resize and Fill". With ``save_detected_map`` ControlNet appends the
    unit's control map to the response's images (off: a response holds the same pictures as without
    ControlNet, for comparisons)."""
    return {
        "enabled": enabled,
        "module": module,
        "model": model,
        "image": encode_image(image if image is not None else control_image()),
        "weight": weight,
        "guidance_start": guidance_start,
        "guidance_end": guidance_end,
        "control_mode": control_mode,
        "resize_mode": resize_mode,
        "processor_res": processor_res,
        "pixel_perfect": False,
        "save_detected_map": save_detected_map,
    }


def with_controlnet(payload: dict[str, Any], *units: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with ControlNet's units (any other always-on scripts kept)."""
    scripts = dict(payload.get("alwayson_scripts") or {})
    scripts[CONTROLNET_SCRIPT] = {"args": list(units)}
    return dict(payload, alwayson_scripts=scripts)


def controlnet_xyz_args(ui: WebUI, field: str, values: list[str], y_field: str | None = None,
                        y_values: str = "") -> list[Any]:
    """``script_args`` of the X/Y/Z plot over ControlNet's axis for unit ``field`` (a key of
    :data:`CONTROLNET_AXES`) with ``values`` on X (e.g. ``["0.5", "1"]``; sent as the axis's text and as its
    dropdown, which the axes with choices read), and optionally a second axis without choices on Y (its
    values as text, e.g. ``"0,0.5"``). ControlNet's axes apply to every unit of the request."""
    x_type = script_arg_index(ui, "x/y/z plot", "X type", CONTROLNET_AXES[field])
    y_type = script_arg_index(ui, "x/y/z plot", "Y type", CONTROLNET_AXES[y_field]) if y_field else 0
    return xyz_args(x_type, ",".join(values), y_type, y_values, x_dropdown=list(values))
