"""Reading WebUI single-file checkpoints safely and telling which model family they hold.

Owns: opening ``.safetensors`` (header checked first, so a truncated or foreign file gets a
clear message) and ``.ckpt``/``.pt`` (only through ``torch.load(weights_only=True)``), the
family detection from the key layout (SD 1.x, SD 2.x, SDXL base), and the file hash the
WebUI shows as "Model hash". Every error names the file and the reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

logger = logging.getLogger(__name__)

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
_UNET_PROBE = UNET_PREFIX + "input_blocks.0.0.weight"
SUPPORTED_FAMILIES = ("sd1", "sd2", "sdxl")
METADATA_CONFIG_KEY = "ov_accelerate_sd.configs"


class CheckpointError(ValueError):
    """A file that cannot be loaded as a supported Stable Diffusion checkpoint."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: its tensors, its family and the metadata stored with it."""

    path: str
    state_dict: dict[str, torch.Tensor]
    family: str
    """One of ``SUPPORTED_FAMILIES``."""
    prediction_type: str | None
    """"v_prediction" when the file says so (a ``v_pred`` key), else None (decided later)."""
    metadata: dict[str, str]
    """The safetensors metadata (empty for pickles)."""


def safetensors_header(path: Path) -> tuple[dict[str, str], dict[str, dict]]:
    """(metadata, tensor name -> {"dtype", "shape", "data_offsets"}) of a safetensors file, checked."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(path, f"not a safetensors file (only {size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > 100_000_000 or header_len < 2:
            raise CheckpointError(
                path, "not a safetensors file (no valid header; is it a pickle or an image?)"
            )
        if 8 + header_len > size:
            raise CheckpointError(path, f"truncated: header needs {header_len} bytes, file has {size}")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(path, f"not a safetensors file (header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, "not a safetensors file (header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    end = max((int(v["data_offsets"][1]) for v in header.values() if isinstance(v, dict)), default=0)
    if 8 + header_len + end > size:
        raise CheckpointError(
            path, f"truncated: the tensors need {8 + header_len + end} bytes, the file has {size}"
        )
    tensors = {str(k): v for k, v in header.items() if isinstance(v, dict)}
    return {str(k): str(v) for k, v in metadata.items()}, tensors


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            path,
            "refused: this pickle needs more than plain tensors to load (torch.load weights_only=True "
            f"said: {first}); convert it to .safetensors with a tool you trust",
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(path, f"truncated or not a PyTorch checkpoint ({exc})") from None
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise CheckpointError(path, f"not a checkpoint: holds a {type(obj).__name__}, not a dict of tensors")
    return {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}


def load_state_dict(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read the tensors of a ``.safetensors``, ``.ckpt`` or ``.pt`` file onto the CPU.

    Returns:
        (state dict, safetensors metadata or an empty dict).

    Raises:
        CheckpointError: missing, not safetensors, truncated, or a pickle needing code to load.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(path, "no such file")
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        metadata = safetensors_header(path)[0]
        try:
            return load_file(str(path), device="cpu"), metadata
        except Exception as exc:  # safetensors raises its own error type for damaged files
            raise CheckpointError(path, f"damaged safetensors file ({exc})") from None
    if suffix in (".ckpt", ".pt", ".pth", ".bin"):
        return _load_pickle(path), {}
    raise CheckpointError(path, f"unsupported file type {suffix!r}; expected .safetensors or .ckpt")


def detect_family(path: str | os.PathLike, state_dict: dict[str, torch.Tensor]) -> str:
    """Tell the model family from the key layout.

    Raises:
        CheckpointError: no UNet keys, or a family we do not support (named).
    """
    if _UNET_PROBE not in state_dict:
        if any(k.startswith(("down_blocks.", "unet.", "lora_", "encoder.", "decoder.")) for k in state_dict):
            hint = " (it looks like a diffusers component, a LoRA or a VAE, not a full WebUI checkpoint)"
        else:
            hint = ""
        raise CheckpointError(
            path, f"no UNet keys ({_UNET_PROBE!r} missing): not a Stable Diffusion checkpoint{hint}"
        )
    in_channels = state_dict[_UNET_PROBE].shape[1]
    if in_channels != 4:
        raise CheckpointError(
            path, f"unsupported family: UNet takes {in_channels} input channels (inpainting or "
            "instruct-pix2pix models); supported: SD 1.x, SD 2.x, SDXL base"
        )
    if "conditioner.embedders.1.model.ln_final.weight" in state_dict:
        return "sdxl"
    if any(k.startswith("conditioner.embedders.0.model.") for k in state_dict):
        raise CheckpointError(path, "unsupported family: SDXL refiner; supported: SD 1.x, SD 2.x, SDXL base")
    if "cond_stage_model.model.ln_final.weight" in state_dict:
        return "sd2"
    if any(k.startswith("cond_stage_model.transformer.") for k in state_dict):
        return "sd1"
    if any(k.startswith("cond_stage_model.") for k in state_dict):
        raise CheckpointError(
            path, "unsupported family: unknown text encoder layout under 'cond_stage_model.'"
        )
    raise CheckpointError(
        path, "unsupported family: no text encoder keys (SD 1.x, SD 2.x, SDXL base expected)"
    )


class _Shape:
    """A tensor's shape as a safetensors header gives it, for :func:`detect_family` without the tensors."""

    def __init__(self, shape: list[int]) -> None:
        self.shape = tuple(int(n) for n in shape)


def check_checkpoint_file(path: str | os.PathLike) -> str | None:
    """Check a checkpoint file without loading its tensors: its family for a ``.safetensors`` file (from the
    header), None for a pickle (only loading it tells).

    Raises:
        CheckpointError: missing, of another file type, damaged, or not a supported family.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(path, "no such file")
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        _, tensors = safetensors_header(path)
        return detect_family(path, {k: _Shape(v.get("shape", [])) for k, v in tensors.items()})  # type: ignore[misc]
    if suffix in (".ckpt", ".pt", ".pth", ".bin"):
        return None
    raise CheckpointError(path, f"unsupported file type {suffix!r}; expected .safetensors or .ckpt")


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Load a WebUI single-file checkpoint and detect its family.

    Raises:
        CheckpointError: see ``load_state_dict`` and ``detect_family``.
    """
    state_dict, metadata = load_state_dict(path)
    family = detect_family(path, state_dict)
    prediction = "v_prediction" if "v_pred" in state_dict else None
    logger.info("loaded %s: family %s, %d tensors", path, family, len(state_dict))
    return Checkpoint(str(path), state_dict, family, prediction, metadata)


def file_hash(path: str | os.PathLike) -> str:
    """The WebUI's "Model hash": the first 10 hex digits of the file's sha256."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:10]
