"""Sizes that depend on routing: how many rows a mixture-of-experts layer sends each expert.

Note [Routed sizes]
    A mixture-of-experts layer written as an eager loop over its experts (transformers' older Mixtral
    and Qwen-MoE eager paths, DeepSeek's and many research codebases) picks each expert's tokens with
    ``torch.where(mask[e])``, ``mask = one_hot(top_k_index, E).permute(2, 1, 0)``, or with
    ``(top_k_index == e).nonzero()``. On fake tensors each count is an unbacked SymInt ``u_e``: the
    ShapeEnv knows nothing of its value, so the tensors an expert saves have sizes like ``512*u0``, and
    ``if idx.numel() == 0: continue`` stops torch.export (a guard on data-dependent ``Eq(u0, 0)``).

    Their sum is not unknown. ``one_hot`` puts exactly one nonzero in each of ``numel(top_k_index)``
    rows, so the counts of the E class slices add up to ``numel(top_k_index)`` (``N * k`` for N tokens
    and top-k routing, whatever the router chose); likewise ``top_k_index == e`` over ``e < E``, since
    every index lies in ``[0, E)`` (``torch.topk`` over an axis of E). Every token visits exactly k
    experts, so where every expert saves the same bytes per token (identical experts), the saved bytes
    of the layer are ``per_token * N * k`` under any routing: exact, not an estimate. Measured: the real
    saved bytes and step peak of such a model are identical across input seeds, even when an expert
    receives no token (tests/test_routing.py).

    ``RoutedSizes`` (a TorchFunctionMode, on during torch.export and every fake pass) follows those
    tensors from ``one_hot`` / ``topk`` through ``permute``, ``transpose``, integer indexing, ``select``
    and ``== e``, and where ``torch.where``, ``nonzero`` or boolean indexing turns one into a
    data-dependent size, it tells the ShapeEnv the count an even split gives (``torch._check(u == T/E)``;
    the last class takes the remainder where E does not divide T). The ShapeEnv then replaces ``u_e``
    everywhere, so the bytes are polynomials in B again and guards such as ``u_e == 0`` are decided. A
    mask over all classes at once (``torch.where(mask)``) is given its exact count ``T``, no assumption.

    transformers' eager experts loop (``_experts_implementation="eager"``: Mixtral, Qwen-MoE, ...) first asks
    which experts any row went to, ``expert_hit = (mask.sum(dim=(-1, -2)) > 0).nonzero()``, and loops over
    them in Python (``for expert_idx in expert_hit: expert_idx = expert_idx[0]``), which no trace can do with
    a count the data decides. Under an even split every expert that top-k chooses among is hit (when there
    are at least as many rows as experts), so while exporting that ``nonzero`` returns those indices as
    Python integers and the loop unrolls; ``one_hot``'s extra class (``num_classes=num_experts + 1``, which no
    top-k index names) receives no row, exactly.

    What stays an assumption, and is said in the report: an even split. The saved bytes do not depend on
    it when the experts are alike; the step's peak does not where it falls outside the expert loop
    (backward's start, the optimizer step), which is where it fell in every routed model measured. Two
    unlike experts make the figures those of an even split, which the note says.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["Routed", "RoutedSizes", "UnevenSplit", "routed_sizes_seen", "routing_ledger"]


class UnevenSplit(ValueError):
    """A symbolic pass whose routed counts cannot be polynomials in B (Note [Routed sizes])."""


@dataclass(frozen=True)
class _Classes:
    """A tensor whose nonzeros along ``dim`` partition ``total`` routed rows among ``classes`` classes
    (a one-hot mask), or whose values each name one of ``classes`` (top-k indices: ``dim`` is None).
    ``routed`` classes receive rows: fewer than ``classes`` where ``one_hot`` was given more classes than
    the top-k chose among (transformers' ``num_classes=num_experts + 1``, a class no index names)."""

    total: Any
    classes: int
    dim: int | None
    routed: int = 0

    @property
    def receiving(self) -> int:
        return self.routed or self.classes


@dataclass(frozen=True)
class _PerClass:
    """Per class, how many of ``total`` rows are routed to it (a one-hot mask summed over every axis but the
    class's), or, ``hit``, whether any is (those counts ``> 0``): under an even split, the first ``routed``."""

    routed: int
    total: Any
    hit: bool = False


@dataclass(frozen=True)
class _Share:
    """One class's slice of a ``_Classes`` tensor: its nonzeros are the rows routed to class ``index``,
    one of ``classes`` that receive rows (an index beyond them receives none)."""

    total: Any
    classes: int
    index: int


@dataclass(frozen=True)
class Routed:
    """A data-dependent count taken as an even split (Note [Routed sizes]), as the report says it."""

    total: str
    classes: int
    share: str

    def describe(self) -> str:
        symbolic = not self.total.isdigit()  # concrete passes' totals are one batch's: the words then stand alone
        total, share = (f" ({self.total})", f" ({self.share} each)") if symbolic else ("", "")
        return (
            f"the rows routed to each of {self.classes} experts (torch.where / nonzero on a top-k routing mask) depend on "
            f"the data; their sum{total} does not, and they are taken as an even split{share}: the saved bytes are exact "
            "where the experts are alike, the step's peak is that of an even routing"
        )


_LEDGER: contextvars.ContextVar[dict[int, Routed] | None] = contextvars.ContextVar("fxmem_routed", default=None)


@contextlib.contextmanager
def routing_ledger() -> Iterator[dict[int, Routed]]:
    """Collect the even-split assumptions the passes inside make, one per number of experts."""
    seen: dict[int, Routed] = {}
    token = _LEDGER.set(seen)
    try:
        yield seen
    finally:
        _LEDGER.reset(token)


def routed_sizes_seen(seen: Mapping[int, Routed]) -> tuple[str, ...]:
    """The ledger's assumptions in words, for the report."""
    return tuple(r.describe() for r in seen.values())


_SOURCES = frozenset({"one_hot", "topk"})
_RESHAPES = frozenset({"view", "reshape", "flatten", "contiguous", "clone", "squeeze", "unsqueeze"})
_VIEWS = frozenset(
    {"permute", "transpose", "swapaxes", "select", "__getitem__", "eq", "__eq__", "to", "bool", "int", "long", "sum", "greater", "gt", "__gt__", "ne", "__ne__"}
    | _RESHAPES
)
_COUNTS = frozenset({"where", "nonzero", "argwhere"})
"""Ops whose output size is the input's count of nonzeros (indexing with a mask: ``_masked``)."""


def _name(func: Any) -> str:
    """A function's name for ``torch.where`` and ``aten.where.default`` alike."""
    packet = getattr(func, "overloadpacket", None)
    return getattr(packet if packet is not None else func, "__name__", "")


class RoutedSizes(TorchFunctionMode):
    """Follows routing masks to the counts they make. See Note [Routed sizes]."""

    def __init__(self, *, record: bool = True) -> None:
        super().__init__()
        self.tags: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.record = record
        """Whether the ledger hears of the assumptions (not while exporting, whose symbols are named otherwise)."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        hits = self.tags.get(args[0]) if args and isinstance(args[0], torch.Tensor) and self.tags else None
        if isinstance(hits, _PerClass) and hits.hit and name in ("nonzero", "argwhere") and not kwargs.get("as_tuple"):
            if _every_class_fed(hits, self.record):
                return _every_class_hit(hits)
        out = func(*args, **kwargs)
        if not self.tags and name not in _SOURCES:  # no routing tensor yet: nothing to follow (most models, always)
            return out
        if name in _SOURCES:
            self._made(name, args, out)
        elif name in ("__getitem__", "index") and len(args) > 1 and self._masked(args[1], out):
            pass
        elif args and isinstance(args[0], torch.Tensor) and args[0] in self.tags:
            tag = self.tags[args[0]]
            if name in _COUNTS:
                self._counted(name, tag, args, kwargs, out)
            if name in _VIEWS and isinstance(out, torch.Tensor) and out not in self.tags:
                follow = _followed(name, tag, args, kwargs, out)
                if follow is not None:
                    self.tags[out] = follow
        return out

    def _made(self, name: str, args: Sequence[Any], out: Any) -> None:
        if name == "one_hot" and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
            chosen = self.tags.get(args[0])
            routed = min(chosen.classes, int(out.shape[-1])) if isinstance(chosen, _Classes) and chosen.dim is None else 0
            self.tags[out] = _Classes(args[0].numel(), int(out.shape[-1]), out.dim() - 1, routed)
        elif name == "topk" and isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(args[0], torch.Tensor):
            dim = args[2] if len(args) > 2 else -1
            indices = out[1]
            self.tags[indices] = _Classes(indices.numel(), int(args[0].shape[dim]), None)

    def _masked(self, indexer: Any, out: Any) -> bool:
        """``x[mask]`` with a class's mask: its rows are that class's count."""
        masks = indexer if isinstance(indexer, (tuple, list)) else (indexer,)
        kept = 0  # output axes before the mask's rows: those the earlier indexers keep (``:`` and None)
        for mask in masks:
            if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and isinstance(self.tags.get(mask), _Share):
                return isinstance(out, torch.Tensor) and out.dim() > kept and _tell(out.shape[kept], self.tags[mask], self.record)
            kept += mask is None or isinstance(mask, slice)
        return False

    def _counted(self, name: str, tag: _Tag, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> None:
        """A data-dependent count made from a routing mask: told to the ShapeEnv (Note [Routed sizes])."""
        if name == "where" and (len(args) > 1 or kwargs):
            return  # torch.where(cond, a, b): no data-dependent size
        first = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(first, torch.Tensor) or first.dim() == 0:
            return
        if isinstance(tag, _Share):
            _tell(first.shape[0], tag, self.record)
        elif isinstance(tag, _Classes) and tag.dim is not None:
            _told(first.shape[0], tag.total)  # a mask over every class holds exactly ``total`` nonzeros: no assumption


def _followed(name: str, tag: _Tag, args: Sequence[Any], kwargs: Mapping[str, Any], out: torch.Tensor) -> _Tag | None:
    """The tag of a view or comparison of a tagged tensor, or None where the op loses track."""
    x = args[0]
    if isinstance(tag, _PerClass):
        other = args[1] if len(args) > 1 else kwargs.get("other")
        hit = name in ("greater", "gt", "__gt__", "ne", "__ne__") and isinstance(other, int) and other == 0
        return replace(tag, hit=True) if hit and not tag.hit else None
    if isinstance(tag, _Share):
        return tag if name in ("to", "bool", "int", "long") else None
    if name in ("to", "bool", "int", "long"):
        return tag
    if tag.dim is None:  # top-k indices: ``indices == e`` is class e's mask; any view of them holds the same values
        if name in _RESHAPES:
            return tag
        other = args[1] if len(args) > 1 else None
        if name in ("eq", "__eq__") and isinstance(other, int) and not isinstance(other, bool) and 0 <= other < tag.classes:
            return _Share(tag.total, tag.classes, other)
        return None
    if name == "sum" and _sums_all_but(tag.dim, x, args, kwargs):
        return _PerClass(tag.receiving, tag.total)
    if name == "permute":
        dims = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        dims = [int(d) % x.dim() for d in dims]
        return replace(tag, dim=dims.index(tag.dim))
    if name in ("transpose", "swapaxes") and len(args) == 3:
        a, b = (int(d) % x.dim() for d in args[1:3])
        return replace(tag, dim={a: b, b: a}.get(tag.dim, tag.dim))
    index = _class_index(name, tag, args, x)
    return _Share(tag.total, tag.receiving, index) if index is not None else None


def _class_index(name: str, tag: _Classes, args: Sequence[Any], x: torch.Tensor) -> int | None:
    """The class a ``mask[e]`` or ``mask.select(dim, e)`` takes, where it indexes the class axis."""
    index = args[1] if name == "__getitem__" and tag.dim == 0 else None
    if isinstance(index, torch.Tensor) and _real_integer(index):  # an expert index from the loop over every class hit
        index = int(index)
    if isinstance(index, int) and not isinstance(index, bool):
        return index % tag.classes
    if name == "select" and len(args) == 3 and int(args[1]) % x.dim() == tag.dim and isinstance(args[2], int):
        return args[2] % tag.classes
    return None


def _tell(count: Any, share: _Share, record: bool) -> bool:
    """Class ``share.index``'s count is its part of an even split (the last class the remainder); a class
    beyond those the top-k chooses among receives no row, exactly."""
    if share.index >= share.classes:
        return _told(count, 0)
    part = share.total // share.classes
    expected = share.total - part * (share.classes - 1) if share.index == share.classes - 1 else part
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    least = 1 if statically_known_true(share.total >= share.classes) else 0  # an even split leaves no class empty
    if _told(count, expected, least, strict=record):
        ledger = _LEDGER.get()
        if ledger is not None and record:
            routed = Routed(_spoken(share.total), share.classes, _spoken(part))
            known = ledger.get(share.classes)
            if known is None or (known.total.isdigit() and not routed.total.isdigit()):  # the symbolic pass's words win
                ledger[share.classes] = routed
        return True
    return False


def _told(count: Any, expected: Any, least: int = 0, strict: bool = False) -> bool:
    """``torch._check(count == expected)`` for an unbacked count; True where it was one.

    Where the ShapeEnv keeps the equality as a runtime assert rather than a replacement (a floor, when the
    classes do not divide the rows), ``strict`` raises ``UnevenSplit``: a symbolic pass then gives way to
    concrete ones, whose counts are integers. The unbacked symbol's range is first widened to ``[0, int_oo]``: its default upper bound
    (``sys.maxsize - 1``) is below what ``expected``'s bound rounds to, and the ShapeEnv then refuses the
    replacement (``tgt_bound ... not a subset of src_bound``, symbolic_shapes.py ``_set_replacement``); and it is
    no longer size-like, whose size-oblivious bound (>= 2) refuses a count of 1 there too."""
    if not isinstance(count, torch.SymInt):
        return False
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    from torch.utils._sympy.numbers import int_oo
    from torch.utils._sympy.value_ranges import ValueRanges

    expr = count.node.expr
    if not free_unbacked_symbols(expr) or not expr.is_Symbol:
        return False
    env = count.node.shape_env
    env.var_to_range[expr] = ValueRanges(0, int_oo)
    env.size_like.discard(expr)  # a size-like symbol is taken as >= 2, and a count of 1 would not replace it
    torch._check(count == expected)
    if env.replace(expr) != expr:
        return True
    if strict:
        raise UnevenSplit(f"an even split of {_spoken(expected)} rows is not a polynomial in the batch: each batch is passed on its own")
    # torch.export keeps a count equal to a floor (T - 2*(T//3)) as a runtime assert and no replacement
    # (prefer_deferred_runtime_asserts_over_guards); a lower bound still decides ``count == 0``.
    if least > 0:
        torch._check(count >= least)
    return True


def _spoken(value: Any) -> str:
    """A count as the report writes it: each symbol by its source's name (fxmem's batch symbol is ``B``)."""
    if not isinstance(value, torch.SymInt):
        return str(value)
    import sympy

    env, expr = value.node.shape_env, value.node.expr
    names = {s: sympy.Symbol(env.var_to_sources[s][0].name) for s in expr.free_symbols if env.var_to_sources.get(s)}
    return str(expr.subs(names))


_Tag = _Classes | _Share | _PerClass


def _sums_all_but(dim: int | None, x: torch.Tensor, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether ``x.sum(...)`` reduces every axis but the class axis ``dim`` (and keeps no reduced axis)."""
    dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if dim is None or dims is None or kwargs.get("keepdim") or (len(args) > 2 and args[2]):
        return False
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    return {int(d) % x.dim() for d in dims} == set(range(x.dim())) - {dim}


