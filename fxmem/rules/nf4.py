"""4-bit NF4 weights as QLoRA stores them: bitsandbytes' ``Linear4bit`` (transformers'
``BitsAndBytesConfig(load_in_4bit=True)``, peft's LoRA on top) and torchao's ``NF4Tensor`` (torchtune).

What a step holds for them is three things: the weight as stored (Note [What a 4-bit weight holds],
here), a dequantized copy made and dropped around each matmul, forward and backward, and nothing saved
for backward but the stored weight itself (fxmem/rules/nf4_ops.py, the ops that trace them so).
bitsandbytes and torchao enter fxmem through these two modules alone, and only once the user's code
has imported them (``sys.modules``).

Note [What a 4-bit weight holds]
    bitsandbytes 0.50 (functional.py ``quantize_4bit``; nn/modules.py ``Params4bit._quantize``): the
    parameter is the packed codes, two 4-bit indices a byte, ``ceil(n / 2)`` uint8 as ``(n/2, 1)``
    (``_ops.py``, the ``quantize_4bit`` fake kernel), and its ``quant_state`` (a ``QuantState``, no
    parameter nor buffer) holds per block of ``blocksize`` (64) values an absmax: fp32 (``ceil(n /
    64)`` x 4 bytes), or with ``compress_statistics`` (``bnb_4bit_use_double_quant``) those absmaxes
    less their mean quantized once more (``quantize_blockwise(absmax - offset, blocksize=256)``): a
    uint8 per block, an fp32 absmax per 256 blocks, the 256-entry fp32 dynamic map (``state2.code``,
    each layer's own copy of ``name2qmap["dynamic"]``: ``code.to(A.device, copy=True)`` in
    ``quantize_blockwise``) and the fp32 mean (``offset``, 0-d). ``quant_state.code`` is the
    16-entry fp32 NF4 table, one per layer (``get_4bit_type`` builds a new tensor each call). For a
    4096 x 4096 weight: 8,388,608 B of codes; 262,144 blocks: 262,144 B of uint8 absmax; 1,024
    blocks of 256: 4,096 B; plus 1,024 + 4 + 64 B (tests/test_qlora.py).
    torchao's ``NF4Tensor`` (torchao 0.18, quantization/quantize_/workflows/nf4/nf4_tensor.py,
    ``from_tensor``) is a wrapper subclass, which owns no storage (its ``untyped_storage()`` reports
    the logical weight's bytes, allocated nowhere), whose inner tensors are the same packed codes
    (``n / 2`` uint8), int8 quantized scalers (one a block of ``block_size``), a per-256-scaler factor
    in the weight's dtype, the mean (0-d, the weight's dtype) and the NF4 table (16 of the weight's
    dtype). ``state_bytes`` counts these as the weight's bytes (a frozen weight) and the logical
    ``n`` as its parameters; the simulated step (fxmem/step/timeline.py) and ``measure_peak`` start
    with the same tensors held.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = [
    "bitsandbytes",
    "fake_quantized",
    "nf4_tensor_type",
    "quant_state",
    "quant_state_tensors",
    "quantized_format",
    "quantized_parameter_count",
    "quantized_state_tensors",
    "quantized_weight_bytes",
    "stored_tensors",
]


def bitsandbytes() -> Any:
    """bitsandbytes if the user's code imported it (a 4-bit model cannot exist otherwise), else None."""
    return sys.modules.get("bitsandbytes")


