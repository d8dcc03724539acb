"""Scaled dot-product attention on a CUDA target: the backend torch picks, what it keeps, what it borrows.

``run_sdpa`` calls the chosen kernel's own ATen op on fake CPU tensors (their meta kernels run there),
so that autograd itself records what the kernel's derivative saves (tools/autograd/derivatives.yaml);
the math path is a Python copy of its composite that takes CUDA's fused dropout. The workspace rules at
the end (registered in fxmem/rules/ops.py) charge what the kernels allocate and free inside, which no
fake tensor shows. ``fxmem/gpu/target.py`` routes every ``scaled_dot_product_attention`` of a cuda-target
pass here, with the torch release the training job runs (``--torch-version``; default: fxmem's own).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxmem.rules import TorchRelease, torch_release

__all__ = [
    "CUDNN_VERSION",
    "Capability",
    "SdpBackend",
    "TorchVersion",
    "choose_sdp_backend",
    "run_sdpa",
]

aten = torch.ops.aten
Capability = tuple[int, int]
TorchVersion = TorchRelease
"""(major, minor) of a torch release, e.g. (2, 11)."""

CUDNN_VERSION = 91900
"""The runtime cuDNN assumed on the target (cuDNN 9.19.0, 91900 in cuDNN's numbering): what the
torch 2.11.0+cu130 wheels loaded on the H200 that tests/data/h200 was measured on."""


class SdpBackend(StrEnum):
    """The kernels ``select_sdp_backend`` chooses among."""

    CUDNN = "cudnn"
    FLASH = "flash"
    EFFICIENT = "efficient"
    MATH = "math"


# Note [SDPA on the cuda target]
#     ``select_sdp_backend`` (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) tries the backends
#     in the context's priority order, flash, memory-efficient, math, cuDNN, and takes the first whose
#     ``can_use_*`` checks all pass; math always can. ``priority_order`` puts cuDNN first where
#     ``check_prefer_cudnn_attention`` holds: a runtime cuDNN above 9.15 on sm9x/sm10x with minor 0 or 3.
#     Each check below names its function in sdp_utils.cpp or sdp_utils_cpp.h. A symbolic size passes
#     a check only when it is known to (``TORCH_GUARD_OR_FALSE``), but for cuDNN's batch limit, which a
#     symbolic batch, standing for the batches the GPU runs, is taken to meet.
#     Read for 2.11: a stored sdp_utils.cpp of early 2026 (a downstream copy of upstream with
#     pytorch#172621's DeepSeek head dims; cuDNN head dims up to 256 on sm90 from cuDNN 9.10; no
#     dropout-resolution or pointer-alignment check), borne out by the H200's choice in all 868
#     measured calls (tests/test_sdpa.py), and stored copies of attention.cpp. For 2.13: the
#     sdp_utils_cpp.h installed with torch 2.13.0 (``check_attn_mask_shape``, taken for 2.11 too;
#     ``check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads>``; the mask-stride
#     test of ``check_last_dim_stride_equals_1_dense``), pytorch/pytorch's stored sdp_utils.cpp from
#     after 2.14's branch cut (commit 001f694a) and the pull requests in between. Came in after 2.11,
#     each gated below by the first release that has it (2.13's branch was cut on 2026-06-08):
#     - ``check_cudnn_dropout`` (pytorch#174245, merged 2026-02-26): cuDNN only for a dropout
#       probability that is a multiple of 1/16, so p = 0.1 goes to flash, or past it;
#     - batch and heads at most 65535 in ``check_cudnn_tensor_shapes`` (pytorch#180718, 2026-04-20);
#     - ``check_data_ptr_alignment_mem_efficient`` (pytorch#184258, 2026-05-18): q, k, v offsets aligned.
#     Not in 2.13: memory-efficient GQA (pytorch#191085, 2026-07; its third template parameter of
#     ``check_batch_size_and_num_heads_dense``, ``supports_mqa``, is not in 2.13's header). Unsettled:
#     cuDNN's head dims above 128 only on cuDNN > 9.22, with the backward limited to d <= 128, 192/128
#     or 256/256 (pytorch#185553, opened 2026-05-28), taken here as after 2.13. Runtime switches
#     (``sdpa_kernel``, deterministic mode, ``TORCH_CUDNN_SDPA_DEPRIORITIZED``) are at their defaults.
_CUDNN_DROPOUT_RESOLUTION: TorchVersion = (2, 12)
_CUDNN_DIM_LIMIT: TorchVersion = (2, 13)
_MEM_EFF_POINTER_ALIGNMENT: TorchVersion = (2, 13)
_FLASH_MAX_HEAD_DIM = 256  # check_head_dim_size_flash
_CUDNN_MAX_DIM = 65535  # check_cudnn_tensor_shapes: batch and heads
_FLASH_SM = ((8, 0), (12, 1))  # check_flash_attention_hardware_support: [sm80, sm121]
_EFFICIENT_SM = ((5, 0), (12, 1))  # check_mem_efficient_hardware_support: [sm50, sm121]
_CUDNN_SM = ((8, 0), (12, 1))  # check_cudnn_hardware_support: [sm80, sm121]
_HALF = (torch.float16, torch.bfloat16)


def _torch_version(version: TorchVersion | None) -> TorchVersion:
    return version if version is not None else torch_release()


@dataclass(frozen=True)
class _Call:
    """One ``scaled_dot_product_attention`` call, as ``sdp_params`` holds it."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    dropout: float
    causal: bool
    gqa: bool


@dataclass(frozen=True)
class _Target:
    """The GPU and the software on it."""

    cap: Capability
    torch: TorchVersion
    cudnn: int


def choose_sdp_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
    capability: Capability,
    version: TorchVersion | None = None,
    cudnn: int = CUDNN_VERSION,
) -> SdpBackend:
    """The backend CUDA's ``select_sdp_backend`` picks on an sm``capability`` GPU running torch ``version``
    (None: the one fxmem runs with) with runtime cuDNN ``cudnn``. See Note [SDPA on the cuda target].

    >>> q = torch.empty(2, 4, 16, 64, dtype=torch.bfloat16, device="meta")
    >>> choose = lambda cap: str(choose_sdp_backend(q, q, q, attn_mask=None, dropout_p=0.0, is_causal=True, enable_gqa=False, capability=cap))
    >>> choose((9, 0)), choose((8, 0))
    ('cudnn', 'flash')
    """
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    target = _Target(capability, _torch_version(version), cudnn)
    for backend in _priority(target):
        if _CAN_USE[backend](call, target):
            return backend
    return SdpBackend.MATH


