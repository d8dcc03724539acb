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
    _PAGE,
    _REDUCER_BUFFER,
    ConvShape,
    _bias_scratchpad,
    _cdiv,
    _gemm_scratchpad,
    _p,
    _reducer_booking,
    _reducer_split,
    _strided_scratchpad,
)

__all__ = ["avx2_backward_marks", "avx2_forward_marks", "onednn_avx2_convolution"]


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
#       max(input copy + weights + y8, y8 + output), as on AVX512.
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
#         shape: kernels narrower than 14 and no larger than the input, paddings smaller than the
#         kernel, no 3-D depth padding, no dilation. Exactly 3 input channels are "flat" (input
#         plain, gradient K * p8(cout) * 3); others go to x8, gradient K * p8(cin) * p8(cout); y8
#         either way. Its weight reducer (``cpu_reducer_t``, jobs of K * ic_block * 8 over batch *
#         output depth) books the extra threads' partial sums (onednn_conv.py's ``_reducer_split``
#         and ``_reducer_booking``, as its AVX2 kernel there).
#       - GEMM (``gemm:jit``) otherwise (3-D kernels with depth padding, kernels 14 and wider):
#         plain layouts, onednn_conv.py's ``_gemm_scratchpad``; exact on the grid, but over by 40%
#         (263,424 bytes) for one output channel, 7x7x7, padding 3, on 9x9x9 at B = 2.
#       With a bias gradient, the padded bias and bias reducer as on AVX512 (8-channel blocks; the
#       1x1 kernel's reducer capped at 8 jobs a thread), ideep's own bias buffer, and the returned
#       bias. For a bias alone ATen still returns a weight gradient, freed at once: charged here.
#     A split depends on the batch: with a symbolic batch, ``highest`` takes the lines large batches
#     give (Note [Kernel choices that change with the batch] in fxmem/step/timeline.py).
#     Checked against the profiler, byte for byte, on some 300 shapes (1-D, 2-D, 3-D, kernels 1 to
#     7, strides 1 and 2, 1 to 64 channels, batch 1 to 8, every output mask, with and without a bias)
#     at 1 and 2 threads (tests/test_onednn_conv_avx2.py), and on some 2000 more while writing it.
#     AdamW step peaks (B = 4) that were 14% to 27% low are now exact: a 3x3 stack, 1x1 convs, Conv1d,
#     Conv3d. Not covered (no rule, as on AVX512): transposed and grouped convolutions, other dtypes,
#     channels-last inputs, dilation.

_SIMD = 8
"""AVX2's f32 vector width: the channel block of its kernels."""
_MAX_KW = 14
"""The direct weight-gradient kernel takes kernels narrower than this (``jcp.kw < 14``)."""
_REGISTERS = 15
"""The YMM registers the direct forward kernel accumulates in (``num_avail_regs`` on AVX2)."""


def _p8(c: int) -> int:
    return _p(c, _SIMD)


def onednn_avx2_convolution(
    inp: Any, weight: Any, stride: Any, padding: Any, dilation: Any, transposed: bool, output_padding: Any, groups: int
) -> bool:
    """Whether the rules of Note [CPU oneDNN convolution buffers on AVX2] describe this convolution."""
    if transposed or groups != 1 or inp.dim() not in (3, 4, 5) or inp.dtype != torch.float32:
        return False
    if torch.backends.cpu.get_cpu_capability() != "AVX2" or not inp.is_contiguous():
        return False
    backend = torch._C._select_conv_backend(inp, weight, None, stride, padding, dilation, transposed, output_padding, groups)
    return str(backend).rpartition(".")[2] == "Mkldnn"


def as_2d(conv: ConvShape) -> ConvShape:
    """A 1-D convolution as oneDNN sees it: 2-D, one row high (ATen's ``view4d``)."""
    if conv.dim != 1:
        return conv
    return replace(conv, kernel=(1, *conv.kernel), stride=(1, *conv.stride), pad=(0, *conv.pad), inp=(1, *conv.inp), out=(1, *conv.out))


