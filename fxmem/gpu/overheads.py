"""Fixed CUDA costs outside the model: the CUDA context and the library workspaces.

Each cost is a named line with a cited default that ``--overhead NAME=SIZE`` replaces. A line says
where it shows: ``DRIVER`` lines are held by the driver and only nvidia-smi sees them; ``PERSISTENT``
lines go through PyTorch's caching allocator, allocated once and kept, so they count in
``torch.cuda.max_memory_allocated()`` (and in ``memory_reserved`` and nvidia-smi) as well (replay them
in ``fxmem.gpu.allocator.replay(initial=...)``).

>>> from fxmem.gpu.gpus import get_gpu
>>> o = cuda_overheads(get_gpu("a100-80gb"), cublas_workspace_config=":4096:2:16:8", cublaslt_unified=True)
>>> [(name, nbytes) for name, nbytes, _ in o.lines()]
[('cuda_context', 543162368), ('cublas_kernels', 165675008), ('cudnn_kernels', 8388608), ('cublas_workspace', 17039360), ('cublaslt_workspace', 0)]
>>> o.allocator_bytes, o.driver_bytes
(17039360, 717225984)

Note [cuBLAS workspaces in a training step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``aten/src/ATen/cuda/CublasHandlePool.cpp``: ``getCurrentCUDABlasHandle`` binds each (handle, stream)
pair to a workspace from the caching allocator (``setWorkspaceForHandle`` -> ``getNewWorkspace``, i.e.
``CUDACachingAllocator::get()->allocate``), kept until ``torch._C._cuda_clearCublasWorkspaces()``. Its
size is ``getChosenWorkspaceSize``: ``CUBLAS_WORKSPACE_CONFIG`` (":SIZE:COUNT" pairs, SIZE in KiB,
summed as SIZE*1024*COUNT by ``parseChosenWorkspaceSize``) or, unset, ":4096:2:16:8" (8 MiB + 128 KiB)
and 32 MiB (":4096:8") for compute capability 9.x-12.x. An A10G measured 8519680 bytes left in
``memory_allocated`` after one Linear (pytorch/pytorch#95668). cuBLAS handles are per thread
(``DeviceThreadHandlePool``) and autograd runs a CUDA backward on its own device thread, so a training
step holds two workspaces: the forward's and the backward's. That count is derived from the code, not
measured here; ``blas_workspaces`` sets it.

Measured on an H200 (torch 2.11; tests/data/h200/trace_steps.json.gz, the blocks alive before a
step): two 32 MiB blocks, one allocated by a Linear's forward and one with no Python frame (the
backward's thread), as derived.

cuBLASLt: torch 2.13's ``torch.backends.cuda.blas_workspace_size`` documents that with
``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` (the default on open-source CUDA builds) the cuBLASLt workspace is
capped at the cuBLAS one and reuses the same allocation (pytorch/pytorch#145130, #168175, #175879):
0 extra bytes. Before that default took effect (#175879, merged 2026-03-02, mended the env handling
that kept it from applying), a (handle, stream) that ran cuBLASLt got its own ``CUBLASLT_WORKSPACE_SIZE``
(KiB, default 1024: ``parseCUDABlasLtWorkspaceSize``): the H200 above, on torch 2.11, held one 1 MiB
block more, allocated by a Linear's forward (``addmm`` with a bias runs cuBLASLt's fused bias epilogue;
backward's matmuls are plain ``mm``), the "missing MiB" of every earlier GPU comparison. So fxmem
counts one such workspace where the torch it runs with is older than 2.12, none from 2.12 on. Later versions
allocate BLAS workspaces per operation instead (pytorch/pytorch#194311, ``TORCH_CUBLAS_WORKSPACE_CACHE``);
there the workspace is transient, not persistent.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum

from fxmem.errors import InputSpecError
from fxmem.gpu.gpus import GpuSpec
from fxmem.rules import TorchRelease, torch_release

__all__ = [
    "CONTEXT_BYTES",
    "CUBLASLT_WORKSPACE_KIB",
    "CUBLAS_KERNELS_BYTES",
    "CUDNN_KERNELS_BYTES",
    "Overhead",
    "Overheads",
    "Where",
    "cublas_workspace_size",
    "cuda_overheads",
    "parse_cublas_workspace_config",
]

_MiB = 2**20

CONTEXT_BYTES = 543_162_368
"""The CUDA context of a process, measured: NVML (what nvidia-smi prints per process, 518 MiB) for a
process that had only created its context, on an H200 with driver 580.159, torch 2.11+cu130, CUDA 13.0
and lazy module loading (shared/gpu/steps_h200.json, ``cuda_context.nvml_after_context``). On other
GPUs it is an estimate: the context grows with the driver and the GPU's size; PyTorch's maintainers
quote ~300-400 MB (pytorch/pytorch#107667, #109888). Override it with ``--overhead cuda_context=SIZE``
after reading nvidia-smi once."""

CUBLAS_KERNELS_BYTES = 165_675_008
"""cuBLAS's kernel modules, which lazy loading brings in at the first matmul: on the same H200 the
device's used bytes less torch's reserved rose by this much at the first fp32 matmul, and not at a bf16
one after it (``after_cublas_fp32`` less ``after_context`` in the same record). Every training step
runs a matmul."""

CUDNN_KERNELS_BYTES = 8_388_608
"""cuDNN's, brought in by its first call: +8 MiB at a convolution (``after_cudnn_conv`` less
``after_cublas_bf16``); a cuDNN attention call after it added nothing more. Counted only for a step
that runs a cuDNN kernel."""

CUBLASLT_WORKSPACE_KIB = 1024
"""``parseCUDABlasLtWorkspaceSize``'s default (KiB, "according to #73328") on CUDA builds."""

