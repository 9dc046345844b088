"""The panel under gradio 3.41.2, the settings section, and each control reaching the backend settings."""

from __future__ import annotations

import threading
import traceback
from pathlib import Path
from typing import Any

import gradio as gr
import pytest
import torch
from conftest import make_p

from ov_accelerate_webui import create_extension
from ov_accelerate_webui.backend_bridge import BackendApi
from ov_accelerate_webui.extension import Extension
from ov_accelerate_webui.options import PRECISION_LABELS, panel_values
from ov_accelerate_webui.settings import FIELD_NAMES, from_ui_args
from ov_accelerate_webui.ui import PanelHandlers, option_key


def make_script(extension: Extension, is_img2img: bool = False) -> Any:
    from ov_accelerate_webui.script import make_script_class

    script = make_script_class(extension)()
    script.is_img2img, script.is_txt2img = is_img2img, not is_img2img
    return script


def test_script_identity(fake_host: Any, extension: Extension) -> None:
    script = make_script(extension)
    assert script.title() == "Accelerate with OpenVINO"
    assert script.show(False) is True and script.show(True) is True
    assert script.elem_id("device") == "script_txt2img_accelerate_with_openvino_device"


@pytest.mark.parametrize("is_img2img", [False, True])
def test_panel_builds_with_controls_in_field_order(fake_host: Any, extension: Extension, is_img2img: bool) -> None:
    script = make_script(extension, is_img2img)
    with gr.Blocks() as demo:
        components = script.ui(is_img2img)
    assert [c.elem_id for c in components] == [script.elem_id(name) for name in FIELD_NAMES]
    kinds = [type(c).__name__ for c in components]
    assert kinds == ["Dropdown", "Checkbox", "Checkbox", "Checkbox", "Radio", "Checkbox", "Textbox", "Radio"]
    device = components[0]
    assert any(label.startswith("CPU: ") for label in device.choices) and "AUTO: let OpenVINO choose" in device.choices
    config = demo.get_config_file()
    html = " ".join(str(c.get("props", {}).get("value", "")) for c in config["components"])
    assert "ov-accelerate-config" in html and script.elem_id("clear_cache") in html


def test_each_control_reaches_backend_settings(fake_host: Any, extension: Extension, tmp_path: Path) -> None:
    device_label = next(label for label, name in extension.device_choices() if name == "CPU")
    ui_values = [device_label, False, True, True, PRECISION_LABELS["f32"], False, str(tmp_path / "cache")]
    settings = from_ui_args(ui_values, extension.device_names(), read=panel_values)
    prepared = extension.accelerator().prepare(fake_host.model, settings, "unused")
    backend = extension.accelerator().backends.existing(prepared.choice.for_part("vae")).settings
    assert backend.device == "CPU" and backend.model_caching is False
    assert Path(backend.cache_dir) == tmp_path / "cache"
    assert backend.compile_config == {"INFERENCE_PRECISION_HINT": "f32"}
    assert "model.diffusion_model" not in [r.label for r in prepared.routes]
    assert {r.label for r in prepared.routes} == {
        "first_stage_model.decoder",
        "first_stage_model.encoder",
        "cond_stage_model.wrapped.transformer.text_model.encoder",
    }

    auto = from_ui_args(["CPU", True, False, False, "auto", True, ""], extension.device_names())
    prepared = extension.accelerator().prepare(fake_host.model, auto, str(tmp_path / "default"))
    backend = extension.accelerator().backends.existing(prepared.choice.for_part("unet")).settings
    assert backend.compile_config == {} and backend.model_caching is True
    assert Path(backend.cache_dir) == tmp_path / "default"
    assert [r.label for r in prepared.routes] == ["model.diffusion_model"]


def test_bad_script_args_are_rejected_with_the_fix(fake_host: Any, extension: Extension) -> None:
    with pytest.raises(ValueError, match="available"):
        from_ui_args(["GPU.7"], extension.device_names())
    with pytest.raises(ValueError, match="precision"):
        from_ui_args(["CPU", True, True, True, "bf17"])
    with pytest.raises(ValueError, match="at most 8"):
        from_ui_args([None] * 9)
    with pytest.raises(ValueError, match=r"step caching interval 5; choose one of \[1, 2, 3, 4\]"):
        from_ui_args(["CPU", True, True, True, "f32", True, "", 5])
    for given in (3, 3.0, "3", "Every 3 steps"):  # API requests: the interval, or the panel's label
        assert from_ui_args(["CPU", True, True, True, "f32", True, "", given], read=panel_values).step_cache == 3


