"""The compiled step on the cuda target against a real GPU (issue 38). Skipped without CUDA; never run by CI.

The cuda target's compiled step is an estimate (Note [Inductor on a cuda target] in
fxmem/step/compiled.py): Inductor's CPU plan replayed through the GPU's allocator. This holds it to
one real compiled step (``measure_peak(device="cuda", compile=True)``: Triton kernels, the caching
allocator), ``max_memory_allocated`` against the prediction's allocated peak, within 10%, and prints
both so that a run on a lent device records how far the estimate is:

    python -m pytest tests/gpu/test_gpu_compiled.py -q -s
"""

from __future__ import annotations

import os

import pytest
import torch

import fxmem

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run by hand where one is lent)")

TOLERANCE = 0.10
"""How far the estimate may be from the real compiled step; the figures printed say how far it is."""


@pytest.mark.parametrize(("spec", "batch"), [("zoo:gpt2-small:test", 4), ("zoo:vit-b16:test", 8)])
def test_compiled_step_on_the_gpu(spec: str, batch: int) -> None:
    model = fxmem.load_model(spec)
    gpu = os.environ.get("FXMEM_GPU", "h200")
    report = fxmem.analyze(model.model, model.inputs, loss=model.loss, batch=batch, target="cuda", gpu=gpu, compile=True)
    predicted = report.compiled.peak(batch)
    assert predicted.device is not None
    real = fxmem.load_model(spec, meta=False)
    measured = fxmem.measure_peak(real.model, model.inputs, batch, loss=model.loss, device="cuda", compile=True)
    print(f"{spec} B={batch}: compiled allocated predicted {predicted.device.allocated}, measured {measured.bytes}")
    assert abs(predicted.device.allocated - measured.bytes) <= TOLERANCE * measured.bytes
