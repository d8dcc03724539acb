"""FLOPs and bytes moved by each ATen op, from PyTorch's own formulas, on real, fake or symbolic tensors.

The FLOPs come from ``torch.utils.flop_counter.flop_registry`` (matmuls, convolutions, attention),
called the way ``FlopCounterMode`` calls them, so a run under ``FlopTally`` totals exactly what
``FlopCounterMode`` totals, plus the few formulas torch lacks (``EXTRA_FORMULAS``: the grouped matmuls
of mixture-of-experts layers, Note [Grouped matmuls]). Because the formulas are pure functions of
shapes, they work unchanged on SymInt sizes: under ``FakeTensorMode`` with a ShapeEnv the count is a
SymInt in the batch symbol.

Every op lands in one of three states (fvcore's ``jit_handles.py``): it has a formula; it is in
``IGNORED`` because it does no arithmetic (a view, a copy, a fill), with the reason written down; or it
is *missing*, counted in ``FlopTally.missing`` so that a report can list it. Elementwise ops, norms and
softmax are missing by design: torch counts no FLOPs for them, and we never show that as a silent zero.

>>> import torch
>>> with FlopTally() as tally:
...     _ = torch.ones(4, 8) @ torch.ones(8, 2)
>>> tally.total_flops  # 2 * 4 * 8 * 2
128
>>> tally.records[-1]
('aten.mm', OpCost(flops=128, read_bytes=192, written_bytes=32, has_formula=True))

Note [Calling the flop formulas]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``flop_registry`` is keyed by overload packet (``aten.mm``), and each entry is wrapped by
``shape_wrapper``, which maps every tensor in ``(args, kwargs, out_val)`` to its ``.shape`` and passes
the output shape as ``out_shape``. ``FlopCounterMode._count_flops`` therefore calls
``formula(*args, **kwargs, out_val=out)`` with the op's own arguments and output; so do we
(torch/utils/flop_counter.py, ``shape_wrapper`` and ``FlopCounterMode._count_flops``).
``_FlopCounterMode.__torch_dispatch__`` also first asks each op to ``decompose()`` (a no-op unless the
op has a CompositeImplicitAutograd kernel) and counts the pieces instead; ``FlopTally`` does the same,
so the two totals agree exactly.

Note [Grouped matmuls]
~~~~~~~~~~~~~~~~~~~~~~
A mixture-of-experts layer sends each of T tokens to top_k of E experts. transformers 5's "grouped_mm"
experts (transformers/integrations/moe.py, ``grouped_mm_experts_forward``) sort the T * top_k
(token, expert) rows by expert, so that they fall into E contiguous groups of an [M, K] matrix
(M = T * top_k), and multiply group g by expert g's [K, N] weight in one call: ``aten._grouped_mm(x, w,
offs)``, torch's grouped GEMM (``offs[g]`` is the row where group g ends), or, where that kernel cannot
run (traced or exported with weights not in bf16, among others: ``_can_use_grouped_mm``), transformers'
custom op ``transformers.grouped_mm_fallback``, a loop of ``mm``s whose backward is the custom op
``transformers.grouped_mm_fallback_backward``. fxmem's traces take the eager kernel, as
``fxmem.grouped_mm`` where the meta kernel refuses the dtype (Note [grouped_mm on fake tensors] in
fxmem/rules/grouped_mm.py), with ``fxmem.grouped_mm_backward``. torch 2.13's ``flop_registry`` has a
formula for none of them, so without ours the experts, most of an MoE model's FLOPs, would count zero.

Group g costs ``2 * m_g * K * N`` for its ``m_g`` rows. The groups partition the rows (sum of m_g =
M), so the call costs ``2 * M * K * N`` whatever the routing: the count is exact although ``offs``
(data, unknown on fake tensors) is not, since only its total matters and that total is M, a shape.
Autograd's ``_grouped_mm`` backward (derivatives.yaml: ``_grouped_mm_mat1_backward`` and
``_mat2_backward``) calls ``_grouped_mm`` again; the weight gradient ``x^T @ dy`` is a 2D x 2D call
whose groups split the contraction dimension M (output [G, K, N]), again ``2 * M * K * N`` in all. So
every layout ``_grouped_mm`` takes costs 2 * (output elements) * (contraction size), but for 2D x 2D,
whose G outputs are partial products of one matrix over slices of the contraction: 2 * M * N * K
(``_grouped_mm_flop``). The fallback's backward computes ``dx = dy @ w^T`` and ``dw = x^T @ dy``, two
such products. Rows past ``offs[-1]`` are skipped by the kernel; transformers leaves rows there only
for expert parallelism's sentinel tokens (moe.py: "grouped_mm skips rows beyond ``offsets[-1]``"),
where the count is then an upper bound. Like torch's ``addmm`` formula, a bias adds no FLOPs.

Note [Bytes moved]
~~~~~~~~~~~~~~~~~~
``read_bytes`` sums the tensor arguments and ``written_bytes`` the tensor outputs, each distinct tensor
once: ``x * x`` reads ``x`` once. Two tensors are the same when they share storage, offset, sizes and
strides; distinct views of one storage (q, k and v split from one qkv projection) are each read, so
keying on the storage alone would undercount them. A dimension with stride 0 (``expand``) is read
once, as ``torch.utils._runtime_estimation.get_num_bytes`` counts it. Views move no bytes: they only
write new sizes and strides (``is_view_like``). This is the DRAM traffic of an unfused kernel, an
upper bound on what a fused kernel moves.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from math import prod
from types import MappingProxyType
from typing import Any

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, shape_wrapper

from fxmem.rules import Ignored, Missing, Registry

__all__ = ["EXTRA_FORMULAS", "IGNORED", "IGNORED_REASONS", "FlopTally", "OpCost", "is_view_like", "op_cost"]

aten = torch.ops.aten

Count = int | torch.SymInt
"""A FLOP or byte count: an int on real or static tensors, a SymInt when a size is symbolic."""

Shape = tuple[Count, ...]

EXTRA_FORMULAS: Registry[str, Callable[..., Count]] = Registry("FLOP formula")
"""Formulas torch's ``flop_registry`` lacks, keyed by op name (``"aten._grouped_mm"``): a custom op
such as transformers' exists only once its library is imported, so its packet cannot be the key.
Each is wrapped by torch's ``shape_wrapper`` and so called exactly as torch's own formulas are (Note
[Calling the flop formulas]); torch's formula wins where it has one."""


