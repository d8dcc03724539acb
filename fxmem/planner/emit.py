"""A checkpointing plan as code: the source a user pastes, and the same source compiled for use in-process.

The source is the only form of the plan that runs: ``compile_plan`` executes it, so the code tested
(fxmem/planner/verify.py, tests/test_plan_checkpoint.py) is the code a user gets.

Note [Naming ops in a policy function]
    A policy function is called once per op of the region's forward with the OpOverload
    (``torch.ops.aten.addmm.default``, whose ``str`` is ``"aten.addmm.default"``), and SAC keys its cache by
    the OpOverload and its call count within the region (torch/utils/checkpoint.py,
    ``_CachingTorchDispatchMode``). The emitted policy counts calls per OpOverload the same way, with
    fresh counts for each region call (``context_fn`` runs once per checkpoint call), so
    ``("aten.addmm.default", 3)`` is the block's fourth addmm, as the chooser recorded it (Note [Ops as
    a policy function sees them] in block_ops.py). Torch releases before 2.5 also called the policy during
    recomputation (``ctx.is_recompute``); those calls are counted apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from torch import nn

from fxmem.planner.checkpoint import CheckpointPlan

__all__ = ["apply_plan_to", "compile_plan", "emit_source"]

_TEMPLATE = '''\
"""Activation checkpointing for {model} at batch {batch}, chosen by fxmem: {saved} bytes saved for backward
(budget {budget}; {unplanned} without checkpointing). Backward reruns the ops each block below does not keep:
{flops} FLOPs by torch.utils.flop_counter's count, which gives elementwise ops, norms and views none, so 0
means the blocks keep every output that costs FLOPs (matmuls, attention) and rerun only such ops.

Call apply_checkpointing(model) once, before training: it wraps the forward of each block below in
torch.utils.checkpoint.checkpoint with a selective-checkpoint policy.
"""

import functools

import torch
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy

# Per checkpointed block, the ops whose outputs are kept for backward: (ATen op, its call count in the
# block's forward, from 0). Every other op of the block is recomputed in backward.
KEPT = {{
{kept}
}}


def _policy(kept):
    counts = {{}}

    def policy(ctx, op, *args, **kwargs):
        key = (getattr(ctx, "is_recompute", False), str(op))
        n = counts.get(key, 0)
        counts[key] = n + 1
        return CheckpointPolicy.MUST_SAVE if (str(op), n) in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _contexts(kept):
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(_policy(kept))


def _checkpointed(forward, kept):
    context_fn = functools.partial(_contexts, kept)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run


def apply_checkpointing(model):
    for fqn, kept in KEPT.items():
        module = model.get_submodule(fqn)
        module.forward = _checkpointed(module.forward, kept)
    return model
'''


def _kept_lines(plan: CheckpointPlan) -> str:
    lines = []
    for block in plan.blocks:
        if block.checkpointed:
            ops = "".join(f"\n        ({k.op!r}, {k.occurrence})," for k in block.kept)
            lines.append(f"    {block.fqn!r}: {{{ops}\n    }}," if ops else f"    {block.fqn!r}: set(),")
    return "\n".join(lines)


def emit_source(plan: CheckpointPlan) -> str:
    """The plan as a Python module: a ``KEPT`` table, a policy for ``create_selective_checkpoint_contexts``
    and ``apply_checkpointing(model)``, which wraps each checkpointed block's forward in
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)``. See Note [Naming ops in a policy function]."""
    return _TEMPLATE.format(
        model=plan.model,
        batch=plan.batch,
        saved=plan.saved_at_batch,
        budget=plan.budget,
        unplanned=plan.unplanned.at(plan.batch),
        flops=plan.recompute_flops,
        kept=_kept_lines(plan),
    )


def compile_plan(plan: CheckpointPlan) -> Callable[[nn.Module], nn.Module]:
    """``apply_checkpointing`` from ``emit_source(plan)``, executed: call it on a real model to apply the plan
    in place (it returns the model)."""
    namespace: dict[str, Any] = {"__name__": f"fxmem_plan_{plan.model}"}
    exec(compile(emit_source(plan), f"<fxmem checkpoint plan for {plan.model}>", "exec"), namespace)
    return cast(Callable[[nn.Module], nn.Module], namespace["apply_checkpointing"])


def apply_plan_to(plan: CheckpointPlan, model: nn.Module) -> nn.Module:
    """``compile_plan(plan)(model)`` as a module-level function, so that ``functools.partial(apply_plan_to,
    plan)`` pickles: real ranks in other processes apply the plan themselves (fxmem/measure_ranks.py)."""
    return compile_plan(plan)(model)
