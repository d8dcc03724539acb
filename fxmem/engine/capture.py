"""Run the traced graph node by node and record every tensor autograd saves for backward.

The same recorder serves two worlds. ``capture_saved`` runs it on fake tensors (FakeTensorMode with a
ShapeEnv), where the batch axis of every input is one symbol B and parameters are static: no data, no
RAM for weights. ``record_real`` runs it on real CPU tensors; that is the measurement in measure.py.

Note [Counting storages once]
    A saved tensor is often a view (a transpose kept by a linear, the q/k/v split of one projection,
    an in-place ReLU's output that is the BatchNorm's output). Memory is held by storages, so each
    storage is counted once, at its full size, and charged to the node whose execution allocated it:
    the node that first produced it as an output, or, for kernel-internal buffers (dropout's noise,
    max-pool's indices), the node during which autograd first saw it. Keys are
    ``StorageWeakRef``s (``data_ptr()`` is 0 for fake tensors). Every value of the pass is kept alive
    until the pass ends, so a freed storage's key can never be reused within one pass.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._refs
import torch.fx as fx
from torch._guards import GuardSource, Source
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from fxmem.engine.binding import bind_inputs, fake_like, local_tensor, state_kinds, storage_of, storage_parts, swapped_state
from fxmem.engine.dispatch import DtypeMismatch, LayoutRule, OpRule, OpRuleMode
from fxmem.engine.losses import Loss
from fxmem.engine.module_hooks import ModuleHooks, ModuleScopes, Scope
from fxmem.engine.recompute import RegionInterpreter
from fxmem.errors import CaptureError, FxmemError
from fxmem.frontends.checkpointing import Region
from fxmem.inputs import InputSpec, dtype_name, has_seq, make_input, tensors_of
from fxmem.results import Capture, Kind, NodeInfo, SavedTensor, Unsupported
from fxmem.rules.nf4 import fake_quantized
from fxmem.symbolic import ByteExpr, DataDependentBytes, label_dim, to_byte_expr

__all__ = [
    "BatchSpecialized",
    "FakeBatch",
    "OpRule",
    "StepCapture",
    "SymbolicUnsupported",
    "capture_saved",
    "dtype_error",
    "fake_batch",
    "node_error",
    "node_fqn",
    "quiet_fake_tensor_log",
    "record_real",
]

_BATCH_HINT = 8
"""The value ShapeEnv assumes for B when a kernel asks; any value above 1 avoids 0/1 specialization."""
_SEQ_HINT = 24
"""The same for S; unlike B's, so that no comparison of B with S is decided by equal hints."""

LOSS_NODE = "loss"


class SymbolicUnsupported(Exception):
    """The symbolic pass could not run (a kernel needs concrete sizes); retry with concrete batches.

    ``error`` is the CaptureError the failure would be if it is not the symbolic sizes' fault.
    """

    def __init__(self, message: str, *, node: str = "", error: CaptureError | None = None) -> None:
        super().__init__(message)
        self.node = node
        self.error = error


class BatchSpecialized(Exception):
    """The model guarded on B and ShapeEnv replaced the symbol by a constant."""


@dataclass(frozen=True)
class _SymbolSource(Source):
    """The ShapeEnv source of the batch or sequence symbol (a constant name; no guards are ever generated)."""

    symbol: str = "B"

    @property
    def guard_source(self) -> GuardSource:
        return GuardSource.CONSTANT

    @property
    def _name_template(self) -> str:
        return self.symbol


@dataclass
class _Entry:
    node: str
    saved_by: list[str]
    shape: tuple[int | str, ...]
    dtype: str
    nbytes: object
    kind: Kind


