"""fxmem/frontends/tracing.py: the traced graph runs what eager runs."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import nn

import fxmem
from fxmem.frontends.tracing import trace_model, unpacked
from tests.helpers import assert_matches_measurement, assert_step_peak


class UnpackedAttention(nn.Module):
    """Self-attention that unpacks its fused projection: ``q, k, v = qkv`` (iterating a tensor)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.qkv, self.out, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


def test_unpacking_a_tensor_unbinds_it() -> None:
    """Note [Unpacking a tensor]: one ``unpacked`` node, then getitems of what it returns, which on a
    tensor is its unbind(0) (three views whose backward is one stack), as Tensor.__iter__ gives."""
    graph = trace_model(UnpackedAttention(), frontend="fx").gm.graph
    unpack = [n for n in graph.nodes if n.target is unpacked]
    assert len(unpack) == 1
    assert [u.target for u in unpack[0].users] == [operator.getitem] * 3
    t = torch.randn(3, 2)
    assert [tuple(v.shape) for v in unpacked(t)] == [(2,)] * 3
    pair = (torch.ones(1), torch.zeros(1))
    assert unpacked(pair) is pair


def test_unpacked_attention_step_peak() -> None:
    """With q, k and v as three selects, their backward made three zero-filled gradients of the whole
    projection and summed them: the steady step's backward peak was 7.9% above the real step's at B=4
    (10% for the first step)."""
    for first_step in (True, False):
        assert_step_peak(UnpackedAttention(), ["B,16,32"], 4, loss="sum", first_step=first_step)


class Recurrent(nn.Module):
    """A module returning a tuple, unpacked into names: the tuple itself, not an unbind."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.GRU(6, 10, batch_first=True), nn.Linear(10, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, h = self.rnn(x)
        return self.head(out + h.transpose(0, 1))


def test_unpacking_a_tuple_is_unchanged() -> None:
    report = fxmem.analyze(Recurrent(), ["B,5,6"], loss="sum", target="cpu")
    assert_matches_measurement(report, Recurrent, ["B,5,6"], "sum", batches=(1, 3))