def _priority(t: _Target) -> tuple[SdpBackend, ...]:
    """priority_order: cuDNN first where check_prefer_cudnn_attention holds, else last (after math)."""
    prefer_cudnn = t.cudnn > 91500 and t.cap[0] in (9, 10) and t.cap[1] in (0, 3)
    fused = (SdpBackend.FLASH, SdpBackend.EFFICIENT, SdpBackend.MATH)
    return (SdpBackend.CUDNN, *fused) if prefer_cudnn else (*fused, SdpBackend.CUDNN)


def _known(condition: Any) -> bool:
    return bool(statically_known_true(condition))


def _in_range(capability: Capability, bounds: tuple[Capability, Capability]) -> bool:
    """check_sm_version<lower, upper>: inclusive on (major, minor)."""
    return bounds[0] <= capability <= bounds[1]


def _four_dims(c: _Call) -> bool:
    """check_tensor_shapes: q, k and v 4-D."""
    return c.q.dim() == c.k.dim() == c.v.dim() == 4


def _heads(c: _Call, supports_gqa: bool, same_kv_heads: bool = True) -> bool:
    """check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads>: one batch size; with
    ``enable_gqa`` on a backend that takes it, check_grouped_query_attention, else equal heads."""
    (b, hq), (bk, hk), (bv, hv) = c.q.shape[:2], c.k.shape[:2], c.v.shape[:2]
    if not (_known(b == bk) and _known(b == bv)):
        return False
    if c.gqa and supports_gqa:
        if same_kv_heads and not _known(hk == hv):
            return False
        return _known(hq % hk == 0) and (same_kv_heads or _known(hq % hv == 0))
    return _known(hq == hk) and _known(hq == hv)


