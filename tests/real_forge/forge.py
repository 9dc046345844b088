"""Drives a real Forge (Stable Diffusion WebUI Forge, main at dfdcbab6) from its test bed: the real-WebUI tier's
driver (``tests/real_webui/webui.py``) with Forge's venv, launch flags and models.

The bed is built by ``.ci/forge_testbed.py`` (``.ci/testbed`` runs it) into ``$FORGE_ROOT`` (default
``build/forge-testbed`` in the checkout). Each session gets its own data folder (``--data-dir``, which Forge
keeps from A1111: models, extensions, config, outputs), with links to the bed's models, so the bed is never
changed. Forge starts CPU-only and offline as ``/work/shared/forge-host.md`` describes: ``--always-cpu`` and
``--skip-prepare-environment`` (its preparation would pip-install openai's CLIP from GitHub), so the extension's
``install.py`` is run by :meth:`Forge.prepare`, as Forge's preparation would run it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.real_webui.webui import ROOT, WebUI

CHECKPOINT_A = "ovtest-forge-sd15-a.safetensors"
"""SD 1.5 as Forge's huggingface_guess recognises it: full-size CLIP-L and VAE, a small UNet
(``make_models.py``)."""
CHECKPOINT_B = "ovtest-forge-sd15-b.safetensors"
"""The same architecture with other weights (a checkpoint switch)."""
LORA = "ovtest-forge-lora"
"""A kohya LoRA of CHECKPOINT_A's UNet and text encoder (the prompt's ``<lora:ovtest-forge-lora:1>``)."""
SDXL_CHECKPOINT = "ovtest-forge-sdxl.safetensors"
"""SDXL as huggingface_guess recognises it: full-size CLIP-L, OpenCLIP-bigG and VAE, SDXL's input side of the
UNet at 320 channels (``make_models_sdxl.py``); its approximate VAE for live previews is in the bed too."""
SDXL_REFINER = "ovtest-forge-sdxl-refiner.safetensors"
"""SDXL's refiner as huggingface_guess recognises it: full-size OpenCLIP-bigG alone and the VAE, a UNet at 384 channels
(``make_models_sdxl.py``)."""
SD2_CHECKPOINT = "ovtest-forge-sd2-v.safetensors"
"""SD 2.x with v-prediction (its ``.yaml`` beside it says so): full-size OpenCLIP-H and VAE, a small UNet
(``make_models_sd2.py``)."""
FULL_CHECKPOINT = "sd15-random.safetensors"
"""The A1111 bed's full-size random SD 1.5, linked into Forge's bed when that bed has it (slow: minutes to
convert to OpenVINO on 2 cores)."""
MODELS = (f"Stable-diffusion/{CHECKPOINT_A}", f"Stable-diffusion/{CHECKPOINT_B}", f"Lora/{LORA}.safetensors",
          f"Stable-diffusion/{SDXL_CHECKPOINT}", f"Stable-diffusion/{SDXL_REFINER}",
          f"Stable-diffusion/{SD2_CHECKPOINT}", "Stable-diffusion/ovtest-forge-sd2-v.yaml",
          "VAE-approx/vaeapprox-sdxl.pt")
SECTION_NAME = "openvino"
"""The extension's AlwaysVisible section as ``/sdapi/v1/scripts`` lists it (its title, lower-case)."""
LAUNCH_FLAGS = (
    "--always-cpu",
    "--skip-prepare-environment",
    "--skip-python-version-check",
    "--skip-version-check",
    "--skip-torch-cuda-test",
    "--api",
)


def forge_testbed_root() -> Path:
    return Path(os.environ.get("FORGE_ROOT") or ROOT / "build" / "forge-testbed")


def forge_testbed_ready(root: Path) -> bool:
    return (
        (root / "webui" / "launch.py").is_file()
        and (root / "venv" / "bin" / "python").is_file()
        and all((root / "webui" / "models" / name).is_file() for name in MODELS)
    )


