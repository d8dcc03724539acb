"""Activation checkpointing, the frontends' part: find each ``torch.utils.checkpoint`` call while tracing.

fxmem/engine/recompute.py runs the regions found here through the real checkpoint.

Note [Checkpointed regions]
    ``torch.fx.symbolic_trace`` runs ``checkpoint(fn, *args)`` like any Python call, so the nodes of
    ``fn`` land in the graph and the checkpoint is gone: fxmem would count every tensor ``fn`` saves,
    when a real step keeps only the checkpoint's inputs and recomputes the rest in backward (a 4-block
    MLP checkpointed per block keeps 2 MiB at B=8, not 18 MiB). So the tracer stands in for the two
    entry points every checkpoint call goes through (non-reentrant: the generator
    ``_checkpoint_without_reentrant_generator``; reentrant: ``CheckpointFunction.apply``), whatever
    name the model imported it under, and notes which nodes each call made, its arguments and its
    options: a ``Region``. The passes that run the graph (capture, the step's timeline, the real
    per-node measurement) then call the real ``torch.utils.checkpoint.checkpoint`` over those nodes with
    the same arguments and options, so torch itself decides what is saved (the inputs, through the
    outer saved-tensor hooks: what a real step's hooks see) and autograd recomputes the region in
    backward, which the timeline sees as it happens. Nothing about checkpointing is re-derived.

    A region's nodes run with no saved-tensor hooks of the pass's own: hooks do not nest, and the
    innermost pair would take the checkpoint's place. Values from outside the region that it reads
    without receiving them as arguments (a mask in a closure) are held by the region, as the closure
    holds them in eager.

    torch.export traces through a checkpoint the same way, building its graph in a proxy mode: while
    it runs, the generator stand-in tags each node the call makes (node metadata survives into
    ``ExportedProgram.module()``) and notes which nodes its arguments were, and the regions are rebuilt
    from the tags. Two kinds export cannot give back are refused rather than counted as if nothing
    were recomputed: reentrant checkpoints (an autograd.Function whose no_grad forward export records
    as grad-mode switches) and nested ones (export wraps them in a grad-mode submodule).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint as torch_checkpoint
from torch.fx.node import map_aggregate
from torch.utils._pytree import tree_leaves

__all__ = [
    "Region", "attach_exported_regions", "attach_regions", "checkpoint_regions", "copy_regions", "deepcopy_graph", "recording_checkpoints", "tagging_checkpoints",
]  # fmt: skip

_META = "fxmem_checkpoint_regions"


@dataclass(frozen=True)
class Region:
    """One ``torch.utils.checkpoint`` call seen while tracing (See Note [Checkpointed regions])."""

    nodes: tuple[fx.Node, ...]
    """The nodes the checkpointed function made, in graph order (nested regions' included)."""
    args: tuple[Any, ...]
    """The call's positional arguments: nodes where the model passed traced values, else constants."""
    kwargs: Mapping[str, Any]
    options: Mapping[str, Any]
    """``use_reentrant`` and the options of the call, as ``checkpoint`` takes them."""
    parent: int | None = None

    @property
    def first(self) -> fx.Node:
        return self.nodes[0]

    def outputs(self) -> tuple[fx.Node, ...]:
        """The region's nodes that nodes outside it use: what the checkpoint must return."""
        inside = set(self.nodes)
        return tuple(n for n in self.nodes if any(u not in inside for u in n.users))

    def leaves(self) -> list[Any]:
        """The call's arguments flattened, positional then keyword: nodes and constants."""
        return tree_leaves((self.args, dict(self.kwargs)))

    def passed(self) -> set[fx.Node]:
        """The nodes the call receives as arguments."""
        return {a for a in self.leaves() if isinstance(a, fx.Node)}

    def closure(self) -> tuple[fx.Node, ...]:
        """Nodes from outside the region that it reads without receiving them as arguments."""
        inside, passed = set(self.nodes), self.passed()
        seen: dict[fx.Node, None] = {}
        for n in self.nodes:
            for a in n.all_input_nodes:
                if a not in inside and a not in passed:
                    seen.setdefault(a)
        return tuple(seen)


@dataclass
class _Recording:
    """The regions of one trace, kept open as a stack while their functions are being traced."""

    tracer: fx.Tracer
    regions: list[Region] = field(default_factory=list)
    open: list[tuple[int, tuple[Any, ...], dict[str, Any], dict[str, Any]]] = field(default_factory=list)

    def begin(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], options: dict[str, Any]) -> None:
        as_node = lambda a: a.node if isinstance(a, fx.Proxy) else a
        self.open.append((len(self.tracer.graph.nodes), map_aggregate(args, as_node), map_aggregate(dict(kwargs), as_node), options))

    def end(self) -> None:
        start, args, kwargs, options = self.open.pop()
        nodes = tuple(list(self.tracer.graph.nodes)[start:])
        if nodes:
            self.regions.append(Region(nodes, tuple(args), kwargs, options))


