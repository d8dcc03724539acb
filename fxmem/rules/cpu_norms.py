"""Buffers the CPU's normalization kernels allocate and free inside one op, which no fake kernel shows.

Note [CPU group norm buffers]
    The CPU's group norm (aten/src/ATen/native/cpu/group_norm_kernel.cpp) makes, besides its outputs,
    float scratch in its input's accumulate type (float64 for float64 inputs, float32 for float32,
    bfloat16 and float16 ones, whatever the weight's dtype), all of it freed before the op returns:

    - backward, every layout: per-sample, per-channel sums ``ds`` and ``db``, two buffers of N x C,
      whichever gradients are asked for;
    - forward, contiguous input: none;
    - forward, channels-last input (4-D or 5-D, the layout ``suggest_memory_format`` names): with
      fewer than 1024 positions per channel (HxW, the kernel's ``feature_map_threshold``), a scale
      and shift per channel, N x 2C; from 1024 positions, per-thread sums of x and x² (T x N x 2C,
      T = at::get_num_threads()) and per-group statistics (N x 2G).

    Measured with the profiler on torch 2.13 (the op's allocations less its outputs): 120 shapes of
    1-D, 2-D and 3-D inputs, contiguous and channels last, groups 1, C and between, 1 to 1600
    positions per channel (1023 and 1024 at the threshold), float32, float64 and bfloat16, 1 and 2
    threads; float16 and bfloat16 inputs with float32 weights (tests/test_cpu_norms.py). Exact on
    every one. A fuzzed GroupNorm(1, 3) over (B, 3, 1) peaked in its backward 72 bytes (ds and db at
    B=3: 2 x 3 x 3 x 4) above fxmem without the backward's buffers. A channels-last input with a
    symbolic number of positions leaves the forward's branch open: that case is not described (0).

Note [CPU batch norm backward buffers]
    The CPU's batch norm backward (native_batch_norm_backward; batch_norm_backward_cpu_template in
    aten/src/ATen/native/Normalization.cpp and cpu/batch_norm_kernel.cpp) takes one of two paths:

    - its fused kernel, where the input and the incoming gradient are both dense in the input's
      suggested layout (contiguous, or channels last for both): computing the input's gradient it
      makes a buffer of the input's size; without it, none on contiguous tensors, and on channels-last
      ones (2T + [no weight] + [eval mode]) x C values (T = at::get_num_threads());
    - otherwise (a sum's expanded gradient, a transposed one, layouts that differ), TensorIterator
      reductions that keep C values.

    Values are in the accumulate type (float32 for float32, float64 for float64); all of it dies with
    the op. Measured with the profiler on torch 2.13 (the op's allocations less its outputs; 1-D,
    2-D, 3-D inputs, 1 to 16 channels, every output mask, with and without a weight, train and eval,
    1 and 2 threads): exact for float32 and float64 (tests/test_cpu_norms.py). bfloat16 inputs copy
    more on some layouts (a transposed gradient over a channels-last input: the input's size twice
    over): reduced precision is not described (0). A fuzzed Linear -> BatchNorm3d(1) -> ReLU peaked in
    this backward 72 bytes above fxmem (the input-sized buffer, 3 x 6 floats at B=3); a Linear ->
    BatchNorm2d(2) -> ReLU on (B, 2, 5, 4) 720 bytes (16%).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch._prims_common import suggest_memory_format

from fxmem.rules.registries import register_workspace_rule

__all__ = ["cpu_batch_norm_backward_workspace", "cpu_group_norm_backward_workspace", "cpu_group_norm_workspace"]

_FEATURE_MAP_THRESHOLD = 1024
"""Positions per channel from which the channels-last forward sums per thread. See Note [CPU group norm buffers]."""


def _accumulate_size(t: Any) -> int:
    """Bytes of one element of the kernel's accumulate type: float64 stays, the rest sum in float32."""
    return 8 if t.dtype == torch.float64 else 4


def cpu_group_norm_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The channels-last forward's scale and shift, or its per-thread sums. See Note [CPU group norm buffers]."""
    inp, n, c, hxw, groups = args[0], args[3], args[4], args[5], args[6]
    if inp.dim() not in (4, 5) or suggest_memory_format(inp) == torch.contiguous_format:
        return 0
    if not isinstance(hxw, int):
        return 0  # the branch depends on the positions per channel
    if hxw < _FEATURE_MAP_THRESHOLD:
        return n * 2 * c * _accumulate_size(inp)
    return (torch.get_num_threads() * n * 2 * c + n * 2 * groups) * _accumulate_size(inp)


def cpu_group_norm_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The per-sample, per-channel sums ds and db. See Note [CPU group norm buffers]."""
    inp, n, c = args[1], args[5], args[6]
    return 2 * n * c * _accumulate_size(inp)


def _fused_batch_norm_backward(grad_out: Any, inp: Any) -> torch.memory_format | None:
    """The layout the fused kernel runs in, or None where the input and gradient are not both dense in it."""
    layout = suggest_memory_format(inp) if inp.dim() in (4, 5) else torch.contiguous_format
    return layout if inp.is_contiguous(memory_format=layout) and grad_out.is_contiguous(memory_format=layout) else None


def cpu_batch_norm_backward_workspace(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> object:
    """The fused kernel's buffers, or the reductions' per-channel values. See Note [CPU batch norm backward buffers]."""
    grad_out, inp, weight, train = args[0], args[1], args[2], args[7]
    output_mask = args[9] if len(args) > 9 else kwargs.get("output_mask", [True, True, True])
    if inp.dtype not in (torch.float32, torch.float64) or grad_out.dtype != inp.dtype:
        return 0  # reduced precision: not described
    values = inp.shape[1] * _accumulate_size(inp)
    layout = _fused_batch_norm_backward(grad_out, inp)
    if layout is None:
        return values
    if output_mask[0]:
        return inp.numel() * inp.element_size()
    if layout == torch.contiguous_format:
        return 0
    return (2 * torch.get_num_threads() + (weight is None) + (not train)) * values


register_workspace_rule(("aten.native_batch_norm_backward", "cpu"))(cpu_batch_norm_backward_workspace)
register_workspace_rule(("aten.native_group_norm", "cpu"))(cpu_group_norm_workspace)
register_workspace_rule(("aten.native_group_norm_backward", "cpu"))(cpu_group_norm_backward_workspace)
