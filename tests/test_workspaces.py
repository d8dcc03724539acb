"""The kernel-workspace rules of fxmem/rules/ops.py against torch.profiler on the real CPU kernels.

For each op the measured figure is the op's own high mark (its allocations, summed in order, at their
highest) less the bytes of the outputs it returns: what the timeline charges as the op's workspace.
The oneDNN rules describe this machine's kernels on an AVX512 CPU (Note [CPU oneDNN convolution
buffers]), so those tests skip elsewhere.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._python_dispatch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import fxmem
from fxmem.measure import measure_peak
from fxmem.rules.ops import (
    addmm_operand_copies,
    convolution_backward_workspace,
    convolution_workspace,
    mkldnn_rnn_layer_backward_workspace,
    mm_operand_copies,
)
from tests.helpers import assert_step_peak, scratch_of

AVX512 = torch.backends.mkldnn.is_available() and torch.backends.cpu.get_cpu_capability() == "AVX512"
onednn_avx512 = pytest.mark.skipif(not AVX512, reason="the oneDNN rules describe AVX512 kernels")


def _high_mark(run: Callable[[], Any]) -> tuple[int, Any]:
    """(highest running total of the allocations ``run`` makes, its result)."""
    run()  # create oneDNN's primitives first, as a training step's later iterations find them
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = run()
    stack, sizes = list(prof.profiler.kineto_results.experimental_event_tree()), []  # type: ignore[union-attr]
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.typed[0] == _EventType.Allocation:
            sizes.append((e.start_time_ns, e.typed[1].alloc_size))
    total = top = 0
    for _, size in sorted(sizes):
        total += size
        top = max(top, total)
    return top, result


def _nbytes(out: Any) -> int:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return sum(t.untyped_storage().nbytes() for t in outs if isinstance(t, torch.Tensor))


CONVS = [
    # (input shape, weight shape, stride, padding, output mask)
    ((4, 3, 64, 64), (8, 3, 7, 7), 2, 3, (False, True, False)),
    ((4, 8, 16, 16), (8, 8, 3, 3), 1, 1, (True, True, False)),
    ((4, 8, 16, 16), (32, 8, 1, 1), 1, 0, (True, True, False)),
    ((4, 16, 16, 16), (16, 16, 3, 3), 2, 1, (True, True, False)),
    ((4, 32, 16, 16), (64, 32, 1, 1), 2, 0, (True, True, False)),
    ((2, 64, 8, 8), (128, 64, 1, 1), 2, 0, (True, True, False)),
    ((8, 128, 4, 4), (64, 128, 1, 1), 1, 0, (True, True, False)),
    ((4, 1, 16, 16, 16), (4, 1, 3, 3, 3), 1, 1, (False, True, False)),
    ((4, 4, 8, 8, 8), (8, 4, 3, 3, 3), 1, 1, (True, True, False)),
    ((2, 8, 8, 8, 8), (8, 8, 3, 3, 3), 1, 1, (True, True, False)),
    ((4, 16, 8, 8, 8), (8, 16, 3, 3, 3), 1, 1, (True, True, False)),
    ((4, 16, 16, 16, 16), (16, 16, 3, 3, 3), 2, 1, (True, True, False)),
    ((4, 8, 16, 16, 16), (20, 8, 1, 1, 1), 1, 0, (True, True, False)),
]


def _backward_calls(lstm: torch.nn.LSTM, seq: int, batch: int, inp: int) -> list[tuple[Any, ...]]:
    """The arguments of every ``mkldnn_rnn_layer_backward`` call of one real backward through ``lstm``."""
    calls: list[tuple[Any, ...]] = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.overloadpacket == torch.ops.aten.mkldnn_rnn_layer_backward:
                calls.append(args)
            return func(*args, **(kwargs or {}))

    y = lstm(torch.randn(seq, batch, inp, requires_grad=True))[0]
    with Spy():
        y.backward(torch.randn_like(y))
    return calls


WIDE_LSTMS = [
    # (seq, batch, input, hidden): widths at and around 256, where oneDNN pads the weight gradient's
    # rows by get_good_ld (a multiple of 256 gets 16 more) and keeps a plain-sized copy
    (10, 2, 256, 64), (10, 2, 512, 64), (10, 2, 255, 64), (10, 2, 256, 32), (10, 2, 32, 255),
    (10, 2, 32, 256), (40, 2, 32, 256), (10, 8, 32, 256), (50, 8, 128, 256), (10, 2, 32, 192),
]  # fmt: skip


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize(("seq", "batch", "inp", "hidden"), WIDE_LSTMS)
def test_wide_lstm_backward_workspace_matches_the_profiler(seq: int, batch: int, inp: int, hidden: int) -> None:
    """Note [CPU oneDNN LSTM backward buffers], wider layers: the rule is at most 1.4 KiB over the
    profiler's high mark, and under it only where H >= 256, by at most 2 KiB a sample (15 KiB at
    N = 8). Without the padded rows and their copy, LSTM(32, 256) was 1.1 MB under."""
    calls = _backward_calls(torch.nn.LSTM(inp, hidden), seq, batch, inp)
    top, grads = _high_mark(lambda: torch.ops.aten.mkldnn_rnn_layer_backward.default(*calls[0]))
    over = mkldnn_rnn_layer_backward_workspace(calls[0], {}, grads) - (top - _nbytes(grads))
    under_allowed = 2048 * batch if hidden >= 256 else 0
    assert -under_allowed <= over <= 1400, over


@onednn_avx512
@pytest.mark.parametrize(("xs", "ws", "stride", "pad", "mask"), CONVS, ids=lambda v: str(v).replace(" ", ""))
def test_onednn_convolution_workspace_matches_the_profiler(
    xs: tuple[int, ...], ws: tuple[int, ...], stride: int, pad: int, mask: tuple[bool, ...]
) -> None:
    dim = len(xs) - 2
    x, w = torch.randn(*xs), torch.randn(*ws)
    args = (x, w, None, [stride] * dim, [pad] * dim, [1] * dim, False, [0] * dim, 1)
    assert str(torch._C._select_conv_backend(*args)).endswith("Mkldnn")  # type: ignore[attr-defined]
    top, y = _high_mark(lambda: torch.ops.aten.convolution(*args))
    assert convolution_workspace(args, {}, y) == top - _nbytes(y)
    bargs = (torch.randn_like(y), *args[:2], None, *args[3:], list(mask))
    top, grads = _high_mark(lambda: torch.ops.aten.convolution_backward(*bargs))
    assert convolution_backward_workspace(bargs, {}, grads) == top - _nbytes(grads)


@onednn_avx512
def test_onednn_forward_matches_the_profiler_over_a_grid() -> None:
    # 1x1 kernels with stride 2 on 7x7 (the outputs do not tile the input: no gathered input) and on 8x8
    misses: list[str] = []
    for c, o, k, s, h in itertools.product((3, 16, 256), (16, 40), (1, 3, 7), (1, 2), (7, 8, 28)):
        x, w = torch.randn(2, c, h, h), torch.randn(o, c, k, k)
        args = (x, w, None, [s, s], [k // 2] * 2, [1, 1], False, [0, 0], 1)
        if not str(torch._C._select_conv_backend(*args)).endswith("Mkldnn"):  # type: ignore[attr-defined]
            continue
        top, y = _high_mark(lambda args=args: torch.ops.aten.convolution(*args))
        if convolution_workspace(args, {}, y) != top - _nbytes(y):
            misses.append(
                f"{tuple(x.shape)} {tuple(w.shape)} stride {s}: predicted {convolution_workspace(args, {}, y)}, measured {top - _nbytes(y)}"
            )
    assert not misses, "\n".join(misses)


def _weight_grid() -> list[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
    """(input shape, weight shape, stride, padding) over oneDNN's weight-gradient kernels (Note [CPU
    oneDNN convolution buffers]): the direct avx512 one with 1 or 3 input channels (its
    first-convolution form) and 16 or more (blocked), 2-D and 3-D, outputs up to 9 rows and taller
    (split over rows too), at batches where balance() splits the batch over the threads and where it
    does not; the AVX2 one; GEMM; the 1x1 one."""
    grid = [
        ((b, c, h, h), (o, c, k, k), s, 0) for c, o, k, s, b, h in itertools.product((1, 3), (16, 48), (4, 8), (2, 0), (1, 2, 3), (32,))
    ]
    grid = [(x, w, s or w[2], p) for x, w, s, p in grid]
    grid += [((b, c, h, h), (o, c, 3, 3), s, 1) for c, o, s, b, h in itertools.product((16, 32), (16, 64), (1, 2), (1, 2, 4), (8, 14, 28))]
    grid += [((b, c, h, h, h), (o, c, 3, 3, 3), s, 1) for c, o, s, b, h in itertools.product((16, 32), (16, 48), (1, 2), (1, 3), (4, 8))]
    # the AVX2 kernel (4..15 input channels), with and without its reducer's split
    grid += [((b, c, 16, 16), (o, c, 3, 3), s, 1) for c, o, s, b in itertools.product((4, 12), (8, 24), (1, 2), (1, 2, 8))]
    # GEMM: kernels wider than 14 (a ViT patch embedding) and 3-D kernels with 4..15 input channels
    grid += [((b, 3, h, h), (32, 3, 16, 16), 16, 0) for b, h in itertools.product((1, 2, 4), (32, 64))]
    grid += [((b, c, 8, 8, 8), (o, c, 3, 3, 3), s, 1) for c, o, s, b in itertools.product((4, 8), (4, 32), (1, 2), (1, 2))]
    # 1x1: stride 1, strides its gather (rtus) takes away, and strides it cannot (the direct kernel)
    grid += [((b, c, h, h), (o, c, 1, 1), s, 0) for c, o, s, b, h in itertools.product((16, 256), (40, 128), (1, 2), (2, 4), (7, 8, 28))]
    grid += [((b, c, 8, 8, 8), (o, c, 1, 1, 1), s, 0) for c, o, s, b in itertools.product((8, 16), (20,), (1, 2), (2, 4))]
    return grid


@onednn_avx512
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_onednn_weight_gradient_matches_the_profiler_over_a_grid(bias: bool) -> None:
    # with a bias, ideep sums its gradient in a buffer of its own and the kernels add a padded bias
    # and a bias reducer over the batch (Note [CPU oneDNN convolution buffers])
    misses: list[str] = []
    checked = 0
    for xs, ws, stride, pad in _weight_grid():
        dim = len(xs) - 2
        x, w = torch.randn(*xs), torch.randn(*ws)
        fwd = (x, w, None, [stride] * dim, [pad] * dim, [1] * dim, False, [0] * dim, 1)
        if not str(torch._C._select_conv_backend(*fwd)).endswith("Mkldnn"):  # type: ignore[attr-defined]
            continue  # batch 1 with small inputs can go to ATen's own kernel
        g = torch.randn_like(torch.ops.aten.convolution(*fwd))
        bargs = (g, x, w, [ws[0]] if bias else None, [stride] * dim, [pad] * dim, [1] * dim, False, [0] * dim, 1, [False, True, bias])
        top, grads = _high_mark(lambda bargs=bargs: torch.ops.aten.convolution_backward(*bargs))
        predicted, measured = convolution_backward_workspace(bargs, {}, grads), top - _nbytes(grads)
        checked += 1
        if predicted != measured:
            misses.append(f"{xs} {ws} stride {stride}: predicted {predicted}, measured {measured}")
    assert checked >= 200, "too few shapes reached oneDNN to test its kernels"
    assert not misses, "\n".join(misses)


@onednn_avx512
def test_onednn_backward_copies_a_non_contiguous_grad_output() -> None:
    # a patch embedding's gradient arriving as a view (ViT at B=1): ATen makes it contiguous first
    x, w = torch.randn(1, 3, 32, 32), torch.randn(32, 3, 8, 8)
    g = torch.randn(1, 4, 4, 32).permute(0, 3, 1, 2)
    assert not g.is_contiguous()
    bargs = (g, x, w, [32], [8, 8], [0, 0], [1, 1], False, [0, 0], 1, [False, True, True])
    top, grads = _high_mark(lambda: torch.ops.aten.convolution_backward(*bargs))
    assert convolution_backward_workspace(bargs, {}, grads) == top - _nbytes(grads)


def _strided_grid() -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """(input shape, weight shape, padding), stride 2: the strided input-gradient kernel's scratchpad
    grows with cout and the output (Note [CPU oneDNN convolution buffers]); odd widths add a row buffer."""
    grid = [((2, c, h, h), (o, c, k, k), k // 2) for c, o, k, h in itertools.product((4, 16, 64), (16, 64, 256), (1, 3, 7), (8, 15, 28))]
    return grid + [((2, c, h, h, h), (o, c, 3, 3, 3), 1) for c, o, h in itertools.product((16, 32), (16, 64), (4, 7, 8))]


@onednn_avx512
def test_onednn_strided_input_gradient_matches_the_profiler_over_a_grid() -> None:
    misses: list[str] = []
    for xs, ws, pad in _strided_grid():
        dim = len(xs) - 2
        x, w = torch.randn(*xs), torch.randn(*ws)
        fwd = (x, w, None, [2] * dim, [pad] * dim, [1] * dim, False, [0] * dim, 1)
        assert str(torch._C._select_conv_backend(*fwd)).endswith("Mkldnn")  # type: ignore[attr-defined]
        g = torch.randn_like(torch.ops.aten.convolution(*fwd))
        bargs = (g, x, w, None, [2] * dim, [pad] * dim, [1] * dim, False, [0] * dim, 1, [True, False, False])
        top, grads = _high_mark(lambda bargs=bargs: torch.ops.aten.convolution_backward(*bargs))
        predicted, measured = convolution_backward_workspace(bargs, {}, grads), top - _nbytes(grads)
        if predicted != measured:
            misses.append(f"{xs} {ws}: predicted {predicted}, measured {measured}")
    assert not misses, "\n".join(misses)


@onednn_avx512
def test_onednn_strided_input_gradient_bounds_an_odd_number_of_channel_blocks() -> None:
    # 40 channels are three 16-channel blocks: oneDNN weighs a 16- against a 32-channel block by an
    # efficiency estimate the rule does not port, and the rule takes 32, so the weight copy it counts
    # has 64 input channels. Where oneDNN takes 16 (a copy with 48; the AVX512 machine the rule was
    # measured on) the rule is over by K * cout * (64 - 48) * 4 bytes; where it takes 32 too (the
    # Xeon CI runs on since) it is exact; never under.
    x, w = torch.randn(2, 40, 8, 8), torch.randn(256, 40, 7, 7)
    g = torch.randn_like(torch.ops.aten.convolution(x, w, None, [2, 2], [3, 3], [1, 1], False, [0, 0], 1))
    bargs = (g, x, w, None, [2, 2], [3, 3], [1, 1], False, [0, 0], 1, [True, False, False])
    top, grads = _high_mark(lambda: torch.ops.aten.convolution_backward(*bargs))
    over = convolution_backward_workspace(bargs, {}, grads) - (top - _nbytes(grads))
    assert over in (0, 49 * 256 * (64 - 48) * 4)


LSTMS = [
    # (seq, batch, input, hidden, layers, bidirectional)
    (12, 4, 16, 32, 2, False),
    (12, 1, 16, 32, 1, False),
    (24, 8, 8, 64, 1, False),
    (5, 3, 20, 40, 1, False),
    (6, 3, 10, 20, 2, True),
]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize(("seq", "batch", "inp", "hidden", "layers", "bi"), LSTMS)
def test_lstm_backward_workspace_matches_the_profiler(seq: int, batch: int, inp: int, hidden: int, layers: int, bi: bool) -> None:
    calls = _backward_calls(torch.nn.LSTM(inp, hidden, num_layers=layers, bidirectional=bi), seq, batch, inp)
    assert len(calls) == layers * (2 if bi else 1)
    for args in calls:
        top, grads = _high_mark(lambda args=args: torch.ops.aten.mkldnn_rnn_layer_backward.default(*args))
        over = mkldnn_rnn_layer_backward_workspace(args, {}, grads) - (top - _nbytes(grads))
        # exact but for H=64, T=24, N=8 (512 bytes over): Note [CPU oneDNN LSTM backward buffers]
        assert 0 <= over <= (512 if (seq, batch, hidden) == (24, 8, 64) else 0)


@onednn_avx512
@pytest.mark.parametrize(("name", "optimizer"), [("resnet50", "sgd"), ("unet3d", "adamw"), ("lstm-lm", "sgd-momentum")])
def test_zoo_peak_with_workspaces_is_within_one_percent(name: str, optimizer: str) -> None:
    spec = fxmem.load_model(f"zoo:{name}:test")
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, optimizer=optimizer, name=name, target="cpu")
    real = fxmem.load_model(f"zoo:{name}:test", meta=False).model
    measured = measure_peak(real, spec.inputs, 4, loss=spec.loss, optimizer=optimizer, first_step=False)
    predicted = report.peak(4, first_step=False)
    assert abs(predicted.bytes - measured.bytes) <= 0.01 * measured.bytes, (predicted.bytes, measured.bytes)


def _layouts(rows: int, cols: int) -> dict[str, Callable[[], torch.Tensor]]:
    """Eight ways a (rows, cols) operand reaches a matmul: the BLAS-ready ones and the ones ATen clones."""
    return {
        "contiguous": lambda: torch.randn(rows, cols),
        "transposed": lambda: torch.randn(cols, rows).t(),
        "expanded scalar": lambda: torch.randn(()).expand(rows, cols),  # a sum loss's gradient
        "expanded row": lambda: torch.randn(1, cols).expand(rows, cols),
        "expanded column": lambda: torch.randn(rows, 1).expand(rows, cols),
        "column slice": lambda: torch.randn(rows, cols + 8)[:, :cols],
        "every other row": lambda: torch.randn(2 * rows, cols)[::2],
        "every other column": lambda: torch.randn(rows, 2 * cols)[:, ::2],
    }


def test_matmul_operand_copies_match_the_profiler() -> None:
    # Note [CPU matmul operand copies]: 64 pairs of layouts, mm and addmm; 16 pairs need no copy.
    misses, copied = [], 0
    for (a_name, a_make), (b_name, b_make) in itertools.product(_layouts(24, 40).items(), _layouts(40, 56).items()):
        a, b, bias = a_make(), b_make(), torch.randn(56)
        for name, op, rule, args in (
            ("mm", torch.mm, mm_operand_copies, (a, b)),
            ("addmm", torch.addmm, addmm_operand_copies, (bias, a, b)),
        ):
            top, out = _high_mark(lambda op=op, args=args: op(*args))
            measured, predicted = top - _nbytes(out), rule(args, {}, out)
            copied += measured > 0
            if predicted != measured:
                misses.append(f"{name}({a_name}, {b_name}): predicted {predicted}, measured {measured}")
    assert copied == 2 * (64 - 16)
    assert not misses, "\n".join(misses)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_two_layer_lstm_with_256_hidden_units_peak() -> None:
    """Issue 18's LSTM: two layers of 256 units over 128 inputs, T = 50, B = 8. Its saved bytes were
    exact while the step's peak was 6.5% (steady) and 8.2% (first step) under the profiler's, for want
    of the padded weight-gradient rows and their copy in the backward (Note [CPU oneDNN LSTM backward
    buffers]); now within 0.5% of the real step, in the same phase."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = torch.nn.LSTM(128, 256, 2, batch_first=True)
            self.head = torch.nn.Linear(256, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(x)[0][:, -1])

    torch.manual_seed(0)
    model, inputs = Model(), ["B,50,128"]
    report = fxmem.analyze(model, inputs, loss="sum", optimizer="adamw", target="cpu")
    for first in (False, True):
        predicted = report.peak(8, first_step=first)
        measured = fxmem.measure_peak(model, inputs, 8, loss="sum", optimizer="adamw", first_step=first)
        assert predicted.phase == measured.phase
        assert abs(predicted.bytes / measured.bytes - 1) <= 0.005, (first, predicted.bytes, measured.bytes)


