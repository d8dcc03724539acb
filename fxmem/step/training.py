"""The training setup a prediction is for: target device and GPU, autocast, precision, sharding.

Everything here is checked at the boundary and then read by the stages: capture and the timeline run
the forward under ``kernels()`` (what the target's kernels save, and its autocast policy), the state
stage reads the precision recipe and the sharding plan, and the peak stage replays the step through
the target's allocator (``fxmem/gpu/allocator.py``) where the target is CUDA.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fxmem.errors import InputSpecError
from fxmem.options import DEFAULT_GPU, Hardware, Parallelism, Training, spell
from fxmem.results import ZERO_GRAD_PLACES, Loop
from fxmem.rules import TorchRelease, torch_release
from fxmem.rules.linear import LinearAsReal
from fxmem.rules.routing import RoutedSizes
from fxmem.rules.optimizers import IMPLS
from fxmem.step.sharding import STAGES as SHARDS
from fxmem.step.sharding import check_plan

if TYPE_CHECKING:
    from fxmem.gpu.alloc_conf import AllocatorConfig
    from fxmem.gpu.gpus import GpuSpec
    from fxmem.step.timeline import StepTarget

__all__ = ["AMP_DTYPES", "DEFAULT_GPU", "IMPLS", "SHARDS", "TARGETS", "TrainingSetup", "amp_dtype", "check_loop", "fsdp_sharding"]

TARGETS = ("cuda", "cpu")
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class TrainingSetup:
    """Where and how the step runs. The defaults describe one H100 training in fp32 with torch's
    default optimizer implementation for that device (foreach on CUDA, for-loop on the CPU)."""

    target: str = "cuda"
    gpu: str = DEFAULT_GPU
    amp: str | None = None
    """'bf16' or 'fp16': the forward and the loss run under autocast with the target's cast policy."""
    precision: str = ""
    """A recipe of fxmem/step/precision.py; '' picks 'amp' when ``amp`` is set, else 'fp32'."""
    world_size: int = 1
    shard: str = "none"
    optimizer_impl: str | None = None
    """'foreach', 'fused' or 'for-loop'; None: what torch picks on the target device."""
    overheads: dict[str, int] = field(default_factory=dict)
    """Overrides of the fixed CUDA costs by line name (see fxmem/gpu/overheads.py), in bytes."""
    torch_version: str | None = None
    """The torch release the training job runs ("2.11"), whose kernel choices a cuda target follows
    where they changed between releases (SDPA's backend, cuBLASLt's workspace); None: fxmem's own."""
    tp: int = 1
    """Tensor-parallel ranks (``--tp``), each data-parallel rank's group of ``tp`` GPUs; the step is
    then one rank's of the real engine (fxmem/parallel)."""
    alloc_conf: str = ""
    """``PYTORCH_CUDA_ALLOC_CONF`` as the training job sets it ("" : torch's defaults); see fxmem/gpu/alloc_conf.py."""
    memory_fraction: float | None = None
    """``torch.cuda.set_per_process_memory_fraction``'s share, where the job sets one."""
    offload: bool = False
    """FSDP2's ``CPUOffloadPolicy`` (``--offload``): the sharded state in host memory, Note [FSDP2's CPU
    offload] in fxmem/parallel/fsdp.py."""
    loop: Loop = Loop()
    """The training loop around the step: clipping, where zero_grad runs, whether outputs are kept
    (Note [What a loop holds from the step before] in fxmem/step/timeline.py)."""

    def __post_init__(self) -> None:
        _check_choice("target", self.target, TARGETS)
        amp_dtype(self.amp)
        check_plan(self.world_size, self.shard)
        if self.optimizer_impl is not None:
            _check_choice("optimizer_impl", self.optimizer_impl, IMPLS)
        if self.shard != "none" and self.target != "cuda" and not self.engine:
            raise InputSpecError(f"--shard {self.shard} shards state across GPUs: use it with --target cuda.")
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise InputSpecError(f"--tp needs a whole number of ranks, 1 or more; got {self.tp!r}.")
        if self.tp > 1 and self.recipe == "mixed" and not self.fsdp:
            raise InputSpecError(
                "--precision mixed with --tp is FSDP2's MixedPrecisionPolicy, which needs --fsdp N too; use fp32 or amp "
                "with tensor parallel alone."
            )
        if self.engine and self.recipe not in ENGINE_RECIPES:
            raise InputSpecError(
                f"--fsdp runs FSDP2 itself, which keeps fp32 shards and takes low precision from its MixedPrecisionPolicy: "
                f"--precision {self.recipe} has no FSDP2 form; use fp32, amp, or mixed (bf16 gathered weights and compute, "
                "fp32 shards, gradients and optimizer state), or --shard zero3 (DeepSpeed's formula)."
            )
        _check_offload(self.offload, self.fsdp, self.tp)
        check_loop(self.loop)
        if self.target == "cuda":
            self.device  # noqa: B018 - fails early on an unknown --gpu
            self.allocator  # noqa: B018 - fails early on a malformed --alloc-conf
        self.release  # noqa: B018 - fails early on a malformed --torch-version

    @classmethod
    def of(cls, training: Training, hardware: Hardware, parallel: Parallelism) -> TrainingSetup:
        """The setup the option objects describe, ``parallel.fsdp`` folded into the sharding (one
        rank of the real FSDP2 engine over ``fsdp`` ranks); the pipeline's stages are not part of it."""
        world_size, shard = fsdp_sharding(parallel)
        if parallel.offload is True and parallel.pp != 1:
            raise InputSpecError(
                f"offload (--offload, FSDP2's CPUOffloadPolicy) inside pipeline stages (pp={parallel.pp!r}) is not modelled yet; "
                "drop one of the two."
            )
        loop = Loop(training.clip_grad_norm, training.zero_grad, training.keep_outputs)
        check_loop(loop)  # before it is described below
        if not loop.plain and parallel.pp != 1:
            raise InputSpecError(
                f"the training loop's settings ({loop.describe()}) are simulated on one GPU and with FSDP2 or tensor parallel, "
                f"not yet inside pipeline stages (pp={parallel.pp!r}); drop them, or drop pp."
            )
        return cls(
            hardware.target, hardware.gpu, training.amp, training.precision, world_size, shard, training.optimizer_impl,
            dict(hardware.overheads), hardware.torch_version, parallel.tp, hardware.alloc_conf, hardware.memory_fraction,
            parallel.offload, loop,
        )  # fmt: skip

    def unused(self, *, flags: bool = False) -> tuple[str, ...]:
        """What was asked that has no effect on this setup, one sentence each (see FxmemWarning), naming
        each setting as the CLI's flag where ``flags``, else as the API's own (``Parallelism.shard``)."""
        say = lambda setting, value=None: spell(setting, value, flags=flags)
        found = []
        if self.world_size == 1 and self.shard != "none":
            found.append(
                f"{say('shard', self.shard)} with {say('world_size', 1)} divides nothing: one GPU holds the whole state; "
                f"give {say('world_size', 'N') if flags else say('world_size') + '=N'}."
            )
        if self.world_size > 1 and self.shard == "none":
            found.append(
                f"{say('world_size', self.world_size)} without {say('shard')} changes nothing here: every GPU holds the whole state "
                "(plain data parallel; DDP's gradient buckets are not modelled), as one GPU does; "
                + ("add --shard zero1, zero2, zero3 or fsdp" if flags else f"set {say('shard')} to 'zero1', 'zero2', 'zero3' or 'fsdp'")
                + " to divide it."
            )
        if not self.cuda:
            given = [
                ("gpu", self.gpu != DEFAULT_GPU),
                ("torch_version", self.torch_version is not None),
                ("overheads", bool(self.overheads)),
                ("alloc_conf", bool(self.alloc_conf)),
                ("memory_fraction", self.memory_fraction is not None),
            ]
            found += [
                f"{say(option)} describes the cuda target and has no effect with {say('target', 'cpu')}." for option, on in given if on
            ]
        return tuple(found)

    @property
    def cuda(self) -> bool:
        return self.target == "cuda"

    @property
    def engine(self) -> bool:
        """Whether the step is simulated as one rank of a real FSDP2 run (fxmem/parallel) rather than
        divided by DeepSpeed's formulas: ``--shard fsdp`` (``--fsdp N``) with more than one GPU, or
        tensor parallel (``--tp T``)."""
        return self.fsdp or self.tp > 1

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 itself shards the state over the data-parallel ranks."""
        return self.shard == "fsdp" and self.world_size > 1

    @property
    def fsdp_mixed(self) -> bool:
        """Whether FSDP2 runs with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``:
        the ``mixed`` recipe's form in FSDP2 (the same 16 bytes of state per AdamW parameter, held as
        fp32 shards, fp32 gradient shards and fp32 moments; the gathered weights and the compute bf16)."""
        return self.fsdp and self.recipe == "mixed"

    @property
    def distributed(self) -> bool:
        """Whether the state is divided among GPUs (more than one, or a sharding stage named)."""
        return self.world_size > 1 or self.shard != "none" or self.tp > 1

    @property
    def ranks(self) -> int:
        """GPUs in the run: the data-parallel ranks times each one's tensor-parallel group."""
        return self.world_size * self.tp

    @property
    def engine_name(self) -> str:
        """The parallelisms the real engine runs, in words ("" without one)."""
        return " x ".join(name for name, on in (("FSDP2", self.fsdp), ("tensor parallel", self.tp > 1)) if on)

    def _engine_words(self) -> str:
        """The engine's parallelisms with their degrees, for the header ("FSDP2 (fully_shard) 4 x tensor parallel 2")."""
        words = [("FSDP2 (fully_shard)", self.world_size, self.fsdp), ("tensor parallel", self.tp, self.tp > 1)]
        offload = " with CPU offload" if self.offload else ""
        return " x ".join(f"{name} {degree}" for name, degree, on in words if on) + offload

    @property
    def device(self) -> GpuSpec:
        """The GPU of a cuda target."""
        from fxmem.gpu.gpus import get_gpu

        return get_gpu(self.gpu)

    @property
    def allocator(self) -> AllocatorConfig:
        """The caching allocator's settings of a cuda target (``alloc_conf`` and ``memory_fraction``)."""
        from fxmem.gpu.alloc_conf import parse_alloc_conf

        return parse_alloc_conf(self.alloc_conf, memory_fraction=self.memory_fraction)

    @property
    def release(self) -> TorchRelease:
        """(major, minor) of the torch release the kernel choices follow."""
        return torch_release(self.torch_version)

    @property
    def amp_dtype(self) -> torch.dtype | None:
        return amp_dtype(self.amp)

    @property
    def state_dtype(self) -> torch.dtype | None:
        """The dtype the model's floating weights are held (and computed) in under an explicit recipe
        with low-precision weights (bf16, mixed): the step is simulated as after ``model.to(dtype)``."""
        if not self.precision or self.engine:  # FSDP2 holds fp32 shards whatever the recipe (``fsdp_mixed``)
            return None
        from fxmem.step.precision import get_recipe

        dtype = get_recipe(self.precision).weight_dtype
        return None if dtype == torch.float32 else dtype

    @property
    def recipe(self) -> str:
        return self.precision or ("amp" if self.amp is not None else "fp32")

    def kernels(self) -> Callable[[], AbstractContextManager[object]]:
        """A factory of the context the forward and the loss run in: the cuda target's kernel choices and
        autocast policy (fxmem/gpu/target.py), CPU autocast for a cpu target with ``amp``, else ``linear``
        as real tensors run it (Note [linear's bias on fake tensors] in fxmem/rules/linear.py); inside it, the
        counts of mixture-of-experts routing (Note [Routed sizes] in fxmem/rules/routing.py)."""
        return functools.partial(_routed, self._target_kernels())

    def _target_kernels(self) -> Callable[[], AbstractContextManager[object]]:
        amp = self.amp_dtype
        if self.cuda:
            from fxmem.gpu.target import CudaTargetMode

            capability, release = self.device.compute_capability, self.release
            return lambda: CudaTargetMode(compute_capability=capability, amp=amp, release=release)
        if amp is not None:
            return lambda: torch.autocast("cpu", dtype=amp)
        return LinearAsReal

    def step_target(self, optimizer_impl: str | None) -> StepTarget:
        """What the target decides about every simulated step of this setup (``StepTarget``)."""
        from fxmem.rules.ops import layout_rules_for, op_rules_for, workspace_rules_for
        from fxmem.step.timeline import StepTarget

        t = self.target
        return StepTarget(
            op_rules_for(t), workspace_rules_for(t), layout_rules_for(t), self.kernels(), optimizer_impl, self.state_dtype, self.loop, t
        )

    def describe(self, as_built: str | None = None) -> str:
        """One line for the report's header. ``as_built`` says the dtypes of weights held as the model
        built them (a bf16 base with fp32 adapters), shown where no recipe or autocast decides them."""
        where = "cpu" if not self.cuda else f"cuda: {self.device.label}"
        precision = f"precision as built: {as_built}" if as_built and not self.precision and not self.amp else f"precision {self.recipe}"
        parts = [where, precision + (f" (autocast {self.amp})" if self.amp else "")]
        if self.distributed:
            how = f"{self._engine_words()}, one rank simulated" if self.engine else f"shard {self.shard}"
            parts.append(f"{self.ranks} GPU{'s' if self.ranks > 1 else ''}, {how}")
        if self.optimizer_impl:
            parts.append(f"optimizer {self.optimizer_impl}")
        if self.torch_version is not None:
            parts.append(f"torch {self.torch_version}")
        if self.cuda and (self.alloc_conf or self.memory_fraction is not None):
            parts.append(f"allocator {self.allocator.describe()}")
        if not self.loop.plain:
            parts.append(self.loop.describe())
        return ", ".join(parts)


