"""Builds the Forge test bed: Stable Diffusion WebUI Forge (main at dfdcbab6), CPU only, offline, for tests/real_forge.

Usage (``bash .ci/testbed`` runs it after the A1111 bed, with the defaults below; any python3 >= 3.9 runs it)::

    FORGE_ROOT=build/forge-testbed [FORGE_SRC=<archive | folder>] [A1111_ROOT=build/a1111-testbed] \\
        python3 .ci/forge_testbed.py

What ends up in ``$FORGE_ROOT`` (what tests/real_forge/forge.py uses):

  webui/          Forge's code with repositories/ at the commits its launch_utils.py pins (each with a .git whose
                  HEAD is that commit, as in the A1111 bed), and in models/ the tier's checkpoints and LoRA
                  (tests/real_forge/make_models.py: SD 1.5 as Forge's huggingface_guess recognises it, full-size
                  CLIP-L and VAE, a UNet of a twentieth of SD 1.5's size; make_models_sdxl.py: SDXL likewise, with
                  full-size CLIP-L and OpenCLIP-bigG, 2.1 GB, its refiner with bigG alone, and a random SDXL
                  approximate VAE for live previews; make_models_sd2.py: SD 2.x, v-prediction, full-size OpenCLIP-H)
                  and a link to the A1111 bed's full-size random SD 1.5 checkpoint when that bed has one
  venv/           Python 3.10 or 3.11 (``FORGE_PYTHON``, default python3.11): torch 2.13.0+cpu, torchvision 0.28.0,
                  every pin of Forge's requirements_versions.txt (setuptools aside, and its bare ``torch`` line
                  dropped: REQUIREMENTS), sentencepiece and joblib (imported by Forge, missing from that file)
  tvstub/         a link to the A1111 bed's stand-ins for the CUDA libraries torchvision links (same torch, same
                  torchvision) when they load here, else built here the same way
  hf-home/        an empty offline Hugging Face cache (HF_HOME): Forge reads the configs and tokenizers of the
                  model families from its own backend/huggingface/, so nothing is cached; ``hub/version.txt``
                  keeps transformers from warning that an offline cache needs migrating
  requirements-forge.txt   the requirements as installed
  constraints.txt          the pins every install here runs under (nothing moves torch)

Forge starts from it with ``launch.py --always-cpu --skip-prepare-environment ...`` (tests/real_forge/forge.py):
its own preparation would pip-install openai's CLIP from GitHub. Where Forge comes from: ``FORGE_SRC`` (a tar
archive, e.g. the workplace's forge-dfdcbab6-src.tar.xz, or a folder), otherwise git at FORGE_COMMIT with each
repository from the URL and commit its launch_utils.py names. Every step first checks its result (a built bed is
checked in about 15 s); start over with ``rm -rf "$FORGE_ROOT"``.

Exit status: 0 built and checked; 1 a build step failed; 75 no ``FORGE_SRC`` and GitHub cannot be reached
(nothing was built; ``.ci/testbed`` turns this into a warning and the tier skips).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import build_testbed as a1111  # noqa: E402 (the A1111 bed's builder, beside this file)
from build_testbed import BuildError, Source, SourceUnavailable, say, write_if_changed  # noqa: E402

FORGE_REPO = "https://github.com/lllyasviel/stable-diffusion-webui-forge.git"
FORGE_COMMIT = "dfdcbab685e57677014f05a3309b48cc87383167"  # main, 2025-06-26, "Fix SD upscale Batch count"
# what that commit's modules/launch_utils.py pins (a source whose pins differ is another Forge)
FORGE_PINS = {
    "stable-diffusion-webui-assets": "6f7db241d2f8ba7457bac5ca9753331f0c266917",
    "huggingface_guess": "84826248b49bb7ca754c73293299c4d4e23a548d",
    "BLIP": "48211a1594f1321b00f14c9f7a5b4813144b2fb9",
}
REQUIREMENTS = "requirements-forge.txt"
EXTRA_REQUIREMENTS = ("sentencepiece", "joblib")  # imported by Forge, not in its requirements_versions.txt
# recipe -> the files it writes into webui/models
MODEL_RECIPES = {
    "tests/real_forge/make_models.py": ("Stable-diffusion/ovtest-forge-sd15-a.safetensors",
                                        "Stable-diffusion/ovtest-forge-sd15-b.safetensors",
                                        "Lora/ovtest-forge-lora.safetensors"),
    "tests/real_forge/make_models_sdxl.py": ("Stable-diffusion/ovtest-forge-sdxl.safetensors",
                                             "Stable-diffusion/ovtest-forge-sdxl-refiner.safetensors",
                                             "VAE-approx/vaeapprox-sdxl.pt"),
    "tests/real_forge/make_models_sd2.py": ("Stable-diffusion/ovtest-forge-sd2-v.safetensors",
                                            "Stable-diffusion/ovtest-forge-sd2-v.yaml"),
}
#: The A1111 bed's models Forge's tier uses too (linked, not built twice): its full-size random SD 1.5, and the random
#: ControlNet for it (Forge's integrated ControlNet reads the same files).
SHARED_MODELS = ("Stable-diffusion/sd15-random.safetensors", "ControlNet/ovtest-controlnet-sd15.safetensors")


class ForgeBed(a1111.TestBed):
    label = "Forge"
    python_variable = "FORGE_PYTHON"

    def __init__(self, root: Path, a1111_root: Path) -> None:
        super().__init__(root)
        self.requirements = root / REQUIREMENTS
        self.a1111 = a1111_root

    # --- 1. Forge's source and its repositories ------------------------------------------------------
    def forge_source(self) -> None:
        self.stage(Source("FORGE_SRC", "Forge source", "backend/loader.py", FORGE_REPO, FORGE_COMMIT, FORGE_COMMIT[:8],
                          check_forge_source, ignore=("venv", "__pycache__"), needs_reachable=True), self.webui)

    # --- 2. requirements file ------------------------------------------------------------------------
    def requirements_file(self) -> None:
        text = (self.webui / "requirements_versions.txt").read_text(encoding="utf-8")
        text, count = re.subn(r"(?m)^setuptools==.*$",
                              f"setuptools=={a1111.SETUPTOOLS}  # test bed: torch {a1111.TORCH} needs >=77.0.3", text)
        if count != 1:
            raise BuildError("Forge's requirements_versions.txt: no setuptools pin to replace")
        text, count = re.subn(r"(?m)^torch\s*\n", "", text)  # installed first, from the CPU wheel
        if count != 1:
            raise BuildError("Forge's requirements_versions.txt: no bare torch line to drop")
        write_if_changed(self.requirements, text)

    # --- 3. torchvision's CUDA stand-ins: the A1111 bed's when they serve ----------------------------
    def torchvision_stubs(self) -> None:
        check = Path(a1111.__file__).resolve(), "worker", "torchvision-loads"
        theirs = self.a1111 / "tvstub"
        if not self.tvstub.exists() and not self.tvstub.is_symlink() and theirs.is_dir():
            self.tvstub.symlink_to(theirs, target_is_directory=True)
        if self.succeeds(*check):
            return
        if self.tvstub.is_symlink():  # the A1111 bed's do not serve (or are gone): build our own, never into theirs
            say(f"tvstub/: {theirs} does not load torchvision here; building them here")
            self.tvstub.unlink()
        super().torchvision_stubs()

    # --- 4. Forge's requirements ----------------------------------------------------------------------
    def webui_requirements(self) -> None:
        have = self.versions(*EXTRA_REQUIREMENTS)
        if not self.requirements_met() or None in have.values():
            say(f"Forge's requirements ({self.requirements.name}) and {', '.join(EXTRA_REQUIREMENTS)} "
                f"under {self.constraints.name}")
            self.pip_install("--prefer-binary", "-r", self.requirements, *EXTRA_REQUIREMENTS, "-c", self.constraints)
            self.check_installed("Forge's requirements")
        self.worker("torchvision-works")

    # --- 5. an offline Hugging Face cache with nothing in it -------------------------------------------
    def hf_cache(self) -> None:
        (self.hf_home / "hub").mkdir(parents=True, exist_ok=True)
        write_if_changed(self.hf_home / "hub" / "version.txt", "1")

    # --- 6. the tier's checkpoints and LoRA, and the A1111 bed's full-size one --------------------------
    def checkpoints(self) -> None:
        models = self.webui / "models"
        for recipe, files in MODEL_RECIPES.items():
            if not all((models / name).is_file() for name in files):
                say(f"models/: {', '.join(Path(name).name for name in files)} (random weights, Forge's classes)")
                self.py(Path(a1111.__file__).resolve().parents[1] / recipe, self.webui, models, cwd=self.webui,
                        PYTHONWARNINGS="ignore")
        for name in SHARED_MODELS:
            link, theirs = models / name, self.a1111 / "webui" / "models" / name
            if link.is_symlink() and not link.exists():
                link.unlink()  # the A1111 bed was removed
            if theirs.is_file() and not link.exists():
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(theirs)

    def build(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.forge_source()
        self.repositories()
        self.requirements_file()
        self.python_and_torch()
        self.torchvision_stubs()
        self.webui_requirements()
        self.hf_cache()
        self.checkpoints()


def check_forge_source(folder: Path) -> None:
    """Forge (its backend/ and modules_forge/) pinning the repositories FORGE_COMMIT pins; at FORGE_COMMIT when it
    is a git checkout."""
    if not (folder / "modules_forge").is_dir():
        raise BuildError(f"{folder} has backend/loader.py but no modules_forge/: not Forge")
    pins = {pin.name: pin.commit for pin in a1111.pinned_repositories(folder / "modules" / "launch_utils.py")}
    if pins != FORGE_PINS:
        raise BuildError(f"{folder} pins {pins}, not Forge {FORGE_COMMIT[:8]}'s {FORGE_PINS}")
    head = a1111.git_head(folder)
    if head is not None and head != FORGE_COMMIT:
        raise BuildError(f"{folder} is a git checkout at {head}, not {FORGE_COMMIT}")


def main() -> int:
    root = os.environ.get("FORGE_ROOT")
    if not root:
        sys.stderr.write("set FORGE_ROOT to the folder to build the Forge test bed in (bash .ci/testbed does)\n")
        return 1
    here = Path(__file__).resolve().parents[1]
    a1111_root = Path(os.environ.get("A1111_ROOT") or here / "build" / "a1111-testbed").expanduser().resolve()
    bed = ForgeBed(Path(root).expanduser().resolve(), a1111_root)
    try:
        bed.build()
    except SourceUnavailable as e:
        sys.stderr.write(f"no Forge source: {e}\n")
        return a1111.SOURCE_UNAVAILABLE
    except BuildError as e:
        sys.stderr.write(f"ERROR: the Forge test bed in {bed.root} is not usable: {e}\n")
        return 1
    say(f"Forge test bed ready in {bed.root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
