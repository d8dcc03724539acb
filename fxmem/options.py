"""What a prediction is for, as three small option objects: how the model is trained, what it runs
on, and how it is spread over GPUs.

>>> import fxmem, torch.nn as nn
>>> report = fxmem.analyze(
...     nn.Sequential(nn.Linear(512, 512), nn.ReLU()), ["B,512"], batch=64,
...     training=fxmem.Training(loss="cross_entropy", optimizer="adam", amp="bf16"),
...     hardware=fxmem.Hardware(gpu="a100-40gb"),
... )

Each object is one concern, frozen, with the defaults of a plain run (fp32 AdamW on one H100), and
each field is documented where it is defined. ``analyze`` also takes every field as a plain keyword
(``analyze(model, inputs, loss="cross_entropy")``); a field given both in its object and as a
keyword, with two different values, is an InputSpecError naming it. The values are checked where
they are used (``fxmem.analyze`` and ``TrainingSetup`` in fxmem/step/training.py), each with an
error that names the field and the way out.

The CLI mirrors these groups: its options fill the same fields (``--loss``, ``--gpu``, ``--fsdp``);
``SETTINGS`` maps each field to its flag, so that a note or an error can name the setting in the
caller's own terms (``Hardware.gpu`` from Python, ``--gpu`` from the command line).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

import torch

from fxmem.errors import FxmemWarning, InputSpecError

__all__ = ["DEFAULT_GPU", "SETTINGS", "Hardware", "Parallelism", "Training", "merge", "spell", "warn_at_caller"]

DEFAULT_GPU = "h100-80gb"
"""The GPU a cuda-target prediction is for when none is named."""


@dataclass(frozen=True)
class Training:
    """How the model is trained: the loss, the optimizer, and the precision of the step.

    The defaults are a plain fp32 step with AdamW and torch's default optimizer implementation for
    the target device (foreach on CUDA, for-loop on the CPU).
    """

    loss: str = "sum"
    """The loss the step backpropagates: "sum" (any output), "cross_entropy", "mse", ... (fxmem/engine/losses.py)."""
    optimizer: str = "adamw"
    """The optimizer whose state the step holds: "adamw", "adam", "sgd", "sgd_momentum", ... (``fxmem.register_optimizer`` adds one)."""
    optimizer_impl: str | None = None
    """"foreach", "fused" or "for-loop"; None: what torch picks on the target device."""
    precision: str = ""
    """The state recipe (fxmem/step/precision.py: "fp32", "amp", "bf16", "mixed", ...); "" picks "amp"
    when ``amp`` is set, else "fp32"."""
    amp: str | None = None
    """"bf16" or "fp16": the forward and the loss run under autocast with the target's cast policy; None: no autocast."""
    param_dtype: torch.dtype | None = None
    """The dtype the weights are counted in (e.g. ``torch.bfloat16`` for a model cast with ``.to``);
    None: the model's own."""
    compile: bool = False
    """Also predict the step with ``torch.compile(model)`` (default mode): ``Report.compiled``, shown beside the eager step."""
    activation_memory_budget: float = 1.0
    """With ``compile``: ``torch._functorch.config.activation_memory_budget``, what the partitioner may
    save, from 0.0 (what checkpointing the whole compiled region saves) to 1.0 (torch's default, its
    min-cut); lower recomputes more in backward."""
    clip_grad_norm: float | None = None
    """The loop clips the gradients with ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``
    between ``loss.backward()`` and ``optimizer.step()``, at this max_norm; None: no clipping."""
    zero_grad: str = "after-step"
    """Where the loop calls ``optimizer.zero_grad()``: "after-step" (after ``optimizer.step()``) or
    "before-backward" (after the loss, just before ``loss.backward()``: a steady step then holds the
    last step's gradients through its forward and loss)."""
    keep_outputs: bool = False
    """The loop holds each step's output and loss until the next ones replace them, as
    ``for x in data: out = model(x); loss = loss_fn(out)`` does: a steady step then holds the last
    step's outputs (an LLM's B x S x vocab logits) through its forward."""


