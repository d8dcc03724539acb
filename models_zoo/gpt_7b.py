"""GPT decoder at LLaMA-7B size (~6.7B params): d=4096, 32 layers, context 2048, no dropout.

Same code as ``gpt2_small`` with untied embeddings, as LLaMA has; the MLP stays
4x GELU rather than SwiGLU, which keeps the parameter count in the 7B class.
"""

from __future__ import annotations

from fxmem.results import ModelSpec

from .gpt2_small import GPT

__all__ = ["build"]


def build(test: bool = False) -> ModelSpec:
    """The 7B-class decoder; ``test`` gives a 2-layer d=32 model at context 16."""
    if test:
        vocab, ctx, dim, layers, heads = 97, 16, 32, 2, 4
    else:
        vocab, ctx, dim, layers, heads = 32000, 2048, 4096, 32, 32
    model = GPT(vocab, ctx, dim, layers, heads, dropout=0.0, tied=False)
    return ModelSpec(model, [f"B,{ctx}:int64"], loss="lm_cross_entropy", name="gpt-7b")
