"""The truth that predictions are tested against: real runs on the CPU.

``measure`` materializes the weights with random values, feeds random floats and zero integers, and
records every tensor autograd saves with ``saved_tensors_hooks``, each storage once, leaving out
parameters, buffers, inputs and targets. It does this twice, independently:

- eagerly, by calling the model itself, without fx: the total a user can reproduce by hand;
- through the traced graph, with the same recorder the fake pass uses: the per-node split.

``measure_peak`` runs one whole real training step under ``torch.profiler`` and reads the step's
peak from the profiler's raw allocation events. See Note [Reading the peak from the profiler].

Note [Reading the peak from the profiler]
    With ``profile_memory=True`` the CPU allocator reports every allocation and free to the profiler,
    kernel-internal buffers included. The events only see what changes during the step, so the peak is
    the bytes alive when the step starts (each storage of the weights, buffers, batch, target and, in a
    steady step, optimizer state, counted once) plus the highest running sum of the events. The raw
    events are read rather than the exported memory timeline, which merges events within a
    microsecond and can hide a short spike. Each phase runs inside a ``record_function`` range, and an
    allocation belongs to the phase whose range contains it. The category split comes from the
    profiler's own memory profile (``MemoryProfileTimeline``), replayed up to the peak.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import types
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from fxmem.engine.account import node_bytes_at
from fxmem.engine.binding import storage_parts
from fxmem.engine.capture import record_real
from fxmem.engine.losses import Loss, get_loss
from fxmem.engine.recompute import selective_caches
from fxmem.errors import CaptureError, FxmemError, InputSpecError
from fxmem.frontends.adapters import forward_module
from fxmem.frontends.huggingface import prepared_for_training
from fxmem.frontends.tracing import trace_model
from fxmem.inputs import InputSpec, InputSpecs, call_arguments, check_batch, make_input, parse_inputs, tensors_of
from fxmem.options import Training, merge
from fxmem.results import Loop, Phase
from fxmem.rules.nf4 import stored_tensors
from fxmem.rules.optimizers import OptimizerRule
from fxmem.step.state import get_optimizer
from fxmem.step.training import amp_dtype, check_loop

__all__ = ["Measurement", "PeakMeasurement", "materialize", "measure", "measure_peak"]


@dataclass(frozen=True)
class Measurement:
    """Measured activation bytes at one batch size: in total (eager run) and per fx node."""

    batch: int
    total: int
    nodes: dict[str, int]

    @property
    def graph_total(self) -> int:
        """The per-node bytes summed; equals ``total`` unless tracing changed what the model saves."""
        return sum(self.nodes.values())


def measure(
    model: nn.Module,
    inputs: InputSpecs,
    batch: int,
    *,
    training: Training | None = None,
    loss: str | None = None,
    seed: int = 0,
    leaf_types: tuple[type, ...] = (),
    frontend: str = "auto",
    seq_len: int | None = None,
    compile: bool = False,
    activation_memory_budget: float = 1.0,
) -> Measurement:
    """Run the model for real on the CPU at ``batch`` and measure the activation bytes saved for backward.

    ``leaf_types`` and ``frontend`` must be the ones given to ``analyze`` so that the per-node split uses
    the same graph. ``training`` (or the plain keyword ``loss``) gives the loss, as to ``analyze``; its
    other fields shape the step's state, not what the forward saves in fp32, and must keep their defaults.
    ``compile`` runs ``torch.compile(model)`` (default mode, Inductor's C++ backend) instead, compiled
    by one forward and backward beforehand; its saved bytes have no per-node split (Inductor's kernels
    are not the graph's nodes), so ``nodes`` holds the total under "(compiled)"; ``activation_memory_budget``
    is the partitioner's, as ``torch._functorch.config`` sets it.
    """
    check_batch(batch)
    loss = _measured(merge(training, Training, {"loss": loss}), "measure", ("loss",)).loss
    specs, loss_fn = parse_inputs(inputs), get_loss(loss)
    torch.manual_seed(seed)
    real = materialize(model).train()
    if compile:
        with _real_run(model, batch, "compiled CPU", real=real):
            runner = _compiled_for_real(real, specs, loss_fn, batch, seq_len, budget=activation_memory_budget)
            total = _eager_total(runner, specs, loss_fn, batch, seq_len, state=real)
        return Measurement(batch, total, {"(compiled)": total})
    with _real_run(model, batch, real=real):
        total = _eager_total(real, specs, loss_fn, batch, seq_len)
    traced = trace_model(forward_module(real), specs, leaf_types=leaf_types, frontend=frontend)  # Note [A bare PeftModel]
    capture = record_real(traced.gm, specs, loss=loss_fn, batch=batch, seq=seq_len)
    return Measurement(batch, total, node_bytes_at(capture))


@contextlib.contextmanager
def _real_run(model: nn.Module, batch: int, where: str = "CPU", *, real: nn.Module | None = None) -> Iterator[None]:
    """A real run's failure as one clear error instead of torch's traceback. A Hugging Face model runs
    with the configuration its trace had (``real``'s configs edited for training: no key/value cache;
    Note [A Hugging Face model passed as an object]): the measured step is the step fxmem predicts."""
    try:
        with prepared_for_training(real if real is not None else model):
            yield
    except FxmemError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise CaptureError(
            f"model '{type(model).__name__}': the real {where} run at B={batch} failed ({type(e).__name__}: {first}); "
            "fake tensors cannot see this (they carry shapes, not values), so check the --input shapes and values "
            "the model expects (token ids are zeros, sequence lengths within its context)."
        ) from e


def materialize(model: nn.Module) -> nn.Module:
    """A CPU copy with real weights if any tensor is on the meta device, else the model itself.

    ``to_empty`` gives every module its own new parameter, which would untie tied weights (an LM head
    sharing the embedding matrix); the ties are restored afterwards, so the copy has the same state.
    """
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return model
    real = copy.deepcopy(model)
    ties = _parameter_slots(real)
    real.to_empty(device="cpu")
    _retie(real, ties)
    with torch.no_grad():
        for b in real.buffers():
            b.zero_()
        for p in real.parameters():
            p.normal_(0.0, 0.02)
        for m in real.modules():
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()
    return real


def _parameter_slots(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (module, attribute) slot that holds each parameter object, by the object's id."""
    slots: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                slots[id(p)].append((module, name))
    return slots


def _retie(model: nn.Module, slots: dict[int, list[tuple[nn.Module, str]]]) -> None:
    for places in slots.values():
        first_module, first_name = places[0]
        for module, name in places[1:]:
            module._parameters[name] = first_module._parameters[first_name]


def _compiled_for_real(
    model: nn.Module, specs: Sequence[InputSpec], loss: Loss, batch: int, seq: int | None, device: str = "cpu", budget: float = 1.0
) -> nn.Module:
    """``torch.compile(model)``, compiled by one forward and backward at ``batch`` (torch's default
    mode compiles for the first call's shapes), its gradients dropped again; the partitioner held to
    ``budget`` (``activation_memory_budget``). Dynamo's caches are reset first: an earlier model's
    compiled code must not serve this one."""
    torch._dynamo.reset()
    compiled = torch.compile(model)
    tensors = [_to(make_input(s, batch, seq), device) for s in specs]
    args, kwargs = call_arguments(specs, tensors)
    with _quiet_stderr(), torch._functorch.config.patch(activation_memory_budget=budget):
        output = loss.select(compiled(*args, **kwargs), type(model).__name__)
        value = loss.compute(output, loss.make_target(output))
        if value.requires_grad:
            value.backward()
    model.zero_grad(set_to_none=True)
    return compiled


def _eager_total(
    model: nn.Module, specs: Sequence[InputSpec], loss: Loss, batch: int, seq: int | None = None, *, state: nn.Module | None = None
) -> int:
    """Saved activation bytes of ``model(...)`` plus the loss, without fx: the independent total.
    ``state``: the module whose parameters and buffers are left out, where ``model`` wraps it."""
    tensors = [make_input(s, batch, seq) for s in specs]
    args, kwargs = call_arguments(specs, tensors)
    held = state if state is not None else model
    excluded = {StorageWeakRef(t.untyped_storage()) for t in [*held.parameters(), *held.buffers(), *tensors_of(specs, tensors)]}
    seen: dict[StorageWeakRef, int] = {}
    alive: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        alive.append(t)
        for part in storage_parts(t):  # See Note [A sparse tensor's storages] in fxmem/engine/binding.py
            seen.setdefault(StorageWeakRef(part.untyped_storage()), part.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), selective_caches() as caches:
        out = model(*args, **kwargs)
        output = loss.select(out, type(held).__name__)
        target = loss.make_target(output)
        if target is not None:
            excluded.add(StorageWeakRef(target.untyped_storage()))
        loss.compute(output, target)
    for t in (t for cache in caches for t in cache.new()):  # what a selective checkpoint's policy kept for backward
        pack(t)
    return sum(n for key, n in seen.items() if key not in excluded)


@dataclass(frozen=True)
class PeakMeasurement:
    """The measured peak of one real training step on the CPU (see Note [Reading the peak from the profiler])."""

    batch: int
    first_step: bool
    bytes: int
    phase: Phase
    baseline: int
    """Bytes alive when the step starts."""
    breakdown: dict[str, int]
    """Live bytes at the peak by the profiler's own categories (``"unknown"`` where it has none)."""
    requested: int | None = None
    """On a GPU: the peak of the caching allocator's requested bytes (``requested_bytes.all.peak``), the
    same step's figure before the allocator's rounding; ``bytes`` is ``max_memory_allocated``."""
    phases: dict[Phase, int] = field(default_factory=dict)
    """The highest bytes reached within each phase: on a GPU ``max_memory_allocated`` read per phase, on
    the CPU the baseline plus the profiler's running sum at its highest inside the phase's range."""


_PHASE_RANGE = "fxmem.phase::"  # not "fxmem::", the namespace of fxmem's own ops (fxmem::cache_cat), which the profiler lists too


def measure_peak(
    model: nn.Module,
    inputs: InputSpecs,
    batch: int,
    *,
    training: Training | None = None,
    loss: str | None = None,
    optimizer: str | None = None,
    first_step: bool = False,
    seed: int = 0,
    seq_len: int | None = None,
    device: str = "cpu",
    amp: str | None = None,
    optimizer_impl: str | None = None,
    compile: bool = False,
    activation_memory_budget: float = 1.0,
) -> PeakMeasurement:
    """Run one real training step at ``batch`` and measure its peak.

    The step is ``out = model(batch)``, the loss, ``backward()``, ``optimizer.step()`` and
    ``zero_grad(set_to_none=True)``, or the loop ``training`` describes (``Training.clip_grad_norm``,
    ``zero_grad`` and ``keep_outputs``: ``_real_step``). A steady step (``first_step=False``) is preceded by one
    real step outside the measurement, which creates the optimizer state of every parameter that
    receives a gradient (and of no other: a layer that backward never reaches has none), and leaves
    what the loop holds from it (gradients, outputs) alive into the measured step. On the CPU the peak
    comes from torch.profiler (Note [Reading the peak from the profiler]); with ``device="cuda"`` from
    ``torch.cuda.max_memory_allocated``, read per phase. ``amp`` ("bf16"/"fp16") runs the forward and
    the loss under ``torch.autocast`` on ``device``; ``optimizer_impl`` picks the optimizer's
    implementation ("foreach", "fused", "for-loop"; None: torch's default). ``training`` gives these
    as ``analyze`` takes them (``Training(loss=..., optimizer=..., amp=..., optimizer_impl=...)``);
    a real run has no ``precision`` recipe or ``param_dtype`` to apply, so those keep their defaults.
    ``compile`` runs the step with ``torch.compile(model)`` (default mode), compiled beforehand at
    ``batch`` outside the measurement (``activation_memory_budget`` as for ``measure``); the loss and
    the optimizer stay eager, as users write them.
    """
    check_batch(batch)
    keywords = {"loss": loss, "optimizer": optimizer, "amp": amp, "optimizer_impl": optimizer_impl}
    setup = _measured(merge(training, Training, keywords), "measure_peak", (*keywords, *_LOOP_FIELDS))
    loss, optimizer, amp, optimizer_impl = setup.loss, setup.optimizer, setup.amp, setup.optimizer_impl
    loop, carried = _loop(setup)
    specs, loss_fn, rule = parse_inputs(inputs), get_loss(loss), get_optimizer(optimizer)
    autocast = _autocast(torch.device(device).type, amp)
    torch.manual_seed(seed)
    real = _on_device(materialize(model).train(), device)
    real.zero_grad(set_to_none=True)  # a loop's first step starts without gradients (a model run before may hold some)
    tensors = [_to(make_input(s, batch, seq_len), device) for s in specs]
    args, kwargs = call_arguments(specs, tensors)
    name = type(model).__name__
    with (
        _real_run(model, batch, real=real),
        torch.no_grad(),
        warnings.catch_warnings(),
    ):  # the target's shape comes from the output; the data loader made it beforehand
        warnings.filterwarnings("ignore", "None of the inputs have requires_grad")  # a reentrant checkpoint's, true of any no_grad forward
        target = loss_fn.make_target(loss_fn.select(real(*args, **kwargs), name))
    runner: nn.Module = real
    if compile:
        with _real_run(model, batch, "compiled CPU", real=real):
            runner = _compiled_for_real(real, specs, loss_fn, batch, seq_len, device, activation_memory_budget)
    unranged: Around = lambda _: contextlib.nullcontext()
    warm_up = lambda: _real_step(runner, args, kwargs, loss_fn, target, opt, name, unranged, autocast, loop, carried)
    profiled = not first_step and _holds_over(loop) and torch.device(device).type == "cpu"  # Note [A warm-up step the profiler sees]
    with _real_run(model, batch, real=real):
        opt = _optimizer(real, rule, optimizer_impl)
        if not first_step and not profiled:  # one real step beforehand: state for exactly the parameters that get gradients
            warm_up()
    device_ = torch.device(device)
    on_device = lambda t: t.device.type == device_.type
    held = [*real.parameters(), *real.buffers(), *tensors_of(specs, tensors), *([target] if target is not None else [])]
    held = [s for t in held for s in stored_tensors(t)]  # a 4-bit weight's scales and tables, an NF4Tensor's inner tensors (Note [What a 4-bit weight holds])
    held += [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor) and on_device(t)]
    held += _held_over(real, loop, carried)
    baseline = sum({StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in held}.values())
    del held  # the gradients and outputs held from the step before go when the loop drops them, not later
    if torch.device(device).type == "cuda":
        with _real_run(model, batch, "CUDA", real=real):
            step = lambda around: _real_step(runner, args, kwargs, loss_fn, target, opt, name, around, autocast, loop, carried)
            peaks = _cuda_peaks(step)
        phase = max(peaks, key=lambda p: peaks[p][0])
        allocated = {p: top for p, (top, _) in peaks.items()}
        return PeakMeasurement(batch, first_step, allocated[phase], phase, baseline, {}, max(r for _, r in peaks.values()), allocated)
    with _real_run(model, batch, real=real), _quiet_stderr(), _profiled() as prof:
        if profiled:
            warm_up()
        _real_step(runner, args, kwargs, loss_fn, target, opt, name, _profiler_range, autocast, loop, carried)
    top, at, phase, tops = _highest(prof, after_warm_up=profiled)
    phases = {p: baseline + t for p, t in tops.items()}
    start = baseline + (_left_by_warm_up(prof) if profiled else 0)
    return PeakMeasurement(batch, first_step, baseline + top, phase, start, _categories_at(prof, at), None, phases)


# Note [A warm-up step the profiler sees]
#     The profiler reports the release of a block only where it saw the block's allocation (c10's
#     CPUAllocator warns "Memory block of unknown size was allocated before the profiling started,
#     profiler results will not include the deallocation event"). What a default loop carries into a
#     steady step (the optimizer state) lives through it, so the warm-up step runs unprofiled and its
#     state is counted storage by storage. A loop that holds gradients or outputs into the next step
#     frees them inside it, so there the warm-up step runs under the profiler too, without phase
#     ranges: its allocations and releases count toward the running sum, the highest point is taken
#     from the measured step's first phase on, and the step starts with what the warm-up left.


def _holds_over(loop: Loop) -> bool:
    """Whether ``loop`` carries into the next step storages that step frees (gradients, outputs)."""
    return loop.zero_grad == "before-backward" or loop.keep_outputs


def _left_by_warm_up(prof: torch.profiler.profile) -> int:
    """Bytes the profiled warm-up step left allocated: its events' sum, up to the first phase range
    (Note [A warm-up step the profiler sees])."""
    from torch._C._profiler import _EventType

    events = _events(prof)
    start = min((e.start_time_ns for e in events if _name(e).startswith(_PHASE_RANGE)), default=0)
    return sum(e.typed[1].alloc_size for e in events if e.typed[0] == _EventType.Allocation and e.start_time_ns < start)


def _on_device(model: nn.Module, device: str) -> nn.Module:
    """``model.to(device)``, unless it is there already: ``.to`` swaps a wrapper-subclass weight (torchao's
    ``NF4Tensor``) even onto its own device, which ``torch.utils.swap_tensors`` refuses while an exported
    graph's fake tensors keep a weakref to it (a report made by torch.export holds them)."""
    target = torch.device(device)
    tensors = [*model.parameters(), *model.buffers()]
    same = all(t.device.type == target.type and (target.index is None or t.device.index == target.index) for t in tensors)
    return model if same else model.to(device)


def _measured(training: Training, call: str, taken: tuple[str, ...]) -> Training:
    """``training``, where the real run applies every field it sets (``taken``); else an InputSpecError."""
    default = Training()
    fields = ("loss", "optimizer", "optimizer_impl", "precision", "amp", "param_dtype", *_LOOP_FIELDS)
    extra = [f for f in fields if f not in taken and getattr(training, f) != getattr(default, f)]
    if extra:
        raise InputSpecError(
            f"{call}() runs the model as it is and applies only Training's {', '.join(taken)}; Training.{extra[0]}="
            f"{getattr(training, extra[0])!r} has no real form here: leave it at its default (cast the model yourself for a dtype)."
        )
    return training


_LOOP_FIELDS = ("clip_grad_norm", "zero_grad", "keep_outputs")
"""``Training``'s fields that describe the loop around the step, which ``measure_peak`` runs for real."""


@dataclass
class _Carried:
    """What a loop with ``Loop.keep_outputs`` holds between steps: the last step's output and loss,
    dropped only when the next step's replace them (``out = model(x)``, ``loss = ...``)."""

    out: Any = None
    value: torch.Tensor | None = None


def _loop(training: Training) -> tuple[Loop, _Carried | None]:
    """The loop ``training`` describes, checked as ``analyze`` checks it, and where it keeps outputs, their holder."""
    loop = Loop(training.clip_grad_norm, training.zero_grad, training.keep_outputs)
    check_loop(loop)
    return loop, _Carried() if loop.keep_outputs else None


def _held_over(model: nn.Module, loop: Loop, carried: _Carried | None) -> list[torch.Tensor]:
    """What the loop holds from the step before when the measured step starts: the gradients where
    zero_grad runs before backward, the last output and loss where it keeps them (Note [What a loop
    holds from the step before] in fxmem/step/timeline.py)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None] if loop.zero_grad == "before-backward" else []
    kept = tree_leaves((carried.out, carried.value)) if carried is not None else []
    return grads + [t for t in kept if isinstance(t, torch.Tensor)]


def _to(value: Any, device: str | torch.device) -> Any:
    """An input on the run's device: a tensor moved, a pass-through constant as it is."""
    return value.to(device) if isinstance(value, torch.Tensor) else value


Around = Callable[[Phase], AbstractContextManager[object]]
"""What wraps each phase of the real step: a profiler range on the CPU, a peak reading on CUDA."""


def _profiler_range(phase: Phase) -> AbstractContextManager[object]:
    return torch.profiler.record_function(_PHASE_RANGE + phase.value)


def _cuda_peaks(step: Callable[[Around], None]) -> dict[Phase, tuple[int, int]]:
    """Per phase of the step: (``torch.cuda.max_memory_allocated``, the peak of requested bytes)."""
    peaks: dict[Phase, tuple[int, int]] = {}

    @contextlib.contextmanager
    def around(phase: Phase) -> Iterator[None]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        yield
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        peaks[phase] = (int(stats["allocated_bytes.all.peak"]), int(stats["requested_bytes.all.peak"]))

    step(around)
    return peaks


def _autocast(device_type: str, amp: str | None) -> Callable[[], contextlib.AbstractContextManager[object]]:
    """The context the real forward and loss run in: autocast in ``amp``'s dtype, or nothing."""
    dtype = amp_dtype(amp)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type, dtype=dtype)