def _real_integer(t: torch.Tensor) -> bool:
    """A real (not fake) 0-d integer tensor: its value can be read."""
    from torch._subclasses.fake_tensor import is_fake

    return t.dim() == 0 and not t.dtype.is_floating_point and t.dtype != torch.bool and not is_fake(t) and not t.is_meta


def _every_class_fed(hits: _PerClass, record: bool) -> bool:
    """Whether an even split feeds every class (at least as many rows as classes), while exporting: only
    torch.export bakes the returned constant indices into its graph; a fake pass has no use for real ones."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return not record and statically_known_true(hits.total >= hits.routed)


class _ClassesHit(list):  # type: ignore[type-arg]
    """``nonzero``'s (classes, 1) indices as Python integers: a loop over them (``for e in hit: e = e[0]``)
    reads each class as an int, which a fake tensor under torch.export could not give."""

    def tolist(self) -> list[list[int]]:
        return [list(row) for row in self]

    def numel(self) -> int:
        return len(self)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"fxmem follows the experts a routing hit (nonzero of a one-hot mask's counts) in a Python loop over them, "
            f"as transformers' eager experts do; this model uses them as a tensor (.{name}), which no trace of every routing "
            "can do: run its experts with transformers' default grouped_mm (config._experts_implementation), or loop over them"
        )


def _every_class_hit(hits: _PerClass) -> Any:
    """``nonzero`` of which classes were hit, under an even split: every class that receives rows, as
    constants, so a loop over them unrolls in torch.export's graph (transformers' ``for expert_idx in
    expert_hit: expert_idx = expert_idx[0]``)."""
    return _ClassesHit([e] for e in range(hits.routed))
