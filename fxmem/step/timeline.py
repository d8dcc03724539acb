"""One whole training step on fake tensors, allocation by allocation.

The step is the one users write::

    out = model(batch); loss = loss_fn(out, target); loss.backward()
    optimizer.step(); optimizer.zero_grad(set_to_none=True)

with the batch, the target and ``out`` held by the caller for the whole step. Autograd and the real
torch optimizer (built by the optimizer rule, so the implementation torch picks for CPU tensors) run
on fake tensors; nothing about backward or the optimizer is modelled by hand.

Note [How the timeline sees memory]
    A dispatch mode below autograd sees every aten op of the step: the forward's, the backward's
    (autograd runs CPU graphs on the calling thread, and dispatch modes follow it) and the
    optimizer's. After each op it notes the storages the op returned that it has not seen: an
    allocation. Before each op it notes the storages that have died since: a release. Asking every
    live storage ``StorageWeakRef.expired()`` before every op costs ops x live storages (28 million
    checks for Llama-3.1-8B's step); instead each storage's Python object carries a weakref whose
    callback files a death notice, and the poll before the next op turns the notices into releases
    in allocation order, as the full scan did. That needs torch to keep a storage's Python object
    alive exactly as long as the storage (it does: storages preserve their PyObject like tensors);
    ``_storage_deaths_are_seen`` checks it once, and where it fails the tracker scans as before.
    Nothing is kept alive that the step would not keep itself, so
    releases fall where they fall in a real run: the fx Interpreter drops each value after its last
    use, autograd frees saved tensors as backward consumes them, ``zero_grad`` drops the gradients.
    Parameters, buffers and inputs exist before the step and are never released by it, so they form
    the baseline and are not polled.

Note [Categories are decided afterwards]
    What a storage is becomes clear only later: a gradient is whatever ``p.grad`` holds after
    backward, optimizer state whatever ``optimizer.state`` holds after the step, an activation
    whatever autograd saved (seen by a saved-tensor pack hook) or the model output. Every storage is
    numbered at its allocation and given its category when the step has ended.

Note [Gradients summed in place]
    Where a tensor feeds several ops, autograd sums its gradients in the input buffer of the node
    that made it (InputBuffer::accumulate, torch/csrc/autograd/input_buffer.cpp). With grad mode off
    (backward without create_graph) it adds in place into the buffered gradient when the buffer holds
    its last reference and the gradient is dense, so the sum costs no memory; otherwise ``old + new``.
    It never adds in place when a dispatch mode is active or a tensor is a subclass
    (``isTensorSubclassLike``): on fake tensors, and under this tracker, every sum is a new
    gradient-sized allocation that a real step does not make (an attention block that splits one
    projection into q, k and v was 2.4% high in backward). The tracker emulates the eager rule: it
    marks, with a pre- and a post-hook on every autograd node, the moments between nodes when the
    engine sums; an ``add`` there whose first operand is dense, not a view (whose base shares its
    storage: a linear's input gradient reshaped back to (B, S, E) is one, and eager sums into it out
    of place), and dies as the sum is made (the buffer held its last reference, as eager's use counts
    require) is taken as done in place: the sum keeps the old gradient's storage, and neither the
    allocation nor the release is recorded.

Note [Steady step from first step]
    A first step creates the optimizer state inside ``step()``; a steady step starts with it. The ops
    are otherwise the same (AdamW's and SGD's updates do not depend on whether state was just made),
    so the steady timeline is the first one with its state allocations moved into the baseline.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import re
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from fxmem.compiling.inductor import CompiledModel, compile_on_fakes, compiling
from fxmem.engine.binding import bind_inputs, local_tensor, storage_of, storage_parts, swapped_state
from fxmem.engine.capture import (
    LOSS_NODE,
    FakeBatch,
    StepCapture,
    SymbolicUnsupported,
    fake_batch,
    node_error,
    node_fqn,
    quiet_fake_tensor_log,
)
from fxmem.engine.dispatch import QUERIES, LayoutRule, OpRule, OpRuleMode, SeesCompiledCode
from fxmem.engine.flops import OpCost, is_view_like, op_cost
from fxmem.engine.losses import Loss
from fxmem.engine.module_hooks import ModuleHooks, ModuleScopes, Scope
from fxmem.engine.recompute import SIGNALS as CHECKPOINT_SIGNALS
from fxmem.engine.recompute import RegionInterpreter
from fxmem.errors import CaptureError, FxmemError, first_line
from fxmem.frontends.checkpointing import Region
from fxmem.frontends.kv_cache import holding_caches
from fxmem.frontends.python_scopes import held_through
from fxmem.inputs import InputSpec, dtype_name, tensors_of
from fxmem.parallel import ParallelPlan, gathered_parameters, one_rank
from fxmem.parallel.fsdp import device_timeline
from fxmem.results import Category, Estimated, Loop, MemoryEvent, OpCostRecord, Phase, Timeline, WorkspaceBound, WorkspaceLines
from fxmem.rules.linear import in_aten_rnn, in_attention
from fxmem.rules.nf4 import quantized_state_tensors, stored_tensors
from fxmem.rules.optimizers import OptimizerRule
from fxmem.symbolic import ByteExpr, DataDependentBytes, to_byte_expr

aten = torch.ops.aten

__all__ = ["WorkspaceRule", "simulate_step", "steady_step"]

WorkspaceRule = Callable[[Sequence[Any], Mapping[str, Any], Any], object]
"""A kernel-workspace rule: an aten op's (args, kwargs, output) to the bytes it allocates and frees
inside, or, with a symbolic batch, ``WorkspaceLines`` (Note [Kernel choices that change with the batch])."""


# Note [Kernel choices that change with the batch]
#     A timeline's bytes are polynomials in B. A kernel's buffers need not be: the largest of
#     several lines (a copy that leads at small B, another at large B), or a buffer that exists only
#     at some batches (oneDNN splits a batch over its threads, with a reduction buffer, only where
#     its cost model says so). A workspace rule then returns ``WorkspaceLines``: the lines of the
#     kernel that runs at large B, each of which becomes its own transient, so that the step's peak,
#     the largest point over the step, takes the largest of them at every B; and a check of whether
#     those lines are the kernel's bytes at a given B (another kernel may run there). The symbolic
#     timeline keeps the checks (``Timeline.checks``); a batch that one of them fails is simulated on
#     its own when asked (fxmem/step/peak.py), so every figure at a batch is exact, and only the
#     envelope over all B (``max_batch``'s search aside) follows the lines.


# Note [A symbolic step at a batch where another kernel runs]
#     A check that refuses a batch sent that batch to a whole simulated step: 2-3 s each for a small
#     CNN on the cuda target, where cuDNN's and oneDNN's convolution choices change with B, and
#     ``max_batch``'s search for ResNet-50's test config asked 47 batches (two minutes for a default
#     report). Yet such a step differs from the symbolic one in those workspaces only: the rule knows
#     the kernel's bytes at any concrete batch (``highest`` in fxmem/rules/onednn_conv.py). Its lines
#     carry ``at_batch`` corrections (``WorkspaceLines.at_batch``, ``MemoryEvent.at_batch``): at a
#     concrete B the first line becomes the kernel's bytes and the others go, as one transient of
#     that size is what a step simulated at B records. ``Timeline.at_batch`` makes that step from the
#     symbolic one, every size a number; checks that carry no correction still send their batches to
#     a simulation. tests/test_peak.py holds the made step to the simulated one, event for event.


_LABEL = "fxmem"
"""Key of the (node, module path) label fxmem puts in each autograd node's ``metadata``."""


