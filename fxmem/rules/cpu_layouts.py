"""Output layouts of the CPU's pointwise kernels (TensorIterator), where fake kernels lay them out otherwise.

Note [TensorIterator output layouts on the CPU]
    The CPU's pointwise kernels allocate their output through TensorIterator
    (aten/src/ATen/TensorIterator.cpp): ``compute_fast_setup_type`` gives it canonical contiguous
    strides where every input has the output's shape and is contiguous, canonical channels-last ones
    where every such 4-D input is channels-last contiguous, and the inputs' strides where they all
    have the same ones and are non-overlapping and dense; otherwise ``reorder_dimensions`` sorts the
    dimensions by the inputs' strides (an insertion sort that skips broadcast dimensions and breaks
    ties by size) and ``allocate_or_resize_outputs`` lays the output out densely in that order. A
    Python number an arithmetic op takes as its ``other`` is a 0-dim operand (a wrapped number):
    it has not the output's shape, so it turns the fast setup off.
    The fake kernels (torch._prims_common's elementwise strides, ``empty_like``) agree on every
    dimension of size above 1 but not on the strides of size-1 dimensions, which no contiguity check
    reads; ``suggest_memory_format`` does, though, and so does ``cat``, which lays its output out in
    its inputs' suggested layout. A fuzzed model (PixelUnshuffle -> chunk-multiply -> where -> permute
    / LayerNorm(2) / permute -> chunk-multiply -> ReLU on (B, 1, 2, 6)) had a ReLU over (B, 1, 1, 3)
    give strides (3, 3, 3, 1) in eager and keep its input's (3, 1, 3, 1) on fake tensors; chunk's
    backward then concatenated the multiplications' gradients channels-last on fake tensors only,
    the permuted gradient reached layer norm's backward contiguous, and the fake step missed that
    backward's copy of it (Note [CPU layer norm buffers] in fxmem/rules/ops.py): 68 bytes (11%) low
    at B=3. These rules give the outputs TensorIterator's strides. Measured against eager CPU kernels
    on torch 2.13 (tests/test_cpu_layouts.py): every op registered here, on contiguous,
    channels-last, permuted, sliced, expanded and broadcast operands with size-1 dimensions, 1-D
    to 5-D; exact on each (threshold_backward's and leaky_relu_backward's iterators take ``self``
    before the gradient, which decides ties). Not described, so the fake layout stays: operands of
    two dtypes (TensorIterator casts them first, each copy in a layout of its own), and ops whose CPU
    kernels allocate otherwise (masked_fill fills a clone, ``empty_like`` and the ``*_like``
    factories, dropout's noise, hardtanh's backward). hardtanh and relu6 allocate like
    ``empty_like(input)`` (the input's strides where it is dense, else dense in its strides' order):
    a fuzzed permute / LayerNorm / permute -> ReLU6 -> Conv3d(1, 5, 1, stride=2, padding=1) had the
    convolution's input channels-last in eager only, and its backward was predicted 720 bytes high. With a symbolic batch the
    layout is chosen at the batch's hint; the strides it gives stay expressions in B.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fxmem.rules.registries import register_layout_rule

__all__ = ["ARITHMETIC", "SELF_FIRST", "UNARY", "empty_like_strides", "hardtanh_layout", "tensor_iterator_strides"]


class _NoHint(Exception):
    """A size or stride without a hint (data-dependent): the layout is not described."""


def _hint(value: Any) -> int:
    """A size or stride as an int: a SymInt's hint (the batch it was traced at)."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    if value.node.hint is None:
        raise _NoHint(value)
    return int(value.node.hint)


def _dense_in(sizes: Sequence[int], strides: Sequence[int], order: Sequence[int]) -> bool:
    """Whether the dimensions of size above 1, fastest first in ``order``, are packed densely
    (c10's compute_contiguous and compute_channels_last_contiguous_2d)."""
    expected = 1
    for d in order:
        if sizes[d] != 1:
            if strides[d] != expected:
                return False
            expected *= sizes[d]
    return True


