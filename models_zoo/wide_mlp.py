"""Very wide MLP on MNIST-sized inputs (784 -> 8192 x3 -> 10, ~141M params).

Weights dominate activations here, the opposite regime to the conv and
attention models, which is why it is in the zoo.
"""

from __future__ import annotations

from torch import nn

from fxmem.results import ModelSpec

__all__ = ["build", "wide_mlp"]


def wide_mlp(inp: int, width: int, classes: int, dropout: float = 0.1) -> nn.Sequential:
    """Three ReLU hidden layers of ``width``, LayerNorm after the first, dropout before the head."""
    return nn.Sequential(
        nn.Linear(inp, width), nn.LayerNorm(width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(),
        nn.Dropout(dropout), nn.Linear(width, classes),
    )  # fmt: skip


def build(test: bool = False) -> ModelSpec:
    """Width 8192; ``test`` gives width 64 on the same 784-wide input."""
    width = 64 if test else 8192
    return ModelSpec(wide_mlp(784, width, 10), ["B,784"], loss="cross_entropy", name="wide-mlp")
