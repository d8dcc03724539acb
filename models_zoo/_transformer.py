"""Pre-LayerNorm transformer block shared by the GPT and ViT zoo models.

Attention goes through ``F.scaled_dot_product_attention`` so the causal mask is
built inside the kernel: no mask buffer to precompute, which keeps the module
safe to build on the meta device and materialize with ``to_empty()``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLP", "Block", "SelfAttention"]


class SelfAttention(nn.Module):
    """Multi-head self-attention with a fused QKV projection (GPT-2 / ViT layout)."""

    def __init__(self, dim: int, heads: int, dropout: float, causal: bool) -> None:
        super().__init__()
        self.heads, self.head_dim, self.p, self.causal = heads, dim // heads, dropout, causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, S, D) -> (B, H, S, D/H) without reading B or S, so fx records no shape math. The head
        count is inferred from the width, as HF's and torchtitan's attention infer it, so that a
        tensor-parallel rank holding a column slice of the projection runs its share of the heads."""
        return t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # direct unpack: fx can't iterate a Proxy in a loop
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=self.causal
        )
        return self.drop(self.proj(y.transpose(1, 2).flatten(2)))


class MLP(nn.Sequential):
    """Position-wise feed-forward: Linear -> GELU -> Linear -> Dropout."""

    def __init__(self, dim: int, hidden: int, dropout: float, gelu: str = "none") -> None:
        super().__init__(
            nn.Linear(dim, hidden),
            nn.GELU(approximate=gelu),
            nn.Linear(hidden, dim),
            nn.Dropout(dropout),
        )


class Block(nn.Module):
    """Pre-LN residual block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(
        self, dim: int, heads: int, hidden: int, dropout: float, causal: bool, gelu: str = "none"
    ) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, dropout, causal)
        self.mlp = MLP(dim, hidden, dropout, gelu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))
