"""The dispatch mode under which fake passes run: faithful to what eager CPU kernels allocate.

It does four things, all in ``__torch_dispatch__``, below autograd: refuses the operand dtypes that
real matmul and convolution kernels refuse (Note [Operand dtypes]), computes a few composite ops
with a SymInt-safe reference where their fake kernel would read concrete sizes, decomposes composite
ops exactly as eager CPU does, and applies op rules (``fxmem/rules/ops.py``) that record the true size
of storages whose fake kernels under-report them (the CPU LSTM's workspace).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch._refs
from torch._C import DispatchKey
from torch._prims_common import suggest_memory_format
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["QUERIES", "DtypeMismatch", "LayoutRule", "OpRule", "OpRuleMode", "check_operand_dtypes"]

OpRule = Callable[[Sequence[Any], Mapping[str, Any], Any], Mapping[int, object]]
"""An op rule gets an aten op's (args, kwargs, output) and returns {output index: true nbytes}
for outputs whose fake storage under-reports what the real kernel allocates."""
LayoutRule = Callable[[Sequence[Any], Mapping[str, Any], Any], Mapping[int, tuple[Any, ...]]]
"""A layout rule gets an aten op's (args, kwargs, output) and returns {output index: strides} for
outputs that the real kernel lays out otherwise than the fake one."""


def _restride(out: Any, strides: Mapping[int, tuple[Any, ...]]) -> None:
    """Give outputs the strides their real kernel gives them: a change of metadata, no allocation, made
    below every mode (the tracker and autograd see the output as the real kernel returns it)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    for index, wanted in strides.items():
        t = outs[index]
        if isinstance(t, torch.Tensor) and tuple(t.stride()) != tuple(wanted):
            with no_dispatch():
                t.as_strided_(t.shape, wanted)


def _constant_pad_nd(x: torch.Tensor, pad: Sequence[Any], value: float = 0.0) -> Any:
    """constant_pad_nd as torch's Python reference computes it (SymInt sizes stay symbolic), but with one
    allocation, as the ATen kernel makes: the reference fills its output out of place (``torch.fill``),
    which on fake tensors is a second padded tensor for a moment (a pad's backward, which crops with
    negative pads, peaked 1,344 bytes high in a fuzzed model at B=4; tests/test_dispatch.py)."""
    pad = list(pad)
    source, shape, where = x, list(x.shape), []
    for i in range(len(pad) // 2):
        dim, before, after = x.dim() - 1 - i, pad[2 * i], pad[2 * i + 1]
        shape[dim] = x.shape[dim] + before + after
        if before < 0:
            source = source.narrow(dim, -before, source.shape[dim] + before)
        if after < 0:
            source = source.narrow(dim, 0, source.shape[dim] + after)
        where.append((dim, max(before, 0)))
    out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=suggest_memory_format(x)).fill_(value)
    target = out
    for dim, start in where:
        target = target.narrow(dim, start, source.shape[dim])
    target.copy_(source)
    return out


# Note [Slicing with a symbolic size]
#     Indexing a tensor with a slice that spans a whole dimension (the ``:`` of ``x[:, 0:1]``) makes no
#     slice in eager: ``applySlicing`` (aten/src/ATen/TensorIndexing.h) returns the tensor itself when
#     start is 0, step 1 and stop its length. On fake tensors whose size is a symbol (the batch) that
#     test cannot be decided, so the slice is made, and its backward, ``slice_backward``, allocates a
#     zero-filled gradient of the whole input and copies into it: a second input-sized tensor that
#     eager never makes. Such a slice's backward is here the gradient itself, as in eager; a slice of a
#     concrete size is left as it is, since there fake and eager agree. Where a slice's or a select's
#     backward does run, it is computed as the ATen kernels compute it (TensorShape.cpp: one
#     zero-filled tensor, the gradient copied into the slice), not by torch's Python decomposition,
#     which fake tensors take with symbolic sizes (new_zeros, then an out-of-place slice_scatter: two
#     input-sized tensors). A fuzzed Embedding -> x[:, 0:1] model's backward peaked 20% high at B=3
#     for the first reason (tests/test_dispatch.py).