@dataclass
class _Storage:
    """One storage the step allocated, numbered in order; its category is decided at the end."""

    number: int
    nbytes: object
    node: str
    fqn: str
    op: str
    bound: WorkspaceBound | None = None
    """For an estimated workspace: what it is and the most it can be (see ``Estimated``)."""
    at_batch: Callable[[int], int | None] | None = None
    """For one line of a workspace's ``WorkspaceLines``: its correction at a concrete batch."""


@dataclass
class _Raw:
    """An allocation or release, in order; a release keeps the phase it was seen in."""

    alloc: bool
    storage: _Storage
    phase: Phase
    context: str = ""
    """The module path of the op running when it happened (a release is seen before the next op)."""


@dataclass(eq=False)
class _Tracker(SeesCompiledCode, TorchDispatchMode):
    """Notes allocations and releases of storages around every op. See Note [How the timeline sees memory]."""

    rules: Mapping[str, OpRule]
    workspaces: Mapping[str, WorkspaceRule]
    phase: Phase = Phase.FORWARD
    node: str = ""
    fqn: str = ""
    paused: bool = False
    recomputing: int = 0
    """How many checkpointed regions backward is recomputing now (Note [Checkpointed regions])."""
    live: dict[StorageWeakRef, _Storage] = field(default_factory=dict)
    permanent: dict[StorageWeakRef, tuple[Category, object]] = field(default_factory=dict)
    raw: list[_Raw] = field(default_factory=list)
    names: dict[StorageWeakRef, str] = field(default_factory=dict)
    """Parameter name per storage of a parameter, its gradient and its state: the optimizer's attribution."""
    costs: list[tuple[Phase, str, str, str, str, OpCost]] = field(default_factory=list)
    """(phase, node, fqn, op, dtype, cost) of every op that computes or moves bytes."""
    checks: list[Callable[[int], bool]] = field(default_factory=list)
    corrected: list[Callable[[int], bool]] = field(default_factory=list)
    """Checks of workspaces whose events say what they are at any batch (``Timeline.corrected``)."""
    """Whether each workspace rule's lines are its bytes at a batch (Note [Kernel choices that change with the batch])."""
    watchers: dict[StorageWeakRef, weakref.ref[Any]] = field(default_factory=dict)
    """A weakref per live storage whose callback files its death in ``deaths``."""
    deaths: list[StorageWeakRef] = field(default_factory=list)
    scanned: set[StorageWeakRef] = field(default_factory=set)
    """Live storages no weakref watches: asked ``expired()`` at every poll."""
    newest: int = -1
    """The number of the storage an op's output was given last."""
    between_nodes: bool = False
    """Whether backward is between two autograd nodes, where the engine sums gradients (Note [Gradients summed in place])."""
    summed: tuple[StorageWeakRef, StorageWeakRef] | None = None
    """(buffered gradient, the sum just made of it) where the sum may have been made in place."""
    ranges: list[str] = field(default_factory=list)
    """The ``record_function`` ranges open now, innermost last (Note [What a sharded step's engine allocates])."""
    communication: set[int] = field(default_factory=set)
    """Numbers of the storages allocated inside the sharding engine's own ranges."""
    kept: list[torch.Tensor] = field(default_factory=list)
    """Outputs selective checkpoints kept in forward (their caches hold them until backward anyway)."""

    def __post_init__(self) -> None:
        super().__init__()
        self._watch = _storage_deaths_are_seen()
        self._sharded = False
        """Whether the step runs on a fake process group (so DTensors reach this mode)."""

    def adopt(self, t: torch.Tensor, category: Category) -> None:
        """Register a storage that exists before the step and outlives it (weights, inputs)."""
        storage = storage_of(t)
        self.permanent.setdefault(StorageWeakRef(storage), (category, storage.nbytes()))

    def number(self, t: torch.Tensor) -> int | None:
        entry = self.live.get(StorageWeakRef(storage_of(t)))
        return entry.number if entry is not None else None

    def resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """A storage resized in place, which no op of this mode sees: FSDP2 frees a unit's gathered
        weights by resizing their storage to 0 and gathers them again into the same storage
        (Note [What a sharded step's engine allocates]). To 0 is a release, from 0 an allocation."""
        if self.paused:
            return
        key = StorageWeakRef(storage)
        self.poll()
        if nbytes == 0 and key in self.live:
            self.raw.append(_Raw(False, self.live.pop(key), self.phase, self.fqn))
            self.watchers.pop(key, None)
            self.scanned.discard(key)
        elif nbytes > 0 and storage.nbytes() == 0 and key not in self.live and key not in self.permanent:
            node, fqn = self._attribution(())
            self._allocated_storage(storage, nbytes, node, fqn, self._label("resize_"))

    def poll(self, context: str | None = None) -> None:
        """Record the release of every storage that has died since the last poll, oldest first, as
        seen while ``context`` (a module path; the running one when None) runs."""
        self._settle_sum()
        dead = [key for key in self.scanned if key.expired()]
        if self.deaths:
            dead += self.deaths
            self.deaths = []
        if not dead:
            return
        dead = [key for key in dead if key in self.live]  # a storage handed on (``_adds_in_place``) is not released
        for key in sorted(dead, key=lambda k: self.live[k].number):
            self.raw.append(_Raw(False, self.live.pop(key), self.phase, self.fqn if context is None else context))
            self.watchers.pop(key, None)
            self.scanned.discard(key)

    def _settle_sum(self) -> None:
        """Where the gradient an ``add`` summed into died with the sum, count the sum as made in its
        storage, in place, as eager makes it (Note [Gradients summed in place])."""
        if self.summed is None:
            return
        (old, new), self.summed = self.summed, None
        last = self.raw[-1] if self.raw else None
        if not old.expired() or old not in self.live or last is None or not last.alloc or last.storage is not self.live.get(new):
            return
        self.raw.pop()
        self.live[new] = self.live.pop(old)
        self.watchers.pop(old, None)
        self.scanned.discard(old)
        self.deaths = [key for key in self.deaths if key != old]
        self.newest = -1

    def node_starts(self, *_: object) -> None:
        self.between_nodes = False

    def node_ends(self, *_: object) -> None:
        self.between_nodes = True

    def _may_sum_in_place(self, func: Any, args: Any, kwargs: Mapping[str, Any], out: Any) -> bool:
        """An engine's sum of two gradients that eager could make in place (Note [Gradients summed in place])."""
        if func is not aten.add.Tensor or kwargs or len(args) != 2 or not self.between_nodes or self.recomputing:
            return False
        old, new = args
        return (
            self.phase == Phase.BACKWARD
            and not torch.is_grad_enabled()
            and isinstance(old, torch.Tensor)
            and isinstance(new, torch.Tensor)
            and old.layout == new.layout == torch.strided
            and old.shape == out.shape
            and old.dtype == out.dtype
            and is_non_overlapping_and_dense_or_false(old)
            and not old._is_view()  # a view's base holds its storage too: eager's storage use count is 2
            and StorageWeakRef(old.untyped_storage()) in self.live
        )

    def _watch_death(self, key: StorageWeakRef, storage: torch.UntypedStorage) -> None:
        if self._watch:
            with contextlib.suppress(TypeError):
                self.watchers[key] = weakref.ref(storage, functools.partial(self._died, key))
                return
        self.scanned.add(key)

    def _died(self, key: StorageWeakRef, _: object) -> None:
        self.deaths.append(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        node, fqn = self._attribution(args)
        self.poll(fqn)
        out = func(*args, **kwargs)
        if func in QUERIES:  # nothing to record
            return out
        if func in _RANGE_OPS:
            self._track_range(func, args)
            return out
        result = out
        if self._sharded:  # a DTensor op (the optimizer's on sharded state): what it does to the shards
            args, kwargs, out = _locals(args), _locals(kwargs), _locals(out)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        op = str(func.overloadpacket)
        rule = self.rules.get(op)
        sizes = rule(args, kwargs, out) if rule is not None else {}
        label = self._label(f"{op} (recomputed)" if self.recomputing else op)
        if _adds_in_place_for_real(func, args) and self._adds_in_place(args[0], out):
            outs = ()
        elif func is _WAIT and isinstance(out, torch.Tensor) and self._moved(args[0], out):
            outs = ()  # Note [What a sharded step's engine allocates]: the collective's output, waited on
        for i, t in enumerate(outs):
            for part in storage_parts(t) if isinstance(t, torch.Tensor) else ():  # Note [A sparse tensor's storages] in fxmem/engine/binding.py
                if part.layout == torch.strided and not part.is_nested:
                    self._allocated(part, sizes.get(i), *self._foreach_owner(op, args, i, (node, fqn)), label)
        if self._may_sum_in_place(func, args, kwargs, out):
            self.summed = (StorageWeakRef(args[0].untyped_storage()), StorageWeakRef(out.untyped_storage()))
        cost = op_cost(func, args, kwargs, out)
        if cost is not None and not is_view_like(func):
            self.costs.append((self.phase, node, fqn, op, _compute_dtype(args), cost))
        workspace = self.workspaces.get(op)
        found = workspace(args, kwargs, out) if workspace is not None else 0
        bound: WorkspaceBound | None = None
        if isinstance(found, Estimated):
            bound = found.bound
            found = found.found
        if isinstance(found, WorkspaceLines):
            (self.checks if found.at_batch is None else self.corrected).append(found.exact_at)
        lines = found.lines if isinstance(found, WorkspaceLines) else (found,)
        corrections = found.at_batch if isinstance(found, WorkspaceLines) and found.at_batch is not None else (None,) * len(lines)
        for nbytes, at_batch in zip(lines, corrections):
            if not (isinstance(nbytes, int) and nbytes == 0):
                self._transient(nbytes, node, fqn, f"{label} (workspace)", bound, at_batch)
        return result

    def _track_range(self, func: Any, args: Any) -> None:
        """Keep the stack of open ``record_function`` ranges (Note [What a sharded step's engine allocates])."""
        if func is _RANGE_ENTER and args and isinstance(args[0], str):
            self.ranges.append(args[0])
        elif func is not _RANGE_ENTER and self.ranges:
            self.ranges.pop()

    def _label(self, op: str) -> str:
        """An op's label: inside one of the sharding engine's ranges, the range's name before it."""
        engine = self._engine_range()
        return f"{engine}: {op}" if engine else op

    def _engine_range(self) -> str:
        """The innermost open range of the sharding engine, without the unit FSDP2 appends to its name
        ("FSDP::all_gather (blocks.3)"): the event's node says where it ran, and a label that names
        no block repeats with the blocks (Note [Repeated blocks] in fxmem/frontends/blocks.py)."""
        found = next((r for r in reversed(self.ranges) if r.startswith(_ENGINE_RANGES)), "")
        return found.split(" (", 1)[0]

    def _adds_in_place(self, source: torch.Tensor, out: torch.Tensor) -> bool:
        """Count ``out`` as ``source``'s storage, written in place, when ``source`` is the newest storage
        (the matmul before the add). See Note [linear's bias on fake tensors] in fxmem/rules/linear.py."""
        entry = self.live.get(StorageWeakRef(source.untyped_storage()))
        if entry is None or entry.number != self.newest or source.shape != out.shape:
            return False
        return self._moved(source, out)

    def _moved(self, source: torch.Tensor, out: torch.Tensor) -> bool:
        """Count ``out``'s storage as ``source``'s, which it is in a real run; False if ``source``'s is not live."""
        key = StorageWeakRef(source.untyped_storage())
        entry = self.live.get(key)
        if entry is None:
            return False
        self.live.pop(key)
        self.watchers.pop(key, None)
        self.scanned.discard(key)
        new_key = StorageWeakRef(out.untyped_storage())
        self.live[new_key] = entry
        self._watch_death(new_key, out.untyped_storage())
        return True

    def made_outside(self, t: torch.Tensor, op: str) -> None:
        """A tensor made without the dispatcher (so no op of this mode saw it), charged as an op's output."""
        self.poll()
        self._allocated(t, None, *self._attribution(()), op)

    def _transient(
        self,
        nbytes: object,
        node: str,
        fqn: str,
        op: str,
        bound: WorkspaceBound | None = None,
        at_batch: Callable[[int], int | None] | None = None,
    ) -> None:
        """A kernel's workspace: allocated and released within the op, alive with its outputs."""
        storage = _Storage(len(self.raw), nbytes, node, fqn, op, bound, at_batch)
        self.raw.append(_Raw(True, storage, self.phase, fqn))
        self.raw.append(_Raw(False, storage, self.phase, fqn))

    def _allocated(self, t: torch.Tensor, nbytes: object, node: str, fqn: str, op: str) -> None:
        self._allocated_storage(t.untyped_storage(), nbytes, node, fqn, op)

    def _allocated_storage(self, untyped: torch.UntypedStorage, nbytes: object, node: str, fqn: str, op: str) -> None:
        key = StorageWeakRef(untyped)
        if key in self.live or key in self.permanent:
            return
        size = untyped.nbytes() if nbytes is None else nbytes
        storage = _Storage(len(self.raw), size, node, fqn, op)
        self.newest = storage.number
        self.live[key] = storage
        self._watch_death(key, untyped)
        self.raw.append(_Raw(True, storage, self.phase, fqn))
        if self._engine_range():
            self.communication.add(storage.number)
        if self.phase in (Phase.OPTIMIZER, Phase.ZERO_GRAD):
            self.names[key] = node

    def _foreach_owner(self, op: str, args: Any, i: int, default: tuple[str, str]) -> tuple[str, str]:
        """The parameter a foreach op's ``i``-th output is for: the one its first list holds at ``i``
        (all of them would otherwise be charged to the list's first parameter)."""
        if not op.startswith("aten._foreach_") or self.phase not in _PER_PARAMETER:
            return default
        first = args[0] if args else None
        if not isinstance(first, (list, tuple)) or i >= len(first) or not isinstance(first[i], torch.Tensor):
            return default
        name = self.names.get(StorageWeakRef(first[i].untyped_storage()))
        return (name, _module_of(name)) if name is not None else default

    def _attribution(self, args: Any) -> tuple[str, str]:
        """(node, module path) an op is charged to: the running fx node in forward and loss, the
        forward node whose gradient autograd is computing in backward, the parameter in the optimizer
        (and in ``clip_grad_norm_``, where an op reads one gradient)."""
        if self.phase == Phase.BACKWARD and self.recomputing:
            return self.node, self.fqn
        if self.phase == Phase.BACKWARD:
            current = torch._C._current_autograd_node()
            label = _metadata(current).get(_LABEL) if current is not None else None
            if label is not None:
                return label
            return (current.name() if current is not None else self.node), ""
        if self.phase in _PER_PARAMETER:
            for a in tree_leaves(args):
                if isinstance(a, torch.Tensor):
                    name = self.names.get(StorageWeakRef(storage_of(a)))
                    if name is not None:
                        return name, _module_of(name)
        return self.node, self.fqn


# Note [What a sharded step's engine allocates]
#     On a fake process group (fxmem/parallel) the step runs FSDP2's own code, and what it allocates
#     is seen as any op's allocation is, with three additions:
#     * FSDP2 frees a unit's gathered weights by resizing their storage to 0 bytes and gathers them
#       again into the same storage (``free_storage`` / ``alloc_storage`` in torch/distributed/fsdp/
#       _fully_shard/_fsdp_common.py), which no dispatched op does: the tracker wraps
#       ``UntypedStorage.resize_`` for the step and records a resize to 0 as a release, one from 0 as
#       an allocation (torch's MemTracker, torch/distributed/_tools/mem_tracker.py, does the same).
#     * The sharded parameters, their gradients and the optimizer state are DTensors. The tracker,
#       a mode, sees an op on DTensors before DTensor runs it on the local shards, so it reads what
#       the op did off the shards (``_local_tensor``), which hold the rank's storages.
#     * A functional collective (tensor parallel's, through DTensor) returns its output, and
#       ``wait_tensor`` returns that same tensor once the collective is done (torch/csrc/distributed/
#       c10d/Functional.cpp); on fake tensors it returns a new one. The tracker counts the waited
#       tensor as the collective's output, moved, not as a second allocation.
#     * Every collective FSDP2 runs sits inside a ``record_function`` range of its own ("FSDP::
#       all_gather", "FSDP::post_backward_reduce", ...), which reaches the mode as a profiler op. What
#       is allocated inside one is the engine's: its category is COMMUNICATION (unless it later
#       holds the gradients, as the reduce-scatter output does), and its label names the range.

_PER_PARAMETER = (Phase.CLIP, Phase.OPTIMIZER, Phase.ZERO_GRAD)
"""The phases whose ops are charged to the parameter whose tensors they read (``_Tracker._attribution``)."""

_RANGE_ENTER = torch.ops.profiler._record_function_enter_new.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default

_RANGE_OPS = frozenset({_RANGE_ENTER, torch.ops.profiler._record_function_exit._RecordFunction})
_ENGINE_RANGES = ("FSDP::",)
"""The ``record_function`` names whose allocations are the sharding engine's."""


def _locals(value: Any) -> Any:
    """``value`` with every DTensor in it replaced by its local shard."""
    return tree_map(lambda v: local_tensor(v) if isinstance(v, torch.Tensor) else v, value)


@contextlib.contextmanager
def _resizes_seen(tracker: _Tracker) -> Iterator[None]:
    """Tell the tracker of every storage resized in place while the step runs (Note [What a sharded
    step's engine allocates])."""
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, nbytes: int) -> Any:
        tracker.resized(storage, int(nbytes))
        return original(storage, nbytes)

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


