"""What a CUDA device runs, emulated on fake CPU tensors: its kernels' choices and autocast.

A cuda-target pass cannot use cuda tensors (fake tensors on 'cuda' abort a CPU build; see NOTES.md),
so the forward and the loss run on fake CPU tensors inside ``CudaTargetMode``, which makes the
choices where CUDA differs from the CPU in what autograd saves, and calls the CUDA kernels' own ATen
ops (their meta kernels run on fake CPU tensors) so that autograd itself says what they save. The
calls it handles are in ``_KERNELS``:

- ``scaled_dot_product_attention`` takes the backend ``select_sdp_backend`` would pick for the torch
  release the job runs (fxmem/rules/sdpa.py, Note [SDPA on the cuda target]);
- ``linear`` adds its bias in place after a matmul, as real tensors do (fxmem/rules/linear.py);
- ``dropout`` is the fused ``native_dropout`` with a 1-byte mask (``dropout`` in
  aten/src/ATen/native/Dropout.cpp takes it when ``is_fused_kernel_acceptable``: a CUDA input);
- ``lstm``, ``gru`` and the plain RNNs run cuDNN's ``_cudnn_rnn`` (fxmem/rules/cudnn_rnn.py);
- ``cross_entropy`` under autocast runs as its composite does (Note [Cross-entropy under CUDA autocast]);
- with ``amp``, CUDA autocast's cast policy and weight-cast cache (aten/src/ATen/autocast_mode.cpp,
  the lists in aten/src/ATen/autocast_mode.h); ``torch.autocast('cuda')`` is off on a CPU build and
  CPU autocast has another op list.

What the kernels allocate besides their outputs, and outputs whose meta kernels under-report them (the
RNN reserve, batch norm's fp32 statistics), are op and workspace rules (fxmem/rules/ops.py).

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
    left as it is, but for one thing: for a bf16 input CUDA's statistics stay fp32 and the CPU's fake
    kernel makes them bf16 (a rule mends it: Note [Batch-norm statistics on CUDA] in
    fxmem/rules/cuda_norms.py). CUDA autocast does not list batch_norm: it runs in its input's dtype.

Limits, each a choice: feature dropout (dropout1d/2d/3d), alpha dropout and in-place dropout run as
on the CPU, as on CUDA (``dropout_`` and ``feature_dropout`` in Dropout.cpp never take the fused
kernel). The inner calls of ``F.multi_head_attention_forward`` and ``torch.norm`` (Python functions
that reach the mode whole) are seen one by one, as the dispatcher sees them (see ``_REENTERED``); other
Python functions are not re-entered.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import FunctionType
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from fxmem.rules import TorchRelease
from fxmem.rules.cudnn_rnn import rnn_kernel
from fxmem.rules.linear import linear_arguments, linear_as_real
from fxmem.rules.sdpa import Capability, SdpBackend, choose_sdp_backend, run_sdpa

__all__ = ["CudaTargetMode", "SdpBackend", "choose_sdp_backend"]  # the last two re-exported from fxmem.rules.sdpa

aten = torch.ops.aten


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
    # Not CUDA's: cross_entropy is, for the cases Note [Cross-entropy under CUDA autocast] leaves whole.
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


_REENTERED = {
    "torch.nn.functional": frozenset({"multi_head_attention_forward"}),
    "torch.functional": frozenset({"norm"}),
    "torch._tensor": frozenset({"norm"}),
}
"""Python functions of torch, by module, whose body calls ops this mode changes (linear, SDPA, dropout,
the autocast lists) and which reach the mode whole: ``torch.norm`` (and ``Tensor.norm``) runs
``linalg.vector_norm`` or ``matrix_norm``, which autocast gives ``dtype=float32`` where ``norm`` itself
would be cast to float32. Only these are re-entered: re-entering every F function loops forever on
``boolean_dispatch`` wrappers (``max_pool2d``), whose inner function asks the mode again."""


def _unguarded(func: FunctionType) -> FunctionType:
    """A copy of a Python function of torch that skips its ``has_torch_function`` test,
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

    def __init__(self, *, compute_capability: Capability, amp: torch.dtype | None = None, release: TorchRelease | None = None) -> None:
        super().__init__()
        self.capability = compute_capability
        self.amp = amp
        self.release = release
        """The torch release whose kernel choices to follow (None: the one fxmem runs with)."""
        self._casts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._bodies: dict[Callable[..., Any], FunctionType] = {}

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = _op_name(func)
        kernel = _KERNELS.get(name) if name is not None else None
        if kernel is not None:
            return kernel(self, func, args, kwargs)
        if isinstance(func, FunctionType) and func.__name__ in _REENTERED.get(func.__module__, ()):
            return self._reenter(func, args, kwargs)  # its inner calls meet autocast one by one
        if self.amp is not None and name is not None:
            args, kwargs = self.autocast(name, args, kwargs)
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

    def autocast(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Sequence[Any], Mapping[str, Any]]:
        """The arguments as CUDA autocast casts them for op ``name`` (unchanged without amp)."""
        policy = self._policy(name)
        if policy is None:
            return args, kwargs
        if policy == "fp32_unless_dtype":
            return args, _in_float32(args, kwargs)
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

    def _linear(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """``linear`` after autocast's casts, its bias added in place where real tensors add it so
        (Note [linear's bias on fake tensors] in fxmem/rules/linear.py)."""
        args, kwargs = self.autocast("linear", args, kwargs)
        x, weight, bias = linear_arguments(args, kwargs)
        out = linear_as_real(x, weight, bias) if isinstance(x, torch.Tensor) and isinstance(bias, torch.Tensor) else None
        return func(*args, **kwargs) if out is None else out

    def _dropout(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """The fused ``native_dropout`` (a bool mask) where CUDA's ``dropout`` takes it, else ``func``."""
        a = _bind(("input", "p", "training", "inplace"), {"p": 0.5, "training": True, "inplace": False}, args, kwargs)
        x, p, training = a["input"], float(a["p"]), bool(a.get("train", a["training"]))
        if not (training and 0.0 < p < 1.0 and not a["inplace"]) or statically_known_true(x.numel() == 0):
            return func(*args, **kwargs)
        return aten.native_dropout(x, p, True)[0]

    def _cross_entropy(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Under autocast, ``cross_entropy`` as its composite runs. See Note [Cross-entropy under CUDA autocast]."""
        aten_op = isinstance(func, torch._ops.OpOverload)
        a = _bind(_CE_ATEN_ARGS, _CE_ATEN_DEFAULTS, args, kwargs) if aten_op else _bind(_CE_ARGS, _CE_DEFAULTS, args, kwargs)
        x, target = a["self"] if aten_op else a["input"], a["target"]
        composite = self.amp is not None and isinstance(x, torch.Tensor) and _eligible(x) and x.dtype != torch.float32
        if not composite or target.is_floating_point() or float(a["label_smoothing"]) != 0.0:
            args, kwargs = self.autocast("cross_entropy", args, kwargs)
            return func(*args, **kwargs)
        with self:
            log_probs = torch.log_softmax(x, 0 if x.dim() == 1 else 1, dtype=x.dtype)
            reduction = _REDUCTIONS[a["reduction"]] if aten_op else a["reduction"]
            legacy = {} if aten_op else {"size_average": a["size_average"], "reduce": a["reduce"]}
            return F.nll_loss(log_probs, target, a["weight"], ignore_index=a["ignore_index"], reduction=reduction, **legacy)

    def _sdpa(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> torch.Tensor:
        args, kwargs = self.autocast("scaled_dot_product_attention", args, kwargs)
        a = _bind(_SDPA_ARGS, _SDPA_DEFAULTS, args, kwargs)
        return run_sdpa(
            a["query"], a["key"], a["value"], attn_mask=a["attn_mask"], dropout_p=float(a["dropout_p"]), is_causal=bool(a["is_causal"]),
            scale=a["scale"], enable_gqa=bool(a["enable_gqa"]), capability=self.capability, version=self.release,
        )  # fmt: skip


# Note [Cross-entropy under CUDA autocast]
#     CUDA autocast lists no cross-entropy: ``cross_entropy_loss`` is a composite (LossNLL.cpp) whose
#     inner calls meet the autocast key one by one. It calls ``log_softmax(input, class_dim,
#     input.scalar_type())``: log_softmax is fp32_set_opt_dtype, which leaves a call that names its
#     dtype alone, so the log-probabilities are computed, and saved by LogSoftmaxBackward0, in bf16;
#     ``nll_loss`` is an fp32 op, so it casts them to fp32 and saves that copy. A bf16 logit thus costs
#     2 + 4 bytes until backward, where casting the logits first would keep 4. Measured on an H200
#     (torch 2.11, shared/gpu/steps_h200.json): LogSoftmaxBackward0 keeps 2 bytes per logit (BERT's
#     MLM head 1,280,000 B per sample, ResNet-50's 2,000) beside NllLossBackward0's 4. Index targets
#     without label smoothing run the composite here; probability targets and label smoothing are
#     run in fp32 whole, 2 bytes per logit under the GPU.

_KERNELS: dict[str, Callable[..., Any]] = {
    "scaled_dot_product_attention": CudaTargetMode._sdpa,
    "dropout": CudaTargetMode._dropout,
    "linear": CudaTargetMode._linear,
    "cross_entropy": CudaTargetMode._cross_entropy,
    "cross_entropy_loss": CudaTargetMode._cross_entropy,
    # nn.LSTM / GRU / RNN's _VF calls: cuDNN's, see Note [cuDNN RNN call on fake tensors] in fxmem/rules/cudnn_rnn.py
    **{name: rnn_kernel(name) for name in ("lstm", "gru", "rnn_tanh", "rnn_relu")},
}
"""The calls a cuda target runs otherwise than the CPU, by op name: each handler takes the mode, the
function called and its arguments, and returns what the GPU's kernel returns."""

_CE_ARGS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
_CE_ATEN_ARGS = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")
_CE_ATEN_DEFAULTS = {"weight": None, "reduction": 1, "ignore_index": -100, "label_smoothing": 0.0}
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
"""at::Reduction (aten/src/ATen/core/Reduction.h) by its number, as aten.cross_entropy_loss takes it."""
_CE_DEFAULTS = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None, "reduction": "mean", "label_smoothing": 0.0}


def _in_float32(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Mapping[str, Any]:
    """fp32_set_opt_dtype (autocast_mode.h): a call that names no output dtype gets ``dtype=float32``;
    its tensors are not cast. The op computes in float32 from its low-precision input, and autograd keeps
    that input, not a float32 copy of it (``linalg_vector_norm`` saves ``self`` and its result; softmax
    converts inside and saves its float32 result)."""
    named = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)
    first = args[0] if args else None
    if named or not (isinstance(first, torch.Tensor) and _eligible(first)) or first.dtype == torch.float32:
        return kwargs
    return {**kwargs, "dtype": torch.float32}


def _tensors(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    return [t for t in tree_leaves((tuple(args), dict(kwargs))) if isinstance(t, torch.Tensor)]


def _eligible(t: torch.Tensor) -> bool:
    """is_eligible (autocast_mode.h): floating, and not float64."""
    return t.is_floating_point() and t.dtype != torch.float64
