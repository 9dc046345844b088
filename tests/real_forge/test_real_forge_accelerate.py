"""The extension accelerating inside a real Forge, over HTTP, against Forge's own picture for the same request.

``test_real_forge.py`` (on a Forge of its own, same bed and checkpoints) shows the reference is sound: stock Forge's
picture on these checkpoints is not flat and moves with the prompt (26.5 dB), the seed (10.6 dB), the LoRA (21.5 dB)
and the checkpoint (9.4 dB), so a picture within :data:`MIN_F32_DB` of stock's cannot come from a wrong part.
Measured here (AMD EPYC Zen 4, 2026-11-29): f32 86 dB against stock, a LoRA bit for bit, *Automatic* (bf16) 43 dB.

Forge reuses a request's conditioning when its cache key is unchanged (``processing.cached_params``), and then
never calls the text encoder; the key holds ``distilled_cfg_scale``, which SD 1.x and SDXL do not use, so
:func:`fresh` gives each request its own and every request runs the text encoder (stock's in PyTorch, ours in
OpenVINO).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ov_accelerate_webui.options import WEIGHTS_IN_FILE_OPTION
from tests.real_webui.controlnet import controlnet_unit, with_controlnet
from tests.real_webui.webui import SCRIPT_NAME, Result, psnr

from .forge import (
    CHECKPOINT_A,
    CHECKPOINT_B,
    FULL_CHECKPOINT,
    LORA,
    SD2_CHECKPOINT,
    SDXL_CHECKPOINT,
    SDXL_REFINER,
    SECTION_NAME,
    Forge,
    assert_accelerated,
)
from .test_real_forge import request

F32 = ["CPU", True, True, True, "f32", True, "", 1]
"""The dropdown entry's arguments: device, UNet, VAE, text encoder, precision, disk cache, its folder, step caching."""
AUTO = [*F32[:4], "auto", *F32[5:]]
MIN_F32_DB = 40.0
"""Accelerated at f32 against stock Forge (measured 84-86 dB; another prompt moves stock's picture to 26.5 dB)."""
MIN_AUTO_DB = 30.0
"""At *Automatic*: bf16 on a CPU with AVX-512 BF16 or AMX (measured 43 dB), f32 elsewhere."""
MIN_INT8_DB = 22.0
"""The INT8 UNet against stock's f32 (measured 33 dB on the tier's checkpoint; the A1111 tier's floor too)."""
UNET, VAE_DECODER = "unet.model.diffusion_model", "vae.first_stage_model.decoder"
TEXT_ENCODER = "clip.cond_stage_model.clip_l.transformer.text_model.encoder"
_unique = itertools.count(1)