def _adds_in_place_for_real(func: Any, args: Any) -> bool:
    """An ``add`` that real tensors make in place where fake ones cannot: a 1-D bias inside ATen's C++
    RNN (``at::linear``'s) or the mask inside the CPU's math attention (Note [The attention mask added
    in place] in fxmem/rules/linear.py)."""
    if func is not aten.add.Tensor or len(args) < 2:
        return False
    x, other = args[0], args[1]
    if not isinstance(x, torch.Tensor) or not isinstance(other, torch.Tensor):
        return False
    if in_attention():
        return True
    return in_aten_rnn() and other.dim() == 1 and x.dim() >= 2


@functools.cache
def _storage_deaths_are_seen() -> bool:
    """Whether a weakref to a storage's Python object dies with the storage, not with that object:
    dropping the object while a tensor holds the storage must not fire it, dropping the tensor must."""
    fired: list[bool] = []
    t = torch.empty(1)
    ref = weakref.ref(t.untyped_storage(), lambda _: fired.append(True))
    gc.collect(0)  # the youngest generation holds whatever this made; two full collections were 0.24 s of a profiled gpt-7b analyze
    if fired or ref() is None:
        return False
    del t
    gc.collect(0)
    return bool(fired)


def _compute_dtype(args: Any) -> str:
    """The dtype an op computes in: its first floating tensor argument's (float32 when it has none)."""
    for a in tree_leaves(args):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return dtype_name(a.dtype)
    return "float32"


