"""``linear`` as real tensors run it (Note [linear's bias on fake tensors] in fxmem/rules/linear.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxmem.rules.linear import LinearAsReal, takes_matmul_path
from tests.helpers import assert_step_peak


def test_which_inputs_add_the_bias_after_a_matmul() -> None:
    """Linear.cpp's branches: 2-D and contiguous inputs take one addmm, others matmul then add."""
    bias = torch.zeros(4)
    assert not takes_matmul_path(torch.zeros(3, 4), bias)  # 2-D: addmm
    assert not takes_matmul_path(torch.zeros(2, 3, 4), bias)  # contiguous 3-D: flattened
    assert not takes_matmul_path(torch.zeros(2, 3, 5, 4), bias)  # contiguous, 1-D bias: flattened
    assert takes_matmul_path(torch.zeros(3, 2, 4).transpose(0, 1), bias)  # a batch-first RNN's output
    assert takes_matmul_path(torch.zeros(2, 4, 3, 5).permute(0, 2, 3, 1), bias)  # channels last by permute
    assert not takes_matmul_path(torch.zeros(3, 2, 4).transpose(0, 1), None)  # no bias: matmul alone


def test_the_mode_computes_what_linear_computes() -> None:
    torch.manual_seed(0)
    layer, x = nn.Linear(5, 7), torch.randn(2, 5, 3, 4).permute(0, 2, 3, 1)  # (2, 3, 4, 5), not contiguous
    expected = layer(x)
    with LinearAsReal():
        got = layer(x)
    torch.testing.assert_close(got, expected)


class ChannelsLastMLP(nn.Module):
    """ConvNeXt's pointwise MLP without its convolution: Linear layers over a permuted (B, H, W, C) view."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc2(self.act(self.fc1(x.permute(0, 2, 3, 1))))
        return x + y.permute(0, 3, 1, 2)


class FrozenChannelsLastMLP(ChannelsLastMLP):
    """The MLP frozen, with an in-place ReLU and a trainable per-channel scale: its forward peaks at
    fc1's bias add, where adding out of place holds a second (B, H, W, 4C) tensor beside the matmul's
    (294,912 bytes at B=8, C=16, 12x12). Without the rule the step's peak was 221,184 bytes high."""

    def __init__(self, c: int) -> None:
        super().__init__(c)
        self.act = nn.ReLU(inplace=True)
        for p in self.parameters():
            p.requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(c, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * super().forward(x)


class FrozenGruStack(nn.Module):
    """The fuzzer's finding: a frozen GRU(10, 160), a Linear over its batch-first output, a GRU(160, 100);
    its forward peaked 9,600 bytes (one (3, 5, 160) float32 tensor) above the real run at B=3."""

    def __init__(self) -> None:
        super().__init__()
        self.gru1, self.proj, self.gru2 = nn.GRU(10, 160, batch_first=True), nn.Linear(160, 160), nn.GRU(160, 100, batch_first=True)
        self.head = nn.Linear(100, 20, bias=False)
        for p in [*self.gru1.parameters(), *self.proj.parameters(), *self.gru2.parameters()]:
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru2(self.proj(self.gru1(x)[0]))[0])


class Gru(nn.Module):
    """A trained two-layer GRU: its C++ input projection adds the bias in place as well."""

    def __init__(self, e: int, h: int) -> None:
        super().__init__()
        self.gru = nn.GRU(e, h, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(x)[0]


@pytest.mark.parametrize("first_step", [False, True])
@pytest.mark.parametrize(
    ("make", "inputs", "loss", "batch"),
    [
        (lambda: ChannelsLastMLP(16), ["B,16,12,12"], "sum", 8),
        (lambda: FrozenChannelsLastMLP(16), ["B,16,12,12"], "sum", 8),
        (FrozenGruStack, ["B,5,10"], "cross_entropy", 3),
        (lambda: Gru(24, 64), ["B,12,24"], "sum", 6),
    ],
    ids=["channels_last_mlp", "frozen_channels_last_mlp", "frozen_gru_stack", "gru"],
)
def test_step_peak_against_a_real_run(make: object, inputs: list[str], loss: str, batch: int, first_step: bool) -> None:
    torch.manual_seed(0)
    assert_step_peak(make(), inputs, batch, loss=loss, first_step=first_step, phase="near")  # type: ignore[operator]
