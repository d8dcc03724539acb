"""The ops that trace QLoRA's 4-bit linears as their libraries run them: ``fxmem::matmul_4bit`` for
bitsandbytes' ``MatMul4Bit`` (Note [bitsandbytes' 4-bit matmul in a graph]) and ``fxmem::linear_nf4``
for torchao's ``LinearNF4`` (Note [torchao's NF4 linear in a graph]), put in place while a model is
traced (``quantized_linears_as_ops``), and the workspace rules for the copies bitsandbytes' kernels
make inside (Note [The forward's dequantized copies]). What the weights themselves hold is
fxmem/rules/nf4.py's.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxmem.rules.nf4 import bitsandbytes, nf4_tensor_type, quant_state
from fxmem.rules.ledger import note_code_path
from fxmem.rules.registries import register_workspace_rule

__all__ = [
    "cpu_matmul_4bit_workspace",
    "cuda_matmul_4bit_workspace",
    "linear_nf4",
    "matmul_4bit",
    "quantized_linears_as_ops",
]


# Note [bitsandbytes' 4-bit matmul in a graph]
#     bitsandbytes 0.50 runs a 4-bit linear in training as ``MatMul4Bit`` (autograd/_functions.py), an
#     autograd.Function. Its forward calls ``bitsandbytes::gemm_4bit``, which on the CPU (and on CUDA
#     above 1,536 rows, backends/cuda/ops.py ``_dequant_linear_fallback``) dequantizes: with nested
#     statistics an fp32 absmax per block (``dequantize_blockwise``, then ``+ offset``: a second one),
#     then the whole weight in the input's dtype (``dequantize_4bit``), then ``F.linear``; both copies
#     die when the op returns (backends/default/ops.py ``_gemm_4bit_default_impl``). It saves nothing
#     through ``save_for_backward``: it keeps the packed weight and its ``QuantState`` on ``ctx``
#     (``ctx.tensors = (None, B)``, ``ctx.state``), state the step holds anyway, so no
#     ``saved_tensors_hooks`` sees anything. Its backward dequantizes again
#     (``F.dequantize_4bit(B, ctx.state)``: the absmaxes as above, in place of the second one, then the
#     weight in the dtype it was loaded in, ``quant_state.dtype``), casts that to the gradient's dtype
#     (a second copy where the two differ) and multiplies; the weight gets no gradient.
#     torch.export keeps no autograd.Function: it records the forward's ``gemm_4bit``, which has no
#     autograd formula, so the replayed step would lose the backward. While exporting, fxmem's own op
#     ``fxmem::matmul_4bit`` stands in for ``bitsandbytes.matmul_4bit``: its real kernel is
#     ``gemm_4bit`` itself, its autograd keeps what ``MatMul4Bit`` keeps and its backward calls
#     bitsandbytes' own ``dequantize_4bit``, so the backward's copies are ops the step simulates. The
#     forward's copies happen inside one op, where no fake tensor shows them: the workspace rules
#     below charge them. Export also swaps each parameter for a plain fake tensor, without the
#     ``quant_state`` that ``Linear4bit.forward`` reads (``fix_4bit_weight_quant_state_from_module``
#     would then re-wrap the fake tensor as a ``Params4bit`` and fail): the module's own
#     ``QuantState`` is handed to it instead; its tensors become the graph's constants.

_NESTED_BLOCKSIZE = 256
"""The block of the nested absmax quantization; bitsandbytes' gemm runs no other
(autograd/_functions.py ``MatMul4Bit.forward``: "nested quantization with state2.blocksize != 256 is not supported")."""


@torch.library.custom_op("fxmem::matmul_4bit", mutates_args=())
def matmul_4bit(
    A: torch.Tensor,
    B: torch.Tensor,
    shape: Sequence[int],
    absmax: torch.Tensor,
    blocksize: int,
    quant_type: str,
    dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    absmax_8bit: torch.Tensor | None = None,
    absmax_code: torch.Tensor | None = None,
    absmax_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """bitsandbytes' 4-bit matmul with ``MatMul4Bit``'s autograd (Note [bitsandbytes' 4-bit matmul in a
    graph]); ``absmax`` is the nested state's where ``absmax_8bit`` is given, as ``gemm_4bit`` takes it,
    and ``dtype`` the weight's as loaded (the backward's dequantized copy)."""
    return torch.ops.bitsandbytes.gemm_4bit.default(
        A, B.view(-1, 1), shape, absmax, blocksize, quant_type,
        bias=bias, absmax_8bit=absmax_8bit, absmax_code=absmax_code, absmax_offset=absmax_offset,
    )  # fmt: skip


@matmul_4bit.register_fake
def _(A: torch.Tensor, B: torch.Tensor, shape: Sequence[int], *_: Any, **__: Any) -> torch.Tensor:
    return A.new_empty((*A.shape[:-1], shape[0]))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    """Keep the weight on ``ctx``, not through ``save_for_backward``, as ``MatMul4Bit`` does."""
    _, B, shape, absmax, blocksize, quant_type, dtype, bias, absmax_8bit, absmax_code, absmax_offset = inputs
    ctx.weight = (B, tuple(shape), absmax, blocksize, quant_type, dtype, absmax_8bit, absmax_code, absmax_offset)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _dequantized(weight: tuple[Any, ...]) -> torch.Tensor:
    """The weight as ``MatMul4Bit.backward`` dequantizes it: bitsandbytes' own ``dequantize_4bit``."""
    B, shape, absmax, blocksize, quant_type, dtype, absmax_8bit, absmax_code, absmax_offset = weight
    functional = bitsandbytes().functional
    nested = None
    if absmax_8bit is not None:
        nested = functional.QuantState(absmax=absmax, code=absmax_code, blocksize=_NESTED_BLOCKSIZE, dtype=torch.float32)
    state = functional.QuantState(
        absmax=absmax if nested is None else absmax_8bit, shape=torch.Size(shape), blocksize=blocksize,
        quant_type=quant_type, dtype=dtype, offset=absmax_offset, state2=nested,
    )  # fmt: skip
    return functional.dequantize_4bit(B.view(-1, 1), state)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """``MatMul4Bit.backward``: the input's gradient through a fresh dequantized weight; none for the weight."""
    grad_a = grad_bias = None
    if ctx.needs_input_grad[7]:
        grad_bias = grad.sum(0, dtype=ctx.bias_dtype)
    if ctx.needs_input_grad[0]:
        grad_a = torch.matmul(grad, _dequantized(ctx.weight).to(grad.dtype))
    return grad_a, None, None, None, None, None, None, grad_bias, None, None, None


