"""One model, several training setups: the CPU, one 80 GB GPU in fp32 and bf16, and 8 GPUs with ZeRO-3.

Prints the markdown table of the README's section "On the GPU you train on". Every figure is fxmem's
prediction (no GPU is used): the steady step's peak (on the CPU, in tensor bytes; on a GPU, what the
CUDA caching allocator would report as ``max_memory_allocated``), what nvidia-smi would show, and the
largest batch that fits in 80 GB.

    python benchmarks/targets.py                    # zoo:gpt2-small at B=8
    python benchmarks/targets.py zoo:resnet50 32
"""

from __future__ import annotations

import sys
from typing import Any

import fxmem
from fxmem.output.render import format_bytes

SETUPS: list[tuple[str, dict[str, Any]]] = [
    ("cpu, fp32", {"target": "cpu"}),
    ("H100 80GB, fp32", {"target": "cuda", "gpu": "h100-80gb"}),
    ("H100 80GB, bf16 autocast", {"target": "cuda", "gpu": "h100-80gb", "amp": "bf16"}),
    ("8 x H100 80GB, bf16 autocast, mixed precision, ZeRO-3", {"target": "cuda", "gpu": "h100-80gb", "amp": "bf16", "precision": "mixed", "world_size": 8, "shard": "zero3"}),
]


def row(spec: fxmem.ModelSpec, name: str, batch: int, label: str, setup: dict[str, Any]) -> list[str]:
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, optimizer="adamw", batch=batch, name=name, device_memory=80 * 10**9, **setup)
    peak = report.peak(batch)
    state = report.per_gpu.total if report.per_gpu is not None else report.state.total
    device = peak.device
    top = format_bytes(device.allocated) if device else format_bytes(peak.bytes)
    total = format_bytes(device.total) if device else "-"
    return [label, format_bytes(state), format_bytes(report.activation_bytes(batch)), top, total, str(report.max_batch(80 * 10**9))]


def main(argv: list[str]) -> int:
    name = argv[0] if argv else "zoo:gpt2-small"
    batch = int(argv[1]) if len(argv) > 1 else 8
    spec = fxmem.load_model(name)
    header = ["setup", "state per GPU", "saved activations", "peak (CPU) / max_memory_allocated (GPU)", "nvidia-smi", "largest batch in 80 GB"]
    print(f"{name}, AdamW, B={batch} per GPU")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for label, setup in SETUPS:
        print("| " + " | ".join(row(spec, name, batch, label, setup)) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
