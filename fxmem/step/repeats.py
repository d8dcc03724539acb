"""A deep model's step from a 3-block one: the middle block's events repeated (Note [Repeated blocks]
in fxmem/frontends/blocks.py).

Note [Extending a step by its middle block]
    Each event of a shallow step (an allocation, a release, an op's cost) belongs to a block: an
    allocation to the block whose op made it, a release to the block whose op was running when it
    was seen, or, where that is no block (the optimizer's foreach ops, ``zero_grad``), to the block
    that made the storage. Within each phase the events then read as sweeps over the blocks (the
    forward and each foreach op in block order, backward in reverse), each sweep a run of events
    per block with events of no block between runs, and events of no block or of an edge block
    (the first, the last) outside the sweeps. With 3 blocks, a sweep is first, middle, last; with
    L blocks it is first, L-2 copies of the middle, last, and the events between two middle runs
    are those between the middle and the last run. A copied event names the block it is copied to
    (and its neighbours: a release of the next block's storage stays the next block's), and a
    release frees the copy of the storage it freed. Storages are numbered by their allocation's
    place in the step, as the simulation numbers them.

    Nothing here is assumed about what a block does: where the events do not read as such sweeps,
    or where extending the 3-block step does not give the 4-block step exactly, the caller
    simulates the full model.
"""

from __future__ import annotations

import contextlib
import difflib
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, TypeVar

import torch.fx as fx

from fxmem.engine.capture import BatchSpecialized, SymbolicUnsupported
from fxmem.errors import FxmemError
from fxmem.frontends.blocks import BlockStack
from fxmem.results import Capture, Category, MemoryEvent, NodeInfo, OpCostRecord, Phase, Timeline
from fxmem.symbolic import ByteExpr

__all__ = [
    "CAPTURED",
    "Growth",
    "Names",
    "NotRepeating",
    "ShallowCaptures",
    "ShallowNames",
    "ShallowSteps",
    "extend_baseline",
    "extend_capture",
    "extend_timeline",
    "names_for",
]


class NotRepeating(Exception):
    """The shallow step's events do not extend by repeating the middle block (the full step is simulated)."""


_RUNNING = ("call_function", "call_method", "call_module")
"""The nodes that run ops: the only ones a step's events are charged to (an exported graph's
parameters are placeholders, whose number grows with the blocks)."""
CAPTURED = (*_RUNNING, "get_attr", "placeholder")
"""The nodes a capture lists: all but the output."""


@dataclass(frozen=True)
class Names:
    """fx node names per block, in graph order, of the shallow graph and of the graph extended to."""

    stack: BlockStack
    source: Mapping[str, tuple[int | None, int]]
    """Shallow node name -> (block or None, its place among that block's nodes)."""
    target: Mapping[int | None, Sequence[str]]

    @staticmethod
    def of(stack: BlockStack, shallow: fx.Graph, full: fx.Graph, depth: int, kinds: tuple[str, ...] = _RUNNING) -> Names:
        """Names of the nodes of ``kinds`` (by default those that run ops). Raises NotRepeating unless
        both graphs have as many of them outside the blocks and in each block, so that a node's place
        in its block names its counterpart."""
        source: dict[str, tuple[int | None, int]] = {}
        counts: dict[int | None, int] = {}
        for n in shallow.nodes:
            if n.op not in kinds:
                continue
            layer = stack.node_layer(n)
            source[n.name] = (layer, counts.get(layer, 0))
            counts[layer] = counts.get(layer, 0) + 1
        target: dict[int | None, list[str]] = {}
        for n in full.nodes:
            if n.op in kinds:
                target.setdefault(stack.node_layer(n), []).append(n.name)
        per_block = {len(names) for layer, names in target.items() if layer is not None} | {
            count for layer, count in counts.items() if layer is not None
        }
        if len(per_block) != 1 or len(target.get(None, ())) != counts.get(None, 0) or len(target) != depth + (None in target):
            raise NotRepeating("the graphs differ outside the blocks, or their blocks differ")
        return Names(stack, source, target)

    def block_of_node(self, name: str) -> int | None:
        placed = self.source.get(name)
        return placed[0] if placed is not None else None

    def node(self, name: str, to: Callable[[int], int]) -> str:
        """An event's node (fx node, parameter name, or a fixed label) with its block moved by ``to``."""
        placed = self.source.get(name)
        if placed is not None:
            layer, k = placed
            names = self.target.get(layer if layer is None else to(layer), ())
            if k >= len(names):
                raise NotRepeating(f"node {name} has no counterpart")
            return names[k]
        layer = self.stack.layer_of(name)
        return name if layer is None else self.stack.with_layer(name, to(layer))

    def relative(self, name: str, layer: int) -> tuple[object, ...]:
        """A node name or module path as (block relative to ``layer``, what it is within its block)."""
        placed = self.source.get(name)
        if placed is not None:
            block, k = placed
            return (None if block is None else block - layer, k)
        block = self.stack.layer_of(name)
        return (None, name) if block is None else (block - layer, self.stack.with_layer(name, 0))

    def fqn(self, fqn: str, to: Callable[[int], int]) -> str:
        layer = self.stack.layer_of(fqn)
        return fqn if layer is None else self.stack.with_layer(fqn, to(layer))


