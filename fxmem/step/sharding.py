"""Model state per GPU when N data-parallel GPUs share it: DeepSpeed ZeRO stages 1-3 and PyTorch FSDP.

ZeRO (Rajbhandari et al. 2020, section 5) partitions the state of mixed-precision Adam, 2 + 2 + K
bytes per parameter, in three steps: stage 1 the optimizer state and the fp32 master copy (the K),
stage 2 also the gradients, stage 3 also the weights. FSDP's FULL_SHARD shards what stage 3 does.
Buffers are never sharded: every GPU keeps its own copy (DDP, ZeRO and FSDP alike).

Sharding weights has a price: before a unit of the model runs, its parameters are all-gathered to
full size in the compute dtype, and freed after it ran. See Note [Gathered units] for which units and
how many are alive at once.

>>> from fxmem.results import StateBytes
>>> psi = 1_000_000   # mixed-precision Adam: 2 + 2 bytes, 4 master, 8 state per parameter
>>> s = StateBytes(psi, psi, 2 * psi, {"bfloat16": 2 * psi}, 0, 2 * psi, 8 * psi, "adam", 4 * psi, "mixed")
>>> shard_state(s, world_size=4, stage="zero2").total   # 2 psi + 14 psi / 4
5500000
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from torch import nn

from fxmem.errors import InputSpecError
from fxmem.results import Category, Peak, PerGpuState, Phase, ShardLine, StateBytes, Timeline
from fxmem.rules.optimizers import OptimizerRule
from fxmem.step.precision import get_recipe

__all__ = ["STAGES", "check_plan", "engine_share", "fsdp_units", "offloaded_state", "shard_state", "units_of"]

STAGES = ("none", "zero1", "zero2", "zero3", "fsdp")

# Note [Gathered units]
# ZeRO-3 gathers the parameters of each submodule just before it runs (a pre-forward hook per module,
# ``module.parameters(recurse=False)``): its unit is one module's own parameters, and DeepSpeed's own
# estimate, ``estimate_zero3_model_states_mem_needs`` with ``model_to_params`` in
# deepspeed/runtime/zero/stage3.py, charges the largest such "layer". It prefetches the next modules'
# parameters up to ``stage3_prefetch_bucket_size`` (default 5e7 elements, deepspeed/runtime/zero/
# config.py); we count one prefetched unit, the second largest, which holds when units are large and
# undercounts when many small ones fit in the bucket. Parameters under ``stage3_param_persistence_
# threshold`` (1e5 elements) stay unpartitioned in DeepSpeed; that is not modelled.
# FSDP's unit is each wrapped module (with transformer_auto_wrap_policy, each block; the root unit keeps
# the rest). With the defaults ``backward_prefetch=BackwardPrefetch.BACKWARD_PRE`` and
# ``limit_all_gathers=True`` (FullyShardedDataParallel.__init__, torch/distributed/fsdp/
# fully_sharded_data_parallel.py), backward holds "the current set of parameters, next set of
# parameters, and current set of gradients" at its peak (BackwardPrefetch's docstring, torch/
# distributed/fsdp/api.py): two units' parameters and one unit's unsharded gradient. The rate limiter
# keeps at most two units' all-gathers alive in forward too. With one GPU there is nothing to gather
# (FSDP then runs NO_SHARD).


def shard_state(state: StateBytes, *, world_size: int, stage: str, units: Sequence[tuple[str, int]] = ()) -> PerGpuState:
    """Divide ``state`` (the whole model's, from ``state_bytes``) among ``world_size`` GPUs.

    ``units`` are (name, parameter count) of what zero3/fsdp gather at a time (see ``units_of``); without
    them the gathered parameters are left out, and the line says so.
    """
    check_plan(world_size, stage)
    level = STAGES.index(stage) if stage != "fsdp" else STAGES.index("zero3")
    split = lambda nbytes, at: _split(nbytes, world_size) if level >= at and world_size > 1 else nbytes
    who = "FSDP FULL_SHARD" if stage == "fsdp" else f"ZeRO stage {level}"
    return PerGpuState(
        stage,
        world_size,
        _line(split(state.weights, 3), f"weights sharded 1/{world_size} by {who}", "weights replicated on every GPU", level >= 3),
        ShardLine(state.buffers, "buffers replicated on every GPU (never sharded)"),
        _line(split(state.gradients, 2), f"gradients reduce-scattered, 1/{world_size} kept", "full gradients on every GPU", level >= 2),
        _line(split(state.master, 1), f"fp32 master weights sharded 1/{world_size}", "fp32 master weights on every GPU", level >= 1),
        _line(split(state.optimizer, 1), f"optimizer state sharded 1/{world_size}", "optimizer state on every GPU", level >= 1),
        _gathered(state, stage, world_size, units) if level >= 3 else ShardLine(0, "nothing gathered: full weights stay resident"),
    )


def check_plan(world_size: object, stage: str) -> None:
    """A world size and stage the sharding model knows; anything else is an InputSpecError."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise InputSpecError(f"world_size must be a whole number of GPUs, 1 or more; got {world_size!r}.")
    if stage not in STAGES:
        raise InputSpecError(f"unknown shard stage '{stage}'; use one of: {', '.join(STAGES)}.")


def _split(nbytes: int, world_size: int) -> int:
    """One GPU's share; partitions are padded to equal size, so the share rounds up."""
    return math.ceil(nbytes / world_size)


def _line(nbytes: int, sharded: str, replicated: str, is_sharded: bool) -> ShardLine:
    return ShardLine(nbytes, sharded if is_sharded else replicated)


def _gathered(state: StateBytes, stage: str, world_size: int, units: Sequence[tuple[str, int]]) -> ShardLine:
    """See Note [Gathered units]."""
    if world_size == 1:
        return ShardLine(0, "one GPU: nothing to all-gather")
    if not units:
        return ShardLine(0, "units unknown: the all-gathered parameters are not counted (pass units_of(model))")
    ranked = sorted(units, key=lambda u: u[1], reverse=True)
    (big, n_big), second = ranked[0], ranked[1] if len(ranked) > 1 else ("", 0)
    weight, grad = _element_sizes(state)
    nbytes = (n_big + second[1]) * weight
    why = f"all-gathered parameters of the largest unit ({big}) and one prefetched unit ({second[0] or 'none'})"
    if stage == "fsdp":
        nbytes += n_big * grad
        why += ", plus the largest unit's unsharded gradient before its reduce-scatter"
    return ShardLine(nbytes, why)


def _element_sizes(state: StateBytes) -> tuple[int, int]:
    """Bytes per element of the gathered weights and gradients: the recipe's, else the model's average."""
    if state.precision:
        recipe = get_recipe(state.precision)
        return recipe.weights, recipe.gradients
    weight = round(state.weights / state.parameters) if state.parameters else 0
    grad = round(state.gradients / state.trainable) if state.trainable else 0
    return weight, grad


def units_of(model: nn.Module, stage: str = "fsdp") -> list[tuple[str, int]]:
    """What ``stage`` gathers at a time, as (fqn, parameter count); tied parameters count once.

    "zero3": every module's own parameters (DeepSpeed's fetch unit). Otherwise FSDP's default wrap:
    each child of the largest container of repeated blocks (a ModuleList, or a Sequential of one block
    type), plus "(rest)" for the parameters outside them; without such a container, each top-level
    child plus "(root)" for the root's own parameters.

    >>> units_of(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    [('0', 20), ('2', 10)]
    """
    check_plan(1, stage)
    if stage == "zero3":
        return _module_units(model)
    return _block_units(model)


def _module_units(model: nn.Module) -> list[tuple[str, int]]:
    seen: set[int] = set()
    units = [(fqn or "(root)", _count(m.parameters(recurse=False), seen)) for fqn, m in model.named_modules()]
    return [(fqn, n) for fqn, n in units if n]


def _block_units(model: nn.Module) -> list[tuple[str, int]]:
    containers = [(fqn, m) for fqn, m in model.named_modules() if fqn and _repeated(m)]
    seen: set[int] = set()
    if containers:
        fqn, blocks = max(containers, key=lambda c: _count(c[1].parameters(), set()))
        units = [(f"{fqn}.{name}", _count(child.parameters(), seen)) for name, child in blocks.named_children()]
        units.append(("(rest)", _count(model.parameters(), seen)))
    else:
        units = [(name, _count(child.parameters(), seen)) for name, child in model.named_children()]
        units.append(("(root)", _count(model.parameters(), seen)))
    return [(fqn, n) for fqn, n in units if n]


def _repeated(m: nn.Module) -> bool:
    """A container of two or more blocks: a ModuleList, or a Sequential whose children share one type."""
    children = list(m.children())
    if len(children) < 2:
        return False
    return isinstance(m, nn.ModuleList) or (isinstance(m, nn.Sequential) and len({type(c) for c in children}) == 1)


def _count(params: Iterator[nn.Parameter], seen: set[int]) -> int:
    """Elements of the parameters not seen yet; marks them seen."""
    total = 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def fsdp_units(model: nn.Module) -> tuple[str, ...]:
    """The modules ``--fsdp`` wraps with ``fully_shard`` before the root: FSDP's default units of
    ``units_of`` (each repeated block; else each top-level child), the root's own parameters aside."""
    return tuple(fqn for fqn, _ in _block_units(model) if not fqn.startswith("("))


def engine_share(
    steady: Timeline,
    peak: Peak,
    batch: int,
    seq: int | None,
    world_size: int,
    engine: str = "FSDP2",
    host: tuple[int, int, int] | None = None,
) -> PerGpuState:
    """One rank's state as the simulated step of the real engine holds it (fxmem/parallel), not by
    formula: the shards it starts with, the sharded gradients the step makes, and the engine's
    buffers at the peak. With ``host`` (``offloaded_state``'s weights, gradients and optimizer
    state), FSDP2's CPU offload: the device holds none of the state (Note [FSDP2's CPU offload] in
    fxmem/parallel/fsdp.py)."""
    if host is not None:
        return _offloaded_share(steady, peak, batch, seq, world_size, host)
    at = lambda c: steady.baseline[c].at(batch, seq) if c in steady.baseline else 0
    grads = sum(e.nbytes.at(batch, seq) for e in steady.events if e.alloc and e.category == Category.GRADIENT and e.phase == Phase.BACKWARD)
    who = f"{engine} over {world_size} ranks, simulated"
    return PerGpuState(
        "fsdp",
        world_size,
        ShardLine(at(Category.PARAMETER), f"this rank's shards of the weights ({who})"),
        ShardLine(at(Category.BUFFER), "buffers replicated on every rank (neither engine shards them)"),
        ShardLine(grads, "this rank's gradients (FSDP2's reduce-scattered into shards), kept until zero_grad"),
        ShardLine(0, "no fp32 master copy: the shards are the weights"),
        ShardLine(at(Category.OPTIMIZER_STATE), "optimizer state of this rank's shards"),
        ShardLine(peak.breakdown.get(Category.COMMUNICATION, 0), f"{engine}'s gathered weights and collective buffers alive at the peak"),
    )


def _offloaded_share(steady: Timeline, peak: Peak, batch: int, seq: int | None, world_size: int, host: tuple[int, int, int]) -> PerGpuState:
    """``engine_share`` under CPU offload: the state lines say what host memory holds, the device none of it."""
    weights, gradients, optimizer = host
    buffers = steady.baseline[Category.BUFFER].at(batch, seq) if Category.BUFFER in steady.baseline else 0
    where = f"FSDP2 over {world_size} ranks with CPUOffloadPolicy, simulated"
    return PerGpuState(
        "fsdp",
        world_size,
        ShardLine(0, f"in host memory: this rank's shards of the weights, {weights:,} B, copied to the device unit by unit ({where})"),
        ShardLine(buffers, "buffers on the device, replicated on every rank (CPU offload moves only parameters)"),
        ShardLine(0, f"in host memory: this rank's gradient shards, {gradients:,} B, each copied from the device after its reduce-scatter"),
        ShardLine(0, "no fp32 master copy: the shards are the weights"),
        ShardLine(0, f"in host memory: the optimizer state of this rank's shards, {optimizer:,} B (the optimizer step runs on the CPU)"),
        ShardLine(peak.breakdown.get(Category.COMMUNICATION, 0), "FSDP2's staged shards, gathered weights and buffers at the peak"),
    )


def offloaded_state(model: nn.Module, world_size: int, optimizer: OptimizerRule, impl: str | None) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) in host memory of rank 0 of FSDP2 over ``world_size``
    ranks with CPU offload: each parameter's shard of ceil(rows / world_size) rows of dim 0
    (``torch.chunk``, as ``FSDPParam._init_sharding_spec`` cuts it; rank 0 always has the full
    chunk), its gradient shard as large, and the optimizer's state of that shard on the CPU.

    >>> from fxmem.step.state import get_optimizer
    >>> offloaded_state(nn.Linear(3, 5), 2, get_optimizer("adamw"), "for-loop")   # 3 of 5 rows: (9 + 3) x 4 B
    (48, 48, 104)
    """
    weights = gradients = optimizer_state = 0
    for p in model.parameters():
        shape = (-(-p.shape[0] // world_size), *p.shape[1:]) if p.dim() else ()
        nbytes = math.prod(shape) * p.element_size()
        weights += nbytes
        if p.requires_grad:
            gradients += nbytes
            optimizer_state += optimizer.state_bytes(shape, p.element_size(), impl=impl, target="cpu")
    return weights, gradients, optimizer_state
