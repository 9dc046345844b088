"""A UNet's forward split in two for step caching (:mod:`.step_cache`): ``full`` and ``shallow``.

Owns :class:`UNetSplit` and :func:`split_unet`: ``full`` returns the UNet's output and the feature entering its last
``depth`` output blocks; ``shallow`` runs only the first ``depth`` input blocks and the last ``depth`` output blocks,
on such a feature. For the LDM and SGM ``UNetModel`` (what the WebUI loads) and diffusers' ``UNet2DConditionModel``
(the command line's); Forge's is split by ``ov_accelerate_webui.forge_unet``. Each method takes the UNet as its first
argument, so a backend compiles it with the UNet's live weights (a LoRA written into them is seen), and the split
keeps no reference to the UNet (a model the WebUI replaces is freed as before). Knows torch only.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch

logger = logging.getLogger(__name__)


class StepCacheUnsupported(ValueError):
    """A UNet that step caching cannot split (named, with why)."""


class UNetSplit(torch.nn.Module):
    """A UNet's forward in two methods (see the module docstring), for UNets of one layout: made from one, it
    runs any UNet of the same architecture passed to its methods.

    Subclasses give the UNet's own embedding, its flat lists of input and output layers (each maps
    ``(h, emb, context)`` to ``h``; output layer ``j`` takes the skip of input layer ``n - 1 - j``), the
    middle block and the head."""

    def __init__(self, unet: torch.nn.Module, depth: int) -> None:
        super().__init__()
        self.depth = depth
        self.kind = type(unet).__name__

    def check_depth(self, inputs: int, outputs: int) -> None:
        """Check that the UNet has one skip per output layer and that :attr:`depth` fits it; records
        :attr:`layers`."""
        if inputs != outputs:
            raise StepCacheUnsupported(f"{self.kind} has {inputs} input and {outputs} output blocks: "
                                       "step caching needs one skip connection per output block")
        if not 1 <= self.depth < inputs:
            raise StepCacheUnsupported(f"step caching depth {self.depth} does not fit {self.kind}: "
                                       f"its input blocks are 1 to {inputs - 1} deep")
        self._layers = inputs

    # the UNet kind's own parts
    def begin(self, unet: Any, x: torch.Tensor, timesteps: Any, context: Any,
              kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        """(h, emb, context) before the first input layer."""
        raise NotImplementedError

    def input_layer(self, unet: Any, index: int, h: Any, emb: Any, context: Any, skips: list[Any]) -> Any:
        raise NotImplementedError

    def middle(self, unet: Any, h: Any, emb: Any, context: Any) -> Any:
        raise NotImplementedError

    def output_layer(self, unet: Any, index: int, h: Any, emb: Any, context: Any, skips: list[Any]) -> Any:
        """Output layer ``index``: pops its skip from ``skips``."""
        raise NotImplementedError

    def end(self, unet: Any, h: Any, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    @property
    def layers(self) -> int:
        """How many input (and output) layers the UNet has (set by :meth:`check_depth`)."""
        return self._layers

    # the two methods a backend compiles
    def full(self, unet: Any, x: torch.Tensor, timesteps: Any = None, context: Any = None,
             **kwargs: Any) -> tuple[Any, Any]:
        """``unet``'s output for its arguments, and the feature a shallow step starts from."""
        h, emb, context = self.begin(unet, x, timesteps, context, kwargs)
        skips: list[Any] = []
        for index in range(self.layers):
            h = self.input_layer(unet, index, h, emb, context, skips)
            skips.append(h)
        h = self.middle(unet, h, emb, context)
        cut = self.layers - self.depth
        feature = h
        for index in range(self.layers):
            if index == cut:
                feature = h
            h = self.output_layer(unet, index, h, emb, context, skips)
        return self.end(unet, h, x, kwargs), feature

    def shallow(self, unet: Any, x: torch.Tensor, timesteps: Any = None, context: Any = None, *,
                feature: torch.Tensor, **kwargs: Any) -> Any:
        """``unet``'s output from ``feature`` (kept by :meth:`full` for the same size, prompt and weights)."""
        h, emb, context = self.begin(unet, x, timesteps, context, kwargs)
        skips: list[Any] = []
        for index in range(self.depth):
            h = self.input_layer(unet, index, h, emb, context, skips)
            skips.append(h)
        h = feature
        for index in range(self.layers - self.depth, self.layers):
            h = self.output_layer(unet, index, h, emb, context, skips)
        return self.end(unet, h, x, kwargs)