@dataclass(frozen=True)
class ShallowNames:
    """The names a shallow result is renamed by: from the 3-block graph to the 4-block one and to the
    whole model's."""

    to_four: Names
    to_full: Names

    @property
    def stack(self) -> BlockStack:
        return self.to_four.stack


def names_for(
    stack: BlockStack, graphs: Mapping[int, fx.GraphModule], full: fx.GraphModule, kinds: tuple[str, ...] = _RUNNING
) -> ShallowNames:
    """The names from the 3-block graph to the 4-block one and to ``full``; NotRepeating where they
    do not correspond."""
    three, four, whole = graphs[3].graph, graphs[4].graph, full.graph
    return ShallowNames(Names.of(stack, three, four, 4, kinds), Names.of(stack, three, whole, stack.depth, kinds))


@dataclass(frozen=True)
class _Piece:
    """Consecutive events of one phase: ``fixed`` (outside any sweep), or one block's ``run`` in a
    sweep, or the ``gap`` after it, with the block ``layer`` (in the shallow step) they belong to."""

    kind: str
    start: int
    end: int
    sweep: int = -1
    layer: int = -1
    ascending: bool = True


def extend_timeline(shallow: Timeline, growth: Growth, depth: int, to_depth: int, names: Names) -> Timeline:
    """The step of ``to_depth`` blocks from ``shallow``, a step of ``depth`` (3 or more) (Note [Extending a step
    by its middle block]); what one more block adds to the ops outside the sweeps is ``growth`` (Note
    [One cost for all the parameters]). Raises NotRepeating where the events do not read as sweeps."""
    if depth < 3 or to_depth < depth or len(shallow.contexts) != len(shallow.events):
        raise NotRepeating("needs a step of at least 3 blocks, with each event's running module")
    tags = [_event_tag(e, c, names.stack) for e, c in zip(shallow.events, shallow.contexts)]
    phases = [e.phase for e in shallow.events]
    plan = _plan(phases, tags, depth, to_depth)
    events = _copy_events(shallow.events, plan, _pieces(phases, tags, depth), depth, to_depth, names)
    costs = _extend_costs(shallow.costs, growth, depth, to_depth, names)
    return replace(shallow, events=events, costs=costs, contexts=())


# Note [One cost for all the parameters]
#     Some ops of the optimizer lie outside the sweeps yet grow with the blocks: a foreach or fused op
#     (``_foreach_addcdiv_`` over every parameter) is one op whose bytes are those of all its
#     tensors, and AdamW reads each parameter's step count (``_local_scalar_dense``) in a row of
#     ops charged to no parameter. Each block adds the same tensors to the lists and the same ops
#     to the row, so outside the sweeps the step of 3 blocks and that of 4 are the same ops, in
#     runs of equal ops, where a run may be longer by the same count per block and a foreach op may
#     cost more by the same bytes per block; at L blocks, each grows L - 3 times as much. Any
#     other difference outside the sweeps stops the extension.


class _RunGrowth(NamedTuple):
    """One run of equal ops outside the sweeps: its op and length in the step it is applied to, and
    what one more block adds: ops to the run, or bytes and FLOPs to a foreach op."""

    base: OpCostRecord
    length: int
    added: int
    flops: ByteExpr
    read: ByteExpr
    written: ByteExpr

    @property
    def grows(self) -> bool:
        return bool(self.added) or any(e != ByteExpr() for e in (self.flops, self.read, self.written))


