"""The transient buffers of oneDNN's CPU convolutions: reorders, scratchpads, reduction buffers.

Fake tensors see a convolution's outputs, never the copies ideep makes to feed oneDNN's kernels or
the scratchpad a kernel books; at the step's peak those are real memory. This module computes them
the way oneDNN decides them (which kernel, which layouts, how many threads split the batch), so that
ops.py's workspace rules can charge them; see Note [CPU oneDNN convolution buffers].
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fxmem.results import WorkspaceLines

__all__ = ["ConvShape", "backward_marks", "forward_marks", "highest", "onednn_convolution"]


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
#     * Backward: a grad_output that arrives as a non-contiguous view (ViT's flattened patches at
#       B=1, where the flatten's gradient is a view) is first copied contiguous (y bytes, alive
#       through the op; ops.py adds it).
#     * Backward, input gradient, stride 1: grad_output to y16, weights to K * p16(cin) * p16(cout),
#       the gradient made as x16 and reordered into the plain result (max(y16 + w + x16, x16 + x)).
#       Stride > 1 takes ``brgconv_strided`` in channels-last: grad_output copied (y bytes), weights
#       K * cout * p16(cin) (p32 for an odd number of blocks: ``_strided_ic_block``), the result
#       (x bytes) and a scratchpad that holds, per thread, grad_output's channels over the output
#       grown by the kernel's overhang (``_strided_scratchpad``), then two x-sized copies.
#     * Backward, weight gradient (after the input gradient, which is alive by then). The kernel is
#       oneDNN's first that accepts the shape; each is ported from its ``init_conf`` and
#       ``init_scratchpad``, whose thread split decides whether a reduction buffer exists:
#       - ``jit:avx512_core`` (jit_avx512_common_convolution_bwd_weights_t) for 1..3 input channels
#         in plain layout (its "first convolution": input plain, grad_output to y16, gradient
#         K * p16(cout) * cin) or at least 16 (x16, y16, gradient K * p16(cin) * p16(cout)), kernels
#         up to 14 wide. Its ``balance()`` splits the threads over the batch (``nthr_mb``) and the
#         output and input channel blocks: the split with the least memory traffic, then one with less
#         compute if that costs at most 10% more traffic (or 25% less compute at any traffic); 2-D
#         outputs taller than 9 rows are split over batch * rows (``harness_2d_reduction``). Where the
#         batch is split, each thread beyond the first accumulates into its own gradient and bias: a
#         scratchpad of (nthr_mb - 1) * (gradient + p16(cout) * 4) + 128 bytes (the registry's
#         alignment) and a barrier context (a page, with a page of alignment): 8320 bytes beyond the
#         copies. ``_avx512_batch_threads`` ports ``balance()``.
#       - ``jit:avx2`` (8-channel blocks) for 2-D kernels > 1 with 4..15 input channels: x8, y8,
#         gradient w8, and a scratchpad only where oneDNN's ``reduce_balancer_t`` gives a group of
#         several threads (``_avx2_scratchpad``).
#       - GEMM (``gemm:jit``) for kernels wider than 14 (ViT's 16x16 patches) and 3-D kernels > 1 with
#         4..15 input channels: plain layouts, no reorders; the gradient w and a scratchpad of a
#         weight-reduction buffer and im2col columns (``_gemm_scratchpad``); high mark w + max(S, w).
#       - ``jit_1x1:avx512_core`` for 1x1 kernels with stride 1, or 2-D strides whose outputs tile
#         the input exactly (others go to the kernels above): x16, y16, gradient p16(cin) *
#         p16(cout), a reduction buffer where its own ``balance()`` splits the batch, and for a
#         stride the gathered input of each working thread (``_1x1_scratchpad``).
#       The gradient is then reordered into the returned weight gradient (blocked layouts only).
#       A split depends on the batch: with a symbolic batch, the split at B = 2 where large batches
#       take the same one, else the split at B = 8 (``highest``).
#     Checked against the profiler for 2-D and 3-D, kernels 1 to 16, strides 1 to 16, 1 to 256
#     channels, batch 1 to 8, at 2 threads (tests/test_workspaces.py), and on some 5000 more shapes
#     and at 1, 3 and 4 threads while the ports were written. Other ISAs, dtypes, groups and transposed
#     convolutions get no rule (their kernels and layouts differ); channels-last inputs skip the reorders
#     (no rule either: the figures above would overstate).

_ALIGN = 128
"""What oneDNN's scratchpad registry adds to each booking (its default alignment)."""
_PAGE = 4096
"""oneDNN's barrier context size and alignment (``CTX_ALIGNMENT`` on Linux), and a reducer's alignment."""
_REDUCTION_PAD = _ALIGN + 2 * _PAGE
"""A batch-split reduction booking's extra bytes: its alignment, and the barrier context with its own."""
_REDUCER_BUFFER = 1 << 21
"""The AVX2 reducers' cap on partial-sum elements (``max_buffer_size``)."""
_BIAS_BUFFER_AVX512 = 3 * 5 * 5 * 16 * 16
"""The avx512 kernels' bias reducer cap on partial-sum elements, per thread."""
_BATCH_ELEMENT = 40
"""The size of one brgemm batch descriptor (``brgemm_batch_element_t``)."""
_MIN_OH_REDUCE = 9
"""oneDNN's ``min_oh_reduce``: a 2-D output taller than this is split over its rows as well as the batch."""
_MAX_KW = 14
"""The widest kernel the direct avx512 weight-gradient kernel takes (wider ones go to GEMM)."""
_LARGE = 2**20
"""A batch large enough that oneDNN's choices have settled (the symbolic timeline's lines are its)."""


