"""Per-op rules for storages whose fake (meta) kernels report a different size than the real kernel.

Most ops need no rule: autograd itself reports what it saves, and fake tensors have the right sizes.
A rule exists only where a real run and the fake run were seen to disagree, keyed by the aten op and
the device whose kernel is modelled. Each returns ``{output index: true nbytes}``.

The registries themselves live in fxmem/rules/registries.py, which the rule modules register into;
this module re-exports them and imports every rule module, so importing it fills them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch._prims_common import (
    is_channels_last_contiguous_or_false,
    is_contiguous_or_false,
    make_channels_last_strides_for,
    make_contiguous_strides_for,
    suggest_memory_format,
)
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxmem.rules.cudnn_conv import cudnn_convolution_backward_workspace, cudnn_convolution_workspace
from fxmem.rules.cudnn_rnn import cudnn_rnn_backward_workspace, cudnn_rnn_reserve, cudnn_rnn_workspace
from fxmem.rules.onednn_conv import ConvShape, backward_marks, forward_marks, highest, onednn_convolution
from fxmem.rules.onednn_conv_avx2 import (
    avx2_backward_marks,
    avx2_channels_last_backward_marks,
    avx2_channels_last_forward_marks,
    avx2_channels_last_grad_output_copy,
    avx2_forward_marks,
    onednn_avx2_channels_last,
    onednn_avx2_convolution,
)
from fxmem.rules.onednn_rnn import PAGE_SIZE, get_good_ld, lstm_workspace_bytes
from fxmem.rules.registries import (
    LAYOUT_RULES,
    OP_RULES,
    WORKSPACE_RULES,
    layout_rules_for,
    op_rules_for,
    register_layout_rule,
    register_op_rule,
    register_workspace_rule,
    workspace_rules_for,
)
from fxmem.rules.sdpa_buffers import (
    cudnn_attention_backward_workspace,
    cudnn_attention_workspace,
    efficient_attention_backward_workspace,
    efficient_attention_host_seeds,
    efficient_attention_workspace,
    safe_softmax_workspace,
    softmax_backward_workspace,
)

__all__ = [
    "LAYOUT_RULES",
    "OP_RULES",
    "WORKSPACE_RULES",
    "layout_rules_for",
    "op_rules_for",
    "register_layout_rule",
    "register_op_rule",
    "register_workspace_rule",
    "workspace_rules_for",
]


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


# Note [Batch norm backward without an input gradient]
#     Where the input needs no gradient (batch norm as a model's first layer), autograd calls
#     native_batch_norm_backward with output_mask[0] false: the CPU kernel then returns no input
#     gradient at all, while its fake kernel still allocates one of the input's size. Measured on
#     torch 2.13 (tests/test_workspaces.py::test_batch_norm_backward_without_input_gradient); a
#     BatchNorm2d(2) on 2x8x9 inputs at B=1 predicted 43% high before this rule.


@register_op_rule(("aten.native_batch_norm_backward", "cpu"))
def batch_norm_backward_outputs(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> dict[int, object]:
    """No input gradient where none was asked for. See Note [Batch norm backward without an input gradient]."""
    output_mask = _arg(args, kwargs, 9, "output_mask", [True, True, True])
    return {} if output_mask[0] else {0: 0}


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


# Note [CPU losses that keep an input-sized storage]
#     Measured on the CPU (torch 2.13, profiler allocation events, tests/test_loss_storage.py): with
#     reduction 'mean' or 'sum', aten.mse_loss, aten.smooth_l1_loss and aten.soft_margin_loss make their
#     result input-shaped, reduce into it and hand it back as a 0-dim tensor; resize_ never shrinks a
#     storage, so the loss value holds the input's bytes. The user keeps ``loss`` to the step's end, so
#     those bytes live through backward and the optimizer step, and they grow with the batch. Their meta
#     kernels return 4 bytes. l1_loss, huber_loss and binary_cross_entropy_with_logits return plain
#     scalars. Inside the op, mse and smooth_l1 also fill an input-sized elementwise buffer, and a mean
#     divides by a wrapped count: 8 bytes, plus a copy in the loss's dtype where that is not float64;
#     16-bit inputs also sum in a float32 copy of the buffer (numel * 4) beside a 4-byte partial.
#     soft_margin_loss writes in place and holds only the mean's 4-byte partial beside the divisor.

_LOSS_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}
_INPUT_SIZED_LOSSES = ("aten.mse_loss", "aten.smooth_l1_loss", "aten.soft_margin_loss")


def _loss_reduction(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    return _LOSS_REDUCTIONS[int(_arg(args, kwargs, 2, "reduction", 1))]


def loss_value_storage(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> dict[int, object]:
    """The reduced loss's storage: the input's bytes. See Note [CPU losses that keep an input-sized storage]."""
    if _loss_reduction(args, kwargs) == "none":
        return {}
    inp = args[0]
    return {0: inp.numel() * inp.element_size()}


def loss_reduction_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any, *, buffer: bool) -> object:
    """What the reduced loss allocates and frees inside the op. See Note [CPU losses that keep an input-sized storage]."""
    reduction = _loss_reduction(args, kwargs)
    if reduction == "none":
        return 0
    inp = args[0]
    elementwise = inp.numel() * inp.element_size() if buffer else 0
    if reduction == "sum":
        return elementwise if buffer else 4
    divisor = 8 + (0 if inp.dtype == torch.float64 else inp.element_size())
    if not buffer:
        return 4 + divisor
    if inp.dtype in (torch.float16, torch.bfloat16):
        return elementwise + max(4 + inp.numel() * 4, divisor)
    return elementwise + divisor


for _loss in _INPUT_SIZED_LOSSES:
    register_op_rule((_loss, "cpu"))(loss_value_storage)


# Output layouts: where a real kernel lays an output out otherwise than its fake kernel, the bytes
# agree but what runs after may not (a reshape that is a view of one layout copies the other). Each
# rule returns {output index: the real kernel's strides}; dispatch.py's OpRuleMode sets them.

# Note [Batch norm outputs in the suggested layout]
#     The CPU kernels of batch norm (batch_norm_cpu and batch_norm_backward_cpu in
#     aten/src/ATen/native/Normalization.cpp) make the output and the input's gradient with
#     ``at::empty_like(input, input.suggest_memory_format())``: contiguous, or channels-last where the
#     input is laid out so. Their fake kernels keep the input's strides, as CUDA's native kernel does
#     (``batch_norm_cuda``: ``at::empty_like(self)``), so the rule is the CPU's only. A permuted
#     (B, C, L) input (a sequence transposed into channels) gets a contiguous output in eager and a
#     transposed one on fake tensors, and a Linear after it copied that output in its reshape on fake
#     tensors only: the fuzzer (seed 3) saw the bytes charged to the Linear that eager charges to the
#     norm. Measured against eager CPU on 2-, 3-, 4- and 5-d layouts (tests/test_dispatch.py).


def _suggested_strides(t: Any) -> tuple[Any, ...]:
    if suggest_memory_format(t) == torch.contiguous_format:
        return tuple(make_contiguous_strides_for(t.shape))
    return tuple(make_channels_last_strides_for(t.shape))


def _batch_norm_layout(input_index: int) -> Any:
    def rule(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> dict[int, tuple[Any, ...]]:
        inp = args[input_index]
        first = out[0]
        if not isinstance(first, torch.Tensor) or first.dim() < 2 or first.shape != inp.shape:
            return {}
        return {0: _suggested_strides(inp)}

    rule.__doc__ = "The output's layout: Note [Batch norm outputs in the suggested layout]."
    return rule


for _op in ("aten.native_batch_norm", "aten._native_batch_norm_legit", "aten._native_batch_norm_legit_functional",
            "aten._batch_norm_with_update", "aten._batch_norm_with_update_functional"):  # fmt: skip
    register_layout_rule((_op, "cpu"))(_batch_norm_layout(0))
for _op in ("aten.native_batch_norm_backward", "aten.batch_norm_backward"):
    register_layout_rule((_op, "cpu"))(_batch_norm_layout(1))


# Kernel workspaces: memory a kernel allocates and frees inside one op, owned by no tensor the op
# returns, so fake tensors never see it. Each rule returns the workspace's bytes (0 for none); the
# timeline charges it as a temporary alive, with the op's outputs, for the length of the op.

# Note [CPU slow convolution columns]
#     Where ATen picks its native ("slow") kernel for a 2-D or 3-D convolution (Slow2d, Slow3d:
#     oneDNN disabled or declined), the kernel unfolds its input into a columns buffer of
#     ``B * C_in * prod(kernel) * prod(output spatial)`` elements (im2col / vol2col), in the forward
#     before its output and freed after it, and again in backward: 2-D once, after both gradients
#     are made; 3-D once per gradient it computes (the same size, so the highest moment is the same).
#     A 1x1 kernel with stride 1 and no padding needs no columns (the input is its own), except in a
#     3-D backward that computes the input's gradient. Measured with torch.profiler for 2-D and 3-D,
#     kernels 1 and 3, strides 1 and 2, with and without an input gradient.
#     The backward, besides: both kernels take ``grad_output.contiguous()``, a copy of the whole
#     gradient where it is not contiguous (the expanded gradient of a sum, a transposed one), alive
#     with the columns; and the 2-D one makes its columns only for the weight's gradient (an input
#     gradient alone needs none). Measured with the profiler on torch 2.13, oneDNN on and off (the
#     slow kernels run 1x1 convolutions with few channels on this AVX2 CPU): 1008 backwards, 2-D and
#     3-D, kernels 1 to 3, padding 0 and 1, strides 1 and 2, 1 and 3 input and 1 and 4 output
#     channels, contiguous, expanded and transposed gradients, every mask of input and weight
#     gradients; exact on each (tests/test_fuzz_regressions.py). A fuzzed ReLU -> Conv3d(1, 1, 1,
#     padding=1) on (B, 1, 1, 1, 1) peaked in its backward 108 bytes a sample above fxmem without the
#     copy (the sum's expanded gradient, 27 floats a sample).

_SLOW_CONV = ("Slow2d", "Slow3d")


def _slow_conv_columns(inp: Any, weight: Any, out_spatial: Sequence[Any]) -> Any:
    return inp.shape[0] * weight.shape[1] * math.prod(weight.shape[2:]) * math.prod(out_spatial) * inp.element_size()


def _pointwise(weight: Any, stride: Sequence[Any], padding: Sequence[Any]) -> bool:
    return all(k == 1 for k in weight.shape[2:]) and all(s == 1 for s in stride) and all(p == 0 for p in padding)


def _slow_backend(
    inp: Any, weight: Any, stride: Any, padding: Any, dilation: Any, transposed: bool, output_padding: Any, groups: int
) -> str:
    if transposed or groups != 1:
        return ""
    backend = torch._C._select_conv_backend(inp, weight, None, stride, padding, dilation, transposed, output_padding, groups)
    name = str(backend).rpartition(".")[2]
    return name if name in _SLOW_CONV else ""


def _onednn_marks(inp: Any, weight: Any, *conv_args: Any, bias: bool = False) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The forward's and the backward's high marks as this CPU's oneDNN rules give them (AVX512's or
    AVX2's), or None where no rule describes the convolution (``conv_args``: stride, padding, dilation,
    transposed, output_padding, groups; ``bias``: whether the forward has one)."""
    if onednn_convolution(inp, weight, *conv_args):
        return forward_marks, backward_marks
    stride, padding, dilation, transposed, output_padding, groups = conv_args
    if onednn_avx2_convolution(inp, weight, stride, padding, dilation, transposed, output_padding, groups, bias=bias):
        return (
            functools.partial(avx2_forward_marks, groups=groups, bias=bias, dilation=dilation, transposed=transposed),
            functools.partial(avx2_backward_marks, groups=groups, transposed=transposed),
        )
    if onednn_avx2_channels_last(inp, weight, stride, padding, dilation, transposed, output_padding, groups):
        return (
            functools.partial(avx2_channels_last_forward_marks, groups=groups, bias=bias),
            functools.partial(avx2_channels_last_backward_marks, groups=groups),
        )
    return None


