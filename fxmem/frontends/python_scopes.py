"""How long a Python name keeps a traced value alive, recorded while fx traces the model or
torch.export exports it.

Note [Python locals keep values alive]
    In eager PyTorch a tensor lives while anything refers to it, and a local variable does until it
    is rebound or its function returns (CPython frees a frame's locals when the frame ends; see
    "Naming and binding" in the Python reference). In::

        def forward(self, x):
            h = self.up(x)
            y = h * 2.0
            return y + 1.0

    ``h`` is alive while ``y + 1.0`` runs, although nothing reads it there. An fx graph has no names:
    the fx Interpreter drops each value after its last use, so a replay of the graph frees ``h``
    one op early and a forward's peak comes out low by one tensor (-49% on the model above, where
    the forward's end is the step's peak). The same holds for every frame on the way, including
    ``nn.Module._call_impl``'s ``args``, which keep a submodule's inputs alive until it returns.

    The tracer runs the model's own Python, so the names exist while it traces: each time fx makes
    a node, ``LocalsRecorder`` looks at the locals of every frame between the model's ``forward``
    and the tracer, and notes in each value it finds there (a Proxy, or one inside a tuple, list or
    dict such as Hugging Face's ModelOutput) the name of the node being made. The last such note is
    the last node that runs while a name still holds the value; the timeline keeps the value until
    that node has run (``held_through``). The tracer's own frames (torch.fx, fxmem) are skipped:
    they do not exist in eager.

    Not covered: values held by objects other than containers (``self.cache = x``).

Note [Python locals on an exported graph]
    torch.export (non-strict, as fxmem runs it) also runs the model's own Python, on fake tensors,
    while make_fx's proxy mode records each ATen op as a node; nothing there creates nodes that fxmem
    can hook, and the graph it returns names no locals. So during the export the model's forward runs
    inside ``ExportLocals``, a TorchFunctionMode entered inside forward (export's own function modes
    would otherwise take the calls first): at each torch call it looks into the frames between
    forward and the call, as ``LocalsRecorder`` does at each node, and finds each named tensor's node
    through the proxy mode's own record (``get_proxy_slot``; ``node.meta["val"]`` is a detached copy,
    not the tensor the frame names). A value a frame stops naming is held through the last node made
    before the call that saw it gone. Export renames and drops nodes after tracing, so the record is
    kept in positions: each traced node's position (``ORDER``) and, for a held value, its hold's
    (``HELD_AT``), in node meta, which export copies to the graph it returns; ``name_exported_holds``
    then writes ``HELD`` as the last surviving node at or before that position.

    Frames that exist only in export (torch.fx's module-stack tracer, torch.export's own) are skipped
    like the fx tracer's. Measured: a SegFormer-style decode head that keeps its up-sampled maps in a
    tuple until it returns (tests/test_export_locals.py) had its step's peak 23% low at B=2 and 24% at
    B=8 on the exported graph (the maps died at the cat); with the record it equals a real CPU step's,
    as the fx-traced graph of the same head does.

    Not covered, beyond what fx misses: the locals of a torch function written in Python that export
    takes apart into ATen ops (``F.multi_head_attention_forward``'s q, k, v): the mode sees the call
    once, at its start, and the function's body runs with the mode off, so its values die at their
    last use there. fx records such a call as one node, whose insides the rules model.
"""

from __future__ import annotations

import bisect
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

__all__ = ["HELD", "ExportLocals", "LocalsRecorder", "held_through", "name_exported_holds"]

HELD = "fxmem_held_through"
"""Node meta key: the name of the last node made while a Python name held this node's value."""

_TRACER_FILES = (os.path.dirname(fx.__file__) + os.sep, os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)
_DEPTH = 3
"""How deep into nested tuples, lists and dicts a local is searched for values."""

ORDER = "fxmem_traced_at"
"""Node meta key, on an exported graph: the node's position in the graph export traced (Note [Python locals on an exported graph])."""
HELD_AT = "fxmem_held_at"
"""Node meta key, on an exported graph: the traced position of the last node a Python name held this node's value through."""

