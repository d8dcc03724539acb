"""Per-op rules for storages whose fake (meta) kernels report a different size than the real kernel.

Most ops need no rule: autograd itself reports what it saves, and fake tensors have the right sizes.
A rule exists only where a real run and the fake run were seen to disagree, keyed by the aten op and
the device whose kernel is modelled. Each returns ``{output index: true nbytes}``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fxmem.rules import Registry
from fxmem.rules.onednn_rnn import PAGE_SIZE, get_good_ld, lstm_workspace_bytes

__all__ = ["OP_RULES", "WORKSPACE_RULES", "op_rules_for", "register_op_rule", "register_workspace_rule", "workspace_rules_for"]

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


# Kernel workspaces: memory a kernel allocates and frees inside one op, owned by no tensor the op
# returns, so fake tensors never see it. Each rule returns the workspace's bytes (0 for none); the
# timeline charges it as a temporary alive, with the op's outputs, for the length of the op.

WORKSPACE_RULES: Registry[OpKey, Any] = Registry("workspace rule")
register_workspace_rule = WORKSPACE_RULES.register


def workspace_rules_for(device: str, rules: Registry[OpKey, Any] = WORKSPACE_RULES) -> dict[str, Any]:
    """The workspace rules for one device, keyed by op packet name, as timeline.py applies them."""
    return {op: rule for (op, dev), rule in rules.rules().items() if dev == device}


# Note [CPU slow convolution columns]
#     Where ATen picks its native ("slow") kernel for a 2-D or 3-D convolution (Slow2d, Slow3d:
#     oneDNN disabled or declined), the kernel unfolds its input into a columns buffer of
#     ``B * C_in * prod(kernel) * prod(output spatial)`` elements (im2col / vol2col), in the forward
#     before its output and freed after it, and again in backward: 2-D once, after both gradients
#     are made; 3-D once per gradient it computes (the same size, so the highest moment is the same).
#     A 1x1 kernel with stride 1 and no padding needs no columns (the input is its own), except in a
#     3-D backward that computes the input's gradient. Measured with torch.profiler for 2-D and 3-D,
#     kernels 1 and 3, strides 1 and 2, with and without an input gradient
#     (tests/test_timeline.py::test_slow_convolution_columns_match_the_profiler).

_SLOW_CONV = ("Slow2d", "Slow3d")


def _slow_conv_columns(inp: Any, weight: Any, out_spatial: Sequence[Any]) -> Any:
    return inp.shape[0] * weight.shape[1] * math.prod(weight.shape[2:]) * math.prod(out_spatial) * inp.element_size()


def _pointwise(weight: Any, stride: Sequence[Any], padding: Sequence[Any]) -> bool:
    return all(k == 1 for k in weight.shape[2:]) and all(s == 1 for s in stride) and all(p == 0 for p in padding)


def _slow_backend(inp: Any, weight: Any, stride: Any, padding: Any, dilation: Any, transposed: bool, output_padding: Any, groups: int) -> str:
    if transposed or groups != 1:
        return ""
    backend = torch._C._select_conv_backend(inp, weight, None, stride, padding, dilation, transposed, output_padding, groups)
    name = str(backend).rpartition(".")[2]
    return name if name in _SLOW_CONV else ""


# Note [CPU oneDNN convolution buffers]
#     Where ATen picks oneDNN (the Mkldnn backend) for a plain-layout (NCHW / NCDHW) convolution, ideep
#     reorders its operands into the blocked layouts the chosen oneDNN kernel wants, runs it, and
#     reorders the result back; every reordered copy and the kernel's scratchpad are c10 allocations
#     freed inside the op. What follows is this machine's oneDNN (v3.12, torch 2.13) on an AVX512 CPU
#     (``torch.backends.cpu.get_cpu_capability() == "AVX512"``: 16-channel blocks, ``aBcd16b``), read
#     off ONEDNN_VERBOSE's kernel names and layouts and the profiler's allocations, f32. ``p16(c)`` is c
#     rounded up to 16, ``x16`` / ``y16`` the input / output with channels so padded, ``K`` the kernel
#     volume, ``nthr`` torch's intra-op threads.
#     * Forward: with fewer than 16 input channels and a kernel larger than 1 the input stays plain
#       ("first convolution" kernel; weights ``Acdb16a``, K * p16(cout) * cin); otherwise the input is
#       reordered to x16 and the weights to K * p16(cout) * p16(cin). The output is made as y16 and
#       reordered into the returned plain tensor. A 2-D 1x1 kernel with stride > 1 also gathers the
#       strided input per thread (``rtus``): (nthr * p16(cin) * output pixels + 32) elements.
#       The high mark is max(input copy + weights + y16 (+ rtus), y16 + output).
#     * Backward, input gradient, stride 1: grad_output to y16, weights to K * p16(cin) * p16(cout),
#       the gradient made as x16 and reordered into the plain result (max(y16 + w + x16, x16 + x)).
#       Stride > 1 takes ``brgconv_strided`` in channels-last: grad_output copied (y bytes), weights
#       K * cout * p16(cin), the result (x bytes) and a scratchpad (61488 bytes in 2-D; in 3-D it varies
#       with the kernel, 94256..151584 seen: 151584 is used, an estimate), then two x-sized copies.
#     * Backward, weight gradient (after the input gradient, which is alive by then):
#       - fewer than 4 input channels, kernel > 1: the first-convolution kernel, input plain,
#         grad_output to y16, gradient K * p16(cout) * cin, scratchpad 8384 + that gradient;
#       - 2-D, kernel > 1, at most 8 channels in and out: an AVX2 kernel with 8-channel blocks
#         (x8, y8, gradient w8, scratchpad 12288 + w8);
#       - 3-D, kernel > 1, fewer than 16 input channels: the GEMM kernel on plain layouts, gradient w,
#         scratchpad nthr * cin * K * (output H * W) elements (its im2col, one output depth plane per
#         thread) + 8 * w + 256 bytes;
#       - otherwise the AVX512 blocked kernel: x16, y16, gradient K * p16(cin) * p16(cout), plus the
#         2-D rtus buffer above, plus a per-thread reduction copy (8384 + gradient) where the channel
#         blocks are too few to share among the threads (p16(cin)/16 * p16(cout)/16 <= nthr; 64 bytes less for 1x1 stride 1). That
#         last test is a heuristic (oneDNN's balance() also weighs the spatial work): a 2-D 12->12 3x3
#         kernel was seen without it, so there the rule overstates by ~10 KB.
#       The gradient is then reordered into the returned weight gradient.
#     Checked against the profiler for 2-D and 3-D, kernels 1, 2, 3 and 7, strides 1 and 2, 1 to 128
#     channels, batch 1 to 8 (tests/test_workspaces.py). Other ISAs, dtypes, groups and transposed
#     convolutions get no rule (their kernels and layouts differ); channels-last inputs skip the reorders
#     (no rule either: the figures above would overstate).

_DNNL_SCRATCH_2D_STRIDED = 61488
_DNNL_SCRATCH_3D_STRIDED = 151584
_DNNL_REDUCTION = 8384
_DNNL_AVX2 = 12288


def _p(c: int, block: int = 16) -> int:
    return -(-c // block) * block


def _onednn_convolution(inp: Any, weight: Any, stride: Any, padding: Any, dilation: Any, transposed: bool, output_padding: Any, groups: int) -> bool:
    """Whether the rules of Note [CPU oneDNN convolution buffers] describe this convolution."""
    if transposed or groups != 1 or inp.dim() not in (4, 5) or inp.dtype != torch.float32:
        return False
    if torch.backends.cpu.get_cpu_capability() != "AVX512" or not inp.is_contiguous():
        return False
    backend = torch._C._select_conv_backend(inp, weight, None, stride, padding, dilation, transposed, output_padding, groups)
    return str(backend).rpartition(".")[2] == "Mkldnn"


def _rtus(inp: Any, weight: Any, stride: Sequence[Any], out_spatial: Sequence[Any]) -> Any:
    """The 2-D 1x1 strided kernel's per-thread gathered input (Note [CPU oneDNN convolution buffers])."""
    if inp.dim() != 4 or any(k != 1 for k in weight.shape[2:]) or all(s == 1 for s in stride):
        return 0
    return (torch.get_num_threads() * _p(weight.shape[1]) * math.prod(out_spatial) + 32) * inp.element_size()


