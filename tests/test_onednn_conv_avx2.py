"""fxmem/rules/onednn_conv_avx2.py against torch.profiler on the real oneDNN kernels of an AVX2 CPU.

Every expected figure is the profiler's, in the same run: an op's high mark (its allocations summed
in order, at their highest) less the bytes of the outputs it returns, which is what the timeline
charges as the op's workspace (Note [CPU oneDNN convolution buffers on AVX2]). The rules describe
AVX2 kernels, so everything here skips on other CPUs (AVX512 has its own, in test_workspaces.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import sympy
import torch
from torch import nn
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fxmem.results import WorkspaceLines
from fxmem.rules.onednn_conv import ConvShape, highest
from fxmem.rules.onednn_conv_avx2 import _forward_kernel, _weight_kernel, as_2d, avx2_backward_marks
from fxmem.rules.ops import convolution_backward_workspace, convolution_workspace
from tests.helpers import assert_step_peak
from tests.test_workspaces import _high_mark, _nbytes

AVX2 = torch.backends.mkldnn.is_available() and torch.backends.cpu.get_cpu_capability() == "AVX2"
pytestmark = pytest.mark.skipif(not AVX2, reason="the rules describe oneDNN's AVX2 kernels (8-channel blocks)")

MASKS = [(True, True, False), (True, False, False), (False, True, False), (False, True, True), (True, True, True), (False, False, True)]


def _grid() -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
    """(input shape, weight shape, stride, padding): 1-D, 2-D and 3-D, kernels 1 to 7, strides 1 and
    2, 1 to 64 channels, batch 1 to 8, outputs at least 3 wide (narrower ones with padding go to GEMM,
    whose forward is not modelled: see the Note). Input channels above 32 stay at stride 1 (the strided
    input gradient's channel block is not ported: the Note)."""
    sizes = {1: 23, 2: 13, 3: 7}
    for i, (dim, k, s, cin, cout) in enumerate(itertools.product((1, 2, 3), (1, 2, 3, 5, 7), (1, 2), (1, 3, 5, 8, 24, 64), (1, 8, 13, 32))):
        if (dim == 3 and k > 5) or (cin > 32 and s > 1):
            continue
        batch, pad = 1 + (i * 5) % 8, (0, k // 2)[i % 2]
        yield (batch, cin) + (sizes[dim],) * dim, (cout, cin) + (k,) * dim, s, pad


def _args(xs: Sequence[int], ws: Sequence[int], stride: int, pad: int) -> tuple[Any, ...]:
    dim = len(xs) - 2
    return (torch.randn(*xs), torch.randn(*ws), None, [stride] * dim, [pad] * dim, [1] * dim, False, [0] * dim, 1)


def _onednn(args: tuple[Any, ...]) -> bool:
    return str(torch._C._select_conv_backend(*args)).endswith("Mkldnn")  # type: ignore[attr-defined]


def _asked(grads: Sequence[Any], mask: Sequence[bool]) -> int:
    """The bytes of the gradients the mask asks for. ATen returns a weight gradient for a bias-only
    mask too, freed at once by the caller: the timeline (whose fake op returns none) charges it as
    workspace, and so does the rule."""
    return sum(_nbytes(g) for g, wanted in zip(grads, mask) if wanted)


def _misses(threads: int) -> tuple[int, list[str]]:
    """(shapes checked, each forward and backward where the rule and the profiler differ)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    misses, checked = [], 0
    try:
        for n, (xs, ws, stride, pad) in enumerate(_grid()):
            args = _args(xs, ws, stride, pad)
            if not _onednn(args):
                continue  # small batch-1 inputs go to ATen's own kernels
            checked += 1
            top, y = _high_mark(lambda args=args: torch.ops.aten.convolution(*args))
            if convolution_workspace(args, {}, y) != top - _nbytes(y):
                misses.append(f"forward {xs} {ws} s{stride} p{pad}: rule {convolution_workspace(args, {}, y)}, profiler {top - _nbytes(y)}")
            for mask in (MASKS[n % len(MASKS)], MASKS[(n + 3) % len(MASKS)]):
                bias = [ws[0]] if mask[2] else None
                bargs = (torch.randn_like(y), args[0], args[1], bias, *args[3:], list(mask))
                top, grads = _high_mark(lambda bargs=bargs: torch.ops.aten.convolution_backward(*bargs))
                rule, measured = convolution_backward_workspace(bargs, {}, grads), top - _asked(grads, mask)
                if rule != measured:
                    misses.append(f"backward {mask} {xs} {ws} s{stride} p{pad}: rule {rule}, profiler {measured}")
    finally:
        torch.set_num_threads(before)
    return checked, misses


@pytest.mark.parametrize("threads", [1, 2])
def test_workspaces_match_the_profiler_over_a_grid(threads: int) -> None:
    """Forward and backward (each output mask, with and without a bias) equal the profiler's high
    mark less the outputs, byte for byte, at 1 and 2 threads (the reducers split by threads)."""
    checked, misses = _misses(threads)
    assert checked >= 150, "too few shapes reached oneDNN to test its kernels"
    assert not misses, "\n".join(misses)


def test_the_grid_reaches_every_modelled_kernel() -> None:
    # the 1x1 kernel, the direct one and GEMM (3-D kernels with depth padding) for the weight
    # gradient; the 1x1 and direct forward kernels
    convs = [
        as_2d(ConvShape.of(*_args(xs, ws, s, p)[:2], [s] * (len(xs) - 2), [p] * (len(xs) - 2), [1] * (len(xs) - 2), _out(xs, ws, s, p)))
        for xs, ws, s, p in _grid()
    ]
    assert {_weight_kernel(c) for c in convs} == {"1x1", "direct", "gemm"}
    assert {_forward_kernel(c) for c in convs} == {"1x1", "direct"}


def _out(xs: Sequence[int], ws: Sequence[int], stride: int, pad: int) -> tuple[int, ...]:
    return tuple((i + 2 * pad - k) // stride + 1 for i, k in zip(xs[2:], ws[2:]))


FORWARD_BY_HAND = [
    # (input, weight, stride, padding, high mark less the output): the output made as y8 and its
    # plain copy are the same size here, so the first mark is input copy + weights
    # x8 4*16*16*16*4 = 65536, weights 9*16*16*4 = 9216
    ((4, 16, 16, 16), (16, 16, 3, 3), 2, 1, 65536 + 9216),
    # x8 4*8*16*16*4 = 32768, weights 9*8*8*4 = 2304
    ((4, 8, 16, 16), (8, 8, 3, 3), 1, 1, 32768 + 2304),
    # y8 beside the returned copy (4*64*16*16*4 = 262144) is above x8 + weights (65536 + 4096)
    ((4, 16, 16, 16), (64, 16, 1, 1), 1, 0, 262144),
    # 3 input channels: the input stays plain ("flat"); weights 9 * p8(16) * 3 * 4 = 1728 beside
    # y8 (262144) are below y8 beside its copy
    ((4, 3, 32, 32), (16, 3, 3, 3), 1, 1, 262144),
]


@pytest.mark.parametrize(("xs", "ws", "stride", "pad", "by_hand"), FORWARD_BY_HAND, ids=["3x3-s2", "3x3", "1x1", "flat"])
def test_forward_figures_by_hand(xs: tuple[int, ...], ws: tuple[int, ...], stride: int, pad: int, by_hand: int) -> None:
    """The forward's high mark less its output, in closed form, next to the profiler's."""
    args = _args(xs, ws, stride, pad)
    top, y = _high_mark(lambda: torch.ops.aten.convolution(*args))
    assert top - _nbytes(y) == by_hand
    assert convolution_workspace(args, {}, y) == by_hand


def test_weight_reducer_by_hand() -> None:
    """The direct kernel's weight reducer on 2 threads: one job (an 8x8 block of 3x3 weights, 576
    floats), batch 4: one group of both threads, the second's partial sum 576 * 4 = 2304 bytes, a
    page of alignment, one barrier context and the booking's page: 2304 + 3 * 4096 = 14592."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        args = _args((4, 8, 16, 16), (8, 8, 3, 3), 1, 1)
        y = torch.ops.aten.convolution(*args)
        bargs = (torch.randn_like(y), args[0], args[1], None, *args[3:], [False, True, False])
        top, grads = _high_mark(lambda: torch.ops.aten.convolution_backward(*bargs))
        # x8 32768 + y8 32768 + blocked gradient 2304 + reducer 14592, less the returned gradient
        # (2304: 8 channels need no padding)
        assert top - _nbytes(grads) == 32768 + 32768 + 14592
        assert convolution_backward_workspace(bargs, {}, grads) == 32768 + 32768 + 14592
    finally:
        torch.set_num_threads(before)


def _symbolic_batch() -> tuple[torch.SymInt, sympy.Symbol]:
    env = ShapeEnv()
    symbol = env.create_symbol(8, ConstantSource("B"))
    return env.create_symintnode(symbol, hint=8), symbol  # type: ignore[return-value]


@pytest.mark.parametrize("cin", [8, 16])
def test_a_symbolic_batch_gets_the_lines_of_large_batches(cin: int) -> None:
    """The reducer splits by the batch: with B symbolic, ``highest`` gives lines that equal the
    concrete rule at every batch where they say they are exact (Note [Kernel choices that change
    with the batch] in fxmem/step/timeline.py)."""
    conv = ConvShape(cin, 8, 4, (3, 3), (1, 1), (1, 1), False, (16, 16), (16, 16))
    marks = avx2_backward_marks(conv, 2, (True, True, False))
    batch, symbol = _symbolic_batch()
    found = highest(batch, marks)
    assert isinstance(found, WorkspaceLines)
    for b in range(2, 9):
        if found.exact_at(b):
            at_b = max(int(sympy.expand(line.node.expr).subs(symbol, b)) for line in found.lines)  # type: ignore[attr-defined]
            assert at_b == highest(b, marks)


def _conv3x3() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1))


STEP_MODELS = {
    # (model, inputs, batch); before the AVX2 rules these peaks were 26% to 22% low (see the Note)
    "conv3x3": (_conv3x3, ["B,3,32,32"], 4),
    "conv1x1": (lambda: nn.Sequential(nn.Conv2d(16, 64, 1), nn.ReLU(), nn.Conv2d(64, 16, 1)), ["B,16,16,16"], 4),
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(8, 32, 5), nn.ReLU(), nn.Conv1d(32, 8, 3)), ["B,8,100"], 4),
    "conv3d": (lambda: nn.Sequential(nn.Conv3d(2, 8, 3), nn.ReLU(), nn.Conv3d(8, 4, 3)), ["B,2,12,12,12"], 4),
}


@pytest.mark.parametrize("first_step", [False, True])
@pytest.mark.parametrize("name", list(STEP_MODELS))
def test_step_peak(name: str, first_step: bool) -> None:
    make, inputs, batch = STEP_MODELS[name]
    torch.manual_seed(0)
    assert_step_peak(make(), inputs, batch, loss="sum", first_step=first_step)