def fresh(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with a conditioning-cache key of its own (see the module docstring)."""
    return dict(payload, distilled_cfg_scale=3.5 + next(_unique) / 1000)


def accelerated(payload: dict[str, Any], args: list[Any] = F32) -> dict[str, Any]:
    return dict(payload, script_name=SCRIPT_NAME, script_args=list(args))


def with_section(payload: dict[str, Any], precision: str = "f32") -> dict[str, Any]:
    section = [{"enabled": True, "precision": precision}]
    scripts = dict(payload.get("alwayson_scripts") or {}, **{SECTION_NAME: {"args": section}})
    return dict(payload, alwayson_scripts=scripts)


def stock_and_fast(forge: Forge, payload: dict[str, Any], args: list[Any] = F32) -> tuple[Result, Result, dict]:
    """Stock Forge's picture for ``payload``, then the dropdown entry's with ``args``, and the status after it."""
    stock = forge.generate(fresh(payload))
    fast = forge.generate(fresh(accelerated(payload, args)))
    return stock, fast, forge.status()


def matches(forge: Forge, what: str, stock: Result, fast: Result, status: dict[str, Any], min_db: float) -> float:
    assert len(stock.images) == len(fast.images) >= 1, (len(stock.images), len(fast.images))
    worst = min(psnr(a, b) for a, b in zip(stock.images, fast.images))
    forge.record(f"forge: {what}", worst, Result(fast.images, fast.info, fast.seconds, status))
    assert worst >= min_db, (what, worst, status["status"])
    return worst


@contextlib.contextmanager
def on_checkpoint(forge: Forge, name: str) -> Iterator[None]:
    """``name`` selected (as the dropdown does) for the ``with`` block, the tier's CHECKPOINT_A again afterwards."""
    forge.call("/sdapi/v1/options", {"sd_model_checkpoint": name})
    try:
        yield
    finally:
        forge.call("/sdapi/v1/options", {"sd_model_checkpoint": CHECKPOINT_A})


def compile_lines(status: dict[str, Any]) -> list[str]:
    return [line.strip() for line in status["status"].splitlines() if line.strip().startswith("graph ")]


def test_dropdown_entry_runs_every_part_in_openvino_and_matches_forge(forge: Forge) -> None:
    payload = request("a lighthouse on a cliff, (dramatic sky:1.2)")
    stock, fast, status = stock_and_fast(forge, payload)
    assert_accelerated(status)
    assert status["calls"][UNET] == 3 and status["calls"][VAE_DECODER] == 1, status["calls"]  # 3 steps, cond+uncond
    assert status["calls"][TEXT_ENCODER] >= 1, status["calls"]
    assert "in place of sub-quadratic" in status["status"], status["status"]  # Forge's CPU attention, swapped
    assert not status["pytorch"], status["pytorch"]
    matches(forge, "dropdown entry, f32", stock, fast, status, MIN_F32_DB)
    infotext = fast.infotexts[0]
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32"' in infotext and "Script: Accelerate with OpenVINO" in infotext, infotext
    # the accelerated text encoder reads the prompt: another prompt moves the accelerated picture as it moves stock's
    other = forge.generate(fresh(accelerated(request("a red car in the rain"))))
    assert psnr(other.images[0], fast.images[0]) < MIN_F32_DB


def test_a_second_size_at_automatic_precision(forge: Forge) -> None:
    payload = request("a stone bridge over a river", width=96, height=64)
    stock, fast, status = stock_and_fast(forge, payload, AUTO)
    assert_accelerated(status)
    assert status["settings"] == "CPU, UNet+VAE+TE, auto", status["settings"]
    assert fast.images[0].shape == (64, 96, 3)
    matches(forge, "96x64, Automatic precision", stock, fast, status, MIN_AUTO_DB)


def test_lora_on_and_off_matches_forges_own_loader_and_compiles_without_converting(forge: Forge) -> None:
    """Forge's LoRA loader writes new weight tensors into the UNet and the text encoder (``refresh_loras``); the
    accelerated picture is Forge's own, and the change is a compile of the model converted before, not a
    conversion. Taking the LoRA off gives the base picture back. The weights the loader merges go into the weight file
    as they are made (``forge_lora``), and the status says so."""
    base = request("a lighthouse on a cliff, (dramatic sky:1.2)")
    forge.generate(fresh(accelerated(base)))  # this test's weights and size compiled before the change
    stock, fast, status = stock_and_fast(forge, request(f"a lighthouse on a cliff, (dramatic sky:1.2) <lora:{LORA}:1>"))
    assert_accelerated(status)
    matches(forge, "LoRA on", stock, fast, status, MIN_F32_DB)
    assert "Lora hashes" in fast.infotexts[0], fast.infotexts[0]
    lines = compile_lines(status)
    assert lines and all("convert 0.00s" in line for line in lines), status["status"]
    # acceleration in use: the weights Forge's loader merged (for stock's request, first) went into the weight file
    assert "of merged weights went into the weight file as they were made" in status["status"], status["status"]
    stock_off, fast_off, status_off = stock_and_fast(forge, base)
    assert_accelerated(status_off)
    matches(forge, "LoRA off again", stock_off, fast_off, status_off, MIN_F32_DB)
    assert psnr(fast_off.images[0], fast.images[0]) < MIN_F32_DB  # the LoRA moved the accelerated picture


def test_checkpoint_switch_and_back(forge: Forge) -> None:
    """Forge loads another checkpoint into a new model object inside the request: the generation routes that one,
    names it plainly, and the one it started with is let go; switching back compiles from the disk cache, and
    dynamo traces nothing: the parts' captures, saved by the first checkpoint of the family, come from the disk
    cache (as on a restart), though Forge's layer classes are defined inside a class (``ForgeOperations.Linear``)."""
    payload = request("a windmill in a field")
    with on_checkpoint(forge, CHECKPOINT_B):
        stock, fast, status = stock_and_fast(forge, payload)
    assert "Model: ovtest-forge-sd15-b" in fast.infotexts[0], fast.infotexts[0]
    assert_accelerated(status)
    matches(forge, "checkpoint B", stock, fast, status, MIN_F32_DB)
    stock_a, fast_a, status_a = stock_and_fast(forge, payload)
    assert "Model: ovtest-forge-sd15-a" in fast_a.infotexts[0]
    assert_accelerated(status_a)
    assert set(status_a["calls"]) == set(status["calls"]), status_a["calls"]  # the routes of one model, unprefixed
    assert not status_a["switches"], status_a["switches"]
    assert status_a["cache_hits"] > 0, status_a["status"]  # A's converted models, from the disk cache
    assert status_a["captures_loaded"] >= 3 and status_a["captures_made"] == 0, status_a["status"]
    assert "loaded from the disk cache instead of tracing again" in status_a["status"], status_a["status"]
    matches(forge, "checkpoint A again", stock_a, fast_a, status_a, MIN_F32_DB)


def test_a_load_while_accelerating_writes_the_routed_weights_straight_into_the_file(forge: Forge) -> None:
    """After an accelerated generation, the next checkpoint Forge loads writes the routed parts' weights from the
    checkpoint file into the weight file (Forge's f32 copy of them is never made): stock Forge's picture from those
    weights is bit for bit its picture after its own load (the setting off), and the status says what moved."""
    payload = request("a lighthouse at night")
    forge.generate(fresh(accelerated(payload)))  # acceleration in use, on checkpoint A
    forge.call("/sdapi/v1/options", {WEIGHTS_IN_FILE_OPTION: False})
    try:
        with on_checkpoint(forge, CHECKPOINT_B):
            own = forge.generate(fresh(payload))  # Forge's own load of B
    finally:
        forge.call("/sdapi/v1/options", {WEIGHTS_IN_FILE_OPTION: True})
    forge.generate(fresh(payload))  # back on A (Forge loads a checkpoint at the request that needs it)
    with on_checkpoint(forge, CHECKPOINT_B):
        filled = forge.generate(fresh(payload))  # B again: into the weight file as it loads
        fast = forge.generate(fresh(accelerated(payload)))
    status = forge.status()
    assert psnr(own.images[0], filled.images[0]) == float("inf")
    assert_accelerated(status)
    assert "ovtest-forge-sd15-b" in status["status"] and "straight into the weight file" in status["status"], \
        status["status"]
    matches(forge, "after a load into the weight file", filled, fast, status, MIN_F32_DB)


def test_8_bit_weights_and_the_int8_unet(forge: Forge) -> None:
    """*8-bit weights* compresses the UNet's and text encoder's weights and computes at *Automatic*; *INT8 UNet* runs
    the UNet at float on the first generation while its steps are recorded, quantizes it at the end (NNCF, installed
    by install.py into Forge's venv), and the next generation runs the INT8 model."""
    payload = request("a red barn in a field", steps=4)
    stock, fast, status = stock_and_fast(forge, payload, [*F32[:4], "int8-weights", *F32[5:]])
    assert_accelerated(status)
    matches(forge, "8-bit weights", stock, fast, status, MIN_AUTO_DB)
    int8 = [*F32[:4], "int8", *F32[5:]]
    first = forge.generate(fresh(accelerated(payload, int8)))
    status = forge.status()
    assert_accelerated(status)
    assert "INT8 quantization; calibrated on 4 recorded call(s)" in status["status"], status["status"]
    assert 'OpenVINO: "CPU, UNet+VAE+TE, int8"' in first.infotexts[0], first.infotexts[0]
    again = forge.generate(fresh(accelerated(payload, int8)))
    status = forge.status()
    assert_accelerated(status)
    assert "INT8 model" in status["status"] and "INT8 quantization" not in status["status"], status["status"]
    matches(forge, "INT8 UNet against stock f32", stock, again, status, MIN_INT8_DB)
    assert again.images[0].std() > 5


def test_step_caching_splits_forges_unet_and_stays_close_to_the_uncached_picture(forge: Forge) -> None:
    """Step caching on Forge's own UNet: the schedule in Forge's sampler steps, the status and the infotext as in
    A1111, the picture close to the uncached one and moved by the shallow steps; with every step full, the split's
    full method gives the uncached picture (it is Forge's UNet forward, block by block)."""
    payload = request("a harbour at dawn", steps=10)
    plain = forge.generate(fresh(accelerated(payload)))
    cached = forge.generate(fresh(accelerated(payload, [*F32[:7], 2])))
    status = forge.status()
    assert_accelerated(status)
    facts = status["step_cache"]
    # 10 sampler steps at interval 2 (the first 2 and the last full): F F s F s F s F s F
    assert (facts["full_calls"], facts["shallow_calls"]) == (6, 4), status["status"]
    assert not facts["full_on_shallow_steps"] and not facts["unsupported"], status["status"]
    assert "Step caching every 2 steps (depth 2): 6 full and 4 shallow" in status["status"], status["status"]
    assert 'OpenVINO: "CPU, UNet+VAE+TE, f32, step cache 2"' in cached.infotexts[0], cached.infotexts[0]
    difference = min(psnr(a, b) for a, b in zip(plain.images, cached.images))
    forge.record("forge: step caching every 2 steps against uncached", difference, cached)
    assert 20.0 <= difference < 80, difference  # close, and the shallow steps did change it
    short = request("a harbour at dawn", steps=3)  # 3 steps: the first 2 and the last are full
    whole = forge.generate(fresh(accelerated(short)))
    split = forge.generate(fresh(accelerated(short, [*F32[:7], 2])))
    status = forge.status()
    assert (status["step_cache"]["full_calls"], status["step_cache"]["shallow_calls"]) == (3, 0), status["status"]
    matches(forge, "step caching with every step full against uncached", whole, split, status, 80.0)


def test_section_with_xyz_plot_accelerates_every_cell(forge: Forge) -> None:
    info = next(s for s in forge.get("/sdapi/v1/script-info") if s["name"] == "x/y/z plot" and not s["is_img2img"])
    args = [arg["value"] for arg in info["args"]]
    for i, arg in enumerate(info["args"]):  # the axis types are dropdowns of type "index": their defaults are labels
        if arg["label"] in ("X type", "Y type", "Z type"):
            args[i] = arg["choices"].index("Steps" if arg["label"] == "X type" else "Nothing")
    args[1] = "2,3"
    payload = dict(request("a teapot on a table"), script_name="x/y/z plot", script_args=args)
    stock = forge.generate(fresh(payload))
    fast = forge.generate(fresh(with_section(payload)))
    status = forge.status()
    assert_accelerated(status)
    assert status["generations"] == 2 and status["plain_generations"] == 0, status["status"]
    assert status["calls"][UNET] == 2 + 3, status["calls"]
    matches(forge, "section with X/Y/Z plot (Steps 2, 3)", stock, fast, status, MIN_F32_DB)
    assert "OpenVINO section: on" in fast.infotexts[-1], fast.infotexts[-1]


def test_freeu_runs_the_unet_in_pytorch_and_names_it(forge: Forge) -> None:
    """Forge's FreeU patches the UNet's output blocks through the call's options: those calls run in PyTorch, the
    status and the infotext name FreeU, and the picture is stock Forge's with FreeU."""
    freeu = next(s for s in forge.get("/sdapi/v1/script-info") if s["name"].startswith("freeu") and not s["is_img2img"])
    payload = dict(request("a cabin in the woods"),
                   alwayson_scripts={freeu["name"]: {"args": [True, 1.3, 1.4, 0.9, 0.2, 0.0, 1.0]}})
    stock, fast, status = stock_and_fast(forge, payload)
    assert status["accelerated"], status["status"]
    why = status["pytorch"][UNET]["why"]
    assert "FreeU (output_block_patch)" in why, why
    assert status["pytorch"][UNET]["calls"] == 3 and status["calls"][UNET] == 0, status
    assert status["calls"][VAE_DECODER] == 1 and status["calls"][TEXT_ENCODER] >= 1, status["calls"]
    assert "; UNet in PyTorch (FreeU)" in fast.infotexts[0], fast.infotexts[0]
    matches(forge, "FreeU on (UNet in PyTorch)", stock, fast, status, MIN_F32_DB)


#: (Forge's built-in script, its arguments with it on, the owner the status names): scripts that patch the UNet call.
BUILT_IN_PATCHES = (
    ("Kohya HRFix Integrated", [True, 3, 2.0, 0.0, 0.35, True, "bicubic", "bicubic"], "Kohya HRFix"),
    ("SelfAttentionGuidance Integrated", [True, 0.5, 2.0, 1.0], "SAG (Self-Attention Guidance)"),
    ("PerturbedAttentionGuidance Integrated", [True, 3.0, 0.0, 0.0, 1.0], "PAG (Perturbed Attention Guidance)"),
    ("StyleAlign Integrated", [True, 1.0], "StyleAlign"),
)


@pytest.mark.parametrize(("title", "args", "owner"), BUILT_IN_PATCHES, ids=[p[2].split()[0] for p in BUILT_IN_PATCHES])
def test_forges_built_in_unet_patches_run_in_pytorch_and_are_named(forge: Forge, title: str, args: list[Any],
                                                                   owner: str) -> None:
    """Each of Forge's built-in scripts that patch the UNet call, on: the calls it patches run in PyTorch with the
    script named in the status, the others (and the VAE, the text encoder) in OpenVINO, and the picture is stock
    Forge's with the same script."""
    script = next(s for s in forge.get("/sdapi/v1/script-info")
                  if s["name"].startswith(title.lower()) and not s["is_img2img"])
    payload = dict(request("a red kite over the dunes", batch_size=2),
                   alwayson_scripts={script["name"]: {"args": args}})
    stock, fast, status = stock_and_fast(forge, payload)
    assert status["accelerated"], status["status"]
    assert owner in status["pytorch"][UNET]["why"], status["pytorch"]
    assert status["pytorch"][UNET]["calls"] >= 3, status["pytorch"]  # (3 steps)
    assert status["calls"][VAE_DECODER] >= 1 and status["calls"][TEXT_ENCODER] >= 1, status["calls"]
    assert f"; UNet in PyTorch ({owner})" in fast.infotexts[0], fast.infotexts[0]
    matches(forge, f"{owner} on (its UNet calls in PyTorch)", stock, fast, status, MIN_F32_DB)


def test_multidiffusion_tiles_run_through_openvino_inside_its_wrapper(forge: Forge) -> None:
    """Forge's MultiDiffusion sets a UNet function wrapper of its own that calls the UNet on tiles of the latent (its
    script runs before ours: ours wraps around it); each tile's UNet call runs in OpenVINO, the picture is stock
    Forge's with the same tiles, and the tiles move stock's picture."""
    script = next(s for s in forge.get("/sdapi/v1/script-info")
                  if s["name"].startswith("multidiffusion") and not s["is_img2img"])
    payload = request("a harbour at dawn", width=128, height=64)
    # 64x64 px tiles (8x8 latent) overlapping by 32 px over a 16x8 latent: 3 tiles, 2 of them in one UNet call
    tiled = dict(payload, alwayson_scripts={script["name"]: {"args": [True, "MultiDiffusion", 64, 64, 32, 2]}})
    plain = forge.generate(fresh(payload))
    stock, fast, status = stock_and_fast(forge, tiled)
    moved = psnr(plain.images[0], stock.images[0])
    forge.record("forge: stock with MultiDiffusion against without", moved)
    assert moved < MIN_F32_DB, moved
    assert "multidiffusion_enabled: True" in stock.infotexts[0], stock.infotexts[0]
    assert "multidiffusion_enabled: True" in fast.infotexts[0], fast.infotexts[0]
    assert_accelerated(status)
    assert not status["pytorch"], status["pytorch"]
    # 3 steps x 2 tile batches (2 tiles, then 1), each with its cond and uncond in one call
    assert status["calls"][UNET] == 6, status["calls"]
    matches(forge, "MultiDiffusion (tiles in OpenVINO), f32", stock, fast, status, MIN_F32_DB)


def test_forges_integrated_controlnet_runs_the_unet_in_pytorch_and_names_it(forge: Forge) -> None:
    """Forge's integrated ControlNet (``sd_forge_controlnet``) with the A1111 bed's random ControlNet on its full-size
    SD 1.5 (ControlNet's layout fits nothing smaller): its residuals come into the UNet call, which then runs in
    PyTorch with ControlNet named; the VAE and the text encoder stay in OpenVINO; the picture is stock Forge's with
    the same unit, and that unit moves stock's picture."""
    names = forge.get("/controlnet/model_list")["model_list"]
    model = next((n for n in names if n.startswith("ovtest-controlnet-sd15")), None)
    assert model is not None, f"the random ControlNet is not listed by Forge: {names} (rebuild: bash .ci/testbed)"
    payload = request("a stone bridge over a river")
    controlled = with_controlnet(payload, controlnet_unit(model, module="None", weight=1.5))
    with on_checkpoint(forge, FULL_CHECKPOINT):
        plain = forge.generate(fresh(payload))
        stock, fast, status = stock_and_fast(forge, controlled)
    moved = psnr(plain.images[0], stock.images[0])
    forge.record("forge: stock with ControlNet against without", moved)
    assert moved < MIN_F32_DB, moved
    assert status["accelerated"], status["status"]
    assert "Forge's integrated ControlNet" in status["pytorch"][UNET]["why"], status["pytorch"]
    assert status["pytorch"][UNET]["calls"] == 3 and not status["calls"].get(UNET), status
    assert status["calls"][VAE_DECODER] == 1 and status["calls"][TEXT_ENCODER] >= 1, status["calls"]
    assert "; UNet in PyTorch (ControlNet)" in fast.infotexts[0], fast.infotexts[0]
    matches(forge, "ControlNet on (UNet in PyTorch)", stock, fast, status, MIN_F32_DB)


def test_interrupt_leaves_nothing_patched(forge: Forge) -> None:
    """Interrupt mid-generation: the request returns, and the next stock picture is the stock picture of before."""
    reference = request("a quiet street")
    before = forge.generate(fresh(reference))
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = forge.generate(fresh(accelerated(request("a busy market", steps=40, n_iter=4))))
        except Exception as exc:  # noqa: BLE001 (reported below)
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.time() + 600
    while forge.get("/sdapi/v1/progress?skip_current_image=true")["state"]["sampling_step"] < 2:
        assert time.time() < deadline and thread.is_alive(), out
        time.sleep(0.1)
    forge.call("/sdapi/v1/interrupt", {})
    thread.join(600)
    assert "error" not in out, out.get("error")
    assert 1 <= len(out["result"].images) < 4
    after = forge.generate(fresh(reference))
    assert psnr(before.images[0], after.images[0]) == float("inf")  # stock after == stock before


def test_sd2_v_prediction_runs_every_part_in_openvino_and_matches_forge(forge: Forge) -> None:
    """SD 2.x with v-prediction (OpenCLIP-H, Forge's ``StableDiffusion2``): stock Forge's picture on the tier's
    checkpoint is sane (not flat, moved by the prompt), and the accelerated one is it."""
    payload = request("a lighthouse on a cliff")
    with on_checkpoint(forge, SD2_CHECKPOINT):
        stock, fast, status = stock_and_fast(forge, payload)
        other = forge.generate(fresh(request("a red car in the rain")))
    assert "Model: ovtest-forge-sd2-v" in fast.infotexts[0], fast.infotexts[0]
    assert float(stock.images[0].std()) > 5, "stock Forge's SD 2 picture is flat"
    moved = psnr(other.images[0], stock.images[0])
    forge.record("forge: SD 2, stock with another prompt", moved)
    assert moved < MIN_F32_DB, moved
    assert_accelerated(status)
    encoders = {label for label, n in status["calls"].items() if n and label.startswith("clip.")}
    assert encoders == {TEXT_ENCODER.replace("clip_l", "clip_h")}, status["calls"]
    matches(forge, "SD 2 (v-prediction), f32", stock, fast, status, MIN_F32_DB)


def test_sdxl_and_its_refiner_switching_mid_generation_run_in_openvino_and_match_forge(forge: Forge) -> None:
    """SDXL base alone: every part (both text encoders, the prompt's weights read) in OpenVINO, Forge's own picture.
    With the refiner from half-way (``refiner_switch_at``), Forge loads it inside the sampling and samples on with its
    UNet: that UNet, its text encoder and its VAE run in OpenVINO from there on, and the picture is stock Forge's with
    the refiner (which moves stock's picture)."""
    base = request("a castle in the fog, (dramatic sky:1.2)", steps=4)
    refined = dict(base, refiner_checkpoint=SDXL_REFINER, refiner_switch_at=0.5)
    with on_checkpoint(forge, SDXL_CHECKPOINT):
        # stock's two first: the accelerated base then starts from the base Forge loads back after the refiner,
        # and the accelerated run with the refiner from the base the one before left loaded (its parts compiled)
        plain, stock_refined = forge.generate(fresh(base)), forge.generate(fresh(refined))
        fast, status = forge.generate(fresh(accelerated(base))), forge.status()
        fast_refined, status_refined = forge.generate(fresh(accelerated(refined))), forge.status()
    assert "Model: ovtest-forge-sdxl" in fast.infotexts[0], fast.infotexts[0]
    assert_accelerated(status)
    encoders = {label for label, n in status["calls"].items() if n and label.startswith("clip.")}
    assert encoders == {TEXT_ENCODER, TEXT_ENCODER.replace("clip_l", "clip_g")}, status["calls"]
    matches(forge, "SDXL, f32", plain, fast, status, MIN_F32_DB)

    assert "Refiner: ovtest-forge-sdxl-refiner" in stock_refined.infotexts[0], stock_refined.infotexts[0]
    moved = psnr(plain.images[0], stock_refined.images[0])
    forge.record("forge: SDXL, stock with the refiner against without", moved)
    assert moved < MIN_F32_DB, moved
    assert_accelerated(status_refined, parts=("UNet", "TE"))  # (the base's VAE decodes nothing: the refiner's does)
    assert not status_refined["pytorch"], status_refined["pytorch"]
    refiner, calls = "ovtest-forge-sdxl-refiner: ", status_refined["calls"]
    # 4 steps, the refiner from the third: each UNet two calls (cond and uncond in one); the refiner's VAE decodes
    assert calls[UNET] == 2 and calls[refiner + UNET] == 2, calls
    assert calls[refiner + VAE_DECODER] == 1 and calls[refiner + TEXT_ENCODER.replace("clip_l", "clip_g")] >= 1, calls
    switches = "Model switches during the generation: ovtest-forge-sdxl-refiner"
    assert switches in status_refined["status"], status_refined["status"]
    matches(forge, "SDXL with the refiner from half-way, f32", stock_refined, fast_refined, status_refined, MIN_F32_DB)
