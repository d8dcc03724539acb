"""The device's edge: each zoo model at three batches around its largest on two GPUs, replayed through the
caching allocator with the device's capacity (as every report now does) and without it (an unbounded
cache, as reports did before issue 35), side by side in one run.

With capacity, a ``cudaMalloc`` that does not fit first releases the cache and retries, and a cuDNN
workspace that does not fit gives way (Note [When cudaMalloc fails] and Note [A workspace that does not
fit] in fxmem/gpu/allocator.py); without it, reserved memory only grows. The "largest" columns are the
largest batch under each: with capacity, the verdict's (Note [The largest batch] in fxmem/report.py);
without, the largest batch whose unbounded nvidia-smi total is within the device, found the same way.

    python benchmarks/edge.py                 # full-size zoo models (several minutes)
    python benchmarks/edge.py --test          # their small test configs
    python benchmarks/edge.py --gpus h100-80gb,l4 --models resnet50,gpt2-small
"""

from __future__ import annotations

import argparse
import time

import torch
from tabulate import tabulate

import fxmem
from fxmem.output.render import format_bytes
from fxmem.report import Report, largest_fitting
from models_zoo import ZOO

UNBOUNDED = 1 << 60
"""A budget no step reaches: the allocator never releases its cache (the replay before capacity)."""
MODELS = ("resnet50", "vit-b16", "gpt2-small", "wide-mlp", "lstm-lm", "unet3d")


def analyze_on(name: str, gpu: str, test: bool) -> Report:
    with torch.device("meta"):
        spec = ZOO[name](test=test)
    return fxmem.analyze(spec.model, spec.inputs, loss=spec.loss or "sum", name=name, gpu=gpu, batch=1)


def unbounded_largest(report: Report) -> int:
    """The largest batch whose unbounded total is within the device (the pre-capacity reading)."""
    budget = report.device_memory
    assert budget is not None
    return largest_fitting(lambda b: report.steps.device_bytes(b, UNBOUNDED) <= budget)[0]


def rows_for(name: str, gpu: str, test: bool) -> list[list[object]]:
    started = time.perf_counter()
    report = analyze_on(name, gpu, test)
    verdict = report.verdict()
    if verdict.max_batch is None:
        return [[name, gpu, "-", verdict.describe(), "", "", "", "", "", "", "", "", f"{time.perf_counter() - started:.1f}"]]
    old = unbounded_largest(report)
    rows = []
    for b in (verdict.max_batch - 1, verdict.max_batch, verdict.max_batch + 1):
        capped = report.steps.device_peak(b, budget=report.device_memory)
        free = report.steps.device_peak(b, budget=UNBOUNDED)
        rows.append([
            name, gpu, b, "fits" if capped.fits else f"no ({format_bytes(capped.short)} short)",
            format_bytes(capped.allocated), format_bytes(capped.reserved), format_bytes(capped.total),
            format_bytes(free.allocated), format_bytes(free.reserved), format_bytes(free.total),
            f"{verdict.max_batch}", f"{old} ({old / verdict.max_batch:.2f}x)", f"{time.perf_counter() - started:.1f}",
        ])  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--test", action="store_true", help="the zoo's small test configs")
    parser.add_argument("--gpus", default="h100-80gb,l4")
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    rows = [row for name in args.models.split(",") for gpu in args.gpus.split(",") for row in rows_for(name, gpu, args.test)]
    headers = [
        "model", "GPU", "B", "with capacity", "allocated", "reserved", "nvidia-smi", "allocated (unbounded)",
        "reserved (unbounded)", "nvidia-smi (unbounded)", "largest", "largest (unbounded)", "s",
    ]  # fmt: skip
    print(tabulate(rows, headers=headers, disable_numparse=True))


if __name__ == "__main__":
    main()
