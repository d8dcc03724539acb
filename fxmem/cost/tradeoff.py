"""What a batch size costs besides memory: FLOPs, a roofline lower bound on step time, the
trade-off table, and the batch-norm caveat.

The simulated step (fxmem/step/timeline.py) records every op's FLOPs (torch.utils.flop_counter's formulas) and bytes
moved, as polynomials in B. Here they become, at any batch size:

- FLOPs per phase (``flop_count``): forward (with the loss), backward and the optimizer step;
- a roofline estimate (``step_estimate``): per op ``max(flops / peak, bytes / bandwidth)`` on the GPU
  named by ``--gpu`` (fxmem/cost/roofline.py), summed over the step. It is a lower bound on the step's time,
  never a benchmark: kernels reach a fraction of peak and launches cost time the bound leaves out;
- the trade-off table (``tradeoff``): memory and estimated throughput for batch sizes from 1 to the
  largest that fits.

Shrinking the batch to fit also has a statistical price where the model normalizes with batch
statistics: see ``batchnorm_caveat``.

Note [TF32 by default]
~~~~~~~~~~~~~~~~~~~~~~
PyTorch runs fp32 convolutions on TF32 tensor cores by default (``torch.backends.cudnn.allow_tf32``
defaults to True) but not fp32 matmuls (``torch.backends.cuda.matmul.allow_tf32`` defaults to False
since 1.12; docs "TensorFloat-32 (TF32) on Ampere (and later) devices"). The estimate follows those
defaults: convolution ops get the TF32 rate, every other fp32 op the FP32 one.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fxmem.cost.roofline import Bound, StepTime, op_time, step_time
from fxmem.engine.flops import IGNORED
from fxmem.gpu.gpus import GpuSpec
from fxmem.results import OpCostRecord, Phase, Timeline
from fxmem.symbolic import ByteExpr

__all__ = [
    "BN_THRESHOLD",
    "FlopCount",
    "NodeCost",
    "TradeoffRow",
    "batches_to_try",
    "batchnorm_caveat",
    "batchnorm_layers",
    "flop_count",
    "flop_exprs",
    "memory_bound",
    "node_costs",
    "node_flop_exprs",
    "padded_lengths",
    "step_estimate",
]

BN_THRESHOLD = 16
"""Per-device batches below this get the batch-norm caveat (``--bn-threshold``). Wu & He, "Group
Normalization" (ECCV 2018), Figure 1: BatchNorm's ImageNet error rises steeply below 16 images per GPU."""

_FORWARD = (Phase.FORWARD, Phase.LOSS)
_TF32_OPS = frozenset({"aten.convolution", "aten.convolution_backward", "aten._convolution"})
_NO_ARITHMETIC = frozenset(str(p) for p in IGNORED)
"""Ops known to do no arithmetic (fxmem/engine/flops.py gives each its reason): never listed as missing."""
_PEAK_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one training step at ``batch``, by phase, and the ops torch has no formula for."""

    batch: int
    forward: int
    """The model's forward and the loss."""
    backward: int
    optimizer: int
    missing: tuple[tuple[str, int], ...]
    """(op, calls) for ops without a FLOP formula (elementwise ops, norms): counted for bytes only,
    most calls first."""

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.optimizer

    @property
    def missing_calls(self) -> int:
        """How many op calls of the step have no FLOP formula: their FLOPs, uncounted, are not in ``total``."""
        return sum(calls for _, calls in self.missing)


def flop_count(timeline: Timeline, batch: int, seq: int | None = None) -> FlopCount:
    """The step's FLOPs at ``batch`` from a timeline's op costs."""
    by_phase: Counter[Phase] = Counter()
    missing: Counter[str] = Counter()
    for c in timeline.costs:
        by_phase[c.phase] += c.flops.at(batch, seq)
        if not c.has_formula and c.op not in _NO_ARITHMETIC:
            missing[c.op] += 1
    forward = sum(by_phase[p] for p in _FORWARD)
    return FlopCount(batch, forward, by_phase[Phase.BACKWARD], by_phase[Phase.OPTIMIZER], tuple(missing.most_common()))


def flop_exprs(timeline: Timeline) -> dict[str, ByteExpr]:
    """FLOPs per phase as polynomials in B (and S): exact where ``timeline`` has a symbolic batch."""
    phases = {"forward": _FORWARD, "backward": (Phase.BACKWARD,), "optimizer": (Phase.OPTIMIZER,)}
    return {name: ByteExpr.total(c.flops for c in timeline.costs if c.phase in ps) for name, ps in phases.items()}


