"""Published checkpointing recipes as plans: what a recipe keeps, predicted on fake tensors, as a ``CheckpointPlan``.

A recipe is a policy someone else chose. Expressed as the ``OpKey``s it keeps per block, it is a plan
like the chooser's (checkpoint.py): ``emit_source``/``compile_plan`` write the same policy as code,
``measure_plan`` runs it for real, and its saved bytes and recomputed FLOPs can be set beside a plan
chosen for a budget. The one recipe here is torchtitan's per-op selective activation checkpointing
(``op_sac_plan``), the one its Llama 3.1 8B training config uses.

Note [torchtitan's per-op policy]
    torchtitan (torchtitan/distributed/activation_checkpoint.py, ``_apply_op_sac``, as of commit
    cfb9326; earlier in ``_apply_ac_to_transformer_block``) wraps each transformer block with
    ``checkpoint_wrapper(context_fn=...)``, whose policy MUST_SAVEs the outputs of the ops in a save list
    and PREFER_RECOMPUTEs every other op, but for matmuls: a per-region counter (a fresh
    ``defaultdict(int)`` per ``context_fn`` call, so per block call) is incremented on each
    ``aten.mm.default`` *before* the test, and an mm whose count is even is recomputed. The 1st, 3rd,
    5th... mm are saved: in the 0-based occurrences block_ops.py records, ``("aten.mm.default", k)``
    for every even ``k``. The save list (``_op_sac_save_list`` in torchtitan/models/llama3/parallelize.py,
    later infra/parallelize.py; the Llama 3 8B config, train_configs/llama3_8b.toml, sets
    ``mode = 'selective'``, ``selective_ac_option = 'op'``) is ``TORCHTITAN_SAVE_OPS``: mm, the CUDA
    SDPA kernels (flash, efficient, cuDNN), the functional ``reduce_scatter_tensor`` of sequence
    parallel, and ``max`` (float8 scaling's amax). Later releases add
    ``_scaled_dot_product_attention_math`` (CompositeImplicitAutograd: it decomposes above the dispatch
    modes, so a policy never sees it in eager), ``_scaled_dot_product_fused_attention_overrideable``
    (other backends' fused kernel) and higher-order ops (flex attention, varlen attention, compiled
    regions), none of which an eager CPU step of a Llama or GPT block runs. The newest upstream file
    names outputs instead (``_AutoNamingMode``, a ``sac_save_list`` of names such as
    ``layers.*.attention.mm_0``) and has no counter; the counter's recipe is the one here.

    Only ``aten.mm.default`` is counted and alternated: a linear with a bias runs ``addmm``
    (``at::linear``, Note [linear's bias on fake tensors] in fxmem/rules/linear.py), which the list does
    not name, so a block of biased linears (the zoo's GPT) keeps no matmul at all; torchtitan's Llama
    has no biases.

    The CPU's SDPA. fxmem records a block's ops on the CPU, where ``scaled_dot_product_attention``
    runs ``aten._scaled_dot_product_flash_attention_for_cpu`` wherever CUDA would run one of the listed
    flash, efficient or cuDNN kernels, and the math path (bmm, softmax, dropout, none listed) when
    dropout is on (``select_sdp_backend_cpp``; checked on torch 2.13). torchtitan's intent is to keep
    attention's output, so the honest CPU form of the recipe keeps the CPU flash kernel too:
    ``save_ops_for("cpu")`` adds it. ``save_ops_for("cuda")`` is the list verbatim; on fxmem's CPU pass
    it matches no attention kernel, so attention is recomputed there, as a literal reading of the list
    on a CPU would do.

    What torch refuses. Note [What a selective checkpoint must rerun] (checkpoint.py) keeps random
    and in-place-written ops out of the chooser's plans; torchtitan's policy tests only the op.
    - Every SDPA kernel is tagged ``nondeterministic_seeded`` (it takes ``dropout_p``), so block_ops.py
      records it as random, but it draws only when ``dropout_p > 0``. The CPU flash kernel never runs
      with dropout (the CPU takes the math path then), and torchtitan's models have no attention
      dropout, so caching it skips no draw: the recipe keeps it as torchtitan does. (On CUDA with
      attention dropout, caching it would shift the random numbers of later ops' recomputation:
      torchtitan's recipe would do the same.)
    - An output written in place after it is cached fails in backward ("Tensor cached during selective
      activation checkpoint has been mutated", ``_VersionWrapper.get_val``), so a listed op that writes
      in place, or whose output a later op writes, is recomputed instead. No mm output of a Llama or GPT
      block is written in place (the residual adds and activations are out of place); a biased linear
      on a non-contiguous input does write one (``matmul``, then ``add_`` of the bias onto its output).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import nn

from fxmem.engine.losses import get_loss
from fxmem.errors import InputSpecError
from fxmem.inputs import InputSpecs, check_batch, parse_inputs
from fxmem.planner.block_ops import BlockOps, record_block_ops
from fxmem.planner.checkpoint import CheckpointPlan, _check_blocks, _checkpointed, _choice
from fxmem.step.training import TARGETS
from fxmem.frontends.huggingface import without_kv_cache

__all__ = ["CPU_FLASH_ATTENTION", "TORCHTITAN_SAVE_OPS", "op_sac_plan", "save_ops_for"]

MM = "aten.mm.default"
"""The op torchtitan's policy counts, saving only its odd-numbered calls (Note [torchtitan's per-op policy])."""

TORCHTITAN_SAVE_OPS: frozenset[str] = frozenset(
    {
        MM,
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
        "_c10d_functional.reduce_scatter_tensor.default",
        "aten.max.default",
    }
)
"""torchtitan's ``_op_sac_save_list`` for Llama 3 as its 8B recipe runs it, by ``str(OpOverload)`` (Note [torchtitan's per-op policy])."""

CPU_FLASH_ATTENTION = "aten._scaled_dot_product_flash_attention_for_cpu.default"
"""What SDPA runs on the CPU where CUDA runs a listed kernel (Note [torchtitan's per-op policy])."""


def save_ops_for(target: str) -> frozenset[str]:
    """The save list of torchtitan's per-op recipe on ``target``: verbatim for "cuda", with the CPU's flash
    attention kernel for "cpu" (Note [torchtitan's per-op policy])."""
    if target not in TARGETS:
        raise InputSpecError(f"target must be one of {', '.join(repr(t) for t in TARGETS)}, got {target!r}.")
    return TORCHTITAN_SAVE_OPS | {CPU_FLASH_ATTENTION} if target == "cpu" else TORCHTITAN_SAVE_OPS


@without_kv_cache(0)  # checkpointed layers run without a key/value cache, as transformers runs them
def op_sac_plan(
    model: nn.Module,
    inputs: InputSpecs,
    blocks: Sequence[str],
    *,
    batch: int,
    loss: str = "sum",
    name: str | None = None,
    seq_len: int | None = None,
    target: str = "cpu",
    save_ops: Collection[str | torch._ops.OpOverload] | None = None,
) -> CheckpointPlan:
    """torchtitan's per-op selective activation checkpointing of every block in ``blocks`` (module paths), as
    a plan at ``batch``: each block keeps the outputs of the ops in ``save_ops`` (default
    ``save_ops_for(target)``) but every second ``aten.mm.default``, and recomputes the rest
    (Note [torchtitan's per-op policy]). Saved bytes and recomputed FLOPs are counted as
    ``plan_checkpointing`` counts them; the plan's budget is what it saves (a recipe has none).

    >>> from models_zoo import gpt2_small
    >>> spec = gpt2_small.build(test=True)
    >>> plan = op_sac_plan(spec.model, spec.inputs, ["blocks.0", "blocks.1"], batch=4, loss=spec.loss)
    >>> [b.kept for b in plan.blocks]   # biased linears run addmm, which the save list does not name
    [(), ()]
    """
    name = name or type(model).__name__
    check_batch(batch)
    names = save_ops_for(target) if save_ops is None else frozenset(str(op) for op in save_ops)
    _check_blocks(model, blocks, name)
    trace = record_block_ops(model.train(), parse_inputs(inputs), blocks, loss=get_loss(loss), name=name, seq=seq_len, batch=batch)
    outside = frozenset(trace.outside)
    chosen = [_checkpointed(block, _kept(block, names)) for block in trace.blocks]
    saved = trace.nbytes(outside.union(*(o.storages for o in chosen)))
    unplanned = outside.union(*(b.saved for b in trace.blocks))
    return CheckpointPlan(
        name, batch, saved.at(batch), tuple(_choice(b, o, trace, batch) for b, o in zip(trace.blocks, chosen)),
        trace.nbytes(outside), saved, trace.nbytes(unplanned),
    )  # fmt: skip


def _kept(block: BlockOps, save_ops: frozenset[str]) -> frozenset[int]:
    """The ops torchtitan's policy saves, by index: listed, not an odd-occurrence mm, not written in place."""
    return frozenset(
        op.index
        for op in block.ops
        if op.op in save_ops and not (op.op == MM and op.occurrence % 2) and not (op.in_place or op.mutated_later)
    )
