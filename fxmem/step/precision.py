"""Precision recipes: how many bytes each trainable parameter costs as weights, gradients, an fp32
master copy and optimizer state, for the ways people actually train.

A recipe says nothing about activations: under autocast the low-precision copies of the weights that
matmuls consume are made during the forward and freed after backward, so they are activations (the
timeline sees them), not state. Non-trainable parameters hold only their weights; buffers (BatchNorm
statistics, position ids) keep whatever dtype they have, since no recipe casts them.

>>> RECIPES["mixed"].bytes_per_param(optimizer_states=2)   # Adam: 2 + 2 + 4 master + 2 x 4 (K = 12)
16
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from fxmem.errors import InputSpecError

__all__ = ["RECIPES", "PrecisionRecipe", "get_recipe"]


@dataclass(frozen=True)
class PrecisionRecipe:
    """Bytes per trainable parameter under one training recipe."""

    name: str
    summary: str
    """One line shown to users (``--precision`` help, the report)."""
    weight_dtype: torch.dtype
    """The dtype the model holds its floating parameters in (and computes with, outside autocast)."""
    gradient_dtype: torch.dtype
    master_dtype: torch.dtype | None
    """The dtype of a separate master copy the optimizer updates, or None when it updates the weights."""
    optimizer_dtype: torch.dtype
    """The element type of the optimizer's parameter-sized state (exp_avg, momentum, ...)."""

    @property
    def weights(self) -> int:
        return _size(self.weight_dtype)

    @property
    def gradients(self) -> int:
        return _size(self.gradient_dtype)

    @property
    def master(self) -> int:
        return 0 if self.master_dtype is None else _size(self.master_dtype)

    @property
    def optimizer(self) -> int:
        return _size(self.optimizer_dtype)

    def bytes_per_param(self, optimizer_states: int) -> int:
        """Weights + gradients + master + ``optimizer_states`` parameter-sized buffers, per parameter."""
        return self.weights + self.gradients + self.master + optimizer_states * self.optimizer


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


_F32, _BF16 = torch.float32, torch.bfloat16

RECIPES: Mapping[str, PrecisionRecipe] = MappingProxyType(
    {
        r.name: r
        for r in (
            PrecisionRecipe("fp32", "fp32 weights, gradients and optimizer state (4 + 4 bytes + state)", _F32, _F32, None, _F32),
            PrecisionRecipe(
                "amp",
                "torch.autocast over fp32 weights: state as fp32 (4 + 4 + state); the bf16/fp16 weight copies are activations",
                _F32, _F32, None, _F32,
            ),
            PrecisionRecipe("bf16", "pure bf16, model.to(torch.bfloat16): weights, gradients and optimizer state in bf16 (2 + 2 + state)", _BF16, _BF16, None, _BF16),
            PrecisionRecipe(
                "mixed",
                "Megatron/DeepSpeed mixed precision: bf16/fp16 weights and gradients, fp32 master copy and optimizer state (2 + 2 + 4 + state)",
                _BF16, _BF16, _F32, _F32,
            ),
            PrecisionRecipe(
                "mixed-fp32-grads",
                "bf16 weights, fp32 gradient accumulation, fp32 master copy and optimizer state (2 + 4 + 4 + state)",
                _BF16, _F32, _F32, _F32,
            ),
        )
    }
)
"""Built once here. The 16 bytes per Adam parameter of ``mixed`` are the ZeRO paper's 2 + 2 + K Psi with
K = 12 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
section 3.1): fp16 weights and gradients, then an fp32 master copy, momentum and variance."""


def get_recipe(name: str) -> PrecisionRecipe:
    """Validate a recipe name at the boundary."""
    if name not in RECIPES:
        raise InputSpecError(f"unknown precision '{name}'; use one of: {', '.join(RECIPES)} (see fxmem.step.precision for what each holds).")
    return RECIPES[name]
