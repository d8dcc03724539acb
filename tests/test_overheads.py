"""The fixed CUDA costs: workspace arithmetic, per-architecture defaults, overrides, and counters."""

from __future__ import annotations

import doctest

import pytest

import fxmem.gpu.overheads
from fxmem.errors import InputSpecError
from fxmem.gpu.allocator import replay
from fxmem.gpu.gpus import get_gpu
from fxmem.gpu.overheads import (
    CONTEXT_BYTES,
    CUBLAS_KERNELS_BYTES,
    CUDNN_KERNELS_BYTES,
    Where,
    cublas_workspace_size,
    cuda_overheads,
    parse_cublas_workspace_config,
)
from fxmem.rules import torch_release

KiB, MiB = 2**10, 2**20


def test_docstring_examples() -> None:
    result = doctest.testmod(fxmem.gpu.overheads, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    ("config", "nbytes"),
    [
        (":4096:8", 8 * 4096 * KiB),  # 8 x 4096 KiB = 32 MiB, torch's Hopper default
        (":4096:2:16:8", 2 * 4096 * KiB + 8 * 16 * KiB),  # 8 MiB + 128 KiB = 8,519,680 B, the pre-Hopper default
        (":16:8", 8 * 16 * KiB),  # the deterministic-mode setting torch's docs suggest
        (":0:0", 0),
    ],
)
def test_workspace_config_arithmetic(config: str, nbytes: int) -> None:
    assert parse_cublas_workspace_config(config) == nbytes


def test_pre_hopper_default_matches_the_measured_leftover() -> None:
    # pytorch/pytorch#95668: one Linear on an A10G (sm_86) left 8,519,680 B in memory_allocated.
    assert cublas_workspace_size(get_gpu("rtx3090")) == 8_519_680


def test_unparsable_workspace_config_is_an_input_error() -> None:
    with pytest.raises(InputSpecError, match="':SIZE:COUNT'"):
        parse_cublas_workspace_config("4096x8")


@pytest.mark.parametrize(
    ("name", "each"), [("h100-80gb", 32 * MiB), ("h200", 32 * MiB), ("a100-80gb", 8_519_680), ("l40s", 8_519_680), ("t4", 8_519_680)]
)
def test_cublas_default_depends_on_the_architecture(name: str, each: int) -> None:
    # 32 MiB for compute capability 9.x-12.x, ":4096:2:16:8" below; two workspaces in a training step.
    line = cuda_overheads(get_gpu(name), cublas_workspace_config=None).line("cublas_workspace")
    assert (line.nbytes, line.pieces, line.where) == (2 * each, (each, each), Where.PERSISTENT)


def test_counters_split_driver_and_allocator_lines() -> None:
    o = cuda_overheads(get_gpu("h100-80gb"), cublas_workspace_config=None, cublaslt_unified=True)
    # Driver: the context (518 MiB, NVML on an H200) and the cuBLAS and cuDNN modules loaded lazily
    # (165,675,008 and 8 MiB on the same H200). Allocator: 2 x 32 MiB cuBLAS; cuBLASLt shares them.
    assert o.driver_bytes == CONTEXT_BYTES + CUBLAS_KERNELS_BYTES + CUDNN_KERNELS_BYTES == 543_162_368 + 165_675_008 + 8 * MiB
    assert o.allocator_bytes == 64 * MiB
    assert o.initial_allocations() == (32 * MiB, 32 * MiB)
    assert o.nvidia_smi(peak_reserved=1000 * MiB) == 1000 * MiB + o.driver_bytes
    assert o.without("cudnn_kernels").driver_bytes == o.driver_bytes - 8 * MiB
    assert [name for name, _, _ in o.lines()] == [
        "cuda_context",
        "cublas_kernels",
        "cudnn_kernels",
        "cublas_workspace",
        "cublaslt_workspace",
    ]
    assert all(why for _, _, why in o.lines())


def test_cuda_context_is_the_h200s_measured_one() -> None:
    # shared/gpu/steps_h200.json, cuda_context.nvml_after_context: NVML's per-process figure once torch
    # had made its context, 543,162,368 B = 518 MiB as nvidia-smi prints it (driver 580.159).
    assert CONTEXT_BYTES == 543_162_368 and CONTEXT_BYTES // MiB == 518
    # cuBLAS's modules: the device's used bytes less torch's reserved, 718,077,952 after the first fp32
    # matmul against 552,402,944 with the bare context; cuDNN's: 726,466,560 after a convolution.
    assert CUBLAS_KERNELS_BYTES == 718_077_952 - 552_402_944
    assert CUDNN_KERNELS_BYTES == 726_466_560 - 718_077_952
    assert "measured on this GPU" in cuda_overheads(get_gpu("h200")).line("cuda_context").why
    assert "an estimate for this GPU" in cuda_overheads(get_gpu("a100-80gb")).line("cuda_context").why