def _optimizer(model: nn.Module, rule: OptimizerRule, impl: str | None = None) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return rule.make(trainable if trainable else [nn.Parameter(torch.zeros(()))], impl)  # a frozen model: an optimizer with nothing to do


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Mute file descriptor 2 while profiling: the profiler's C++ side logs its start and stop there,
    and the library never prints."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _profiled() -> torch.profiler.profile:
    activities = [torch.profiler.ProfilerActivity.CPU]
    return torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True)


def _real_step(
    model: nn.Module,
    args: list[Any],
    kwargs: dict[str, Any],
    loss: Loss,
    target: torch.Tensor | None,
    opt: torch.optim.Optimizer,
    name: str,
    around: Around,
    autocast: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
    loop: Loop = Loop(),
    carried: _Carried | None = None,
) -> None:
    """The step users write, each phase wrapped by ``around``; ``out`` and the loss live until its end
    (and on into the next step in ``carried``, where given). The forward and the loss run inside
    ``autocast()``, as under ``torch.autocast``; ``loop`` places zero_grad and clips as the user's loop does."""
    with autocast():
        with around(Phase.FORWARD):
            out = model(*args, **kwargs)
        if carried is not None:
            carried.out = out  # ``out = model(x)``: the last step's output is dropped only now
        with around(Phase.LOSS):
            value = loss.compute(loss.select(out, name), target)
        if carried is not None:
            carried.value = value
    if loop.zero_grad == "before-backward":
        with around(Phase.ZERO_GRAD):
            opt.zero_grad(set_to_none=True)
    with around(Phase.BACKWARD):
        value.backward()
    if loop.clip_grad_norm is not None:
        with around(Phase.CLIP):
            torch.nn.utils.clip_grad_norm_(model.parameters(), loop.clip_grad_norm)  # torch's defaults: foreach=None
    with around(Phase.OPTIMIZER):
        opt.step()
    if loop.zero_grad == "after-step":
        with around(Phase.ZERO_GRAD):
            opt.zero_grad(set_to_none=True)
    del out, value


