"""cuDNN's convolution workspaces on the cuda target, and an upper bound for each.

On CUDA a convolution that is not depthwise runs through cuDNN (``_select_conv_backend`` in
aten/src/ATen/native/Convolution.cpp), which allocates a workspace for the engine it runs and frees
it before returning; fake tensors never see it. This module sizes it from the shapes, the dtype and
the direction, the way an H200 with cuDNN 9.19 was measured to ask for it (Note [cuDNN convolution
workspaces]), and says how far the figure can be trusted: each ``ConvWorkspace`` carries the
estimate that fxmem charges and a bound for the report. fxmem/rules/ops.py registers the rules.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch._prims_common import is_contiguous_for_memory_format_or_false, is_contiguous_or_false, suggest_memory_format
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxmem.results import Estimated, WorkspaceBound
from fxmem.rules.onednn_conv import highest

__all__ = [
    "CUDNN_CONV_WORKSPACE",
    "ConvFrame",
    "ConvWorkspace",
    "Direction",
    "Law",
    "conv_workspace",
    "convolution_workspaces",
    "cudnn_convolution_backward_workspace",
    "cudnn_convolution_workspace",
    "suggested_layout",
]


CUDNN_CONV_WORKSPACE = "cuDNN convolution workspace"
"""What the bound of a cuDNN convolution's workspace is called; the allocator replay lets such a workspace give way
(Note [A workspace that does not fit] in fxmem/gpu/allocator.py)."""


# Note [cuDNN convolution workspaces]
#     How ATen asks (aten/src/ATen/native/cudnn/Conv_v8.cpp, read at pytorch commit 06ca69ca;
#     cudnn.benchmark off): each direction (forward, data gradient, weight gradient) is its own cuDNN
#     operation graph. ATen takes the engine configs of cuDNN's heuristics (CUDNN_HEUR_MODE_INSTANT;
#     the fallback list only if none runs), drops those with the DOWN_CONVERT_INPUTS note (and the
#     TENSOR_CORE ones for fp32 when TF32 is off), and tries them in order: ``run_conv_plan`` allocates
#     ``plan.getWorkspaceSize()`` bytes from the caching allocator, uncapped, runs, and frees them on
#     return; a failed allocation (OutOfMemoryError) moves on to the next config. Only benchmark mode
#     caps a workspace (by the allocator's largest free block, halving on failure). So the workspace is
#     what the first config heuristics rank needs, unless memory is short. In ConvShared.cpp,
#     ``cudnn_convolution_backward`` runs the data gradient and then the weight gradient, each after its
#     own ``grad_output.contiguous()`` (a copy, alive through that part, where grad_output is a
#     non-contiguous view: a sum's expanded gradient, a channel slice of a ``cat``'s); the transposed
#     backward makes one copy for both. The bias gradient is a plain ``sum`` afterwards.
#
#     What the engines asked for (tests/data/h200: 258 traced calls, 2-D, depthwise, 3-D and transposed
#     3-D, B 1/2/4, fp32 with TF32 and bf16 autocast; sizes in bytes, in the convolution's own frame: X
#     its input, Y its output, W its weight; a transposed convolution's forward is the data gradient of
#     the convolution from its output to its input, and its data gradient that convolution's forward).
#     ``p`` pads a channel count to 16 bytes (4 fp32, 8 bf16 channels), both of W's in the weight:
#       * layout transform, most engines: NHWC copies Xp + Wp + Yp plus 16 bytes (16 per group in a
#         grouped data gradient; 16 + 131 in fp32 strided 3-D data gradients). fp32 forwards of 32 or
#         more input channels copy no output (Xp + Wp + 16). Exact for 182 of 222 forwards and 149 of
#         198 data gradients (13 more within the 131 bytes).
#       * strided 1x1 kernels: X + Y + 16 (forward), + 16 or 147 (data), + 144 (weight gradient).
#       * 1x1 kernels, stride 1: forward and data gradient 0 to 656 bytes (charged 0); the weight
#         gradient one fp32 partial weight gradient per sample, b * Wf (1 to 50 of them at B = 1).
#         ResNet-50's 1x1 layers at B = 1 to 64 (trace_conv_batches, 192 calls) add: where the copies
#         X + Y are under half of b * Wf and b * Wf passes 8 MiB (7x7 images; 14x14 ones in bf16 from
#         B = 8 or 16), the weight gradient copies X and Y (+ 16) instead. A fit, not a law: it gets
#         113 of the 120 weight gradients at B >= 4 exact within 1 KiB, over-estimates 3 and under-
#         estimates 4 (by 2 to 8.3 MiB), where cuDNN's heuristics went the other way. There the forward
#         and data gradient also copy X and Y at 7x7 from B = 4 (bf16) or 16 (fp32), and split into up
#         to 16 partials at B = 1 in fp32: not charged, but inside the bound.
#       * no workspace: forwards of fewer than 4 input channels (an image stem, a 1-channel volume),
#         fp32 stride-1 data gradients into at most 8 channels (and 2-D ones into fewer than 4), bf16
#         strided data gradients into 1 channel, and depthwise convolutions, which ATen runs with its
#         own kernels (``use_cudnn_depthwise`` takes only fp16 or channels-last inputs).
#       * weight gradients: the copies of X, Y and W (padded in bf16; as they are in fp32) and 16
#         bytes, plus split-K partial sums whose size is the engine's own: 0 to 8.5 MB over the sweep
#         (up to 10 MB where the split is over a large weight, 256 -> 256 channels 3x3 at 14x14), with no
#         law in the shapes that this model could find. The estimate adds the sweep's median for the
#         dtype and dimensionality (``_SPLIT_MEDIAN``); |error| median 1 MB, 163 of 183 within 4 MiB.
#       * one FFT engine, fp32 5x5 2-D weight gradients: 2 * Cin * Cout spectra of a 128x128 tile
#         (128 * 65 complex64 each: 260 MiB for 32 -> 64 channels) plus Y.
#     Which engine runs is cuDNN's heuristic, and opaque: the thresholds above are the sweep's, and a
#     shape outside it may get another engine (24 forwards and 16 data gradients of the sweep did, and
#     MONAI's last layer, 2 -> 2 channels at 64^3 in bf16, took an 8.65 MB weight-gradient engine where
#     the padded copies and the median, 17.3 MB, are charged). ``ConvWorkspace.bound`` charges, for every
#     direction, the largest family (the padded copies of all three operands, b * Wf, the FFT engine
#     where it was seen: fp32 2-D kernels of 5x5 or more, stride 1) plus 16 MiB of split-K partials
#     (the most seen: 10.2 MB), 1x1 kernels' forward and data gradient included. Every
#     sweep workspace is within its bound. Not modelled: the workspaces of channels-last inputs (their
#     copies follow ConvShared.cpp's layouts: Note [Which kernel runs a depthwise convolution]), fp16
#     depthwise through cuDNN, GPUs other than the H200 (cuDNN's heuristics depend on the architecture), cudnn.benchmark,
#     and the bias gradient's ``sum``, whose CUDA reduction stages up to an eighth of grad_output after
#     the weight gradient's workspace is freed.

# Note [Which kernel runs a depthwise convolution]
#     ``_select_conv_backend`` (aten/src/ATen/native/Convolution.cpp, read at torch 2.11-2.13) sends a
#     CUDA convolution with ``is_depthwise`` (groups == input channels > 1, output channels a multiple,
#     not transposed, 4-D or 5-D) to cuDNN only where ``ConvParams::use_cudnn_depthwise`` says so: always
#     where ``cudnn_conv_suggest_memory_format(input, weight)`` (ConvUtils.h: channels-last if the input
#     or the 4-D weight suggests it) is not Contiguous, else only for fp16 input and weight through
#     ``check_cudnn_depthwise_workload_with_filter``; fp32 and bf16 NCHW depthwise convolutions
#     (ConvNeXt's 7x7 in its official form, which adds the residual first) run ATen's own
#     ``conv_depthwise2d`` kernels (DepthwiseConv2d.cu), which allocate nothing but their outputs. Their
#     backward (``conv_depthwise2d_backward_cuda_out``) takes ``grad_output.expect_contiguous()`` once
#     for both gradients: a copy where grad_output is a view, as a ConvNeXt block's is (the gradient of
#     ``permute(0, 2, 3, 1)``: channels-last strides). ``convolution_backward`` picks the backend from
#     the saved input and the weight, so forward and backward agree. The H200 sweep (kernels_h200.json
#     ``conv``, trace_conv.json) ran NCHW depthwise 7x7, 3x3 and strided 5x5 convolutions in fp32 and
#     bf16: no workspace in any direction, the backward's rise its outputs and that copy only.
#     A channels-last depthwise convolution (timm's ConvNeXt, whose ``LayerNorm2d`` and residual leave
#     the activations channels-last) runs cuDNN instead; ConvShared.cpp copies grad_output to
#     ``cudnn_conv_suggest_memory_format(grad_output, weight)`` for the data gradient and the input and
#     grad_output to ``cudnn_conv_suggest_memory_format(input, grad_output)`` for the weight gradient,
#     so a channels-last grad_output is not copied at all, where charging the native kernel's copy
#     counted one output-sized tensor too many. Its workspace was not measured (``Law.CUDNN_DEPTHWISE``).
#     Not modelled: fp16's workload heuristic (fp16 NCHW depthwise is taken as native).

_TRAILER = 16
"""What every layout-transform workspace adds to its copies."""
_STRIDED_DATA_TRAILER = 16 + 131
"""The trailer of fp32 strided 3-D and strided 1x1 data gradients (their engines add 131 bytes)."""
_GATHER_WEIGHT_TRAILER = 144
"""The strided 1x1 weight gradient's trailer."""
_SPLIT_ALLOWANCE = 16 * 2**20
"""The bound's room for split-K partial sums (the most seen: 10.2 MB, a 256-channel 3x3 weight gradient)."""
_SPLIT_MEDIAN = {(4, 2): 2_224_312, (4, 3): 987_307, (2, 2): 128, (2, 3): 557_359}
"""The median excess of a weight gradient's workspace over its layout transform, by (element size,
spatial dims), over the sweep (tests/test_cudnn_conv.py recomputes it)."""
_PAIR_SHARE = 2
"""A 1x1 weight gradient copies X and Y, not per-sample partials, only where the copies are under
half the partials (Note [cuDNN convolution workspaces]) ..."""
_PARTIALS_UP_TO = 8 * 2**20
"""... and the partials would take more than 8 MiB."""
_FFT_TILE = 128 * 65 * 8
"""One complex64 spectrum of a 128x128 tile, real-to-complex (128 x 65)."""
_FEW_CHANNELS = 4
"""Inputs with fewer channels take engines without a forward workspace."""
_FP32_DIRECT_DATA = 8
"""fp32 stride-1 data gradients into at most this many channels take an engine without workspace."""
_WIDE_FP32_INPUT = 32
"""fp32 forwards with at least this many input channels skip the output's copy."""


