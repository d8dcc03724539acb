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

A GPU that is not in the table is described instead of named (Note [Describing a GPU]):

>>> mine = get_gpu("memory=12GiB, cc=8.6, bandwidth=360GB/s, fp32=12.7, fp16=51")
>>> mine.name, mine.memory_bytes == 12 * 2**30, mine.peak(torch.float16) / 1e12
('memory=12GiB,cc=8.6,bandwidth=360GB/s,fp32=12.7,fp16=51', True, 51.0)
>>> GpuSpec.describe(memory="12GiB", compute_capability=(8, 6), bandwidth="360GB/s", fp32=12.7, fp16=51) == mine
True

Note [Which memory total]
~~~~~~~~~~~~~~~~~~~~~~~~~
``memory_bytes`` is the total ``nvidia-smi`` prints in its Memory-Usage column (MiB) with a recent
driver, converted to bytes. It is not the datasheet's "80 GB": for the A100 80GB and the HBM parts it
is that figure read as GiB (81920 MiB), for others a little less (H100: 81559 MiB; H200 "141 GB":
143771 MiB). ``torch.cuda.get_device_properties().total_memory`` reports a few hundred MiB less still
(79.25 GiB on an A100 80GB in its out-of-memory messages), because the driver keeps some for itself
before any process starts. Older drivers printed the smaller figure in nvidia-smi too (V100 32GB:
32510 MiB; T4: 15109 MiB); we keep the recent drivers' total (32768 MiB; 15360 MiB; RTX 3080:
10018 MiB then, 10240 MiB now). ECC on GDDR6 keeps about a sixteenth for itself: the A40 and L40 show
46068 MiB with ECC on, as data-center cards ship, and 49140 MiB with it off, as the RTX A6000 is run.
The figures were read off nvidia-smi tables published in public repositories, GPU by GPU; none is the
marketed size converted. A card whose total is not known to us is left out of the table rather than
given its marketed "12 GB" read as 12288 MiB, which overstates what the driver leaves by up to a few
hundred MiB; describe such a card instead, with the total its own nvidia-smi shows.

Note [Describing a GPU]
~~~~~~~~~~~~~~~~~~~~~~~
``--gpu`` takes a description wherever it takes a name: comma-separated KEY=VALUE pairs, ``memory`` (with
a unit, best the nvidia-smi total: memory=12288MiB), ``cc`` (compute capability, MAJOR.MINOR; nvidia-smi
--query-gpu=compute_cap --format=csv prints it), ``bandwidth`` (GB/s or TB/s) and ``fp32`` required;
``tf32``, ``bf16``, ``fp16``, ``fp8`` and ``label`` optional. Rates are dense TFLOPS: where a datasheet
prints a rate "with sparsity" (an asterisk), give half of it. The description is parsed into a GpuSpec
whose ``name`` is the description in one canonical spelling (keys in the order above, memory in the
unit that spells it exactly with the fewest digits, bandwidth in GB/s), so ``get_gpu(spec.name) == spec``, and a ``TrainingSetup`` or an
``analyze(gpu=...)`` that holds only the string holds the whole GPU. Values are parsed exactly (as
decimals) and rounded to whole bytes, bytes/s and FLOP/s, so the spelling round-trips.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from types import MappingProxyType

import torch