_DEFAULT_CUBLAS_CONFIG = ":4096:2:16:8"
_HOPPER_AND_LATER_CUBLAS_CONFIG = ":4096:8"
_LARGE_WORKSPACE_MAJORS = (9, 10, 11, 12)
"""Compute-capability majors that get 32 MiB (``parseChosenWorkspaceSize``, "32MiB for Hopper and Blackwell")."""


class Where(Enum):
    """Which counters a line shows in."""

    DRIVER = "driver"
    """Held by the driver: nvidia-smi only, never in torch's counters."""
    PERSISTENT = "persistent"
    """Caching allocator, allocated once and kept: in max_memory_allocated, reserved and nvidia-smi."""


@dataclass(frozen=True)
class Overhead:
    """One line: ``pieces`` are the separate allocations that make up ``nbytes`` (two cuBLAS workspaces)."""

    name: str
    nbytes: int
    where: Where
    why: str
    pieces: tuple[int, ...] = ()


@dataclass(frozen=True)
class Overheads:
    """The fixed CUDA costs of one process on one GPU, line by line."""

    gpu: str
    items: tuple[Overhead, ...]

    def lines(self) -> list[tuple[str, int, str]]:
        """(name, bytes, explanation) per line, in report order."""
        return [(o.name, o.nbytes, o.why) for o in self.items]

    def line(self, name: str) -> Overhead:
        for o in self.items:
            if o.name == name:
                return o
        raise InputSpecError(f"unknown overhead {name!r} (--overhead): the lines are {', '.join(o.name for o in self.items)}.")

    @property
    def allocator_bytes(self) -> int:
        """Bytes of the lines that go through the caching allocator (they count in max_memory_allocated)."""
        return sum(o.nbytes for o in self.items if o.where is not Where.DRIVER)

    @property
    def driver_bytes(self) -> int:
        """Bytes only nvidia-smi sees."""
        return sum(o.nbytes for o in self.items if o.where is Where.DRIVER)

    def initial_allocations(self) -> tuple[int, ...]:
        """Sizes of the persistent allocator blocks a steady-state step starts with, for
        ``fxmem.gpu.allocator.replay(initial=...)`` (give them storage ids of your own)."""
        return tuple(p for o in self.items if o.where is Where.PERSISTENT for p in o.pieces)

    def nvidia_smi(self, peak_reserved: int) -> int:
        """What nvidia-smi would show for the process at the allocator's peak: segments plus driver lines."""
        return peak_reserved + self.driver_bytes

    def without(self, name: str) -> Overheads:
        """A copy without the line ``name`` (a cost the step does not incur)."""
        return replace(self, items=tuple(o for o in self.items if o.name != name))

    def with_overrides(self, overrides: Mapping[str, int]) -> Overheads:
        """A copy with the named lines set to the given bytes (``--overhead NAME=SIZE``)."""
        items = {o.name: o for o in self.items}
        for name, nbytes in overrides.items():
            old = self.line(name)
            if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
                raise InputSpecError(f"--overhead {name}: give a size in bytes, 0 or more; got {nbytes!r}.")
            items[name] = replace(
                old, nbytes=nbytes, why=f"set by --overhead {name} (default: {old.why})", pieces=_split(nbytes, len(old.pieces))
            )
        return replace(self, items=tuple(items[o.name] for o in self.items))


