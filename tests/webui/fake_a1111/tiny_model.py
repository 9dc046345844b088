"""Tiny models in the layouts A1111 loads, built from small diffusers/transformers configs.

* :class:`TinyLatentDiffusion`: SD1 (ldm ``LatentDiffusion``): ``model.diffusion_model`` (forward
  ``(x, timesteps, context, y=None)``), ``first_stage_model`` (encoder, decoder, quant convs),
  ``cond_stage_model.wrapped.transformer`` (a transformers CLIPTextModel) after A1111's hijack.
* :class:`TinySD2`: SD2: the same, with the open_clip text encoder (``cond_stage_model.wrapped`` is
  ldm's ``FrozenOpenCLIPEmbedder``).
* :class:`TinySDXL`: SDXL (sgm ``DiffusionEngine``): ``conditioner.embedders`` = [CLIP-L, OpenCLIP-bigG,
  3 size embedders], UNet forward with ``y``.
* :class:`TinySDXLRefiner`: SDXL's refiner: ``conditioner.embedders`` = [OpenCLIP-bigG, 3 size embedders
  (original size, crop, aesthetic score)], no CLIP-L.
* :class:`TinySD1Inpainting`: an SD1 inpainting checkpoint: ``model.conditioning_key == "hybrid"`` and a
  UNet with 9 input channels (latent + mask + masked-image latent, concatenated by ``DiffusionWrapper``).
The UNet and VAE of SD1 and SD2 come from the same seeded builders (same weights for the same seed).
Models are built as the checkpoint defines them; ``sd_models.load_model`` applies A1111's hijack (the
chunking text encoder wrappers, ``EmbeddingsWithFixes``), as A1111 does after loading.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from tiny_open_clip import CLIPText, FrozenOpenCLIPEmbedder, FrozenOpenCLIPEmbedder2
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel

CONTEXT_DIM = 32
VOCAB = 1000
BOS, EOS = VOCAB - 2, VOCAB - 1
SIZE_EMBED = 8  # SDXL size embedders' outdim (256 in SDXL)
POOLED = 16


def build_unet(seed: int, y_dim: int | None = None, in_channels: int = 4) -> UNet2DConditionModel:
    torch.manual_seed(seed)
    extra = {"class_embed_type": "projection", "projection_class_embeddings_input_dim": y_dim} if y_dim else {}
    return UNet2DConditionModel(
        sample_size=8,
        in_channels=in_channels,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=CONTEXT_DIM,
        attention_head_dim=4,
        norm_num_groups=8,
        mid_block_type=None,  # fewer ops: OpenVINO conversion time dominates the tests
        **extra,
    )


def build_vae(seed: int) -> AutoencoderKL:
    torch.manual_seed(seed + 1)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(8, 8, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        layers_per_block=1,
        norm_num_groups=4,
        sample_size=64,
        mid_block_add_attention=False,
    )


def build_clip(seed: int, hidden: int) -> CLIPTextModel:
    torch.manual_seed(seed + 2)
    config = CLIPTextConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    model = CLIPTextModel(config)
    _trained_layer_norm_bias(model.text_model.final_layer_norm)
    return model


def build_open_clip(seed: int, width: int) -> CLIPText:
    torch.manual_seed(seed + 3)
    model = CLIPText(vocab_size=VOCAB, width=width, layers=2, heads=2, embed_dim=POOLED)
    _trained_layer_norm_bias(model.ln_final)
    return model


def _trained_layer_norm_bias(norm: nn.LayerNorm) -> None:
    """A trained text encoder's last layer norm has a bias, so its output's mean is not 0; at init (bias 0)
    every token's vector has mean 0, and A1111's emphasis (rescaling by the old mean over the new) divides
    by that mean."""
    with torch.no_grad():
        norm.bias.normal_(0.1, 0.05)


class LdmUNet(nn.Module):
    """``openaimodel.UNetModel``'s call signature over a diffusers UNet (``y`` -> class embedding)."""

    def __init__(self, unet: UNet2DConditionModel) -> None:
        super().__init__()
        self.unet = unet
        self.in_channels = unet.config.in_channels

    def forward(
        self,
        x: torch.Tensor,
        timesteps: torch.Tensor = None,
        context: torch.Tensor = None,
        y: torch.Tensor = None,
        **kwargs: object,
    ) -> torch.Tensor:
        return self.unet(x, timesteps, encoder_hidden_states=context, class_labels=y).sample


class DiffusionWrapper(nn.Module):
    """ldm's DiffusionWrapper: "crossattn" conditioning, or "hybrid" (inpainting: ``c_concat`` is
    concatenated to the latent along the channels, ``c_crossattn`` is the context)."""

    def __init__(self, unet: LdmUNet, conditioning_key: str = "crossattn") -> None:
        super().__init__()
        self.diffusion_model = unet
        self.conditioning_key = conditioning_key

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, c_concat: list | None = None, c_crossattn: list | None = None
    ) -> torch.Tensor:
        if self.conditioning_key == "hybrid":
            x = torch.cat([x, *c_concat], dim=1)
        return self.diffusion_model(x, t, context=torch.cat(c_crossattn, 1))


