"""What differs between the WebUIs the adapter runs in, behind one small interface.

AUTOMATIC1111 v1.10.1 and Forge keep the same front end (scripts, hooks, infotext, the HTTP API) over different
model code. The shared adapter code asks a :class:`Host` where the parts of the loaded model are, how the UNet is
put on the route for a sampling call, which attention the routed UNet runs, and how its checkpoint load is wrapped
to write the weights into the weight file; it never asks which WebUI it is in. :func:`detect` picks the
implementation from what the WebUI has imported (:func:`.host.is_forge`).

- :class:`A1111Host`: the LDM/sgm model of A1111 (:mod:`.model_parts`); every part is routed for the whole
  generation, the UNet's attention is A1111's "sdp" while routed (:mod:`.attention`), and the checkpoint load
  writes the weights into the weight file (:mod:`.weights_at_load`).
- :class:`.forge.ForgeHost`: Forge's ``forge_objects``; the UNet is routed for each sampling call by a function
  wrapper on a clone of Forge's UnetPatcher, set again before every sampling (each batch, the hires pass,
  img2img); the checkpoint load writes the weights into the weight file part by part (:mod:`.forge_load`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from . import host
from .attention import FusedAttention
from .model_parts import Target, find_targets
from .routing import Route

logger = logging.getLogger(__name__)


class Attention(Protocol):
    """A context manager that gives the routed UNet one fused attention for a generation."""

    replaced: str | None
    """The name of the attention replaced for the generation (None: nothing was), for the status."""

    def __enter__(self) -> Attention: ...

    def __exit__(self, *exc: object) -> None: ...

    def ensure(self) -> None:
        """Put the fused attention back where a model load inside the generation replaced it."""


class Host(Protocol):
    """The WebUI the adapter runs in, as far as the shared code needs to know it."""

    name: str
    """What the user calls it, for messages: "AUTOMATIC1111", "Forge"."""

    def find_targets(self, model: Any, parts: tuple[str, ...]) -> list[Target]:
        """The modules to route for ``parts`` of ``model``. Raises ``model_parts.UnsupportedModel``."""

    def stand_in(self, model: Any) -> bool:
        """Whether ``model`` only stands in for the checkpoint the WebUI loads inside ``process_images`` (Forge,
        lazily, on the first generation): the generation then routes the model loaded there."""

    def attention(self, parts: tuple[str, ...]) -> Attention:
        """The fused attention of the routed ``parts`` during one generation."""

    def route_for_sampling(self, p: Any, routes: Sequence[Route]) -> str:
        """Before a sampling (each batch, the hires pass): put ``routes`` (those of targets marked ``per_call``)
        on the host's own patch point for ``p``'s sampling. Returns why they could not be ("" when they were, or
        when there is nothing to do)."""

    def install_load_hook(self, extension: Any) -> Callable[[], None] | None:
        """Wrap the WebUI's checkpoint load so that, while acceleration is in use, the routed parts' weights go from
        the checkpoint file straight into the weight file (in Forge, its LoRA merge's weights too). Returns what takes
        the wrappers out again (None: the WebUI's loader is not there)."""


class A1111Host:
    """AUTOMATIC1111 WebUI v1.10.1."""

    name = "AUTOMATIC1111"

    def find_targets(self, model: Any, parts: tuple[str, ...]) -> list[Target]:
        return find_targets(model, parts)

    def stand_in(self, model: Any) -> bool:
        return False  # A1111 loads a checkpoint as it starts and when the user picks one, before the request

    def attention(self, parts: tuple[str, ...]) -> Attention:
        return FusedAttention() if "unet" in parts else NoAttention()

    def route_for_sampling(self, p: Any, routes: Sequence[Route]) -> str:
        return ""  # every route stays for the whole generation: no target is per call

    def install_load_hook(self, extension: Any) -> Callable[[], None] | None:
        from .weights_at_load import install

        return install(extension)


class NoAttention(contextlib.AbstractContextManager):
    """Nothing to replace: the host's attention is one fused call already."""

    replaced: str | None = None

    def __exit__(self, *exc: object) -> None:
        return None

    def ensure(self) -> None:
        return None


def detect() -> Host:
    """The host the adapter runs in now: Forge when the WebUI loaded Forge's ``modules_forge``, else A1111."""
    if host.is_forge():
        from .forge import ForgeHost

        return ForgeHost()
    return A1111Host()
