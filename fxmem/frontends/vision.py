"""Loading from vision libraries: ``torchvision:NAME`` and ``timm:NAME``, built from the library's own
constructors, never with weights.

Both libraries are optional; a spec for one that is not installed (or does not import beside this
torch) is a clear error that says what to install. The default input is the model's own size where
the library records one (timm's ``pretrained_cfg["input_size"]``, torchvision's weights metadata),
else ``B,3,224,224``; the loss is cross-entropy over the classes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

from fxmem.errors import LoadError
from fxmem.results import ModelSpec

__all__ = ["timm_factory", "torchvision_factory"]

_DEFAULT_SIZE = (3, 224, 224)


def _library(name: str, spec: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception as e:  # ImportError, or a build that fails to import beside this torch
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise LoadError(
            f"model spec '{spec}' needs {name}, which does not import here ({type(e).__name__}: {first}); "
            f"install a {name} built for this torch (pip install {name}), or build the model in a file and pass file.py:factory."
        ) from e


def _inputs(size: tuple[int, ...]) -> list[str]:
    return ["B," + ",".join(str(int(d)) for d in size)]


def torchvision_factory(name: str) -> Callable[[], ModelSpec]:
    """``torchvision.models.get_model(name, weights=None)``, input from its default weights' transforms if listed."""
    spec = f"torchvision:{name}"

    def build() -> ModelSpec:
        models = _library("torchvision", spec).models
        available = set(models.list_models())
        if name not in available:
            raise LoadError(f"model spec '{spec}': torchvision has no model '{name}'; torchvision.models.list_models() lists {len(available)}.")
        model: nn.Module = models.get_model(name, weights=None)
        return ModelSpec(model, _inputs(_torchvision_size(models, name)), "cross_entropy", spec)

    return build


def _torchvision_size(models: Any, name: str) -> tuple[int, ...]:
    try:
        weights = models.get_model_weights(name).DEFAULT
        crop = weights.transforms().crop_size
        side = int(crop[0] if isinstance(crop, (list, tuple)) else crop)
        return (3, side, side)
    except (AttributeError, KeyError, ValueError, TypeError, IndexError):  # no weights enum or crop size: ImageNet size
        return _DEFAULT_SIZE


def timm_factory(name: str) -> Callable[[], ModelSpec]:
    """``timm.create_model(name, pretrained=False)``, input from its ``pretrained_cfg["input_size"]``."""
    spec = f"timm:{name}"

    def build() -> ModelSpec:
        timm = _library("timm", spec)
        try:
            model: nn.Module = timm.create_model(name, pretrained=False)
        except RuntimeError as e:
            raise LoadError(f"model spec '{spec}': timm cannot build '{name}' ({e}); timm.list_models('*{name[:6]}*') lists close names.") from e
        cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
        size = tuple(cfg.get("input_size", _DEFAULT_SIZE))
        return ModelSpec(model, _inputs(size), "cross_entropy", spec)

    return build
