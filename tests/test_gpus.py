"""The GPU table: consistent entries, the lookup, the dtype -> peak FLOP/s rules, and described GPUs."""

from __future__ import annotations

import doctest

import pytest
import torch

import fxmem.gpu.gpus
from fxmem.errors import InputSpecError
from fxmem.gpu.gpus import GPUS, GpuSpec, get_gpu

REQUIRED = ("a100-40gb", "a100-80gb", "h100-80gb", "h100-pcie", "h200", "l4", "l40s", "rtx4090", "rtx3090", "v100-32gb", "t4")

# The entries of issue 35, as their cited sheets print them (fxmem/gpu/gpus.py names each sheet): TFLOPS as
# (dense, sparse*) where the sheet prints both, (None, sparse*) where it prints only the rate with sparsity;
# GB/s; and the MiB total nvidia-smi shows (Note [Which memory total]).
SHEETS = {
    # H100 datasheet, H100 NVL column: FP32 60, TF32 835*, BF16 1,671*, FP16 1,671*, FP8 3,341*; 94GB at 3.9TB/s.
    "h100-nvl": {"fp32": 60, "tf32": (None, 835), "bf16": (None, 1671), "fp16": (None, 1671), "fp8": (None, 3341), "GB/s": 3900, "MiB": 95830},
    # L40 datasheet: FP32 90.5, TF32 90.5 | 181*, BF16 and FP16 181.05 | 362.1*, FP8 362 | 724*; 864GB/s.
    "l40": {"fp32": 90.5, "tf32": (90.5, 181), "bf16": (181.05, 362.1), "fp16": (181.05, 362.1), "fp8": (362, 724), "GB/s": 864, "MiB": 46068},
    # A40 datasheet: FP32 37.4, TF32 74.8 | 149.6*, BF16 (FP32 accumulate) and FP16 149.7 | 299.4*; 696GB/s.
    "a40": {"fp32": 37.4, "tf32": (74.8, 149.6), "bf16": (149.7, 299.4), "fp16": (149.7, 299.4), "GB/s": 696, "MiB": 46068},
    # A10 datasheet: FP32 31.2, TF32 62.5 | 125*, BF16 and FP16 125 | 250*; 600GB/s.
    "a10": {"fp32": 31.2, "tf32": (62.5, 125), "bf16": (125, 250), "fp16": (125, 250), "GB/s": 600, "MiB": 23028},
    # GA102 whitepaper v2, RTX A6000: FP32 38.7, TF32 77.4 | 154.8*, BF16 and FP16 (FP32 accumulate) 154.8 | 309.7*; 768GB/s.
    "a6000": {"fp32": 38.7, "tf32": (77.4, 154.8), "bf16": (154.8, 309.7), "fp16": (154.8, 309.7), "GB/s": 768, "MiB": 49140},
    # GA102 whitepaper v2, RTX 3080: FP32 29.8, TF32 29.8 | 59.5*, BF16 and FP16 (FP32 accumulate) 59.5 | 119*; 760GB/s.
    "rtx3080": {"fp32": 29.8, "tf32": (29.8, 59.5), "bf16": (59.5, 119), "fp16": (59.5, 119), "GB/s": 760, "MiB": 10240},
}


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


@pytest.mark.parametrize("name", list(SHEETS))
def test_new_entries_hold_their_sheets_figures(name: str) -> None:
    gpu, sheet = GPUS[name], SHEETS[name]
    assert gpu.memory_bytes == sheet["MiB"] * 2**20
    assert gpu.bandwidth == sheet["GB/s"] * 1e9
    assert gpu.peak_flops["fp32"] == pytest.approx(sheet["fp32"] * 1e12)
    tensor = {unit: pair for unit, pair in sheet.items() if isinstance(pair, tuple)}
    assert set(gpu.peak_flops) == {"fp32", *tensor}
    for unit, (dense, sparse) in tensor.items():
        expected = dense if dense is not None else sparse / 2  # a sparse-only sheet: half its figure
        assert gpu.peak_flops[unit] == pytest.approx(expected * 1e12), unit


@pytest.mark.parametrize("name", list(SHEETS))
def test_sheets_that_print_both_rates_print_the_dense_one_as_half(name: str) -> None:
    # So taking the printed dense figure and halving a sparse-only one are the same rule: 299.4 / 2 = 149.7
    # (A40 FP16); the sheets round to one decimal, 309.7 / 2 = 154.85 printed 154.8 (RTX A6000).
    pairs = [pair for pair in SHEETS[name].values() if isinstance(pair, tuple) and pair[0] is not None]
    assert all(dense == pytest.approx(sparse / 2, abs=0.051) for dense, sparse in pairs)


def test_geforce_accumulates_in_fp32_at_half_the_professional_rate() -> None:
    # Same GA102 chip: the RTX 3080's FP16 with FP32 accumulate is 2x its FP32 rate (59.5 vs 29.8), the
    # RTX A6000's and A40's 4x (154.8 vs 38.7; 149.7 vs 37.4), as their sheets print.
    ratio = {n: GPUS[n].peak(torch.float16) / GPUS[n].peak(torch.float32) for n in ("rtx3080", "rtx3090", "a6000", "a40", "a10")}
    assert ratio["rtx3080"] == pytest.approx(2, rel=0.01) and ratio["rtx3090"] == pytest.approx(2, rel=0.01)
    assert ratio["a6000"] == pytest.approx(4, rel=0.01) and ratio["a40"] == pytest.approx(4, rel=0.01)
    assert ratio["a10"] == pytest.approx(4, rel=0.01)  # 125 / 31.2


