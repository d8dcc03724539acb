"""The planner's search: which levers make a training step fit the GPU, and which fitting configuration
trains fastest.

Each configuration of the slow levers (the precision recipe, the optimizer's implementation, the
optimizer where allowed, FSDP2's and tensor parallel's degrees on several GPUs, activation
checkpointing) is one ``analyze()`` with B symbolic; the fast lever, the micro-batch and the gradient
accumulation that reach the global batch, is read off its exact memory at every B. So every memory
figure here is fxmem's simulated step, not a rule of thumb.

Note [Ranking by throughput]
    Configurations that fit are ranked by estimated samples per second over all GPUs: the global
    batch divided by the time of one optimizer step, ``accumulation`` micro-steps each timed by the
    roofline bound (fxmem/cost/roofline.py) of the simulated step at the micro-batch, recomputed
    forward ops of a checkpointed model included since they are ops of that step. The bound is a
    lower bound, so the ranking says which configuration does the least work per sample at the best
    rates the GPU could give: a larger micro-batch amortizes the optimizer step and the weight reads,
    bf16 runs on faster tensor cores, recomputation costs its FLOPs. It ignores communication time
    (the GPUs' links are not modelled), so with several GPUs it favours no configuration for
    exchanging less. Ties keep the order of the levers' safer settings (fp32 before amp before mixed).

Note [What each configuration costs]
    A simulated configuration costs one ``analyze`` (a Llama-3.1-8B rank: 4 to 10 s here); the search
    spends that only where the answer could change. One trace serves every configuration of the same
    model and compute dtype (``shared_traces``). A configuration is ruled out unsimulated where a
    lower bound of its model state per GPU (fp32 weight, gradient and optimizer state of every
    parameter, divided among the ranks that shard it; amp and FSDP2's MixedPrecisionPolicy keep the
    same fp32 state) exceeds the budget: no micro-batch or checkpointing lowers it. The fused
    optimizer implementation changes only the optimizer step's own allocations (torch's
    ``_fused_adamw_`` updates in place; foreach makes per-group temporaries), so it is simulated only
    where torch's default peaks in its optimizer step at the first micro-batch that does not fit
    (micro-batch 1, or one more than its largest); elsewhere it cannot fit more. (Checkpointing could
    move a peak into the optimizer step; that case is not searched.) Checkpointing, the lever that
    costs the most time per step, is not tried for a configuration where another of its layout already
    fits without it; on a GPU, bf16 weights (FSDP2's MixedPrecisionPolicy) are simulated first. On a GPU, fp32 is simulated
    after bf16 autocast and FSDP2's MixedPrecisionPolicy, and only where neither fits with the same
    layout: a GPU with bf16 tensor cores runs its matmuls far faster than fp32 (H100: 989.5 against 67
    dense TFLOPS, 494.5 with TF32), and a bf16 step saves half the activation bytes, so an fp32 step
    could outrank it only by fitting a larger micro-batch, which takes autocast's bf16 weight copies
    outweighing the activations it halves. The plan says where it ruled fp32 out so; ``--allow`` without
    precision keeps fp32 alone. ``Plan.evaluated`` lists
    every configuration with its seconds or why it was ruled out; benchmarks/plan_speed.py prints them.

Note [The standard recipes]
    The setups practitioners copy are candidates beside the search's own, ranked by the same roofline
    so that the best plan is never slower than them by fxmem's measure. On several GPUs of a cuda
    target: torchtitan's Llama 3 recipe (torchtitan/models/llama3/train_configs/llama3_8b.toml:
    FSDP2 over every GPU with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``,
    selective per-op activation checkpointing of every block (fxmem/planner/recipes.py), AdamW fused,
    local batch 1). A recipe that does not fit, or that fxmem cannot simulate, is said in the plan.

Note [What would make it fit]
    Where nothing fits, the levers the user did not allow are tried on the configuration with the
    least state, in the order of what they cost the training: the fused optimizer implementation (no
    cost), bf16 precision (numerics), activation checkpointing (recomputation), sharding over the GPUs
    given (communication), FSDP2's CPU offload (host transfers every step, the optimizer on the CPU),
    and a leaner optimizer (Adafactor, 8-bit Adam, SGD with momentum: a different training). Each
    lever's first setting that fits is named with its total (``Plan.unlocks``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from torch import nn

from fxmem.errors import FxmemError, InputSpecError
from fxmem.inputs import InputSpecs, has_seq, parse_inputs
from fxmem.frontends.deepen import shared_traces
from fxmem.options import Hardware, Training, merge, spell, warn_at_caller
from fxmem.parallel import default_tp_plan
from fxmem.planner.checkpoint import CheckpointPlan, plan_checkpointing
from fxmem.planner.emit import apply_plan_to, compile_plan
from fxmem.report import Report
from fxmem.step.sharding import fsdp_units
from fxmem.frontends.huggingface import without_kv_cache

if TYPE_CHECKING:
    from fxmem.measure_ranks import RankMeasurement

__all__ = ["DEFAULT_LEVERS", "LEVERS", "Candidate", "Config", "Evaluation", "Plan", "Unlock", "Verification", "plan", "verify"]

LEVERS = ("batch", "precision", "optimizer-impl", "checkpoint", "shard", "offload", "optimizer", "compile")
"""What the planner may change (``--allow``); by default every one but FSDP2's CPU offload (it trades
the GPUs' memory for host transfers each step) and a leaner optimizer (it changes the training)."""
DEFAULT_LEVERS = LEVERS[:-3]
_PRECISIONS = (("fp32", None), ("amp", "bf16"))
"""(recipe, autocast dtype) in the order of their safety (Note [Ranking by throughput]): what plain
torch runs. Under FSDP2 its MixedPrecisionPolicy too (``_ENGINE_MIXED``); DeepSpeed's and Megatron's
bf16 weights with an fp32 master copy have no torch.optim form, so the planner does not propose them."""
_ENGINE_MIXED = ("mixed", None)
"""FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (fxmem/parallel)."""
_LEANER = {"adamw": ("adafactor", "adam8bit", "sgd-momentum"), "adam": ("adafactor", "adam8bit", "sgd-momentum")}
"""Leaner optimizers for each: Adafactor's factored second moment, 8-bit Adam's byte-wide moments,
SGD's one momentum buffer."""