def _slice_backward(grad: Any, input_sizes: Sequence[Any], dim: int, start: Any, end: Any, step: Any) -> Any:
    """slice_backward as eager runs it. See Note [Slicing with a symbolic size]."""
    whole = grad.shape[dim]
    if isinstance(whole, torch.SymInt) and start == 0 and step == 1 and statically_known_true(whole == input_sizes[dim]):
        return torch.ops.aten.alias.default(grad)
    out = torch.empty(input_sizes, dtype=grad.dtype, device=grad.device).zero_()  # torch.zeros: a second, filled tensor
    torch.ops.aten.slice.Tensor(out, dim, start, end, step).copy_(grad)
    return out


def _select_backward(grad: Any, input_sizes: Sequence[Any], dim: int, index: Any) -> Any:
    """select_backward as its ATen kernel computes it (Note [Slicing with a symbolic size])."""
    out = torch.empty(input_sizes, dtype=grad.dtype, device=grad.device).zero_()  # torch.zeros: a second, filled tensor
    out.select(dim, index).copy_(grad)
    return out


# Note [Loss gradients in the legacy layout]
#     The CPU and CUDA kernels of mse_loss_backward, smooth_l1_loss_backward and huber_loss_backward
#     allocate the input's gradient contiguous (at::zeros_like(input, LEGACY_CONTIGUOUS_MEMORY_FORMAT)
#     in aten/src/ATen/native/Loss.cpp); their fake kernels keep the input's strides. The bytes are the
#     same, but what runs after depends on the layout: a model whose output is a permuted view (a
#     channels-last LayerNorm permuted back) hands the norm's backward a gradient that the real step
#     must copy to contiguous rows and the fake one need not (Note [CPU layer norm buffers]). Measured
#     on torch 2.13's CPU: a permuted input's gradient is contiguous in eager and permuted on fake
#     tensors (tests/test_dispatch.py). These are computed as one contiguous tensor of the input's
#     shape and dtype instead; the values are fake, only the layout matters.


def _legacy_contiguous_gradient(grad: Any, inp: Any, *args: Any, **kwargs: Any) -> Any:
    return torch.empty(inp.shape, dtype=inp.dtype, device=inp.device)


# Note [sparse_mask on fake tensors]
#     ``dense.sparse_mask(mask)`` keeps ``dense``'s values at ``mask``'s indices: a sparse COO tensor with
#     ``mask``'s nnz. Its fake kernel returns one with no values (nnz 0), and the backward of
#     ``torch.sparse_coo_tensor`` (``grad.sparse_mask(result)._values()``, the gradient of the values)
#     then fails autograd's shape check ("got [0] but expected shape compatible with [768]"): SHiRA's
#     step (peft 0.21, tuners/shira/layer.py) stopped there. It is computed as the CPU kernel does it
#     (``sparse_mask`` in aten/src/ATen/native/sparse/SparseTensor.cpp, measured with torch.profiler on
#     torch 2.13: a copy of the mask's indices, 16 B per nonzero of a 2-D mask, and one gathered value
#     per nonzero); the 4-byte ``ones`` it multiplies by is left out.


def _sparse_mask(t: Any, mask: Any) -> Any:
    """sparse_mask of a strided tensor by a sparse COO mask: Note [sparse_mask on fake tensors]."""
    if t.layout != torch.strided or mask.layout != torch.sparse_coo or not mask._nnz():
        return NotImplemented
    values = t.new_empty((mask._nnz(), *t.shape[mask.sparse_dim() :]))
    return torch.sparse_coo_tensor(mask._indices().clone(), values, mask.shape, is_coalesced=mask.is_coalesced())


