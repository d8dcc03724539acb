"""Per-op rules for storages whose fake (meta) kernels report a different size than the real kernel.

Most ops need no rule: autograd itself reports what it saves, and fake tensors have the right sizes.
A rule exists only where a real run and the fake run were seen to disagree, keyed by the aten op and
the device whose kernel is modelled. Each returns ``{output index: true nbytes}``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fxmem.rules import Registry
from fxmem.rules.onednn_rnn import lstm_workspace_bytes

__all__ = ["OP_RULES", "op_rules_for", "register_op_rule"]

OpKey = tuple[str, str]
"""(aten op packet, e.g. ``'aten.mkldnn_rnn_layer'``; device type, e.g. ``'cpu'``)."""

OP_RULES: Registry[OpKey, Any] = Registry("op rule")
register_op_rule = OP_RULES.register


def op_rules_for(device: str, rules: Registry[OpKey, Any] = OP_RULES) -> dict[str, Any]:
    """The rules for one device, keyed by op packet name, as capture.py applies them."""
    return {op: rule for (op, dev), rule in rules.rules().items() if dev == device}


@register_op_rule(("aten.mkldnn_rnn_layer", "cpu"))
def mkldnn_rnn_layer_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> dict[int, int]:
    """The CPU LSTM's oneDNN workspace (output 3): its meta kernel returns an empty uint8 tensor."""
    # ATen transposes batch-first input to (seq, batch, feature) before this op, whatever args[14] says.
    inp, hidden_size = args[0], int(args[10])
    seq_len, batch = inp.shape[0], inp.shape[1]
    nbytes = lstm_workspace_bytes(
        seq_len=int(seq_len), batch=int(batch), input_size=int(inp.shape[2]), hidden_size=hidden_size, dtype=inp.dtype
    )
    return {3: nbytes}


# Note [CPU embedding_bag buffers]
#     The CPU kernel of aten._embedding_bag allocates two of its outputs larger than they end up, then
#     shrinks them with resize_, which keeps the storage: offset2bag (output 1) is made with
#     indices.size(0) + 1 elements and resized to indices.size(0); bag_size (output 2) is made with
#     offsets.size(0) elements and, under include_last_offset, resized to one fewer. Its meta kernel
#     allocates the final sizes. It also disagrees about when offset2bag exists at all: the kernel
#     skips it for mode='sum' on its fast path, which takes float32, float16 and bfloat16 weights,
#     while the meta kernel's copy of that test leaves bfloat16 out. Both outputs are saved for backward.


@register_op_rule(("aten._embedding_bag", "cpu"))
def embedding_bag_buffers(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> dict[int, object]:
    """offset2bag and bag_size as the CPU kernel allocates them. See Note [CPU embedding_bag buffers]."""
    weight, indices, offsets = args[0], args[1], args[2]
    mode = _arg(args, kwargs, 4, "mode", 0)
    per_sample_weights = _arg(args, kwargs, 6, "per_sample_weights", None)
    padding_idx = _arg(args, kwargs, 8, "padding_idx", -1)
    offset2bag, bag_size = out[1], out[2]
    fast_sum = mode == _EMBEDDING_BAG_SUM and _embedding_bag_fast_sum(weight, per_sample_weights, padding_idx)
    return {
        1: 0 if fast_sum else (indices.shape[0] + 1) * offset2bag.element_size(),
        2: offsets.shape[0] * bag_size.element_size(),
    }


_EMBEDDING_BAG_SUM = 0


def _embedding_bag_fast_sum(weight: Any, per_sample_weights: Any, padding_idx: int) -> bool:
    """The CPU kernel's ``is_fast_path`` for mode='sum' (its freshly made output is always row-contiguous)."""
    fast = weight.dtype in (torch.float32, torch.float16, torch.bfloat16) and weight.stride(1) == 1 and padding_idx < 0
    return fast and (per_sample_weights is None or per_sample_weights.stride(0) == 1)


def _arg(args: Sequence[Any], kwargs: Mapping[str, Any], index: int, name: str, default: Any) -> Any:
    """An aten op's argument, whether the dispatcher passed it by position, by name, or left the default."""
    if index < len(args):
        return args[index]
    return kwargs.get(name, default)


# Note [CPU slow_conv_transpose3d output]
#     Where ATen picks its native kernel for a 3-D transposed convolution (slow_conv_transpose3d:
#     no oneDNN, or oneDNN declined, as for small single-sample inputs or 1x1 kernels on one thread),
#     that kernel makes its output with empty_like(input) and then resizes it to the output shape.
#     resize_ never shrinks a storage, so when the input has more elements per sample than the
#     output (a transposed convolution that reduces channels, or crops with its padding), the
#     output, which autograd saves for the next layer, holds the input's bytes. The meta kernel
#     allocates the output's size. The backend is ATen's own choice, asked of ATen for the same
#     arguments. With a symbolic batch ATen decides by the batch's hint (_BATCH_HINT in capture.py),
#     so for 1x1 kernels on one thread, where it switches to oneDNN from B=16, the line holds only
#     below 16 (test_conv_transpose3d_kernel_choice_changes_at_batch_16 in test_fuzz_regressions.py).


@register_op_rule(("aten.convolution", "cpu"))
def slow_conv_transpose3d_output(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> dict[int, object]:
    """The output storage of the native 3-D transposed convolution; see Note [CPU slow_conv_transpose3d output]."""
    inp, weight, bias, stride, padding, dilation, transposed, output_padding, groups = args[:9]
    if not transposed or inp.dim() != 5:
        return {}
    conv_args = (inp, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    if torch._C._select_conv_backend(*conv_args) != torch._C._ConvBackend.SlowTranspose3d:  # type: ignore[attr-defined]
        return {}
    larger = inp if _per_sample(inp) > _per_sample(out) else out
    return {0: larger.numel() * out.element_size()}


def _per_sample(t: Any) -> int:
    """Elements per entry of dim 0 (the convolution's batch), a plain int for any batch size."""
    return math.prod(t.shape[1:])