ENGINE_RECIPES = ("fp32", "amp", "mixed")
"""The recipes ``--fsdp`` runs: FSDP2 keeps fp32 shards, and ``mixed`` is its bf16 MixedPrecisionPolicy."""


def fsdp_sharding(parallel: Parallelism) -> tuple[int, str]:
    """(world_size, shard) with ``fsdp=N`` folded in: N ranks of the real FSDP2 engine."""
    fsdp, world_size, shard = parallel.fsdp, parallel.world_size, parallel.shard
    if not isinstance(fsdp, int) or isinstance(fsdp, bool) or fsdp < 1:
        raise InputSpecError(f"fsdp must be a whole number of ranks, 1 or more; got {fsdp!r}.")
    if fsdp == 1:
        return world_size, shard
    if (world_size, shard) not in ((1, "none"), (fsdp, "fsdp")):
        raise InputSpecError(
            f"--fsdp {fsdp} sets the ranks and the sharding itself; it cannot be combined with --world-size {world_size} "
            f"--shard {shard}: give one or the other."
        )
    return fsdp, "fsdp"


def _check_offload(offload: object, fsdp: bool, tp: int) -> None:
    """``offload`` is FSDP2's CPUOffloadPolicy, which only a run of FSDP2 over more than one rank has."""
    if not isinstance(offload, bool):
        raise InputSpecError(f"offload (--offload) must be True or False; got {offload!r}.")
    if offload and not fsdp:
        raise InputSpecError(
            "offload (--offload) is FSDP2's CPUOffloadPolicy, which keeps the sharded weights, their gradients and the "
            "optimizer state in host memory and copies each unit's shards to the device for its all-gather; without "
            "FSDP2 there are no shards to offload, so it needs fsdp=N (--fsdp N) with N > 1 too; pass fsdp=N, or drop offload."
        )
    if offload and tp > 1:
        raise InputSpecError(
            f"offload (--offload) with tensor parallel (tp={tp}) is not modelled yet: fxmem simulates FSDP2's CPUOffloadPolicy "
            "over a 1-D data-parallel mesh; drop tp or offload."
        )