def _events(prof: torch.profiler.profile) -> list[Any]:
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    found = []
    while stack:
        e = stack.pop()
        found.append(e)
        stack.extend(e.children)
    return found


def _name(event: object) -> str:
    """An event's name; "" for the odd Python-stack event whose name the profiler hands over as bad UTF-8."""
    try:
        return str(event.name)  # type: ignore[attr-defined]
    except UnicodeDecodeError:
        return ""


def _highest(
    prof: torch.profiler.profile, leave_out: Callable[[list[Any]], set[int]] | None = None, *, after_warm_up: bool = False
) -> tuple[int, int, Phase, dict[Phase, int]]:
    """(highest running sum of allocations and frees, the time it is reached, its phase, and the highest
    running sum inside each phase's range). ``leave_out`` names allocation events (by ``id``) not to count.
    ``after_warm_up``: events before the first phase range (a warm-up step's) count toward the running
    sum, not toward the highest point (Note [A warm-up step the profiler sees])."""
    from torch._C._profiler import _EventType

    events = _events(prof)
    named = [(e, _name(e)) for e in events]
    ranges = [(e.start_time_ns, e.end_time_ns, Phase(n[len(_PHASE_RANGE) :])) for e, n in named if n.startswith(_PHASE_RANGE)]
    allocations = sorted((e for e in events if e.typed[0] == _EventType.Allocation), key=lambda e: e.start_time_ns)
    if leave_out is not None:
        skipped = leave_out(allocations)
        allocations = [e for e in allocations if id(e) not in skipped]
    running, top, at = 0, 0, 0
    tops: dict[Phase, int] = {}
    step = min((start for start, _, _ in ranges), default=0) if after_warm_up else 0
    for e in allocations:
        running += e.typed[1].alloc_size
        if e.start_time_ns < step:
            continue
        if running > top:
            top, at = running, e.start_time_ns
        inside = next((p for start, end, p in ranges if start <= e.start_time_ns <= end), None)
        if inside is not None and running > tops.get(inside, -1):
            tops[inside] = running
    phase = next((p for start, end, p in ranges if start <= at <= end), Phase.FORWARD)
    return top, at, phase, tops


