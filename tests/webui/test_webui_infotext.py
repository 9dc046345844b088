"""The "OpenVINO" infotext entry: written from the settings, read back, and pasted into the panel.

The table round trip is checked against entries written out by hand and against A1111's own quoting
(the fake host's ``infotext_utils`` mirrors ``parse_generation_parameters``). Paste-back is checked the
way A1111 does it: the tab's paste fields (``Script.infotext_fields`` collected by ``ScriptRunner``, the
Script dropdown's "Script" key) filled from a generated image's infotext by ``paste_func``'s body,
and the pasted values given back to ``run`` as its args.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
from conftest import make_p

from ov_accelerate_sd.openvino_entry import SLOTS
from ov_accelerate_webui.extension import Extension
from ov_accelerate_webui.infotext import ENTRY_KEY, SCRIPT_KEY, TITLE, generation_params
from ov_accelerate_webui.options import PRECISION_LABELS, panel_values
from ov_accelerate_webui.settings import FIELD_NAMES, INFOTEXT_ITEMS, build_settings, from_ui_args, parse_infotext

PRECISION_F32 = PRECISION_LABELS["f32"]
"""The panel's precision control at f32."""

#: Settings -> the entry, worked out by hand.
ENTRIES = [
    ({}, "CPU, UNet+VAE+TE, auto"),
    ({"device": "GPU.0", "vae": False, "precision": "f32"}, "GPU.0, UNet+TE, f32"),
    ({"text_encoder": False, "unet": False}, "CPU, VAE, auto"),
    (
        {"device": "HETERO:GPU.0,CPU", "unet": False, "vae": False, "text_encoder": False},
        "HETERO:GPU.0,CPU, none, auto",
    ),
    ({"device": "AUTO", "precision": "f32", "model_caching": False, "cache_dir": "/c, d"}, "AUTO, UNet+VAE+TE, f32"),
    ({"step_cache": 3, "vae": False}, "CPU, UNet+TE, auto, step cache 3"),
    ({"precision": "int8-weights"}, "CPU, UNet+VAE+TE, int8-weights"),
]
#: The fields that describe this machine, not the image: deliberately not in the infotext.
NOT_IN_INFOTEXT = {"model_caching", "cache_dir"}


def test_infotext_table_covers_each_field_once() -> None:
    fields = [item.field for item in INFOTEXT_ITEMS]
    names = [item.name for item in INFOTEXT_ITEMS]
    assert len(set(fields)) == len(fields) and len(set(names)) == len(names)
    assert set(fields) | NOT_IN_INFOTEXT == set(FIELD_NAMES) and not set(fields) & NOT_IN_INFOTEXT
    assert sorted({item.slot for item in INFOTEXT_ITEMS}) == list(range(SLOTS + 1))  # (+ step caching's, optional)
    for item in INFOTEXT_ITEMS:
        if item.spellings is not None:  # every value of the field has a spelling, and spellings differ
            assert len(set(item.spellings.values())) == len(item.spellings)


@pytest.mark.parametrize(("values", "entry"), ENTRIES)
def test_entry_round_trip(fake_host: Any, values: dict[str, Any], entry: str) -> None:
    from modules import infotext_utils

    settings = build_settings(values)
    assert settings.infotext() == entry
    expected = {item.field: getattr(settings, item.field) for item in INFOTEXT_ITEMS}
    assert parse_infotext(entry) == (expected, [])
    # Through A1111's infotext line: quoted on write (it has commas), unquoted by the parser.
    written = generation_params(settings)
    line = ", ".join(f"{k}: {infotext_utils.quote(v)}" for k, v in {"Steps": 2, **written, "Seed": 7}.items())
    params = infotext_utils.parse_generation_parameters(f"a cat\nNegative prompt: dog\n{line}")
    assert params[ENTRY_KEY] == entry and params[SCRIPT_KEY] == TITLE and params["Seed"] == "7"
    assert parse_infotext(params[ENTRY_KEY])[0] == expected


def test_entry_notes_are_written_after_it_and_ignored_when_read() -> None:
    settings = build_settings({"vae": False, "precision": "f32"})
    written = generation_params(settings, ["tiny-refiner in PyTorch", "hires, model in PyTorch"])
    assert written == {
        "Script": "Accelerate with OpenVINO",
        "OpenVINO": "CPU, UNet+TE, f32; tiny-refiner in PyTorch; hires, model in PyTorch",
    }
    assert parse_infotext(written["OpenVINO"]) == (
        {"device": "CPU", "unet": True, "vae": False, "text_encoder": True, "precision": "f32", "step_cache": 1},
        [],
    )


