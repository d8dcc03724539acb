"""Hand-computed saved bytes per op, each also checked against a real CPU run.

Sequential children are fx nodes named _0, _1, ...; an activation is charged to the node that
allocated its storage (see Note [Counting storages once] in fxmem/engine/capture.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers import FLOAT, INT64, analyze_on_meta, assert_matches_measurement, saved


def check(factory, inputs, loss="sum"):  # type: ignore[no-untyped-def]
    report = analyze_on_meta(factory, inputs, loss)
    assert_matches_measurement(report, factory, inputs, loss)
    return saved(report)


def test_linear_keeps_its_input() -> None:
    # _1 = Linear(16, 4) keeps its input, the (B, 16) output of _0: 16 * 4 B per sample, charged to _0.
    # _0 keeps its own input too, but that is the input batch, which is not an activation.
    got = check(lambda: nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4)), ["B,8"])
    assert got == {"_0": (16 * FLOAT, 0)}


def test_relu_keeps_its_output() -> None:
    # ReLU keeps its (B, 16) output: 64 B per sample, on _1. The Linear's output is not kept.
    got = check(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU()), ["B,8"])
    assert got == {"_1": (16 * FLOAT, 0)}


def test_convolution_keeps_its_input_not_its_weight() -> None:
    # _1 = Conv2d(4, 2, 3) keeps its input, the (B, 4, 8, 8) output of _0: 4*8*8*4 = 1024 B per sample.
    # Both convolutions also keep their weights, which are model state.
    got = check(lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 3)), ["B,3,10,10"])
    assert got == {"_0": (4 * 8 * 8 * FLOAT, 0)}


def test_inplace_relu_after_batchnorm_is_counted_once() -> None:
    # BatchNorm keeps its input (conv output, B x 4x8x8 floats = 1024 B per sample, charged to _0) and its
    # per-channel save_mean and save_invstd (4 floats each: 32 B, constant in B). The in-place ReLU keeps
    # its output, which IS the BatchNorm output: 1024 B per sample, charged once to _1 (which allocated it).
    got = check(lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True)), ["B,3,8,8"])
    assert got == {"_0": (4 * 8 * 8 * FLOAT, 0), "_1": (4 * 8 * 8 * FLOAT, 2 * 4 * FLOAT)}


def test_cpu_dropout_keeps_a_float_noise_mask() -> None:
    # On the CPU, dropout is input * noise and keeps the noise in the input's dtype: (B, 16) floats.
    got = check(lambda: nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5)), ["B,8"])
    assert got == {"_1": (16 * FLOAT, 0)}


def test_max_pool_keeps_int64_indices() -> None:
    # MaxPool2d(2) keeps its input (B, 2, 8, 8) floats = 512 B per sample (charged to the conv _0) and
    # int64 indices of its (B, 2, 4, 4) output: 32 * 8 = 256 B per sample, charged to _1.
    got = check(lambda: nn.Sequential(nn.Conv2d(1, 2, 1), nn.MaxPool2d(2)), ["B,1,8,8"])
    assert got == {"_0": (2 * 8 * 8 * FLOAT, 0), "_1": (2 * 4 * 4 * INT64, 0)}


def test_cross_entropy_keeps_its_log_softmax() -> None:
    # log_softmax keeps its (B, 10) output: 40 B per sample; nll_loss keeps a 4-byte total_weight.
    # Its class-index target is input data, not an activation.
    got = check(lambda: nn.Sequential(nn.Linear(8, 10)), ["B,8"], loss="cross_entropy")
    assert got == {"loss": (10 * FLOAT, 4)}


def test_layernorm_statistics_scale_with_the_batch() -> None:
    # LayerNorm keeps its input ((B,16) floats, charged to the Linear) and per-row mean and rstd:
    # (B, 1) floats each = 8 B per sample, unlike BatchNorm's per-channel constants.
    got = check(lambda: nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16)), ["B,8"])
    assert got == {"_0": (16 * FLOAT, 0), "_1": (2 * FLOAT, 0)}


class _ViewAtOne(nn.Module):
    """relu keeps y; (y^T).reshape is a view of y at B=1 (size-1 axis) but a copy for B >= 2."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.lin(x))
        return y.transpose(0, 1).reshape(4, -1) * self.w


def test_batch_one_is_exact_where_a_view_replaces_a_copy() -> None:
    # y is (B, 4, 8) floats = 128 B per sample, kept by relu. The mul keeps the reshaped copy (another
    # 128 B per sample) for B >= 2, but at B=1 the reshape is a view of y, already counted: 128 B in all.
    report = analyze_on_meta(_ViewAtOne, ["B,4,8"])
    assert report.activations.per_sample == 2 * 4 * 8 * FLOAT
    assert report.activation_bytes(1) == 4 * 8 * FLOAT
    assert report.batch_one_special == ("reshape",)
    assert_matches_measurement(report, _ViewAtOne, ["B,4,8"], "sum", batches=(1, 2, 3))


def test_frozen_parameters_save_nothing_for_themselves() -> None:
    # With every parameter frozen and a float input that does not require grad, nothing needs backward.
    def frozen() -> nn.Module:
        m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        m.requires_grad_(False)
        return m

    report = analyze_on_meta(frozen, ["B,8"])
    assert report.activation_bytes(4) == 0
    assert report.state.gradients == 0 and report.state.optimizer == 0
