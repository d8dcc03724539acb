"""The CPU group norm's and batch norm backward's buffers (Notes [CPU group norm buffers] and [CPU batch
norm backward buffers] in fxmem/rules/cpu_norms.py) against torch.profiler on the real kernels, op by
op, and the whole step's peak against ``measure_peak``."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import fxmem
from fxmem.rules.cpu_norms import cpu_batch_norm_backward_workspace, cpu_group_norm_backward_workspace, cpu_group_norm_workspace
from tests.helpers import scratch_of

_A = torch.ops.aten


@pytest.fixture
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run the test on ``request.param`` threads (the channels-last forward sums per thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


SHAPES = [
    # (input shape, groups): 1-D, 2-D and 3-D; groups 1, C and between; 1 to 1600 positions per
    # channel, 1023 and 1024 on either side of the channels-last forward's threshold
    ((3, 3, 1), 1), ((2, 6, 1), 3), ((1, 4, 7), 2), ((5, 16, 33), 16),
    ((2, 6, 5, 3), 3), ((4, 32, 1, 1), 8), ((5, 10, 31, 33), 5), ((3, 8, 32, 32), 2), ((2, 8, 40, 40), 8),
    ((1, 16, 2, 2, 2), 4), ((2, 6, 12, 12, 8), 1),
]  # fmt: skip
LAYOUTS = {3: ["contiguous"], 4: ["contiguous", "channels last"], 5: ["contiguous", "channels last"]}
CASES = [(shape, groups, layout) for shape, groups in SHAPES for layout in LAYOUTS[len(shape)]]


def _group_norm_input(shape: tuple[int, ...], layout: str, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(*shape, dtype=dtype)
    if layout == "channels last":
        return x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    return x


def _group_norm_args(x: torch.Tensor, groups: int, weight_dtype: torch.dtype) -> tuple[Any, ...]:
    """native_group_norm's (input, weight, bias, N, C, HxW, group, eps)."""
    n, c = x.shape[:2]
    w, b = torch.randn(c, dtype=weight_dtype), torch.randn(c, dtype=weight_dtype)
    return (x, w, b, n, c, x[0, 0].numel(), groups, 1e-5)


DTYPES = [(torch.float32, torch.float32), (torch.float64, torch.float64), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("shape", "groups", "layout"), CASES, ids=str)
def test_group_norm_forward_scratch(
    shape: tuple[int, ...], groups: int, layout: str, dtype: torch.dtype, weight_dtype: torch.dtype, threads: int
) -> None:
    """Contiguous: none; channels last: N x 2C below 1024 positions, T x N x 2C + N x 2G from 1024."""
    args = _group_norm_args(_group_norm_input(shape, layout, dtype), groups, weight_dtype)
    measured = scratch_of("aten::native_group_norm", lambda: _A.native_group_norm(*args))
    assert cpu_group_norm_workspace(args, {}, None) == measured


# A channels-last backward that computes no input gradient crashes the process (torch 2.13, CPU:
# segmentation fault), so only the contiguous backward is measured without one.
MASKS = {"all": [True, True, True], "no input": [False, True, True], "input only": [True, False, False]}
BACKWARDS = [(*case, mask) for case, mask in itertools.product(CASES, MASKS) if case[2] == "contiguous" or mask != "no input"]


@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize(("shape", "groups", "layout", "mask"), BACKWARDS, ids=str)
def test_group_norm_backward_scratch(
    shape: tuple[int, ...], groups: int, layout: str, mask: str, dtype: torch.dtype, weight_dtype: torch.dtype
) -> None:
    """ds and db: N x C each, in the accumulate type, whichever gradients are asked for."""
    x, w, b, n, c, hxw, g, eps = _group_norm_args(_group_norm_input(shape, layout, dtype), groups, weight_dtype)
    y, mean, rstd = _A.native_group_norm(x, w, b, n, c, hxw, g, eps)
    args = (torch.randn_like(y), x, mean, rstd, w, n, c, hxw, g, MASKS[mask])
    measured = scratch_of("aten::native_group_norm_backward", lambda: _A.native_group_norm_backward(*args))
    assert cpu_group_norm_backward_workspace(args, {}, None) == measured


