"""PEFT fine-tuning as people run it (issue 40): fxmem/frontends/adapters.py and kv_cache.py.

Truth is a real CPU step of the same model: ``fxmem.measure`` (saved bytes) and ``fxmem.measure_peak``
(the step's peak); state bytes are counted by hand from the tiny config below.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import fxmem
from fxmem.cli import main
from fxmem.errors import InputSpecError, LoadError
from fxmem.frontends.adapters import LoraOptions, forward_module
from fxmem.frontends.load import load_model

transformers = pytest.importorskip("transformers", reason="PEFT models are Hugging Face models: they need transformers")
peft = pytest.importorskip("peft", reason="PEFT models need the peft package")
transformers.logging.set_verbosity_error()

INPUTS = {"input_ids": "B,16:int64", "labels": "B,16:int64"}
LAYERS, HIDDEN, KV_HEADS, HEAD_DIM = 2, 64, 2, 16


def _config(**extra: Any) -> Any:
    return transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=KV_HEADS,
        vocab_size=256, max_position_embeddings=64, architectures=["LlamaForCausalLM"], **extra,
    )  # fmt: skip


def _lora(task: str | None = "CAUSAL_LM") -> Any:
    return peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type=task)


def _peft_model(task: str | None, dtype: torch.dtype = torch.float32, **extra: Any) -> Any:
    torch.manual_seed(0)
    return peft.get_peft_model(transformers.LlamaForCausalLM(_config(**extra)).to(dtype), _lora(task))


def _held_to_real(model: Any, **kw: Any) -> fxmem.Report:
    report = fxmem.analyze(model, INPUTS, loss="auto", target="cpu", batch=2, **kw)
    assert report.activation_bytes(2) == fxmem.measure(model, INPUTS, 2, loss="auto").total
    real = fxmem.measure_peak(model, INPUTS, 2, loss="auto").bytes
    assert report.peak(2).bytes == pytest.approx(real, rel=0.01)
    return report


# LoRA r=8 on q_proj (64 -> 64) and v_proj (64 -> 2 KV heads x 16 = 32), per layer: A is r x in, B out x r
ADAPTER_PARAMS = LAYERS * ((8 * 64 + 64 * 8) + (8 * 64 + 32 * 8))  # 2 x (1024 + 768) = 3584


@pytest.mark.parametrize("task", ["CAUSAL_LM", None], ids=["task", "bare"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_peft_model_is_analyzed_as_it_runs(task: str | None, dtype: torch.dtype) -> None:
    # A bare PeftModel (no task_type) runs its base model's forward: Note [A bare PeftModel]
    model = _peft_model(task, dtype)
    assert type(model).__name__ == ("PeftModelForCausalLM" if task else "PeftModel")
    report = _held_to_real(model)
    assert report.model == type(model).__name__
    s = report.state
    assert s.trainable == ADAPTER_PARAMS == model.get_nb_trainable_parameters()[0]
    # peft keeps the adapters in fp32 over a bf16 base (autocast_adapter_dtype): 4 bytes each, and
    # only they have gradients; every other weight is frozen
    assert s.gradients == 4 * ADAPTER_PARAMS
    assert s.frozen_weights == s.weights - 4 * ADAPTER_PARAMS == sum(p.nbytes for p in model.parameters() if not p.requires_grad)
    text = str(report)
    assert f"({ADAPTER_PARAMS / 1000:.3g}K trainable)" in text and "frozen" in text
    assert ("precision as built: bfloat16 frozen, float32 trainable" in text) == (dtype == torch.bfloat16)


def test_a_bare_peft_model_runs_its_base_model() -> None:
    bare, task = _peft_model(None), _peft_model("CAUSAL_LM")
    assert forward_module(bare) is bare.get_base_model()
    assert forward_module(task) is task  # its own forward wraps the base model's call
    plain = torch.nn.Linear(2, 2)
    assert forward_module(plain) is plain


def test_the_bf16_recipe_on_a_peft_model_keeps_its_adapters_in_fp32() -> None:
    # Note [A PEFT model under the bf16 recipe]: the fp32 model under --precision bf16 is the run with
    # a bf16 base and peft's fp32 adapters, measured for real
    recipe = fxmem.analyze(_peft_model("CAUSAL_LM"), INPUTS, loss="auto", target="cpu", batch=2, precision="bf16")
    built = _held_to_real(_peft_model("CAUSAL_LM", torch.bfloat16))
    assert recipe.activation_bytes(2) == built.activation_bytes(2)
    assert recipe.peak(2).bytes == pytest.approx(built.peak(2).bytes, abs=64)
    assert recipe.state.gradients == 4 * ADAPTER_PARAMS
    model = _peft_model("CAUSAL_LM")
    fxmem.analyze(model, INPUTS, loss="auto", target="cpu", batch=2, precision="bf16", peak=False)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the user's weights as they were


def test_lora_options_read_as_peft_takes_them() -> None:
    o = LoraOptions.parse("r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05")
    assert (o.r, o.alpha, o.targets, o.dropout) == (16, 32.0, ("q_proj", "v_proj"), 0.05)
    assert LoraOptions.parse("r=4") == LoraOptions(r=4)
    assert LoraOptions.parse("targets=all-linear").targets == ("all-linear",)
    for bad, said in (("rank=4", "unknown key 'rank'"), ("r=x", "not a number"), ("r=0", "out of range"), ("q_proj", "not KEY=VALUE")):
        with pytest.raises(InputSpecError, match=said):
            LoraOptions.parse(bad)


@pytest.fixture
def llama_json(tmp_path: Path) -> str:
    _config().save_pretrained(tmp_path)
    return f"hf:{tmp_path / 'config.json'}"


def test_lora_from_a_spec_is_get_peft_model(llama_json: str) -> None:
    spec = load_model(llama_json, seq_len=16, lora=LoraOptions(r=8, alpha=16, targets=("q_proj", "v_proj")), meta=False)
    assert type(spec.model).__name__ == "PeftModelForCausalLM" and "LoRA r=8 alpha=16 on q_proj,v_proj" in (spec.name or "")
    report = _held_to_real(spec.model)
    by_hand = fxmem.analyze(_peft_model("CAUSAL_LM"), INPUTS, loss="auto", target="cpu", batch=2)
    assert report.activation_bytes(2) == by_hand.activation_bytes(2) and report.state == by_hand.state
    with pytest.raises(LoadError, match="peft cannot add LoRA"):
        load_model(llama_json, lora=LoraOptions(targets=("no_such_proj",)))


def test_an_hf_spec_in_bf16_is_built_in_bf16(llama_json: str) -> None:
    # --precision bf16 on an hf: spec builds the weights in bf16, as from_pretrained(dtype=torch.bfloat16)
    # loads them; RoPE's inv_freq buffer stays fp32 as transformers computes it
    spec = load_model(llama_json, seq_len=16, dtype=torch.bfloat16, lora=LoraOptions(r=8, alpha=16, targets=("q_proj", "v_proj")), meta=False)
    frozen = {p.dtype for p in spec.model.parameters() if not p.requires_grad}
    trainable = {p.dtype for p in spec.model.parameters() if p.requires_grad}
    assert (frozen, trainable) == ({torch.bfloat16}, {torch.float32})
    assert torch.get_default_dtype() == torch.float32
    _held_to_real(spec.model, precision="bf16")


def test_gradient_checkpointing_under_lora_matches_a_real_run(llama_json: str) -> None:
    # as model.gradient_checkpointing_enable() does it: non-reentrant, every layer, the embeddings'
    # output made to require grad for the frozen base; transformers turns the cache off under it
    lora = LoraOptions(r=8, alpha=16, targets=("q_proj", "v_proj"))
    spec = load_model(llama_json, seq_len=16, checkpoint=True, lora=lora, meta=False)
    report = _held_to_real(spec.model)
    assert report.checkpointed == LAYERS and not report.paths
    plain = fxmem.analyze(load_model(llama_json, seq_len=16, lora=lora, meta=False).model, INPUTS, loss="auto", target="cpu", batch=2)
    assert report.activation_bytes(2) < plain.activation_bytes(2)


@pytest.mark.parametrize("peft_model", [False, True], ids=["full", "lora"])
def test_the_cache_a_training_forward_builds_is_held_with_the_output(peft_model: bool) -> None:
    # Note [The cache a training forward builds]: use_cache=True (transformers' default) builds a
    # DynamicCache whose K and V copies the loop holds with the output; the step's attention then reads
    # the copies. What it adds to the peak is the real runs' difference, to the byte.
    def model(use_cache: bool) -> Any:
        if peft_model:
            return _peft_model("CAUSAL_LM", use_cache=use_cache)
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(_config(use_cache=use_cache))

    cached, plain = model(True), model(False)
    with_cache, without = _held_to_real(cached), _held_to_real(plain)
    assert any("DynamicCache" in p and "use_cache=False" in p for p in with_cache.paths) and not without.paths
    real = [fxmem.measure_peak(m, INPUTS, 2, loss="auto").bytes for m in (cached, plain)]
    assert with_cache.peak(2).bytes - without.peak(2).bytes == real[0] - real[1]
    if not peft_model:  # full fine-tuning: each layer's K and V, 2 x 2 KV heads x 16 tokens x 16 dims x 4 bytes, over 2 layers
        assert real[0] - real[1] == LAYERS * 2 * (2 * KV_HEADS * 16 * HEAD_DIM * 4)
    assert with_cache.activation_bytes(2) == without.activation_bytes(2)  # held with the output, not saved for backward


def test_the_cli_adds_lora_and_builds_bf16(llama_json: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["analyze", llama_json, "--seq-len", "16", "--batch", "2", "--target", "cpu", "--lora", "r=8,alpha=16,targets=q_proj,v_proj",
            "--precision", "bf16", "--grad-checkpointing"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "+ LoRA r=8 alpha=16 on q_proj,v_proj" in out and "precision as built: bfloat16 frozen, float32 trainable" in out
    assert "2 checkpointed regions" in out


def test_lora_without_peft_says_how_to_install_it(llama_json: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    assert main(["analyze", llama_json, "--lora", "r=8", "--seq-len", "16"]) == 2
    err = capsys.readouterr().err
    assert "pip install peft" in err and "Traceback" not in err
