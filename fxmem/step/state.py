"""Model state, the pile that depends only on the parameters: weights, buffers, gradients,
an fp32 master copy and optimizer state. Tied parameters are counted once; frozen ones have no
gradient, no master copy and no state.

The step is simulated with the model's own dtypes (or a recipe's low-precision weights); what one GPU
holds beyond that simulated state is a ``HeldState`` (``held_state``), which ``hold_state`` puts into a
simulated timeline for the step's peak. See Note [The state the peak holds].

Without a ``precision`` recipe every parameter keeps its own dtype (or ``param_dtype``) for its
weights, gradient and optimizer state. With one, the recipe (fxmem/step/precision.py) fixes the bytes of
each floating parameter; buffers keep their dtype either way. Sharding across GPUs is applied to
the result afterwards (fxmem/step/sharding.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from fractions import Fraction

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from fxmem.errors import InputSpecError
from fxmem.inputs import dtype_name
from fxmem.results import Category, MemoryEvent, PerGpuState, Phase, StateBytes, Timeline
from fxmem.rules import Registry
from fxmem.rules.nf4 import quantized_format, quantized_parameter_count, quantized_weight_bytes
from fxmem.rules.optimizers import OPTIMIZERS, OptimizerRule
from fxmem.step.precision import PrecisionRecipe, get_recipe
from fxmem.step.training import TARGETS
from fxmem.symbolic import ByteExpr

__all__ = ["TARGETS", "HeldState", "get_optimizer", "held_state", "hold_state", "state_bytes"]


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
    frozen: Counter[str] = Counter()
    counted: set[StorageWeakRef] = set()  # a storage two 4-bit weights' states share counts once
    for p, s in zip(params, sizes):
        dtype, nbytes = _weight_bytes(p, s, counted)
        by_dtype[dtype] += nbytes
        if not p.requires_grad:
            frozen[dtype] += nbytes
    trainable = [(p, s) for p, s in zip(params, sizes) if p.requires_grad]
    return StateBytes(
        parameters=sum(quantized_parameter_count(p) for p in params),
        trainable=sum(p.numel() for p, _ in trainable),
        weights=sum(by_dtype.values()),
        weights_by_dtype=dict(by_dtype),
        buffers=sum(b.numel() * b.element_size() for b in model.buffers()),
        gradients=sum(p.numel() * s.gradient for p, s in trainable),
        optimizer=sum(optimizer.state_bytes(p.shape, s.optimizer, impl=optimizer_impl, target=target) for p, s in trainable),
        optimizer_name=optimizer.name,
        master=sum(p.numel() * s.master for p, s in trainable),
        precision=recipe.name if recipe is not None else "",
        frozen_by_dtype=dict(frozen),
    )


def _weight_bytes(p: torch.Tensor, s: _Sizes, counted: set[StorageWeakRef]) -> tuple[str, int]:
    """(dtype, bytes) of ``p``'s weights: a 4-bit weight's as stored, codes, scales and tables (Note
    [What a 4-bit weight holds] in fxmem/rules/nf4.py), under its format's name; else numel x size."""
    quantized = quantized_weight_bytes(p, counted)
    if quantized is None:
        return s.weight_dtype, p.numel() * s.weight
    return quantized_format(p) or s.weight_dtype, quantized


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


# Note [The state the peak holds]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A recipe with low-precision weights converts the model before the step is simulated, so the
# timeline holds bf16 weights, bf16 gradients and bf16 optimizer state, and no master copy. Under
# ``mixed`` one GPU holds 2 + 2 + 4 + 2 x 4 bytes per Adam parameter (fxmem/step/precision.py), the
# simulated step 2 + 2 + 2 x 2. The device replay scales each state storage by its category's
# per-GPU bytes over simulated bytes and places the missing storages first (Note [Per-GPU state in
# the replay] in fxmem/gpu/device.py); the step's peak in tensor bytes (``StepPeaks``) does the same
# through ``hold_state``, on either target, with the ratios ``held_state`` takes from the same two
# counts as ``device_model`` (tests/test_state.py holds them equal). Scaling a category scales every
# storage in it alike, so its total is the per-GPU one; an optimizer's 4-byte step counters, fp32
# under every recipe, scale with its moments (a few bytes per parameter tensor). The master copy is
# counted as optimizer state, as ZeRO counts it (Rajbhandari et al. 2020, section 3.1: "the optimizer
# states ... fp32 copy of the parameters, momentum and variance"); a sharding stage's gathered
# parameters as parameters. The timelines themselves stay as simulated: the replay scales them on
# its own, and their op costs are what was run.