@dataclass(frozen=True)
class Growth:
    """What one more block adds to the ops outside the sweeps (Note [One cost for all the parameters]),
    per fixed piece, per run of equal ops."""

    pieces: tuple[tuple[_RunGrowth, ...], ...]

    @staticmethod
    def between(small: Timeline, big: Timeline, depth: int, names: Names) -> Growth:
        """Read off the steps of ``depth`` and ``depth + 1`` blocks (``names`` renames the smaller one's
        records as the bigger step names them), to be applied to the smaller step (or a step alike,
        at another batch: ``onto``). Each run keeps the smaller step's own record as its base."""
        edge = _edges(depth, depth + 1)
        rename = lambda r: _named(r, names.node(r.node, edge), names.fqn(r.fqn, edge))
        mine, theirs = _fixed_pieces(small.costs, depth, names.stack), _fixed_pieces(big.costs, depth + 1, names.stack)
        if len(mine) != len(theirs):
            raise NotRepeating("the ops outside the sweeps differ with one more block")
        return Growth(tuple(_run_growth(a, [rename(r) for r in a], b) for a, b in zip(mine, theirs)))

    def onto(self, costs: Sequence[OpCostRecord], depth: int, stack: BlockStack) -> Growth:
        """This growth for a step of ``depth`` blocks (the depth it was read at) at another batch,
        whose ops outside the sweeps are ``costs``': where the batch changes which ops run there
        (backward of a slice at B=1 only), the runs that grow are found among them by op, node and
        module, each whole; NotRepeating where one is not."""
        pieces = _fixed_pieces(costs, depth, stack)
        if len(pieces) != len(self.pieces):
            raise NotRepeating("the ops outside the sweeps differ between the batches")
        return Growth(tuple(_aligned(runs, records) for runs, records in zip(self.pieces, pieces)))


def _aligned(runs: tuple[_RunGrowth, ...], records: list[OpCostRecord]) -> tuple[_RunGrowth, ...]:
    """``runs`` laid over ``records``: each growing run where the same ops stand, the rest of
    ``records`` as runs of their own that do not grow. Only the forward, the loss and backward may
    run other ops at the other batch: the optimizer's, where the ops that grow run, must be the same."""
    key = lambda r: (r.phase, r.op, r.node, r.fqn)
    theirs = [key(run.base) for run in runs for _ in range(run.length)]
    starts = list(itertools.accumulate((run.length for run in runs), initial=0))
    moved: dict[int, int] = {}
    for tag, i1, i2, j1, _ in difflib.SequenceMatcher(None, [key(r) for r in records], theirs, autojunk=False).get_opcodes():
        if tag == "equal":
            moved.update({j1 + k: i1 + k for k in range(i2 - i1)})
    unmatched = set(range(len(records))) - set(moved.values())
    if any(records[k].phase in (Phase.OPTIMIZER, Phase.ZERO_GRAD) for k in unmatched):
        raise NotRepeating("the optimizer's ops differ between the batches")  # where what grows with the blocks runs
    placed: dict[int, _RunGrowth] = {}
    for run, start in zip(runs, starts):
        if not run.grows:
            continue
        first = moved.get(start, -1)
        if first < 0 or any(moved.get(start + k) != first + k for k in range(run.length)):
            raise NotRepeating(f"the op {run.base.op} at {run.base.node}, which grows with the blocks, does not run at both batches")
        placed[first] = run
    out: list[_RunGrowth] = []
    k = 0
    while k < len(records):
        here = placed.get(k, _RunGrowth(records[k], 1, 0, ByteExpr(), ByteExpr(), ByteExpr()))
        out.append(here)
        k += here.length
    return tuple(out)


def _fixed_pieces(costs: Sequence[OpCostRecord], depth: int, stack: BlockStack) -> list[list[OpCostRecord]]:
    pieces = _pieces([c.phase for c in costs], [stack.layer_of(c.fqn) for c in costs], depth)
    return [list(costs[p.start : p.end]) for p in pieces if p.kind == "fixed"]


def _run_growth(mine: list[OpCostRecord], renamed: list[OpCostRecord], theirs: list[OpCostRecord]) -> tuple[_RunGrowth, ...]:
    """One fixed piece's runs, ``mine`` (``renamed`` as with one more block) against ``theirs`` (the
    step with one more block): the same ops, where a run may be longer and a foreach op cost more."""
    ours, other = _run_lengths(renamed), _run_lengths(theirs)
    if len(ours) != len(other):
        raise NotRepeating("the ops outside the sweeps differ with one more block")
    runs = []
    starts = itertools.accumulate((count for _, count in ours), initial=0)
    for (record, count), (deeper, deeper_count), start in zip(ours, other, starts):
        if record != deeper:
            same_op = replace(deeper, flops=record.flops, read=record.read, written=record.written) == record
            if not same_op or count != 1 or deeper_count != 1 or not record.op.startswith(("aten._foreach_", "aten._fused_")):
                raise NotRepeating(f"the op {record.op} at {record.node} differs with one more block")
        added = (deeper.flops - record.flops, deeper.read - record.read, deeper.written - record.written)
        runs.append(_RunGrowth(mine[start], count, deeper_count - count, *added))
    return tuple(runs)


