"""The command line: ``fxmem analyze``, ``measure``, ``timeline``, ``plan``, ``zoo``. The only module that prints.

Every mistake a user can make ends the same way: one line on stderr starting ``fxmem: error:``, exit
status 2, no traceback. That covers FxmemError from the library and argparse's own usage errors (a
mistyped option or command names the nearest one, ``_parse``). Ctrl-C exits 130 with one line. Any
other exception is a bug in fxmem and shows its traceback (exit 1). Stages that run long show progress
on stderr; see ``_Progress``. torch's own log lines and warnings are held back unless ``-v``; fxmem's
notes always show (``_run``).

Note [A parser without torch]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``fxmem --help``, ``--version`` and a usage error need only the parser, while importing torch and the
engine takes seconds (benchmarks/cli_speed.py measures both). So this module imports at its top only
what the parser needs: fxmem.choices (copies of the registries' names, which tests/test_cli.py holds
equal to the registries) and fxmem.errors; ``import fxmem`` itself is lazy (fxmem/__init__.py). The
names the commands use (``_ENGINE``) are bound into this module's globals by ``_load_engine`` when a
command starts; before that, ``cli.analyze`` resolves through the module's ``__getattr__``, so that a
test can patch it as before. mypy reads them from the TYPE_CHECKING block.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import importlib
import json
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from fxmem import __version__
from fxmem.choices import (
    AMP_DTYPES,
    BF16_WEIGHT_RECIPES,
    BN_THRESHOLD,
    DEFAULT_GPU,
    DEFAULT_LEVERS,
    FORMATS,
    FRONTENDS,
    GPUS,
    IMPLS,
    LEVERS,
    LOSSES,
    MAX_ROWS,
    OPTIMIZERS,
    RECIPES,
    SCHEDULES,
    SHARDS,
    TARGETS,
    ZERO_GRAD_PLACES,
)
from fxmem.errors import FxmemError, FxmemWarning, InputSpecError

if TYPE_CHECKING:
    import torch
    from tabulate import tabulate

    from fxmem.api import analyze
    from fxmem.frontends.adapters import LoraOptions
    from fxmem.frontends.load import load_leaf_types, load_model
    from fxmem.inputs import Constant, has_seq, looks_like_shape, parse_dtype, parse_inputs, parse_size
    from fxmem.measure import PeakMeasurement, materialize, measure, measure_peak
    from fxmem.measure_ranks import measure_ranks
    from fxmem.output.pipeline import render_pipeline
    from fxmem.output.render import format_bytes, render, render_timeline
    from fxmem.parallel import default_tp_plan
    from fxmem.report import Report
    from fxmem.results import ModelSpec, Peak
    from fxmem.step.state import get_optimizer

__all__ = ["main"]

_ENGINE: dict[str, tuple[str, str | None]] = {
    "torch": ("torch", None),
    "tabulate": ("tabulate", "tabulate"),
    "analyze": ("fxmem.api", "analyze"),
    "LoraOptions": ("fxmem.frontends.adapters", "LoraOptions"),
    "load_leaf_types": ("fxmem.frontends.load", "load_leaf_types"),
    "load_model": ("fxmem.frontends.load", "load_model"),
    "Constant": ("fxmem.inputs", "Constant"),
    "has_seq": ("fxmem.inputs", "has_seq"),
    "looks_like_shape": ("fxmem.inputs", "looks_like_shape"),
    "parse_dtype": ("fxmem.inputs", "parse_dtype"),
    "parse_inputs": ("fxmem.inputs", "parse_inputs"),
    "parse_size": ("fxmem.inputs", "parse_size"),
    "materialize": ("fxmem.measure", "materialize"),
    "measure": ("fxmem.measure", "measure"),
    "measure_peak": ("fxmem.measure", "measure_peak"),
    "measure_ranks": ("fxmem.measure_ranks", "measure_ranks"),
    "render_pipeline": ("fxmem.output.pipeline", "render_pipeline"),
    "format_bytes": ("fxmem.output.render", "format_bytes"),
    "render": ("fxmem.output.render", "render"),
    "render_timeline": ("fxmem.output.render", "render_timeline"),
    "default_tp_plan": ("fxmem.parallel", "default_tp_plan"),
    "ModelSpec": ("fxmem.results", "ModelSpec"),
    "get_optimizer": ("fxmem.step.state", "get_optimizer"),
}
"""The names the commands use, each (module, attribute; None for the module itself), bound on first use
(Note [A parser without torch])."""


def _engine_name(name: str) -> Any:
    module, attribute = _ENGINE[name]
    imported = importlib.import_module(module)
    return imported if attribute is None else getattr(imported, attribute)


def _load_engine() -> None:
    """Bind every name of ``_ENGINE`` not bound yet (one a test patched stays patched)."""
    for name in _ENGINE:
        if name not in globals():
            globals()[name] = _engine_name(name)


def __getattr__(name: str) -> Any:
    """``cli.analyze`` and the other ``_ENGINE`` names before a command has bound them (PEP 562)."""
    if name not in _ENGINE:
        raise AttributeError(f"module '{__name__}' has no attribute '{name}'")
    value = globals()[name] = _engine_name(name)
    return value


_SECURITY = (
    "Security: a package.module:factory or path/to/file.py:factory spec imports and RUNS that code with your "
    "permissions, exactly as 'python file.py' would, so load only code you trust. fxmem itself never loads "
    "weights or unpickles anything: models are built on the meta device."
)
_SPEC_HELP = (
    "zoo:NAME (see 'fxmem zoo'; zoo:NAME:test for its small config), hf:NAME or hf:path/config.json "
    "(Hugging Face, from the config alone), torchvision:NAME, timm:NAME, package.module:factory, or path/to/file.py:factory"
)
_LEAF_HELP = (
    "keep modules of this class opaque (one node) when tracing: a class name from the model or torch.nn "
    "(e.g. MultiheadAttention), or package.module:ClassName; repeat for several"
)
_SLOW_S = 2.0
"""A stage that runs longer than this gets a progress line on stderr even when stderr is not a terminal."""


class _UsageError(Exception):
    """An argparse error, raised instead of argparse's usage dump so that main prints one line."""

    def __init__(self, message: str, prog: str) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _UsageError(message, self.prog)


def _whole_number(minimum: int, below: str) -> Callable[[str], int]:
    """An argparse type: an int of at least ``minimum``, with ``below`` saying what a smaller one means."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"'{value}' {below}")
        return value

    return parse


_positive_int = _whole_number(1, "is not a positive integer; it must be 1 or more")
_depth_number = _whole_number(0, "is negative; 0 groups everything into one row, 1 by top-level module, 'all' lists every module path")


def _depth(text: str) -> int | str:
    """--depth: 'all' (every module path in full) or a whole number of path components; not given, the
    table's depth is chosen to fit a screen (render.choose_depth) and JSON and CSV list every path."""
    if text == "all":
        return "all"
    if not text.lstrip("+-").isdigit():
        raise argparse.ArgumentTypeError(
            f"'{text}' is neither a whole number nor 'all'; e.g. --depth 2, or --depth all for every module path"
        )
    return _depth_number(text)


@dataclass(frozen=True)
class _Groups:
    """A command's options in the order its --help lists them, the common ones first (issue 36): the
    model and its inputs; the batch, the device and the verdict; the training setup; parallelism; the rest."""

    model: Any
    verdict: Any
    training: Any
    parallel: Any
    advanced: Any

    @classmethod
    def of(cls, p: argparse.ArgumentParser, verdict: str = "batch, device and verdict", training: str = "training setup") -> _Groups:
        titles = ("model and inputs", verdict, training, "parallelism", "advanced")
        return cls(*(p.add_argument_group(title) for title in titles))