@dataclass
class _Book:
    """Per-pass bookkeeping of storages: who allocated each, which were saved, and what they cost."""

    kinds: dict[Hashable, Kind]
    batch_symbol: Any = None
    seq_symbol: Any = None
    strict: bool = False
    current: str = ""
    owner: dict[Hashable, str] = field(default_factory=dict)
    saved: dict[Hashable, _Entry] = field(default_factory=dict)
    overrides: dict[StorageWeakRef, object] = field(default_factory=dict)
    unsupported: list[tuple[str, str]] = field(default_factory=list)
    alive: list[object] = field(default_factory=list)
    inputs: dict[Hashable, object] = field(default_factory=dict)

    def key(self, t: torch.Tensor) -> Hashable:
        """What names ``t``'s storage for the length of the pass (Note [Counting storages once])."""
        return StorageWeakRef(storage_of(t))

    def nbytes(self, key: Hashable, t: torch.Tensor) -> object:
        """A storage's true size: a rule's where one says the kernel's differs from the fake one's."""
        return self.overrides.get(key, storage_of(t).nbytes())  # type: ignore[call-overload]

    def hold(self, value: object) -> None:
        """Keep ``value`` alive to the end of the pass, so that its storages' keys stay unique."""
        self.alive.append(value)

    def add_input(self, t: torch.Tensor) -> None:
        """Register an input batch or loss-target storage: classified as INPUT, counted on its own line."""
        key = self.key(t)
        self.kinds[key] = Kind.INPUT
        self.inputs[key] = t.untyped_storage().nbytes()
        self.hold(t)

    def input_bytes(self) -> ByteExpr:
        return ByteExpr.total(to_byte_expr(n, self.batch_symbol, self.seq_symbol) for n in self.inputs.values())

    def claim(self, value: object, node: str) -> None:
        """Charge every storage first seen in ``value`` to ``node``. See Note [Counting storages once]."""
        self.hold(value)
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor) and _has_storage(t):
                self.owner.setdefault(self.key(t), node)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Note a saved tensor's storage; a DTensor's is its local shard's, whose shape is the rank's."""
        if t.layout == torch.sparse_coo:  # See Note [A sparse tensor's storages] in fxmem/engine/binding.py
            for part in storage_parts(t):
                self.pack(part)
            return t
        if not _has_storage(t):
            self.unsupported.append((self.current, f"saved a {t.layout} tensor without a plain storage"))
            return t
        key = self.key(t)
        self.hold(t)
        if key in self.saved:
            if self.current not in self.saved[key].saved_by:
                self.saved[key].saved_by.append(self.current)
            return t
        owner = self.owner.setdefault(key, self.current)
        nbytes = self.nbytes(key, t)
        shape = tuple(label_dim(d, self.batch_symbol, self.seq_symbol) for d in local_tensor(t).shape)
        kind = self.kinds.get(key, Kind.ACTIVATION)
        self.saved[key] = _Entry(owner, [self.current], shape, dtype_name(t.dtype), nbytes, kind)
        return t

    def saved_tensors(self) -> tuple[SavedTensor, ...]:
        return tuple(
            SavedTensor(i, e.node, tuple(e.saved_by), e.shape, e.dtype, self._bytes(e), e.kind) for i, e in enumerate(self.saved.values())
        )

    def _bytes(self, entry: _Entry) -> ByteExpr:
        """A storage's bytes in B and S; a data-dependent size is counted as 0 B and reported unsupported."""
        try:
            return to_byte_expr(entry.nbytes, self.batch_symbol, self.seq_symbol)
        except DataDependentBytes as e:
            if entry.kind != Kind.ACTIVATION:
                return ByteExpr()
            reason = f"saved a {entry.dtype} tensor of {e}"
            if self.strict:
                raise CaptureError(f"node '{entry.node}' {reason}; without --strict it is counted as 0 B and reported.") from e
            self.unsupported.append((entry.node, reason))
            return ByteExpr()