def nf4_tensor_type() -> type | None:
    """torchao's ``NF4Tensor`` if torchao's quantization package is imported, else None."""
    module = sys.modules.get("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    found = getattr(module, "NF4Tensor", None)
    return found if isinstance(found, type) else None


def quant_state(t: torch.Tensor) -> Any:
    """A bitsandbytes ``Params4bit``'s ``QuantState``, or None for any other tensor."""
    bnb = bitsandbytes()
    params4bit = getattr(getattr(bnb, "nn", None), "Params4bit", None)
    if not (isinstance(params4bit, type) and isinstance(t, params4bit)):
        return None
    return getattr(t, "quant_state", None)


def quant_state_tensors(state: Any) -> list[torch.Tensor]:
    """The tensors a ``QuantState`` holds (absmax, code, offset, and its nested state's). See Note [What a 4-bit weight holds]."""
    found = [getattr(state, name, None) for name in ("absmax", "code", "offset")]
    nested = getattr(state, "state2", None)
    if nested is not None:
        found += quant_state_tensors(nested)
    return [t for t in found if isinstance(t, torch.Tensor)]


def _inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a 4-bit weight is stored in, the codes included; [] for any other tensor."""
    state = quant_state(t)
    if state is not None:
        return [t, *quant_state_tensors(state)]
    nf4 = nf4_tensor_type()
    if nf4 is not None and isinstance(t, nf4):
        names, _ = t.__tensor_flatten__()
        return [getattr(t, name) for name in names]
    return []


def quantized_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors the ``QuantState`` of each bitsandbytes 4-bit weight of ``model`` holds beside the
    parameter (scales, tables; the graph's constants once exported), each storage once (a state
    loaded or copied by other code may share one). See Note [What a 4-bit weight holds]."""
    seen: dict[StorageWeakRef, torch.Tensor] = {}
    for p in model.parameters():
        state = quant_state(p)
        for t in quant_state_tensors(state) if state is not None else ():
            seen.setdefault(StorageWeakRef(t.untyped_storage()), t)
    return list(seen.values())


def quantized_weight_bytes(p: torch.Tensor, counted: set[StorageWeakRef] | None = None) -> int | None:
    """The bytes that hold the 4-bit weight ``p`` (None if ``p`` is not one), each storage once
    across calls that share ``counted``. See Note [What a 4-bit weight holds]; tests/test_qlora.py
    works one 4096 x 4096 layer out by hand."""
    inner = _inner_tensors(p)
    if not inner:
        return None
    counted = set() if counted is None else counted
    total = 0
    for t in inner:
        key = StorageWeakRef(t.untyped_storage())
        if key not in counted:
            counted.add(key)
            total += t.untyped_storage().nbytes()
    return total


def quantized_format(p: torch.Tensor) -> str | None:
    """The 4-bit format ``p`` is stored in ("nf4", "fp4"), or None if it is not a 4-bit weight."""
    state = quant_state(p)
    if state is not None:
        return str(state.quant_type)
    nf4 = nf4_tensor_type()
    return "nf4" if nf4 is not None and isinstance(p, nf4) else None


def quantized_parameter_count(p: torch.Tensor) -> int:
    """The number of weights ``p`` stands for: a bitsandbytes 4-bit weight's original shape, two a byte
    of its codes; ``p.numel()`` for any other tensor (an ``NF4Tensor`` has its original shape)."""
    state = quant_state(p)
    return math.prod(state.shape) if state is not None and state.shape is not None else p.numel()


def fake_quantized(mode: Any, t: torch.Tensor) -> torch.Tensor | None:
    """A fake copy of ``t`` in ``mode`` that keeps its inner tensors, where ``t`` is an ``NF4Tensor`` (a
    Parameter stays one); None for any other tensor. See Note [torchao's NF4 linear in a graph] in
    fxmem/rules/nf4_ops.py."""
    nf4 = nf4_tensor_type()
    if nf4 is None or not isinstance(t, nf4):
        return None
    names, meta = t.__tensor_flatten__()
    with mode:  # empty copies, not ``mode.from_tensor``, whose memo would keep a weakref that stops ``model.to()`` swapping ``t``
        inner = {name: torch.empty_strided(part.shape, part.stride(), dtype=part.dtype) for name, part in _parts(t, names)}
    fake = nf4.__tensor_unflatten__(inner, meta, t.shape, t.stride())
    return nn.Parameter(fake, requires_grad=False) if isinstance(t, nn.Parameter) else fake


def _parts(t: torch.Tensor, names: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
    return ((name, getattr(t, name)) for name in names)


def stored_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose storages hold ``t``: a 4-bit weight's codes, scales and tables (an ``NF4Tensor``
    owns no storage of its own), ``[t]`` for any other tensor. See Note [What a 4-bit weight holds]."""
    return _inner_tensors(t) or [t]
