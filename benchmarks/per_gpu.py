"""Per-GPU model state of a 7B and a 70B GPT under each sharding stage, as a markdown table.

Mixed-precision AdamW (bf16 weights and gradients, fp32 master copy and moments: 16 bytes per
parameter, the ZeRO paper's 2 + 2 + 12) on N data-parallel GPUs, divided as DeepSpeed ZeRO and PyTorch
FSDP divide it (fxmem/step/sharding.py), with the transient all-gathered units of ZeRO-3 and FSDP. The models
are built on the meta device, so this takes seconds and no memory.

    python benchmarks/per_gpu.py            # N = 8
    python benchmarks/per_gpu.py 64         # N = 64
"""

from __future__ import annotations

import sys

import torch

from fxmem.output.render import format_bytes
from fxmem.step.sharding import STAGES, shard_state, units_of
from fxmem.step.state import get_optimizer, state_bytes
from models_zoo.gpt2_small import GPT

CONFIGS = {
    # name: (layers, dim, heads, vocab, context), as benchmarks/scale.py
    "gpt-7b": (32, 4096, 32, 32000, 2048),
    "gpt-70b": (80, 8192, 64, 32000, 2048),
}


def rows(name: str, world_size: int) -> list[list[str]]:
    layers, dim, heads, vocab, ctx = CONFIGS[name]
    with torch.device("meta"):
        model = GPT(vocab, ctx, dim, layers, heads, dropout=0.0, tied=False)
    state = state_bytes(model, optimizer=get_optimizer("adamw"), precision="mixed", target="cuda")
    out = []
    for stage in STAGES:
        units = units_of(model, stage) if stage in ("zero3", "fsdp") else []
        share = shard_state(state, world_size=1 if stage == "none" else world_size, stage=stage, units=units)
        cells = [share.weights, share.gradients, share.master, share.optimizer, share.gathered]
        gpus = 1 if stage == "none" else world_size
        out.append([name, f"{stage} x {gpus}", *(format_bytes(c.nbytes) for c in cells), format_bytes(share.total)])
    return out


def main(argv: list[str]) -> int:
    world_size = int(argv[0]) if argv else 8
    header = ["model", "stage x GPUs", "weights", "gradients", "fp32 master", "Adam moments", "gathered", "state per GPU"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in CONFIGS:
        for row in rows(name, world_size):
            print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