def suggested_layout(a: Any, b: Any) -> torch.memory_format:
    """``cudnn_conv_suggest_memory_format(a, b)`` (aten/src/ATen/native/ConvUtils.h): channels-last
    where either tensor's strides suggest it (by ``b``'s rank: 4-D channels_last, 5-D channels_last_3d),
    else contiguous; ATen asks it with (input, weight), (grad_output, weight) and (input, grad_output).
    See Note [Which kernel runs a depthwise convolution]."""
    wanted = {4: torch.channels_last, 5: torch.channels_last_3d}.get(b.dim())
    if wanted is None or a.dtype == torch.float64 or b.dtype == torch.float64:
        return torch.contiguous_format
    return wanted if wanted in (suggest_memory_format(a), suggest_memory_format(b)) else torch.contiguous_format


class Direction(StrEnum):
    """The three cuDNN operations of a convolution, in the frame of the convolution itself."""

    FORWARD = "forward"
    DATA = "data gradient"
    WEIGHT = "weight gradient"


class Law(StrEnum):
    """Which family of engines a workspace is sized as (Note [cuDNN convolution workspaces])."""

    NONE = "none"
    """An engine (or ATen's native depthwise kernel) that needs no workspace."""
    CUDNN_DEPTHWISE = "cuDNN channels-last depthwise (not measured)"
    """A depthwise convolution ``use_cudnn_depthwise`` hands to cuDNN (channels-last): charged 0, as
    its operands need no layout transform, with the bound of the copies family (Note [Which kernel
    runs a depthwise convolution])."""
    SMALL = "1x1 gemm"
    """A 1x1 kernel's forward or data gradient: a few hundred bytes, charged as 0."""
    TRANSFORM = "layout transform"
    """NHWC copies of input, weight and output, channels padded to 16 bytes."""
    TRANSFORM_NO_OUTPUT = "layout transform without the output"
    """The fp32 forward of a wide input: the input and weight copies only."""
    GATHER = "strided 1x1 gather"
    """A strided 1x1 kernel: the gathered input and the output."""
    BATCH_SPLIT = "per-sample partials"
    """A 1x1 weight gradient: one fp32 partial weight gradient per sample."""
    PAIR = "input and output copies"
    """A 1x1 weight gradient whose copies of X and Y cost less than per-sample partials (small images)."""
    SPLIT = "layout transform + split-K (fitted)"
    """A weight gradient: the layout transform and split-K partials whose size is cuDNN's choice."""


