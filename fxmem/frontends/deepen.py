"""A model with a block stack traced with its copies cut to 3 and 4 blocks (``trace_blocks``); an
exported one's whole graph built from its 4-block copy, the middle block's nodes repeated.

Note [An exported graph deepened from its copy]
    ``torch.export`` runs the model's Python on fake tensors once per op, so exporting Llama-3.1-8B's
    32 layers takes 4.6 s where its 4-layer copy takes 0.7 s (this 2-core machine). The fast step
    (Note [Repeated blocks] in blocks.py) needs the whole graph only for its nodes' names and the
    report's rows; its saved bytes and events come from the 3- and 4-block copies. So the whole graph
    is built from the 4-block one: in graph order, each run of nodes of the last middle block (block
    2) is followed by copies of that run for blocks 3 to L-2, and the last block and what follows
    it are moved to the end of the list. A copy reads the copy of what its original read, counted
    back from its own block (a node reading the previous block's output reads the previous copy's);
    its module paths (``nn_module_stack``, a weight's ``get_attr`` target) name its own block.

    Names follow export's counters: ``linear_7`` is the eighth name made from ``linear``, and names
    of nodes that export made and then dropped still count, so the first block can use more of
    them than the others (Llama's does: four ``mul`` names). Each base name therefore moves by the
    step it takes from block 1 to block 2 of the 4-block graph, where both blocks are middle
    blocks; a weight's name moves with its path. Everything else a node carries (its ``val``, its
    source lines) is its original's.

    Nothing here is assumed about the model: the same construction takes the 3-block graph to 4
    blocks, and unless that gives the exported 4-block graph exactly (every node's name, op,
    target, arguments, module stack, source lines, and its value's shape and dtype) the model is
    exported whole; what then runs the whole graph (a step whose blocks do not repeat, a pipeline's
    stages) runs the exported graph, node for node. fx-traced models are traced whole as before:
    their whole trace costs little (0.12 s for gpt-7b).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import map_aggregate

from fxmem.errors import FxmemError
from fxmem.frontends.blocks import BlockStack, cut_to, find_block_stack
from fxmem.frontends.checkpointing import checkpoint_regions
from fxmem.frontends.tracing import Traced, trace_model
from fxmem.inputs import InputSpec

__all__ = ["CompileGraphs", "NotDeepened", "compile_graphs", "deepened", "trace_blocks"]


class NotDeepened(Exception):
    """The graph does not extend by repeating its middle block (the model is exported whole)."""


_SUFFIX = re.compile(r"^(.*?)_(\d+)$")


@dataclass(frozen=True)
class _Blocks:
    """A graph's nodes by block: each node's block (None outside the stack) and place in its block."""

    block: Mapping[fx.Node, int | None]
    place: Mapping[fx.Node, int]
    nodes: Mapping[int, Sequence[fx.Node]]

    @staticmethod
    def of(graph: fx.Graph, stack: BlockStack, depth: int) -> _Blocks:
        block: dict[fx.Node, int | None] = {}
        place: dict[fx.Node, int] = {}
        nodes: dict[int, list[fx.Node]] = {}
        for n in graph.nodes:
            layer = stack.node_layer(n)
            block[n] = layer
            if layer is not None:
                place[n] = len(nodes.setdefault(layer, []))
                nodes[layer].append(n)
        if sorted(nodes) != list(range(depth)) or len({len(v) for v in nodes.values()}) != 1:
            raise NotDeepened(f"the graph's {depth} blocks do not have one node count")
        return _Blocks(block, place, nodes)


def trace_blocks(
    model: nn.Module,
    specs: Sequence[InputSpec],
    *,
    name: str,
    leaf_types: Sequence[type] = (),
    frontend: str = "auto",
    compute_dtype: torch.dtype | None = None,
) -> tuple[Traced, tuple[BlockStack, dict[int, fx.GraphModule]] | None]:
    """The model's graph, and its block stack with its graphs cut to 3 and 4 blocks where the step
    can be made from them (Note [Repeated blocks]). A model that only torch.export traces is
    exported at 3 and 4 blocks first, and its whole graph is built from those where that is exact
    (Note [An exported graph deepened from its copy]); it is exported whole otherwise.
    ``compute_dtype``: the dtype the step computes with its floating weights in (Note [Tracing in the
    weights' compute dtype]); the parameters keep their own dtype once traced."""
    shared = _SHARED.get()
    key = (id(model), tuple(specs), name, tuple(leaf_types), frontend, compute_dtype)
    if shared is not None and key in shared:
        return shared[key][1]
    with weights_in(model, compute_dtype):
        traced = _trace_blocks(model, specs, name, leaf_types, frontend)
    if shared is not None:
        shared[key] = (model, traced)  # the model is held so that its id is not reused while the traces are shared
    return traced


_SHARED: contextvars.ContextVar[dict[tuple[object, ...], tuple[nn.Module, Any]] | None] = contextvars.ContextVar("fxmem_traces", default=None)


@contextlib.contextmanager
def shared_traces() -> Iterator[None]:
    """Every ``trace_blocks`` of the same model, inputs and compute dtype while open returns the first
    one's graphs: the planner simulates one model under many levers, and each simulation works on
    its own copy of the graph (the parallel plans shard a copy, fxmem/parallel/rank.py), so one trace
    serves them all (a 7B model's trace is about a third of one simulation's time)."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


# Note [Tracing in the weights' compute dtype]
#     A traced graph keeps a dtype the code read as a constant: Hugging Face's RMSNorm reads
#     ``input_dtype = hidden_states.dtype``, computes in fp32 and returns ``weight * x.to(input_dtype)``,
#     which a trace of the fp32 model records as ``to(float32)``. Where the step computes with bf16
#     weights (a bf16 recipe: ``model.to(bfloat16)``; FSDP2's ``MixedPrecisionPolicy(param_dtype=
#     bfloat16)``, whose all-gather hands every forward bf16 weights), that graph would feed an fp32
#     activation to a bf16 ``mm``, which the real run, traced with bf16 weights, never does. So the
#     model is traced with its floating parameters in the compute dtype, as the real forward sees them
#     (buffers keep theirs: FSDP2 casts parameters only, torch/distributed/fsdp/_fully_shard/
#     _fsdp_param.py ``init_all_gather_outputs``), and its parameters are given back their own dtype
#     afterwards, in the model and in the graph: FSDP2 shards what the model holds.


@contextlib.contextmanager
def weights_in(model: nn.Module, dtype: torch.dtype | None, *, frozen_only: bool = False) -> Iterator[None]:
    """``model``'s floating parameters (``frozen_only``: those that do not require grad) in ``dtype``
    (their data swapped, the Parameter objects kept) while open; each back as it was on exit. See Note
    [Tracing in the weights' compute dtype], and Note [A PEFT model under the bf16 recipe] in adapters.py."""
    chosen = [p for p in model.parameters() if not (frozen_only and p.requires_grad)]
    held = [(p, p.data) for p in chosen if dtype is not None and p.is_floating_point() and p.dtype != dtype]
    for p, data in held:
        p.data = data.to(dtype)
    try:
        yield
    finally:
        for p, data in held:
            p.data = data


def _trace_blocks(
    model: nn.Module, specs: Sequence[InputSpec], name: str, leaf_types: Sequence[type], frontend: str
) -> tuple[Traced, tuple[BlockStack, dict[int, fx.GraphModule]] | None]:
    stack = find_block_stack(model)
    if stack is None:
        return trace_model(model, specs, name=name, leaf_types=leaf_types, frontend=frontend), None
    cut = _cut_graphs(model, stack, specs, name, leaf_types, frontend) if frontend != "fx" else None
    if cut is not None and {t.frontend for t in cut.values()} == {"export"} and not checkpoint_regions(cut[4].gm):
        with contextlib.suppress(NotDeepened):
            asks = any(t.asks_compiling for t in cut.values())
            return Traced(deepened(model, cut[3].gm, cut[4].gm, stack), "export", asks), (stack, {d: t.gm for d, t in cut.items()})
    traced = trace_model(model, specs, name=name, leaf_types=leaf_types, frontend=frontend)
    if checkpoint_regions(traced.gm):
        return traced, None
    if frontend == "fx" or (cut is not None and {t.frontend for t in cut.values()} != {traced.frontend}):
        cut = _cut_graphs(model, stack, specs, name, leaf_types, traced.frontend)  # the copies, traced as the model was
    return traced, (stack, {d: t.gm for d, t in cut.items()}) if cut is not None else None


def _cut_graphs(
    model: nn.Module,
    stack: BlockStack,
    specs: Sequence[InputSpec],
    name: str,
    leaf_types: Sequence[type],
    frontend: str,
    depths: tuple[int, ...] = (3, 4),
    compiling: bool = False,
) -> dict[int, Traced] | None:
    """The model cut to each of ``depths`` blocks (3 and 4), traced; None where it does not trace with
    fewer blocks (it is then simulated whole)."""
    graphs: dict[int, Traced] = {}
    for depth in depths:
        with cut_to(model, stack, depth):
            try:
                graphs[depth] = trace_model(model, specs, name=name, leaf_types=leaf_types, frontend=frontend, compiling=compiling)
            except FxmemError:
                return None
    return graphs


@dataclass(frozen=True)
class CompileGraphs:
    """What a compiled step compiles, traced as Dynamo sees the code: the whole model's graph, and the
    model cut to a few blocks of its stack, each made on first use."""

    whole: Callable[[], fx.GraphModule]
    copy: Callable[[int], fx.GraphModule | None]
    """The model cut to that many blocks; None where it does not trace so."""
    depth: int
    """The stack's full depth; 0 where the model has no block stack to cut (``copy`` then gives None)."""


def compile_graphs(
    model: nn.Module,
    specs: Sequence[InputSpec],
    traced: Traced,
    stack: BlockStack | None,
    *,
    traced_copies: Mapping[int, fx.GraphModule] | None = None,
    name: str,
    leaf_types: Sequence[type] = (),
    compute_dtype: torch.dtype | None = None,
) -> CompileGraphs:
    """The graphs of ``model``'s compiled step, from its eager trace ``traced``: the same graph where the
    code never asked whether it was compiled, else traced again as Dynamo runs it (Note [The code
    Dynamo runs] in dynamo_view.py); copies cut to blocks of ``stack`` traced the same way, or taken
    from ``traced_copies`` (the eager step's, by depth) where the code never asked."""
    compiling = traced.asks_compiling

    @functools.cache
    def whole() -> fx.GraphModule:
        if not compiling:
            return traced.gm
        with weights_in(model, compute_dtype):
            return trace_model(model, specs, name=name, leaf_types=leaf_types, frontend=traced.frontend, compiling=True).gm

    @functools.cache
    def copy(depth: int) -> fx.GraphModule | None:
        if stack is None:
            return None
        if not compiling and traced_copies is not None and depth in traced_copies:
            return traced_copies[depth]
        with weights_in(model, compute_dtype):
            cut = _cut_graphs(model, stack, specs, name, leaf_types, traced.frontend, (depth,), compiling)
        return cut[depth].gm if cut is not None else None

    return CompileGraphs(whole, copy, stack.depth if stack is not None else 0)


def deepened(model: nn.Module, three: fx.GraphModule, four: fx.GraphModule, stack: BlockStack) -> fx.GraphModule:
    """The graph of ``model`` at its full depth, from its exported 3- and 4-block graphs (Note [An
    exported graph deepened from its copy]). Raises NotDeepened where the 3-block graph, deepened
    the same way, is not the 4-block one."""
    steps = _name_steps(four.graph, stack)
    _check_same(_deepen(three.graph, stack, 3, 4, steps), four.graph)
    graph = _deepen(four.graph, stack, 4, stack.depth, steps)
    gm = _lazy_graph_module(_attributes(graph, model, four), graph, type(four).__name__)
    read = [str(n.target) for n in graph.nodes if n.op == "get_attr"]
    _held_as_in(gm, four, [t for t in read if not _has_attr(model, t)])
    gm.meta.update(four.meta)
    for spec in ("_in_spec", "_out_spec"):  # the pytree code calling the graph flattens by them
        if hasattr(four, spec):
            setattr(gm, spec, getattr(four, spec))
    return gm


def _lazy_graph_module(root: dict[str, Any], graph: fx.Graph, name: str) -> fx.GraphModule:
    """A GraphModule that writes and compiles its Python code only when it is first called or read
    (torch's ``_LazyGraphModule``, as inductor makes its pattern graphs): the deep graph is walked,
    never called, on the fast path, and compiling the code of Llama-3.1-8B's 32 layers took 0.05 s."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # an older torch: compiled now
        return fx.GraphModule(root, graph, name)
    return _LazyGraphModule(root, graph, name)


def _attributes(graph: fx.Graph, model: nn.Module, four: fx.GraphModule) -> dict[str, Any]:
    """What each ``get_attr`` of ``graph`` reads: the model's weight or buffer, or a constant export
    lifted out of the forward, which only the exported module holds (outside the blocks, or the
    graph would not have deepened: a lifted constant's name counts them)."""
    found: dict[str, Any] = {}
    for n in graph.nodes:
        if n.op == "get_attr":
            target = str(n.target)
            owner = model if _has_attr(model, target) else four
            if not _has_attr(owner, target):
                raise NotDeepened(f"neither the model nor its 4-block export holds {target}")
            found[target] = _attr(owner, target)
    return found


def _held_as_in(gm: fx.GraphModule, four: fx.GraphModule, constants: Sequence[str]) -> None:
    """Each lifted constant held as the exported module holds it: a plain attribute, not a buffer
    (``GraphModule`` registers any tensor it is handed as a buffer, and buffers count as state)."""
    for target in constants:
        path, _, field = target.rpartition(".")
        mine, theirs = gm.get_submodule(path), four.get_submodule(path)
        if field in mine._buffers and field not in theirs._buffers:
            value = mine._buffers.pop(field)
            mine._non_persistent_buffers_set.discard(field)
            object.__setattr__(mine, field, value)


def _has_attr(module: nn.Module, target: str) -> bool:
    try:
        _attr(module, target)
    except AttributeError:
        return False
    return True


def _attr(module: nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _name_steps(four: fx.Graph, stack: BlockStack) -> dict[str, int]:
    """How far each base name's counter moves per block: block 2's names against block 1's."""
    blocks = _Blocks.of(four, stack, 4)
    steps: dict[str, int] = {}
    for one, two in zip(blocks.nodes[1], blocks.nodes[2]):
        if one.op == "get_attr":
            continue
        (base, a), (other, b) = _split(one.name), _split(two.name)
        if base != other or steps.setdefault(base, b - a) != b - a:
            raise NotDeepened(f"names {one.name} and {two.name} of blocks 1 and 2 do not step alike")
    return steps


def _split(name: str) -> tuple[str, int]:
    match = _SUFFIX.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, 0)


class _Deepening:
    """Copies one graph's nodes into a deeper one (Note [An exported graph deepened from its copy]).
    Nodes are kept by (block in the deeper graph, place in the block), or by their original outside
    the stack; a copy's reads are relative: ``shift`` blocks on from what its original read."""

    def __init__(self, source: fx.Graph, stack: BlockStack, depth: int, to_depth: int, steps: Mapping[str, int]) -> None:
        self.stack, self.steps = stack, steps
        self.middle, self.extra = depth - 2, to_depth - depth
        self.blocks = _Blocks.of(source, stack, depth)
        self.graph = fx.Graph()
        self.graph._codegen = source._codegen
        self.made: dict[tuple[int, int], fx.Node] = {}
        self.outside: dict[fx.Node, fx.Node] = {}
        self.repeated = False
        """Whether the middle block's ops (not only its weights) have been repeated yet: what
        follows them reads blocks and takes names ``extra`` blocks on."""

    def run(self, nodes: Sequence[fx.Node]) -> fx.Graph:
        for k, n in enumerate(nodes):
            layer = self.blocks.block[n]
            if layer is None:
                self.copy(n, None, self.extra if self.repeated else 0)
            else:
                self.copy(n, layer, 0 if layer <= self.middle else self.extra)
            if layer == self.middle and (k + 1 == len(nodes) or self.blocks.block[nodes[k + 1]] != self.middle):
                self.repeat(_run_ending(self.blocks, nodes, k))
        return self.graph

    def repeat(self, run: Sequence[fx.Node]) -> None:
        """Copies 1 to ``extra`` of a run of the middle block's nodes, one after the other."""
        for shift in range(1, self.extra + 1):
            for n in run:
                self.copy(n, self.middle, shift)
        self.repeated = self.repeated or any(n.op != "get_attr" for n in run)

    def copy(self, n: fx.Node, layer: int | None, shift: int) -> None:
        to = None if layer is None else layer + shift
        args, kwargs = self._moved(n.args, shift), self._moved(n.kwargs, shift)
        target = self.stack.with_layer(str(n.target), to) if n.op == "get_attr" and to is not None else n.target
        name = self._name(n, to, shift)
        new = self.graph.create_node(n.op, target, args, kwargs, name, n.type)
        if new.name != name:
            raise NotDeepened(f"node {n.name} copied to block {to} cannot be named {name}")
        new.meta = dict(n.meta)
        if to is None:
            self.outside[n] = new
            return
        if "nn_module_stack" in n.meta:
            new.meta["nn_module_stack"] = self._moved_stack(n.meta["nn_module_stack"], to)
        self.made[(to, self.blocks.place[n])] = new

    def _moved(self, value: Any, shift: int) -> Any:
        def move(a: Any) -> Any:
            if not isinstance(a, fx.Node):
                return a
            read = self.blocks.block[a]
            if read is None:
                if a not in self.outside:
                    raise NotDeepened(f"a copy reads {a.name}, outside the blocks, before it is made")
                return self.outside[a]
            key = (read + shift, self.blocks.place[a])
            if key not in self.made:
                raise NotDeepened(f"a copy of a node that reads {a.name} has nothing to read in block {key[0]}")
            return self.made[key]

        return map_aggregate(value, move)

    def _name(self, n: fx.Node, to: int | None, shift: int) -> str:
        if n.op == "get_attr" and to is not None:
            old, new = _underscored(self.stack, self.blocks.block[n]), _underscored(self.stack, to)
            if not n.name.startswith(old):
                raise NotDeepened(f"weight {n.name} is not named by its path")
            return new + n.name[len(old) :]
        base, count = _split(n.name)
        moved = count + shift * self.steps.get(base, 0)
        if moved == count:
            return n.name  # unmoved, as it was spelled (``lifted_tensor_0`` keeps its suffix)
        return f"{base}_{moved}" if moved else base

    def _moved_stack(self, module_stack: Mapping[str, Any], to: int) -> dict[str, Any]:
        """The node's module stack with its block's entries naming block ``to``."""
        moved: dict[str, Any] = {}
        for key, (fqn, kind) in module_stack.items():
            new = self.stack.with_layer(str(fqn), to) if self.stack.layer_of(str(fqn)) is not None else fqn
            moved[key.replace(str(fqn), new) if new != fqn else key] = (new, kind)
        return moved


def _underscored(stack: BlockStack, layer: int | None) -> str:
    return f"{stack.path.replace('.', '_')}_{layer}_"


def _deepen(source: fx.Graph, stack: BlockStack, depth: int, to_depth: int, steps: Mapping[str, int]) -> fx.Graph:
    """``source`` (of ``depth`` blocks) with its last middle block repeated up to ``to_depth`` blocks."""
    return _Deepening(source, stack, depth, to_depth, steps).run(list(source.nodes))


def _run_ending(blocks: _Blocks, nodes: Sequence[fx.Node], k: int) -> list[fx.Node]:
    """The run of consecutive nodes of node ``k``'s block that ends at it."""
    start = k
    while start > 0 and blocks.block[nodes[start - 1]] == blocks.block[nodes[k]]:
        start -= 1
    return list(nodes[start : k + 1])


def _check_same(made: fx.Graph, exported: fx.Graph) -> None:
    """Raises NotDeepened unless ``made`` is ``exported``, node for node."""
    a, b = list(made.nodes), list(exported.nodes)
    if len(a) != len(b):
        raise NotDeepened(f"the 3-block graph deepened has {len(a)} nodes, the 4-block graph {len(b)}")
    for x, y in zip(a, b):
        if _described(x) != _described(y):
            raise NotDeepened(f"the 3-block graph deepened has {x.name} ({x.target}) where the 4-block graph has {y.name} ({y.target})")


def _described(n: fx.Node) -> tuple[object, ...]:
    named = lambda a: ("node", a.name) if isinstance(a, fx.Node) else a
    val = n.meta.get("val")
    shape = (tuple(str(s) for s in val.shape), val.dtype) if isinstance(val, torch.Tensor) else None
    module_stack = n.meta.get("nn_module_stack") or {}
    return (
        n.name,
        n.op,
        str(n.target),
        map_aggregate(n.args, named),
        map_aggregate(n.kwargs, named),
        tuple((k, str(v[0]), str(v[1])) for k, v in module_stack.items()),
        n.meta.get("stack_trace"),
        shape,
    )