def _nonzero_seqs(c: _Call) -> bool:
    """check_nonzero_sequence_lengths_dense."""
    return _known(c.q.shape[-2] > 0) and _known(c.k.shape[-2] > 0)


def _last_stride_one(c: _Call, ignore_singleton: bool) -> bool:
    """check_last_dim_stride_equals_1_dense<ignore_singleton_dim>, with its GPU test of the mask's last stride."""
    unit = all(_known(t.stride(-1) == 1) for t in (c.q, c.k, c.v))
    unit = unit or (ignore_singleton and _known(c.q.shape[-1] == 1))
    return unit and (c.mask is None or _known(c.mask.stride(-1) == 1))


def _mask_shape(c: _Call) -> bool:
    """check_attn_mask_shape: a mask that needs no gradient (cuDNN's backward returns none for it, see
    Note [An attention bias that requires grad]), 2-D (L, S) or 4-D (B, H, L, S), each dim equal to the
    query's or 1."""
    m = c.mask
    if m is None:
        return True
    if m.requires_grad:
        return False
    fits = lambda size, target: _known(size == target) or (isinstance(size, int) and size == 1)
    if not (fits(m.shape[-2], c.q.shape[2]) and fits(m.shape[-1], c.k.shape[2])):
        return False
    return m.dim() == 2 or (m.dim() == 4 and fits(m.shape[0], c.q.shape[0]) and fits(m.shape[1], c.q.shape[1]))


def _can_use_cudnn(c: _Call, t: _Target) -> bool:
    """can_use_cudnn_attention's checks, in its order."""
    if c.dropout > 0.0 and 91100 < t.cudnn < 91400:  # no dropout on cuDNN 9.11 to 9.13
        return False
    low_precision = _HALF if t.cap[0] >= 8 else (torch.float16,)  # check_dtypes_low_precision
    general = _four_dims(c) and all(x.dtype in low_precision for x in (c.q, c.k, c.v)) and _mask_shape(c)
    if not (general and _in_range(t.cap, _CUDNN_SM)):
        return False
    if t.torch >= _CUDNN_DROPOUT_RESOLUTION and c.dropout * 16.0 != math.floor(c.dropout * 16.0):  # check_cudnn_dropout
        return False
    dense = _nonzero_seqs(c) and _last_stride_one(c, ignore_singleton=True) and _heads(c, supports_gqa=True, same_kv_heads=False)
    return dense and _cudnn_shapes(c, t)


def _cudnn_shapes(c: _Call, t: _Target) -> bool:
    """check_cudnn_tensor_shapes."""
    # a symbolic batch stands for the batches a GPU runs, all far below the limit: only a known excess fails
    if t.torch >= _CUDNN_DIM_LIMIT and (_known(c.q.shape[0] > _CUDNN_MAX_DIM) or _known(c.q.shape[1] > _CUDNN_MAX_DIM)):
        return False
    s_q, s_k, d_qk, d_v = c.q.shape[2], c.k.shape[2], c.q.shape[3], c.v.shape[3]
    if t.cudnn < 8903 or (t.cudnn < 8906 and c.dropout != 0.0):
        return False
    limit = _cudnn_head_dim_limit(d_qk, d_v, t)
    if not (_known(d_qk <= limit) and _known(d_v <= limit) and _known(d_qk % 8 == 0) and _known(d_v % 8 == 0)):
        return False
    if t.cudnn < 8906 and not _known(s_k % 64 == 0):
        return False
    aligned = _known(s_q % 64 == 0) and _known(s_k % 64 == 0)
    if t.cudnn < 90000 and (not _known(s_q >= 64) or (c.dropout != 0.0 and not aligned)):
        return False
    return _known(s_k != 1) and (c.dropout == 0.0 or _known(s_q != 1))


def _cudnn_head_dim_limit(d_qk: Any, d_v: Any, t: _Target) -> int:
    """256 on sm90 from cuDNN 9.10; 192 on sm10x from 9.11 for the DeepSeek shape (192, 128); else 128."""
    if t.cudnn >= 91000 and t.cap == (9, 0):
        return 256
    if t.cudnn >= 91100 and t.cap[0] == 10 and _known(d_qk == 192) and _known(d_v == 128):
        return 192
    return 128