def _register(*names: str) -> Callable[[Callable[..., Count]], Callable[..., Count]]:
    def register(formula: Callable[..., Count]) -> Callable[..., Count]:
        EXTRA_FORMULAS.register(*names)(shape_wrapper(formula))
        return formula

    return register


@_register("aten._grouped_mm", "transformers.grouped_mm_fallback", "fxmem.grouped_mm")
def _grouped_mm_flop(a_shape: Shape, b_shape: Shape, *args: Any, out_shape: Shape, **kwargs: Any) -> Count:
    """2 * M * K * N for ``a`` [M, K] grouped over ``b`` [G, K, N] (the MoE layout), whatever ``offs``
    says; see Note [Grouped matmuls]. A 2D x 2D call splits the contraction instead: its output [G, M, N]
    holds G partial products of one [M, N], so one group's output size counts, times the whole K."""
    k = a_shape[-1]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * out_shape[-2] * out_shape[-1] * k
    return 2 * prod(out_shape) * k


@_register("transformers.grouped_mm_fallback_backward")
def _grouped_mm_fallback_backward_flop(x_shape: Shape, w_shape: Shape, offs_shape: Shape, dy_shape: Shape, **kwargs: Any) -> Count:
    """``dx = dy @ w^T`` and ``dw = x^T @ dy`` per group, each 2 * M * K * N in all (Note [Grouped matmuls])."""
    m, k = x_shape
    return 2 * (2 * m * k * w_shape[-1])


@_register("fxmem.grouped_mm_backward")
def _fxmem_grouped_mm_backward_flop(dy_shape: Shape, x_shape: Shape, w_shape: Shape, offs_shape: Shape, **kwargs: Any) -> Count:
    """Eager's ``_grouped_mm`` backward as ``fxmem::grouped_mm`` runs it (Note [grouped_mm on fake tensors] in
    fxmem/rules/grouped_mm.py): the weight's and the input's gradients, each 2 * M * K * N."""
    m, k = x_shape
    return 2 * (2 * m * k * w_shape[-1])


