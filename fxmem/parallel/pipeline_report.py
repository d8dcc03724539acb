"""Pipeline parallel, the results: every rank's stage, state, saved bytes and peak, and what the
pipeline changed for it against one GPU at the same microbatch (the simulation that makes them is
fxmem/step/pipeline.py; the report's lines, fxmem/output/pipeline.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fxmem.parallel.pipeline_split import PipelinePlan
from fxmem.parallel.rank import ParallelPlan
from fxmem.results import STATE_CATEGORIES, Category
from fxmem.symbolic import ByteExpr

__all__ = ["OneGpu", "PipelineRank", "PipelineRun", "RankChange"]


@dataclass(frozen=True)
class PipelineRank:
    """One rank of the pipeline: its stage, its model state, what it saves per microbatch, and its
    simulated step (a ``fxmem.step.peak.StepPeaks``: ``steps.peak(B)``)."""

    rank: int
    role: str
    blocks: str
    parameters: int
    """Bytes of the stage's parameters (a weight two stages read counts on both)."""
    saved: Mapping[str, ByteExpr]
    steps: Any = field(compare=False, repr=False)
    marks: Mapping[int | None, tuple[tuple[int, int], ...]] = field(default_factory=dict, compare=False, repr=False)
    """``StageStep.marks`` of each simulated step, by its batch (None: B symbolic), filled as they run."""

    @property
    def activations(self) -> ByteExpr:
        """Bytes autograd saves for one microbatch on this rank, a*B + c (B the microbatch)."""
        return ByteExpr.total(self.saved.values())

    def peak(self, batch: int, *, first_step: bool = False) -> Any:
        return self.steps.peak(batch, first_step=first_step)

    def in_flight(self, batch: int, *, first_step: bool = False) -> int:
        """Microbatches in flight at the peak. The timeline at ``batch`` is a step simulated there or
        the symbolic one; either keeps its storages' numbers, which the marks are in."""
        peak = self.peak(batch, first_step=first_step)
        if peak.event < 0:
            return 0
        number = self.steps.timeline(batch, first_step=first_step).events[peak.event].storage
        marks = self.marks.get(batch, self.marks.get(None, ()))
        return sum(delta for at, delta in marks if at <= number)


@dataclass(frozen=True)
class OneGpu:
    """The same step on one GPU, for the pipeline's report to compare each rank against."""

    state: int
    """Bytes of state it holds between steps: weights, buffers, optimizer state (gradients are freed)."""
    saved: Callable[[int], int] = field(compare=False, repr=False)
    """Bytes autograd saves in its forward of ``batch`` samples (one microbatch)."""


@dataclass(frozen=True)
class RankChange:
    """What pipeline parallel changed for one rank against one GPU at the same microbatch, at the
    rank's steady peak."""

    state: int
    """Bytes of state the rank holds between steps (its stage's weights, buffers, optimizer state)."""
    activations: int
    """Activation bytes alive at the peak (saved tensors and the stage outputs the schedule caches)."""
    microbatches: int
    """Microbatches in flight at the peak: their forward has begun and their backward not ended (with
    several stages per rank, each stage's counts: (stage, microbatch) pairs)."""
    receive_buffers: int
    """Bytes of the buffers the rank receives activations and gradients into, alive at the peak."""
    sharding: int = 0
    """Bytes of FSDP2's own buffers alive at the peak (gathered weights, reduce-scatter buffers),
    where the stages are sharded."""


@dataclass(frozen=True)
class PipelineRun:
    """Every rank of a pipeline-parallel step (``Report.pipeline``), and the one-GPU step they split."""

    plan: PipelinePlan
    ranks: tuple[PipelineRank, ...]
    one_gpu: OneGpu | None = None
    within: ParallelPlan | None = None
    """How each stage is sharded too (FSDP2), each rank the first of its stage's data-parallel ranks."""

    def describe(self) -> str:
        """The run in words: the pipeline, and the sharding inside its stages."""
        inside = f", each stage {self.within.describe()}" if self.within is not None else ""
        return self.plan.describe() + inside

    def change(self, rank: int, batch: int) -> RankChange:
        """What the pipeline changed for ``rank`` at microbatch ``batch`` (steady step)."""
        r = self.ranks[rank]
        peak = r.peak(batch)
        timeline = r.steps.timeline(batch)
        state = sum(v.at(batch) for c, v in timeline.baseline.items() if c in STATE_CATEGORIES)
        receive = timeline.baseline[Category.COMMUNICATION].at(batch) if Category.COMMUNICATION in timeline.baseline else 0
        communication = peak.breakdown.get(Category.COMMUNICATION, 0)
        return RankChange(state, peak.breakdown.get(Category.ACTIVATION, 0), r.in_flight(batch), receive, communication - receive)
