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


def test_pack_detaches_only_what_the_node_being_built_outputs() -> None:
    """Note [What the step's saved-tensor hook keeps]: in ``z = y.exp()`` ExpBackward saves its own
    result (an output: detached, or it would hold its own node); in ``w = z * y`` MulBackward saves
    both inputs (kept as they are, as eager keeps them); ``x.sin()`` saves its leaf input."""
    from fxmem.step.timeline import _saved_by_its_own_node

    x = torch.ones(3, requires_grad=True)
    seen: list[bool] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.append(_saved_by_its_own_node(t))
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = x * 2  # saves the scalar only
        z = y.exp()
        z * y
        x.sin()
    assert seen == [True, False, False, False]


class SavesOutputs(nn.Module):
    """Ops that save their own results (exp, sigmoid, softmax) beside ops that save their inputs, and
    one result nobody reads, whose node backward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        torch.tanh(h)  # read by no one: eager frees it, and TanhBackward0 that saved it, at once
        return (h.exp() * torch.sigmoid(h)).softmax(-1) * h


def test_saved_outputs_die_with_their_nodes() -> None:
    """A saved output kept with its own node would make a cycle that only the cycle collector (paused
    during analyze) frees, where eager frees it with its node. A node that backward runs drops what
    it saved then, cycle or not; the unread tanh's node never runs, and its (B, 256) float32 result
    (16 KiB at B=16) would be counted alive to the end of the step, over the real CPU step's peak.
    The predicted peak is the real step's, first and steady."""
    for first_step in (True, False):
        assert_step_peak(SavesOutputs(), ["B,8"], 16, loss="sum", first_step=first_step)
