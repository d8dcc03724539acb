"""Normalization statistics as CUDA keeps them, where the CPU's fake kernels keep them otherwise.

Note [Batch-norm statistics on CUDA]
    CUDA's batch norm makes its per-channel ``save_mean`` and ``save_invstd`` (outputs 1 and 2, both
    saved for backward) in the accumulate type of its input: float32 for float16 and bfloat16 inputs
    (``batch_norm_cuda`` in aten/src/ATen/native/cuda/Normalization.cu, ``toAccumulateType(...,
    /*is_cuda=*/true)``; cuDNN's batch norm, which takes fp16 but not bf16 inputs, keeps float
    statistics as well). The fake CPU kernel makes them in the input's dtype, half the bytes. Under
    autocast every batch norm takes a bf16 input (the convolution before it ran in bf16), so each
    layer's statistics were 2 bytes a channel short: ResNet-50's 26,560 channels 106,240 B, and an
    instance norm, which is a batch norm over (1, B*C, ...), 2 bytes per channel per sample (MONAI's
    3-D U-Net 2,312 B a sample). Measured on an H200 (torch 2.11, shared/gpu/steps_h200.json:
    NativeBatchNormBackward0 keeps 212,480 B of fp32 statistics for ResNet-50 in bf16 as in fp32).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fxmem.rules.registries import register_op_rule

__all__ = ["batch_norm_statistics"]

_HALF = (torch.float16, torch.bfloat16)
_BATCH_NORMS = (
    "aten.native_batch_norm",
    "aten._native_batch_norm_legit",
    "aten._native_batch_norm_legit_functional",
    "aten._batch_norm_with_update",
    "aten._batch_norm_with_update_functional",
)
"""The batch-norm ops a training pass can reach; each returns (output, save_mean, save_invstd, ...)."""


@register_op_rule(*((op, "cuda") for op in _BATCH_NORMS))
def batch_norm_statistics(args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> dict[int, object]:
    """float32 statistics for a half-precision input. See Note [Batch-norm statistics on CUDA]."""
    if args[0].dtype not in _HALF:
        return {}
    return {i: out[i].numel() * 4 for i in (1, 2) if out[i].dtype in _HALF}