FORWARD_LSTMS = [
    # (seq, batch, input, hidden, bias): the GEMM merged over T (N < 128) and per step (N >= 128);
    # rows and gates that get_good_ld pads (256, 255 -> 1020 gates); no bias
    (12, 1, 16, 64, True), (12, 100, 16, 64, True), (12, 127, 16, 64, True), (3, 128, 16, 64, True),
    (2, 300, 8, 32, True), (10, 2, 256, 64, True), (4, 5, 32, 255, True), (4, 5, 32, 256, True),
    (5, 3, 7, 11, False), (29, 64, 180, 291, True),
]  # fmt: skip


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("seq", "batch", "inp", "hidden", "bias"), FORWARD_LSTMS)
def test_lstm_forward_workspace_matches_the_profiler(threads: int, seq: int, batch: int, inp: int, hidden: int, bias: bool) -> None:
    """Note [CPU oneDNN LSTM forward buffers]: the bytes mkldnn_rnn_layer holds above its outputs, to
    the byte, with frozen weights (the rule does not look at grad mode; nor, measured, does the op)."""
    from fxmem.rules.ops import mkldnn_rnn_layer_forward_workspace

    lstm, calls = torch.nn.LSTM(inp, hidden, bias=bias).requires_grad_(False), []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.overloadpacket == torch.ops.aten.mkldnn_rnn_layer:
                calls.append(args)
            return func(*args, **(kwargs or {}))

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(seq, batch, inp)
        with Spy():
            lstm(x)
        measured = scratch_of("aten::mkldnn_rnn_layer", lambda: lstm(x))
    finally:
        torch.set_num_threads(before)
    assert measured == mkldnn_rnn_layer_forward_workspace(calls[0], {}, None)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize("first_step", [False, True])