def _module_of(parameter: str) -> str:
    return parameter.rpartition(".")[0]


_PASS_THROUGH: tuple[type[BaseException], ...] = (FxmemError, SymbolicUnsupported, KeyboardInterrupt, *CHECKPOINT_SIGNALS)
"""What a node's failure handler re-raises as it is: fxmem's own errors, Ctrl-C, checkpoint's early stop."""


class _Forward(ModuleHooks, RegionInterpreter):
    """Runs the graph freeing each value after its last use, telling the tracker which node runs, and
    labelling the autograd nodes each fx node creates so that backward's ops are charged to it.

    A checkpointed region runs through the real checkpoint, which backward calls again to recompute
    it: those ops are charged to the nodes they recompute (See Note [Checkpointed regions])."""

    passthrough = _PASS_THROUGH

    def __init__(
        self,
        gm: fx.GraphModule,
        tracker: _Tracker,
        fake: FakeBatch,
        model: str,
        kernels: Callable[[], AbstractContextManager[object]],
        scopes: ModuleScopes | None = None,
        record: StepCapture | None = None,
    ) -> None:
        super().__init__(gm, garbage_collect_values=True, model_label=model)
        self.tracker = tracker
        self.fake = fake
        self.kernels = kernels
        self.scopes = scopes
        self.record = record
        """Where the forward's saved tensors are recorded too (Note [One pass for the capture and the step])."""
        """The hooked modules' stretches of the graph (Note [Module hooks on a flattened graph])."""
        _hold_python_locals(self)
        _drop_unread_values(self)

    def hooks_run(self, scope: Scope, node: fx.Node) -> None:
        self.tracker.node, self.tracker.fqn = node.name, scope.path

    def left(self, scope: Scope) -> None:
        self.tracker.poll(scope.path)  # the call's arguments die with it (an FSDP2 unit's inputs, held for its forward hooks)

    @contextlib.contextmanager
    def recompute_context(self) -> Iterator[None]:
        """Backward recomputing a region: the forward's kernels again, and its ops charged to the nodes
        they recompute (not to the gradient that asked for them), marked as recomputed."""
        self.tracker.recomputing += 1
        try:
            with self.kernels():
                yield
        finally:
            self.tracker.recomputing -= 1

    def entered(self, scope: Scope) -> None:
        if self.record is not None:
            self.record.module_entered(scope.module)

    def region_call(self, region: Region) -> AbstractContextManager[object]:
        self.tracker.node, self.tracker.fqn = region.first.name, node_fqn(region.first)
        if self.record is not None:
            self.record.node_starts(region.first.name)
        return contextlib.nullcontext()

    def run_one(self, n: fx.Node) -> Any:
        self.tracker.node, self.tracker.fqn = n.name, node_fqn(n)
        if self.record is not None:
            self.record.node_starts(n.name)
        try:
            out = super().run_one(n)
        except _PASS_THROUGH:
            raise
        except Exception as e:
            symbols = (self.fake.symbols.get("B"), self.fake.symbols.get("S"))
            raise node_error(n, self.env, symbols, self.model_label, e) from e
        made_from = None
        if n.op == "get_attr" and _traced_constant(str(n.target)) and isinstance(out, torch.Tensor):
            made_from, out = out, out.clone()  # Note [Tensors made while tracing]
        _label_autograd(out, (n.name, node_fqn(n)))
        if self.record is not None:
            self.record.node_ran(n, out, made_from)
        for kept in self.cached():  # a selective checkpoint's policy keeps them for backward, as autograd would
            self.tracker.kept.append(kept)
            if self.record is not None:
                self.record.pack(kept)
        return out


# Note [Tensors made while tracing]
#     A tensor the forward makes from nothing but Python values (``torch.ones(S, S).tril()``, an
#     attention mask) is computed once by fx's tracer and kept in the graph as a constant,
#     ``_tensor_constant0``, which GraphModule registers as a buffer. Eager makes it anew in every
#     forward, where the code runs, and frees it when nothing holds it. As a buffer it would sit in
#     the baseline for the whole step: a 33 x 33 bool mask made in the forward was 1,089 bytes high at
#     the backward's peak (3% of a small attention model's, tests/test_timeline.py). The timeline
#     leaves such constants out of the baseline and has each get_attr of one hand on a fresh copy, an
#     allocation at that node, released when its value is last used, as eager's is. fx places the
#     get_attr where the constant is first used, so a tensor made long before its use (a mask built
#     at the top of forward) is counted from its use on, as are not the temporaries that made it
#     (``ones`` before ``tril``): the forward's peak can then be low by those bytes.

