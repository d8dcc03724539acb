"""The report's lines for a pipeline-parallel step (``Report.pipeline``): each rank's stage, state,
saved bytes and peak, and what the pipeline changed against one GPU (fxmem/step/pipeline.py)."""

from __future__ import annotations

from collections.abc import Callable

from fxmem.output.render import format_bytes
from fxmem.parallel.pipeline_report import OneGpu, PipelineRun, RankChange
from fxmem.results import DevicePeak

__all__ = ["render_pipeline"]


def render_pipeline(run: PipelineRun, batch: int, seq: int | None = None) -> str:
    """The report's lines per rank: what its stage runs, holds and peaks at, and against one GPU."""
    plan = run.plan
    lines = [f"Pipeline: {run.describe()}, B={batch} per microbatch (a step takes {plan.microbatches * batch} samples)"]
    for r in run.ranks:
        steady, first = r.peak(batch), r.peak(batch, first_step=True)
        lines.append(
            f"  rank {r.rank} ({r.role}, {r.blocks}): parameters {format_bytes(r.parameters)}, saved per microbatch "
            f"{format_bytes(r.activations.at(batch, seq))}, peak {format_bytes(steady.bytes)} steady / {format_bytes(first.bytes)} first step, "
            f"in {steady.phase.value} at {steady.node}{_on_the_device(steady.device)}"
        )
        if run.one_gpu is not None:
            lines.append("    " + _against_one_gpu(run.change(r.rank, batch), run.one_gpu, batch, plan.virtual, format_bytes))
    return "\n".join(lines) + "\n"


def _on_the_device(device: DevicePeak | None) -> str:
    """The steady peak as the GPU holds it (the allocator's blocks, and nvidia-smi's total), on a cuda target."""
    if device is None:
        return ""
    return f"; on the {device.gpu}: allocated {format_bytes(device.allocated)}, nvidia-smi {format_bytes(device.total)}"


def _against_one_gpu(change: RankChange, one: OneGpu, batch: int, virtual: int, size: Callable[[int], str]) -> str:
    """One line: the rank's state, activations in flight and receive buffers at its peak, against one GPU's."""
    unit = "microbatch" if virtual == 1 else "stage-microbatch"  # several stages per rank: (stage, microbatch) pairs
    count = f"{change.microbatches} {unit}{'es' if change.microbatches != 1 else ''} in flight"
    return (
        f"against one GPU: state {size(change.state)} of {size(one.state)}; activations at the peak {size(change.activations)}, {count} "
        f"(one GPU saves {size(one.saved(batch))} for one microbatch); receive buffers {size(change.receive_buffers)}"
        + (f"; FSDP2's buffers {size(change.sharding)}" if change.sharding else "")
    )