matmul_4bit.register_autograd(_backward, setup_context=_setup_context)


def _op_matmul_4bit(original: Any) -> Any:
    """``bitsandbytes.matmul_4bit`` calling ``fxmem::matmul_4bit`` where it would call ``MatMul4Bit``;
    the paths that run no autograd.Function (a weight stored as [K, N], CPU inference packing) stay bitsandbytes'."""

    def matmul(A: torch.Tensor, B: torch.Tensor, quant_state: Any, out: Any = None, bias: Any = None) -> Any:
        k = A.shape[-1]
        transposed = k == quant_state.shape[0] and k != quant_state.shape[1]  # a weight stored as [K, N]
        if out is not None or transposed or getattr(quant_state, "packing_format_for_cpu", False) or A.numel() == 0:
            return original(A, B, quant_state, out=out, bias=bias)
        nested = quant_state.state2 if quant_state.nested else None
        return matmul_4bit(
            A, B, list(quant_state.shape), quant_state.absmax if nested is None else nested.absmax,
            quant_state.blocksize, quant_state.quant_type, quant_state.dtype, bias,
            None if nested is None else quant_state.absmax, None if nested is None else nested.code,
            None if nested is None else quant_state.offset,
        )  # fmt: skip

    return matmul


def _quant_state_from(states: Mapping[int, Any]) -> Any:
    """``fix_4bit_weight_quant_state_from_module`` for export's fake weights: hand each one its module's
    ``QuantState`` (Note [bitsandbytes' 4-bit matmul in a graph])."""

    def fix(module: nn.Module) -> None:
        weight = module.weight
        if getattr(weight, "quant_state", None) is None:
            weight.quant_state = states.get(id(module), getattr(module, "quant_state", None))

    return fix


