"""CPU losses whose reduced value keeps an input-sized storage (Note [CPU losses that keep an
input-sized storage] in fxmem/rules/ops.py), held to real CPU runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxmem.rules.ops import loss_reduction_workspace, loss_value_storage
from tests.helpers import assert_step_peak

_REDUCED = {"mean": 1, "sum": 2}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("op", [torch.ops.aten.mse_loss, torch.ops.aten.smooth_l1_loss, torch.ops.aten.soft_margin_loss])
def test_reduced_loss_keeps_the_input_bytes(op: object, reduction: str) -> None:
    a, t = torch.randn(6, 10), torch.randn(6, 10)
    args = (a, t, _REDUCED[reduction]) + ((1.0,) if op is torch.ops.aten.smooth_l1_loss else ())
    value = op(*args)  # type: ignore[operator]
    assert value.dim() == 0
    # The real kernel's storage, against the rule's: 60 float32 elements = 240 bytes.
    assert value.untyped_storage().nbytes() == 240
    assert loss_value_storage(args, {}, value) == {0: 240}


def test_unreduced_and_plain_scalar_losses_get_no_rule() -> None:
    a, t = torch.randn(6, 10), torch.randn(6, 10)
    assert loss_value_storage((a, t, 0), {}, torch.ops.aten.mse_loss(a, t, 0)) == {}
    assert loss_reduction_workspace((a, t, 0), {}, None, buffer=True) == 0
    for loss in (F.l1_loss, F.huber_loss, F.binary_cross_entropy_with_logits):  # no rule is registered for these
        assert loss(a, torch.rand(6, 10)).untyped_storage().nbytes() == 4


def test_mean_workspace_by_hand() -> None:
    """mse's mean over 60 float32 values: the 240-byte elementwise buffer, the 8-byte wrapped count and
    its 4-byte float32 copy; a sum needs only the buffer."""
    a = torch.randn(6, 10)
    assert loss_reduction_workspace((a, a, 1), {}, None, buffer=True) == 240 + 8 + 4
    assert loss_reduction_workspace((a, a, 2), {}, None, buffer=True) == 240
    assert loss_reduction_workspace((a.double(), a.double(), 1), {}, None, buffer=True) == 480 + 8


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 512))


class SmoothL1Inside(nn.Module):
    """A model whose forward returns a smooth-L1 value: the 0-dim output keeps (B, 512) float32 bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return F.smooth_l1_loss(y, torch.zeros_like(y))


@pytest.mark.parametrize("first_step", [False, True])
@pytest.mark.parametrize(("make", "loss"), [(_mlp, "mse"), (SmoothL1Inside, "sum")], ids=["mse", "smooth_l1_in_forward"])
def test_step_peak_with_an_input_sized_loss(make: object, loss: str, first_step: bool) -> None:
    """Without the rule the prediction was 64 * 512 * 4 = 131,072 bytes low at B=64 (3.4% of the step):
    the loss value lives through backward and the optimizer step, where this step peaks."""
    assert_step_peak(make(), ["B,64"], 64, loss=loss, first_step=first_step)  # type: ignore[operator]
