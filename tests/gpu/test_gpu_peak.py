"""Predicted vs measured peak on a real GPU (``torch.cuda.max_memory_allocated``). Skipped without CUDA.

The predictions are made with fxmem's kernels and rules for the CPU; what CUDA kernels keep differs in
places (flash attention, cuDNN workspaces, the caching allocator's rounding), which the target-GPU work
models. These checks say how far the CPU model is from a GPU today; they are run by hand where a GPU is
lent (``python -m pytest tests/gpu -q``), never by CI.
"""

from __future__ import annotations

import pytest
import torch

import fxmem
from fxmem.measure import measure_peak

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODELS = ("gpt2-small", "resnet50", "unet3d")
TOLERANCE = 0.01


@pytest.mark.parametrize("first_step", [True, False], ids=["first", "steady"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("name", MODELS)
def test_predicted_peak_against_cuda(name: str, batch: int, first_step: bool) -> None:
    spec = fxmem.load_model(f"zoo:{name}:test")
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, optimizer="adamw", batch=batch)
    real = fxmem.load_model(f"zoo:{name}:test", meta=False).model
    torch.cuda.empty_cache()
    measured = measure_peak(real, spec.inputs, batch, loss=spec.loss, optimizer="adamw", first_step=first_step, device="cuda")
    predicted = report.peak(batch, first_step=first_step)
    error = (predicted.bytes - measured.bytes) / measured.bytes
    print(f"{name} B={batch} {'first' if first_step else 'steady'}: predicted {predicted.bytes}, measured {measured.bytes} ({error:+.2%})")
    assert abs(error) <= TOLERANCE