_TRACED_CONSTANT = re.compile(r"_tensor_constant\d+")


def _traced_constant(name: str) -> bool:
    """Whether a graph attribute is a tensor fx's tracer computed from the forward's code (Note [Tensors made while tracing])."""
    return _TRACED_CONSTANT.fullmatch(name) is not None


def _hold_python_locals(interpreter: fx.Interpreter) -> None:
    """Drop each value after the last node a Python name held it through, where that is later than
    its last use (Note [Python locals keep values alive] in fxmem/frontends/python_scopes.py)."""
    held = held_through(interpreter.graph)
    if not held:
        return
    for user, values in interpreter.user_to_last_uses.items():
        interpreter.user_to_last_uses[user] = [v for v in values if v not in held]
    for value, until in held.items():
        interpreter.user_to_last_uses.setdefault(until, []).append(value)


# Note [A value nothing reads]
#     fx's Interpreter frees a node's value after its last user runs (``user_to_last_uses``); a node with
#     no users is no one's argument, so its value stayed in the Interpreter's environment until the
#     forward ended, and with it the autograd graph behind it and every tensor that graph saved. Eager
#     drops a result nobody keeps at once: ShadowPEFT (peft 0.21, tuners/shadow/layers.py) updates its
#     shadow state in the last block too, and the model's exit hook keeps only the hidden states, so the
#     last ``shadow_update``'s activations die with it in eager; torch.export keeps the dead ``.to(dtype)``
#     it ends with, and the simulated forward held them to its end (45 KB, 3% of the tiny Llama's step
#     peak in tests/test_peft_methods.py). Such a value is now dropped right after its node runs, unless
#     a Python name holds it longer (Note [Python locals keep values alive]).


def _drop_unread_values(interpreter: fx.Interpreter) -> None:
    """Drop the value of a node that nothing reads right after it runs: Note [A value nothing reads]."""
    held = held_through(interpreter.graph)
    for node in interpreter.graph.nodes:
        if not node.users and node.op in ("call_function", "call_method", "call_module") and node not in held:
            interpreter.user_to_last_uses.setdefault(node, []).append(node)


def _metadata(fn: Any) -> dict[str, Any]:
    """An autograd node's metadata dict, kept by the C++ node however often Python rewraps it."""
    return fn.metadata


