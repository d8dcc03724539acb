"""``fxmem::grouped_mm`` against eager's ``grouped_mm`` (Note [grouped_mm on fake tensors] in fxmem/rules/grouped_mm.py)."""

from __future__ import annotations

import pytest
import torch

import fxmem
import fxmem.rules.grouped_mm  # noqa: F401 - registers the op


def _saved(run) -> list[tuple[tuple[int, ...], torch.dtype]]:  # type: ignore[no-untyped-def]
    saved: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return saved, out


def test_it_saves_computes_and_differentiates_as_eager() -> None:
    """Four experts over ten rows: eager saves the (4, 8, 8) weight, the four int32 offsets and the (10, 8) input."""
    torch.manual_seed(0)
    a, w = torch.randn(10, 8, requires_grad=True), torch.randn(4, 8, 8, requires_grad=True)
    offs = torch.tensor([2, 5, 7, 10], dtype=torch.int32)
    eager_saved, eager = _saved(lambda: torch.nn.functional.grouped_mm(a, w, offs=offs))
    ours_saved, ours = _saved(lambda: torch.ops.fxmem.grouped_mm(a, w, offs))
    assert ours_saved == eager_saved == [((4, 8, 8), torch.float32), ((4,), torch.int32), ((10, 8), torch.float32)]
    torch.testing.assert_close(ours, eager)
    grad = torch.randn(10, 8)
    expected = torch.autograd.grad(eager, (a, w), grad)
    torch.testing.assert_close(torch.autograd.grad(ours, (a, w), grad), expected)


def test_an_hf_mixture_of_experts_saves_what_its_eager_step_saves() -> None:
    """Issue 39: exported alone, transformers took its grouped_mm_fallback, 16 bytes a layer short (the offsets)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    with torch.device("meta"):
        meta = transformers.MixtralForCausalLM(config)
    report = fxmem.analyze(meta, ["input_ids=B,16:int64"], batch=2, target="cpu")
    assert any("grouped_mm" in p for p in report.paths) and "Code path: transformers' experts ran" in str(report)
    torch.manual_seed(0)
    real = transformers.MixtralForCausalLM(config)
    assert report.activation_bytes(2) == fxmem.measure(real, ["input_ids=B,16:int64"], 2).total
    measured = fxmem.measure_peak(real, ["input_ids=B,16:int64"], 2).bytes
    assert abs(report.peak(2).bytes - measured) <= 0.01 * measured