@dataclass(frozen=True)
class HeldState:
    """What one GPU holds of the state beyond the simulated step's. See Note [The state the peak holds]."""

    scale: Mapping[Category, Fraction]
    """Per-GPU bytes over simulated bytes, per state category; the optimizer step's temporaries follow
    OPTIMIZER_STATE (the step runs over the fp32 master copy where there is one)."""
    extra: tuple[tuple[str, int, str], ...] = ()
    """Per-GPU storages the simulated step lacks, as (name, bytes, why): master weights, gathered units."""

    def factor(self, category: Category, phase: Phase | None = None) -> Fraction:
        if phase == Phase.OPTIMIZER and category == Category.TEMPORARY:
            category = Category.OPTIMIZER_STATE
        return self.scale.get(category, Fraction(1))

    @property
    def unchanged(self) -> bool:
        """Nothing to add or scale: no recipe beyond the simulated dtypes, one GPU."""
        return not self.extra and all(f == 1 for f in self.scale.values())


_EXTRA_CATEGORY = {"master weights": Category.OPTIMIZER_STATE, "gathered parameters": Category.PARAMETER}
"""The category each per-GPU extra is counted in. See Note [The state the peak holds]."""


def held_state(simulated: StateBytes, per_gpu: PerGpuState) -> HeldState:
    """``per_gpu`` (what one GPU holds under the recipe and sharding stage) over ``simulated`` (the
    state the timeline holds: the model's own dtypes, or the recipe's weight dtype, on one GPU).

    >>> from fxmem.step.sharding import shard_state
    >>> m, sgd = nn.Linear(1000, 1000), get_optimizer("sgd-momentum")   # 1,001,000 params
    >>> one_gpu = shard_state(state_bytes(m, optimizer=sgd, precision="mixed"), world_size=1, stage="none")
    >>> held = held_state(state_bytes(m, optimizer=sgd, param_dtype=torch.bfloat16), one_gpu)  # the bf16 step's
    >>> held.factor(Category.OPTIMIZER_STATE), held.extra[0][:2]   # fp32 momentum held, 4 B/param of master
    (Fraction(2, 1), ('master weights', 4004000))
    """
    ratio = lambda per, sim: Fraction(per, sim) if sim else Fraction(1)
    optimizer, gradients = per_gpu.optimizer.nbytes, per_gpu.gradients.nbytes
    state = ratio(optimizer, simulated.optimizer) if simulated.optimizer else ratio(gradients, simulated.gradients)
    scale = {
        Category.PARAMETER: ratio(per_gpu.weights.nbytes, simulated.weights),
        Category.GRADIENT: ratio(gradients, simulated.gradients),
        Category.OPTIMIZER_STATE: state,
    }
    lines = (("master weights", per_gpu.master), ("gathered parameters", per_gpu.gathered))
    extra = tuple((name, line.nbytes, line.why) for name, line in lines if line.nbytes)
    return HeldState(scale, extra)


def hold_state(timeline: Timeline, held: HeldState | None) -> Timeline:
    """``timeline`` with its state as one GPU holds it: each state storage scaled, the extras added to
    the baseline (the step starts with them, as the replay places them). Events keep their order, so an
    index into one timeline's events is an index into the other's. See Note [The state the peak holds]."""
    if held is None or held.unchanged:
        return timeline
    storages = tuple((c, _times(n, held.factor(c))) for c, n in timeline.baseline_storages)
    baseline = dict(timeline.baseline)
    for c, n in timeline.baseline.items():
        if held.factor(c) != 1:
            own = [m for k, m in storages if k == c]
            baseline[c] = ByteExpr.total(own) if own else _times(n, held.factor(c))
    for name, nbytes, _ in held.extra:
        c = _EXTRA_CATEGORY[name]
        storages += ((c, ByteExpr(fixed=nbytes)),)
        baseline[c] = baseline.get(c, ByteExpr()) + ByteExpr(fixed=nbytes)
    events = tuple(_held_event(e, held) for e in timeline.events)
    return replace(timeline, baseline=baseline, events=events, baseline_storages=storages)


def _held_event(e: MemoryEvent, held: HeldState) -> MemoryEvent:
    factor = held.factor(e.category, e.phase)
    return e if factor == 1 else replace(e, nbytes=_times(e.nbytes, factor))


def _times(n: ByteExpr, factor: Fraction) -> ByteExpr:
    """``n`` scaled by ``factor``, each coefficient rounded up as the replay rounds a storage's bytes
    (fxmem/gpu/device.py ``_scaled``). State storages are constants (a parameter's size), so the two agree."""
    up = lambda c: -(-c * factor.numerator // factor.denominator)
    if factor == 1:
        return n
    return ByteExpr(up(n.per_sample), up(n.fixed), tuple(up(c) for c in n.higher), tuple((i, j, up(c)) for i, j, c in n.seq_terms))
