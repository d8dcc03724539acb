"""The key/value cache a Hugging Face model builds in a training forward, held as the user's loop holds it.

Note [The cache a training forward builds]
    With ``use_cache=True`` in its config (the default of most pretrained configs) and no activation
    checkpointing, a transformers 5 decoder builds a cache in every forward, training included:
    ``LlamaModel.forward`` (transformers 5.25, models/llama/modeling_llama.py) makes
    ``DynamicCache(config=self.config)`` when ``use_cache and cache is None``, and each attention
    layer calls ``cache.update(key_states, value_states, layer_idx)``, whose ``DynamicLayer.update``
    (cache_utils.py) starts from ``torch.tensor([])`` and stores ``torch.cat([self.keys, key_states],
    dim=-2)``: a copy of K and V per layer, B x kv_heads x S x head_dim each in the model's dtype,
    which attention then reads in place of the originals. The cache is returned in the output, which
    the loop holds through backward: for a 3B Llama (28 layers, 8 KV heads of 128) in bf16 at B=4,
    28 x 2 x 8 x 128 x 2 B x 4 = 0.46 MB per token. Under activation checkpointing
    ``GradientCheckpointingLayer.__call__`` (modeling_layers.py) sets ``use_cache=False`` in training,
    so nothing is built there.

    torch.export cannot return a ``Cache`` ("Found DynamicCache in output"), and a graph that returned
    each layer's tensors could not be deepened from its 3- and 4-block copies (its outputs would
    count the blocks: Note [An exported graph deepened from its copy] in deepen.py). So while
    exporting, the ``torch.cat`` of transformers' cache module is ``fxmem::cache_cat``, a custom op
    that concatenates as ``torch.cat`` does (its legacy empty 1-D operand dropped, as ``cat`` drops
    it) and, in a simulated step, hands its result to the step to hold (``holding_caches``), as the
    loop's ``out`` holds the cache: each layer's op is in that layer's block, and the cache itself is
    left out of the exported output. The report's "Code path" line says so, with the way to drop it
    (``use_cache=False``), which saves those bytes whenever the loop does not use the cache.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from unittest import mock

import torch

from fxmem.rules.ledger import note_code_path

__all__ = ["cache_cats_as_ops", "holding_caches", "without_caches"]

_HELD: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar("fxmem_held_caches", default=None)


@torch.library.custom_op("fxmem::cache_cat", mutates_args=())
def cache_cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(tensors, dim)`` as a transformers cache layer stores it: Note [The cache a training forward builds]."""
    return torch.cat(tensors, dim)


@cache_cat.register_fake
def _(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    out = torch.cat(tensors, dim)
    held = _HELD.get()
    if held is not None:
        held.append(out)
    return out


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    tensors, dim = inputs
    ctx.dim, ctx.sizes = dim, [t.size(dim) for t in tensors]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[list[torch.Tensor], None]:
    """As ``CatBackward0`` (``cat_tensors_backward``): each input's gradient a slice of the output's, a view."""
    return list(grad.split(ctx.sizes, ctx.dim)), None


cache_cat.register_autograd(_backward, setup_context=_setup)


@contextlib.contextmanager
def holding_caches() -> Iterator[list[torch.Tensor]]:
    """While open, every cache a simulated forward builds (``fxmem::cache_cat``) is kept in the list
    yielded, for the step to drop where the loop drops its output."""
    held: list[torch.Tensor] = []
    token = _HELD.set(held)
    try:
        yield held
    finally:
        _HELD.reset(token)


class _TorchWithCacheCat:
    """The ``torch`` module as transformers' cache module sees it while exporting: ``cat`` is fxmem's op."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def cat(tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        kept = [t for t in tensors if not (t.dim() == 1 and t.numel() == 0)]  # cat skips the legacy empty tensor
        return torch.ops.fxmem.cache_cat(kept, dim)


@contextlib.contextmanager
def cache_cats_as_ops() -> Iterator[None]:
    """transformers' cache layers concatenating through ``fxmem::cache_cat`` while open (a no-op where
    transformers' cache module is not imported)."""
    module = sys.modules.get("transformers.cache_utils")
    if module is None or getattr(module, "torch", None) is not torch:
        yield
        return
    with mock.patch.object(module, "torch", _TorchWithCacheCat()):
        yield


def without_caches(out: Any) -> Any:
    """``out`` with every transformers ``Cache`` in it (at its top level, or as a field of a
    ``ModelOutput``) replaced by None: Note [The cache a training forward builds]."""
    base = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    if not isinstance(base, type):
        return out
    if isinstance(out, base):
        return _dropped(out)
    if isinstance(out, Mapping):
        for key, value in list(out.items()):
            if isinstance(value, base):
                out[key] = _dropped(value)  # type: ignore[index]
    elif type(out) is tuple:
        return tuple(_dropped(v) if isinstance(v, base) else v for v in out)
    return out


def _dropped(cache: Any) -> None:
    note_code_path(
        f"transformers built a {type(cache).__name__} in the training forward (use_cache=True in the config): every layer's "
        "keys and values are held with the output through the step; set use_cache=False (--config use_cache=false) if your "
        "loop does not use them"
    )
    return None
