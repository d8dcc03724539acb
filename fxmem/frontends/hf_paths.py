"""Make Hugging Face transformers take, under torch.export, the code paths it takes in an eager step.

Note [Eager code paths under torch.export]
    transformers asks "am I being compiled or exported?" and, when it is, builds its attention masks
    differently: it cannot read tensor values there, so it materializes the causal or bidirectional
    mask that an eager forward skips. In eager, a forward without an ``attention_mask`` passes no mask
    to SDPA (``is_causal=True`` or nothing), which also lets SDPA do grouped-query attention itself
    (``enable_gqa``) instead of ``repeat_kv`` copying k and v per head. An exported graph built on the
    other path saves more than the eager step does (the (B, H, S, S) float mask T5 builds from the bool
    one, Llama's repeated k/v), so a prediction from it would disagree with the step it predicts.

    Two of transformers' decisions are made here as an eager forward makes them, and only where that
    decision reads no tensor value, so that the exported graph is the eager step's graph:

    - ``masking_utils._ignore_causal_mask_sdpa`` and ``_ignore_bidirectional_mask_sdpa`` (may SDPA go
      without a mask?): when none of their arguments is a tensor (no padding mask, integer offsets),
      eager's answer depends on lengths only, so they are evaluated with masking_utils' tracing checks
      answering "not tracing". With a padding mask they keep their traced answer (materialize), which
      is also eager's answer for the all-zero masks fxmem feeds.
    - ``masking_utils.find_packed_sequence_indices`` (are several sequences packed in a row?): eager
      reads the position ids; when the inputs do not name ``position_ids``, the model makes them
      itself with ``arange`` (one sequence per row), where eager's answer is always "no" (``None``).

    - ``integrations.moe._can_use_grouped_mm`` (may a mixture-of-experts layer run ``grouped_mm``?):
      under torch.compile or export it answers no for weights other than bfloat16, and the layer takes
      transformers' ``grouped_mm_fallback`` custom op, which keeps its offsets as a Python attribute
      where the eager ``grouped_mm`` saves them (16 bytes per layer for 4 experts, which the fallback
      path left out). Its checks read dtypes, devices and versions, never values, so it is decided with
      the tracing checks answering "not tracing"; the report names the path taken (fxmem/rules/ledger.py).

    Every patch is skipped when the installed transformers lacks the function (other versions decide
    elsewhere), and everything is restored when the export returns. When a model's eager decision
    depends on a symbolic length (a sliding window shorter than some S), export rejects the guard; the
    caller then exports again without these patches, as before.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch

from fxmem.inputs import InputSpec
from fxmem.rules.grouped_mm import eager_grouped_mm
from fxmem.rules.ledger import note_code_path

__all__ = ["eager_code_paths", "forward_input_names", "has_eager_code_paths"]

_SKIP_DECISIONS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
_TRACING_CHECKS = ("is_torchdynamo_exporting", "is_torchdynamo_compiling", "is_tracing")
"""The names masking_utils may use to ask whether it is traced; each is answered False while deciding."""


def forward_input_names(model: torch.nn.Module, specs: Sequence[InputSpec]) -> set[str]:
    """The forward() parameter names the inputs bind to (positional ones by position)."""
    params = inspect.signature(model.forward).parameters
    positional = [p.name for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    unnamed = sum(1 for s in specs if s.name is None)
    return {*positional[:unnamed], *(s.name for s in specs if s.name is not None)}


def has_eager_code_paths() -> bool:
    """Whether ``eager_code_paths`` has anything to patch: transformers' masking_utils is imported."""
    return "transformers.masking_utils" in sys.modules


@contextlib.contextmanager
def eager_code_paths(input_names: Collection[str]) -> Iterator[None]:
    """See Note [Eager code paths under torch.export]; a no-op unless transformers is imported."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        yield
        return
    patches: dict[str, Callable[..., Any]] = {}
    for name in _SKIP_DECISIONS:
        original = getattr(masking, name, None)
        if callable(original):
            patches[name] = _decided_as_in_eager(masking, original)
    if "position_ids" not in input_names and callable(getattr(masking, "find_packed_sequence_indices", None)):
        patches["find_packed_sequence_indices"] = _no_packed_sequences
    targets = [(masking, name, patch) for name, patch in patches.items()]
    moe = sys.modules.get("transformers.integrations.moe")
    if callable(getattr(moe, "_can_use_grouped_mm", None)):
        targets.append((moe, "_can_use_grouped_mm", _grouped_mm_as_in_eager(moe, moe._can_use_grouped_mm)))  # type: ignore[union-attr]
        if callable(getattr(torch.nn.functional, "grouped_mm", None)):  # Note [grouped_mm on fake tensors]
            targets.append((torch.nn.functional, "grouped_mm", eager_grouped_mm(torch.nn.functional.grouped_mm)))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    try:
        for owner, name, patch in targets:
            setattr(owner, name, patch)
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def _grouped_mm_as_in_eager(module: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """``_can_use_grouped_mm`` answered as in an eager step; the answer is recorded for the report."""

    @functools.wraps(original)
    def decide(*args: Any, **kwargs: Any) -> Any:
        with _not_tracing(module):
            eager = original(*args, **kwargs)
        kernel = "torch.nn.functional.grouped_mm" if eager else "transformers' grouped_mm_fallback loop"
        note_code_path(f"transformers' experts ran {kernel}, as an eager step does on this device and dtype")
        return eager

    return decide


def _decided_as_in_eager(module: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def decide(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)
        if any(isinstance(v, torch.Tensor) for v in bound.arguments.values()):
            return original(*args, **kwargs)  # eager would read tensor values: keep the traced answer
        with _not_tracing(module):
            return original(*args, **kwargs)

    return decide


@contextlib.contextmanager
def _not_tracing(module: Any) -> Iterator[None]:
    saved = {name: getattr(module, name) for name in _TRACING_CHECKS if callable(getattr(module, name, None))}
    try:
        for name in saved:
            setattr(module, name, _not_traced)
        yield
    finally:
        for name, check in saved.items():
            setattr(module, name, check)


def _not_traced(*_args: Any, **_kwargs: Any) -> bool:
    return False


def _no_packed_sequences(*_args: Any, **_kwargs: Any) -> None:
    return None
