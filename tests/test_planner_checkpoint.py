"""The checkpointing chooser (fxmem/plan): its min-cut against brute force, and its plans against real CPU steps.

Each plan is applied to the real model by its own emitted code, and one real forward, loss and backward
at B=4 is measured (fxmem/planner/verify.py): the bytes saved for backward must equal the plan's to the
byte, and the FLOPs backward recomputes (``FlopCounterMode``, backward with the plan minus backward
without) must equal the plan's. Budgets are chosen to force each kind of plan on the zoo's test configs.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from fractions import Fraction

import pytest
import torch

import fxmem
import fxmem.planner.checkpoint
import fxmem.planner.cut
from fxmem.errors import FxmemError, InputSpecError
from fxmem.planner import CheckpointPlan, OpKey, PlanMeasurement, compile_plan, emit_source, measure_plan, plan_checkpointing
from fxmem.planner.cut import CutOp, cut_block
from fxmem.results import ModelSpec
from models_zoo import gpt2_small, unet3d, vit_b16

BATCH = 4
BLOCKS = ["blocks.0", "blocks.1"]
FC2 = OpKey("aten.addmm.default", 3)
"""The MLP's second linear, the block's fourth addmm (qkv, attention proj, fc1, fc2)."""


# --- the min-cut against brute force ------------------------------------------------------------------


def _brute_force(ops: list[CutOp], nbytes: dict[int, int], lam: Fraction) -> tuple[Fraction, frozenset[int]]:
    """The least ``FLOPs rerun + lam * bytes kept`` over every subset of ops, each storage paid once."""
    best: tuple[Fraction, frozenset[int]] | None = None
    for r in range(len(ops) + 1):
        for kept in itertools.combinations(ops, r):
            storages = {s for op in kept for s in op.outputs}
            cost = sum(op.flops for op in ops if op not in kept) + lam * sum(nbytes[s] for s in storages)
            if best is None or cost < best[0]:
                best = (Fraction(cost), frozenset(op.index for op in kept))
    assert best is not None
    return best


def _cost(ops: list[CutOp], nbytes: dict[int, int], lam: Fraction, kept: frozenset[int]) -> Fraction:
    storages = {s for op in ops if op.index in kept for s in op.outputs}
    return sum((Fraction(op.flops) for op in ops if op.index not in kept), start=Fraction(0)) + lam * sum(nbytes[s] for s in storages)


TINY = [CutOp(0, flops=100, outputs=(10,)), CutOp(1, flops=30, outputs=(10,)), CutOp(2, flops=30, outputs=(11,))]
TINY_BYTES = {10: 10, 11: 20}


def test_min_cut_shares_a_storage_by_hand() -> None:
    # At 4 FLOPs per byte: op 0 alone is worth keeping (100 FLOPs > 4 * 10 B); op 1 alone is not (30 < 40),
    # but it writes op 0's storage, so once op 0 is kept op 1 is free; op 2 is not (30 < 4 * 20 B).
    # Kept {0, 1}: rerun 30 FLOPs (op 2) + 4 * 10 B = 70, against 160 keeping nothing, 100 keeping {0},
    # 120 keeping all three: the cut sees what a per-op ratio test would miss.
    assert cut_block(TINY, TINY_BYTES, free=(), lam=Fraction(4)) == {0, 1}
    assert _cost(TINY, TINY_BYTES, Fraction(4), frozenset({0, 1})) == 70
    # A storage kept anyway (a block input) costs nothing: every op writing it is kept at any price.
    assert cut_block(TINY, TINY_BYTES, free={10}, lam=Fraction(1000)) == {0, 1}


@pytest.mark.parametrize("lam", [Fraction(1, 3), Fraction(1), Fraction(3, 2), Fraction(4), Fraction(13, 2), Fraction(20)])
def test_min_cut_matches_brute_force(lam: Fraction) -> None:
    best, _ = _brute_force(TINY, TINY_BYTES, lam)
    assert _cost(TINY, TINY_BYTES, lam, cut_block(TINY, TINY_BYTES, free=(), lam=lam)) == best


def test_min_cut_matches_brute_force_on_a_denser_graph() -> None:
    ops = [CutOp(i, flops=f, outputs=o) for i, (f, o) in enumerate([(90, (1, 2)), (40, (2,)), (70, (3,)), (10, (3, 4)), (55, (5,))])]
    nbytes = {1: 8, 2: 12, 3: 30, 4: 5, 5: 11}
    for lam in (Fraction(k, 4) for k in range(1, 40)):
        assert _cost(ops, nbytes, lam, cut_block(ops, nbytes, free=(), lam=lam)) == _brute_force(ops, nbytes, lam)[0], lam


# --- plans on the zoo, measured ------------------------------------------------------------------------

_SPECS: dict[str, Callable[..., ModelSpec]] = {"gpt2-small": gpt2_small.build, "vit-b16": vit_b16.build}


@pytest.fixture(scope="module")
def plans() -> Callable[[str, int], tuple[ModelSpec, CheckpointPlan]]:
    """Plans by (model, budget), each made once for the module's tests."""
    made: dict[tuple[str, int], tuple[ModelSpec, CheckpointPlan]] = {}

    def get(model: str, budget: int) -> tuple[ModelSpec, CheckpointPlan]:
        if (model, budget) not in made:
            spec = _SPECS[model](test=True)
            made[(model, budget)] = spec, plan_checkpointing(spec.model, spec.inputs, BLOCKS, budget=budget, batch=BATCH, loss=spec.loss)
        return made[(model, budget)]

    return get


