"""The fake host behaves as A1111 v1.10.1 where the extension's risks are; each test failed against the fake
as it was before (issue 13):

* ``load_scripts`` puts the extension's folder on ``sys.path`` only while its ``scripts/*.py`` run;
* ``override_settings`` with ``sd_model_checkpoint`` loads that checkpoint for the generation and puts the
  setting back afterwards;
* prompt emphasis weights the text encoder's output (rescaled to the old mean), and a NaN from the UNet
  or the VAE raises ``NansException`` naming the part;
* ``Processed.js()`` (the API reply's ``info``) has A1111's keys, without ``comments``;
* ``script_args`` is one list for all scripts: the dropdown script's slice sits between always-on
  scripts' arguments.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from conftest import FAKE_HOST, IMAGE_TOLERANCE, ROUNDED_IMAGE_TOLERANCE, make_p, max_pixel_diff, pixels

from ov_accelerate_webui.routing import is_routed
from ov_accelerate_webui.settings import FIELD_NAMES

ROOT = Path(__file__).resolve().parents[2]

#: The keys of ``Processed.js()`` in A1111 v1.10.1 (``modules/processing.py``).
WEBUI_JS_KEYS = frozenset(
    {
        "prompt", "all_prompts", "negative_prompt", "all_negative_prompts", "seed", "all_seeds", "subseed",
        "all_subseeds", "subseed_strength", "width", "height", "sampler_name", "cfg_scale", "steps",
        "batch_size", "restore_faces", "face_restoration_model", "sd_model_name", "sd_model_hash",
        "sd_vae_name", "sd_vae_hash", "seed_resize_from_w", "seed_resize_from_h", "denoising_strength",
        "extra_generation_params", "index_of_first_image", "infotexts", "styles", "job_timestamp",
        "clip_skip", "is_using_inpainting_conditioning", "version",
    }
)  # fmt: skip


def script_args(settings: Any) -> list[Any]:
    """The Script's ``ui()`` values for ``settings``, in order."""
    return [getattr(settings, name) for name in FIELD_NAMES]


def tab_with_script(host: SimpleNamespace, extension: Any, *extra: type, runner: Any = None) -> Any:
    """A txt2img ScriptRunner with "Accelerate with OpenVINO" (and ``extra`` script classes), its UI built."""
    from modules import scripts, ui

    from ov_accelerate_webui.script import make_script_class

    runner = runner or scripts.ScriptRunner(is_img2img=False)
    for script_class in (*extra, make_script_class(extension)):
        runner.add(script_class)
    ui.create_tab(runner)
    return runner


def run_dropdown(runner: Any, p: Any, args: list[Any]) -> Any:
    """What the Generate button does with the dropdown set to our script (``modules.txt2img``)."""
    index = runner.title_index("Accelerate with OpenVINO")
    script = runner.selectable_scripts[index]
    all_args = [getattr(c, "value", None) for c in runner.inputs]
    all_args[0] = index + 1
    all_args[script.args_from : script.args_to] = args
    p.scripts, p.script_args = runner, all_args
    return runner.run(p, *all_args)


# --- 1. sys.path while the scripts load ------------------------------------------------------------