def test_cublaslt_has_its_own_workspace_before_torch_2_12() -> None:
    # An H200 on torch 2.11 held one 1 MiB block more than the two cuBLAS workspaces before each step,
    # allocated by a Linear's forward (tests/data/h200/trace_steps.json.gz): cuBLASLt's own
    # CUBLASLT_WORKSPACE_SIZE (1024 KiB), on the forward's thread only. From 2.12 it shares cuBLAS's.
    separate = cuda_overheads(get_gpu("h200"), cublaslt_unified=False)
    assert separate.line("cublaslt_workspace").pieces == (1024 * KiB,)
    assert separate.initial_allocations() == (32 * MiB, 32 * MiB, MiB)
    assert cuda_overheads(get_gpu("h200"), cublaslt_unified=True).line("cublaslt_workspace").nbytes == 0
    assert cuda_overheads(get_gpu("h200"), release=(2, 11)).line("cublaslt_workspace").nbytes == MiB
    assert cuda_overheads(get_gpu("h200"), release=(2, 12)).line("cublaslt_workspace").nbytes == 0
    assert torch_release("2.11.0+cu130") == (2, 11) and torch_release("2.13") == (2, 13)


def test_workspace_config_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # CUBLAS_WORKSPACE_CONFIG=:4096:2 (two 4 MiB chunks = 8 MiB per workspace) where fxmem runs.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2")
    assert cuda_overheads(get_gpu("h200")).line("cublas_workspace").pieces == (8 * MiB, 8 * MiB)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    assert cuda_overheads(get_gpu("h200")).line("cublas_workspace").pieces == (32 * MiB, 32 * MiB)


def test_arguments_replace_defaults() -> None:
    o = cuda_overheads(
        get_gpu("a100-80gb"), context_bytes=300 * MiB, cublas_workspace_config=":4096:8", blas_workspaces=1, cublaslt_unified=True
    )
    assert [(n, b) for n, b, _ in o.lines()] == [
        ("cuda_context", 300 * MiB),
        ("cublas_kernels", CUBLAS_KERNELS_BYTES),
        ("cudnn_kernels", CUDNN_KERNELS_BYTES),
        ("cublas_workspace", 32 * MiB),
        ("cublaslt_workspace", 0),
    ]
    assert o.initial_allocations() == (32 * MiB,)
    with pytest.raises(InputSpecError, match="context_bytes"):
        cuda_overheads(get_gpu("t4"), context_bytes=-1)


def test_overrides_by_line_name() -> None:
    o = cuda_overheads(get_gpu("h100-80gb")).with_overrides({"cuda_context": 600 * MiB, "cublas_workspace": 16 * MiB})
    assert o.driver_bytes == 600 * MiB + CUBLAS_KERNELS_BYTES + CUDNN_KERNELS_BYTES
    assert o.line("cublas_workspace").pieces == (8 * MiB, 8 * MiB)  # 16 MiB over the same two workspaces
    assert "set by --overhead cuda_context" in o.line("cuda_context").why
    odd = cuda_overheads(get_gpu("h100-80gb")).with_overrides({"cublas_workspace": 3})
    assert odd.line("cublas_workspace").pieces == (3,)  # does not split evenly: one block
    with pytest.raises(InputSpecError, match="cuda_context, cublas_kernels"):
        cuda_overheads(get_gpu("h100-80gb")).with_overrides({"cuda_ctx": 1})
    with pytest.raises(InputSpecError, match="0 or more"):
        cuda_overheads(get_gpu("h100-80gb")).with_overrides({"cuda_context": -5})


def test_persistent_workspaces_feed_the_allocator_replay() -> None:
    # Two 32 MiB workspaces (>= 10 MiB: 32 MiB segments each) before a 5 MiB activation (20 MiB segment).
    o = cuda_overheads(get_gpu("h100-80gb"))
    initial = [(-(i + 1), n) for i, n in enumerate(o.initial_allocations())]
    r = replay([(0, 5 * MiB)], initial=initial)
    assert (r.peak_allocated, r.peak_reserved) == (69 * MiB, 84 * MiB)
