"""Hugging Face models passed to ``fxmem.analyze`` as objects (issue 18): traced as their ``hf:`` spec is.

A model the user built keeps its own config (``use_cache=True``, and for T5 the encoder's and
decoder's deep copies of it); fxmem edits them for the trace only (Note [A Hugging Face model passed
as an object] in fxmem/frontends/huggingface.py). Truth is the ``hf:`` spec of the same config, and
fxmem.measure on a real model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxmem
from fxmem.frontends.huggingface import prepared_for_training

transformers = pytest.importorskip("transformers", reason="Hugging Face models need the transformers package")
transformers.logging.set_verbosity_error()

INPUTS = {"input_ids": "B,16:int64", "labels": "B,16:int64"}


def _t5(**extra: Any) -> Any:
    return transformers.T5Config(d_model=32, d_ff=64, d_kv=16, num_layers=2, num_heads=2, vocab_size=100, **extra)


def _bart() -> Any:
    return transformers.BartConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100, max_position_embeddings=64,
    )  # fmt: skip


def _gpt2() -> Any:
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0)


MODELS: dict[str, tuple[Callable[[], Any], str]] = {
    # decoder_start_token_id as in t5-small's config.json: without one, T5 cannot shift its labels
    "t5": (lambda: _t5(decoder_start_token_id=0), "T5ForConditionalGeneration"),
    "bart": (_bart, "BartForConditionalGeneration"),
    "gpt2": (_gpt2, "GPT2LMHeadModel"),
}


def _hf_spec(config: Any, architecture: str, folder: Path) -> str:
    config.architectures = [architecture]
    config.save_pretrained(folder)
    return f"hf:{folder / 'config.json'}"


def _configs(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Every submodule's config as its attributes (absent ones stay absent), for before/after comparisons."""
    return {name: copy.deepcopy(vars(m.config)) for name, m in model.named_modules() if hasattr(m, "config")}


@pytest.mark.parametrize("family", list(MODELS))
def test_an_object_is_analyzed_as_its_hf_spec_and_keeps_its_config(family: str, tmp_path: Path) -> None:
    make, architecture = MODELS[family]
    spec = fxmem.load_model(_hf_spec(make(), architecture, tmp_path), seq_len=16)
    expected = fxmem.analyze(spec.model, INPUTS, loss=spec.loss, target="cpu", peak=False)
    with torch.device("meta"):
        model = getattr(transformers, architecture)(make())
    before = _configs(model)
    assert model.config.use_cache is True  # the user's choice: on, as transformers defaults it
    report = fxmem.analyze(model, INPUTS, loss="auto", target="cpu", peak=False)
    assert report.frontend == expected.frontend == "export"
    assert [report.activation_bytes(b) for b in (1, 2)] == [expected.activation_bytes(b) for b in (1, 2)]
    assert _configs(model) == before
    assert model.config._attn_implementation == "sdpa"


def test_a_t5_object_matches_a_real_run() -> None:
    # The report's own call: the model's loss, labels shorter than the encoder's inputs, a real CPU
    # model with T5's decoder caching on (its deep copy of the config included).
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(_t5(decoder_start_token_id=0))
    assert model.decoder.config.use_cache is True
    inputs = {"input_ids": "B,16:int64", "labels": "B,8:int64"}
    report = fxmem.analyze(model, inputs, loss="model", target="cpu", peak=False)
    assert report.frontend == "export"
    assert report.activation_bytes(2) == fxmem.measure(model, inputs, 2, loss="model").total
    assert model.config.use_cache is True and model.decoder.config.use_cache is True


def test_preparing_restores_what_it_added_and_leaves_other_models_alone() -> None:
    # A T5 config without a decoder start token (T5Config's default in transformers 5) gets one for
    # the trace, as an hf: spec's does, and has none again afterwards.
    with torch.device("meta"):
        model = transformers.T5ForConditionalGeneration(_t5())
    assert not hasattr(model.config, "decoder_start_token_id")
    with prepared_for_training(model):
        assert model.config.decoder_start_token_id == 0
        # The cache stays as the user's config says (Note [The cache a training forward builds])
        assert model.config.use_cache is True and model.decoder.config.use_cache is True
    assert not hasattr(model.config, "decoder_start_token_id")
    assert model.config.use_cache is True and model.decoder.config.use_cache is True
    plain = nn.Linear(2, 2)
    plain.config = {"use_cache": True}  # type: ignore[assignment]  # not a transformers config: untouched
    with prepared_for_training(plain):
        assert plain.config == {"use_cache": True}
