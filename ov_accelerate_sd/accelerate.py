"""Routing the parts of a pipeline through ov_backend, and undoing it.

Owns: which callable of each part is compiled (the UNet's forward, the VAE's encoder and
decoder forwards, each text encoder's forward: every replacement keeps the call signature of
what it replaces, so diffusers' sampling loop runs unchanged), the ``OVBackend`` instance that
holds the compiled models, and ``restore()``. Parts not listed in ``SDSettings.accelerate``
stay in PyTorch.

At INT8 precision only the UNet is quantized (its first calls run at float and are recorded for
calibration, :meth:`Accelerator.calibrate` quantizes on what was recorded); the VAE and text encoders
run at the float default, as measured: they are a small part of a generation's time.

Each part's forward is an ``ov_backend.CompiledMethod`` (the object the WebUI adapter routes with too:
torch.compile, the captures saved in the disk cache, the check of each call): a call dynamo ran without
any compiled graph (it gave up on the function, e.g. at its recompile limit) is counted with the reason,
and :meth:`Accelerator.eager_report` says so.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from .loader import Components
from .parts import VARYING_DIMS
from .settings import SDSettings

if TYPE_CHECKING:
    from ov_backend import EagerCalls

logger = logging.getLogger(__name__)



class Accelerator:
    """Compiles the chosen parts of ``components`` with one ``OVBackend``.

    Args:
        components: the loaded modules (changed in place: their ``forward`` is replaced).
        settings: SD-layer settings; mapped to backend settings here.
        backend: an existing ``OVBackend`` to use instead of building one.
    """

    def __init__(self, components: Components, settings: SDSettings, backend: Any = None) -> None:
        self.components = components
        self.settings = settings
        self.backend = backend
        self._originals: list[tuple[torch.nn.Module, Any]] = []
        self._calls: EagerCalls | None = None

    def targets(self) -> list[tuple[str, torch.nn.Module]]:
        """(part, module) pairs whose ``forward`` gets compiled under the current settings."""
        found: list[tuple[str, torch.nn.Module]] = []
        if "unet" in self.settings.accelerate:
            found.append(("unet", self.components.unet))
        if "vae" in self.settings.accelerate:
            found += [("vae", self.components.vae.decoder), ("vae", self.components.vae.encoder)]
        if "text_encoder" in self.settings.accelerate:
            found += [("text_encoder", m) for m in self.components.text_encoders]
        return found

    def apply(self) -> Accelerator:
        """Compile the chosen parts (lazily: OpenVINO converts on the first call of each shape)."""
        if self._originals:
            return self
        from ov_backend import DEFAULT_PRECISION, QUANTIZED_PRECISIONS, CompiledMethod, EagerCalls, GraphRunCounter

        quantized = self.settings.precision in QUANTIZED_PRECISIONS
        if self.backend is None:
            from ov_backend import OVBackend, build_settings

            options = self.settings.to_backend_options()
            if quantized:  # INT8 is for the UNet: the VAE and text encoders run at the float default
                options["precision"] = DEFAULT_PRECISION
            self.backend = OVBackend(build_settings(options))
        counter = GraphRunCounter(self.backend)
        unet_counter = counter
        if quantized and self.backend.settings.precision != self.settings.precision:
            unet_counter = GraphRunCounter(self.backend.derived(self.settings.precision))
        self._calls = EagerCalls()
        for part, module in self.targets():
            original = module.__dict__.get("forward")
            method = CompiledMethod(module.forward, unet_counter if part == "unet" else counter, VARYING_DIMS,
                                    code=getattr(type(module).forward, "__code__", None))
            module.forward = self._calls.watch(part, method)
            self._originals.append((module, original))
            logger.info("%s (%s) routed through ov_backend on %s", part, type(module).__name__,
                        self.settings.device)
        return self

    def restore(self) -> None:
        """Put the PyTorch forwards back and drop the compiled models."""
        for module, original in reversed(self._originals):
            if original is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = original
        self._originals.clear()
        if self.backend is not None:
            self.backend.reset()
        torch._dynamo.reset()

    def calibrate(self) -> int:
        """At INT8 precision: quantize the UNet now on the calls recorded so far (the end of the first batch);
        returns how many models were quantized (0 when there was nothing to quantize)."""
        return self.backend.calibrate() if self.backend is not None and self._originals else 0

    def eager_report(self) -> str | None:
        """Which parts' calls dynamo ran in plain PyTorch and why, or None if every call was compiled."""
        return self._calls.report() if self._calls is not None else None

    def stats(self) -> dict[str, float]:
        """The backend's counters (compile_seconds, run_seconds, ...), empty when not applied."""
        return dict(self.backend.stats()) if self.backend is not None else {}
