"""fxmem/step/timeline.py: where the simulated step follows eager rather than the fake tensors it runs on,
held to real CPU steps (``measure_peak``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fxmem
from tests.helpers import assert_step_peak


class TwoUses(nn.Module):
    """One projection read by two products with fixed weights: autograd sums its two gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 512)
        self.register_buffer("w1", torch.ones(512))
        self.register_buffer("w2", torch.ones(512))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return (h * self.w1).sum(-1) + (h * self.w2).sum(-1)


def test_gradients_are_summed_in_place() -> None:
    """Note [Gradients summed in place]. In backward, h's two gradients (B x 512 float32 each, 2 KiB a
    sample) are alive together and eager sums the second into the first: no third. On fake tensors
    the sum was a new tensor, a third gradient of 131,072 bytes at B=64 (64 x 2,048): measured before
    the fix, the predicted peak was 418,056 bytes in backward, the real step's 287,232 in forward."""
    model, inputs = TwoUses(), ["B,8"]
    report = fxmem.analyze(model, inputs, loss="sum", optimizer="adamw", target="cpu")
    backward_sums = [e for e in report.timeline(64).events if e.alloc and e.op == "aten.add" and e.phase.value == "backward"]
    assert backward_sums == []
    for first_step in (True, False):
        assert_step_peak(model, inputs, 64, loss="sum", first_step=first_step)


class MadeMask(nn.Module):
    """Attention whose mask the forward builds from Python numbers: fx computes it once, as a constant."""

    def __init__(self, seq: int = 33, dim: int = 12) -> None:
        super().__init__()
        self.seq = seq
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        mask = torch.ones(self.seq, self.seq, dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_tensor_made_while_tracing_is_made_by_each_forward() -> None:
    """Note [Tensors made while tracing]: the 33 x 33 bool mask (1,089 bytes) is a graph constant after
    fx traces the model, but eager makes it in the forward and frees it when the forward returns; as
    a baseline buffer it was alive at the backward's peak: the peak fuzzer's model of this kind (SDPA
    over 33 tokens, two heads of 2) was 3.2% high at B=2."""
    for first_step in (True, False):
        assert_step_peak(MadeMask(), ["B,33,12"], 2, loss="sum", first_step=first_step)
