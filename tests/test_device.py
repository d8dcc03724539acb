"""The cuda target's device stage: the step replayed through the caching allocator, on top of the fixed
costs, with the per-GPU state of a recipe and a sharding stage. Every expected figure is hand arithmetic
over the allocator's rules (fxmem/gpu/allocator.py cites them) and the overheads' defaults."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from torch import nn

import fxmem
from fxmem.gpu.device import DeviceModel, replay_step
from fxmem.gpu.gpus import get_gpu
from fxmem.gpu.overheads import cuda_overheads
from fxmem.results import Category, MemoryEvent, Phase, Timeline
from fxmem.symbolic import ByteExpr

MiB = 2**20
H100 = get_gpu("h100-80gb")
WORKSPACES = 2 * 32 * MiB  # two cuBLAS workspaces of ":4096:8" = 8 x 4 MiB on sm_90 (forward and backward threads)
CONTEXT = 543_162_368  # fxmem.gpu.overheads.CONTEXT_BYTES (an H200's, measured), seen only by nvidia-smi
CUBLAS_KERNELS = 165_675_008  # fxmem.gpu.overheads.CUBLAS_KERNELS_BYTES, loaded at the first matmul: nvidia-smi only
CUDNN_KERNELS = 8 * MiB  # fxmem.gpu.overheads.CUDNN_KERNELS_BYTES: only for a step that calls cuDNN
DRIVER = CONTEXT + CUBLAS_KERNELS  # what a step without cuDNN adds to the allocator's segments in nvidia-smi


def _event(
    storage: int,
    nbytes: int,
    *,
    alloc: bool = True,
    phase: Phase = Phase.FORWARD,
    category: Category = Category.ACTIVATION,
    op: str = "aten.mm",
) -> MemoryEvent:
    return MemoryEvent(phase, alloc, ByteExpr(fixed=nbytes), category, "n", "", op, storage)


def _model(
    *, fused: bool = False, scale: dict[Category, Fraction] | None = None, extra: tuple[tuple[str, int, str], ...] = ()
) -> DeviceModel:
    overheads = cuda_overheads(
        H100, cublas_workspace_config=":4096:8", cublaslt_unified=True
    )  # whatever torch and environment run the tests
    return DeviceModel(H100, overheads, host_scalars=not fused, scale=scale or {}, extra=extra)


def _timeline(*events: MemoryEvent, baseline: tuple[tuple[Category, int], ...] = ()) -> Timeline:
    storages = tuple((c, ByteExpr(fixed=n)) for c, n in baseline)
    return Timeline(4, False, {}, tuple(events), storages)


def test_blocks_are_rounded_and_workspaces_and_context_added() -> None:
    # 1000 B of weights -> a 1024 B block (512 B rounding); a 3 MiB activation is a large request
    # under 10 MiB -> its own 20 MiB segment, of which it takes 3 MiB (the rest stays free in it).
    t = _timeline(_event(0, 3 * MiB), _event(0, 0, alloc=False), baseline=((Category.PARAMETER, 1000),))
    d = replay_step(t, 4, None, _model())
    assert d.allocated == WORKSPACES + 1024 + 3 * MiB
    # Segments: the workspaces (32 MiB each, >= 10 MiB: rounded to 2 MiB, already are), one 2 MiB small
    # segment for the 1 KiB block, one 20 MiB large segment for the 3 MiB activation.
    assert d.reserved == WORKSPACES + 2 * MiB + 20 * MiB
    assert d.total == d.reserved + DRIVER  # no convolution, RNN or cuDNN attention: no cuDNN modules
    conv = _timeline(_event(0, 3 * MiB, op="aten.convolution"), _event(0, 0, alloc=False), baseline=((Category.PARAMETER, 1000),))
    assert replay_step(conv, 4, None, _model()).total == d.total + CUDNN_KERNELS


def test_host_step_counters_are_left_out_unless_fused() -> None:
    # Adam's torch.tensor(0.0) step counters (aten.lift_fresh in the optimizer step) stay on the host
    # with foreach/for-loop; a fused optimizer keeps them on the GPU: one 512 B block each.
    scalar = _event(7, 4, phase=Phase.OPTIMIZER, category=Category.OPTIMIZER_STATE, op="aten.lift_fresh")
    t = _timeline(scalar)
    assert replay_step(t, 4, None, _model()).allocated == WORKSPACES
    assert replay_step(t, 4, None, _model(fused=True)).allocated == WORKSPACES + 512


def test_per_gpu_state_scales_state_storages_and_adds_the_extras() -> None:
    # ZeRO-2 on 4 GPUs: gradients 1/4, optimizer state 1/4 (and the optimizer step's temporaries with
    # it); weights whole. A 2 MiB gradient becomes 512 KiB, an 8 KiB optimizer temporary 2 KiB; the
    # master copy's 4096 B shard is an extra block placed first.
    scale = {Category.PARAMETER: Fraction(1), Category.GRADIENT: Fraction(1, 4), Category.OPTIMIZER_STATE: Fraction(1, 4)}
    t = _timeline(
        _event(0, 2 * MiB, phase=Phase.BACKWARD, category=Category.GRADIENT),
        _event(1, 8192, phase=Phase.OPTIMIZER, category=Category.TEMPORARY),
        baseline=((Category.PARAMETER, 4096),),
    )
    d = replay_step(t, 4, None, _model(scale=scale, extra=(("master weights", 4096, "fp32 master, sharded"),)))
    assert d.allocated == WORKSPACES + 4096 + 4096 + MiB // 2 + 2048
    assert d.extra == (("master weights", 4096, "fp32 master, sharded"),)


def _rounded_peak(report: fxmem.Report, batch: int) -> int:
    """The highest sum of live storages, each rounded up to 512 B, over the steady step: what the
    allocator's blocks add up to when every request is under 1 MiB (small pool, exact-size splits)."""
    t = report.timeline(batch)
    up = lambda n: -(-n // 512) * 512
    live = {-i - 1: up(n.at(batch)) for i, (_, n) in enumerate(t.baseline_storages)}
    best = sum(live.values())
    for e in t.events:
        if e.alloc:
            live[e.storage] = up(e.nbytes.at(batch))
        else:
            live.pop(e.storage, None)
        best = max(best, sum(live.values()))
    return best


def test_a_small_step_on_the_gpu_by_hand() -> None:
    # Linear(128, 128, bias=False) with SGD at B=4: every storage is under 1 MiB, so each takes a block
    # of its size rounded up to 512 B in the small pool (the 4-byte loss and its gradient seed take
    # 512 B each), and max_memory_allocated is the highest sum of those blocks plus the two cuBLAS
    # workspaces. Weights 64 KiB, input 4 x 128 x 4 = 2 KiB.
    report = fxmem.analyze(nn.Linear(128, 128, bias=False), ["B,128"], optimizer="sgd", batch=4, target="cuda", gpu="h100-80gb")
    peak = report.peak(4)
    assert peak.device is not None
    assert peak.device.allocated == _rounded_peak(report, 4) + WORKSPACES
    # Everything small fits one 2 MiB small segment (the peak is under 1 MiB).
    assert peak.bytes < MiB
    assert peak.device.reserved == WORKSPACES + 2 * MiB
    assert peak.device.total == WORKSPACES + 2 * MiB + DRIVER
    assert report.step_bytes(4) == peak.device.total
    assert report.verdict(report.device_memory or 0).basis == "device total"


def test_overheads_are_configurable_by_name() -> None:
    report = fxmem.analyze(
        nn.Linear(128, 128, bias=False),
        ["B,128"],
        optimizer="sgd",
        batch=4,
        target="cuda",
        overheads={"cuda_context": 0, "cublas_kernels": 0, "cublas_workspace": 0, "cublaslt_workspace": 0},
    )
    peak = report.peak(4)
    assert peak.device is not None
    assert peak.device.allocated == _rounded_peak(report, 4)
    assert peak.device.total == 2 * MiB


def test_sharding_needs_the_cuda_target() -> None:
    with pytest.raises(fxmem.errors.InputSpecError, match="--shard zero3"):
        fxmem.analyze(nn.Linear(4, 4), ["B,4"], target="cpu", shard="zero3", world_size=8)


def test_zero3_on_8_gpus_divides_the_state_per_gpu() -> None:
    # Linear(1024, 1024) + AdamW, mixed precision: 1,049,600 parameters x (2 + 2 + 4 + 8) = 16 B each
    # in all; ZeRO-3 on 8 GPUs keeps 16/8 = 2 B per parameter of each GPU's share, plus the gathered
    # unit: the Linear's 1,049,600 bf16 weights = 2 B per parameter (one unit; no second to prefetch).
    model = nn.Linear(1024, 1024)
    report = fxmem.analyze(model, ["B,1024"], precision="mixed", world_size=8, shard="zero3", batch=4)
    params = 1024 * 1024 + 1024
    assert report.state.total == 16 * params
    assert report.per_gpu.total == 16 * params // 8 + 2 * params
    assert "State per GPU (8 x zero3)" in str(report)


def test_json_carries_the_target_and_the_gpu_counters() -> None:
    report = fxmem.analyze(nn.Linear(128, 128, bias=False), ["B,128"], optimizer="sgd", batch=4, amp="bf16")
    out = report.to_dict()
    assert out["target"] == {
        "target": "cuda",
        "gpu": "h100-80gb",
        "amp": "bf16",
        "precision": "amp",
        "world_size": 1,
        "shard": "none",
        "optimizer_impl": None,
        "torch_version": None,
        "alloc_conf": "",
        "memory_fraction": None,
    }
    device = out["peak"]["steady_step"]["device"]
    assert device["max_memory_allocated"] == report.peak().device.allocated  # type: ignore[union-attr]
    assert device["overheads"]["cuda_context"] == CONTEXT
    assert "autocast bf16" in str(report).splitlines()[1]


def test_a_low_precision_recipe_runs_the_step_in_its_dtype() -> None:
    # precision="bf16" simulates the step as after model.to(torch.bfloat16) with bf16 inputs: the ReLU
    # keeps its 32 outputs at 2 bytes (64 B per sample, not 128), the input batch is 64 x 2 B per
    # sample; the user's model is not touched.
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 2))
    bf16 = fxmem.analyze(model, ["B,64"], precision="bf16", batch=4)
    fp32 = fxmem.analyze(model, ["B,64"], batch=4)
    assert (bf16.activations.per_sample, fp32.activations.per_sample) == (64, 128)
    assert bf16.accounting.inputs.per_sample == 128
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # mixed: bf16 weights and gradients in the step, fp32 master and moments on the GPU: the replay
    # adds the master copy (4 B/param) and doubles the simulated bf16 moments.
    mixed = fxmem.analyze(model, ["B,64"], precision="mixed", batch=4, optimizer="adamw")
    params = 64 * 32 + 32 + 32 * 2 + 2
    assert mixed.state.master == 4 * params and mixed.state.optimizer == 8 * params
    assert mixed.peak(4).device.extra == (("master weights", 4 * params, "fp32 master weights on every GPU"),)  # type: ignore[union-attr]