def _extend_costs(small: Sequence[OpCostRecord], growth: Growth, depth: int, to_depth: int, names: Names) -> tuple[OpCostRecord, ...]:
    pieces = _pieces([c.phase for c in small], [names.stack.layer_of(c.fqn) for c in small], depth)
    if len(growth.pieces) != sum(p.kind == "fixed" for p in pieces):
        raise NotRepeating("the ops outside the sweeps differ from those the growth was read from")
    edge = _edges(depth, to_depth)
    out: list[OpCostRecord] = []
    rename = lambda r, to, n=names: _named(r, n.node(r.node, to), n.fqn(r.fqn, to))
    i, f = 0, 0
    while i < len(pieces):
        piece = pieces[i]
        if piece.kind == "fixed":
            grown = _grown(list(small[piece.start : piece.end]), growth.pieces[f], to_depth - depth)
            out.extend(rename(r, edge) for r in grown)
            i, f = i + 1, f + 1
            continue
        sweep = [p for p in pieces[i:] if p.sweep == piece.sweep]
        out.extend(rename(small[c.event], c.to) for c in _sweep_plan(sweep, depth, to_depth))
        i += len(sweep)
    return tuple(out)


def _grown(records: list[OpCostRecord], runs: tuple[_RunGrowth, ...], blocks: int) -> list[OpCostRecord]:
    """A fixed piece's ops with ``blocks`` more blocks: each run longer by its ops per block, each
    foreach op costing more by its bytes and FLOPs per block. ``records`` are the runs the growth is
    for, op for op and in the same lengths (names aside: they may be another depth's, and costs
    aside, another batch's), a run that grows cost for cost as well."""
    if len(records) != sum(run.length for run in runs):
        raise NotRepeating("the ops outside the sweeps differ from those the growth was read from")
    out: list[OpCostRecord] = []
    at = 0
    for run in runs:
        span, at = records[at : at + run.length], at + run.length
        base = run.base
        for record in span:
            if (record.phase, record.op, record.dtype, record.has_formula) != (base.phase, base.op, base.dtype, base.has_formula):
                raise NotRepeating(f"the op {record.op} at {record.node} is not the op the growth was read from ({base.op})")
            if run.grows and (record.flops, record.read, record.written) != (base.flops, base.read, base.written):
                raise NotRepeating(f"the op {record.op} at {record.node} costs other than where its growth was read")
        if not run.grows:
            out.extend(span)
        elif run.added:
            out.extend(span + [span[-1]] * (blocks * run.added))
        else:
            out.append(
                replace(
                    span[0],
                    flops=span[0].flops + run.flops * blocks,
                    read=span[0].read + run.read * blocks,
                    written=span[0].written + run.written * blocks,
                )
            )
    return out


def _run_lengths(records: Sequence[OpCostRecord]) -> list[tuple[OpCostRecord, int]]:
    return [(record, len(list(run))) for record, run in itertools.groupby(records)]


def extend_baseline(
    shallow: Timeline, deeper: Timeline, depth: int, to_depth: int, onto: Timeline | None = None
) -> tuple[dict[Category, ByteExpr], tuple[tuple[Category, ByteExpr], ...]]:
    """The baseline (by category, and storage by storage) of ``to_depth`` blocks from those of
    ``depth`` and ``depth + 1``: what one more block inserts (its parameters among the parameters,
    its buffers among the buffers) inserted ``to_depth - depth`` times. With ``onto`` (the shallow
    step at another batch), its storages are the ones extended: only the inputs may differ between
    the batches, and one more block inserts no input."""
    small, big = shallow.baseline_storages, deeper.baseline_storages
    base = small if onto is None else onto.baseline_storages
    if len(base) != len(small) or any(a[0] != b[0] or (a != b and a[0] != Category.INPUT) for a, b in zip(base, small)):
        raise NotRepeating("the baseline's storages other than the inputs differ between the batches")
    storages: list[tuple[Category, ByteExpr]] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, small, big, autojunk=False).get_opcodes():
        if tag == "equal":
            storages.extend(base[i1:i2])
        elif tag == "insert" and all(category != Category.INPUT for category, _ in big[j1:j2]):
            storages.extend(big[j1:j2] * (to_depth - depth))
        else:
            raise NotRepeating("one more block changes the baseline's storages, not only adds to them")
    baseline: dict[Category, ByteExpr] = {}
    for category, nbytes in storages:
        baseline[category] = baseline.get(category, ByteExpr()) + nbytes
    return baseline, tuple(storages)


