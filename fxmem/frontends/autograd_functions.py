"""A model's own ``torch.autograd.Function``s kept whole in an exported graph, so the step saves what their ``ctx`` saves.

Note [A custom autograd.Function in an exported graph]
    A custom ``torch.autograd.Function`` decides for itself what backward needs: LoHa's ``HadaWeight``
    (peft 0.21, tuners/loha/layer.py) computes ``((w1a @ w1b) * (w2a @ w2b)) * scale`` and keeps only
    its four factors (``ctx.save_for_backward(w1a, w1b, w2a, w2b, scale)``, all parameters), recomputing
    the products in backward; RandLoRA's ``UniqueBaseGrad`` and C3A's ``BlockCircularConvolution`` do
    the same to save memory. Non-strict torch.export traces through ``forward`` and keeps no Function:
    the graph holds the forward's ATen ops, and replayed, each saves what its own derivative formula
    saves (both products of ``HadaWeight``, out x in each), and backward is autograd's, not the
    Function's. A LoHa step came out 98 KB (38%) high on the tiny Llama of tests/test_peft_methods.py.

    torch.export has an experimental way to keep a Function whole: ``apply`` decorated with
    ``torch._export.wrappers.allow_in_pre_dispatch_graph`` is recorded as one ``flat_apply`` node that
    calls ``torch.export.custom_ops._call_custom_autograd_function_in_pre_dispatch``, which imports the
    class by its name and calls ``apply`` again. While exporting, every Function's ``apply`` goes through
    that decorator where the class is outside torch (torch's own, such as reentrant checkpointing, are
    handled elsewhere: Note [Checkpointed regions]), importable by ``module.qualname`` (what the node
    calls), and called with arguments a graph can hold; any other keeps the traced forward. The replayed
    step then runs the Function itself on fake tensors: the tensors its ``ctx`` saves, its forward's
    temporaries and its own backward, as the eager step does.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["functions_kept_whole"]


@contextlib.contextmanager
def functions_kept_whole() -> Iterator[None]:
    """While open, a custom Function's ``apply`` is one node of torch.export's graph (Note [A custom
    autograd.Function in an exported graph]); nothing changes where torch lacks the mechanism."""
    try:
        from torch._export.wrappers import allow_in_pre_dispatch_graph
        from torch._higher_order_ops.flat_apply import is_graphable
    except ImportError:
        yield
        return
    base = torch.autograd.Function
    saved = base.__dict__["apply"]
    original = saved.__func__

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        return original(cls, *args, **kwargs)

    whole = allow_in_pre_dispatch_graph(apply)

    def kept(cls: type, *args: Any, **kwargs: Any) -> Any:
        if _named(cls) and all(is_graphable(a) for a in pytree.tree_leaves((args, kwargs))):
            return whole(cls, *args, **kwargs)
        return original(cls, *args, **kwargs)

    base.apply = classmethod(kept)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        base.apply = saved  # type: ignore[method-assign]


def _named(cls: type) -> bool:
    """Whether the graph's node can find ``cls`` again by ``module.qualname``, and it is not torch's own."""
    module = cls.__module__
    if module == "torch" or module.startswith("torch.") or "." in cls.__qualname__ or "<" in cls.__qualname__:
        return False
    return getattr(sys.modules.get(module), cls.__qualname__, None) is cls
