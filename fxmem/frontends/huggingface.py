"""Hugging Face models from their configs alone: no weights are downloaded, nothing is unpickled.

``hf:gpt2`` reads the config from the local Hugging Face cache; ``hf:./config.json`` (or a folder
holding one) reads a file, which is how to name a model where no network is reachable. The model is
built with ``from_config`` (on the meta device, as every spec is), with ``use_cache=False`` (a
``DynamicCache`` output cannot be exported), and its default inputs carry ``labels`` so that the step
includes the model's own loss and the log-softmax over the vocabulary it keeps.

Note [A Hugging Face model passed as an object]
    ``fxmem.analyze(model, ...)`` with a model the user built (``T5ForConditionalGeneration(config)``,
    ``from_pretrained``) must be traced as the ``hf:`` spec of the same config is, or the two disagree
    (issue 18). An ``hf:`` spec edits its config before the model exists (``_for_training``), so
    every copy the model makes of it carries the edit; a built model has already made its copies:
    T5 (transformers 5.25, models/t5/modeling_t5.py, ``T5ForConditionalGeneration.__init__``)
    deep-copies its config for the encoder and decoder stacks, so ``model.config.use_cache = False``
    leaves the decoder building an ``EncoderDecoderCache``, which torch.export rejects as an output
    ("Found EncoderDecoderCache in output"). ``prepared_for_training`` therefore applies the same
    edit to every config the model holds (each submodule's ``config``, and their ``sub_configs``), for
    the trace only, and puts back each attribute it changed, the user's config as it was. The
    attention implementation is left as the user chose it: it is what their step runs, and a model
    built from a config gets transformers' default, as an ``hf:`` spec does. An encoder-decoder
    without a decoder start token (``T5Config()`` has none in transformers 5.25) is given one for the
    trace, as its ``hf:`` spec is; its own eager step (and fxmem.measure) fails on shifting labels.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from fxmem.errors import FxmemWarning, LoadError
from fxmem.results import ModelSpec

__all__ = ["hf_factory", "prepared_for_training", "without_kv_cache"]

_T = TypeVar("_T")

_MAX_DEFAULT_SEQ = 2048
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")
_HEADS = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM", "AutoModel")
"""Tried in order when the config names no architecture: the first whose mapping knows the config."""


def hf_factory(
    name: str, *, overrides: Mapping[str, str] = {}, seq_len: int | None = None, checkpoint: bool = False, dtype: torch.dtype | None = None
) -> Callable[[], ModelSpec]:
    """A factory for ``hf:NAME``: resolves the config now (errors early), builds the model when called.

    ``checkpoint`` turns on transformers' own activation checkpointing as
    ``model.activation_checkpointing_enable()`` (``gradient_checkpointing_enable()`` before transformers
    5) does: non-reentrant, every layer, and the input embeddings' output made to require grad so
    that a frozen base passes gradients to its adapters; fxmem/frontends/checkpointing.py finds its
    regions in the exported graph. ``dtype`` builds the floating weights in it, as
    ``from_pretrained(..., dtype=torch.bfloat16)`` loads them (transformers sets the default dtype
    while the model is built, so buffers computed in fp32 on purpose, RoPE's ``inv_freq``, stay fp32).
    """
    transformers = _import_transformers()
    config = _config(transformers, name)
    _apply_overrides(config, overrides, name)
    _for_training(config)
    seq = seq_len or _default_seq_len(config)
    inputs = {"input_ids": f"B,{seq}:int64", "labels": f"B,{seq}:int64"}

    def build() -> ModelSpec:
        with _default_dtype(dtype):
            model = _instantiate(_model_class(transformers, config), config)
        if checkpoint:
            _checkpoint_layers(model, name)
        return ModelSpec(model, inputs, loss="auto", name=f"hf:{name}")

    return build


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """torch's default dtype set to ``dtype`` while open, as transformers' ``_from_config`` sets it."""
    old = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


_ABSENT = object()
"""The old value of an attribute ``_for_training`` added: restoring it deletes the attribute."""


def _for_training(config: Any) -> dict[str, Any]:
    """Edit ``config`` for a training step; return {attribute: old value} for what changed.

    An encoder-decoder gets a decoder start token where it has none, since its labels are shifted
    right with it to make the decoder's inputs. ``use_cache`` stays as the config says: Note [The
    cache a training forward builds].
    """
    old: dict[str, Any] = {}
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        old["decoder_start_token_id"] = getattr(config, "decoder_start_token_id", _ABSENT)
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0
    return old


@contextlib.contextmanager
def prepared_for_training(model: nn.Module, *, cache: bool = True) -> Iterator[None]:
    """See Note [A Hugging Face model passed as an object]: every config in ``model`` edited as an
    ``hf:`` spec's is, while tracing; the user's configs as they were afterwards. A no-op for a
    model that holds no transformers config (and transformers is never imported here). ``cache=False``
    also turns the key/value cache off, as transformers does under its own checkpointing: a step whose
    layers fxmem's planner checkpoints must not build one (its recompute would update the cache again,
    and torch.utils.checkpoint refuses the second forward's different slices)."""
    changed: list[tuple[Any, dict[str, Any]]] = []
    try:
        for config in _configs(model):
            changed.append((config, _for_training(config)))
            if not cache and getattr(config, "use_cache", None):
                changed.append((config, {"use_cache": config.use_cache}))
                config.use_cache = False
        yield
    finally:
        for config, old in reversed(changed):
            _restore(config, old)