@dataclass(frozen=True)
class Config:
    """One setting of the slow levers."""

    precision: str = "fp32"
    amp: str | None = None
    optimizer: str = "adamw"
    optimizer_impl: str | None = None
    fsdp: int = 1
    units: tuple[str, ...] = ()
    """The modules FSDP2 wraps before the root (each repeated block, its default)."""
    tp: int = 1
    tp_plan: tuple[tuple[str, str], ...] = ()
    """Tensor parallel's plan (the model's own)."""
    data_parallel: int = 1
    """Replicas that split the global batch (FSDP2's ranks, or plain data parallel's GPUs)."""
    checkpoint: CheckpointPlan | None = None
    offload: bool = False
    """FSDP2's ``CPUOffloadPolicy()``: the sharded weights, gradients and optimizer state in host memory,
    the optimizer step on the CPU."""
    compile: bool = False
    """``torch.compile(model)`` (default mode), its partitioner held to ``budget`` (fxmem/step/compiled.py)."""
    budget: float = 1.0
    """With ``compile``: ``torch._functorch.config.activation_memory_budget``."""

    def describe(self) -> str:
        precision = "bf16 MixedPrecisionPolicy" if self.precision == "mixed" and self.fsdp > 1 else self.precision
        parts = [precision + (f" ({self.amp} autocast)" if self.amp else ""), self.optimizer]
        parts += [f"{self.optimizer_impl}"] if self.optimizer_impl else []
        if self.fsdp > 1 or self.tp > 1:
            parts.append(
                " x ".join(p for p in (f"FSDP2 {self.fsdp}" if self.fsdp > 1 else "", f"TP {self.tp}" if self.tp > 1 else "") if p)
            )
        elif self.data_parallel > 1:
            parts.append(f"data parallel {self.data_parallel}")
        if self.offload:
            parts.append("CPU offload")
        if self.compile:
            parts.append("torch.compile" + (f" (activation_memory_budget {self.budget:g})" if self.budget != 1.0 else ""))
        if self.checkpoint is not None:
            kept = sum(1 for b in self.checkpoint.blocks if b.checkpointed)
            parts.append(f"checkpointing {kept} of {len(self.checkpoint.blocks)} blocks")
        return ", ".join(parts)


@dataclass(frozen=True)
class Candidate:
    """A configuration at its micro-batch: what one GPU holds, and how fast the job trains."""

    config: Config
    micro_batch: int
    accumulation: int
    total: int
    """The GPU's total at the micro-batch (the cuda target's device total: allocator, context, libraries)."""
    peak: int
    """The step's peak of live tensors."""
    recompute_flops: int
    step_seconds: float
    """Roofline lower bound of one micro-step."""
    state: int = 0
    """One GPU's model state (weights, gradients, optimizer state; a rank's share under the engines)."""
    recipe: str = ""
    """The published setup this candidate is (e.g. "torchtitan Llama-3.1-8B"), else empty: found by the search."""

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.config.data_parallel

    @property
    def samples_per_second(self) -> float:
        """Note [Ranking by throughput]."""
        return self.micro_batch * self.config.data_parallel / self.step_seconds if self.step_seconds else 0.0


@dataclass(frozen=True)
class Unlock:
    """A lever outside ``allow`` that makes the step fit: its name (as ``--allow`` spells it) and the
    fitting candidate it gives."""

    lever: str
    candidate: Candidate


@dataclass(frozen=True)
class Evaluation:
    """One configuration the search considered: simulated (``seconds`` of wall time), or ruled out
    without a simulation (``outcome`` says why)."""

    config: str
    outcome: str
    """"fits", "does not fit", "ruled out: ..." or "not evaluated: ..."."""
    seconds: float


