"""The torch.export frontend: models fx cannot trace, and Hugging Face models built from configs.

Truth is fxmem.measure: per node, the same graph on real CPU tensors; in total, the model's own eager
forward without any graph.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxmem
from tests.helpers import FLOAT, analyze_on_meta, assert_matches_measurement


class _ShapeBranch(nn.Module):
    """Python control flow on a shape: torch.fx.symbolic_trace cannot trace it, torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 4:
            x = x * 2
        return self.norm(torch.relu(self.lin(x)))


def test_auto_falls_back_to_export_and_stays_exact() -> None:
    report = analyze_on_meta(_ShapeBranch, ["B,8"])
    assert report.frontend == "export" and report.accounting.method == "symbolic"
    # lin keeps x*2 (B,8 floats: 32 B per sample, charged to the mul), relu keeps its (B,16) output
    # (64 B), LayerNorm keeps its input (the relu output, counted once) and per-row mean and rstd (8 B).
    assert report.activations == fxmem.ByteExpr(per_sample=8 * FLOAT + 16 * FLOAT + 2 * FLOAT)
    assert {n.fqn for n in report.nodes if not n.saved.is_zero} == {"", "norm"}
    assert_matches_measurement(report, _ShapeBranch, ["B,8"], "sum", batches=(1, 2, 3))


def test_forcing_fx_on_an_untraceable_model_is_a_trace_error() -> None:
    with pytest.raises(fxmem.TraceError, match="cannot trace"):
        analyze_on_meta(_ShapeBranch, ["B,8"], frontend="fx")


transformers = pytest.importorskip("transformers")


def _hf(config: object, tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp(type(config).__name__)
    config.save_pretrained(folder)  # type: ignore[attr-defined]
    return f"hf:{folder / 'config.json'}"


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=64, bos_token_id=0, eos_token_id=0)
    config.architectures = ["GPT2LMHeadModel"]
    return _hf(config, tmp_path_factory)


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=97, max_position_embeddings=64
    )
    config.architectures = ["BertForMaskedLM"]
    return _hf(config, tmp_path_factory)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_hugging_face_models_match_their_eager_run(family: str, request: pytest.FixtureRequest) -> None:
    spec_name = request.getfixturevalue(family)
    spec = fxmem.load_model(spec_name, seq_len=16)
    assert dict(spec.inputs) == {"input_ids": "B,16:int64", "labels": "B,16:int64"} and spec.loss == "auto"
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, name=spec_name, target="cpu")
    assert report.frontend == "export"
    real = fxmem.load_model(spec_name, seq_len=16, meta=False).model
    for batch in (1, 2, 3):
        m = fxmem.measure(real, spec.inputs, batch, loss=spec.loss, frontend="export")
        assert report.activation_bytes(batch) == m.total
        assert {k: v for k, v in report.node_bytes(batch).items() if v} == m.nodes


def test_exported_layers_use_the_module_paths_of_print_model(gpt2: str) -> None:
    spec = fxmem.load_model(gpt2, seq_len=16)
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, target="cpu")
    paths = {name for name, _m in spec.model.named_modules()}
    layers = {row.fqn for row in report.layers()}
    assert "transformer.h.0.attn" in layers and "transformer.h.1.mlp.act" in layers
    assert layers - {"(top level)", "(loss)"} <= paths


def test_config_overrides_and_sequence_length(gpt2: str) -> None:
    spec = fxmem.load_model(gpt2, hf_config={"n_layer": "1"}, seq_len=8)
    assert spec.model.config.n_layer == 1 and dict(spec.inputs)["input_ids"] == "B,8:int64"
    with pytest.raises(fxmem.LoadError, match="no 'n_layerz'"):
        fxmem.load_model(gpt2, hf_config={"n_layerz": "1"})


def test_an_hf_name_that_cannot_be_resolved_offline_says_how_to_pass_a_config() -> None:
    with pytest.raises(fxmem.LoadError, match=r"config\.json"):
        fxmem.load_model("hf:no-such-org/no-such-model-xyz")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=64,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    return _hf(config, tmp_path_factory)


