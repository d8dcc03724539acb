"""The kernel-workspace rules of fxmem/rules/ops.py against torch.profiler on the real CPU kernels.

For each op the measured figure is the op's own high mark (its allocations, summed in order, at their
highest) less the bytes of the outputs it returns: what the timeline charges as the op's workspace.
The oneDNN rules describe this machine's kernels on an AVX512 CPU (Note [CPU oneDNN convolution
buffers]), so those tests skip elsewhere.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import fxmem
from fxmem.measure import measure_peak
from fxmem.rules.ops import convolution_backward_workspace, convolution_workspace, mkldnn_rnn_layer_backward_workspace

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


@onednn_avx512
@pytest.mark.parametrize(("xs", "ws", "stride", "pad", "mask"), CONVS, ids=lambda v: str(v).replace(" ", ""))
def test_onednn_convolution_workspace_matches_the_profiler(xs: tuple[int, ...], ws: tuple[int, ...], stride: int, pad: int, mask: tuple[bool, ...]) -> None:
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
def test_onednn_reduction_heuristic_overstates_by_at_most_one_weight_copy() -> None:
    # Note [CPU oneDNN convolution buffers]: this kernel shares one channel block without the
    # per-thread reduction copy the rule assumes for it.
    x, w = torch.randn(4, 12, 16, 16), torch.randn(12, 12, 3, 3)
    bargs = (torch.randn(4, 12, 16, 16), x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])
    top, grads = _high_mark(lambda: torch.ops.aten.convolution_backward(*bargs))
    over = convolution_backward_workspace(bargs, {}, grads) - (top - _nbytes(grads))
    assert 0 <= over <= 8384 + 16 * 16 * 9 * 4


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
    calls: list[tuple[Any, ...]] = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.overloadpacket == torch.ops.aten.mkldnn_rnn_layer_backward:
                calls.append(args)
            return func(*args, **(kwargs or {}))

    lstm = torch.nn.LSTM(inp, hidden, num_layers=layers, bidirectional=bi)
    y = lstm(torch.randn(seq, batch, inp, requires_grad=True))[0]
    with Spy():
        y.backward(torch.randn_like(y))
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
