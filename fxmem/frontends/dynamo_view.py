"""The model's code as Dynamo runs it: ``torch.compiler.is_compiling()`` answered as under ``torch.compile``.

Note [The code Dynamo runs]
    Dynamo does not call the functions that say whether code is being compiled: it folds each to a
    constant as it traces (``tracing_state_functions`` in torch/_dynamo/variables/torch.py):
    ``torch.compiler.is_compiling()``, ``is_dynamo_compiling()``, ``torch._utils.is_compiling()`` and
    ``torch._dynamo.external_utils.is_compiling()`` are True under ``torch.compile``, and
    ``torch.compiler.is_exporting()`` reads the export flag, False there (the same code exported, as
    fxmem traces some models, sees it True). Libraries branch on them.
    transformers' masking code does (``is_tracing`` in transformers/utils/import_utils.py): an HF
    Llama with grouped KV heads, run eagerly, calls SDPA with ``is_causal=True`` and ``enable_gqa=True``
    on its 2 KV heads; compiled, it builds a (B, 1, S, S) mask and repeats K and V to all 4 heads
    (``repeat_kv``). The compiled step saves those: a real compiled run of a 1-layer test config saved
    10,240 B more than the eager code's graph, compiled, did. So a compiled step is traced from the
    code Dynamo would trace: while fx or torch.export traces the model, these functions answer the
    model's code as Dynamo would (torch's own calls get the truth: the tracers run on them), and
    fxmem's patches that keep transformers on its eager paths under torch.export stay off. A model
    whose trace never asked is the same program either way, and its eager graph serves the compiled
    step.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from unittest import mock

import torch

__all__ = ["Asked", "dynamo_view", "viewing_compiled"]

_COMPILED: contextvars.ContextVar[bool] = contextvars.ContextVar("fxmem_viewing_compiled", default=False)


def viewing_compiled() -> bool:
    """Whether the model is being traced as ``torch.compile`` runs it: fxmem's own patches that steer
    transformers onto its eager code paths under torch.export stay off then (Note [Eager code paths
    under torch.export] in hf_paths.py): the compiled step takes the compiled paths."""
    return _COMPILED.get()


@dataclass
class Asked:
    """Whether the model's own code (not torch's) asked if it was being compiled."""

    asked: bool = False


def _compiling_functions() -> list[tuple[object, str]]:
    """The (module, name) of each function Dynamo folds to True under ``torch.compile`` (torch/_dynamo/variables/torch.py)."""
    import torch._dynamo.external_utils as external_utils

    found = [(torch.compiler, "is_compiling"), (torch.compiler, "is_dynamo_compiling"), (torch._utils, "is_compiling"), (external_utils, "is_compiling")]
    return [(module, name) for module, name in found if hasattr(module, name)]


@contextlib.contextmanager
def dynamo_view(compiling: bool) -> Iterator[Asked]:
    """While open, the model's code (code outside torch) is told it runs under ``torch.compile`` where
    ``compiling``, else what is true; the yielded ``Asked`` records whether it asked (Note [The code
    Dynamo runs]). torch's own code is told what is true: fx and torch.export run on it."""
    asked = Asked()

    def answer(real: Callable[[], bool], compiled: bool) -> Callable[[], bool]:
        def told() -> bool:
            if sys._getframe(1).f_globals.get("__name__", "").split(".")[0] == "torch":
                return real()
            asked.asked = True
            return compiled if compiling else real()

        return told

    with contextlib.ExitStack() as stack:
        token = _COMPILED.set(compiling)
        stack.callback(_COMPILED.reset, token)
        for module, name in _compiling_functions():
            stack.enter_context(mock.patch.object(module, name, answer(getattr(module, name), True)))
        stack.enter_context(mock.patch.object(torch.compiler, "is_exporting", answer(torch.compiler.is_exporting, False)))
        yield asked