def _highest(batch: Any, marks: Callable[[int], Sequence[int]]) -> Any:
    """The largest of some byte counts, each linear in the batch: ``marks(b)`` lists them at batch b.

    A timeline's bytes must be polynomials in B, and the largest of several lines is not one. So
    where the batch is symbolic this returns the line largest at B = 2 (where the symbolic timeline
    starts) if it is also largest for large B, and so everywhere from 2 up. Where the lead changes
    hands, no polynomial is exact; it returns the line largest at B = 8 (the batch ShapeEnv assumes),
    which errs on the batches where another line leads, by the gap between the two lines there
    (ResNet-50's test configuration at B=4: its layer-3 downsampling backward, 8 KB under of 2.8 MB)."""
    if not isinstance(batch, torch.SymInt):
        return max(marks(int(batch)))
    fixed, at_one, at_two, at_eight, at_large = marks(0), marks(1), marks(2), marks(8), marks(2**20)
    lead = max(range(len(fixed)), key=lambda i: (at_two[i], at_large[i]))
    if at_large[lead] != max(at_large):
        lead = max(range(len(fixed)), key=lambda i: (at_eight[i], at_large[i]))
    return (at_one[lead] - fixed[lead]) * batch + fixed[lead]


@register_workspace_rule(("aten.convolution", "cpu"))
def convolution_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """Slow: the columns buffer (Note [CPU slow convolution columns]); oneDNN: its reorders
    (Note [CPU oneDNN convolution buffers])."""
    inp, weight, _bias, stride, padding, dilation, transposed, output_padding, groups = args[:9]
    if _onednn_convolution(inp, weight, stride, padding, dilation, transposed, output_padding, groups):
        cin, cout, e = weight.shape[1], weight.shape[0], inp.element_size()
        ks, s_in, s_out = math.prod(weight.shape[2:]), math.prod(inp.shape[2:]), math.prod(out.shape[2:])
        first = cin < 16 and ks > 1
        w_copy = ks * _p(cout) * (cin if first else _p(cin)) * e
        rtus = _rtus(inp, weight, stride, out.shape[2:])

        def marks(batch: int) -> list[int]:
            x_copy = 0 if first else batch * _p(cin) * s_in * e
            y16, y = batch * _p(cout) * s_out * e, batch * cout * s_out * e
            return [x_copy + w_copy + y16 + rtus - y, y16]

        return _highest(inp.shape[0], marks)
    if not _slow_backend(inp, weight, stride, padding, dilation, transposed, output_padding, groups) or _pointwise(weight, stride, padding):
        return 0
    return _slow_conv_columns(inp, weight, out.shape[2:])