_SYMBOLIC_REWRITES: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.sparse_mask.default: _sparse_mask,
    torch.ops.aten.constant_pad_nd.default: _constant_pad_nd,
    torch.ops.aten.slice_backward.default: _slice_backward,
    torch.ops.aten.select_backward.default: _select_backward,
    torch.ops.aten.mse_loss_backward.default: _legacy_contiguous_gradient,
    torch.ops.aten.smooth_l1_loss_backward.default: _legacy_contiguous_gradient,
    torch.ops.aten.huber_loss_backward.default: _legacy_contiguous_gradient,
}
"""Ops computed otherwise than by their fake kernel: constant_pad_nd, whose fake kernel reads concrete
sizes, so that it would fix B to its hint (HF pads labels with it), by torch's own SymInt-safe Python
reference (both allocate one output of the padded size, so what autograd saves is unchanged); the
slice and select backwards with the one allocation of their ATen kernels; the loss
gradients of Note [Loss gradients in the legacy layout] in the layout their real kernels give."""


_aten = torch.ops.aten


# Note [Operand dtypes]
#     A real matmul or convolution kernel refuses operands of two floating dtypes; the fake kernels of
#     several (mm, addmm, addbmm, mv, _addmm_activation: torch/_meta_registrations.py) do not check,
#     so a float16 batch fed to float32 weights ran and gave numbers where the real step raises.
#     The rules, from the torch sources and checked op by op against eager CPU in
#     tests/test_dtype_errors.py:
#     - aten/src/ATen/native/LinearAlgebra.cpp: ADDMM_META ("self and mat2 must have the same dtype",
#       "mat1 and mat2 must have the same dtype") for addmm and _addmm_activation, mm's meta function,
#       baddbmm/addbmm/bmm ("expected scalar type ... but found ..."), mv/addmv and dot/vdot: every
#       floating tensor operand, the added one (a Linear's bias) included, has one dtype.
#     - aten/src/ATen/native/Convolution.cpp: the input and the weight have one dtype
#       (check_input_same_type_as_parameters: "Input type ... and weight type ... should be the same").
#       The bias is checked by the conv1d/2d/3d entry points (the same function, "... and bias type
#       ... should be the same") and by the CPU's transposed 3-d kernel, not by ``convolution`` itself
#       nor by conv_transpose1d/2d: eager CPU runs those with a bias of another dtype.
#     The conv1d/2d/3d checks run in C++ before their ops reach any mode, on fake tensors too; their
#     messages are read back into a DtypeMismatch (``DtypeMismatch.from_torch``).
#     Autocast (CPU, or CUDA's as fxmem/gpu/target.py emulates it) casts these ops' operands before
#     they reach this mode, which sits below both; so the check sees what the kernel would get, and a
#     mixed-dtype layer under autocast passes, as it does for real. The ``.dtype`` overloads of the
#     matmuls (an explicit out_dtype) are left to torch's own checks.

