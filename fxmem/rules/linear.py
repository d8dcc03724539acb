"""``linear`` as ATen runs it on real tensors: where the bias is added after a matmul, it is added in place.

Note [linear's bias on fake tensors]
    ``at::linear`` (aten/src/ATen/native/Linear.cpp) runs one ``addmm`` for a 2-D input, and for a
    contiguous input of more dimensions (flattened to 2-D, ``_flatten_nd_linear``) when the bias is
    1-D or the input 3-D. Any other input with a bias (a permuted or transposed one: ConvNeXt's
    channels-last MLP after ``permute``, a projection of a batch-first GRU's output) takes
    ``matmul`` and then adds the bias: in place (``output.add_(bias)``) unless the bias
    ``isTensorSubclassLike`` or has a forward gradient, in which case out of place. A FakeTensor is
    subclass-like, so on fake tensors the add makes a second output-sized tensor that a real step
    never holds, next to the matmul's output until that dies. Measured on the CPU (torch 2.13): a
    GRU(10, 160) -> Linear(160, 160) -> GRU step at B=3 peaked 9,600 bytes (one (3, 5, 160) float32
    tensor) above the real run in the forward; tests/test_linear_rule.py holds the step to a real one.

    ``LinearAsReal`` (a TorchFunctionMode, so autograd records what it runs) takes that branch as the
    real tensors do: ``matmul`` then ``add_``. ATen's own CPU RNNs (``_VF.gru``, ``rnn_tanh``,
    ``rnn_relu``, and ``lstm`` where oneDNN declines it) call ``at::linear`` from C++ on the whole
    input sequence, where no Python mode can reach the call: while one runs, ``in_aten_rnn()`` is true,
    and the timeline counts an ``add`` of a 1-D bias to the tensor the op before it made as the in-place
    add it is (fxmem/step/timeline.py, ``_Tracker``). Autograd saves the same tensors either way (``matmul``
    saves its operands, ``add`` and ``add_`` nothing). Under CPU autocast it leaves ``linear`` alone:
    autocast casts the bias with the operands, below this mode, and the two paths differ only by that
    cast. The cuda target's mode (fxmem/gpu/target.py) applies the same branch after its own casts.

Note [The attention mask added in place]
    The CPU's math attention (``_scaled_dot_product_attention_math``, attention.cpp) adds the mask to
    the scores in place (``attn.add_(mask)``) unless a tensor is subclass-like, so on fake tensors it
    makes a second (B, H, L, S) score tensor that eager never holds. While
    ``F.scaled_dot_product_attention`` runs under ``LinearAsReal``, ``in_attention()`` is true, and the
    timeline counts an ``add`` onto the tensor the op before it made (the scores) as that in-place add,
    as it does for an RNN's bias. The flash kernel adds nothing; the cuda target runs its own math
    path (Note [The math path on the cuda target] in fxmem/rules/sdpa.py).
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["LinearAsReal", "in_aten_rnn", "in_attention", "linear_as_real", "takes_matmul_path"]

_LINEAR_ARGS = ("input", "weight", "bias")
_ATEN_RNNS = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu"})
_IN_ATEN_RNN: contextvars.ContextVar[bool] = contextvars.ContextVar("fxmem_in_aten_rnn", default=False)


def in_aten_rnn() -> bool:
    """Whether one of ATen's RNN functions is running (its ``at::linear`` calls are C++'s own)."""
    return _IN_ATEN_RNN.get()


_IN_ATTENTION: contextvars.ContextVar[bool] = contextvars.ContextVar("fxmem_in_attention", default=False)


def in_attention() -> bool:
    """Whether ``F.scaled_dot_product_attention`` is running (Note [The attention mask added in place])."""
    return _IN_ATTENTION.get()


def takes_matmul_path(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``at::linear`` adds ``bias`` after a matmul (rather than in one ``addmm``)."""
    if bias is None or x.dim() == 2:
        return False
    flattened = x.is_contiguous() and (x.dim() == 3 or (x.layout == torch.strided and bias.dim() == 1))
    return not flattened


def linear_as_real(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``linear`` as real tensors run it where its bias is added after a matmul; None elsewhere (run
    ``linear`` itself). See Note [linear's bias on fake tensors]."""
    if not takes_matmul_path(x, bias):
        return None
    assert bias is not None
    return torch.matmul(x, weight.t()).add_(bias)


def linear_arguments(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    """(input, weight, bias) of a ``linear`` call however its arguments were passed."""
    bound = {"bias": None, **dict(zip(_LINEAR_ARGS, args)), **kwargs}
    return bound["input"], bound["weight"], bound["bias"]


def is_linear(func: Any) -> bool:
    """``F.linear`` / ``torch._C._nn.linear`` (the same builtin) and ``aten.linear``."""
    return func is torch._C._nn.linear or func is torch.ops.aten.linear.default or func is torch.ops.aten.linear


class LinearAsReal(TorchFunctionMode):
    """Runs ``linear`` as it runs on real tensors. See Note [linear's bias on fake tensors]."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _ATEN_RNNS and getattr(func, "__module__", None) in (None, "torch", "torch._VF"):
            return _running(_IN_ATEN_RNN, func, args, kwargs)
        if func is torch._C._nn.scaled_dot_product_attention:
            return _running(_IN_ATTENTION, func, args, kwargs)
        if is_linear(func) and not torch.is_autocast_enabled("cpu"):
            x, weight, bias = linear_arguments(args, kwargs)
            if isinstance(x, torch.Tensor) and isinstance(bias, torch.Tensor):
                out = linear_as_real(x, weight, bias)
                if out is not None:
                    return out
        return func(*args, **kwargs)


def _running(flag: contextvars.ContextVar[bool], func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """Call ``func`` with ``flag`` set while it runs."""
    token = flag.set(True)
    try:
        return func(*args, **kwargs)
    finally:
        flag.reset(token)
