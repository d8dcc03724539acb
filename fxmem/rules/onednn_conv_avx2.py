"""The transient buffers of oneDNN's CPU convolutions on an AVX2 CPU (8-channel blocks).

The AVX512 kernels are modelled in onednn_conv.py; an AVX2 CPU runs other kernels (``jit:avx2``,
``jit_1x1:avx2``, ``brgconv_strided:avx2``, GEMM) with other layouts and scratchpads. This module
computes those, in the same form (byte counts linear in the batch, for ``highest``), so that ops.py's
workspace rules can charge them; see Note [CPU oneDNN convolution buffers on AVX2].
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from fxmem.rules.onednn_conv import (
    _ALIGN,
    _BATCH_ELEMENT,
    _PAGE,
    _REDUCER_BUFFER,
    ConvShape,
    _bias_scratchpad,
    _cdiv,
    _p,
    _reducer_booking,
    _reducer_split,
    _strided_scratchpad,
)

__all__ = [
    "avx2_backward_marks",
    "avx2_channels_last_backward_marks",
    "avx2_channels_last_forward_marks",
    "avx2_channels_last_grad_output_copy",
    "avx2_forward_marks",
    "onednn_avx2_channels_last",
    "onednn_avx2_convolution",
]


# Note [CPU oneDNN convolution buffers on AVX2]
#     What Note [CPU oneDNN convolution buffers] says of ideep's reorders holds here, with oneDNN's
#     AVX2 kernels (``torch.backends.cpu.get_cpu_capability() == "AVX2"``: 8-channel blocks,
#     ``aBcd8b``), read off ONEDNN_VERBOSE and the profiler on an AMD EPYC (AVX2, no AVX512), f32,
#     torch 2.13. ``p8(c)`` is c rounded up to 8, ``x8`` / ``y8`` the input / output with channels so
#     padded, ``K`` the kernel volume, ``nthr`` torch's intra-op threads. A Conv1d reaches oneDNN as a
#     2-D convolution one row high (ATen's ``view4d``), and is modelled so.
#     * Forward (``jit:avx2``; ``jit_1x1:avx2`` for unpadded 1x1 kernels with stride 1, or a 2-D
#       stride whose outputs tile the input, which the kernel gathers per thread (``rtus``: (nthr *
#       p8(cin) * output pixels + 32) floats, booked before the reorders)): with
#       fewer than 8 input channels the direct kernel reads the input plain ("flat": ``flat = ic <
#       simd_w`` in jit_avx2_conv_kernel_f32.cpp's fwd ``init_conf``; weights ``Acdb8a``, K * p8(cout)
#       * cin); otherwise the input is reordered to x8 and the weights to K * p8(cout) * p8(cin). The
#       output is made as y8 and reordered into the returned plain tensor: the high mark is
#       max(input copy + weights + y8, y8 + output), as on AVX512. With a bias, where cout is no
#       multiple of 8, both kernels book it padded (``key_conv_padded_bias``: p8(cout) floats and
#       128 bytes of alignment), alive beside the first (``_padded_bias``).
#     * GEMM forward (``gemm:jit``, plain layouts) where the direct kernel declines (kernels wider
#       than 7 padded and strided, a left padding wider than the unroll, a kernel that falls outside
#       the input): its im2col columns (cin * K * a block of output pixels, per thread or shared,
#       chosen by jit_gemm_convolution_utils' ``init_conf``) are NOT modelled; the rule charges 0,
#       under by the columns (e.g. 557,696 bytes for 8 -> 16 channels, 11x11, stride 2, padding 5
#       on 24x24).
#     * Backward, input gradient, stride 1 (``jit:avx2`` and ``jit_1x1:avx2`` backward_data):
#       grad_output to y8, weights to K * p8(cin) * p8(cout), the gradient made as x8 and reordered
#       into the plain result: max(y8 + w + x8, x8 + x). The kernels book no scratchpad.
#       Stride > 1 takes ``brgconv_strided:avx2`` in channels-last, as on AVX512: grad_output
#       copied (y bytes; none where it is already channels-last: one channel or one output pixel),
#       weights K * cout * (cin rounded up to the input-channel block), the result (x bytes) and
#       onednn_conv.py's ``_strided_scratchpad`` (the same bookings), then two x-sized copies. The
#       block is 8, 16, 24 or 32 channels, picked by ``try_exec_type``'s efficiency estimate (not
#       ported); the rule takes p8(cin), exact for every cin up to 32 seen, but with more channels
#       oneDNN may pad further (64 channels went to 72: under by K * cout * 8 * 4 bytes, 131,072 for
#       64 -> 64, 4x4x4). 3-D kernels over 102 taps sometimes take fewer batch descriptors than the
#       whole kernel: over by up to nthr * 4 KiB per extra page (16,400 bytes for 6x6x6).
#     * Backward, weight gradient (after the input gradient, which is alive by then):
#       - ``jit_1x1:avx2`` where the forward takes it: x8, y8, gradient p8(cin) * p8(cout), the
#         gathered input where strided, and the weight reducer of jit_avx2_1x1_convolution.hpp's
#         ``init_balancers``: jobs of (output blocks, halved or thirded to 32 at most) x (input
#         blocks, to 9 at most), over batch * output pixels, at most 8 jobs a thread; a
#         ``cpu_reducer_2d_t`` books every thread of a multi-thread group, the first too, at
#         128-byte alignment, with a barrier context (a page and its page of alignment)
#         (``_1x1_avx2_scratchpad``; e.g. 16 -> 64 channels on 2 threads: 2 * 4096 + 128 + 8192).
#       - ``jit:avx2`` (jit_avx2_conv_bwd_weights_kernel_f32) where its ``init_conf`` takes the
#         shape: kernels narrower than 14, no taller or deeper than the input, paddings smaller than the
#         kernel, no 3-D depth padding, no dilation. Exactly 3 input channels are "flat" (input
#         plain, gradient K * p8(cout) * 3); others go to x8, gradient K * p8(cin) * p8(cout); y8
#         either way. Its weight reducer (``cpu_reducer_t``, jobs of K * ic_block * 8 over batch *
#         output depth) books the extra threads' partial sums (onednn_conv.py's ``_reducer_split``
#         and ``_reducer_booking``, as its AVX2 kernel there).
#       - GEMM (``gemm:jit``) otherwise (3-D kernels with depth padding, kernels 14 and wider):
#         plain layouts, onednn_conv.py's ``_gemm_scratchpad`` with AVX2's ``simd_w`` of 8 in its
#         outer-threading estimate (``_gemm_avx2_scratchpad``: AVX512's 16 kept one thread where
#         oneDNN took two, e.g. 1 -> 1 channel, 7x7, padding 3, on 1x1 at B = 3: under by 980
#         bytes); exact on the grid, but over by 40% (263,424 bytes) for one output channel, 7x7x7,
#         padding 3, on 9x9x9 at B = 2 (seen with the 16).
#       With a bias gradient, the padded bias and bias reducer as on AVX512 (8-channel blocks; the
#       1x1 kernel's reducer capped at 8 jobs a thread), ideep's own bias buffer, and the returned
#       bias. For a bias alone ATen still returns a weight gradient, freed at once: charged here.
#     A split depends on the batch: with a symbolic batch, ``highest`` takes the lines large batches
#     give (Note [Kernel choices that change with the batch] in fxmem/step/timeline.py).
#     Checked against the profiler, byte for byte, on some 300 shapes (1-D, 2-D, 3-D, kernels 1 to
#     7, strides 1 and 2, 1 to 64 channels, batch 1 to 8, every output mask, with and without a bias)
#     at 1 and 2 threads (tests/test_onednn_conv_avx2.py), and on some 2000 more while writing it.
#     AdamW step peaks (B = 4) that were 14% to 27% low are now exact: a 3x3 stack, 1x1 convs, Conv1d,
#     Conv3d. Dilated convolutions at stride 1 follow the same figures where the direct forward and
#     input-gradient kernels take them (their ``init_conf`` with the dilated kernel's reach, ``ext_kw``:
#     ``_direct_forward_ok``, ``_direct_data_ok``; the weight gradient always takes GEMM, as the
#     direct one declines dilation); exact on some 250 shapes (1-D to 3-D, dilation 2 and 3) at 1
#     and 2 threads. Elsewhere they get no rule: a stride sends the input gradient to GEMM, a wide
#     padding (DeepLab's dilation 4 with padding 4) the forward. Grouped convolutions: Note [CPU
#     oneDNN grouped convolution buffers on AVX2]; transposed ones: Note [CPU oneDNN transposed
#     convolution buffers on AVX2]. Not covered (no rule, as on AVX512): other dtypes, channels-last
#     inputs.

_SIMD = 8
"""AVX2's f32 vector width: the channel block of its kernels."""
_MAX_KW = 14
"""The direct weight-gradient kernel takes kernels narrower than this (``jcp.kw < 14``)."""
_REGISTERS = 15
"""The YMM registers the direct forward kernel accumulates in (``num_avail_regs`` on AVX2)."""