def _measured(spec: ModelSpec, plan: CheckpointPlan) -> PlanMeasurement:
    return measure_plan(spec.model, spec.inputs, plan, loss=spec.loss)


def _assert_exact(spec: ModelSpec, plan: CheckpointPlan) -> PlanMeasurement:
    real = _measured(spec, plan)
    assert real.saved == plan.saved_at_batch, (real.saved, plan.saved_at_batch)
    assert real.saved <= plan.budget
    assert real.unplanned == plan.unplanned.at(BATCH)
    assert real.recompute_flops == plan.recompute_flops, (real.recompute_flops, plan.recompute_flops)
    return real


# GPT test config at B=4 (2 blocks of d=32 over 16 tokens): 446340 B saved without checkpointing, of
# which 51076 B outside the blocks (embeddings' dropout, final LayerNorm, the LM head's log-softmax).
# Each block's input is (4, 16, 32) fp32 = 8192 B: the least is 51076 + 2 * 8192 = 67460 B.
GPT_LEAST = 67460


def test_gpt_no_checkpointing_when_everything_fits(plans: Callable[[str, int], tuple[ModelSpec, CheckpointPlan]]) -> None:
    spec, plan = plans("gpt2-small", 10**9)
    assert [b.checkpointed for b in plan.blocks] == [False, False]
    assert plan.saved == plan.unplanned and plan.recompute_flops == 0
    real = _assert_exact(spec, plan)
    assert real.saved == 446340
    # The chooser's pass and fxmem's own capture count the same storages.
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, target="cpu", peak=False)
    assert report.activation_bytes(BATCH) == plan.unplanned.at(BATCH) == 446340


def test_gpt_every_block_fully_checkpointed_at_the_least_budget(plans: Callable[[str, int], tuple[ModelSpec, CheckpointPlan]]) -> None:
    spec, plan = plans("gpt2-small", GPT_LEAST)
    assert [(b.checkpointed, b.kept) for b in plan.blocks] == [(True, ()), (True, ())]
    assert [b.saved_at_batch for b in plan.blocks] == [8192, 8192]  # each keeps its input only
    assert plan.saved_at_batch == GPT_LEAST
    # Rerun per block: qkv 2*64*32*96, proj 2*64*32*32, fc1 and fc2 2*64*32*128 each, and the two
    # attention bmm's 2*(4*4)*16*16*8 each: 393216 + 131072 + 2 * 524288 + 2 * 65536 = 1703936.
    assert [b.recompute_flops_at_batch for b in plan.blocks] == [1703936, 1703936]
    _assert_exact(spec, plan)


