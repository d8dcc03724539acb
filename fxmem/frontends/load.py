"""Resolve a model spec to a module on the meta device and its default inputs.

Specs: ``zoo:NAME`` (models_zoo; ``zoo:NAME:test`` for its small test config), ``hf:NAME`` or
``hf:path/config.json`` (Hugging Face, from the config alone), ``torchvision:NAME`` and ``timm:NAME``
(when installed; see vision.py), ``package.module:factory`` and ``path/to/file.py:factory``. A factory
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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from fxmem.errors import FxmemError, LoadError
from fxmem.frontends.adapters import LoraOptions, add_lora
from fxmem.frontends.huggingface import hf_factory
from fxmem.frontends.off_meta import build_off_meta, counting_state, meta_failure
from fxmem.frontends.vision import timm_factory, torchvision_factory
from fxmem.results import ModelSpec

__all__ = ["import_user_file", "load_leaf_types", "load_model", "user_files"]

_USER_FILES: dict[str, str] = {}
"""The .py files run by ``_import_file`` in this process: module name -> resolved path."""


def load_model(
    spec: str,
    *,
    meta: bool = True,
    hf_config: Mapping[str, str] = {},
    seq_len: int | None = None,
    checkpoint: bool = False,
    dtype: torch.dtype | None = None,
    lora: LoraOptions | None = None,
) -> ModelSpec:
    """Build the model named by ``spec`` (on the meta device unless ``meta=False``).

    ``hf_config`` (config overrides), ``seq_len``, ``checkpoint`` (transformers' activation
    checkpointing) and ``dtype`` (the weights built in it, as ``from_pretrained(dtype=...)`` loads
    them) apply to ``hf:`` specs only. ``lora`` adds a LoRA adapter with peft to any model.
    """
    if spec.startswith("hf:"):
        build = hf_factory(spec[len("hf:") :], overrides=hf_config, seq_len=seq_len, checkpoint=checkpoint, dtype=dtype)
        return _call_factory(_adapted(build, lora, spec), spec, meta=meta)
    if checkpoint:
        raise LoadError(
            f"model spec '{spec}': checkpoint=True (--checkpoint) turns on transformers' activation checkpointing, "
            "so it applies to hf: specs only; other models checkpoint in their own code (torch.utils.checkpoint), which fxmem follows."
        )
    for prefix, make in (("torchvision:", torchvision_factory), ("timm:", timm_factory)):
        if spec.startswith(prefix):
            name = spec[len(prefix) :]
            if not name:
                raise LoadError(f"model spec '{spec}': name the model, e.g. {prefix}resnet50.")
            return _call_factory(_adapted(make(name), lora, spec), spec, meta=meta)
    factory, name = _resolve(spec)
    return _call_factory(_adapted(factory, lora, name), name, meta=meta)


def _adapted(factory: Callable[..., object], lora: LoraOptions | None, name: str) -> Callable[[], object]:
    """``factory`` with a LoRA adapter added to what it builds, on the device it builds on."""
    if lora is None:
        return factory

    def build() -> ModelSpec:
        spec = _as_spec(factory(), name)
        return ModelSpec(add_lora(spec.model, lora, name), spec.inputs, spec.loss, f"{spec.name or name} + {lora.describe()}", spec.extra)

    return build


def load_leaf_types(names: Sequence[str], model: nn.Module) -> tuple[type[nn.Module], ...]:
    """Resolve ``--leaf`` names to module classes that tracing keeps opaque.

    A name is a class of one of ``model``'s submodules (``Block``), a ``torch.nn`` class
    (``MultiheadAttention``), or ``package.module:ClassName`` / ``path/to/file.py:ClassName``.
    """
    return tuple(dict.fromkeys(t for name in names for t in _leaf_types(name.strip(), model)))


def _leaf_types(name: str, model: nn.Module) -> tuple[type[nn.Module], ...]:
    label = f"--leaf '{name}'"
    if ":" in name:
        target, _, attr = name.rpartition(":")
        if not target or not attr:
            raise LoadError(f"{label}: write a class name such as MultiheadAttention, or package.module:ClassName.")
        return (_module_class(_attribute(_import_target(target, label), attr, label, target), label),)
    own = tuple(dict.fromkeys(type(m) for m in model.modules() if name in (type(m).__name__, type(m).__qualname__)))
    if own:
        return own
    if hasattr(nn, name):
        return (_module_class(getattr(nn, name), label),)
    kinds = sorted({type(m).__name__ for m in model.modules()})
    close = _closest(name, kinds + [n for n in dir(nn) if n[:1].isupper()])
    hint = f" (did you mean '{close}'?)" if close else ""
    raise LoadError(
        f"{label}: no module class of that name in the model or in torch.nn{hint}; the model's classes are "
        f"{', '.join(kinds[:20])}{', ...' if len(kinds) > 20 else ''}; or write package.module:ClassName."
    )


def _module_class(value: object, label: str) -> type[nn.Module]:
    if isinstance(value, type) and issubclass(value, nn.Module):
        return value
    raise LoadError(f"{label}: that names {_a(type(value).__name__)}, not an nn.Module class; name the class of a module.")


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
            f"model spec '{spec}' is not understood{_spec_hint(spec)}; write zoo:NAME (see 'fxmem zoo'), "
            "package.module:factory, or path/to/file.py:factory."
        )
    module = _import_target(target, f"model spec '{spec}'")
    return _factory(module, attr, spec, target), spec


def _spec_hint(spec: str) -> str:
    """A guess at what a spec without 'target:factory' meant: a zoo name, or a file missing its factory."""
    from models_zoo import ZOO

    body = spec.rstrip(":")
    close = _closest(body.replace("_", "-"), list(ZOO))
    if close:
        return f" (did you mean 'zoo:{close}'?)"
    if body.endswith(".py"):
        return f" (name the factory in the file: '{body}:build')"
    return ""


def _zoo_factory(name: str) -> Callable[..., object]:
    from models_zoo import ZOO

    if name not in ZOO:
        close = _closest(name, list(ZOO))
        hint = f" (did you mean '{close}'?)" if close else ""
        raise LoadError(f"unknown zoo model '{name}'{hint}; the zoo has: {', '.join(ZOO)}.")
    return ZOO[name]


def _closest(name: str, names: list[str]) -> str | None:
    """The name ``name`` most likely meant: the one it starts, else difflib's closest match."""
    starts = [n for n in names if name and n.lower().startswith(name.lower())]
    close = starts or difflib.get_close_matches(name, names, n=1)
    return close[0] if close else None


