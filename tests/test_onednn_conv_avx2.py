"""fxmem/rules/onednn_conv_avx2.py against torch.profiler on the real oneDNN kernels of an AVX2 CPU.

Every expected figure is the profiler's, in the same run: an op's high mark (its allocations summed
in order, at their highest) less the bytes of the outputs it returns, which is what the timeline
charges as the op's workspace (Note [CPU oneDNN convolution buffers on AVX2]). The rules describe
AVX2 kernels, so everything here skips on other CPUs (AVX512 has its own, in test_workspaces.py).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import sympy
import torch
from torch import nn
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fxmem.results import WorkspaceLines
from fxmem.rules.onednn_conv import ConvShape, highest
from fxmem.rules.onednn_conv_avx2 import (
    _depthwise_ok,
    _dw_weights_ok,
    _forward_kernel,
    _weight_kernel,
    as_2d,
    avx2_backward_marks,
    avx2_channels_last_backward_marks,
    avx2_channels_last_forward_marks,
    avx2_channels_last_grad_output_copy,
    onednn_avx2_channels_last,
    onednn_avx2_convolution,
)
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


GroupedCase = tuple[tuple[int, ...], tuple[int, ...], int, int, int, int, bool]
"""(input shape, weight shape, stride, padding, dilation, groups, whether the forward has a bias)."""

GROUPED_BY_HAND: list[GroupedCase] = [
    ((2, 96, 14, 14), (96, 1, 7, 7), 1, 3, 1, 96, True),  # ConvNeXt's depthwise 7x7 (GEMM weight gradient)
    ((1, 96, 28, 28), (96, 1, 7, 7), 1, 3, 1, 96, False),  # one sample: GEMM threads the 96 groups anyway
    ((4, 13, 14, 14), (13, 1, 3, 3), 1, 1, 1, 13, True),  # channels padded to 16, the bias too
    ((4, 32, 15, 15), (32, 1, 3, 3), 2, 1, 1, 32, True),  # MobileNet's strided depthwise 3x3
    ((3, 16, 40), (16, 1, 5), 1, 2, 1, 16, False),  # a depthwise Conv1d
    ((4, 32, 12, 12), (64, 8, 3, 3), 1, 1, 1, 4, True),  # ResNeXt-like groups of 8 input channels
    ((2, 16, 10, 10), (32, 8, 1, 1), 1, 0, 1, 2, False),  # grouped 1x1
    ((4, 16, 16, 16), (16, 16, 3, 3), 1, 2, 2, 1, True),  # dilated 3x3, padding kept
    ((4, 3, 20), (8, 3, 3), 1, 2, 2, 1, False),  # a dilated Conv1d on 3 channels (flat forward)
]


def _grouped_grid(seed: int = 18) -> Iterator[GroupedCase]:
    """Hand picks, then fixed-seed random depthwise (1-D, 2-D; any stride), blocked-group (8 or 16
    channels a group, stride 1) and dilated (stride 1) shapes, batch 1 to 6."""
    yield from GROUPED_BY_HAND
    rng = random.Random(seed)
    for i in range(75):
        dim, k, size, batch = rng.choice((1, 2, 2)), rng.choice((1, 2, 3, 3, 5, 7)), rng.randint(5, 16), rng.randint(1, 6)
        family = ("depthwise", "groups", "dilated")[i % 3]
        if family == "depthwise":
            c = rng.choice((3, 5, 8, 13, 16, 24, 40))
            shapes, stride, pad, dil, groups = ((batch, c), (c, 1)), rng.choice((1, 1, 2)), rng.choice((0, k // 2)), 1, c
        elif family == "groups":
            groups, cin, cout = rng.choice((2, 3, 4)), rng.choice((8, 16)), rng.choice((8, 16))
            shapes, stride, pad, dil = ((batch, cin * groups), (cout * groups, cin)), 1, rng.choice((0, k // 2)), 1
        else:
            cin, cout, dil = rng.choice((1, 3, 8, 16)), rng.choice((1, 8, 13)), rng.choice((2, 3))
            shapes, stride, pad, groups = ((batch, cin), (cout, cin)), 1, rng.choice((0, k // 2 * dil, dil)), 1
        size = max(size, (k - 1) * dil + 1)  # the kernel fits the input
        yield shapes[0] + (size,) * dim, shapes[1] + (k,) * dim, stride, pad, dil, groups, rng.random() < 0.5


def _grouped_args(case: GroupedCase) -> tuple[Any, ...]:
    xs, ws, stride, pad, dil, groups, bias = case
    dim = len(xs) - 2
    b = torch.randn(ws[0]) if bias else None
    return (torch.randn(*xs), torch.randn(*ws), b, [stride] * dim, [pad] * dim, [dil] * dim, False, [0] * dim, groups)


def _op_misses(args: tuple[Any, ...], label: str, n: int) -> list[str]:
    """Where the rule and the profiler differ for one convolution (``aten.convolution``'s args): its
    forward, and its backward under two output masks picked by ``n``."""
    misses = []
    top, y = _high_mark(lambda: torch.ops.aten.convolution(*args))
    if convolution_workspace(args, {}, y) != top - _nbytes(y):
        misses.append(f"forward {label}: rule {convolution_workspace(args, {}, y)}, profiler {top - _nbytes(y)}")
    for mask in (MASKS[n % len(MASKS)], MASKS[(n + 3) % len(MASKS)]):
        bias = [y.shape[1]] if mask[2] else None
        bargs = (torch.randn_like(y), args[0], args[1], bias, *args[3:], list(mask))
        top, grads = _high_mark(lambda bargs=bargs: torch.ops.aten.convolution_backward(*bargs))
        rule, measured = convolution_backward_workspace(bargs, {}, grads), top - _asked(grads, mask)
        if rule != measured:
            misses.append(f"backward {mask} {label}: rule {rule}, profiler {measured}")
    return misses


def _described(args: tuple[Any, ...]) -> bool:
    return onednn_avx2_convolution(args[0], args[1], *args[3:], bias=args[2] is not None)


def _grid_misses(threads: int, cases: Sequence[tuple[Any, ...]], make: Callable[[Any], tuple[Any, ...]]) -> tuple[int, list[str]]:
    """(cases the rules take, each forward and backward where the rule and the profiler differ)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    misses, checked = [], 0
    try:
        for n, case in enumerate(cases):
            args = make(case)
            if _described(args):  # else not a family the rules describe (GEMM forwards, ATen's own kernels)
                checked += 1
                misses += _op_misses(args, str(case), n)
    finally:
        torch.set_num_threads(before)
    return checked, misses


def _grouped_misses(threads: int) -> tuple[int, list[str]]:
    return _grid_misses(threads, list(_grouped_grid()), _grouped_args)


@pytest.mark.parametrize("threads", [1, 2])
def test_grouped_and_dilated_workspaces_match_the_profiler(threads: int) -> None:
    """Depthwise, blocked-group and dilated convolutions the rules take (Note [CPU oneDNN grouped
    convolution buffers on AVX2]): forward (with and without a bias) and backward (two output masks
    each) equal the profiler's high mark less the outputs, byte for byte, at 1 and 2 threads (the
    depthwise reduction and GEMM's outer threading split by threads)."""
    checked, misses = _grouped_misses(threads)
    assert checked >= 55, "too few shapes reached the rules"
    assert not misses, "\n".join(misses)


def _conv_shape(case: GroupedCase) -> ConvShape:
    xs, ws, stride, pad, dil, _groups, _bias = case
    dim = len(xs) - 2
    out = [(i + 2 * pad - dil * (k - 1) - 1) // stride + 1 for i, k in zip(xs[2:], ws[2:])]
    return as_2d(ConvShape.of(torch.empty(xs), torch.empty(ws), [stride] * dim, [pad] * dim, [dil] * dim, out))


def test_the_grouped_grid_reaches_both_depthwise_weight_kernels() -> None:
    # jit_dw for kernels up to 3 wide, GEMM for ConvNeXt's 7x7
    dw = [_conv_shape(case) for case in _grouped_grid() if case[5] > 1 and _depthwise_ok(_conv_shape(case), case[5])]
    assert {_dw_weights_ok(c) for c in dw} == {True, False}


NOT_DESCRIBED = [
    # (input, weight, stride, padding, dilation, groups): oneDNN runs these with GEMM (im2col
    # columns, not modelled) or kernels not ported; the rules decline them rather than guess
    ((4, 16, 12, 12), (32, 1, 3, 3), 1, 1, 1, 16),  # a channel multiplier: GEMM
    ((4, 16, 12, 12), (16, 4, 3, 3), 1, 1, 1, 4),  # 4 channels a group: GEMM
    ((4, 16, 12, 12), (32, 8, 3, 3), 2, 1, 1, 2),  # strided groups: the input gradient's kernel varies
    ((4, 16, 6, 6, 6), (16, 1, 3, 3, 3), 1, 1, 1, 16),  # 3-D depthwise: brdgmm_dw, then GEMM
    ((4, 16, 12, 12), (16, 1, 7, 7), 1, 5, 1, 16),  # padding past the depthwise unroll: GEMM forward
    ((4, 16, 12, 12), (16, 16, 3, 3), 2, 2, 2, 1),  # dilated and strided: GEMM input gradient
    ((4, 8, 32, 32), (8, 8, 3, 3), 1, 4, 4, 1),  # dilation 4, padding 4: GEMM forward
    ((4, 3, 15, 15), (1, 3, 5, 5), 1, 0, 3, 1),  # a reach of 13 over 3 outputs: GEMM input gradient
]


@pytest.mark.parametrize(("xs", "ws", "stride", "pad", "dil", "groups"), NOT_DESCRIBED)
def test_undescribed_families_get_no_rule(xs: tuple[int, ...], ws: tuple[int, ...], stride: int, pad: int, dil: int, groups: int) -> None:
    dim = len(xs) - 2
    args = (torch.randn(*xs), torch.randn(*ws), [stride] * dim, [pad] * dim, [dil] * dim, False, [0] * dim, groups)
    assert _onednn((*args[:2], None, *args[2:]))
    assert not onednn_avx2_convolution(*args)


def test_depthwise_figures_by_hand() -> None:
    """Three depthwise figures in closed form, next to the profiler's."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # forward, 13 channels with a bias: x8 4*16*14*14*4 = 50176, w8 9*16*4 = 576, y8 50176, the
        # padded bias 16*4 + 128 = 192, less the output 4*13*14*14*4 = 40768
        args = _grouped_args(((4, 13, 14, 14), (13, 1, 3, 3), 1, 1, 1, 13, True))
        top, y = _high_mark(lambda: torch.ops.aten.convolution(*args))
        assert top - _nbytes(y) == convolution_workspace(args, {}, y) == 50176 + 576 + 50176 + 192 - 40768
        # weight gradient, 5 channels (one block) at batch 4: both threads split the batch; x8 and y8
        # 4*8*14*14*4 = 25088 each, w8 9*8*4 = 288, the second thread's sum 288 + 128, less the
        # returned 9*5*4 = 180
        args = _grouped_args(((4, 5, 14, 14), (5, 1, 3, 3), 1, 1, 1, 5, False))
        bargs = (torch.randn(4, 5, 14, 14), args[0], args[1], None, *args[3:], [False, True, False])
        top, grads = _high_mark(lambda: torch.ops.aten.convolution_backward(*bargs))
        assert top - _nbytes(grads) == convolution_backward_workspace(bargs, {}, grads) == 2 * 25088 + 288 + 416 - 180
        # ConvNeXt's 7x7 over 96 channels, weight and bias gradients: GEMM's reduction buffer
        # 4 * 2 * 18816 + 128 and two threads' columns 2 * 49 * 196 * 4 + 128 (w and the biases are
        # the outputs, at the top too)
        args = _grouped_args(((4, 96, 14, 14), (96, 1, 7, 7), 1, 3, 1, 96, False))
        bargs = (torch.randn(4, 96, 14, 14), args[0], args[1], [96], *args[3:], [False, True, True])
        top, grads = _high_mark(lambda: torch.ops.aten.convolution_backward(*bargs))
        by_hand = 4 * 2 * 18816 + 128 + 2 * 49 * 196 * 4 + 128
        assert top - _asked(grads, (False, True, True)) == convolution_backward_workspace(bargs, {}, grads) == by_hand
    finally:
        torch.set_num_threads(before)


TransposedCase = tuple[tuple[int, ...], tuple[int, ...], int, int, int, bool]
"""(input shape, weight shape (in, out, *kernel), stride, padding, output padding, forward bias)."""

TRANSPOSED_BY_HAND: list[TransposedCase] = [
    ((4, 16, 8, 8), (16, 8, 2, 2), 2, 0, 0, True),  # UNet's 2x2 up-convolution: the bias added in place
    ((4, 16, 8, 8), (16, 16, 4, 4), 2, 1, 0, False),  # DCGAN's 4x4, stride 2
    ((4, 13, 10, 10), (13, 5, 3, 3), 1, 1, 0, True),  # stride 1 with a bias: a blocked output to add it to
    ((3, 16, 20), (16, 8, 3), 1, 1, 0, True),  # a ConvTranspose1d
    ((2, 8, 6, 6), (8, 8, 1, 1), 2, 0, 1, False),  # 1x1, stride 2, output padding
]


def _transposed_grid(seed: int = 18) -> Iterator[TransposedCase]:
    """Hand picks, then fixed-seed random 1-D and 2-D transposed convolutions."""
    yield from TRANSPOSED_BY_HAND
    rng = random.Random(seed)
    for _ in range(40):
        dim, cin, cout = rng.choice((1, 2, 2)), rng.choice((1, 3, 8, 13, 16, 24)), rng.choice((1, 5, 8, 16, 32))
        k, stride, size, batch = rng.choice((1, 2, 3, 4, 5)), rng.choice((1, 1, 2)), rng.randint(3, 12), rng.randint(1, 5)
        pad, out_pad = rng.choice((0, k // 2)), rng.choice((0, stride - 1))
        yield (batch, cin) + (size,) * dim, (cin, cout) + (k,) * dim, stride, pad, out_pad, rng.random() < 0.5


def _transposed_args(case: TransposedCase) -> tuple[Any, ...]:
    xs, ws, stride, pad, out_pad, bias = case
    dim = len(xs) - 2
    b = torch.randn(ws[1]) if bias else None
    return (torch.randn(*xs), torch.randn(*ws), b, [stride] * dim, [pad] * dim, [1] * dim, True, [out_pad] * dim, 1)


@pytest.mark.parametrize("threads", [1, 2])
def test_transposed_workspaces_match_the_profiler(threads: int) -> None:
    """Transposed convolutions the rules take (Note [CPU oneDNN transposed convolution buffers on
    AVX2]): forward and backward equal the profiler's high mark less the outputs, byte for byte."""
    checked, misses = _grid_misses(threads, list(_transposed_grid()), _transposed_args)
    assert checked >= 30, "too few shapes reached the rules"
    assert not misses, "\n".join(misses)


TRANSPOSED_NOT_DESCRIBED = [
    # (input, weight, stride, padding, dilation, groups, forward bias)
    ((4, 16, 8, 8), (16, 8, 3, 3), 2, 1, 1, 1, True),  # strided, overlapping taps, a bias: its buffer is not ported
    ((4, 16, 8, 8), (16, 4, 3, 3), 1, 1, 1, 2, False),  # grouped
    ((4, 16, 8, 8), (16, 8, 3, 3), 1, 2, 2, 1, False),  # dilated
    ((2, 8, 5, 5, 5), (8, 8, 3, 3, 3), 1, 1, 1, 1, False),  # 3-D
]


@pytest.mark.parametrize(("xs", "ws", "stride", "pad", "dil", "groups", "bias"), TRANSPOSED_NOT_DESCRIBED)
def test_undescribed_transposed_convolutions_get_no_rule(
    xs: tuple[int, ...], ws: tuple[int, ...], stride: int, pad: int, dil: int, groups: int, bias: bool
) -> None:
    dim = len(xs) - 2
    args = (torch.randn(*xs), torch.randn(*ws), [stride] * dim, [pad] * dim, [dil] * dim, True, [0] * dim, groups)
    assert not onednn_avx2_convolution(*args, bias=bias)


def test_transposed_figures_by_hand() -> None:
    """A strided transposed forward in closed form, next to the profiler's: a 2x2 up-convolution,
    64 -> 8 channels on 4x64x8x8 at 1 thread, is ``conv``'s strided input gradient (8 -> 64
    channels, 2x2, stride 2, 16x16 to 8x8): its input copied channels-last (4*64*64*4 = 65536),
    weights 4 * 64 * p8(8) * 4 = 8192, the result 4*8*256*4 = 32768, brgconv_strided's bookings,
    each with a page of alignment (a page of batch descriptors, 103 * 40 = 4120 bytes; the
    output's 64 pixels * 64 channels, a page of floats: 16384; a page of row masks: 4096) and the
    nested registry's 128; less the output."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = _transposed_args(((4, 64, 8, 8), (64, 8, 2, 2), 2, 0, 0, True))
        top, y = _high_mark(lambda: torch.ops.aten.convolution(*args))
        scratchpad = (4120 + 4096) + (16384 + 4096) + (4096 + 4096)
        by_hand = 65536 + 8192 + 32768 + scratchpad + 128 - 32768
        assert top - _nbytes(y) == convolution_workspace(args, {}, y) == by_hand
    finally:
        torch.set_num_threads(before)


def _conv3x3() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, stride=2, padding=1))


STEP_MODELS = {
    # (model, inputs, batch); before the AVX2 rules these peaks were 26% to 22% low (see the Note)
    "conv3x3": (_conv3x3, ["B,3,32,32"], 4),
    "conv1x1": (lambda: nn.Sequential(nn.Conv2d(16, 64, 1), nn.ReLU(), nn.Conv2d(64, 16, 1)), ["B,16,16,16"], 4),
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(8, 32, 5), nn.ReLU(), nn.Conv1d(32, 8, 3)), ["B,8,100"], 4),
    "conv3d": (lambda: nn.Sequential(nn.Conv3d(2, 8, 3), nn.ReLU(), nn.Conv3d(8, 4, 3)), ["B,2,12,12,12"], 4),
    # before the grouped rules these were 36%, 24% and 28% low
    "depthwise7x7": (
        lambda: nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 16, 7, padding=3, groups=16),
            nn.GELU(),
            nn.Conv2d(16, 16, 3, padding=1, groups=16),
        ),
        ["B,3,24,24"],
        4,
    ),
    "depthwise3x3": (
        lambda: nn.Sequential(
            nn.Conv2d(3, 13, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(13, 13, 3, padding=1, groups=13),
            nn.ReLU(),
            nn.Conv2d(13, 13, 3, 2, 1, groups=13),
        ),
        ["B,3,24,24"],
        4,
    ),
    "grouped": (
        lambda: nn.Sequential(
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1, groups=2), nn.Conv2d(32, 48, 3, padding=1, groups=2)
        ),
        ["B,16,16,16"],
        4,
    ),
    # before the transposed rules these were 13% and 22% low
    "dcgan": (
        lambda: nn.Sequential(nn.ConvTranspose2d(16, 16, 4, 2, 1, bias=False), nn.ReLU(), nn.ConvTranspose2d(16, 3, 4, 2, 1, bias=False)),
        ["B,16,8,8"],
        4,
    ),
    "conv_transpose1d": (
        lambda: nn.Sequential(
            nn.Conv1d(8, 16, 3, padding=1), nn.ConvTranspose1d(16, 8, 3, padding=1), nn.ReLU(), nn.ConvTranspose1d(8, 4, 3, padding=1)
        ),
        ["B,8,40"],
        4,
    ),
    "dilated": (
        lambda: nn.Sequential(nn.Conv2d(3, 16, 3, padding=2, dilation=2), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=2, dilation=2)),
        ["B,3,32,32"],
        4,
    ),
}


@pytest.mark.parametrize("first_step", [False, True])
@pytest.mark.parametrize("name", list(STEP_MODELS))
def test_step_peak(name: str, first_step: bool) -> None:
    make, inputs, batch = STEP_MODELS[name]
    torch.manual_seed(0)
    assert_step_peak(make(), inputs, batch, loss="sum", first_step=first_step)


ChannelsLastCase = tuple[tuple[int, ...], tuple[int, ...], int, int, int, bool]
"""(input shape, weight shape, stride, padding, groups, forward bias): a channels-last input."""


def _channels_last_grid(seed: int = 39) -> Iterator[ChannelsLastCase]:
    """Fixed-seed ConvNeXt-like channels-last convolutions: depthwise 5x5 and 7x7 "same" (2 to 40
    channels), and tiled 2x2 and 4x4 (kernel == stride) over 3 to 192 channels, batch 1 to 6."""
    rng = random.Random(seed)
    for i in range(60):
        batch, size = rng.randint(1, 6), rng.randint(7, 14)
        if i % 2 == 0:
            c, k = rng.choice((2, 5, 8, 13, 16, 24, 40)), rng.choice((5, 7))
            yield (batch, c, size, size), (c, 1, k, k), 1, k // 2, c, rng.random() < 0.5
        else:
            cin, cout, k = rng.choice((3, 8, 13, 16, 20, 32, 96)), rng.choice((5, 8, 21, 32, 96, 192)), rng.choice((2, 2, 4))
            size = size // k * k
            yield (batch, cin, size, size), (cout, cin, k, k), k, 0, 1, rng.random() < 0.5


def _channels_last_args(case: ChannelsLastCase) -> tuple[Any, ...]:
    xs, ws, stride, pad, groups, bias = case
    x = torch.randn(*xs).to(memory_format=torch.channels_last)
    return (x, torch.randn(*ws), torch.randn(ws[0]) if bias else None, [stride] * 2, [pad] * 2, [1, 1], False, [0, 0], groups)


def _channels_last_misses(args: tuple[Any, ...], n: int, nthr: int) -> list[str]:
    """Where Note [CPU oneDNN channels-last convolution buffers on AVX2] and the profiler differ for
    one convolution: its forward, and its backward under two output masks, grad_output
    channels-last or not (ATen copies it then)."""
    x, w, bias, stride, pad, groups = args[0], args[1], args[2], args[3], args[4], args[8]
    top, y = _high_mark(lambda: torch.ops.aten.convolution(*args))
    conv = ConvShape.of(x, w, stride, pad, [1, 1], y.shape[2:])
    rule = highest(x.shape[0], avx2_channels_last_forward_marks(conv, nthr, groups=groups, bias=bias is not None))
    misses = [] if rule == top - _nbytes(y) else [f"forward: rule {rule}, profiler {top - _nbytes(y)}"]
    for mask, grad in ((MASKS[n % len(MASKS)], torch.randn_like(y)), (MASKS[(n + 3) % len(MASKS)], torch.randn(y.shape))):
        bargs = (grad, x, w, [w.shape[0]] if mask[2] else None, *args[3:], list(mask))
        top, grads = _high_mark(lambda bargs=bargs: torch.ops.aten.convolution_backward(*bargs))
        marks = avx2_channels_last_backward_marks(conv, nthr, mask, groups=groups)
        rule, measured = highest(x.shape[0], marks, plus=avx2_channels_last_grad_output_copy(grad)), top - _asked(grads, mask)
        if rule != measured:
            layout = "channels-last" if grad.is_contiguous(memory_format=torch.channels_last) else "contiguous"
            misses.append(f"backward {mask}, {layout} grad_output: rule {rule}, profiler {measured}")
    return misses


@pytest.mark.parametrize("threads", [1, 2])
def test_channels_last_workspaces_match_the_profiler(threads: int) -> None:
    """Channels-last depthwise and tiled convolutions (Note [CPU oneDNN channels-last convolution
    buffers on AVX2]): forward (with and without a bias) and backward (two output masks each) equal
    the profiler's high mark less the outputs, byte for byte, at 1 and 2 threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    misses, checked = [], 0
    try:
        for n, case in enumerate(_channels_last_grid()):
            args = _channels_last_args(case)
            if onednn_avx2_channels_last(args[0], args[1], *args[3:]):
                checked += 1
                misses += [f"{case} {m}" for m in _channels_last_misses(args, n, threads)]
    finally:
        torch.set_num_threads(before)
    assert checked >= 40, "too few shapes reached the rules"
    assert not misses, "\n".join(misses)


def test_channels_last_figures_by_hand() -> None:
    """ConvNeXt's two channels-last convolutions in closed form, next to the profiler's, at 1 thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # depthwise 7x7 over 13 channels, weight and bias gradients: the gradient with each group
        # padded to an 8 x 8 block, 13 * 64 * 49 * 4 = 163072, its padded bias 13 * 8 * 4 + 128 = 544
        # beside ideep's bias (52), then two copies of w (2548) and two biases at the top; less the
        # returned w and bias
        args = _channels_last_args(((2, 13, 8, 8), (13, 1, 7, 7), 1, 3, 13, False))
        bargs = (torch.randn(2, 13, 8, 8).to(memory_format=torch.channels_last), args[0], args[1], [13], *args[3:], [False, True, True])
        top, grads = _high_mark(lambda: torch.ops.aten.convolution_backward(*bargs))
        by_hand = 163072 + 2 * 2548 + 2 * 52 - 2548 - 52
        assert top - _asked(grads, (False, True, True)) == by_hand
        conv = ConvShape.of(args[0], args[1], [1, 1], [3, 3], [1, 1], (8, 8))
        assert highest(2, avx2_channels_last_backward_marks(conv, 1, (False, True, True), groups=13)) == by_hand
        # 2x2 downsampling, 16 -> 32 channels on 2x16x8x8: the channels-last weight copy 8192, the
        # Acdb32a weights 4 * 16 * 32 * 4 = 8192, a page of batch descriptors (103 * 40 = 4120) and a
        # page of alignment
        args = _channels_last_args(((2, 16, 8, 8), (32, 16, 2, 2), 2, 0, 1, True))
        top, y = _high_mark(lambda: torch.ops.aten.convolution(*args))
        conv = ConvShape.of(args[0], args[1], [2, 2], [0, 0], [1, 1], (4, 4))
        by_hand = 8192 + 8192 + 4120 + 4096
        assert top - _nbytes(y) == highest(2, avx2_channels_last_forward_marks(conv, 1, bias=True)) == by_hand
    finally:
        torch.set_num_threads(before)


CHANNELS_LAST_NOT_DESCRIBED: list[ChannelsLastCase] = [
    ((4, 16, 12, 12), (16, 1, 3, 3), 1, 1, 16, False),  # depthwise 3x3: jit_dw's NHWC weight split, not ported
    ((4, 3, 12, 12), (3, 1, 7, 7), 1, 3, 3, False),  # 3 groups: GEMM weight gradient
    ((4, 16, 6, 6), (16, 1, 7, 7), 1, 3, 16, False),  # a kernel taller than the input: GEMM
    ((4, 16, 12, 12), (16, 1, 7, 7), 2, 3, 16, False),  # strided depthwise
    ((4, 40, 8, 8), (80, 40, 2, 2), 2, 0, 1, False),  # 80 outputs: brgemm's block (16 or 24) varies
    ((4, 16, 12, 12), (32, 16, 3, 3), 2, 1, 1, False),  # overlapping taps
]


@pytest.mark.parametrize("case", CHANNELS_LAST_NOT_DESCRIBED)
def test_undescribed_channels_last_convolutions_get_no_rule(case: ChannelsLastCase) -> None:
    args = _channels_last_args(case)
    assert _onednn(args)
    assert not onednn_avx2_channels_last(args[0], args[1], *args[3:])


class _LayerNorm2d(nn.LayerNorm):
    """torchvision's: LayerNorm over the channels of an NCHW tensor, by permuting (so its output is
    channels-last in memory)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


class _Permute(nn.Module):
    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(*self.dims)


class _CNBlock(nn.Module):
    """torchvision's ConvNeXt block: depthwise 7x7, channels-last LayerNorm, 4x MLP, layer scale (no
    stochastic depth: the identity at p = 0)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, 7, padding=3, groups=dim),
            _Permute([0, 2, 3, 1]),
            nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(dim, 4 * dim),
            nn.GELU(),
            nn.Linear(4 * dim, dim),
            _Permute([0, 3, 1, 2]),
        )
        self.layer_scale = nn.Parameter(torch.full((dim, 1, 1), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.layer_scale * self.block(x)
        result += x
        return result


def _convnext(dims: tuple[int, ...] = (16, 32)) -> nn.Module:
    """A small torchvision ConvNeXt-T: 4x4 stride-4 stem and LayerNorm2d, one block a stage,
    LayerNorm2d and a 2x2 stride-2 conv between stages, pooled LayerNorm2d and Linear head."""
    layers: list[nn.Module] = [nn.Conv2d(3, dims[0], 4, 4), _LayerNorm2d(dims[0], eps=1e-6)]
    for i, dim in enumerate(dims):
        layers.append(_CNBlock(dim))
        if i + 1 < len(dims):
            layers += [_LayerNorm2d(dim, eps=1e-6), nn.Conv2d(dim, dims[i + 1], 2, 2)]
    head = [nn.AdaptiveAvgPool2d(1), _LayerNorm2d(dims[-1], eps=1e-6), nn.Flatten(1), nn.Linear(dims[-1], 10)]
    return nn.Sequential(*layers, *head)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch", [2, 3])
def test_convnext_step_peak(batch: int, threads: int) -> None:
    """A ConvNeXt-like AdamW step: its depthwise 7x7 and 2x2 downsampling convolutions read
    channels-last inputs (LayerNorm2d's permutes); 17.8% (B = 2) and 3.7% (B = 3) low before the
    channels-last rules."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        assert_step_peak(_convnext(), ["B,3,32,32"], batch, loss="sum", first_step=False)
    finally:
        torch.set_num_threads(before)