@pytest.mark.parametrize(
    ("entry", "values", "problem"),
    [
        ("CPU, UNet+VAE+TE, bf16", {"device": "CPU", "unet": True, "vae": True, "text_encoder": True,
                                    "step_cache": 1}, "'bf16'"),
        ("GPU.1, UNet+LoRA, f32", {"device": "GPU.1", "precision": "f32", "step_cache": 1}, "['LoRA']"),
        ("CPU, , auto", {"device": "CPU", "precision": "auto", "step_cache": 1}, "unknown part"),
        ("CPU", {}, "expected 'device, parts, precision'"),
        (", UNet, auto", {"unet": True, "vae": False, "text_encoder": False, "precision": "auto", "step_cache": 1},
         "empty"),
        ("CPU, UNet, auto, step cache 9", {"device": "CPU", "unet": True, "vae": False, "text_encoder": False,
                                           "precision": "auto"}, "unknown step caching"),
    ],
)
def test_unreadable_slots_are_left_out_with_the_reason(entry: str, values: dict[str, Any], problem: str) -> None:
    parsed, problems = parse_infotext(entry)
    assert parsed == values
    assert len(problems) == 1 and problem in problems[0]


# --- paste-back in the fake host --------------------------------------------------------------------


def build_tab(extension: Extension, is_img2img: bool = False) -> tuple[Any, Any, Any]:
    """A tab built as A1111 builds it: (runner, script, demo)."""
    from modules import scripts, ui

    from ov_accelerate_webui.script import make_script_class

    runner = scripts.ScriptRunner(is_img2img=is_img2img)
    script = runner.add(make_script_class(extension))
    demo = ui.create_tab(runner)
    return runner, script, demo


def paste(tab: str, infotext: str) -> dict[str, Any]:
    """What the tab's paste button sets: elem_id -> new value (components left unchanged are absent)."""
    from modules import infotext_utils

    fields = infotext_utils.paste_fields[tab]["fields"]
    updates = infotext_utils.paste(fields, infotext)
    return {field.elem_id: update["value"] for (field, _key), update in zip(fields, updates) if "value" in update}


def test_script_declares_its_paste_fields(fake_host: Any, extension: Extension) -> None:
    runner, script, _demo = build_tab(extension)
    keys = {"device": "device", "unet": "UNet", "vae": "VAE", "text_encoder": "TE", "precision": "precision",
            "step_cache": "step caching"}
    expected = [(script.elem_id(field), f"OpenVINO {name}") for field, name in keys.items()]
    assert [(c.elem_id, key) for c, key in script.infotext_fields] == expected
    assert script.paste_field_names == [key for _id, key in expected]
    # ScriptRunner collected them; each component is the one whose value reaches run() for that field.
    assert runner.infotext_fields[: len(expected)] == script.infotext_fields
    assert runner.paste_field_names == script.paste_field_names
    args = runner.inputs[script.args_from : script.args_to]
    for component, _key in script.infotext_fields:
        field = next(f for f in FIELD_NAMES if script.elem_id(f) == component.elem_id)
        assert args[FIELD_NAMES.index(field)] is component


def test_pasting_a_generated_infotext_restores_the_script_and_its_panel(
    fake_host: Any, extension: Extension, f32: Any
) -> None:
    used = dataclasses.replace(f32, vae=False, text_encoder=False)
    processed = extension.run(make_p(fake_host, steps=1), used)
    infotext = processed.infotexts[0]
    assert "Script: Accelerate with OpenVINO" in infotext and 'OpenVINO: "CPU, UNet, f32"' in infotext

    runner, script, _demo = build_tab(extension)
    pasted = paste("txt2img", infotext)
    cpu_label = next(label for label, name in extension.device_choices() if name == "CPU")
    assert pasted == {
        "txt2img_prompt": "a tiny cat",
        "script_list": TITLE,
        script.elem_id("device"): cpu_label,
        script.elem_id("unet"): True,
        script.elem_id("vae"): False,
        script.elem_id("text_encoder"): False,
        script.elem_id("precision"): PRECISION_F32,
        script.elem_id("step_cache"): "Off",  # made without step caching: pasted as off
    }
    # Generate after the paste: run() gets back the settings of the image (the cache is this machine's).
    args = [pasted.get(c.elem_id, c.value) for c in runner.inputs[script.args_from : script.args_to]]
    again = from_ui_args(args, extension.device_names(), read=panel_values)
    assert dataclasses.replace(again, cache_dir=used.cache_dir) == used


