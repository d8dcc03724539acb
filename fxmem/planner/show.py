"""A plan as the planner prints it, and as the runnable file ``--emit`` writes."""

from __future__ import annotations

from tabulate import tabulate

from fxmem.errors import InputSpecError
from fxmem.output.render import format_bytes
from fxmem.planner.emit import emit_source
from fxmem.planner.search import Candidate, Config, Plan

__all__ = ["emit_plan", "plan_table"]


def plan_table(plan: Plan) -> str:
    """The fitting configurations, fastest first, then the verdict (or the closest and its shortfall)."""
    rows = [_row(rank, c) for rank, c in enumerate(plan.fitting, start=1)]
    head = f"Plan for {plan.model} on {plan.where} ({format_bytes(plan.memory)} each)"
    head += f", global batch {plan.global_batch}" if plan.global_batch else ""
    parts = [head + ":", ""]
    if rows:
        headers = ["#", "configuration", "micro-batch x accumulation", "GPU total", "peak", "recomputed", "samples/s (roofline)"]
        parts += [tabulate(rows, headers=headers, disable_numparse=True), ""]
    parts.append(plan.verdict())
    parts += [f"Not evaluated: {why}" for why in plan.skipped]
    return "\n".join(parts) + "\n"


def _row(rank: int, c: Candidate) -> list[str]:
    flops = f"{c.recompute_flops / 1e9:.3g} GFLOP" if c.recompute_flops else "-"
    return [
        str(rank),
        c.config.describe(),
        f"{c.micro_batch} x {c.accumulation}",
        format_bytes(c.total),
        format_bytes(c.peak),
        flops,
        f"{c.samples_per_second:,.0f}",
    ]


_TEMPLATE = '''\
"""The training setup fxmem's planner chose for {model}: {config}, micro-batch {micro} with {accumulation}
accumulation steps ({global_batch} samples per optimizer step), predicted {total} on each GPU.

Apply it with ``model = apply_plan(model)`` and ``optimizer = make_optimizer(model)``, and train
with ``train_step(model, optimizer, batches, loss_fn)``.
"""

import contextlib

import torch

DEVICE = {device!r}
AMP = {amp}
"""The autocast dtype of the forward and the loss (None: no autocast)."""
ACCUMULATION = {accumulation}
MICRO_BATCH = {micro}


def make_optimizer(model):
    return {optimizer}


def apply_plan(model):
    """Checkpointing first (it wraps forwards), then tensor parallel, then FSDP2, as torchtitan orders them.
    Under torchrun with {ranks} processes for the sharded setups."""
{apply}
    return model


def train_step(model, optimizer, batches, loss_fn):
    """One optimizer step over ``ACCUMULATION`` micro-batches of ``MICRO_BATCH`` samples each."""
    autocast = torch.autocast(DEVICE, dtype=AMP) if AMP else contextlib.nullcontext()
    for inputs, target in batches:
        with autocast:
            loss = loss_fn(model(inputs), target) / ACCUMULATION
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
{checkpointing}'''


def emit_plan(plan: Plan, candidate: Candidate | None = None) -> str:
    """A runnable Python file that applies ``candidate`` (default the plan's best): its optimizer and
    implementation, its autocast, its gradient accumulation and its activation checkpointing."""
    c = candidate or plan.best
    if c is None:
        raise InputSpecError(f"model '{plan.model}': nothing fits, so there is no configuration to emit; see the plan's closest one.")
    config = c.config
    checkpointing = "\n\n# Activation checkpointing, as fxmem chose it:\n" + emit_source(config.checkpoint) if config.checkpoint else ""
    return _TEMPLATE.format(
        model=plan.model, config=config.describe(), micro=c.micro_batch, accumulation=c.accumulation, global_batch=c.global_batch,
        total=format_bytes(c.total), amp={"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(config.amp or "", "None"), device=plan.target, optimizer=_optimizer_call(config.optimizer, config.optimizer_impl),
        apply=_apply_lines(config), ranks=config.fsdp * config.tp, checkpointing=checkpointing,
    )  # fmt: skip


def _apply_lines(config: Config) -> str:
    """The body of ``apply_plan``: the calls a training script makes for ``config``."""
    lines = ["    apply_checkpointing(model)"] if config.checkpoint else []
    if config.fsdp > 1 or config.tp > 1:
        lines += [
            "    from torch.distributed.device_mesh import init_device_mesh",
            f"    mesh = init_device_mesh('cuda', ({config.fsdp}, {config.tp}), mesh_dim_names=('dp', 'tp'))",
        ]
    if config.tp > 1:
        styles = {"colwise": "ColwiseParallel()", "rowwise": "RowwiseParallel()", "colwise_gather_output": "ColwiseParallel(output_layouts=Replicate())",
                  "embedding_rowwise": "RowwiseParallel(input_layouts=Replicate())"}  # fmt: skip
        plan = ", ".join(f"{path!r}: {styles[style]}" for path, style in _expanded(config.tp_plan))
        lines += [
            "    from torch.distributed.tensor import Replicate",
            "    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module",
            f"    parallelize_module(model, mesh['tp'], {{{plan}}})",
        ]
    if config.fsdp > 1:
        policy = (
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
            if config.precision == "mixed"
            else "MixedPrecisionPolicy()"
        )
        lines += [
            "    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard",
            f"    for unit in {list(config.units)!r}:",
            f"        fully_shard(model.get_submodule(unit), mesh=mesh['dp'], mp_policy={policy})",
            f"    fully_shard(model, mesh=mesh['dp'], mp_policy={policy})",
        ]
    return "\n".join(lines) or "    pass  # nothing to change in the model"


def _expanded(plan: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """A plan as ``parallelize_module`` takes it: its own fnmatch-style ``*`` patterns, as given."""
    return plan


def _optimizer_call(name: str, impl: str | None) -> str:
    classes = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "sgd-momentum": "SGD", "adafactor": "Adafactor", "adagrad": "Adagrad"}
    options = {"sgd": "lr=0.01", "sgd-momentum": "lr=0.01, momentum=0.9"}.get(name, "")
    flag = {"fused": "fused=True", "foreach": "foreach=True", "for-loop": "foreach=False"}.get(impl or "", "")
    arguments = ", ".join(a for a in ("model.parameters()", options, flag) if a)
    if name == "adam8bit":  # bitsandbytes' 8-bit AdamW, which fxmem's rule describes
        return f"__import__('bitsandbytes').optim.AdamW8bit({arguments})"
    if name not in classes:
        raise InputSpecError(
            f"--emit writes torch.optim calls, and optimizer '{name}' has none fxmem knows; build it yourself in make_optimizer, "
            "or plan with adamw, adam, sgd, sgd-momentum, adafactor, adagrad or adam8bit."
        )
    return f"torch.optim.{classes[name]}({arguments})"