def test_frozen_lstm_forward_peak(first_step: bool) -> None:
    """The peak fuzzer's open case (Note [Peaks the fuzzer does not hold yet]): a frozen two-layer
    LSTM of 64 units under a trained head peaks in the forward, inside mkldnn_rnn_layer; at B=1 its
    reordered weights and scratchpad are most of that peak, which was 37% low without the forward
    rule."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = torch.nn.LSTM(8, 64, 2, batch_first=True).requires_grad_(False)
            self.head = torch.nn.Linear(64, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.rnn(x)[0])

    assert_step_peak(Model(), ["B,12,8"], 1, loss="sum", first_step=first_step)


# --------------------------------------------------------------------------------------------------
# CPU flash attention and layer norm scratch (Notes [CPU flash attention buffers] and [CPU layer norm
# buffers] in fxmem/rules/ops.py), held to the profiler's allocations in a real run.


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("queries", "keys", "head_dim"), [(5, 5, 1), (7, 7, 4), (192, 192, 8), (768, 768, 4), (600, 520, 8), (50, 513, 8)])
def test_cpu_flash_attention_forward_scratch(threads: int, queries: int, keys: int, head_dim: int) -> None:
    from fxmem.rules.ops import cpu_flash_attention_workspace

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k = torch.randn(1, 2, queries, head_dim), torch.randn(1, 2, keys, head_dim)
        op = "aten::_scaled_dot_product_flash_attention_for_cpu"
        measured = scratch_of(op, lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, k))
        assert cpu_flash_attention_workspace((q, k, k), {}, None) == measured
    finally:
        torch.set_num_threads(before)


class _PermutedNorm(nn.Module):
    """ConvNeXt's LayerNorm over channels: permute to channels last, normalize, permute back."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