# In a child: no checkout and no editable install on the path. The fake host's own modules are imported
# first (they use the SD layer's prompt and infotext code, which uses ov_backend's file helpers: copies in
# host_libs); then those copies leave sys.path and sys.modules, so only the extension's folder holds the
# project's packages. The fake's load_scripts() runs the copied entry script; a generation through the
# loaded Script follows.
CHILD = textwrap.dedent(
    """
    import importlib, json, sys
    ext, checkout, fake_host, host_libs, work = sys.argv[1:6]
    ours = ("ov_backend", "ov_accelerate_webui", "ov_accelerate_sd")
    sys.path[:] = [p for p in sys.path if p not in ("", ".", checkout)] + [fake_host, host_libs]
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()
                        and "editable" not in getattr(f, "__name__", "").lower()]
    for name in [m for m in sys.modules if m.split(".")[0] in ours]:
        del sys.modules[name]
    from modules import paths, processing, script_callbacks, scripts, sd_models, shared, ui
    from tiny_model import TinyLatentDiffusion
    sys.path.remove(host_libs)
    for name in [m for m in sys.modules if m.split(".")[0] in ours]:
        del sys.modules[name]
    paths.models_path = work + "/models"
    plain_import_possible = any(importlib.util.find_spec(name) is not None for name in ours)

    scripts.load_scripts(ext)
    path_after_load = list(sys.path)
    sd_models.load_model(TinyLatentDiffusion(seed=0), sd_models.CheckpointInfo(work + "/tiny-a.safetensors", "a" * 64))
    runner = scripts.ScriptRunner()
    runner.initialize_scripts(is_img2img=False)
    ui.create_tab(runner)
    settings = importlib.import_module("ov_accelerate_webui.settings")
    routing = importlib.import_module("ov_accelerate_webui.routing")
    chosen = settings.build_settings({"precision": "f32", "cache_dir": work + "/cache"})
    seen = []
    script_callbacks.on_cfg_denoiser(
        lambda params: seen.append([routing.is_routed(shared.sd_model.model.diffusion_model), ext in sys.path])
    )

    def make_p():
        return processing.StableDiffusionProcessingTxt2Img(
            sd_model=shared.sd_model, prompt="a tiny cat", negative_prompt="", seed=7, steps=2, width=64,
            height=64, do_not_save_samples=True)

    plain = processing.process_images(make_p())
    seen.clear()
    p = make_p()
    index = runner.title_index("Accelerate with OpenVINO")
    script = runner.selectable_scripts[index]
    args = [c.value for c in runner.inputs[1:]]
    args[script.args_from - 1 : script.args_to - 1] = [getattr(chosen, n) for n in settings.FIELD_NAMES]
    p.scripts, p.script_args = runner, [index + 1, *args]
    processed = runner.run(p, *p.script_args)
    diff = max(float(abs(a - b).max()) for a, b in zip(processed.samples_255, plain.samples_255))
    print(json.dumps({
        "plain_import_possible": plain_import_possible,
        "ext_on_path_after_load": ext in path_after_load,
        "seen": seen,
        "max_diff": diff,
        "infotext": processed.infotexts[0],
        "backend_file": sys.modules["ov_backend"].__file__,
    }))
    """
)


