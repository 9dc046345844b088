"""A tiny SD1-style model in the LDM layout A1111 loads, built from small diffusers/transformers configs.

``model.diffusion_model`` (forward(x, timesteps, context, y=None)), ``first_stage_model`` (encoder,
decoder, quant convs, encode/decode), ``cond_stage_model.wrapped.transformer`` (a transformers
CLIPTextModel) with fake token ids (no tokenizer files needed).
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from torch import nn
from transformers import CLIPTextConfig, CLIPTextModel

CONTEXT_DIM = 32
VOCAB = 1000
BOS, EOS = VOCAB - 2, VOCAB - 1


class LdmUNet(nn.Module):
    """``openaimodel.UNetModel``'s call signature over a diffusers UNet."""

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
        return self.unet(x, timesteps, encoder_hidden_states=context).sample


class DiffusionWrapper(nn.Module):
    def __init__(self, unet: LdmUNet) -> None:
        super().__init__()
        self.diffusion_model = unet

    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, c_crossattn: list) -> torch.Tensor:
        return self.diffusion_model(x, timesteps, context=torch.cat(c_crossattn, 1))


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
    def __init__(self, transformer: CLIPTextModel) -> None:
        super().__init__()
        self.transformer = transformer


class FrozenCLIPEmbedderWithCustomWords(nn.Module):
    """A1111's hijacked SD1 text encoder: chunks of 75 tokens, each padded to 77 and encoded."""

    def __init__(self, wrapped: FrozenCLIPEmbedder) -> None:
        super().__init__()
        self.wrapped = wrapped

    def tokenize(self, text: str) -> list[int]:
        return [(ord(ch) * 7 + i) % (VOCAB - 3) + 1 for i, ch in enumerate(text)]

    def forward(self, texts: list[str]) -> torch.Tensor:
        tokens = [self.tokenize(t) for t in texts]
        chunks = max(1, max((len(t) + 74) // 75 for t in tokens))
        outputs = []
        for c in range(chunks):
            batch = []
            for t in tokens:
                part = t[c * 75 : (c + 1) * 75]
                batch.append([BOS, *part, EOS] + [EOS] * (75 - len(part)))
            ids = torch.tensor(batch, dtype=torch.int64)
            outputs.append(self.wrapped.transformer(input_ids=ids).last_hidden_state)
        return torch.cat(outputs, dim=1)


class TinyLatentDiffusion(nn.Module):
    """``LatentDiffusion`` as A1111 has it loaded (SD1 flags)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(16, 32),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=CONTEXT_DIM,
            attention_head_dim=4,
            norm_num_groups=8,
        )
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            block_out_channels=(8, 8, 8, 8),
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=1,
            norm_num_groups=4,
            sample_size=64,
        )
        text = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=VOCAB,
                hidden_size=CONTEXT_DIM,
                intermediate_size=37,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=77,
                bos_token_id=BOS,
                eos_token_id=EOS,
            )
        )
        self.model = DiffusionWrapper(LdmUNet(unet))
        self.first_stage_model = FirstStage(vae)
        self.cond_stage_model = FrozenCLIPEmbedderWithCustomWords(FrozenCLIPEmbedder(text))
        self.scale_factor = 0.18215
        self.is_sd1, self.is_sd2, self.is_sdxl = True, False, False
        self.sd_checkpoint_info = None
        self.sd_model_hash = None
        self.eval()

    def get_learned_conditioning(self, prompts: list[str]) -> torch.Tensor:
        return self.cond_stage_model(prompts)

    def apply_model(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return self.model(x, t, c_crossattn=[cond])

    def decode_first_stage(self, z: torch.Tensor) -> torch.Tensor:
        return self.first_stage_model.decode(z / self.scale_factor)

    def encode_first_stage(self, x: torch.Tensor) -> Gaussian:
        return self.first_stage_model.encode(x)

    def get_first_stage_encoding(self, dist: Gaussian) -> torch.Tensor:
        return self.scale_factor * dist.sample()