def _p8(c: int) -> int:
    return _p(c, _SIMD)


def onednn_avx2_convolution(
    inp: Any,
    weight: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    output_padding: Any,
    groups: int,
    bias: bool = False,
) -> bool:
    """Whether the rules of Note [CPU oneDNN convolution buffers on AVX2] (plain convolutions), Note
    [CPU oneDNN grouped convolution buffers on AVX2] or Note [CPU oneDNN transposed convolution
    buffers on AVX2] describe this convolution (``bias``: a forward with one)."""
    if inp.dim() not in (3, 4, 5) or inp.dtype != torch.float32:
        return False
    if torch.backends.cpu.get_cpu_capability() != "AVX2" or not inp.is_contiguous():
        return False
    backend = torch._C._select_conv_backend(inp, weight, None, stride, padding, dilation, transposed, output_padding, groups)
    if str(backend).rpartition(".")[2] != ("???" if transposed else "Mkldnn"):  # MkldnnTranspose has no Python name
        return False
    out = _output_size(inp, weight, stride, padding, dilation, transposed, output_padding)
    if min(out, default=1) < 1:
        return False  # no output: ATen refuses the shape
    conv = as_2d(ConvShape.of(inp, weight, stride, padding, dilation, out))
    if transposed:
        return groups == 1 and not conv.dilated and conv.dim == 2 and _transposed_ok(_as_convolution(conv), bias)
    if groups == 1:
        return not conv.dilated or _dilated_ok(conv, reach(conv, dilation))
    return _depthwise_ok(conv, groups) or _blocked_groups_ok(conv, groups)