def node_flop_exprs(timeline: Timeline) -> dict[str, dict[str, ByteExpr]]:
    """Each node's FLOPs as polynomials in B (and S): "forward" (its own ops) and "backward" (the ops
    autograd runs for its gradient), for the nodes that have any."""
    out: dict[str, dict[str, ByteExpr]] = {}
    for c in timeline.costs:
        if c.phase in _FORWARD or c.phase == Phase.BACKWARD:
            side = "backward" if c.phase == Phase.BACKWARD else "forward"
            entry = out.setdefault(c.node, {"forward": ByteExpr(), "backward": ByteExpr()})
            entry[side] = entry[side] + c.flops
    return {node: e for node, e in out.items() if any(x != ByteExpr() for x in e.values())}


def _dtype(c: OpCostRecord) -> torch.dtype:
    """The rate an op's FLOPs run at: its dtype's; float64 and others take the FP32 rate (a lower bound)."""
    return _PEAK_DTYPES.get(c.dtype, torch.float32)


def step_estimate(timeline: Timeline, batch: int, gpu: GpuSpec, seq: int | None = None) -> StepTime:
    """A roofline lower bound on one step's time at ``batch`` on ``gpu``. See Note [TF32 by default]."""
    at: dict[tuple[int, int, int], tuple[int, int]] = {}

    def evaluated(c: OpCostRecord) -> tuple[int, int]:
        """(FLOPs, bytes moved) at ``batch``, worked out once per distinct op cost (a deep model repeats
        each block's ops once per block, so a 7B step has ~15,000 ops and ~500 distinct costs). The
        copies of one block's record share its ByteExprs, so they are told apart by identity, which
        the timeline, alive throughout, keeps from being reused."""
        key = (id(c.flops), id(c.read), id(c.written))
        found = at.get(key)
        if found is None:
            found = at[key] = (c.flops.at(batch, seq), (c.read + c.written).at(batch, seq))
        return found

    costs = ((c.phase, _dtype(c), *evaluated(c), c.op in _TF32_OPS) for c in timeline.costs)
    return step_time(costs, gpu)


@dataclass(frozen=True)
class NodeCost:
    """One node's ops at one batch size, forward and backward together: FLOPs, bytes moved (inputs
    read, saved tensors re-read in backward, outputs written), and their roofline time."""

    node: str
    fqn: str
    flops: int
    moved_bytes: int
    seconds: float
    memory_bound_seconds: float
    """The part of ``seconds`` spent in ops whose bytes, not FLOPs, set their time."""

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved: below the GPU's ridge point (peak / bandwidth) a node is memory-bound."""
        return self.flops / self.moved_bytes if self.moved_bytes else float("inf")

    @property
    def bound(self) -> Bound:
        return Bound.MEMORY if 2 * self.memory_bound_seconds > self.seconds else Bound.COMPUTE


def node_costs(timeline: Timeline, batch: int, gpu: GpuSpec, seq: int | None = None) -> tuple[NodeCost, ...]:
    """Every node's cost at ``batch`` in the order the nodes first run (the optimizer step left out)."""
    total: dict[tuple[str, str], list[float]] = {}
    for c in timeline.costs:
        if c.phase == Phase.OPTIMIZER:
            continue
        flops, moved = c.flops.at(batch, seq), (c.read + c.written).at(batch, seq)
        t = op_time(flops, moved, _dtype(c), gpu, tf32=c.op in _TF32_OPS)
        entry = total.setdefault((c.node, c.fqn), [0, 0, 0.0, 0.0])
        entry[0] += flops
        entry[1] += moved
        entry[2] += t.seconds
        entry[3] += t.seconds if t.bound is Bound.MEMORY else 0.0
    return tuple(NodeCost(node, fqn, int(f), int(b), s, m) for (node, fqn), (f, b, s, m) in total.items())


# Note [What the memory-bound list names]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The list points at layers a user can change, so it names a node by its module path where it has
# one, each path once (a GELU written as five elementwise nodes is one layer), and it leaves out two
# kinds of node. A node that moves nothing costs no bandwidth. A shape query (torch.export's
# ``sym_size_int_2``, ``aten.sym_size.int``; fx's ``size``, ``getattr`` for ``x.shape``) makes no
# tensor and is no layer, yet it can be charged bytes: the step charges an op to the node running
# when it happens, and FSDP2's pre-forward all-gather of the root's parameters runs right after the
# inputs, where an exported Hugging Face model runs its first shape query (an 8-layer Llama, hidden
# 64, fsdp=2 on the cpu target: 469,376 bytes moved at ``sym_size_int_2``). Such nodes are known by
# the names both frontends give them: a graph node is named after its target.