@contextlib.contextmanager
def quantized_linears_as_ops(model: nn.Module) -> Iterator[None]:
    """While ``model`` is traced, its 4-bit linears call fxmem's ops: bitsandbytes' ``fxmem::matmul_4bit``
    (Note [bitsandbytes' 4-bit matmul in a graph]), torchao's ``fxmem::linear_nf4`` (Note [torchao's
    NF4 linear in a graph]). Nothing changes for a model without any."""
    with contextlib.ExitStack() as stack:
        bnb = bitsandbytes()
        states = {id(m): quant_state(m.weight) for m in model.modules() if quant_state(getattr(m, "weight", None)) is not None}
        if bnb is not None and states:
            stack.enter_context(_patched(bnb, "matmul_4bit", _op_matmul_4bit(bnb.matmul_4bit)))
            stack.enter_context(_patched(bnb.nn.modules, "fix_4bit_weight_quant_state_from_module", _quant_state_from(states)))
        nf4 = nf4_tensor_type()
        if nf4 is not None and any(isinstance(p, nf4) for p in model.parameters()):
            function = sys.modules[nf4.__module__].LinearNF4
            stack.enter_context(_patched(function, "apply", staticmethod(_op_linear_nf4), inherited=True))
        yield


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any, *, inherited: bool = False) -> Iterator[None]:
    """``owner.name`` set to ``value`` for the block; an ``inherited`` attribute is deleted again after it."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if inherited:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


# Note [torchao's NF4 linear in a graph]
#     torchao 0.18 (quantization/quantize_/workflows/nf4/nf4_tensor.py) runs ``linear_nf4(input,
#     weight)``, and ``F.linear`` or ``aten.mm`` on an ``NF4Tensor``, as ``LinearNF4``, an
#     autograd.Function: its forward is ``F.linear(input, weight.to(input.dtype))``, where ``.to``
#     dequantizes (``get_original_weight``: the codes' two nibbles as int64 indices, each looked up in
#     the NF4 table and scaled by the dequantized scalers, stacked and reshaped: plain ATen ops, whose
#     fake kernels size every temporary), and it saves the ``NF4Tensor`` weight itself, a frozen
#     parameter; its backward is ``grad_output @ weight.to(grad_output.dtype)``, a second
#     dequantization. torch.fx and torch.export trace through ``LinearNF4.forward`` and drop the
#     Function: the replayed linear would save the dequantized weight and the backward would make
#     none. While tracing, ``LinearNF4.apply`` is ``_op_linear_nf4``: the dequantization stays in the
#     graph as torchao's own ops, and ``fxmem::linear_nf4`` multiplies, saving nothing; its backward
#     rebuilds the ``NF4Tensor`` from its inner tensors and runs torchao's expression. The simulated
#     step needs the weight as an ``NF4Tensor`` of fake inner tensors (``fake_quantized`` in
#     fxmem/rules/nf4.py), not as a plain fake tensor of its logical size. Measured here to 8 bytes of a
#     real CPU step, fx and export alike (tests/test_qlora.py).

_NF4_INNER = ("quantized_data", "scaler_mean", "quantization_factor", "quantized_scalers", "nf4")
"""The inner tensors of an ``NF4Tensor`` (``__tensor_flatten__``), in the order ``fxmem::linear_nf4`` takes them."""


@torch.library.custom_op("fxmem::linear_nf4", mutates_args=())
def linear_nf4(
    input: torch.Tensor,
    weight: torch.Tensor,
    quantized_data: torch.Tensor,
    scaler_mean: torch.Tensor,
    quantization_factor: torch.Tensor,
    quantized_scalers: torch.Tensor,
    nf4: torch.Tensor,
) -> torch.Tensor:
    """``LinearNF4``'s product with its autograd (Note [torchao's NF4 linear in a graph]): ``weight`` is
    the dequantized weight, which it does not keep; the inner tensors are the ``NF4Tensor``'s."""
    return torch.nn.functional.linear(input, weight)


@linear_nf4.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, *_: Any) -> torch.Tensor:
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


