"""fxmem.engine.flops: FLOPs equal torch's FlopCounterMode on every zoo model, symbolic FLOPs are linear in B,
and bytes moved follow Note [Bytes moved] (hand arithmetic inline)."""

from __future__ import annotations

import doctest

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxmem
import fxmem.engine.flops
from fxmem.engine.capture import fake_batch
from fxmem.engine.flops import IGNORED, IGNORED_REASONS, FlopTally, is_view_like, op_cost
from fxmem.engine.losses import get_loss
from fxmem.inputs import make_tensor, parse_inputs
from models_zoo import ZOO

aten = torch.ops.aten


def test_docstring_examples() -> None:
    result = doctest.testmod(fxmem.engine.flops, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


# --- equal to FlopCounterMode on the zoo ---------------------------------------------------------------
# Each test config runs forward + backward on 2 CPUs in under 1 s (unet3d, the slowest, ~0.15 s), so no
# model needs skipping.


@pytest.fixture(scope="module", params=list(ZOO))
def zoo_model(request: pytest.FixtureRequest) -> tuple[str, fxmem.ModelSpec]:
    torch.manual_seed(0)
    return request.param, fxmem.load_model(f"zoo:{request.param}:test", meta=False)


def _forward(spec: fxmem.ModelSpec, inputs: list[torch.Tensor]) -> torch.Tensor:
    specs = parse_inputs(spec.inputs)
    args = [t for s, t in zip(specs, inputs) if s.name is None]
    kwargs = {s.name: t for s, t in zip(specs, inputs) if s.name is not None}
    return get_loss(spec.loss).select(spec.model(*args, **kwargs), type(spec.model).__name__).sum()


def _counted(spec: fxmem.ModelSpec, inputs: list[torch.Tensor]) -> tuple[int, int]:
    """(forward, backward) FLOPs by torch's FlopCounterMode."""
    with FlopCounterMode(display=False) as fwd:
        loss = _forward(spec, inputs)
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


def _tallied(spec: fxmem.ModelSpec, inputs: list[torch.Tensor]) -> tuple[FlopTally, FlopTally]:
    with FlopTally() as fwd:
        loss = _forward(spec, inputs)
    with FlopTally() as bwd:
        loss.backward()
    return fwd, bwd


@pytest.mark.parametrize("batch", [2, 3])
def test_flops_equal_flop_counter_mode(zoo_model: tuple[str, fxmem.ModelSpec], batch: int) -> None:
    name, spec = zoo_model
    inputs = [make_tensor(s, batch) for s in parse_inputs(spec.inputs)]
    expected_fwd, expected_bwd = _counted(spec, inputs)
    fwd, bwd = _tallied(spec, inputs)
    assert (fwd.total_flops, bwd.total_flops) == (expected_fwd, expected_bwd), name
    assert expected_fwd > 0 and expected_bwd > 0, name  # every zoo model has a matmul or a convolution
    # What torch does not count is listed, never a silent zero: all zoo models have elementwise ops.
    assert fwd.missing and all(op not in {str(p) for p in IGNORED} for op in fwd.missing), name


# --- symbolic batch -------------------------------------------------------------------------------------


def test_linear_flops_are_linear_in_the_batch_symbol() -> None:
    batch = fake_batch(parse_inputs(["B,64"]), batch=None, seq=None)
    symbol = batch.symbols["B"]
    layer = nn.Linear(64, 32)
    with batch.mode, FlopTally() as tally:
        layer(batch.inputs[0])
    # Linear(64, 32) on [B, 64] is addmm(bias, x, W.t()): B*32 outputs, each 64 multiply-adds,
    # 2 FLOPs per multiply-add -> 2 * B * 64 * 32 = 4096 * B.
    flops = tally.total_flops
    assert isinstance(flops, torch.SymInt)
    assert flops.node.expr == 4096 * symbol
    assert flops.node.expr.as_poly(symbol).degree() == 1
    (cost,) = [c for op, c in tally.records if op == "aten.addmm"]
    # Reads x (B*64*4 bytes), W through the view W.t() (32*64*4 = 8192) and the bias (32*4 = 128);
    # writes [B, 32] fp32 (128 * B).
    assert cost.read_bytes.node.expr == 256 * symbol + 8192 + 128
    assert cost.written_bytes.node.expr == 128 * symbol
    assert not tally.missing  # t (a view) and addmm (a formula): nothing unaccounted


# --- op_cost on real tensors ----------------------------------------------------------------------------


def _cost(func: torch._ops.OpOverload, *args: object) -> fxmem.engine.flops.OpCost:
    cost = op_cost(func, args, {}, func(*args))
    assert cost is not None
    return cost


def test_matmul_cost() -> None:
    a, b = torch.ones(4, 8), torch.ones(8, 2)
    cost = _cost(aten.mm.default, a, b)
    # 2 * 4 * 8 * 2 = 128 FLOPs; reads (32 + 16) * 4 = 192 bytes, writes 8 * 4 = 32.
    assert (cost.flops, cost.read_bytes, cost.written_bytes, cost.has_formula) == (128, 192, 32, True)
    assert cost.moved_bytes == 224


def test_a_tensor_passed_twice_is_read_once() -> None:
    x = torch.ones(10)
    cost = _cost(aten.mul.Tensor, x, x)
    # x * x reads x once (40 bytes) and writes 40: no formula, so 0 FLOPs that callers must list.
    assert (cost.flops, cost.read_bytes, cost.written_bytes, cost.has_formula) == (0, 40, 40, False)


def test_distinct_views_of_one_storage_are_each_read() -> None:
    qkv = torch.ones(3, 16)
    q, k = qkv[0], qkv[1]
    assert _cost(aten.add.Tensor, q, k).read_bytes == 2 * 16 * 4


def test_a_broadcast_dimension_is_read_once() -> None:
    row = torch.ones(1, 8).expand(4, 8)  # stride (0, 1): 8 floats in memory, not 32
    assert _cost(aten.add.Tensor, torch.ones(4, 8), row).read_bytes == (32 + 8) * 4


def test_views_move_no_bytes() -> None:
    assert is_view_like(aten.t.default) and is_view_like(aten._unsafe_view.default)
    assert not is_view_like(aten.add_.Tensor) and not is_view_like(aten.clone.default)
    cost = _cost(aten.view.default, torch.ones(4, 8), [32])
    assert (cost.read_bytes, cost.written_bytes) == (0, 0)


def test_metadata_queries_are_not_ops() -> None:
    assert op_cost(aten.sym_size.int, (torch.ones(2),), {}, 2) is None


def test_missing_counts_ops_without_formula_but_not_ignored_ones() -> None:
    x = torch.ones(4, 8)
    with FlopTally() as tally:
        y = torch.relu(x).t().clone()
        torch.zeros_like(y)
    assert tally.missing == {"aten.relu": 1}
    assert [op for op, _ in tally.records] == ["aten.relu", "aten.t", "aten.clone", "aten.zeros_like"]


def test_every_ignored_op_has_a_reason() -> None:
    assert frozenset(IGNORED_REASONS) == IGNORED
    assert all(reason.strip() for reason in IGNORED_REASONS.values())
    assert not IGNORED & set(torch.utils.flop_counter.flop_registry)
