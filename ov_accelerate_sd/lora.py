"""LoRA named in the prompt, applied the way the WebUI's built-in Lora extension (A1111 v1.10.1) does.

Owns: the ``<lora:name:te[:unet[:dyn]]>`` tags (``parse_prompt_loras``), finding a LoRA file by
name in the LoRA folders (``find_lora``), writing the LoRAs of a prompt into the weights of
loaded ``Components`` in place and putting the originals back (``LoraWeights``), and the
"Lora hashes" infotext entry. What a file's tensors change in which module: ``lora_layers``.

Weights are changed in place (``copy_`` into the same tensors, never new Parameters): a part
compiled by ``ov_backend`` sees the change and compiles for the new weights.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import math
import os
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import CheckpointError, load_state_dict
from .loader import Components
from .lora_layers import TEXT_ENCODER, LoraError, LoraTargets, Target, group_layers, layer_delta, layer_kind

logger = logging.getLogger(__name__)

__all__ = ["AppliedLora", "LoraError", "LoraRef", "LoraWeights", "find_lora", "hashes_infotext",
           "lora_files", "parse_prompt_loras", "short_hash", "webui_lora_dirs"]

INFOTEXT_KEY = "Lora hashes"
LORA_SUFFIXES = (".safetensors", ".pt", ".ckpt")
#: Tag names the Lora extension answers to (``lyco`` is its alias).
TAG_NAMES = ("lora", "lyco")
_TAG = re.compile(r"<(\w+):([^>]+)>")  # any extra network; the WebUI removes them all from the prompt
_NOT_IN_INFOTEXT_NAMES = str.maketrans("", "", ":,")
_SHOWN = 8


@dataclass(frozen=True)
class LoraRef:
    """One ``<lora:...>`` tag: which LoRA and how strongly."""

    name: str
    """The file name without its extension, as written in the tag."""
    te_multiplier: float = 1.0
    """Multiplier of the text encoder layers (``lora_te*`` keys)."""
    unet_multiplier: float = 1.0
    """Multiplier of the UNet layers (``lora_unet_*`` keys)."""
    dyn_dim: int | None = None
    """Use only the first ``dyn_dim`` ranks of LoRA layers (None: all)."""


def _number(tag: str, what: str, text: str, kind: type = float) -> float:
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or (kind is int and value < 1):
        right = "a whole number of ranks >= 1" if kind is int else "a finite number"
        raise ValueError(
            f"{tag}: the {what} {text!r} is not {right}; write <lora:name:0.8> (both parts), "
            "<lora:name:0.8:0.5> (text encoder, UNet), <lora:name:1:1:8> (and ranks) or <lora:name:te=0.8:unet=0.5>"
        ) from None
    return value


def _ref(items: list[str], tag: str) -> LoraRef:
    """A1111's ``ExtraNetworkParams`` and ``ExtraNetworkLora.activate`` reading of one tag's items."""
    positional: list[str] = []
    named: dict[str, str] = {}
    for item in items:
        parts = item.split("=", 2)
        if len(parts) == 2:
            named[parts[0]] = parts[1]
        else:
            positional.append(item)
    if not positional or not positional[0]:
        raise ValueError(f"{tag}: no LoRA name; write <lora:name> or <lora:name:0.8>")
    unknown = sorted(set(named) - {"te", "unet", "dyn"})
    if unknown:
        logger.warning("%s: ignored %s (the WebUI reads te=, unet= and dyn=)", tag, ", ".join(unknown))
    te = _number(tag, "multiplier", positional[1]) if len(positional) > 1 else 1.0
    te = _number(tag, "text encoder multiplier", named["te"]) if "te" in named else te
    unet = _number(tag, "UNet multiplier", positional[2]) if len(positional) > 2 else te
    unet = _number(tag, "UNet multiplier", named["unet"]) if "unet" in named else unet
    dyn = int(_number(tag, "rank count", positional[3], int)) if len(positional) > 3 else None
    dyn = int(_number(tag, "rank count", named["dyn"], int)) if "dyn" in named else dyn
    return LoraRef(positional[0], te, unet, dyn)


def parse_prompt_loras(prompt: str) -> tuple[str, list[LoraRef]]:
    """Take the LoRA tags out of a prompt, as the WebUI does before it encodes the prompt.

    Every ``<word:...>`` tag is cut out and nothing else: the text around it stays as it was
    (``"a, <lora:x:1>, b"`` -> ``"a, , b"``). ``lora`` and ``lyco`` tags become refs, grouped as
    A1111 does (all tags of the first-written of the two names first); other extra networks
    (hypernetworks) are dropped with a WARNING. A name given twice is loaded twice, both times
    with the multipliers of its last tag (A1111 keeps one object per name).

    Raises:
        ValueError: a tag without a name, or with a multiplier that is not a number.
    """
    by_name: dict[str, list[tuple[str, list[str]]]] = {}

    def cut(match: re.Match) -> str:
        by_name.setdefault(match.group(1), []).append((match.group(0), match.group(2).split(":")))
        return ""

    text = _TAG.sub(cut, prompt)
    others = [tag for name, tags in by_name.items() if name not in TAG_NAMES for tag, _ in tags]
    if others:
        logger.warning("removed from the prompt as the WebUI does, not applied here: %s", " ".join(others))
    refs = [_ref(items, tag) for name, tags in by_name.items() if name in TAG_NAMES for tag, items in tags]
    last = {ref.name: ref for ref in refs}
    return text, [last[ref.name] for ref in refs]


def _natural(text: str) -> list:
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", text)]


def lora_files(folders: Sequence[str | os.PathLike]) -> dict[str, list[Path]]:
    """Name (file stem) -> the LoRA files of that name under ``folders``, subfolders included.

    Listed in the WebUI's order (folders in turn; in each, folders and files in natural order;
    hidden subfolders skipped); the WebUI uses the last file of a name.
    """
    found: dict[str, list[Path]] = {}
    for folder in map(Path, folders):
        walked = sorted(os.walk(folder, followlinks=True), key=lambda entry: _natural(entry[0]))
        for root, _, files in walked:
            if any(part.startswith(".") for part in Path(root).relative_to(folder).parts):
                continue
            for name in sorted(files, key=_natural):
                path = Path(root, name)
                if path.suffix.lower() in LORA_SUFFIXES:
                    found.setdefault(path.stem, []).append(path)
    return found


def find_lora(name: str, folders: Sequence[str | os.PathLike]) -> Path:
    """The LoRA file named ``name`` (its stem), as the WebUI picks it.

    Raises:
        LoraError: no such file; the message names close and available names and the folders searched.
    """
    files = lora_files(folders)
    if name in files:
        paths = files[name]
        if len(paths) > 1:
            logger.warning("several LoRA files named %r: %s; using the last, as the WebUI does",
                           name, ", ".join(map(str, paths)))
        return paths[-1]
    searched = ", ".join(str(f) + ("" if Path(f).is_dir() else " (missing)") for f in folders) or "no folder"
    names = sorted(files, key=_natural)
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
    shown = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
    available = f"available: {shown}" if names else "no LoRA files there"
    raise LoraError(f"no LoRA named {name!r} ({'/'.join(LORA_SUFFIXES)}, subfolders included) in "
                    f"{searched}{hint}; {available}")


def webui_lora_dirs(checkpoint: str | os.PathLike) -> list[Path]:
    """The LoRA folders of the WebUI a checkpoint lives in (``models/Lora``, and ``models/LyCORIS`` where it
    exists): for ``.../models/Stable-diffusion[/sub]/x.safetensors``; none for a checkpoint kept elsewhere."""
    for folder in Path(checkpoint).absolute().parents:
        if folder.name == "Stable-diffusion":
            return [d for d in (folder.parent / "Lora", folder.parent / "LyCORIS") if d.is_dir()]
    return []


def short_hash(path: str | os.PathLike) -> str:
    """The hash A1111 writes for a LoRA: 12 hex digits of the ``sshs_model_hash`` metadata if given, else
    of the sha256 of the tensor bytes after the header ("addnet" hash) for safetensors, or of the file."""
    path = Path(path)
    digest = hashlib.sha256()
    with path.open("rb") as f:
        if path.suffix.lower() == ".safetensors":
            (header_len,) = struct.unpack("<Q", f.read(8))
            given = (json.loads(f.read(header_len)).get("__metadata__") or {}).get("sshs_model_hash")
            if given:
                return str(given)[:12]
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:12]


def hashes_infotext(names_and_hashes: Iterable[tuple[str, str]]) -> dict[str, str]:
    """``{"Lora hashes": "name: hash, ..."}`` as A1111 writes it (the tag's name without ':' and ','; one
    entry per name), or ``{}``; the infotext writer quotes the value."""
    hashes: dict[str, str] = {}
    for name, digest in names_and_hashes:
        if digest:
            hashes[name.translate(_NOT_IN_INFOTEXT_NAMES)] = digest
    return {INFOTEXT_KEY: ", ".join(f"{k}: {v}" for k, v in hashes.items())} if hashes else {}


@dataclass(frozen=True)
class AppliedLora:
    """A LoRA written into the weights."""

    ref: LoraRef
    path: Path
    short_hash: str
    layers: int
    """Modules it changed."""
    unmatched: tuple[str, ...]
    """Its layers no module of this model answers to (reported, skipped)."""


@dataclass
class _Plan:
    applied: AppliedLora
    layers: list[tuple[Target, dict[str, torch.Tensor]]]
    family_hint: str


def _family_hint(metadata: dict[str, str], keys: Iterable[str]) -> str:
    version = metadata.get("ss_base_model_version", "")
    if version.startswith("sdxl_") or any(k.startswith("lora_te2_") for k in keys):
        return "it looks like an SDXL LoRA"
    if metadata.get("ss_v2") == "True" or version.startswith("sd_v2"):
        return "its metadata says SD 2.x"
    if version.startswith("sd_v1"):
        return "its metadata says SD 1.x"
    return "a LoRA for another model family?"


class LoraWeights:
    """Writes the LoRAs of a prompt into ``components``' weights in place, and puts the originals back.

    Keeps a copy of each weight it changed (and only those). Make a new one when other weights
    are loaded into the modules.
    """

    def __init__(self, components: Components) -> None:
        self.components = components
        self._targets = LoraTargets(components)
        self._originals: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._key: tuple = ()
        self.applied: tuple[AppliedLora, ...] = ()

    def apply(self, refs: Sequence[LoraRef], folders: Sequence[str | os.PathLike]) -> bool:
        """Make the weights ``original + the changes of refs``, in the order given.

        The same refs (and unchanged files) as now are a no-op; otherwise the originals are put
        back first. An error while finding or reading the files leaves the weights as they were;
        one while writing them leaves the model without any LoRA.

        Returns:
            Whether any weight changed.

        Raises:
            LoraError: a file is missing or unreadable, holds a kind we do not apply, or does not
                fit this model (none of its layers matches, or one matches a module of another shape).
        """
        files = [(ref, find_lora(ref.name, folders)) for ref in refs]
        stats = [(ref, path, path.stat()) for ref, path in files]
        key = tuple((ref, str(path), stat.st_mtime_ns, stat.st_size) for ref, path, stat in stats)
        if key == self._key:
            return False
        plans = [self._read(ref, path) for ref, path in files]
        self._put_back()
        self._key, self.applied = (), ()
        written: set[str] = set()
        try:
            for plan in plans:
                self._write(plan, written)
        except BaseException:
            self.restore()
            raise
        for name in set(self._originals) - written:
            del self._originals[name]
        self._key, self.applied = key, tuple(plan.applied for plan in plans)
        for done in self.applied:
            logger.info("LoRA %s (text encoder %g, UNet %g): %d modules", done.ref.name, done.ref.te_multiplier,
                        done.ref.unet_multiplier, done.layers)
        return True

    def restore(self) -> bool:
        """Put every original weight back, bit for bit. Returns whether any weight had been changed."""
        changed = bool(self._originals)
        self._put_back()
        self._originals.clear()
        self._key, self.applied = (), ()
        return changed

    def infotext(self) -> dict[str, str]:
        """The "Lora hashes" entry of the LoRAs applied now (``{}`` for none)."""
        return hashes_infotext((a.ref.name, a.short_hash) for a in self.applied)

    def _put_back(self) -> None:
        with torch.no_grad():
            for tensor, original in self._originals.values():
                tensor.copy_(original)

    def _read(self, ref: LoraRef, path: Path) -> _Plan:
        try:
            state, metadata = load_state_dict(path)
        except CheckpointError as exc:
            raise LoraError(f"LoRA {ref.name!r}: {exc}") from None
        grouped = group_layers(state)
        if grouped.pop("bundle_emb", None) is not None:
            logger.warning("LoRA %s: its bundled embeddings are not loaded here", ref.name)
        merged: dict[str, tuple[Target, dict[str, torch.Tensor]]] = {}
        unmatched, unused = [], 0
        for key, tensors in grouped.items():
            target = self._targets.by_key.get(key)
            if target is None:
                if self._targets.is_unused(key):
                    unused += 1
                else:
                    unmatched.append(key)
                continue
            if layer_kind(tensors) is None:
                raise LoraError(f"LoRA {ref.name!r} ({path}): layer {key} holds {sorted(tensors)}, a kind "
                                "we do not apply (LoRA, LoCon, LoHa, LoKr and full differences are supported)")
            merged.setdefault(target.name, (target, {}))[1].update(tensors)
        qkv: dict[str, int] = {}
        for target, _ in merged.values():
            if target.qkv_set:
                qkv[target.qkv_set] = qkv.get(target.qkv_set, 0) + 1
        partial = sorted(name for name, count in qkv.items() if count < 4)
        if partial:
            logger.warning("LoRA %s: %s lack some of q/k/v/out; skipped, as the WebUI applies these only together",
                           ref.name, ", ".join(partial))
        layers = [(t, w) for t, w in merged.values() if t.qkv_set not in partial]
        hint = _family_hint(metadata, grouped)
        if not layers:
            raise LoraError(f"LoRA {ref.name!r} ({path}) changes nothing in this {self._targets.family} model: "
                            f"none of its {len(grouped)} layers matches a module here (e.g. {unmatched[:3]}); {hint}")
        if unmatched:
            logger.warning("LoRA %s: %d of its %d layers match no module of this %s model and are skipped "
                           "(e.g. %s); %s", ref.name, len(unmatched), len(grouped), self._targets.family,
                           ", ".join(unmatched[:3]), hint)
        if unused:
            logger.debug("LoRA %s: %d layers of text encoder layers the model does not use", ref.name, unused)
        applied = AppliedLora(ref, path, short_hash(path), len(layers), tuple(unmatched))
        return _Plan(applied, layers, hint)

    def _keep(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._originals:
            self._originals[name] = (tensor, tensor.detach().clone())

    def _write(self, plan: _Plan, written: set[str]) -> None:
        ref = plan.applied.ref
        misfits: list[str] = []
        with torch.no_grad():
            for target, tensors in plan.layers:
                multiplier = ref.te_multiplier if target.part == TEXT_ENCODER else ref.unet_multiplier
                weight, bias = target.module.weight, getattr(target.module, "bias", None)
                try:
                    updown, ex_bias = layer_delta(tensors, target.module, weight.float(), multiplier, ref.dyn_dim)
                except RuntimeError as exc:
                    misfits.append(f"{target.name} ({exc})")
                    continue
                if updown.shape != weight.shape or ex_bias is not None and (
                        bias is None or ex_bias.shape != bias.shape):
                    misfits.append(f"{target.name} (weight {tuple(weight.shape)}, change {tuple(updown.shape)})")
                    continue
                self._keep(target.name + ".weight", weight)
                weight.copy_((weight.float() + updown).to(weight.dtype))
                written.add(target.name + ".weight")
                if ex_bias is not None:
                    self._keep(target.name + ".bias", bias)
                    bias.copy_((bias.float() + ex_bias).to(bias.dtype))
                    written.add(target.name + ".bias")
        if misfits:
            raise LoraError(f"LoRA {ref.name!r} ({plan.applied.path}) does not fit this {self._targets.family} "
                            f"model: {len(misfits)} of its layers have other shapes than the modules of the "
                            f"same name, e.g. {'; '.join(misfits[:3])}; {plan.family_hint}")
