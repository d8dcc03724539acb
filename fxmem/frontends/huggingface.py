"""Hugging Face models from their configs alone: no weights are downloaded, nothing is unpickled.

``hf:gpt2`` reads the config from the local Hugging Face cache; ``hf:./config.json`` (or a folder
holding one) reads a file, which is how to name a model where no network is reachable. The model is
built with ``from_config`` (on the meta device, as every spec is), with ``use_cache=False`` (a
``DynamicCache`` output cannot be exported), and its default inputs carry ``labels`` so that the step
includes the model's own loss and the log-softmax over the vocabulary it keeps.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from fxmem.errors import LoadError
from fxmem.results import ModelSpec

__all__ = ["hf_factory"]

_MAX_DEFAULT_SEQ = 2048
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")
_HEADS = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM", "AutoModel")
"""Tried in order when the config names no architecture: the first whose mapping knows the config."""


def hf_factory(
    name: str, *, overrides: Mapping[str, str] = {}, seq_len: int | None = None, checkpoint: bool = False
) -> Callable[[], ModelSpec]:
    """A factory for ``hf:NAME``: resolves the config now (errors early), builds the model when called.

    ``checkpoint`` turns on transformers' own activation checkpointing (non-reentrant, every layer),
    as a training script would; fxmem/frontends/checkpointing.py finds its regions in the exported graph.
    """
    transformers = _import_transformers()
    config = _config(transformers, name)
    _apply_overrides(config, overrides, name)
    config.use_cache = False
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = getattr(config, "pad_token_id", None) or 0  # labels are shifted with it
    seq = seq_len or _default_seq_len(config)
    inputs = {"input_ids": f"B,{seq}:int64", "labels": f"B,{seq}:int64"}

    def build() -> ModelSpec:
        model = _instantiate(_model_class(transformers, config), config)
        if checkpoint:
            _checkpoint_layers(model, name)
        return ModelSpec(model, inputs, loss="auto", name=f"hf:{name}")

    return build


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