@dataclass
class _StepBook(_Book):
    """The book of a forward that frees what eager frees, the simulated step's (fxmem/step/timeline.py).

    There a dead storage's key can be reused, and keeping every value alive would change the step.
    So a storage the step's tracker numbered is named by its number, unique within the step, and its
    size is the tracker's (the op rules applied); only what the tracker does not number (state,
    inputs) is named by its StorageWeakRef and kept alive, as it is anyway.
    """

    numbered: Callable[[torch.Tensor], tuple[int, object] | None] = lambda _: None
    """A live storage's (number, true size) in the step, or None where the tracker numbers none."""

    def key(self, t: torch.Tensor) -> Hashable:
        found = self.numbered(t)
        return ("storage", found[0]) if found is not None else StorageWeakRef(storage_of(t))

    def nbytes(self, key: Hashable, t: torch.Tensor) -> object:
        found = self.numbered(t)
        return found[1] if found is not None else storage_of(t).nbytes()

    def hold(self, value: object) -> None:
        parts = (p for t in tree_leaves(value) if isinstance(t, torch.Tensor) for p in storage_parts(t))  # Note [A sparse tensor's storages]
        self.alive.extend(p for p in parts if self.numbered(p) is None)


class StepCapture:
    """What ``capture_saved`` records, recorded by the simulated step's own forward and loss, so that
    one fake pass serves both (Note [One pass for the capture and the step]).

    The step calls ``node_ran`` after each fx node of the forward, ``pack`` from its saved-tensor
    hook, and ``loss_ran`` after the loss; ``capture`` then gives what ``capture_saved`` would have.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        inputs: Sequence[torch.Tensor],
        fake: FakeBatch,
        numbered: Callable[[torch.Tensor], tuple[int, object] | None],
    ) -> None:
        self.book = _StepBook(
            kinds=state_kinds(gm), batch_symbol=fake.symbols.get("B"), seq_symbol=fake.symbols.get("S"), numbered=numbered
        )
        for t in inputs:
            self.book.add_input(t)
        self.infos: list[NodeInfo] = []
        self.recording = True

    def node_starts(self, name: str) -> None:
        if self.recording:
            self.book.current = name

    def node_ran(self, n: fx.Node, out: object, made_from: torch.Tensor | None = None) -> None:
        """Node ``n`` returned ``out``; ``made_from``: the graph's constant that ``out`` copies (Note
        [Tensors made while tracing] in fxmem/step/timeline.py), whose kind the copy takes."""
        if not self.recording or n.op == "output":
            return
        if made_from is not None and isinstance(out, torch.Tensor):
            kind = self.book.kinds.get(StorageWeakRef(storage_of(made_from)))
            if kind is not None:
                self.book.kinds[self.book.key(out)] = kind
        self.book.claim(out, n.name)
        self.infos.append(_node_info(n, out, self.book))

    def pack(self, t: torch.Tensor) -> None:
        if self.recording:
            self.book.pack(t)

    def module_entered(self, module: nn.Module) -> None:
        """A hooked module's pre-hooks ran: the parameters its code uses now (a sharding engine's
        gathered copies) are state, as ``_Recorder.entered`` marks them for ``capture_saved``."""
        if self.recording:
            for p in module.parameters():
                self.book.kinds.setdefault(self.book.key(p), Kind.PARAM)

    def loss_starts(self, target: torch.Tensor | None) -> None:
        self.book.current = LOSS_NODE
        if target is not None:
            self.book.add_input(target)

    def loss_ran(self, value: object, target: object, loss: Loss) -> None:
        """The loss ran: what it returned is its own, and the forward's recording ends (backward's
        recomputations save nothing the forward did not)."""
        self.infos.append(_loss_ran(self.book, value, target, loss))
        self.recording = False

    def capture(self, batch: int | None) -> Capture:
        """The capture, once the step has run; raises SymbolicUnsupported as ``capture_saved`` does."""
        return _captured(self.book, self.infos, batch)


def _has_storage(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_nested


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class _Recorder(ModuleHooks, RegionInterpreter):
    """An fx Interpreter that installs the saved-tensor hooks around each node it runs.

    Inside a checkpointed region it installs none: the checkpoint's own hooks decide what the region
    keeps, and the hooks around the checkpoint call see that (See Note [Checkpointed regions]). What a
    selective checkpoint's policy keeps passes through no hook: after each node of a region the
    recorder takes what the policy stored meanwhile as saved by that node (See Note [What a selective
    checkpoint keeps] in fxmem/engine/recompute.py).
    """

    passthrough = (FxmemError, SymbolicUnsupported, KeyboardInterrupt)

    def __init__(self, gm: fx.GraphModule, book: _Book, model_name: str, scopes: ModuleScopes | None = None) -> None:
        super().__init__(gm, garbage_collect_values=False, model_label=model_name)
        self.book = book
        self.infos: list[NodeInfo] = []
        self.scopes = scopes

    def entered(self, scope: Scope) -> None:
        """The parameters a hooked module's code uses now (a sharding engine's gathered copies) are
        state, not activations, when autograd saves them: Note [Module hooks on a flattened graph]."""
        for p in scope.module.parameters():
            self.book.kinds.setdefault(StorageWeakRef(storage_of(p)), Kind.PARAM)

    def region_call(self, region: Region) -> AbstractContextManager[object]:
        self.book.current = region.first.name
        return torch.autograd.graph.saved_tensors_hooks(self.book.pack, _unpack)

    def run_one(self, n: fx.Node) -> Any:
        self.book.current = n.name
        hooks = contextlib.nullcontext() if self.checkpointed else torch.autograd.graph.saved_tensors_hooks(self.book.pack, _unpack)
        try:
            with hooks:
                out = super().run_one(n)
        except (FxmemError, SymbolicUnsupported, KeyboardInterrupt):
            raise
        except Exception as e:
            raise node_error(n, self.env, (self.book.batch_symbol, self.book.seq_symbol), self.model_label, e) from e
        if n.op != "output":
            self.book.claim(out, n.name)
            self.infos.append(_node_info(n, out, self.book))
        for t in self.cached() if self.checkpointed else ():  # See Note [What a selective checkpoint keeps]
            self.book.pack(t)
        return out


def node_fqn(n: fx.Node) -> str:
    """The module path a node belongs to: its own target for call_module, else the innermost module."""
    if n.op == "call_module":
        return str(n.target)
    stack = n.meta.get("nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1][0]
        return str(path)
    return ""


def _target_name(n: fx.Node, gm: fx.GraphModule) -> str:
    if n.op == "call_module":
        return type(gm.get_submodule(str(n.target))).__name__
    if n.op == "call_function":
        return str(getattr(n.target, "_opname", None) or getattr(n.target, "__name__", n.target))
    return str(n.target)


def _node_info(n: fx.Node, out: object, book: _Book) -> NodeInfo:
    gm = n.graph.owning_module
    label = lambda d: label_dim(d, book.batch_symbol, book.seq_symbol)
    shape = tuple(label(d) for d in out.shape) if isinstance(out, torch.Tensor) else None
    return NodeInfo(n.name, n.op, _target_name(n, gm) if gm is not None else str(n.target), node_fqn(n), shape)


def node_error(n: fx.Node, env: Mapping[fx.Node, Any], symbols: tuple[Any, Any], model: str, e: Exception) -> Exception:
    """A CaptureError naming the node, its module, source line and input shapes (B and S written as such).

    ``env`` holds the values computed so far; ``symbols`` are the pass's (B, S) sympy symbols, None
    where the axis is concrete. In a symbolic pass the failure may be the symbolic sizes' fault, so it
    is raised as SymbolicUnsupported carrying that CaptureError: if the concrete passes fail at the
    same node, the caller raises it, with shapes that show which axis is the batch.
    """
    float_ids = _float_ids_error(n, env, symbols, model)
    if float_ids is not None:  # a dtype's fault too, the same at every B
        return float_ids
    mismatch = e if isinstance(e, DtypeMismatch) else DtypeMismatch.from_torch(e)
    if mismatch is not None:  # the dtypes' fault, not the symbolic sizes': the same at every B
        return dtype_error(n, model, mismatch)
    label = lambda d: label_dim(d, *symbols)
    args = [env[a] for a in n.all_input_nodes if a in env]
    shapes = ["(" + ", ".join(str(label(d)) for d in a.shape) + ")" for a in args if isinstance(a, torch.Tensor)]
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300].rstrip(".")
    for symbol, name in zip(symbols, ("B", "S")):
        if symbol is not None:  # torch's text names ShapeEnv symbols (s44); the user knows them as B and S
            first = re.sub(rf"\b{symbol}\b", name, first)
    error = CaptureError(
        f"model '{model}': node '{n.name}' ({n.format_node()}) in module '{node_fqn(n) or '(top level)'}'"
        f"{_source_line(n)} failed on input shapes {', '.join(shapes) or '(none)'}: "
        f"{type(e).__name__}: {first}. Check that the --input shapes match what this layer expects."
    )
    if any(symbol is not None for symbol in symbols):
        error.__cause__ = e  # never raised here, but what caused it is read later (fxmem/parallel/tensor.py)
        return SymbolicUnsupported(f"{n.name}: {first}", node=n.name, error=error)
    error.node = n.name  # type: ignore[attr-defined]
    return error


def dtype_error(n: fx.Node, model: str, e: DtypeMismatch) -> CaptureError:
    """The CaptureError for operands a real kernel refuses (Note [Operand dtypes] in engine/dispatch.py).

    Names the layer and the dtypes, and the way out: the usual cause is an --input dtype that differs
    from the weights', where the user believed --param-dtype changed the weights the step computes with.
    """
    dtypes = " and ".join(dtype_name(d) for d in e.dtypes)
    weights = _weight_dtype(n)
    held = f"the model's weights are {dtype_name(weights)} in this step" if weights is not None else "the model's weights keep their dtypes"
    match = f"give --input in {dtype_name(weights)}" if weights is not None else "give --input in the weights' dtype"
    error = CaptureError(
        f"model '{model}': node '{n.name}' in module '{node_fqn(n) or '(top level)'}'{_source_line(n)} calls {e.op} on "
        f"operands of two dtypes, {dtypes} ({e.describe()}), which torch refuses outside autocast: a real run raises "
        f"here. {held.capitalize()} (--param-dtype only changes how the state is counted; a --precision recipe with "
        f"bf16 weights runs the step with bfloat16 weights): {match}, or run the forward under autocast (--amp bf16 "
        "or --amp fp16), which casts both operands."
    )
    error.node = n.name  # type: ignore[attr-defined]
    return error


def _float_ids_error(n: fx.Node, env: Mapping[fx.Node, Any], symbols: tuple[Any, Any], model: str) -> CaptureError | None:
    """An embedding fed floating-point ids (``--input B,16`` without ``:int64``): a dtype problem, not
    a shape one; None for any other failure."""
    ids = _embedding_ids(n)
    value = env.get(ids) if isinstance(ids, fx.Node) else None
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return None
    dims = ",".join(str(label_dim(d, *symbols)) for d in value.shape)
    given = f" '{ids.name}'" if isinstance(ids, fx.Node) and ids.op == "placeholder" else ""
    error = CaptureError(
        f"model '{model}': Embedding '{node_fqn(n) or '(top level)'}'{_source_line(n)} needs integer ids, but its "
        f"input{given} is {dtype_name(value.dtype)} ({dims}); give the input a dtype: --input {dims}:int64 "
        f"(Python: '{dims}:int64'). An embedding looks its rows up by index, so its input's dtype, not its shape, is wrong."
    )
    error.node = n.name  # type: ignore[attr-defined]
    return error


def _embedding_ids(n: fx.Node) -> object:
    """The ids argument of an embedding lookup (an nn.Embedding leaf, F.embedding or aten.embedding), else None."""
    gm = n.graph.owning_module
    if n.op == "call_module" and gm is not None and isinstance(gm.get_submodule(str(n.target)), (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        return n.args[0] if n.args else n.kwargs.get("input")
    if n.target is torch.nn.functional.embedding:
        return n.args[0] if n.args else n.kwargs.get("input")
    if n.target is torch.ops.aten.embedding.default:  # (weight, indices, ...)
        return n.args[1] if len(n.args) > 1 else None
    return None


def _weight_dtype(n: fx.Node) -> torch.dtype | None:
    """The one dtype of the model's floating parameters in this pass (None: none, or several)."""
    gm = n.graph.owning_module
    dtypes = {p.dtype for p in gm.parameters() if p.is_floating_point()} if gm is not None else set()
    return next(iter(dtypes)) if len(dtypes) == 1 else None