class LdmSplit(UNetSplit):
    """The ``UNetModel`` of LDM (SD 1.x/2.x) and SGM (SDXL), as the WebUI loads them.

    The embedding and the concatenation of the skips are looked up in the UNet's own module at each call,
    so they are whatever that module's ``forward`` uses then (the WebUI replaces both: a cast of the
    timestep embedding and a concatenation that resizes a skip of another size)."""

    def __init__(self, unet: torch.nn.Module, depth: int) -> None:
        super().__init__(unet, depth)
        for name in ("input_blocks", "middle_block", "output_blocks", "out", "time_embed", "model_channels"):
            if not hasattr(unet, name):
                raise StepCacheUnsupported(f"{type(unet).__name__} has no {name}: not an LDM/SGM UNetModel")
        if getattr(unet, "predict_codebook_ids", False):
            raise StepCacheUnsupported("a UNet that predicts codebook ids is not a Stable Diffusion UNet")
        self.check_depth(len(unet.input_blocks), len(unet.output_blocks))
        self.source_module = sys.modules[type(unet).__module__]
        missing = [name for name in ("th", "timestep_embedding") if not hasattr(self.source_module, name)]
        if missing:  # LDM-shaped, but another implementation whose blocks may take other arguments
            raise StepCacheUnsupported(f"{type(unet).__name__} is not LDM/SGM's UNetModel (its module "
                                       f"{self.source_module.__name__} has no {' or '.join(missing)}): step caching "
                                       "does not split it")

    def begin(self, unet: Any, x: torch.Tensor, timesteps: Any, context: Any,
              kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        emb = unet.time_embed(self.source_module.timestep_embedding(timesteps, unet.model_channels,
                                                                    repeat_only=False))
        if getattr(unet, "num_classes", None) is not None:
            emb = emb + unet.label_emb(kwargs["y"])
        dtype = getattr(unet, "dtype", None)  # LDM's runs its blocks at its own dtype; SGM's has none
        h = x.type(dtype) if isinstance(dtype, torch.dtype) else x
        return h, emb, context

    def input_layer(self, unet: Any, index: int, h: Any, emb: Any, context: Any, skips: list[Any]) -> Any:
        return unet.input_blocks[index](h, emb, context)

    def middle(self, unet: Any, h: Any, emb: Any, context: Any) -> Any:
        return unet.middle_block(h, emb, context)

    def output_layer(self, unet: Any, index: int, h: Any, emb: Any, context: Any, skips: list[Any]) -> Any:
        h = self.source_module.th.cat([h, skips.pop()], dim=1)
        return unet.output_blocks[index](h, emb, context)

    def end(self, unet: Any, h: Any, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        return unet.out(h.type(x.dtype))


class DiffusersSplit(UNetSplit):
    """diffusers' ``UNet2DConditionModel`` as Stable Diffusion 1.x/2.x/SDXL use it (the command line's).

    Its down blocks' (resnet, attention) pairs and downsamplers are the input layers, its up blocks'
    pairs the output layers (an up block's upsampler belongs to its last pair), as in LDM's layout. The
    call keeps the UNet's signature; options an SD pipeline does not pass (masks, ControlNet or adapter
    residuals, GLIGEN, FreeU, class labels) are refused."""

    def __init__(self, unet: torch.nn.Module, depth: int) -> None:
        super().__init__(unet, depth)
        config = unet.config
        refused = {
            "class embeddings": getattr(unet, "class_embedding", None) is not None,
            "an encoder projection": getattr(unet, "encoder_hid_proj", None) is not None,
            "centered inputs": bool(config.get("center_input_sample", False)),
            f"addition embedding {config.get('addition_embed_type')!r}":
                config.get("addition_embed_type") not in (None, "text_time"),
            "FreeU": any(getattr(block, "s1", None) is not None for block in unet.up_blocks),
        }
        unfit = [name for name, found in refused.items() if found]
        if unfit:
            raise StepCacheUnsupported(f"step caching does not take a UNet with {', '.join(unfit)}")
        # (down block, layer in it): block -1 is conv_in, layer -1 the block's downsampler
        self._inputs: list[tuple[int, int]] = [(-1, 0)]
        for b, block in enumerate(unet.down_blocks):
            self._inputs += [(b, i) for i in range(len(block.resnets))]
            if getattr(block, "downsamplers", None):
                self._inputs.append((b, -1))
        self._outputs = [(b, i) for b, block in enumerate(unet.up_blocks) for i in range(len(block.resnets))]
        self.check_depth(len(self._inputs), len(self._outputs))

    def begin(self, unet: Any, x: torch.Tensor, timesteps: Any, context: Any,
              kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
        unknown = {k for k, v in kwargs.items() if v is not None} - {"added_cond_kwargs", "timestep_cond",
                                                                        "return_dict", "cross_attention_kwargs"}
        if unknown or kwargs.get("cross_attention_kwargs"):
            raise StepCacheUnsupported(f"step caching does not take the UNet's {sorted(unknown) or 'attention kwargs'}")
        emb = unet.time_embedding(unet.get_time_embed(sample=x, timestep=timesteps), kwargs.get("timestep_cond"))
        extra = unet.get_aug_embed(emb=emb, encoder_hidden_states=context,
                                   added_cond_kwargs=kwargs.get("added_cond_kwargs") or {})
        if extra is not None:
            emb = emb + extra
        if unet.time_embed_act is not None:
            emb = unet.time_embed_act(emb)
        return x, emb, context

    def input_layer(self, unet: Any, index: int, h: Any, emb: Any, context: Any, skips: list[Any]) -> Any:
        b, i = self._inputs[index]
        if b < 0:
            return unet.conv_in(h)
        block = unet.down_blocks[b]
        if i < 0:
            for down in block.downsamplers:
                h = down(h)
            return h
        h = block.resnets[i](h, emb)
        if getattr(block, "attentions", None):
            h = block.attentions[i](h, encoder_hidden_states=context, return_dict=False)[0]
        return h

    def middle(self, unet: Any, h: Any, emb: Any, context: Any) -> Any:
        block = unet.mid_block
        if getattr(block, "has_cross_attention", False):
            return block(h, emb, encoder_hidden_states=context)
        return block(h, emb)

    def output_layer(self, unet: Any, index: int, h: Any, emb: Any, context: Any, skips: list[Any]) -> Any:
        b, i = self._outputs[index]
        block = unet.up_blocks[b]
        h = torch.cat([h, skips.pop()], dim=1)
        h = block.resnets[i](h, emb)
        if getattr(block, "attentions", None):
            h = block.attentions[i](h, encoder_hidden_states=context, return_dict=False)[0]
        if i == len(block.resnets) - 1 and getattr(block, "upsamplers", None):
            # as diffusers does: the next skip's size, only when a latent size is not a multiple of the
            # UNet's overall upscale (else the upsamplers double)
            # (skips[0], conv_in's output, has the latent's size)
            factor = 2 ** unet.num_upsamplers
            size = skips[-1].shape[2:] if any(d % factor for d in skips[0].shape[2:]) else None
            for up in block.upsamplers:
                h = up(h, size)
        return h

    def end(self, unet: Any, h: Any, x: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        if unet.conv_norm_out is not None:
            h = unet.conv_act(unet.conv_norm_out(h))
        return unet.conv_out(h)


def split_unet(unet: torch.nn.Module, depth: int) -> UNetSplit:
    """``unet``'s forward split at ``depth`` (see :class:`UNetSplit`).

    Raises:
        StepCacheUnsupported: not a UNet step caching knows, or ``depth`` does not fit it (said why).
    """
    if hasattr(unet, "input_blocks"):
        return LdmSplit(unet, depth)
    if hasattr(unet, "down_blocks") and hasattr(unet, "up_blocks"):
        return DiffusersSplit(unet, depth)
    raise StepCacheUnsupported(f"step caching knows LDM/SGM and diffusers UNets, not {type(unet).__name__}")