@register_workspace_rule(("aten.convolution", "cpu"))
def convolution_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """Slow: the columns buffer (Note [CPU slow convolution columns]); oneDNN: its reorders
    (Note [CPU oneDNN convolution buffers] in onednn_conv.py, and on AVX2 Note [CPU oneDNN
    convolution buffers on AVX2] in onednn_conv_avx2.py)."""
    inp, weight, bias, stride, padding, dilation, transposed, output_padding, groups = args[:9]
    onednn = _onednn_marks(inp, weight, stride, padding, dilation, transposed, output_padding, groups, bias=bias is not None)
    if onednn is not None:
        conv = ConvShape.of(inp, weight, stride, padding, dilation, out.shape[2:])
        return highest(inp.shape[0], onednn[0](conv, torch.get_num_threads()))
    if not _slow_backend(inp, weight, stride, padding, dilation, transposed, output_padding, groups) or _pointwise(weight, stride, padding):
        return 0
    return _slow_conv_columns(inp, weight, out.shape[2:])


@register_workspace_rule(("aten.convolution_backward", "cpu"))
def convolution_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """Slow: the columns buffer (Note [CPU slow convolution columns]); oneDNN: its reorders and
    scratchpads (Note [CPU oneDNN convolution buffers] in onednn_conv.py, and on AVX2 Note [CPU
    oneDNN convolution buffers on AVX2] in onednn_conv_avx2.py)."""
    grad_output, inp, weight, _bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = args[:11]
    onednn = _onednn_marks(inp, weight, stride, padding, dilation, transposed, output_padding, groups)
    if onednn is not None:
        if not any(mask):
            return 0
        conv = ConvShape.of(inp, weight, stride, padding, dilation, grad_output.shape[2:])
        if onednn_avx2_channels_last(inp, weight, stride, padding, dilation, transposed, output_padding, groups):
            copy = avx2_channels_last_grad_output_copy(grad_output)  # Note [CPU oneDNN channels-last convolution buffers on AVX2]
        else:
            copy = 0 if grad_output.is_contiguous() else grad_output.numel() * grad_output.element_size()
        return highest(inp.shape[0], onednn[1](conv, torch.get_num_threads(), mask), plus=copy)
    backend = _slow_backend(inp, weight, stride, padding, dilation, transposed, output_padding, groups)
    if not backend or not (mask[0] or mask[1]):
        return 0
    copy = 0 if grad_output.is_contiguous() else grad_output.numel() * grad_output.element_size()
    pointwise = _pointwise(weight, stride, padding)
    columns = (not pointwise or mask[0]) if backend == "Slow3d" else (mask[1] and not pointwise)
    return copy + (_slow_conv_columns(inp, weight, grad_output.shape[2:]) if columns else 0)


