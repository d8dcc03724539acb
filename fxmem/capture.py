"""Stage 3: run the traced graph node by node and record every tensor autograd saves for backward.

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
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._refs
import torch.fx as fx
from torch._C import DispatchKey
from torch._guards import GuardSource, Source
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fxmem.errors import CaptureError, FxmemError, InputSpecError
from fxmem.inputs import InputSpec, dtype_name, has_seq, make_tensor
from fxmem.losses import Loss
from fxmem.results import Capture, Kind, NodeInfo, SavedTensor, Unsupported
from fxmem.symbolic import ByteExpr, DataDependentBytes, label_dim, to_byte_expr

__all__ = ["BatchSpecialized", "OpRule", "SymbolicUnsupported", "capture_saved", "node_fqn", "record_real"]

_BATCH_HINT = 8
"""The value ShapeEnv assumes for B when a kernel asks; any value above 1 avoids 0/1 specialization."""
_SEQ_HINT = 24
"""The same for S; unlike B's, so that no comparison of B with S is decided by equal hints."""

LOSS_NODE = "loss"

OpRule = Callable[[Sequence[Any], Mapping[str, Any], Any], Mapping[int, object]]
"""An op rule gets an aten op's (args, kwargs, output) and returns {output index: true nbytes}
for outputs whose fake storage under-reports what the real kernel allocates."""


