"""Mixture-of-experts layers written as eager loops over their experts (Note [Routed sizes] in fxmem/rules/routing.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import fxmem
from fxmem.rules.routing import RoutedSizes, routing_ledger

INPUTS = ["ids=B,16:int64"]


class Expert(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False), nn.Linear(d, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopMoE(nn.Module):
    """transformers' older Mixtral eager path: a one-hot mask per expert, ``torch.where``, ``index_add_``,
    and an empty expert skipped in Python (which stops torch.fx, and torch.export without fxmem's counts)."""

    def __init__(self, d: int, h: int, experts: int, k: int) -> None:
        super().__init__()
        self.gate, self.k, self.e = nn.Linear(d, experts, bias=False), k, experts
        self.experts = nn.ModuleList(Expert(d, h) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = x.reshape(-1, d)
        weights, chosen = torch.topk(F.softmax(self.gate(h), dim=1, dtype=torch.float), self.k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(h.dtype)
        out = torch.zeros_like(h)
        mask = F.one_hot(chosen, num_classes=self.e).permute(2, 1, 0)
        for e in range(self.e):
            slot, token = torch.where(mask[e])
            if token.numel() == 0:
                continue
            out.index_add_(0, token, self.experts[e](h[token]) * weights[token, slot, None])
        return out.view(b, s, d)


class MaskedMoE(LoopMoE):
    """A research codebase's loop: each token repeated k times, a boolean mask per expert, read and written."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = x.reshape(-1, d)
        weights, chosen = torch.topk(F.softmax(self.gate(h), dim=-1), self.k, dim=-1)
        flat, repeated = chosen.view(-1), h.repeat_interleave(self.k, dim=0)
        y = torch.empty_like(repeated)
        for e in range(self.e):
            rows = flat == e
            y[rows] = self.experts[e](repeated[rows])
        return (y.view(-1, self.k, d) * weights.unsqueeze(-1)).sum(1).view(b, s, d)


class MoELM(nn.Module):
    """Two MoE layers between an embedding and a head. fxmem feeds zero token ids, which would send every
    token to the same k experts; the ids are spread over the vocabulary by position, so the real runs
    route as a trained model's varied tokens do (the router's weights, seeded, decide the rest)."""

    def __init__(self, moe: type[LoopMoE] = LoopMoE, experts: int = 4, k: int = 2, vocab: int = 97, d: int = 32) -> None:
        super().__init__()
        self.vocab, self.embed, self.head = vocab, nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.layers = nn.ModuleList(moe(d, 2 * d, experts, k) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = (ids + 7 * torch.arange(ids.numel(), device=ids.device).view_as(ids)) % self.vocab
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _fake_ids(batch: int) -> tuple[FakeTensorMode, torch.Tensor]:
    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    return mode, mode.from_tensor(torch.zeros(batch, 16, dtype=torch.long), symbolic_context=context)


def test_an_even_split_of_the_routed_rows_replaces_each_count() -> None:
    """16 tokens per sample, top-2 of 4 experts: 32*B routed rows, 8*B per expert under an even split;
    a mask over every expert at once holds exactly the 32*B, no assumption."""
    mode, ids = _fake_ids(4)
    with routing_ledger() as seen, mode, RoutedSizes():
        batch = ids.shape[0]
        chosen = torch.topk(torch.randn(batch * 16, 4), 2, dim=-1).indices
        mask = F.one_hot(chosen, num_classes=4).permute(2, 1, 0)
        slot, token = torch.where(mask[1])
        assert str(token.shape[0]) == str(8 * batch)
        assert str(torch.nonzero(mask).shape[0]) == str(32 * batch)  # every class at once: exact
        rows = torch.randn(batch * 16 * 2, 3)[chosen.view(-1) == 3]  # a boolean mask from the indices
        assert str(rows.shape[0]) == str(8 * batch)
    assert [r.classes for r in seen.values()] == [4]


def test_a_loop_over_experts_that_skips_an_empty_one_saves_exactly_what_real_runs_save() -> None:
    """The real saved bytes do not depend on the routing (two seeds route differently); fxmem's equal them,
    and the step's peak is within 1% of the real one at both seeds (equal at B=4 on this machine)."""
    with torch.device("meta"):
        meta = MoELM()
    report = fxmem.analyze(meta, INPUTS, batch=4, target="cpu")
    assert report.frontend == "export" and "even split (8*B each)" in report.routed[0]
    assert not report.accounting.unsupported
    for seed in (0, 1):
        torch.manual_seed(seed)
        real = MoELM()
        assert report.activation_bytes(4) == fxmem.measure(real, INPUTS, 4).total
        measured = fxmem.measure_peak(real, INPUTS, 4).bytes
        assert abs(report.peak(4).bytes - measured) <= 0.01 * measured, (report.peak(4).bytes, measured)


@pytest.mark.parametrize("experts", [4, 3], ids=["even", "three-experts"])
def test_boolean_masks_of_top_k_indices(experts: int) -> None:
    """``y[flat == e] = expert(x[flat == e])``: with 3 experts, 32*B rows split no polynomial way, and the
    batches are passed one by one (each count an integer); the saved bytes still equal the real run's."""
    with torch.device("meta"):
        meta = MoELM(MaskedMoE, experts=experts)
    report = fxmem.analyze(meta, INPUTS, batch=3, target="cpu")
    assert report.routed and not report.accounting.unsupported
    assert (report.accounting.method == "concrete") == (experts == 3)
    torch.manual_seed(0)
    assert report.activation_bytes(3) == fxmem.measure(MoELM(MaskedMoE, experts=experts), INPUTS, 3).total


def test_the_report_says_what_was_assumed() -> None:
    with torch.device("meta"):
        meta = MoELM()
    report = fxmem.analyze(meta, INPUTS, batch=2, target="cpu")
    assert "Routing: the rows routed to each of 4 experts" in str(report) and "their sum (32*B) does not" in str(report)
    assert report.to_dict()["routing"] == list(report.routed)


class _SpreadIds(nn.Module):
    """A Hugging Face causal LM fed token ids spread over its vocabulary by position (fxmem feeds zeros,
    which would route every token alike), returning its logits."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = (input_ids + 7 * torch.arange(input_ids.numel(), device=input_ids.device).view_as(input_ids)) % 97
        return self.lm(input_ids=ids).logits


def test_transformers_eager_experts_loop() -> None:
    """transformers' eager experts path (``for expert_idx in expert_hit``), refused before with a guard on
    ``u0``: saved bytes equal real runs at three seeds, the step's peak within 1% (0.65% at most here, the
    real peak moving with the routing)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    config._experts_implementation = "eager"
    with torch.device("meta"):
        meta = _SpreadIds(transformers.MixtralForCausalLM(config))
    inputs = ["input_ids=B,16:int64"]
    report = fxmem.analyze(meta, inputs, batch=2, target="cpu")
    assert report.routed and not report.accounting.unsupported
    for seed in (0, 1, 2):
        torch.manual_seed(seed)
        real = _SpreadIds(transformers.MixtralForCausalLM(config))
        assert report.activation_bytes(2) == fxmem.measure(real, inputs, 2).total
        measured = fxmem.measure_peak(real, inputs, 2).bytes
        assert abs(report.peak(2).bytes - measured) <= 0.01 * measured, (report.peak(2).bytes, measured)