@dataclass(frozen=True)
class Plan:
    """The fitting configurations, fastest first; where none fits, the closest and what it lacks."""

    model: str
    gpu: str
    target: str
    gpus: int
    memory: int
    global_batch: int | None
    fitting: tuple[Candidate, ...]
    closest: Candidate | None
    """Where nothing fits: the configuration with the smallest total at micro-batch 1."""
    skipped: tuple[str, ...] = ()
    """Configurations that could not be evaluated, each with the reason."""
    unlocks: tuple[Unlock, ...] = ()
    """Where nothing fits: configurations with a lever that was not allowed which do fit, cheapest change first."""
    evaluated: tuple[Evaluation, ...] = ()
    """Every configuration the search considered, in order, with what it cost to evaluate."""

    @property
    def where(self) -> str:
        return f"{self.gpus} x {self.gpu}" if self.target == "cuda" else "this machine's CPU"

    @property
    def best(self) -> Candidate | None:
        return self.fitting[0] if self.fitting else None

    def verdict(self) -> str:
        """One paragraph: what wins and why, or how far the closest falls short."""
        from fxmem.output.render import format_bytes

        on_gpu = self.target == "cuda"  # the roofline is a GPU's: a CPU plan claims no speed
        if self.best is not None:
            b = self.best
            speed = f"{b.samples_per_second:,.0f} samples/s estimated (roofline), " if on_gpu else ""
            why = f"{speed}{format_bytes(b.total)} of {format_bytes(self.memory)}"
            if len(self.fitting) > 1:
                runner = self.fitting[1]
                why += f"; next: {runner.config.describe()} at micro-batch {runner.micro_batch}"
                why += f", {runner.samples_per_second:,.0f} samples/s" if on_gpu else ""
            return f"Best: {b.config.describe()} at micro-batch {b.micro_batch} x {b.accumulation} accumulation: {why}."
        if self.closest is None:
            reasons = {why.split(": ", 1)[-1] for why in self.skipped}
            if len(reasons) == 1 and len(self.skipped) > 1:  # one cause, whatever the levers
                return f"Nothing could be evaluated ({len(self.skipped)} configurations): {reasons.pop()}"
            return "Nothing could be evaluated: " + "; ".join(self.skipped)
        c = self.closest
        rest = c.total - c.peak
        parts = f"state {format_bytes(c.state)}, the rest of the step's peak {format_bytes(c.peak - c.state)}"
        parts += f", the device's fixed costs and rounding {format_bytes(rest)}" if rest > 0 else ""
        advice = "allow more levers (--allow)"
        if c.state > self.memory // 2:
            more = "GPUs" if on_gpu else "processes (--gpus)"
            advice = f"shard the state over more {more} (it alone needs about {math.ceil(c.state / (self.memory // 2))} at half of each)"
        if self.unlocks:
            advice = "it would fit with " + "; or ".join(
                f"--allow ...,{u.lever}: {u.candidate.config.describe()} at micro-batch {u.candidate.micro_batch}, "
                f"{format_bytes(u.candidate.total)}" for u in self.unlocks
            )
        return (
            f"Nothing fits {self.where} ({format_bytes(self.memory)} {'each' if on_gpu else 'budget'}). Closest: {c.config.describe()} at micro-batch "
            f"1, {format_bytes(c.total)} ({parts}): {format_bytes(c.total - self.memory)} short; {advice}."
        )


