"""GPT-2 small (124M): pre-LN causal decoder, 12 layers, d=768, tied embeddings.

The ``GPT`` class here is also used by ``gpt_7b``; only the sizes differ.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from fxmem.results import ModelSpec

from ._transformer import Block

__all__ = ["GPT", "build"]


class GPT(nn.Module):
    """Token + learned position embedding, ``layers`` pre-LN blocks, final LN, LM head."""

    _tp_plan: ClassVar[dict[str, str]] = {
        "blocks.*.attn.qkv": "colwise",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise",
    }
    """Tensor parallel (in HF's ``_tp_plan`` form, see fxmem/parallel/tensor.py): Megatron's split of
    each block, attention's fused projection and the MLP's first layer by output features, their
    second layers by input features, so each block all-reduces twice in forward and twice in
    backward. The fused projection's rows are sliced as they lie; Megatron orders them by head
    (each head's q, k and v rows together) so that a slice holds whole heads, which changes no size.
    The embeddings and the tied LM head stay replicated."""

    _sp_plan: ClassVar[dict[str, str]] = {
        "drop": "sequence_shard_input",
        "blocks.*.ln1": "sequence_parallel_gather_output",
        "blocks.*.attn.qkv": "colwise",
        "blocks.*.attn.proj": "rowwise_scatter_output",
        "blocks.*.ln2": "sequence_parallel_gather_output",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise_scatter_output",
        "ln_f": "sequence_parallel_gather_output",
    }
    """``_tp_plan`` with sequence parallel (Note [Sequence parallel] in fxmem/parallel/tensor.py):
    between the sharded layers each rank holds S/T positions of the residual stream. The stream is
    split at the embeddings' dropout, which then keeps S/T of its noise: the token and position
    embeddings (the token one tied to the LM head) stay replicated, their sum whole on every rank.
    The second layers reduce-scatter, the norms run on the rank's positions and all-gather their
    output for the fused projection, the MLP and the tied LM head, whose logits stay whole."""

    def __init__(
        self,
        vocab: int,
        context: int,
        dim: int,
        layers: int,
        heads: int,
        dropout: float,
        tied: bool = True,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(
            *(Block(dim, heads, 4 * dim, dropout, causal=True, gelu="tanh") for _ in range(layers))
        )
        self.ln_f = nn.LayerNorm(dim)
        # Tied (GPT-2): the LM head reuses tok.weight in forward. Assigning head.weight =
        # tok.weight would tie too, but Module.to_empty() rebuilds each module's parameters
        # separately and silently unties them, doubling the count on materialized models.
        self.head = None if tied else nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Map token ids (B, S) to next-token logits (B, S, vocab)."""
        # arange(S) is computed in forward, not stored: no buffer for the engine to materialize.
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        h = self.ln_f(self.blocks(x))
        return F.linear(h, self.tok.weight) if self.head is None else self.head(h)


def build(test: bool = False) -> ModelSpec:
    """GPT-2 small at context 1024; ``test`` gives a 2-layer d=32 model at context 16."""
    if test:
        vocab, ctx, dim, layers, heads = 101, 16, 32, 2, 4
    else:
        vocab, ctx, dim, layers, heads = 50257, 1024, 768, 12, 12
    model = GPT(vocab, ctx, dim, layers, heads, dropout=0.1, tied=True)
    return ModelSpec(model, [f"B,{ctx}:int64"], loss="lm_cross_entropy", name="gpt2-small")
