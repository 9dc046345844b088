"""The always-on "OpenVINO" section in a real AUTOMATIC1111 WebUI v1.10.1, with the WebUI's own scripts.

Each script runs twice with the same request and seed: stock A1111, then with the section enabled at f32
(over the API's ``alwayson_scripts``). Every picture must match stock's (>= ``MIN_PSNR`` dB), and the
status route must show the whole job (all of the script's ``process_images`` calls) ran its UNet, VAE and
text encoder through OpenVINO with nothing in PyTorch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .test_real_webui import (
    F32_ARGS,
    MIN_PSNR,
    _unique,
    assert_ran_in_openvino,
    encode_image,
    init_image,
    min_psnr,
    request,
)
from .webui import SCRIPT_NAME, Result, WebUI, psnr

SECTION = "OpenVINO"
SECTION_F32 = [True, *F32_ARGS]


def with_section(payload: dict[str, Any], args: list[Any] | None = None) -> dict[str, Any]:
    scripts = dict(payload.get("alwayson_scripts") or {})
    scripts[SECTION] = {"args": list(SECTION_F32 if args is None else args)}
    return dict(payload, alwayson_scripts=scripts)


def fresh(payload: dict[str, Any]) -> dict[str, Any]:
    """The same request with a new conditioning-cache key (see test_real_webui's docstring)."""
    return dict(payload, override_settings=dict(payload["override_settings"], sdxl_crop_top=next(_unique)))


def stock_and_section(ui: WebUI, payload: dict[str, Any], kind: str = "txt2img") -> tuple[Result, Result]:
    """(stock, with the section) for one request; the section's run has its status attached.

    In img2img, A1111 samples the VAE's latent distribution (``encode_first_stage(...).sample()``) with
    torch's global generator before it seeds that generator for the image's noise, so its picture depends on
    the request before it (two stock runs of one img2img request after different requests measured 28 dB
    apart). The same request first, untimed, makes the state before both runs the same.
    """
    if kind == "img2img":
        ui.generate(fresh(payload), kind)
    stock = ui.generate(fresh(payload), kind)
    fast = ui.generate(with_section(fresh(payload)), kind)
    fast.status = ui.status()
    return stock, fast


def assert_job_matches(ui: WebUI, what: str, stock: Result, fast: Result, generations: int,
                       parts: tuple[str, ...] = ("UNet", "VAE", "TE")) -> None:
    assert len(stock.images) == len(fast.images) > 0, (len(stock.images), len(fast.images))
    assert_ran_in_openvino(fast.status, parts)
    assert fast.status["generations"] == generations, fast.status["status"]
    assert fast.status["plain_generations"] == 0, fast.status["status"]
    assert all(run["settings"] == "CPU, UNet+VAE+TE, f32" for run in fast.status["runs"]), fast.status["runs"]
    value = min_psnr(stock, fast)
    ui.record(what, value, fast)
    assert value >= MIN_PSNR, f"{what}: {value:.1f} dB\n{fast.status['status']}"


@contextlib.contextmanager
def webui_option(ui: WebUI, key: str, value: Any) -> Iterator[None]:
    """A WebUI option set for the requests inside the block, and put back after.

    (Not ``override_settings``: A1111 v1.10.1 puts back only the options that were in its settings file, so
    an override of an option still at its default stays for every later request.)
    """
    before = ui.get("/sdapi/v1/options")[key]
    ui.call("/sdapi/v1/options", {key: value})
    try:
        yield
    finally:
        ui.call("/sdapi/v1/options", {key: before})


def script_arg_index(ui: WebUI, script: str, label: str, choice: str, img2img: bool = False) -> int:
    """The index of ``choice`` among the choices of ``script``'s argument ``label`` (X/Y/Z's axis types)."""
    info = next(s for s in ui.get("/sdapi/v1/script-info") if s["name"] == script and s["is_img2img"] == img2img)
    arg = next(a for a in info["args"] if a["label"] == label)
    return arg["choices"].index(choice)


def xyz_args(x_type: int, x_values: str, y_type: int = 0, y_values: str = "",
             x_dropdown: list[str] | None = None) -> list[Any]:
    return [x_type, x_values, x_dropdown or [], y_type, y_values, [], 0, "", [],
            True, True, False, False, False, False, False, 0, False]


def test_section_is_an_always_on_script_with_a_title_of_its_own(webui: WebUI) -> None:
    info = webui.get("/sdapi/v1/script-info")
    for img2img in (False, True):
        section = next(s for s in info if s["name"] == SECTION.lower() and s["is_img2img"] == img2img)
        assert section["is_alwayson"], section
        assert len(section["args"]) == len(SECTION_F32) + 1  # (step caching, not sent by these tests: off)
        assert section["args"][0]["value"] is False  # off unless the user turns it on
        dropdown = next(s for s in info if s["name"] == SCRIPT_NAME and s["is_img2img"] == img2img)
        assert not dropdown["is_alwayson"]


def test_section_txt2img_matches_stock_and_says_so_in_the_infotext(webui: WebUI) -> None:
    stock, fast = stock_and_section(webui, request("a windmill in a field, (golden hour:1.1)"))
    assert_job_matches(webui, "section: txt2img", stock, fast, generations=1)
    infotext = fast.infotexts[0]
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32"' in infotext and "OpenVINO section: on" in infotext, infotext
    assert "Script: Accelerate with OpenVINO" not in infotext, infotext
    assert "OpenVINO" not in stock.infotexts[0]


def test_section_named_arguments_and_a_short_list(webui: WebUI) -> None:
    """The section's arguments as one object of named values; a short list takes the documented defaults
    (here: Enable only, at the panel's defaults)."""
    payload = request("a stone bridge over a river")
    fast = webui.generate(with_section(fresh(payload), [{"enabled": True, "precision": "f32"}]))
    status = webui.status()
    assert_ran_in_openvino(status)
    assert status["settings"] == "CPU, UNet+VAE+TE, f32", status
    webui.generate(with_section(fresh(payload), [True]))
    status = webui.status()
    assert_ran_in_openvino(status)
    assert status["settings"] == "CPU, UNet+VAE+TE, auto", status
    webui.generate(with_section(fresh(payload), [*SECTION_F32, "Off", "one too many"]))  # A1111 cuts the list to 9
    status = webui.status()
    assert_ran_in_openvino(status)
    assert status["settings"] == "CPU, UNet+VAE+TE, f32", status
    stock = webui.generate(fresh(payload))
    assert min_psnr(stock, fast) >= MIN_PSNR


def test_section_wrong_argument_is_said_and_the_image_still_made_in_pytorch(webui: WebUI) -> None:
    payload = request("a wooden boat on a lake")
    wrong = webui.generate(with_section(fresh(payload), [True, "CPU", "yes"]))
    status = webui.status()
    assert not status["accelerated"], status
    assert "'unet' must be true or false" in status["status"], status["status"]
    assert "'unet' must be true or false" in webui.log_text()
    assert "OpenVINO" not in wrong.infotexts[0]
    stock = webui.generate(fresh(payload))
    assert min_psnr(stock, wrong) == np.inf  # stock A1111's picture: nothing was routed


def test_dropdown_entry_and_section_together_accelerate_once(webui: WebUI) -> None:
    payload = with_section(request("a lantern in the snow"))
    payload.update(script_name=SCRIPT_NAME, script_args=list(F32_ARGS))
    fast = webui.generate(payload)
    status = webui.status()
    assert_ran_in_openvino(status)
    assert "Script: Accelerate with OpenVINO" in fast.infotexts[0]
    assert "OpenVINO section" not in fast.infotexts[0]
    assert status["generations"] == 1 and "This job ran" not in status["status"], status["status"]
    stock = webui.generate(fresh(request("a lantern in the snow")))
    assert min_psnr(stock, fast) >= MIN_PSNR


def test_prompts_from_file_with_its_own_steps_and_width(webui: WebUI) -> None:
    lines = 'a red barn\n--prompt "a blue lake" --steps 4 --width 96\na green hill'
    payload = request("", script_name="prompts from file or textbox", script_args=[False, False, "start", lines])
    stock, fast = stock_and_section(webui, payload)
    assert [im.shape[1] for im in fast.images] == [64, 96, 64]
    assert_job_matches(webui, "section: Prompts from file (3 lines, one 96 wide)", stock, fast, generations=3)


def test_xyz_plot_over_steps_and_cfg(webui: WebUI) -> None:
    steps = script_arg_index(webui, "x/y/z plot", "X type", "Steps")
    cfg = script_arg_index(webui, "x/y/z plot", "Y type", "CFG Scale")
    payload = request("a red fox in the forest", script_name="x/y/z plot",
                      script_args=xyz_args(steps, "2,3", cfg, "4,7"))
    stock, fast = stock_and_section(webui, payload)
    assert len(fast.images) == 1 + 4  # the grid and each cell
    assert_job_matches(webui, "section: X/Y/Z plot steps x CFG", stock, fast, generations=4)
    compiled = [run["compiles"] for run in fast.status["runs"]]
    assert sum(compiled[1:]) == 0, fast.status["runs"]  # the first cell's compiled models serve every cell


def test_xyz_plot_over_the_openvino_enabled_axis(webui: WebUI) -> None:
    enabled = script_arg_index(webui, "x/y/z plot", "X type", "[OpenVINO] Enabled")
    for axis in ("[OpenVINO] Precision", "[OpenVINO] Device"):
        script_arg_index(webui, "x/y/z plot", "X type", axis)  # listed
    payload = request("a teapot on a table", script_name="x/y/z plot",
                      script_args=xyz_args(enabled, "", x_dropdown=["On", "Off"]))
    stock = webui.generate(fresh(payload))
    grid = webui.generate(fresh(payload))  # the section off: the axis alone turns it on in the On cells
    status = webui.status()
    assert_ran_in_openvino(status)
    assert status["generations"] == 1 and status["plain_generations"] == 1, status["status"]
    on, off = grid.images[1], grid.images[2]
    assert psnr(off, stock.images[2]) == np.inf  # the Off cell is stock A1111
    value = psnr(on, stock.images[1])
    webui.record("section: X/Y/Z [OpenVINO] Enabled On cell", value)
    assert value >= MIN_PSNR
    assert 'OpenVINO: "CPU, UNet+VAE+TE, auto"' in grid.infotexts[1], grid.infotexts[1]
    assert "OpenVINO" not in grid.infotexts[2], grid.infotexts[2]


def test_sd_upscale_tiles_share_one_compile(webui: WebUI) -> None:
    upscalers = [u["name"] for u in webui.get("/sdapi/v1/upscalers")]
    payload = request("a castle on a hill", init_images=[encode_image(init_image())], denoising_strength=0.4,
                      script_name="sd upscale", script_args=["", 16, upscalers.index("Lanczos"), 2.0])
    stock, fast = stock_and_section(webui, payload, "img2img")
    assert fast.images[0].shape[:2] == (128, 128)
    runs = fast.status["runs"]
    assert len(runs) >= 2 and sum(run["compiles"] for run in runs[1:]) == 0, runs
    assert "compiled nothing" in fast.status["status"], fast.status["status"]
    assert_job_matches(webui, f"section: SD upscale ({len(runs)} tile batches)", stock, fast, generations=len(runs))


def test_loopback_three_loops(webui: WebUI) -> None:
    payload = request("a lighthouse in fog", init_images=[encode_image(init_image())], denoising_strength=0.5,
                      script_name="loopback", script_args=[3, 0.5, "Linear", "None"])
    stock, fast = stock_and_section(webui, payload, "img2img")
    assert_job_matches(webui, "section: Loopback (3 loops)", stock, fast, generations=3)


def test_prompt_matrix(webui: WebUI) -> None:
    payload = request("a cabin|at night|in the rain", script_name="prompt matrix",
                      script_args=[False, False, "positive", "comma", 0])
    stock, fast = stock_and_section(webui, payload)
    assert len(fast.images) == 1 + 4
    assert_job_matches(webui, "section: Prompt matrix (4 prompts)", stock, fast, generations=1)


@pytest.mark.parametrize("kind", ["txt2img", "img2img"])
def test_section_turned_off_again_is_stock(webui: WebUI, kind: str) -> None:
    extra: dict[str, Any] = {"init_images": [encode_image(init_image())]} if kind == "img2img" else {}
    payload = request("a field of poppies", **extra)
    webui.generate(with_section(fresh(payload)), kind)
    off = webui.generate(with_section(fresh(payload), [False, *F32_ARGS]), kind)
    stock = webui.generate(fresh(payload), kind)
    assert min_psnr(stock, off) == np.inf
    assert "OpenVINO" not in off.infotexts[0]


def test_token_merging_runs_the_unet_in_pytorch_and_says_why(webui: WebUI) -> None:
    """Settings -> Optimizations -> Token merging: A1111 patches the UNet's transformer blocks with tomesd for
    the generation, into token scatters OpenVINO cannot convert. The UNet then runs in PyTorch (the picture is
    stock's with Token merging), the VAE and text encoder in OpenVINO, and the status and infotext say so."""
    payload = request("a hot air balloon over hills", width=128, height=128, steps=4)  # 256 tokens to merge
    plain = webui.generate(fresh(payload))
    with webui_option(webui, "token_merging_ratio", 0.75):
        stock, fast = stock_and_section(webui, payload)
    moved = min_psnr(plain, stock)
    status = fast.status
    assert_ran_in_openvino(status, ("VAE", "TE"))
    assert status["calls"]["model.diffusion_model"] == 0, status["status"]
    unet = status["pytorch"]["model.diffusion_model"]
    assert unet["calls"] > 0 and "Token merging is on (ratio 0.75" in unet["why"], status["pytorch"]
    assert "Ran in PyTorch, not OpenVINO: model.diffusion_model" in status["status"], status["status"]
    assert "Attention in the UNet" not in status["status"]
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32; UNet in PyTorch"' in fast.infotexts[0], fast.infotexts[0]
    value = min_psnr(stock, fast)
    webui.record(f"section: Token merging 0.75 (moves stock by {moved:.1f} dB; UNet in PyTorch)", value, fast)
    # the tiny model's picture moves little with Token merging (its attention matters little): the section's
    # picture must be far closer to stock's with Token merging than stock's without it is
    assert value >= max(MIN_PSNR, moved + 20), (value, moved)
    after = webui.generate(with_section(fresh(payload)))  # the ratio back at 0: the UNet in OpenVINO again
    assert_ran_in_openvino(webui.status())
    assert min_psnr(after, plain) >= MIN_PSNR


def test_negative_guidance_minimum_sigma(webui: WebUI) -> None:
    """Settings -> Optimizations -> Negative Guidance minimum sigma: A1111 skips the negative half of CFG on
    odd steps below that sigma, so the UNet's batch goes from 2 to 1 and back within the generation. It moves
    stock's picture, and the section gives stock's picture with it, every UNet call through OpenVINO. The
    batch of 1 costs what a new size costs: after a generation at a batch of 2, nothing is captured or
    converted again (before, it was a second dynamo capture of the whole UNet)."""
    payload = request("a hot air balloon over hills, at noon", steps=6, cfg_scale=25)
    plain = webui.generate(fresh(payload))
    webui.generate(with_section(fresh(payload)))  # the routes at a batch of 2, this size and these settings
    with webui_option(webui, "s_min_uncond", 100.0):
        stock, fast = stock_and_section(webui, payload)
    moved = min_psnr(plain, stock)
    assert moved < MIN_PSNR, f"the option does not move stock's picture ({moved:.1f} dB): the test shows nothing"
    status = fast.status
    assert status["calls"]["model.diffusion_model"] > 0, (status["status"], status["pytorch"])
    assert status["captures_made"] == 0 and status["convert_seconds"] == 0, status["status"]
    assert_job_matches(webui, f"section: Negative Guidance minimum sigma (moves stock by {moved:.1f} dB)", stock,
                       fast, generations=1)


def test_pad_prompt_and_the_lcm_sampler(webui: WebUI) -> None:
    """Settings -> Optimizations -> "Pad prompt/negative prompt" (a two-chunk prompt with a one-chunk negative
    prompt: padded, the UNet runs at a batch of 2 on 154 tokens instead of twice at a batch of 1), then the LCM
    sampler; each against stock with the same setting."""
    long_prompt = "a castle on a hill, " + ", ".join(f"detail {i}" for i in range(40))
    payload = request(long_prompt, cfg_scale=15)  # the negative half's weight: padding shows
    plain = webui.generate(fresh(payload))
    with webui_option(webui, "pad_cond_uncond", True):
        stock, fast = stock_and_section(webui, payload)
    moved = min_psnr(plain, stock)
    assert moved < MIN_PSNR, f"padding does not move stock's picture ({moved:.1f} dB): the test shows nothing"
    assert_job_matches(webui, f"section: Pad prompt/negative prompt (moves stock by {moved:.1f} dB)", stock, fast,
                       generations=1)
    stock, fast = stock_and_section(webui, request("a castle on a hill", sampler_name="LCM", cfg_scale=1.5))
    assert_job_matches(webui, "section: LCM sampler", stock, fast, generations=1)


def test_taesd_decode_is_named_and_the_rest_accelerated(webui: WebUI) -> None:
    """Settings -> VAE -> "VAE type for decode": TAESD, a small separate decoder the WebUI runs in PyTorch (the
    tier's is random, written by make_models.py). The UNet and text encoder run in OpenVINO, the VAE decoder
    is not called, and the status says why."""
    payload = request("a red kite over a beach")
    plain = webui.generate(fresh(payload))
    with webui_option(webui, "sd_vae_decode_method", "TAESD"):
        stock, fast = stock_and_section(webui, payload)
    assert np.std(stock.images[0]) > 5  # a picture, not a flat field
    moved = min_psnr(plain, stock)
    assert moved < MIN_PSNR, f"TAESD does not move stock's picture ({moved:.1f} dB): the test shows nothing"
    status = fast.status
    assert_ran_in_openvino(status, ("UNet", "TE"))
    assert status["calls"]["first_stage_model.decoder"] == 0, status["calls"]
    assert "The VAE decoder was not called: Settings -> VAE -> 'VAE type for decode' is TAESD" in status["status"]
    value = min_psnr(stock, fast)
    webui.record(f"section: TAESD decode (moves stock by {moved:.1f} dB; VAE decoder not called)", value, fast)
    assert value >= MIN_PSNR



MIB = 1 << 20


def _earlier_sessions(folder: Path, count: int) -> list[str]:
    """``count`` cache entries of 1 MiB each, as earlier sessions left them (last used 1-``count`` hours ago, the
    first the oldest), and a store another process is writing (a temporary folder); returns the keys, oldest first."""
    import time

    import openvino as ov

    from ov_backend import ModelCache

    cache = ModelCache(folder)
    keys = []
    for i in range(count):
        key = f"earlier-session-{i}"
        param = ov.opset13.parameter([MIB // 4], ov.Type.f32)
        weight = ov.opset13.constant(np.full(MIB // 4, float(i), np.float32))
        cache.store(key, ov.Model([ov.opset13.add(param, weight)], [param], key), "an earlier session's model")
        when = time.time() - 3600 * (count - i)
        os.utime(cache.models_dir / key / "meta.json", (when, when))
        keys.append(key)
    writing = cache.models_dir / ".tmp-another-process-writing"
    writing.mkdir()
    (writing / "model.bin").write_bytes(b"\0" * 4096)
    return keys


def _entry_bytes(folder: Path) -> int:
    """What the cache's entries take on disk, counted here with ``os.walk`` (models/, blobs/, captures/; not a
    store being written, nor ``weights/``, PyTorch's weights moved out of memory, which are no entries)."""
    total = 0
    for sub in ("models", "blobs", "captures"):
        for root, dirs, files in os.walk(folder / sub):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            total += sum(os.path.getsize(os.path.join(root, name)) for name in files if not name.startswith("."))
    return total


def test_disk_cache_limit_prunes_old_entries_and_keeps_the_ones_in_use(webui: WebUI, tmp_path: Path) -> None:
    """Settings -> OpenVINO -> "Disk cache limit (GB)" set through ``/sdapi/v1/options``: the first generation stores
    its models in a cache holding five old entries and prunes the least recently used until the folder is under the
    limit; a limit below what the WebUI uses keeps every entry in use (a WARNING, once) and the generations at new
    sizes still make their pictures; the status route reports the size, the limit and what was pruned as numbers."""
    from .test_real_webui import accelerated, request

    folder = tmp_path / "limited-cache"  # this test's own cache folder: the tier's other tests keep theirs
    old = _earlier_sessions(folder, 5)
    args = [*F32_ARGS[:-1], str(folder)]
    limit = 10 * MIB  # the WebUI's own entries (about 6.5 MiB on the tiny models) and a few old ones
    with webui_option(webui, "openvino_cache_limit_gb", limit / (1 << 30)):
        first = webui.generate(accelerated(request("a quiet lake", width=64, height=64), args))
        status = webui.status()
    assert first.images and status["accelerated"], status["status"]
    left = [key for key in old if (folder / "models" / key).is_dir()]
    pruned = old[:len(old) - len(left)]
    assert pruned and left == old[len(pruned):], (pruned, left)  # least recently used first
    assert status["cache_limit_bytes"] == limit
    assert status["cache_pruned"] == len(pruned) and status["cache_pruned_bytes"] >= len(pruned) * MIB
    assert status["cache_bytes"] == _entry_bytes(folder) <= limit, status
    assert (folder / "models" / ".tmp-another-process-writing" / "model.bin").is_file()  # never a store in progress
    in_use = {p.relative_to(folder) for sub in ("models", "captures") for p in (folder / sub).iterdir()
              if not p.name.startswith((".", "earlier-session-"))}
    assert len(in_use) >= 3 and status["cache_in_use_bytes"] > 0, in_use

    tiny = MIB  # smaller than what the WebUI uses: those stay, the WebUI says so, the pictures are made
    with webui_option(webui, "openvino_cache_limit_gb", tiny / (1 << 30)):
        for width, height in ((64, 96), (96, 64)):
            run = webui.generate(accelerated(request("a quiet lake", width=width, height=height), args))
            assert run.images and np.std(run.images[0]) > 5
        status = webui.status()
    assert not any((folder / "models" / key).exists() for key in old)
    assert in_use <= {p.relative_to(folder) for sub in ("models", "captures") for p in (folder / sub).iterdir()}
    assert status["cache_limit_bytes"] == tiny and status["cache_bytes"] == _entry_bytes(folder) > tiny
    assert status["cache_in_use_bytes"] == status["cache_bytes"], status
    assert "Disk cache:" in status["status"] and "limit (over it:" in status["status"], status["status"]
    assert webui.log_text().count("over its limit of 1.0 MiB") == 1, webui.log_tail()
