"""fxmem.cost.roofline: hand-computed roofline times on the A100 80GB (bf16 dense peak 312e12 FLOP/s,
fp32 19.5e12 FLOP/s, DRAM bandwidth 2039e9 B/s, from its datasheet in fxmem.gpu.gpus)."""

from __future__ import annotations

import doctest

import pytest
import torch
from torch import nn

import fxmem.cost.roofline
from fxmem.cost.roofline import Bound, op_time, step_time
from fxmem.cost.tradeoff import NodeCost, memory_bound, node_costs
from fxmem.errors import InputSpecError
from fxmem.gpu.gpus import get_gpu
from fxmem.results import Phase
from tests.helpers import analyze_on_meta

A100 = get_gpu("a100-80gb")

# One 8192 x 8192 x 8192 bf16 matmul: 8192^2 outputs of 8192 multiply-adds, 2 FLOPs each:
# 2 * 8192^3 = 1_099_511_627_776 FLOPs. It reads two 8192^2 bf16 matrices and writes one:
# 3 * 8192^2 * 2 = 402_653_184 bytes. Compute: 1.0995e12 / 312e12 = 3.524e-3 s; memory:
# 4.027e8 / 2039e9 = 1.975e-4 s; so compute-bound, 3.524 ms, at 2730.7 FLOPs per byte.
MATMUL_FLOPS = 2 * 8192**3
MATMUL_BYTES = 3 * 8192 * 8192 * 2

# An elementwise add of 2^28 fp32 elements: one FLOP each, 2^28 = 268_435_456 FLOPs; reads two
# inputs and writes one: 3 * 2^28 * 4 = 3_221_225_472 bytes. Compute: 2.684e8 / 19.5e12 = 1.377e-5 s;
# memory: 3.221e9 / 2039e9 = 1.580e-3 s; so memory-bound, 1.580 ms, at 1/12 FLOP per byte.
ADD_FLOPS = 2**28
ADD_BYTES = 3 * 2**28 * 4


