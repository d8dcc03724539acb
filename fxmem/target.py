"""What a CUDA device runs, emulated on fake CPU tensors: SDPA's backend, fused dropout, autocast.

A cuda-target pass cannot use cuda tensors (fake tensors on 'cuda' abort a CPU build; see NOTES.md),
so the forward and the loss run on fake CPU tensors inside ``CudaTargetMode``, which makes the three
choices where CUDA differs from the CPU in what autograd saves, and calls the CUDA kernels' own ATen
ops (their meta kernels run on fake CPU tensors) so that autograd itself says what they save:

- ``scaled_dot_product_attention`` takes the backend ``select_sdp_backend`` would pick
  (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp), see Note [SDPA on the cuda target];
- ``dropout`` is the fused ``native_dropout`` with a 1-byte mask (``dropout`` in
  aten/src/ATen/native/Dropout.cpp takes it when ``is_fused_kernel_acceptable``: a CUDA input);
- with ``amp``, CUDA autocast's cast policy and weight-cast cache (aten/src/ATen/autocast_mode.cpp,
  the lists in aten/src/ATen/autocast_mode.h); ``torch.autocast('cuda')`` is off on a CPU build and
  CPU autocast has another op list.

Why a TorchFunctionMode: it sits above autograd, as the Autocast dispatch key and the
CompositeImplicitAutograd ``scaled_dot_product_attention`` do (c10/core/DispatchKey.h orders Autocast
before Autograd), so casts and kernel choices are recorded by autograd as on the device: a matmul
saves the bf16 copy of its input, SDPA saves what the chosen kernel's derivative saves
(tools/autograd/derivatives.yaml). A dispatch mode would sit below autograd, too late for both.

Note [cudnn batch norm]
    On CUDA, training-mode ``batch_norm`` runs ``cudnn_batch_norm`` (``_batch_norm_impl_index`` in
    aten/src/ATen/native/Normalization.cpp), which saves input, weight, running stats, save_mean,
    save_var and a reserve buffer; the CPU's ``native_batch_norm`` saves input, weight, running stats,
    save_mean and save_invstd. Weights and running stats are state, the input is the same tensor,
    save_mean/save_var are fp32 (C,) vectors in both, and the reserve of plain BN (no fused add or
    activation, as ``cudnn_batch_norm`` asks for) is 0 bytes. The bytes are equal, so batch norm is
    left as it is. CUDA autocast does not list batch_norm: it runs in its input's dtype, as here.

Limits, each a choice: feature dropout (dropout1d/2d/3d), alpha dropout and in-place dropout run as
on the CPU, as on CUDA (``dropout_`` and ``feature_dropout`` in Dropout.cpp never take the fused
kernel). The inner calls of ``F.multi_head_attention_forward`` (a Python function that reaches the mode
whole) are seen one by one, as the dispatcher sees them (see ``_REENTERED``); other Python functions are
not re-entered. The math path's dropout is the CPU's (a noise tensor in the input's dtype).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from types import FunctionType
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["CudaTargetMode", "SdpBackend", "choose_sdp_backend"]

aten = torch.ops.aten
Capability = tuple[int, int]


class SdpBackend(StrEnum):
    """The kernels of ``select_sdp_backend`` this module emulates, in its priority order."""

    FLASH = "flash"
    EFFICIENT = "efficient"
    MATH = "math"


# Note [SDPA on the cuda target]
#     The default priority order is flash, memory-efficient, math (``select_sdp_backend``). Where
#     ``check_prefer_cudnn_attention`` holds (sm90/sm100 with cuDNN > 9.15) cuDNN attention comes
#     first; it saves the same q, k, v, out and fp32 (B, H, S) statistics as flash (its philox seed
#     and offset are 8 bytes smaller), so flash stands for it. Each check below names its function in
#     sdp_utils.cpp / sdp_utils_cpp.h. A size that is symbolic passes a check only when it is known
#     to (``TORCH_GUARD_OR_FALSE``), except pointer alignment, assumed (``TORCH_GUARD_OR_TRUE``).
_FLASH_MAX_HEAD_DIM = 256  # check_head_dim_size_flash
_FLASH_SM = ((8, 0), (12, 1))  # check_flash_attention_hardware_support: [sm80, sm121]
_EFFICIENT_SM = ((5, 0), (12, 1))  # check_mem_efficient_hardware_support: [sm50, sm121]
_HALF = (torch.float16, torch.bfloat16)


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
) -> SdpBackend:
    """The backend CUDA's ``select_sdp_backend`` picks for these inputs on an sm``capability`` GPU.

    >>> q = torch.empty(2, 4, 16, 64, dtype=torch.bfloat16, device="meta")
    >>> str(choose_sdp_backend(q, q, q, attn_mask=None, dropout_p=0.0, is_causal=True, enable_gqa=False, capability=(9, 0)))
    'flash'
    """
    if _dense_ok(query, key, value, enable_gqa) and _can_use_flash(query, key, value, attn_mask, dropout_p, is_causal, capability):
        return SdpBackend.FLASH
    if _dense_ok(query, key, value, False) and _can_use_efficient(query, key, value, capability):
        return SdpBackend.EFFICIENT  # efficient checks heads with supports_gqa=false: equal heads, enable_gqa or not
    return SdpBackend.MATH


def _known(condition: Any) -> bool:
    return bool(statically_known_true(condition))


def _dense_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> bool:
    """check_tensor_shapes (4-D), check_batch_size_and_num_heads_dense and check_nonzero_sequence_lengths_dense.

    ``gqa`` is ``enable_gqa and supports_gqa``: flash instantiates the heads check with GQA support, so
    32 query heads over 8 key heads pass where GQA is asked for; efficient instantiates it without, so
    it demands equal heads even then, and a GQA call that misses flash falls to math, which repeats k and v.
    """
    if not q.dim() == k.dim() == v.dim() == 4:
        return False
    if not (_known(q.shape[0] == k.shape[0]) and _known(q.shape[0] == v.shape[0])):
        return False
    hq, hk, hv = q.shape[1], k.shape[1], v.shape[1]
    heads = _known(hk == hv) and _known(hq % hk == 0) if gqa else _known(hq == hk) and _known(hq == hv)
    return heads and all(_known(t.shape[2] > 0) for t in (q, k, v))


def _in_range(capability: Capability, bounds: tuple[Capability, Capability]) -> bool:
    """check_sm_version<lower, upper>: inclusive on (major, minor)."""
    return bounds[0] <= capability <= bounds[1]


def _can_use_flash(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, p: float, causal: bool, cap: Capability
) -> bool:
    """can_use_flash_attention's checks, in its order."""
    d = q.shape[-1]
    if mask is not None:  # check_for_attn_mask
        return False
    if not (_known(d == k.shape[-1]) and _known(d == v.shape[-1]) and _known(d <= _FLASH_MAX_HEAD_DIM)):
        return False
    if not _in_range(cap, _FLASH_SM):
        return False
    sm86_89_or_120 = _in_range(cap, ((8, 6), (8, 9))) or _in_range(cap, ((12, 0), (12, 1)))
    if sm86_89_or_120 and _grad_wanted(q, k, v) and not (_known(d <= 192) or (p == 0.0 and _known(d > 224))):
        return False  # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
    if causal and not _known(q.shape[-2] == k.shape[-2]):  # check_flash_causal_non_square_seqlens
        return False
    if not all(t.dtype in _HALF for t in (q, k, v)):  # check_dtypes_flash_attention (sm80+)
        return False
    return all(_known(t.stride(-1) == 1) or _known(t.shape[-1] == 1) for t in (q, k, v))


