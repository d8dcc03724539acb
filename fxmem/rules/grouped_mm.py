"""``grouped_mm`` as eager CPU runs it, for the dtypes whose meta kernel refuses it.

Note [grouped_mm on fake tensors]
    transformers 5 runs a mixture-of-experts layer's matmuls as one ``torch.nn.functional.grouped_mm``
    (``integrations/moe.py``, ``grouped_mm_experts_forward``) in an eager step, float32 included on the
    CPU. Its meta kernel (``_meta_grouped_mm_common`` in torch/_meta_registrations.py) accepts only
    bfloat16 (the CUDA kernel's rule), so on fake tensors a float32 layer cannot run it, and under
    torch.export transformers takes its own ``grouped_mm_fallback`` custom op instead, which keeps the
    offsets as a Python attribute rather than saving them.

    What eager's ``_grouped_mm`` does, measured on the CPU (torch 2.13, tests/test_grouped_mm.py): the
    forward allocates its (S, N) output; autograd saves the weight, the offsets and the input (an int32
    offset per expert: 16 bytes for 4 experts, which the fallback leaves out); backward computes the
    weight's gradient and the input's, each by one ``_grouped_mm``, their sizes and nothing more.
    ``fxmem::grouped_mm`` is that op with a shape-only fake kernel: on real tensors it calls
    ``torch._grouped_mm`` itself, so a graph exported with it still runs for real (fxmem.measure).
    While transformers' eager paths are exported (Note [Eager code paths under torch.export] in
    fxmem/frontends/hf_paths.py), ``torch.nn.functional.grouped_mm`` on a 2-D input and 3-D weights
    of another dtype than bfloat16 calls it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["eager_grouped_mm"]


@torch.library.custom_op("fxmem::grouped_mm", mutates_args=())
def _grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(mat_a, mat_b, offs=offs)


@_grouped_mm.register_fake
def _(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return mat_a.new_empty(mat_a.shape[0], mat_b.shape[-1])


@torch.library.custom_op("fxmem::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward(grad: torch.Tensor, mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_b = torch._grouped_mm(mat_a.t(), grad, offs=offs)  # eager computes the weight's gradient first
    grad_a = torch._grouped_mm(grad, mat_b.transpose(-2, -1), offs=offs)
    return grad_a, grad_b


@_grouped_mm_backward.register_fake
def _(grad: torch.Tensor, mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(mat_a), torch.empty_like(mat_b)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    mat_a, mat_b, offs = inputs
    ctx.save_for_backward(mat_b, offs, mat_a)  # what eager's GroupedMmBackward0 saves, in its order


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    mat_b, offs, mat_a = ctx.saved_tensors
    grad_a, grad_b = torch.ops.fxmem.grouped_mm_backward(grad, mat_a, mat_b, offs)
    return grad_a, grad_b, None


_grouped_mm.register_autograd(_backward, setup_context=_setup)


def eager_grouped_mm(original: Any) -> Any:
    """``torch.nn.functional.grouped_mm`` that takes ``fxmem::grouped_mm`` where the meta kernel would refuse
    the dtype (Note [grouped_mm on fake tensors]); everything else as ``original``."""

    def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, *, offs: torch.Tensor | None = None, bias: Any = None, out_dtype: Any = None) -> Any:
        plain = offs is not None and bias is None and out_dtype is None and mat_a.dim() == 2 and mat_b.dim() == 3
        if plain and mat_a.dtype == mat_b.dtype and mat_a.dtype != torch.bfloat16:
            return torch.ops.fxmem.grouped_mm(mat_a, mat_b, offs)
        return original(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)

    return grouped_mm
