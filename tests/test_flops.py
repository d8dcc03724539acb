"""fxmem.engine.flops: FLOPs equal torch's FlopCounterMode on every zoo model, symbolic FLOPs are linear in B,
bytes moved follow Note [Bytes moved], grouped matmuls (mixture-of-experts layers) count by Note [Grouped
matmuls], and the report says how many op calls have no formula (hand arithmetic inline)."""

from __future__ import annotations

import doctest

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxmem
import fxmem.engine.flops
from fxmem.cost.tradeoff import flop_count
from fxmem.engine.capture import fake_batch
from fxmem.engine.flops import EXTRA_FORMULAS, IGNORED, IGNORED_REASONS, FlopTally, is_view_like, op_cost
from fxmem.errors import DuplicateRuleError
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
    assert not {str(p) for p in IGNORED} & set(EXTRA_FORMULAS.keys())


# --- grouped matmuls (mixture of experts) -----------------------------------------------------------------


def test_torch_lacks_the_extra_formulas_and_a_duplicate_is_refused() -> None:
    # When torch gains a formula for one of these ops, torch's wins (fxmem.engine.flops._formula) and this
    # test says ours can go.
    assert {str(p) for p in torch.utils.flop_counter.flop_registry} & set(EXTRA_FORMULAS.keys()) == set()
    with pytest.raises(DuplicateRuleError):
        EXTRA_FORMULAS.register("aten._grouped_mm")(lambda *a, **k: 0)


# x [16, 8] (16 routed rows, K = 8) grouped over 3 experts' [8, 16] weights (N = 16), in groups of 3, 4 and 9
# rows (offs = [3, 7, 16]) or of 0, 0 and 16 rows: either way 2 * M * K * N = 2 * 16 * 8 * 16 = 4096 FLOPs,
# since 2*8*16*(3 + 4 + 9) = 2*8*16*(0 + 0 + 16). Sizes are multiples of 16 bytes, as the CPU kernel requires.
_ROUTINGS = [[3, 7, 16], [0, 0, 16]]


@pytest.mark.parametrize("ends", _ROUTINGS)
def test_grouped_mm_costs_2_m_k_n_whatever_the_routing(ends: list[int]) -> None:
    x, w, offs = torch.randn(16, 8), torch.randn(3, 8, 16), torch.tensor(ends, dtype=torch.int32)
    cost = _cost(aten._grouped_mm.default, x, w, offs)
    assert (cost.flops, cost.has_formula) == (4096, True)


@pytest.mark.parametrize(
    ("a", "b", "ends", "flops"),
    [
        # 3D x 3D, no offs: 3 products [16, 8] @ [8, 16]: 3 * 2*16*8*16 = 12288.
        ((3, 16, 8), (3, 8, 16), None, 12288),
        # 3D x 2D, the groups split N = 48 in thirds: 3 products [16, 8] @ [8, 16] = 2 * 16 * 8 * 48 = 12288.
        ((3, 16, 8), (8, 48), [16, 32, 48], 12288),
        # 2D x 2D, the groups split the contraction K = 48: 3 products [16, 16] @ [16, 16] = 2 * 16 * 48 * 16 = 24576.
        ((16, 48), (48, 16), [16, 32, 48], 24576),
    ],
)
def test_grouped_mm_other_layouts(a: tuple[int, ...], b: tuple[int, ...], ends: list[int] | None, flops: int) -> None:
    args = [torch.randn(a), torch.randn(b)] + ([torch.tensor(ends, dtype=torch.int32)] if ends else [])
    assert _cost(aten._grouped_mm.default, *args).flops == flops


@pytest.mark.parametrize("ends", _ROUTINGS)
def test_grouped_mm_step_equals_flop_counter_mode_on_its_loop_of_mms(ends: list[int]) -> None:
    # Forward 4096 (above). Backward, by autograd's own _grouped_mm calls: dx = dy [16, 16] grouped over
    # w^T [3, 16, 8] (2 * 16 * 16 * 8 = 4096) and dw = x^T [8, 16] @ dy [16, 16] with the groups splitting
    # the 16 rows, the contraction (2 * 8 * 16 * 16 = 4096): 8192. FlopCounterMode on the same product
    # written as one mm per group is the independent count.
    x = torch.randn(16, 8, requires_grad=True)
    w = torch.randn(3, 8, 16, requires_grad=True)
    offs = torch.tensor(ends, dtype=torch.int32)
    with FlopTally() as fwd:
        out = torch._grouped_mm(x, w, offs=offs)
    dy = torch.randn_like(out)
    with FlopTally() as bwd:
        out.backward(dy)
    starts = [0, *ends[:-1]]
    with FlopCounterMode(display=False) as loop_fwd:
        loop = torch.cat([x[a:b] @ w[g] for g, (a, b) in enumerate(zip(starts, ends))])
    with FlopCounterMode(display=False) as loop_bwd:
        loop.backward(dy)
    assert (fwd.total_flops, bwd.total_flops) == (4096, 8192)
    assert (fwd.total_flops, bwd.total_flops) == (loop_fwd.get_total_flops(), loop_bwd.get_total_flops())
    assert not fwd.missing and not bwd.missing