class SymbolicUnsupported(Exception):
    """The symbolic pass could not run (a kernel needs concrete sizes); retry with concrete batches."""


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

    kinds: dict[StorageWeakRef, Kind]
    batch_symbol: Any = None
    seq_symbol: Any = None
    strict: bool = False
    current: str = ""
    owner: dict[StorageWeakRef, str] = field(default_factory=dict)
    saved: dict[StorageWeakRef, _Entry] = field(default_factory=dict)
    overrides: dict[StorageWeakRef, object] = field(default_factory=dict)
    unsupported: list[tuple[str, str]] = field(default_factory=list)
    alive: list[object] = field(default_factory=list)
    inputs: dict[StorageWeakRef, object] = field(default_factory=dict)

    def add_input(self, t: torch.Tensor) -> None:
        """Register an input batch or loss-target storage: classified as INPUT, counted on its own line."""
        key = StorageWeakRef(t.untyped_storage())
        self.kinds[key] = Kind.INPUT
        self.inputs[key] = t.untyped_storage().nbytes()
        self.alive.append(t)

    def input_bytes(self) -> ByteExpr:
        return ByteExpr.total(to_byte_expr(n, self.batch_symbol, self.seq_symbol) for n in self.inputs.values())

    def claim(self, value: object, node: str) -> None:
        """Charge every storage first seen in ``value`` to ``node``. See Note [Counting storages once]."""
        self.alive.append(value)
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor) and _has_storage(t):
                self.owner.setdefault(StorageWeakRef(t.untyped_storage()), node)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not _has_storage(t):
            self.unsupported.append((self.current, f"saved a {t.layout} tensor without a plain storage"))
            return t
        key = StorageWeakRef(t.untyped_storage())
        self.alive.append(t)
        if key in self.saved:
            if self.current not in self.saved[key].saved_by:
                self.saved[key].saved_by.append(self.current)
            return t
        owner = self.owner.setdefault(key, self.current)
        nbytes = self.overrides.get(key, t.untyped_storage().nbytes())
        shape = tuple(label_dim(d, self.batch_symbol, self.seq_symbol) for d in t.shape)
        kind = self.kinds.get(key, Kind.ACTIVATION)
        self.saved[key] = _Entry(owner, [self.current], shape, dtype_name(t.dtype), nbytes, kind)
        return t

    def saved_tensors(self) -> tuple[SavedTensor, ...]:
        return tuple(
            SavedTensor(i, e.node, tuple(e.saved_by), e.shape, e.dtype, self._bytes(e), e.kind)
            for i, e in enumerate(self.saved.values())
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


def _has_storage(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_nested


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class _Recorder(fx.Interpreter):
    """An fx Interpreter that installs the saved-tensor hooks around each node it runs."""

    def __init__(self, gm: fx.GraphModule, book: _Book, model_name: str) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.book = book
        self.model_name = model_name
        self.infos: list[NodeInfo] = []

    def run_node(self, n: fx.Node) -> Any:
        self.book.current = n.name
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.book.pack, _unpack):
                out = super().run_node(n)
        except (FxmemError, SymbolicUnsupported, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 - every kernel error is reported at its node
            raise _node_error(n, self, e) from e
        if n.op != "output":
            self.book.claim(out, n.name)
            self.infos.append(_node_info(n, out, self.book))
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
    label = lambda d: label_dim(d, book.batch_symbol, book.seq_symbol)  # noqa: E731
    shape = tuple(label(d) for d in out.shape) if isinstance(out, torch.Tensor) else None
    return NodeInfo(n.name, n.op, _target_name(n, gm) if gm is not None else str(n.target), node_fqn(n), shape)


_SYMBOLIC_MESSAGES = ("symbolic sizes", "symbolic shape", "SymIntArrayRef expected to contain only concrete", "data-dependent", "GuardOnDataDependent")


def _node_error(n: fx.Node, rec: _Recorder, e: Exception) -> Exception:
    if rec.book.batch_symbol is not None or rec.book.seq_symbol is not None:
        return SymbolicUnsupported(f"{n.name}: {e}")
    args = [rec.env[a] for a in n.all_input_nodes if a in rec.env]
    shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    return CaptureError(
        f"model '{rec.model_name}': node '{n.name}' ({n.format_node()}) in module '{node_fqn(n) or '(top level)'}'"
        f"{_source_line(n)} failed on input shapes {', '.join(map(str, shapes)) or '(none)'}: "
        f"{type(e).__name__}: {first}. Check that the --input shapes match what this layer expects."
    )


def _source_line(n: fx.Node) -> str:
    """' at file:line' of the innermost frame outside torch in the node's recorded stack trace."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', n.stack_trace or "")
    user = [f"{path}:{line}" for path, line in frames if "/torch/" not in path and "/fxmem/" not in path]
    return f" (source {user[-1]})" if user else ""


def _constant_pad_nd(x: torch.Tensor, pad: Sequence[Any], value: float = 0.0) -> Any:
    """constant_pad_nd through its Python reference, which keeps SymInt sizes symbolic."""
    return torch._refs.constant_pad_nd(x, pad, value)


_SYMBOLIC_REWRITES: dict[Any, Callable[..., Any]] = {torch.ops.aten.constant_pad_nd.default: _constant_pad_nd}
"""Ops whose fake kernel reads concrete sizes, so that it would fix B to its hint (HF pads labels with
constant_pad_nd), computed instead by torch's own SymInt-safe Python reference. Both allocate one
output of the padded size, so what autograd saves is unchanged."""


def _eager_decomposes(func: Any) -> bool:
    """True for an aten op that eager CPU runs as its C++ CompositeImplicitAutograd decomposition.

    Not ``func._can_decompose()``: that also holds for ops with a kernel of their own and a Python
    decomposition (upsample_nearest1d), which eager never uses and which can lay out its output
    differently (see test_interpolate_keeps_the_cpu_kernel_layout in tests/test_fuzz_regressions.py).
    Ops the dispatcher has no kernel for at all (aten.size.default, met in interpolate's symbolic
    pass) are run as they are.
    """
    name = func.name()
    return (
        func.namespace == "aten"
        and torch._C._dispatch_has_kernel(name)
        and torch._C._dispatch_has_kernel_for_dispatch_key(name, DispatchKey.CompositeImplicitAutograd)
    )


class _RuleMode(TorchDispatchMode):
    """Applies op rules: records the true size of storages whose fake kernels under-report them."""

    def __init__(self, rules: Mapping[str, OpRule], book: _Book) -> None:
        super().__init__()
        self.rules = rules
        self.book = book

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _SYMBOLIC_REWRITES:
            rewritten = _SYMBOLIC_REWRITES[func](*args, **kwargs)
            if rewritten is not NotImplemented:
                return rewritten
        if _eager_decomposes(func):
            # A Python mode receives some composite ops (aten.pad) whole; decomposing them here, with
            # the C++ decomposition eager uses, keeps SymInt sizes symbolic (as make_fx's mode does).
            return func._op_dk(DispatchKey.CompositeImplicitAutograd, *args, **kwargs)
        out = func(*args, **kwargs)
        rule = self.rules.get(str(func.overloadpacket))
        if rule is not None:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for index, nbytes in rule(args, kwargs, out).items():
                self.book.overrides[StorageWeakRef(outs[index].untyped_storage())] = nbytes
        return out


def _placeholder_values(gm: fx.GraphModule, specs: Sequence[InputSpec], tensors: Sequence[torch.Tensor], model: str) -> list[Any]:
    """Line up input tensors with the graph's placeholders: positional first, then by keyword name."""
    positional = [t for s, t in zip(specs, tensors) if s.name is None]
    keyword = {s.name: t for s, t in zip(specs, tensors) if s.name is not None}
    values: list[Any] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = [str(p.target).lstrip("*") for p in placeholders]
    unknown = sorted(set(keyword) - set(names))
    if unknown or len(positional) > len(placeholders):
        raise InputSpecError(
            f"model '{model}' takes inputs ({', '.join(names)}), but was given "
            f"{len(positional)} positional input(s) and keyword(s) {unknown or sorted(keyword)}; "
            "match --input to the forward() signature."
        )
    for i, (p, name) in enumerate(zip(placeholders, names)):
        if i < len(positional):
            values.append(positional[i])
        elif name in keyword:
            values.append(keyword[name])
        elif p.args:
            values.append(p.args[0])
        else:
            raise InputSpecError(
                f"model '{model}' needs input '{name}' of forward(), which was not given; add an "
                f"--input for it (e.g. --input {name}=B,...)."
            )
    return values


@contextlib.contextmanager
def _swapped_state(gm: fx.GraphModule, replace: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Temporarily replace every parameter and buffer (tied ones by the same object), then restore."""
    originals: list[tuple[dict[str, Any], str, Any]] = []
    cache: dict[int, torch.Tensor] = {}
    for module in gm.modules():
        for slots in (module._parameters, module._buffers):
            for name, value in slots.items():
                if value is None:
                    continue
                originals.append((slots, name, value))
                if id(value) not in cache:
                    cache[id(value)] = replace(value)
                slots[name] = cache[id(value)]
    try:
        yield
    finally:
        for slots, name, value in originals:
            slots[name] = value


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    return torch.nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else fake


def _state_kinds(gm: fx.GraphModule) -> dict[StorageWeakRef, Kind]:
    kinds = {StorageWeakRef(b.untyped_storage()): Kind.BUFFER for b in gm.buffers()}
    kinds.update({StorageWeakRef(p.untyped_storage()): Kind.PARAM for p in gm.parameters()})
    return kinds


def _new_symbol(shape_env: ShapeEnv, name: str, hint: int) -> torch.SymInt:
    source = _SymbolSource(name)
    sym = shape_env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC)
    return shape_env.create_symintnode(sym, hint=hint, source=source)


def _run(gm: fx.GraphModule, book: _Book, values: list[Any], loss: Loss, model: str) -> list[NodeInfo]:
    recorder = _Recorder(gm, book, model)
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
    book.claim((value, target), LOSS_NODE)
    return NodeInfo(LOSS_NODE, "loss", loss.name, "(loss)", ())


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
) -> Capture:
    """Run ``gm`` on fake tensors at a concrete ``batch``, or with a symbolic B when ``batch`` is None.

    Inputs with a sequence axis S get ``seq``, or one symbolic S when ``seq`` is None.
    Raises SymbolicUnsupported or BatchSpecialized when a symbolic pass cannot stand for every B (and S).
    """
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    with mode:
        b = _new_symbol(shape_env, "B", _BATCH_HINT) if batch is None else batch
        s = _new_symbol(shape_env, "S", _SEQ_HINT) if seq is None and has_seq(specs) else seq
        inputs = [make_tensor(spec, b, s) for spec in specs]
    symbols = {name: v.node.expr for name, v in (("B", b), ("S", s)) if isinstance(v, torch.SymInt)}
    with _swapped_state(gm, lambda t: _under(mode, _fake_like, t)):
        book = _new_book(gm, inputs, symbols.get("B"), symbols.get("S"))
        book.strict = strict
        values = _placeholder_values(gm, specs, inputs, model)
        with mode, _RuleMode(rules, book):
            infos = _run(gm, book, values, loss, model)
    for name, symbol in symbols.items():
        if shape_env.replacements.get(symbol) is not None:
            raise BatchSpecialized(f"the model fixed {name} to {shape_env.replacements[symbol]}")
    try:
        saved = book.saved_tensors()
    except ValueError as e:  # bytes like floor(B/3): not a polynomial, so concrete passes take over
        raise SymbolicUnsupported(str(e)) from e
    unsupported = tuple(Unsupported(node, _fqn_of(infos, node), why) for node, why in book.unsupported)
    return Capture(batch, tuple(infos), saved, book.input_bytes(), unsupported)


def _under(mode: FakeTensorMode, fn: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    with mode:
        return fn(t)


def _fqn_of(infos: Sequence[NodeInfo], node: str) -> str:
    return next((i.fqn for i in infos if i.name == node), "")


def record_real(
    gm: fx.GraphModule, specs: Sequence[InputSpec], *, loss: Loss, batch: int, model: str = "model", seq: int | None = None
) -> Capture:
    """The same recorder on real CPU tensors: the measurement. ``gm`` must hold real CPU weights."""
    inputs = [make_tensor(s, batch, seq) for s in specs]
    book = _new_book(gm, inputs, None, None)
    infos = _run(gm, book, _placeholder_values(gm, specs, inputs, model), loss, model)
    return Capture(batch, tuple(infos), book.saved_tensors(), book.input_bytes(), ())


def _new_book(gm: fx.GraphModule, inputs: Sequence[torch.Tensor], batch_symbol: Any, seq_symbol: Any) -> _Book:
    book = _Book(kinds=_state_kinds(gm), batch_symbol=batch_symbol, seq_symbol=seq_symbol)
    for t in inputs:
        book.add_input(t)
    return book