from fxmem.errors import InputSpecError
from fxmem.inputs import parse_size

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
        CUDA cores there, so the FP32 peak is an upper bound for it. Every GPU in the table has an fp16
        rate; a described one without it gets the FP32 rate too.
        """
        rates = self.peak_flops
        if dtype == torch.float32:
            return rates["tf32"] if tf32 and "tf32" in rates else rates["fp32"]
        if dtype == torch.bfloat16:
            return rates.get("bf16", rates["fp32"])
        if dtype == torch.float16:
            return rates.get("fp16", rates["fp32"])
        if dtype in _FP8_DTYPES and "fp8" in rates:
            return rates["fp8"]
        known = ", ".join(sorted(rates))
        raise InputSpecError(
            f"no peak FLOP/s for dtype {dtype} on {self.label}: the table has {known}. "
            "Use float32, bfloat16 or float16 (float8 on Ada, Hopper and later)."
        )

    @classmethod
    def describe(
        cls,
        *,
        memory: str | int,
        compute_capability: tuple[int, int] | str,
        bandwidth: str | float,
        fp32: float,
        tf32: float | None = None,
        bf16: float | None = None,
        fp16: float | None = None,
        fp8: float | None = None,
        label: str | None = None,
    ) -> GpuSpec:
        """A GPU that is not in the table, from its datasheet: ``memory`` with a unit ("12GiB", best the
        nvidia-smi total) or in bytes, ``bandwidth`` with a unit ("360GB/s") or in bytes/s, and dense TFLOPS
        per unit. The result's ``name`` is the canonical description, which ``get_gpu``, ``--gpu`` and
        ``analyze(gpu=...)`` accept; see Note [Describing a GPU].

        >>> GpuSpec.describe(memory="24GiB", compute_capability=(8, 6), bandwidth="0.6TB/s", fp32=31.2).name
        'memory=24GiB,cc=8.6,bandwidth=600GB/s,fp32=31.2'
        """
        if label is not None and "," in label:
            raise InputSpecError(f"GpuSpec.describe label {label!r}: a label cannot hold a comma, which separates a description's keys.")
        cc = compute_capability if isinstance(compute_capability, str) else ".".join(str(n) for n in compute_capability)
        values = {
            "memory": memory if isinstance(memory, str) else f"{memory}B",
            "cc": cc,
            "bandwidth": bandwidth if isinstance(bandwidth, str) else f"{_decimal_text(Decimal(repr(bandwidth)) / 10**9)}GB/s",
            "label": label,
        }
        rates = {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16, "fp8": fp8}
        values |= {unit: None if rate is None else _number_text(rate) for unit, rate in rates.items()}
        text = ",".join(f"{key}={value}" for key, value in values.items() if value is not None)
        return _described(text, where="GpuSpec.describe")


def _rates(
    fp32: float, tf32: float | None = None, bf16: float | None = None, fp16: float | None = None, fp8: float | None = None
) -> Mapping[str, float]:
    """TFLOPS as printed (dense) -> a read-only FLOP/s table without the units the GPU lacks."""
    pairs = {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16, "fp8": fp8}
    return MappingProxyType({k: v * _TFLOPS for k, v in pairs.items() if v is not None})


# Datasheets and whitepapers, by title and address. The Hopper, Ada data-center and A100 datasheets
# print tensor-core rates "with sparsity"; the dense rate is half (their footnote says so). The A10, A40,
# L40 and L40S sheets and the GA102 whitepaper print both, "dense | sparse*"; we take the dense one, and
# tests/test_gpus.py checks it is half the sparse one.
_A100 = "NVIDIA A100 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet, https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/"
_L4 = "NVIDIA L4 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/l4/"
_L40S = "NVIDIA L40S GPU datasheet, https://www.nvidia.com/en-us/data-center/l40s/"
_ADA = "NVIDIA Ada GPU Architecture whitepaper, Appendix A (GeForce RTX 4090), https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
_GA102 = "NVIDIA Ampere GA102 GPU Architecture whitepaper v2, Appendix A (GeForce RTX 3090), https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"
_V100 = "NVIDIA V100 Tensor Core GPU datasheet (SXM2), https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"
_T4 = "NVIDIA T4 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf"
_A10 = "NVIDIA A10 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/products/a10-gpu/"
_A40 = "NVIDIA A40 datasheet, https://www.nvidia.com/en-us/data-center/a40/"
_L40 = "NVIDIA L40 GPU datasheet, https://www.nvidia.com/en-us/data-center/l40/"
_A6000 = "NVIDIA Ampere GA102 GPU Architecture whitepaper v2, the RTX A6000 tables, https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"
_RTX3080 = "NVIDIA Ampere GA102 GPU Architecture whitepaper v2, RTX 3080 vs RTX 2080 Super, https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"
# Compute capabilities: NVIDIA's list, https://developer.nvidia.com/cuda-gpus (GA10x 8.6, Ada 8.9, Hopper 9.0).

_TABLE = (
    # A100 SXM: FP32 19.5, TF32 156 (312 sparse), BF16/FP16 312 (624 sparse); 1,555 GB/s (40GB), 2,039 GB/s (80GB).
    GpuSpec("a100-40gb", "NVIDIA A100 40GB SXM", 40960 * _MiB, (8, 0), 1555 * _GBPS, _rates(19.5, 156, 312, 312), _A100),
    GpuSpec("a100-80gb", "NVIDIA A100 80GB SXM", 81920 * _MiB, (8, 0), 2039 * _GBPS, _rates(19.5, 156, 312, 312), _A100),
    # H100 SXM: FP32 67, TF32 989*, BF16/FP16 1,979*, FP8 3,958* (* sparse); 3.35 TB/s.
    GpuSpec("h100-80gb", "NVIDIA H100 80GB SXM", 81559 * _MiB, (9, 0), 3350 * _GBPS, _rates(67, 494.5, 989.5, 989.5, 1979), _H100),
    # H100 PCIe: FP32 51, TF32 756*, BF16/FP16 1,513*, FP8 3,026*; 2 TB/s.
    GpuSpec("h100-pcie", "NVIDIA H100 80GB PCIe", 81559 * _MiB, (9, 0), 2000 * _GBPS, _rates(51, 378, 756.5, 756.5, 1513), _H100),
    # H100 NVL: FP32 60, TF32 835*, BF16/FP16 1,671*, FP8 3,341* (* sparse); 94 GB HBM3 at 3.9 TB/s (the datasheet's NVL column).
    GpuSpec("h100-nvl", "NVIDIA H100 NVL 94GB", 95830 * _MiB, (9, 0), 3900 * _GBPS, _rates(60, 417.5, 835.5, 835.5, 1670.5), _H100),
    # H200 SXM: same compute as the H100 SXM; 141 GB HBM3e at 4.8 TB/s.
    GpuSpec("h200", "NVIDIA H200 141GB SXM", 143771 * _MiB, (9, 0), 4800 * _GBPS, _rates(67, 494.5, 989.5, 989.5, 1979), _H200),
    # L4: FP32 30.3, TF32 120*, BF16/FP16 242*, FP8 485*; 300 GB/s.
    GpuSpec("l4", "NVIDIA L4 24GB", 23034 * _MiB, (8, 9), 300 * _GBPS, _rates(30.3, 60, 121, 121, 242.5), _L4),
    # L40S: FP32 91.6, TF32 183 (366*), BF16/FP16 362.05 (733*), FP8 733 (1,466*); 864 GB/s.
    GpuSpec("l40s", "NVIDIA L40S 48GB", 46068 * _MiB, (8, 9), 864 * _GBPS, _rates(91.6, 183, 362.05, 362.05, 733), _L40S),
    # L40: FP32 90.5, TF32 90.5 (181*), BF16/FP16 181.05 (362.1*), FP8 362 (724*); 48 GB GDDR6 with ECC at 864 GB/s.
    GpuSpec("l40", "NVIDIA L40 48GB", 46068 * _MiB, (8, 9), 864 * _GBPS, _rates(90.5, 90.5, 181.05, 181.05, 362), _L40),
    # A40: FP32 37.4, TF32 74.8 (149.6*), BF16 with FP32 accumulate 149.7 (299.4*); 48 GB GDDR6 with ECC, 696 GB/s. FP16 is
    # printed with FP16 accumulate, 149.7 (299.4*); a GA102 professional part accumulates in FP32 at that rate too (RTX A6000).
    GpuSpec("a40", "NVIDIA A40 48GB", 46068 * _MiB, (8, 6), 696 * _GBPS, _rates(37.4, 74.8, 149.7, 149.7), _A40),
    # A10: FP32 31.2, TF32 62.5 (125*), BF16 125 (250*), FP16 125 (250*); 24 GB GDDR6 at 600 GB/s.
    GpuSpec("a10", "NVIDIA A10 24GB", 23028 * _MiB, (8, 6), 600 * _GBPS, _rates(31.2, 62.5, 125, 125), _A10),
    # RTX A6000: FP32 38.7; TF32 77.4 (154.8*); BF16, and FP16 with FP32 accumulate, 154.8 (309.7*); 48 GB GDDR6, 768 GB/s.
    GpuSpec("a6000", "NVIDIA RTX A6000 48GB", 49140 * _MiB, (8, 6), 768 * _GBPS, _rates(38.7, 77.4, 154.8, 154.8), _A6000),
    # RTX 4090: FP32 82.6; FP16 and BF16 tensor with FP32 accumulate 165.2; TF32 82.6; FP8 (FP32 acc.) 330.3; 1,008 GB/s.
    GpuSpec("rtx4090", "NVIDIA GeForce RTX 4090 24GB", 24564 * _MiB, (8, 9), 1008 * _GBPS, _rates(82.6, 82.6, 165.2, 165.2, 330.3), _ADA),
    # RTX 3090: FP32 35.6; FP16 and BF16 tensor with FP32 accumulate 71; TF32 35.6; 936 GB/s.
    GpuSpec("rtx3090", "NVIDIA GeForce RTX 3090 24GB", 24576 * _MiB, (8, 6), 936 * _GBPS, _rates(35.6, 35.6, 71, 71), _GA102),
    # RTX 3080 (vs RTX 2080 Super table): FP32 29.8; FP16 and BF16 tensor with FP32 accumulate 59.5 (119*); TF32 29.8
    # (59.5*); 10 GB GDDR6X at 760 GB/s. GeForce parts accumulate in FP32 at half their FP16-accumulate rate.
    GpuSpec("rtx3080", "NVIDIA GeForce RTX 3080 10GB", 10240 * _MiB, (8, 6), 760 * _GBPS, _rates(29.8, 29.8, 59.5, 59.5), _RTX3080),
    # V100 SXM2 32GB: FP32 15.7, tensor (FP16 in, FP32 accumulate) 125; no TF32 or bf16 units; 900 GB/s.
    GpuSpec("v100-32gb", "NVIDIA V100 32GB SXM2", 32768 * _MiB, (7, 0), 900 * _GBPS, _rates(15.7, fp16=125), _V100),
    # T4: FP32 8.1, mixed-precision FP16/FP32 tensor 65; no TF32 or bf16 units; 320 GB/s ("320+ GB/s").
    GpuSpec("t4", "NVIDIA T4 16GB", 15360 * _MiB, (7, 5), 320 * _GBPS, _rates(8.1, fp16=65), _T4),
)

GPUS: Mapping[str, GpuSpec] = MappingProxyType({g.name: g for g in _TABLE})
"""Known GPUs by name, the names ``--gpu`` accepts."""


def get_gpu(name: str) -> GpuSpec:
    """The GPU called ``name`` (case and surrounding spaces ignored), or the one a description such as
    "memory=12GiB,cc=8.6,bandwidth=360GB/s,fp32=12.7" describes (Note [Describing a GPU]); an unknown
    name is an InputSpecError that lists the known ones."""
    if "=" in name:
        return _described(name, where="--gpu")
    key = name.strip().lower()
    if key in GPUS:
        return GPUS[key]
    close = [n for n in GPUS if key and n.startswith(key)] or difflib.get_close_matches(key, list(GPUS), n=1)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise InputSpecError(
        f"unknown GPU {name!r} (--gpu): use one of {', '.join(GPUS)}.{hint} Any other GPU can be described from its "
        f"datasheet instead, e.g. --gpu {_EXAMPLE} (dense TFLOPS)."
    )


# See Note [Describing a GPU].
_EXAMPLE = "memory=12GiB,cc=8.6,bandwidth=360GB/s,fp32=12.7,fp16=51"
_RATE_KEYS = ("fp32", "tf32", "bf16", "fp16", "fp8")
_KEYS = ("memory", "cc", "bandwidth", *_RATE_KEYS, "label")
_ALIASES = {"compute_capability": "cc", "name": "label"}
_REQUIRED = ("memory", "cc", "bandwidth", "fp32")
_BYTE_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))
_BANDWIDTH_UNITS = {"gb/s": 10**9, "tb/s": 10**12}
_DESCRIBED = "described by the user (--gpu KEY=VALUE,... or GpuSpec.describe), not read from a datasheet here"


def _described(text: str, *, where: str) -> GpuSpec:
    """The GpuSpec a description gives, named by its canonical spelling."""
    values = _description_items(text, where)
    missing = [key for key in _REQUIRED if key not in values]
    if missing:
        raise InputSpecError(
            f"{where} '{text}': the description lacks {', '.join(missing)}; it needs memory, cc, bandwidth and fp32 "
            f"(dense TFLOPS; tf32, bf16, fp16, fp8 and label are optional), e.g. {where} {_EXAMPLE}."
        )
    memory = parse_size(values["memory"], f"{where} memory")
    cc = _compute_capability(values["cc"], where)
    bandwidth = _exact(values["bandwidth"], where, "bandwidth", _BANDWIDTH_UNITS, "bytes per second in GB/s or TB/s, e.g. bandwidth=360GB/s")
    tflops = {"": 10**12, "tflops": 10**12}
    flops = {key: _exact(values[key], where, key, tflops, f"dense TFLOPS as a positive number, e.g. {key}=51") for key in _RATE_KEYS if key in values}
    label = values.get("label") or f"a described GPU (sm_{cc[0]}{cc[1]}, {_size_text(memory)})"
    canonical = [f"memory={_size_text(memory)}", f"cc={cc[0]}.{cc[1]}", f"bandwidth={_decimal_text(Decimal(bandwidth) / 10**9)}GB/s"]
    canonical += [f"{key}={_decimal_text(Decimal(n) / 10**12)}" for key, n in flops.items()]
    canonical += [f"label={values['label']}"] if "label" in values else []
    rates = MappingProxyType({key: float(n) for key, n in flops.items()})
    return GpuSpec(",".join(canonical), label, memory, cc, float(bandwidth), rates, _DESCRIBED)


def _description_items(text: str, where: str) -> dict[str, str]:
    """KEY=VALUE pairs by canonical key; an unknown, repeated or valueless key is an InputSpecError."""
    values: dict[str, str] = {}
    keys = f"{', '.join(_KEYS)} (cc may be spelled compute_capability, label name)"
    for item in (part.strip() for part in text.split(",") if part.strip()):
        key, eq, value = (s.strip() for s in item.partition("="))
        key = _ALIASES.get(key.lower(), key.lower())
        if not eq or not value:
            raise InputSpecError(f"{where} '{text}': '{item}' is not KEY=VALUE; the keys are {keys}, e.g. {where} {_EXAMPLE}.")
        if key not in _KEYS:
            raise InputSpecError(f"{where} '{text}': unknown key '{item.partition('=')[0].strip()}'; the keys are {keys}.")
        if key in values:
            raise InputSpecError(f"{where} '{text}': {key} is given twice; give each key once.")
        values[key] = value
    return values


def _compute_capability(value: str, where: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)\.(\d)", value)
    if not match:
        raise InputSpecError(
            f"{where} cc '{value}': write the compute capability as MAJOR.MINOR, e.g. cc=8.6 (nvidia-smi "
            "--query-gpu=compute_cap --format=csv prints it; https://developer.nvidia.com/cuda-gpus lists them)."
        )
    return int(match.group(1)), int(match.group(2))


def _exact(value: str, where: str, key: str, units: Mapping[str, int], how: str) -> int:
    """A positive number with one of ``units`` (lower-case) -> a whole count of base units, computed exactly."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Za-z/]*)", value)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in units:
        raise InputSpecError(f"{where} {key} '{value}': write {how}.")
    n = int((Decimal(match.group(1)) * units[unit]).to_integral_value())
    if n < 1:
        raise InputSpecError(f"{where} {key} '{value}' is 0; write {how}.")
    return n


def _size_text(nbytes: int) -> str:
    """Bytes in the unit that spells them exactly with the fewest digits (binary first): 12884901888 -> '12GiB'."""
    exact = [f"{nbytes // size}{unit}" for unit, size in _BYTE_UNITS if nbytes % size == 0]
    return min(exact, key=len, default=f"{nbytes}B")


def _number_text(x: float | str) -> str:
    """A number as a description spells it: 12.7 -> '12.7', 1e+16 -> '10000000000000000'; a string as it is."""
    return x if isinstance(x, str) else _decimal_text(Decimal(repr(x)))


def _decimal_text(d: Decimal) -> str:
    """A decimal without exponent or trailing zeros: Decimal('12.70') -> '12.7', Decimal('5.1E+1') -> '51'."""
    return format(d.normalize(), "f")