def _label_autograd(value: object, label: tuple[str, str]) -> None:
    """Label every not-yet-labelled autograd node reachable from ``value``: those made just now."""
    stack: list[Any] = [t.grad_fn for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or _LABEL in _metadata(fn):
            continue
        _metadata(fn)[_LABEL] = label
        stack.extend(next_fn for next_fn, _ in fn.next_functions)


def _label_accumulators(params: Mapping[str, torch.Tensor], value: torch.Tensor) -> None:
    """Name each AccumulateGrad node after its parameter (its gradient's first copy is made there)."""
    names = {id(p): name for name, p in params.items()}
    seen: set[int] = set()
    stack: list[Any] = [value.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        variable = getattr(fn, "variable", None)
        if variable is not None and id(variable) in names:
            _metadata(fn)[_LABEL] = (names[id(variable)], _module_of(names[id(variable)]))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)


@dataclass(frozen=True)
class StepTarget:
    """What the target device decides about a simulated step's ops, the same for every step of one
    analysis (one GPU's, a pipeline rank's): the op rules (true output sizes), the workspace rules,
    the CPU layout rules, the context the forward and the loss run in (``kernels()``: the target's
    kernel choices and autocast policy, see ``TrainingSetup.kernels``), the optimizer's
    implementation (None: torch's default), the dtype floating parameters and buffers are held
    in (None: their own; see ``capture_saved``), the training loop around the step, and the target
    device's type ("cpu", "cuda"), by which torch's own defaults choose kernels."""

    rules: Mapping[str, OpRule] = field(default_factory=dict)
    workspaces: Mapping[str, WorkspaceRule] = field(default_factory=dict)
    layouts: Mapping[str, LayoutRule] | None = None
    kernels: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext
    optimizer_impl: str | None = None
    state_dtype: torch.dtype | None = None
    loop: Loop = Loop()
    device: str = "cpu"


def simulate_step(
    gm: fx.GraphModule,
    specs: Sequence[InputSpec],
    *,
    loss: Loss,
    optimizer: OptimizerRule,
    batch: int | None,
    target: StepTarget,
    model: str = "model",
    seq: int | None = None,
    parallel: ParallelPlan | None = None,
    strict: bool = False,
    captured: Callable[[StepCapture], None] | None = None,
    compiled: Callable[[CompiledModel, int], None] | None = None,
    budget: float = 1.0,
) -> Timeline:
    """The first training step's timeline at ``batch`` (None: B symbolic, valid for B >= 2), its ops
    as ``target`` runs them.

    ``compiled``, where given, runs the model as ``torch.compile(model)`` does on its first call at
    ``batch`` (which must be concrete): Inductor's forward and backward, every buffer as its wrapper
    allocates and frees it (Note [Inductor on fake tensors] in fxmem/compiling/inductor.py); the loss
    and the optimizer stay eager, as they are outside the compiled module. It is handed the compiled
    model and the bytes packed for backward (each storage once) once the step has run; ``budget`` is
    the partitioner's ``activation_memory_budget``.

    With ``parallel``, the step is one rank's of an FSDP2 run of that many ranks (fxmem/parallel):
    ``batch`` is then the rank's own batch.

    ``captured``, where given (on one GPU only), is handed what the step's forward saved, once the step
    has run: what ``capture_saved`` at the same batch records, ``strict`` as it takes it (Note [One
    pass for the capture and the step]).

    Raises SymbolicUnsupported or BatchSpecialized when a symbolic pass cannot stand for every B.
    """
    fake = fake_batch(specs, batch, seq, target.state_dtype)
    scales = quantized_state_tensors(gm)  # read before the weights are swapped for fakes, which have no QuantState
    with swapped_state(gm, fake.state_copy), quiet_fake_tensor_log(), _one_rank(gm, parallel, fake, model) as (gm, scopes):
        tracker = _Tracker(target.rules, target.workspaces)
        tracker._sharded = parallel is not None
        params = dict(gm.named_parameters())
        for name, p in params.items():
            for stored in stored_tensors(p):  # an NF4Tensor's inner tensors: Note [What a 4-bit weight holds] in fxmem/rules/nf4.py
                tracker.adopt(stored, Category.PARAMETER)
            tracker.names[StorageWeakRef(storage_of(p))] = name
        for name, b in gm.named_buffers():
            if not _traced_constant(name):  # made by the forward, each step: Note [Tensors made while tracing]
                tracker.adopt(b, Category.BUFFER)
        for t in scales:  # the graph's constants: Note [What a 4-bit weight holds] in fxmem/rules/nf4.py
            tracker.adopt(t, Category.PARAMETER)
        for t in tensors_of(specs, fake.inputs):
            tracker.adopt(t, Category.INPUT)
        record = _recorder(gm, specs, fake, tracker, strict) if captured is not None else None
        values = bind_inputs(gm, specs, fake.inputs, model)
        forward = _compiled(gm, values, fake, model, budget) if compiled is not None else None
        with fake.mode:
            trainable = [p for p in params.values() if p.requires_grad]
            opt = optimizer.make(trainable, target.optimizer_impl) if trainable else None  # a frozen model has no step to take
            # OpRuleMode on top only decomposes composite ops as eager CPU does, so that their inner ops
            # reach the tracker below it one by one; the tracker applies the op rules itself, since it
            # must know a storage's true size when it records the allocation.
            resizes = _resizes_seen(tracker) if parallel is not None else contextlib.nullcontext()
            rules = OpRuleMode({}, {}, target.layouts)
            tracker.compiled_step = rules.compiled_step = forward is not None
            with tracker, rules, _host_rng_states(tracker), resizes:
                packed: dict[int, object] = {}
                categories = _run_step(
                    gm, tracker, fake, values, loss, opt, params, model, target.kernels, scopes, record, forward, packed,
                    target.loop, target.device,
                )  # fmt: skip
    fake.check_symbols()
    timeline = _timeline(tracker, categories, batch, fake)
    timeline = timeline if target.loop.plain else replace(timeline, loop=target.loop)
    if parallel is not None and parallel.offload:  # the device's share: Note [FSDP2's CPU offload] in fxmem/parallel/fsdp.py
        timeline = device_timeline(timeline)
    if captured is not None and record is not None:
        captured(record)
    if compiled is not None and forward is not None:
        compiled(forward, sum(int(n) for n in packed.values()))  # type: ignore[call-overload]
    return timeline


COMPILED_NODE = "(compiled)"
"""What the timeline charges a compiled model's own buffers to: Inductor's kernels are not fx nodes."""


def _compiled(gm: fx.GraphModule, values: Sequence[Any], fake: FakeBatch, model: str, budget: float) -> CompiledModel:
    """``gm`` compiled by Inductor on this pass's fake state and inputs (fxmem/compiling/inductor.py);
    a failure names the model and says what torch.compile stopped at."""
    if fake.symbols:
        raise SymbolicUnsupported("a compiled step is simulated at each batch, as torch.compile's first call compiles it")
    try:
        return compile_on_fakes(gm, values, budget)
    except FxmemError:
        raise
    except Exception as e:
        raise CaptureError(
            f"model '{model}': torch.compile (Inductor, default mode) failed on it here ({type(e).__name__}: {first_line(e)}); "
            "check that torch.compile(model) trains on this torch, or analyze the eager step without --compile."
        ) from e


# Note [One pass for the capture and the step]
#     The saved tensors per node (``capture_saved``) and the step's timeline came from two fake
#     passes over the same forward, at the same batch, under the same kernels and rules: the
#     capture's forward alone cost a third of a default analyze of gpt-7b. The step's forward now
#     records what the capture would, through the same book (fxmem/engine/capture.py): the same node
#     charged for each storage, the same saved-by lists, kinds and sizes. Two things differ and are
#     handled there: the step frees what eager frees, so a storage is named by the number the tracker
#     gave it rather than by its address, which a later storage may reuse; and a constant fx made
#     while tracing is copied afresh by the step (Note [Tensors made while tracing]), so the copy takes
#     the constant's kind. Recording stops when the loss has run: backward's recomputations of
#     checkpointed regions save nothing the capture counts. tests/test_timeline.py holds the recorded
#     capture equal to ``capture_saved``'s on the zoo's models and the Hugging Face test configs.


def _recorder(gm: fx.GraphModule, specs: Sequence[InputSpec], fake: FakeBatch, tracker: _Tracker, strict: bool) -> StepCapture:
    """The capture the step's forward keeps, naming storages by the tracker's numbers."""

    def numbered(t: torch.Tensor) -> tuple[int, object] | None:
        entry = tracker.live.get(StorageWeakRef(storage_of(t)))
        return (entry.number, entry.nbytes) if entry is not None else None

    record = StepCapture(gm, tensors_of(specs, fake.inputs), fake, numbered)
    record.book.strict = strict
    return record


def _one_rank(
    gm: fx.GraphModule, parallel: ParallelPlan | None, fake: FakeBatch, model: str
) -> AbstractContextManager[tuple[fx.GraphModule, ModuleScopes | None]]:
    """The graph module the step runs, and the modules whose hooks it calls: ``gm`` itself, or a copy
    sharded as one rank of ``parallel`` holds it, on a fake process group open for the step."""
    if parallel is None:
        return contextlib.nullcontext((gm, None))
    return one_rank(parallel, gm, fake.mode, model)


def _run_step(
    gm: fx.GraphModule,
    tracker: _Tracker,
    fake: FakeBatch,
    values: list[Any],
    loss: Loss,
    opt: torch.optim.Optimizer | None,
    params: Mapping[str, torch.Tensor],
    model: str,
    kernels: Callable[[], AbstractContextManager[object]],
    scopes: ModuleScopes | None = None,
    record: StepCapture | None = None,
    compiled: CompiledModel | None = None,
    packed: dict[int, object] | None = None,
    loop: Loop = Loop(),
    device: str = "cpu",
) -> dict[int, Category]:
    """Run forward, loss, backward, step and zero_grad, in the order ``loop`` runs them (with its
    clipping, on ``device``'s kernels); return the categories decided along the way.
    With ``compiled``, the forward is the compiled model's (and so is its backward); ``packed``, where
    given, collects each storage packed for backward (its number and bytes)."""
    categories: dict[int, Category] = {}

    def activation(t: torch.Tensor) -> None:
        number = tracker.number(t)
        if number is not None:
            categories[number] = Category.ACTIVATION

    def pack(t: torch.Tensor) -> torch.Tensor:
        for part in storage_parts(t):  # See Note [A sparse tensor's storages] in fxmem/engine/binding.py
            activation(part)
            entry = tracker.live.get(StorageWeakRef(storage_of(part))) if packed is not None else None
            if entry is not None:
                packed[entry.number] = entry.nbytes
        if record is not None:
            record.pack(t)
        return t.detach() if _saved_by_its_own_node(t) else t  # Note [What the step's saved-tensor hook keeps]

    def keep_cached() -> None:
        """What selective checkpoints kept (Note [What a selective checkpoint keeps] in fxmem/engine/recompute.py)
        are activations (the record took them as each node kept them)."""
        for t in tracker.kept:
            activation(t)
        tracker.kept.clear()

    # A compiled forward runs outside ``kernels()``, whose function modes Dynamo would guard on and
    # recompile under: Note [Dynamo on the traced graph] in fxmem/compiling/inductor.py
    outside = kernels if compiled is None else contextlib.nullcontext
    inside = contextlib.nullcontext if compiled is None else kernels
    # The hook runs inside the compiled forward, where Dynamo would compile it as the model's code
    hook = torch._dynamo.disable(pack) if compiled is not None else pack
    with torch.autograd.graph.saved_tensors_hooks(hook, _unpack), outside(), holding_caches() as caches:  # held as ``out`` holds them
        if compiled is not None:
            tracker.node, tracker.fqn = COMPILED_NODE, ""
            with compiling():
                out = _guarded(fake, model, "the compiled forward", lambda: compiled(*values))
            _label_autograd(out, (COMPILED_NODE, ""))
        with inside():
            if compiled is None:
                out = _Forward(gm, tracker, fake, model, kernels, scopes, record).run(*values)
            keep_cached()
            tracker.poll()  # what died after the last op is released in the phase it died in
            tracker.phase, tracker.node, tracker.fqn = Phase.LOSS, LOSS_NODE, "(loss)"
            output = loss.select(out, model)
            with _paused(tracker):  # the target is data the caller holds before the step, like the batch
                target = loss.make_target(output)
            if target is not None:
                tracker.adopt(target, Category.INPUT)
            if record is not None:
                record.loss_starts(target)
            value = _guarded(fake, model, f"the loss '{loss.name}'", lambda: loss.compute(output, target))
            if record is not None:
                record.loss_ran(value, target, loss)
    tracker.poll()
    _mark(tracker, categories, out, Category.ACTIVATION)  # the caller holds the output
    _label_autograd(value, (LOSS_NODE, "(loss)"))
    _label_accumulators({**params, **gathered_parameters(gm)} if scopes is not None else params, value)
    if opt is not None and loop.zero_grad == "before-backward":
        _zero_grad(tracker, opt)  # a first step's gradients are None: nothing to free (Note [What a loop holds from the step before])
    tracker.phase = Phase.BACKWARD
    if value.requires_grad:  # nothing to differentiate when every parameter is frozen
        with _node_hooks(tracker, value), compiling() if compiled is not None else contextlib.nullcontext():
            _guarded(fake, model, "backward()", value.backward)
    tracker.poll()
    for name, p in params.items():
        if p.grad is not None:
            _mark(tracker, categories, p.grad, Category.GRADIENT)
            tracker.names[StorageWeakRef(storage_of(p.grad))] = name
    if opt is not None and loop.clip_grad_norm is not None:
        _clip_grad_norm(tracker, fake, model, params, loop.clip_grad_norm, device)
    tracker.phase, tracker.node, tracker.fqn = Phase.OPTIMIZER, "optimizer.step", ""
    if opt is not None:
        _guarded(fake, model, "optimizer.step()", opt.step)
        tracker.poll()
        _mark(tracker, categories, [list(s.values()) for s in opt.state.values()], Category.OPTIMIZER_STATE)
        if loop.zero_grad == "after-step":
            _zero_grad(tracker, opt)
    del out, value, caches  # Note [The cache a training forward builds] in fxmem/frontends/kv_cache.py
    for number in tracker.communication:  # Note [What a sharded step's engine allocates]
        if categories.get(number) not in (Category.GRADIENT, Category.OPTIMIZER_STATE):
            categories[number] = Category.COMMUNICATION
    return categories


def _zero_grad(tracker: _Tracker, opt: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``, torch's default: each gradient dropped, so freed."""
    tracker.phase, tracker.node, tracker.fqn = Phase.ZERO_GRAD, "zero_grad", ""
    opt.zero_grad(set_to_none=True)
    tracker.poll()


# Note [clip_grad_norm_ on fake gradients]
#     The loop's ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` runs here as it is,
#     torch's own code on the fake gradients, as the optimizer does, so every temporary it makes is
#     an op the tracker sees: the per-gradient norms, their ``stack``, the total norm, the clip
#     coefficient (``max_norm / (total + 1e-6)``, clamped to 1) and the in-place multiply. Which
#     path it takes is decided as torch decides it for real tensors, not for fakes: with
#     ``foreach=None`` it takes ``_foreach_norm`` and ``_foreach_mul_`` where
#     ``_has_foreach_support(grads, device)`` (torch/nn/utils/clip_grad.py ``_get_total_norm`` and
#     ``_clip_grads_with_norm_``), which asks for every gradient's type to be exactly ``torch.Tensor``
#     and for the device to be in ``_get_foreach_kernels_supported_devices() + ["cpu"]``
#     (torch/utils/_foreach_utils.py ``_device_has_foreach_support``): foreach on CUDA and, in torch
#     2.13, on the CPU too (unlike the optimizers' default, which leaves the CPU out). A FakeTensor's
#     type is not ``torch.Tensor``, so left to choose, torch would take the per-gradient loop here:
#     the simulation passes the choice real gradients get. A DTensor's type is not ``torch.Tensor``
#     either, so FSDP2's and tensor parallel's gradients take the loop, as they do for real. On the
#     CPU ``_foreach_norm`` computes one norm per gradient, each its own 0-d tensor, as its meta
#     kernel says (tests/test_loop.py holds the clip phase to a real CPU step): with the stacked copy
#     and the total, 8n + 4 bytes for n gradients. A real CPU run also wraps the Python floats 1e-6
#     and max_norm in 8-byte float64 tensors (and a 4-byte float32 copy) while it computes the
#     coefficient, which no fake op allocates: 28 B at most then, below the norms' 8n + 4 from n = 3
#     gradients on: only a model of one or two parameter tensors sees its clip phase low (16 or 8 B). CUDA's kernel
#     (aten/src/ATen/native/cuda/ForeachReduceOp.cu) returns views of one buffer of n floats, beside a
#     scratch of per-chunk sums: on a cuda target the n 0-d tensors here, each a 512-byte block of the
#     caching allocator, overstate it by about 512 B per gradient. The stacked norms grow with the
#     blocks, so a clipped step of a deep model is simulated whole (Note [Repeated blocks]).


def _clip_grad_norm(
    tracker: _Tracker, fake: FakeBatch, model: str, params: Mapping[str, torch.Tensor], max_norm: float, device: str
) -> None:
    """The loop's ``clip_grad_norm_`` between backward and the optimizer step: Note [clip_grad_norm_ on fake gradients]."""
    from torch.utils._foreach_utils import _device_has_foreach_support

    tracker.phase, tracker.node, tracker.fqn = Phase.CLIP, "clip_grad_norm_", ""
    grads = [p.grad for p in params.values() if p.grad is not None]
    plain = all(type(g) in (torch.Tensor, FakeTensor) for g in grads)  # a DTensor's gradients are not
    foreach = plain and _device_has_foreach_support(torch.device(device))
    clip = lambda: torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm, foreach=foreach)
    _guarded(fake, model, "torch.nn.utils.clip_grad_norm_()", clip)  # the total norm it returns is dropped, as the loop drops it
    tracker.poll()


# Note [What the step's saved-tensor hook keeps]
#     With a saved-tensor hook, autograd keeps whatever ``pack`` returns, as it is. Returned as it
#     is, an output saved by the node that made it (``exp``'s result, softmax's) would hold that
#     node through its ``grad_fn``, which holds the saved tensor: a reference cycle, which only the
#     cycle collector frees, so its storage would outlive what eager keeps. Eager's own
#     ``SavedVariable`` keeps such an output without its ``grad_fn`` (``tensor_data()``) and any
#     other saved tensor as it is (csrc/autograd/saved_variable.cpp), and so does ``pack``: it
#     detaches a tensor whose ``grad_fn`` is the node being built, the newest one (sequence number
#     ``torch.autograd._get_sequence_nr() - 1``, as torch/fx/proxy.py reads it), and returns any
#     other as it is. Nothing changes in what is kept alive; what changes is the count of fake ops:
#     a symbolic ``detach`` costs about 0.4 ms, and the symbolic forward of Llama-3.1-8B's 3-block
#     copy packs 127 tensors, 11 of them outputs of the node saving them (rsqrt's, the softmaxes').


def _saved_by_its_own_node(t: torch.Tensor) -> bool:
    """Whether ``t`` is an output of the autograd node being built: Note [What the step's saved-tensor hook keeps]."""
    fn = t.grad_fn
    return fn is not None and fn._sequence_nr() == torch._C._autograd._get_sequence_nr() - 1


@contextlib.contextmanager
def _node_hooks(tracker: _Tracker, value: torch.Tensor) -> Iterator[None]:
    """Tell the tracker when backward is between autograd nodes: Note [Gradients summed in place]."""
    handles, seen, stack = [], set(), [value.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        handles += [fn.register_prehook(tracker.node_starts), fn.register_hook(tracker.node_ends)]
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        tracker.between_nodes = False


@contextlib.contextmanager
def _host_rng_states(tracker: _Tracker) -> Iterator[None]:
    """Let the tracker see the copies ``torch.get_rng_state()`` makes of the CPU generator's state.

    The copy (5,056 B for the Mersenne Twister) is made in C++ without the dispatcher, so no mode sees
    it, yet it is real memory: ``torch.utils.checkpoint`` keeps one per region from its forward until
    backward recomputes it, and ``fork_rng`` makes another during the recomputation.
    """
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = original()
        tracker.made_outside(state, "torch.get_rng_state")
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


def _guarded(fake: FakeBatch, model: str, what: str, run: Callable[[], Any]) -> Any:
    """Run one part of the simulated step; a failure names the model and the part.

    With a symbolic B (or S) the failure may be the symbols' fault (a kernel that needs concrete
    sizes), so it is SymbolicUnsupported, and concrete passes take over; at concrete sizes it is a
    CaptureError the user sees.
    """
    try:
        return run()
    except (FxmemError, SymbolicUnsupported, KeyboardInterrupt):
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        message = f"model '{model}': {what} failed in the simulated training step: {type(e).__name__}: {first}"
        if fake.symbols:
            raise SymbolicUnsupported(message) from e
        raise CaptureError(message + "; check the inputs, the loss and the optimizer, or pass --no-peak (peak=False).") from e


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def _paused(tracker: _Tracker) -> Iterator[None]:
    tracker.paused = True
    try:
        yield
    finally:
        tracker.paused = False


def _mark(tracker: _Tracker, categories: dict[int, Category], value: object, category: Category) -> None:
    for t in tree_leaves(value):
        if isinstance(t, torch.Tensor):
            number = tracker.number(t)
            if number is not None:
                categories[number] = category


def _timeline(tracker: _Tracker, categories: Mapping[int, Category], batch: int | None, fake: FakeBatch) -> Timeline:
    convert = _Converter(fake)
    baseline: dict[Category, ByteExpr] = {}
    storages = tuple((category, convert(nbytes)) for category, nbytes in tracker.permanent.values())
    for category, nbytes in storages:
        baseline[category] = baseline.get(category, ByteExpr()) + nbytes
    events = tuple(
        MemoryEvent(
            r.phase,
            r.alloc,
            convert(r.storage.nbytes),
            categories.get(r.storage.number, Category.TEMPORARY),
            r.storage.node,
            r.storage.fqn,
            r.storage.op,
            r.storage.number,
            r.storage.bound,
            r.storage.at_batch,
        )
        for r in tracker.raw
    )
    costs = tuple(
        OpCostRecord(phase, node, fqn, op, dtype, convert(c.flops), convert(c.read_bytes), convert(c.written_bytes), c.has_formula)
        for phase, node, fqn, op, dtype, c in tracker.costs
    )
    contexts = tuple(r.context for r in tracker.raw)
    return Timeline(batch, True, baseline, events, storages, costs, tuple(tracker.checks), contexts, tuple(tracker.corrected))


@dataclass
class _Converter:
    """Storage sizes (ints or SymInts) as ByteExprs, one sympy conversion per distinct expression."""

    fake: FakeBatch
    cache: dict[object, ByteExpr] = field(default_factory=dict)

    def __call__(self, nbytes: object) -> ByteExpr:
        if isinstance(nbytes, int):
            return ByteExpr(fixed=nbytes)
        expr = getattr(getattr(nbytes, "node", None), "expr", nbytes)
        if expr not in self.cache:
            try:
                self.cache[expr] = to_byte_expr(expr, self.fake.symbols.get("B"), self.fake.symbols.get("S"))
            except DataDependentBytes:
                self.cache[expr] = ByteExpr()
            except ValueError as e:  # bytes like floor(B/3): concrete passes take over
                raise SymbolicUnsupported(str(e)) from e
        return self.cache[expr]


def steady_step(first: Timeline) -> Timeline:
    """The steady step's timeline: the first step's, with state allocations moved into the baseline.

    See Note [Steady step from first step].
    """
    moved = {e.storage for e in first.events if e.alloc and e.category == Category.OPTIMIZER_STATE and e.phase == Phase.OPTIMIZER}
    baseline = dict(first.baseline)
    state = tuple((Category.OPTIMIZER_STATE, e.nbytes) for e in first.events if e.alloc and e.storage in moved)
    for _, nbytes in state:
        baseline[Category.OPTIMIZER_STATE] = baseline.get(Category.OPTIMIZER_STATE, ByteExpr()) + nbytes
    events = tuple(e for e in first.events if e.storage not in moved)
    storages = first.baseline_storages + state
    steady = replace(first, first_step=False, baseline=baseline, events=events, baseline_storages=storages, contexts=())
    return steady if first.loop.plain else _held_from_the_step_before(steady)


# Note [What a loop holds from the step before]
#     A steady step starts with what the training loop still holds from the step before it. In the
#     loop fxmem simulates unless told otherwise (``zero_grad(set_to_none=True)`` after
#     ``optimizer.step()``, ``out`` and the loss dropped each step) that is the optimizer state alone.
#     Two common loops hold more, and the first step's timeline says what: a storage it allocates
#     and never releases is held past its end.
#     * ``zero_grad`` just before ``loss.backward()`` (``Loop.zero_grad`` "before-backward"): each
#       gradient lives from one step's backward to the next step's ``zero_grad``, which sets
#       ``p.grad`` to None and so frees it (torch/optim/optimizer.py ``Optimizer.zero_grad``), after
#       that step's forward and loss. A first step has no gradients to free there.
#     * ``for x in data: out = model(x); loss = loss_fn(out, y)`` (``Loop.keep_outputs``): Python
#       rebinds ``out`` only once the next forward has returned, and ``loss`` once the next loss is
#       computed, so the previous step's outputs (an LLM's B x S x vocab logits, and whatever the
#       output holds) live through the next forward, and the previous loss through the next loss.
#       Backward frees what the graph saved, not the outputs themselves.
#     The steady step starts by allocating those storages, before its first op, and releases each
#     where the loop drops it: the outputs when the forward has returned, the loss when the new one is
#     computed, the gradients at ``zero_grad``, just before backward's first op. Held as events rather
#     than in the baseline, they reach an allocator replay as blocks it can free. Everything else is
#     the first step's: the forward, the loss and backward run the same ops whatever the loop holds.
#     ``fxmem.measure_peak`` runs the same loops for real (tests/test_loop.py).


def _held_from_the_step_before(steady: Timeline) -> Timeline:
    """``steady`` starting with what its loop holds from the step before, each storage released where
    the loop drops it: Note [What a loop holds from the step before]."""
    events, loop = steady.events, steady.loop
    released = {e.storage for e in events if not e.alloc}
    kept = [e for e in events if e.alloc and e.storage not in released and _held_over(e, loop)]
    if not kept:
        return steady
    number = max(e.storage for e in events) + 1
    held = [replace(e, phase=Phase.FORWARD, storage=number + k, op=f"{e.op} (held from the step before)") for k, e in enumerate(kept)]
    drops = [replace(h, alloc=False, phase=_dropped_in(e)) for h, e in zip(held, kept)]
    forward, loss = _end_of(events, (Phase.FORWARD,)), _end_of(events, (Phase.FORWARD, Phase.LOSS))
    outputs = [d for d in drops if d.phase == Phase.FORWARD]
    rest = [d for d in drops if d.phase != Phase.FORWARD]
    return replace(steady, events=(*held, *events[:forward], *outputs, *events[forward:loss], *rest, *events[loss:]))


def _held_over(e: MemoryEvent, loop: Loop) -> bool:
    """Whether ``loop`` holds a storage the step leaves alive into the next step (its gradients, its outputs and loss)."""
    if e.category == Category.GRADIENT:
        return loop.zero_grad == "before-backward"
    return loop.keep_outputs and e.phase in (Phase.FORWARD, Phase.LOSS)


def _dropped_in(e: MemoryEvent) -> Phase:
    """Where the loop drops a storage it held from the step before: a gradient at zero_grad, an output
    when the forward returns (``out = model(x)``), the loss when the loss is computed."""
    return Phase.ZERO_GRAD if e.category == Category.GRADIENT else e.phase


def _end_of(events: Sequence[MemoryEvent], phases: tuple[Phase, ...]) -> int:
    """The index of the first event past the leading run of ``phases``."""
    return next((i for i, e in enumerate(events) if e.phase not in phases), len(events))