# Note [The symbolic step from three blocks]
#     The symbolic passes cost most (SymInt arithmetic in every op of every block), so only the
#     3-block copy takes one: the symbolic step and capture are the 3-block ones, extended by their
#     middle block to the full depth. That the 3-block step extends is checked at B=1, where the
#     3-block step and capture extended to 4 blocks must be the 4-block ones, as always (the blocks
#     repeat, and nothing depends on the depth). What one more block adds outside the sweeps (Note
#     [One cost for all the parameters]) is read off the same B=1 pair: the optimizer's ops do not
#     depend on the batch, and where the symbolic step's ops there are not those of B=1, op for op
#     and cost for cost, the 4-block symbolic pass runs after all and the 3-block step extended to
#     4 blocks must be it, as at B=1. So does it wherever the B=1 pair cannot be had (a model that
#     cannot train on one sample).
#
#     Before, the symbolic step was the 4-block one, extended by its block 1 after checking that
#     its blocks 1 and 2 were alike. That check found nothing the B=1 pair does not: two middle
#     blocks run the same graph on inputs of the same shapes (an exported graph is compared node
#     for node, shapes in B included, in fxmem/frontends/deepen.py), and what a batch of B >= 2
#     could make differ between them would differ at B=1 as well. Dropping the fourth block from
#     the symbolic pass took Llama-3.1-8B's default analyze at 4096 tokens from 4.5 to 4.2 s (this
#     2-core machine; benchmarks/scale.py --in-process).

_NO_BATCH_ONE = (NotRepeating, FxmemError, SymbolicUnsupported, BatchSpecialized)
"""Why the B=1 pair may be missing: a pass fails, or the 3-block one does not extend to the 4-block one."""


@dataclass(frozen=True)
class ShallowSteps:
    """A model's step from its copies cut to 3 and 4 blocks (Note [Repeated blocks] in
    fxmem/frontends/blocks.py): ``simulate(depth, batch)`` runs one of them, each once."""

    names: ShallowNames
    simulate: Callable[[int, int | None], Timeline]
    made: dict[tuple[int, int | None], Timeline | Exception] = field(default_factory=dict, repr=False, compare=False)
    growths: dict[int | None, Growth | Exception] = field(default_factory=dict, repr=False, compare=False)

    @property
    def stack(self) -> BlockStack:
        return self.names.stack

    def step(self, depth: int, batch: int | None) -> Timeline:
        """The step of ``depth`` blocks at ``batch``, simulated once (a failure raised again)."""
        return _once(self.made, (depth, batch), lambda: self.simulate(depth, batch))

    def timeline(self, batch: int | None) -> Timeline:
        """The full model's first-step timeline at ``batch``; NotRepeating where the 3-block step
        extended to 4 blocks is not the 4-block step, event for event and op for op. The symbolic
        one checked at B=1 alone where it can be (Note [The symbolic step from three blocks])."""
        pair = batch is None and _succeeds(lambda: self._growth(1))
        if pair:
            three = self.step(3, None)  # its own failure is the symbolic step's
            with contextlib.suppress(NotRepeating):
                return self._checked_at_one(three)
        growth = self._growth(batch)
        three, four = self.step(3, batch), self.step(4, batch)
        full = extend_timeline(three, growth, 3, self.stack.depth, self.names.to_full)
        baseline, storages = extend_baseline(three, four, 3, self.stack.depth)
        return replace(full, baseline=baseline, baseline_storages=storages, checks=four.checks, corrected=four.corrected)

    def _growth(self, batch: int | None) -> Growth:
        """What one more block adds outside the sweeps at ``batch``, worked out once; NotRepeating
        unless the 3-block step extended to 4 blocks is the 4-block step."""
        return _once(self.growths, batch, lambda: self._checked(self.step(3, batch), self.step(4, batch)))

    def _checked(self, three: Timeline, four: Timeline) -> Growth:
        growth = Growth.between(three, four, 3, self.names.to_four)
        guess = extend_timeline(three, growth, 3, 4, self.names.to_four)
        if guess.events != four.events or guess.costs != four.costs:
            raise NotRepeating(_first_difference(guess, four))
        return growth

    def _checked_at_one(self, three: Timeline) -> Timeline:
        """The 3-block step at another batch extended, by what one more block adds at B=1."""
        three_1, four_1 = self.step(3, 1), self.step(4, 1)
        growth = self._growth(1).onto(three.costs, 3, self.stack)
        full = extend_timeline(three, growth, 3, self.stack.depth, self.names.to_full)
        baseline, storages = extend_baseline(three_1, four_1, 3, self.stack.depth, onto=three)
        return replace(full, baseline=baseline, baseline_storages=storages, checks=three.checks, corrected=three.corrected)