_SHAPE_QUERY = re.compile(r"(sym_(size_int|stride_int|numel_default|storage_offset_default)|size|dim|numel|getattr)(_\d+)?")
"""Node names of shape queries: torch.export's (``aten.sym_size.int`` -> ``sym_size_int_2``) and fx's
(``x.size(0)`` -> ``size``, ``x.shape`` -> ``getattr_1``). See Note [What the memory-bound list names]."""


def memory_bound(nodes: Iterable[NodeCost], top: int = 5) -> tuple[NodeCost, ...]:
    """Of ``node_costs``, the ``top`` nodes that spend most estimated time bound by memory bandwidth,
    one per module path; shape queries and nodes that move nothing left out (Note [What the
    memory-bound list names])."""
    bound = [n for n in nodes if n.memory_bound_seconds > 0 and n.moved_bytes > 0 and not _SHAPE_QUERY.fullmatch(n.node)]
    first: dict[str, NodeCost] = {}
    for n in sorted(bound, key=lambda n: n.memory_bound_seconds, reverse=True):
        first.setdefault(n.fqn or n.node, n)
    return tuple(first.values())[:top]


@dataclass(frozen=True)
class TradeoffRow:
    """Memory and estimated throughput at one batch size."""

    batch: int
    state: int
    activations: int
    peak: int
    """The steady step's peak in tensor bytes."""
    device: int
    """What the device must hold (nvidia-smi's total on a GPU)."""
    seconds: float
    """Roofline lower bound on the step's time."""
    samples_per_second: float
    peak_share: float
    """The share of the GPU's peak FLOP/s the bound reaches."""
    worst_length: tuple[int, int] | None = None
    """Where a sequence axis S is symbolic: (bytes, length) of the batch padded to the length at or
    below the report's S whose step the device must hold the most for (Note [The longest padded batch])."""


# Note [The longest padded batch]
#     Fine-tuning batches are padded to their longest sample, so one run's steps come in many lengths
#     and the user knows a maximum, not a distribution: ``--seq-len`` is the longest padded batch, and
#     every figure of the report is for it. Memory mostly grows with the length, but not everywhere:
#     on a GPU the caching allocator rounds and splits blocks by size class, and a kernel may change
#     at a length (SDPA's backend, cuDNN's engine), so a shorter batch can need more than the longest
#     one. Where S is symbolic, the step's timeline is a polynomial in B and S, so the trade-off
#     table evaluates it (and replays it through the allocator) at eight padded lengths from S/8 to
#     S and shows the worst, with its length: the figure a run of mixed lengths must fit.


def padded_lengths(longest: int) -> tuple[int, ...]:
    """Eight lengths from ``longest``/8 to ``longest``, the padded batches the trade-off table checks."""
    return tuple(sorted({max(1, round(longest * k / 8)) for k in range(1, 9)}))


def batches_to_try(largest: int | None, chosen: int) -> list[int]:
    """Powers of two from 1 up to ``largest`` (the largest batch that fits) and ``largest`` itself, and
    the chosen batch where it is larger (its row then says it does not fit); without a largest batch,
    powers of two up to twice the chosen batch."""
    top = largest if largest is not None else max(2 * chosen, 2)
    batches = [1 << k for k in range(top.bit_length()) if 1 << k <= top]
    return sorted({*batches, top, *([chosen] if largest is not None and chosen > largest else [])})


def batchnorm_layers(model: nn.Module) -> tuple[str, ...]:
    """Modules that normalize with statistics over the batch in training: BatchNorm1d/2d/3d, their lazy
    forms, SyncBatchNorm (all subclass ``nn.modules.batchnorm._BatchNorm``)."""
    return tuple(fqn or "(root)" for fqn, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))


def batchnorm_caveat(layers: Sequence[str], batches: Iterable[tuple[str, int]], threshold: int = BN_THRESHOLD) -> str:
    """One paragraph when batch-statistics layers meet a small per-device batch; "" otherwise.

    ``batches`` are (what, per-device batch) pairs to judge: the chosen batch, the largest that fits.
    """
    small = [(what, b) for what, b in batches if b < threshold]
    if not layers or not small:
        return ""
    named = ", ".join(layers[:4]) + (f" and {len(layers) - 4} more" if len(layers) > 4 else "")
    where = " and ".join(f"{what} B={b}" for what, b in small)
    return (
        f"Batch-norm caveat: {len(layers)} layer{'s' if len(layers) > 1 else ''} ({named}) normalize with statistics over the "
        f"batch, and the {where} is under {threshold} samples per device: their mean and variance get noisy and accuracy "
        "usually drops (a statistical cost, not a memory one). Ways out: GroupNorm or LayerNorm in their place; "
        "SyncBatchNorm to pool statistics across devices; gradient accumulation does not help, since each "
        "micro-batch is normalized on its own."
    )