def test_gpt_selective_saving_inside_blocks(plans: Callable[[str, int], tuple[ModelSpec, CheckpointPlan]]) -> None:
    spec, plan = plans("gpt2-small", 120000)
    # fc2's output, (64, 32) fp32 = 8192 B for 524288 FLOPs, is 64 FLOPs per byte: the best buy in a
    # block; both blocks keep it (83844 B). Next come qkv, proj and fc1 at 16 FLOPs per byte (the
    # attention bmm's give 4 and 8): of the 36156 B left, proj's 8192 B and qkv's 24576 B fit, fc1's
    # 32768 B no longer. Rerun: 2 * 1703936 - 2 * 524288 - 131072 - 393216 = 1835008 FLOPs.
    qkv, proj = OpKey("aten.addmm.default", 0), OpKey("aten.addmm.default", 1)
    assert [(b.checkpointed, b.kept) for b in plan.blocks] == [(True, (FC2,)), (True, (qkv, proj, FC2))]
    assert [b.saved_at_batch for b in plan.blocks] == [16384, 8192 + 24576 + 8192 + 8192]
    assert plan.saved_at_batch == 116612 and plan.recompute_flops == 1835008
    assert FC2 not in plan.blocks[0].recomputed and OpKey("aten.addmm.default", 2) in plan.blocks[0].recomputed
    # Rows sum to the total: in a chain of blocks no storage is kept by two of them.
    assert plan.outside.at(BATCH) + sum(b.saved_at_batch for b in plan.blocks) == plan.saved_at_batch
    assert str(plan).splitlines()[-1] == "saved at B=4: 116612 B of a 120000 B budget (without checkpointing 446340 B)"
    _assert_exact(spec, plan)


def test_gpt_cut_beats_checkpointing_every_block(plans: Callable[[str, int], tuple[ModelSpec, CheckpointPlan]]) -> None:
    """At a budget that checkpointing every block also fits, the plan reruns fewer FLOPs than it."""
    _, plan = plans("gpt2-small", 120000)
    _, every = plans("gpt2-small", GPT_LEAST)
    assert all(b.checkpointed and not b.kept for b in every.blocks) and every.saved_at_batch <= plan.budget
    assert plan.recompute_flops <= every.recompute_flops
    assert (plan.recompute_flops, every.recompute_flops) == (1835008, 3407872)


def test_vit_one_block_fully_checkpointed_one_selective(plans: Callable[[str, int], tuple[ModelSpec, CheckpointPlan]]) -> None:
    # ViT test config at B=4: 17 tokens of d=32, so a block's input is 4*17*32*4 = 8704 B and fc2's
    # output the same 8704 B; 26820 B are saved outside the blocks. At 52932 B = 26820 + 2 * 8704 + 8704
    # there is room for one fc2 output: one block keeps it, the other is fully checkpointed.
    spec, plan = plans("vit-b16", 52932)
    assert sorted((b.checkpointed, b.kept) for b in plan.blocks) == [(True, ()), (True, (FC2,))]
    assert plan.saved_at_batch == 52932
    _assert_exact(spec, plan)


def test_vit_selective_saving_in_both_blocks(plans: Callable[[str, int], tuple[ModelSpec, CheckpointPlan]]) -> None:
    spec, plan = plans("vit-b16", 100000)
    proj, fc1 = OpKey("aten.addmm.default", 1), OpKey("aten.addmm.default", 2)
    assert [b.kept for b in plan.blocks] == [(proj, FC2), (proj, fc1, FC2)]
    assert plan.saved_at_batch == 96452 and plan.recompute_flops == 844288 + 565760
    _assert_exact(spec, plan)