@dataclass(frozen=True)
class ShallowCaptures:
    """A model's capture from its copies cut to 3 and 4 blocks (Note [Saved tensors from three
    blocks]): ``capture(depth, batch, seq)`` runs the capture pass on one of them, each once;
    ``seq`` is the length the B=1 pass runs at."""

    names: ShallowNames
    capture: Callable[[int, int | None, int | None], Capture]
    seq: int | None = None
    made: dict[tuple[int, int | None, int | None], Capture | Exception] = field(default_factory=dict, repr=False, compare=False)

    @property
    def stack(self) -> BlockStack:
        return self.names.stack

    def captured(self, depth: int, batch: int | None, seq: int | None) -> Capture:
        """The capture of ``depth`` blocks at (``batch``, ``seq``), run once (a failure raised again)."""
        return _once(self.made, (depth, batch, seq), lambda: self.capture(depth, batch, seq))

    def at(self, batch: int | None, seq: int | None) -> Capture:
        """The full model's capture; NotRepeating where the 3-block one extended is not the 4-block
        one. The symbolic one checked at B=1 alone where it can be (Note [The symbolic step from
        three blocks])."""
        if batch is None and _succeeds(lambda: self._checked(1, self.seq)):
            return extend_capture(self.captured(3, None, seq), 3, self.stack.depth, self.names.to_full)
        return extend_capture(self._checked(batch, seq), 3, self.stack.depth, self.names.to_full)

    def _checked(self, batch: int | None, seq: int | None) -> Capture:
        """The 3-block capture; NotRepeating unless it extends to the 4-block one."""
        three, four = self.captured(3, batch, seq), self.captured(4, batch, seq)
        if extend_capture(three, 3, 4, self.names.to_four) != four:
            raise NotRepeating("extending the 3-block capture to 4 blocks does not give the 4-block capture")
        return three


_T = TypeVar("_T")


def _succeeds(check: Callable[[], object]) -> bool:
    """Whether the B=1 pair can be had and extends (Note [The symbolic step from three blocks])."""
    try:
        check()
    except _NO_BATCH_ONE:
        return False
    return True


def _once(made: dict[Any, Any], key: object, make: Callable[[], _T]) -> _T:
    """``make()``, kept under ``key``: a pass that failed raises its error again rather than run again."""
    if key not in made:
        try:
            made[key] = make()
        except _NO_BATCH_ONE as e:
            made[key] = e
    found = made[key]
    if isinstance(found, Exception):
        raise found
    return found


def _first_difference(guess: Timeline, real: Timeline) -> str:
    for k, (a, b) in enumerate(zip(guess.events, real.events)):
        if a != b:
            return f"extending 3 blocks to 4 gives event {k} {a.op} at {a.node}, the 4-block step {b.op} at {b.node}"
    if len(guess.events) != len(real.events):
        return f"extending 3 blocks to 4 gives {len(guess.events)} events, the 4-block step {len(real.events)}"
    return "extending 3 blocks to 4 does not give the 4-block step's op costs"


def _event_tag(e: MemoryEvent, context: str, stack: BlockStack) -> int | None:
    """The block an event belongs to: Note [Extending a step by its middle block]."""
    if e.alloc:
        return stack.layer_of(e.fqn)
    running = stack.layer_of(context)
    return running if running is not None else stack.layer_of(e.fqn)


class _Copy(NamedTuple):
    """One event of the extended step: the shallow event ``event`` it copies (its index), from ``piece``, for
    block ``target`` (None for a fixed piece), with ``to`` moving the block numbers it names. (A
    tuple: a 7B model's step makes tens of thousands, and a frozen dataclass is slow to make.)"""

    event: int
    piece: _Piece
    target: int | None
    to: Callable[[int], int]


Plan = list[_Copy]


def _plan(phases: Sequence[object], tags: Sequence[int | None], depth: int, to_depth: int) -> Plan:
    pieces = _pieces(phases, tags, depth)
    plan: Plan = []
    edge = _edges(depth, to_depth)
    i = 0
    while i < len(pieces):
        piece = pieces[i]
        if piece.kind == "fixed":
            plan.extend(_Copy(k, piece, None, edge) for k in range(piece.start, piece.end))
            i += 1
            continue
        sweep = [p for p in pieces[i:] if p.sweep == piece.sweep]
        plan.extend(_sweep_plan(sweep, depth, to_depth))
        i += len(sweep)
    return plan


def _edges(depth: int, to_depth: int) -> Callable[[int], int]:
    def to(layer: int) -> int:
        if layer == 0:
            return 0
        if layer == depth - 1:
            return to_depth - 1
        raise NotRepeating(f"an event outside the sweeps belongs to middle block {layer}")

    return to