@dataclass(frozen=True)
class OpCost:
    """What one op costs: FLOPs by torch's formula and the bytes it reads and writes.

    ``has_formula`` is False where neither torch nor ``EXTRA_FORMULAS`` has a formula for the op;
    ``flops`` is then 0 and the caller lists the op rather than trusting the zero.
    """

    flops: Count
    read_bytes: Count
    written_bytes: Count
    has_formula: bool

    @property
    def moved_bytes(self) -> Count:
        """Bytes read plus bytes written: the DRAM traffic the roofline divides by bandwidth."""
        return self.read_bytes + self.written_bytes


def _reasons(reason: str, *packets: OpOverloadPacket) -> dict[OpOverloadPacket, str]:
    return dict.fromkeys(packets, reason)


_VIEW = "a view: new sizes and strides over the same storage, no data touched"
_VIEWS = _reasons(
    _VIEW,
    # torch/utils/_runtime_estimation.py:_VIEW_OPS, plus the aliases that appear at dispatch level.
    aten.lift_fresh, aten.t, aten.transpose, aten.view, aten.detach, aten._unsafe_view, aten.split,
    aten.adjoint, aten.as_strided, aten.diagonal, aten.expand, aten.expand_as, aten.movedim, aten.permute,
    aten.select, aten.squeeze, aten.mT, aten.mH, aten.real, aten.imag, aten.view_as, aten.unflatten,
    aten.unfold, aten.unbind, aten.unsqueeze, aten.vsplit, aten.hsplit, aten.split_with_sizes, aten.swapaxes,
    aten.swapdims, aten.chunk, aten.alias, aten.slice, aten.narrow, aten._reshape_alias,
)  # fmt: skip

IGNORED_REASONS: Mapping[OpOverloadPacket, str] = MappingProxyType(
    _VIEWS
    | _reasons(
        "creates a tensor: writes a constant or uninitialized memory, no arithmetic",
        aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
        aten.zeros, aten.zeros_like, aten.new_zeros, aten.ones, aten.ones_like, aten.new_ones,
        aten.full, aten.full_like, aten.new_full, aten.scalar_tensor, aten.fill, aten.fill_, aten.zero_,
    )
    | _reasons(
        # torch/utils/_runtime_estimation.py:_CREATE_OPS ignores these too.
        "creates a tensor from an index or random bits: no floating-point arithmetic on data",
        aten.arange, aten.rand, aten.randn, aten.randint, aten.rand_like, aten.randn_like, aten.randint_like,
    )
    | _reasons(
        "copies data (its bytes are counted): no arithmetic",
        aten.copy_, aten._to_copy, aten.clone, aten.lift_fresh_copy, aten.cat, aten.stack,
        aten.constant_pad_nd, aten.index_select, aten.gather, aten.embedding, aten.index,
        aten.slice_scatter, aten.select_scatter,
    )
)  # fmt: skip
"""Ops that do no arithmetic, each with the reason; see fvcore's ``jit_handles.py`` ``_IGNORED_OPS``."""

IGNORED: frozenset[OpOverloadPacket] = frozenset(IGNORED_REASONS)
"""The overload packets of ``IGNORED_REASONS``: known to cost no FLOPs, so never reported missing."""

_METADATA = frozenset(
    # Queries that return sizes, strides or flags, not tensors; FlopCounterMode skips the same set.
    [aten.sym_is_contiguous, aten.is_contiguous, aten.is_strides_like_format, aten.is_non_overlapping_and_dense,
     aten.size, aten.sym_size, aten.stride, aten.sym_stride, aten.storage_offset, aten.sym_storage_offset,
     aten.numel, aten.sym_numel, aten.dim, torch.ops.prim.layout, torch.ops.prim.device]
)  # fmt: skip


def is_view_like(func: OpOverload) -> bool:
    """True for an op whose output aliases its input without a write (its schema says ``Tensor(a)``
    in and out), and for the aliases the schema does not mark (``_unsafe_view``): it moves 0 bytes."""
    return bool(func.is_view) or func.overloadpacket in _VIEWS