@dataclass(frozen=True)
class Hardware:
    """What the step runs on: the device, its memory, and how torch manages it.

    The defaults are one H100 80GB with torch's default caching allocator and fixed costs.
    Everything but ``target`` and ``device_memory`` describes a cuda target only.
    """

    target: str = "cuda"
    """"cuda": the GPU named by ``gpu``, where kernels save what CUDA's save, the caching allocator rounds
    every block and fixed costs are added; "cpu": this machine's CPU, which ``fxmem.measure`` checks exactly."""
    gpu: str = DEFAULT_GPU
    """A GPU of ``fxmem.GPUS`` by name ("a100-40gb"), or a description ("memory=12GiB,cc=8.6,bandwidth=360GB/s,fp32=12.7")."""
    device_memory: int | None = None
    """Bytes the step must fit in; None: the GPU's own memory (no budget on a cpu target)."""
    torch_version: str | None = None
    """The torch release the training job runs ("2.11"), whose kernel choices a cuda target follows
    where they changed between releases (SDPA's backend, cuBLASLt's workspace); None: the torch fxmem runs with."""
    overheads: Mapping[str, int] = field(default_factory=dict)
    """Overrides of the fixed CUDA costs by line name (``{"cuda_context": 600 * 2**20}``; fxmem/gpu/overheads.py), in bytes."""
    alloc_conf: str = ""
    """``PYTORCH_CUDA_ALLOC_CONF`` as the job sets it ("expandable_segments:True,max_split_size_mb:512"); "": torch's defaults."""
    memory_fraction: float | None = None
    """``torch.cuda.set_per_process_memory_fraction``'s share, where the job sets one."""

    def __post_init__(self) -> None:
        _freeze(self, "overheads", _mapping(self.overheads, "Hardware.overheads"))


@dataclass(frozen=True)
class Parallelism:
    """How the step is spread over GPUs. The defaults are one GPU.

    ``fsdp`` (N > 1) simulates one rank of FSDP2 over N ranks by running ``fully_shard`` itself on a
    fake process group; ``tp`` (T > 1) adds tensor parallel over T ranks by running
    ``parallelize_module`` (with both, one rank of a 2-D ``fsdp x tp`` mesh); ``pp`` (P > 1) splits
    the repeated blocks into pipeline stages and simulates every rank's step under torch's own
    schedule. ``world_size`` and ``shard`` instead divide one GPU's state by DeepSpeed's ZeRO formulas.
    """

    fsdp: int = 1
    """FSDP2 ranks (the same as ``world_size=N, shard="fsdp"``); the batch is then each rank's micro-batch."""
    fsdp_units: tuple[str, ...] | None = None
    """Module paths FSDP2 wraps before the root; None: each repeated block."""
    tp: int = 1
    """Tensor-parallel ranks, each data-parallel rank's group of ``tp`` GPUs."""
    tp_plan: Mapping[str, str] | None = None
    """Module path (``*`` one component) -> style ("colwise", "rowwise", "colwise_gather_output",
    "embedding_rowwise", ...); None: the model's own ``_tp_plan`` (Note [Tensor parallel plans] in fxmem/parallel/tensor.py)."""
    sp: bool = False
    """With ``tp``: the model's sequence-parallel plan, the norms and the residual stream split along the sequence."""
    pp: int = 1
    """Pipeline stages (ranks); the report's ``pipeline`` then holds every rank and its ``peak`` the highest."""
    microbatches: int = 1
    """With ``pp``: microbatches of ``batch`` samples each per step."""
    schedule: str = "1f1b"
    """With ``pp``: torch's schedule, "gpipe", "1f1b" or "interleaved"."""
    pp_splits: tuple[int, ...] | None = None
    """With ``pp``: the first block of each stage after the first; None: as even as the blocks allow."""
    stages_per_rank: int | None = None
    """With ``pp`` and the "interleaved" schedule: stages per rank (V); None: 2."""
    world_size: int = 1
    """Data-parallel GPUs whose state ``shard`` divides by DeepSpeed's formulas."""
    shard: str = "none"
    """"none", "zero1", "zero2", "zero3" or "fsdp": which part of the state ``world_size`` GPUs divide."""
    offload: bool = False
    """With ``fsdp``: FSDP2's ``CPUOffloadPolicy``, the sharded weights, their gradients and the
    optimizer state in host memory (the optimizer step on the CPU), each unit's shards copied to the
    device for its all-gather (Note [FSDP2's CPU offload] in fxmem/parallel/fsdp.py)."""

    def __post_init__(self) -> None:
        if self.fsdp_units is not None:
            _freeze(self, "fsdp_units", _tuple(self.fsdp_units, "Parallelism.fsdp_units"))
        if self.pp_splits is not None:
            _freeze(self, "pp_splits", _tuple(self.pp_splits, "Parallelism.pp_splits"))
        if self.tp_plan is not None:
            _freeze(self, "tp_plan", _mapping(self.tp_plan, "Parallelism.tp_plan"))


