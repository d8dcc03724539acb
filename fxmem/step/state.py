"""Model state, the pile that depends only on the parameters: weights, buffers, gradients,
an fp32 master copy and optimizer state. Tied parameters are counted once; frozen ones have no
gradient, no master copy and no state.

Without a ``precision`` recipe every parameter keeps its own dtype (or ``param_dtype``) for its
weights, gradient and optimizer state. With one, the recipe (fxmem/step/precision.py) fixes the bytes of
each floating parameter; buffers keep their dtype either way. Sharding across GPUs is applied to
the result afterwards (fxmem/step/sharding.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from fxmem.errors import InputSpecError
from fxmem.inputs import dtype_name
from fxmem.results import StateBytes
from fxmem.rules import Registry
from fxmem.rules.optimizers import OPTIMIZERS, OptimizerRule
from fxmem.step.precision import PrecisionRecipe, get_recipe
from fxmem.step.training import TARGETS

__all__ = ["TARGETS", "get_optimizer", "state_bytes"]


def get_optimizer(name: str, rules: Registry[str, OptimizerRule] = OPTIMIZERS) -> OptimizerRule:
    """Validate an optimizer name at the boundary."""
    rule = rules.lookup(name)
    if not isinstance(rule, OptimizerRule):
        raise InputSpecError(f"unknown optimizer '{name}'; use one of: {', '.join(rules.rules())}.")
    return rule


def state_bytes(
    model: nn.Module,
    *,
    optimizer: OptimizerRule,
    param_dtype: torch.dtype | None = None,
    precision: str | None = None,
    optimizer_impl: str | None = None,
    target: str = "cpu",
) -> StateBytes:
    """Count weights, buffers, gradients, master weights and optimizer state.

    ``param_dtype`` overrides floating params' dtype; ``precision`` names a recipe (it must agree with
    ``param_dtype`` when both are given); ``optimizer_impl`` and ``target`` ("cpu" or "cuda") decide
    whether the optimizer's step counters are device memory (see Note [Where step lives] in
    fxmem/rules/optimizers.py). The defaults give each parameter's own dtype on the CPU.

    >>> s = state_bytes(nn.Linear(1000, 1000), optimizer=get_optimizer("adam"), precision="mixed", target="cuda")
    >>> (s.weights, s.gradients, s.master, s.optimizer)   # 1,001,000 params x (2, 2, 4, 2 x 4) bytes
    (2002000, 2002000, 4004000, 8008000)
    """
    recipe = _recipe(precision, param_dtype)
    if target not in TARGETS:
        raise InputSpecError(f"unknown target '{target}' for state_bytes; use one of: {', '.join(TARGETS)}.")
    optimizer.flags(optimizer_impl)  # an implementation the optimizer lacks fails here, before any counting
    params = list(model.parameters())  # unique by identity: tied weights once
    sizes = [_Sizes.of(p, param_dtype, recipe) for p in params]
    by_dtype: Counter[str] = Counter()
    for p, s in zip(params, sizes):
        by_dtype[s.weight_dtype] += p.numel() * s.weight
    trainable = [(p, s) for p, s in zip(params, sizes) if p.requires_grad]
    return StateBytes(
        parameters=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p, _ in trainable),
        weights=sum(by_dtype.values()),
        weights_by_dtype=dict(by_dtype),
        buffers=sum(b.numel() * b.element_size() for b in model.buffers()),
        gradients=sum(p.numel() * s.gradient for p, s in trainable),
        optimizer=sum(optimizer.state_bytes(p.shape, s.optimizer, impl=optimizer_impl, target=target) for p, s in trainable),
        optimizer_name=optimizer.name,
        master=sum(p.numel() * s.master for p, s in trainable),
        precision=recipe.name if recipe is not None else "",
    )


@dataclass(frozen=True)
class _Sizes:
    """Bytes per element of one parameter's weights, gradient, master copy and optimizer state."""

    weight_dtype: str
    weight: int
    gradient: int
    master: int
    optimizer: int

    @staticmethod
    def of(p: torch.Tensor, param_dtype: torch.dtype | None, recipe: PrecisionRecipe | None) -> _Sizes:
        if recipe is None or not p.is_floating_point():  # integer/complex params: no recipe casts them
            dtype = param_dtype if param_dtype is not None and p.is_floating_point() else p.dtype
            size = torch.empty((), dtype=dtype).element_size()
            return _Sizes(dtype_name(dtype), size, size, 0, size)
        return _Sizes(dtype_name(recipe.weight_dtype), recipe.weights, recipe.gradients, recipe.master, recipe.optimizer)


def _recipe(precision: str | None, param_dtype: torch.dtype | None) -> PrecisionRecipe | None:
    if precision is None:
        return None
    recipe = get_recipe(precision)
    if param_dtype is not None and param_dtype != recipe.weight_dtype:
        raise InputSpecError(
            f"param_dtype {dtype_name(param_dtype)} contradicts precision '{precision}', whose weights are "
            f"{dtype_name(recipe.weight_dtype)}; drop param_dtype (the recipe sets it) or pick a recipe with "
            f"{dtype_name(param_dtype)} weights."
        )
    return recipe
