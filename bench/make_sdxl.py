"""Makes the bench's full-size random SDXL base checkpoint (``python -m bench webui --model sdxl``).

Run in the test bed's Python from its ``webui/`` folder (the bench does, once)::

    python bench/make_sdxl.py OUT.safetensors SEED

The model is the WebUI's own: sgm's ``DiffusionEngine`` built from the config the WebUI itself picks for an
SDXL base checkpoint (``repositories/generative-models/configs/inference/sd_xl_base.yaml``), at full size
(a UNet of 2.57 billion parameters, CLIP ViT-L and OpenCLIP ViT-bigG text encoders, the SDXL VAE), with random
weights made non-degenerate and checked by the real-WebUI tier's recipe
(``tests/real_webui/make_models_sdxl_sd2.random_model``). Saved in fp16, as SDXL checkpoints are published,
with no ``.yaml`` beside it: the WebUI recognises it from its keys as it would a downloaded one.

Only the text tower of OpenCLIP ViT-bigG is in an SDXL checkpoint (sgm deletes the vision tower): it is built
from an architecture of bigG's text tower and a one-layer vision tower, so the 1.8 billion random vision
parameters sgm would delete are never drawn. The model is made at f32 (about 14 GB) and halved in place.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

RECIPE = Path(__file__).resolve().parents[1] / "tests" / "real_webui"
BIGG = "ViT-bigG-14"
TEXT_ONLY_ARCH = "ovbench-bigG-text"


def register_text_only_bigg(folder: Path) -> None:
    """An open_clip architecture with bigG's text tower and embedding size, and a token vision tower."""
    import open_clip

    bigg = open_clip.get_model_config(BIGG)
    if bigg is None:
        raise SystemExit(f"open_clip has no {BIGG} architecture: the WebUI's SDXL config needs it")
    config = {**bigg, "vision_cfg": {"image_size": 28, "layers": 1, "width": 64, "head_width": 32,
                                     "patch_size": 14}}
    (folder / f"{TEXT_ONLY_ARCH}.json").write_text(json.dumps(config), encoding="utf-8")
    open_clip.add_model_config(folder)


def sdxl_base_config() -> dict:
    """The WebUI's SDXL base config, its OpenCLIP embedder built without pretrained weights (none offline)."""
    from omegaconf import OmegaConf

    path = os.path.join("repositories", "generative-models", "configs", "inference", "sd_xl_base.yaml")
    config = OmegaConf.to_container(OmegaConf.load(path))
    embedders = config["model"]["params"]["conditioner_config"]["params"]["emb_models"]
    bigg = [e for e in embedders if e["target"].endswith(".FrozenOpenCLIPEmbedder2")]
    if len(bigg) != 1 or bigg[0]["params"]["arch"] != BIGG:
        raise SystemExit(f"{path}: expected one FrozenOpenCLIPEmbedder2 of {BIGG}, got {bigg}")
    bigg[0]["params"].update(arch=TEXT_ONLY_ARCH, version=None)
    return config


def main(out: str, seed: str) -> None:
    from safetensors.torch import save_file

    sys.path[:0] = [str(RECIPE)]
    import make_models
    import make_models_sdxl_sd2

    make_models.use_webui_ldm(".")
    sys.path.append(os.path.join("repositories", "generative-models"))
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        register_text_only_bigg(Path(folder))
        model = make_models_sdxl_sd2.random_model(sdxl_base_config(), int(seed))
    model.half()  # in place, tensor by tensor: the f32 model is never held twice
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    unet = sum(v.numel() for k, v in state.items() if k.startswith("model.diffusion_model."))
    save_file(state, out + ".part")
    os.replace(out + ".part", out)
    print(f"wrote {out}: {len(state)} tensors, UNet {unet / 1e9:.2f} billion parameters, "  # noqa: T201
          f"{os.path.getsize(out) / (1 << 30):.2f} GiB, in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main(*sys.argv[1:3])