@pytest.mark.parametrize("first_step", [False, True])
def test_permuted_layer_norm_step_peak(first_step: bool) -> None:
    """Its backward copies the gradient and the saved input to contiguous rows (9,216 bytes each at
    B=4, 16 channels, 6x6) beside per-thread weight sums: without the rule the peak was 48% low."""
    assert_step_peak(_PermutedNorm(16), ["B,16,6,6"], 4, loss="sum", first_step=first_step)


_GRADIENTS = {
    "contiguous": lambda: torch.ones(3, 2, 3),
    "expanded": lambda: torch.ones(()).expand(3, 2, 3),  # a sum's gradient
    "broadcast": lambda: torch.ones(3, 1, 3).expand(3, 2, 3),
    "transposed": lambda: torch.ones(3, 3, 2).transpose(1, 2),
}
_INPUTS = {"contiguous": lambda: torch.randn(3, 2, 3), "transposed": lambda: torch.randn(3, 3, 2).transpose(1, 2)}


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("grad", list(_GRADIENTS))
@pytest.mark.parametrize("inp", list(_INPUTS))
def test_cpu_gelu_backward_scratch(approximate: str, grad: str, inp: str) -> None:
    from fxmem.rules.ops import cpu_gelu_backward_workspace

    g, x = _GRADIENTS[grad](), _INPUTS[inp]()
    out = torch.ops.aten.gelu_backward(g, x, approximate=approximate)
    measured = scratch_of("aten::gelu_backward", lambda: torch.ops.aten.gelu_backward(g, x, approximate=approximate))
    assert cpu_gelu_backward_workspace((g, x), {"approximate": approximate}, out) == measured


