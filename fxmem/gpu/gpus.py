"""The GPUs a cuda-target prediction can be for: memory, compute capability, bandwidth and peak FLOP/s.

Every figure comes from the vendor's datasheet or architecture whitepaper named in ``GpuSpec.source``.
Peak rates are *dense* (NVIDIA's datasheets print the 2:4-sparsity rate with an asterisk; we halve it)
and, for tensor cores, with FP32 accumulation, which is what PyTorch's matmuls ask cuBLAS for.

>>> gpu = get_gpu("h100-80gb")
>>> gpu.compute_capability, gpu.memory_bytes // 2**20
((9, 0), 81559)
>>> gpu.peak(torch.bfloat16) / 1e12
989.5
>>> gpu.peak(torch.float32) / 1e12, gpu.peak(torch.float32, tf32=True) / 1e12
(67.0, 494.5)

Note [Which memory total]
~~~~~~~~~~~~~~~~~~~~~~~~~
``memory_bytes`` is the total ``nvidia-smi`` prints in its Memory-Usage column (MiB) with a recent
driver, converted to bytes. It is not the datasheet's "80 GB": for the A100 80GB and the HBM parts it
is that figure read as GiB (81920 MiB), for others a little less (H100: 81559 MiB; H200 "141 GB":
143771 MiB). ``torch.cuda.get_device_properties().total_memory`` reports a few hundred MiB less still
(79.25 GiB on an A100 80GB in its out-of-memory messages), because the driver keeps some for itself
before any process starts. Older drivers printed the smaller figure in nvidia-smi too (V100 32GB:
32510 MiB; T4: 15109 MiB); we keep the recent drivers' total (32768 MiB; 15360 MiB).
The figures were read off nvidia-smi tables published in public repositories, GPU by GPU.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from fxmem.errors import InputSpecError

__all__ = ["GPUS", "GpuSpec", "get_gpu"]

_TFLOPS = 1e12
_GBPS = 1e9
_MiB = 2**20

_FP8_DTYPES = frozenset(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)
)


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model. ``peak_flops`` maps "fp32" (CUDA cores), "tf32", "bf16", "fp16" and "fp8" (tensor
    cores, dense) to FLOP/s; a key is absent where the hardware has no such unit (no bf16 before Ampere,
    no fp8 before Ada/Hopper). Use ``peak(dtype)`` rather than the keys: it knows the fallbacks."""

    name: str
    label: str
    memory_bytes: int
    """The total nvidia-smi shows; see Note [Which memory total]."""
    compute_capability: tuple[int, int]
    bandwidth: float
    """Peak memory bandwidth, bytes/s."""
    peak_flops: Mapping[str, float] = field(hash=False)
    source: str

    def peak(self, dtype: torch.dtype, *, tf32: bool = False) -> float:
        """Dense peak FLOP/s of a matmul in ``dtype``; ``tf32`` asks for float32 on TF32 tensor cores
        (``torch.backends.cuda.matmul.allow_tf32``), which only Ampere and later have.

        bf16 on a GPU without bf16 tensor cores (V100, T4) gets the FP32 rate: the math runs on the
        CUDA cores there, so the FP32 peak is an upper bound for it.
        """
        rates = self.peak_flops
        if dtype == torch.float32:
            return rates["tf32"] if tf32 and "tf32" in rates else rates["fp32"]
        if dtype == torch.bfloat16:
            return rates.get("bf16", rates["fp32"])
        if dtype == torch.float16:
            return rates["fp16"]
        if dtype in _FP8_DTYPES and "fp8" in rates:
            return rates["fp8"]
        known = ", ".join(sorted(rates))
        raise InputSpecError(
            f"no peak FLOP/s for dtype {dtype} on {self.label}: the table has {known}. "
            "Use float32, bfloat16 or float16 (float8 on Ada, Hopper and later)."
        )


def _rates(
    fp32: float, tf32: float | None = None, bf16: float | None = None, fp16: float | None = None, fp8: float | None = None
) -> Mapping[str, float]:
    """TFLOPS as printed (dense) -> a read-only FLOP/s table without the units the GPU lacks."""
    pairs = {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16, "fp8": fp8}
    return MappingProxyType({k: v * _TFLOPS for k, v in pairs.items() if v is not None})


# Datasheets and whitepapers, by title and address. The Hopper, Ada data-center and A100 datasheets
# print tensor-core rates "with sparsity"; the dense rate is half (their footnote says so).
_A100 = "NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet, https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/"
_L4 = "NVIDIA L4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/l4/"
_L40S = "NVIDIA L40S GPU datasheet, https://www.nvidia.com/en-us/data-center/l40s/"
_ADA = "NVIDIA Ada GPU Architecture whitepaper, Appendix A (GeForce RTX 4090), https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
_GA102 = "NVIDIA Ampere GA102 GPU Architecture whitepaper v2, Appendix A (GeForce RTX 3090), https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"
_V100 = "NVIDIA V100 Tensor Core GPU datasheet (SXM2), https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"
_T4 = "NVIDIA T4 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf"