class OpenAIWrapper(nn.Module):
    """sgm's OpenAIWrapper: ``c`` is a dict with "crossattn" and "vector"."""

    def __init__(self, unet: LdmUNet) -> None:
        super().__init__()
        self.diffusion_model = unet
        self.conditioning_key = "crossattn"

    def forward(self, x: torch.Tensor, t: torch.Tensor, c: dict) -> torch.Tensor:
        return self.diffusion_model(x, timesteps=t, context=c.get("crossattn"), y=c.get("vector"))


class Gaussian:
    """``DiagonalGaussianDistribution`` (mode used for determinism)."""

    def __init__(self, moments: torch.Tensor) -> None:
        self.mean, self.logvar = torch.chunk(moments, 2, dim=1)

    def sample(self) -> torch.Tensor:
        return self.mean


class FirstStage(nn.Module):
    """``ldm.models.autoencoder.AutoencoderKL`` layout."""

    def __init__(self, vae: AutoencoderKL) -> None:
        super().__init__()
        self.encoder, self.decoder = vae.encoder, vae.decoder
        self.quant_conv, self.post_quant_conv = vae.quant_conv, vae.post_quant_conv

    def encode(self, x: torch.Tensor) -> Gaussian:
        return Gaussian(self.quant_conv(self.encoder(x)))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(z))


class FrozenCLIPEmbedder(nn.Module):
    """ldm/sgm FrozenCLIPEmbedder: ``transformer`` (tokenizer omitted)."""

    def __init__(self, transformer: CLIPTextModel, layer: str = "last", layer_idx: int | None = None) -> None:
        super().__init__()
        self.transformer, self.layer, self.layer_idx = transformer, layer, layer_idx
        self.input_key = "txt"


class _Ldm(nn.Module):
    """What SD1 and SD2 share: ``LatentDiffusion``'s methods A1111 calls."""

    scale_factor = 0.18215
    conditioning_key = "crossattn"
    in_channels = 4

    def __init__(self, seed: int, cond_stage_model: nn.Module) -> None:
        super().__init__()
        self.seed = seed
        unet = LdmUNet(build_unet(seed, in_channels=self.in_channels))
        self.model = DiffusionWrapper(unet, self.conditioning_key)
        self.first_stage_model = FirstStage(build_vae(seed))
        self.cond_stage_model = cond_stage_model
        self.cond_stage_key = "txt"
        self.is_sd1, self.is_sd2, self.is_sdxl = False, False, False
        self.sd_checkpoint_info = None
        self.sd_model_hash = None
        self.sd_model_checkpoint = None

    def get_learned_conditioning(self, prompts: list[str]) -> torch.Tensor:
        return self.cond_stage_model(prompts)

    def apply_model(self, x: torch.Tensor, t: torch.Tensor, cond: Any) -> torch.Tensor:
        if not isinstance(cond, dict):
            cond = {"c_crossattn": [cond]}
        return self.model(x, t, **cond)

    def decode_first_stage(self, z: torch.Tensor) -> torch.Tensor:
        return self.first_stage_model.decode(z / self.scale_factor)

    def encode_first_stage(self, x: torch.Tensor) -> Gaussian:
        return self.first_stage_model.encode(x)

    def get_first_stage_encoding(self, dist: Gaussian) -> torch.Tensor:
        return self.scale_factor * dist.sample()


class TinyLatentDiffusion(_Ldm):
    """SD1 as A1111 has it loaded."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed, FrozenCLIPEmbedder(build_clip(seed, CONTEXT_DIM)))
        self.is_sd1 = True
        self.eval()


class TinySD1Inpainting(TinyLatentDiffusion):
    """An SD1 inpainting checkpoint as A1111 has it loaded (``sd-v1-5-inpainting``'s layout)."""

    conditioning_key = "hybrid"
    in_channels = 9


class TinySD2(_Ldm):
    """SD2 as A1111 has it loaded: open_clip text encoder (penultimate layer)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed, FrozenOpenCLIPEmbedder(build_open_clip(seed, CONTEXT_DIM)))
        self.is_sd2 = True
        self.eval()


class ConcatTimestepEmbedderND(nn.Module):
    """sgm's size embedder: each value -> sinusoidal embedding of ``outdim``, concatenated."""

    def __init__(self, outdim: int, input_key: str) -> None:
        super().__init__()
        self.outdim, self.input_key = outdim, input_key
        self.is_trainable, self.legacy_ucg_val, self.ucg_rate = False, None, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, dims = x.shape
        half = self.outdim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
        args = x.reshape(-1, 1).float() * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1).reshape(b, dims * self.outdim)


