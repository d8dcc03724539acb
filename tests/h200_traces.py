"""Replaying one call that an H200 traced against fxmem's timeline: what the cuDNN convolution, cuDNN RNN
and SDPA tests share.

Each of tests/test_cudnn_conv.py, test_cudnn_rnn.py and test_sdpa.py holds fxmem's cuda target to the
caching allocator's own trace of one call on an H200 (tests/data/h200/README.md). A trace is a list of
rows ``[action, requested bytes, innermost Python frames]``, the action one of ``alloc``,
``free_requested``, ``segment_alloc`` and ``segment_free``. The recording script allocated and freed a
*marker block* of ``MARK + 512 * k`` bytes (``marker(k)``) between the parts of a run, ``k`` counting up
from 0: a one-call trace has markers 0, 1 and 2 around its forward and its backward, so the trace's
``Marks`` are read between them, in requested bytes. The timeline's ``Marks`` come from the same call
made by a lone module on the meta device, simulated with the cuda rules under ``CudaTargetMode`` for an
H200 (``simulate_on_h200``), and are read in requested bytes or in the allocator's 512-byte blocks (what
``torch.cuda.max_memory_allocated`` counts, for ``kernels_h200.json.gz``'s records).
"""

from __future__ import annotations

import functools
import gzip
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from fxmem.engine.losses import Loss
from fxmem.frontends.tracing import trace_model
from fxmem.gpu.allocator import round_size
from fxmem.gpu.target import CudaTargetMode
from fxmem.inputs import InputSpec, parse_inputs
from fxmem.results import Phase, Timeline
from fxmem.rules import TorchRelease
from fxmem.rules.ops import op_rules_for, workspace_rules_for
from fxmem.rules.optimizers import OptimizerRule
from fxmem.step.timeline import StepTarget, simulate_step

__all__ = [
    "H200",
    "MARK",
    "Marks",
    "Row",
    "in_blocks",
    "load",
    "lone_graph",
    "marker",
    "signed_steps",
    "simulate_on_h200",
    "split_at_markers",
    "timeline_marks",
    "trace_marks",
]

DATA = Path(__file__).parent / "data" / "h200"
H200 = (9, 0)
"""The H200's compute capability."""
MARK = 512 * 9001
"""Marker 0's bytes; marker k is 512 * k more (``marker``)."""

Row = list[Any]
"""One row of a trace: ``[action, requested bytes, frames]``."""


@functools.cache
def load(name: str) -> Any:
    """A gzipped JSON file of tests/data/h200, read once."""
    with gzip.open(DATA / name) as f:
        return json.load(f)


@dataclass(frozen=True)
class Marks:
    """Bytes above what lived before the forward: alive when it ended, its high mark, the backward's."""

    after_forward: int
    forward: int
    backward: int


# --- the timeline's side --------------------------------------------------------------------------


def lone_graph(build: Callable[[], nn.Module], inputs: list[str]) -> tuple[fx.GraphModule, tuple[InputSpec, ...]]:
    """The module ``build()`` makes on the meta device, traced on ``inputs`` (fxmem's input specs)."""
    with torch.device("meta"):
        model = build()
    specs = parse_inputs(inputs)
    return trace_model(model, specs).gm, specs


def simulate_on_h200(
    gm: fx.GraphModule,
    specs: tuple[InputSpec, ...],
    *,
    loss: Loss,
    optimizer: OptimizerRule,
    batch: int,
    amp: torch.dtype | None = None,
    release: TorchRelease | None = None,
) -> Timeline:
    """The step's timeline with the cuda rules and an H200's kernels (``release``'s choices; None: the
    torch fxmem runs with), under autocast to ``amp`` where given."""
    kernels = lambda: CudaTargetMode(compute_capability=H200, amp=amp, release=release)
    target = StepTarget(op_rules_for("cuda"), workspace_rules_for("cuda"), kernels=kernels)
    return simulate_step(gm, specs, loss=loss, optimizer=optimizer, batch=batch, target=target)


def in_blocks(nbytes: int, *, signed: bool = True) -> int:
    """``nbytes`` in the allocator's 512-byte blocks, 0 kept 0. ``signed``: a negative size rounds as its
    magnitude and stays negative; else it goes to ``round_size`` as it is (one block)."""
    if not nbytes:
        return 0
    if signed and nbytes < 0:
        return -round_size(-nbytes)
    return round_size(nbytes)


def timeline_marks(timeline: Timeline, batch: int, size: Callable[[int], int] | None = None) -> Marks:
    """The timeline's marks at ``batch`` up to the optimizer, each event's bytes through ``size`` (None:
    requested bytes; ``in_blocks`` for the allocator's blocks)."""
    level = forward = backward = after = 0
    for e in timeline.events:
        if e.phase in (Phase.OPTIMIZER, Phase.ZERO_GRAD):
            break
        nbytes = e.nbytes.at(batch)
        level += (nbytes if size is None else size(nbytes)) * (1 if e.alloc else -1)
        if e.phase == Phase.FORWARD:
            forward, after = max(forward, level), level
        else:
            backward = max(backward, level)
    return Marks(after, forward, backward)


# --- the trace's side ---------------------------------------------------------------------------------


def marker(k: int) -> int:
    """The bytes of marker block ``k``."""
    return MARK + 512 * k


def split_at_markers(trace: list[Row]) -> Iterator[list[Row]]:
    """The rows between markers 0, 1 and 2 (past each marker's alloc and free): the forward, then the backward."""
    sizes = {marker(k) for k in range(3)}
    marks = [i for i, (action, size, _) in enumerate(trace) if action == "alloc" and size in sizes]
    for start, end in itertools.pairwise(marks):
        yield trace[start + 2 : end]


def signed_steps(rows: list[Row]) -> list[int]:
    """The requests and releases of ``rows`` as +bytes and -bytes (segments left out)."""
    return [(size if action == "alloc" else -size) for action, size, _ in rows if action in ("alloc", "free_requested")]


def trace_marks(trace: list[Row]) -> Marks:
    """A one-call trace's marks in requested bytes."""
    level, highs = 0, []
    for part in split_at_markers(trace):
        high = level
        for step in signed_steps(part):
            level += step
            high = max(high, level)
        highs.append((high, level))
    (forward, after), (backward, _) = highs
    return Marks(after, forward, backward)
