"""fxmem/engine/dispatch.py: ops computed otherwise than by their fake kernels, held to eager runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fxmem.engine.dispatch import OpRuleMode
from fxmem.rules.ops import layout_rules_for
from tests.helpers import assert_step_peak

_A = torch.ops.aten
_LOSS_GRADIENTS = {
    "mse": lambda g, x, t: _A.mse_loss_backward(g, x, t, 1),
    "smooth_l1": lambda g, x, t: _A.smooth_l1_loss_backward(g, x, t, 1, 1.0),
    "huber": lambda g, x, t: _A.huber_loss_backward(g, x, t, 1, 1.0),
}


@pytest.mark.parametrize("loss", list(_LOSS_GRADIENTS))
def test_loss_gradient_has_the_eager_layout(loss: str) -> None:
    """Note [Loss gradients in the legacy layout]: a permuted input's gradient is contiguous in eager."""
    x = torch.rand(2, 3, 4, 5).permute(0, 2, 3, 1)
    t, g = torch.rand_like(x), torch.tensor(1.0)
    eager = _LOSS_GRADIENTS[loss](g, x, t)
    with FakeTensorMode() as mode, OpRuleMode({}, {}):
        fake = _LOSS_GRADIENTS[loss](mode.from_tensor(g), mode.from_tensor(x), mode.from_tensor(t))
    assert eager.is_contiguous() and not x.is_contiguous()
    assert (fake.shape, fake.stride(), fake.dtype) == (eager.shape, eager.stride(), eager.dtype)


class PermutedOutput(nn.Module):
    """A channels-last LayerNorm whose output is permuted back: mse's gradient reaches the norm's
    backward permuted, so the real step copies it to contiguous rows (Note [CPU layer norm buffers])."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 4, 1)).permute(0, 4, 1, 2, 3)


@pytest.mark.parametrize("first_step", [False, True])
def test_permuted_output_step_peak(first_step: bool) -> None:
    """Found by the peak fuzzer: 13% low (one gradient copy, 1,728 bytes at B=4) before the rewrite."""
    model, inputs = PermutedOutput(), ["B,6,2,3,3"]
    assert_step_peak(model, inputs, 4, loss="mse", first_step=first_step)


@pytest.mark.parametrize(
    "pad",
    [(1, 2), (0, 2, 0, 1, 1, 0), (-1, 1), (1, -2, -1, 0), (2, 2, 2, 2, 1, 1)],
)
@pytest.mark.parametrize("channels_last", [False, True])
def test_constant_pad_matches_aten(pad: tuple[int, ...], channels_last: bool) -> None:
    """The rewrite computes what ATen's kernel computes, values and layout, negative pads (crops) included."""
    from fxmem.engine.dispatch import _constant_pad_nd

    x = torch.randn(2, 3, 4, 5)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    expected = torch.constant_pad_nd(x, pad, 0.5)
    got = _constant_pad_nd(x, pad, 0.5)
    assert got.shape == expected.shape and got.stride() == expected.stride()
    torch.testing.assert_close(got, expected)


class PaddedTail(nn.Module):
    """The peak fuzzer's model: a channels-last LayerNorm, tanh and a constant pad. The pad's backward
    (a constant pad with negative pads) held a second padded tensor on fake tensors: 5.3% high."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x.view(x.size(0), 4, 7, 1, 3).permute(0, 2, 3, 4, 1)).permute(0, 4, 1, 2, 3)
        return torch.nn.functional.pad(y.tanh(), (0, 2, 0, 1, 1, 0))


@pytest.mark.parametrize("first_step", [False, True])
def test_padded_tail_step_peak(first_step: bool) -> None:
    model, inputs = PaddedTail(), ["B,4,7,3"]
    assert_step_peak(model, inputs, 4, loss="mse", first_step=first_step)


_NORM_LAYOUTS = [
    # (shape made contiguous, permutation): a transposed sequence, transposed spatial axes, a batch
    # moved inward, a 5-d one, channels-last (kept), and 2-d
    ((2, 4, 6), (0, 2, 1)), ((2, 6, 3, 4), (0, 1, 3, 2)), ((3, 2, 6, 4), (1, 2, 0, 3)),
    ((2, 6, 3, 4, 5), (0, 1, 4, 2, 3)), ((2, 3, 4, 6), (0, 3, 1, 2)), ((6, 4), (1, 0)),
]  # fmt: skip


@pytest.mark.parametrize(("shape", "permutation"), _NORM_LAYOUTS)
def test_batch_norm_outputs_have_the_cpu_kernel_layout(shape: tuple[int, ...], permutation: tuple[int, ...]) -> None:
    """Note [Batch norm outputs in the suggested layout]: the output and the input's gradient of a
    CPU batch norm have the strides eager gives them (not the fake kernel's, which keep the input's)."""

    def norm_and_gradient(x: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
        weight, bias = torch.ones(x.shape[1]), torch.zeros(x.shape[1])
        out, mean, invstd = _A.native_batch_norm(x, weight, bias, None, None, True, 0.1, 1e-5)
        grad = _A.native_batch_norm_backward(torch.ones_like(out), x, weight, None, None, mean, invstd, True, 1e-5, [True, True, True])
        return tuple(out.stride()), tuple(grad[0].stride())

    x = torch.randn(*shape).permute(*permutation)
    eager = norm_and_gradient(x)
    with FakeTensorMode() as mode, OpRuleMode({}, {}, layout_rules_for("cpu")):
        fake = norm_and_gradient(mode.from_tensor(x))
    with FakeTensorMode() as mode:
        unruled = norm_and_gradient(mode.from_tensor(x))
    assert fake == eager
    if not x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last):
        assert unruled != eager  # the fake kernel alone keeps the input's strides: the rule is needed


class Indexed(nn.Module):
    """An embedding's (B, 7, 3) output indexed as the fuzzer and vision models index it: a slice spanning
    the symbolic batch (``:``) that eager elides, before a slice or a select of another axis."""

    def __init__(self, index: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.embed(x)
        return {
            "slice": lambda: y[:, 0:1],
            "cls": lambda: y[:, 0],
            "middle": lambda: y[:, 2:5],
            "last": lambda: y[..., -1],
            "narrow": lambda: y.narrow(1, 1, 3),
        }[self.index]()


@pytest.mark.parametrize("index", ["slice", "cls", "middle", "last", "narrow"])
def test_indexing_backward_step_peak(index: str) -> None:
    """Note [Slicing with a symbolic size]: without it, the whole-batch slice's backward made a second
    (B, 7, 3) gradient, 84 bytes a sample, that the real step never allocates."""
    for batch in (2, 3):
        assert_step_peak(Indexed(index), ["B,7:int64"], batch, loss="sum", first_step=False)