def _onednn_backward(grad_output: Any, inp: Any, weight: Any, stride: Sequence[Any], mask: Sequence[bool]) -> Any:
    """The high mark of a oneDNN convolution backward above its outputs (Note [CPU oneDNN convolution buffers])."""
    cin, cout, e = weight.shape[1], weight.shape[0], inp.element_size()
    ks, s_in, s_out = math.prod(weight.shape[2:]), math.prod(inp.shape[2:]), math.prod(grad_output.shape[2:])
    nthr, dim, plane = torch.get_num_threads(), inp.dim(), math.prod(grad_output.shape[3:])
    w, w16 = ks * cin * cout * e, ks * _p(cin) * _p(cout) * e
    rtus = _rtus(inp, weight, stride, grad_output.shape[2:])
    strided = any(s != 1 for s in stride)
    return _highest(inp.shape[0], lambda batch: _onednn_backward_marks(batch, cin, cout, e, ks, s_in, s_out, nthr, dim, plane, w, w16, rtus, strided, mask))


def _onednn_backward_marks(
    batch: int, cin: int, cout: int, e: int, ks: int, s_in: int, s_out: int, nthr: int, dim: int, plane: int,
    w: int, w16: int, rtus: int, strided: bool, mask: Sequence[bool],
) -> list[int]:
    x, y = batch * cin * s_in * e, batch * cout * s_out * e
    x16, y16 = batch * _p(cin) * s_in * e, batch * _p(cout) * s_out * e
    grad_input = x if mask[0] else 0
    final = grad_input + (w if mask[1] else 0)
    marks: list[Any] = [final]
    if mask[0]:
        if strided:
            scratch = _DNNL_SCRATCH_2D_STRIDED if dim == 4 else _DNNL_SCRATCH_3D_STRIDED
            marks += [y + ks * cout * _p(cin) * e + x + scratch, 3 * x]
        else:
            marks += [y16 + w16 + x16, x16 + x]
    if mask[1]:
        if ks > 1 and cin < 4:
            w_int = ks * _p(cout) * cin * e
            work = y16 + w_int + _DNNL_REDUCTION + w_int
        elif ks > 1 and dim == 4 and cin <= 8 and cout <= 8:
            w_int = ks * _p(cin, 8) * _p(cout, 8) * e
            work = batch * 8 * (s_in + s_out) * e + w_int + _DNNL_AVX2 + w_int
        elif ks > 1 and dim == 5 and cin < 16:
            w_int = w
            work = w + nthr * cin * ks * plane * e + 8 * w + 256
        else:
            w_int = w16
            shared = (_p(cin) // 16) * (_p(cout) // 16) <= nthr
            reduction = _DNNL_REDUCTION - (64 if ks == 1 and not strided else 0) + w16
            work = x16 + y16 + w16 + rtus + (reduction if shared else 0)
        marks += [grad_input + work, grad_input + w_int + w]
    return [m - final for m in marks]


@register_workspace_rule(("aten.convolution_backward", "cpu"))
def convolution_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """Slow: the columns buffer (Note [CPU slow convolution columns]); oneDNN: its reorders and
    scratchpads (Note [CPU oneDNN convolution buffers])."""
    grad_output, inp, weight, _bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = args[:11]
    if _onednn_convolution(inp, weight, stride, padding, dilation, transposed, output_padding, groups):
        return _onednn_backward(grad_output, inp, weight, stride, mask) if (mask[0] or mask[1]) else 0
    backend = _slow_backend(inp, weight, stride, padding, dilation, transposed, output_padding, groups)
    if not backend or not (mask[0] or mask[1]):
        return 0
    if _pointwise(weight, stride, padding) and not (backend == "Slow3d" and mask[0]):
        return 0
    return _slow_conv_columns(inp, weight, grad_output.shape[2:])


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

_RNN_SCRATCH_FIXED = 12856


def _lstm_weight_gradient(rows: int, gates_ld: int, gates: int, e: int) -> int:
    padded = _p(rows) * gates_ld * e
    return padded + rows * gates * e if _p(rows) != rows else padded


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