def test_transformers_grouped_mm_fallback_and_its_backward() -> None:
    pytest.importorskip("transformers.integrations.moe", reason="transformers registers the custom ops")
    fallback = torch.ops.transformers
    x, w, offs = torch.randn(16, 8), torch.randn(3, 8, 16), torch.tensor([3, 7, 16], dtype=torch.int32)
    forward = _cost(fallback.grouped_mm_fallback.default, x, w, offs)
    # The same product as above: 4096. Its backward op computes dx = dy @ w^T and dw = x^T @ dy per
    # group: 2 * 4096 = 8192.
    backward = _cost(fallback.grouped_mm_fallback_backward.default, x, w, offs, torch.randn(16, 16))
    assert (forward.flops, backward.flops, forward.has_formula, backward.has_formula) == (4096, 8192, True, True)


def test_fxmems_grouped_mm_and_its_backward() -> None:
    import fxmem.rules.grouped_mm  # noqa: F401 - registers the ops (Note [grouped_mm on fake tensors])

    x, w, offs = torch.randn(16, 8), torch.randn(3, 8, 16), torch.tensor([3, 7, 16], dtype=torch.int32)
    forward = _cost(torch.ops.fxmem.grouped_mm.default, x, w, offs)
    # The same product as above: 2 * 16 * 8 * 16 = 4096; the backward, dw = x^T @ dy and dx = dy @ w^T: 8192.
    backward = _cost(torch.ops.fxmem.grouped_mm_backward.default, torch.randn(16, 16), x, w, offs)
    assert (forward.flops, backward.flops, forward.has_formula, backward.has_formula) == (4096, 8192, True, True)


def _tiny_mixtral() -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="Hugging Face models need the transformers package")
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        experts_implementation="grouped_mm",
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config)
    assert model.config._experts_implementation == "grouped_mm"
    return model


def test_mixtral_forward_flops_include_the_experts() -> None:
    # A 1-layer Mixtral, hidden H = 16, expert intermediate I = 32, 2 heads of 8 with 1 key/value head,
    # 4 experts of which top_k = 2 per token, vocabulary 64, S = 8 tokens a sample. Per token (2 * in * out
    # a linear): q 2*16*16 = 512, k and v 2*16*8 = 256 each, o 512, router 2*16*4 = 128, lm_head
    # 2*16*64 = 2048: 3712 dense. Experts: each of top_k = 2 rows costs gate_up 2*16*(2*32) = 2048 and down
    # 2*32*16 = 1024, so 2 * 3072 = 6144 (= top_k * 2 * 3 * H * I, a SwiGLU expert's three matrices).
    # Attention: fp32 with grouped-query heads on the H100 target takes SDPA's math path (flash and
    # cuDNN need half precision, memory-efficient takes no GQA: fxmem/rules/sdpa.py), two bmms a head,
    # QK^T and PV, each 2 * S * S * 8 = 1024: 2 heads * 2048 = 4096 a sample.
    # Forward per sample: 8 * (3712 + 6144) + 4096 = 82944. Backward: every one of these products is a
    # matmul whose backward runs two of the same size (the embedding is trained, so even q, k and v
    # need their input's gradient): 2 * 82944.
    report = fxmem.analyze(_tiny_mixtral(), {"input_ids": "B,8:int64", "labels": "B,8:int64"}, loss="auto")
    for batch in (1, 3):
        timeline = report.timeline(batch)
        flops = flop_count(timeline, batch)
        experts = sum(c.flops.at(batch) for c in timeline.costs if c.op == "fxmem.grouped_mm")  # eager's grouped_mm, float32
        assert experts == batch * 8 * 6144
        assert (flops.forward, flops.backward) == (batch * 82944, batch * 2 * 82944)
        assert not {op for op, _ in flops.missing} & set(EXTRA_FORMULAS.keys())


# --- the report's count of op calls without a formula --------------------------------------------------------


def test_the_flops_line_counts_op_calls_without_a_formula() -> None:
    # Linear(8, 4) then ReLU, loss sum, SGD. Calls without a FLOP formula: forward relu (1); loss sum (1);
    # backward threshold_backward (relu's gradient, 1), sum (the bias gradient, dy summed over the batch,
    # 1), while ones_like (the loss's gradient) creates a tensor (IGNORED), the weight gradient is an mm
    # (a formula) and the input needs no gradient; SGD's step is one _foreach_add_ over both parameters
    # (1). 5 calls of 4 kinds; sum, with 2, first.
    torch.manual_seed(0)
    report = fxmem.analyze(nn.Sequential(nn.Linear(8, 4), nn.ReLU()), ["B,8"], loss="sum", optimizer="sgd")
    flops = report.flops(32)
    assert (flops.missing_calls, len(flops.missing)) == (5, 4)
    (line,) = [line for line in str(report).splitlines() if line.startswith("FLOPs at")]
    assert line.endswith("; 5 op calls (4 kinds) have no FLOP formula, counted for bytes only: sum, relu, threshold_backward, _foreach_add_")
