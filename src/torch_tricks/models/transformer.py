"""A small transformer-encoder text classifier, built on ``nn.TransformerEncoder``.

It uses PyTorch's own encoder layer on purpose: that is the module whose fast paths
(fused SDPA attention, the inference "BetterTransformer" path) the speed tricks act
on, so measurements on it carry over to real models built the same way.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from torch_tricks.errors import UserError
from torch_tricks.models.registry import register_model

__all__ = ["TransformerClassifier", "transformer"]


@register_model(
    "transformer",
    default_input="long:128:1000",
    description="4-layer transformer encoder text classifier (d_model 128, 4 heads)",
    tags=("text", "attention"),
)
def transformer(
    num_classes: int = 2,
    vocab_size: int = 1000,
    d_model: int = 128,
    nhead: int = 4,
    num_layers: int = 4,
    dim_feedforward: int = 512,
    max_len: int = 512,
    dropout: float = 0.1,
    norm_first: bool = False,
) -> "TransformerClassifier":
    """Token ids (batch, seq) -> logits (batch, num_classes)."""
    return TransformerClassifier(
        num_classes=num_classes,
        vocab_size=vocab_size,
        d_model=d_model,
        nhead=nhead,
        num_layers=num_layers,
        dim_feedforward=dim_feedforward,
        max_len=max_len,
        dropout=dropout,
        norm_first=norm_first,
    )


class TransformerClassifier(nn.Module):
    """Token + learned position embeddings, encoder, LayerNorm, mean over tokens, linear.

    Mean pooling instead of a [CLS] token keeps the input a plain id tensor with no
    special tokens, so any ``long:SEQ:VOCAB`` input works.
    """

    def __init__(
        self,
        num_classes: int = 2,
        vocab_size: int = 1000,
        d_model: int = 128,
        nhead: int = 4,
        num_layers: int = 4,
        dim_feedforward: int = 512,
        max_len: int = 512,
        dropout: float = 0.1,
        norm_first: bool = False,
    ) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos_embed = nn.Parameter(torch.zeros(1, max_len, d_model))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        layer = nn.TransformerEncoderLayer(
            d_model,
            nhead,
            dim_feedforward=dim_feedforward,
            dropout=dropout,
            batch_first=True,
            norm_first=norm_first,
        )
        # The nested-tensor fast path only applies to post-norm layers with a padding
        # mask; turning it off for pre-norm avoids PyTorch's warning about it.
        self.encoder = nn.TransformerEncoder(
            layer, num_layers=num_layers, enable_nested_tensor=not norm_first
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        # Under torch.fx the length is a Proxy; skip the check there so the model traces.
        if isinstance(seq, int) and seq > self.max_len:
            raise UserError(
                f"sequence length {seq} exceeds the model's max_len {self.max_len}: "
                f"use a shorter input or build it with max_len>={seq}"
            )
        x = self.embed(tokens) + self.pos_embed[:, :seq]
        x = self.norm(self.encoder(x))
        return self.head(x.mean(dim=1))
