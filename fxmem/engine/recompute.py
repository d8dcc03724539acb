"""Run the checkpointed regions of a graph through the real ``torch.utils.checkpoint``.

The passes that run a graph (capture, the step's timeline, the real per-node measurement) interpret it
with ``RegionInterpreter``: torch itself then decides what a region keeps, and backward recomputes it.
See Note [Checkpointed regions] in fxmem/frontends/checkpointing.py, which finds the regions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch.fx as fx
import torch.utils.checkpoint as torch_checkpoint
from torch.fx.node import map_aggregate
from torch.utils._pytree import tree_leaves

from fxmem.errors import CaptureError, FxmemError
from fxmem.frontends.checkpointing import Region, checkpoint_regions

__all__ = ["SIGNALS", "RegionInterpreter"]

SIGNALS: tuple[type[BaseException], ...] = tuple(
    e for e in (getattr(torch_checkpoint, "_StopRecomputationError", None),) if e is not None
)
"""Exceptions checkpoint raises through the region's nodes on purpose: early stop of a recomputation
once it has made every tensor backward needs. Node error handlers must let them pass."""


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

    def run_one(self, n: fx.Node) -> Any:
        return super().run_node(n)

    def region_call(self, region: Region) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()

    def recompute_context(self) -> contextlib.AbstractContextManager[object]:
        """What a region recomputed in backward runs inside: what the forward ran inside (the target's
        kernels), which checkpoint cannot restore since it is none of autocast, RNG or device state."""
        return contextlib.nullcontext()

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self._forward = True
        try:
            return super().run(*args, **kwargs)
        finally:
            self._forward = False
            self.env = {}  # a region recomputed in backward holds this interpreter, not its values

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
            result = torch_checkpoint.checkpoint(body, *args, **region.options, **kwargs)
        return dict(zip(outputs, result))

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
            return self.run_one(n)
        finally:
            self.env = outer