def test_script_loaded_by_load_scripts_accelerates_with_the_extension_off_sys_path(tmp_path: Path) -> None:
    ext = tmp_path / "extensions" / "sd-webui-openvino-accelerate"
    for part in ("scripts", "ov_accelerate_webui", "ov_backend", "ov_accelerate_sd"):
        shutil.copytree(ROOT / part, ext / part, ignore=shutil.ignore_patterns("__pycache__"))
    host_libs = tmp_path / "host_libs"
    for part in ("ov_accelerate_sd", "ov_backend"):
        shutil.copytree(ROOT / part, host_libs / part, ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(ext), str(ROOT), str(FAKE_HOST), str(host_libs), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["plain_import_possible"] is False
    assert report["ext_on_path_after_load"] is False, "load_scripts put sys.path back"
    assert report["seen"] and all(s == [True, False] for s in report["seen"]), report["seen"]
    assert report["max_diff"] <= IMAGE_TOLERANCE
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32"' in report["infotext"]
    assert Path(report["backend_file"]).resolve().is_relative_to(ext.resolve())


# --- 2. override_settings with a checkpoint --------------------------------------------------------


@pytest.mark.parametrize("limit", [1, 2], ids=["weights-loaded-in-place", "second-model-in-memory"])
def test_override_settings_checkpoint_is_accelerated_and_restored(
    fake_host: SimpleNamespace, extension: Any, f32: Any, limit: int
) -> None:
    shared, sd_models = fake_host.shared, fake_host.sd_models
    shared.opts.sd_checkpoints_limit = limit
    title_a, model_a = shared.opts.sd_model_checkpoint, shared.sd_model
    info_b = sd_models.CheckpointInfo(
        str(fake_host.tmp_path / "tiny-b.safetensors"),
        "b" * 64,
        "TinyLatentDiffusion",
        lambda: fake_host.make_model(seed=7),
    ).register()
    plain_a = fake_host.processing.process_images(make_p(fake_host))
    shared.opts.sd_model_checkpoint = info_b.title  # the oracle: B chosen in the checkpoint dropdown
    plain_b = fake_host.processing.process_images(make_p(fake_host))
    shared.opts.sd_model_checkpoint = title_a
    assert max_pixel_diff(plain_a, plain_b) > IMAGE_TOLERANCE, "the two checkpoints must differ"
    fake_host.processing.process_images(make_p(fake_host))  # A loaded again
    seen: list[tuple[str, bool]] = []
    fake_host.callbacks.on_cfg_denoiser(
        lambda params: seen.append(
            (shared.sd_model.sd_checkpoint_info.title, is_routed(shared.sd_model.model.diffusion_model))
        )
    )
    runner = tab_with_script(fake_host, extension)
    unet_only = dataclasses.replace(f32, vae=False, text_encoder=False)

    p = make_p(fake_host, override_settings={"sd_model_checkpoint": "tiny-b"})
    processed = run_dropdown(runner, p, script_args(unet_only))

    assert seen and all(s == (info_b.title, True) for s in seen), seen
    assert max_pixel_diff(processed, plain_b) <= IMAGE_TOLERANCE
    assert "Model: tiny-b" in processed.infotexts[0]
    assert shared.opts.sd_model_checkpoint == title_a, "override_settings_restore_afterwards"
    for model in {id(m): m for m in (model_a, shared.sd_model)}.values():
        assert not is_routed(model.model.diffusion_model)
    seen.clear()
    again = fake_host.processing.process_images(make_p(fake_host))
    assert seen[0][0] == title_a and not any(routed for _title, routed in seen)
    assert max_pixel_diff(again, plain_a) == 0

    kept = make_p(fake_host, override_settings={"sd_model_checkpoint": "tiny-b"})
    kept.override_settings_restore_afterwards = False
    fake_host.processing.process_images(kept)
    assert shared.opts.sd_model_checkpoint == info_b.title


# --- 3. emphasis and the NaN check ------------------------------------------------------------------

EMPHASISED = "a (tiny:1.5) cat"


def test_emphasised_prompt_is_weighted_and_mean_rescaled_and_accelerated_equals_plain(
    fake_host: SimpleNamespace, extension: Any, f32: Any
) -> None:
    wrapper = fake_host.shared.sd_model.cond_stage_model
    chunk = wrapper.tokenize_line(EMPHASISED)[0]
    assert chunk.multipliers == [1.0] * 3 + [1.5] * 4 + [1.0] * 70  # start, "a ", "tiny", " cat" + padding
    with torch.no_grad():  # the oracle, by hand: each vector times its weight, then the old mean restored
        z = wrapper.wrapped.transformer(input_ids=torch.asarray([chunk.tokens])).last_hidden_state
        weighted = z * torch.asarray(chunk.multipliers)[None, :, None]
        expected = weighted * (z.mean() / weighted.mean())
    plain = fake_host.processing.process_images(make_p(fake_host, prompt=EMPHASISED))
    unweighted = fake_host.processing.process_images(make_p(fake_host, prompt="a tiny cat"))
    assert max_pixel_diff(plain, unweighted) > IMAGE_TOLERANCE, "the weight must change the image"
    conds: list[torch.Tensor] = []
    fake_host.callbacks.on_cfg_denoiser(lambda params: conds.append(params.text_cond.clone()))

    processed = extension.run(make_p(fake_host, prompt=EMPHASISED), dataclasses.replace(f32, unet=False, vae=False))

    assert is_routed(wrapper.wrapped.transformer.text_model.encoder) is False
    assert max_pixel_diff(processed, plain) <= IMAGE_TOLERANCE
    # OpenVINO at f32 is within 1e-5 of PyTorch here; dropping the rescale or a weight moves it by > 0.1
    torch.testing.assert_close(conds[0], expected, atol=1e-4, rtol=1e-4)


def test_nan_from_unet_or_vae_raises_nans_exception_naming_the_part(
    fake_host: SimpleNamespace, extension: Any, f32: Any
) -> None:
    devices = importlib.import_module("modules.devices")
    model = fake_host.model
    vae_bias = model.first_stage_model.decoder.conv_out.bias
    unet_bias = model.model.diffusion_model.unet.conv_out.bias
    with torch.no_grad():
        saved = vae_bias[0].item()
        vae_bias[0] = float("nan")
        with pytest.raises(devices.NansException, match="A tensor with NaNs was produced in VAE"):
            fake_host.processing.process_images(make_p(fake_host))
        vae_bias[0] = saved
        unet_bias[0] = float("nan")

    with pytest.raises(devices.NansException, match="A tensor with NaNs was produced in Unet"):
        extension.run(make_p(fake_host), dataclasses.replace(f32, vae=False, text_encoder=False))

    assert not is_routed(model.model.diffusion_model)
    # the panel's "Last run" and the status route say the generation stopped, and why
    report = extension.last_run_report()
    assert not report["accelerated"] and "NansException" in report["status"] and "restored" in report["status"]
    assert extension.last_status == report["status"]
    fake_host.shared.cmd_opts.disable_nan_check = True  # --disable-nan-check: the NaN image is returned
    try:
        assert len(fake_host.processing.process_images(make_p(fake_host)).images) == 1
    finally:
        fake_host.shared.cmd_opts.disable_nan_check = False


# --- 4. Processed.js() ------------------------------------------------------------------------------


def webui_js_keys() -> frozenset[str] | None:
    """The keys of ``Processed.js()`` read from the test bed's ``modules/processing.py`` (A1111_ROOT)."""
    root = os.environ.get("A1111_ROOT")
    source = Path(root, "webui", "modules", "processing.py") if root else None
    if source is None or not source.is_file():
        return None
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == "js":
            found = next(n for n in ast.walk(node) if isinstance(n, ast.Dict))
            return frozenset(key.value for key in found.keys if isinstance(key, ast.Constant))
    return None


def test_api_info_has_the_webui_keys_without_comments_and_still_names_openvino(
    fake_host: SimpleNamespace, extension: Any, f32: Any
) -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from modules import scripts
    from modules.api.api import Api

    real = webui_js_keys()
    if real is not None:
        assert real == WEBUI_JS_KEYS
    runner = tab_with_script(fake_host, extension, runner=scripts.scripts_txt2img)
    app = FastAPI()
    Api(app)
    request = {"prompt": "a tiny cat", "seed": 7, "steps": 2, "width": 64, "height": 64}
    args = script_args(dataclasses.replace(f32, vae=False, text_encoder=False))

    reply = TestClient(app).post(
        "/sdapi/v1/txt2img", json={**request, "script_name": "accelerate with openvino", "script_args": args}
    )

    info = json.loads(reply.json()["info"])
    assert set(info) == WEBUI_JS_KEYS and "comments" not in info
    assert 'OpenVINO: "CPU, UNet, f32"' in info["infotexts"][0]
    assert info["extra_generation_params"]["OpenVINO"] == "CPU, UNet, f32"
    processed = run_dropdown(runner, make_p(fake_host), args)  # the UI shows Processed.comments
    assert extension.last_status in processed.comments


# --- 5. script_args shared with always-on scripts ---------------------------------------------------


def always_on(title: str, section: str | None, values: list[Any], calls: list) -> type:
    from modules import scripts

    class AlwaysOn(scripts.Script):
        def title(self) -> str:
            return title

        def show(self, is_img2img: bool) -> Any:
            return scripts.AlwaysVisible

        def ui(self, is_img2img: bool) -> list[Any]:
            import gradio as gr

            return [gr.Textbox(value=v, label=f"{title} {i}") for i, v in enumerate(values)]

        def process(self, p: Any, *args: Any) -> None:
            calls.append((title, "process", list(args)))

        def postprocess(self, p: Any, processed: Any, *args: Any) -> None:
            calls.append((title, "postprocess", list(args)))

    AlwaysOn.section = section
    return AlwaysOn


def test_api_script_args_sit_between_always_on_scripts_args(
    fake_host: SimpleNamespace, extension: Any, f32: Any
) -> None:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from modules import scripts
    from modules.api.api import Api, decode_base64_to_image

    from ov_accelerate_webui.script import make_script_class

    calls: list[tuple[str, str, list[Any]]] = []
    received: list[tuple[Any, ...]] = []

    class Recording(make_script_class(extension)):  # type: ignore[misc]
        def run(self, p: Any, *args: Any) -> Any:
            received.append(args)
            return super().run(p, *args)

    runner = scripts.scripts_txt2img
    from modules import ui

    for script_class in (
        always_on("Before", "seed", ["b0", "b1"], calls),  # laid out before the dropdown's scripts
        always_on("Between", None, ["m0"], calls),  # just before the dropdown scripts' controls
        Recording,
        always_on("After", "scripts", ["a0", "a1", "a2"], calls),  # after them
    ):
        runner.add(script_class)
    ui.create_tab(runner)
    ours = runner.selectable_scripts[0]
    assert (ours.args_from, ours.args_to) == (4, 4 + len(FIELD_NAMES))  # after Before's 2 and Between's 1
    app = FastAPI()
    Api(app)
    args = script_args(dataclasses.replace(f32, vae=False, text_encoder=False))
    request = {"prompt": "a tiny cat", "seed": 7, "steps": 2, "width": 64, "height": 64}

    reply = (
        TestClient(app)
        .post(
            "/sdapi/v1/txt2img",
            json={
                **request,
                "script_name": "Accelerate with OpenVINO",
                "script_args": args,
                "alwayson_scripts": {"after": {"args": ["A0"]}},
            },
        )
        .json()
    )

    assert received == [tuple(args)], "exactly its 7 args, none of the always-on scripts'"
    assert calls == [
        ("Before", "process", ["b0", "b1"]),
        ("Between", "process", ["m0"]),
        ("After", "process", ["A0", "a1", "a2"]),
        ("Before", "postprocess", ["b0", "b1"]),
        ("Between", "postprocess", ["m0"]),
        ("After", "postprocess", ["A0", "a1", "a2"]),
    ]
    assert 'OpenVINO: "CPU, UNet, f32"' in json.loads(reply["info"])["infotexts"][0]
    plain = fake_host.processing.process_images(make_p(fake_host, seed=7, negative_prompt=""))
    image = np.asarray(decode_base64_to_image(reply["images"][0]), dtype=np.int16)
    assert int(np.abs(image - pixels(plain)[0]).max()) <= ROUNDED_IMAGE_TOLERANCE
