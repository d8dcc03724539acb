"""The ATen ops of each block's forward, as a selective-checkpoint policy will see them, with their bytes and FLOPs.

One fake pass of the model itself (its parameters and buffers fake, the batch axis the symbol B, as
fxmem/engine/capture.py runs its passes), forward and loss, with a TorchDispatchMode that records each
op and saved-tensor hooks that record what autograd keeps. The chooser (checkpoint.py) cuts these ops.

Note [Ops as a policy function sees them]
    ``create_selective_checkpoint_contexts`` calls its policy once per op that reaches its
    TorchDispatchMode during the region's forward, except the ops in ``SAC_IGNORED_OPS``, and keys
    its cache by the OpOverload and the op's occurrence count within the region
    (torch/utils/checkpoint.py, ``_CachingTorchDispatchMode.__torch_dispatch__``). A dispatch mode
    sits below autograd, so it sees ops after CompositeImplicit decomposition (``linear`` arrives
    as ``t`` and ``addmm``). The recorder here is a TorchDispatchMode too, entered inside the
    FakeTensorMode as FlopTally is, skips the same ignored ops and counts occurrences per OpOverload
    in the same way, so ``(op, occurrence)`` names the same call in the fake pass and in a real one.

Note [Where a checkpointed block stops recomputing]
    Non-reentrant checkpoint stops its recomputation as soon as the last tensor the forward saved has
    been saved again (``_StopRecomputationError``, raised from ``_recomputation_hook``'s pack hook;
    early stop is on by default). Autograd saves an op's inputs before it runs the op and its outputs
    after (the generated VariableType kernels), so the ops recomputed are exactly those dispatched
    before the last pack of the block's forward: ``BlockOps.stop`` counts them. An op after it costs
    no recomputation whatever the policy says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import SAC_IGNORED_OPS

from fxmem.engine.binding import swapped_state
from fxmem.engine.capture import fake_batch, quiet_fake_tensor_log
from fxmem.engine.flops import is_view_like, op_cost
from fxmem.engine.losses import Loss
from fxmem.errors import InputSpecError
from fxmem.frontends.hf_paths import eager_code_paths, forward_input_names
from fxmem.inputs import InputSpec, tensors_of
from fxmem.symbolic import ByteExpr, to_byte_expr

__all__ = ["BlockOps", "OpRecord", "OpTrace", "record_block_ops"]


@dataclass(frozen=True)
class OpRecord:
    """One ATen op of a block's forward; ``op`` and ``occurrence`` identify it to a policy function."""

    index: int
    op: str
    """The OpOverload, as ``str(torch.ops.aten.addmm.default)`` writes it: ``"aten.addmm.default"``."""
    occurrence: int
    """How many earlier calls of the same OpOverload this block's forward made."""
    flops: ByteExpr
    """FLOPs by torch.utils.flop_counter's formula (fxmem/engine/flops.py), as a polynomial in B."""
    outputs: tuple[int, ...]
    """The storages of its tensor outputs (keys of ``OpTrace.storages``): what caching it keeps."""
    random: bool
    """Draws random numbers (``Tag.nondeterministic_seeded``: dropout's ``bernoulli_``)."""
    in_place: bool
    """Writes one of its arguments in place (``bernoulli_``, ``relu_``, BatchNorm's ``num_batches_tracked.add_``)."""
    mutated_later: bool
    """A later op of the block writes its output in place (the ``empty_like`` that ``bernoulli_`` fills)."""
    view: bool


@dataclass(frozen=True)
class BlockOps:
    """A block's forward: its ops, its inputs, what autograd keeps of it, where recomputation stops."""

    fqn: str
    ops: tuple[OpRecord, ...]
    inputs: tuple[int, ...]
    """The storages of its positional tensor arguments: what a non-reentrant checkpoint keeps."""
    saved: tuple[int, ...]
    """The storages autograd keeps for its ops when the block is not checkpointed."""
    stop: int
    """Ops ``[0, stop)`` run again in a recomputation (Note [Where a checkpointed block stops recomputing])."""


@dataclass(frozen=True)
class OpTrace:
    """The blocks' ops and the bytes of every storage the step keeps, for one model and loss."""

    model: str
    blocks: tuple[BlockOps, ...]
    outside: tuple[int, ...]
    """Storages kept for ops outside every block (the embeddings, the head, the loss)."""
    storages: Mapping[int, ByteExpr]
    """Bytes per storage; 0 for parameters, buffers, the input batch and the target (not activations)."""

    def nbytes(self, storages: Sequence[int] | frozenset[int]) -> ByteExpr:
        """The bytes of a set of storages, each counted once."""
        return ByteExpr.total(self.storages[s] for s in set(storages))


@dataclass
class _Block:
    fqn: str
    ops: list[OpRecord] = field(default_factory=list)
    mutated: set[int] = field(default_factory=set)
    """Indices of ops whose output a later op wrote in place."""
    inputs: list[int] = field(default_factory=list)
    saved: list[int] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    stop: int = 0
    calls: int = 0