def _end_pads(conv: ConvShape) -> tuple[int, ...]:
    """oneDNN's ``calculate_end_padding`` per spatial axis (undilated)."""
    return tuple((o - 1) * s + k - (i + p) for i, o, k, s, p in zip(conv.inp, conv.out, conv.kernel, conv.stride, conv.pad))


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


def _direct_forward_ok(conv: ConvShape) -> bool:
    """Whether ``jit:avx2`` takes the forward (jit_avx2_conv_fwd_kernel_f32's ``init_conf``): the
    kernel reaches into the input on every side, the left padding fits the width unroll (3 outputs,
    or fewer where the output is narrower), kernels wider than 7 are unpadded or unstrided, and the
    right padding fits the unroll the kernel then picks."""
    ends = _end_pads(conv)
    if conv.dilated or any(k <= p or k <= end for k, p, end in zip(conv.kernel, conv.pad, ends)):
        return False
    kw, sw, lp, iw, ow = conv.kernel[-1], conv.stride[-1], conv.pad[-1], conv.inp[-1], conv.out[-1]
    ur_w = min(3, ow)
    if lp > ur_w or (kw > 7 and any(conv.pad[-2:]) and conv.strided):
        return False
    tail = ow % ur_w
    r_pad = max(0, (ow - tail - 1) * sw + kw - (iw + lp))
    if r_pad > ur_w * sw and ow // ur_w > 1:
        ur_w = min(r_pad // sw + tail, ow, _REGISTERS // 2)
        tail = ow % ur_w
        r_pad = max(0, (ow - tail - 1) * sw + kw - (iw + lp))
        return ur_w >= max(lp, r_pad)
    return True


def _forward_kernel(conv: ConvShape) -> str:
    """Which oneDNN kernel runs the forward (Note [CPU oneDNN convolution buffers on AVX2])."""
    if _is_1x1(conv):
        return "1x1"
    return "direct" if _direct_forward_ok(conv) else "gemm"


def avx2_forward_marks(conv: ConvShape, nthr: int) -> Callable[[int, int], list[int]]:
    """The forward's high marks above its output, at batch b (Note [CPU oneDNN convolution buffers on AVX2])."""
    conv = as_2d(conv)
    kernel = _forward_kernel(conv)
    if kernel == "gemm":  # plain layouts; its im2col columns are not modelled (see the Note)
        return lambda batch, _regime: [0]
    flat = conv.cin < _SIMD and kernel == "direct"
    w_copy = conv.ks * _p8(conv.cout) * (conv.cin if flat else _p8(conv.cin)) * conv.e
    rtus = _rtus(conv, nthr)

    def marks(batch: int, _regime: int) -> list[int]:
        x_copy = 0 if flat else batch * _p8(conv.cin) * conv.s_in * conv.e
        y8, y = batch * _p8(conv.cout) * conv.s_out * conv.e, batch * conv.cout * conv.s_out * conv.e
        return [x_copy + w_copy + y8 + rtus - y, y8]

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
    ``init_conf``): kernels narrower than 14 and no larger than the input, paddings smaller than the
    kernel, no 3-D depth padding, no dilation."""
    if conv.dilated or conv.kernel[-1] >= _MAX_KW:
        return False
    ends = tuple(max(0, e) for e in _end_pads(conv))
    if any(k > i or p >= k or end >= k for k, i, p, end in zip(conv.kernel, conv.inp, conv.pad, ends)):
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
        work = w + _gemm_scratchpad(conv, regime, nthr)
        extra = 0
    if not bias:
        return [grad_input + work, grad_input + w_int + w]
    b = cout * e
    return [grad_input + work + extra + b, grad_input + w_int + w + 2 * b]


def avx2_backward_marks(conv: ConvShape, nthr: int, mask: Sequence[bool]) -> Callable[[int, int], list[int]]:
    """A backward's high marks above its outputs, at batch b with batch r's kernels (Note [CPU oneDNN
    convolution buffers on AVX2])."""
    conv = as_2d(conv)

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