def test_settings_section_sets_panel_defaults(fake_host: Any, backend_api: BackendApi) -> None:
    loaded = create_extension()
    loaded.register_callbacks()
    fake_host.callbacks.ui_settings_callback()
    opts = fake_host.shared.opts
    for name in FIELD_NAMES:
        info = opts.data_labels[option_key(name)]
        assert info.section == ("openvino", "OpenVINO")
    opts.openvino_precision = PRECISION_LABELS["f32"]  # as the Settings tab stores it
    opts.openvino_vae = False
    script = make_script(Extension(load_api=lambda: backend_api))
    with gr.Blocks():
        components = script.ui(False)
    values = dict(zip(FIELD_NAMES, (c.value for c in components)))
    assert values["precision"] == PRECISION_LABELS["f32"] and values["vae"] is False and values["unet"] is True


def test_device_choices_list_full_names_auto_and_hetero(backend_api: BackendApi) -> None:
    devices = [("CPU", "Intel(R) Xeon(R)"), ("GPU.0", "Intel(R) Arc(TM) A770 Graphics"), ("NPU", "Intel(R) AI Boost")]
    api = BackendApi(backend_api.build_settings, backend_api.backend_class, lambda: devices, backend_api.model_cache)
    labels = dict(Extension(load_api=lambda: api).device_choices())
    assert labels["GPU.0: Intel(R) Arc(TM) A770 Graphics"] == "GPU.0"
    assert labels["NPU: Intel(R) AI Boost"] == "NPU"
    assert "AUTO" in labels.values() and "HETERO:GPU.0,NPU,CPU" in labels.values()


def test_clear_cache_needs_confirmation(
    fake_host: Any, extension: Extension, backend_api: BackendApi, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    backend = backend_api.backend_class(
        backend_api.build_settings(
            {"model_caching": True, "cache_dir": str(cache_dir), "config": {"INFERENCE_PRECISION_HINT": "f32"}}
        )
    )
    torch.compile(torch.nn.Linear(4, 4), backend=backend)(torch.randn(2, 4))
    handlers = PanelHandlers(extension)
    size_before = handlers.refresh(str(cache_dir))[0]
    assert backend_api.model_cache(str(cache_dir)).total_bytes() > 0 and "0 entries" not in size_before

    assert handlers.clear_cache(str(cache_dir), False).startswith("Not cleared")
    assert backend_api.model_cache(str(cache_dir)).total_bytes() > 0
    assert handlers.clear_cache(str(cache_dir), True).startswith("Cleared. 0 entries")
    assert backend_api.model_cache(str(cache_dir)).total_bytes() == 0


def test_precompile_reports_progress_and_ready_sizes(fake_host: Any, extension: Extension, f32: Any) -> None:
    handlers = PanelHandlers(extension)
    args = [getattr(f32, name) for name in FIELD_NAMES]
    updates = list(handlers.precompile("64x64", 1, *args))
    assert updates[0][0].startswith("Compiling 64x64 (1/1)") and updates[-1][0] == "Ready: 64x64."
    assert "64x64" in updates[-1][1]
    processed = extension.run(make_p(fake_host), f32)
    assert "No new compile" in processed.comments
    assert list(handlers.precompile("64x65", 1, *args))[0][0].startswith("Failed: Size '64x65'")
    # several sizes are one use window: each stays compiled for the batch job that follows
    assert list(handlers.precompile("64x64, 96x64, 64x96", 1, *args))[-1][0] == "Ready: 64x64, 96x64, 64x96."
    for width, height in ((64, 64), (96, 64), (64, 96)):
        processed = extension.run(make_p(fake_host, width=width, height=height), f32)
        assert "No new compile" in processed.comments, processed.comments


def test_two_threads_share_compiled_models_safely(fake_host: Any, extension: Extension, f32: Any) -> None:
    settings = f32.__class__(**{**f32.__dict__, "vae": False, "text_encoder": False})
    prepared = extension.accelerator().prepare(fake_host.model, settings, "unused")
    unet_forward = prepared.routes[0].forward
    unet = fake_host.model.model.diffusion_model
    inputs = [
        (
            torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(i)),
            torch.tensor([10.0, 10.0]),
            torch.randn(2, 77, 32, generator=torch.Generator().manual_seed(i)),
        )
        for i in range(2)
    ]
    with torch.no_grad():
        expected = [unet(*args) for args in inputs]
        unet_forward(*inputs[0])  # compile once
        results: dict[int, torch.Tensor] = {}

        errors: list[str] = []

        def work(i: int) -> None:
            try:
                with torch.no_grad():
                    for _ in range(3):
                        results[i] = unet_forward(*inputs[i])
            except Exception:  # reported below, with the thread's traceback
                errors.append(traceback.format_exc())

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    for i in range(2):
        torch.testing.assert_close(results[i], expected[i], atol=1e-3, rtol=1e-3)


