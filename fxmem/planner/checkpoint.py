"""Choose activation checkpointing under a budget: which blocks to checkpoint, and what each keeps.

The pipeline: one fake pass records every block's ATen ops (block_ops.py); per block, a min-cut at
several prices of a byte in FLOPs gives the ways to checkpoint it, from "keep nothing but its inputs"
to "keep every matmul" (cut.py); a knapsack over blocks then picks one way per block, or none, so that
the saved bytes fit the budget with the fewest FLOPs recomputed in backward. emit.py writes the
result as code; verify.py runs it for real.

Note [What a selective checkpoint must rerun]
    - Random ops (dropout's ``bernoulli_``) are rerun, never cached. The checkpoint restores the RNG
      state when its recomputation starts (``preserve_rng_state=True``, the default the emitted code
      keeps), so rerunning every random op draws the same numbers; caching one would skip its draw
      and shift every later random op's numbers (torch.utils.checkpoint, ``recompute_fn``).
    - Ops that write in place are rerun, never cached, and so is an op whose output a later op writes
      in place: autograd bumps a tensor's version above the dispatch modes (ADInplaceOrView), after
      the caching mode has noted it, so a cached in-place output, or one written later, has changed
      version by the time backward reads it, which ``_VersionWrapper.get_val`` refuses ("Tensor cached
      during selective activation checkpoint has been mutated"). An op that writes state
      (BatchNorm's running statistics and ``num_batches_tracked``) therefore runs again in backward
      and updates that state a second time, as it does under plain ``torch.utils.checkpoint``.
    - Views and ops without a FLOP formula cost nothing to rerun by torch.utils.flop_counter's
      measure, so only ops with FLOPs are offered to the cut.
    The CPU RNG state the checkpoint stashes (``torch.get_rng_state()``, 5056 bytes per region) is held
    by the checkpoint's frame, not saved for backward, and not counted.

Note [Between two cuts]
    The min-cut at a price of ``lam`` FLOPs per byte (cut.py) gives the best way to checkpoint a block
    for that price; as the price falls it keeps more, and its answers are the corners of the convex
    hull of (bytes kept, FLOPs rerun). A budget can fall between two corners, and ops with the same
    FLOPs per byte (a block's qkv, output and first MLP projections all do 16 FLOPs per byte in the
    zoo's transformers) enter at the same corner together. So between two consecutive cuts the
    chooser also offers the steps in between: the ops the next cut adds, one group at a time (ops
    writing a common storage form one group), best FLOPs per byte first. The knapsack over blocks
    then chooses among all of them; it is exact over these options (a Pareto front of (bytes, FLOPs)),
    while the options per block are the hull's corners and the chain between them, not every subset.
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from torch import nn

from fxmem.engine.losses import get_loss
from fxmem.errors import InputSpecError
from fxmem.inputs import InputSpecs, check_batch, parse_inputs, parse_size
from fxmem.planner.block_ops import BlockOps, OpTrace, record_block_ops
from fxmem.planner.cut import CutOp, cut_block
from fxmem.symbolic import ByteExpr
from fxmem.frontends.huggingface import without_kv_cache

__all__ = ["BlockChoice", "CheckpointPlan", "OpKey", "plan_checkpointing"]


@dataclass(frozen=True)
class OpKey:
    """An op as a policy function can name it: its OpOverload and its occurrence in the block's forward."""

    op: str
    occurrence: int

    def __str__(self) -> str:
        return f"{self.op}#{self.occurrence}"


@dataclass(frozen=True)
class BlockChoice:
    """What one block does: not checkpointed, or checkpointed keeping the outputs of ``kept``.

    For a checkpointed block ``recomputed`` lists the ops backward runs again (views and ops without
    FLOPs included); ``saved`` is what the block keeps (its inputs and the kept ops' outputs, each
    storage once); ``recompute_flops`` what rerunning costs, by torch.utils.flop_counter's formulas.
    A block left alone keeps what autograd saves for it and has empty ``kept`` and ``recomputed``.
    """

    fqn: str
    checkpointed: bool
    kept: tuple[OpKey, ...]
    recomputed: tuple[OpKey, ...]
    saved: ByteExpr
    recompute_flops: ByteExpr
    batch: int

    @property
    def saved_at_batch(self) -> int:
        return self.saved.at(self.batch)

    @property
    def recompute_flops_at_batch(self) -> int:
        return self.recompute_flops.at(self.batch)