def _sweep_plan(sweep: list[_Piece], depth: int, to_depth: int) -> Plan:
    """One sweep over ``to_depth`` blocks from its pieces over ``depth``: first run, middle runs, last."""
    runs = {p.layer: p for p in sweep if p.kind == "run"}
    gaps = {p.layer: p for p in sweep if p.kind == "gap"}
    order = range(to_depth) if sweep[0].ascending else range(to_depth - 1, -1, -1)
    plan: Plan = []
    for place, target in enumerate(order):
        source = 0 if target == 0 else depth - 1 if target == to_depth - 1 else 1
        plan.extend(_copy(runs[source], source, target))
        if place == to_depth - 1:
            break
        # the gap after a block: its source's (between two middle blocks, the middle's gap to the last)
        gap = gaps.get(source)
        if gap is None:
            raise NotRepeating("a sweep without its gap")
        plan.extend(_copy(gap, source, target))
    return plan


def _copy(piece: _Piece, source: int, target: int) -> Plan:
    move = lambda layer, s=source, t=target: t + (layer - s)
    return [_Copy(k, piece, target, move) for k in range(piece.start, piece.end)]


def _pieces(phases: Sequence[object], tags: Sequence[int | None], depth: int) -> list[_Piece]:
    """Each phase's events as fixed pieces and sweeps (Note [Extending a step by its middle block])."""
    pieces: list[_Piece] = []
    start = 0
    sweeps = 0
    while start < len(phases):
        end = start
        while end < len(phases) and phases[end] == phases[start]:
            end += 1
        found, sweeps = _phase_pieces(tags, start, end, depth, sweeps)
        pieces.extend(found)
        start = end
    return pieces


def _runs(tags: Sequence[int | None], start: int, end: int) -> list[tuple[int, int, int]]:
    """(block, first, last + 1) of each run of one block's events, events of no block inside a run kept in it."""
    runs: list[tuple[int, int, int]] = []
    for k in range(start, end):
        tag = tags[k]
        if tag is None:
            continue
        if runs and runs[-1][0] == tag:
            runs[-1] = (tag, runs[-1][1], k + 1)
        else:
            runs.append((tag, k, k + 1))
    return runs


def _phase_pieces(tags: Sequence[int | None], start: int, end: int, depth: int, sweeps: int) -> tuple[list[_Piece], int]:
    runs = _runs(tags, start, end)
    pieces: list[_Piece] = []
    at = start
    r = 0
    up, down = list(range(depth)), list(range(depth - 1, -1, -1))
    while r < len(runs):
        layers = [run[0] for run in runs[r : r + depth]]
        if layers not in (up, down):
            if 0 < runs[r][0] < depth - 1:
                raise NotRepeating(f"events of middle block {runs[r][0]} outside a sweep")
            r += 1
            continue
        first = runs[r][1]
        if first > at:
            pieces.append(_Piece("fixed", at, first))
        ascending = layers == up
        for k in range(depth):
            layer, lo, hi = runs[r + k]
            pieces.append(_Piece("run", lo, hi, sweeps, layer, ascending))
            if k < depth - 1:
                pieces.append(_Piece("gap", hi, runs[r + k + 1][1], sweeps, layer, ascending))
        at = runs[r + depth - 1][2]
        sweeps += 1
        r += depth
    if at < end:
        pieces.append(_Piece("fixed", at, end))
    return pieces, sweeps


def _copy_events(
    events: Sequence[MemoryEvent], plan: Plan, pieces: Sequence[_Piece], depth: int, to_depth: int, names: Names
) -> tuple[MemoryEvent, ...]:
    """The extended events, each release pointing at the copy of the allocation it releases: in the
    copy of that allocation's piece made for the block the release names, the allocation of the
    same op, node and size (and the same count of such before it). ``pieces`` are all the shallow
    step's: a release may free what a block the plan does not copy allocated (from 4 blocks, block
    2's), whose copy is then its counterpart's in the block copied in its place."""
    alloc_at = {e.storage: k for k, e in enumerate(events) if e.alloc}
    piece_of = {k: p for p in pieces for k in range(p.start, p.end)}
    keys = _allocation_keys(events, piece_of, names)
    edge = _edges(depth, to_depth)
    copies: dict[tuple[object, ...], int] = {}
    out: list[MemoryEvent] = []
    for new, c in enumerate(plan):
        e = events[c.event]
        if e.alloc:
            copies[_where(c.piece, c.target, c.event) + keys[c.event]] = new
            storage = new
        else:
            source = alloc_at.get(e.storage)
            if source is None or source not in piece_of:
                raise NotRepeating("a release without its allocation")
            piece = piece_of[source]
            if piece.kind == "fixed":
                block = None
            elif c.target is None:
                block = edge(piece.layer)
            else:
                block = c.target + (piece.layer - c.piece.layer)
            storage = copies.get(_where(piece, block, source) + keys[source], -1)
            if storage < 0:
                raise NotRepeating(f"the release of storage {e.storage} ({e.op} at {e.node}) has no allocation to free")
        node, fqn = names.node(e.node, c.to), names.fqn(e.fqn, c.to)
        out.append(MemoryEvent(e.phase, e.alloc, e.nbytes, e.category, node, fqn, e.op, storage, e.bound, e.at_batch))
    return tuple(out)