def _can_use_efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cap: Capability) -> bool:
    """can_use_mem_efficient_attention's checks, in its order."""
    if not _in_range(cap, _EFFICIENT_SM):
        return False
    align = _gemm_alignment(q.dtype, cap)
    d, dv = q.shape[-1], v.shape[-1]
    if not (_known(d == k.shape[-1]) and _known(d % align == 0) and _known(dv % align == 0) and _known(d > 0)):
        return False  # check_head_dim_size_mem_efficient: no upper bound on CUDA
    if cap >= (8, 0) and any(_known(t.storage_offset() % align != 0) for t in (q, k, v)):
        return False  # check_data_ptr_alignment_mem_efficient (offset * element size vs alignment bytes)
    if not all(_known(t.stride(-1) == 1) for t in (q, k, v)):  # check_last_dim_stride_equals_1_dense<false>
        return False
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if cap >= (8, 0) else (torch.float16, torch.float32)
    return all(t.dtype in dtypes for t in (q, k, v))


def _gemm_alignment(dtype: torch.dtype, cap: Capability) -> int:
    """minimum_gemm_alignment: 4 from sm80, raised to 128 bits of a scalar where tensor cores run
    (sm80+, or sm70+ for half types): 8 for fp16/bf16, 4 for fp32 on sm80+; 1 for fp32 below sm80."""
    half = dtype in _HALF
    alignment = 4 if cap[0] >= 8 else 1
    tensor_cores = cap[0] >= 8 or (cap[0] >= 7 and half)
    return max(alignment, 128 // (16 if half else 32)) if tensor_cores else alignment


def _grad_wanted(*ts: torch.Tensor) -> bool:
    """should_compute_logsumexp / input_requires_grad: some input requires grad and grad mode is on."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


# CUDA autocast's op lists (aten/src/ATen/autocast_mode.h, registered for CUDA in autocast_mode.cpp),
# by the aten name, plus the Python-level names that reach a TorchFunctionMode for the same op.
_LOWER_PRECISION = _names(
    "_convolution convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d "
    "cudnn_convolution cudnn_convolution_transpose prelu addmm addmv addr matmul __matmul__ __rmatmul__ einsum "
    "mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell "
    "_thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention"
)
_FP32 = _names(
    "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow __pow__ __rpow__ softplus "
    "layer_norm native_layer_norm rms_norm group_norm frobenius_norm nuclear_norm cosine_similarity "
    "poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss "
    "huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss "
    "multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d "
    "_upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d "
    "_upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa "
    "upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa "
    # cross_entropy is not listed: its composite runs log_softmax and nll_loss, both fp32 below.
    "cross_entropy cross_entropy_loss norm"
)
_FP32_UNLESS_DTYPE = _names("prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum")
"""fp32_set_opt_dtype: run in fp32 unless the call names an output dtype itself."""
_PROMOTE = _names("addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler grid_sample index_put tensordot scatter_add")
"""promote: the widest floating input's dtype. cat and stack are not listed; they promote by themselves."""


def _op_name(func: Any) -> str | None:
    """The op a ``__torch_function__`` call is, for torch's callables only: ``F.linear``,
    ``torch._C._nn.linear``, ``torch.Tensor.matmul`` and ``aten.linear.default`` are all 'linear'."""
    if isinstance(func, torch._ops.OpOverload):
        return func.overloadpacket.__name__ if func.namespace == "aten" else None
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func.__name__ if func._qualified_op_name.startswith("aten::") else None
    if getattr(func, "__objclass__", None) in (torch._C.TensorBase, torch.Tensor):
        return str(func.__name__)
    module = getattr(func, "__module__", None) or ""
    return str(func.__name__) if module == "torch" or module.startswith("torch.") else None


def _never(*args: object) -> bool:
    return False


_REENTERED = frozenset({"multi_head_attention_forward"})
"""Python functions of torch.nn.functional whose body calls the ops this mode changes (linear, SDPA,
dropout) and which reach the mode whole. Only these are re-entered: re-entering every F function loops
forever on ``boolean_dispatch`` wrappers (``max_pool2d``), whose inner function asks the mode again."""


def _unguarded(func: FunctionType) -> FunctionType:
    """A copy of a Python function of torch.nn.functional that skips its ``has_torch_function`` test,
    so that, run inside the mode, its body's calls reach the mode one by one instead of the whole
    function being handed to it again (a mode's handler runs with the mode popped)."""
    scope = dict(func.__globals__, has_torch_function=_never, has_torch_function_unary=_never, has_torch_function_variadic=_never)
    body = FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    return body


def _bind(names: Sequence[str], defaults: Mapping[str, Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Positional and keyword arguments by parameter name (the F and aten signatures share names)."""
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


class CudaTargetMode(TorchFunctionMode):
    """Emulates, on fake CPU tensors, the kernels and autocast policy of an sm``compute_capability``
    CUDA GPU; ``amp`` is the autocast dtype, None without autocast. One instance is one autocast
    region: its weight-cast cache lives as long as the instance."""

    def __init__(self, *, compute_capability: Capability, amp: torch.dtype | None = None) -> None:
        super().__init__()
        self.capability = compute_capability
        self.amp = amp
        self._casts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._bodies: dict[Callable[..., Any], FunctionType] = {}

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = _op_name(func)
        if name == "scaled_dot_product_attention":
            return self._sdpa(*self._autocast(name, args, kwargs))
        if name == "dropout":
            return self._dropout(func, args, kwargs)
        if self.amp is not None and name is not None:
            args, kwargs = self._autocast(name, args, kwargs)
        if isinstance(func, FunctionType) and func.__name__ in _REENTERED and func.__module__ == "torch.nn.functional":
            return self._reenter(func, args, kwargs)
        return func(*args, **kwargs)

    def _policy(self, name: str | None) -> torch.dtype | str | None:
        """The autocast cast for ``name``: a dtype, 'promote', 'fp32_unless_dtype', or None (none)."""
        if self.amp is None or name is None:
            return None
        if name in _LOWER_PRECISION or name == "scaled_dot_product_attention":
            return self.amp
        if name in _FP32:
            return torch.float32
        return "fp32_unless_dtype" if name in _FP32_UNLESS_DTYPE else "promote" if name in _PROMOTE else None

    def _autocast(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Sequence[Any], Mapping[str, Any]]:
        """The arguments as CUDA autocast casts them for op ``name`` (unchanged without amp)."""
        policy = self._policy(name)
        if policy is None:
            return args, kwargs
        if policy == "fp32_unless_dtype":
            named_dtype = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)
            first = args[0] if args else None
            if named_dtype or not (isinstance(first, torch.Tensor) and _eligible(first)):
                return args, kwargs
            policy = torch.float32
        if policy == "promote":
            tensors = [t for t in _tensors(args, kwargs) if _eligible(t)]
            policy = torch.float32 if any(t.dtype == torch.float32 for t in tensors) else self.amp
        assert isinstance(policy, torch.dtype)
        cast = lambda a: self._cast(a, policy) if isinstance(a, torch.Tensor) else a
        return tree_map(cast, tuple(args)), tree_map(cast, dict(kwargs))

    def _cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``cached_cast`` (autocast_mode.cpp): fp32 weights (leaves that require grad) cast to the
        lower precision once per region, so a weight used twice is cast, and saved, once."""
        if not _eligible(t) or t.dtype == dtype:
            return t
        cacheable = dtype == self.amp and t.dtype == torch.float32 and t.requires_grad and t.is_leaf and not t._is_view()
        if not cacheable:
            return t.to(dtype)
        if id(t) not in self._casts:  # the source is kept in the value, so its id cannot be reused
            self._casts[id(t)] = (t, t.to(dtype))
        return self._casts[id(t)][1]

    def _reenter(self, func: FunctionType, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        if func not in self._bodies:
            self._bodies[func] = _unguarded(func)
        with self:
            return self._bodies[func](*args, **kwargs)

    def _dropout(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """The fused ``native_dropout`` (a bool mask) where CUDA's ``dropout`` takes it, else ``func``."""
        a = _bind(("input", "p", "training", "inplace"), {"p": 0.5, "training": True, "inplace": False}, args, kwargs)
        x, p, training = a["input"], float(a["p"]), bool(a.get("train", a["training"]))
        if not (training and 0.0 < p < 1.0 and not a["inplace"]) or _known(x.numel() == 0):
            return func(*args, **kwargs)
        return aten.native_dropout(x, p, True)[0]

    def _sdpa(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> torch.Tensor:
        a = _bind(_SDPA_ARGS, _SDPA_DEFAULTS, args, kwargs)
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        p, causal, scale, gqa = float(a["dropout_p"]), bool(a["is_causal"]), a["scale"], bool(a["enable_gqa"])
        backend = choose_sdp_backend(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, enable_gqa=gqa, capability=self.capability)
        if backend == SdpBackend.FLASH:
            return _flash(q, k, v, p, causal, scale)
        mask = _additive_mask(mask, q.dtype)
        if backend == SdpBackend.EFFICIENT:
            bias = None if mask is None else _mem_efficient_bias(mask, q, k)
            return aten._scaled_dot_product_efficient_attention(q, k, v, bias, _grad_wanted(q, k, v), p, causal, scale=scale)[0]
        return aten._scaled_dot_product_attention_math(q, k, v, mask, p, causal, None, scale=scale, enable_gqa=gqa)[0]


def _tensors(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    return [t for t in tree_leaves((tuple(args), dict(kwargs))) if isinstance(t, torch.Tensor)]


def _eligible(t: torch.Tensor) -> bool:
    """is_eligible (autocast_mode.h): floating, and not float64."""
    return t.is_floating_point() and t.dtype != torch.float64


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float, causal: bool, scale: float | None) -> torch.Tensor:
    """The flash branch of ``scaled_dot_product_attention`` (attention.cpp) on CUDA: head dims padded
    to a multiple of 8 (``pad_last_dim<8, false>``), the scale of the unpadded dim, the output sliced."""
    d = q.shape[-1]
    pad = lambda t: t if _known(t.shape[-1] % 8 == 0) else F.pad(t, (0, 8 - t.shape[-1] % 8))
    og_scale = scale if scale is not None else 1.0 / math.sqrt(d)
    out = aten._scaled_dot_product_flash_attention(pad(q), pad(k), pad(v), p, causal, False, scale=og_scale)[0]
    return out if _known(out.shape[-1] == d) else out[..., :d]


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """convert_boolean_attn_mask (attention.cpp): a bool mask becomes 0 / -inf in the query's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, 0.0, torch.scalar_tensor(-math.inf, dtype=dtype))


def _mem_efficient_bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """preprocess_mask (attention.cpp): pad the last dim unless every stride but the last is a multiple
    of 8 (a symbolic stride counts as unaligned), slice back, expand to (B, H, L, S)."""
    aligned = all(isinstance(s, int) and s % 8 == 0 for s in mask.stride()[:-1]) and mask.stride(-1) == 1
    if not aligned:
        s = mask.shape[-1]
        mask = F.pad(mask, (0, 8 - s % 8))[..., :s]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