@dataclass(frozen=True)
class CheckpointPlan:
    """The chosen checkpointing of ``model`` at ``batch``: its blocks, and the step's saved bytes under it.

    ``saved`` counts each storage once over the whole step (blocks and the rest), so it can be less
    than the blocks' and ``outside``'s sum where they share one (a block's input is the previous block's
    output). ``unplanned`` is the step's saved bytes with no checkpointing, for comparison.
    """

    model: str
    batch: int
    budget: int
    blocks: tuple[BlockChoice, ...]
    outside: ByteExpr
    saved: ByteExpr
    unplanned: ByteExpr

    @property
    def saved_at_batch(self) -> int:
        return self.saved.at(self.batch)

    @property
    def recompute_flops(self) -> int:
        return sum(b.recompute_flops_at_batch for b in self.blocks)

    def __str__(self) -> str:
        rows = [f"{'block':<16}{'checkpointed':<14}{'kept':>6}{'saved (B)':>14}{'recompute FLOPs':>18}"]
        for b in self.blocks:
            rows.append(
                f"{b.fqn:<16}{'yes' if b.checkpointed else 'no':<14}{len(b.kept):>6}{b.saved_at_batch:>14}{b.recompute_flops_at_batch:>18}"
            )
        rows.append(
            f"saved at B={self.batch}: {self.saved_at_batch} B of a {self.budget} B budget (without checkpointing {self.unplanned.at(self.batch)} B)"
        )
        return "\n".join(rows)


@dataclass(frozen=True)
class _Option:
    """One way to run a block: its storages kept, the ops cached (checkpointed) and the FLOPs rerun."""

    checkpointed: bool
    kept: frozenset[int]
    storages: frozenset[int]
    flops: ByteExpr
    reruns: tuple[int, ...] = ()


@without_kv_cache(0)  # checkpointed layers run without a key/value cache, as transformers runs them
def plan_checkpointing(
    model: nn.Module,
    inputs: InputSpecs,
    blocks: Sequence[str],
    *,
    budget: int | str,
    batch: int,
    loss: str = "sum",
    name: str | None = None,
    seq_len: int | None = None,
) -> CheckpointPlan:
    """Choose checkpointing for ``blocks`` (module paths) so that the step's saved activations at ``batch``
    fit ``budget`` (bytes, or a size such as "64MiB") with the fewest FLOPs recomputed in backward.

    >>> from models_zoo import gpt2_small
    >>> spec = gpt2_small.build(test=True)
    >>> plan = plan_checkpointing(spec.model, spec.inputs, ["blocks.0", "blocks.1"], budget=10**9, batch=4, loss=spec.loss)
    >>> [b.checkpointed for b in plan.blocks], plan.recompute_flops   # everything fits: nothing checkpointed
    ([False, False], 0)
    """
    name = name or type(model).__name__
    check_batch(batch)
    limit = budget if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0 else parse_size(str(budget), "budget")
    _check_blocks(model, blocks, name)
    trace = record_block_ops(model.train(), parse_inputs(inputs), blocks, loss=get_loss(loss), name=name, seq=seq_len, batch=batch)
    outside = frozenset(trace.outside)
    options = [_options(block, trace, outside, batch) for block in trace.blocks]
    room = limit - trace.nbytes(outside).at(batch)
    weights = [[(_extra(o, trace, outside, batch), _cost(o, batch)) for o in opts] for opts in options]
    picks = _knapsack(weights, room)
    if picks is None:
        raise _budget_error(name, limit, batch, trace, outside, weights)
    chosen = [opts[i] for opts, i in zip(options, picks)]
    everything = outside.union(*(o.storages for o in chosen))
    unplanned = outside.union(*(b.saved for b in trace.blocks))
    return CheckpointPlan(
        name, batch, limit, tuple(_choice(b, o, trace, batch) for b, o in zip(trace.blocks, chosen)),
        trace.nbytes(outside), trace.nbytes(everything), trace.nbytes(unplanned),
    )  # fmt: skip


