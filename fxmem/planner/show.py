"""A plan as the planner prints it (``plan_table``), as JSON (``plan_json``), and as the module ``--emit``
writes (``emit_plan``).

Note [What a CPU plan says about speed]
    ``Candidate.samples_per_second`` is a roofline bound on the GPU the step is costed on
    (fxmem/cost/roofline.py); fxmem models no CPU's speed. The search ranks a CPU plan's candidates
    by that bound all the same (the work per sample: FLOPs recomputed, bytes moved), so on a CPU
    target the table and the emitted module keep the order but show no samples/s, the order is
    labelled for what it is, and the JSON's ``samples_per_second`` and ``step_seconds`` are null.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap
from collections.abc import Iterable
from typing import Any

from tabulate import tabulate

from fxmem.errors import InputSpecError
from fxmem.output.render import format_bytes, format_flops
from fxmem.planner.checkpoint import CheckpointPlan
from fxmem.planner.emit import emit_source
from fxmem.planner.search import Candidate, Config, Plan

__all__ = ["emit_plan", "plan_json", "plan_table"]

_CPU_ORDER = "Listed in the planner's order, least work per sample first (FLOPs, bytes moved); fxmem predicts no speed on a CPU."
"""See Note [What a CPU plan says about speed]."""


def plan_table(plan: Plan) -> str:
    """The fitting configurations in the planner's order (fastest first on a GPU), then the verdict (or
    the closest, its shortfall and what a lever outside ``allow`` would unlock), and what was skipped."""
    on_gpu = plan.target == "cuda"
    head = f"Plan for {plan.model} on {plan.where} ({_budget(plan)})"
    head += f", global batch {plan.global_batch}" if plan.global_batch else ""
    parts = [head + ":", ""]
    if plan.fitting:
        headers = ["#", "configuration", "micro-batch x accumulation"]
        headers += ["GPU total", "peak", "recomputed", "samples/s (roofline)"] if on_gpu else ["peak", "recomputed"]
        rows = [_row(rank, c, on_gpu) for rank, c in enumerate(plan.fitting, start=1)]
        parts += [tabulate(rows, headers=headers, disable_numparse=True), ""]
        parts += [] if on_gpu else [_CPU_ORDER]
    parts.append(plan.verdict())
    parts += [f"Not evaluated: {why}" for why in plan.skipped]
    return "\n".join(parts) + "\n"


def _budget(plan: Plan) -> str:
    if plan.target == "cuda":
        return f"{format_bytes(plan.memory)} each"
    return f"{format_bytes(plan.memory)} per process, {plan.gpus} processes" if plan.gpus > 1 else f"{format_bytes(plan.memory)} budget"


def _row(rank: int, c: Candidate, on_gpu: bool) -> list[str]:
    sizes = [format_bytes(c.total), format_bytes(c.peak)] if on_gpu else [format_bytes(c.peak)]
    speed = [f"{c.samples_per_second:,.0f}"] if on_gpu else []
    return [str(rank), _configuration(c), f"{c.micro_batch} x {c.accumulation}", *sizes, _recomputed(c), *speed]


def _configuration(c: Candidate) -> str:
    return f"recipe {c.recipe}: {c.config.describe()}" if c.recipe else c.config.describe()


def _checkpointed(checkpoint: CheckpointPlan | None) -> tuple[str, ...]:
    return tuple(b.fqn for b in checkpoint.blocks if b.checkpointed) if checkpoint is not None else ()


def _recomputed(c: Candidate) -> str:
    """What backward reruns: its FLOPs; "elementwise only" where a checkpoint keeps every op with FLOPs
    (torch.utils.flop_counter counts none for elementwise ops, norms and views); "-" where nothing is checkpointed."""
    if c.recompute_flops:
        return format_flops(c.recompute_flops)
    return "elementwise only" if _checkpointed(c.config.checkpoint) else "-"


def plan_json(plan: Plan) -> dict[str, Any]:
    """The plan as plain dicts, lists, strings and numbers (``fxmem plan --format json``). Byte counts are
    exact integers, FLOPs too; a key that does not apply holds None rather than being left out.

    Top-level keys: ``model``, ``target`` ("cuda" or "cpu"), ``gpu`` (the GPU's name; None on the CPU),
    ``gpus`` (GPUs, or processes on the CPU), ``where`` (the table's words for them), ``memory`` (the
    budget per GPU or process, bytes), ``global_batch`` (None: the largest micro-batch, no accumulation),
    ``ranking`` (what the order of ``fitting`` means), ``fitting`` (candidates in the table's order:
    the table's # is the index + 1), ``best`` (``fitting[0]`` or None), ``closest`` (where nothing fits,
    the candidate with the smallest total at micro-batch 1, else None), ``unlocks`` (``{"lever",
    "candidate"}``: a lever outside ``allow`` and the fitting candidate it gives), ``skipped`` (one
    string per configuration not evaluated, with why), ``evaluated`` (``{"config", "outcome",
    "seconds"}`` per configuration considered, in order), ``verdict`` (the table's verdict line).

    A candidate: ``configuration`` (the table's words, recipe included), ``recipe`` (a published
    recipe's name, else None), ``config`` (the levers: ``precision``, ``amp``, ``optimizer``,
    ``optimizer_impl``, ``fsdp``, ``units``, ``tp``, ``tp_plan`` (module path -> style),
    ``data_parallel``, ``offload``, ``checkpoint``), ``micro_batch``, ``accumulation``, ``global_batch``,
    ``total`` (bytes the device holds: nvidia-smi's view on a GPU, the step's peak on the CPU), ``peak``
    (the step's live tensors), ``state`` (weights, gradients, optimizer state), ``recompute_flops``,
    ``recomputed`` (the table's column), ``step_seconds`` and ``samples_per_second`` (the GPU roofline
    bound; None on the CPU, Note [What a CPU plan says about speed]). ``checkpoint`` is None or
    ``{"checkpointed", "blocks", "batch", "budget", "saved", "unplanned", "recompute_flops"}``: the
    checkpointed blocks' module paths, how many blocks there are, and the chooser's bytes at its batch.
    """
    on_gpu = plan.target == "cuda"
    fitting = [_candidate_json(c, on_gpu) for c in plan.fitting]
    return {
        "model": plan.model,
        "target": plan.target,
        "gpu": plan.gpu if on_gpu else None,
        "gpus": plan.gpus,
        "where": plan.where,
        "memory": plan.memory,
        "global_batch": plan.global_batch,
        "ranking": "roofline samples/s on the GPU, fastest first" if on_gpu else _CPU_ORDER,
        "fitting": fitting,
        "best": fitting[0] if fitting else None,
        "closest": _candidate_json(plan.closest, on_gpu) if plan.closest is not None else None,
        "unlocks": [{"lever": u.lever, "candidate": _candidate_json(u.candidate, on_gpu)} for u in plan.unlocks],
        "skipped": list(plan.skipped),
        "evaluated": [{"config": e.config, "outcome": e.outcome, "seconds": e.seconds} for e in plan.evaluated],
        "verdict": plan.verdict(),
    }


def _candidate_json(c: Candidate, on_gpu: bool) -> dict[str, Any]:
    return {
        "configuration": _configuration(c),
        "recipe": c.recipe or None,
        "config": {f.name: _config_value(f.name, getattr(c.config, f.name)) for f in dataclasses.fields(Config)},
        "micro_batch": c.micro_batch,
        "accumulation": c.accumulation,
        "global_batch": c.global_batch,
        "total": c.total,
        "peak": c.peak,
        "state": c.state,
        "recompute_flops": c.recompute_flops,
        "recomputed": _recomputed(c),
        "step_seconds": c.step_seconds if on_gpu else None,
        "samples_per_second": c.samples_per_second if on_gpu else None,
    }


def _config_value(name: str, value: Any) -> Any:
    """A ``Config`` field as JSON: a checkpoint as its summary, ``tp_plan`` as a dict, tuples as lists."""
    if isinstance(value, CheckpointPlan):
        return {
            "checkpointed": list(_checkpointed(value)),
            "blocks": len(value.blocks),
            "batch": value.batch,
            "budget": value.budget,
            "saved": value.saved_at_batch,
            "unplanned": value.unplanned.at(value.batch),
            "recompute_flops": value.recompute_flops,
        }
    if name == "tp_plan":
        return dict(value)
    if isinstance(value, tuple):
        return list(value)
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


# --- the emitted module ----------------------------------------------------------------------------

_MODULE = '''\
"""{summary}

Use it from your training script{launch}:

    from plan import apply_plan, device, make_optimizer, train_step   # this file

    model = apply_plan(model)          # before make_optimizer
    optimizer = make_optimizer(model)
    for batches in loader:             # ACCUMULATION (inputs, target) pairs of MICRO_BATCH samples, on device()
        train_step(model, optimizer, batches, loss_fn)

Run this file (python plan.py) to print this text.
"""

import contextlib
import os

import torch

DEVICE = "{device}"
"""Where the plan runs: {where}."""
AMP = {amp}
"""The autocast dtype of the forward and the loss (None: no autocast)."""
MICRO_BATCH = {micro}
ACCUMULATION = {accumulation}
PROCESSES = {processes}
"""{processes_doc}"""
PREDICTED = {predicted}
"""fxmem's prediction in bytes, per process: {predicted_doc}, and the budget it was planned for."""


def device():
{device_body}


def apply_plan(model):
    """{apply_doc}"""
{apply}
    return model


def make_optimizer(model):
    """The optimizer and implementation the plan was simulated with."""
    return {optimizer}


def train_step(model, optimizer, batches, loss_fn):
    """One optimizer step over ``batches``: ACCUMULATION (inputs, target) pairs of MICRO_BATCH samples."""
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    for i, (inputs, target) in enumerate(batches):
        last = i == ACCUMULATION - 1
        with model.no_sync() if ddp and not last else contextlib.nullcontext():  # DDP all-reduces once per step
            with torch.autocast(DEVICE, dtype=AMP) if AMP is not None else contextlib.nullcontext():
                loss = loss_fn(model(inputs), target) / ACCUMULATION
            loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
{checkpointing}

if __name__ == "__main__":
    name = os.path.splitext(os.path.basename(__file__))[0]
    print(__doc__.replace("from plan import", f"from {{name}} import").replace("python plan.py", f"python {{name}}.py"))
'''


def emit_plan(plan: Plan, candidate: Candidate | None = None) -> str:
    """A Python module that applies ``candidate`` (default the plan's best), worded for its target: ``apply_plan(model)``
    (checkpointing, then tensor parallel, FSDP2 or DistributedDataParallel, as torchtitan orders them),
    ``make_optimizer(model)``, ``train_step(...)`` (autocast, gradient accumulation), and a ``__main__``
    that prints what it applies, the predicted memory and how to use it."""
    c = candidate or plan.best
    if c is None:
        raise InputSpecError(f"model '{plan.model}': nothing fits, so there is no configuration to emit; see the plan's closest one.")
    config, processes, target = c.config, _processes(c.config), plan.target
    checkpointing = "\n\n# Activation checkpointing, as fxmem chose it:\n" + emit_source(config.checkpoint) if config.checkpoint else ""
    return _MODULE.format(
        summary=_summary(plan, c), launch=_launch(target, processes), device=target, where=_TARGET_WORDS[target],
        amp={"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(config.amp or "", "None"),
        micro=c.micro_batch, accumulation=c.accumulation, processes=processes,
        processes_doc="One plain python process." if processes == 1 else f"Processes, as torchrun --nproc-per-node {processes} starts them.",
        predicted=json.dumps({"peak": c.peak, "total": c.total, "budget": plan.memory}), predicted_doc=_PREDICTED_DOC[target],
        device_body=_device_body(target, processes), apply_doc=_apply_doc(config, target, processes), apply=_apply_lines(config, target),
        optimizer=_optimizer_call(config.optimizer, config.optimizer_impl), checkpointing=checkpointing,
    )  # fmt: skip


_TARGET_WORDS = {"cuda": "a GPU per process", "cpu": "this machine's CPU"}
_PREDICTED_DOC = {
    "cuda": "the step's peak of live tensors, the GPU's total (nvidia-smi's view)",
    "cpu": "the step's peak of live tensors, all it holds",
}


def _device_body(target: str, processes: int) -> str:
    """The body of the emitted ``device()``."""
    if target == "cpu":
        return '    """This machine\'s CPU."""\n    return torch.device("cpu")'
    if processes == 1:
        return '    """The GPU."""\n    return torch.device("cuda")'
    return '    """This process\'s GPU: its torchrun LOCAL_RANK\'s."""\n    return torch.device("cuda", int(os.environ["LOCAL_RANK"]))'


def _processes(config: Config) -> int:
    """One per GPU (or CPU rank): FSDP2's data-parallel ranks times tensor parallel's, or plain data parallel's replicas."""
    return max(config.fsdp, config.data_parallel) * config.tp


def _summary(plan: Plan, c: Candidate) -> str:
    """The module docstring's opening: the setup, its batch, its predicted memory, and what each function does."""
    config, processes, on_gpu = c.config, _processes(c.config), plan.target == "cuda"
    where = (f"{processes} x {plan.gpu}" if processes > 1 else f"one {plan.gpu} GPU") if on_gpu else "this machine's CPU"
    rows = [("configuration", config.describe())] + ([("recipe", c.recipe)] if c.recipe else [])
    rows += [
        ("batch", f"micro-batch {c.micro_batch} x {_plural(c.accumulation, 'accumulation step')} = {_plural(c.global_batch, 'sample')} "
         "per optimizer step" + (f" over {config.data_parallel} replicas" if config.data_parallel > 1 else "")),
        ("predicted", _predicted(plan, c, processes)),
    ]  # fmt: skip
    doing = [
        ("apply_plan(model)", "; ".join(_applies(config, plan.target))),
        ("make_optimizer(model)", _optimizer_call(config.optimizer, config.optimizer_impl)),
        ("train_step(...)", _step_words(config, plan.target, c.accumulation)),
    ]
    lines = [f"The training setup fxmem plan chose for {plan.model} on {where}.", ""]
    lines += [_wrapped(k, v, 18) for k, v in rows] + ["", "What it applies:"] + [_wrapped(k, v, 25) for k, v in doing]
    return "\n".join(lines)


def _wrapped(key: str, value: str, width: int) -> str:
    """``key`` then ``value`` in a column from ``width``, wrapped at 100 characters."""
    return textwrap.fill(value, 100, initial_indent=f"  {key}".ljust(width), subsequent_indent=" " * width, break_on_hyphens=False)


def _plural(n: int, word: str, words: str = "") -> str:
    return f"{n} {word}" if n == 1 else f"{n} {words or word + 's'}"


def _predicted(plan: Plan, c: Candidate, processes: int) -> str:
    each = f" on each of the {processes} GPUs" if processes > 1 else ""
    if plan.target == "cuda":
        return (
            f"{format_bytes(c.total)} of GPU memory{each} (nvidia-smi's view: the step's tensors, peaking at {format_bytes(c.peak)}, "
            f"the caching allocator's slack, the CUDA context and libraries), of {format_bytes(plan.memory)}"
        )
    each = f" in each of the {processes} processes" if processes > 1 else ""
    return f"the step's tensors peak at {format_bytes(c.peak)}{each}, within the {format_bytes(plan.memory)} budget"


def _launch(target: str, processes: int) -> str:
    if processes == 1:
        return ", run with plain python (one GPU)" if target == "cuda" else ", run with plain python (one process on this machine's CPU)"
    each = "one per GPU" if target == "cuda" else "on this machine's CPU, gloo"
    return f", launched as {processes} processes ({each}) with\n\n    torchrun --nproc-per-node {processes} train.py\n\nwhere train.py does"


def _apply_doc(config: Config, target: str, processes: int) -> str:
    done = "; ".join(_applies(config, target))
    done = done[0].upper() + done[1:] + (f"; in each of the {processes} processes torchrun starts." if processes > 1 else ".")
    filled = textwrap.fill(done, 100, subsequent_indent="    ", break_on_hyphens=False)
    return filled + "\n    " if "\n" in filled else filled


def _applies(config: Config, target: str) -> list[str]:
    """``apply_plan``'s steps in words, in its order."""
    unit = "GPUs" if target == "cuda" else "CPU processes"
    words = [_checkpoint_words(config.checkpoint)] if config.checkpoint is not None else []
    if config.tp > 1:
        words.append(f"tensor parallel over {config.tp} {unit} (the model's plan, parallelize_module)")
    if config.fsdp > 1:
        policies = ["bf16 MixedPrecisionPolicy" if config.precision == "mixed" else "MixedPrecisionPolicy() in the weights' dtype"]
        policies += ["CPUOffloadPolicy: sharded state in host memory, optimizer step on the CPU"] if config.offload else []
        words.append(f"FSDP2 over {config.fsdp} {unit}: fully_shard on {len(config.units)} blocks, then the root ({', '.join(policies)})")
    elif config.tp == 1 and config.data_parallel > 1:
        words.append(f"DistributedDataParallel over {config.data_parallel} {unit}")
    elif config.tp == 1 and target == "cuda":
        words.append("moves the model to the GPU")
    if config.compile:
        budget = f", the partitioner's activation_memory_budget {config.budget:g}" if config.budget != 1.0 else ""
        words.append(f"torch.compile(model) in default mode{budget}")
    return words or ["nothing: the model trains as it is"]


def _checkpoint_words(checkpoint: CheckpointPlan) -> str:
    names = _checkpointed(checkpoint)
    shown = ", ".join(names) if len(names) <= 4 else f"{names[0]} ... {names[-1]}"
    rerun = (
        f"backward recomputes {format_flops(checkpoint.recompute_flops)}"
        if checkpoint.recompute_flops
        else "backward reruns only ops without FLOPs, elementwise ones, norms and views (every matmul's output is kept)"
    )
    return f"selective activation checkpointing of {len(names)} of {len(checkpoint.blocks)} blocks ({shown}): {rerun}"


def _step_words(config: Config, target: str, accumulation: int) -> str:
    amp = f"under {config.amp} autocast" if config.amp else "in the weights' dtype"
    amp = "in bf16 (FSDP2's MixedPrecisionPolicy)" if config.precision == "mixed" and config.fsdp > 1 else amp
    sync = "; DDP all-reduces once per optimizer step" if config.data_parallel > 1 and config.fsdp == 1 and config.tp == 1 else ""
    steps = _plural(accumulation, "micro-batch", "micro-batches")
    return f"the forward and the loss {amp} on the {'GPU' if target == 'cuda' else 'CPU'}; {steps} per optimizer step{sync}"


def _apply_lines(config: Config, target: str) -> str:
    """The body of ``apply_plan``: the calls a training script makes for ``config`` on ``target``, its imports first."""
    imports: list[str] = []
    body = ["apply_checkpointing(model)"] if config.checkpoint else []
    if config.fsdp > 1 or config.tp > 1 or config.data_parallel > 1:
        imports.append("import torch.distributed as dist")
        body += ["torch.cuda.set_device(device())"] if target == "cuda" else []
        body += ["if not dist.is_initialized():", f'    dist.init_process_group("{"nccl" if target == "cuda" else "gloo"}")']
    if config.fsdp > 1 or config.tp > 1:
        dims = [(name, size) for name, size in (("dp", config.fsdp), ("tp", config.tp)) if size > 1]
        imports.append("from torch.distributed.device_mesh import init_device_mesh")
        shape, names = _tuple(str(s) for _, s in dims), _tuple(json.dumps(n) for n, _ in dims)
        body.append(f'mesh = init_device_mesh("{target}", {shape}, mesh_dim_names={names})')
        _add_tp(config, imports, body)
        _add_fsdp(config, imports, body)
    elif config.data_parallel > 1:
        imports.append("from torch.nn.parallel import DistributedDataParallel")
        on_gpu = "model.to(device()), device_ids=[device().index]" if target == "cuda" else "model"
        body.append(f"model = DistributedDataParallel({on_gpu})")
    elif target == "cuda":
        body.append("model = model.to(device())")
    if config.compile:
        body += [f"torch._functorch.config.activation_memory_budget = {config.budget:g}"] if config.budget != 1.0 else []
        body.append("model = torch.compile(model)")
    lines = [*imports, ""] if imports else []
    return "\n".join(f"    {line}" if line else "" for line in lines + body) or "    pass  # nothing to change in the model"


def _tuple(items: Iterable[str]) -> str:
    """Python source for a tuple of the items' source: "(4,)", "(2, 2)"."""
    shown = list(items)
    return f"({shown[0]},)" if len(shown) == 1 else f"({', '.join(shown)})"


def _mesh_dim(config: Config, name: str) -> str:
    """A 2-D mesh's dimension by name; a 1-D mesh is that dimension."""
    return f'mesh["{name}"]' if config.fsdp > 1 and config.tp > 1 else "mesh"


_TP_STYLES = {
    "colwise": "ColwiseParallel()",
    "rowwise": "RowwiseParallel()",
    "colwise_gather_output": "ColwiseParallel(output_layouts=Replicate())",
    "embedding_rowwise": "RowwiseParallel(input_layouts=Replicate())",
}
"""Tensor parallel's styles (fxmem/parallel) as torch.distributed.tensor.parallel spells them."""


def _add_tp(config: Config, imports: list[str], body: list[str]) -> None:
    if config.tp == 1:
        return
    styles = [(path, _TP_STYLES[style]) for path, style in config.tp_plan]  # its fnmatch-style * patterns, as parallelize_module takes them
    imports += ["from torch.distributed.tensor import Replicate"] if any("Replicate" in s for _, s in styles) else []
    imports.append("from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module")
    body += [f"parallelize_module(model, {_mesh_dim(config, 'tp')}, {{", *(f"    {json.dumps(path)}: {s}," for path, s in styles), "})"]


def _add_fsdp(config: Config, imports: list[str], body: list[str]) -> None:
    if config.fsdp == 1:
        return
    mixed = config.precision == "mixed"
    mp = "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" if mixed else "MixedPrecisionPolicy()"
    options = f"mesh={_mesh_dim(config, 'dp')}, mp_policy={mp}" + (", offload_policy=CPUOffloadPolicy()" if config.offload else "")
    imports.append(f"from torch.distributed.fsdp import {'CPUOffloadPolicy, ' if config.offload else ''}MixedPrecisionPolicy, fully_shard")
    body += [
        f"for unit in {json.dumps(list(config.units))}:",
        f"    fully_shard(model.get_submodule(unit), {options})",
        f"fully_shard(model, {options})",
    ]


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