_INPUT_WEIGHT, _INPUT_WEIGHT_BIAS = ("input", "weight"), ("input", "weight", "bias")
_MATMUL_OPERANDS: dict[Any, tuple[str, ...]] = {
    _aten.mm: ("self", "mat2"),
    _aten.addmm: ("self", "mat1", "mat2"),
    _aten._addmm_activation: ("self", "mat1", "mat2"),
    _aten.bmm: ("self", "mat2"),
    _aten.baddbmm: ("self", "batch1", "batch2"),
    _aten.addbmm: ("self", "batch1", "batch2"),
    _aten.mv: ("self", "vec"),
    _aten.addmv: ("self", "mat", "vec"),
    _aten.matmul: ("self", "other"),
    _aten.dot: ("self", "tensor"),
    _aten.vdot: ("self", "other"),
    _aten.linear: _INPUT_WEIGHT_BIAS,
}
"""Matmul-family ops (default overloads) and the operands that must share one dtype."""
_CONV_OPERANDS: dict[Any, tuple[str, ...]] = {
    **dict.fromkeys((_aten.conv1d, _aten.conv2d, _aten.conv3d, _aten.conv_transpose3d), _INPUT_WEIGHT_BIAS),
    **dict.fromkeys((_aten.conv_transpose1d, _aten.conv_transpose2d), _INPUT_WEIGHT),
}
"""Convolution entry points, every overload, and the operands that must share one dtype; ``convolution``
and ``_convolution`` are ``_convolution_operands``'."""
_CHECKED = frozenset((*_MATMUL_OPERANDS, *_CONV_OPERANDS, _aten.convolution, _aten._convolution))
"""Every op packet with a dtype rule: the one set lookup most ops pay."""
_TORCH_CONV_CHECK = re.compile(r"Input type \((?P<input>[^)]+)\) and (?P<other>weight|bias) type \((?P<dtype>[^)]+)\) should be the same")
"""check_input_same_type_as_parameters' message (Convolution.cpp), with C++ or Python dtype names."""
_CPP_DTYPES = {"float": torch.float32, "double": torch.float64, "c10::Half": torch.float16, "c10::BFloat16": torch.bfloat16}


class DtypeMismatch(RuntimeError):
    """An op got floating operands of two dtypes, which its real kernel refuses (Note [Operand dtypes]).

    Not an FxmemError: the node running the op names the layer (``fxmem/engine/capture.py``,
    ``node_error``), which this mode, below the graph, cannot see.
    """

    def __init__(self, op: str, operands: Sequence[tuple[str, torch.dtype]]) -> None:
        self.op = op
        self.operands = tuple(operands)
        super().__init__(f"{op} got operands of two dtypes ({self.describe()}), which its kernel refuses outside autocast")

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        """The distinct dtypes, in operand order."""
        return tuple(dict.fromkeys(dtype for _, dtype in self.operands))

    def describe(self) -> str:
        return ", ".join(f"{name} {str(dtype).removeprefix('torch.')}" for name, dtype in self.operands)

    @classmethod
    def from_torch(cls, e: BaseException) -> DtypeMismatch | None:
        """The mismatch a convolution entry point's own C++ check reported, or None for other errors."""
        found = _TORCH_CONV_CHECK.search(str(e)) if isinstance(e, RuntimeError) else None
        if found is None:
            return None
        input_dtype, other_dtype = _dtype_named(found["input"]), _dtype_named(found["dtype"])
        if input_dtype is None or other_dtype is None:
            return None
        return cls("aten.convolution", [("input", input_dtype), (found["other"], other_dtype)])


def _dtype_named(name: str) -> torch.dtype | None:
    """The dtype of a C++ scalar type name ('c10::Half') or a Python one ('torch.float16')."""
    found = _CPP_DTYPES.get(name, getattr(torch, name.removeprefix("torch."), None))
    return found if isinstance(found, torch.dtype) else None


def _same_dtype_operands(func: Any, bound: Mapping[str, Any]) -> tuple[str, ...]:
    """The names of ``func``'s operands that its kernel requires to share a dtype; () for other ops."""
    packet = func.overloadpacket
    if packet in (_aten.convolution, _aten._convolution):
        return _convolution_operands(bound)
    if packet in _CONV_OPERANDS:
        return _CONV_OPERANDS[packet]
    return _MATMUL_OPERANDS.get(packet, ()) if func._overloadname == "default" else ()


def _convolution_operands(bound: Mapping[str, Any]) -> tuple[str, ...]:
    """``convolution`` checks input against weight; the CPU's transposed 3-d kernel the bias too."""
    weight = bound.get("weight")
    transposed_3d = bool(bound.get("transposed")) and isinstance(weight, torch.Tensor) and weight.dim() == 5
    return _INPUT_WEIGHT_BIAS if transposed_3d else _INPUT_WEIGHT


