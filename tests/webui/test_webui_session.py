"""One WebUI session with one SD1 checkpoint and many generations, as a user runs them: batch size and
batch count with a prompt longer than 75 tokens, hires fix, img2img at an odd size, sizes seen before
(no conversion; no compile for the last generation's), Skip and Interrupt inside a batch count, the
HTTP API with ``script_args`` in ``ui()`` order, and the panel's buttons beside a running generation.
The tests share one extension (compiled models outlive a generation, as in the WebUI); each also works
alone.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import IMAGE_TOLERANCE, ROUNDED_IMAGE_TOLERANCE, max_pixel_diff
from PIL import Image

from ov_accelerate_webui.options import PRECISION_LABELS
from ov_accelerate_webui.routing import is_routed
from ov_accelerate_webui.settings import FIELD_NAMES, FIELDS, build_settings

LONG_PROMPT = "a tiny cat on a mat, " * 5  # 105 characters = tokens: two 77-token chunks
INIT_IMAGE = Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 72, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def host(session_host: SimpleNamespace) -> SimpleNamespace:
    return session_host


@pytest.fixture(scope="module")
def ext(host: SimpleNamespace, backend_api: Any) -> Iterator[Any]:
    from ov_accelerate_webui.extension import Extension

    extension = Extension(load_api=lambda: backend_api)
    yield extension
    extension.unload()


@pytest.fixture(scope="module")
def settings(shared_cache_dir: Any) -> Any:
    return build_settings({"precision": "f32", "cache_dir": str(shared_cache_dir)})


@pytest.fixture(autouse=True)
def fresh_state(host: SimpleNamespace) -> None:
    host.callbacks.clear_callbacks()
    host.shared.state.begin()


def txt2img(host: SimpleNamespace, **kwargs: Any) -> Any:
    params = {"prompt": "a tiny cat", "negative_prompt": "", "seed": 7, "steps": 2, "width": 64, "height": 64}
    return host.processing.StableDiffusionProcessingTxt2Img(sd_model=host.shared.sd_model, **{**params, **kwargs})


def img2img(host: SimpleNamespace, **kwargs: Any) -> Any:
    params = {"prompt": "a tiny cat", "seed": 7, "steps": 2, "width": 72, "height": 56, "denoising_strength": 0.6}
    return host.processing.StableDiffusionProcessingImg2Img(
        sd_model=host.shared.sd_model, init_images=[INIT_IMAGE], **{**params, **kwargs}
    )


def compiles(ext: Any, host: SimpleNamespace, settings: Any) -> int:
    """OpenVINO compiles the backend made so far (``stats()["compiles"]``)."""
    ext.accelerator().prepare(host.shared.sd_model, settings, "unused", window="continue")
    return int(ext.accelerator().backends.stats()["compiles"])


def calls(status: str, label: str) -> int:
    line = status.split(": ", 1)[1].split("\n", 1)[0]
    for item in line.rstrip(".").split("), "):
        name, _, count = item.partition(" (")
        if name == label:
            return 0 if count.startswith("not") else int(count.split()[0])
    raise AssertionError(f"{label} not in {status!r}")


def record_latents(host: SimpleNamespace) -> list[tuple[int, ...]]:
    seen: list[tuple[int, ...]] = []
    host.callbacks.on_cfg_denoiser(lambda params: seen.append((tuple(params.x.shape), params.text_cond.shape[1])))
    return seen


def test_batch_size_and_count_with_a_prompt_longer_than_75_tokens(host: Any, ext: Any, settings: Any) -> None:
    kwargs = {"prompt": LONG_PROMPT, "batch_size": 2, "n_iter": 2}
    baseline = host.processing.process_images(txt2img(host, **kwargs))
    seen = record_latents(host)

    processed = ext.run(txt2img(host, **kwargs), settings)

    assert len(processed.images) == 4 and processed.all_seeds == [7, 8, 9, 10]
    assert max_pixel_diff(processed, baseline) <= IMAGE_TOLERANCE
    assert {s[1] for s in seen} == {154}, "the UNet gets two 77-token chunks of context"
    status = ext.last_status
    # Per batch: the text encoder once per chunk (2 for the prompt, 1 for the empty negative prompt);
    # the UNet twice per step (cond with 154 tokens and uncond with 77 in separate calls); one decode
    # per image.
    assert calls(status, "cond_stage_model.wrapped.transformer.text_model.encoder") == 2 * 3
    assert calls(status, "model.diffusion_model") == 2 * 2 * 2
    assert calls(status, "first_stage_model.decoder") == 4
    assert "64x64 (batch 2)" in ext.ready_sizes_text()


def test_hires_fix_second_pass_runs_at_the_larger_size(host: Any, ext: Any, settings: Any) -> None:
    kwargs = {"enable_hr": True, "hr_scale": 1.5, "denoising_strength": 0.5}
    baseline = host.processing.process_images(txt2img(host, **kwargs))
    seen = record_latents(host)

    processed = ext.run(txt2img(host, **kwargs), settings)

    assert processed.images[0].size == (96, 96)
    assert max_pixel_diff(processed, baseline) <= IMAGE_TOLERANCE
    assert {s[0] for s in seen} == {(1, 4, 8, 8), (1, 4, 12, 12)}, "first pass, then the larger second pass"
    assert "Hires upscale: 1.5" in processed.infotexts[0] and "OpenVINO" in processed.infotexts[0]
    assert calls(ext.last_status, "first_stage_model.decoder") == 1
    assert "96x96" in ext.ready_sizes_text()


def test_img2img_at_an_odd_latent_size(host: Any, ext: Any, settings: Any) -> None:
    baseline = host.processing.process_images(img2img(host))
    seen = record_latents(host)

    processed = ext.run(img2img(host), settings)

    assert processed.images[0].size == (72, 56) and {s[0] for s in seen} == {(1, 4, 7, 9)}
    assert max_pixel_diff(processed, baseline) <= IMAGE_TOLERANCE
    assert calls(ext.last_status, "first_stage_model.encoder") == 1, "the VAE encode is routed too"


def test_returning_to_sizes_seen_before_costs_no_conversion(host: Any, ext: Any, settings: Any) -> None:
    jobs = [
        lambda: txt2img(host, prompt=LONG_PROMPT, batch_size=2, n_iter=2),
        lambda: txt2img(host, enable_hr=True, hr_scale=1.5, denoising_strength=0.5),
        lambda: img2img(host),
        lambda: txt2img(host),
    ]
    first = [ext.run(job(), settings) for job in jobs]  # compiles whatever the tests above did not
    ext.accelerator().prepare(host.shared.sd_model, settings, "unused", window="continue")
    converted = ext.accelerator().backends.stats()["convert_seconds"]

    again = [ext.run(job(), settings) for job in reversed(jobs)]

    # each generation keeps in memory the compiled models it uses: those of other sizes were released
    # and are compiled again from the conversion the backend keeps, never converted again
    backends = ext.accelerator().backends
    assert backends.stats()["convert_seconds"] == converted
    assert backends.stats()["released"] > 0
    assert any("Released" in line for line in ext.last_status.splitlines()), ext.last_status
    for a, b in zip(first, reversed(again)):
        assert max_pixel_diff(a, b) == 0
    # within a generation (hires fix, batch count, cond and uncond) and for the same job again: no compile
    before = compiles(ext, host, settings)
    repeat = ext.run(jobs[-1](), settings)
    assert compiles(ext, host, settings) == before, "the last generation's sizes stay compiled"
    assert "No new compile" in ext.last_status
    assert max_pixel_diff(repeat, again[0]) == 0


def test_the_status_route_counts_the_compiled_models_held_and_new_sizes_do_not_add_to_them(
        host: Any, ext: Any, settings: Any) -> None:
    """``compiled_models`` in the status (what ``python -m bench soak`` bounds): every compile adds a model held
    and every release takes one away, so it equals the backends' compiles less their releases; with "Keep every
    compiled size" off, a stream of new sizes does not add to it.

    An odd latent width takes another dynamo capture of the UNet (its upsampling differs), and a capture keeps
    its last model until it builds again: so the even and the odd sizes each keep one UNet model, one more
    than a single size left (measured; the soak's report shows the same).

    (The accelerator starts empty: the counters' oracle holds for one size per generation, not where a model for
    all sizes replaced the per-size ones, as in the hires fix test above.)"""
    ext.accelerator().reset()
    backends = ext.accelerator().backends

    def held_by_counters() -> int:
        stats = backends.stats()
        return int(stats["compiles"] - stats["released"])

    ext.run(txt2img(host, width=64, height=64), settings)
    first = ext.last_run_report()["compiled_models"]
    assert first > 0 and first == held_by_counters()
    seen = []
    for width in (72, 80, 88, 96, 104, 112):
        ext.run(txt2img(host, width=width, height=64), settings)
        held = ext.last_run_report()["compiled_models"]
        assert held == held_by_counters(), (width, held, backends.stats())
        seen.append(held)
    assert max(seen) <= first + 1, f"widths 72-112 left {seen} compiled models held, one size left {first}"
    assert backends.stats()["released"] >= len(seen), "each new size released the size before it"
    ext.accelerator().reset()
    assert ext.last_run_report()["compiled_models"] == 0


def test_keeping_every_size_in_memory_makes_returning_free(host: Any, ext: Any, settings: Any) -> None:
    """The Settings tab's "keep every compiled size": a size seen before never compiles again."""
    from ov_accelerate_webui.options import KEEP_SIZES_OPTION

    jobs = [lambda: txt2img(host), lambda: txt2img(host, width=72), lambda: img2img(host)]
    setattr(host.shared.opts, KEEP_SIZES_OPTION, True)
    try:
        for job in jobs:
            ext.run(job(), settings)
        before = compiles(ext, host, settings)
        for job in reversed(jobs):
            ext.run(job(), settings)
            assert "No new compile" in ext.last_status, ext.last_status
        assert compiles(ext, host, settings) == before
    finally:
        setattr(host.shared.opts, KEEP_SIZES_OPTION, False)


def test_the_setting_for_the_previous_weights_reaches_each_generations_window(host: Any, ext: Any,
                                                                               settings: Any) -> None:
    """The Settings tab's choice for the compiled models of the weights used before a change is the backend's
    for each generation; a value that is none of the three makes the image in PyTorch and says what is valid."""
    from ov_accelerate_webui.options import PREVIOUS_WEIGHTS_OPTION

    def window() -> Any:
        prepared = ext.accelerator().prepare(host.shared.sd_model, settings, "unused", window="continue")
        return ext.accelerator().backends.existing(prepared.choice.for_part("unet")).build_context.window

    try:
        for mode in ("release", "keep", "auto"):
            setattr(host.shared.opts, PREVIOUS_WEIGHTS_OPTION, mode)
            ext.run(txt2img(host), settings)
            assert window().previous_weights == mode
        setattr(host.shared.opts, PREVIOUS_WEIGHTS_OPTION, "sometimes")
        processed = ext.run(txt2img(host), settings)
        assert processed.images, "the image is still made"
        assert "previous_weights must be one of auto, keep, release, got 'sometimes'" in ext.last_status
    finally:
        setattr(host.shared.opts, PREVIOUS_WEIGHTS_OPTION, "auto")


def test_skip_and_interrupt_inside_a_batch_count(host: Any, ext: Any, settings: Any) -> None:
    state = host.shared.state

    def skip_first_batch(params: Any) -> None:
        if state.job_no == 0 and params.sampling_step == 0:
            state.skip()

    host.callbacks.on_cfg_denoiser(skip_first_batch)
    baseline = host.processing.process_images(txt2img(host, n_iter=3))
    routed: list[bool] = []
    host.callbacks.on_cfg_denoiser(lambda params: routed.append(is_routed(host.model.model.diffusion_model)))
    state.begin()  # A1111 begins a job per generation
    skipped = ext.run(txt2img(host, n_iter=3), settings)

    assert len(skipped.images) == 3 and max_pixel_diff(skipped, baseline) <= IMAGE_TOLERANCE
    assert routed.count(True) == 1 + 2 + 2, "batches 2 and 3 still run through OpenVINO after the Skip"

    host.callbacks.clear_callbacks()
    host.callbacks.on_cfg_denoiser(lambda params: state.job_no == 1 and state.interrupt())
    state.begin()
    interrupted = ext.run(txt2img(host, n_iter=3), settings)
    assert len(interrupted.images) == 2, "Interrupt stops after the current batch"
    assert not is_routed(host.model.model.diffusion_model)


@pytest.fixture(scope="module")
def api(host: SimpleNamespace, ext: Any) -> Any:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from modules import scripts, ui
    from modules.api.api import Api

    from ov_accelerate_webui.script import make_script_class

    for runner in (scripts.scripts_txt2img, scripts.scripts_img2img):
        runner.add(make_script_class(ext))
        ui.create_tab(runner)  # the UI is built before the API serves (default script args)
    app = FastAPI()
    Api(app)
    return TestClient(app)


def test_http_api_runs_the_script_with_script_args_in_ui_order(
    host: Any, ext: Any, settings: Any, api: Any, shared_cache_dir: Any
) -> None:
    from modules.api.api import decode_base64_to_image

    assert "accelerate with openvino" in api.get("/sdapi/v1/scripts").json()["txt2img"]
    info = next(s for s in api.get("/sdapi/v1/script-info").json() if s["name"] == "accelerate with openvino")
    assert [a["label"] for a in info["args"]] == [f.metadata["label"] for f in FIELDS]

    script_args = ["CPU", True, True, True, PRECISION_LABELS["f32"], True, str(shared_cache_dir), "Off"]  # as the panel
    assert len(script_args) == len(FIELD_NAMES)
    request = {"prompt": "a tiny cat", "negative_prompt": "", "seed": 7, "steps": 2, "width": 64, "height": 64}
    plain = api.post("/sdapi/v1/txt2img", json=request).json()
    before = compiles(ext, host, settings)

    reply = api.post(
        "/sdapi/v1/txt2img", json={**request, "script_name": "Accelerate with OpenVINO", "script_args": script_args}
    ).json()

    assert compiles(ext, host, settings) == before, "the API shares the compiled models of the UI"
    images = [np.asarray(decode_base64_to_image(r["images"][0]), dtype=np.int16) for r in (plain, reply)]
    assert int(np.abs(images[0] - images[1]).max()) <= ROUNDED_IMAGE_TOLERANCE
    infotexts = [json.loads(r["info"])["infotexts"][0] for r in (plain, reply)]
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32"' in infotexts[1] and "OpenVINO" not in infotexts[0]

    with pytest.raises(ValueError, match="available"):
        api.post(
            "/sdapi/v1/txt2img", json={**request, "script_name": "accelerate with openvino", "script_args": ["GPU.7"]}
        )


def test_panel_buttons_beside_a_running_generation(host: Any, ext: Any, settings: Any, api: Any) -> None:
    from ov_accelerate_webui.ui import PanelHandlers

    started, release = threading.Event(), threading.Event()

    def hold(params: Any) -> None:
        if not started.is_set():
            started.set()
            release.wait(60)

    host.callbacks.on_cfg_denoiser(hold)
    errors: list[str] = []
    results: dict[str, Any] = {}

    def guarded(name: str, fn: Any) -> Any:
        def work() -> None:
            try:
                results[name] = fn()
            except Exception:  # reported below with the thread's traceback
                errors.append(traceback.format_exc())

        return threading.Thread(target=work)

    args = [getattr(settings, name) for name in FIELD_NAMES]
    request = {"prompt": "a tiny cat", "seed": 7, "steps": 2, "width": 64, "height": 64}
    generation = guarded(
        "api",
        lambda: api.post(
            "/sdapi/v1/txt2img", json={**request, "script_name": "accelerate with openvino", "script_args": args}
        ).json(),
    )
    generation.start()
    assert started.wait(120)
    handlers = PanelHandlers(ext)
    start = time.perf_counter()
    size, ready, _status = handlers.refresh(settings.cache_dir)
    assert time.perf_counter() - start < 10 and "entries" in size, "Refresh does not wait for the generation"
    precompile = guarded("precompile", lambda: list(handlers.precompile("64x64", 1, *args)))
    precompile.start()
    precompile.join(1.0)
    assert precompile.is_alive(), "Pre-compile waits for the running generation (A1111's queue lock)"
    release.set()
    generation.join(120)
    precompile.join(120)

    assert not errors, errors[0]
    assert len(results["api"]["images"]) == 1 and "OpenVINO" in results["api"]["info"]
    assert results["precompile"][-1][0] == "Ready: 64x64."
    assert not is_routed(host.model.model.diffusion_model)
