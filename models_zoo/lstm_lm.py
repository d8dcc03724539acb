"""Two-layer LSTM language model (vocab 10000, hidden 1024, ~37M params) on 256-token sequences.

``nn.LSTM`` is a leaf for torch.fx, so the engine sees it as one opaque module
whose internal activations it must account for as a whole. Under FakeTensorMode
(torch 2.13) ``aten::lstm`` has no symbolic meta kernel: fake mode runs it on
real zeros and pins the batch size (a guard ``B == hint``).
"""

from __future__ import annotations

import torch
from torch import nn

from fxmem.results import ModelSpec

__all__ = ["LSTMLM", "build"]


class LSTMLM(nn.Module):
    """Embedding -> 2-layer batch-first LSTM -> Dropout -> Linear to the vocabulary."""

    def __init__(self, vocab: int, embed: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=2, batch_first=True, dropout=dropout)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, S) -> next-token logits (B, S, vocab)."""
        out = self.lstm(self.embed(idx))[0]  # drop (h, c): index the Proxy rather than unpack it
        return self.head(self.drop(out))


def build(test: bool = False) -> ModelSpec:
    """Vocab 10000, width 1024, 256 tokens; ``test``: vocab 50, embed 16, hidden 32, 12 tokens."""
    if test:
        model, seq = LSTMLM(50, 16, 32, dropout=0.2), 12
    else:
        model, seq = LSTMLM(10000, 1024, 1024, dropout=0.2), 256
    return ModelSpec(model, [f"B,{seq}:int64"], loss="lm_cross_entropy", name="lstm-lm")