def _model_options(g: _Groups) -> None:
    m = g.model
    m.add_argument("spec", help=f"the model: {_SPEC_HELP}")
    m.add_argument("--input", action="append", metavar="SHAPE", help="an input shape with B on the batch axis, e.g. B,3,224,224 or input_ids=B,1024:int64; repeat for several inputs (default: the model's own)")
    m.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE", help="a forward() keyword argument that is not a tensor, passed through unchanged: a JSON or Python literal (true, 0.5, null, [1, 2]), else a string, e.g. --arg return_loss=true; repeat for several")
    m.add_argument("--loss", choices=LOSSES, help="the loss of the step (default: the model's own, else sum)")
    m.add_argument("--seq-len", type=_positive_int, metavar="S", help="the length a symbolic sequence axis S (--input B,S:int64) is evaluated at; for hf: specs also the length of the default inputs (default: the config's context, at most 2048)")
    m.add_argument("--config", nargs="+", default=[], metavar="KEY=VALUE", help="hf: specs: config overrides, e.g. --config n_layer=4 hidden_size=256")
    m.add_argument("--grad-checkpointing", "--checkpoint", dest="checkpoint", action="store_true", help="hf: specs: turn on transformers' activation checkpointing as model.gradient_checkpointing_enable() does (every layer, non-reentrant; the embeddings' output made to require grad, so a frozen base passes gradients to an adapter)")
    m.add_argument("--lora", metavar="r=R,alpha=A,targets=M1,M2[,dropout=P]", help="add a LoRA adapter with peft (pip install peft) as get_peft_model does: rank r, alpha, the target modules by name (or all-linear; default peft's for the model type), dropout; the base is frozen, and with --precision bf16 on an hf: spec it is built in bf16 while the adapter stays fp32, as peft keeps it. E.g. --lora r=16,alpha=32,targets=q_proj,v_proj")
    g.advanced.add_argument("--frontend", choices=FRONTENDS, default="auto", help="how to get the graph: torch.fx, torch.export, or fx then export (default auto)")
    g.advanced.add_argument("--leaf", action="append", default=[], metavar="MODULE_TYPE", help=_LEAF_HELP)


def _gpu_help(target: str | None) -> tuple[str, str]:
    default = f"default {target}" if target else "default cuda where this machine has a GPU, else cpu"
    target_help = f"the device the step runs on ({default}): cuda predicts what the GPU keeps (its kernels, caching allocator and fixed costs); cpu is what 'fxmem measure' checks exactly"
    gpu_help = f"with --target cuda: the GPU, one of {', '.join(GPUS)} (default {DEFAULT_GPU}); or any other, described from its datasheet as KEY=VALUE pairs, e.g. --gpu memory=12GiB,cc=8.6,bandwidth=360GB/s,fp32=12.7,fp16=51: memory (best the total nvidia-smi shows), cc (compute capability), bandwidth (GB/s or TB/s) and fp32 required; tf32, bf16, fp16, fp8 and label optional; rates in dense TFLOPS (half a datasheet's 'with sparsity' figure)"
    return target_help, gpu_help


def _setup_options(g: _Groups, target: str | None = "cuda") -> None:
    """Where and how the step runs: GPU and target device, autocast, precision, parallelism, CUDA's settings.
    ``target`` None: cuda where this machine has a GPU, else cpu (``measure``; resolved in ``_run``)."""
    target_help, gpu_help = _gpu_help(target)
    g.verdict.add_argument("--gpu", default=DEFAULT_GPU, metavar="NAME", help=gpu_help)
    g.verdict.add_argument("--target", choices=TARGETS, default=target, help=target_help)
    t = g.training
    t.add_argument("--amp", choices=AMP_DTYPES, help="run the forward and the loss under autocast in this dtype, with the target's cast policy")
    t.add_argument("--precision", choices=list(RECIPES), metavar="RECIPE", help=f"how the state is held: {'; '.join(f'{k}: {summary}' for k, summary in RECIPES.items())} (default amp with --amp, else fp32). Recipes with bf16 weights ({', '.join(BF16_WEIGHT_RECIPES)}) also change what the step computes: the forward runs with the weights in bfloat16, as after model.to(torch.bfloat16), and float32 --input is fed as bfloat16; fp32 and amp keep the model's own weights")
    t.add_argument("--optimizer-impl", choices=IMPLS, help="the optimizer's implementation (default: what torch picks on the target: foreach on CUDA, for-loop on the CPU)")
    _loop_options(t)
    _parallel_options(g.parallel)
    a = g.advanced
    a.add_argument("--torch-version", metavar="X.Y", help="with --target cuda: the torch release the training job runs, where kernel choices changed between releases (SDPA's backend, cuBLASLt's workspace); default: the one fxmem runs with")
    a.add_argument("--overhead", action="append", default=[], metavar="NAME=SIZE", help="override a fixed CUDA cost, e.g. --overhead cuda_context=600MiB; see the report's device lines for the names")
    a.add_argument("--alloc-conf", default="", metavar="CONF", help="with --target cuda: PYTORCH_CUDA_ALLOC_CONF as your job sets it, e.g. expandable_segments:True or max_split_size_mb:512,garbage_collection_threshold:0.6 (default: torch's defaults); the step is replayed through the caching allocator so set up")
    a.add_argument("--memory-fraction", type=float, metavar="F", help="with --target cuda: torch.cuda.set_per_process_memory_fraction(F) as your job calls it: reserved memory may not pass F x the device's memory")


def _loop_options(t: Any) -> None:
    """The training loop around the step: what it does beyond forward, loss, backward and optimizer.step()."""
    t.add_argument("--clip-grad-norm", type=float, metavar="MAX", help="the loop clips the gradients between loss.backward() and optimizer.step() with torch.nn.utils.clip_grad_norm_(model.parameters(), MAX); the step then also holds the per-gradient norms and the clip factor it computes (default: no clipping)")
    t.add_argument("--zero-grad", choices=ZERO_GRAD_PLACES, default=ZERO_GRAD_PLACES[0], help="where the loop calls optimizer.zero_grad(): after-step, after optimizer.step() (the default: the gradients are freed before the next forward), or before-backward, after the loss and just before loss.backward() (the last step's gradients then stay alive through the next forward)")
    t.add_argument("--keep-outputs", action="store_true", help="the loop keeps each step's output and loss until the next step's replace them, as 'for x in data: out = model(x); loss = loss_fn(out, y)' does: the last step's output (an LLM's logits, batch x sequence x vocabulary) stays alive through the next forward (default: dropped at the end of each step)")


