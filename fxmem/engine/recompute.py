"""Run the checkpointed regions of a graph through the real ``torch.utils.checkpoint``.

The passes that run a graph (capture, the step's timeline, the real per-node measurement) interpret it
with ``RegionInterpreter``: torch itself then decides what a region keeps, and backward recomputes it.
See Note [Checkpointed regions] in fxmem/frontends/checkpointing.py, which finds the regions.

Note [What a selective checkpoint keeps]
    A checkpoint called with ``context_fn=lambda: create_selective_checkpoint_contexts(policy)`` keeps,
    besides its inputs, the outputs of the ops its policy marks MUST_SAVE or PREFER_SAVE. They pass
    through no saved-tensor hook: the forward context, a ``_CachingTorchDispatchMode``, stores each
    op's output (detached, so sharing its storage) as a ``_VersionWrapper`` in
    ``storage[op][call index]``, and ``_RECOMPUTE`` for the others; backward's
    ``_CachedTorchDispatchMode`` hands the stored tensor back and drops it (torch/utils/checkpoint.py).
    So torch's own policy decides, and fxmem reads its decisions where torch keeps them: each region's
    ``context_fn`` is wrapped to see the forward context it makes (``context_fn`` runs once per call,
    in forward), and ``SelectiveCache.new`` lists the tensors it stored since it was last asked, so a
    pass asking after each node charges each one to the node whose ops made it (a kept view's storage
    stays with the node that allocated it: Note [Counting storages once] in fxmem/engine/capture.py).
    Only forward calls are watched: a nested call's recomputation in backward keeps for its own
    backward, after the forward's count. A ``context_fn`` whose
    forward context is not torch's caching mode (a user's own dispatch mode) keeps nothing seen here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint as torch_checkpoint
from torch.fx.node import map_aggregate
from torch.utils._pytree import tree_leaves

from fxmem.errors import CaptureError, FxmemError
from fxmem.frontends.checkpointing import Region, checkpoint_regions

__all__ = ["SIGNALS", "RegionInterpreter", "SelectiveCache"]

SIGNALS: tuple[type[BaseException], ...] = tuple(
    e for e in (getattr(torch_checkpoint, "_StopRecomputationError", None),) if e is not None
)
"""Exceptions checkpoint raises through the region's nodes on purpose: early stop of a recomputation
once it has made every tensor backward needs. Node error handlers must let them pass."""


class SelectiveCache:
    """The outputs one selective checkpoint call keeps for backward (Note [What a selective checkpoint keeps])."""

    def __init__(self, mode: torch_checkpoint._CachingTorchDispatchMode) -> None:
        self._storage = mode.storage
        self._seen: set[tuple[object, int]] = set()

    def new(self) -> list[torch.Tensor]:
        """The tensors stored since the last call (outputs the policy said to recompute are not stored)."""
        found = []
        for op, entries in list(self._storage.items()):
            for index, entry in list(entries.items()):
                if (op, index) not in self._seen:
                    self._seen.add((op, index))
                    found += [w.val for w in tree_leaves(entry) if isinstance(w, torch_checkpoint._VersionWrapper)]
        return [t for t in found if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def selective_caches() -> Iterator[list[SelectiveCache]]:
    """For an eager run (no fx): every selective checkpoint's cache, as each call opens it. Every
    non-reentrant ``checkpoint`` call goes through ``_checkpoint_without_reentrant_generator``, looked
    up at call time (see Note [Checkpointed regions] in fxmem/frontends/checkpointing.py), which is
    given the call's ``context_fn``: it is wrapped here to note the caching mode it returns."""
    found: list[SelectiveCache] = []
    original = torch_checkpoint._checkpoint_without_reentrant_generator

    def generator(fn: Any, preserve: bool = True, context_fn: Any = torch_checkpoint.noop_context_fn, *rest: Any, **kwargs: Any) -> Any:
        def observed() -> tuple[Any, Any]:
            forward, recompute = context_fn()
            if isinstance(forward, torch_checkpoint._CachingTorchDispatchMode):
                found.append(SelectiveCache(forward))
            return forward, recompute

        return original(fn, preserve, observed, *rest, **kwargs)

    torch_checkpoint._checkpoint_without_reentrant_generator = generator  # type: ignore[assignment]
    try:
        yield found
    finally:
        torch_checkpoint._checkpoint_without_reentrant_generator = original


