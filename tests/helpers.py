"""Small helpers shared by the tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import fxmem
from fxmem.report import Report

FLOAT = 4  # bytes per float32 element
INT64 = 8


def analyze_on_meta(factory: Callable[[], nn.Module], inputs: list[str], loss: str = "sum", **kw: object) -> Report:
    """Build the model on the meta device (as the CLI does) and analyze it."""
    with torch.device("meta"):
        model = factory()
    kw.setdefault("target", "cpu")  # the CPU is what the tests measure
    return fxmem.analyze(model, inputs, loss=loss, **kw)  # type: ignore[arg-type]


def saved(report: Report) -> dict[str, tuple[int, int]]:
    """{node: (per_sample, fixed)} for the nodes that are charged any activation bytes."""
    return {n.name: (n.saved.per_sample, n.saved.fixed) for n in report.nodes if not n.saved.is_zero}


def assert_matches_measurement(
    report: Report,
    factory: Callable[[], nn.Module],
    inputs: list[str],
    loss: str,
    batches: tuple[int, ...] = (1, 3),
    leaf_types: tuple[type, ...] = (),
) -> None:
    """Prediction == real CPU run, in total (eager, no fx) and per node, at each batch size."""
    for b in batches:
        torch.manual_seed(0)
        m = fxmem.measure(factory(), inputs, b, loss=loss, leaf_types=leaf_types)
        assert report.activation_bytes(b) == m.total, f"B={b}: predicted {report.activation_bytes(b)}, measured {m.total}"
        predicted = {k: v for k, v in report.node_bytes(b).items() if v}
        assert predicted == m.nodes, f"B={b}: per-node bytes differ"


CRUMBS = 64
"""Bytes a CPU step's peak may differ by: the CPU's scalar crumbs, 8-byte wrapped Python numbers and
their 4-byte casts alive for one op each, which fxmem does not model (Note [Scalar crumbs on the CPU]
in tests/fuzz_grammar.py)."""


def assert_step_peak(model: nn.Module, inputs: list[str], batch: int, *, loss: str, first_step: bool, phase: str = "same") -> None:
    """fxmem's AdamW step peak on the CPU equals a real step's (``measure_peak``) within CRUMBS bytes.
    ``phase``: "same" (the phases equal), "near" (the real run came within CRUMBS of its top in the
    predicted phase) or "any" (not checked)."""
    report = fxmem.analyze(model, inputs, loss=loss, optimizer="adamw", target="cpu")
    predicted = report.peak(batch, first_step=first_step)
    measured = fxmem.measure_peak(model, inputs, batch, loss=loss, optimizer="adamw", first_step=first_step)
    assert abs(predicted.bytes - measured.bytes) <= CRUMBS, (predicted.bytes, measured.bytes, predicted.phase, measured.phase)
    if phase == "same":
        assert predicted.phase == measured.phase
    elif phase == "near":
        assert measured.phases[predicted.phase] >= measured.bytes - CRUMBS


def tiny_llama(vocab_size: int = 97) -> nn.Module:
    """A HF Llama test config (2 layers, d=32, 4 heads sharing 2 key/value heads), seeded; callers
    skip first with ``pytest.importorskip("transformers")``."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)