def _check_blocks(model: nn.Module, blocks: Sequence[str], name: str) -> None:
    """Every block is a module path of the model, given once, and none contains another."""
    modules = dict(model.named_modules())
    if isinstance(blocks, str) or not blocks:
        raise InputSpecError(
            f"model '{name}': blocks must be a list of module paths to checkpoint, such as ['blocks.0', 'blocks.1']; got {blocks!r}."
        )
    for fqn in blocks:
        if not isinstance(fqn, str) or not fqn or fqn not in modules:
            close = difflib.get_close_matches(str(fqn), [m for m in modules if m], n=3) or [m for m in modules if m][:3]
            raise InputSpecError(
                f"model '{name}': block {fqn!r} is not a module path of the model, so it cannot be checkpointed; "
                f"give paths as model.named_modules() lists them, such as {', '.join(repr(c) for c in close)}."
            )
    for a in blocks:
        for b in blocks:
            if (a == b and blocks.count(a) > 1) or (a != b and b.startswith(a + ".")):
                raise InputSpecError(
                    f"model '{name}': blocks {a!r} and {b!r} overlap (a checkpoint region is one module, run once); "
                    "give each block once, and none inside another."
                )


def _cut_ops(block: BlockOps, batch: int) -> list[CutOp]:
    """The ops the cut may keep; See Note [What a selective checkpoint must rerun]."""
    return [
        CutOp(op.index, op.flops.at(batch), op.outputs)
        for op in block.ops[: block.stop]
        if op.flops.at(batch) > 0 and not (op.random or op.in_place or op.mutated_later or op.view)
    ]


def _options(block: BlockOps, trace: OpTrace, outside: frozenset[int], batch: int) -> list[_Option]:
    """The block left alone, then checkpointed keeping more and more: the min-cut at every price where it
    changes its mind, and the steps between two such cuts (Note [Between two cuts])."""
    alone = _Option(False, frozenset(), frozenset(block.saved), ByteExpr())
    offered = _cut_ops(block, batch)
    nbytes = {s: trace.storages[s].at(batch) for s in trace.storages}
    free = outside | frozenset(block.inputs)
    free |= frozenset(s for s, n in nbytes.items() if n == 0)
    cuts = sorted({cut_block(offered, nbytes, free, lam) for lam in _prices(offered, nbytes, free)}, key=len)
    kept_sets: list[frozenset[int]] = [frozenset()]
    for cut in cuts:  # See Note [Between two cuts]
        held = free | frozenset(s for op in offered if op.index in kept_sets[-1] for s in op.outputs)
        for unit in _units([op for op in offered if op.index in cut - kept_sets[-1]], nbytes, held):
            kept_sets.append(kept_sets[-1] | unit)
    return [alone, *(_checkpointed(block, kept) for kept in dict.fromkeys(kept_sets))]


def _units(ops: Sequence[CutOp], nbytes: dict[int, int], free: frozenset[int]) -> list[frozenset[int]]:
    """``ops`` in groups that write a common storage (kept together, or paying for it twice), best FLOPs per new byte first."""
    parent = {op.index: op.index for op in ops}

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    writer: dict[int, int] = {}
    for op in ops:
        for storage in set(op.outputs) - free:
            parent[root(op.index)] = root(writer.setdefault(storage, op.index))
    groups: dict[int, set[int]] = {}
    for op in ops:
        groups.setdefault(root(op.index), set()).add(op.index)
    by_index = {op.index: op for op in ops}
    new = lambda u: sum(nbytes[s] for s in {s for i in u for s in by_index[i].outputs} - free)
    ratio = lambda u: Fraction(sum(by_index[i].flops for i in u), max(new(u), 1))
    return sorted((frozenset(g) for g in groups.values()), key=lambda u: (-ratio(u), new(u), sorted(u)))