def without_kv_cache(model_at: int) -> Callable[[Callable[..., _T]], Callable[..., _T]]:
    """A planner entry point run with its model's key/value cache off (``prepared_for_training(model,
    cache=False)``; the model is its ``model_at``-th positional argument, or ``model=``): the steps it
    compares checkpoint layers, which transformers runs without a cache."""

    def wrap(fn: Callable[..., _T]) -> Callable[..., _T]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> _T:
            model = args[model_at] if len(args) > model_at else kwargs.get("model")
            if not isinstance(model, nn.Module):
                return fn(*args, **kwargs)
            with prepared_for_training(model, cache=False):
                return fn(*args, **kwargs)

        return run

    return wrap


def _configs(model: nn.Module) -> list[Any]:
    """The distinct transformers configs ``model`` holds: each submodule's, and their sub-configs."""
    configuration = sys.modules.get("transformers.configuration_utils")  # imported with any transformers model
    base = getattr(configuration, "PretrainedConfig", None)
    if not isinstance(base, type):
        return []
    found: dict[int, Any] = {}
    pending = [getattr(m, "config", None) for m in model.modules()]
    while pending:
        config = pending.pop()
        if isinstance(config, base) and id(config) not in found:
            found[id(config)] = config
            pending.extend(getattr(config, key, None) for key in getattr(type(config), "sub_configs", {}) or {})
    return list(found.values())


def _restore(config: Any, old: Mapping[str, Any]) -> None:
    for key, value in old.items():
        if value is _ABSENT:
            delattr(config, key)
        else:
            setattr(config, key, value)


def _checkpoint_layers(model: Any, name: str) -> None:
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise LoadError(f"hf:{name}: transformers does not support activation checkpointing for {type(model).__name__}; drop --checkpoint.")
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise LoadError("hf: specs need the transformers package: pip install 'fxmem[hf]' (or pip install transformers).") from e
    transformers.logging.set_verbosity_error()
    return transformers


def _config(transformers: Any, name: str) -> Any:
    path = Path(name).expanduser()
    try:
        if path.suffix == ".json" or path.is_dir():
            if not path.exists():
                raise LoadError(f"hf:{name}: no such file or folder; give the path of a config.json.")
            return transformers.AutoConfig.from_pretrained(str(path))
        return transformers.AutoConfig.from_pretrained(name, local_files_only=True)
    except LoadError:
        raise
    except Exception as e:
        raise LoadError(
            f"hf:{name}: cannot read its config ({type(e).__name__}: {str(e).strip().splitlines()[0][:200]}). Without "
            "network access, download the model's config.json elsewhere (only the config, no weights) and pass "
            "its path: fxmem analyze hf:./config.json."
        ) from e


def _apply_overrides(config: Any, overrides: Mapping[str, str], name: str) -> None:
    for key, text in overrides.items():
        if not hasattr(config, key):
            raise LoadError(f"hf:{name}: --config {key}={text}: the {type(config).__name__} has no '{key}'.")
        setattr(config, key, _literal(text))
    _fit_layer_types(config, "layer_types" in overrides, name)


# Note [A layer count changed under a list of layer types]
#     Configs that mix attention kinds list one per layer (``layer_types``: Gemma 2/3's alternating
#     sliding and full attention, Qwen3's, Llama 4's), and transformers expects
#     ``len(layer_types) == num_hidden_layers``: each decoder layer reads ``config.layer_types[i]``
#     (models/qwen3/modeling_qwen3.py, ``Qwen3DecoderLayer.__init__``), so ``--config
#     num_hidden_layers=8`` on a 2-layer list fails with a bare IndexError, and 1 on a 2-layer list
#     silently keeps a type no layer has. The list is cut to the new count, or extended by repeating
#     its shortest period (sliding, full, sliding, full, ...), which is how those configs build it
#     from their defaults; a note says so, and ``--config layer_types=[...]`` sets it explicitly.


def _fit_layer_types(config: Any, given: bool, name: str) -> None:
    """See Note [A layer count changed under a list of layer types]; ``given``: --config set layer_types itself."""
    count, types = getattr(config, "num_hidden_layers", None), getattr(config, "layer_types", None)
    if not isinstance(count, int) or not isinstance(types, list) or not types or len(types) == count:
        return
    if given:
        raise LoadError(
            f"hf:{name}: --config layer_types lists {len(types)} layers but num_hidden_layers is {count}; transformers needs one "
            "type per layer: give as many, or leave layer_types out and fxmem fits the config's own list to num_hidden_layers."
        )
    period = next(p for p in range(1, len(types) + 1) if all(t == types[i % p] for i, t in enumerate(types)))
    config.layer_types = [types[i % period] for i in range(count)]
    how = "cut to" if count < len(types) else f"extended, repeating {types[:period]}, to"
    warnings.warn(
        f"hf:{name}: num_hidden_layers is {count} but the config's layer_types lists {len(types)} layers; layer_types was "
        f"{how} {count} entries, as transformers needs one per layer. Pass --config layer_types=[...] to choose them.",
        FxmemWarning,
        stacklevel=4,
    )


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _default_seq_len(config: Any) -> int:
    lengths = [getattr(config, k) for k in _CONTEXT_KEYS if isinstance(getattr(config, k, None), int)]
    return min([*lengths, _MAX_DEFAULT_SEQ])


def _instantiate(cls: Any, config: Any) -> Any:
    """Auto classes build with from_config; concrete ones take the config in their constructor."""
    return cls.from_config(config) if hasattr(cls, "from_config") else cls(config)


def _model_class(transformers: Any, config: Any) -> Any:
    for arch in getattr(config, "architectures", None) or []:
        if hasattr(transformers, arch):
            return getattr(transformers, arch)
    for head in _HEADS:
        auto = getattr(transformers, head)
        if type(config) in auto._model_mapping:
            return auto
    raise LoadError(f"no transformers model class accepts a {type(config).__name__}.")