class _ChannelsLastGroupNorm(nn.Module):
    """A per-channel scale (so that the norm's input wants a gradient, see above), then GroupNorm, on a
    channels-last copy of the input."""

    def __init__(self, groups: int, channels: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(channels))
        self.norm = nn.GroupNorm(groups, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
        return self.norm(x * self.scale.view(-1, *[1] * (x.dim() - 2)))


STEPS = [
    # (model, input): the backward's ds and db are the step's top at these sizes
    (nn.GroupNorm(1, 3), "B,3,1"),  # found by the fuzzer: 72 B low at B=3 (2 x 3 x 3 x 4)
    (nn.GroupNorm(3, 6), "B,6,1"),
    (nn.GroupNorm(6, 6), "B,6,5"),
    (nn.GroupNorm(8, 16), "B,16,7"),
    (nn.GroupNorm(6, 6), "B,6,4,4"),
    (nn.GroupNorm(2, 8), "B,8,3,3"),
    (nn.GroupNorm(2, 4), "B,4,32,32"),
    (nn.GroupNorm(1, 4), "B,4,2,3,2"),
    (nn.GroupNorm(4, 8), "B,8,2,2,2"),
    (_ChannelsLastGroupNorm(2, 8), "B,8,4,4"),
    (_ChannelsLastGroupNorm(2, 4), "B,4,32,32"),
    (_ChannelsLastGroupNorm(4, 8), "B,8,4,4,4"),
    # Note [CPU batch norm backward buffers]: a ReLU's gradient is dense, so the fused kernel runs;
    # found by the fuzzer: 72 B low at B=3 (the input-sized buffer, 3 x 6 floats)
    (nn.Sequential(nn.Linear(1, 6, bias=False), nn.ReLU(), nn.BatchNorm3d(1, affine=False), nn.ReLU()), "B,1,1,1,1"),
    (nn.Sequential(nn.Linear(4, 6, bias=False), nn.BatchNorm2d(2), nn.ReLU()), "B,2,5,4"),  # 720 B (16%) low at B=3
    (nn.Sequential(nn.Linear(4, 6, bias=False), nn.BatchNorm2d(2)), "B,2,5,4"),  # a sum's gradient: C floats
]


@pytest.mark.parametrize("threads", [1], indirect=True)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(("model", "inputs"), STEPS, ids=[inputs for _, inputs in STEPS])
def test_group_norm_step_peak(model: nn.Module, inputs: str, batch: int, threads: int) -> None:
    """A steady AdamW step's peak equals the real one's to the byte (without the rules it was low by the
    group norm's 2NC floats, the batch norm's input-sized buffer or its C floats)."""
    report = fxmem.analyze(model, [inputs], loss="sum", optimizer="adamw", target="cpu")
    predicted = report.peak(batch, first_step=False)
    measured = fxmem.measure_peak(model, [inputs], batch, loss="sum", optimizer="adamw", first_step=False)
    assert (predicted.bytes, predicted.phase) == (measured.bytes, measured.phase)


_BN_GRADIENTS: dict[str, Callable[[tuple[int, ...], torch.dtype], torch.Tensor]] = {
    "contiguous": lambda shape, dtype: torch.randn(*shape, dtype=dtype),
    "expanded": lambda shape, dtype: torch.ones((), dtype=dtype).expand(shape),  # a sum's gradient
    "transposed": lambda shape, dtype: torch.randn(*shape[:-2], shape[-1], shape[-2], dtype=dtype).transpose(-1, -2),
    "channels last": lambda shape, dtype: torch.randn(*shape, dtype=dtype).contiguous(memory_format=torch.channels_last),
}


def _batch_norm_backward_cases(shape: tuple[int, ...], dtype: torch.dtype) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """(description, native_batch_norm_backward's arguments) over layouts, weights, modes and masks."""
    layouts = ["contiguous", "channels last"] if len(shape) == 4 else ["contiguous"]
    gradients = [g for g in _BN_GRADIENTS if g != "channels last" or len(shape) == 4]
    masks = [m for m in itertools.product([True, False], repeat=3) if any(m)]
    for layout, grad, affine, train, mask in itertools.product(layouts, gradients, [False, True], [True, False], masks):
        x = _group_norm_input(shape, layout, dtype)
        c = shape[1]
        weight = torch.ones(c, dtype=dtype) if affine else None
        mean, var = torch.zeros(c, dtype=dtype), torch.ones(c, dtype=dtype)
        _, save_mean, save_invstd = _A.native_batch_norm(x, weight, None, mean, var, train, 0.1, 1e-5)
        args = (_BN_GRADIENTS[grad](shape, dtype), x, weight, mean, var, save_mean, save_invstd, train, 1e-5, list(mask))
        yield f"{layout} input, {grad} gradient, weight {affine}, train {train}, mask {mask}", args


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(3, 2, 5, 4), (5, 8, 4, 4), (4, 3, 7), (2, 3, 2, 3, 4), (3, 1, 1, 1, 6)], ids=str)
def test_batch_norm_backward_scratch(shape: tuple[int, ...], dtype: torch.dtype, threads: int) -> None:
    """Fused kernel: the input's size with an input gradient, else 0 (contiguous) or (2T + [no weight]
    + [eval]) x C values (channels last); the reductions' path: C values."""
    wrong = []
    for what, args in _batch_norm_backward_cases(shape, dtype):
        measured = scratch_of("aten::native_batch_norm_backward", functools.partial(_A.native_batch_norm_backward, *args))
        predicted = cpu_batch_norm_backward_workspace(args, {}, None)
        if predicted != measured:
            wrong.append((what, predicted, measured))
    assert not wrong