def _setup_linear_nf4(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    """Keep the ``NF4Tensor``'s parts on ``ctx``: they are the frozen weight, which ``LinearNF4`` saves."""
    ctx.shape = tuple(inputs[1].shape)
    ctx.inner = inputs[2:]


def _nf4_weight(shape: tuple[int, ...], inner: Sequence[torch.Tensor]) -> torch.Tensor:
    """The ``NF4Tensor`` ``inner`` make (``from_tensor``'s layout: one scaler a block, one factor a scaler block)."""
    module = sys.modules[nf4_tensor_type().__module__]  # type: ignore[union-attr]
    quantized_data, scaler_mean, quantization_factor, quantized_scalers, table = inner
    n_blocks = quantized_scalers.numel()
    meta = module.SubclassTensorArgs(torch.Size(shape), (shape[1], 1), 0, table.dtype, quantized_data.device, False)
    block_size = 2 * quantized_data.numel() // n_blocks
    scaler_block_size = n_blocks // quantization_factor.numel()
    return module.NF4Tensor(
        meta, block_size, n_blocks, scaler_block_size, quantized_scalers, quantization_factor, scaler_mean, quantized_data, table
    )


def _backward_linear_nf4(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """``LinearNF4.backward``: ``grad_output @ weight.to(grad_output.dtype)``, the weight dequantized anew."""
    grad_input = grad @ _nf4_weight(ctx.shape, ctx.inner).to(grad.dtype) if ctx.needs_input_grad[0] else None
    return grad_input, None, None, None, None, None, None


linear_nf4.register_autograd(_backward_linear_nf4, setup_context=_setup_linear_nf4)


def _op_linear_nf4(input: torch.Tensor, weight: Any) -> Any:
    """``LinearNF4.apply`` while tracing: torchao's dequantization, then ``fxmem::linear_nf4``. (Under
    torch.fx the inner tensors are lazy attribute proxies: held in no local, which fxmem's recorder of
    Python locals would make into nodes while fx makes one.)"""
    return linear_nf4(input, weight.to(input.dtype), *(getattr(weight, name) for name in _NF4_INNER))


# Note [The forward's dequantized copies]
#     What ``gemm_4bit`` allocates and frees inside (Note [bitsandbytes' 4-bit matmul in a graph]):
#     - CPU, every size (backends/default/ops.py ``_gemm_4bit_default_impl``; no CPU kernel is
#       registered for training: the fused ``gemv_4bit`` runs only for inference-packed weights):
#       with nested statistics one fp32 absmax per block alive with the weight (the first,
#       ``dequantize_blockwise``'s, dies at the ``+ offset``, before the weight is made), and the
#       weight, ``shape[0] x shape[1]`` in the input's dtype. Measured here: tests/test_qlora.py.
#     - CUDA (backends/cuda/ops.py, the ``gemm_4bit`` kernel registered for "cuda"), modelled from
#       bitsandbytes' source, not run: at most 4 rows (``_GEMM_4BIT_CUSTOM_FLOOR_M``) the fused
#       ``cgemm_4bit`` kernel, nothing beside the output; above 1,536 rows ``_dequant_linear_fallback``,
#       which keeps both fp32 absmaxes (``absmax_dq`` stays bound while ``absmax_dq + offset`` is made)
#       beside the weight. Between the two the kernel is chosen per GPU architecture and shape
#       (``_gemm_4bit_use_custom_cuda``); fxmem charges the fallback's copies there, the larger of the two.

_CUDA_NOTE = (
    "bitsandbytes' 4-bit matmuls on CUDA are modelled from bitsandbytes' source, not run: each backward dequantizes the "
    "weight into a fresh tensor, and so does each forward above 1,536 rows, with its fp32 absmax; fxmem assumes the "
    "forward does from 5 rows on, where the GPU's architecture picks between that and a fused kernel that makes no copy"
)
_CPU_HALF_NOTE = (
    "bitsandbytes' 4-bit matmuls in bf16/fp16 on the CPU run through oneDNN, whose scratchpad inside each matmul "
    "(tens of KiB at small sizes) fxmem does not count"
)


_A, _SHAPE, _ABSMAX_8BIT = 0, 2, 8
"""Positions in ``fxmem::matmul_4bit``'s schema: the input, the weight's shape, the nested absmax."""
_CUDA_FUSED_ROWS = 4
"""bitsandbytes 0.50, backends/cuda/ops.py ``_GEMM_4BIT_CUSTOM_FLOOR_M``: up to this many rows the fused kernel runs."""


def _argument(args: Sequence[Any], kwargs: Mapping[str, Any], index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


def _dequantized_bytes(args: Sequence[Any], kwargs: Mapping[str, Any], absmax_copies: int) -> object:
    """The weight dequantized in the input's dtype, and ``absmax_copies`` fp32 absmaxes where the statistics are nested."""
    a, shape, nested = args[_A], args[_SHAPE], _argument(args, kwargs, _ABSMAX_8BIT, "absmax_8bit")
    absmax = 0 if nested is None else absmax_copies * nested.numel() * 4
    return shape[0] * shape[1] * a.element_size() + absmax


@register_workspace_rule(("fxmem.matmul_4bit", "cpu"))
def cpu_matmul_4bit_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The CPU forward's dequantized weight and absmax. See Note [The forward's dequantized copies]."""
    if args[_A].dtype in (torch.bfloat16, torch.float16):
        note_code_path(_CPU_HALF_NOTE)
    return _dequantized_bytes(args, kwargs, absmax_copies=1)


@register_workspace_rule(("fxmem.matmul_4bit", "cuda"))
def cuda_matmul_4bit_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The CUDA forward's copies, from bitsandbytes' source. See Note [The forward's dequantized copies]."""
    note_code_path(_CUDA_NOTE)
    a = args[_A]
    rows = a.numel() // a.shape[-1]
    if statically_known_true(rows <= _CUDA_FUSED_ROWS):
        return 0
    return _dequantized_bytes(args, kwargs, absmax_copies=2)
