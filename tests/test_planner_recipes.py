"""torchtitan's per-op selective checkpointing as a plan (fxmem/planner/recipes.py), against real CPU steps.

Each recipe plan is applied to the real model by its own emitted code and measured
(fxmem/planner/verify.py, ``measure_plan``): the bytes saved for backward must equal the plan's to the
byte, and the FLOPs backward recomputes the plan's. The same real model is then wrapped as torchtitan
wraps its blocks, with a copy of torchtitan's own policy function (``_torchtitan_context_fn`` below),
and one real step under it must save the same bytes and recompute the same FLOPs: the plan is the
recipe, not an approximation of it.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Collection
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy

from fxmem.engine.losses import get_loss
from fxmem.errors import InputSpecError
from fxmem.frontends.huggingface import prepared_for_training
from fxmem.inputs import InputSpecs, make_input, parse_inputs
from fxmem.measure import materialize
from fxmem.planner import CheckpointPlan, OpKey, compile_plan, measure_plan
from fxmem.planner.recipes import CPU_FLASH_ATTENTION, TORCHTITAN_SAVE_OPS, op_sac_plan, save_ops_for
from fxmem.planner.verify import _step
from models_zoo import gpt2_small

BATCH = 4
LLAMA_INPUTS = ["input_ids=B,16:int64"]
LLAMA_BLOCKS = ["model.layers.0", "model.layers.1"]
MM = lambda k: OpKey("aten.mm.default", k)

# --- torchtitan's policy, copied ------------------------------------------------------------------------

TITAN_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
}
"""torchtitan/models/llama3/parallelize.py, ``_op_sac_save_list`` (the Llama 3 8B recipe's)."""
CPU_SAVE_LIST = TITAN_SAVE_LIST | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
"""The same with the CPU's flash attention kernel (Note [torchtitan's per-op policy] in fxmem/planner/recipes.py)."""


def _torchtitan_context_fn(save_list: Collection[Any]) -> Callable[[], Any]:
    """``selective_checkpointing_context_fn`` of torchtitan/distributed/activation_checkpoint.py
    (``_apply_op_sac``), line for line but for the CPU-to-CUDA copy rule (no such copy on the CPU) and
    the shape-based force-recompute (empty by default for Llama). The contexts are made through
    ``torch.utils.checkpoint``'s attribute at call time so that verify.py's ``_caching_modes`` sees them."""

    def _get_custom_policy(meta: defaultdict[str, int]) -> Callable[..., CheckpointPolicy]:
        def _custom_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            mode = "recompute" if ctx.is_recompute else "forward"
            mm_count_key = f"{mode}_mm_count"
            if func == torch.ops.aten.mm.default:
                meta[mm_count_key] += 1
            # Saves output of all compute ops, except every second mm
            to_save = func in save_list and not (func == torch.ops.aten.mm.default and meta[mm_count_key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE

        return _custom_policy

    def selective_checkpointing_context_fn() -> Any:
        meta: defaultdict[str, int] = defaultdict(int)
        return torch.utils.checkpoint.create_selective_checkpoint_contexts(_get_custom_policy(meta))

    return selective_checkpointing_context_fn


def _torchtitan_wrapped(model: nn.Module, blocks: Collection[str], save_list: Collection[Any]) -> nn.Module:
    """Each block replaced by ``checkpoint_wrapper(block, context_fn=..., preserve_rng_state=False)``, as
    torchtitan's ``apply_ac`` registers it in place of the block (non-reentrant, torch's default impl)."""
    for fqn in blocks:
        parent, _, child = fqn.rpartition(".")
        owner = model.get_submodule(parent)
        wrapped = checkpoint_wrapper(owner.get_submodule(child), context_fn=_torchtitan_context_fn(save_list), preserve_rng_state=False)
        owner.register_module(child, wrapped)
    return model


def _real_step(model: nn.Module, inputs: InputSpecs, loss: str, wrap: Callable[[nn.Module], nn.Module]) -> tuple[int, int]:
    """(bytes saved, backward FLOPs) of one real CPU step of ``wrap(copy of model)``, counted as
    ``measure_plan`` counts them (verify.py's ``_step``: hook-packed and policy-cached storages)."""
    specs = parse_inputs(inputs)
    torch.manual_seed(0)
    real = wrap(copy.deepcopy(materialize(model).train()))
    values = [make_input(s, BATCH) for s in specs]
    with prepared_for_training(real):
        return _step(real, specs, values, get_loss(loss), type(model).__name__)


def _assert_recipe_is_torchtitans(
    model: nn.Module, inputs: InputSpecs, loss: str, plan: CheckpointPlan, save_list: Collection[Any]
) -> None:
    """The plan's prediction = its emitted code's real step = torchtitan's own policy's real step."""
    real = measure_plan(model, inputs, plan, loss=loss)
    assert (real.saved, real.recompute_flops) == (plan.saved_at_batch, plan.recompute_flops)
    assert real.unplanned == plan.unplanned.at(BATCH)
    blocks = [b.fqn for b in plan.blocks]
    titan_saved, titan_flops = _real_step(model, inputs, loss, lambda m: _torchtitan_wrapped(m, blocks, save_list))
    assert (titan_saved, titan_flops - real.plain_backward_flops) == (real.saved, real.recompute_flops)


# --- the zoo's GPT: biased linears, no mm ------------------------------------------------------------


def test_gpt_keeps_nothing_its_linears_run_addmm() -> None:
    # A biased linear runs addmm, which torchtitan's list does not name, and with dropout on the CPU's
    # attention takes the math path (bmm, softmax): nothing of a GPT block is in the list, so the recipe
    # is full checkpointing. Each block keeps its input, (4, 16, 32) fp32 = 8192 B, and the 51076 B
    # outside the blocks stay: 51076 + 2 * 8192 = 67460 B, the least any checkpointing of the two blocks
    # keeps (tests/test_planner_checkpoint.py, GPT_LEAST). Each block reruns all its FLOPs: qkv
    # 2*64*32*96, proj 2*64*32*32, fc1 and fc2 2*64*32*128 each, two attention bmm's 2*(4*4)*16*16*8 each.
    spec = gpt2_small.build(test=True)
    plan = op_sac_plan(spec.model, spec.inputs, ["blocks.0", "blocks.1"], batch=BATCH, loss=spec.loss)
    assert [(b.checkpointed, b.kept) for b in plan.blocks] == [(True, ()), (True, ())]
    assert plan.saved_at_batch == plan.budget == 51076 + 2 * 8192
    assert plan.recompute_flops == 2 * (393216 + 131072 + 2 * 524288 + 2 * 65536) == 3407872
    _assert_recipe_is_torchtitans(spec.model, spec.inputs, spec.loss, plan, CPU_SAVE_LIST)


# --- a tiny HF Llama: bias-free linears and the CPU's flash attention ------------------------------------


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    pytest.importorskip("transformers")
    from tests.helpers import tiny_llama

    return tiny_llama(use_cache=False)  # the real steps below checkpoint its layers themselves


@pytest.mark.filterwarnings("ignore:forward\\(\\) of model 'LlamaForCausalLM' returns")
def test_llama_keeps_every_other_mm_and_attention(llama: nn.Module) -> None:
    # A Llama block runs 7 mm's (q, k, v, o, gate, up, down): torchtitan keeps the 1st, 3rd, 5th and
    # 7th, ceil(7/2) = 4 (q, v, gate, down: occurrences 0, 2, 4, 6), and on the CPU the flash kernel's
    # output and log-sum-exp. At B=4, 16 tokens, d=32, 2 key/value heads of 8, MLP width 64, fp32:
    # input 4*16*32*4 = 8192, q 8192, v 4*16*16*4 = 4096, attention 8192 + lse 4*4*16*4 = 1024,
    # gate 4*16*64*4 = 16384, down 8192: 54272 B per block. Rerun: k 2*64*32*16 = 65536,
    # o 2*64*32*32 = 131072, up 2*64*32*64 = 262144 (the elementwise ops have no FLOP formula).
    plan = op_sac_plan(llama, LLAMA_INPUTS, LLAMA_BLOCKS, batch=BATCH, loss="cross_entropy", target="cpu")
    attention = OpKey(CPU_FLASH_ATTENTION, 0)
    assert [b.kept for b in plan.blocks] == [(MM(0), MM(2), attention, MM(4), MM(6))] * 2
    assert [b.saved_at_batch for b in plan.blocks] == [8192 + 8192 + 4096 + 9216 + 16384 + 8192] * 2 == [54272] * 2
    assert [b.recompute_flops_at_batch for b in plan.blocks] == [65536 + 131072 + 262144] * 2
    # Rows sum to the total: a block's input is the previous block's output, kept by it alone.
    assert plan.outside.at(BATCH) + 2 * 54272 == plan.saved_at_batch == 158212
    _assert_recipe_is_torchtitans(llama, LLAMA_INPUTS, "cross_entropy", plan, CPU_SAVE_LIST)


@pytest.mark.filterwarnings("ignore:forward\\(\\) of model 'LlamaForCausalLM' returns")
def test_llama_literal_cuda_list_recomputes_attention_on_the_cpu(llama: nn.Module) -> None:
    # torchtitan's list as written names CUDA's SDPA kernels only: on the CPU attention is recomputed
    # (0 FLOPs by torch's formulas, which have none for the CPU kernel), and each block keeps 9216 B less.
    plan = op_sac_plan(llama, LLAMA_INPUTS, LLAMA_BLOCKS, batch=BATCH, loss="cross_entropy", target="cuda")
    assert [b.kept for b in plan.blocks] == [(MM(0), MM(2), MM(4), MM(6))] * 2
    assert [b.saved_at_batch for b in plan.blocks] == [54272 - 9216] * 2
    assert plan.recompute_flops == 2 * 458752
    _assert_recipe_is_torchtitans(llama, LLAMA_INPUTS, "cross_entropy", plan, TITAN_SAVE_LIST)


# --- every other mm, and what torch refuses to cache ----------------------------------------------------


class _Mlp(nn.Module):
    """Three bias-free linears (three mm's); the first one's output rectified in place if ``inplace``."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
        self.act = nn.ReLU(inplace=inplace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(self.act(self.a(x)))))


def test_three_linears_keep_two_mm() -> None:
    # 3 mm's per block: the 1st and 3rd are kept, ceil(3/2) = 2, each (4, 8) fp32 = 128 B; the block's
    # input is the batch (not an activation) for the first block and the first block's output for the second.
    model = nn.Sequential(_Mlp(inplace=False), _Mlp(inplace=False))
    plan = op_sac_plan(model, ["B,8"], ["0", "1"], batch=BATCH, save_ops=[torch.ops.aten.mm.default])
    assert [b.kept for b in plan.blocks] == [(MM(0), MM(2))] * 2
    assert [b.saved_at_batch for b in plan.blocks] == [2 * 128, 128 + 2 * 128]
    assert plan.recompute_flops == 2 * (2 * 4 * 8 * 8)
    _assert_recipe_is_torchtitans(model, ["B,8"], "sum", plan, {torch.ops.aten.mm.default})


def test_mm_written_in_place_is_recomputed_where_torchtitans_policy_fails() -> None:
    """The first mm's output is rectified in place: cached, it fails in backward (Note [What a selective
    checkpoint must rerun]), so the plan reruns it and keeps only the third; torchtitan's policy raises."""
    model = nn.Sequential(_Mlp(inplace=True), _Mlp(inplace=True))
    plan = op_sac_plan(model, ["B,8"], ["0", "1"], batch=BATCH, target="cuda")
    assert [b.kept for b in plan.blocks] == [(MM(2),)] * 2
    real = measure_plan(model, ["B,8"], plan)
    assert (real.saved, real.recompute_flops) == (plan.saved_at_batch, plan.recompute_flops)
    with pytest.raises(RuntimeError, match="mutated"):
        _real_step(model, ["B,8"], "sum", lambda m: _torchtitan_wrapped(m, ["0", "1"], TITAN_SAVE_LIST))


def test_save_lists() -> None:
    assert save_ops_for("cuda") == TORCHTITAN_SAVE_OPS == {str(op) for op in TITAN_SAVE_LIST}
    assert save_ops_for("cpu") == TORCHTITAN_SAVE_OPS | {CPU_FLASH_ATTENTION}
    with pytest.raises(InputSpecError, match="target must be one of 'cuda', 'cpu', got 'tpu'"):
        save_ops_for("tpu")


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-policy"])
def test_recipe_under_fsdp2_on_a_hugging_face_llama_against_two_real_ranks(llama: nn.Module, mixed: bool) -> None:
    """The whole recipe on a HF Llama: every block per-op checkpointed inside its FSDP2 unit, with
    fp32 weights or FSDP2's bf16 MixedPrecisionPolicy. The exported graph's checkpointed regions start
    before each block's first op, so the units' all-gathers must run inside the regions and the
    recomputation must read the weights FSDP2 gathered for backward (Note [Module hooks inside a
    checkpoint] in fxmem/engine/module_hooks.py). Two real gloo ranks, each applying the emitted plan
    before ``fully_shard``, save what the simulated rank saves, to the byte; in fp32 their peaks lie
    within the bound tests/test_parallel.py holds FSDP2 ranks to."""
    import functools

    import fxmem
    from fxmem.measure_ranks import measure_ranks
    from fxmem.planner.emit import apply_plan_to
    from tests.helpers import assert_rank_peaks

    plan = op_sac_plan(llama, LLAMA_INPUTS, LLAMA_BLOCKS, batch=2, loss="cross_entropy")
    checkpointed = compile_plan(plan)(copy.deepcopy(llama))
    report = fxmem.analyze(
        checkpointed, LLAMA_INPUTS, loss="cross_entropy", batch=2, target="cpu", fsdp=2, precision="mixed" if mixed else None
    )
    prepare = functools.partial(apply_plan_to, plan)
    ranks = measure_ranks(llama, LLAMA_INPUTS, 2, fsdp=2, units=report.fsdp_units, loss="cross_entropy", mixed=mixed, prepare=prepare)
    assert [r.saved for r in ranks] == [report.activation_bytes(2)] * 2
    if not mixed:  # the bf16 step's peak on a CPU with bf16 units is open (tests/test_parallel.py::test_fsdp_mixed_precision_policy)
        unit = sum(p.numel() * p.element_size() for p in llama.model.layers[0].parameters())
        assert_rank_peaks([r.peak for r in ranks], report.peak(2).bytes, unit)