def test_last_run_and_ready_sizes_follow_each_generation(fake_host: Any, extension: Extension) -> None:
    """The panel binds to the change of A1111's result element (``html_info_<tab>``), built after it."""
    from modules import scripts, ui

    from ov_accelerate_webui.script import make_script_class

    runner = scripts.ScriptRunner(is_img2img=False)
    script = runner.add(make_script_class(extension))
    demo = ui.create_tab(runner)
    ids = {block._id: getattr(block, "elem_id", None) for block in demo.blocks.values()}
    bound = [
        d
        for d in demo.dependencies
        if d["trigger"] == "change" and [ids[target] for target in d["targets"]] == ["html_info_txt2img"]
    ]
    assert len(bound) == 1
    assert [ids[o] for o in bound[0]["outputs"]] == [script.elem_id("status"), script.elem_id("ready")]
    extension._set_last_run({"accelerated": True, "status": "OpenVINO (CPU, UNet+VAE+TE, auto) on CPU: ..."})
    status, ready = demo.fns[demo.dependencies.index(bound[0])].fn()
    assert status == extension.last_status and ready == "No size compiled yet for this checkpoint."


def test_cache_size_is_shown_per_checkpoint(
    fake_host: Any, extension: Extension, backend_api: BackendApi, tmp_path: Path
) -> None:
    """Entries that hold nothing of any weights (models converted with the weights as inputs, saved
    captures: all a float generation stores) serve every checkpoint and are counted apart, whichever
    generation made them; an entry holding weights (an INT8 model, a static-shape model) is counted under
    the checkpoint it was noted for; others are "not attributed"; a broken index only loses the labels."""
    from ov_accelerate_webui import cache_owners
    from ov_accelerate_webui.settings import build_settings

    cache_dir = tmp_path / "cache"
    other = backend_api.backend_class(backend_api.build_settings({"model_caching": True, "cache_dir": str(cache_dir)}))
    torch.compile(torch.nn.Linear(4, 4), backend=other)(torch.randn(2, 4))  # an entry no generation made
    cache = backend_api.model_cache(str(cache_dir))
    unattributed = cache_owners.entry_keys(cache)
    settings = build_settings({"precision": "f32", "cache_dir": str(cache_dir)})
    extension.run(make_p(fake_host), settings)

    title = fake_host.model.sd_checkpoint_info.title
    made = [e for e in cache.entries() if e.key not in unattributed]
    assert all(e.any_weights for e in made), [(e.key, e.description) for e in made]
    assert len([e for e in made if e.key.startswith("captures/")]) >= 3, made  # the three parts' captures
    assert len([e for e in made if not e.key.startswith("captures/")]) >= 3, made  # and their models

    cache_owners.record(cache_dir, [next(iter(unattributed))], "other.safetensors [bbbbbbbbbb]")
    sizes = {owner: (size, count) for owner, size, count in cache_owners.sizes_by_checkpoint(cache_dir, cache)}
    assert set(sizes) == {cache_owners.SHARED, "other.safetensors [bbbbbbbbbb]", "not attributed"}, sizes
    assert sizes[cache_owners.SHARED] == (sum(e.size_bytes for e in made), len(made))
    assert sum(size for size, _count in sizes.values()) == sum(e.size_bytes for e in cache.entries())
    text = PanelHandlers(extension).refresh(str(cache_dir))[0]
    assert f"{cache_owners.SHARED} " in text and "other.safetensors" in text and "not attributed" in text, text
    assert title not in text, text  # the generation's checkpoint has no entry of its own

    (cache_dir / cache_owners.INDEX_NAME).write_text("{not json")
    text = PanelHandlers(extension).refresh(str(cache_dir))[0]
    assert "other.safetensors" not in text and "not attributed" in text