def _dense_layouts(shape: tuple[int, ...]) -> dict[str, Callable[[], torch.Tensor]]:
    """Dense (contiguous, channels last) and non-dense (transposed, expanded) tensors of one shape."""
    to_last = (0, *range(2, len(shape)), 1)
    from_last = (0, len(shape) - 1, *range(1, len(shape) - 1))
    swapped = (*shape[:-2], shape[-1], shape[-2])
    return {
        "contiguous": lambda: torch.randn(shape),
        "channels_last": lambda: torch.randn([shape[i] for i in to_last]).permute(from_last),
        "transposed": lambda: torch.randn(swapped).transpose(-1, -2),
        "expanded": lambda: torch.ones(()).expand(shape),
    }


_A = torch.ops.aten


def _max_pool_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    forward = _A.max_pool2d_with_indices if x.dim() == 4 else _A.max_pool3d_with_indices
    backward = _A.max_pool2d_with_indices_backward if x.dim() == 4 else _A.max_pool3d_with_indices_backward
    k, zero, one = [2] * (x.dim() - 2), [0] * (x.dim() - 2), [1] * (x.dim() - 2)
    return backward(grad, x, k, k, zero, one, False, forward(x.contiguous(), k, k)[1])


def _adaptive_max_pool_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    forward = _A.adaptive_max_pool2d if x.dim() == 4 else _A.adaptive_max_pool3d
    backward = _A.adaptive_max_pool2d_backward if x.dim() == 4 else _A.adaptive_max_pool3d_backward
    return backward(grad, x, forward(x, [3] * (x.dim() - 2))[1])


def _pad(x: torch.Tensor) -> list[int]:
    return [1] * (2 * (x.dim() - 2))