@contextlib.contextmanager
def recording_checkpoints(tracer: fx.Tracer) -> Iterator[list[Region]]:
    """While tracing with ``tracer``, record every checkpoint call as a Region (the list is filled in)."""
    recording = _Recording(tracer)
    signature = inspect.signature(torch_checkpoint._checkpoint_without_reentrant_generator)

    def traced_generator(*args: Any, **kwargs: Any) -> Iterator[None]:
        recording.begin(*_bind(signature, args, kwargs))
        yield
        recording.end()

    class TracedCheckpointFunction:
        @staticmethod
        def apply(run: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
            recording.begin(args, {}, {"use_reentrant": True, "preserve_rng_state": preserve_rng_state})
            out = run(*args)
            recording.end()
            return out

    with _standing_in(traced_generator, TracedCheckpointFunction):
        yield recording.regions


@contextlib.contextmanager
def _standing_in(generator: Callable[..., Iterator[None]], function: type) -> Iterator[None]:
    """Put ``generator`` and ``function`` where every checkpoint call looks its two entry points up
    (module globals of torch.utils.checkpoint, read at each call), and put torch's back after."""
    saved = torch_checkpoint._checkpoint_without_reentrant_generator, torch_checkpoint.CheckpointFunction
    torch_checkpoint._checkpoint_without_reentrant_generator = generator
    torch_checkpoint.CheckpointFunction = function  # type: ignore[assignment, misc]
    try:
        yield
    finally:
        torch_checkpoint._checkpoint_without_reentrant_generator, torch_checkpoint.CheckpointFunction = saved  # type: ignore[misc]


_TAG = "fxmem_checkpoint"
"""node.meta key on exported graphs: the checkpoint calls (innermost first) whose code made the node."""


@dataclass(frozen=True)
class _ExportedCall:
    """What the exporting frontend learns of one non-reentrant checkpoint call while torch.export traces it."""

    options: Mapping[str, Any]
    args: tuple[str | None, ...]
    """The names of the graph nodes the call's tensor arguments were (None: not a traced value)."""


@contextlib.contextmanager
def tagging_checkpoints() -> Iterator[_ExportCheckpoints]:
    """While torch.export traces, tag the nodes each checkpoint call makes, each call still run by torch.

    torch.export traces through a checkpoint like fx does (Note [Checkpointed regions]); the proxy
    mode's graph is the one being built, and node metadata survives into ``ExportedProgram.module()``,
    so ``attach_exported_regions`` can rebuild the regions there. A reentrant checkpoint is an
    autograd.Function whose forward runs under no_grad, which export records as grad-mode nodes that a
    replay inside a checkpoint cannot take: those calls are only counted, and the frontend refuses them.
    """
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    found = _ExportCheckpoints()
    generator = torch_checkpoint._checkpoint_without_reentrant_generator
    function = torch_checkpoint.CheckpointFunction
    signature = inspect.signature(generator)

    def name_of(a: Any, tracer: Any) -> str | None:
        slot = get_proxy_slot(a, tracer, None) if tracer is not None and isinstance(a, torch.Tensor) else None
        return str(slot.proxy.node.name) if slot is not None else None

    def tagged_generator(*args: Any, **kwargs: Any) -> Iterator[None]:
        mode = get_proxy_mode()
        graph = mode.tracer.graph if mode is not None else None
        if graph is None:
            found.untagged += 1
            yield from generator(*args, **kwargs)
            return
        call_args, _, options = _bind(signature, args, kwargs)
        index = len(found.calls)
        found.calls.append(_ExportedCall(options, tuple(name_of(a, mode.tracer) for a in call_args)))  # type: ignore[union-attr]
        start = len(graph.nodes)
        yield from generator(*args, **kwargs)
        for n in list(graph.nodes)[start:]:
            n.meta.setdefault(_TAG, []).append(index)

    class CountedCheckpointFunction:
        @staticmethod
        def apply(*args: Any) -> Any:
            found.reentrant += 1
            return function.apply(*args)

    with _standing_in(tagged_generator, CountedCheckpointFunction):
        yield found


@dataclass
class _ExportCheckpoints:
    calls: list[_ExportedCall] = field(default_factory=list)
    reentrant: int = 0
    untagged: int = 0
    """Calls made where no proxy mode was tracing (none expected): they cannot be located in the graph."""

    def unsupported(self) -> int:
        return self.reentrant + self.untagged


def _bind(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]]:
    """The checkpointed function's arguments and the checkpoint's options, from a call of the
    non-reentrant generator (its *args and **kwargs found by kind, not by name)."""
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    named.pop(next(iter(signature.parameters)))  # the checkpointed function, first in every version
    star = {p.kind: name for name, p in signature.parameters.items() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    call_args = named.pop(star.get(inspect.Parameter.VAR_POSITIONAL, ""), ())
    call_kwargs = named.pop(star.get(inspect.Parameter.VAR_KEYWORD, ""), {})
    return tuple(call_args), dict(call_kwargs), {"use_reentrant": False, **named}


def attach_exported_regions(gm: fx.GraphModule, found: _ExportCheckpoints) -> int:
    """Rebuild the regions of an exported graph from the tags ``tagging_checkpoints`` left on its nodes;
    return how many calls could not be rebuilt (the frontend refuses the model then).

    A call's arguments are the nodes that carry its argument names; what else the region reads from
    outside (a mask bound into the function, the weights) it holds as a closure, as eager does. A
    call export wrapped into a submodule (a nested checkpoint comes out inside a
    ``wrap_with_set_grad_enabled``) has lost nodes to it, and is not rebuilt.
    """
    by_call: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":  # a constant first read inside a call (a 4-bit weight's scales) is lifted to the graph's top: state, not recomputed
            continue
        for index in n.meta.get(_TAG, ()):
            by_call.setdefault(index, []).append(n)
    if any(n.op == "call_module" or isinstance(n.target, torch._ops.HigherOrderOperator) for n in gm.graph.nodes):
        return found.unsupported() + len(found.calls)
    names = {n.name: n for n in gm.graph.nodes}
    regions = []
    for index, nodes in sorted(by_call.items()):
        call = found.calls[index]
        args = tuple(names.get(a) if a is not None else None for a in call.args)
        regions.append(Region(tuple(nodes), args, {}, call.options))
    attach_regions(gm, regions)
    return found.unsupported() + len(found.calls) - len(regions)


def attach_regions(gm: fx.GraphModule, regions: list[Region]) -> None:
    """Keep a trace's regions on its GraphModule, nested ones linked to the region around them."""
    ordered = sorted(regions, key=lambda r: (_position(r.first), -len(r.nodes)))
    linked: list[Region] = []
    for region in ordered:
        parent = next((i for i in reversed(range(len(linked))) if set(region.nodes) <= set(linked[i].nodes)), None)
        linked.append(Region(region.nodes, region.args, region.kwargs, region.options, parent))
    if linked:
        gm.meta[_META] = tuple(linked)


def checkpoint_regions(gm: fx.GraphModule) -> tuple[Region, ...]:
    """The checkpointed regions of a graph fxmem traced or exported (none where nothing was checkpointed)."""
    return tuple(gm.meta.get(_META, ()))


def deepcopy_graph(gm: fx.GraphModule, memo: dict[int, object]) -> fx.GraphModule:
    """``copy.deepcopy(gm, memo)`` with its regions carried over by ``copy_regions``. The regions are
    left out of the copy itself: they hold the graph's Nodes, and deepcopy would follow each Node's
    links to the next one, a recursion as deep as the graph is long (a 32-block Llama's checkpointed
    graph exceeds Python's limit)."""
    regions = gm.meta.get(_META)
    if regions is not None:
        memo[id(regions)] = ()  # replaced by copy_regions below
    copied = copy.deepcopy(gm, memo)
    copy_regions(gm, copied)
    return copied


def copy_regions(source: fx.GraphModule, copied: fx.GraphModule) -> None:
    """Put ``source``'s regions on ``copied``, a copy of its graph, each node by its name. ``copy.deepcopy``
    of a GraphModule does not carry them over: fx copies nodes keyed by the Node (``Graph.graph_copy``'s
    ``val_map``), deepcopy's memo by ``id``, so the regions in the copied meta name fresh nodes of no
    graph, and the copy would run without its checkpoints (an FSDP2 rank's step did, 72% high)."""
    regions = checkpoint_regions(source)
    if not regions:
        return
    by_name = {n.name: n for n in copied.graph.nodes}
    swap = lambda a: by_name[a.name] if isinstance(a, fx.Node) else a
    copied.meta[_META] = tuple(
        replace(
            r, nodes=tuple(by_name[n.name] for n in r.nodes), args=map_aggregate(r.args, swap), kwargs=map_aggregate(dict(r.kwargs), swap)
        )
        for r in regions
    )


def _position(n: fx.Node) -> int:
    return next(i for i, m in enumerate(n.graph.nodes) if m is n)
