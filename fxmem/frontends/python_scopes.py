"""How long a Python name keeps a traced value alive, recorded while fx traces the model.

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

    Not covered: values held by objects other than containers (``self.cache = x``), and graphs made
    by torch.export, which runs the model through Dynamo's bytecode interpreter (their values
    are dropped after their last use, as before).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch.fx as fx

__all__ = ["HELD", "LocalsRecorder", "held_through"]

HELD = "fxmem_held_through"
"""Node meta key: the name of the last node made while a Python name held this node's value."""

_TRACER_FILES = (os.path.dirname(fx.__file__) + os.sep, os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)
_DEPTH = 3
"""How deep into nested tuples, lists and dicts a local is searched for values."""


class LocalsRecorder:
    """Notes, at each node fx makes, which earlier values the running Python frames still name.

    Looking into every frame at every node costs as much as the trace itself; but a frame that has
    called another and waits for it cannot rebind its names. So the recorder keeps the chain of
    frames it saw last, with the values each names, and looks again only into the frames that ran
    since: the innermost one the two chains share, and those below it. A value's hold is written
    when the frame that named it lets go of it (rebinds, returns) or is looked into again."""

    def __init__(self) -> None:
        self._chain: list[tuple[FrameType, set[fx.Node]]] = []
        self._last: fx.Node | None = None

    def observe(self, node: fx.Node) -> None:
        """Mark every value a live frame names as held at least through the node before ``node``,
        and start watching what the frames name now. See Note [Python locals keep values alive]."""
        frames = _model_frames(sys._getframe(1))
        shared = 0
        while shared < min(len(frames), len(self._chain)) and frames[shared] is self._chain[shared][0]:
            shared += 1
        keep = max(shared - 1, 0)  # the innermost shared frame has run since: look again
        for _, named in self._chain[keep:]:
            self._release(named)
        self._chain[keep:] = [(f, set(_named_nodes(f))) for f in frames[keep:]]
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
    if isinstance(value, fx.Proxy):
        yield value.node
    elif depth > 0 and isinstance(value, (tuple, list)):
        for item in value:
            yield from _proxied_nodes(item, depth - 1)
    elif depth > 0 and isinstance(value, dict):
        for item in value.values():
            yield from _proxied_nodes(item, depth - 1)


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