# Note [CPU oneDNN LSTM backward buffers]
#     aten.mkldnn_rnn_layer_backward (one layer and direction; input already (T, N, I)) allocates,
#     besides its outputs: N * H zeros for each of grad_hy and grad_cy that autograd left undefined, a
#     4H bias, the weight gradients in oneDNN's own layout, and the primitive's scratchpad, all freed
#     inside. The layout pads the gate dimension 4H to ``get_good_ld(4H)`` and the other (I, or H) to
#     16; where that other dimension needed padding a plain-sized copy is made as well. The scratchpad
#     is the scratch gates, T * N * get_good_ld(4H) elements rounded up to a page, plus 12856 bytes
#     (the same for every shape measured, with 2 threads). The one bias buffer beyond these is the
#     size of the second bias gradient, so the high mark above the outputs is
#         2 N H (each undefined state gradient) + 4H + weight-gradient buffers + scratchpad,
#     f32 (its element size 4). Measured with the profiler for T 5..24, N 1..8, I 8..32, H 16..64
#     (tests/test_workspaces.py).
#
#     Wider layers (measured the same way, T 10..100, N 2..8, I and H up to 512): the other dimension
#     is padded as a leading dimension is, by ``get_good_ld`` (rnn_utils.cpp), which adds 16 elements
#     to a multiple of 256 to avoid 4K aliasing: I or H of 256 or 512 gets the 16 more rows and the
#     plain-sized copy. The rule is then within 1.4 KiB over, but at H of 256 or more with N above 2,
#     where the call holds up to 15 KiB more (2 KiB a sample beyond the second). A 2-layer
#     LSTM(128, 256) at T = 50, B = 8 had its step's peak 6.5% low for want of the copy.
#
#     Which buffer is padded how (the profiler's sizes at H = 1..6, 50, 64, 100; the peak fuzzer found
#     H = 1 high by 3%): where the rows need padding, the padded-rows buffer keeps the gates as they
#     are (rows_ld x 4H) and the copy of the real rows has the padded gates (rows x get_good_ld(4H));
#     where they need none, one buffer of rows x get_good_ld(4H). The two agree wherever 4H is a
#     multiple of 16 below 256, which is what the first sweeps held.

_RNN_SCRATCH_FIXED = 12856


