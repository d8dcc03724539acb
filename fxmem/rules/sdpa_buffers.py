"""What SDPA's CUDA kernels allocate and free inside, which no fake tensor shows: workspace rules.

fxmem/rules/sdpa.py picks the backend and calls its op; the rules here (registered in
fxmem/rules/ops.py) charge the buffers each backend's forward and backward make beside their outputs,
measured on an H200 (tests/data/h200/trace_sdpa.json.gz; tests/test_sdpa.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxmem.results import WorkspaceLines

__all__ = [
    "cudnn_attention_backward_workspace",
    "cudnn_attention_workspace",
    "efficient_attention_backward_workspace",
    "efficient_attention_host_seeds",
    "efficient_attention_workspace",
    "safe_softmax_workspace",
    "softmax_backward_workspace",
]

_HALF = (torch.float16, torch.bfloat16)


def _known(condition: Any) -> bool:
    return bool(statically_known_true(condition))


# Note [SDPA kernels' own buffers on CUDA]
#     Measured on the H200 (tests/data/h200/trace_sdpa.json.gz, torch 2.11, cuDNN 9.19, every case):
#     - cuDNN forward: a 256-byte workspace. Backward: cuDNN frontend's dQ accumulator, fp32 (B, Hq,
#       Sq, Dqk), and softmax sum, fp32 (B, Hq, Sq) (``CompositeSDPABackwardNode``), 256 bytes more,
#       and with fewer key heads than query heads dK and dV per query head in the input's dtype, B *
#       Hq * Skv * (Dqk + Dv) (reduced into the key heads; measured for 8/2 heads, where an fp32 dK
#       alone would be as large).
#     - memory-efficient forward (``_efficient_attention_forward``, attention.cu): fp16/bf16 with a head
#       dim above 128 runs the ``gmem`` kernel (dispatch_cutlassF), which needs an fp32 output
#       accumulator (B, L, H, Dv). Its philox seed and offset are host tensors (CPU scalars), so they
#       take no GPU memory, though autograd saves them.
#     - memory-efficient backward (``_efficient_attention_backward``, attention_backward.cu): a
#       contiguous copy of the output's gradient where its (B, L, H, D) view is not contiguous; delta,
#       fp32 (B, H, L), computed by the half kernels, for fp32 as ``(grad_out * out).sum(-1)``
#       transposed and made contiguous (the product and the row sum are freed before the workspace);
#       and the kernel's workspace, ``p.workspace_size()`` (kernel_backward.h): per batch and head,
#       aligned to 4 floats, dQ's accumulation tiles, ceil(L / kBlockSizeI) * ceil(D / kBlockSizeJ) of
#       (kBlockSizeI * kBlockSizeJ + 4) floats (``GradQTempStorage``: a lock, a counter, two pads and
#       the tile), and for half kernels that cannot keep dK and dV in registers (kMaxK > kBlockSizeI)
#       num_splits * kBlockSizeJ * align(D, kBlockSizeI) floats for each of dK and dV, num_splits being
#       ceil(S / kBlockSizeJ), 1 where B * H >= 256 and S <= 2 * kBlockSizeJ, at most 200 // (B * H).
#       The kernel is the first of dispatch_cutlassB's sm80 list whose kMaxK covers the head dims
#       (assumed to fit in shared memory, as on the H200; sm86/89's extra k96 kernel is not modelled).
#     - math: ``_safe_softmax`` (attention.cpp) marks -inf scores (bool, like its input), reduces them per
#       row (bool) and makes a zero scalar, then writes into its result. Its backward,
#       ``_softmax_backward_data``, computes ``grad * output`` into a temporary before its kernel runs
#       (``softmax_backward_cuda_out``, aten/src/ATen/native/cuda/SoftMax.cu): every softmax's backward
#       on CUDA does, not only attention's.


_CUDNN_WORKSPACE = 256


def cudnn_attention_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """cuDNN attention's forward workspace. See Note [SDPA kernels' own buffers on CUDA]."""
    return _CUDNN_WORKSPACE


def cudnn_attention_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """cuDNN attention's backward buffers. See Note [SDPA kernels' own buffers on CUDA]."""
    q, k, v = args[1], args[2], args[3]
    b, hq, s_q, d_qk = q.shape
    per_query_head = 0 if _known(k.shape[1] == hq) else b * hq * k.shape[2] * (d_qk + v.shape[3]) * q.element_size()
    return b * hq * s_q * d_qk * 4 + b * hq * s_q * 4 + _CUDNN_WORKSPACE + per_query_head


def efficient_attention_host_seeds(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> dict[int, object]:
    """No GPU bytes for the philox seed and offset (outputs 2, 3). See Note [SDPA kernels' own buffers on CUDA]."""
    return {2: 0, 3: 0}


def efficient_attention_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The fp32 output accumulator of the half ``gmem`` kernel. See Note [SDPA kernels' own buffers on CUDA]."""
    q, v = args[0], args[2]
    if q.dtype not in _HALF or (_known(q.shape[3] <= 128) and _known(v.shape[3] <= 128)):
        return 0
    return q.shape[0] * q.shape[1] * q.shape[2] * v.shape[3] * 4


@dataclass(frozen=True)
class _BackwardKernel:
    """An AttentionBackwardKernel instance of dispatch_cutlassB: kBlockSizeI, kBlockSizeJ, kMaxK."""

    block_i: int
    block_j: int
    max_k: int


_F32_BACKWARD = tuple(
    _BackwardKernel(*k) for k in ((64, 64, 32), (64, 64, 64), (128, 64, 128), (64, 64, 128), (128, 64, 65536), (64, 64, 65536))
)
_HALF_BACKWARD = tuple(
    _BackwardKernel(*k) for k in ((64, 64, 32), (64, 64, 64), (128, 128, 128), (64, 64, 128), (128, 64, 65536), (64, 64, 65536))
)


def efficient_attention_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The memory-efficient backward's transient buffers. See Note [SDPA kernels' own buffers on CUDA]."""
    grad_out, q, k, v = args[0], args[1], args[2], args[3]
    b, h, m, d = q.shape
    n, dv = k.shape[2], v.shape[3]
    half = q.dtype in _HALF
    kernel = next(
        (x for x in (_HALF_BACKWARD if half else _F32_BACKWARD) if _known(x.max_k >= d) and _known(x.max_k >= dv)), _F32_BACKWARD[-1]
    )
    copy = 0 if _bshd_contiguous(grad_out) else grad_out.numel() * grad_out.element_size()
    delta = b * h * m * 4
    kernel_bytes = lambda splits: b * h * _align(_accumulators(kernel, half, m, d, dv, splits), 4) * 4
    if half and isinstance(b, int) and isinstance(n, int):
        return copy + delta + kernel_bytes(_splits(kernel, b * h, n))
    if half:  # with a symbolic batch, the line of one split: what any batch of 200 // H or more gets
        return WorkspaceLines((copy + delta + kernel_bytes(1),), lambda batch: isinstance(n, int) and _splits(kernel, batch * h, n) == 1)
    product_and_sum = b * m * h * dv * 4 + b * m * h * 4  # (grad_out * out) and its row sum, freed before the kernel runs
    lines = (copy + product_and_sum + delta, copy + delta + kernel_bytes(1))
    return WorkspaceLines(lines) if any(isinstance(x, torch.SymInt) for x in lines) else max(lines)


def _accumulators(kernel: _BackwardKernel, half: bool, m: Any, d: Any, dv: Any, splits: int) -> Any:
    """Per batch and head, in floats: dQ's tiles, and dK's and dV's for half kernels that do not keep them in registers."""
    bi, bj = kernel.block_i, kernel.block_j
    grad_q = _ceil_div(m, bi) * _ceil_div(d, bj) * (bi * bj + 4)
    if not half or kernel.max_k <= bi:
        return grad_q
    return grad_q + splits * bj * (_align(d, bi) + _align(dv, bi))


def _splits(kernel: _BackwardKernel, batch_heads: int, n: int) -> int:
    """num_splits_key for a half kernel that accumulates dK and dV in memory (attention_backward.cu)."""
    splits = 1 if batch_heads >= 256 and n <= 2 * kernel.block_j else _ceil_div(n, kernel.block_j)
    return max(min(splits, 200 // batch_heads), 1)


def _bshd_contiguous(t: torch.Tensor) -> bool:
    """Whether ``t`` (B, H, L, D) is laid out as a contiguous (B, L, H, D): the kernel then takes it as it is."""
    _, h, m, d = t.shape
    strides = (m * h * d, d, h * d, 1)
    return all(_known(size == 1) or _known(stride == want) for size, stride, want in zip(t.shape, t.stride(), strides))


def _ceil_div(a: Any, b: int) -> Any:
    return -(-a // b)


def _align(a: Any, b: int) -> Any:
    return _ceil_div(a, b) * b


def safe_softmax_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """``_safe_softmax``'s -inf marks, its per-row reduction and its zero. See Note [SDPA kernels' own buffers on CUDA]."""
    x = args[0]
    dim = int(args[1] if len(args) > 1 else kwargs["dim"]) % x.dim()
    rows = math.prod(size for i, size in enumerate(x.shape) if i != dim)
    return x.numel() + rows + out.element_size()


def softmax_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The ``grad * output`` temporary of CUDA's softmax backward. See Note [SDPA kernels' own buffers on CUDA]."""
    grad, output = args[0], args[1]
    return grad.numel() * torch.promote_types(grad.dtype, output.dtype).itemsize