def _non_overlapping_and_dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """c10's compute_non_overlapping_and_dense: size-1 dimensions last, the rest by stride."""
    perm = sorted(range(len(sizes)), key=lambda d: (sizes[d] < 2, strides[d] if sizes[d] >= 2 else 0))
    expected = 1
    for d in perm:
        if sizes[d] < 2:
            return True
        if strides[d] != expected:
            return False
        expected *= sizes[d]
    return True


def _broadcast_strides(t: Any, shape: Sequence[int]) -> list[int]:
    """An operand's strides over the output's dimensions: 0 where it is broadcast (TensorIterator's
    compute_strides)."""
    offset = len(shape) - t.dim()
    strides = [0] * offset
    for i in range(t.dim()):
        size = _hint(t.shape[i])
        strides.append(0 if size == 1 and shape[offset + i] != 1 else _hint(t.stride(i)))
    return strides


def _reorder(operands: Sequence[Any], shape: Sequence[int]) -> list[int]:
    """TensorIterator's reorder_dimensions: the output's dimensions, fastest first."""
    ndim = len(shape)
    strides = [_broadcast_strides(t, shape) for t in operands]

    def should_swap(dim0: int, dim1: int) -> int:
        for s in strides:
            if s[dim0] == 0 or s[dim1] == 0:
                continue
            if s[dim0] != s[dim1]:
                return -1 if s[dim0] < s[dim1] else 1
            if shape[dim0] > shape[dim1]:
                return 1
        return 0

    perm = list(range(ndim - 1, -1, -1))
    for i in range(1, ndim):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[dim0], perm[dim1])
            if comparison > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif comparison < 0:
                break
    return perm


def _dense_strides(sizes: Sequence[Any], order: Sequence[int]) -> tuple[Any, ...]:
    """Strides that pack ``sizes`` densely, fastest first in ``order`` (size-0 dimensions count as 1)."""
    strides: list[Any] = [0] * len(sizes)
    step: Any = 1
    for d in order:
        strides[d] = step
        step = step * sizes[d] if _hint(sizes[d]) != 0 else step
    return tuple(strides)


def tensor_iterator_strides(operands: Sequence[Any], out_shape: Sequence[Any], scalars: int = 0) -> tuple[Any, ...]:
    """The strides TensorIterator gives an output of ``out_shape`` computed from ``operands`` (tensors)
    and ``scalars`` wrapped numbers. See Note [TensorIterator output layouts on the CPU]."""
    shape = [_hint(s) for s in out_shape]
    ndim = len(shape)
    sizes = [[_hint(s) for s in t.shape] for t in operands]
    strides = [[_hint(s) for s in t.stride()] for t in operands]
    contiguous_order = list(range(ndim - 1, -1, -1))
    if ndim and not scalars and all(s == shape for s in sizes):
        if all(_dense_in(sz, st, contiguous_order) for sz, st in zip(sizes, strides)):
            return _dense_strides(out_shape, contiguous_order)
        if ndim == 4 and all(_dense_in(sz, st, (1, 3, 2, 0)) for sz, st in zip(sizes, strides)):
            return _dense_strides(out_shape, (1, 3, 2, 0))
        if all(_non_overlapping_and_dense(sz, st) for sz, st in zip(sizes, strides)) and all(st == strides[-1] for st in strides):
            return tuple(operands[-1].stride())
    if ndim <= 1:
        return _dense_strides(out_shape, contiguous_order)
    return _dense_strides(out_shape, _reorder(operands, shape))