@dataclass
class _Book:
    """Storage numbering (StorageWeakRef -> id) and the blocks' records while the pass runs."""

    symbols: tuple[Any, Any]
    ids: dict[StorageWeakRef, int] = field(default_factory=dict)
    nbytes: dict[int, ByteExpr] = field(default_factory=dict)
    state: set[int] = field(default_factory=set)
    blocks: dict[str, _Block] = field(default_factory=dict)
    current: _Block | None = None
    outside: list[int] = field(default_factory=list)
    alive: list[object] = field(default_factory=list)

    def storage(self, t: torch.Tensor) -> int:
        """The id of ``t``'s storage; every tensor seen is kept alive so that no key is reused."""
        key = StorageWeakRef(t.untyped_storage())
        if key not in self.ids:
            self.ids[key] = len(self.ids)
            self.nbytes[self.ids[key]] = to_byte_expr(t.untyped_storage().nbytes(), *self.symbols)
        self.alive.append(t)
        return self.ids[key]

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        sid = self.storage(t)
        if self.current is None:
            self.outside.append(sid)
        else:
            self.current.saved.append(sid)
            self.current.stop = len(self.current.ops)  # See Note [Where a checkpointed block stops recomputing]
        return t


def _tensors(value: object) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.layout == torch.strided]


def _written(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors an op writes in place: the arguments its schema marks ``Tensor(a!)``."""
    found: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            found += _tensors(args[i] if i < len(args) else kwargs.get(arg.name))
    return found


class _OpRecorder(TorchDispatchMode):
    """Records each op run inside a block (See Note [Ops as a policy function sees them])."""

    def __init__(self, book: _Book) -> None:
        super().__init__()
        self.book = book

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        block = self.book.current
        if block is not None and func not in SAC_IGNORED_OPS:
            self._record(block, func, args, kwargs, out)
        return out

    def _record(self, block: _Block, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> None:
        book, name = self.book, str(func)
        written = {book.storage(t) for t in _written(func, args, kwargs)}
        block.mutated.update(op.index for op in block.ops if written & set(op.outputs))  # all ran before this one
        outputs = tuple(dict.fromkeys(book.storage(t) for t in _tensors(out)))
        cost = op_cost(func, args, kwargs, out)
        occurrence = block.counts.get(name, 0)
        block.counts[name] = occurrence + 1
        flops = to_byte_expr(cost.flops if cost is not None else 0, *book.symbols)
        random = torch.Tag.nondeterministic_seeded in func.tags
        block.ops.append(OpRecord(len(block.ops), name, occurrence, flops, outputs, random, bool(written), False, is_view_like(func)))


def _freeze(block: _Block) -> BlockOps:
    ops = tuple(replace(op, mutated_later=op.index in block.mutated) for op in block.ops)
    return BlockOps(block.fqn, ops, tuple(dict.fromkeys(block.inputs)), tuple(dict.fromkeys(block.saved)), block.stop)


@contextlib.contextmanager
def _block_hooks(model: nn.Module, fqns: Sequence[str], book: _Book) -> Iterator[None]:
    """Mark the ops that run inside each block's forward as that block's (forward pre- and post-hooks)."""
    handles = []
    for fqn in fqns:
        block = book.blocks.setdefault(fqn, _Block(fqn))

        def enter(_m: nn.Module, args: tuple[Any, ...], _block: _Block = block) -> None:
            if book.current is not None:
                raise InputSpecError(f"block '{_block.fqn}' runs inside block '{book.current.fqn}': give blocks that do not nest.")
            _block.calls += 1
            _block.inputs += [book.storage(t) for t in _tensors(args)]
            book.current = _block

        def leave(_m: nn.Module, _args: tuple[Any, ...], _out: Any) -> None:
            book.current = None

        module = model.get_submodule(fqn)
        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def record_block_ops(
    model: nn.Module,
    specs: Sequence[InputSpec],
    blocks: Sequence[str],
    *,
    loss: Loss,
    name: str,
    seq: int | None = None,
    batch: int | None = None,
) -> OpTrace:
    """One fake pass (forward and loss) of ``model``, its ops recorded per block in ``blocks``.

    B is symbolic, so bytes and FLOPs hold for every B >= 2; for ``batch=1`` the pass is made at B=1
    (a size of 1 is special to ShapeEnv: Note [Why B=1 is measured on its own] in engine/account.py).
    """
    fake = fake_batch(specs, 1 if batch == 1 else None, seq)
    book = _Book(symbols=(fake.symbols.get("B"), fake.symbols.get("S")))
    args = [v for s, v in zip(specs, fake.inputs) if s.name is None]
    kwargs = {s.name: v for s, v in zip(specs, fake.inputs) if s.name is not None}
    paths = eager_code_paths(forward_input_names(model, specs))  # transformers' eager masks, as export's pass takes them
    with swapped_state(model, fake.state_copy), quiet_fake_tensor_log(), paths, _block_hooks(model, blocks, book):  # type: ignore[arg-type]
        book.state.update(book.storage(t) for t in [*model.parameters(), *model.buffers(), *tensors_of(specs, fake.inputs)])
        with fake.mode, _OpRecorder(book), torch.autograd.graph.saved_tensors_hooks(book.pack, lambda t: t):
            output = loss.select(model(*args, **kwargs), name)
            target = loss.make_target(output)
            if target is not None:
                book.state.add(book.storage(target))
            loss.compute(output, target)
    _check_calls(book, name)
    storages = {sid: ByteExpr() if sid in book.state else n for sid, n in book.nbytes.items()}
    return OpTrace(name, tuple(_freeze(book.blocks[f]) for f in blocks), tuple(dict.fromkeys(book.outside)), storages)


def _check_calls(book: _Book, model: str) -> None:
    """Each block runs once per forward: a policy counts ops within one call, and a block that never
    runs (or runs twice, as a shared module does) cannot be planned as one region."""
    for block in book.blocks.values():
        if block.calls != 1:
            raise InputSpecError(
                f"model '{model}': block '{block.fqn}' ran {block.calls} times in one forward; the chooser plans "
                "modules that run exactly once (one checkpoint region each): give the module paths of the repeated "
                "blocks themselves, e.g. 'blocks.0'."
            )