def _can_use_flash(c: _Call, t: _Target) -> bool:
    """can_use_flash_attention's checks, in its order."""
    d = c.q.shape[-1]
    if not _four_dims(c) or c.mask is not None:  # check_for_attn_mask
        return False
    if not (_known(d == c.k.shape[-1]) and _known(d == c.v.shape[-1]) and _known(d <= _FLASH_MAX_HEAD_DIM)):
        return False
    if not _in_range(t.cap, _FLASH_SM):
        return False
    sm86_89_or_120 = _in_range(t.cap, ((8, 6), (8, 9))) or _in_range(t.cap, ((12, 0), (12, 1)))
    if sm86_89_or_120 and _grad_wanted(c.q, c.k, c.v) and not (_known(d <= 192) or (c.dropout == 0.0 and _known(d > 224))):
        return False  # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
    if c.causal and not _known(c.q.shape[-2] == c.k.shape[-2]):  # check_flash_causal_non_square_seqlens
        return False
    if not all(x.dtype in _HALF for x in (c.q, c.k, c.v)):  # check_dtypes_flash_attention (sm80+)
        return False
    return _heads(c, supports_gqa=True) and _nonzero_seqs(c) and _last_stride_one(c, ignore_singleton=True)


def _can_use_efficient(c: _Call, t: _Target) -> bool:
    """can_use_mem_efficient_attention's checks, in its order."""
    if not (_in_range(t.cap, _EFFICIENT_SM) and _four_dims(c)):
        return False
    align = _gemm_alignment(c.q.dtype, t.cap)
    d, dv = c.q.shape[-1], c.v.shape[-1]
    if not (_known(d == c.k.shape[-1]) and _known(d % align == 0) and _known(dv % align == 0) and _known(d > 0)):
        return False  # check_head_dim_size_mem_efficient: no upper bound on CUDA
    if t.torch >= _MEM_EFF_POINTER_ALIGNMENT and t.cap >= (8, 0) and any(_known(x.storage_offset() % align != 0) for x in (c.q, c.k, c.v)):
        return False  # check_data_ptr_alignment_mem_efficient (offset * element size vs alignment bytes; unknown: aligned)
    if not (_nonzero_seqs(c) and _last_stride_one(c, ignore_singleton=False) and _heads(c, supports_gqa=False)):
        return False
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if t.cap >= (8, 0) else (torch.float16, torch.float32)
    return all(x.dtype in dtypes for x in (c.q, c.k, c.v))


_CAN_USE: Mapping[SdpBackend, Callable[[_Call, _Target], bool]] = {
    SdpBackend.CUDNN: _can_use_cudnn,
    SdpBackend.FLASH: _can_use_flash,
    SdpBackend.EFFICIENT: _can_use_efficient,
    SdpBackend.MATH: lambda c, t: True,
}


