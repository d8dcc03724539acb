"""What the GPU shows (cuda target) for the simulated step, per GPU.

The timeline (fxmem/step/timeline.py) lists every storage the step makes, at its exact size. A GPU shows more:

- every block goes through PyTorch's CUDA caching allocator, which rounds it and caches segments
  (``fxmem/gpu/allocator.py``): ``torch.cuda.max_memory_allocated()`` is the replayed peak of blocks,
  ``max_memory_reserved()`` that of segments;
- fixed costs outside the model (``fxmem/gpu/overheads.py``): cuBLAS workspaces go through the allocator
  and are replayed as blocks the step starts with; the CUDA context is only in nvidia-smi's figure;
- the optimizer's ``step`` counters live on the host unless the optimizer is fused (Note [Where step
  lives] in fxmem/rules/optimizers.py), so the replay leaves out the optimizer's host scalars;
- the per-GPU share of the state under a precision recipe and a sharding stage (``fxmem/step/precision.py``,
  ``fxmem/step/sharding.py``). See Note [Per-GPU state in the replay].

The device total, what nvidia-smi would print for the process, is the reserved peak plus the driver's
lines. Every replay runs against the device's memory (``budget``, the GPU's unless ``--device-memory``
says otherwise): ``cudaMalloc`` can have the budget less the driver's lines, and a memory fraction caps
reserved memory further. Where a segment does not fit, the allocator releases its cache and retries as
torch does, a cuDNN workspace that does not fit gives way to an engine without one, and only where
torch would raise out-of-memory does the step not fit (``DevicePeak.fits``); see Note [When cudaMalloc
fails] in fxmem/gpu/allocator.py. So near the limit the reserved peak is what torch would hold there,
not what an unbounded cache would.

One steady step is replayed from an empty cache. ``max_memory_allocated`` depends only on which blocks
are live and how each request is rounded or left unsplit, so it is the figure to compare with a GPU;
the reserved peak, and so nvidia-smi's total, is an estimate: a long run's cache also holds the
segments earlier steps split in their own pattern.

Note [Per-GPU state in the replay]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The step is simulated once, on one GPU, with the model's own dtypes (a recipe with low-precision
weights converts the model before tracing, so weights, gradients and activations are simulated in it).
What a recipe or a sharding stage changes beyond that is state: each weight, gradient and optimizer
state storage is scaled by the ratio of its per-GPU bytes (``shard_state``) to the simulated bytes, the
optimizer step's temporaries by the optimizer state's ratio (the step runs on the shard, over the fp32
master copy where there is one), and the per-GPU storages the simulated step lacks (the fp32 master
copy, ZeRO-3/FSDP's all-gathered units) are placed at the start. Without a recipe and with one GPU every
ratio is 1 and the replay is exactly the simulated step. With sharding it is an estimate: collective
buffers (NCCL, DeepSpeed's reduce buckets) are not modelled, and gradients are counted at their shard
size from the moment they are made.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from fractions import Fraction

from fxmem.gpu.alloc_conf import DEFAULT_ALLOC_CONF, AllocatorConfig
from fxmem.gpu.allocator import FREE, AllocatorReplay, replay
from fxmem.gpu.gpus import GpuSpec
from fxmem.gpu.overheads import Overheads, cuda_overheads
from fxmem.results import Category, DevicePeak, MemoryEvent, PerGpuState, Phase, StateBytes, Timeline
from fxmem.rules import TorchRelease
from fxmem.rules.cudnn_conv import CUDNN_CONV_WORKSPACE

__all__ = ["DeviceModel", "device_model", "replay_step"]

_HOST_SCALAR_OP = "aten.lift_fresh"
"""How a non-fused optimizer makes its ``step`` counters and scalar operands: ``torch.tensor(...)``,
which a CUDA run leaves on the host. In the optimizer step only scalars are made this way."""


@dataclass(frozen=True)
class DeviceModel:
    """How one GPU holds the simulated step: its allocator, fixed costs and per-GPU state."""

    gpu: GpuSpec
    overheads: Overheads
    host_scalars: bool
    """The optimizer's 0-dim ``torch.tensor`` scalars stay on the host (every implementation but fused)."""
    scale: Mapping[Category, Fraction]
    """Per-GPU bytes over simulated bytes, per state category; the optimizer's temporaries follow
    OPTIMIZER_STATE. See Note [Per-GPU state in the replay]."""
    extra: tuple[tuple[str, int, str], ...] = ()
    """Per-GPU storages the simulated step lacks, as (name, bytes, why): master weights, gathered units."""
    budget: int | None = None
    """The device memory every replay runs against; None: the GPU's (``GpuSpec.memory_bytes``)."""
    alloc: AllocatorConfig = DEFAULT_ALLOC_CONF
    """``PYTORCH_CUDA_ALLOC_CONF``'s settings and the memory fraction (fxmem/gpu/alloc_conf.py)."""

    @property
    def memory(self) -> int:
        """The device memory the step must fit in."""
        return self.gpu.memory_bytes if self.budget is None else self.budget