def _parallel_options(p: Any) -> None:
    p.add_argument("--world-size", type=_positive_int, default=1, metavar="N", help="GPUs training together (data parallel); --batch is then the per-GPU micro-batch")
    p.add_argument("--shard", choices=SHARDS, default="none", help="how state is divided across the N GPUs: DeepSpeed ZeRO stage 1/2/3 or PyTorch FSDP (full shard)")
    p.add_argument("--fsdp", type=_positive_int, default=1, metavar="N", help="simulate one rank of FSDP2 over N ranks: fully_shard itself runs on a fake process group (each repeated block a unit, then the root); --batch is the rank's micro-batch. The same as --world-size N --shard fsdp")
    p.add_argument("--offload", action="store_true", help="with --fsdp: FSDP2's CPUOffloadPolicy, the sharded weights, gradients and optimizer state in host memory (the GPU holds the gathered weights, activations and transfer copies)")
    p.add_argument("--fsdp-unit", action="append", metavar="PATH", help="with --fsdp: a module fully_shard wraps as a unit (repeat for several; default each repeated block)")
    p.add_argument("--tp", type=_positive_int, default=1, metavar="T", help="simulate one rank of tensor parallel over T ranks: parallelize_module itself runs on a fake process group, with the model's own plan (a HF model's _tp_plan) or --tp-plan; with --fsdp N, one rank of an N x T mesh")
    p.add_argument("--tp-plan", action="append", metavar="PATH=STYLE", help="with --tp: give the module at PATH (* one path component, e.g. layers.*.mlp.up_proj) a style: colwise or rowwise (also colwise_gather_output, embedding_rowwise, and for sequence parallel sequence_parallel, sequence_parallel_gather_output, colwise_gather_input, rowwise_scatter_output, sequence_shard_input); repeat for each; default the model's own plan")
    p.add_argument("--sp", action="store_true", help="with --tp: sequence parallel, the model's own plan for it (the norms and the residual stream split along the sequence between the tensor-parallel layers)")
    p.add_argument("--pp", type=_positive_int, default=1, metavar="P", help="simulate every rank of pipeline parallel over P stages: the repeated blocks split into P contiguous stages (the embeddings on the first, the head and the loss on the last), torch's own schedule run on a fake process group; --batch is the microbatch; with --fsdp N and --tp T, each stage sharded by FSDP2 and tensor parallel too (P x N x T ranks)")
    p.add_argument("--microbatches", type=_positive_int, default=1, metavar="M", help="with --pp: microbatches per step (a step takes M x --batch samples)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="with --pp: torch's pipeline schedule (default 1f1b; interleaved runs --stages-per-rank stages per rank, ScheduleInterleaved1F1B)")
    p.add_argument("--stages-per-rank", type=_positive_int, default=None, metavar="V", help="with --pp and --schedule interleaved: stages on each rank, V x P in all (default 2)")
    p.add_argument("--pp-split", action="append", type=int, metavar="BLOCK", help="with --pp: the first block of each stage after the first (repeat P - 1 times, V x P - 1 with --schedule interleaved; default as even as the blocks allow)")


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    """analyze()'s training-setup keywords from the options of _setup_options."""
    overheads: dict[str, int] = {}
    for item in args.overhead:
        name, eq, size = item.partition("=")
        if not eq:
            raise InputSpecError(f"--overhead '{item}': write NAME=SIZE, e.g. --overhead cuda_context=600MiB.")
        overheads[name] = parse_size(size, f"--overhead {name}", allow_zero=True)
    return {
        "target": args.target, "gpu": args.gpu, "amp": args.amp, "precision": args.precision or "",
        "world_size": args.world_size, "shard": args.shard, "optimizer_impl": args.optimizer_impl, "overheads": overheads,
        "torch_version": args.torch_version, "fsdp": args.fsdp, "offload": args.offload, "fsdp_units": args.fsdp_unit, "tp": args.tp, "tp_plan": _tp_plan(args.tp_plan), "sp": args.sp,
        "pp": args.pp, "microbatches": args.microbatches, "schedule": args.schedule, "pp_splits": args.pp_split,
        "stages_per_rank": args.stages_per_rank, "alloc_conf": args.alloc_conf, "memory_fraction": args.memory_fraction,
        "clip_grad_norm": args.clip_grad_norm, "zero_grad": args.zero_grad, "keep_outputs": args.keep_outputs,
        "_flags": True,  # a note names the setting as its flag (--world-size), not as the API's field
    }  # fmt: skip


def _measured_tp_plan(args: argparse.Namespace, spec: ModelSpec) -> Mapping[str, str] | None:
    """The plan the real ranks apply: --tp-plan, or with --sp the model's sequence-parallel one."""
    if args.sp and not args.tp_plan:
        return default_tp_plan(spec.model, sequence_parallel=True, name=args.spec)
    return _tp_plan(args.tp_plan)


def _tp_plan(items: list[str] | None) -> dict[str, str] | None:
    """--tp-plan PATH=STYLE options as a plan (None: the model's own)."""
    if not items:
        return None
    plan = {}
    for item in items:
        path, eq, style = item.partition("=")
        if not eq or not path or not style:
            raise InputSpecError(f"--tp-plan '{item}': write PATH=STYLE, e.g. --tp-plan 'layers.*.mlp.up_proj=colwise'.")
        plan[path] = style
    return plan


def _version() -> str:
    """``fxmem --version``: read from the installed packages' metadata, so torch is named but not imported."""
    try:
        torch_version = f"torch {version('torch')}"
    except PackageNotFoundError:
        torch_version = "torch not installed"
    return f"fxmem {__version__} ({torch_version}, not imported)"


def _command(sub: Any, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand's parser, with -v/--verbose beside -h."""
    usage = "%(prog)s [-h] [-v]" if name == "zoo" else "%(prog)s [-h] [-v] spec [options]"  # the groups below list the options in order
    p: argparse.ArgumentParser = sub.add_parser(name, usage=usage, **kwargs)
    p.add_argument("-v", "--verbose", action="store_true", help="also show torch's own log lines and warnings, which fxmem otherwise holds back (its own notes always show)")
    return p


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fxmem", description="How much memory one training step of a PyTorch model needs, per layer, at every batch size.", epilog=_SECURITY)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _analyze_parser(sub)
    _measure_parser(sub)
    _timeline_parser(sub)
    _plan_parser(sub)
    _command(sub, "zoo", help="list the zoo's models with their parameters and default inputs")
    return parser


def _analyze_parser(sub: Any) -> None:
    a = _command(sub, "analyze", help="predict activations (a*B + c per layer), model state, totals and the batch that fits",
                 description="Predict the memory of one training step, from fake tensors: no weights, no data, no GPU.", epilog=_SECURITY)  # fmt: skip
    g = _Groups.of(a, verdict="batch, device, verdict and output")
    _model_options(g)
    g.verdict.add_argument("--batch", type=_positive_int, default=32, help="the batch size to evaluate at (default 32)")
    _setup_options(g)
    v = g.verdict
    v.add_argument("--device-memory", metavar="SIZE", help="device memory with its unit, e.g. 80GiB or 24GB (a bare number is an error): report the largest batch that fits")
    v.add_argument("--check", action="store_true", help=f"make the exit status the verdict, for scripts and CI: 0 when --batch fits the device, {EXIT_DOES_NOT_FIT} when it does not (2 stays an error)")
    v.add_argument("--format", choices=FORMATS, default="table", help="how the report is printed (default table); json keeps stdout pure JSON, notes going to stderr")
    v.add_argument("--depth", type=_depth, metavar="K|all", help=f"group layers by module path truncated to K components, or 'all' for every module path (default: the deepest grouping with at most {MAX_ROWS} rows, full paths with --top; JSON and CSV: every module path)")
    v.add_argument("--top", type=_positive_int, metavar="K", help="show only the K layers that hold the most activation memory")
    v.add_argument("--plot", metavar="FILE.png", help="also draw memory against batch size and the top layers (needs matplotlib: pip install 'fxmem[plot]')")
    v.add_argument("--html", metavar="FILE.html", help="also write the report as one self-contained web page (module tree, the step's memory over time, the batch trade-off); open it in any browser")
    g.training.add_argument("--optimizer", default="adamw", help=f"one of {', '.join(OPTIMIZERS)} (default adamw)")
    g.training.add_argument("--compile", action="store_true", help="also predict the step with torch.compile(model) (default mode): Inductor itself compiles the model on fake tensors at each batch asked, and the report shows what the compiled step saves, its peak and the largest batch beside eager's")
    g.training.add_argument("--activation-memory-budget", type=float, default=1.0, metavar="F", help="with --compile: torch._functorch.config.activation_memory_budget, what the partitioner may save, from 0.0 (what checkpointing the whole compiled region saves) to 1.0 (the default: its min-cut); lower recomputes more in backward")
    g.training.add_argument("--param-dtype", metavar="DTYPE", help="count weights, gradients and optimizer state in this dtype (e.g. bfloat16). Accounting only: the model-state lines change, but the step is simulated with the model's own weights (their dtype, the activations, the peak), so --input must match their dtype unless --amp casts it; --precision bf16 runs the step in bfloat16")
    g.advanced.add_argument("--strict", action="store_true", help="fail on a saved tensor whose size depends on the data, instead of counting it as 0 B and listing it")
    g.advanced.add_argument("--no-peak", action="store_true", help="skip simulating the whole step: faster, but the batch that fits is then judged on state + activations + inputs, without temporaries")
    g.advanced.add_argument("--bn-threshold", type=int, default=BN_THRESHOLD, metavar="N", help=f"warn about batch-norm statistics when the per-GPU batch (chosen, or the largest that fits) is under N (default {BN_THRESHOLD})")


def _measure_parser(sub: Any) -> None:
    m = _command(sub, "measure", help="run one real forward (or, with --peak, a whole step) on the CPU and print measured beside predicted",
                 description="Run the model for real on the CPU with random weights, and compare with the prediction. This "
                 "allocates the real weights and activations in RAM: use a small config such as zoo:NAME:test.", epilog=_SECURITY)  # fmt: skip
    g = _Groups.of(m, verdict="batch and device")
    _model_options(g)
    g.verdict.add_argument("--batch", type=_positive_int, default=2, help="the batch size of the real run (default 2)")
    g.verdict.add_argument("--peak", action="store_true", help="measure the peak of a whole real training step instead of the saved activations: with torch.profiler on the CPU, or torch.cuda.max_memory_allocated where CUDA is present")
    g.training.add_argument("--optimizer", default="adamw", help="with --peak: the optimizer of the step (default adamw)")
    g.training.add_argument("--first-step", action="store_true", help="with --peak: measure the first step, which creates the optimizer state (default: a steady step)")
    g.training.add_argument("--compile", action="store_true", help="run the model as torch.compile(model) (default mode, Inductor's C++ backend on the CPU; compiled before the measurement) and compare with the compiled step's prediction")
    g.training.add_argument("--activation-memory-budget", type=float, default=1.0, metavar="F", help="with --compile: the partitioner's activation_memory_budget, as torch._functorch.config sets it (default 1.0)")
    _setup_options(g, target=None)


def _timeline_parser(sub: Any) -> None:
    t = _command(sub, "timeline", help="simulate one training step and show its memory over time, phase by phase",
                 description="Simulate one training step on fake tensors and show its memory phase by phase: where it peaks and what is alive there.", epilog=_SECURITY)  # fmt: skip
    g = _Groups.of(t, verdict="batch, device and output")
    _model_options(g)
    g.verdict.add_argument("--batch", type=_positive_int, default=32, help="the batch size (default 32)")
    g.training.add_argument("--optimizer", default="adamw", help=f"one of {', '.join(OPTIMIZERS)} (default adamw)")
    g.training.add_argument("--first-step", action="store_true", help="the first step, which creates the optimizer state (default: a steady step)")
    _setup_options(g)
    g.verdict.add_argument("--plot", metavar="FILE.png", help="draw the memory over time by category (needs matplotlib: pip install 'fxmem[plot]')")


def _plan_parser(sub: Any) -> None:
    pl = _command(sub, "plan", help="search the levers (micro-batch, precision, optimizer implementation, checkpointing, sharding) for the fastest step that fits",
                  description="Find the training configurations whose step fits the GPU, fastest first, each simulated in full; or how far the closest falls short.", epilog=_SECURITY)  # fmt: skip
    g = _Groups.of(pl, verdict="GPUs and budget", training="the search and its output")
    _model_options(g)
    v = g.verdict
    v.add_argument("--gpu", default=DEFAULT_GPU, metavar="NAME", help=f"the GPU, one of {', '.join(GPUS)} (default {DEFAULT_GPU}); or any other described from its datasheet, e.g. --gpu memory=12GiB,cc=8.6,bandwidth=360GB/s,fp32=12.7,fp16=51 (the keys: see fxmem analyze --help)")
    v.add_argument("--target", choices=TARGETS, default="cuda", help="cuda (the GPU's kernels, allocator and fixed costs), or cpu to plan for this machine, where --verify measures the plan")
    v.add_argument("--gpus", type=_positive_int, default=1, metavar="N", help="GPUs to train on: with N > 1 the planner also tries FSDP2 and FSDP2 x tensor parallel")
    v.add_argument("--memory", metavar="SIZE", help="memory per GPU to fit in, e.g. 40GiB (default: the GPU's)")
    v.add_argument("--global-batch", type=_positive_int, metavar="G", help="samples per optimizer step, reached by micro-batch x accumulation x data-parallel GPUs (default: the largest micro-batch that fits)")
    s = g.training
    s.add_argument("--allow", default=",".join(DEFAULT_LEVERS), metavar="LEVERS", help=f"comma-separated levers the planner may pull, from {', '.join(LEVERS)} (default all but offload, which moves FSDP2's state to host memory, optimizer, which changes the training, and compile, torch.compile on one GPU at partitioner budgets 1.0 and 0.5, which compiles each configuration; where nothing fits, the plan says which of them would)")
    s.add_argument("--format", choices=("table", "json"), default="table", help="table (default), or json: the plan as one JSON object on stdout (progress and notes go to stderr)")
    s.add_argument("--optimizer", default="adamw", help=f"one of {', '.join(OPTIMIZERS)} (default adamw)")
    s.add_argument("--emit", metavar="FILE.py", help="write a runnable file that applies the best configuration (optimizer, autocast, accumulation, checkpointing)")
    s.add_argument("--verify", action="store_true", help="with --target cpu: apply the best configuration to the real model and measure one real step (a sharded one on as many real gloo processes)")


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args, where a mistyped command or option names the nearest one (difflib) instead of a bare
    'unrecognized arguments' from the top-level parser."""
    words = list(sys.argv[1:] if argv is None else argv)
    commands = _commands(parser)
    if words and not words[0].startswith("-") and words[0] not in commands:
        choose = f"argument COMMAND: invalid choice: '{words[0]}' (choose from {', '.join(commands)})"  # argparse's words
        raise _UsageError(choose + _did_you_mean(words[0], list(commands)), parser.prog)
    args, extras = parser.parse_known_args(words)
    if extras:
        command = commands.get(args.command, parser)
        raise _UsageError(_unrecognized(extras, command), command.prog)
    return args


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _unrecognized(extras: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """'unrecognized argument --bach; did you mean --batch?': the first unknown option beside the
    command's nearest one; stray values alone keep argparse's wording."""
    options = [e.partition("=")[0] for e in extras if e.startswith("--") or (e.startswith("-") and not e[1:2].isdigit())]
    if not options:
        return f"unrecognized arguments: {' '.join(extras)}"
    known = [s for s in parser._option_string_actions if s.startswith("--")]
    return f"unrecognized argument {options[0]}{_did_you_mean(options[0], known)}"


def _did_you_mean(typed: str, known: Sequence[str]) -> str:
    near = difflib.get_close_matches(typed, known, n=1, cutoff=0.6)
    return f"; did you mean {near[0]}?" if near else ""


class _Progress:
    """Stage lines on stderr, so that a graph that takes minutes does not look hung.

    On a terminal, the current stage shows at once on one line that each stage overwrites and
    ``close`` erases. Elsewhere (a log, a pipe) a stage gets a line only once it has run ``_SLOW_S``.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.timer: threading.Timer | None = None
        self.shown = False

    def __call__(self, stage: str) -> None:
        self._cancel()
        if self.tty:
            self._write(f"\r\033[Kfxmem: {stage}...")
            return
        self.timer = threading.Timer(_SLOW_S, self._write, args=(f"fxmem: {stage}...\n",))
        self.timer.daemon = True
        self.timer.start()

    def close(self) -> None:
        self._cancel()
        if self.tty and self.shown:
            self._write("\r\033[K")

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
        self.shown = True


def _load(args: argparse.Namespace, say: Callable[[str], None]) -> ModelSpec:
    say(f"loading {args.spec}")
    precision = getattr(args, "precision", None)
    lora = LoraOptions.parse(args.lora) if args.lora else None
    dtype = torch.bfloat16 if precision in BF16_WEIGHT_RECIPES and args.spec.startswith("hf:") else None  # built as from_pretrained(dtype=...)
    spec = load_model(args.spec, hf_config=_config_overrides(args.config), seq_len=args.seq_len, checkpoint=args.checkpoint, dtype=dtype, lora=lora)
    loss = args.loss or spec.loss
    if args.loss is None and loss not in LOSSES:
        raise InputSpecError(f"model '{args.spec}' asks for loss '{loss}', which fxmem does not know; pass --loss, one of {', '.join(LOSSES)}.")
    return ModelSpec(spec.model, _inputs(args, spec), loss, spec.name or args.spec)


def _config_overrides(items: Sequence[str]) -> dict[str, str]:
    pairs = [item.partition("=") for item in items]
    bad = [item for item, (key, eq, _v) in zip(items, pairs) if not eq or not key.isidentifier()]
    if bad:
        raise InputSpecError(f"--config '{bad[0]}': write KEY=VALUE, e.g. --config n_layer=4 hidden_size=256.")
    return {key: value for key, _eq, value in pairs}


def _inputs(args: argparse.Namespace, spec: ModelSpec) -> Any:
    """The --input shapes (else the model's own) and the --arg values after them, validated here."""
    shapes = _shapes(args, spec)
    constants = [Constant.of(*_arg(text)) for text in getattr(args, "arg", [])]
    if not constants:
        return shapes
    if isinstance(shapes, Mapping):
        return {**shapes, **{c.name: c for c in constants}}
    return [*shapes, *constants]


def _arg(text: str) -> tuple[str, object]:
    """``--arg NAME=VALUE``: VALUE read as JSON, else as a Python literal, else kept as a string."""
    name, eq, raw = text.partition("=")
    if not eq or not name.strip().isidentifier():
        raise InputSpecError(f"--arg '{text}': write NAME=VALUE with NAME a forward() parameter, e.g. --arg return_loss=true.")
    for read in (json.loads, ast.literal_eval):
        try:
            return name.strip(), read(raw)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    if looks_like_shape(raw):
        raise InputSpecError(f"--arg '{text}': '{raw}' is a shape; tensors are given with --input {name.strip()}={raw}.")
    return name.strip(), raw


def _analysis_seq_len(args: argparse.Namespace, spec: ModelSpec) -> int | None:
    """--seq-len for analyze(): None where an hf: spec's default inputs took it as their length (no
    S axis is left for analyze() to evaluate, and nothing to warn about)."""
    if args.seq_len is not None and args.spec.startswith("hf:") and not args.input and not has_seq(parse_inputs(spec.inputs)):
        return None
    return args.seq_len


def _shapes(args: argparse.Namespace, spec: ModelSpec) -> Sequence[str] | Mapping[str, str]:
    """The --input shapes, else the model's own, validated here so that a bad default names the model."""
    if args.input:
        parse_inputs(args.input)
        return list(args.input)
    if not spec.inputs:
        raise InputSpecError(f"model '{args.spec}' has no default inputs; pass them with --input, e.g. --input B,3,224,224.")
    try:
        parse_inputs(spec.inputs)
        return spec.inputs
    except InputSpecError as e:
        raise InputSpecError(f"model '{args.spec}' has invalid default inputs {spec.inputs!r}: {e} Pass --input instead.") from e


def _param_dtype(text: str | None) -> torch.dtype | None:
    if text is None:
        return None
    dtype = parse_dtype(text, option="--param-dtype")
    if not dtype.is_floating_point:
        raise InputSpecError(f"--param-dtype: '{text}' is not a floating-point dtype; use float32, bfloat16, float16 or float64.")
    return dtype


def _analyze(args: argparse.Namespace, say: Callable[[str], None]) -> str:
    param_dtype, opt = _param_dtype(args.param_dtype), get_optimizer(args.optimizer).name  # before a slow load
    device_memory = parse_size(args.device_memory, "--device-memory") if args.device_memory else None
    spec = _load(args, say)
    report = analyze(
        spec.model, spec.inputs, loss=spec.loss, optimizer=opt, batch=args.batch, name=spec.name if args.lora else args.spec, param_dtype=param_dtype,
        device_memory=device_memory, leaf_types=load_leaf_types(args.leaf, spec.model), frontend=args.frontend,
        seq_len=_analysis_seq_len(args, spec), strict=args.strict, peak=not args.no_peak, progress=say, bn_threshold=args.bn_threshold,
        compile=args.compile, activation_memory_budget=args.activation_memory_budget, **_setup(args),
    )  # fmt: skip
    if args.check and report.device_memory is None:
        raise InputSpecError("--check needs a device to fit in: with --target cpu give --device-memory (e.g. 24GiB).")
    text = render(report, args.format, depth=args.depth, top=args.top)
    if report.pipeline is not None and args.format in ("table", "markdown"):  # every rank of --pp beside the highest one's step
        text += "\n" + render_pipeline(report.pipeline, report.batch, report.seq_len)
    wrote = []
    if args.plot:
        from fxmem.output.plot import plot_batches

        say(f"drawing {args.plot}")
        plot_batches(report, args.plot)
        wrote.append(args.plot)
    if args.html:
        say(f"writing {args.html}")
        _write_page(args.html, report.to_html())
        wrote.append(args.html)
    if args.format != "json":  # JSON keeps stdout to the report: main says what it wrote on stderr
        text += "".join(f"\nWrote {path}.\n" for path in wrote)
        wrote = []
    return _Output(text, EXIT_DOES_NOT_FIT if args.check and not report.fits() else 0, tuple(wrote))


EXIT_DOES_NOT_FIT = 3
"""``fxmem analyze --check``'s exit status when the batch does not fit (0: it fits; 2: an error)."""


@dataclass(frozen=True)
class _Output:
    """What a command prints, and the exit status it asks for (``--check``)."""

    text: str
    status: int = 0
    wrote: tuple[str, ...] = ()
    """Files written whose 'fxmem: wrote FILE' goes to stderr (``--format json``: stdout is the report alone)."""


_OUTPUTS = {"html": "--html: cannot write the page", "plot": "cannot write the picture (--plot)", "emit": "--emit: cannot write the code"}
"""The options that name a file a command writes, and how an error about it starts (as the writers' own do)."""


def _check_writable(args: argparse.Namespace) -> None:
    """Fail before the analysis, which can take minutes, when --html, --plot or --emit names a file that
    cannot be written: its folder is missing or read-only, or the path is a folder."""
    for option, cannot_write in _OUTPUTS.items():
        path = getattr(args, option, None)
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        cannot = f"{cannot_write} to '{path}':"
        if not os.path.isdir(folder):
            raise InputSpecError(f"{cannot} the folder '{folder}' does not exist; create it, or pick a path in an existing folder.")
        if os.path.isdir(path):
            raise InputSpecError(f"{cannot} it is a folder; name a file in it, e.g. {os.path.join(path, 'report' + Path(path).suffix)}.")
        if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
            raise InputSpecError(f"{cannot} permission denied; pick a path you can write.")


def _write_page(path: str, page: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as e:
        raise InputSpecError(f"--html: cannot write the page to '{path}': {e.strerror or e}; pick a writable path ending in .html.") from e


def _measure(args: argparse.Namespace, say: Callable[[str], None]) -> str:
    _check_measurable(args)
    if args.compile:
        return _measure_compiled(args, say)
    if args.peak:
        return _measure_peak(args, say)
    spec = _load(args, say)
    leaves = load_leaf_types(args.leaf, spec.model)
    report = analyze(
        spec.model, spec.inputs, loss=spec.loss, batch=args.batch, name=args.spec, leaf_types=leaves,
        frontend=args.frontend, seq_len=_analysis_seq_len(args, spec), progress=say, peak=False, target="cpu", _flags=True,
    )  # fmt: skip
    say(f"running the model for real on the CPU at B={args.batch}")
    measured = measure(
        materialize(spec.model), spec.inputs, args.batch, loss=spec.loss, leaf_types=leaves, frontend=report.frontend,
        seq_len=report.seq_len,
    )
    return _comparison(report, measured.nodes, measured.total, args.batch)


def _measure_compiled(args: argparse.Namespace, say: Callable[[str], None]) -> str:
    """``measure --compile [--peak]``: the compiled step's saved bytes (or peak) measured beside its prediction."""
    if args.target != "cpu" or args.fsdp != 1 or args.tp != 1 or args.pp != 1 or args.amp is not None:
        raise InputSpecError("measure --compile runs the compiled step on the CPU, on one device, in the model's own dtypes: use --target cpu, without --fsdp, --tp, --pp or --amp.")
    opt = get_optimizer(args.optimizer).name
    spec, report = _step_report(args, say, opt)
    compiled = report.compiled
    model = materialize(spec.model)
    say(f"compiling the model with torch.compile and running it for real on the CPU at B={args.batch}")
    if args.peak:
        measured = measure_peak(
            model, spec.inputs, args.batch, loss=spec.loss, optimizer=opt, first_step=args.first_step, seq_len=report.seq_len,
            optimizer_impl=args.optimizer_impl, compile=True, activation_memory_budget=args.activation_memory_budget, training=_loop(args),
        )  # fmt: skip
        return "torch.compile(model), default mode\n\n" + _peak_comparison(compiled.steps.peak(args.batch, first_step=args.first_step), measured)
    total = measure(model, spec.inputs, args.batch, loss=spec.loss, seq_len=report.seq_len, compile=True, activation_memory_budget=args.activation_memory_budget).total
    rows = [[v.name, "x".join(map(str, v.shape)), v.dtype, format_bytes(v.nbytes)] for v in compiled.values if not v.held]
    table = tabulate(rows, headers=["Saved by the compiled forward", "Shape", "Dtype", "Bytes"], disable_numparse=True)
    verdict = "exact" if compiled.saved == total else f"differs by {compiled.saved - total:+d} B"
    listed = f" The values listed are the {compiled.listed_from}-block copy's: the prediction is {compiled.path}." if compiled.listed_from else ""
    return (
        f"{table}\n\nSaved for backward at B={args.batch} under torch.compile (the compiled forward's and the eager loss's): "
        f"measured {total} B, predicted {compiled.saved} B: {verdict}.{listed}\n"
    )


def _comparison(report: Report, nodes: dict[str, int], total: int, batch: int) -> str:
    predicted = report.node_bytes(batch)
    rows = [
        [layer.fqn, format_bytes(sum(nodes.get(n, 0) for n in layer.nodes)), format_bytes(sum(predicted.get(n, 0) for n in layer.nodes))]
        for layer in report.layers()
    ]
    pred_total = report.activation_bytes(batch)
    rows.append(["Total (eager run)", format_bytes(total), format_bytes(pred_total)])
    verdict = "exact" if pred_total == total and all(nodes.get(k, 0) == v for k, v in predicted.items()) else f"differs by {pred_total - total:+d} B"
    table = tabulate(rows, headers=["Layer", f"Measured at B={batch}", "Predicted"], disable_numparse=True)
    return f"{table}\n\nActivations at B={batch}: measured {total} B, predicted {pred_total} B: {verdict}.\n"


def _step_report(args: argparse.Namespace, say: Callable[[str], None], optimizer: str) -> tuple[ModelSpec, Report]:
    """Load the model and analyze it with its simulated step, for ``measure --peak`` and ``timeline``."""
    spec = _load(args, say)
    report = analyze(
        spec.model, spec.inputs, loss=spec.loss, optimizer=optimizer, batch=args.batch, name=args.spec,
        leaf_types=load_leaf_types(args.leaf, spec.model), frontend=args.frontend, seq_len=_analysis_seq_len(args, spec), progress=say,
        compile=getattr(args, "compile", False), activation_memory_budget=getattr(args, "activation_memory_budget", 1.0), **_setup(args),
    )  # fmt: skip
    return spec, report


def _default_target(args: argparse.Namespace) -> None:
    """``measure`` runs where the machine can: cuda where it has a GPU, else cpu (the parser's default is
    None so that --help need not import torch to ask)."""
    if getattr(args, "target", "") is None:
        args.target = "cuda" if torch.cuda.is_available() else "cpu"


def _check_measurable(args: argparse.Namespace) -> None:
    """A real run is one forward (or with --peak one step) on one device in the model's own dtypes: the
    setup options it cannot honour are refused rather than silently left out of both sides."""
    fsdp_mixed = args.fsdp != 1 and args.peak and args.precision == "mixed"  # FSDP2's MixedPrecisionPolicy: the real ranks run it
    flags = {"--world-size": args.world_size != 1, "--shard": args.shard != "none", "--precision": bool(args.precision) and not fsdp_mixed}
    flags["--fsdp"] = args.fsdp != 1 and not args.peak  # one real rank per process: a whole step only
    flags["--tp"] = args.tp != 1 and not args.peak
    flags["--pp"] = args.pp != 1 and not args.peak
    flags["--torch-version"] = args.torch_version is not None  # the real run is the installed torch's
    flags["--alloc-conf"] = bool(args.alloc_conf)  # a real CUDA run reads PYTORCH_CUDA_ALLOC_CONF from its environment
    flags["--memory-fraction"] = args.memory_fraction is not None
    loop = {"--clip-grad-norm": args.clip_grad_norm is not None, "--zero-grad": args.zero_grad != "after-step", "--keep-outputs": args.keep_outputs}
    if not args.peak or args.fsdp != 1 or args.tp != 1 or args.pp != 1:  # a forward alone, or ranks that run the default loop
        flags |= loop
    if not args.peak:
        flags |= {"--amp": args.amp is not None, "--optimizer-impl": args.optimizer_impl is not None, "--overhead": bool(args.overhead)}
    given = [name for name, on in flags.items() if on]
    if given:
        what = "measure --peak runs one real step" if args.peak else "measure runs one real forward on the CPU"
        keep = " (--amp and --optimizer-impl do apply)" if args.peak else " (with --peak, --amp, --optimizer-impl and the loop's --clip-grad-norm, --zero-grad and --keep-outputs apply)"
        raise InputSpecError(
            f"{what} on one device with the model's own dtypes: {', '.join(given)} apply to 'fxmem analyze' only; drop them here{keep}."
        )


def _measure_peak(args: argparse.Namespace, say: Callable[[str], None]) -> str:
    opt = get_optimizer(args.optimizer).name
    spec, report = _step_report(args, say, opt)
    predicted = report.peak(args.batch, first_step=args.first_step)
    device = args.target  # a GPU measures what the GPU keeps
    if device == "cuda" and not torch.cuda.is_available():
        raise InputSpecError("measure --peak --target cuda runs the step on a GPU, and this machine has no CUDA device; use --target cpu here.")
    if args.pp > 1:
        return _measure_pipeline(args, spec, report, say)
    if args.fsdp > 1 or args.tp > 1:
        return _measure_ranks(args, spec, report, predicted, say)
    say(f"running one training step for real on the {device.upper()} at B={args.batch}")
    measured = measure_peak(
        materialize(spec.model), spec.inputs, args.batch, loss=spec.loss, optimizer=opt, first_step=args.first_step,
        seq_len=report.seq_len, device=device, amp=args.amp, optimizer_impl=args.optimizer_impl, training=_loop(args),
    )  # fmt: skip
    return _peak_comparison(predicted, measured, device)


def _loop(args: argparse.Namespace) -> Any:
    """The training loop of --clip-grad-norm, --zero-grad and --keep-outputs, as ``measure_peak``'s ``training``."""
    from fxmem.options import Training

    return Training(clip_grad_norm=args.clip_grad_norm, zero_grad=args.zero_grad, keep_outputs=args.keep_outputs)


def _measure_ranks(args: argparse.Namespace, spec: ModelSpec, report: Report, predicted: Peak, say: Callable[[str], None]) -> str:
    """``measure --peak --fsdp N --tp T``: the real step on N x T CPU processes, each rank beside the simulated one."""
    if args.target != "cpu" or args.amp is not None or args.optimizer_impl is not None:
        raise InputSpecError(
            "measure --peak --fsdp/--tp runs the ranks on this machine's CPU with gloo: give --target cpu, without --amp or --optimizer-impl."
        )
    units = report.fsdp_units
    say(f"running one training step for real on {args.fsdp * args.tp} CPU processes (torchrun, gloo) at B={args.batch} per rank")
    ranks = measure_ranks(
        materialize(spec.model), spec.inputs, args.batch, fsdp=args.fsdp, units=units, tp=args.tp, tp_plan=_measured_tp_plan(args, spec), loss=spec.loss,
        optimizer=get_optimizer(args.optimizer).name, first_step=args.first_step, seq_len=report.seq_len,
        mixed=report.setup.fsdp_mixed,
    )  # fmt: skip
    saved = report.activation_bytes(args.batch)
    rows = [[f"rank {m.rank}", format_bytes(m.peak), m.phase.value, format_bytes(m.saved)] for m in ranks]
    rows.append(["fxmem (one rank)", format_bytes(predicted.bytes), predicted.phase.value, format_bytes(saved)])
    step = "first step" if args.first_step else "steady step"
    table = tabulate(rows, headers=["", f"Peak ({step}, B={args.batch} per rank)", "Phase", "Saved activations"], disable_numparse=True)
    top = max(m.peak for m in ranks)
    error = 100 * (predicted.bytes - top) / top if top else 0.0
    exact = "exact" if all(m.saved == saved for m in ranks) else "differ"
    return (
        f"{table}\n\nPeak: highest rank {top} B, predicted {predicted.bytes} B ({error:+.2f}%); saved activations {exact} "
        f"({saved} B predicted). Measured with torch.profiler on each rank, gloo's own buffers left out as NCCL's are outside torch's allocator "
        "(see Note [Ranks of one real step] in fxmem/measure_ranks.py).\n"
    )


def _measure_pipeline(args: argparse.Namespace, spec: ModelSpec, report: Report, say: Callable[[str], None]) -> str:
    """``measure --peak --pp P [--fsdp N] [--tp T]``: the real pipeline step on P x N x T CPU processes, each
    rank beside its simulated one (its stage's first data- and tensor-parallel rank)."""
    if args.target != "cpu" or args.amp is not None or args.optimizer_impl is not None:
        raise InputSpecError("measure --peak --pp runs the ranks on this machine's CPU with gloo: give --target cpu, without --amp or --optimizer-impl.")
    run = report.pipeline
    within = run.within
    width = within.world_size if within is not None else 1  # the ranks of one stage (Note [Data parallel inside pipeline stages])
    say(f"running one training step for real on {args.pp * width} CPU processes (torchrun, gloo) at B={args.batch} per microbatch")
    ranks = measure_ranks(
        materialize(spec.model), spec.inputs, args.batch, pp=args.pp, microbatches=args.microbatches, schedule=args.schedule,
        stages_per_rank=args.stages_per_rank, splits=args.pp_split, loss=spec.loss,
        optimizer=get_optimizer(args.optimizer).name, first_step=args.first_step, seq_len=report.seq_len,
        fsdp=args.fsdp, units=report.fsdp_units, mixed=within is not None and within.mixed, tp=args.tp, tp_plan=_measured_tp_plan(args, spec),
    )  # fmt: skip
    rows, worst = [], 0.0
    for m in ranks:
        r = run.ranks[m.rank // width]
        predicted, saved = r.peak(args.batch, first_step=args.first_step), r.activations.at(args.batch, report.seq_len)
        worst = max(worst, abs(predicted.bytes - m.peak) / m.peak if m.peak else 0.0)
        rows.append([f"rank {m.rank} ({r.role})", format_bytes(m.peak), format_bytes(predicted.bytes), m.phase.value, format_bytes(m.saved), format_bytes(saved)])
    step = "first step" if args.first_step else "steady step"
    headers = ["", f"Peak measured ({step})", "predicted", "Phase", "Saved measured", "predicted"]
    table = tabulate(rows, headers=headers, disable_numparse=True)
    exact = "exact" if all(m.saved == run.ranks[m.rank // width].activations.at(args.batch, report.seq_len) for m in ranks) else "differ"
    return (
        f"{run.describe()}, B={args.batch} per microbatch\n{table}\n\nPeak: largest error over the ranks {100 * worst:.2f}%; "
        f"saved per microbatch {exact}. Measured with torch.profiler on each rank (Note [Pipeline schedules on a fake group] in fxmem/step/pipeline.py).\n"
    )


def _peak_comparison(predicted: Peak, measured: PeakMeasurement, device: str = "cpu") -> str:
    """Measured and predicted peak side by side, each split by its own categories (the profiler's and fxmem's)."""
    step = "first step" if predicted.first_step else "steady step"
    peak = predicted.device.allocated if predicted.device is not None else predicted.bytes  # max_memory_allocated on a GPU
    rows = [["Peak", format_bytes(measured.bytes), format_bytes(peak)], ["Phase", measured.phase.value, predicted.phase.value]]
    names = sorted({*measured.breakdown, *(c.value.replace(" ", "_") for c in predicted.breakdown)})
    ours = {c.value.replace(" ", "_"): n for c, n in predicted.breakdown.items()}
    rows += [[f"  {name}", format_bytes(measured.breakdown.get(name, 0)), format_bytes(ours.get(name, 0))] for name in names]
    how = "torch.profiler" if device == "cpu" else "torch.cuda.max_memory_allocated"
    table = tabulate(rows, headers=["", f"Measured ({how}, {step}, B={measured.batch})", "Predicted (fxmem)"], disable_numparse=True)
    error = 100 * (peak - measured.bytes) / measured.bytes if measured.bytes else 0.0
    return (
        f"{table}\n\nPeak at B={measured.batch}: measured {measured.bytes} B, predicted {peak} B ({error:+.2f}%); "
        f"predicted at {predicted.node}. Categories are each side's own: the profiler calls some "
        "of the step's buffers autograd_detail or unknown.\n"
    )


def _timeline(args: argparse.Namespace, say: Callable[[str], None]) -> str:
    _spec, report = _step_report(args, say, get_optimizer(args.optimizer).name)
    timeline = report.timeline(args.batch, first_step=args.first_step)
    text = render_timeline(timeline, report.peak(args.batch, first_step=args.first_step), args.batch, report.seq_len, args.spec)
    if args.plot:
        from fxmem.output.plot import plot_timeline

        say(f"drawing {args.plot}")
        plot_timeline(timeline, args.plot, title=args.spec, seq=report.seq_len, batch=args.batch)
        text += f"\nWrote {args.plot}.\n"
    return text


def _zoo(_args: argparse.Namespace, say: Callable[[str], None]) -> str:
    from models_zoo import ZOO

    rows = []
    for name, build in ZOO.items():
        say(f"building zoo:{name}")
        spec = load_model(f"zoo:{name}")
        params = sum(p.numel() for p in spec.model.parameters())
        summary = (sys.modules[build.__module__].__doc__ or "").strip().splitlines()[0]
        rows.append([name, f"{params / 1e6:,.1f}M", " ".join(spec.inputs), spec.loss, summary])
    table: str = tabulate(rows, headers=["Model", "Params", "Default input", "Loss", "What it is"], disable_numparse=True)
    return table + "\n"


def _plan(args: argparse.Namespace, say: Callable[[str], None]) -> str:
    """``fxmem plan``: the levers searched (fxmem/planner/search.py), the table, and ``--emit`` / ``--verify``."""
    from fxmem.planner.search import plan, verify
    from fxmem.planner.show import emit_plan, plan_table

    memory = parse_size(args.memory, "--memory") if args.memory else None
    levers = [lever.strip() for lever in args.allow.split(",") if lever.strip()]
    if args.verify and args.format == "json":
        raise InputSpecError("plan --verify prints a measurement beside the table; run it without --format json.")
    if args.verify and args.target != "cpu":
        raise InputSpecError("plan --verify measures the plan on this machine's CPU: give --target cpu (and --memory).")
    spec = _load(args, say)
    found = plan(
        spec.model, spec.inputs, gpu=args.gpu, target=args.target, gpus=args.gpus, memory=memory, global_batch=args.global_batch,
        allow=levers, loss=spec.loss, optimizer=get_optimizer(args.optimizer).name, name=args.spec, seq_len=_analysis_seq_len(args, spec), progress=say,
    )  # fmt: skip
    if args.format == "json":
        return _plan_json(args, found)
    text = plan_table(found)
    if args.emit and found.best is not None:
        Path(args.emit).write_text(emit_plan(found))
        text += f"Wrote {args.emit}: the best configuration as code.\n"
    if args.verify and found.best is not None:
        say(f"running the best configuration for real on the CPU at micro-batch {found.best.micro_batch}")
        v = verify(found.best, spec.model, spec.inputs, loss=spec.loss, seq_len=_analysis_seq_len(args, spec))
        chosen = found.best.config.checkpoint
        saved = "" if v.measured_saved is None or chosen is None else f"; saved for backward {v.measured_saved} B measured, {chosen.saved_at_batch} B planned"
        ranks = f" (the highest of {len(v.ranks)} real ranks: {', '.join(str(r.peak) for r in v.ranks)} B)" if v.ranks else ""
        text += f"Verified: peak {v.measured_peak} B measured{ranks}, {found.best.peak} B predicted ({100 * v.peak_error:+.2f}%){saved}.\n"
    return text


def _plan_json(args: argparse.Namespace, found: Any) -> str:
    """``plan --format json``: ``plan_json`` on stdout, the emitted file written as with the table."""
    import json

    from fxmem.planner.show import emit_plan, plan_json

    if args.emit and found.best is not None:
        Path(args.emit).write_text(emit_plan(found))
    return json.dumps(plan_json(found), indent=2) + "\n"


_COMMANDS: dict[str, Callable[[argparse.Namespace, Callable[[str], None]], str | _Output]] = {
    "analyze": _analyze,
    "measure": _measure,
    "timeline": _timeline,
    "zoo": _zoo,
    "plan": _plan,
}


def _run(args: argparse.Namespace) -> _Output:
    _check_writable(args)
    progress = _Progress(sys.stderr)
    try:
        with warnings.catch_warnings():
            if not args.verbose:
                warnings.simplefilter("ignore")  # torch's UserWarnings and FutureWarnings, FSDP2's among them: -v shows them
            warnings.simplefilter("once", FxmemWarning)  # one note per message, however many analyses run
            warnings.showwarning = _note
            _load_engine()  # inside: what importing torch and transformers warns is held back too
            _default_target(args)
            with _torch_logs(verbose=args.verbose):
                out = _COMMANDS[args.command](args, progress)
            return out if isinstance(out, _Output) else _Output(out)
    finally:
        progress.close()


@contextlib.contextmanager
def _torch_logs(verbose: bool) -> Iterator[None]:
    """torch's loggers at ERROR for the run, unless -v: their warnings ('W1205 ... Unable to find user
    code corresponding to {u0}' from symbolic_shapes, export's and dynamo's notes) are about fxmem's own
    tracing, which reports its outcome itself. torch configures its loggers when imported (torch._logging,
    each with its own handler and level NOTSET under 'torch'), so the levels are raised after the import and
    restored after the run."""
    if verbose:
        yield
        return
    names = ["torch", *(n for n in logging.root.manager.loggerDict if n.startswith("torch."))]
    loggers = [logger for logger in map(logging.getLogger, names) if logger.name == "torch" or logger.level != logging.NOTSET]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.level, logging.ERROR))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _note(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: object = None, line: str | None = None) -> None:
    """An FxmemWarning as one line on stderr (``fxmem: note: ...``); any other warning as Python shows it
    (``warnings.showwarning``'s arguments; ``file`` is stderr here)."""
    if issubclass(category, FxmemWarning):
        print(f"fxmem: note: {' '.join(str(message).split())}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _error(message: str) -> int:
    print(f"fxmem: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def _write(text: str) -> int:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `fxmem ... | head`: the reader left; say nothing more (Python docs, signal SIGPIPE note)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fxmem`` script; returns the exit status."""
    try:
        args = _parse(_parser(), argv)
    except _UsageError as e:
        message = str(e)
        return _error(f"{message}{' ' if message.endswith('?') else '; '}see '{e.prog} --help'.")
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    if args.command is None:
        return _error("name a command: analyze, measure, timeline, plan or zoo; see 'fxmem --help'.")
    try:
        out = _run(args)
    except FxmemError as e:
        return _error(str(e))
    except KeyboardInterrupt:
        print("fxmem: interrupted (Ctrl-C); nothing was reported.", file=sys.stderr)
        return 130
    status = _write(out.text)
    for path in out.wrote:
        print(f"fxmem: wrote {path}", file=sys.stderr)
    return status or out.status
