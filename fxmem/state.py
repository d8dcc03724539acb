"""Stage 5: model state, the pile that depends only on the parameters: weights, buffers, gradients
and optimizer state. Tied parameters are counted once; frozen ones have no gradient and no state."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from fxmem.errors import InputSpecError
from fxmem.inputs import dtype_name
from fxmem.results import StateBytes
from fxmem.rules import Registry
from fxmem.rules.optimizers import OPTIMIZERS, OptimizerRule

__all__ = ["get_optimizer", "state_bytes"]


def get_optimizer(name: str, rules: Registry[str, OptimizerRule] = OPTIMIZERS) -> OptimizerRule:
    """Validate an optimizer name at the boundary."""
    rule = rules.lookup(name)
    if not isinstance(rule, OptimizerRule):
        raise InputSpecError(f"unknown optimizer '{name}'; use one of: {', '.join(rules.rules())}.")
    return rule


def state_bytes(model: nn.Module, *, optimizer: OptimizerRule, param_dtype: torch.dtype | None = None) -> StateBytes:
    """Count weights, buffers, gradients and optimizer state; ``param_dtype`` overrides floating params' dtype."""
    params = list(model.parameters())  # unique by identity: tied weights once
    size = lambda p: torch.empty((), dtype=_dtype(p, param_dtype)).element_size()
    by_dtype: Counter[str] = Counter()
    for p in params:
        by_dtype[dtype_name(_dtype(p, param_dtype))] += p.numel() * size(p)
    trainable = [p for p in params if p.requires_grad]
    return StateBytes(
        parameters=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in trainable),
        weights=sum(by_dtype.values()),
        weights_by_dtype=dict(by_dtype),
        buffers=sum(b.numel() * b.element_size() for b in model.buffers()),
        gradients=sum(p.numel() * size(p) for p in trainable),
        optimizer=sum(optimizer.state_bytes(p.numel(), size(p)) for p in trainable),
        optimizer_name=optimizer.name,
    )


def _dtype(p: torch.Tensor, override: torch.dtype | None) -> torch.dtype:
    return override if override is not None and p.is_floating_point() else p.dtype
