"""Per-GPU model state of a 7B and a 70B GPT under each sharding stage, as a markdown table.

ZeRO rows: mixed-precision AdamW (bf16 weights and gradients, fp32 master copy and moments: 16 bytes
per parameter, the ZeRO paper's 2 + 2 + 12) on N data-parallel GPUs, divided as DeepSpeed ZeRO divides
it, by formula (fxmem/step/sharding.py), with ZeRO-3's gathered units. The fsdp rows are not a formula:
one rank of FSDP2 itself (``fully_shard`` on each block, then the root, on a fake process group of N
ranks; fxmem/parallel) simulated through a whole step at B=1 on the cuda target. FSDP2 keeps fp32
shards, so its 16 bytes per parameter are 4 + 4 + 8 (weights, gradients, moments; no separate master
copy), and "gathered" is what its own buffers hold at the step's peak. The models are built on the
meta device, so this takes a minute and no memory.

The second table is tensor parallel's effect on one rank of Llama-3.1-8B (HF's config sizes, its own
``base_model_tp_plan``: attention and MLP split column- then row-wise, the embedding's rows split, the
LM head's output gathered) training at 8192 tokens, B=1, bf16 autocast, fp32 AdamW (for-loop: tensor
parallel alone leaves the norms plain tensors, which foreach refuses beside DTensors), each rank's
step simulated on the real ``parallelize_module`` (fxmem/parallel/tensor.py), a minute per row.

    python benchmarks/per_gpu.py            # N = 8
    python benchmarks/per_gpu.py 64         # N = 64
"""

from __future__ import annotations

import sys

import torch

import fxmem
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
        if stage == "fsdp":
            out.append(_engine_row(name, model, ctx, world_size))
            continue
        units = units_of(model, stage) if stage == "zero3" else []
        share = shard_state(state, world_size=1 if stage == "none" else world_size, stage=stage, units=units)
        cells = [share.weights, share.gradients, share.master, share.optimizer, share.gathered]
        gpus = 1 if stage == "none" else world_size
        out.append([name, f"{stage} x {gpus}", *(format_bytes(c.nbytes) for c in cells), format_bytes(share.total)])
    return out


def _engine_row(name: str, model: torch.nn.Module, ctx: int, world_size: int) -> list[str]:
    """One rank of FSDP2 over ``world_size``, simulated (fp32 shards and AdamW, B=1)."""
    report = fxmem.analyze(model, [f"B,{ctx}:int64"], loss="lm_cross_entropy", batch=1, fsdp=world_size)
    share = report.per_gpu
    cells = [share.weights, share.gradients, share.master, share.optimizer, share.gathered]
    return [name, f"fsdp x {world_size} (FSDP2 run, fp32)", *(format_bytes(c.nbytes) for c in cells), format_bytes(share.total)]


LLAMA_3_8B = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
}  # fmt: skip
"""Llama-3.1-8B's sizes (meta-llama/Llama-3.1-8B's config.json)."""


def tp_rows(degrees: tuple[int, ...] = (1, 2, 4, 8), tokens: int = 8192) -> list[list[str]]:
    """One rank of Llama-3.1-8B under tensor parallel over each degree, then with sequence parallel
    (``sp=True``: its plan derived from HF's, fxmem/parallel/tensor.py), simulated on the cuda target."""
    import transformers

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_3_8B))
    out = []
    for tp, sp in [*((t, False) for t in degrees), *((t, True) for t in degrees if t > 1)]:
        report = fxmem.analyze(
            model, {"input_ids": f"B,{tokens}:int64"}, loss="lm_cross_entropy", batch=1, tp=tp, sp=sp, amp="bf16", optimizer_impl="for-loop"
        )
        peak = report.peak(1)
        allocated = peak.device.allocated if peak.device is not None else peak.bytes
        state = report.per_gpu.total if tp > 1 else report.state.total
        cells = (state, report.activation_bytes(1), allocated)
        out.append(["Llama-3.1-8B", f"{tokens}", f"tp x {tp}" + (" + sp" if sp else ""), *(format_bytes(c) for c in cells)])
    return out


def _table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main(argv: list[str]) -> int:
    world_size = int(argv[0]) if argv else 8
    header = ["model", "stage x GPUs", "weights", "gradients", "fp32 master", "Adam moments", "gathered", "state per GPU"]
    _table(header, [row for name in CONFIGS for row in rows(name, world_size)])
    print()
    _table(["model", "tokens", "parallel", "state per GPU", "saved activations per GPU", "peak per GPU (allocated)"], tp_rows())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