_EXPORT_FILES = tuple(os.path.join(os.path.dirname(torch.__file__), d) + os.sep for d in ("export", "_export", "_subclasses", "_dynamo"))
"""torch.export's own frames, which do not exist in eager (torch.fx's are in ``_TRACER_FILES``)."""
_SKIPPED_FILES = _TRACER_FILES + _EXPORT_FILES


class _Chain:
    """The chain of frames seen last, each with the values it named then; see ``LocalsRecorder``."""

    def __init__(self) -> None:
        self._chain: list[tuple[FrameType, set[fx.Node]]] = []

    def look(self, frames: Sequence[FrameType], named: Callable[[FrameType], set[fx.Node]]) -> list[set[fx.Node]]:
        """Look again into the frames that ran since the last look (the innermost shared one and those
        below it: a frame waiting on a call cannot rebind its names); returns what they named before."""
        shared = 0
        while shared < min(len(frames), len(self._chain)) and frames[shared] is self._chain[shared][0]:
            shared += 1
        keep = max(shared - 1, 0)  # the innermost shared frame has run since: look again
        released = [named_then for _, named_then in self._chain[keep:]]
        self._chain[keep:] = [(f, named(f)) for f in frames[keep:]]
        return released


class LocalsRecorder:
    """Notes, at each node fx makes, which earlier values the running Python frames still name.

    Looking into every frame at every node costs as much as the trace itself; but a frame that has
    called another and waits for it cannot rebind its names. So the recorder keeps the chain of
    frames it saw last, with the values each names, and looks again only into the frames that ran
    since: the innermost one the two chains share, and those below it. A value's hold is written
    when the frame that named it lets go of it (rebinds, returns) or is looked into again."""

    def __init__(self) -> None:
        self._chain = _Chain()
        self._last: fx.Node | None = None

    def observe(self, node: fx.Node) -> None:
        """Mark every value a live frame names as held at least through the node before ``node``,
        and start watching what the frames name now. See Note [Python locals keep values alive]."""
        for named in self._chain.look(_model_frames(sys._getframe(1)), lambda f: set(_named_nodes(f))):
            self._release(named)
        self._last = node

    def _release(self, named: set[fx.Node]) -> None:
        if self._last is None:
            return
        for held in named:
            if held.op in ("call_function", "call_method", "call_module"):
                held.meta[HELD] = self._last.name


def _model_frames(frame: FrameType | None) -> list[FrameType]:
    """The frames between the tracer's entry and ``frame`` that would exist in eager, outermost first."""
    found: list[FrameType] = []
    while frame is not None:
        code = frame.f_code
        if code.co_name == "trace" and code.co_filename.startswith(_TRACER_FILES[0]):
            break  # the tracer's entry: what is above it is the caller, not the model
        if not code.co_filename.startswith(_TRACER_FILES):
            found.append(frame)
        frame = frame.f_back
    found.reverse()
    return found


def _named_nodes(frame: FrameType) -> Iterator[fx.Node]:
    for value in frame.f_locals.values():
        yield from _proxied_nodes(value, _DEPTH)


def _proxied_nodes(value: Any, depth: int) -> Iterator[fx.Node]:
    """The nodes of the proxies in ``value``; an attribute proxy fx has not made a node for yet
    (``weight.quantized_data`` before its first use) holds nothing, and asking for its node would make one."""
    return (proxy.node for proxy in _found(value, depth, fx.Proxy) if not (isinstance(proxy, fx.proxy.Attribute) and proxy._node is None))


def _found(value: Any, depth: int, kind: type) -> Iterator[Any]:
    """The values of ``kind`` in ``value`` and in the tuples, lists and dicts it nests, ``depth`` levels down."""
    if isinstance(value, kind):
        yield value
    elif depth > 0 and isinstance(value, (tuple, list, dict)):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _found(item, depth - 1, kind)