def check_operand_dtypes(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """Raise DtypeMismatch where the real kernel of ``func`` would refuse its operands' dtypes."""
    if getattr(func, "overloadpacket", None) not in _CHECKED:  # a higher-order op has no packet
        return
    bound = {a.name: v for a, v in zip(func._schema.arguments, args)} | dict(kwargs)
    names = _same_dtype_operands(func, bound)
    operands = [(n, t.dtype) for n in names if isinstance(t := bound.get(n), torch.Tensor) and t.is_floating_point()]
    if len({dtype for _, dtype in operands}) > 1:
        raise DtypeMismatch(str(func.overloadpacket), operands)


def _eager_decomposes(func: Any) -> bool:
    """True for an aten op that eager CPU runs as its C++ CompositeImplicitAutograd decomposition.

    Not ``func._can_decompose()``: that also holds for ops with a kernel of their own and a Python
    decomposition (upsample_nearest1d), which eager never uses and which can lay out its output
    differently (see test_interpolate_keeps_the_cpu_kernel_layout in tests/test_fuzz_regressions.py).
    Ops the dispatcher has no kernel for at all (aten.size.default, met in interpolate's symbolic
    pass) are run as they are, and so are the few that have a CPU kernel besides their decomposition
    (silu_backward, mish_backward, native_channel_shuffle): eager CPU runs that kernel, one output,
    where the decomposition makes four temporaries (SiLU's backward in every Llama layer).
    """
    name = func.name()
    return (
        func.namespace == "aten"
        and torch._C._dispatch_has_kernel(name)
        and torch._C._dispatch_has_kernel_for_dispatch_key(name, DispatchKey.CompositeImplicitAutograd)
        and not torch._C._dispatch_has_kernel_for_dispatch_key(name, DispatchKey.CPU)
    )


QUERIES = frozenset({torch.ops.prim.device.default, torch.ops.prim.layout.default})
"""Queries of a tensor's device or layout: no tensor out, no kernel, no rule. The optimizers'
``_group_tensors_by_device_and_dtype`` asks each tensor's device: 61% of the ops a gpt-7b step
dispatches (5,052 of 8,274), which the modes pass through untouched."""


class SeesCompiledCode:
    """A dispatch mode that stays on while Dynamo runs compiled code, where ``compiled_step`` is set:
    Dynamo runs a compiled artifact under a mode only when the mode ignores compile internals
    (torch/utils/_python_dispatch.py; Note [Dynamo on the traced graph] in fxmem/compiling/inductor.py)."""

    compiled_step = False

    def ignore_compile_internals(self) -> bool:
        return self.compiled_step


class OpRuleMode(SeesCompiledCode, TorchDispatchMode):
    """Applies op rules: records the true size of storages whose fake kernels under-report them."""

    def __init__(
        self, rules: Mapping[str, OpRule], overrides: dict[StorageWeakRef, object], layouts: Mapping[str, LayoutRule] | None = None
    ) -> None:
        super().__init__()
        self.rules = rules
        self.overrides = overrides
        self.layouts = layouts or {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in QUERIES:
            return func(*args, **kwargs)
        check_operand_dtypes(func, args, kwargs)
        if func in _SYMBOLIC_REWRITES:
            rewritten = _SYMBOLIC_REWRITES[func](*args, **kwargs)
            if rewritten is not NotImplemented:
                return rewritten
        if _eager_decomposes(func):
            # A Python mode receives some composite ops (aten.pad) whole; decomposing them here, with
            # the C++ decomposition eager uses, keeps SymInt sizes symbolic (as make_fx's mode does).
            return func._op_dk(DispatchKey.CompositeImplicitAutograd, *args, **kwargs)
        out = func(*args, **kwargs)
        packet = str(func.overloadpacket)
        layout = self.layouts.get(packet)
        if layout is not None:
            _restride(out, layout(args, kwargs, out))
        rule = self.rules.get(packet)
        if rule is not None:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for index, nbytes in rule(args, kwargs, out).items():
                self.overrides[StorageWeakRef(outs[index].untyped_storage())] = nbytes
        return out