def _prices(ops: Sequence[CutOp], nbytes: dict[int, int], free: frozenset[int]) -> list[Fraction]:
    """Prices of a byte in FLOPs between and around each op's FLOPs per byte of its new storages: one cut
    per interval finds every distinct answer of the parametric cut (ties at a breakpoint are avoided)."""
    ratios = sorted({Fraction(op.flops, new) for op in ops if (new := sum(nbytes[s] for s in set(op.outputs) - free))})
    if not ratios:
        return [Fraction(1)]
    between = [(a + b) / 2 for a, b in itertools.pairwise(ratios)]
    return [ratios[0] / 2, *between, ratios[-1] * 2]


def _checkpointed(block: BlockOps, kept: frozenset[int]) -> _Option:
    storages = frozenset(block.inputs) | frozenset(s for i in kept for s in block.ops[i].outputs)
    reruns = tuple(op.index for op in block.ops[: block.stop] if op.index not in kept)
    return _Option(True, kept, storages, ByteExpr.total(block.ops[i].flops for i in reruns), reruns)


def _extra(option: _Option, trace: OpTrace, outside: frozenset[int], batch: int) -> int:
    """The bytes an option adds to what the rest of the model keeps anyway."""
    return trace.nbytes(option.storages - outside).at(batch)


Cost = tuple[int, int]
_State = tuple[int, Cost, tuple[int, ...]]


def _cost(option: _Option, batch: int) -> Cost:
    """What an option costs in backward: its FLOPs rerun, then (to break ties, as elementwise ops have no
    FLOP formula) the ops it reruns, so that a block that fits is left alone rather than checkpointed for free."""
    return (option.flops.at(batch), len(option.reruns))


def _knapsack(weights: Sequence[Sequence[tuple[int, Cost]]], room: int) -> tuple[int, ...] | None:
    """One option per block, (bytes, cost) each, of least total cost whose bytes fit ``room``; None if
    none fits. A multiple-choice knapsack kept exact by carrying only the Pareto front of (bytes, cost)."""
    states: list[_State] = [(0, (0, 0), ())] if room >= 0 else []
    for options in weights:
        grown = [
            (b + ob, (f + of[0], n + of[1]), (*picks, i))
            for b, (f, n), picks in states
            for i, (ob, of) in enumerate(options)
            if b + ob <= room
        ]
        states = _pareto(grown)
    return min(states, key=lambda s: (s[1], s[0]))[2] if states else None


def _pareto(states: Iterable[_State]) -> list[_State]:
    """The states no other beats on both bytes and cost."""
    front: list[_State] = []
    for state in sorted(states, key=lambda s: (s[0], s[1])):
        if not front or state[1] < front[-1][1]:
            front.append(state)
    return front


def _choice(block: BlockOps, option: _Option, trace: OpTrace, batch: int) -> BlockChoice:
    if not option.checkpointed:
        return BlockChoice(block.fqn, False, (), (), trace.nbytes(option.storages), ByteExpr(), batch)
    key = lambda i: OpKey(block.ops[i].op, block.ops[i].occurrence)
    kept, rerun = tuple(key(i) for i in sorted(option.kept)), tuple(key(i) for i in option.reruns)
    return BlockChoice(block.fqn, True, kept, rerun, trace.nbytes(option.storages), option.flops, batch)


def _budget_error(
    name: str, budget: int, batch: int, trace: OpTrace, outside: frozenset[int], weights: Sequence[Sequence[tuple[int, Cost]]]
) -> InputSpecError:
    rest = trace.nbytes(outside).at(batch)
    least = rest + sum(min(b for b, _ in options) for options in weights)
    return InputSpecError(
        f"model '{name}': a budget of {budget} bytes for the activations saved at B={batch} is below the least any "
        f"checkpointing of blocks {', '.join(b.fqn for b in trace.blocks)} keeps: {least} bytes with every block "
        f"checkpointed ({rest} bytes of it saved outside those blocks, which checkpointing them cannot reduce). "
        f"Give a budget of at least {least} bytes, a smaller batch, or more of the model as blocks."
    )
