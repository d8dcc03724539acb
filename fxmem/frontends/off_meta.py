"""A model whose factory cannot run on the meta device, built on the CPU instead, and the report told so.

Note [A factory that needs real values]
    fxmem calls a model factory under ``torch.device("meta")`` so that a 70B config costs no memory. Some
    models read their weights' values while they are built, which meta tensors do not have: PEFT methods
    that derive the adapter from the base weights (peft 0.21: AdaMSS and FRoD decompose them, ``.cpu()``
    of a meta tensor: "Cannot copy out of meta tensor"), or that compute index tables (BOFT's permutation
    matrices, ``perm_mat[i, idx] = 1`` with a tensor index: "Tensor.item() cannot be called on meta
    tensors"; SHiRA's random mask through ``torch.where``, whose meta kernel refuses; UniLoRA's
    ``torch.bincount``, which has none), and torchvision's RegNet computes its widths with tensors.

    Such a factory is called again on the CPU, as it runs for real. Where the weights it made on the
    meta device before it failed (parameters and buffers registered, counted through torch's global
    registration hooks) hold at most ``_REAL_INIT_BYTES``, it runs unchanged: the model is built at its
    real size, with its own initialization, a few seconds at most. Above that, torch.nn.init's
    initializers and transformers' ``init_weights`` are skipped, as transformers' ``no_init_weights``
    (transformers/initialization.py) does for a model whose weights are loaded afterwards: the tensors are
    allocated and not filled (untouched pages cost no memory until written), and the code that reads
    values (the adapter's own initialization) still runs on them. Either way the analysis is the same as
    on the meta device, and an FxmemWarning says which way the model was built and why.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Callable, Iterator

import torch
from torch import nn

from fxmem.errors import first_line
from fxmem.options import warn_at_caller

__all__ = ["build_off_meta", "counting_state", "meta_failure"]

_REAL_INIT_BYTES = 1 << 30
"""Weights up to this size are built with their own initialization on the CPU (Note [A factory that needs real values])."""

_INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
    "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
)  # fmt: skip
"""torch.nn.init's initializers, the ones transformers' ``TORCH_INIT_FUNCTIONS`` lists."""


@contextlib.contextmanager
def counting_state() -> Iterator[list[int]]:
    """The bytes of every parameter and buffer registered while open, in a one-item list."""
    counted = [0]

    def count(module: nn.Module, name: str, t: torch.Tensor | None) -> None:
        counted[0] += t.nbytes if isinstance(t, torch.Tensor) else 0

    hooks = [nn.modules.module.register_module_parameter_registration_hook(count), nn.modules.module.register_module_buffer_registration_hook(count)]
    try:
        yield counted
    finally:
        for hook in hooks:
            hook.remove()


def meta_failure(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) is torch refusing a meta tensor (torch's messages name the meta
    device: "cannot be called on meta tensors", "Cannot copy out of meta tensor", "with Meta tensors",
    "register_meta"); any other failure of a factory is its own, and is not tried again on the CPU."""
    seen: list[BaseException] = []
    while e is not None and all(e is not s for s in seen):
        if "meta" in str(e).lower():
            return True
        seen.append(e)
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return False


def build_off_meta(factory: Callable[[], object], name: str, failure: BaseException, counted: int) -> object:
    """``factory()`` on the CPU after it failed on the meta device with ``failure`` having registered
    ``counted`` bytes of weights: Note [A factory that needs real values]."""
    skip = counted > _REAL_INIT_BYTES
    with torch.device("cpu"), _init_skipped() if skip else contextlib.nullcontext():
        built = factory()
    how = (
        f"with torch.nn.init's initializers skipped (as transformers' no_init_weights does), which holds its weights in memory ({counted / 2**30:.1f} GiB made before the meta build failed)"
        if skip
        else f"at its real size, as it runs for real ({_size(counted)} of weights were made before the meta build failed)"
    )
    warn_at_caller(
        f"model '{name}' cannot be built on the meta device ({_where(failure)}{_first_sentence(failure)}): its code reads "
        f"tensor values while it is built. fxmem built it on the CPU instead, {how}; the analysis is the same."
    )
    return built


@contextlib.contextmanager
def _init_skipped() -> Iterator[None]:
    """torch.nn.init's initializers and transformers' ``init_weights`` as no-ops (transformers' ``no_init_weights``)."""
    names = getattr(sys.modules.get("transformers.initialization"), "TORCH_MODULES_TO_PATCH", ("torch.nn.init",))  # modules that may hold their own names
    modules = [sys.modules[n] for n in names if n in sys.modules]
    patched: list[tuple[object, str, object]] = [(m, f, getattr(m, f)) for m in modules for f in _INIT_FUNCTIONS if hasattr(m, f)]
    pretrained = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    if pretrained is not None and hasattr(pretrained, "init_weights"):
        patched.append((pretrained, "init_weights", pretrained.init_weights))
    for owner, attr, _ in patched:
        setattr(owner, attr, _unfilled)
    try:
        yield
    finally:
        for owner, attr, original in patched:
            setattr(owner, attr, original)


def _unfilled(tensor: object = None, *args: object, **kwargs: object) -> object:
    return tensor


def _where(e: BaseException) -> str:
    """'file:line: ' of the innermost frame outside torch that raised ``e``, or ''."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f"{torch.__path__[0]}/" not in f.filename]
    if not frames:
        return ""
    parts = frames[-1].filename.split("site-packages/")
    return f"{parts[-1]}:{frames[-1].lineno}: "


def _first_sentence(e: BaseException) -> str:
    line = first_line(e, 160)
    return line.split(". ")[0].rstrip(".")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"