def _gemm_alignment(dtype: torch.dtype, cap: Capability) -> int:
    """minimum_gemm_alignment: 4 from sm80, raised to 128 bits of a scalar where tensor cores run
    (sm80+, or sm70+ for half types): 8 for fp16/bf16, 4 for fp32 on sm80+; 1 for fp32 below sm80."""
    half = dtype in _HALF
    alignment = 4 if cap[0] >= 8 else 1
    tensor_cores = cap[0] >= 8 or (cap[0] >= 7 and half)
    return max(alignment, 128 // (16 if half else 32)) if tensor_cores else alignment


def _grad_wanted(*ts: torch.Tensor) -> bool:
    """should_compute_logsumexp / input_requires_grad: some input requires grad and grad mode is on.
    Called with q, k and v only, as torch does: a mask's own need of a gradient does not count (Note
    [An attention bias that requires grad])."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


# Note [An attention bias that requires grad]
#     A trained additive bias (T5's relative position bias: an nn.Embedding looked up per (query, key)
#     pair, permuted to (1, H, L, S), added as ``attn_mask``) changes both the backend and what is kept.
#     Backend (sdp_utils.cpp, sdp_utils_cpp.h; the same in 2.11 and 2.13):
#     - cuDNN: ``check_attn_mask_shape`` returns false for a mask that ``requires_grad()`` (whatever the
#       grad mode), as ``_scaled_dot_product_cudnn_attention``'s derivative (tools/autograd/derivatives.yaml)
#       differentiates q, k and v only (called with such a bias, the op raises "not differentiable with
#       respect to argument 'attn_bias'"); so bf16/fp16 leave cuDNN, which they take with the mask untrained.
#     - flash: no mask at all (``check_for_attn_mask``).
#     - memory-efficient: no check on the mask's gradient (``check_requires_grad_and_nested`` is about
#       nested inputs), but ``check_last_dim_stride_equals_1_dense`` wants the mask's last stride 1 on a
#       GPU (pytorch#158424, in 2.8). T5's lookup, (L, S, H) permuted to (1, H, L, S), has last stride H:
#       it goes to math unless made contiguous (or H = 1); contiguous, it runs memory-efficient, fp32 and
#       bf16 alike.
#     Kept for backward:
#     - memory-efficient: ``scaled_dot_product_attention`` (attention.cpp) passes ``preprocess_mask``'s
#       result, the bias padded to a multiple of 8 unless ``aligned_tensor`` and expanded to (B, H, L, S)
#       (``_mem_efficient_bias``); derivatives.yaml saves it as ``attn_bias`` with q, k, v, the output,
#       the log-sum-exp and the philox seed and offset, the same list as for an untrained mask, and
#       passes ``grad_input_mask[3]`` on as ``bias_requires_grad``. ``_efficient_attention_backward``
#       (attention_backward.cu) then allocates ``grad_bias`` at the saved bias's sizes, the expanded
#       (B, H, L, S) with its last dim rounded up to 16, in the bias's dtype: a full per-batch, per-head
#       gradient even for a (1, H, L, S) bias, which autograd sums back (ExpandBackward0) and, where it was
#       padded, copies into zeros of the padded size (SliceBackward0). The meta kernel
#       (torch/_meta_registrations.py) allocates the same, so the fake call needs no rule of its own.
#       ``compute_log_sumexp`` (``should_compute_logsumexp``, attention.cpp) looks at q, k and v only: a
#       bias trained under frozen q, k and v gets an empty log-sum-exp, which the GPU's backward reads
#       through a null pointer (pytorch#148476; pytorch#188302, which would count the mask, came after
#       2.13's branch cut and was closed). fxmem follows torch here: an empty log-sum-exp, no error.
#     - math: the composite adds the mask in place (``attn.add_``), which saves nothing; what it keeps
#       is Note [The math path on the cuda target]'s, the mask's gradient being the scores' gradient
#       summed to its shape.
#     The H200's records (tests/data/h200) have no mask that requires grad; tests/test_sdpa.py checks
#     this against the arithmetic, and against the fp32 float-mask record, whose saved list this is.


def run_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    capability: Capability,
    version: TorchVersion | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as an sm``capability`` GPU runs it: the backend's own op, with
    the mask made as ``scaled_dot_product_attention`` (attention.cpp) makes it for that backend."""
    backend = choose_sdp_backend(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        enable_gqa=enable_gqa,
        capability=capability,
        version=version,
    )
    if backend == SdpBackend.FLASH:
        return _flash(q, k, v, dropout_p, is_causal, scale)
    if backend == SdpBackend.CUDNN:
        bias = _additive_mask(attn_mask, q.dtype, fill=-65504.0)  # convert_boolean_attn_mask_cudnn
        return aten._scaled_dot_product_cudnn_attention(q, k, v, bias, _grad_wanted(q, k, v), dropout_p, is_causal, False, scale=scale)[0]
    mask = _additive_mask(attn_mask, q.dtype)
    if backend == SdpBackend.EFFICIENT:
        bias = None if mask is None else _mem_efficient_bias(mask, q, k)
        return aten._scaled_dot_product_efficient_attention(q, k, v, bias, _grad_wanted(q, k, v), dropout_p, is_causal, scale=scale)[0]
    return _math(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, causal: bool, scale: float | None) -> torch.Tensor:
    """The flash branch of ``scaled_dot_product_attention`` (attention.cpp) on CUDA: head dims padded
    to a multiple of 8 (``pad_last_dim<8, false>``), the scale of the unpadded dim, the output sliced."""
    d = q.shape[-1]
    pad = lambda t: t if _known(t.shape[-1] % 8 == 0) else F.pad(t, (0, 8 - t.shape[-1] % 8))
    og_scale = scale if scale is not None else 1.0 / math.sqrt(d)
    out = aten._scaled_dot_product_flash_attention(pad(q), pad(k), pad(v), p, causal, False, scale=og_scale)[0]
    return out if _known(out.shape[-1] == d) else out[..., :d]


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype, fill: float = -math.inf) -> torch.Tensor | None:
    """convert_boolean_attn_mask_ (attention.cpp): a bool mask becomes 0 where true, ``fill`` elsewhere,
    in the query's dtype (the H200's traces show its two scalars and its output, no inverted copy)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, 0.0, torch.scalar_tensor(fill, dtype=dtype))


def _mem_efficient_bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """preprocess_mask (attention.cpp): pad the last dim unless every stride but the last is a multiple
    of 8 (a symbolic stride counts as unaligned), slice back, expand to (B, H, L, S)."""
    aligned = all(isinstance(s, int) and s % 8 == 0 for s in mask.stride()[:-1]) and mask.stride(-1) == 1
    if not aligned:
        s = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - s % 8))[..., :s]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


# Note [The math path on the cuda target]
#     ``_scaled_dot_product_attention_math`` (attention.cpp) is a composite, the same code on every
#     device but for its dropout: ``at::dropout`` takes the fused ``native_dropout`` on CUDA (a bool
#     mask, NativeDropoutBackward0) and on the CPU a float noise tensor. Called by name on fake CPU
#     tensors it would also add the mask out of place (FakeTensor is subclass-like, see
#     ``areAnyTensorSubclassLike``), which CUDA does in place. So ``_math`` repeats the composite step by
#     step: fp16/bf16 inputs copied to fp32 (unless ``allow_fp16_bf16_reduction_math_sdp``), q scaled by
#     the square root of the scale, the causal mask built, k and v repeated per query head
#     (``pre_process_group_query_attention_input``), k scaled, q @ k^T, the mask added in place,
#     ``_safe_softmax``, dropout, and the second result ``attn.to(origin dtype)``, made before the
#     output as the H200 made it and dropped by ``scaled_dot_product_attention``. Each allocation of
#     the H200's traces appears in that order (tests/test_sdpa.py).


def _math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    p: float,
    causal: bool,
    scale: float | None,
    gqa: bool,
) -> torch.Tensor:
    """``_scaled_dot_product_attention_math`` as CUDA runs it. See Note [The math path on the cuda target]."""
    origin = query.dtype
    q_acc, k_acc, v_acc = (_accumulate(t) for t in (query, key, value))
    negative = scale is not None and scale < 0.0
    factor = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(q_acc.shape[-1]))
    q = q_acc * (-factor if negative else factor)
    if causal:
        mask = _additive_mask(torch.ones(q.shape[-2], k_acc.shape[-2], dtype=torch.bool, device=q.device).tril(), q.dtype)
    k_exp, v_exp = _repeat_heads(q, k_acc, v_acc, gqa)
    attn = torch.matmul(q, k_exp.transpose(-2, -1) * factor)
    if mask is not None:
        attn.add_(mask)
    attn = aten._safe_softmax(attn, -1)
    if p > 0.0:
        attn = aten.native_dropout(attn, p, True)[0] if p < 1.0 else F.dropout(attn, p, True)
    weights = attn.to(origin)  # the composite's second result, made first
    out = torch.matmul(attn, v_exp).to(origin)
    del weights
    return out


def _accumulate(t: torch.Tensor) -> torch.Tensor:
    """The composite's ``*_acc``: an fp32 copy of an fp16/bf16 input unless reduced-precision math is allowed."""
    if t.dtype in _HALF and not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        return t.to(torch.float32)
    return t


def _repeat_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """pre_process_group_query_attention_input: with ``enable_gqa`` and unequal heads, k and v repeated per query head."""
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if not gqa or (_known(hq == hk) and _known(hk == hv)):
        return k, v
    return k.repeat_interleave(hq // hk, dim=-3), v.repeat_interleave(hq // hv, dim=-3)