# (forward, backward, op name): each backward takes (grad, x) as its first two arguments.
_POOLING = {
    "max_pool": (lambda x: _A.max_pool2d_with_indices(x, [2, 2], [2, 2])[0] if x.dim() == 4 else _A.max_pool3d_with_indices(x, [2] * 3, [2] * 3)[0], _max_pool_backward, "max_pool{n}d_with_indices_backward"),
    "avg_pool": (lambda x: F.avg_pool2d(x, 2) if x.dim() == 4 else F.avg_pool3d(x, 2), lambda g, x: (_A.avg_pool2d_backward if x.dim() == 4 else _A.avg_pool3d_backward)(g, x, [2] * (x.dim() - 2), [2] * (x.dim() - 2), [0] * (x.dim() - 2), False, True, None), "avg_pool{n}d_backward"),
    "adaptive_avg": (lambda x: F.adaptive_avg_pool2d(x, 3) if x.dim() == 4 else F.adaptive_avg_pool3d(x, 3), lambda g, x: (_A._adaptive_avg_pool2d_backward if x.dim() == 4 else _A._adaptive_avg_pool3d_backward)(g, x), "_adaptive_avg_pool{n}d_backward"),
    "adaptive_max": (lambda x: F.adaptive_max_pool2d(x, 3) if x.dim() == 4 else F.adaptive_max_pool3d(x, 3), _adaptive_max_pool_backward, "adaptive_max_pool{n}d_backward"),
    "reflection_pad": (lambda x: F.pad(x, _pad(x), mode="reflect"), lambda g, x: (_A.reflection_pad2d_backward if x.dim() == 4 else _A.reflection_pad3d_backward)(g, x, _pad(x)), "reflection_pad{n}d_backward"),
    "replication_pad": (lambda x: F.pad(x, _pad(x), mode="replicate"), lambda g, x: (_A.replication_pad2d_backward if x.dim() == 4 else _A.replication_pad3d_backward)(g, x, _pad(x)), "replication_pad{n}d_backward"),
    "upsample_nearest": (lambda x: F.interpolate(x, scale_factor=2), lambda g, x: (_A.upsample_nearest2d_backward if x.dim() == 4 else _A.upsample_nearest3d_backward)(g, list(g.shape[2:]), list(x.shape)), "upsample_nearest{n}d_backward"),
}  # fmt: skip


@pytest.mark.parametrize("shape", [(2, 3, 6, 8), (2, 3, 4, 6, 4)], ids=["2d", "3d"])
@pytest.mark.parametrize("kind", list(_POOLING))
def test_cpu_pooling_backward_scratch(kind: str, shape: tuple[int, ...]) -> None:
    """Every input and gradient layout: the rule's scratch equals the profiler's, op by op."""
    from fxmem.rules.ops import WORKSPACE_RULES

    forward, backward, name = _POOLING[kind]
    name = name.format(n=len(shape) - 2)
    rule = WORKSPACE_RULES.rules()[(f"aten.{name}", "cpu")]
    wrong = []
    for x_layout, make_x in _dense_layouts(shape).items():
        if x_layout == "expanded":
            continue
        x = make_x()
        for g_layout, make_g in _dense_layouts(tuple(forward(x).shape)).items():
            g = make_g()
            calls: list[tuple[Any, ...]] = []
            with _Calls(name, calls):
                out = backward(g, x)
            args, kwargs = calls[0]
            measured = scratch_of(f"aten::{name}", lambda g=g, x=x: backward(g, x))
            if rule(args, kwargs, out) != measured:
                wrong.append((x_layout, g_layout, rule(args, kwargs, out), measured))
    assert not wrong, wrong


def test_cpu_adaptive_max_pool_backward_copies_indices() -> None:
    """Contiguous indices beside a channels-last input: the 2-D kernel works channels-last and copies
    them (2*3*3*3 int64 = 432 bytes), besides the contiguous gradient (2*3*3*3 float32 = 216 bytes)."""
    from fxmem.rules.ops import cpu_adaptive_max_pool_backward_workspace

    x = torch.randn(2, 6, 8, 3).permute(0, 3, 1, 2)
    indices = _A.adaptive_max_pool2d(x, [3, 3])[1].contiguous()
    grad = torch.randn(2, 3, 3, 3)
    run = lambda: _A.adaptive_max_pool2d_backward(grad, x, indices)
    assert scratch_of("aten::adaptive_max_pool2d_backward", run) == 432 + 216
    assert cpu_adaptive_max_pool_backward_workspace((grad, x, indices), {}, run()) == 432 + 216


def _backward_call(name: str, out: torch.Tensor) -> tuple[tuple[Any, ...], int]:
    """The (args, kwargs) of the aten op ``name`` in ``out``'s backward (ones as its gradient), and the
    profiler's scratch of that op in a second backward of the same graph."""
    grad = torch.ones_like(out)
    calls: list[tuple[Any, ...]] = []
    with _Calls(name, calls):
        out.backward(grad, retain_graph=True)
    return calls[0], scratch_of(f"aten::{name}", lambda: out.backward(grad, retain_graph=True))