@dataclass(frozen=True)
class ConvFrame:
    """A cuDNN convolution's sizes in its own frame: X (input, ``cx`` channels over ``sx``) to Y
    (output, ``cy`` over ``sy``); a transposed convolution is the convolution from its output to its
    input, run backwards. ``depthwise`` marks one ATen hands to its native kernels instead,
    ``cudnn_depthwise`` one it hands to cuDNN (Note [Which kernel runs a depthwise convolution])."""

    cx: int
    cy: int
    groups: int
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    sx: tuple[int, ...]
    sy: tuple[int, ...]
    itemsize: int
    depthwise: bool = False
    cudnn_depthwise: bool = False

    @classmethod
    def of(
        cls, inp: Any, weight: Any, stride: Sequence[Any], padding: Sequence[Any], transposed: bool, groups: int, out_spatial: Sequence[Any]
    ) -> ConvFrame:
        """The frame of ``aten.convolution(inp, weight, ...)`` whose output has ``out_spatial``."""
        ints = lambda xs: tuple(int(x) for x in xs)
        kernel, sin, sout = ints(weight.shape[2:]), ints(inp.shape[2:]), ints(out_spatial)
        per_channel = not transposed and groups > 1 and int(inp.shape[1]) == groups and int(weight.shape[0]) % groups == 0
        to_cudnn = per_channel and suggested_layout(inp, weight) != torch.contiguous_format
        if transposed:  # weight (Cin, Cout / groups, *k): the convolution from Cout channels to Cin
            cx, cy, sx, sy = int(weight.shape[1]) * groups, int(weight.shape[0]), sout, sin
        else:
            cx, cy, sx, sy = int(inp.shape[1]), int(weight.shape[0]), sin, sout
        native = per_channel and not to_cudnn
        return cls(cx, cy, int(groups), kernel, ints(stride), ints(padding), sx, sy, inp.element_size(), native, to_cudnn)

    @property
    def dims(self) -> int:
        return len(self.kernel)

    @property
    def pointwise(self) -> bool:
        """A 1x1 kernel without padding (strided or not)."""
        return all(k == 1 for k in self.kernel) and all(p == 0 for p in self.padding)

    @property
    def strided(self) -> bool:
        return any(s != 1 for s in self.stride)

    def _pad(self, channels: int) -> int:
        per_vector = max(1, 16 // self.itemsize)
        return -(-channels // per_vector) * per_vector

    def x(self, batch: int, padded: bool = False) -> int:
        return batch * (self._pad(self.cx) if padded else self.cx) * math.prod(self.sx) * self.itemsize

    def y(self, batch: int, padded: bool = False) -> int:
        return batch * (self._pad(self.cy) if padded else self.cy) * math.prod(self.sy) * self.itemsize

    def w(self, padded: bool = False, itemsize: int | None = None) -> int:
        """The weight's bytes (in ``itemsize`` bytes an element where given: 4 for fp32 partial sums)."""
        per_group = self.cx // self.groups
        rows, cols = (self._pad(self.cy), self._pad(per_group)) if padded else (self.cy, per_group)
        return rows * cols * math.prod(self.kernel) * (itemsize or self.itemsize)


@dataclass(frozen=True)
class ConvWorkspace:
    """One cuDNN operation's workspace: what fxmem charges and the most it could be.

    ``estimate`` is the workspace the rules of this module charge to the timeline, in bytes.
    ``bound`` (>= estimate) is the largest workspace any engine family seen on the H200 would ask for
    at these sizes (Note [cuDNN convolution workspaces]): an engineering bound, not a guarantee, since
    cuDNN may rank an unseen engine first. ``law`` names the family the estimate follows; ``exact``
    says whether that family's size is a law that matched the measurements to the byte (it is False
    where a part is fitted: split-K partials, 1x1 kernels' few hundred bytes or per-sample partials).
    """

    direction: Direction
    law: Law
    estimate: int
    bound: int

    @property
    def exact(self) -> bool:
        return self.law in (Law.NONE, Law.TRANSFORM, Law.TRANSFORM_NO_OUTPUT, Law.GATHER)


def _forward_law(f: ConvFrame) -> Law:
    """The engine family of the convolution's forward (Note [cuDNN convolution workspaces])."""
    if f.pointwise:
        return Law.GATHER if f.strided else Law.SMALL
    if f.cx < _FEW_CHANNELS:
        return Law.NONE
    if f.itemsize >= 4 and f.cx >= _WIDE_FP32_INPUT:
        return Law.TRANSFORM_NO_OUTPUT
    return Law.TRANSFORM


def _data_law(f: ConvFrame) -> Law:
    """The engine family of the data gradient (Y to X)."""
    if f.pointwise:
        return Law.GATHER if f.strided else Law.SMALL
    if f.itemsize >= 4:
        direct = (not f.strided and f.cx <= _FP32_DIRECT_DATA) or (f.dims == 2 and f.cx < _FEW_CHANNELS)
        return Law.NONE if direct else Law.TRANSFORM
    return Law.NONE if f.strided and f.cx == 1 else Law.TRANSFORM


def _weight_law(f: ConvFrame) -> Law:
    """The engine family of the weight gradient."""
    if f.pointwise and f.strided:
        return Law.GATHER
    if f.pointwise and (f.dims == 2 or f.itemsize >= 4):
        return Law.BATCH_SPLIT
    return Law.SPLIT


_LAWS: dict[Direction, Callable[[ConvFrame], Law]] = {
    Direction.FORWARD: _forward_law,
    Direction.DATA: _data_law,
    Direction.WEIGHT: _weight_law,
}


def _copies_instead(f: ConvFrame, batch: int) -> bool:
    """Whether a 1x1 weight gradient copies X and Y rather than keep per-sample partials: where the
    partials would pass ``_PARTIALS_UP_TO`` and the copies cost under 1 / ``_PAIR_SHARE`` of them."""
    partials = batch * f.w(itemsize=4)
    return partials > _PARTIALS_UP_TO and _PAIR_SHARE * (f.x(batch) + f.y(batch)) < partials


def _transform(f: ConvFrame, batch: int, direction: Direction) -> int:
    """Padded NHWC copies of X, W and Y and the trailer: the layout-transform family."""
    if direction != Direction.DATA:
        return f.x(batch, True) + f.w(True) + f.y(batch, True) + _TRAILER
    return f.x(batch, True) + f.w(True) + f.y(batch, True) + _data_trailer(f) * f.groups


def _data_trailer(f: ConvFrame) -> int:
    """The data gradient's trailer: fp32 strided 3-D and strided 1x1 engines add 131 bytes to the 16."""
    return _STRIDED_DATA_TRAILER if f.itemsize >= 4 and f.strided and (f.dims == 3 or f.pointwise) else _TRAILER


def _weight_transform(f: ConvFrame, batch: int) -> int:
    """The weight gradient's copies: padded in 16-bit types, as they are in fp32."""
    padded = f.itemsize < 4
    return f.x(batch, padded) + f.y(batch, padded) + f.w(padded) + _TRAILER


def _fft(f: ConvFrame, batch: int) -> int:
    """The FFT engine seen for fp32 5x5 2-D weight gradients: 2 * Cin * Cout tile spectra and Y."""
    applies = f.itemsize >= 4 and f.dims == 2 and min(f.kernel) >= 5 and not f.strided and f.groups == 1
    return 2 * f.cx * f.cy * _FFT_TILE + f.y(batch) if applies else 0


def _estimate(f: ConvFrame, law: Law, direction: Direction, batch: int) -> int:
    """The bytes ``law`` asks for at ``batch``."""
    if law in (Law.NONE, Law.SMALL, Law.CUDNN_DEPTHWISE):
        return 0
    if law == Law.GATHER:
        trailers = {Direction.FORWARD: _TRAILER, Direction.DATA: _data_trailer(f), Direction.WEIGHT: _GATHER_WEIGHT_TRAILER}
        return f.x(batch) + f.y(batch) + trailers[direction]
    if law == Law.TRANSFORM_NO_OUTPUT:
        return f.x(batch, True) + f.w(True) + _TRAILER
    if law == Law.BATCH_SPLIT:
        return batch * f.w(itemsize=4)
    if law == Law.PAIR:
        return f.x(batch) + f.y(batch) + _TRAILER
    if law == Law.SPLIT:
        return _weight_transform(f, batch) + _SPLIT_MEDIAN[4 if f.itemsize >= 4 else 2, 3 if f.dims >= 3 else 2]
    return _transform(f, batch, direction)


def _bound(f: ConvFrame, law: Law, direction: Direction, batch: int) -> int:
    """The most any family seen for such a convolution would ask for (Note [cuDNN convolution workspaces])."""
    if f.depthwise:
        return 0
    copies = max(_transform(f, batch, Direction.DATA), _weight_transform(f, batch), f.x(batch) + f.y(batch) + _GATHER_WEIGHT_TRAILER)
    if direction == Direction.WEIGHT:
        copies = max(copies, batch * f.w(itemsize=4), _fft(f, batch))
    return copies + _SPLIT_ALLOWANCE


def conv_workspace(frame: ConvFrame, direction: Direction, batch: int) -> ConvWorkspace:
    """The workspace cuDNN asks for to run ``direction`` of ``frame`` at ``batch``, with its bound.

    MONAI's last 3-D U-Net layer (2 -> 2 channels, 3x3x3 at 64^3) under bf16 autocast, at B = 2: its
    data gradient copies dY and dX with 8 channels each, and the weight padded to 8 x 8:

    >>> f = ConvFrame(2, 2, 1, (3, 3, 3), (1, 1, 1), (1, 1, 1), (64, 64, 64), (64, 64, 64), itemsize=2)
    >>> w = conv_workspace(f, Direction.DATA, 2)
    >>> (str(w.law), w.estimate, w.estimate == 2 * (2 * 8 * 64**3 * 2) + 8 * 8 * 27 * 2 + 16, w.exact)
    ('layout transform', 16780688, True, True)
    """
    law = Law.NONE if frame.depthwise else Law.CUDNN_DEPTHWISE if frame.cudnn_depthwise else _LAWS[direction](frame)
    if law == Law.BATCH_SPLIT and _copies_instead(frame, batch):
        law = Law.PAIR
    estimate = _estimate(frame, law, direction, batch)
    return ConvWorkspace(direction, law, estimate, max(estimate, _bound(frame, law, direction, batch)))


def _frame(args: Sequence[Any], *, backward: bool, out_spatial: Sequence[Any] | None = None) -> tuple[ConvFrame, bool]:
    """The frame of an ``aten.convolution`` (or ``convolution_backward``) call, and whether it is transposed."""
    if backward:
        grad_output, inp, weight, _bias, stride, padding, _dilation, transposed, _out_pad, groups = args[:10]
        return ConvFrame.of(inp, weight, stride, padding, bool(transposed), int(groups), grad_output.shape[2:]), bool(transposed)
    inp, weight, _bias, stride, padding, _dilation, transposed, _out_pad, groups = args[:9]
    spatial = _output_spatial(inp, weight, args) if out_spatial is None else out_spatial
    return ConvFrame.of(inp, weight, stride, padding, bool(transposed), int(groups), spatial), bool(transposed)


def _output_spatial(inp: Any, weight: Any, args: Sequence[Any]) -> tuple[int, ...]:
    """A forward call's output sizes, by ATen's formula (``conv_output_size`` / ``conv_input_size``)."""
    _inp, _w, _b, stride, padding, dilation, transposed, output_padding, _groups = args[:9]
    sizes = []
    for i, k, s, p, d, op in zip(inp.shape[2:], weight.shape[2:], stride, padding, dilation, output_padding):
        span = int(d) * (int(k) - 1)
        sizes.append(
            (int(i) - 1) * int(s) - 2 * int(p) + span + int(op) + 1 if transposed else (int(i) + 2 * int(p) - span - 1) // int(s) + 1
        )
    return tuple(sizes)


def _directions(args: Sequence[Any], *, backward: bool, transposed: bool) -> tuple[Direction, ...]:
    """The cuDNN operations one ATen call runs, in order."""
    if not backward:
        return (Direction.DATA,) if transposed else (Direction.FORWARD,)
    mask = args[10]
    first = (Direction.FORWARD if transposed else Direction.DATA,) if mask[0] else ()
    return first + ((Direction.WEIGHT,) if mask[1] else ())


def convolution_workspaces(args: Sequence[Any], *, backward: bool, batch: int | None = None) -> tuple[ConvWorkspace, ...]:
    """The cuDNN workspaces of one ATen call, one per operation it runs, in order.

    ``args`` are an ``aten.convolution`` call's (``backward=False``) or an ``aten.convolution_backward``
    call's (``backward=True``) arguments, on real, fake or meta tensors; ``batch`` overrides their
    batch size (the default; it must then be concrete). Each ``ConvWorkspace`` has the ``estimate``
    fxmem's timeline charges and the ``bound`` a report shows as "cuDNN convolution workspace:
    estimated X, at most Y" (an NCHW fp32 or bf16 depthwise convolution, which ATen runs without cuDNN,
    gives ``estimate == bound == 0``: Note [Which kernel runs a depthwise convolution]). The grad_output
    copy a backward may make is not a workspace and is not included (the workspace rule charges it).
    """
    frame, transposed = _frame(args, backward=backward)
    b = int(args[1].shape[0] if backward else args[0].shape[0]) if batch is None else batch
    return tuple(conv_workspace(frame, d, b) for d in _directions(args, backward=backward, transposed=transposed))


def _nbytes(t: Any) -> int:
    return int(t.numel()) * t.element_size() if isinstance(t, torch.Tensor) else 0


def cudnn_convolution_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The forward's cuDNN workspace, alive with its output. See Note [cuDNN convolution workspaces]."""
    frame, transposed = _frame(args, backward=False, out_spatial=out.shape[2:])
    if frame.depthwise or statically_known_true(args[0].numel() == 0):
        return 0
    direction = Direction.DATA if transposed else Direction.FORWARD
    found = highest(args[0].shape[0], lambda b, _regime: [conv_workspace(frame, direction, b).estimate])
    return Estimated(found, WorkspaceBound(CUDNN_CONV_WORKSPACE, lambda b: conv_workspace(frame, direction, b).bound))


def _per_sample(t: Any) -> int:
    """The bytes of one sample of ``t`` (its first dimension the batch)."""
    return math.prod(int(n) for n in t.shape[1:]) * t.element_size()


def _copy_in(t: Any, layout: torch.memory_format) -> bool:
    """Whether ``t.contiguous(layout)`` copies ``t``."""
    return not is_contiguous_for_memory_format_or_false(t, memory_format=layout)


@dataclass(frozen=True)
class _Copies:
    """What the backward copies besides its workspaces: per sample for the first cuDNN part (or ATen's
    native depthwise kernel) and for the weight gradient's part, and the weight's fixed bytes copied
    for the data gradient (Note [Which kernel runs a depthwise convolution])."""

    first: int
    weight_part: int
    weight: int = 0


def _backward_copies(grad_output: Any, inp: Any, weight: Any, frame: ConvFrame, transposed: bool) -> _Copies:
    """The copies ``convolution_backward`` makes for ``frame``: the native depthwise kernel one NCHW
    grad_output copy for both gradients; a transposed cuDNN backward one for both (as measured);
    cuDNN's data gradient grad_output (and the weight) in ``suggested_layout(grad_output, weight)``,
    its weight gradient grad_output and the input in ``suggested_layout(input, grad_output)`` (ConvShared.cpp)."""
    if frame.depthwise or transposed:
        copy = _per_sample(grad_output) if not is_contiguous_or_false(grad_output) else 0
        return _Copies(copy, copy)
    data, wgrad = suggested_layout(grad_output, weight), suggested_layout(inp, grad_output)
    first = _per_sample(grad_output) if _copy_in(grad_output, data) else 0
    second = (_per_sample(grad_output) if _copy_in(grad_output, wgrad) else 0) + (_per_sample(inp) if _copy_in(inp, wgrad) else 0)
    return _Copies(first, second, _nbytes(weight) if _copy_in(weight, data) else 0)


def cudnn_convolution_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The backward's high mark above its outputs: each cuDNN part's workspace, with the grad_output
    copy it makes, and less the outputs made after it. See Note [cuDNN convolution workspaces] and
    Note [Which kernel runs a depthwise convolution]."""
    grad_output, inp, weight, mask = args[0], args[1], args[2], args[10]
    frame, transposed = _frame(args, backward=True)
    if not (mask[0] or mask[1]) or statically_known_true(inp.numel() == 0):
        return 0
    copies = _backward_copies(grad_output, inp, weight, frame, transposed)
    later_weight = _nbytes(weight) if mask[1] else 0  # the weight gradient, made after the data gradient's part
    bias = _nbytes(out[2]) if len(mask) > 2 and mask[2] else 0  # the bias gradient, made last

    def marks(batch: int, _regime: int, size: Callable[[ConvWorkspace], int] = lambda w: w.estimate) -> list[int]:
        if frame.depthwise:  # ATen's native kernel: the copy alone, with both gradients made
            return [0, batch * copies.first - bias]
        found = [0]
        if mask[0]:
            first = size(conv_workspace(frame, Direction.FORWARD if transposed else Direction.DATA, batch))
            found.append(batch * copies.first + copies.weight + first - later_weight - bias)
        if mask[1]:
            found.append(batch * copies.weight_part + size(conv_workspace(frame, Direction.WEIGHT, batch)) - bias)
        return found

    found = highest(inp.shape[0], marks)
    if frame.depthwise:
        return found
    return Estimated(found, WorkspaceBound(CUDNN_CONV_WORKSPACE, lambda b: max(marks(b, b, lambda w: w.bound))))