class RegionInterpreter(fx.Interpreter):
    """An fx Interpreter that runs each checkpointed region through ``torch.utils.checkpoint``.

    Subclasses put their per-node work in ``run_one`` and may wrap an outermost region's checkpoint
    call in ``region_call`` (to see what it saves). ``self.checkpointed`` is how many regions are
    running: inside one, a pass installs no saved-tensor hooks of its own.
    """

    passthrough: tuple[type[BaseException], ...] = (FxmemError, KeyboardInterrupt, *SIGNALS)
    """Exceptions a region's checkpoint call lets through as they are (subclasses add their own)."""

    def __init__(self, gm: fx.GraphModule, *, garbage_collect_values: bool, model_label: str) -> None:
        super().__init__(gm, garbage_collect_values=garbage_collect_values)
        self.model_label = model_label
        regions = checkpoint_regions(gm)
        self.checkpointed = 0
        self._regions = regions
        self._top = {n: i for i, r in enumerate(regions) if r.parent is None for n in r.nodes}
        """The outermost region each node belongs to (outermost regions do not overlap)."""
        self._ready: dict[fx.Node, Any] = {}
        self._forward = False
        self._plans: dict[int, list[tuple[fx.Node | int, tuple[fx.Node, ...]]]] = {}
        self.caches: list[SelectiveCache] = []
        """The selective checkpoint calls of this forward, in call order (Note [What a selective checkpoint keeps])."""

    def run_one(self, n: fx.Node) -> Any:
        return super().run_node(n)

    def region_call(self, region: Region) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()

    def recompute_context(self) -> contextlib.AbstractContextManager[object]:
        """What a region recomputed in backward runs inside: what the forward ran inside (the target's
        kernels), which checkpoint cannot restore since it is none of autocast, RNG or device state."""
        return contextlib.nullcontext()

    def cached(self) -> list[torch.Tensor]:
        """The tensors every selective checkpoint stored since the last call (Note [What a selective checkpoint keeps])."""
        return [t for cache in self.caches for t in cache.new()]

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self._forward = True
        try:
            return super().run(*args, **kwargs)
        finally:
            self._forward = False
            self.env = {}  # a region recomputed in backward holds this interpreter, not its values
            self.caches = []

    def run_node(self, n: fx.Node) -> Any:
        index = self._top.get(n)
        if index is None:
            return self.run_one(n)
        if n in self._ready:
            return self._ready.pop(n)
        region = self._regions[index]
        if n is not region.first:
            return None  # a value inside the checkpoint: nobody outside it holds one
        try:
            self._ready.update(self._call(index, self.env.__getitem__))
        except self.passthrough:
            raise
        except Exception as e:  # the checkpoint call itself (its options); a node's failure is run_one's to name
            raise CaptureError(
                f"model '{self.model_label}': the torch.utils.checkpoint call whose region starts at node '{n.name}' "
                f"({n.format_node()}) failed: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}. "
                "A real run fails the same way: fix the call's arguments (use_reentrant, determinism_check, context_fn, ...)."
            ) from e
        return self._ready.pop(n, None)

    def _call(self, index: int, lookup: Callable[[fx.Node], Any]) -> dict[fx.Node, Any]:
        """Run region ``index`` through the real checkpoint; its outputs by node."""
        region = self._regions[index]
        value = lambda a: lookup(a) if isinstance(a, fx.Node) else a
        args, kwargs = map_aggregate(region.args, value), map_aggregate(dict(region.kwargs), value)
        held = {n: lookup(n) for n in region.closure()}
        outputs = region.outputs()

        def body(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
            env = dict(held)
            for node, given in zip(region.leaves(), tree_leaves((args, kwargs))):
                if isinstance(node, fx.Node):
                    env[node] = given
            self.checkpointed += 1
            try:
                with contextlib.nullcontext() if self._forward else self.recompute_context():
                    self._run_region(index, env)
            finally:
                self.checkpointed -= 1
            return tuple(env[o] for o in outputs)

        outermost = self.region_call(region) if not self.checkpointed else contextlib.nullcontext()
        with outermost:  # a nested checkpoint's inputs are saved to the checkpoint around it, not to the pass
            result = torch_checkpoint.checkpoint(body, *args, **self._observed(region.options), **kwargs)
        return dict(zip(outputs, result))

    def _observed(self, options: Mapping[str, Any]) -> Mapping[str, Any]:
        """The call's options, its ``context_fn`` wrapped to note a selective checkpoint's caching mode."""
        context_fn = options.get("context_fn")
        if context_fn is None or context_fn is torch_checkpoint.noop_context_fn:
            return options

        def observed() -> tuple[Any, Any]:
            forward, recompute = context_fn()
            if self._forward and isinstance(forward, torch_checkpoint._CachingTorchDispatchMode):  # not a nested call recomputed
                self.caches.append(SelectiveCache(forward))
            return forward, recompute

        return {**options, "context_fn": observed}

    def _run_region(self, index: int, env: dict[fx.Node, Any]) -> None:
        """Run a region's steps in ``env``, each value dropped after its last use, as eager drops a
        local: a region's intermediates are not kept, so holding them would raise the forward's peak."""
        for step, done in self._steps(index):
            if isinstance(step, fx.Node):
                env[step] = self._run_in(step, env)
            else:
                env.update(self._call(step, env.__getitem__))
            if self.garbage_collect_values:
                for n in done:
                    env.pop(n, None)

    def _steps(self, index: int) -> list[tuple[fx.Node | int, tuple[fx.Node, ...]]]:
        """A region's steps (its own nodes, and nested regions as one step each), each with the values
        last read there; the region's outputs are never dropped."""
        cached = self._plans.get(index)
        if cached is not None:
            return cached
        region = self._regions[index]
        owner = {n: i for i, r in enumerate(self._regions) if r.parent == index for n in r.nodes}
        steps: list[fx.Node | int] = []
        reads: list[set[fx.Node]] = []
        for n in region.nodes:
            child = owner.get(n)
            if child is None:
                steps.append(n)
                reads.append(set(n.all_input_nodes))
            elif n is self._regions[child].first:
                inner = self._regions[child]
                steps.append(child)
                reads.append(inner.passed() | set(inner.closure()))
        last = {n: i for i, read in enumerate(reads) for n in read}
        keep = set(region.outputs())
        plan = [(step, tuple(n for n in reads[i] if last[n] == i and n not in keep)) for i, step in enumerate(steps)]
        self._plans[index] = plan
        return plan

    def _run_in(self, n: fx.Node, env: dict[fx.Node, Any]) -> Any:
        outer, self.env = self.env, env
        try:
            return self.run_region_node(n, self.run_one)
        finally:
            self.env = outer

    def run_region_node(self, n: fx.Node, run: Callable[[fx.Node], Any]) -> Any:
        """Run ``n``, a node inside a region (``run``: the interpreter's own step); fxmem/engine/module_hooks.py
        wraps it in the hooks of the modules that open or close there."""
        return run(n)