class GeneralConditioner(nn.Module):
    """sgm's GeneralConditioner: runs each embedder on its input key, concatenates by output rank."""

    OUTPUT_DIM2KEYS = {2: "vector", 3: "crossattn", 4: "concat", 5: "concat"}
    KEY2CATDIM = {"vector": 1, "crossattn": 2, "concat": 1}

    def __init__(self, embedders: list[nn.Module]) -> None:
        super().__init__()
        self.embedders = nn.ModuleList(embedders)

    def forward(self, batch: dict, force_zero_embeddings: list | None = None) -> dict[str, torch.Tensor]:
        output: dict[str, torch.Tensor] = {}
        for embedder in self.embedders:
            emb_out = embedder(batch[embedder.input_key])
            for emb in emb_out if isinstance(emb_out, (list, tuple)) else [emb_out]:
                key = self.OUTPUT_DIM2KEYS[emb.dim()]
                if embedder.input_key in (force_zero_embeddings or []):
                    emb = torch.zeros_like(emb)
                output[key] = torch.cat((output[key], emb), self.KEY2CATDIM[key]) if key in output else emb
        return output


class TinySDXL(nn.Module):
    """SDXL base as A1111 has it loaded (sgm ``DiffusionEngine`` with A1111's hijacked embedders)."""

    scale_factor = 0.13025
    #: The size embedders after the text encoders: (input key, values per sample).
    size_inputs: tuple[tuple[str, int], ...] = (
        ("original_size_as_tuple", 2),
        ("crop_coords_top_left", 2),
        ("target_size_as_tuple", 2),
    )

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = seed
        self.conditioner = GeneralConditioner(
            [*self.text_embedders(seed), *(ConcatTimestepEmbedderND(SIZE_EMBED, key) for key, _n in self.size_inputs)]
        )
        y_dim = POOLED + SIZE_EMBED * sum(n for _key, n in self.size_inputs)
        self.model = OpenAIWrapper(LdmUNet(build_unet(seed, y_dim=y_dim)))
        self.first_stage_model = FirstStage(build_vae(seed))
        self.cond_stage_key = "txt"
        self.is_sd1, self.is_sd2, self.is_sdxl = False, False, True
        self.sd_checkpoint_info = None
        self.sd_model_hash = None
        self.sd_model_checkpoint = None
        self.eval()

    def text_embedders(self, seed: int) -> list[nn.Module]:
        """CLIP-L (hidden layer 1 of 2) and OpenCLIP-bigG; their widths add up to the UNet's context."""
        clip_l = FrozenCLIPEmbedder(build_clip(seed, CONTEXT_DIM // 2), layer="hidden", layer_idx=1)
        return [clip_l, FrozenOpenCLIPEmbedder2(build_open_clip(seed, CONTEXT_DIM // 2))]

    def get_learned_conditioning(self, batch: list[str], width: int = 1024, height: int = 1024) -> dict:
        """A1111's ``sd_models_xl.get_learned_conditioning``: the prompt and the size conds; the
        conditioner gives each embedder the input it reads (the refiner's reads the aesthetic score)."""
        from modules import shared

        is_negative = getattr(batch, "is_negative_prompt", False)
        opts = shared.opts
        aesthetic = opts.sdxl_refiner_low_aesthetic_score if is_negative else opts.sdxl_refiner_high_aesthetic_score
        n = len(batch)
        conds = {
            "txt": list(batch),
            "original_size_as_tuple": torch.tensor([height, width], dtype=torch.float32).repeat(n, 1),
            "crop_coords_top_left": torch.tensor([0, 0], dtype=torch.float32).repeat(n, 1),
            "target_size_as_tuple": torch.tensor([height, width], dtype=torch.float32).repeat(n, 1),
            "aesthetic_score": torch.tensor([aesthetic], dtype=torch.float32).repeat(n, 1),
        }
        zero = is_negative and all(x == "" for x in batch)
        return self.conditioner(conds, force_zero_embeddings=["txt"] if zero else [])

    def apply_model(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        # A1111's sd_models_xl.apply_model: c_concat only for 9-channel (inpainting) UNets
        concat = cond.get("c_concat")
        if self.model.diffusion_model.in_channels == 9:
            x = torch.cat([x, *concat], dim=1)
        return self.model(x, t, {k: v for k, v in cond.items() if k != "c_concat"})

    def decode_first_stage(self, z: torch.Tensor) -> torch.Tensor:
        return self.first_stage_model.decode(z / self.scale_factor)

    def encode_first_stage(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale_factor * self.first_stage_model.encode(x).sample()

    def get_first_stage_encoding(self, x: torch.Tensor) -> torch.Tensor:
        return x


class TinySDXLRefiner(TinySDXL):
    """SDXL's refiner as A1111 has it loaded (``sd_xl_refiner.yaml``): only the OpenCLIP-bigG text encoder
    (its width is the UNet's context), size embedders for original size, crop and aesthetic score. A1111
    marks it ``is_sdxl`` like the base; its hijack makes the one wrapped embedder ``cond_stage_model``."""

    size_inputs = (("original_size_as_tuple", 2), ("crop_coords_top_left", 2), ("aesthetic_score", 1))

    def text_embedders(self, seed: int) -> list[nn.Module]:
        return [FrozenOpenCLIPEmbedder2(build_open_clip(seed, CONTEXT_DIM))]


MODELS = {
    "sd1": TinyLatentDiffusion,
    "sd1-inpainting": TinySD1Inpainting,
    "sd2": TinySD2,
    "sdxl": TinySDXL,
    "sdxl-refiner": TinySDXLRefiner,
}
