"""Every zoo model (test config): predicted activation bytes == a real CPU run, in total and per node."""

from __future__ import annotations

import pytest
import torch

import fxmem
from models_zoo import ZOO

BATCHES = (1, 2, 5)


@pytest.fixture(scope="module", params=list(ZOO))
def zoo_case(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    name = request.param
    spec = fxmem.load_model(f"zoo:{name}:test")  # on the meta device, as the CLI builds it
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, name=name, target="cpu")
    return name, spec, report


@pytest.mark.parametrize("batch", BATCHES)
def test_prediction_equals_measurement(zoo_case, batch: int) -> None:  # type: ignore[no-untyped-def]
    name, spec, report = zoo_case
    torch.manual_seed(0)
    measured = fxmem.measure(fxmem.load_model(f"zoo:{name}:test", meta=False).model, spec.inputs, batch, loss=spec.loss)
    assert report.activation_bytes(batch) == measured.total
    assert {k: v for k, v in report.node_bytes(batch).items() if v} == measured.nodes


def test_zoo_reports_stay_linear_except_the_lstm(zoo_case) -> None:  # type: ignore[no-untyped-def]
    name, _spec, report = zoo_case
    # The CPU LSTM cannot run with a symbolic batch, and its oneDNN workspace is page-rounded.
    assert report.accounting.method == ("concrete" if name == "lstm-lm" else "symbolic")
    assert report.activations.per_sample > 0
