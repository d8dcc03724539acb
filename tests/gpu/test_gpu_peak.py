"""The cuda target against a real GPU: predicted ``max_memory_allocated`` vs measured. Skipped without CUDA.

For the zoo's GPT, ResNet-50 and 3D U-Net steps (AdamW, torch's default foreach implementation on CUDA),
in fp32 and under bf16 autocast, at B in {1, 4}, steady step: the prediction is
``analyze(..., target="cuda", gpu=...)``'s replay through the caching allocator (with the cuBLAS
workspaces), the measurement ``torch.cuda.max_memory_allocated`` around each phase of a real step
(``fxmem.measure.measure_peak(device="cuda")``). Run by hand where a GPU is lent, never by CI:

    python tests/gpu/test_gpu_peak.py            # prints the table of errors (under 5 minutes on one GPU)
    python -m pytest tests/gpu -q -s             # the same, as tests with a tolerance

The GPU is named with ``FXMEM_GPU`` (default: guessed from ``torch.cuda.get_device_name()``).
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

import fxmem
from fxmem.gpus import GPUS
from fxmem.measure import measure_peak

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODELS = ("gpt2-small:test", "resnet50", "unet3d:test")
AMPS = (None, "bf16")
BATCHES = (1, 4)
TOLERANCE = 0.05
"""Looser than the CPU's 1%: cuDNN's convolution workspaces are engine-dependent and not predicted."""


def gpu_name() -> str:
    """The fxmem name of this machine's GPU: FXMEM_GPU, or the first whose label matches the device's."""
    if "FXMEM_GPU" in os.environ:
        return os.environ["FXMEM_GPU"]
    device = torch.cuda.get_device_name().lower()
    for name in GPUS:
        if name.split("-")[0] in device:
            return name
    return "h100-80gb"


def compare(spec_name: str, amp: str | None, batch: int) -> tuple[int, int]:
    """(predicted, measured) max_memory_allocated of a steady AdamW step."""
    spec = fxmem.load_model(f"zoo:{spec_name}")
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, optimizer="adamw", batch=batch, target="cuda", gpu=gpu_name(), amp=amp)
    device = report.peak(batch).device
    assert device is not None
    real = fxmem.load_model(f"zoo:{spec_name}", meta=False).model
    torch.cuda.empty_cache()
    measured = measure_peak(real, spec.inputs, batch, loss=spec.loss, optimizer="adamw", device="cuda", amp=amp, seq_len=report.seq_len)
    return device.allocated, measured.bytes


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("amp", AMPS, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", MODELS)
def test_predicted_allocated_against_cuda(name: str, amp: str | None, batch: int) -> None:
    predicted, measured = compare(name, amp, batch)
    error = (predicted - measured) / measured
    print(f"{name} {amp or 'fp32'} B={batch}: predicted {predicted}, measured {measured} ({error:+.2%})")
    assert abs(error) <= TOLERANCE


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to compare")
        return 0
    start = time.perf_counter()
    print(f"GPU {torch.cuda.get_device_name()} as fxmem's '{gpu_name()}'")
    print(f"{'model':<18}{'amp':<6}{'B':>3}{'predicted MiB':>16}{'measured MiB':>15}{'error':>9}")
    for name in MODELS:
        for amp in AMPS:
            for batch in BATCHES:
                predicted, measured = compare(name, amp, batch)
                error = (predicted - measured) / measured
                print(f"{name:<18}{amp or 'fp32':<6}{batch:>3}{predicted / 2**20:>16.1f}{measured / 2**20:>15.1f}{error:>+9.2%}", flush=True)
    print(f"done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