class _Calls(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (args, kwargs) of every call of the aten op ``name``."""

    def __init__(self, name: str, calls: list[tuple[Any, ...]]) -> None:
        super().__init__()
        self.name, self.calls = name, calls

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ == self.name:
            self.calls.append((args, kwargs or {}))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("per_sample_weights", [False, True])
@pytest.mark.parametrize(("count", "bags"), [(27, 3), (100, 10), (7, 7)])
def test_cpu_embedding_bag_backward_scratch(mode: str, padding_idx: int | None, per_sample_weights: bool, count: int, bags: int) -> None:
    """Note [CPU embedding_bag backward scratch]: the rule against the profiler, configuration by configuration."""
    from fxmem.rules.ops import cpu_embedding_bag_backward_workspace

    if per_sample_weights and mode != "sum":
        pytest.skip("per-sample weights need mode='sum'")
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(12, 7, mode=mode, padding_idx=padding_idx)
    indices = torch.randint(0, 12, (bags, count // bags))
    out = bag(indices, per_sample_weights=torch.rand(indices.shape) if per_sample_weights else None)
    (args, kwargs), measured = _backward_call("_embedding_bag_backward", out)
    assert cpu_embedding_bag_backward_workspace(args, kwargs, None) == measured


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
@pytest.mark.parametrize("hidden", [1, 2, 3, 4, 8, 32])
@pytest.mark.parametrize(("seq", "batch", "inputs"), [(1, 3, 1), (5, 2, 3), (3, 4, 8)])
def test_lstm_backward_scratch_at_small_hidden_sizes(hidden: int, seq: int, batch: int, inputs: int) -> None:
    """Note [CPU oneDNN LSTM backward buffers], its last paragraph: the profiler's scratch of one
    backward call. Exact but where the gates (4H) are fewer than one 64-byte line; there the rule is
    at most 96 bytes over (seen at H = 1 to 3), from buffers oneDNN frees before the last is made."""
    from fxmem.rules.ops import mkldnn_rnn_layer_backward_workspace

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        lstm = nn.LSTM(inputs, hidden, batch_first=True)
        out = lstm(torch.randn(batch, seq, inputs, requires_grad=True))[0]
        (args, kwargs), measured = _backward_call("mkldnn_rnn_layer_backward", out)
        predicted = mkldnn_rnn_layer_backward_workspace(args, kwargs, None)
    finally:
        torch.set_num_threads(before)
    assert predicted == measured or (4 * hidden < 16 and 0 < predicted - measured <= 96), (predicted, measured)


@pytest.mark.parametrize("first_step", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_batch_norm_backward_without_input_gradient(batch: int, first_step: bool) -> None:
    """Note [Batch norm backward without an input gradient]: the real kernel returns no input gradient
    when none is asked for, and the step's peak follows (it was 43% high at B=1 for this model)."""
    from fxmem.rules.ops import batch_norm_backward_outputs

    x, weight, mean, var = torch.randn(2, 3, 4, 4), torch.ones(3), torch.zeros(3), torch.ones(3)
    _, save_mean, save_invstd = _A.native_batch_norm(x, weight, None, mean, var, True, 0.1, 1e-5)
    args = (torch.ones_like(x), x, weight, mean, var, save_mean, save_invstd, True, 1e-5, [False, True, True])
    real = _A.native_batch_norm_backward(*args)
    assert real[0] is None  # the real kernel made no input gradient
    assert batch_norm_backward_outputs(args, {}, real) == {0: 0}
    assert_step_peak(nn.Sequential(nn.BatchNorm2d(2)), ["B,2,8,9"], batch, loss="sum", first_step=first_step, phase="any")


# --------------------------------------------------------------------------------------------------
# Attention's backward, batched matmuls and 2-D upsampling (Notes [CPU flash attention buffers],
# [CPU batched matmul operand copies] and [CPU 2-D upsampling works channels-last] in
# fxmem/rules/ops.py), each held to the profiler's high mark less the outputs.


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", ["kernel order", "head rows"])
@pytest.mark.parametrize(
    ("batch", "heads", "length", "head_dim"), [(4, 4, 16, 8), (2, 2, 100, 16), (1, 8, 200, 8), (3, 1, 37, 4), (1, 2, 800, 16)]
)
def test_cpu_flash_attention_backward_scratch(threads: int, layout: str, batch: int, heads: int, length: int, head_dim: int) -> None:
    """The blocks, one row sum for all threads, and a copy of the output's gradient unless it is laid
    out (B, S, H, D) as the kernel works (never with one head: then both orders are one)."""
    from fxmem.rules.ops import cpu_flash_attention_backward_workspace

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v = (torch.randn(batch, length, heads, head_dim).transpose(1, 2) for _ in range(3))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[:2]
        if layout == "kernel order":
            grad = torch.randn(batch, length, heads, head_dim).transpose(1, 2)
        else:
            grad = torch.randn(batch, heads, length, head_dim)
        args = (grad, q, k, v, out, lse, 0.0, False)
        top, grads = _high_mark(lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*args))
        assert cpu_flash_attention_backward_workspace(args, {}, grads) == top - _nbytes(grads)
    finally:
        torch.set_num_threads(before)


def _batched_layouts(n: int, rows: int, cols: int) -> dict[str, Callable[[], torch.Tensor]]:
    return {
        "contiguous": lambda: torch.randn(n, rows, cols),
        "transposed slices": lambda: torch.randn(n, cols, rows).transpose(1, 2),
        "batch last": lambda: torch.randn(rows, cols, n).permute(2, 0, 1),
        "column slice": lambda: torch.randn(n, rows, cols + 3)[:, :, :cols],
        "expanded batch": lambda: torch.randn(1, rows, cols).expand(n, rows, cols),
    }


