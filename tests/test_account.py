"""How passes combine: symbolic a*B + c, a model that fixes B, bytes that grow like B^2, page-rounded kernels."""

from __future__ import annotations

import torch
from torch import nn

import fxmem
from tests.helpers import FLOAT, analyze_on_meta, assert_matches_measurement


class _IntOfBatch(nn.Module):
    """int(x.shape[0]) forces ShapeEnv to specialize B to its hint: the symbol is no longer free."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(x.shape[0])
        return x * torch.ones(n, 1)


class _Guarded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 16)
        self.fix = _IntOfBatch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fix(self.lin(x)))


def test_a_model_that_fixes_the_batch_falls_back_to_concrete_passes() -> None:
    # _IntOfBatch is kept opaque (a leaf), so int() runs on the fake tensor and specializes B.
    report = analyze_on_meta(_Guarded, ["B,4"], leaf_types=(_IntOfBatch,))
    assert report.accounting.method == "concrete" and report.accounting.linear
    # The mul keeps ones(n, 1), a (B, 1) float tensor, for x's gradient: 4 B per sample;
    # relu keeps its (B, 16) output: 64 B per sample.
    assert report.activations == fxmem.ByteExpr(per_sample=1 * FLOAT + 16 * FLOAT)
    assert_matches_measurement(report, _Guarded, ["B,4"], "sum", batches=(1, 4, 9), leaf_types=(_IntOfBatch,))


class _Gram(nn.Module):
    """A B x B similarity matrix, as in a contrastive loss: bytes grow like B^2."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(x)
        return torch.relu(z @ z.T)


def test_quadratic_bytes_are_reported_with_their_polynomial() -> None:
    # mm keeps z (B x 16 floats = 64 B per sample) and z.T (a view of z: counted once);
    # relu keeps its B x B output: 4*B^2 bytes.
    report = analyze_on_meta(_Gram, ["B,8"])
    assert report.activations == fxmem.ByteExpr(per_sample=16 * FLOAT, fixed=0, higher=(FLOAT,))
    assert "4*B^2 + 64*B" in str(report)
    assert_matches_measurement(report, _Gram, ["B,8"], "sum", batches=(1, 2, 5))


def test_lstm_workspace_is_exact_at_batches_no_pass_ran() -> None:
    # The CPU LSTM's oneDNN workspace is page-rounded, so no line is exact: figures at B=7 and B=33
    # come from further concrete fake passes, with the workspace from fxmem/rules/onednn_rnn.py.
    def lstm() -> nn.Module:
        return nn.LSTM(16, 32, num_layers=2, batch_first=True)

    report = analyze_on_meta(lstm, ["B,12,16"])
    assert report.accounting.method == "concrete" and not report.accounting.linear
    assert_matches_measurement(report, lstm, ["B,12,16"], "sum", batches=(7, 33))


class _Masked(nn.Module):
    """y[y > 0] has a size that depends on the data; multiplying it by itself saves it for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.lin(x))
        z = y[y > 0]
        return (z * z).sum() + y.sum()


def test_data_dependent_sizes_are_listed_not_fatal() -> None:
    report = analyze_on_meta(_Masked, ["B,8"])
    # Known: relu keeps y ((B,8) floats, 32 B per sample) and the index keeps its bool mask (8 B per sample).
    # Unknown: z's size is the number of positive entries; it is counted as 0 B and listed.
    assert report.activations == fxmem.ByteExpr(per_sample=8 * FLOAT + 8)
    assert [u.node for u in report.accounting.unsupported] == ["getitem"]
    assert "Unsupported: node getitem" in str(report) and "depends on the data" in str(report)


def test_strict_makes_data_dependent_sizes_an_error() -> None:
    import pytest

    with pytest.raises(fxmem.CaptureError, match="depends on the data"):
        analyze_on_meta(_Masked, ["B,8"], strict=True)
