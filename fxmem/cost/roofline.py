"""A lower bound on the time of one training step, from each op's FLOPs and bytes on a named GPU.

This is a roofline, not a benchmark: each op takes at least the time to do its arithmetic at the
GPU's dense peak, and at least the time to move its bytes at peak DRAM bandwidth, whichever is longer;
the step takes at least the sum over its ops. A real step is slower: kernels reach a fraction of peak,
launches cost microseconds, and ops without a FLOP formula (see ``fxmem.engine.flops``) count only their bytes.

>>> from fxmem.gpu.gpus import get_gpu
>>> t = op_time(2 * 4096**3, 3 * 4096**2 * 2, torch.bfloat16, get_gpu("h100-80gb"))
>>> t.bound, round(t.seconds * 1e6, 1)  # microseconds
(<Bound.COMPUTE: 'compute'>, 138.9)

Note [Roofline after RuntimeEstimator]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The model is PyTorch's ``RuntimeEstimator._roofline_estimate``
(torch/distributed/_tools/runtime_estimator.py): per op ``max(compute_time, transfer_time)`` with
``compute_time = flops / peak`` (``torch.utils._runtime_estimation.get_compute_time``, the same
``flop_registry``, the dtype of the op's output) and ``transfer_time = bytes / bandwidth``
(``get_transfer_time``). It differs from ours in four ways:

- It needs CUDA: the peak comes from the running GPU (``torch._inductor.utils.get_device_tflops``: the
  datasheet table in ``torch/_inductor/analysis/device_info.py``, else Triton's clock-rate estimate)
  and the bandwidth from Triton's ``get_dram_gbps``. We take both from the datasheet of a GPU named
  in ``fxmem.gpu.gpus``, so the estimate runs on a CPU for any target.
- It derates compute: ``flops_to_ns`` divides the FLOPs by 2 (MACs) and the peak by 0.75. We divide
  FLOPs by the full dense peak, so ours stays a bound rather than a guess at achieved efficiency.
- It skips views *and* creation ops (``_IGNORE_OPS``) entirely, and reads every tensor argument even
  when one is passed twice. We charge creation ops their writes and read each tensor once
  (see Note [Bytes moved] in fxmem/engine/flops.py).
- It reports milliseconds per module; we sum seconds per phase of the step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

import torch

from fxmem.errors import InputSpecError
from fxmem.gpu.gpus import GpuSpec
from fxmem.results import Phase

__all__ = ["Bound", "OpTime", "PhaseTime", "StepTime", "op_time", "step_time"]

Cost = tuple["Phase | str", torch.dtype, float, float] | tuple["Phase | str", torch.dtype, float, float, bool]
"""One op for ``step_time``: (phase, dtype of its arithmetic, FLOPs, bytes moved[, runs fp32 as TF32])."""


class Bound(StrEnum):
    """Which roof an op hits: COMPUTE when its FLOPs at peak take longer than its bytes at full
    bandwidth (high arithmetic intensity, large matmuls), MEMORY otherwise (elementwise ops)."""

    COMPUTE = "compute"
    MEMORY = "memory"


@dataclass(frozen=True)
class OpTime:
    """The roofline time of one op: a lower bound, ``max(compute_s, memory_s)``."""

    seconds: float
    compute_s: float
    """FLOPs / dense peak FLOP/s of the dtype."""
    memory_s: float
    """Bytes moved / peak DRAM bandwidth."""
    bound: Bound
    intensity: float
    """FLOPs per byte moved (inf for an op that moves nothing)."""


def op_time(flops: float, moved_bytes: float, dtype: torch.dtype, gpu: GpuSpec, *, tf32: bool = False) -> OpTime:
    """The least time one op can take on ``gpu``: ``max(flops / peak(dtype), moved_bytes / bandwidth)``.

    An op with no FLOPs never asks for a peak, so an integer op (an index gather) costs its bytes only.
    See Note [Roofline after RuntimeEstimator].
    """
    compute_s = float(flops) / gpu.peak(dtype, tf32=tf32) if flops else 0.0
    memory_s = float(moved_bytes) / gpu.bandwidth
    bound = Bound.COMPUTE if compute_s >= memory_s and flops else Bound.MEMORY
    intensity = float(flops) / float(moved_bytes) if moved_bytes else float("inf")
    return OpTime(max(compute_s, memory_s), compute_s, memory_s, bound, intensity)


@dataclass(frozen=True)
class PhaseTime:
    """The roofline time of one phase of the step: the sum over its ops of ``OpTime.seconds``."""

    phase: Phase
    seconds: float
    flops: float
    moved_bytes: float
    ops: int
    compute_bound_ops: int


@dataclass(frozen=True)
class StepTime:
    """A lower bound on the time of one training step on ``gpu``, by phase (in the order they run).

    ``dtype`` is the dtype that does most of the FLOPs (None when no op has any), and ``peak`` its dense
    peak FLOP/s: the roof against which ``peak_share`` is measured.
    """

    gpu: str
    phases: tuple[PhaseTime, ...]
    dtype: torch.dtype | None
    peak: float
    tf32: bool = False
    """Whether the dominant FLOPs are fp32 run on TF32 tensor cores (so ``peak`` is the TF32 rate)."""

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    @property
    def flops(self) -> float:
        return sum(p.flops for p in self.phases)

    @property
    def peak_share(self) -> float:
        """Total FLOPs / (seconds * peak): the share of peak compute the bound reaches; below 1 by
        as much as the memory-bound ops and the other dtypes take."""
        return self.flops / (self.seconds * self.peak) if self.peak and self.seconds else 0.0

    def samples_per_second(self, batch: int) -> float:
        """An upper bound on throughput at ``batch`` samples per step (from a lower bound on time)."""
        return batch / self.seconds if self.seconds else float("inf")


def step_time(costs: Iterable[Cost], gpu: GpuSpec, *, tf32: bool = False) -> StepTime:
    """Sum the roofline time of every op, by phase: a lower bound on one step, not a benchmark.

    ``costs`` holds ``(phase, dtype, flops, moved_bytes)`` per op, the phase as a ``Phase`` or its
    name ("forward", "backward", "optimizer"); a fifth element, where given, overrides ``tf32`` for
    that op (PyTorch runs fp32 convolutions as TF32 by default but not fp32 matmuls).
    """
    by_phase: dict[Phase, list[tuple[float, float, OpTime]]] = {}
    flops_by_rate: dict[tuple[torch.dtype, bool], float] = {}
    timed_once: dict[tuple[object, ...], OpTime] = {}  # a deep model's blocks repeat their ops' costs
    for phase, dtype, flops, moved, *own in costs:
        op_tf32 = bool(own[0]) if own else tf32
        op_key = (flops, moved, dtype, op_tf32)
        timed = timed_once.get(op_key)
        if timed is None:
            timed = timed_once[op_key] = op_time(flops, moved, dtype, gpu, tf32=op_tf32)
        by_phase.setdefault(_phase(phase), []).append((float(flops), float(moved), timed))
        if flops:
            key = (dtype, op_tf32 and dtype == torch.float32)
            flops_by_rate[key] = flops_by_rate.get(key, 0.0) + float(flops)
    phases = tuple(_phase_time(p, by_phase[p]) for p in Phase if p in by_phase)
    dominant = max(flops_by_rate, key=flops_by_rate.__getitem__) if flops_by_rate else None
    peak = gpu.peak(dominant[0], tf32=dominant[1]) if dominant is not None else 0.0
    return StepTime(gpu.name, phases, dominant[0] if dominant else None, peak, tf32=bool(dominant and dominant[1]))


def _phase_time(phase: Phase, ops: list[tuple[float, float, OpTime]]) -> PhaseTime:
    return PhaseTime(
        phase,
        seconds=sum(t.seconds for _, _, t in ops),
        flops=sum(f for f, _, _ in ops),
        moved_bytes=sum(b for _, b, _ in ops),
        ops=len(ops),
        compute_bound_ops=sum(t.bound is Bound.COMPUTE for _, _, t in ops),
    )


def _phase(value: Phase | str) -> Phase:
    """A phase by value ("optimizer step") or by name ("optimizer"); anything else is an InputSpecError."""
    if isinstance(value, Phase):
        return value
    if value in {p.value for p in Phase}:
        return Phase(value)
    try:
        return Phase[value.upper().replace(" ", "_")]
    except KeyError:
        names = ", ".join(p.name.lower() for p in Phase)
        raise InputSpecError(f"unknown phase {value!r} for step_time: use one of {names}.") from None