def _assert_exact_against_eager(spec_name: str, inputs: dict[str, str], seq: int | None = None) -> None:
    """analyze on the meta model == measure on a real one: per node (same graph) and in total (eager forward)."""
    spec = fxmem.load_model(spec_name, seq_len=16)
    report = fxmem.analyze(
        spec.model, inputs, loss=spec.loss, seq_len=seq, target="cpu", peak=False
    )  # saved bytes only: no step to simulate
    assert report.frontend == "export"
    real = fxmem.load_model(spec_name, seq_len=16, meta=False).model
    for batch in (1, 2, 3):
        m = fxmem.measure(real, inputs, batch, loss=spec.loss, frontend="export", seq_len=seq)
        assert {k: v for k, v in report.node_bytes(batch).items() if v} == m.nodes, f"B={batch}, S={seq}"
        assert report.activation_bytes(batch) == m.total, f"B={batch}, S={seq}"


def test_llama_with_grouped_query_attention_matches_its_eager_run(llama: str) -> None:
    # Exported on transformers' traced path, the causal mask was materialized and k/v repeated per head
    # (repeat_kv), which eager SDPA does without (is_causal, enable_gqa): see Note [Eager code paths
    # under torch.export]. Exported on the CPU's kernels, the graph is the one measure exports.
    _assert_exact_against_eager(llama, {"input_ids": "B,16:int64", "labels": "B,16:int64"})


@pytest.mark.parametrize("seq", [16, 32])
def test_llama_with_a_symbolic_sequence_matches_its_eager_run(llama: str, seq: int) -> None:
    _assert_exact_against_eager(llama, {"input_ids": "B,S:int64", "labels": "B,S:int64"}, seq=seq)


@pytest.fixture(scope="module")
def t5(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_kv=8, d_ff=64, num_heads=4, vocab_size=97)
    config.architectures = ["T5ForConditionalGeneration"]
    return _hf(config, tmp_path_factory)


def test_t5_matches_its_eager_run(t5: str) -> None:
    # On the traced path, the masks came from masking_utils (expanded bool (B, 1, S, S) tensors), where
    # eager passes none and SDPA's position-bias path builds the decoder's causal (1, 1, S, S) mask
    # itself: torch.where saved other masks, 240 bytes fewer than the eager step at S=16.
    _assert_exact_against_eager(t5, {"input_ids": "B,16:int64", "labels": "B,16:int64"})


def test_a_padding_mask_keeps_the_materialized_mask_which_eager_builds_too(llama: str) -> None:
    # fxmem feeds zeros, so eager sees padding and materializes the mask as the traced path does.
    inputs = {"input_ids": "B,16:int64", "attention_mask": "B,16:int64", "labels": "B,16:int64"}
    _assert_exact_against_eager(llama, inputs)


def test_eager_code_paths_decide_only_without_tensors_and_are_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxmem.frontends.hf_paths import eager_code_paths

    masking = pytest.importorskip("transformers.masking_utils")
    monkeypatch.setattr(masking, "is_torchdynamo_exporting", lambda: True)  # as under torch.export
    originals = {n: getattr(masking, n) for n in ("_ignore_causal_mask_sdpa", "find_packed_sequence_indices")}
    positions = torch.arange(4)[None]
    assert masking._ignore_causal_mask_sdpa(None, 4, 4, 0, 0) is False
    with eager_code_paths({"input_ids", "labels"}):
        assert masking._ignore_causal_mask_sdpa(None, 4, 4, 0, 0) is True  # eager: no mask, is_causal
        assert masking._ignore_causal_mask_sdpa(torch.ones(1, 4, dtype=torch.bool), 4, 4, 0, 0) is False  # reads values
        assert masking.find_packed_sequence_indices(positions) is None
        assert masking.is_torchdynamo_exporting() is True  # only answered False while deciding
    with eager_code_paths({"input_ids", "position_ids"}):
        assert masking.find_packed_sequence_indices is originals["find_packed_sequence_indices"]  # the inputs may pack
    assert {n: getattr(masking, n) for n in originals} == originals


@pytest.mark.parametrize("seq", [16, 32])
def test_t5_with_a_symbolic_sequence_matches_its_eager_run(t5: str, seq: int) -> None:
    # T5 shifts its labels right, so export insists on S >= 3 and says so; fxmem re-exports with the
    # bound torch suggests (see _suggested_dims).
    _assert_exact_against_eager(t5, {"input_ids": "B,S:int64", "labels": "B,S:int64"}, seq=seq)


@pytest.fixture(scope="module")
def bert_64(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = transformers.BertConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64
    )
    config.architectures = ["BertForMaskedLM"]
    return _hf(config, tmp_path_factory)