Options = TypeVar("Options", Training, Hardware, Parallelism)

SETTINGS: dict[str, tuple[str, str]] = {
    **{f.name: ("Training", f"--{f.name.replace('_', '-')}") for f in fields(Training)},
    **{f.name: ("Hardware", f"--{f.name.replace('_', '-')}") for f in fields(Hardware)},
    **{f.name: ("Parallelism", f"--{f.name.replace('_', '-')}") for f in fields(Parallelism)},
    "overheads": ("Hardware", "--overhead"),
    "fsdp_units": ("Parallelism", "--fsdp-unit"),
    "pp_splits": ("Parallelism", "--pp-split"),
    "seq_len": ("", "--seq-len"),
    "batch": ("", "--batch"),
    "peak": ("", "--no-peak"),
}
"""Each setting's option object ("" for a plain keyword of ``analyze``) and the CLI flag that sets it."""


def spell(setting: str, value: object = None, *, flags: bool = False) -> str:
    """A setting as the caller wrote it: the CLI's flag (``--seq-len 64``) where ``flags``, else the
    API's own name (``seq_len=64``, ``Parallelism.shard='zero3'``); without the value where ``value`` is None."""
    group, flag = SETTINGS[setting]
    if flags:
        return flag if value is None or isinstance(value, bool) else f"{flag} {value}"
    name = f"{group}.{setting}" if group else f"{setting}="
    if value is None:
        return name.rstrip("=")
    return f"{name}{'' if name.endswith('=') else '='}{value!r}"


def merge(given: Options | None, kind: type[Options], keywords: Mapping[str, Any]) -> Options:
    """The option object ``given`` (default ``kind()``) with the plain keywords that were given (not
    None) filled in. A field the object sets to a value other than its default and a keyword sets to
    another value is given twice: an InputSpecError naming it."""
    argument = kind.__name__.lower() if kind is not Parallelism else "parallel"
    if given is not None and not isinstance(given, kind):
        raise InputSpecError(
            f"{argument}= takes a fxmem.{kind.__name__}, got {type(given).__name__}; e.g. {argument}=fxmem.{kind.__name__}()."
        )
    base = given if given is not None else kind()
    default = kind()
    changes = {}
    for name, value in keywords.items():
        if value is None:
            continue
        ours = getattr(base, name)
        if given is not None and not _same(ours, getattr(default, name)) and not _same(ours, value):
            raise InputSpecError(
                f"{name} is given twice: {kind.__name__}.{name}={ours!r} in {argument}= and the keyword {name}={value!r}; "
                f"give it once, in the {kind.__name__} or as the keyword."
            )
        changes[name] = value
    return replace(base, **changes) if changes else base


def warn_at_caller(message: str) -> None:
    """An FxmemWarning pointing at the first frame outside fxmem: the caller's own line, however deep
    in fxmem the option was found to change nothing (``warnings.warn``'s ``skip_file_prefixes`` needs Python 3.12)."""
    frame, level = sys._getframe(0), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, FxmemWarning, stacklevel=level)


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _same(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values whose == is not a bool (tensors) are not the same setting
        return a is b


def _freeze(options: object, name: str, value: object) -> None:
    object.__setattr__(options, name, value)


def _tuple(items: Iterable[Any], name: str) -> tuple[Any, ...]:
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise InputSpecError(f"{name} takes a sequence, got {items!r}; e.g. ({items!r},).")
    return tuple(items)


def _mapping(items: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    if not isinstance(items, Mapping):
        raise InputSpecError(f"{name} takes a mapping of names to values, got {type(items).__name__}.")
    return dict(items)  # a copy: the caller's later changes do not reach the options