class Forge(WebUI):
    """One Forge data folder that can be started (API only, or with its UI: ``ui=True``), restarted and stopped."""

    launch_flags = LAUNCH_FLAGS
    started_marker = "Startup time:"  # printed in both modes once the API's routes and callbacks are in place
    requirements_file = "requirements-forge.txt"
    name = "Forge"

    def __init__(self, testbed: Path, data_dir: Path, log_dir: Path, ui: bool = False) -> None:
        super().__init__(testbed, data_dir, log_dir)
        self.checkpoint = CHECKPOINT_A
        # With its UI, Forge's gradio 4 serves page files only from its allowed paths, which default to the data
        # folder: with a --data-dir of its own, Forge's page scripts (script.js, javascript/) would get 403 and the
        # page would lack onUiLoaded, paste-back, ... A Forge run from its own folder allows that folder.
        self.extra_flags = ["--gradio-allowed-path", str(self.webui)] if ui else ["--nowebui"]

    def prepare(self, extra_extensions: list[Path], tiny_models: bool = True) -> None:
        """The bed's models linked into the data folder, the extension cloned into extensions/ as a user does,
        ``extra_extensions`` copied there, and the extension's installer run (Forge's own preparation, which
        would run it, is skipped)."""
        super().prepare(extra_extensions, tiny_models)
        self.run_installer()

    def prepare_models(self, tiny_models: bool = True) -> None:
        """Links to every checkpoint, LoRA, approximate VAE and ControlNet of the bed (the tier's, and the A1111
        bed's full-size checkpoint and ControlNet when it has them) in the data folder's models/; Forge only reads
        them."""
        bed_models = self.webui / "models"
        for kind in ("Stable-diffusion", "Lora", "VAE-approx", "ControlNet"):
            folder = self.data_dir / "models" / kind
            folder.mkdir(parents=True, exist_ok=True)
            for model in sorted((bed_models / kind).iterdir()) if (bed_models / kind).is_dir() else ():
                if model.suffix not in (".safetensors", ".pt"):
                    continue
                link = folder / model.name
                if model.exists() and not link.exists():
                    link.symlink_to(model.resolve())


# The parts of Forge's model the extension routes, as the start of their labels in the status's ``calls`` (the
# Forge host names them by their path from ForgeObjects: "unet.model.diffusion_model", "vae.first_stage_model.decoder",
# "clip.cond_stage_model.clip_l.transformer.text_model.encoder").
PART_LABELS = {"UNet": "unet.model.diffusion_model", "VAE": "vae.first_stage_model", "TE": "clip.cond_stage_model"}


def assert_accelerated(status: dict[str, Any], parts: tuple[str, ...] = ("UNet", "VAE", "TE")) -> None:
    """What a generation through the extension on Forge must show once the Forge host exists (not asserted by any
    test yet): the status says accelerated, nothing ran in PyTorch or fell back, OpenVINO was called, and each
    part in ``parts`` was called through OpenVINO. The same checks as the A1111 tier's
    ``assert_ran_in_openvino``. Forge, like A1111, reuses the previous request's conditioning when its cache key
    (``processing.cached_params``: prompts, steps, checkpoint, ``sdxl_crop_top``, size, ...) is unchanged, and then
    never calls the text encoder: give each request its own ``override_settings={"sdxl_crop_top": n}`` (as
    tests/real_webui does), or leave "TE" out of ``parts``. Seen to pass on the Forge host in the work tree of
    2026-11-29 (SD 1.5 checkpoint, default arguments: 42.9 dB against stock, 0.4 s a picture once compiled)."""
    assert status["accelerated"], status["status"]
    assert status["eager_calls"] == 0 and not status["eager"] and not status["fallback_ops"], status["status"]
    assert status["ov_calls"] > 0, status["status"]
    called = [label for label, n in status["calls"].items() if n > 0]
    for part in parts:
        assert any(label.startswith(PART_LABELS[part]) for label in called), (
            f"{part} was not called through OpenVINO: {status['calls']}")