def _source_line(n: fx.Node) -> str:
    """' at file:line' of the innermost frame outside torch in the node's recorded stack trace."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', n.stack_trace or "")
    user = [f"{path}:{line}" for path, line in frames if "/torch/" not in path and "/fxmem/" not in path]
    return f" (source {user[-1]})" if user else ""


def _new_symbol(shape_env: ShapeEnv, name: str, hint: int) -> int | torch.SymInt:
    source = _SymbolSource(name)
    sym = shape_env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC)
    return shape_env.create_symintnode(sym, hint=hint, source=source)


def _run(gm: fx.GraphModule, book: _Book, values: list[Any], loss: Loss, model: str, scopes: ModuleScopes | None = None) -> list[NodeInfo]:
    recorder = _Recorder(gm, book, model, scopes)
    out = recorder.run(*values)
    recorder.infos.append(_run_loss(out, loss, book, model))
    return recorder.infos


def _run_loss(out: object, loss: Loss, book: _Book, model: str) -> NodeInfo:
    output = loss.select(out, model)
    book.current = LOSS_NODE
    target = loss.make_target(output)
    if target is not None:
        book.add_input(target)
    with torch.autograd.graph.saved_tensors_hooks(book.pack, _unpack):
        value = loss.compute(output, target)
    return _loss_ran(book, value, target, loss)


def _loss_ran(book: _Book, value: object, target: object, loss: Loss) -> NodeInfo:
    """What the loss returned is its own; its line among the nodes."""
    book.claim((value, target), LOSS_NODE)
    return NodeInfo(LOSS_NODE, "loss", loss.name, "(loss)", ())


Sharding = Callable[[fx.GraphModule, FakeTensorMode], AbstractContextManager[tuple[fx.GraphModule, ModuleScopes | None]]]
"""A pass's sharding engine: the graph module (state already fake) to the copy one rank runs and the
modules whose hooks it calls, for the length of the pass (fxmem/parallel: ``one_rank``)."""


def capture_saved(
    gm: fx.GraphModule,
    specs: Sequence[InputSpec],
    *,
    loss: Loss,
    batch: int | None,
    rules: Mapping[str, OpRule],
    model: str = "model",
    seq: int | None = None,
    strict: bool = False,
    kernels: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    state_dtype: torch.dtype | None = None,
    layouts: Mapping[str, LayoutRule] | None = None,
    sharded: Sharding | None = None,
) -> Capture:
    """Run ``gm`` on fake tensors at a concrete ``batch``, or with a symbolic B when ``batch`` is None.

    Inputs with a sequence axis S get ``seq``, or one symbolic S when ``seq`` is None. The forward and
    the loss run inside ``kernels()``: the target device's kernel choices and autocast policy
    (``TrainingSetup.kernels``). ``state_dtype`` holds the floating parameters and buffers in that dtype
    (a precision recipe's, as ``model.to(dtype)`` would), without touching the model. ``sharded``
    runs the pass on one rank of a sharding engine instead (fxmem/parallel: ``one_rank``).
    Raises SymbolicUnsupported or BatchSpecialized when a symbolic pass cannot stand for every B (and S).
    """
    fake = fake_batch(specs, batch, seq, state_dtype)
    rank = sharded(gm, fake.mode) if sharded is not None else contextlib.nullcontext((gm, None))
    with swapped_state(gm, fake.state_copy), quiet_fake_tensor_log(), rank as (gm, scopes):
        book = _new_book(gm, tensors_of(specs, fake.inputs), fake.symbols.get("B"), fake.symbols.get("S"))
        book.strict = strict
        values = bind_inputs(gm, specs, fake.inputs, model)
        with fake.mode, OpRuleMode(rules, book.overrides, layouts), kernels():
            infos = _run(gm, book, values, loss, model, scopes)
    fake.check_symbols()
    return _captured(book, infos, batch)


def _captured(book: _Book, infos: Sequence[NodeInfo], batch: int | None) -> Capture:
    """The pass's record; SymbolicUnsupported where its bytes are no polynomial in B (and S)."""
    try:
        saved = book.saved_tensors()
    except ValueError as e:  # bytes like floor(B/3): not a polynomial, so concrete passes take over
        raise SymbolicUnsupported(str(e)) from e
    unsupported = tuple(Unsupported(node, _fqn_of(infos, node), why) for node, why in book.unsupported)
    return Capture(batch, tuple(infos), saved, book.input_bytes(), unsupported)


@dataclass
class FakeBatch:
    """A FakeTensorMode with its ShapeEnv, and the fake input batch: B (and S) symbolic where asked."""

    mode: FakeTensorMode
    shape_env: ShapeEnv
    inputs: list[torch.Tensor]
    symbols: dict[str, Any]
    """Sympy symbols by name ("B", "S") for the axes that are symbolic in this pass."""
    state_dtype: torch.dtype | None = None
    """The dtype floating parameters and buffers take in this pass (None: their own)."""

    def state_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A fake copy of a parameter or buffer, static in every axis (for ``swapped_state``); a torchao
        ``NF4Tensor`` keeps its inner tensors (Note [torchao's NF4 linear in a graph] in fxmem/rules/nf4_ops.py)."""
        quantized = fake_quantized(self.mode, t)
        if quantized is not None:
            return quantized
        with self.mode:
            return fake_like(t, self.state_dtype if t.is_floating_point() else None)

    def check_symbols(self) -> None:
        """Raise BatchSpecialized when the model guarded a symbol down to a constant during the pass."""
        for name, symbol in self.symbols.items():
            if self.shape_env.replacements.get(symbol) is not None:
                raise BatchSpecialized(f"the model fixed {name} to {self.shape_env.replacements[symbol]}")


def fake_batch(specs: Sequence[InputSpec], batch: int | None, seq: int | None, state_dtype: torch.dtype | None = None) -> FakeBatch:
    """Fake inputs at a concrete ``batch``, or with one symbol B for every batch axis when it is None;
    the same for the sequence axis S (``seq``) where an input has one. ``state_dtype``: see ``FakeBatch``."""
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    with mode:
        b = _new_symbol(shape_env, "B", _BATCH_HINT) if batch is None else batch
        s = _new_symbol(shape_env, "S", _SEQ_HINT) if seq is None and has_seq(specs) else seq
        inputs = [make_input(spec, b, s) for spec in specs]
    symbols = {name: v.node.expr for name, v in (("B", b), ("S", s)) if isinstance(v, torch.SymInt)}
    return FakeBatch(mode, shape_env, inputs, symbols, state_dtype)


@contextlib.contextmanager
def quiet_fake_tensor_log() -> Iterator[None]:
    """FakeTensorMode logs a full traceback for a kernel that fails on fake inputs. fxmem handles each
    such failure itself (a fallback to concrete passes, or a CaptureError naming the node), so the log
    would only bury the outcome; it is silenced for the length of a fake pass."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _fqn_of(infos: Sequence[NodeInfo], node: str) -> str:
    return next((i.fqn for i in infos if i.name == node), "")


def record_real(
    gm: fx.GraphModule, specs: Sequence[InputSpec], *, loss: Loss, batch: int, model: str = "model", seq: int | None = None
) -> Capture:
    """The same recorder on real CPU tensors: the measurement. ``gm`` must hold real CPU weights."""
    inputs = [make_input(s, batch, seq) for s in specs]
    book = _new_book(gm, tensors_of(specs, inputs), None, None)
    infos = _run(gm, book, bind_inputs(gm, specs, inputs, model), loss, model)
    return Capture(batch, tuple(infos), book.saved_tensors(), book.input_bytes(), ())


def _new_book(gm: fx.GraphModule, inputs: Sequence[torch.Tensor], batch_symbol: Any, seq_symbol: Any) -> _Book:
    book = _Book(kinds=state_kinds(gm), batch_symbol=batch_symbol, seq_symbol=seq_symbol)
    for t in inputs:
        book.add_input(t)
    return book