def _categories_at(prof: torch.profiler.profile, at: int) -> dict[str, int]:
    """Live bytes by the profiler's own categories at time ``at`` (its memory timeline, replayed)."""
    from torch.profiler._memory_profiler import Action, MemoryProfileTimeline

    profile = prof._memory_profile()
    timeline = MemoryProfileTimeline(profile)
    live: dict[object, tuple[str, int]] = {}
    for t, action, (key, version), size in timeline.timeline:
        if t > at:
            break
        category = profile._categories.get(key, version)
        label = category.name.lower() if category is not None else "unknown"
        if action in (Action.PREEXISTING, Action.CREATE) or action == Action.INCREMENT_VERSION:
            live[key] = (label, size)
        elif action == Action.DESTROY:
            live.pop(key, None)
    split: dict[str, int] = defaultdict(int)
    for label, size in live.values():
        split[label] += size
    return dict(split)


# Note [fxmem.measure, module and function]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``fxmem.measure`` names both this module and the function above (``fxmem/__init__.py`` loads its public
# names lazily, so that ``fxmem --help`` need not import torch). Importing the module (``from
# fxmem.measure import measure_peak``, or any command that measures) makes the import system set the
# package's attribute ``measure`` to the module, after which ``fxmem.measure(model, ...)`` would call a
# module. So the module calls through to the function.


class _CallableModule(types.ModuleType):
    """This module, callable as ``measure`` (Note [fxmem.measure, module and function])."""

    def __call__(self, *args: Any, **kwargs: Any) -> Measurement:
        return measure(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
