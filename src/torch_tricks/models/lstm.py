"""A bidirectional LSTM text classifier: the recurrent reference model.

Recurrent nets run as cuDNN's fused LSTM kernel on GPU and as a sequential loop on
CPU; tricks such as AMP, compile or quantization behave quite differently on them than
on convolutions or attention, which is why one is in the reference set.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from torch_tricks.models.registry import register_model

__all__ = ["LSTMClassifier", "lstm"]


@register_model(
    "lstm",
    default_input="long:64:1000",
    description="2-layer bidirectional LSTM text classifier (embed 128, hidden 256)",
    tags=("text", "rnn"),
)
def lstm(
    num_classes: int = 2,
    vocab_size: int = 1000,
    embed_dim: int = 128,
    hidden_size: int = 256,
    num_layers: int = 2,
    bidirectional: bool = True,
    dropout: float = 0.0,
    pooling: str = "last",
) -> "LSTMClassifier":
    """Token ids (batch, seq) -> logits (batch, num_classes)."""
    return LSTMClassifier(
        num_classes=num_classes,
        vocab_size=vocab_size,
        embed_dim=embed_dim,
        hidden_size=hidden_size,
        num_layers=num_layers,
        bidirectional=bidirectional,
        dropout=dropout,
        pooling=pooling,
    )


class LSTMClassifier(nn.Module):
    """Embedding, LSTM, pooling, linear.

    ``pooling="last"`` uses the final hidden state of each direction of the top layer
    (``h_n``): for the backward direction that is the state after reading the whole
    sequence right to left, which output[:, -1] would not give. ``"mean"`` averages
    the outputs over time.
    """

    def __init__(
        self,
        num_classes: int = 2,
        vocab_size: int = 1000,
        embed_dim: int = 128,
        hidden_size: int = 256,
        num_layers: int = 2,
        bidirectional: bool = True,
        dropout: float = 0.0,
        pooling: str = "last",
    ) -> None:
        super().__init__()
        if pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be 'last' or 'mean', got {pooling!r}")
        self.num_classes = num_classes
        self.vocab_size = vocab_size
        self.pooling = pooling
        self.num_directions = 2 if bidirectional else 1
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.rnn = nn.LSTM(
            embed_dim,
            hidden_size,
            num_layers=num_layers,
            batch_first=True,
            bidirectional=bidirectional,
            dropout=dropout if num_layers > 1 else 0.0,
        )
        self.head = nn.Linear(hidden_size * self.num_directions, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Indexing rather than tuple unpacking keeps the model traceable by torch.fx.
        result = self.rnn(self.embed(tokens))
        if self.pooling == "mean":
            feat = result[0].mean(dim=1)
        else:
            # h_n: (num_layers * directions, batch, hidden); the last `directions` rows are
            # the top layer's forward (then backward) final states, concatenated per sample.
            h_n = result[1][0]
            feat = h_n[-self.num_directions :].transpose(0, 1).flatten(1)
        return self.head(feat)
