"""Routing the parts of a pipeline through ov_backend, and undoing it.

Owns: which callable of each part is compiled (the UNet's forward, the VAE's encoder and
decoder forwards and the 1x1 convolutions beside them, each text encoder's forward: every
replacement keeps the call signature of what it replaces, so diffusers' sampling loop runs
unchanged), the backends that hold the compiled models (:class:`~.backends.Backends`: at INT8,
the UNet's and the float one of the other parts), and ``restore()``. Parts not listed in
``SDSettings.accelerate`` stay in PyTorch.

With step caching on (``SDSettings.step_cache``), the UNet's forward runs its split methods instead
(:mod:`.step_cache`: a full call that keeps the deep feature, a shallow call that reuses it), each compiled
through the UNet's backend; the pipeline says which sampler step each call belongs to
(:attr:`Accelerator.step_cache`).

Each part's forward is an ``ov_backend.CompiledMethod`` (the object the WebUI adapter routes with too:
torch.compile, the captures saved in the disk cache, the check of each call): a call dynamo ran without
any compiled graph (it gave up on the function, e.g. at its recompile limit) is counted with the reason,
and :meth:`Accelerator.eager_report` says so.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from .backends import Backends
from .loader import Components
from .parts import VARYING_DIMS
from .settings import SDSettings
from .step_cache import StepCacheRun
from .unet_split import split_unet

if TYPE_CHECKING:
    from ov_backend import EagerCalls

logger = logging.getLogger(__name__)



class Accelerator:
    """Compiles the chosen parts of ``components`` through one set of backends.

    Args:
        components: the loaded modules (changed in place: their ``forward`` is replaced).
        settings: SD-layer settings.
        backends: the backends to compile with (default: new ones, reset by :meth:`restore`).
    """

    def __init__(self, components: Components, settings: SDSettings, backends: Backends | None = None) -> None:
        self.components = components
        self.settings = settings
        self.backends = backends or Backends()
        self._originals: list[tuple[torch.nn.Module, Any]] = []
        self._calls: EagerCalls | None = None
        self.step_cache: StepCacheRun | None = None
        """The UNet's step caching state while it is routed with step caching (else None)."""

    def targets(self) -> list[tuple[str, torch.nn.Module]]:
        """(part, module) pairs whose ``forward`` gets compiled under the current settings."""
        found: list[tuple[str, torch.nn.Module]] = []
        if "unet" in self.settings.accelerate:
            found.append(("unet", self.components.unet))
        if "vae" in self.settings.accelerate:
            vae = self.components.vae
            # the 1x1 convolutions beside the decoder and the encoder too: left in PyTorch, they would be VAE work
            # not done in OpenVINO, and their sums split by PyTorch's thread count (a batch worker on 1 thread
            # would render other bytes than one process on every core)
            # (a VAE made without them, ``use_quant_conv=False``, has None there)
            found += [("vae", m) for m in (getattr(vae, "post_quant_conv", None), vae.decoder, vae.encoder,
                                           getattr(vae, "quant_conv", None)) if m is not None]
        if "text_encoder" in self.settings.accelerate:
            found += [("text_encoder", m) for m in self.components.text_encoders]
        return found

    def apply(self) -> Accelerator:
        """Compile the chosen parts (lazily: OpenVINO converts on the first call of each shape).

        Raises:
            ValueError: ov_backend refused the settings (e.g. an unknown device).
        """
        if self._originals:
            return self
        from ov_backend import CompiledMethod, EagerCalls

        choice = self.settings.backend_choice()
        self._calls = EagerCalls()
        for part, module in self.targets():
            original = module.__dict__.get("forward")
            counter = self.backends.counter(choice.for_part(part))
            if part == "unet" and self.settings.step_cache.enabled:
                module.forward = self._step_cached(module, counter)
            else:
                # a class of torch itself (the VAE's 1x1 convolutions): dynamo keeps the compiled variants of every
                # such object on the class's one forward, and a capture of it does not hold for the routed call
                # (measured: "4 captured, 3 saved"), so each object compiles a copy of its own, unsaved
                own_code = type(module).__module__.startswith("torch.")
                method = CompiledMethod(module.forward, counter, VARYING_DIMS,
                                        code=None if own_code else getattr(type(module).forward, "__code__", None),
                                        own_code=own_code)
                module.forward = self._calls.watch(part, method)
            self._originals.append((module, original))
            logger.info("%s (%s) routed through ov_backend on %s", part, type(module).__name__,
                        self.settings.device)
        return self

    def _step_cached(self, unet: torch.nn.Module, counter: Any) -> Any:
        """The diffusers UNet's forward with step caching (same signature and result as its own)."""
        from ov_backend import CompiledMethod

        split = split_unet(unet, self.settings.step_cache.depth)
        assert self._calls is not None
        methods = {kind: self._calls.watch("unet", CompiledMethod(getattr(split, kind), counter, VARYING_DIMS, kind))
                   for kind in ("full", "shallow")}
        run = self.step_cache = StepCacheRun(self.settings.step_cache)

        def forward(sample: torch.Tensor, timestep: Any, encoder_hidden_states: Any = None, *args: Any,
                    return_dict: bool = True, **kwargs: Any) -> Any:
            if args:
                raise TypeError("the step-cached UNet takes its options by keyword, as diffusers' pipelines pass them")
            out = run.call(unet, (sample, timestep, encoder_hidden_states), kwargs,
                           lambda kind, a, kw: methods[kind](unet, *a, **kw))
            if not return_dict:
                return (out,)
            from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

            return UNet2DConditionOutput(sample=out)

        return forward

    def restore(self) -> None:
        """Put the PyTorch forwards back and drop the compiled models."""
        for module, original in reversed(self._originals):
            if original is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = original
        self._originals.clear()
        self.step_cache = None
        self.backends.reset()
        torch._dynamo.reset()

    def calibrate(self) -> int:
        """At INT8 precision: quantize the UNet now on the calls recorded so far (the end of a batch);
        returns how many models were quantized (0 when there was nothing to quantize)."""
        return self.backends.calibrate(self.settings.backend_choice()) if self._originals else 0

    def eager_report(self) -> str | None:
        """Which parts' calls dynamo ran in plain PyTorch and why, or None if every call was compiled."""
        return self._calls.report() if self._calls is not None else None

    def stats(self) -> dict[str, float]:
        """The backends' counters (compile_seconds, run_seconds, ...), summed; empty before any was made."""
        return self.backends.stats()