def device_model(
    gpu: GpuSpec,
    overrides: Mapping[str, int],
    *,
    fused: bool,
    simulated: StateBytes,
    per_gpu: PerGpuState,
    release: TorchRelease | None = None,
    budget: int | None = None,
    alloc: AllocatorConfig = DEFAULT_ALLOC_CONF,
) -> DeviceModel:
    """The device model for ``gpu``: ``simulated`` is the state the timeline holds (the model's own
    dtypes on one GPU), ``per_gpu`` what one GPU holds under the recipe and sharding stage."""
    ratio = lambda per, sim: Fraction(per, sim) if sim else Fraction(1)
    state = (
        ratio(per_gpu.optimizer.nbytes, simulated.optimizer)
        if simulated.optimizer
        else ratio(per_gpu.gradients.nbytes, simulated.gradients)
    )
    scale = {
        Category.PARAMETER: ratio(per_gpu.weights.nbytes, simulated.weights),
        Category.GRADIENT: ratio(per_gpu.gradients.nbytes, simulated.gradients),
        Category.OPTIMIZER_STATE: state,
    }
    extra = tuple(
        (name, line.nbytes, line.why)
        for name, line in (("master weights", per_gpu.master), ("gathered parameters", per_gpu.gathered))
        if line.nbytes
    )
    overheads = cuda_overheads(gpu, release=release).with_overrides(overrides)
    return DeviceModel(gpu, overheads, host_scalars=not fused, scale=scale, extra=extra, budget=budget, alloc=alloc)


def replay_step(timeline: Timeline, batch: int, seq: int | None, model: DeviceModel) -> DevicePeak:
    """Replay the step at ``batch`` through the caching allocator, on top of the fixed costs, against
    the device's memory (``model.memory``)."""
    if not _runs_cudnn(timeline):
        model = replace(model, overheads=model.overheads.without("cudnn_kernels"))
    initial = list(_initial(timeline, batch, seq, model))
    events = list(_events(timeline.events, batch, seq, model))
    capacity = max(model.memory - model.overheads.driver_bytes, 0)
    limit = int(model.alloc.memory_fraction * model.memory) if model.alloc.memory_fraction is not None else None
    result = replay(events, initial=initial, capacity=capacity, limit=limit, config=model.alloc)
    named = _named_events(timeline.events, model)
    return DevicePeak(
        gpu=model.gpu.name,
        allocated=result.peak_allocated,
        reserved=result.peak_reserved,
        total=model.overheads.nvidia_smi(result.peak_reserved),
        capacity=model.memory,
        overheads=tuple(model.overheads.lines()),
        extra=model.extra,
        fits=result.fits,
        oom_node=_where(named, result.oom_at),
        shrunk=tuple(dict.fromkeys(_where(named, i) for i in result.shrunk)),
        alloc_conf=model.alloc.describe(),
        short=_short(result, capacity, limit),
    )


def _short(result: AllocatorReplay, capacity: int, limit: int | None) -> int:
    """Bytes the allocator lacked: its reserved peak (carried on past the failure) over its bound."""
    if result.fits:
        return 0
    bound = capacity if limit is None else min(capacity, limit)
    return max(result.peak_reserved - bound, 1)


def _named_events(events: tuple[MemoryEvent, ...], model: DeviceModel) -> list[MemoryEvent]:
    """The timeline's events in the order ``_events`` hands them to the allocator (host scalars left out)."""
    return [e for e, _ in _paired(events, model)]


def _where(named: list[MemoryEvent], index: int | None) -> str:
    """The node and phase of the replayed event ``index`` ("" for None; "the model state" for -1)."""
    if index is None:
        return ""
    if index < 0:
        return "the model state before the step"
    e = named[index]
    return f"{e.node} ({e.phase.value})" if e.node else e.phase.value


_CUDNN_OPS = frozenset({"aten.convolution", "aten._cudnn_rnn", "aten._scaled_dot_product_cudnn_attention", "aten.cudnn_batch_norm"})
"""The ops of a cuda-target step that call cuDNN, whose kernels are then loaded (CUDNN_KERNELS_BYTES)."""


def _runs_cudnn(timeline: Timeline) -> bool:
    return any(c.op in _CUDNN_OPS for c in timeline.costs) or any(e.op in _CUDNN_OPS for e in timeline.events)


def _initial(timeline: Timeline, batch: int, seq: int | None, model: DeviceModel) -> Iterator[tuple[int, int]]:
    """What the allocator holds before the step: workspaces, per-GPU extras, then the baseline storages.
    Their ids are negative, apart from the timeline's storage numbers."""
    sizes = [*model.overheads.initial_allocations(), *(nbytes for _, nbytes, _ in model.extra)]
    sizes += [_scaled(category, nbytes.at(batch, seq), model) for category, nbytes in timeline.baseline_storages]
    for i, nbytes in enumerate(sizes):
        yield -(i + 1), nbytes


def _events(events: tuple[MemoryEvent, ...], batch: int, seq: int | None, model: DeviceModel) -> Iterator[tuple[int, ...]]:
    """The allocator's events; a cuDNN convolution workspace is optional (Note [A workspace that does not fit])."""
    for e, category in _paired(events, model):
        if not e.alloc:
            yield (e.storage, FREE)
            continue
        nbytes = _scaled(category, e.nbytes.at(batch, seq), model)
        yield (e.storage, nbytes, True) if e.bound is not None and e.bound.what == CUDNN_CONV_WORKSPACE else (e.storage, nbytes)


def _paired(events: tuple[MemoryEvent, ...], model: DeviceModel) -> Iterator[tuple[MemoryEvent, Category]]:
    """Each event the GPU's allocator sees, with the category its bytes scale by: the optimizer's
    host scalars are left out (Note [Where step lives] in fxmem/rules/optimizers.py)."""
    host: set[int] = set()
    for e in events:
        if e.alloc and model.host_scalars and e.phase == Phase.OPTIMIZER and e.op == _HOST_SCALAR_OP:
            host.add(e.storage)
        if e.storage in host:
            if not e.alloc:
                host.discard(e.storage)
            continue
        yield e, (Category.OPTIMIZER_STATE if e.phase == Phase.OPTIMIZER and e.category == Category.TEMPORARY else e.category)


def _scaled(category: Category, nbytes: int, model: DeviceModel) -> int:
    factor = model.scale.get(category, Fraction(1))
    return nbytes if factor == 1 else -(-nbytes * factor.numerator // factor.denominator)