def _import_target(target: str, label: str) -> ModuleType:
    return _import_file(target, label) if target.endswith(".py") else _import_module(target, label)


def _import_module(target: str, label: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        raise LoadError(
            f"{label}: cannot import module '{target}' ({e}); check the name and that it is "
            "installed or on PYTHONPATH, or give a file path such as ./my_model.py:NAME."
        ) from e
    except Exception as e:
        raise LoadError(f"{label}: importing '{target}' raised {type(e).__name__}: {e}.") from e


def user_files() -> dict[str, str]:
    """The .py files that file specs imported in this process, module name -> path. Their module names
    are this process's own (``fxmem_user_<hash>``, Python's randomized ``hash``), so another process
    that unpickles a model whose classes they define imports them first with ``import_user_file``."""
    return dict(_USER_FILES)


def import_user_file(name: str, path: str) -> ModuleType:
    """Import the .py file at ``path`` as module ``name``, as another process's ``user_files`` named it."""
    return _run_file(Path(path), name, f"user file '{path}'")


def _import_file(target: str, label: str) -> ModuleType:
    """Run a .py file as a module, once per process, so that classes it defines keep one identity."""
    path = Path(target).expanduser()
    if not path.is_file():
        raise LoadError(f"{label}: no file '{path}' (from {Path.cwd()}); give the path to a .py file that defines it.")
    return _run_file(path, f"fxmem_user_{abs(hash(str(path.resolve())))}", label)


def _run_file(path: Path, name: str, label: str) -> ModuleType:
    """Run ``path`` as module ``name`` unless it has run, registered before it runs (as import does)."""
    if name in sys.modules:
        return sys.modules[name]
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # as `python file.py` does: the file's own folder first, so its sibling modules import
        sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise LoadError(f"{label}: running '{path}' raised {type(e).__name__}: {e}.") from e
    _USER_FILES[name] = str(path.resolve())
    return module


def _attribute(module: ModuleType, attr: str, label: str, target: str) -> object:
    if not hasattr(module, attr):
        names = [n for n, v in vars(module).items() if not n.startswith("_") and callable(v)]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f"; it defines {', '.join(sorted(names)[:12]) or 'nothing callable'}{', ...' if len(names) > 12 else ''}"
        raise LoadError(f"{label}: '{target}' has no attribute '{attr}'{hint}.")
    return getattr(module, attr)


def _factory(module: ModuleType, attr: str, spec: str, target: str) -> Callable[..., object]:
    factory = _attribute(module, attr, f"model spec '{spec}'", target)
    if not callable(factory):
        raise LoadError(
            f"model spec '{spec}': '{attr}' is {_a(type(factory).__name__)}, not a factory; "
            "name a function or class that builds the model."
        )
    return factory


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _call_factory(factory: Callable[..., object], name: str, *, meta: bool) -> ModelSpec:
    try:
        with torch.device("meta") if meta else torch.device("cpu"), counting_state() as counted:
            built = factory()
    except TypeError as e:
        raise LoadError(
            f"model spec '{name}': calling the factory with no arguments failed ({e}); fxmem calls it as "
            "factory(), so wrap it in a function that supplies the arguments."
        ) from e
    except FxmemError:
        raise
    except Exception as e:
        if not (meta and meta_failure(e)):
            raise LoadError(f"model spec '{name}': the factory raised {type(e).__name__}: {e}.") from e
        built = _built_on_cpu(factory, name, e, counted[0])
    return _as_spec(built, name)


def _built_on_cpu(factory: Callable[..., object], name: str, on_meta: Exception, counted: int) -> object:
    """The factory's model built on the CPU where the meta device failed it (Note [A factory that needs
    real values] in off_meta.py); where the CPU fails too, the error says both."""
    try:
        return build_off_meta(factory, name, on_meta, counted)
    except FxmemError:
        raise
    except Exception as e:
        raise LoadError(
            f"model spec '{name}': the factory raised {type(e).__name__}: {e}. (On the meta device it raised "
            f"{type(on_meta).__name__}: {str(on_meta)[:200]}; fxmem tried the CPU after it.)"
        ) from e


def _as_spec(built: object, name: str) -> ModelSpec:
    if isinstance(built, ModelSpec):
        return ModelSpec(built.model, built.inputs, built.loss, built.name or name, built.extra) if isinstance(built.model, nn.Module) else _not_module(built.model, name)
    if isinstance(built, nn.Module):
        return ModelSpec(built, (), name=name)
    if isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module):
        return ModelSpec(built[0], built[1], name=name)
    return _not_module(built, name)


def _not_module(value: object, name: str) -> ModelSpec:
    raise LoadError(
        f"model spec '{name}': the factory returned {type(value).__name__}, not an nn.Module; return the "
        "module, (module, inputs), or fxmem.ModelSpec."
    )
