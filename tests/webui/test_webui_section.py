"""The always-on "OpenVINO" section against the fake host: its arguments, a job of several generations, an
error between its hooks, X/Y/Z cells, paste-back. The real WebUI's tests are in tests/real_webui."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from conftest import IMAGE_TOLERANCE, make_p, max_pixel_diff
from test_webui_generation import routed_modules

from ov_accelerate_webui.infotext import SECTION_PASTE_KEY, expand_pasted
from ov_accelerate_webui.options import PRECISION_LABELS, STEP_CACHE_LABELS
from ov_accelerate_webui.section import ARG_NAMES, OVERRIDE_ATTR, make_section_class, section_settings
from ov_accelerate_webui.settings import FIELD_NAMES


def section_args(settings: Any, enabled: bool = True) -> list[Any]:
    return [enabled, *(getattr(settings, name) for name in FIELD_NAMES)]


def test_arguments_positional_named_short_and_wrong() -> None:
    settings, why = section_settings([True, "CPU", True, False, True, "f32"], None, ["CPU"])
    assert settings is not None and not settings.vae and settings.precision == "f32" and why == ""
    labelled, _ = section_settings([True, "CPU", True, False, True, PRECISION_LABELS["f32"]], None, ["CPU"])
    assert labelled == settings  # as the panel gives it
    named, _ = section_settings([{"enabled": True, "precision": "f32", "vae": False}], None, ["CPU"])
    assert named == settings
    off, why = section_settings([False], None, None)
    assert off is None and "not enabled" in why
    assert section_settings([], None, None)[0] is None  # nothing sent: the default is off
    with pytest.raises(ValueError, match="'unet' must be true or false"):
        section_settings([True, "CPU", "yes"], None, None)
    with pytest.raises(ValueError, match="first argument .'enabled'. must be true or false"):
        section_settings(["CPU", True], None, None)
    with pytest.raises(ValueError, match="at most 9 arguments"):
        section_settings([True, *range(9)], None, None)
    with pytest.raises(ValueError, match="unknown OpenVINO section argument"):
        section_settings([{"enable": True}], None, None)
    with pytest.raises(ValueError, match="Unknown OpenVINO device 'GPU.7'|GPU.7"):
        section_settings([True, "GPU.7"], None, ["CPU"])
    assert len(ARG_NAMES) == 1 + len(FIELD_NAMES)


def test_xyz_cell_values_override_the_section() -> None:
    on, _ = section_settings([False], {"precision": "f32"}, None)  # a Precision cell accelerates
    assert on is not None and on.precision == "f32"
    off, why = section_settings([True], {"enabled": False}, None)
    assert off is None and "X/Y/Z" in why
    forced, _ = section_settings([False], {"enabled": True, "device": "CPU"}, None)
    assert forced is not None


def runner_with_section(fake_host: Any, extension: Any) -> tuple[Any, Any]:
    import gradio as gr
    from modules import scripts

    runner = scripts.ScriptRunner(is_img2img=False)
    section = runner.add(make_section_class(extension))
    with gr.Blocks(analytics_enabled=False):
        runner.create_script_ui(section)
    return runner, section


def with_section(fake_host: Any, runner: Any, section: Any, args: list[Any], **kwargs: Any) -> Any:
    p = make_p(fake_host, **kwargs)
    script_args = [None] * section.args_to
    script_args[section.args_from : section.args_to] = args
    p.scripts, p.script_args = runner, script_args
    return p


def test_a_job_of_several_generations_shares_compiles_and_reports_once(
    fake_host: Any, extension: Any, f32: Any
) -> None:
    runner, section = runner_with_section(fake_host, extension)
    baseline = fake_host.processing.process_images(make_p(fake_host))
    outer = with_section(fake_host, runner, section, section_args(f32))
    section.setup(outer, *section_args(f32))  # A1111 calls it when the request's script_args are set
    results = []
    for _ in range(3):  # what a dropdown script does: process_images on copies of the request's p
        cell = make_p(fake_host)
        cell.scripts, cell.script_args = runner, outer.script_args
        results.append(fake_host.processing.process_images(cell))
        assert not any(routed_modules(fake_host.model).values())
    report = extension.last_run_report()
    assert report["generations"] == 3 and report["accelerated"], report
    assert [run["compiles"] for run in report["runs"]][1:] == [0, 0], report["runs"]
    assert "This job ran 3 generation(s) through OpenVINO" in report["status"]
    for processed in results:
        assert max_pixel_diff(processed, baseline) <= IMAGE_TOLERANCE
        assert 'OpenVINO: "CPU, UNet+VAE+TE, f32"' in processed.infotexts[0]
        assert "OpenVINO section: on" in processed.infotexts[0]
        assert "Script: Accelerate with OpenVINO" not in processed.infotexts[0]
    outer.close()


def test_an_error_between_the_hooks_is_restored_by_the_end_of_the_request(
    fake_host: Any, extension: Any, f32: Any
) -> None:
    runner, section = runner_with_section(fake_host, extension)
    p = with_section(fake_host, runner, section, section_args(f32))
    section.setup(p, *section_args(f32))

    def broken(*args: Any, **kwargs: Any) -> Any:
        assert routed_modules(fake_host.model)["unet"]
        raise RuntimeError("sampler exploded")

    p.sample = broken
    with pytest.raises(RuntimeError, match="sampler exploded"):
        fake_host.processing.process_images(p)
    assert routed_modules(fake_host.model)["unet"]  # no postprocess: still routed until the request ends
    p.close()  # what A1111's `with closing(p)` does
    assert not any(routed_modules(fake_host.model).values())
    assert "stopped with" in extension.last_status and "restored" in extension.last_status


def test_an_error_is_also_restored_by_the_next_generation(fake_host: Any, extension: Any, f32: Any) -> None:
    runner, section = runner_with_section(fake_host, extension)
    p = with_section(fake_host, runner, section, section_args(f32))
    p.sample = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(RuntimeError):
        fake_host.processing.process_images(p)  # no setup, no close: another extension's own p
    baseline = fake_host.processing.process_images(make_p(fake_host))  # stock, through no hook of ours
    fast = fake_host.processing.process_images(with_section(fake_host, runner, section, section_args(f32)))
    assert not any(routed_modules(fake_host.model).values())
    assert max_pixel_diff(fast, baseline) <= IMAGE_TOLERANCE


def test_an_off_cell_after_an_on_cell_is_stock_and_carries_no_entry(
    fake_host: Any, extension: Any, f32: Any
) -> None:
    runner, section = runner_with_section(fake_host, extension)
    outer = with_section(fake_host, runner, section, section_args(f32, enabled=False))
    section.setup(outer, *section_args(f32, enabled=False))
    shared_params: dict[str, Any] = {}
    cells = []
    for enabled in (True, False):
        cell = make_p(fake_host)
        cell.scripts, cell.script_args = runner, outer.script_args
        cell.extra_generation_params = shared_params  # X/Y/Z's copies share the dict
        setattr(cell, OVERRIDE_ATTR, {"enabled": enabled})
        cells.append(fake_host.processing.process_images(cell))
    baseline = fake_host.processing.process_images(make_p(fake_host))
    assert "OpenVINO" in cells[0].infotexts[0] and "OpenVINO" not in cells[1].infotexts[0]
    assert max_pixel_diff(cells[1], baseline) == 0
    assert not shared_params
    report = extension.last_run_report()
    assert report["generations"] == 1 and report["plain_generations"] == 1
    assert "[OpenVINO] Enabled: Off" in report["status"]
    outer.close()


def test_the_dropdown_entry_with_the_section_enabled_accelerates_once(
    fake_host: Any, extension: Any, f32: Any
) -> None:
    runner, section = runner_with_section(fake_host, extension)
    p = with_section(fake_host, runner, section, section_args(dataclasses.replace(f32, vae=False)))
    processed = extension.run(p, f32)  # the dropdown's run, with the section's hooks inside
    report = extension.last_run_report()
    assert report["settings"] == "CPU, UNet+VAE+TE, f32" and report["generations"] == 1
    assert "Script: Accelerate with OpenVINO" in processed.infotexts[0]
    assert "OpenVINO section" not in processed.infotexts[0]


@pytest.mark.parametrize(
    ("params", "default", "enabled", "script"),
    [
        ({"OpenVINO": "CPU, UNet+VAE+TE, f32", "OpenVINO section": "on"}, False, True, None),
        ({"OpenVINO": "CPU, UNet+VAE+TE, f32", "Script": "Accelerate with OpenVINO"}, True, False,
         "Accelerate with OpenVINO"),
        ({"OpenVINO": "CPU, UNet+VAE+TE, f32"}, True, False, "Accelerate with OpenVINO"),  # before the section
        ({"Steps": "20"}, False, False, None),
        ({"Steps": "20"}, True, True, None),  # no entry: the Settings default
        ({"OpenVINO": "CPU, UNet, auto", "OpenVINO section": "on", "Script": "X/Y/Z plot"}, False, True,
         "X/Y/Z plot"),
    ],
)
def test_paste_restores_the_section_as_the_image_was_made(
    params: dict[str, Any], default: bool, enabled: bool, script: str | None
) -> None:
    params = dict(params)
    expand_pasted(params, [("CPU", "CPU")], PRECISION_LABELS, STEP_CACHE_LABELS, section_default=default)
    assert params[SECTION_PASTE_KEY] is enabled
    assert params.get("Script") == script


def test_xyz_axes_are_added_once_and_write_a_new_dict_per_cell(fake_host: Any, extension: Any) -> None:
    from types import ModuleType, SimpleNamespace

    from modules import scripts

    from ov_accelerate_webui.xyz_axes import register_axes

    xyz = ModuleType("xyz_grid.py")

    class AxisOption:
        def __init__(self, label: str, type: Any, apply: Any, choices: Any = None, confirm: Any = None) -> None:
            self.label, self.type, self.apply, self.choices, self.confirm = label, type, apply, choices, confirm

    xyz.AxisOption, xyz.axis_options = AxisOption, [AxisOption("Nothing", str, None)]
    scripts.scripts_data.append(SimpleNamespace(path="/webui/scripts/xyz_grid.py", module=xyz))
    try:
        assert register_axes(extension) == 4 and register_axes(extension) == 0  # a UI reload adds none again
    finally:
        scripts.scripts_data.pop()
    axes = {option.label: option for option in xyz.axis_options}
    assert axes["[OpenVINO] Enabled"].choices() == ["On", "Off"]
    assert axes["[OpenVINO] Precision"].choices() == ["auto", "f32", "int8", "int8-weights"]
    assert "CPU" in axes["[OpenVINO] Device"].choices()
    assert axes["[OpenVINO] Step caching"].choices() == ["1", "2", "3", "4"]
    with pytest.raises(RuntimeError, match=r"unknown value\(s\) \['bf16'\]; choose from"):
        axes["[OpenVINO] Precision"].confirm(None, ["f32", "bf16"])
    p = SimpleNamespace()
    axes["[OpenVINO] Precision"].apply(p, "f32", [])
    first = getattr(p, OVERRIDE_ATTR)
    cell = SimpleNamespace(**vars(p))  # X/Y/Z's shallow copy of p for the next cell
    axes["[OpenVINO] Enabled"].apply(cell, "Off", [])
    assert first == {"precision": "f32"}  # the first cell's values are not changed by the next cell
    assert getattr(cell, OVERRIDE_ATTR) == {"precision": "f32", "enabled": False}


def test_taesd_is_named_when_the_vae_was_not_called() -> None:
    from ov_accelerate_webui.generation import _uncalled_vae

    calls = {"model.diffusion_model": 3, "first_stage_model.decoder": 0, "first_stage_model.encoder": 0}
    notes = _uncalled_vae(calls, ("TAESD", "Full"))
    assert len(notes) == 1 and "VAE decoder was not called" in notes[0] and "TAESD" in notes[0]
    assert _uncalled_vae(calls, ("Full", "Full")) == []
    assert _uncalled_vae({**calls, "first_stage_model.decoder": 1}, ("TAESD", "TAESD"))[0].startswith(
        "The VAE encoder")


def controlnet_like_script(fake_host: Any) -> type:
    """An always-on script that replaces the UNet's forward in ``process`` with the class's own forward (as
    sd-webui-controlnet's hook does) and puts the previous one back in ``postprocess``."""
    from modules import scripts

    class ReplacesUNet(scripts.Script):
        def title(self) -> str:
            return "replaces unet"

        def show(self, is_img2img: bool) -> Any:
            return scripts.AlwaysVisible

        def process(self, p: Any, *args: Any) -> None:
            unet = p.sd_model.model.diffusion_model
            self.saved = unet.__dict__.get("forward")
            unet.forward = lambda *a, **k: type(unet).forward(unet, *a, **k)

        def postprocess(self, p: Any, processed: Any, *args: Any) -> None:
            unet = p.sd_model.model.diffusion_model
            if self.saved is None:
                unet.__dict__.pop("forward", None)
            else:
                unet.forward = self.saved

    return ReplacesUNet


@pytest.mark.parametrize("how", ["dropdown", "section"])
def test_a_foreign_unet_forward_is_reported_and_left_to_run(fake_host: Any, extension: Any, f32: Any,
                                                            how: str) -> None:
    import gradio as gr
    from modules import scripts

    runner = scripts.ScriptRunner(is_img2img=False)
    other = runner.add(controlnet_like_script(fake_host))  # first: its process() runs before the section's
    section = runner.add(make_section_class(extension))
    with gr.Blocks(analytics_enabled=False):
        runner.create_script_ui(other)
        runner.create_script_ui(section)
    baseline = fake_host.processing.process_images(make_p(fake_host, steps=3))
    p = with_section(fake_host, runner, section, section_args(f32, enabled=how == "section"), steps=3)
    processed = extension.run(p, f32) if how == "dropdown" else fake_host.processing.process_images(p)
    report = extension.last_run_report()
    assert report["calls"]["model.diffusion_model"] == 0, report["status"]
    why = report["pytorch"]["model.diffusion_model"]["why"]
    assert ("during the generation" if how == "dropdown" else "before this generation") in why, why
    assert "ReplacesUNet.process.<locals>.<lambda>" in why, why
    assert "Ran in PyTorch, not OpenVINO: model.diffusion_model" in report["status"]
    assert "UNet in PyTorch" in processed.infotexts[0], processed.infotexts[0]
    assert max_pixel_diff(processed, baseline) <= IMAGE_TOLERANCE
    assert not routed_modules(fake_host.model)["unet"]


def test_a_unet_called_around_its_route_is_reported(fake_host: Any, extension: Any, f32: Any) -> None:
    """An extension that calls the UNet class's own forward from higher up (here: the model wrapper's
    forward), leaving the routed forward in place and never calling it."""
    import torch
    from modules import scripts

    class CallsTheOriginal(scripts.Script):
        def title(self) -> str:
            return "calls the original"

        def show(self, is_img2img: bool) -> Any:
            return scripts.AlwaysVisible

        def process(self, p: Any, *args: Any) -> None:
            wrapper = p.sd_model.model
            unet = wrapper.diffusion_model

            def forward(x: Any, t: Any, c_concat: Any = None, c_crossattn: Any = None) -> Any:
                return type(unet).forward(unet, x, t, context=torch.cat(c_crossattn, 1))

            wrapper.forward = forward

        def postprocess(self, p: Any, processed: Any, *args: Any) -> None:
            p.sd_model.model.__dict__.pop("forward", None)

    runner = scripts.ScriptRunner(is_img2img=False)
    runner.add(CallsTheOriginal)
    p = make_p(fake_host, steps=3)
    p.scripts, p.script_args = runner, []
    processed = extension.run(p, f32)
    report = extension.last_run_report()
    assert report["calls"]["model.diffusion_model"] == 0
    assert "none called the routed forward" in report["pytorch"]["model.diffusion_model"]["why"]
    assert "UNet in PyTorch" in processed.infotexts[0]
