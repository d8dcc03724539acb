"""fxmem/rules/onednn_conv.py: oneDNN's choices, worked by hand (the profiler checks are in test_workspaces.py)."""

from __future__ import annotations

import pytest
import sympy
import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import fxmem
from fxmem.measure import measure_peak
from fxmem.results import WorkspaceLines
from fxmem.rules.onednn_conv import (
    ConvShape,
    _avx512_batch_threads,
    _best_divider,
    _reducer_split,
    _weight_kernel,
    highest,
)


def _patch_embedding(cout: int) -> ConvShape:
    """ViT's test-config patch embedding: 3 -> cout channels, 8x8 kernel, stride 8, on 32x32 (4x4 out)."""
    return ConvShape(3, cout, 4, (8, 8), (8, 8), (0, 0), False, (32, 32), (4, 4))


def test_balance_splits_the_batch_only_where_that_moves_least() -> None:
    # balance()'s traffic at B=2 on 2 threads, first-convolution kernel (ic_block 3, one input block),
    # output 4 rows (<= 9: no row split): src = ceil(2/m) * 3*32*32 // 8 // 8 = 96 or 48 (m = 1, 2),
    # dst = ceil(2/m) * ceil(nb_oc/o) * 16*4*4, weights = 8 * ceil(nb_oc/o) * 8*8*3*16 = ceil(nb_oc/o) * 24576.
    # 32 outputs (nb_oc 2): (m,o) = (1,1): 96 + 1024 + 49152; (1,2): 96 + 512 + 24576 = 25184;
    # (2,1): 48 + 512 + 49152. (1,2) moves least, and no split computes 25% less: no batch split.
    assert _avx512_batch_threads(_patch_embedding(32), 2, 2, 3) == 1
    # 16 outputs (nb_oc 1): (1,1): 96 + 512 + 24576 = 25184; (2,1): 48 + 256 + 24576 = 24880: split.
    assert _avx512_batch_threads(_patch_embedding(16), 2, 2, 3) == 2
    # one sample is never split over threads (the output has too few rows to split over them)
    assert _avx512_batch_threads(_patch_embedding(16), 1, 2, 3) == 1


def test_kernel_choice() -> None:
    conv = lambda cin, k, dim=2, stride=1: ConvShape(
        cin, 32, 4, (k,) * dim, (stride,) * dim, (0,) * dim, False, (64,) * dim, ((64 - k) // stride + 1,) * dim
    )
    assert _weight_kernel(conv(3, 8)) == "first"
    assert _weight_kernel(conv(8, 3)) == "avx2"
    assert _weight_kernel(conv(8, 3, dim=3)) == "gemm"  # 3-D, 4..15 channels
    assert _weight_kernel(conv(3, 16, stride=16)) == "gemm"  # wider than 14
    assert _weight_kernel(conv(64, 3)) == "blocked"
    assert _weight_kernel(conv(64, 1, stride=2)) == "1x1"  # 32 outputs * 2 = 64: the gather applies
    # 7x7 with stride 2 gives 4x4, and 4 * 2 != 7: the 1x1 kernel declines, the direct one takes it
    assert _weight_kernel(ConvShape(64, 32, 4, (1, 1), (2, 2), (0, 0), False, (7, 7), (4, 4))) == "blocked"


def test_best_divider() -> None:
    # 49 pixels in blocks of 7..16: 7 wastes nothing (10 wastes 1 of 50)
    assert _best_divider(49, 7, 16, True) == 7
    # 64: 16 and 8 both waste nothing; the largest or the smallest of equals
    assert _best_divider(64, 7, 16, True) == 16
    assert _best_divider(64, 7, 16, False) == 8


def test_reducer_split() -> None:
    # one job (one 8-channel block each way), batch 4, 2 threads: one group of both threads,
    # each summing ceil(4/2) = 2 samples (+1 for the reduction) beats one thread summing all 4
    assert _reducer_split(2, 9 * 64, 1, 4) == (1, 2, 1)
    # two jobs: a group per job, one thread each (cost 1 * (4 + 0)), no reduction
    assert _reducer_split(2, 9 * 64, 2, 4)[1] == 1


def _symbolic_batch() -> tuple[torch.SymInt, sympy.Symbol]:
    env = ShapeEnv()
    symbol = env.create_symbol(8, ConstantSource("B"))
    return env.create_symintnode(symbol, hint=8), symbol  # type: ignore[return-value]


def _exprs(found: WorkspaceLines) -> set[sympy.Expr]:
    return {sympy.expand(line.node.expr) for line in found.lines}  # type: ignore[attr-defined]


def test_highest_keeps_the_one_line_leading_everywhere() -> None:
    batch, symbol = _symbolic_batch()
    marks = lambda b, _r: [100 * b + 7, 10 * b + 50]  # the first leads from B = 2 (207 > 70) on
    found = highest(batch, marks)
    assert _exprs(found) == {100 * symbol + 7}
    assert all(found.exact_at(b) for b in range(2, 100))


def test_highest_keeps_every_line_that_leads_somewhere() -> None:
    batch, symbol = _symbolic_batch()
    # the second leads at B = 2..5 (at 5: 550 > 507), the first from B = 6: the timeline gets both,
    # and the step's peak takes the larger at every B
    marks = lambda b, _r: [100 * b + 7, 10 * b + 500, 5 * b + 20]
    assert _exprs(highest(batch, marks)) == {100 * symbol + 7, 10 * symbol + 500}
    assert all(highest(batch, marks).exact_at(b) for b in range(2, 100))
    assert highest(3, marks) == 530  # a concrete batch takes its own largest
    assert _exprs(highest(batch, marks, plus=64)) == {100 * symbol + 71, 10 * symbol + 564}


def test_highest_checks_the_batches_where_another_kernel_runs() -> None:
    batch, symbol = _symbolic_batch()
    # a buffer of 1000 bytes exists where the kernel splits the batch, which it does from B = 4
    marks = lambda b, r: [64 * b + (1000 if r >= 4 else 0)]
    found = highest(batch, marks)
    assert _exprs(found) == {64 * symbol + 1000}
    assert [b for b in range(2, 100) if not found.exact_at(b)] == [2, 3]
    assert highest(2, marks) == 128  # a concrete batch gets its own split


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="the oneDNN rules describe AVX512 kernels")
def test_a_batch_where_the_thread_split_differs_is_simulated_on_its_own() -> None:
    # A 1x1 convolution 128 -> 512 on 28x28: on 2 threads oneDNN splits the weight gradient over the
    # batch (a reduction buffer of one blocked weight gradient, 256 KiB) from B = 8 on, not below;
    # the symbolic timeline's lines are large batches', so B = 3 is simulated on its own: both exact.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = torch.nn.Sequential(torch.nn.Conv2d(128, 512, 1, bias=False))
        report = fxmem.analyze(model, ["B,128,28,28"], optimizer="sgd", target="cpu", batch=3)
        symbolic = report.steps.symbolic_timeline()  # type: ignore[union-attr]
        assert symbolic is not None and not symbolic.exact_at(3) and symbolic.exact_at(8)
        assert report.peak(3).bytes == measure_peak(model, ["B,128,28,28"], 3, optimizer="sgd").bytes
        assert report.peak(8).bytes == measure_peak(model, ["B,128,28,28"], 8, optimizer="sgd").bytes
    finally:
        torch.set_num_threads(threads)