def _p(c: int, block: int = 16) -> int:
    return -(-c // block) * block


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ConvShape:
    """One convolution's sizes as oneDNN's conf reads them; spatial tuples are depth first (2-D: H, W)."""

    cin: int
    cout: int
    e: int
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    pad: tuple[int, ...]
    dilated: bool
    inp: tuple[int, ...]
    out: tuple[int, ...]

    @classmethod
    def of(
        cls, inp: Any, weight: Any, stride: Sequence[Any], padding: Sequence[Any], dilation: Sequence[Any], out_spatial: Sequence[Any]
    ) -> ConvShape:
        ints = lambda xs: tuple(int(x) for x in xs)
        return cls(
            int(weight.shape[1]), int(weight.shape[0]), inp.element_size(), ints(weight.shape[2:]), ints(stride), ints(padding),
            any(int(d) != 1 for d in dilation), ints(inp.shape[2:]), ints(out_spatial),
        )

    @property
    def dim(self) -> int:
        return len(self.kernel)

    @property
    def ks(self) -> int:
        return math.prod(self.kernel)

    @property
    def s_in(self) -> int:
        return math.prod(self.inp)

    @property
    def s_out(self) -> int:
        return math.prod(self.out)

    @property
    def strided(self) -> bool:
        return any(s != 1 for s in self.stride)


def onednn_convolution(inp: Any, weight: Any, stride: Any, padding: Any, dilation: Any, transposed: bool, output_padding: Any, groups: int) -> bool:
    """Whether the rules of Note [CPU oneDNN convolution buffers] describe this convolution."""
    if transposed or groups != 1 or inp.dim() not in (4, 5) or inp.dtype != torch.float32:
        return False
    if torch.backends.cpu.get_cpu_capability() != "AVX512" or not inp.is_contiguous():
        return False
    backend = torch._C._select_conv_backend(inp, weight, None, stride, padding, dilation, transposed, output_padding, groups)
    return str(backend).rpartition(".")[2] == "Mkldnn"


def highest(batch: Any, marks: Callable[[int, int], Sequence[int]], plus: Any = 0) -> Any:
    """The largest of some byte counts, each linear in the batch, plus ``plus``: ``marks(b, r)``
    lists them at batch b for the kernels oneDNN picks at batch r (a thread split depends on the batch).

    A concrete batch gets its number. A symbolic one gets the lines of the kernels large batches
    pick that are the largest somewhere from B = 2 up, and a check of whether they are the bytes at
    a given batch, where other kernels may run (Note [Kernel choices that change with the batch] in
    fxmem/step/timeline.py)."""
    if not isinstance(batch, torch.SymInt):
        return max(marks(int(batch), int(batch))) + plus
    large = marks(1, _LARGE)
    envelope = _upper_envelope([(one - zero, zero) for zero, one in zip(marks(0, _LARGE), large)])
    kept = [(slope, fixed) for slope, fixed in envelope if (slope, fixed + plus) != (0, 0)]
    lines = tuple(slope * batch + fixed + plus for slope, fixed in kept)
    exact_at = lambda b: max(marks(b, b)) == max(a * b + c for a, c in envelope)
    if not kept:
        return WorkspaceLines(lines, exact_at)
    (a0, c0), rest = kept[0], len(kept) - 1
    first = lambda b: max(marks(b, b)) - (a0 * b + c0)  # the first line becomes the kernel's bytes there
    return WorkspaceLines(lines, exact_at, (first, *[lambda b: None] * rest))


def _upper_envelope(lines: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The lines (slope, intercept) that are the largest at some integer B >= 2, in order of slope:
    the largest at B = 2, at a large batch, and on either side of every crossing in between."""
    where = {2, _LARGE}
    for (a1, c1), (a2, c2) in itertools.combinations(lines, 2):
        if a1 != a2:
            x = (c2 - c1) / (a1 - a2)
            where |= {b for b in (math.floor(x), math.ceil(x)) if 2 <= b <= _LARGE}
    top = {max(lines, key=lambda line: (line[0] * b + line[1], line[0])) for b in where}
    return sorted(top)


def _rtus(conv: ConvShape, nthr: int) -> int:
    """The 2-D 1x1 strided kernel's per-thread gathered input (Note [CPU oneDNN convolution buffers])."""
    if conv.dim != 2 or conv.ks != 1 or not conv.strided or not _1x1_unit_stride(conv):
        return 0
    return (nthr * _p(conv.cin) * conv.s_out + 32) * conv.e


def forward_marks(conv: ConvShape, nthr: int) -> Callable[[int, int], list[int]]:
    """The forward's high marks above its output, at batch b (Note [CPU oneDNN convolution buffers])."""
    first = conv.cin < 16 and (conv.ks > 1 or not _1x1_unit_stride(conv))
    w_copy = conv.ks * _p(conv.cout) * (conv.cin if first else _p(conv.cin)) * conv.e
    rtus = _rtus(conv, nthr)

    def marks(batch: int, _regime: int) -> list[int]:
        x_copy = 0 if first else batch * _p(conv.cin) * conv.s_in * conv.e
        y16, y = batch * _p(conv.cout) * conv.s_out * conv.e, batch * conv.cout * conv.s_out * conv.e
        return [x_copy + w_copy + y16 + rtus - y, y16]

    return marks


def _avx512_batch_threads(conv: ConvShape, batch: int, nthr: int, ic_block: int) -> int:
    """How many threads oneDNN's direct avx512 weight-gradient kernel splits the batch over
    (``nthr_mb``): its ``balance()`` for one group, with its memory- and compute-cost models."""
    nb_ic, nb_oc, oc_block = _cdiv(conv.cin, ic_block), _p(conv.cout) // 16, 16
    pad3 = lambda xs: (1,) * (3 - len(xs)) + tuple(xs)
    (id_, ih, iw), (od, oh, ow), (kd, kh, kw), (sd, sh, sw) = pad3(conv.inp), pad3(conv.out), pad3(conv.kernel), pad3(conv.stride)
    transposed = _hw_transposed(conv)
    if transposed:
        ih, iw, oh, ow = iw, ih, ow, oh  # is_hw_transp: height and width trade places
    rows = conv.dim == 2 and oh > _MIN_OH_REDUCE and not conv.dilated and not transposed
    ih_red, oh_red = (ih, oh) if rows else (1, 1)
    ih_rest, oh_rest = (1, 1) if rows else (ih, oh)
    mb_max = min(nthr, batch * od * max(1, oh_red // _MIN_OH_REDUCE))

    def traffic(m: int, o: int, i: int) -> int:
        src = _cdiv(batch * ih_red, m) * _cdiv(nb_ic, i) * ic_block * ih_rest * iw * id_ // sd // sh // sw
        dst = _cdiv(batch * oh_red, m) * _cdiv(nb_oc, o) * oc_block * oh_rest * ow * od
        return src + dst + 8 * _cdiv(nb_oc, o) * _cdiv(nb_ic, i) * kh * kw * kd * ic_block * oc_block

    def compute(m: int, o: int, i: int) -> int:
        return _cdiv(batch * oh_red, m) * _cdiv(nb_oc, o) * _cdiv(nb_ic, i)

    splits = [(m, o, min(nthr // m // o, nb_ic)) for m in range(1, mb_max + 1) for o in range(1, min(nthr // m, nb_oc) + 1)]
    best, least = (1, 1, 1), traffic(1, 1, 1)
    for s in splits:  # step 1: least traffic (the last of equals)
        if traffic(*s) <= least:
            best, least = s, traffic(*s)
    cheapest = compute(*best)
    for s in splits:  # step 2: less compute within 10% more traffic (any, transposed), or 25% less compute
        if (compute(*s) <= cheapest and (transposed or traffic(*s) < 1.1 * least)) or 4 * compute(*s) <= 3 * cheapest:
            best, cheapest = s, compute(*s)
    m = best[0]
    if nthr // 2 < m < nthr:
        m = min(batch * od * max(1, oh_red // _MIN_OH_REDUCE), nthr)
    return m


def _strided_ic_block(cin: int) -> int:
    """The input-channel block the strided input-gradient kernel pads its weights to: 16, or 32
    where p16(cin) is an odd number (3 or more) of 16-channel blocks. There oneDNN's
    ``try_exec_type`` weighs 16 against 32 by an efficiency estimate (``est_eff``, not ported) and
    mostly takes 32; taking 32 always makes the figure an upper bound (by K * cout * 64 bytes)."""
    blocks = _p(cin) // 16
    return 32 if blocks % 2 == 1 and blocks >= 3 else 16


def _strided_scratchpad(conv: ConvShape, nthr: int) -> int:
    """The scratchpad of oneDNN's strided input-gradient kernel (``brgconv_strided``,
    jit_brgemm_convolution_bwd_strided_t), as ``brgemm_convolution_bwd_utils`` books it for f32;
    each booking costs its size plus a page (its alignment). Per thread: a page of brgemm batch
    descriptors (40 bytes each; more pages for kernels over 102 taps, bounded here by the whole
    kernel), grad_output's channels over the output grown by the kernel's overhang on each side
    (the whole cout is one block in f32), a page of block masks, and, where the input width is not
    a multiple of the stride, a row buffer of (width rounded up to the stride) * stride * cin."""
    overhang = 1
    for i, o, k, st, p in zip(conv.inp, conv.out, conv.kernel, conv.stride, conv.pad):
        end = (o - 1) * st + k - (i + p)  # calculate_end_padding
        overhang *= o + max(0, k - 1 - p) // st + max(0, k - 1 - end) // st
    descriptors = _cdiv(_p(conv.ks * _BATCH_ELEMENT, _PAGE), _BATCH_ELEMENT) * _BATCH_ELEMENT
    rows = math.prod(_cdiv(i, st) for i, st in zip(conv.inp[:-1], conv.stride[:-1]))
    books = [nthr * descriptors, nthr * _p(overhang * conv.cout, _PAGE) * conv.e, nthr * _p(rows, _PAGE)]
    width, stride_w = conv.inp[-1], conv.stride[-1]
    if width % stride_w:
        books.append(nthr * _p(_p(width, stride_w) * stride_w * conv.cin, _PAGE) * conv.e)
    return sum(b + _PAGE for b in books if b)


def _reducer_split(nthr: int, job: int, jobs: int, reduction: int, buffer: int = _REDUCER_BUFFER) -> tuple[int, int, int]:
    """oneDNN's ``reduce_balancer_t::balance()`` (cpu_reducer.cpp; threads may share a group): how
    ``jobs`` independent sums of ``job`` floats, each over ``reduction`` items, go to ``nthr``
    threads, as (groups, threads per group, jobs per group at most). A group of several threads
    gives each thread beyond the first a private partial sum to reduce afterwards."""
    least_jobs = max(1, jobs // nthr)
    most_jobs = max(1, buffer // (nthr * job))
    groups = min(jobs // least_jobs, nthr)
    best = (groups, min(nthr // groups, reduction), _cdiv(jobs, groups))
    cost = jobs * job * reduction
    for per in range(least_jobs, jobs):  # every jobs-per-group; strictly cheaper wins
        g = min(jobs // per, nthr)
        t, ub = min(nthr // g, reduction), _cdiv(jobs, g)
        if t > 1 and ub > most_jobs:
            continue
        c = job * ub * (_cdiv(reduction, t) + (t != 1))
        if c < cost:
            best, cost = (g, t, ub), c
    return best


def _reducer_booking(groups: int, per_group: int, ub: int, job: int, e: int) -> int:
    """What a ``cpu_reducer`` books where a group has several threads: the extra threads' partial
    sums, page-aligned, and a barrier context per group (a page each), the whole page-aligned."""
    return groups * (per_group - 1) * ub * job * e + _PAGE + groups * _PAGE + _PAGE if per_group > 1 else 0


def _bias_scratchpad(cout: int, block: int, batch: int, nthr: int, e: int, buffer: int) -> int:
    """What a direct or 1x1 kernel adds for a bias gradient: a padded bias where cout is no multiple
    of its channel block, and a bias reducer over the batch (``reducer_bia_conf_``: one job per
    output block)."""
    padded = _p(cout, block) * e + _ALIGN if cout % block else 0
    return padded + _reducer_booking(*_reducer_split(nthr, block, _p(cout, block) // block, batch, buffer), block, e)


def _avx2_scratchpad(conv: ConvShape, batch: int, nthr: int) -> int:
    """The scratchpad of oneDNN's AVX2 weight-gradient kernel (8-channel blocks): only the weight
    reducer's, which the driver (``jit_avx2_convolution_bwd_weights_t``) books where the balancer
    splits the batch: the partial sums of the extra threads, booked page-aligned, and one barrier
    context per group (a page each, ``CTX_ALIGNMENT``), the whole booked page-aligned too."""
    job = conv.ks * 8 * 8
    groups, per_group, ub = _reducer_split(nthr, job, (_p(conv.cin, 8) // 8) * (_p(conv.cout, 8) // 8), batch * math.prod(conv.out[:-2]))
    return _reducer_booking(groups, per_group, ub, job, conv.e)


def _gemm_scratchpad(conv: ConvShape, batch: int, nthr: int) -> int:
    """The scratchpad of oneDNN's GEMM weight-gradient kernel (``gemm_convolution_bwd_weights_t``,
    plain layouts), as ``jit_gemm_convolution_utils::init_conf`` books it for f32.

    Two bookings, each 128 bytes (the registry's alignment) beyond its size: a weight-reduction
    buffer booked as ``nthr * weights`` floats where ``weights`` is already a byte count (so four
    times the bytes meant), and the im2col columns, cin * K * (one output plane) floats per thread.
    The threads take one batch slice each ("outer threading") only where there is more than one
    sample, fewer than 256 output pixels of a plane per thread, and the per-thread buffers fit a limit
    of min(1 GiB, 15 * nthr * (input + weights + output bytes)); otherwise one buffer serves all. Where
    the columns would not fit what the limit leaves, they shrink to a block of max(16, 5% of what
    fits) output pixels.
    """
    e, ks, plane = conv.e, conv.ks, math.prod(conv.out[-2:])
    w = conv.cin * conv.cout * ks * e
    limit = min(1 << 30, 15 * nthr * (batch * conv.cin * conv.s_in * e + w + batch * conv.cout * conv.s_out * e))
    per_thread = e * nthr * w + e * nthr * conv.cin * ks * 16
    n = nthr if batch != 1 and plane // nthr < 256 and per_thread < limit else 1
    reduction = e * n * w + _ALIGN
    columns = n * conv.cin * ks * plane * e
    if columns > limit - reduction:
        fits = (limit - reduction) // (e * n * conv.cin * ks)
        columns = n * conv.cin * ks * max(16, int(fits * 0.05)) * e
    return reduction + columns + _ALIGN


def _hw_transposed(conv: ConvShape) -> bool:
    """oneDNN's ``is_hw_transp``: a 2-D kernel as wide as its input (14 to 19), one output column,
    stride 1, no padding."""
    return (
        conv.dim == 2 and conv.out[1] == 1 and conv.kernel[1] == conv.inp[1] and 14 <= conv.kernel[1] < 20
        and conv.stride == (1, 1) and conv.pad == (0, 0) and not conv.dilated
    )


def _f32(x: float) -> float:
    """x rounded to a C float (oneDNN compares some ratios in single precision)."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def _best_divider(value: int, low: int, high: int, largest: bool) -> int:
    """oneDNN's ``best_divider`` (jit_uni_1x1_conv_utils.hpp): the block size in [low, high] that
    wastes the smallest fraction when ``value`` is rounded up to a multiple of it; of equals, the
    largest or the smallest."""
    high = max(1, min(high, value))
    low = max(1, min(low, high))
    best, least = high, math.inf
    for d in range(high, low - 1, -1):
        rounded = _cdiv(value, d) * d
        loss = _f32(_f32(rounded - value) / _f32(rounded))
        if loss < least or (not largest and loss == least):
            best, least = d, loss
    return best


def _1x1_unit_stride(conv: ConvShape) -> bool:
    """Whether the 1x1 kernel takes the shape: stride 1, or a 2-D stride ``rtus_prepare`` can
    gather away (each output size times its stride is the input size)."""
    if not conv.strided:
        return True
    return conv.dim == 2 and all(o * s == i for o, s, i in zip(conv.out, conv.stride, conv.inp))


def _1x1_scratchpad(conv: ConvShape, batch: int, nthr: int) -> int:
    """The scratchpad of oneDNN's 1x1 weight-gradient kernel (``jit_avx512_common_1x1_conv_kernel``'s
    ``init_conf`` and ``balance()``): the output pixels go in blocks (``best_divider``), the threads
    split over batch * blocks and the channel blocks by least memory traffic (the last of equals; a
    batch split over more than half of the threads but not all widens to all); a batch split books a
    reduction buffer ((nthr_mb - 1) blocked gradients, no bias) with its barrier context; a strided
    input is gathered per working thread (``rtus``) into nb_bcast_blocking channel blocks."""
    pixels = conv.s_out
    block = _best_divider(pixels, 7, 16, True)
    if pixels % block:
        block = _best_divider(conv.out[-1], 4, conv.out[-1], False)
    block = 1 if block > 256 else block
    blocks, nb_ic, nb_oc = _cdiv(pixels, block), _p(conv.cin) // 16, _p(conv.cout) // 16

    def traffic(m: int, o: int, i: int) -> int:
        data = _cdiv(batch * blocks, m) * 16 * block * (_cdiv(nb_ic, i) + _cdiv(nb_oc, o))
        return data + 12 * _cdiv(nb_oc, o) * _cdiv(nb_ic, i) * 16 * 16

    best, least = (1, 1, 1), traffic(1, 1, 1)
    for m in range(1, min(nthr, batch * blocks) + 1):
        for o in range(1, min(nthr // m, nb_oc) + 1):
            split = (m, o, min(nthr // m // o, nb_ic))
            if traffic(*split) <= least:
                best, least = split, traffic(*split)
    m, o, i = best
    if nthr // 2 < m < nthr:
        m = min(batch, nthr)
    w16 = _p(conv.cin) * _p(conv.cout) * conv.e
    reduction = (m - 1) * w16 + _REDUCTION_PAD if m > 1 else 0
    rtus = m * o * i * _best_divider(nb_ic, 5, nb_ic, False) * 16 * pixels * conv.e + _ALIGN if conv.strided else 0
    return reduction + rtus


def _weight_kernel(conv: ConvShape) -> str:
    """Which oneDNN kernel computes the weight gradient (Note [CPU oneDNN convolution buffers])."""
    if conv.ks == 1 and _1x1_unit_stride(conv):
        return "1x1"
    if conv.kernel[-1] > _MAX_KW and not _hw_transposed(conv):
        return "gemm"
    if conv.cin < 4:
        return "first"
    if conv.cin < 16:
        return "avx2" if conv.dim == 2 or conv.ks == 1 else "gemm"
    return "blocked"


def _weight_marks(conv: ConvShape, batch: int, regime: int, nthr: int, grad_input: int, bias: bool) -> list[int]:
    """The weight gradient's high marks, with the input gradient (``grad_input`` bytes) alive.

    With a bias gradient ideep sums it into its own plain buffer (cout), made after the scratchpad
    and freed last, and the returned bias is made after the kernel, before the returned weight
    gradient; the kernels other than GEMM add their bias scratchpad (``_bias_scratchpad``)."""
    e, ks, cin, cout = conv.e, conv.ks, conv.cin, conv.cout
    x16, y16 = batch * _p(cin) * conv.s_in * e, batch * _p(cout) * conv.s_out * e
    w = ks * cin * cout * e
    kernel = _weight_kernel(conv)
    if kernel in ("first", "blocked"):
        first = kernel == "first"
        w_int = ks * _p(cout) * (cin if first else _p(cin)) * e
        split = _avx512_batch_threads(conv, regime, nthr, cin if first else 16)
        reduction = (split - 1) * (w_int + _p(cout) * e) + _REDUCTION_PAD if split > 1 else 0
        work = (0 if first else x16) + y16 + w_int + reduction
        extra = _bias_scratchpad(cout, 16, regime, nthr, e, nthr * _BIAS_BUFFER_AVX512)
    elif kernel == "avx2":
        w_int = ks * _p(cin, 8) * _p(cout, 8) * e
        x8, y8 = batch * _p(cin, 8) * conv.s_in * e, batch * _p(cout, 8) * conv.s_out * e
        work = x8 + y8 + w_int + _avx2_scratchpad(conv, regime, nthr)
        extra = _bias_scratchpad(cout, 8, regime, nthr, e, _REDUCER_BUFFER)
    elif kernel == "gemm":
        w_int = w
        work = w + _gemm_scratchpad(conv, regime, nthr)
        extra = 0
    else:
        w_int = ks * _p(cin) * _p(cout) * e
        work = x16 + y16 + w_int + _1x1_scratchpad(conv, regime, nthr)
        extra = _bias_scratchpad(cout, 16, regime, nthr, e, nthr * _BIAS_BUFFER_AVX512)
    if not bias:
        return [grad_input + work, grad_input + w_int + w]
    b = cout * e  # ideep's bias buffer; at the reorder, the returned bias too
    return [grad_input + work + extra + b, grad_input + w_int + w + 2 * b]


def backward_marks(conv: ConvShape, nthr: int, mask: Sequence[bool]) -> Callable[[int, int], list[int]]:
    """A backward's high marks above its outputs, at batch b with batch r's kernels (Note [CPU oneDNN
    convolution buffers])."""

    def marks(batch: int, regime: int) -> list[int]:
        e, ks, cin, cout = conv.e, conv.ks, conv.cin, conv.cout
        x, y = batch * cin * conv.s_in * e, batch * cout * conv.s_out * e
        x16, y16 = batch * _p(cin) * conv.s_in * e, batch * _p(cout) * conv.s_out * e
        grad_input = x if mask[0] else 0
        bias = len(mask) > 2 and bool(mask[2])
        # a bias gradient alone still runs the weight kernel, and its weight gradient is then workspace
        final = grad_input + (ks * cin * cout * e if mask[1] else 0) + (cout * e if bias else 0)
        found: list[int] = [final]
        if mask[0]:
            if conv.strided:
                w_copy = ks * cout * _p(cin, _strided_ic_block(cin)) * e
                found += [y + w_copy + x + _strided_scratchpad(conv, nthr), 3 * x]
            else:
                found += [y16 + ks * _p(cin) * _p(cout) * e + x16, x16 + x]
        if mask[1] or bias:
            found += _weight_marks(conv, batch, regime, nthr, grad_input, bias)
        return [m - final for m in found]

    return marks