@pytest.mark.parametrize(("n", "rows", "inner", "cols"), [(4, 33, 8, 33), (4, 33, 33, 8), (3, 5, 4, 6), (2, 40, 16, 40)])
def test_bmm_operand_copies_match_the_profiler(n: int, rows: int, inner: int, cols: int) -> None:
    """Note [CPU batched matmul operand copies]: 25 layout pairs each, bmm and baddbmm; (3, 5, 4, 6) is
    under 400 multiply-adds a slice, ATen's own loop, which copies nothing."""
    from fxmem.rules.ops import baddbmm_operand_copies, bmm_operand_copies

    misses, copied = [], 0
    pairs = itertools.product(_batched_layouts(n, rows, inner).items(), _batched_layouts(n, inner, cols).items())
    for (a_name, a_make), (b_name, b_make) in pairs:
        a, b, bias = a_make(), b_make(), torch.randn(n, rows, cols)
        for name, op, rule, args in (
            ("bmm", torch.bmm, bmm_operand_copies, (a, b)),
            ("baddbmm", torch.baddbmm, baddbmm_operand_copies, (bias, a, b)),
        ):
            top, out = _high_mark(lambda op=op, args=args: op(*args))
            measured = top - _nbytes(out)
            copied += measured > 0
            if rule(args, {}, out) != measured:
                misses.append(f"{name}({a_name}, {b_name}): predicted {rule(args, {}, out)}, measured {measured}")
    assert not misses, "\n".join(misses)
    assert (copied > 0) == (rows * inner * cols >= 400)


_UPSAMPLE_LAYOUTS: dict[str, Callable[[tuple[int, ...]], torch.Tensor]] = {
    "contiguous": lambda s: torch.randn(*s),
    "channels last": lambda s: torch.randn(*s).to(memory_format=torch.channels_last),
    "transposed": lambda s: torch.randn(s[0], s[1], s[3], s[2]).transpose(2, 3),
    "channel slice": lambda s: torch.randn(s[0], s[1] + 2, *s[2:])[:, 1:-1],
}


@pytest.mark.parametrize("layout", list(_UPSAMPLE_LAYOUTS))
@pytest.mark.parametrize(("mode", "align"), [("nearest", None), ("nearest-exact", None), ("bilinear", False), ("bilinear", True)])
def test_cpu_upsample_2d_copies_match_the_profiler(layout: str, mode: str, align: bool | None) -> None:
    """Note [CPU 2-D upsampling works channels-last]: an input not channels-last is copied, and an
    output not channels-last is computed into a temporary; one channel is both layouts."""
    from fxmem.rules.ops import cpu_upsample_2d_workspace

    op = {"nearest": "upsample_nearest2d", "nearest-exact": "_upsample_nearest_exact2d", "bilinear": "upsample_bilinear2d"}[mode]
    copied = 0
    for shape in [(2, 1, 5, 7), (2, 3, 5, 7), (4, 6, 1, 1), (3, 16, 8, 8), (2, 8, 1, 9)]:
        x = _UPSAMPLE_LAYOUTS[layout](shape)
        kwargs = {} if align is None else {"align_corners": align}
        top, y = _high_mark(lambda x=x, kwargs=kwargs: F.interpolate(x, scale_factor=2, mode=mode, **kwargs))
        measured = top - _nbytes(y)
        copied += measured > 0
        assert cpu_upsample_2d_workspace((x,), {}, y) == measured, (shape, op)
    assert copied > 0 or layout == "channels last"


def test_cpu_safe_softmax_scratch() -> None:
    """The math attention's softmax on the CPU: -inf marks (one bool per score), one bool a row and a
    4-byte zero, as on CUDA: 2 x 3 x 7 x 9 scores make 378 + 42 + 4 bytes."""
    from fxmem.rules.ops import workspace_rules_for

    x = torch.randn(2, 3, 7, 9)
    top, y = _high_mark(lambda: torch.ops.aten._safe_softmax(x, -1))
    assert top - _nbytes(y) == 378 + 42 + 4
    assert workspace_rules_for("cpu")["aten._safe_softmax"]((x, -1), {}, y) == 378 + 42 + 4


_GENERIC_UPSAMPLES = [
    # (input shape, mode, taps): 1-D and 3-D contiguous inputs and bicubic take the generic kernel
    ((2, 1, 2), "nearest", 1), ((2, 4, 6), "linear", 2), ((1, 2, 7), "nearest-exact", 1),
    ((2, 4, 3, 3, 3), "nearest", 1), ((2, 1, 3, 2, 5), "trilinear", 2), ((2, 3, 5, 7), "bicubic", 4),
]  # fmt: skip


@pytest.mark.parametrize(("shape", "mode", "taps"), _GENERIC_UPSAMPLES)
def test_cpu_upsample_index_tables_match_the_profiler(shape: tuple[int, ...], mode: str, taps: int) -> None:
    """Note [CPU upsampling's index tables]: 12 bytes (an int64 position and a float32 weight) per
    tap per output position per spatial dimension; at scale 2, (2, 4, 3, 3, 3) nearest is
    1 x 12 x (6 + 6 + 6) = 216 bytes."""
    from fxmem.rules.ops import workspace_rules_for

    x = torch.randn(*shape)
    top, y = _high_mark(lambda: F.interpolate(x, scale_factor=2, mode=mode))
    assert top - _nbytes(y) == taps * 12 * sum(2 * n for n in shape[2:])
    rule = workspace_rules_for("cpu")[f"aten.{_UPSAMPLE_OP[mode, len(shape)]}"]
    assert rule((x,), {}, y) == top - _nbytes(y)


_UPSAMPLE_OP = {
    ("nearest", 3): "upsample_nearest1d", ("linear", 3): "upsample_linear1d", ("nearest-exact", 3): "_upsample_nearest_exact1d",
    ("nearest", 5): "upsample_nearest3d", ("trilinear", 5): "upsample_trilinear3d", ("bicubic", 4): "upsample_bicubic2d",
}  # fmt: skip