def _split(nbytes: int, count: int) -> tuple[int, ...]:
    """An overridden total over the same number of allocations, when it divides evenly; else one block."""
    if count == 0 or nbytes == 0:
        return ()
    return (nbytes // count,) * count if nbytes % count == 0 else (nbytes,)


def parse_cublas_workspace_config(config: str) -> int:
    """Bytes of one cuBLAS workspace for a ``CUBLAS_WORKSPACE_CONFIG`` value, as
    ``parseChosenWorkspaceSize`` reads it: every ":SIZE:COUNT" pair adds SIZE KiB * COUNT.

    >>> parse_cublas_workspace_config(":4096:8") == 8 * 4096 * 1024
    True
    >>> parse_cublas_workspace_config(":4096:2:16:8")
    8519680
    """
    pairs = re.findall(r":([0-9]+):([0-9]+)", config)
    if not pairs:
        # torch warns and falls back to its default; a typo here would silently change the prediction.
        raise InputSpecError(
            f"CUBLAS_WORKSPACE_CONFIG {config!r} has no ':SIZE:COUNT' pair (SIZE in KiB), "
            "e.g. ':4096:8' for 8 workspaces of 4 MiB or ':16:8'."
        )
    return sum(int(size) * 1024 * int(count) for size, count in pairs)


def cublas_workspace_size(gpu: GpuSpec, config: str | None = None) -> int:
    """One cuBLAS workspace on ``gpu``: ``config`` (a CUBLAS_WORKSPACE_CONFIG value) or torch's default
    for the GPU's compute capability. See Note [cuBLAS workspaces in a training step]."""
    if config is None:
        large = gpu.compute_capability[0] in _LARGE_WORKSPACE_MAJORS
        config = _HOPPER_AND_LATER_CUBLAS_CONFIG if large else _DEFAULT_CUBLAS_CONFIG
    return parse_cublas_workspace_config(config)


def cuda_overheads(
    gpu: GpuSpec,
    *,
    context_bytes: int | None = None,
    cublas_workspace_config: str | None = None,
    blas_workspaces: int = 2,
    cublaslt_unified: bool | None = None,
    cublaslt_workspace_kib: int = CUBLASLT_WORKSPACE_KIB,
    release: TorchRelease | None = None,
) -> Overheads:
    """The default fixed costs of a training process on ``gpu``, each argument overriding one line.

    ``cublas_workspace_config`` defaults to the ``CUBLAS_WORKSPACE_CONFIG`` of fxmem's own environment
    (set it as the training job does; importing MONAI sets ":4096:8"), else torch's default for the GPU. ``cublaslt_unified`` defaults
    to what torch ``release`` does (None: the one fxmem runs with; see Note [cuBLAS workspaces in a
    training step]).
    ``blas_workspaces`` counts (cuBLAS handle, stream) pairs that run a matmul (2 in a training step:
    forward and backward threads). Kernel workspaces that live for one op (cuDNN's convolution and RNN
    workspaces) are not fixed costs: the cuda target's workspace rules put them in the step itself.
    """
    for arg, value in (
        ("context_bytes", context_bytes),
        ("cublaslt_workspace_kib", cublaslt_workspace_kib),
    ):
        if value is not None and value < 0:
            raise InputSpecError(f"cuda_overheads: {arg} must be 0 or more bytes; got {value}.")
    if blas_workspaces < 0:
        raise InputSpecError(f"cuda_overheads: blas_workspaces counts workspaces, 0 or more; got {blas_workspaces}.")
    context = CONTEXT_BYTES if context_bytes is None else context_bytes
    config = cublas_workspace_config if cublas_workspace_config is not None else os.environ.get("CUBLAS_WORKSPACE_CONFIG") or None
    unified = cublaslt_unified if cublaslt_unified is not None else (release or torch_release()) >= _UNIFIED_LT_SINCE
    items = (
        Overhead("cuda_context", context, Where.DRIVER, _context_why(context_bytes, gpu)),
        Overhead("cublas_kernels", CUBLAS_KERNELS_BYTES, Where.DRIVER, _kernels_why("cuBLAS", "at the first matmul")),
        Overhead("cudnn_kernels", CUDNN_KERNELS_BYTES, Where.DRIVER, _kernels_why("cuDNN", "by the step's first cuDNN call")),
        _cublas_line(gpu, config, blas_workspaces),
        _cublaslt_line(unified, cublaslt_workspace_kib),
    )
    return Overheads(gpu.name, items)


def _kernels_why(lib: str, when: str) -> str:
    return f"{lib}'s kernel modules, loaded lazily {when}: measured on an H200 (see fxmem.gpu.overheads.{lib.upper()}_KERNELS_BYTES)"


def _context_why(given: int | None, gpu: GpuSpec) -> str:
    if given is not None:
        return "CUDA context, as given"
    where = "measured on this GPU" if gpu.name == _MEASURED_ON else "measured on an H200, an estimate for this GPU"
    return f"CUDA context with lazy module loading, {where} (driver 580, CUDA 13; see fxmem.gpu.overheads.CONTEXT_BYTES)"


_MEASURED_ON = "h200"
_UNIFIED_LT_SINCE = (2, 12)
"""The torch release from which cuBLASLt shares the cuBLAS workspace; see Note [cuBLAS workspaces in a training step]."""


def _cublas_line(gpu: GpuSpec, config: str | None, count: int) -> Overhead:
    each = cublas_workspace_size(gpu, config)
    shown = config if config is not None else f"default for sm_{gpu.compute_capability[0]}{gpu.compute_capability[1]}"
    why = f"{count} x {each} B cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG {shown}), one per thread that runs matmuls"
    return Overhead("cublas_workspace", count * each, Where.PERSISTENT, why, (each,) * count if each else ())


def _cublaslt_line(unified: bool, kib: int) -> Overhead:
    if unified:
        return Overhead(
            "cublaslt_workspace", 0, Where.PERSISTENT, "shares the cuBLAS workspace (TORCH_CUBLASLT_UNIFIED_WORKSPACE, default on)"
        )
    each = kib * 1024
    why = f"{each} B cuBLASLt workspace of the forward's thread (CUBLASLT_WORKSPACE_SIZE={kib} KiB; torch < 2.12 does not share it)"
    return Overhead("cublaslt_workspace", each, Where.PERSISTENT, why, (each,) if each else ())