def test_pasting_an_image_without_the_entry_leaves_the_panel_and_clears_the_script(
    fake_host: Any, extension: Extension
) -> None:
    _runner, script, _demo = build_tab(extension)
    pasted = paste("txt2img", "a dog\nNegative prompt: cat\nSteps: 20, Sampler: Euler a, Seed: 1, Size: 64x64")
    assert pasted == {"txt2img_prompt": "a dog", "script_list": "None"}


def test_an_infotext_from_before_the_script_entry_still_selects_the_script(
    fake_host: Any, extension: Extension
) -> None:
    _runner, script, _demo = build_tab(extension, is_img2img=True)
    pasted = paste("img2img", 'a dog\nSteps: 20, Seed: 1, Size: 64x64, OpenVINO: "CPU, TE, auto; refiner in PyTorch"')
    assert pasted["script_list"] == TITLE
    assert [pasted[script.elem_id(f)] for f in ("unet", "vae", "text_encoder", "precision")] == [
        False,
        False,
        True,
        PRECISION_LABELS["auto"],
    ]


def test_a_device_this_machine_lacks_keeps_the_panels_device_and_says_so(
    fake_host: Any, extension: Extension, caplog: pytest.LogCaptureFixture
) -> None:
    _runner, script, _demo = build_tab(extension)
    infotext = 'a dog\nSteps: 20, Seed: 1, Script: Accelerate with OpenVINO, OpenVINO: "GPU.7, UNet, f32"'
    with caplog.at_level(logging.WARNING), pytest.warns(UserWarning, match="'GPU.7' is not available here"):
        pasted = paste("txt2img", infotext)
    assert script.elem_id("device") not in pasted
    assert pasted[script.elem_id("vae")] is False and pasted[script.elem_id("precision")] == PRECISION_F32
    [record] = [r for r in caplog.records if "GPU.7" in r.getMessage()]
    assert record.levelno == logging.WARNING and "available: ['CPU'" in record.getMessage()


def test_send_to_img2img_carries_the_panel_over(fake_host: Any, extension: Extension) -> None:
    """A1111's "Send to img2img" under txt2img's images copies the fields named in paste_field_names."""
    from modules import infotext_utils

    runner, txt_script, _ = build_tab(extension)
    _runner, img_script, _ = build_tab(extension, is_img2img=True)
    inputs, outputs = infotext_utils.send_fields("txt2img", "img2img", runner.paste_field_names)
    ours = [(i.elem_id, o.elem_id) for i, o in zip(inputs, outputs) if i.elem_id.startswith("script_")]
    assert ours == [(txt_script.elem_id(item.field), img_script.elem_id(item.field)) for item in INFOTEXT_ITEMS]
    assert len(inputs) == len(outputs)


def test_an_image_of_the_command_line_pastes_into_the_panel(fake_host: Any, extension: Extension) -> None:
    """The command line writes the same "OpenVINO" entry (``ov_accelerate_sd.openvino_entry``): its image,
    pasted, selects the script and sets the panel to what made it."""
    from ov_accelerate_sd.openvino_entry import ENTRY_KEY as CLI_KEY
    from ov_accelerate_sd.openvino_entry import format_entry
    from ov_accelerate_sd.pnginfo import format_infotext

    infotext = format_infotext("a tiny cat", "blurry", {
        "Steps": 2, "Sampler": "Euler a", "Seed": 3, "Size": "64x64",
        CLI_KEY: format_entry("CPU", ("text_encoder", "unet"), "f32"),
    })
    assert 'OpenVINO: "CPU, UNet+TE, f32"' in infotext
    _runner, script, _demo = build_tab(extension)
    pasted = paste("txt2img", infotext)
    assert pasted["script_list"] == TITLE
    assert [pasted[script.elem_id(f)] for f in ("unet", "vae", "text_encoder", "precision")] == [
        True, False, True, PRECISION_F32]
