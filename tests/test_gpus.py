"""The GPU table: consistent entries, the lookup, and the dtype -> peak FLOP/s rules."""

from __future__ import annotations

import doctest

import pytest
import torch

import fxmem.gpu.gpus
from fxmem.errors import InputSpecError
from fxmem.gpu.gpus import GPUS, GpuSpec, get_gpu

REQUIRED = ("a100-40gb", "a100-80gb", "h100-80gb", "h100-pcie", "h200", "l4", "l40s", "rtx4090", "rtx3090", "v100-32gb", "t4")


def test_docstring_examples() -> None:
    result = doctest.testmod(fxmem.gpu.gpus, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_required_gpus_are_present_and_keyed_by_name() -> None:
    assert set(REQUIRED) <= set(GPUS)
    assert all(key == gpu.name for key, gpu in GPUS.items())
    assert len({g.label for g in GPUS.values()}) == len(GPUS)  # labels tell GPUs apart in reports


@pytest.mark.parametrize("gpu", list(GPUS.values()), ids=lambda g: g.name)
def test_entry_is_consistent(gpu: GpuSpec) -> None:
    assert gpu.memory_bytes > 0 and gpu.memory_bytes % 2**20 == 0  # nvidia-smi totals are whole MiB
    assert gpu.bandwidth > 0
    major, minor = gpu.compute_capability
    assert 7 <= major <= 9 and 0 <= minor <= 9
    assert gpu.peak(torch.bfloat16) >= gpu.peak(torch.float32) > 0
    assert gpu.peak(torch.float16) >= gpu.peak(torch.float32)
    assert gpu.peak(torch.float32, tf32=True) >= gpu.peak(torch.float32)
    assert set(gpu.peak_flops) <= {"fp32", "tf32", "bf16", "fp16", "fp8"}
    assert "https://" in gpu.source


def test_units_follow_the_architecture() -> None:
    # TF32 and bf16 tensor cores came with Ampere (sm_80), FP8 with Ada (sm_89) and Hopper (sm_90).
    for gpu in GPUS.values():
        assert ("tf32" in gpu.peak_flops) == (gpu.compute_capability >= (8, 0)), gpu.name
        assert ("bf16" in gpu.peak_flops) == (gpu.compute_capability >= (8, 0)), gpu.name
        assert ("fp8" in gpu.peak_flops) == (gpu.compute_capability >= (8, 9)), gpu.name


def test_dense_rates_are_half_the_sparse_datasheet_figures() -> None:
    # The H100 SXM datasheet prints BF16 1,979 TFLOPS and TF32 989 TFLOPS "with sparsity".
    h100 = get_gpu("h100-80gb")
    assert h100.peak(torch.bfloat16) == 1979e12 / 2
    assert h100.peak(torch.float32, tf32=True) == 989e12 / 2
    assert h100.peak(torch.float8_e4m3fn) == 3958e12 / 2
    # The H200 differs only in memory: 141 GB HBM3e at 4.8 TB/s against 80 GB at 3.35 TB/s.
    h200 = get_gpu("h200")
    assert h200.peak_flops == h100.peak_flops
    assert h200.memory_bytes > h100.memory_bytes and h200.bandwidth > h100.bandwidth


def test_no_bf16_units_fall_back_to_fp32_and_no_tf32_ignores_the_flag() -> None:
    v100 = get_gpu("v100-32gb")
    assert v100.peak(torch.bfloat16) == v100.peak(torch.float32) == pytest.approx(15.7e12)
    assert v100.peak(torch.float32, tf32=True) == v100.peak(torch.float32)
    assert v100.peak(torch.float16) == 125e12


def test_unknown_dtype_is_an_input_error() -> None:
    with pytest.raises(InputSpecError, match="float64"):
        get_gpu("a100-80gb").peak(torch.float64)
    with pytest.raises(InputSpecError, match="float8"):
        get_gpu("a100-80gb").peak(torch.float8_e4m3fn)  # Ampere has no FP8 units


def test_lookup_ignores_case_and_spaces() -> None:
    assert get_gpu(" H100-80GB ") is GPUS["h100-80gb"]


def test_unknown_gpu_lists_the_known_names() -> None:
    with pytest.raises(InputSpecError) as err:
        get_gpu("h100")
    message = str(err.value)
    assert all(name in message for name in REQUIRED)
    assert "--gpu" in message and "Did you mean 'h100-" in message
    with pytest.raises(InputSpecError, match="unknown GPU 'tpu-v5'"):
        get_gpu("tpu-v5")


def test_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        GPUS["mine"] = GPUS["t4"]  # type: ignore[index]
    with pytest.raises(TypeError):
        GPUS["t4"].peak_flops["fp32"] = 0.0  # type: ignore[index]