def _p(c: int, block: int = 16) -> int:
    return -(-c // block) * block


def _lstm_weight_gradient(rows: int, gates_ld: int, gates: int, e: int) -> int:
    """The weight gradient: rows by ``gates_ld`` where the rows need no padding; else a buffer of padded
    rows by the gates as they are, and a copy of the real rows by ``gates_ld``."""
    rows_ld = get_good_ld(rows, e)
    if rows_ld == rows:
        return rows * gates_ld * e
    return rows_ld * gates * e + rows * gates_ld * e


@register_workspace_rule(("aten.mkldnn_rnn_layer_backward", "cpu"))
def mkldnn_rnn_layer_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The oneDNN LSTM backward's transient buffers; see Note [CPU oneDNN LSTM backward buffers]."""
    inp, grad_hy, grad_cy = args[0], args[11], args[12]
    if inp.dtype != torch.float32:
        return 0
    seq, batch, input_size = inp.shape
    hidden = int(args[15])
    e, gates = inp.element_size(), 4 * hidden
    ld = get_good_ld(gates, e)
    undefined = sum(1 for g in (grad_hy, grad_cy) if g is None)
    scratch = seq * batch * ld * e
    # page rounding is no polynomial: with a symbolic batch, its bound
    scratch = scratch + PAGE_SIZE - 1 if isinstance(scratch, torch.SymInt) else -(-scratch // PAGE_SIZE) * PAGE_SIZE
    weights = _lstm_weight_gradient(int(input_size), ld, gates, e) + _lstm_weight_gradient(hidden, ld, gates, e)
    grad_copy = 0 if args[10].is_contiguous() else args[10].numel() * e
    return undefined * batch * hidden * e + gates * e + weights + scratch + _RNN_SCRATCH_FIXED + grad_copy


# Note [CPU oneDNN LSTM forward buffers]
#     aten.mkldnn_rnn_layer (one layer and direction, input already (T, N, I)) allocates, besides its
#     outputs and all freed inside: the two biases summed into one 4H row, both weight matrices
#     reordered to oneDNN's layout (I, and H, rows by ``get_good_ld(4H)``), and the primitive's
#     scratchpad. The scratchpad holds the scratch gates, rounded up to a page, for all T time steps
#     where oneDNN merges the layer's GEMM over the sequence and for one step where it does not; it
#     merges in the forward pass only below 128 samples (``merge_gemm_layer`` in oneDNN's
#     rnn_utils). Beside them are two N x ``get_good_ld(H)`` state rows, each rounded to a page, and
#     4664 bytes that no shape moved:
#         4H + (I + H) ld4H + page(T' N ld4H) + 2 page(N ldH) + 4664 bytes, f32, T' = T if N < 128 else 1.
#     The same with or without grad mode, trained or frozen weights, biases or none, and 1, 2 or 4
#     threads: measured with the profiler on 36 random shapes per thread count (T 1..30, N 1..300, I
#     and H 1..300) with no byte's difference (tests/test_workspaces.py). The fuzzer's frozen 2-layer
#     LSTM (H = 64, B = 1), whose forward is the step's peak, was 37% low without it.

_RNN_FORWARD_FIXED = 4664
_MERGED_GEMM_BELOW = 128


def _page(nbytes: int) -> int:
    return -(-nbytes // PAGE_SIZE) * PAGE_SIZE


@register_workspace_rule(("aten.mkldnn_rnn_layer", "cpu"))
def mkldnn_rnn_layer_forward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The oneDNN LSTM forward's transient buffers; see Note [CPU oneDNN LSTM forward buffers]. The CPU
    LSTM runs on concrete sizes only (Note [Concrete passes] in fxmem/engine/account.py)."""
    inp = args[0]
    if inp.dtype != torch.float32:
        return 0
    seq, batch, input_size = (int(d) for d in inp.shape)
    hidden = int(args[10])
    e = inp.element_size()
    ld = get_good_ld(4 * hidden, e)
    steps = seq if batch < _MERGED_GEMM_BELOW else 1
    weights = 4 * hidden * e + (input_size + hidden) * ld * e
    return weights + _page(steps * batch * ld * e) + 2 * _page(batch * get_good_ld(hidden, e) * e) + _RNN_FORWARD_FIXED


# Note [CPU matmul operand copies]
#     ATen's CPU addmm/mm (addmm_impl_cpu_ in aten/src/ATen/native/LinearAlgebra.cpp) hands BLAS an
#     operand as it is when its strides make it a row- or column-major matrix (one unit stride, the
#     other at least the matrix's width or height), and a contiguous clone of it otherwise, freed when
#     the op returns; both clones of one call live at once. The expanded gradient of a ``sum`` loss
#     (every stride 0) is such an operand: the head's two backward matmuls each clone it, the size of
#     the model's output. Float32 and float64 take that BLAS path; half-precision ones may take
#     oneDNN's matmul instead, which this rule does not describe, so it stands aside for them.
#     Measured with torch.profiler over eight layouts of each operand
#     (tests/test_workspaces.py::test_matmul_operand_copies_match_the_profiler).

_BLAS_DTYPES = (torch.float32, torch.float64)


def _blas_ready(m: Any) -> bool:
    """Whether BLAS takes the matrix ``m`` in place: row- or column-major with a valid leading dimension.
    A condition the symbolic sizes leave open counts as met (no copy), so that none is invented."""
    (rows, cols), (s0, s1) = m.shape, m.stride()
    maybe = lambda condition: not statically_known_true(torch.sym_not(condition))
    row_major = maybe(s1 == 1) and maybe(s0 >= torch.sym_max(1, cols))
    col_major = maybe(s0 == 1) and maybe(s1 >= torch.sym_max(1, rows))
    return row_major or col_major


def _operand_copies(*matrices: Any) -> object:
    if any(m.dtype not in _BLAS_DTYPES or m.dim() != 2 for m in matrices):
        return 0
    return sum((m.numel() * m.element_size() for m in matrices if not _blas_ready(m)), 0)


@register_workspace_rule(("aten.mm", "cpu"))
def mm_operand_copies(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """Contiguous clones of operands BLAS cannot take; see Note [CPU matmul operand copies]."""
    return _operand_copies(args[0], args[1])


@register_workspace_rule(("aten.addmm", "cpu"))
def addmm_operand_copies(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """Contiguous clones of operands BLAS cannot take; see Note [CPU matmul operand copies]."""
    return _operand_copies(args[1], args[2])


# Note [CPU batched matmul operand copies]
#     ATen's CPU bmm and baddbmm (bmm_out_or_baddbmm_ in LinearAlgebra.cpp) multiply small problems,
#     under 400 multiply-adds a slice (contraction x rows x columns), in a loop of their own, and
#     otherwise call addmm_impl_cpu_ once per batch slice: each slice's operands are cloned as in Note
#     [CPU matmul operand copies], one slice at a time, so the workspace is one slice of each operand
#     BLAS cannot take. The gradient of attention's weights (the math path's bmm of the output's
#     gradient with v transposed) copies this way. Measured with the profiler on shapes above and
#     below the 400, 25 layout pairs each, float32 (tests/test_workspaces.py); the peak fuzzer's SDPA
#     with dropout was 1% low without it.

_BATCHED_LOOP_BELOW = 400


@register_workspace_rule(("aten.bmm", "cpu"))
def bmm_operand_copies(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """One slice's clones of the operands BLAS cannot take; see Note [CPU batched matmul operand copies]."""
    return _batched_operand_copies(args[0], args[1])


@register_workspace_rule(("aten.baddbmm", "cpu"))
def baddbmm_operand_copies(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """One slice's clones of the operands BLAS cannot take; see Note [CPU batched matmul operand copies]."""
    return _batched_operand_copies(args[1], args[2])


def _batched_operand_copies(batch1: Any, batch2: Any) -> object:
    if batch1.dim() != 3 or batch2.dim() != 3 or batch1.shape[0] == 0:
        return 0
    (_, rows, inner), columns = batch1.shape, batch2.shape[2]
    if not statically_known_true(rows * inner * columns >= _BATCHED_LOOP_BELOW):
        return 0
    return _operand_copies(batch1[0], batch2[0])


# cuDNN's RNNs on the cuda target (fxmem/rules/cudnn_rnn.py): the reserve its meta kernel leaves empty
# (Note [cuDNN RNN reserve]), the forward's and backward's workspaces (Note [cuDNN RNN workspace],
# Note [cuDNN RNN backward buffers]).
# The math attention's ``_safe_softmax`` makes the same buffers on the CPU as on CUDA (Note [SDPA
# kernels' own buffers on CUDA] in sdpa_buffers.py): the -inf marks, one bool a row and the zero,
# all dying with the op (the profiler on torch 2.13; tests/test_workspaces.py).
register_workspace_rule(("aten._safe_softmax", "cpu"))(safe_softmax_workspace)


# Note [CPU flash attention buffers]
#     The CPU's fused attention (aten._scaled_dot_product_flash_attention_for_cpu, FlashAttentionKernel.cpp)
#     works in blocks of qSplit query rows by kvSplit keys: qSplit is 256 from 768 queries, 64 from 192,
#     else 32, kvSplit is 512 from 512 keys, each capped at the length. Each of at::get_num_threads()
#     threads gets its own float32 scratch: the forward a qSplit x kvSplit score block, a running max
#     and sum per row and a qSplit x head_dim output block; the backward a score block and its gradient
#     (2 x qSplit x kvSplit), with one qSplit row sum for all threads. The backward works in the
#     kernel's (B, S, H, D) order: where the output's gradient, seen so (``grad_out.transpose(1, 2)``),
#     is not contiguous (a gradient that reached it as (B, H, S, D) rows, as nn.MultiheadAttention's
#     does), it is first copied, a tensor of its size. All die with the op. Measured with the profiler
#     on torch 2.13 (float32, 1, 2 and 4 threads, 5 to 1000 queries, masks, 511-520 keys, both
#     gradient layouts; tests/test_workspaces.py): exact on every shape. Only float32 with a concrete
#     sequence length is covered: reduced precision adds more buffers, and a symbolic length leaves the
#     block sizes open.


def _concrete(*sizes: Any) -> bool:
    """Whether sizes are plain ints: with a symbolic sequence length the block sizes are not known."""
    return all(isinstance(n, int) for n in sizes)


def _flash_splits(queries: int, keys: int) -> tuple[int, int]:
    q_split = 256 if queries >= 768 else 64 if queries >= 192 else 32
    return min(q_split, queries), min(512 if keys >= 512 else keys, keys)


def cpu_flash_attention_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The forward's per-thread blocks. See Note [CPU flash attention buffers]."""
    q, k = args[0], args[1]
    if q.dtype != torch.float32 or not _concrete(q.shape[-2], k.shape[-2], q.shape[-1]):
        return 0
    q_split, kv_split = _flash_splits(int(q.shape[-2]), int(k.shape[-2]))
    return torch.get_num_threads() * (q_split * kv_split + 2 * q_split + q_split * int(q.shape[-1])) * 4


def cpu_flash_attention_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The backward's per-thread blocks. See Note [CPU flash attention buffers]."""
    q, k = args[1], args[2]
    if q.dtype != torch.float32 or not _concrete(q.shape[-2], k.shape[-2]):
        return 0
    q_split, kv_split = _flash_splits(int(q.shape[-2]), int(k.shape[-2]))
    grad_out = args[0]
    copy = 0 if is_contiguous_or_false(grad_out.transpose(1, 2)) else grad_out.numel() * grad_out.element_size()
    return (torch.get_num_threads() * 2 * q_split * kv_split + q_split) * 4 + copy


register_workspace_rule(("aten._scaled_dot_product_flash_attention_for_cpu", "cpu"))(cpu_flash_attention_workspace)
register_workspace_rule(("aten._scaled_dot_product_flash_attention_for_cpu_backward", "cpu"))(cpu_flash_attention_backward_workspace)
# Note [CPU layer norm buffers]
#     The CPU's layer norm (aten/src/ATen/native/layer_norm.cpp and cpu/layer_norm_kernel.cpp) works on
#     contiguous rows: the forward takes ``input.expect_contiguous()``, so an input that is a permuted
#     view (ConvNeXt's LayerNorm over channels after ``permute(0, 2, 3, 1)``) is copied whole for the
#     op's length; the backward does the same to the saved input and to the incoming gradient, and, when
#     it computes the weight's or the bias's gradient, sums per thread into a float32 buffer of
#     at::get_num_threads() x 2 x N (N the normalized size). All die with the op. Their meta kernels
#     allocate none of it. Measured with the profiler on torch 2.13 (1, 2 and 3 threads; permuted and
#     contiguous inputs; with and without weight, bias and input gradient): tests/test_workspaces.py.
#     A ConvNeXt block's permuted LayerNorm at B=4, 16 channels, 6x6 peaked 48% above fxmem without it.
#     Whether the gradient is contiguous can hang on the strides of size-1 dimensions upstream (a cat
#     in a layout its inputs suggest): see Note [TensorIterator output layouts on the CPU].


def _copy_if_strided(t: Any) -> int:
    """The bytes of ``t.contiguous()``'s copy: 0 where it is contiguous already."""
    return 0 if t is None or t.is_contiguous() else t.numel() * t.element_size()


def cpu_layer_norm_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The input's contiguous copy. See Note [CPU layer norm buffers]."""
    return _copy_if_strided(args[0])


def cpu_layer_norm_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """Contiguous copies of the gradient and the input, and the per-thread weight-gradient sums.
    See Note [CPU layer norm buffers]."""
    grad_out, inp, normalized_shape = args[0], args[1], args[2]
    weight = _arg(args, kwargs, 5, "weight", None)
    output_mask = _arg(args, kwargs, 7, "output_mask", [True, True, True])
    sums = 0
    if weight is not None and (output_mask[1] or output_mask[2]):
        sums = torch.get_num_threads() * 2 * math.prod(normalized_shape) * 4
    return _copy_if_strided(grad_out) + _copy_if_strided(inp) + sums


register_workspace_rule(("aten.native_layer_norm", "cpu"))(cpu_layer_norm_workspace)
register_workspace_rule(("aten.native_layer_norm_backward", "cpu"))(cpu_layer_norm_backward_workspace)
# Note [CPU log_softmax copies a strided input]
#     The CPU's log_softmax (log_softmax_cpu_out in aten/src/ATen/native/SoftMax.cpp), and its softmax
#     (softmax_cpu_out, same file, same code, measured alike), starts with
#     ``input.contiguous()`` whatever the dim, so logits that are not contiguous (a classifier's
#     channels-last (B, C, H, W) output, log_softmax over the channels as cross_entropy does) are copied
#     whole for the op's length; its output is always contiguous (the meta function asks for the legacy
#     contiguous format). The backward (log_softmax_backward_cpu_out, same file) copies the incoming
#     gradient the same way (and the output, which is contiguous). Those copies die with the op; the
#     fake kernels allocate none of them. A tensor that is both layouts (one channel, or 1 x 1 maps) is
#     not copied. Measured with the profiler on torch 2.13, float32: channels-last, transposed and
#     expanded tensors, dims 0, 1 and 3 (tests/test_export_locals.py).


def cpu_log_softmax_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The input's contiguous copy. See Note [CPU log_softmax copies a strided input]."""
    return _copy_if_strided(args[0])


def cpu_log_softmax_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The gradient's and the output's contiguous copies. See Note [CPU log_softmax copies a strided input]."""
    return _copy_if_strided(args[0]) + _copy_if_strided(args[1])


for _op in ("_log_softmax", "_softmax"):
    register_workspace_rule((f"aten.{_op}", "cpu"))(cpu_log_softmax_workspace)
    register_workspace_rule((f"aten.{_op}_backward_data", "cpu"))(cpu_log_softmax_backward_workspace)
# Note [CPU exact GELU backward]
#     The CPU's gelu_backward with approximate='none' hands a contiguous float32 input to oneDNN's
#     eltwise backward (gelu_backward_out_cpu in aten/src/ATen/native/Activation.cpp, ``use_mkldnn``),
#     which needs dense operands: a gradient that is not contiguous (the expanded gradient of a sum, a
#     transposed one) is copied first, and a gradient input laid out like a non-contiguous gradient is
#     computed into a dense temporary and copied back. Both die with the op. Measured with the profiler
#     on torch 2.13 over contiguous, expanded, broadcast and transposed gradients and inputs, both
#     approximations (tests/test_workspaces.py); the tanh approximation and non-contiguous inputs take
#     the TensorIterator kernel, which needs neither.


def cpu_gelu_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """oneDNN's dense copies. See Note [CPU exact GELU backward]."""
    grad, inp = args[0], args[1]
    approximate = _arg(args, kwargs, 2, "approximate", "none")
    if approximate != "none" or inp.dtype != torch.float32 or not inp.is_contiguous() or not torch.backends.mkldnn.is_available():
        return 0
    return _copy_if_strided(grad) + _copy_if_strided(out)


register_workspace_rule(("aten.gelu_backward", "cpu"))(cpu_gelu_backward_workspace)
# Note [CPU pooling and padding backward copies]
#     The CPU backward kernels of pooling (max with indices, average, adaptive), reflection and
#     replication padding work on dense tensors in one of two layouts, contiguous or channels last
#     (aten/src/ATen/native/cpu/AvgPoolKernel.cpp, MaxPoolKernel.cpp, AdaptiveAvgPoolKernel.cpp,
#     PaddingKernel.cpp). They take the incoming gradient's layout when it is dense in either, and copy
#     it to contiguous when it is dense in neither (a sum's expanded gradient, a transposed one); the
#     gradient input is allocated in the input's suggested layout, and where that differs from the
#     kernel's, computed into a dense temporary first. Max pooling also copies its indices into the
#     kernel's layout. 2-D nearest upsampling backward only copies a gradient that is dense in neither
#     layout; 3-D average and adaptive average pooling have no channels-last path and copy any
#     gradient that is not contiguous, and 3-D nearest upsampling reduces a channels-last gradient
#     into an input-sized temporary. All of it dies with the op; the meta kernels show none of
#     it. Measured with the profiler over contiguous, channels-last, transposed and expanded gradients
#     and inputs, 2-D and 3-D, on torch 2.13 (tests/test_workspaces.py::test_cpu_pooling_backward_scratch);
#     the ops without a rule here (1-D padding, linear upsampling) were not measured.
#     Adaptive max pooling's backward (AdaptiveMaxPoolKernel.cpp, AdaptiveMaxPooling3d.cpp) differs:
#     the 2-D kernel works in the layout the input suggests (its gradient input is allocated so), the
#     3-D one in contiguous order always, and each copies the incoming gradient and the indices that
#     are not dense in that layout, whatever layout they are dense in. 1-D pooling is the 2-D op on an
#     unsqueezed input. Measured the same way over input, gradient and indices layouts, 2-D and 3-D
#     (test_cpu_pooling_backward_scratch); the fuzzer's Embedding -> ReLU -> adaptive_max_pool1d, whose
#     backward peaked copying a sum's expanded gradient, was 17% low without it.

_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def _dense_format(t: Any) -> torch.memory_format | None:
    """The layout ``t`` is dense in: contiguous, channels last, or None for neither."""
    if t.is_contiguous():
        return torch.contiguous_format
    last = _CHANNELS_LAST.get(t.dim())
    return last if last is not None and t.is_contiguous(memory_format=last) else None


def _bytes(t: Any) -> int:
    return t.numel() * t.element_size()


def cpu_pooling_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any, *, indices: int | None = None) -> object:
    """The gradient's copy, the gradient input's temporary and the indices' copy. See Note [CPU pooling
    and padding backward copies]."""
    grad, inp = args[0], args[1]
    if grad.dtype != torch.float32:
        return 0
    grad_format = _dense_format(grad)
    kernel = grad_format or torch.contiguous_format
    nbytes = 0 if grad_format is not None else _bytes(grad)
    if kernel != (_dense_format(inp) or torch.contiguous_format):
        nbytes += _bytes(inp)
    if indices is not None:
        index = _arg(args, kwargs, indices, "indices", None)
        if index is not None and not index.is_contiguous(memory_format=kernel):
            nbytes += _bytes(index)
    return nbytes


def cpu_adaptive_max_pool_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The gradient's and the indices' copies into the kernel's layout. See Note [CPU pooling and
    padding backward copies]."""
    grad, inp, indices = args[0], args[1], _arg(args, kwargs, 2, "indices", None)
    if grad.dtype != torch.float32:
        return 0
    kernel = suggest_memory_format(inp) if inp.dim() == 4 else torch.contiguous_format
    return sum((_bytes(t) for t in (grad, indices) if t is not None and not t.is_contiguous(memory_format=kernel)), 0)


def cpu_upsample_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The gradient's copy where it is dense in neither layout. See Note [CPU pooling and padding backward copies]."""
    grad = args[0]
    return 0 if grad.dtype != torch.float32 or _dense_format(grad) is not None else _bytes(grad)


def cpu_contiguous_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The gradient's contiguous copy, for the 3-D kernels with no channels-last path. See Note [CPU
    pooling and padding backward copies]."""
    grad = args[0]
    return 0 if grad.dtype != torch.float32 or grad.is_contiguous() else _bytes(grad)


_POOLING_BACKWARD = (
    "avg_pool2d_backward", "_adaptive_avg_pool2d_backward", "reflection_pad2d_backward", "reflection_pad3d_backward",
    "replication_pad2d_backward", "replication_pad3d_backward",
)  # fmt: skip
_MAX_POOLING_BACKWARD = {"max_pool2d_with_indices_backward": 7, "max_pool3d_with_indices_backward": 7}
"""Op name: the position of its indices argument."""
_CONTIGUOUS_BACKWARD = ("avg_pool3d_backward", "_adaptive_avg_pool3d_backward")


def cpu_upsample_nearest3d_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """A channels-last gradient is reduced into a contiguous temporary the input's size; a gradient dense
    in neither layout is copied. See Note [CPU pooling and padding backward copies]."""
    grad, input_size = args[0], args[2]
    if grad.dtype != torch.float32 or grad.is_contiguous():
        return 0
    if _dense_format(grad) is not None:
        return math.prod(input_size) * grad.element_size()
    return _bytes(grad)


# Note [CPU 2-D upsampling works channels-last]
#     The CPU kernels of 2-D nearest, nearest-exact and bilinear upsampling (UpSampleKernel.cpp) work
#     on channels-last tensors: an input that is not channels-last contiguous is copied to that layout
#     first, and where the output they return is not channels-last contiguous (a contiguous NCHW
#     input's output is not), they compute into a channels-last temporary and copy it over. Both die
#     with the op. A one-channel tensor is both layouts at once: no copy. The fake kernels show the
#     output only. Measured with the profiler on torch 2.13, float32: 192 cases of shape, layout
#     (contiguous, channels-last, transposed, channel-sliced), mode, align_corners and output size,
#     every one to the byte (tests/test_workspaces.py). The peak fuzzer found it through a model whose
#     forward peaked at an upsampling (3.6% low).


def cpu_upsample_2d_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The channels-last copies of input and output; see Note [CPU 2-D upsampling works channels-last]."""
    inp = args[0]
    if inp.dtype != torch.float32 or inp.dim() != 4 or not isinstance(out, torch.Tensor):
        return 0
    copies = [t for t in (inp, out) if not is_channels_last_contiguous_or_false(t)]
    return sum((_bytes(t) for t in copies), 0)


for _op in ("upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_bilinear2d"):
    register_workspace_rule((f"aten.{_op}", "cpu"))(cpu_upsample_2d_workspace)


# Note [CPU upsampling's index tables]
#     Where the CPU's upsampling does not take the channels-last path (1-D and 3-D inputs laid out
#     contiguously, and bicubic), its generic kernel (upsample_generic_Nd_kernel_impl, UpSampleKernel.cpp)
#     first tabulates, for every output position of every spatial dimension, the input positions it
#     reads (int64) and their weights (float32): one of each for nearest, two for linear, four for
#     bicubic, 12 bytes a tap, all dying with the op. The backward kernels keep no such table. Measured
#     with the profiler on torch 2.13, float32, 1-D and 3-D shapes, contiguous inputs (and bicubic in
#     both 2-D layouts) (tests/test_workspaces.py); the fuzzer's two 1-D nearest upsamplings, whose
#     forward was the step's peak, were 22% low without it. A channels-last 3-D input takes another
#     path, not measured enough to describe: no rule.

_UPSAMPLE_TAPS = {
    "upsample_nearest1d": 1, "_upsample_nearest_exact1d": 1, "upsample_linear1d": 2,
    "upsample_nearest3d": 1, "_upsample_nearest_exact3d": 1, "upsample_trilinear3d": 2, "upsample_bicubic2d": 4,
}  # fmt: skip
_TAP_BYTES = 12


def cpu_upsample_index_tables(taps: int, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The generic kernel's positions and weights; see Note [CPU upsampling's index tables]."""
    inp = args[0]
    if inp.dtype != torch.float32 or not isinstance(out, torch.Tensor):
        return 0
    laid_out = inp.is_contiguous() or (taps == 4 and is_channels_last_contiguous_or_false(inp))
    return taps * _TAP_BYTES * sum(out.shape[2:]) if laid_out else 0


for _op, _taps in _UPSAMPLE_TAPS.items():
    register_workspace_rule((f"aten.{_op}", "cpu"))(functools.partial(cpu_upsample_index_tables, _taps))
for _op in _POOLING_BACKWARD:
    register_workspace_rule((f"aten.{_op}", "cpu"))(cpu_pooling_backward_workspace)
for _op, _at in _MAX_POOLING_BACKWARD.items():
    register_workspace_rule((f"aten.{_op}", "cpu"))(functools.partial(cpu_pooling_backward_workspace, indices=_at))
for _op in ("adaptive_max_pool2d_backward", "adaptive_max_pool3d_backward"):
    register_workspace_rule((f"aten.{_op}", "cpu"))(cpu_adaptive_max_pool_backward_workspace)
for _op in _CONTIGUOUS_BACKWARD:
    register_workspace_rule((f"aten.{_op}", "cpu"))(cpu_contiguous_backward_workspace)
register_workspace_rule(("aten.upsample_nearest2d_backward", "cpu"))(cpu_upsample_backward_workspace)
register_workspace_rule(("aten.upsample_nearest3d_backward", "cpu"))(cpu_upsample_nearest3d_backward_workspace)


# Note [CPU embedding_bag backward scratch]
#     The CPU's dense embedding_bag backward for mode 'sum' and 'mean' (_embedding_bag_dense_backward_cpu
#     in aten/src/ATen/native/EmbeddingBag.cpp) sorts the indices (values and permutation, int64 each)
#     and gathers through an index list of the same length, three index-sized buffers at once; where
#     the forward took the fast 'sum' path and made no offset2bag (Note [CPU embedding_bag buffers]) it
#     builds one, one entry longer than the indices; with per-sample weights it also fills their
#     gradient, one value per index. All die with the op. Measured with the profiler on torch 2.13 over
#     both modes, with and without padding_idx and per-sample weights, 7 to 100 indices
#     (tests/test_workspaces.py::test_cpu_embedding_bag_backward_scratch). Mode 'max' works otherwise
#     and has no rule.


def cpu_embedding_bag_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The sort, gather and offset2bag buffers. See Note [CPU embedding_bag backward scratch]."""
    grad, indices = args[0], args[1]
    mode = _arg(args, kwargs, 8, "mode", 0)
    sparse = _arg(args, kwargs, 9, "sparse", False)
    per_sample_weights = _arg(args, kwargs, 10, "per_sample_weights", None)
    padding_idx = _arg(args, kwargs, 11, "padding_idx", -1)
    if sparse or mode not in (_EMBEDDING_BAG_SUM, _EMBEDDING_BAG_MEAN):
        return 0
    nbytes = 3 * indices.numel() * indices.element_size()
    fast_sum = mode == _EMBEDDING_BAG_SUM and padding_idx < 0 and grad.dtype in (torch.float32, torch.float16, torch.bfloat16)
    if fast_sum and (per_sample_weights is None or per_sample_weights.stride(0) == 1):
        nbytes += (indices.numel() + 1) * indices.element_size()
    if per_sample_weights is not None:
        nbytes += indices.numel() * grad.element_size()
    return nbytes


_EMBEDDING_BAG_MEAN = 1
register_workspace_rule(("aten._embedding_bag_backward", "cpu"))(cpu_embedding_bag_backward_workspace)


register_workspace_rule(("aten.mse_loss", "cpu"))(functools.partial(loss_reduction_workspace, buffer=True))
register_workspace_rule(("aten.smooth_l1_loss", "cpu"))(functools.partial(loss_reduction_workspace, buffer=True))
register_workspace_rule(("aten.soft_margin_loss", "cpu"))(functools.partial(loss_reduction_workspace, buffer=False))

register_op_rule(("aten._cudnn_rnn", "cuda"))(cudnn_rnn_reserve)
register_workspace_rule(("aten._cudnn_rnn", "cuda"))(cudnn_rnn_workspace)
register_workspace_rule(("aten._cudnn_rnn_backward", "cuda"))(cudnn_rnn_backward_workspace)

# SDPA's kernels on the cuda target (fxmem/rules/sdpa.py): the memory-efficient kernel's philox seed
# and offset, host tensors its meta kernel makes as 8-byte tensors, and the buffers cuDNN attention,
# memory-efficient attention and the math path's _safe_softmax make and free inside, and the
# temporary of every softmax's backward (fxmem/rules/sdpa_buffers.py, Note [SDPA kernels' own buffers on CUDA]).
register_op_rule(("aten._scaled_dot_product_efficient_attention", "cuda"))(efficient_attention_host_seeds)
register_workspace_rule(("aten._scaled_dot_product_cudnn_attention", "cuda"))(cudnn_attention_workspace)
register_workspace_rule(("aten._scaled_dot_product_cudnn_attention_backward", "cuda"))(cudnn_attention_backward_workspace)
register_workspace_rule(("aten._scaled_dot_product_efficient_attention", "cuda"))(efficient_attention_workspace)
register_workspace_rule(("aten._scaled_dot_product_efficient_attention_backward", "cuda"))(efficient_attention_backward_workspace)
register_workspace_rule(("aten._safe_softmax", "cuda"))(safe_softmax_workspace)
register_workspace_rule(("aten._softmax_backward_data", "cuda"))(softmax_backward_workspace)


# cuDNN's convolution workspaces on the cuda target (fxmem/rules/cudnn_conv.py, Note [cuDNN convolution
# workspaces]): the forward's, and the backward's parts with the grad_output copies they make.
register_workspace_rule(("aten.convolution", "cuda"))(cudnn_convolution_workspace)
register_workspace_rule(("aten.convolution_backward", "cuda"))(cudnn_convolution_backward_workspace)


# The rule modules that register into fxmem/rules/registries.py themselves: imported last, so that
# every registry is full once this module is, and in the order the rules were registered before.
from fxmem.rules import cpu_layouts, cpu_norms, cuda_norms, nf4_ops  # noqa: E402, F401  (the cpu's pointwise layouts and normalization rules, the cuda target's norms, bitsandbytes' 4-bit matmul)
