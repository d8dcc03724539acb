"""Stage 1: resolve a model spec to a module on the meta device and its default inputs.

Specs: ``zoo:NAME`` (models_zoo; ``zoo:NAME:test`` for its small test config), ``package.module:factory`` and ``path/to/file.py:factory``. A factory
returns an ``nn.Module``, a ``ModelSpec``, or ``(module, inputs)``. It is called under
``torch.device("meta")``, so a 70B-parameter config costs no RAM.

Loading ``file.py:factory`` or ``package.module:factory`` runs that code, with your permissions,
exactly as ``python file.py`` would: load only code you trust. fxmem never unpickles weights.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from fxmem.errors import FxmemError, LoadError
from fxmem.results import ModelSpec

__all__ = ["load_model"]


def load_model(spec: str, *, meta: bool = True) -> ModelSpec:
    """Build the model named by ``spec`` (on the meta device unless ``meta=False``)."""
    factory, name = _resolve(spec)
    return _call_factory(factory, name, meta=meta)


def _resolve(spec: str) -> tuple[Callable[..., object], str]:
    if spec.startswith("zoo:"):
        name, _, variant = spec[len("zoo:") :].partition(":")
        factory = _zoo_factory(name)
        if variant not in ("", "test"):
            raise LoadError(f"model spec '{spec}': unknown variant '{variant}'; write zoo:{name} or zoo:{name}:test.")
        return (functools.partial(factory, test=True) if variant else factory), spec
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise LoadError(
            f"model spec '{spec}' is not understood; write zoo:NAME (see 'fxmem zoo'), package.module:factory, "
            "or path/to/file.py:factory."
        )
    module = _import_file(target, spec) if target.endswith(".py") else _import_module(target, spec)
    return _attribute(module, attr, spec), spec


def _zoo_factory(name: str) -> Callable[..., object]:
    from models_zoo import ZOO

    if name not in ZOO:
        close = difflib.get_close_matches(name, ZOO, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise LoadError(f"unknown zoo model '{name}'{hint}; the zoo has: {', '.join(ZOO)}.")
    return ZOO[name]


def _import_module(target: str, spec: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        raise LoadError(
            f"model spec '{spec}': cannot import module '{target}' ({e}); check the name and that it is "
            "installed or on PYTHONPATH, or pass a file path such as ./my_model.py:factory."
        ) from e
    except Exception as e:  # noqa: BLE001 - the user's module raised while importing
        raise LoadError(f"model spec '{spec}': importing '{target}' raised {type(e).__name__}: {e}.") from e


def _import_file(target: str, spec: str) -> ModuleType:
    path = Path(target).expanduser()
    if not path.is_file():
        raise LoadError(f"model spec '{spec}': no file '{path}'; give the path to a .py file that defines the factory.")
    unique = f"fxmem_user_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(unique, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[unique] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file raised while running
        raise LoadError(f"model spec '{spec}': running '{path}' raised {type(e).__name__}: {e}.") from e
    return module


def _attribute(module: ModuleType, attr: str, spec: str) -> Callable[..., object]:
    if not hasattr(module, attr):
        names = [n for n in vars(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise LoadError(f"model spec '{spec}': '{module.__name__}' has no attribute '{attr}'{hint}.")
    factory = getattr(module, attr)
    if not callable(factory):
        raise LoadError(f"model spec '{spec}': '{attr}' is a {type(factory).__name__}, not a factory function or class.")
    return factory  # type: ignore[no-any-return]


def _call_factory(factory: Callable[..., object], name: str, *, meta: bool) -> ModelSpec:
    try:
        with torch.device("meta") if meta else torch.device("cpu"):
            built = factory()
    except TypeError as e:
        raise LoadError(
            f"model spec '{name}': calling the factory with no arguments failed ({e}); fxmem calls it as "
            "factory(), so wrap it in a function that supplies the arguments."
        ) from e
    except FxmemError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's factory raised
        raise LoadError(f"model spec '{name}': the factory raised {type(e).__name__}: {e}.") from e
    return _as_spec(built, name)


def _as_spec(built: object, name: str) -> ModelSpec:
    if isinstance(built, ModelSpec):
        return ModelSpec(built.model, built.inputs, built.loss, built.name or name, built.extra) if isinstance(built.model, nn.Module) else _not_module(built.model, name)
    if isinstance(built, nn.Module):
        return ModelSpec(built, (), name=name)
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module):
        return ModelSpec(built[0], built[1], name=name)  # type: ignore[arg-type]
    return _not_module(built, name)


def _not_module(value: object, name: str) -> ModelSpec:
    raise LoadError(
        f"model spec '{name}': the factory returned {type(value).__name__}, not an nn.Module; return the "
        "module, (module, inputs), or fxmem.ModelSpec."
    )