def op_cost(func: OpOverload, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> OpCost | None:
    """FLOPs and bytes of one call ``out = func(*args, **kwargs)``; None for a metadata query
    (``aten.size``, ``aten.stride``...), which is not a kernel.

    See Note [Calling the flop formulas] and Note [Bytes moved].
    """
    packet = func.overloadpacket
    if packet in _METADATA:
        return None
    formula = _formula(packet)
    flops: Count = formula(*args, **kwargs, out_val=out) if formula is not None else 0
    if is_view_like(func):
        return OpCost(flops, 0, 0, formula is not None)
    read = _unique_nbytes(tree_leaves((args, dict(kwargs))))
    return OpCost(flops, read, _unique_nbytes(tree_leaves(out)), formula is not None)


def _formula(packet: OpOverloadPacket) -> Callable[..., Count] | None:
    """torch's formula for ``packet``, else ours (``EXTRA_FORMULAS``), else None."""
    formula: Callable[..., Count] | None = flop_registry.get(packet)
    if formula is not None:
        return formula
    found = EXTRA_FORMULAS.lookup(str(packet))
    return None if isinstance(found, (Ignored, Missing)) else found


def _unique_nbytes(leaves: Iterable[Any]) -> Count:
    """Bytes of the distinct tensors among ``leaves``; see Note [Bytes moved]. The symbolic sizes are
    summed apart from the plain ones, so that a sum costs one SymInt addition per symbolic size."""
    seen: set[tuple[object, ...]] = set()
    fixed = 0
    symbolic: list[torch.SymInt] = []
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            continue
        key = _tensor_key(t)
        if key not in seen:
            seen.add(key)
            nbytes = _nbytes(t)
            if isinstance(nbytes, int):
                fixed += nbytes
            else:
                symbolic.append(nbytes)
    return _sum(symbolic, fixed)


def _sum(symbolic: list[torch.SymInt], fixed: int) -> Count:
    if not symbolic:
        return fixed
    total: Count = symbolic[0]
    for nbytes in symbolic[1:]:
        total = total + nbytes
    return total + fixed if fixed else total


def _tensor_key(t: torch.Tensor) -> tuple[object, ...]:
    """Identity of the data a tensor covers. A symbolic SymInt is unhashable: its expression stands for it."""
    if t.layout != torch.strided:
        return ("object", id(t))
    return (StorageWeakRef(t.untyped_storage()), _hashable(t.storage_offset()), *map(_hashable, t.shape), None, *map(_hashable, t.stride()))


def _hashable(n: object) -> object:
    return n.node.expr if isinstance(n, torch.SymInt) else n


def _nbytes(t: torch.Tensor) -> Count:
    """numel * element_size, except that a stride-0 (broadcast) dimension is read once. The plain
    sizes are multiplied first: SymInt arithmetic costs tens of microseconds an operation (a Python
    SymNode and its sympy expression each time), and a symbolic pass counts every op's bytes."""
    if t.layout != torch.strided:
        return t.numel() * t.element_size()
    fixed = t.element_size()
    symbolic: Count | None = None
    for size, stride in zip(t.shape, t.stride()):
        if statically_known_true(stride == 0):
            continue
        if isinstance(size, torch.SymInt):
            symbolic = size if symbolic is None else symbolic * size
        else:
            fixed *= size
    return fixed if symbolic is None else symbolic * fixed


class FlopTally(TorchDispatchMode):
    """Records the cost of every op that runs inside ``with FlopTally() as tally:``.

    Under FakeTensorMode, enter FakeTensorMode first and FlopTally inside it, so that FlopTally sees
    each op before the fake kernel runs it. ``records`` keeps one ``(op, OpCost)`` per call in order,
    ``missing`` counts the calls of ops with no formula that are not ``IGNORED`` or views.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, OpCost]] = []
        self.missing: Counter[str] = Counter()

    @property
    def total_flops(self) -> Count:
        """The FLOPs of every recorded op: ``FlopCounterMode.get_total_flops()`` for the same run, plus
        the ops only ``EXTRA_FORMULAS`` has a formula for."""
        return sum((cost.flops for _, cost in self.records), start=0)

    def __torch_dispatch__(self, func: OpOverload, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket not in _METADATA:
            # Decompose where torch can, as FlopCounterMode does (its registry check compares an
            # OpOverload with packet keys, so it tries every op); see Note [Calling the flop formulas].
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        self._record(func, args, kwargs, out)
        return out

    def _record(self, func: OpOverload, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> None:
        cost = op_cost(func, args, kwargs, out)
        if cost is None:
            return
        name = str(func.overloadpacket)
        self.records.append((name, cost))
        if not cost.has_formula and func.overloadpacket not in IGNORED and not is_view_like(func):
            self.missing[name] += 1