@pytest.mark.parametrize("seq", [16, 32])
def test_bert_with_a_symbolic_sequence_within_its_positions_matches_its_eager_run(bert_64: str, seq: int) -> None:
    # BERT's 64 position embeddings bound S: export rejects an unbounded Dim and suggests max=64.
    _assert_exact_against_eager(bert_64, {"input_ids": "B,S:int64", "labels": "B,S:int64"}, seq=seq)


def test_suggested_bounds_are_read_from_torchs_message() -> None:
    from fxmem.frontends.exporting import _suggested_dims

    dims = {"B": torch.export.Dim("batch"), "S": torch.export.Dim("seq")}
    message = "Constraints violated (seq)! ...\nSuggested fixes:\n  seq = Dim('seq', min=3, max=64)"
    bounded = _suggested_dims(message, dims)
    assert bounded is not None and bounded["B"] is dims["B"]
    assert (bounded["S"].min, bounded["S"].max) == (3, 64)
    assert _suggested_dims("Suggested fixes:\n  seq = 16", dims) is None  # a constant: S cannot stay symbolic
    assert _suggested_dims("Suggested fixes:\n  seq = Dim('seq', max=8)", dims) is None  # excludes the example S=16


def test_a_users_own_hugging_face_model_exports_without_its_cache() -> None:
    # Built by the user's factory, not by an hf: spec, the model has use_cache=True: its forward would
    # return a DynamicCache that torch.export cannot take. A training step never uses the cache, so
    # export runs with it off, and the user's config is left as it was.
    config = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=64,
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    assert model.config.use_cache is True
    inputs = {"input_ids": "B,16:int64", "labels": "B,16:int64"}
    report = fxmem.analyze(model, inputs, loss="auto", target="cpu", peak=False)
    assert report.frontend == "export" and model.config.use_cache is True
    torch.manual_seed(0)
    real = transformers.LlamaForCausalLM(config)
    assert report.activation_bytes(2) == fxmem.measure(real, inputs, 2, loss="auto", frontend="export").total


@pytest.mark.parametrize("family", ["gpt2", "bert", "llama", "t5"])
def test_hugging_face_step_peaks_match_the_profiler(family: str, request: pytest.FixtureRequest) -> None:
    # The whole step of the exported model (its own loss, backward, AdamW), as tests/test_peak_zoo.py
    # holds the zoo to: within 1% of a real CPU step under torch.profiler, in the same phase.
    spec_name = request.getfixturevalue(family)
    spec = fxmem.load_model(spec_name, seq_len=16)
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, target="cpu", batch=4)
    for batch, first_step in ((1, False), (4, True), (4, False)):
        real = fxmem.load_model(spec_name, seq_len=16, meta=False).model
        torch.manual_seed(0)
        measured = fxmem.measure_peak(real, spec.inputs, batch, loss=spec.loss, first_step=first_step)
        predicted = report.peak(batch, first_step=first_step)
        assert abs(predicted.bytes - measured.bytes) <= 0.01 * measured.bytes, (
            f"B={batch} first={first_step}: {predicted.bytes} vs {measured.bytes}"
        )
        assert predicted.phase == measured.phase


class _LossInside(nn.Module):
    """A head that returns its logits and computes its loss on a float32 copy, as Hugging Face's do."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(x)
        if x.shape[0] > 0:  # a shape branch: fx cannot trace this, export can
            loss = logits.float().square().mean()
        return loss, logits


def test_an_output_behind_a_cast_that_was_a_no_op_is_its_source() -> None:
    # Note [Outputs behind a cast that was a no-op when exported]: in float32, logits.float() is the
    # logits themselves, and export points the output at the cast. Under bf16 autocast the cast is real:
    # the caller holds the bf16 logits (4 x 32 x 2 = 256 B at B=4, made by addmm) through the whole
    # step, and the fp32 copy (512 B, kept by square for backward) is released in backward.
    report = analyze_on_meta(_LossInside, ["B,8"], loss="model", amp="bf16", target="cuda", batch=4)
    events = report.timeline(4).events
    released = {e.storage for e in events if not e.alloc}
    logits = [e for e in events if e.alloc and e.op == "aten.addmm"]
    copies = [e for e in events if e.alloc and e.op == "aten._to_copy" and e.node == "to" and e.phase.value == "forward"]
    assert [e.nbytes.at(4, None) for e in logits] == [4 * 32 * 2] and logits[0].storage not in released
    assert [e.nbytes.at(4, None) for e in copies] == [4 * 32 * 4] and copies[0].storage in released