EXAMPLE = "memory=12GiB,cc=8.6,bandwidth=360GB/s,fp32=12.7,fp16=51"


def test_a_description_is_parsed_exactly() -> None:
    gpu = get_gpu(EXAMPLE)
    assert gpu.memory_bytes == 12 * 2**30  # 12,884,901,888 bytes
    assert gpu.compute_capability == (8, 6)
    assert gpu.bandwidth == 360e9  # 360 GB/s
    assert gpu.peak_flops == {"fp32": 12.7e12, "fp16": 51e12}  # TFLOPS x 10^12, no float rounding: 12.7 x 10^12 exactly
    assert gpu.name == EXAMPLE and get_gpu(gpu.name) == gpu
    assert gpu.label == "a described GPU (sm_86, 12GiB)"


def test_a_description_without_a_unit_falls_back_as_the_table_does() -> None:
    gpu = get_gpu(EXAMPLE)
    assert gpu.peak(torch.bfloat16) == 12.7e12  # no bf16 given: the FP32 rate, as on a V100
    assert gpu.peak(torch.float32, tf32=True) == 12.7e12  # no tf32 given: the flag changes nothing
    assert get_gpu("memory=12GiB,cc=8.6,bandwidth=360GB/s,fp32=12.7").peak(torch.float16) == 12.7e12
    with pytest.raises(InputSpecError, match="float8"):
        gpu.peak(torch.float8_e4m3fn)


def test_a_description_has_one_canonical_spelling() -> None:
    # Keys in any order and case, aliases, spaces, TB/s and a TFLOPS suffix: one name, which parses back to the same GPU.
    gpu = get_gpu(" Name=My H100 , bf16=989.5TFLOPS, fp32=67, bandwidth=3.35TB/s, compute_capability=9.0, memory=1.5GiB ")
    assert gpu.name == "memory=1536MiB,cc=9.0,bandwidth=3350GB/s,fp32=67,bf16=989.5,label=My H100"
    assert gpu.label == "My H100" and gpu.memory_bytes == 1536 * 2**20 and gpu.bandwidth == 3.35e12
    assert get_gpu(gpu.name) == gpu
    assert get_gpu("memory=24GB,cc=8.6,bandwidth=600GB/s,fp32=31.2").name.startswith("memory=24GB,")  # 24 x 10^9 is no whole GiB


def test_describe_builds_the_same_gpu_from_python() -> None:
    spec = GpuSpec.describe(memory="12GiB", compute_capability=(8, 6), bandwidth="360GB/s", fp32=12.7, fp16=51)
    assert spec == get_gpu(EXAMPLE) and spec.name == EXAMPLE
    in_units = GpuSpec.describe(memory=12 * 2**30, compute_capability="8.6", bandwidth=360e9, fp32=12.7, fp16=51.0)
    assert in_units == spec  # bytes and bytes/s given as numbers
    with pytest.raises(InputSpecError, match="cannot hold a comma"):
        GpuSpec.describe(memory="1GiB", compute_capability=(9, 0), bandwidth="1TB/s", fp32=1, label="a,b")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("memory=12GiB,cc=8.6,bandwidth=360GB/s", ["lacks fp32", "memory, cc, bandwidth and fp32"], id="missing-key"),
        pytest.param("memory=12GiB,cc=8.6,bandwidth=360,fp32=12.7", ["--gpu bandwidth '360'", "GB/s or TB/s"], id="bandwidth-without-unit"),
        pytest.param("memory=12GiB,cc=8.6,bandwidth=360GiB/s,fp32=12.7", ["--gpu bandwidth '360GiB/s'", "GB/s or TB/s"], id="bad-unit"),
        pytest.param("memory=12,cc=8.6,bandwidth=360GB/s,fp32=12.7", ["--gpu memory '12' has no unit", "12GiB"], id="memory-without-unit"),
        pytest.param(f"{EXAMPLE},fp64=1", ["unknown key 'fp64'", "memory, cc, bandwidth, fp32, tf32, bf16, fp16, fp8, label"], id="unknown-key"),
        pytest.param("memory=12GiB,cc=86,bandwidth=360GB/s,fp32=12.7", ["--gpu cc '86'", "MAJOR.MINOR"], id="bad-cc"),
        pytest.param(f"{EXAMPLE},compute_capability=8.6", ["cc is given twice"], id="repeated-key"),
        pytest.param("memory=12GiB,cc=8.6,bandwidth=360GB/s,fp32=12.7,fp16=0", ["--gpu fp16 '0' is 0", "dense TFLOPS"], id="zero-rate"),
        pytest.param("memory=12GiB,cc=8.6,bandwidth=360GB/s,fp32", ["'fp32' is not KEY=VALUE", "the keys are"], id="no-value"),
    ],
)
def test_bad_descriptions_name_the_key(text: str, expected: list[str]) -> None:
    with pytest.raises(InputSpecError) as err:
        get_gpu(text)
    assert all(fragment in str(err.value) for fragment in expected), str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_gpu_points_to_descriptions() -> None:
    with pytest.raises(InputSpecError, match="described from its datasheet instead, e.g. --gpu memory=12GiB"):
        get_gpu("rtx3060")