def test_unet_convolutions_kept_around_batch_norm() -> None:
    """BatchNorm, its in-place ReLU and num_batches_tracked.add_ are rerun (Note [What a selective
    checkpoint must rerun] in fxmem/planner/checkpoint.py); what is kept, if anything, is convolution outputs."""
    spec = unet3d.build(test=True)
    blocks = ["downs.0", "downs.1", "bottleneck", "decs.0", "decs.1"]
    plan = plan_checkpointing(spec.model, spec.inputs, blocks, budget=1_000_000, batch=2, loss=spec.loss)
    conv = lambda n: OpKey("aten.convolution.default", n)
    assert [b.kept for b in plan.blocks] == [(), (), (conv(1),), (conv(0),), (conv(0),)]
    assert all(b.checkpointed for b in plan.blocks) and plan.blocks[0].saved_at_batch == 0  # its input is the batch
    real = measure_plan(spec.model, spec.inputs, plan, loss=spec.loss)
    assert (real.saved, real.recompute_flops) == (plan.saved_at_batch, plan.recompute_flops) == (995332, 25657344)
    assert real.unplanned == plan.unplanned.at(2) == 1831556


# --- the emitted code -----------------------------------------------------------------------------------


def test_emitted_source_names_the_ops(plans: Callable[[str, int], tuple[ModelSpec, CheckpointPlan]]) -> None:
    _, plan = plans("gpt2-small", 120000)
    source = emit_source(plan)
    compile(source, "<plan>", "exec")
    assert "'blocks.0': {\n        ('aten.addmm.default', 3),\n    }," in source
    assert "116612 bytes saved for backward" in source
    assert "use_reentrant=False" in source and "create_selective_checkpoint_contexts" in source


def test_applied_plan_gives_the_same_gradients(plans: Callable[[str, int], tuple[ModelSpec, CheckpointPlan]]) -> None:
    """Dropout is rerun with the RNG state the checkpoint restores: loss and gradients are unchanged."""
    spec, plan = plans("gpt2-small", 120000)
    torch.manual_seed(0)
    plain = spec.model.train()
    checkpointed = compile_plan(plan)(copy.deepcopy(plain))
    idx = torch.randint(0, 101, (BATCH, 16))
    grads = []
    for model in (plain, checkpointed):
        torch.manual_seed(1)
        model.zero_grad()
        model(idx).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))


# --- errors ---------------------------------------------------------------------------------------------


def test_block_that_is_not_a_module() -> None:
    spec = gpt2_small.build(test=True)
    with pytest.raises(InputSpecError, match=r"model 'gpt2-small': block 'blocks.7' is not a module path .* 'blocks.0'") as e:
        plan_checkpointing(spec.model, spec.inputs, ["blocks.0", "blocks.7"], budget=10**9, batch=BATCH, name="gpt2-small")
    assert "\n" not in str(e.value)


def test_blocks_not_a_list() -> None:
    spec = gpt2_small.build(test=True)
    given: list[object] = ["blocks.0", []]  # a path where a list of them belongs, and no block at all
    for blocks in given:
        with pytest.raises(InputSpecError, match="blocks must be a list of module paths"):
            plan_checkpointing(spec.model, spec.inputs, blocks, budget=10**9, batch=BATCH)  # type: ignore[arg-type]


def test_nested_blocks() -> None:
    spec = gpt2_small.build(test=True)
    with pytest.raises(InputSpecError, match="overlap"):
        plan_checkpointing(spec.model, spec.inputs, ["blocks.0", "blocks.0.attn"], budget=10**9, batch=BATCH)


def test_budget_below_full_checkpointing(plans: Callable[[str, int], tuple[ModelSpec, CheckpointPlan]]) -> None:
    spec, _ = plans("gpt2-small", GPT_LEAST)
    with pytest.raises(FxmemError, match=rf"model 'GPT': a budget of {GPT_LEAST - 1} bytes .* least .*: {GPT_LEAST} bytes") as e:
        plan_checkpointing(spec.model, spec.inputs, BLOCKS, budget=GPT_LEAST - 1, batch=BATCH, loss=spec.loss)
    assert "51076 bytes of it saved outside those blocks" in str(e.value)


class _Shared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(self.f(x))


def test_block_that_runs_twice() -> None:
    with pytest.raises(InputSpecError, match=r"model '_Shared': block 'f' ran 2 times in one forward"):
        plan_checkpointing(_Shared(), ["B,8"], ["f"], budget="1MiB", batch=BATCH)