def _output_size(inp: Any, weight: Any, stride: Any, padding: Any, dilation: Any, transposed: bool, output_padding: Any) -> list[int]:
    """The output's spatial sizes (ATen's ``conv_output_size`` and ``conv_input_size``)."""
    sizes = zip(inp.shape[2:], weight.shape[2:], stride, padding, dilation, output_padding)
    if transposed:
        return [(int(i) - 1) * int(s) - 2 * int(p) + int(d) * (int(k) - 1) + int(op) + 1 for i, k, s, p, d, op in sizes]
    return [(int(i) + 2 * int(p) - int(d) * (int(k) - 1) - 1) // int(s) + 1 for i, k, s, p, d, _op in sizes]


def reach(conv: ConvShape, dilation: Sequence[Any]) -> tuple[int, ...]:
    """How far the kernel reaches along each axis of ``conv`` (as 2-D): (k - 1) * dilation + 1,
    oneDNN's ``calculate_extended_filter_size``."""
    dils = (1,) * (conv.dim - len(dilation)) + tuple(int(d) for d in dilation)
    return tuple((k - 1) * d + 1 for k, d in zip(conv.kernel, dils))


def _dilated_ok(conv: ConvShape, extent: tuple[int, ...]) -> bool:
    """Where Note [CPU oneDNN convolution buffers on AVX2] holds for a dilated convolution: stride 1
    (the direct input-gradient kernel declines dilation with a stride), and the forward and the
    input gradient take other kernels than GEMM."""
    if conv.strided or _forward_kernel(conv, extent) == "gemm":
        return False
    return _is_1x1(conv) or _direct_data_ok(conv, extent)


def _direct_data_ok(conv: ConvShape, extent: tuple[int, ...]) -> bool:
    """Whether ``jit:avx2`` takes the input gradient at stride 1 (jit_avx2_conv_bwd_data_kernel_f32's
    ``init_conf``): the kernel reaches into the input on every side, and some width unroll (up to
    15 registers over 1 to 4 input blocks) covers the kernel's left overhang and its right one."""
    ends = _end_pads(conv, extent)
    if any(k <= p or k <= end for k, p, end in zip(extent, conv.pad, ends)):
        return False
    kw, lp, rp, iw = extent[-1], conv.pad[-1], ends[-1], conv.inp[-1]
    l_overflow, nb_ic = max(0, kw - 1 - lp), _p8(conv.cin) // _SIMD
    best, ur_w = 0, 1
    for b in (b for b in range(1, 5) if nb_ic % b == 0):
        for u in range(1, min(_REGISTERS // (b + 1), iw) + 1):
            if l_overflow > u and u != iw:
                continue
            if u * b > best or (u * b == best and ur_w < u):
                best, ur_w = u * b, u
    if not best:
        return False
    return max(0, kw - 1 - rp - iw % ur_w) <= ur_w


def as_2d(conv: ConvShape) -> ConvShape:
    """A 1-D convolution as oneDNN sees it: 2-D, one row high (ATen's ``view4d``)."""
    if conv.dim != 1:
        return conv
    return replace(conv, kernel=(1, *conv.kernel), stride=(1, *conv.stride), pad=(0, *conv.pad), inp=(1, *conv.inp), out=(1, *conv.out))


def _end_pads(conv: ConvShape, extent: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """oneDNN's ``calculate_end_padding`` per spatial axis, for a kernel reaching ``extent`` (default:
    its size, undilated)."""
    extent = extent or conv.kernel
    return tuple((o - 1) * s + k - (i + p) for i, o, k, s, p in zip(conv.inp, conv.out, extent, conv.stride, conv.pad))


def _is_1x1(conv: ConvShape) -> bool:
    """Whether ``jit_1x1:avx2`` takes the shape: a 1x1 kernel, no padding, and stride 1 or a 2-D
    stride ``rtus_prepare`` can gather away (each output size times its stride is the input size)."""
    if conv.ks != 1 or any(conv.pad):
        return False
    return not conv.strided or (conv.dim == 2 and all(o * s == i for o, s, i in zip(conv.out, conv.stride, conv.inp)))


def _rtus(conv: ConvShape, nthr: int) -> int:
    """The 1x1 kernel's gathered strided input (``rtus``), per thread: (nthr * p8(cin) * output
    pixels + 32) elements, booked by the forward and the weight gradient."""
    return (nthr * _p8(conv.cin) * conv.s_out + 32) * conv.e if _is_1x1(conv) and conv.strided else 0


def _direct_forward_ok(conv: ConvShape, extent: tuple[int, ...] | None = None) -> bool:
    """Whether ``jit:avx2`` takes the forward (jit_avx2_conv_fwd_kernel_f32's ``init_conf``): the
    kernel reaches into the input on every side, the left padding fits the width unroll (3 outputs,
    or fewer where the output is narrower), kernels wider than 7 are unpadded or unstrided, and the
    right padding fits the unroll the kernel then picks. ``extent``: the dilated kernel's reach
    (``ext_kw``; needed where ``conv.dilated``)."""
    if conv.dilated and extent is None:
        return False
    extent = extent or conv.kernel
    ends = _end_pads(conv, extent)
    if any(k <= p or k <= end for k, p, end in zip(extent, conv.pad, ends)):
        return False
    kw, sw, lp, iw, ow = extent[-1], conv.stride[-1], conv.pad[-1], conv.inp[-1], conv.out[-1]
    ur_w = min(3, ow)
    if lp > ur_w or (conv.kernel[-1] > 7 and any(conv.pad[-2:]) and conv.strided):
        return False
    tail = ow % ur_w
    r_pad = max(0, (ow - tail - 1) * sw + kw - (iw + lp))
    if r_pad > ur_w * sw and ow // ur_w > 1:
        ur_w = min(r_pad // sw + tail, ow, _REGISTERS // 2)
        tail = ow % ur_w
        r_pad = max(0, (ow - tail - 1) * sw + kw - (iw + lp))
        return ur_w >= max(lp, r_pad)
    return True


def _forward_kernel(conv: ConvShape, extent: tuple[int, ...] | None = None) -> str:
    """Which oneDNN kernel runs the forward (Note [CPU oneDNN convolution buffers on AVX2]);
    ``extent`` as for ``_direct_forward_ok``."""
    if _is_1x1(conv):
        return "1x1"
    return "direct" if _direct_forward_ok(conv, extent) else "gemm"


def _padded_bias(cout: int, e: int, bias: bool) -> int:
    """The forward's padded bias: direct kernels book p8(cout) where cout is no multiple of 8
    (``key_conv_padded_bias``), a scratchpad booking (128 bytes of alignment beyond its size)."""
    return _p8(cout) * e + _ALIGN if bias and cout % _SIMD else 0


def avx2_forward_marks(
    conv: ConvShape, nthr: int, groups: int = 1, bias: bool = False, dilation: Sequence[Any] = (), transposed: bool = False
) -> Callable[[int, int], list[int]]:
    """The forward's high marks above its output, at batch b (Note [CPU oneDNN convolution buffers on
    AVX2]; grouped: Note [CPU oneDNN grouped convolution buffers on AVX2]; transposed: Note [CPU
    oneDNN transposed convolution buffers on AVX2])."""
    conv = as_2d(conv)
    if transposed:
        return _transposed_forward_marks(_as_convolution(conv), nthr, bias)
    if groups > 1:
        return _depthwise_forward_marks(conv, bias) if _depthwise_ok(conv, groups) else _grouped_forward_marks(conv, groups)
    kernel = _forward_kernel(conv, reach(conv, dilation) if dilation else None)
    if kernel == "gemm":  # plain layouts; its im2col columns are not modelled (see the Note)
        return lambda batch, _regime: [0]
    flat = conv.cin < _SIMD and kernel == "direct"
    w_copy = conv.ks * _p8(conv.cout) * (conv.cin if flat else _p8(conv.cin)) * conv.e
    fixed = w_copy + _rtus(conv, nthr) + _padded_bias(conv.cout, conv.e, bias)

    def marks(batch: int, _regime: int) -> list[int]:
        x_copy = 0 if flat else batch * _p8(conv.cin) * conv.s_in * conv.e
        y8, y = batch * _p8(conv.cout) * conv.s_out * conv.e, batch * conv.cout * conv.s_out * conv.e
        return [x_copy + fixed + y8 - y, y8]

    return marks


def _data_marks(conv: ConvShape, batch: int, nthr: int) -> list[int]:
    """The input gradient's high marks (Note [CPU oneDNN convolution buffers on AVX2])."""
    e, ks, cin, cout = conv.e, conv.ks, conv.cin, conv.cout
    x, y = batch * cin * conv.s_in * e, batch * cout * conv.s_out * e
    if conv.strided:
        y_copy = 0 if cout == 1 or conv.s_out == 1 else y  # already channels-last: no copy
        w_copy = ks * cout * _p8(cin) * e
        return [y_copy + w_copy + x + _strided_scratchpad(conv, nthr), 3 * x]
    x8, y8 = batch * _p8(cin) * conv.s_in * e, batch * _p8(cout) * conv.s_out * e
    return [y8 + ks * _p8(cin) * _p8(cout) * e + x8, x8 + x]


def _direct_weights_ok(conv: ConvShape) -> bool:
    """Whether ``jit:avx2`` computes the weight gradient (jit_avx2_conv_bwd_weights_kernel_f32's
    ``init_conf``): kernels narrower than 14, no taller or deeper than the input, paddings smaller than the
    kernel, no 3-D depth padding, no dilation."""
    if conv.dilated or conv.kernel[-1] >= _MAX_KW:
        return False
    ends = tuple(max(0, e) for e in _end_pads(conv))
    if any(k > i for k, i in zip(conv.kernel[:-1], conv.inp[:-1])):  # the width is not bounded (``kh <= ih``)
        return False
    if conv.cin == 3 and conv.s_in == 1:  # measured: a one-pixel input (plain and channels-last alike) goes to GEMM when flat
        return False
    if any(p >= k or end >= k for k, p, end in zip(conv.kernel, conv.pad, ends)):
        return False
    return conv.dim == 2 or (conv.pad[0] == 0 and ends[0] == 0)


def _weight_kernel(conv: ConvShape) -> str:
    """Which oneDNN kernel computes the weight gradient (Note [CPU oneDNN convolution buffers on AVX2])."""
    if _is_1x1(conv):
        return "1x1"
    return "direct" if _direct_weights_ok(conv) else "gemm"


def _1x1_blocking(blocks: int, limit: int) -> int:
    """jit_avx2_1x1_conv_kernel_f32's bwd-weights blocking: halve or third ``blocks`` while it is
    above ``limit`` (and divisible)."""
    while blocks > limit:
        if blocks % 2 == 0:
            blocks //= 2
        elif blocks % 3 == 0:
            blocks //= 3
        else:
            break
    return blocks


def _1x1_avx2_scratchpad(conv: ConvShape, batch: int, nthr: int) -> int:
    """The weight reducer of ``jit_avx2_1x1_convolution_bwd_weights_t`` (``init_balancers``): jobs of
    (output blocks of 32 at most) x (input blocks of 9 at most), reduced over batch * pixels; a
    ``cpu_reducer_2d_t`` books every thread of a multi-thread group, the first too."""
    nb_ic, nb_oc = _p8(conv.cin) // _SIMD, _p8(conv.cout) // _SIMD
    ic_blocking, oc_blocking = _1x1_blocking(nb_ic, 9), _1x1_blocking(nb_oc, 32)
    job = oc_blocking * ic_blocking * _SIMD * _SIMD
    jobs = _cdiv(nb_ic, ic_blocking) * _cdiv(nb_oc, oc_blocking)
    groups, per_group, ub = _reducer_split(nthr, job, jobs, batch * conv.s_out, nthr * job * 8)
    if per_group == 1:
        return 0
    return groups * per_group * ub * job * conv.e + _ALIGN + groups * _PAGE + _PAGE


def _direct_avx2_scratchpad(conv: ConvShape, batch: int, nthr: int) -> int:
    """The weight reducer of ``jit_avx2_convolution_bwd_weights_t`` (``init_balancers``): jobs of
    K * ic_block * 8 (ic_block 3 where flat), reduced over batch * output depth."""
    ic_block = 3 if conv.cin == 3 else _SIMD
    job = conv.ks * ic_block * _SIMD
    jobs = _cdiv(conv.cin, ic_block) * (_p8(conv.cout) // _SIMD)
    groups, per_group, ub = _reducer_split(nthr, job, jobs, batch * math.prod(conv.out[:-2]))
    return _reducer_booking(groups, per_group, ub, job, conv.e)


def _weight_marks(conv: ConvShape, batch: int, regime: int, nthr: int, grad_input: int, bias: bool) -> list[int]:
    """The weight gradient's high marks, with the input gradient (``grad_input`` bytes) alive; the
    bias as in onednn_conv.py's ``_weight_marks``."""
    e, ks, cin, cout = conv.e, conv.ks, conv.cin, conv.cout
    x8, y8 = batch * _p8(cin) * conv.s_in * e, batch * _p8(cout) * conv.s_out * e
    w = ks * cin * cout * e
    kernel = _weight_kernel(conv)
    if kernel == "1x1":
        w_int = _p8(cin) * _p8(cout) * e
        work = x8 + y8 + w_int + _1x1_avx2_scratchpad(conv, regime, nthr) + _rtus(conv, nthr)
        extra = _bias_scratchpad(cout, _SIMD, regime, nthr, e, nthr * _SIMD * _SIMD * 8)
    elif kernel == "direct":
        flat = cin == 3
        w_int = ks * _p8(cout) * (cin if flat else _p8(cin)) * e
        work = (0 if flat else x8) + y8 + w_int + _direct_avx2_scratchpad(conv, regime, nthr)
        extra = _bias_scratchpad(cout, _SIMD, regime, nthr, e, _REDUCER_BUFFER)
    else:
        w_int = w
        work = w + _gemm_avx2_scratchpad(conv, regime, nthr)
        extra = 0
    if not bias:
        return [grad_input + work, grad_input + w_int + w]
    b = cout * e
    return [grad_input + work + extra + b, grad_input + w_int + w + 2 * b]


def avx2_backward_marks(
    conv: ConvShape, nthr: int, mask: Sequence[bool], groups: int = 1, transposed: bool = False
) -> Callable[[int, int], list[int]]:
    """A backward's high marks above its outputs, at batch b with batch r's kernels (Note [CPU oneDNN
    convolution buffers on AVX2]; grouped: Note [CPU oneDNN grouped convolution buffers on AVX2];
    transposed: Note [CPU oneDNN transposed convolution buffers on AVX2])."""
    conv = as_2d(conv)
    if transposed:
        return _transposed_backward_marks(_as_convolution(conv), nthr, mask)
    if groups > 1:
        if _depthwise_ok(conv, groups):
            return _depthwise_backward_marks(conv, nthr, mask, groups)
        return _grouped_backward_marks(conv, nthr, mask, groups)

    def marks(batch: int, regime: int) -> list[int]:
        e, ks, cin, cout = conv.e, conv.ks, conv.cin, conv.cout
        grad_input = batch * cin * conv.s_in * e if mask[0] else 0
        bias = len(mask) > 2 and bool(mask[2])
        final = grad_input + (ks * cin * cout * e if mask[1] else 0) + (cout * e if bias else 0)
        found: list[int] = [final]
        if mask[0]:
            found += _data_marks(conv, batch, nthr)
        if mask[1] or bias:
            found += _weight_marks(conv, batch, regime, nthr, grad_input, bias)
        return [m - final for m in found]

    return marks


# Note [CPU oneDNN grouped convolution buffers on AVX2]
#     Grouped convolutions on the AVX2 machine of Note [CPU oneDNN convolution buffers on AVX2], read
#     off ONEDNN_VERBOSE and the profiler the same way (f32, torch 2.13), in the two families oneDNN
#     runs with blocked kernels. A Conv1d is a 2-D convolution one row high, as for plain ones.
#     Depthwise (groups == cin == cout). ``C8`` is the channels rounded up to 8 (the depthwise
#     kernels pad the groups: ``ok_to_pad_channels`` in jit_uni_dw_conv_kernel_utils.cpp), ``x8`` /
#     ``y8`` the input / output with C8 channels (``aBcd8b``), ``w8`` = K * C8 floats (``Goihw8g``).
#     * Forward: ``jit_dw:avx2`` (jit_uni_dw_conv_fwd_kernel's ``init_conf``: 2-D only, the kernel
#       reaches into the input on every side, and the left padding and the right padding of the
#       untailed outputs fit the width unroll, min(4, ow)). The reorders as for plain convolutions:
#       max(x8 + w8 + y8, y8 + y), and with a bias where C is no multiple of 8 the padded bias
#       (``key_conv_padded_bias``: C8 floats and 128 bytes of alignment) beside the first, which
#       the plain direct kernels book too (jit_avx2_conv_fwd_kernel_f32's ``init_scratchpad``; the
#       plain rule now charges it). Where ``jit_dw`` declines oneDNN takes GEMM: no rule.
#     * Input gradient: ``jit_dw:avx2`` backward_data at every stride, no scratchpad:
#       max(y8 + w8 + x8, x8 + x).
#     * Weight gradient (the input gradient alive): ``jit_dw:avx2`` backward_weights for kernels at
#       most 3 wide, a stride no wider than the kernel, paddings at most half the kernel, a non-unit
#       top / bottom padding a multiple of the stride, an input at least the kernel tall (its
#       ``init_conf``): x8, y8, the gradient w8 and, where ``balance()`` splits the batch (threads
#       go to the C8 / 8 channel blocks first: nthr_mb = min(nthr // min(blocks, nthr), batch)), a
#       reduction of (nthr_mb - 1) * w8 floats (and (nthr_mb - 1) * C8 for a bias), each booking 128
#       bytes beyond its size (its ``init_scratchpad``: no barrier, no padded bias). Wider kernels
#       (ConvNeXt's 7x7) take GEMM (``gemm:jit``, plain layouts): the gradient w and the bookings of
#       onednn_conv.py's ``_gemm_scratchpad`` with jit_gemm_convolution_utils.cpp's group terms:
#       im2col columns of one group (K * output plane floats a thread), the reduction buffer of
#       nthr * (all the weights' bytes) floats, outer threading for one sample too where there are
#       more than 2 groups (``mb != 1 || ngroups > 2``), and a memory limit over the whole input and
#       output (``_gemm_avx2_scratchpad``; e.g. 96 channels, 7x7 on 14x14, batch 4, 2 threads:
#       4 * 2 * 18816 + 128 + 2 * 49 * 196 * 4 + 128 = 227,616 bytes).
#     Blocked groups (cin / groups and cout / groups multiples of 8, stride 1, 2-D): ``jit:avx2``
#     with ``gOIhw8i8o`` weights, the plain rule's figures with no channel padding: forward
#     max(x + w + y8, 2y) (y8 = y), input gradient max(y + w + x, 2x), weight gradient x + y + w
#     and the direct kernel's reducer (``cpu_reducer_t`` over groups * input blocks * output blocks
#     jobs: the plain ``_direct_avx2_scratchpad`` already counts groups * blocks, as ``conv.cout``
#     is all the output channels), or GEMM as above for kernels 14 and wider.
#     With a bias gradient, ideep's bias buffer and the returned bias as for plain convolutions.
#     Checked against the profiler, byte for byte, on fixed-seed grids of 1-D and 2-D shapes
#     (kernels 1 to 7, strides 1 and 2, 1 to 96 channels, batch 1 to 8, each output mask, a forward
#     bias or none) at 1 and 2 threads (tests/test_onednn_conv_avx2.py), and some 900 more while
#     writing it; AdamW step peaks 24% to 36% low (depthwise 3x3 and 7x7, groups of 16) are exact.
#     Not covered (no rule): channel multipliers (cout a multiple of groups > cin: GEMM), groups of
#     other sizes (GEMM, or a flat ``jit:avx2`` forward with GEMM backward), strided blocked groups
#     (``jit:avx2``, ``brgconv_strided`` or GEMM for the input gradient, by a heuristic not ported),
#     3-D depthwise (``brdgmm_dw`` in channels-last, then GEMM), dilated grouped convolutions.

_DW_UNROLL = 4
"""The depthwise forward kernel's width unroll on AVX2 (``jcp.ur_w``)."""
_DW_MAX_KW = 3
"""The widest kernel the depthwise weight-gradient kernel takes (``jcp.kw <= 3``)."""


def _depthwise_ok(conv: ConvShape, groups: int) -> bool:
    """Whether Note [CPU oneDNN grouped convolution buffers on AVX2] describes ``conv`` (as 2-D):
    one channel in and out a group, undilated, 2-D, and a forward ``jit_dw`` takes."""
    if conv.cin != 1 or conv.cout != groups or conv.dilated or conv.dim != 2:
        return False
    return _dw_forward_ok(conv)


def _dw_forward_ok(conv: ConvShape) -> bool:
    """jit_uni_dw_conv_fwd_kernel's ``init_conf`` (blocked layout): the kernel reaches into the input
    on every side, and the left padding and the right padding of the untailed outputs fit the width
    unroll."""
    ends = _end_pads(conv)
    if any(k <= p or k <= end for k, p, end in zip(conv.kernel, conv.pad, ends)):
        return False
    kw, sw, lp, iw, ow = conv.kernel[-1], conv.stride[-1], conv.pad[-1], conv.inp[-1], conv.out[-1]
    ur_w = min(_DW_UNROLL, ow)
    r_pad_no_tail = max(0, (ow - ow % ur_w - 1) * sw + kw - (iw + lp))
    return lp <= ur_w and r_pad_no_tail <= ur_w


def _dw_weights_ok(conv: ConvShape) -> bool:
    """jit_uni_dw_conv_bwd_weights_kernel's ``init_conf``: kernels at most 3 wide, no gaps between
    strides, paddings at most half the kernel, a non-unit top or bottom padding a multiple of the
    stride, and an input that holds the kernel."""
    (kh, kw), (sh, sw), (tp, lp), (ih, _iw) = conv.kernel, conv.stride, conv.pad, conv.inp
    bp, rp = (max(0, e) for e in _end_pads(conv))
    if kw > _DW_MAX_KW or sw > kw or max(tp, bp) > kh // 2 or max(lp, rp) > kw // 2:
        return False
    if ih < kh + (-tp) % sh:
        return False
    return all(p <= 1 or p % sh == 0 for p in (tp, bp))


def _depthwise_forward_marks(conv: ConvShape, bias: bool) -> Callable[[int, int], list[int]]:
    """The depthwise forward's high marks above its output (Note [CPU oneDNN grouped convolution
    buffers on AVX2])."""
    c8, e = _p8(conv.cout), conv.e
    fixed = conv.ks * c8 * e + _padded_bias(conv.cout, e, bias)

    def marks(batch: int, _regime: int) -> list[int]:
        x8, y8, y = batch * c8 * conv.s_in * e, batch * c8 * conv.s_out * e, batch * conv.cout * conv.s_out * e
        return [x8 + fixed + y8 - y, y8]

    return marks


def _gemm_avx2_scratchpad(conv: ConvShape, batch: int, nthr: int, groups: int = 1) -> int:
    """onednn_conv.py's ``_gemm_scratchpad`` with AVX2's vector width (``simd_w`` 8: the per-thread
    estimate that decides outer threading, and the smallest block of output pixels) and groups
    (``conv.cin`` a group's input channels): jit_gemm_convolution_utils' ``init_conf`` threads the
    batch for one sample too where there are more than 2 groups, and bounds its bookings by the
    whole input and output."""
    e, ks, plane = conv.e, conv.ks, math.prod(conv.out[-2:])
    w = conv.cin * conv.cout * ks * e
    x, y = batch * conv.cin * groups * conv.s_in * e, batch * conv.cout * conv.s_out * e
    limit = min(1 << 30, 15 * nthr * (x + w + y))
    per_thread = e * nthr * w + e * nthr * conv.cin * ks * _SIMD
    n = nthr if (batch != 1 or groups > 2) and plane // nthr < 256 and per_thread < limit else 1
    reduction = e * n * w + _ALIGN
    columns = n * conv.cin * ks * plane * e
    if columns > limit - reduction:
        fits = (limit - reduction) // (e * n * conv.cin * ks)
        columns = n * conv.cin * ks * max(_SIMD, int(fits * 0.05)) * e
    return reduction + columns + _ALIGN


def _dw_reduction(conv: ConvShape, batch: int, nthr: int, bias: bool) -> tuple[int, int]:
    """(weight, bias) reduction bookings of the depthwise weight-gradient kernel where ``balance()``
    splits the batch: threads go to the channel blocks first, the rest over the batch."""
    c8 = _p8(conv.cout)
    split = min(max(1, nthr // min(c8 // _SIMD, nthr)), batch)
    if split == 1:
        return 0, 0
    weights = (split - 1) * conv.ks * c8 * conv.e + _ALIGN
    return weights, (split - 1) * c8 * conv.e + _ALIGN if bias else 0


def _dw_weight_marks(conv: ConvShape, groups: int, batch: int, regime: int, nthr: int, grad_input: int, bias: bool) -> list[int]:
    """The depthwise weight gradient's high marks, with the input gradient (``grad_input`` bytes)
    alive (Note [CPU oneDNN grouped convolution buffers on AVX2])."""
    e, c8 = conv.e, _p8(conv.cout)
    w = conv.ks * conv.cout * e
    if _dw_weights_ok(conv):
        w_int = conv.ks * c8 * e
        weights, extra = _dw_reduction(conv, regime, nthr, bias)
        work = batch * c8 * (conv.s_in + conv.s_out) * e + w_int + weights
    else:
        w_int, extra = w, 0
        work = w + _gemm_avx2_scratchpad(conv, regime, nthr, groups)
    if not bias:
        return [grad_input + work, grad_input + w_int + w]
    b = conv.cout * e
    return [grad_input + work + extra + b, grad_input + w_int + w + 2 * b]


def _depthwise_backward_marks(conv: ConvShape, nthr: int, mask: Sequence[bool], groups: int) -> Callable[[int, int], list[int]]:
    """The depthwise backward's high marks above its outputs (Note [CPU oneDNN grouped
    convolution buffers on AVX2])."""

    def marks(batch: int, regime: int) -> list[int]:
        e, ks, c, c8 = conv.e, conv.ks, conv.cout, _p8(conv.cout)
        grad_input = batch * c * conv.s_in * e if mask[0] else 0
        bias = len(mask) > 2 and bool(mask[2])
        final = grad_input + (ks * c * e if mask[1] else 0) + (c * e if bias else 0)
        found: list[int] = [final]
        if mask[0]:
            x8, y8 = batch * c8 * conv.s_in * e, batch * c8 * conv.s_out * e
            found += [y8 + ks * c8 * e + x8, x8 + grad_input]
        if mask[1] or bias:
            found += _dw_weight_marks(conv, groups, batch, regime, nthr, grad_input, bias)
        return [m - final for m in found]

    return marks


def _blocked_groups_ok(conv: ConvShape, groups: int) -> bool:
    """Whether ``jit:avx2`` runs a grouped convolution whose groups hold whole 8-channel blocks, at
    stride 1, undilated, 2-D, where the forward takes the direct kernel."""
    if groups == 1 or conv.cin % _SIMD or (conv.cout // groups) % _SIMD or conv.dilated or conv.dim != 2:
        return False
    return not conv.strided and _direct_forward_ok(conv)


def _grouped_forward_marks(conv: ConvShape, groups: int) -> Callable[[int, int], list[int]]:
    """The blocked grouped forward's high marks above its output: the plain rule's, with no channel
    padding (Note [CPU oneDNN grouped convolution buffers on AVX2])."""
    w = conv.ks * conv.cin * conv.cout * conv.e

    def marks(batch: int, _regime: int) -> list[int]:
        x, y = batch * conv.cin * groups * conv.s_in * conv.e, batch * conv.cout * conv.s_out * conv.e
        return [x + w, y]

    return marks


def _grouped_backward_marks(conv: ConvShape, nthr: int, mask: Sequence[bool], groups: int) -> Callable[[int, int], list[int]]:
    """The blocked grouped backward's high marks above its outputs: the plain rule's at stride 1,
    with no channel padding (Note [CPU oneDNN grouped convolution buffers on AVX2])."""

    def marks(batch: int, regime: int) -> list[int]:
        e, w = conv.e, conv.ks * conv.cin * conv.cout * conv.e
        x, y = batch * conv.cin * groups * conv.s_in * e, batch * conv.cout * conv.s_out * e
        grad_input = x if mask[0] else 0
        bias = len(mask) > 2 and bool(mask[2])
        final = grad_input + (w if mask[1] else 0) + (conv.cout * e if bias else 0)
        found: list[int] = [final]
        if mask[0]:
            found += [y + w + x, 2 * x]
        if mask[1] or bias:
            if _direct_weights_ok(conv):
                work = x + y + w + _direct_avx2_scratchpad(conv, regime, nthr)
                extra = _bias_scratchpad(conv.cout, _SIMD, regime, nthr, e, _REDUCER_BUFFER)
            else:
                work, extra = w + _gemm_avx2_scratchpad(conv, regime, nthr, groups), 0
            b = conv.cout * e if bias else 0
            found += [grad_input + work + extra + b, grad_input + 2 * w + 2 * b]
        return [m - final for m in found]

    return marks


# Note [CPU oneDNN transposed convolution buffers on AVX2]
#     ATen runs a transposed convolution (MkldnnTranspose) as ideep's deconvolution, which oneDNN
#     builds on a nested convolution with input and output swapped (``conv:any+jit:avx2``, or
#     ``brg_deconv:avx2+brgconv_strided:avx2`` for a stride; ONEDNN_VERBOSE on the AVX2 machine of
#     Note [CPU oneDNN convolution buffers on AVX2], f32, torch 2.13): call ``conv`` the convolution
#     from the transposed output to its input (cin = the transposed output channels, cout = its
#     input channels, ``_as_convolution``). Then, byte for byte against the profiler:
#     * Forward = ``conv``'s input gradient, with the plain rule's figures (``_data_marks``: the
#       direct kernel's 8-channel reorders at stride 1, ``brgconv_strided`` in channels-last with a
#       stride). A deconvolution books its nested convolution's scratchpad inside its own, which
#       costs the nested registry's 128 bytes of alignment more where there is one (every strided
#       forward). A bias at stride 1 takes a blocked output to add it to (x8 in ``conv``'s terms,
#       and 128 bytes); with a stride the bias is added in place where each output pixel comes from
#       one tap (kernel == stride, no padding: UNet's 2x2 up-convolutions), and otherwise takes a
#       buffer whose size did not follow one rule (no rule there).
#     * Input gradient = ``conv``'s forward (``avx2_forward_marks``), plus the nested 128 where it
#       books a scratchpad (the 1x1 kernel's gathered strided input).
#     * Weight gradient = ``conv``'s weight gradient (its input is the transposed output's gradient,
#       its output gradient the transposed input), plus the nested 128 where its kernel books a
#       scratchpad (a reducer that splits, the 1x1 kernel's, GEMM's). The bias gradient is summed
#       apart: ideep's bias buffer and the returned bias, no bias scratchpad.
#     Where the kernels of those figures are ported: 1-D and 2-D, groups 1, undilated; at stride 1
#     the direct input-gradient kernel must take ``conv`` (``_direct_data_ok``), with a stride
#     ``brgconv_strided``'s channel block must be p8's (at most 16 output channels, or 32: 24 went
#     to 32 once), and ``conv``'s forward must not be GEMM. The same check found the direct weight
#     kernel takes kernels wider than the input (``kh <= ih`` bounds only the height), which the
#     plain rule now follows. Checked on some 500 random shapes (kernels 1 to 5, strides 1 and 2,
#     output padding, 1 to 64 channels, batch 1 to 5, each output mask, a forward bias or none) at
#     1 and 2 threads; AdamW step peaks of a DCGAN-like and a Conv1d decoder, 13% and 22% low
#     before, are exact (tests/test_onednn_conv_avx2.py). Not covered: grouped, dilated and 3-D
#     transposed convolutions, strided ones with a bias and overlapping or gapped taps.

_NESTED = _ALIGN
"""What a deconvolution adds to its nested convolution's scratchpad where that has one (the nested
registry's booking alignment)."""


def _as_convolution(conv: ConvShape) -> ConvShape:
    """The convolution whose input gradient a transposed convolution is: ``ConvShape.of`` read the
    transposed weight's (in, out) as (cout, cin); here the input and output trade places too."""
    return replace(conv, inp=conv.out, out=conv.inp)


def _transposed_ok(conv: ConvShape, bias: bool) -> bool:
    """Whether Note [CPU oneDNN transposed convolution buffers on AVX2] describes the transposed
    convolution whose equivalent convolution is ``conv`` (``bias``: a forward with one)."""
    if bias and conv.strided and not _tiled(conv):
        return False  # its bias buffer is not ported
    # strided: brgconv_strided pads the channels to a block its heuristic picks (8 to 32, not ported),
    # which p8 matched up to 16 channels and at 32 (24 went to 32); stride 1: the direct kernel
    data = conv.cin in (*range(1, 17), 32) if conv.strided else _direct_data_ok(conv, conv.kernel)
    return data and _forward_kernel(conv) != "gemm"


def _weight_scratchpad(conv: ConvShape, batch: int, nthr: int) -> int:
    """The plain weight-gradient kernel's scratchpad, no bias (Note [CPU oneDNN convolution buffers on AVX2])."""
    kernel = _weight_kernel(conv)
    if kernel == "1x1":
        return _1x1_avx2_scratchpad(conv, batch, nthr) + _rtus(conv, nthr)
    if kernel == "direct":
        return _direct_avx2_scratchpad(conv, batch, nthr)
    return _gemm_avx2_scratchpad(conv, batch, nthr)


def _tiled(conv: ConvShape) -> bool:
    """Whether a strided transposed convolution writes each output pixel from exactly one input
    pixel and tap: kernel as wide as the stride on every axis, no padding, no output padding."""
    return all(k == st and p == 0 and i == o * st for k, st, p, i, o in zip(conv.kernel, conv.stride, conv.pad, conv.inp, conv.out))


def _transposed_forward_marks(conv: ConvShape, nthr: int, bias: bool) -> Callable[[int, int], list[int]]:
    """The transposed forward: ``conv``'s input gradient, its scratchpad nested; at stride 1 a bias
    takes a blocked copy of the output to add it to."""

    def marks(batch: int, _regime: int) -> list[int]:
        found = _data_marks(conv, batch, nthr)
        x, x8 = (batch * c * conv.s_in * conv.e for c in (conv.cin, _p8(conv.cin)))  # the transposed output
        if not bias:
            extra = _NESTED if conv.strided else 0
        elif conv.strided:  # tiled (``_transposed_ok``): the bias is added in place
            extra = _NESTED
        else:
            extra = x8 + _ALIGN
        return [found[0] + extra - x, *(m - x for m in found[1:])]

    return marks


def _transposed_backward_marks(conv: ConvShape, nthr: int, mask: Sequence[bool]) -> Callable[[int, int], list[int]]:
    """The transposed backward: ``conv``'s forward for the input gradient, its weight gradient for
    the weights (with the roles of input and output swapped), the bias summed apart."""

    def marks(batch: int, regime: int) -> list[int]:
        e, w = conv.e, conv.ks * conv.cin * conv.cout * conv.e
        grad_input = batch * conv.cout * conv.s_out * e if mask[0] else 0
        bias = len(mask) > 2 and bool(mask[2])
        b = conv.cin * e if bias else 0
        final = grad_input + (w if mask[1] else 0) + b
        found: list[int] = [final]
        if mask[0]:
            nested = _NESTED if _rtus(conv, nthr) else 0
            found += [m + grad_input + (nested if i == 0 else 0) for i, m in enumerate(avx2_forward_marks(conv, nthr)(batch, regime))]
        if mask[1] or bias:
            work, rest = _weight_marks(conv, batch, regime, nthr, grad_input, False)
            nested = _NESTED if _weight_scratchpad(conv, regime, nthr) else 0
            found += [work + nested + b, rest + 2 * b]
        return [m - final for m in found]

    return marks


# Note [CPU oneDNN channels-last convolution buffers on AVX2]
#     ATen runs a convolution channels-last where its input is (``mkldnn_conv_use_channels_last``),
#     as ConvNeXt's are: LayerNorm2d permutes to NHWC and back, so every depthwise 7x7 and every
#     downsampling conv after the stem reads a channels-last input. oneDNN then takes other kernels
#     than the blocked ones above (ONEDNN_VERBOSE under ONEDNN_MAX_CPU_ISA=AVX2, f32, torch 2.13), and
#     source and result need no reorder. Read off the profiler, byte for byte (``K`` the kernel volume,
#     ``C8`` the channels rounded up to 8, ``w`` the plain weights' bytes, ``x`` / ``y`` input / output):
#     * Depthwise (groups == cin == cout), stride 1, odd kernels wider than 3 with "same" padding:
#       - forward ``brdgmm_dw:avx2`` (jit_brdgmm_dw_conv.cpp): the weights reordered to ``debcA8a``,
#         K * C8 floats; no scratchpad, no padded bias.
#       - input gradient ``jit_dw:avx2`` backward_data in NHWC (jit_uni_dw_convolution.cpp): the
#         weights as ``Abcde8a`` (K * C8 floats), nothing else.
#       - weight gradient: ``jit_dw`` takes only kernels at most 3 wide (as for the blocked layout),
#         so oneDNN falls to the grouped direct kernel ``jit:avx2`` backward_weights
#         (jit_avx2_conv_kernel_f32.cpp) with ``aBCde8c8b`` weights: each group's one input and one
#         output channel padded to an 8 x 8 block, G * 64 * K floats (``ap``: padded; ConvNeXt-T's 768
#         channels, 7x7: 9.6 MB), then reordered to ``abcde`` (w) and copied into the returned
#         gradient (2w at the top). A bias gradient books a padded bias of G * 8 floats and 128 bytes
#         beside ideep's bias buffer, then the returned bias. Its reducer (``cpu_reducer_t``, G jobs)
#         splits nothing where G >= nthr; fewer groups than threads are declined, unchecked.
#       Declined (no rule): kernels at most 3 wide (``jit_dw``'s NHWC weight gradient splits its
#       threads another way than ``_dw_reduction``: not ported), 3 groups (GEMM weight gradient),
#       kernels the direct weight kernel declines (``_direct_weights_ok``: e.g. taller than the
#       input, GEMM), strides.
#     * Tiled convolutions (kernel == stride > 1 on both axes, no padding, the input exactly tiled:
#       ConvNeXt's 2x2 downsampling), groups 1. ATen first copies the (contiguous) weights
#       channels-last (w, alive through the op), and a backward first copies grad_output
#       channels-last where it is not (y bytes: ``avx2_channels_last_grad_output_copy``):
#       - forward ``brg_conv_fwd:avx2`` (jit_brgemm_conv.cpp): weights ``AcdbNa``, K * cin * (cout
#         rounded up to the block N) floats, and a page of brgemm batch descriptors a thread (103 * 40
#         bytes, as in onednn_conv.py's ``_strided_scratchpad``) with a page of alignment.
#       - input gradient ``brgconv_strided:avx2`` (jit_brgemm_conv_bwd_strided.cpp): the plain strided
#         rule's bookings (``_strided_scratchpad``) and weights ``BcdaNb``, K * cout * (cin rounded up
#         to N), with no copy before or after.
#       - weight gradient ``jit:avx2`` backward_weights in NHWC: K * p8(cin) * p8(cout) floats (3 input
#         channels "flat": K * p8(cout) * 3), the plain direct kernel's reducer and bias bookings
#         (``_direct_avx2_scratchpad``, ``_bias_scratchpad``), then w and its copy at the top.
#       The block N (8, 16, 24 or 32) comes from brgemm's efficiency estimate
#       (jit_brgemm_conv_utils.cpp, not ported): up to 32 channels it padded to C8 in every case seen;
#       above, mostly to a multiple of 24 at one thread (40 -> 48, 80 -> 96, 64 -> 72, as the plain
#       Note's strided input gradient), but 32 -> 80 channels took 16 at two threads (by its bytes).
#       So the rule takes C8 up to 32 channels and multiples of 96 (no padding under any block:
#       ConvNeXt-T's 96 to 768), and declines the rest (ConvNeXt-V2 atto's 80, 160, 320), and
#       one-pixel outputs (other bookings at 2 threads).
#     Checked on a fixed-seed grid (55 shapes: depthwise 5x5 and 7x7 over 2 to 40 channels, tiled 2x2
#     and 4x4 over 3 to 192, batch 1 to 6, each output mask, bias or none, grad_output channels-last
#     or not) at 1 and 2 threads (tests/test_onednn_conv_avx2.py), and some 140 more while writing
#     it. ConvNeXt-like AdamW steps (dims 16/32 on 32x32, dims 96/192 on 64x64) that were 3.7% to
#     31.8% low are exact. ops.py charges grad_output's channels-last copy from
#     ``avx2_channels_last_grad_output_copy`` (not its contiguous copy) where this Note's rule applies.

_BRG_MAX_P8 = 32
"""Up to this many channels brgemm's AVX2 blocks padded them to C8 in every case seen."""
_BRG_EVERY_BLOCK = 96
"""The least common multiple of brgemm's AVX2 channel blocks (8, 16, 24, 32)."""


def onednn_avx2_channels_last(
    inp: Any, weight: Any, stride: Any, padding: Any, dilation: Any, transposed: bool, output_padding: Any, groups: int
) -> bool:
    """Whether Note [CPU oneDNN channels-last convolution buffers on AVX2] describes this convolution:
    a channels-last 4-D f32 input, contiguous weights, and a depthwise "same" or a tiled kernel."""
    if inp.dim() != 4 or inp.dtype != torch.float32 or transposed or torch.backends.cpu.get_cpu_capability() != "AVX2":
        return False
    if inp.is_contiguous() or not inp.is_contiguous(memory_format=torch.channels_last) or not weight.is_contiguous():
        return False
    backend = torch._C._select_conv_backend(inp, weight, None, stride, padding, dilation, transposed, output_padding, groups)
    if str(backend).rpartition(".")[2] != "Mkldnn" or any(int(d) != 1 for d in dilation):
        return False
    out = _output_size(inp, weight, stride, padding, dilation, transposed, output_padding)
    if min(out) < 1:
        return False
    conv = ConvShape.of(inp, weight, stride, padding, dilation, out)
    if groups > 1:
        return _cl_depthwise_ok(conv, groups, torch.get_num_threads())
    known = all(_brg_padded(c) for c in (conv.cin, conv.cout))
    # one output pixel: other bookings at 2 threads (seen, not ported)
    return known and conv.s_out > 1 and _tiled(conv) and conv.strided and _direct_weights_ok(conv)


def _cl_depthwise_ok(conv: ConvShape, groups: int, nthr: int) -> bool:
    """Depthwise, stride 1, odd kernels wider than 3 with "same" padding (narrower ones take
    ``jit_dw``'s weight gradient, whose NHWC split is not ported), not 3 groups (GEMM), and at least
    as many groups as threads (the weight reducer is not seen split: see the Note)."""
    if conv.cin != 1 or conv.cout != groups or conv.strided or groups < nthr or groups == 3:
        return False
    if conv.kernel[-1] <= _DW_MAX_KW or not _direct_weights_ok(conv):  # e.g. a kernel taller than the input: GEMM
        return False
    return all(k % 2 == 1 and p == k // 2 for k, p in zip(conv.kernel, conv.pad))


def _brg_padded(c: int) -> int:
    """The channels brgemm's kernels pad ``c`` to, where their block (8, 16, 24 or 32, by an
    efficiency estimate not ported) does not matter: C8 up to 32 channels, none for multiples of 96
    (every block divides them); 0 elsewhere (declined)."""
    if c <= _BRG_MAX_P8:
        return _p8(c)
    return c if c % _BRG_EVERY_BLOCK == 0 else 0


def avx2_channels_last_grad_output_copy(grad_output: Any) -> int:
    """The channels-last copy ATen makes of a grad_output that is not channels-last (its bytes)."""
    if grad_output.is_contiguous(memory_format=torch.channels_last):
        return 0
    return int(grad_output.numel()) * grad_output.element_size()


def avx2_channels_last_forward_marks(conv: ConvShape, nthr: int, groups: int = 1, bias: bool = False) -> Callable[[int, int], list[int]]:
    """The channels-last forward's high mark above its output (Note [CPU oneDNN channels-last
    convolution buffers on AVX2]): the reordered weights, and for a tiled kernel the channels-last
    weight copy and brgemm's batch descriptors; no batch term."""
    e = conv.e
    if groups > 1:
        fixed = conv.ks * _p8(conv.cout) * e
    else:
        descriptors = _cdiv(_p(conv.ks * _BATCH_ELEMENT, _PAGE), _BATCH_ELEMENT) * _BATCH_ELEMENT
        w = conv.ks * conv.cin * conv.cout * e
        fixed = w + conv.ks * conv.cin * _brg_padded(conv.cout) * e + nthr * descriptors + _PAGE
    return lambda batch, _regime: [fixed]


def avx2_channels_last_backward_marks(conv: ConvShape, nthr: int, mask: Sequence[bool], groups: int = 1) -> Callable[[int, int], list[int]]:
    """The channels-last backward's high marks above its outputs, grad_output's copy aside (Note
    [CPU oneDNN channels-last convolution buffers on AVX2])."""

    def marks(batch: int, regime: int) -> list[int]:
        e = conv.e
        w = conv.ks * conv.cin * conv.cout * e
        grad_input = batch * conv.cin * groups * conv.s_in * e if mask[0] else 0
        bias = len(mask) > 2 and bool(mask[2])
        b = conv.cout * e if bias else 0
        final = grad_input + (w if mask[1] else 0) + b
        w_cl = 0 if groups > 1 else w
        found: list[int] = [final]
        if mask[0]:
            if groups > 1:
                found.append(grad_input + conv.ks * _p8(conv.cout) * e)
            else:
                found.append(w_cl + grad_input + conv.ks * conv.cout * _brg_padded(conv.cin) * e + _strided_scratchpad(conv, nthr))
        if mask[1] or bias:
            w_int, scratch, extra = _cl_weight_buffers(conv, groups, regime, nthr, bias)
            found += [w_cl + grad_input + w_int + scratch + extra + b, w_cl + grad_input + w_int + 2 * w + 2 * b]
        return [m - final for m in found]

    return marks


def _cl_weight_buffers(conv: ConvShape, groups: int, batch: int, nthr: int, bias: bool) -> tuple[int, int, int]:
    """(gradient in the kernel's layout, weight reducer, bias bookings) of the channels-last weight
    gradient (``jit:avx2`` backward_weights)."""
    e = conv.e
    if groups > 1:  # aBCde8c8b: each group an 8 x 8 block; its padded bias G * 8 floats
        return groups * _SIMD * _SIMD * conv.ks * e, 0, groups * _SIMD * e + _ALIGN if bias else 0
    flat = conv.cin == 3  # the input read as is, 3 channels a block (as for the plain direct kernel)
    w_int = conv.ks * (conv.cin if flat else _p8(conv.cin)) * _p8(conv.cout) * e
    extra = _bias_scratchpad(conv.cout, _SIMD, batch, nthr, e, _REDUCER_BUFFER) if bias else 0
    return w_int, _direct_avx2_scratchpad(conv, batch, nthr), extra