def check_loop(loop: Loop) -> None:
    """The training loop's settings as ``Training`` takes them: a max_norm above 0, a known zero_grad place, a bool."""
    norm = loop.clip_grad_norm
    if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float)) or not 0 < norm < float("inf")):
        raise InputSpecError(
            f"clip_grad_norm (--clip-grad-norm) is the max_norm the loop passes to torch.nn.utils.clip_grad_norm_, a finite "
            f"number above 0 such as 1.0; got {norm!r}. Leave it out (None) for a loop that does not clip."
        )
    if loop.zero_grad not in ZERO_GRAD_PLACES:
        raise InputSpecError(
            f"zero_grad (--zero-grad) says where the loop calls optimizer.zero_grad(): 'after-step' (after optimizer.step(), "
            f"the default) or 'before-backward' (after the loss, just before loss.backward()); got {loop.zero_grad!r}."
        )
    if not isinstance(loop.keep_outputs, bool):
        raise InputSpecError(
            f"keep_outputs (--keep-outputs) must be True or False: whether the loop holds each step's output and loss "
            f"until the next step's replace them; got {loop.keep_outputs!r}."
        )


def amp_dtype(amp: str | None) -> torch.dtype | None:
    """The autocast dtype of ``--amp`` ("bf16", "fp16"; None: no autocast); anything else is an InputSpecError."""
    if amp is None:
        return None
    _check_choice("amp", amp, tuple(AMP_DTYPES))
    return AMP_DTYPES[amp]


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InputSpecError(f"unknown {name} {value!r}; use one of: {', '.join(choices)}.")


@contextlib.contextmanager
def _routed(target: Callable[[], AbstractContextManager[object]]) -> Iterator[None]:
    """The target's kernels with routing counts followed inside them (Note [Routed sizes])."""
    with target(), RoutedSizes():
        yield