class ExportLocals(TorchFunctionMode):
    """Notes, at each torch call the model's forward makes while torch.export traces it, which traced
    values the running Python frames still name (Note [Python locals on an exported graph]).

    Entered inside the forward, from the frame ``entry``: the frames above it are the caller's and
    export's. Writes the record into the traced graph's node meta when the forward returns (``close``)."""

    def __init__(self, entry: FrameType) -> None:
        super().__init__()
        self._entry = entry
        self._chain = _Chain()
        self._held: dict[fx.Node, fx.Node] = {}
        self._graph: fx.Graph | None = None

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        frames = _frames_below(sys._getframe(1), self._entry)
        if frames is not None:
            self._look(frames)
        return func(*args, **(kwargs or {}))

    def close(self) -> None:
        """The forward returned: its frames let go of everything; write the holds into the graph."""
        self._look([])
        if self._graph is None:
            return
        order = {n: i for i, n in enumerate(self._graph.nodes)}
        for n, i in order.items():
            n.meta[ORDER] = i
        for value, until in self._held.items():
            if value in order and until in order:
                value.meta[HELD_AT] = order[until]

    def _look(self, frames: Sequence[FrameType]) -> None:
        tracer = _export_tracer()
        if tracer is None:
            return
        self._graph = tracer.graph
        last = next(iter(reversed(tracer.graph.nodes)), None)  # the last node the calls so far made
        for named in self._chain.look(frames, lambda f: set(_traced_nodes(f, tracer))):
            for held in named:
                if last is not None and held.op == "call_function":
                    self._held[held] = last


def _export_tracer() -> Any:
    """The make_fx tracer recording the export, or None (not tracing, or a torch without the API)."""
    try:
        from torch.fx.experimental.proxy_tensor import get_proxy_mode
    except ImportError:
        return None
    mode = get_proxy_mode()
    return getattr(mode, "tracer", None)


def _frames_below(frame: FrameType | None, entry: FrameType) -> list[FrameType] | None:
    """The frames between ``entry`` (excluded) and ``frame`` that would exist in eager, outermost
    first; None for a call not made from inside the forward (nothing of the model's to look into)."""
    found: list[FrameType] = []
    while frame is not None and frame is not entry:
        if not frame.f_code.co_filename.startswith(_SKIPPED_FILES):
            found.append(frame)
        frame = frame.f_back
    if frame is None:
        return None
    found.reverse()
    return found


def _traced_nodes(frame: FrameType, tracer: Any) -> Iterator[fx.Node]:
    from torch.fx.experimental.proxy_tensor import get_proxy_slot

    for value in frame.f_locals.values():
        for t in _tensors(value, _DEPTH):
            slot = get_proxy_slot(t, tracer, None)
            proxy = getattr(slot, "proxy", None)
            if isinstance(proxy, fx.Proxy):
                yield proxy.node


def _tensors(value: Any, depth: int) -> Iterator[torch.Tensor]:
    return _found(value, depth, torch.Tensor)


def name_exported_holds(graph: fx.Graph) -> None:
    """Write ``HELD`` on an exported graph from the positions ``ExportLocals`` recorded: the last
    node still in the graph at or before each hold's position (Note [Python locals on an exported graph])."""
    surviving = sorted((n.meta[ORDER], i, n) for i, n in enumerate(graph.nodes) if isinstance(n.meta.get(ORDER), int))
    positions = [p for p, _, _ in surviving]
    for n in graph.nodes:
        at = n.meta.get(HELD_AT)
        if not isinstance(at, int):
            continue
        k = bisect.bisect_right(positions, at) - 1
        if k >= 0:
            n.meta[HELD] = surviving[k][2].name


def held_through(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """For each value a Python name held beyond its last use: the last node it must outlive.
    See Note [Python locals keep values alive]."""
    by_name = {n.name: n for n in graph.nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    held: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        until = by_name.get(n.meta.get(HELD, ""))
        if until is None or order[until] <= order[n]:
            continue
        last_use = max((order[u] for u in n.users), default=-1)
        if order[until] > last_use and not any(u.op == "output" for u in n.users):
            held[n] = until
    return held