def _where(piece: _Piece, block: int | None, index: int) -> tuple[object, ...]:
    return ("fixed", index) if piece.kind == "fixed" else (piece.sweep, piece.kind, block)


def _allocation_keys(events: Sequence[MemoryEvent], piece_of: Mapping[int, _Piece], names: Names) -> dict[int, tuple[object, ...]]:
    """Per allocation, what it is relative to its piece's block (op, node, size) and how many such
    came before it in the piece: the same in every copy of a block's events."""
    keys: dict[int, tuple[object, ...]] = {}
    seen: dict[tuple[object, ...], int] = {}
    for k, e in enumerate(events):
        piece = piece_of.get(k)
        if not e.alloc or piece is None:
            continue
        what = (piece.start, e.op, e.nbytes, e.category, names.relative(e.node, piece.layer), names.relative(e.fqn, piece.layer))
        keys[k] = (*what[1:], seen.get(what, 0))
        seen[what] = seen.get(what, 0) + 1
    return keys


def _named(c: OpCostRecord, node: str, fqn: str) -> OpCostRecord:
    """``c`` at ``node`` in ``fqn``, built directly: ``dataclasses.replace`` costs microseconds a call,
    and extending a deep step copies tens of thousands of records."""
    return OpCostRecord(c.phase, node, fqn, c.op, c.dtype, c.flops, c.read, c.written, c.has_formula)


# Note [Saved tensors from three blocks]
#     The capture pass (what autograd saves, node by node) extends as the step does: its nodes and
#     its saved storages, in the order the forward met them, read as one sweep over the blocks, and
#     those of L blocks are the first block's, L - 2 copies of the middle one's and the last one's,
#     renamed. It is kept only where the 3-block capture extended to 4 blocks is the 4-block
#     capture, node for node and storage for storage. A weight read by a ``get_attr`` node belongs to
#     the block its path names, as an exported graph's weights carry no module stack.


def extend_capture(shallow: Capture, depth: int, to_depth: int, names: Names) -> Capture:
    """The capture of ``to_depth`` blocks from that of ``depth``: Note [Saved tensors from three blocks]."""
    if shallow.unsupported:
        raise NotRepeating("a node's saved bytes are not supported")
    tags = [names.block_of_node(i.name) for i in shallow.nodes]
    plan = _plan(["forward"] * len(shallow.nodes), tags, depth, to_depth)
    infos = [_renamed_info(shallow.nodes[c.event], c.to, names) for c in plan]
    saved_tags = [names.block_of_node(s.saved_by[0] if s.saved_by else s.node) for s in shallow.saved]  # the node running
    saved_plan = _plan(["forward"] * len(shallow.saved), saved_tags, depth, to_depth)
    saved = tuple(
        replace(
            shallow.saved[c.event],
            storage=k,
            node=names.node(shallow.saved[c.event].node, c.to),
            saved_by=_savers(shallow.saved[c.event].saved_by, c, depth, to_depth, names),
        )
        for k, c in enumerate(saved_plan)
    )
    return replace(shallow, nodes=tuple(infos), saved=saved)


def _savers(savers: Sequence[str], copy: _Copy, depth: int, to_depth: int, names: Names) -> tuple[str, ...]:
    """The nodes that saved a storage, renamed for the copy; a storage that every block saves (a rotary
    table made once) is saved by every block's copy, its savers read as a sweep like the events."""
    tags = [names.block_of_node(n) for n in savers]
    if {t for t in tags if t is not None} != set(range(depth)):
        return tuple(names.node(n, copy.to) for n in savers)
    plan = _plan(["saved"] * len(savers), tags, depth, to_depth)
    return tuple(names.node(savers[c.event], c.to) for c in plan)


def _renamed_info(info: NodeInfo, to: Callable[[int], int], names: Names) -> NodeInfo:
    target = names.fqn(info.target, to) if info.op == "get_attr" else info.target  # a weight's target is its path
    return replace(info, name=names.node(info.name, to), target=target, fqn=names.fqn(info.fqn, to))