_TABLE = (
    # A100 SXM: FP32 19.5, TF32 156 (312 sparse), BF16/FP16 312 (624 sparse); 1,555 GB/s (40GB), 2,039 GB/s (80GB).
    GpuSpec("a100-40gb", "NVIDIA A100 40GB SXM", 40960 * _MiB, (8, 0), 1555 * _GBPS, _rates(19.5, 156, 312, 312), _A100),
    GpuSpec("a100-80gb", "NVIDIA A100 80GB SXM", 81920 * _MiB, (8, 0), 2039 * _GBPS, _rates(19.5, 156, 312, 312), _A100),
    # H100 SXM: FP32 67, TF32 989*, BF16/FP16 1,979*, FP8 3,958* (* sparse); 3.35 TB/s.
    GpuSpec("h100-80gb", "NVIDIA H100 80GB SXM", 81559 * _MiB, (9, 0), 3350 * _GBPS, _rates(67, 494.5, 989.5, 989.5, 1979), _H100),
    # H100 PCIe: FP32 51, TF32 756*, BF16/FP16 1,513*, FP8 3,026*; 2 TB/s.
    GpuSpec("h100-pcie", "NVIDIA H100 80GB PCIe", 81559 * _MiB, (9, 0), 2000 * _GBPS, _rates(51, 378, 756.5, 756.5, 1513), _H100),
    # H200 SXM: same compute as the H100 SXM; 141 GB HBM3e at 4.8 TB/s.
    GpuSpec("h200", "NVIDIA H200 141GB SXM", 143771 * _MiB, (9, 0), 4800 * _GBPS, _rates(67, 494.5, 989.5, 989.5, 1979), _H200),
    # L4: FP32 30.3, TF32 120*, BF16/FP16 242*, FP8 485*; 300 GB/s.
    GpuSpec("l4", "NVIDIA L4 24GB", 23034 * _MiB, (8, 9), 300 * _GBPS, _rates(30.3, 60, 121, 121, 242.5), _L4),
    # L40S: FP32 91.6, TF32 183 (366*), BF16/FP16 362.05 (733*), FP8 733 (1,466*); 864 GB/s.
    GpuSpec("l40s", "NVIDIA L40S 48GB", 46068 * _MiB, (8, 9), 864 * _GBPS, _rates(91.6, 183, 362.05, 362.05, 733), _L40S),
    # RTX 4090: FP32 82.6; FP16 and BF16 tensor with FP32 accumulate 165.2; TF32 82.6; FP8 (FP32 acc.) 330.3; 1,008 GB/s.
    GpuSpec("rtx4090", "NVIDIA GeForce RTX 4090 24GB", 24564 * _MiB, (8, 9), 1008 * _GBPS, _rates(82.6, 82.6, 165.2, 165.2, 330.3), _ADA),
    # RTX 3090: FP32 35.6; FP16 and BF16 tensor with FP32 accumulate 71; TF32 35.6; 936 GB/s.
    GpuSpec("rtx3090", "NVIDIA GeForce RTX 3090 24GB", 24576 * _MiB, (8, 6), 936 * _GBPS, _rates(35.6, 35.6, 71, 71), _GA102),
    # V100 SXM2 32GB: FP32 15.7, tensor (FP16 in, FP32 accumulate) 125; no TF32 or bf16 units; 900 GB/s.
    GpuSpec("v100-32gb", "NVIDIA V100 32GB SXM2", 32768 * _MiB, (7, 0), 900 * _GBPS, _rates(15.7, fp16=125), _V100),
    # T4: FP32 8.1, mixed-precision FP16/FP32 tensor 65; no TF32 or bf16 units; 320 GB/s ("320+ GB/s").
    GpuSpec("t4", "NVIDIA T4 16GB", 15360 * _MiB, (7, 5), 320 * _GBPS, _rates(8.1, fp16=65), _T4),
)

GPUS: Mapping[str, GpuSpec] = MappingProxyType({g.name: g for g in _TABLE})
"""Known GPUs by name, the names ``--gpu`` accepts."""


def get_gpu(name: str) -> GpuSpec:
    """The GPU called ``name`` (case and surrounding spaces ignored); an unknown name is an InputSpecError
    that lists the known ones."""
    key = name.strip().lower()
    if key in GPUS:
        return GPUS[key]
    close = [n for n in GPUS if key and n.startswith(key)] or difflib.get_close_matches(key, list(GPUS), n=1)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise InputSpecError(f"unknown GPU {name!r} (--gpu): use one of {', '.join(GPUS)}.{hint}")