def test_docstring_examples() -> None:
    result = doctest.testmod(fxmem.cost.roofline, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_large_bf16_matmul_is_compute_bound() -> None:
    t = op_time(MATMUL_FLOPS, MATMUL_BYTES, torch.bfloat16, A100)
    assert t.bound is Bound.COMPUTE
    assert t.seconds == pytest.approx(MATMUL_FLOPS / 312e12, rel=1e-12)
    assert t.memory_s == pytest.approx(MATMUL_BYTES / 2039e9, rel=1e-12)
    assert t.intensity == pytest.approx(8192 / 3, rel=1e-12)  # 2*8192^3 / (6*8192^2)


def test_large_fp32_add_is_memory_bound() -> None:
    t = op_time(ADD_FLOPS, ADD_BYTES, torch.float32, A100)
    assert t.bound is Bound.MEMORY
    assert t.seconds == pytest.approx(ADD_BYTES / 2039e9, rel=1e-12)
    assert t.compute_s == pytest.approx(ADD_FLOPS / 19.5e12, rel=1e-12)
    assert t.intensity == pytest.approx(1 / 12, rel=1e-12)


def test_tf32_uses_the_tensor_core_peak() -> None:
    # 1.0995e12 FLOPs / 156e12 (TF32 dense) = 7.048e-3 s; on the CUDA cores, / 19.5e12 = 5.639e-2 s.
    assert op_time(MATMUL_FLOPS, 0, torch.float32, A100, tf32=True).seconds == pytest.approx(MATMUL_FLOPS / 156e12, rel=1e-12)
    assert op_time(MATMUL_FLOPS, 0, torch.float32, A100).seconds == pytest.approx(MATMUL_FLOPS / 19.5e12, rel=1e-12)


def test_an_op_without_flops_costs_its_bytes_in_any_dtype() -> None:
    t = op_time(0, 8 * 2**20, torch.int64, A100)  # an index gather: no peak for int64 is asked for
    assert (t.bound, t.compute_s) == (Bound.MEMORY, 0.0)
    assert t.seconds == pytest.approx(8 * 2**20 / 2039e9, rel=1e-12)


def test_step_time_sums_phases_in_order() -> None:
    costs = [
        ("backward", torch.bfloat16, 2 * MATMUL_FLOPS, 2 * MATMUL_BYTES),  # two matmuls, run as one op here
        ("forward", torch.bfloat16, MATMUL_FLOPS, MATMUL_BYTES),
        ("forward", torch.float32, ADD_FLOPS, ADD_BYTES),
        ("optimizer", torch.float32, 0, ADD_BYTES),
    ]
    step = step_time(costs, A100)
    matmul_s, add_s = MATMUL_FLOPS / 312e12, ADD_BYTES / 2039e9
    assert [p.phase for p in step.phases] == [Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER]
    assert [p.seconds for p in step.phases] == pytest.approx([matmul_s + add_s, 2 * matmul_s, add_s], rel=1e-12)
    assert [p.compute_bound_ops for p in step.phases] == [1, 1, 0]
    assert step.seconds == pytest.approx(3 * matmul_s + 2 * add_s, rel=1e-12)
    assert step.samples_per_second(32) == pytest.approx(32 / step.seconds, rel=1e-12)
    # bf16 does most FLOPs, so the roof is 312e12: (3 * 2*8192^3 + 2^28) / (seconds * 312e12) = 0.76...
    assert step.dtype == torch.bfloat16
    assert step.peak_share == pytest.approx((3 * MATMUL_FLOPS + ADD_FLOPS) / (step.seconds * 312e12), rel=1e-12)
    assert 0.7 < step.peak_share < 1


def test_step_time_rejects_an_unknown_phase() -> None:
    with pytest.raises(InputSpecError, match="unknown phase 'warmup'"):
        step_time([("warmup", torch.float32, 1, 1)], A100)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class _ShapeFirst(nn.Module):
    """Reads its input's shape before any layer: torch.export makes that a ``sym_size_int`` node."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(32, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.emb(idx).view(b, t, 32)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_the_memory_bound_list_names_layers_not_shape_queries() -> None:
    # Issue 35. Exported with B symbolic, the graph's first node after the inputs is sym_size_int_1.
    # Under FSDP2 (2 ranks) the root unit's pre-forward all-gather runs there and is charged to it:
    # emb and head, 64*32 + 32*64 + 64 floats = 16,640 B gathered, the most bandwidth-bound time of
    # any node. The list names layers, so it leaves the shape query out, and each module path once.
    report = analyze_on_meta(_ShapeFirst, ["B,16:int64"], batch=4, frontend="export", fsdp=2)
    nodes = node_costs(report.timeline(4), 4, report.gpu)
    (query,) = [n for n in nodes if n.node.startswith("sym_size_int")]
    assert query.moved_bytes > 0 and query.memory_bound_seconds == max(n.memory_bound_seconds for n in nodes)
    listed = memory_bound(nodes, top=len(nodes))
    names = [n.fqn or n.node for n in listed]
    assert query not in listed and all(n.moved_bytes > 0 for n in listed) and len(names) == len(set(names))
    (line,) = [line for line in str(report).splitlines() if "most memory-bound:" in line]
    assert line.endswith("most memory-bound: blocks.0.fc, blocks.1.fc, head")


def test_the_memory_bound_list_by_hand() -> None:
    # Memory-bound seconds 5 > 4 > 3 > 2 > 1 > 0: the shape queries (export's, fx's) and the node that
    # moves nothing are left out; blocks.0's second node repeats a listed module path.
    nodes = [
        NodeCost("sym_size_int_2", "", 0, 100, 5.0, 5.0),
        NodeCost("getattr_1", "", 0, 100, 4.5, 4.5),
        NodeCost("mul", "blocks.0", 0, 80, 4.0, 4.0),
        NodeCost("tanh", "blocks.0", 0, 60, 3.0, 3.0),
        NodeCost("linear", "head", 10, 40, 2.0, 2.0),
        NodeCost("cross_entropy_loss", "", 0, 20, 1.0, 1.0),
        NodeCost("empty", "pool", 0, 0, 0.0, 0.0),
    ]
    assert [n.node for n in memory_bound(nodes, top=3)] == ["mul", "linear", "cross_entropy_loss"]