@without_kv_cache(0)  # checkpointed layers run without a key/value cache, as transformers runs them
def plan(
    model: nn.Module,
    inputs: InputSpecs,
    *,
    training: Training | None = None,
    hardware: Hardware | None = None,
    gpu: str | None = None,
    target: str | None = None,
    gpus: int = 1,
    memory: int | None = None,
    global_batch: int | None = None,
    allow: Iterable[str] = DEFAULT_LEVERS,
    loss: str | None = None,
    optimizer: str | None = None,
    name: str | None = None,
    seq_len: int | None = None,
    max_micro_batch: int = 4096,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Search the levers ``allow`` for configurations whose step fits ``memory`` (default the GPU's)
    on each of ``gpus`` GPUs, at ``global_batch`` samples per optimizer step (default: the largest
    micro-batch that fits, no accumulation); rank them (Note [Ranking by throughput]). ``target``
    "cpu" plans for this machine's CPU (``memory`` then required), where ``verify`` checks a plan for real.
    ``training`` and ``hardware`` take the options as ``analyze`` does: ``Training``'s loss and
    optimizer (the levers choose its precision and implementation), and ``Hardware``'s target, gpu,
    ``device_memory`` (the same as ``memory``) and the rest of the device, which every configuration is simulated on.

    >>> from models_zoo import gpt2_small
    >>> spec = gpt2_small.build(test=True)
    >>> p = plan(spec.model, spec.inputs, loss=spec.loss, memory=2 * 2**30, global_batch=8, allow=["batch"])
    >>> p.best.micro_batch, p.best.accumulation   # the whole batch fits one 2 GiB step
    (8, 1)
    """
    from fxmem.api import analyze  # the planner drives the whole pipeline

    training = merge(training, Training, {"loss": loss, "optimizer": optimizer})
    _check_searched(training)
    hardware = merge(hardware, Hardware, {"gpu": gpu, "target": target, "device_memory": memory})
    loss, optimizer, gpu, target, memory = training.loss, training.optimizer, hardware.gpu, hardware.target, hardware.device_memory
    device = replace(hardware, device_memory=None)  # each step is replayed against the GPU's memory; ``memory`` is the plan's budget
    name = name or type(model).__name__
    levers = _levers(allow)
    _check_counts(gpus, global_batch, max_micro_batch)
    if target != "cuda" and memory is None:
        raise InputSpecError(f"model '{name}': planning for --target {target} needs the memory to fit in (--memory SIZE).")
    if target == "cuda" and memory is None:
        from fxmem.gpu.gpus import get_gpu

        memory = get_gpu(gpu).memory_bytes  # an unknown GPU is one error here, not one per configuration
    parse_inputs(inputs)  # a malformed input is one error here, not one per configuration
    seq_len = _applied_seq_len(inputs, seq_len)
    search = _Search(model, inputs, loss, name, seq_len, device, memory, global_batch, max_micro_batch, levers, progress or (lambda _: None))
    configs = list(_configs(model, levers, gpus, optimizer))
    recipes = search.recipes(gpus, optimizer)
    with shared_traces(), _torch_notices_muted():
        search.run(configs, recipes)
        unlocks = search.unlock(gpus, optimizer) if not search.fitting else ()
    fitting = sorted(search.fitting, key=lambda c: -c.samples_per_second)
    closest = None if fitting or not search.floors else min(search.floors, key=lambda c: c.total)
    return Plan(
        name, gpu, target, gpus, memory, global_batch, tuple(fitting), closest, tuple(search.skipped), unlocks, tuple(search.evaluated)
    )


class _Search:
    """One plan's search: each configuration simulated once (Note [What each configuration costs]),
    what fits, the floors of what does not, and every evaluation with its cost."""

    def __init__(
        self,
        model: nn.Module,
        inputs: InputSpecs,
        loss: str,
        name: str,
        seq_len: int | None,
        device: Hardware,
        budget: int,
        global_batch: int | None,
        cap: int,
        levers: frozenset[str],
        say: Callable[[str], None],
    ) -> None:
        self.model, self.inputs, self.loss, self.name, self.seq_len = model, inputs, loss, name, seq_len
        self.device, self.budget, self.global_batch, self.cap, self.levers, self.say = device, budget, global_batch, cap, levers, say
        self.fitting: list[Candidate] = []
        self.floors: list[Candidate] = []
        self.skipped: list[str] = []
        self.evaluated: list[Evaluation] = []
        self.defaults: dict[Config, Report] = {}
        """Each simulated configuration's report at torch's default optimizer implementation."""
        self.spent: list[float] = []

    def run(self, configs: list[Config], recipes: list[tuple[str, Callable[[], Config]]]) -> None:
        if self.device.target == "cuda":  # bf16 weights first, fp32 last (Note [What each configuration costs])
            configs = sorted(configs, key=lambda c: (c.precision == "fp32", c.precision == "amp"))
        total = len(configs) + len(recipes)
        for done, config in enumerate(configs):
            self._progress(done, total, config.describe())
            self._consider(config)
        if not self.floors and not self.fitting and configs:  # every one ruled out by its state: simulate the leanest for the closest
            self._simulate(min(configs, key=self._state_floor), force=True)
        for done, (label, make) in enumerate(recipes, start=len(configs)):
            self._progress(done, total, label)
            self._recipe(label, make)

    def _progress(self, done: int, total: int, what: str) -> None:
        left = ""
        if self.spent:
            per = sum(self.spent) / len(self.spent)
            left = f", about {max(1, round(per * (total - done)))} s left"
        self.say(f"configuration {done + 1} of {total}: {what}{left}")

    def _consider(self, config: Config) -> None:
        why = self._ruled_out(config)
        if why:
            self.evaluated.append(Evaluation(config.describe(), f"ruled out: {why}", 0.0))
            return
        self._simulate(config)

    def _ruled_out(self, config: Config) -> str:
        """Why ``config`` cannot fit without simulating it, or "" (Note [What each configuration costs])."""
        from fxmem.output.render import format_bytes

        floor = self._state_floor(config)
        if floor > self.budget:
            return f"its model state alone needs at least {format_bytes(floor)} per GPU, over {format_bytes(self.budget)}"
        if self._outpaced_in_bf16(config):
            return "a bf16 configuration of the same layout fits, and fp32 runs on the GPU's slower fp32 units (the roofline ranks it below)"
        default = self.defaults.get(replace(config, optimizer_impl=None)) if config.optimizer_impl is not None else None
        if default is not None and not _optimizer_bound(default, self):
            return "torch's default implementation already fits and its step peaks outside the optimizer step, which is all the implementation changes"
        return ""

    def _fits_unchecked(self, config: Config) -> bool:
        """Whether another configuration of ``config``'s layout already fits without checkpointing, the
        lever that costs the most time per step (Note [What each configuration costs])."""
        return any(c.config.checkpoint is None and not c.recipe and _layout(c.config) == _layout(config) for c in self.fitting)

    def _outpaced_in_bf16(self, config: Config) -> bool:
        """Whether ``config`` is fp32 on a GPU and the same layout already fits in bf16 (autocast or
        FSDP2's MixedPrecisionPolicy): its matmuls would run at the fp32 rate, several times slower."""
        if self.device.target != "cuda" or config.precision != "fp32":
            return False
        return any(c.config.precision != "fp32" and _layout(c.config) == _layout(config) and not c.recipe for c in self.fitting)

    def _state_floor(self, config: Config) -> int:
        """A lower bound of one GPU's model state under ``config``: every floating parameter's weight,
        gradient and optimizer state in fp32 (what amp and FSDP2's MixedPrecisionPolicy keep, and what
        plain fp32 keeps), divided among the ranks that shard it. Padding and buffers only add."""
        from fxmem.step.state import get_optimizer, state_bytes

        state = state_bytes(self.model, optimizer=get_optimizer(config.optimizer), optimizer_impl=config.optimizer_impl, target=self.device.target)
        if config.offload:
            return 0
        return (state.weights + state.gradients + state.optimizer) // (config.fsdp * config.tp)

    def _simulate(self, config: Config, force: bool = False, checkpoint: bool | None = None) -> None:
        """Simulate ``config`` and keep what fits; ``force`` skips checkpointing (the closest is wanted),
        ``checkpoint`` overrides whether the lever is allowed."""
        start = time.perf_counter()
        try:
            report = _viewed(self._analyze(self.model, config), config)
        except FxmemError as e:
            self.skipped.append(f"{config.describe()}: {e}")
            self.evaluated.append(Evaluation(config.describe(), f"not evaluated: {e}", time.perf_counter() - start))
            return
        if config.optimizer_impl is None:
            self.defaults[config] = report
        best, floor = _fit(report, config, self.budget, self.global_batch, self.cap)
        self.floors.append(floor)
        allowed = ("checkpoint" in self.levers and not self._fits_unchecked(config)) if checkpoint is None else checkpoint
        allowed = allowed and not config.compile  # a compiled step with checkpointing is not simulated yet
        if best is None and allowed and floor.state < self.budget and not force:  # checkpointing cannot shrink the state
            best, checkpointed = self._with_checkpointing(report, config)
            self.floors += [checkpointed] if checkpointed is not None else []
        if best is not None:
            self.fitting.append(best)
        seconds = time.perf_counter() - start
        self.spent.append(seconds)
        self.evaluated.append(Evaluation((best or floor).config.describe(), "fits" if best is not None else "does not fit", seconds))

    def _analyze(self, model: nn.Module, config: Config) -> Report:
        from fxmem.api import analyze

        return analyze(
            model, self.inputs, loss=self.loss, optimizer=config.optimizer, batch=1, hardware=self.device, amp=config.amp,
            precision=config.precision, optimizer_impl=config.optimizer_impl, fsdp=config.fsdp, tp=config.tp, name=self.name,
            seq_len=self.seq_len, fsdp_units=config.units if config.fsdp > 1 else None,
            tp_plan=dict(config.tp_plan) if config.tp > 1 else None, offload=config.offload, compile=config.compile,
            activation_memory_budget=config.budget,
        )  # fmt: skip

    def _with_checkpointing(self, report: Report, config: Config) -> tuple[Candidate | None, Candidate | None]:
        """The same configuration with activation checkpointing chosen (fxmem/planner/checkpoint.py) so that
        micro-batch 1 fits. The saved activations' budget starts as what the step's total exceeds the
        budget by, taken off its saved activations; the checkpointed model is simulated again (its whole
        step, recomputation included), and where its total still exceeds the budget (the peak moved to
        where recomputation runs) the saved budget shrinks by that much, a few times at most."""
        blocks = list(fsdp_units(self.model))  # each repeated block (else each top-level child), as FSDP2's units
        if not blocks or config.tp > 1:  # tensor parallel splits what each op saves: the chooser sees whole ops
            return None, None
        room, floor = report.activation_bytes(1) - (report.step_bytes(1) - self.budget), None
        for _ in range(_ATTEMPTS):
            if room <= 0:
                break
            try:
                chosen = plan_checkpointing(
                    self.model, self.inputs, blocks, budget=room, batch=1, loss=self.loss, name=self.name, seq_len=self.seq_len
                )
            except InputSpecError:  # below what checkpointing every block keeps
                break
            again = self._analyze(compile_plan(chosen)(copy.deepcopy(self.model)), config)
            best, floor = _fit(again, replace(config, checkpoint=chosen), self.budget, self.global_batch, self.cap)
            if best is not None:
                return best, floor
            room = chosen.saved_at_batch - (again.step_bytes(1) - self.budget)
        return None, floor

    def _recipe(self, label: str, make: Callable[[], Config]) -> None:
        """A published setup at its own micro-batch (Note [The standard recipes]): in the ranking where it fits."""
        from fxmem.output.render import format_bytes

        start = time.perf_counter()
        try:
            config = make()
            model = compile_plan(config.checkpoint)(copy.deepcopy(self.model)) if config.checkpoint is not None else self.model
            report = self._analyze(model, config)
        except FxmemError as e:
            self.skipped.append(f"{label}: {e}")
            self.evaluated.append(Evaluation(label, f"not evaluated: {e}", time.perf_counter() - start))
            return
        candidate = replace(_candidate(report, config, 1, _accumulation(self.global_batch, config, 1)), recipe=label)
        fits = report.fits(1, self.budget)
        if fits:
            self.fitting.append(candidate)
        else:
            self.skipped.append(
                f"{label}: {config.describe()} at micro-batch 1 needs {format_bytes(candidate.total)} per GPU, over {format_bytes(self.budget)}"
            )
        seconds = time.perf_counter() - start
        self.spent.append(seconds)
        self.evaluated.append(Evaluation(label, "fits" if fits else "does not fit", seconds))

    def recipes(self, gpus: int, optimizer: str) -> list[tuple[str, Callable[[], Config]]]:
        """The published setups that apply (Note [The standard recipes]), each made when it is evaluated."""
        blocks = fsdp_units(self.model)
        if self.device.target != "cuda" or gpus < 2 or "shard" not in self.levers or not blocks or not _has_linears(self.model, blocks):
            return []

        def torchtitan() -> Config:
            from fxmem.planner.recipes import op_sac_plan

            sac = op_sac_plan(
                self.model, self.inputs, blocks, batch=1, loss=self.loss, name=self.name, seq_len=self.seq_len, target=self.device.target
            )
            return Config("mixed", None, optimizer, "fused", gpus, blocks, data_parallel=gpus, checkpoint=sac)

        return [(TORCHTITAN, torchtitan)]

    def unlock(self, gpus: int, optimizer: str) -> tuple[Unlock, ...]:
        """Where nothing fits: for each lever not allowed, cheapest first (``_UNLOCK_ORDER``), the
        first of its settings on the leanest configuration that fits (Note [What would make it fit])."""
        base = min(self.floors, key=lambda c: c.state).config if self.floors else Config()
        floors = list(self.floors)  # the closest is among the allowed configurations only
        found: list[Unlock] = []
        for lever in _UNLOCK_ORDER:
            if lever in self.levers:
                continue
            for config in _variants(self.model, base, lever, gpus, optimizer):
                if self._ruled_out(replace(config, optimizer_impl=None)):
                    continue
                before = len(self.fitting)
                self.say(f"what would fit: {config.describe()} ({lever})")
                self._simulate(config, checkpoint=lever == "checkpoint" or None)
                if len(self.fitting) > before:
                    found.append(Unlock(lever, self.fitting.pop()))
                    break
        self.floors = floors
        return tuple(found)


TORCHTITAN = "torchtitan Llama 3"
"""FSDP2 over every GPU with bf16 weights and fp32 reduction, per-op selective checkpointing of every
block, AdamW fused, local batch 1 (torchtitan/models/llama3/train_configs/llama3_8b.toml)."""

_UNLOCK_ORDER = ("optimizer-impl", "compile", "precision", "checkpoint", "shard", "offload", "optimizer")
"""Levers in the order of what they cost the training (Note [What would make it fit])."""


def _variants(model: nn.Module, base: Config, lever: str, gpus: int, optimizer: str) -> list[Config]:
    """``base`` with one more ``lever`` pulled, in that lever's order of preference."""
    if lever == "optimizer-impl":
        return [replace(base, optimizer_impl=impl) for impl in _impls(frozenset({lever}), base.optimizer) if impl is not None]
    if lever == "precision":
        return [replace(base, precision="amp", amp="bf16")] + ([replace(base, precision="mixed", amp=None)] if base.fsdp > 1 else [])
    if lever == "checkpoint":
        return [base]  # its simulation checkpoints where micro-batch 1 does not fit (``_Search._simulate``)
    if lever == "shard" and gpus > 1 and base.fsdp == 1:
        return [replace(base, fsdp=gpus, units=fsdp_units(model), data_parallel=gpus)]
    if lever == "offload" and base.fsdp > 1 and base.tp == 1:
        return [replace(base, offload=True)]
    if lever == "compile" and _compilable(base):
        return [replace(base, compile=True, budget=b) for b in _BUDGETS]
    if lever == "optimizer":
        return [replace(base, optimizer=o, optimizer_impl=None) for o in _LEANER.get(optimizer, ()) if o != base.optimizer]
    return []


def _optimizer_bound(report: Report, search: _Search) -> bool:
    """Whether another optimizer implementation could change what fits: the default one's step peaks in
    the optimizer step at micro-batch 1 where that does not fit, else at one sample more than its
    largest fitting micro-batch."""
    from fxmem.results import Phase

    if not report.fits(1, search.budget):
        return report.peak(1).phase is Phase.OPTIMIZER
    largest = report.max_batch(search.budget, scan=0)
    if largest is None or largest >= search.cap:
        return False
    return report.peak(largest + 1).phase is Phase.OPTIMIZER


@contextlib.contextmanager
def _torch_notices_muted() -> Iterator[None]:
    """torch's own notices, raised by the fake runs the search makes, not by the user's code: pickling a
    pytree spec in a graph copy (a FutureWarning about ``LeafSpec``) and FSDP2's caution about a unit
    returning a view, which a flattened graph's units do by construction. The user's model never ran."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*", category=FutureWarning)
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)
        yield


def _check_searched(training: Training) -> None:
    """The planner chooses the precision and the optimizer's implementation itself (its levers), and
    simulates the default training loop (no clipping, zero_grad after the step, outputs dropped)."""
    default = Training()
    for field in ("optimizer_impl", "precision", "amp", "param_dtype"):
        if getattr(training, field) != getattr(default, field):
            raise InputSpecError(
                f"plan() searches the precision and the optimizer's implementation itself (allow=); Training.{field}="
                f"{getattr(training, field)!r} would fix it: leave it at its default and allow the levers to try."
            )
    for field in ("clip_grad_norm", "zero_grad", "keep_outputs"):
        if getattr(training, field) != getattr(default, field):
            raise InputSpecError(
                f"plan() searches with the default training loop so far; Training.{field}={getattr(training, field)!r} is not "
                "searched: leave it at its default, and check the chosen configuration with fxmem.analyze(..., training=Training(...))."
            )


def _levers(allow: Iterable[str]) -> frozenset[str]:
    chosen = frozenset(allow)
    unknown = sorted(chosen - set(LEVERS))
    if unknown:
        raise InputSpecError(f"--allow '{unknown[0]}' is not a lever; choose among {', '.join(LEVERS)}.")
    return chosen


def _check_counts(gpus: int, global_batch: int | None, max_micro_batch: int) -> None:
    for option, value in (("--gpus", gpus), ("--global-batch", global_batch), ("max_micro_batch", max_micro_batch)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InputSpecError(f"{option} must be a whole number, 1 or more; got {value!r}.")
    if global_batch is not None and global_batch % 1:
        raise InputSpecError(f"--global-batch must be whole; got {global_batch!r}.")


def _configs(model: nn.Module, levers: frozenset[str], gpus: int, optimizer: str) -> Iterator[Config]:
    """The slow levers' settings to simulate, safest first; with ``compile``, each one-GPU layout compiled
    too, at torch's default partitioner budget and at the lower ones of ``_BUDGETS``."""
    optimizers = [optimizer, *(_LEANER.get(optimizer, ()) if "optimizer" in levers else ())]
    for parallel in _parallel_layouts(model, levers, gpus):
        precisions = (*_PRECISIONS, *((_ENGINE_MIXED,) if parallel.fsdp > 1 else ())) if "precision" in levers else _PRECISIONS[:1]
        for precision, amp in precisions:
            for opt in optimizers:
                for impl in _impls(levers, opt):
                    config = replace(parallel, precision=precision, amp=amp, optimizer=opt, optimizer_impl=impl)
                    yield config
                    if "compile" in levers and _compilable(config):
                        yield from (replace(config, compile=True, budget=b) for b in _BUDGETS)


_BUDGETS = (1.0, 0.5)
"""The partitioner budgets a compiled configuration is tried at: torch's default (1.0, its min-cut), and
0.5, halfway between that and checkpointing the whole compiled region (0.0), the least recomputation
that stays under it chosen by a knapsack (``activation_memory_budget`` in torch/_functorch/config.py)."""


def _compilable(config: Config) -> bool:
    """Whether fxmem simulates ``config`` compiled: one GPU's layout (or plain data parallel), no checkpointing."""
    return config.fsdp == 1 and config.tp == 1 and not config.offload and config.checkpoint is None


class _CompiledView:
    """A report read through its compiled step (``Report.compiled``): what a configuration with
    torch.compile holds, fits and peaks at; its step time is the eager roofline's (a lower bound either way)."""

    def __init__(self, report: Report) -> None:
        self.report, self.compiled = report, report.compiled

    def max_batch(self, budget: int, *, scan: int = 0) -> int | None:
        return self.compiled.max_batch(budget, self.report.least_batch)[0]

    def fits(self, batch: int, budget: int) -> bool:
        return bool(self.compiled.steps.fits(batch, budget))

    def step_bytes(self, batch: int) -> int:
        return self.compiled.device_bytes(batch)

    def peak(self, batch: int) -> Any:
        return self.compiled.peak(batch)

    def __getattr__(self, name: str) -> Any:  # the rest (step_time, activation_bytes, ...) as the report has it
        return getattr(self.report, name)


def _viewed(report: Report, config: Config) -> Report:
    """``report`` as ``config`` runs it: through its compiled step where it is compiled."""
    return _CompiledView(report) if config.compile else report  # type: ignore[return-value]


def _parallel_layouts(model: nn.Module, levers: frozenset[str], gpus: int) -> Iterator[Config]:
    """On one GPU, one layout; on several, plain data parallel, FSDP2 over all, and FSDP2 x tensor
    parallel for each degree that divides the GPUs where the model has a plan."""
    if gpus == 1:
        yield Config()
        return
    yield Config(data_parallel=gpus)
    if "shard" not in levers:
        return
    units = fsdp_units(model)
    yield Config(fsdp=gpus, units=units, data_parallel=gpus)
    if "offload" in levers:
        yield Config(fsdp=gpus, units=units, data_parallel=gpus, offload=True)
    tp_plan = default_tp_plan(model)
    if tp_plan is None:
        return
    for tp in (2, 4, 8):
        if tp < gpus and gpus % tp == 0:  # FSDP2 over the rest: every parameter a DTensor, so any optimizer implementation
            yield Config(fsdp=gpus // tp, units=units, tp=tp, tp_plan=tuple(tp_plan.items()), data_parallel=gpus // tp)


def _impls(levers: frozenset[str], optimizer: str) -> tuple[str | None, ...]:
    """torch's default, and the fused implementation where the lever is allowed and the optimizer has
    one (it keeps no per-parameter temporaries, which matters where the peak is the optimizer's)."""
    from fxmem.step.state import get_optimizer

    fused = "optimizer-impl" in levers and "fused" in get_optimizer(optimizer).impls
    return (None, "fused") if fused else (None,)


def _fit(report: Report, config: Config, budget: int, global_batch: int | None, cap: int) -> tuple[Candidate | None, Candidate]:
    """The configuration's best micro-batch under ``budget`` (None if B=1 does not fit), and its B=1 candidate."""
    floor = _candidate(report, config, 1, _accumulation(global_batch, config, 1))
    largest = report.max_batch(budget, scan=0)  # a batch that fits with the next failing: enough to rank configurations
    if largest is None:
        if not report.fits(1, budget):
            return None, floor
        largest = cap  # nothing grows with B: any batch fits
    per_replica = None if global_batch is None else math.ceil(global_batch / config.data_parallel)
    micro = min(largest, cap, per_replica or cap)
    if per_replica is not None:  # a micro-batch that divides the replica's share, so every step is whole
        micro = max(d for d in range(1, micro + 1) if per_replica % d == 0)
    return _candidate(report, config, micro, _accumulation(global_batch, config, micro)), floor


def _accumulation(global_batch: int | None, config: Config, micro: int) -> int:
    return 1 if global_batch is None else max(1, math.ceil(global_batch / (config.data_parallel * micro)))


def _candidate(report: Report, config: Config, micro: int, accumulation: int) -> Candidate:
    recompute = config.checkpoint.recompute_flops if config.checkpoint is not None else 0
    peak = report.peak(micro)
    return Candidate(
        config, micro, accumulation, report.step_bytes(micro), peak.bytes, recompute, report.step_time(micro).seconds, peak.state
    )


_ATTEMPTS = 4
"""How many times the saved budget is shrunk before checkpointing is given up for a configuration."""


def _layout(config: Config) -> tuple[object, ...]:
    """What two configurations must share to be compared lever by lever: sharding, offload, optimizer."""
    return (config.fsdp, config.tp, config.data_parallel, config.offload, config.optimizer)


def _has_linears(model: nn.Module, blocks: tuple[str, ...]) -> bool:
    """Whether the repeated blocks hold linear layers, which a per-op recipe is about."""
    return any(isinstance(m, nn.Linear) for b in blocks for m in model.get_submodule(b).modules())


@dataclass(frozen=True)
class Verification:
    """A candidate applied to the real model and one real step measured on the CPU at its micro-batch."""

    candidate: Candidate
    measured_peak: int
    """The real step's peak (torch.profiler, fxmem.measure.measure_peak), steady step."""
    measured_saved: int | None
    """The real bytes saved for backward where the candidate checkpoints (fxmem/planner/verify.py), else None."""
    ranks: tuple[RankMeasurement, ...] = ()
    """A sharded candidate's real ranks (``measured_peak`` is the highest peak), else empty."""

    @property
    def peak_error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.candidate.peak - self.measured_peak) / self.measured_peak if self.measured_peak else 0.0


def _applied_seq_len(inputs: InputSpecs, seq_len: int | None) -> int | None:
    """``seq_len`` where an input has a symbolic sequence axis S to evaluate it at; else None, said once
    here, where every configuration's analysis would repeat the note (analyze's ``_warn_unused``)."""
    if seq_len is None:
        return None
    specs = parse_inputs(inputs)
    if has_seq(specs):
        return seq_len
    warn_at_caller(
        f"{spell('seq_len', seq_len)} has no effect: no input has a symbolic sequence axis S "
        f"({', '.join(map(str, specs))}); write S in the shape, e.g. B,S:int64, or drop {spell('seq_len')}."
    )
    return None


@without_kv_cache(1)  # checkpointed layers run without a key/value cache, as transformers runs them
def verify(candidate: Candidate, model: nn.Module, inputs: InputSpecs, *, loss: str = "sum", seq_len: int | None = None) -> Verification:
    """Apply ``candidate`` to the real model (its checkpointing through the emitted code, its
    precision through autocast, its optimizer and implementation, torch.compile) and measure one real steady step
    on this machine's CPU: the proof a plan made with ``target="cpu"`` is held to. A sharded candidate
    (FSDP2, tensor parallel) runs as that many real gloo processes (fxmem/measure_ranks.py)."""
    from fxmem.measure import materialize, measure_peak
    from fxmem.planner.verify import measure_plan

    config = candidate.config
    if config.fsdp > 1 or config.tp > 1:
        return _verify_ranks(candidate, model, inputs, loss, seq_len)
    if config.data_parallel > 1:
        raise InputSpecError(
            f"verify cannot run {config.describe()}: plain data parallel's gradient buckets are not simulated, so there is "
            "nothing to hold a real run to; plan with --allow shard (FSDP2) or verify on one GPU (--gpus 1)."
        )
    real = materialize(model)
    if config.checkpoint is not None:
        real = compile_plan(config.checkpoint)(copy.deepcopy(real))
    measured = measure_peak(
        real, inputs, candidate.micro_batch, loss=loss, optimizer=config.optimizer, seq_len=seq_len, amp=config.amp,
        optimizer_impl=config.optimizer_impl, compile=config.compile, activation_memory_budget=config.budget,
    )  # fmt: skip
    saved = None
    if config.checkpoint is not None:
        saved = measure_plan(model, inputs, config.checkpoint, loss=loss, seq_len=seq_len).saved
    return Verification(candidate, measured.bytes, saved)


def _verify_ranks(candidate: Candidate, model: nn.Module, inputs: InputSpecs, loss: str, seq_len: int | None) -> Verification:
    """The sharded candidate as real ranks: FSDP2 over ``fsdp`` and tensor parallel over ``tp`` gloo
    processes, composed as the simulation composed them (``apply_plan``), each rank measured."""
    from fxmem.measure_ranks import measure_ranks

    config = candidate.config
    unsupported = [
        what
        for what, present in (("autocast", config.amp is not None), (f"the {config.optimizer_impl} optimizer", config.optimizer_impl is not None))
        if present
    ]  # fmt: skip
    if unsupported:
        raise InputSpecError(
            f"verify cannot run {config.describe()} on real ranks yet: {', '.join(unsupported)} under FSDP2 or tensor "
            "parallel is not applied by fxmem measure; plan with --allow batch,shard,precision,checkpoint to verify a sharded plan."
        )
    prepare = None if config.checkpoint is None else functools.partial(apply_plan_to, config.checkpoint)  # each rank applies it
    ranks = measure_ranks(
        model, inputs, candidate.micro_batch, fsdp=config.fsdp, units=config.units, tp=config.tp, tp_plan=dict(config.tp_plan) or None,
        loss=loss, optimizer=config.optimizer, seq_len=seq_len, mixed=config.precision == "mixed", prepare=prepare,
    )  # fmt: skip
    saved = ranks[0].saved if config.checkpoint is not None else None
    return Verification(candidate, max(r.peak for r in ranks), saved, ranks)