def _pointwise_layout(wrapped_number: bool, self_first: bool = False, skip: int = 0) -> Any:
    """A layout rule for a pointwise op whose tensor arguments are TensorIterator's inputs, in order
    (``self`` before the gradient where ``self_first``), and its ``other`` too where ``wrapped_number``
    and it is a Python number (arithmetic's wrapped scalar). Operands from the ``skip``-th on must share
    a dtype (where's condition is the one skipped)."""

    def rule(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> dict[int, tuple[Any, ...]]:
        if not isinstance(out, torch.Tensor) or out.layout != torch.strided or "out" in kwargs:
            return {}  # an out= overload writes where it is told
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if self_first:
            tensors[:2] = tensors[1::-1]
        if len({t.dtype for t in tensors[skip:]}) > 1:
            return {}  # TensorIterator casts operands of other dtypes first: not described
        scalars = int(wrapped_number and len(args) > 1 and isinstance(args[1], (int, float, bool)))
        scalars += sum(t.dim() == 0 for t in tensors if out.dim() > 0)
        operands = [t for t in tensors if t.dim() > 0 or out.dim() == 0]
        if not operands:
            return {}
        try:
            return {0: tensor_iterator_strides(operands, out.shape, scalars)}
        except _NoHint:
            return {}

    rule.__doc__ = "TensorIterator's output strides. See Note [TensorIterator output layouts on the CPU]."
    return rule


UNARY = (
    "aten.relu", "aten.leaky_relu", "aten.gelu", "aten.silu", "aten.sigmoid", "aten.tanh", "aten.elu",
    "aten.softplus", "aten.mish", "aten.hardswish", "aten.hardsigmoid", "aten.neg", "aten.exp", "aten.abs",
    "aten.sqrt", "aten.rsqrt", "aten.reciprocal", "aten.erf", "aten.sin", "aten.cos", "aten.sign",
    "aten.floor", "aten.clamp", "aten.clamp_min", "aten.clamp_max", "aten.log", "aten.celu", "aten.hardshrink",
    "aten.sigmoid_backward", "aten.tanh_backward", "aten.gelu_backward",
    "aten.silu_backward", "aten.elu_backward", "aten.softplus_backward",
    "aten.hardswish_backward", "aten.hardsigmoid_backward", "aten.mish_backward", "aten.where",
    "aten.lerp", "aten.addcmul", "aten.addcdiv", "aten.pow",
)  # fmt: skip
"""Pointwise ops whose scalar arguments are parameters, not operands."""
ARITHMETIC = (
    "aten.add", "aten.sub", "aten.mul", "aten.div", "aten.gt", "aten.lt", "aten.ge",
    "aten.le", "aten.eq", "aten.ne", "aten.maximum", "aten.minimum", "aten.rsub",
)  # fmt: skip
"""Pointwise ops that take a Python number as a wrapped 0-dim operand."""


def empty_like_strides(t: Any) -> tuple[Any, ...]:
    """The strides ``torch.empty_like(t)`` gives on the CPU: ``t``'s own where it is non-overlapping and
    dense, else dense ones in the order of ``t``'s strides (c10's infer_dense_strides, the sort of
    TensorIterator's reorder_dimensions over one operand)."""
    sizes, strides = [_hint(s) for s in t.shape], [_hint(s) for s in t.stride()]
    if _non_overlapping_and_dense(sizes, strides):
        return tuple(t.stride())
    return _dense_strides(t.shape, _reorder([t], sizes) if t.dim() > 1 else [0])


@register_layout_rule(("aten.hardtanh", "cpu"), ("aten.relu6", "cpu"))
def hardtanh_layout(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> dict[int, tuple[Any, ...]]:
    """hardtanh (and relu6, which is hardtanh) allocates its output like ``empty_like(input)``, not
    through TensorIterator. See Note [TensorIterator output layouts on the CPU]."""
    if not isinstance(out, torch.Tensor) or "out" in kwargs or out.shape != args[0].shape:
        return {}
    try:
        return {0: empty_like_strides(args[0])}
    except _NoHint:
        return {}


SELF_FIRST = ("aten.threshold_backward", "aten.leaky_relu_backward")
"""Backward ops whose TensorIterator takes ``self`` before the gradient (their meta functions in
aten/src/ATen/native/Activation.cpp: ``build_borrowing_binary_op(out, self, grad)``)."""

for _op in UNARY:
    register_layout_rule((_op, "cpu"))(_pointwise_layout(wrapped_number=False, skip=int(_op == "aten.where")))
for _op in ARITHMETIC:
    register_layout_rule((_op, "cpu"))(_pointwise_layout(wrapped_number=True))
for _op in SELF_FIRST:
    register_layout_rule((_op, "cpu"))(_pointwise_layout(wrapped_number=False, self_first=True))
