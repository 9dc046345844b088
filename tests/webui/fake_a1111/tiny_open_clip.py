"""A stand-in for open_clip's text tower (open_clip needs torchvision, absent here) and the ldm/sgm
embedders A1111 wraps: same attribute layout and the same calls as open-clip-torch 2.20 and
Stability-AI's ``FrozenOpenCLIPEmbedder`` (SD2) / ``FrozenOpenCLIPEmbedder2`` (SDXL).

``encode_with_transformer`` runs ``model.transformer.resblocks`` one by one in LND layout with the
causal ``model.attn_mask``; ``model.transformer.forward`` is never called, as in the real code.
"""

from __future__ import annotations

import torch
from torch import nn


class ResidualAttentionBlock(nn.Module):
    """open_clip.transformer.ResidualAttentionBlock (LND, ``attn_mask`` keyword)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential()
        self.mlp.add_module("c_fc", nn.Linear(width, width * 4))
        self.mlp.add_module("gelu", nn.GELU())
        self.mlp.add_module("c_proj", nn.Linear(width * 4, width))

    def attention(self, q_x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        attn_mask = attn_mask.to(q_x.dtype) if attn_mask is not None else None
        return self.attn(q_x, q_x, q_x, need_weights=False, attn_mask=attn_mask)[0]

    def forward(self, q_x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = q_x + self.attention(self.ln_1(q_x), attn_mask=attn_mask)
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    """open_clip.transformer.Transformer: ``resblocks``; its forward is unused by A1111."""

    def __init__(self, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.width, self.layers, self.grad_checkpointing = width, layers, False
        self.resblocks = nn.ModuleList([ResidualAttentionBlock(width, heads) for _ in range(layers)])

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        for r in self.resblocks:
            x = r(x, attn_mask=attn_mask)
        return x


class CLIPText(nn.Module):
    """open_clip.CLIP with ``visual`` deleted: token/positional embeddings, transformer, ln_final."""

    def __init__(self, vocab_size: int, width: int, layers: int, heads: int, embed_dim: int) -> None:
        super().__init__()
        self.vocab_size, self.context_length = vocab_size, 77
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.randn(77, width) * 0.01)
        self.transformer = Transformer(width, layers, heads)
        self.ln_final = nn.LayerNorm(width)
        self.text_projection = nn.Parameter(torch.randn(width, embed_dim) * width**-0.5)
        mask = torch.empty(77, 77).fill_(float("-inf")).triu_(1)
        self.register_buffer("attn_mask", mask, persistent=False)


class FrozenOpenCLIPEmbedder(nn.Module):
    """ldm.modules.encoders.modules.FrozenOpenCLIPEmbedder (SD2; layer "penultimate")."""

    def __init__(self, model: CLIPText, layer: str = "penultimate") -> None:
        super().__init__()
        self.model, self.max_length, self.layer = model, 77, layer
        self.layer_idx = {"last": 0, "penultimate": 1}[layer]

    def encode_with_transformer(self, text: torch.Tensor) -> torch.Tensor:
        x = self.model.token_embedding(text)
        x = x + self.model.positional_embedding
        x = x.permute(1, 0, 2)
        x = self.text_transformer_forward(x, attn_mask=self.model.attn_mask)
        x = x.permute(1, 0, 2)
        return self.model.ln_final(x)

    def text_transformer_forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        for i, r in enumerate(self.model.transformer.resblocks):
            if i == len(self.model.transformer.resblocks) - self.layer_idx:
                break
            x = r(x, attn_mask=attn_mask)
        return x


class FrozenOpenCLIPEmbedder2(nn.Module):
    """sgm.modules.encoders.modules.FrozenOpenCLIPEmbedder2 (SDXL-G; penultimate, pooled, not legacy)."""

    def __init__(self, model: CLIPText) -> None:
        super().__init__()
        self.model, self.max_length = model, 77
        self.layer, self.layer_idx, self.legacy, self.return_pooled = "penultimate", 1, False, True
        self.input_key = "txt"

    def encode_with_transformer(self, text: torch.Tensor) -> dict[str, torch.Tensor]:
        x = self.model.token_embedding(text)
        x = x + self.model.positional_embedding
        x = x.permute(1, 0, 2)
        x = self.text_transformer_forward(x, attn_mask=self.model.attn_mask)
        o = self.model.ln_final(x["last"])
        x["pooled"] = self.pool(o, text)
        return x

    def pool(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return x[torch.arange(x.shape[0]), text.argmax(dim=-1)] @ self.model.text_projection

    def text_transformer_forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        outputs = {}
        for i, r in enumerate(self.model.transformer.resblocks):
            if i == len(self.model.transformer.resblocks) - 1:
                outputs["penultimate"] = x.permute(1, 0, 2)
            x = r(x, attn_mask=attn_mask)
        outputs["last"] = x.permute(1, 0, 2)
        return outputs
