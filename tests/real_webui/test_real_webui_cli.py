"""The command line's batch job against the real WebUI: for the same checkpoint, prompt, seed and LoRA (of each
kind A1111's built-in Lora extension loads), ``python -m ov_backend batch`` through OpenVINO at f32 gives stock
A1111's picture and writes A1111's ``Lora hashes``.

The command line reads the tier's checkpoint from the WebUI's own data folder, with the LDM config beside it
(as the WebUI does) and the LoRA files from the WebUI's ``models/Lora`` (its default ``--lora-dir``). Stock
A1111's own pictures show first that each LoRA moves the picture past the comparison bound: a LoRA lost or
applied at another weight would fail it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from ov_accelerate_sd.pnginfo import parse_infotext, read_png_infotext

from .test_real_webui import MIN_PSNR
from .webui import CHECKPOINT_A, WebUI, psnr

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "a red barn in the snow"
KINDS = {"plain": "", "lora": " <lora:ovtest-lora:1>", "locon": " <lora:ovtest-locon:0.8>",
         "loha": " <lora:ovtest-loha:1>", "lokr": " <lora:ovtest-lokr:1>"}


def stock_request(prompt: str, sampler: str) -> dict:
    return {"prompt": prompt, "negative_prompt": "blurry", "seed": 1, "steps": 4, "width": 64, "height": 64,
            "sampler_name": sampler, "cfg_scale": 7, "batch_size": 1, "n_iter": 1}


def test_the_batch_command_with_each_kind_of_lora_gives_stock_a1111s_picture(webui: WebUI, tmp_path: Path) -> None:
    webui.call("/sdapi/v1/options", {"sd_model_checkpoint": CHECKPOINT_A})
    # Euler and the ancestral Euler a (its noise drawn from the seed as the WebUI draws it); each LoRA kind once
    cases = [("plain", "Euler a"), *((kind, "Euler") for kind in KINDS)]
    stock = {}
    for kind, sampler in cases:
        result = webui.generate(stock_request(PROMPT + KINDS[kind], sampler))
        stock[kind, sampler] = (result.images[0], parse_infotext(result.infotexts[0]))
    for kind, sampler in cases:  # each LoRA moves stock's own picture past the bound
        if kind != "plain":
            assert psnr(stock[kind, sampler][0], stock["plain", "Euler"][0]) < MIN_PSNR, (kind, sampler)

    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"prompt": PROMPT + KINDS[kind], "sampler": sampler}) + "\n"
                            for kind, sampler in cases))
    out = tmp_path / "out"
    checkpoint = webui.data_dir / "models" / "Stable-diffusion" / CHECKPOINT_A
    done = subprocess.run(
        [sys.executable, "-m", "ov_backend", "batch", str(jobs), "--checkpoint", str(checkpoint), "--negative-prompt",
         "blurry", "--seed", "1", "--steps", "4", "--width", "64", "--height", "64", "--cfg-scale", "7",
         "--precision", "f32", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)],
        env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout + done.stderr
    files = sorted(out.glob("*.png"))
    assert len(files) == len(cases)
    for (kind, sampler), path in zip(cases, files):
        with Image.open(path) as img:
            ours = np.asarray(img.convert("RGB"), dtype=np.float64)
        picture, info = stock[kind, sampler]
        assert psnr(ours, picture) >= MIN_PSNR, (kind, sampler, psnr(ours, picture))
        mine = parse_infotext(read_png_infotext(path))
        assert mine.get("Lora hashes") == info.get("Lora hashes"), (kind, mine, info)
        assert mine["Model hash"] == info["Model hash"] and mine["Prompt"] == info["Prompt"]
        assert mine["OpenVINO"] == "CPU, UNet+VAE+TE, f32"
