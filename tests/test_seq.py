"""A second symbol, the sequence length S: bytes become a polynomial in B and S, exact at every (B, S)."""

from __future__ import annotations

import pytest
import torch

import fxmem
from models_zoo.gpt2_small import GPT

LAYERS, HEADS = 2, 4


def _gpt() -> torch.nn.Module:
    return GPT(97, 64, 32, LAYERS, HEADS, dropout=0.1, tied=True)


@pytest.fixture(scope="module")
def meta_gpt() -> torch.nn.Module:
    with torch.device("meta"):
        return _gpt()


def test_attention_brings_a_b_s_squared_term(meta_gpt: torch.nn.Module) -> None:
    report = fxmem.analyze(meta_gpt, ["B,S:int64"], loss="lm_cross_entropy", seq_len=16, target="cpu")
    # Per layer and head, the CPU's math SDPA path (dropout on) keeps three float32 S x S tensors:
    # the softmax output, dropout's float noise and the dropped-out probabilities: 12 bytes per entry.
    s_squared = {(i, j): c for i, j, c in report.activations.seq_terms if j == 2}
    assert s_squared == {(1, 2): LAYERS * HEADS * 3 * 4}
    assert "B*S^2" in report.activations.polynomial()


@pytest.mark.parametrize("seq", [16, 32])
def test_exact_at_every_batch_and_sequence_length(meta_gpt: torch.nn.Module, seq: int) -> None:
    report = fxmem.analyze(meta_gpt, ["B,S:int64"], loss="lm_cross_entropy", seq_len=seq, target="cpu")
    assert report.seq_len == seq and report.accounting.method == "symbolic"
    for batch in (1, 2, 3):
        torch.manual_seed(0)
        m = fxmem.measure(_gpt(), ["B,S:int64"], batch, loss="lm_cross_entropy", seq_len=seq)
        assert report.activation_bytes(batch) == m.total
        assert {k: v for k, v in report.node_bytes(batch).items() if v} == m.nodes


def test_max_batch_is_taken_at_the_given_sequence_length(meta_gpt: torch.nn.Module) -> None:
    short = fxmem.analyze(meta_gpt, ["B,S:int64"], loss="lm_cross_entropy", seq_len=16, target="cpu")
    long = fxmem.analyze(meta_gpt, ["B,S:int64"], loss="lm_cross_entropy", seq_len=64, target="cpu")
    budget = 64 * 2**20
    assert long.max_batch(budget) < short.max_batch(budget)  # type: ignore[operator]
    b = long.max_batch(budget)
    assert long.step_bytes(b) <= budget < long.step_bytes(b + 1)  # type: ignore[operator]  # the step peak decides


def test_a_symbolic_sequence_needs_a_length(meta_gpt: torch.nn.Module) -> None:
    with pytest.raises(fxmem.InputSpecError, match="--seq-len"):
        fxmem.analyze(meta_gpt, ["B,S:int64"], loss="lm_cross_entropy", target="cpu")


transformers = pytest.importorskip("transformers")


def test_hugging_face_gpt2_with_a_symbolic_sequence(tmp_path: object) -> None:
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=64, bos_token_id=0, eos_token_id=0)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    spec_name = f"hf:{tmp_path}/config.json"
    inputs = {"input_ids": "B,S:int64", "labels": "B,S:int64"}
    model = fxmem.load_model(spec_name).model
    real = fxmem.load_model(spec_name, meta=False).model
    for seq in (16, 32):
        report = fxmem.analyze(model, inputs, loss="auto", seq_len=seq, target="cpu")
        assert report.frontend == "export" and report.activations.seq_terms
        for batch in (1, 2, 3):
            m = fxmem.measure(real, inputs, batch, loss="auto", frontend="export", seq_len=seq)
            assert report.activation_bytes(batch) == m.total
            assert {k: v for k, v in report.node_bytes(batch).items() if v} == m.nodes


@pytest.mark.parametrize("amp", [None, "bf16"])
def test_on_the_gpu_attention_keeps_no_s_squared_term(meta_gpt: torch.nn.Module, amp: str | None) -> None:
    # The same GPT for an H100: fp32 takes the memory-efficient kernel, bf16 autocast flash (head dim
    # a multiple of 8, no mask, dropout allowed); both keep q, k, v, the output and a log-sum-exp, and
    # dropout inside them keeps only a seed. Nothing is S x S: the B*S^2 term is gone.
    report = fxmem.analyze(meta_gpt, ["B,S:int64"], loss="lm_cross_entropy", seq_len=16, target="cuda", amp=amp)
    assert not [term for term in report.activations.seq_terms if term[1] >= 2]
    assert "S^2" not in report.activations.polynomial()


def test_the_longest_padded_batch_and_the_lengths_below_it(meta_gpt: torch.nn.Module) -> None:
    # Note [The longest padded batch]: --seq-len is the longest padded batch; the lengths below it are
    # read from the same symbolic step, and each is what a real step padded to that length peaks at
    report = fxmem.analyze(meta_gpt, ["B,S:int64"], loss="lm_cross_entropy", seq_len=32, target="cpu", batch=3, device_memory=2**30)
    rows = report.length_peaks()
    assert [s for s, _ in rows] == [4, 8, 12, 16, 20, 24, 28, 32]
    assert dict(rows)[32] == report.peak(3).bytes
    for seq in (8, 20):
        torch.manual_seed(0)
        real = fxmem.measure_peak(_gpt(), ["B,S:int64"], 3, loss="lm_cross_entropy", seq_len=seq).bytes
        assert dict(rows)[seq] == pytest.approx(real, rel=0.01)
    assert report.length_peaks(1) == ()  # B=1 was simulated at S=32 only
    text = str(report)
    assert "S=32      the longest padded batch: every figure here is for batches padded to 32; shorter ones need less" in text
    assert "Worst length <= 32" not in text  # a cpu target has no GPU trade-off table
    worst = max(rows, key=lambda r: (r[1], r[0]))
    assert worst == (32, report.peak(3).bytes)  # on the CPU the peak grows with the length here
