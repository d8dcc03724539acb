"""Fixed CUDA costs outside the model: the CUDA context and the library workspaces.

Each cost is a named line with a cited default that ``--overhead NAME=SIZE`` replaces. A line says
where it shows: ``DRIVER`` lines are held by the driver and only nvidia-smi sees them; ``PERSISTENT``
and ``TRANSIENT`` lines go through PyTorch's caching allocator, so they count in
``torch.cuda.max_memory_allocated()`` (and in ``memory_reserved`` and nvidia-smi) as well. A persistent
line is allocated once and kept (replay it in ``fxmem.allocator.replay(initial=...)``); a transient one
lives only while one kernel runs.

>>> from fxmem.gpus import get_gpu
>>> o = cuda_overheads(get_gpu("a100-80gb"))
>>> [(name, nbytes) for name, nbytes, _ in o.lines()]
[('cuda_context', 536870912), ('cublas_workspace', 17039360), ('cublaslt_workspace', 0), ('cudnn_workspace', 0)]
>>> o.allocator_bytes, o.driver_bytes
(17039360, 536870912)

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

cuBLASLt: torch 2.13's ``torch.backends.cuda.blas_workspace_size`` documents that with
``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` (the default on open-source CUDA builds) the cuBLASLt workspace is
capped at the cuBLAS one and reuses the same allocation (pytorch/pytorch#145130, #168175, #175879):
0 extra bytes. With ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0`` each (handle, stream) gets its own
``CUBLASLT_WORKSPACE_SIZE`` (KiB, default 1024: ``parseCUDABlasLtWorkspaceSize``). Later versions
allocate BLAS workspaces per operation instead (pytorch/pytorch#194311, ``TORCH_CUBLAS_WORKSPACE_CACHE``);
there the workspace is transient, not persistent.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum

from fxmem.errors import InputSpecError
from fxmem.gpus import GpuSpec

__all__ = [
    "CONTEXT_BYTES",
    "CUBLASLT_WORKSPACE_KIB",
    "Overhead",
    "Overheads",
    "Where",
    "cublas_workspace_size",
    "cuda_overheads",
    "parse_cublas_workspace_config",
]

_MiB = 2**20

CONTEXT_BYTES = 512 * _MiB
"""Default CUDA context of a training process, an estimate. With lazy module loading (CUDA >= 11.7,
the default since 12.2 on Linux) a bare PyTorch context measured 256 MiB on an RTX 3090 (torch 2.7.1,
CUDA 12.8; invoke-ai/InvokeAI#9413) and 426 MiB on an RTX 6000 Ada (torch 2.10, CUDA 13.0;
unslothai/unsloth-zoo#1053); PyTorch's maintainers quote ~300-400 MB (pytorch/pytorch#107667, #109888),
and >1000 MB before lazy loading. Training loads more kernels (cuBLAS, cuDNN, optimizer) lazily on top,
hence 512 MiB. Override it with ``--overhead cuda_context=SIZE`` after reading nvidia-smi once."""

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
    TRANSIENT = "transient"
    """Caching allocator, alive during one kernel: in max_memory_allocated if it lands on the peak."""


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
        ``fxmem.allocator.replay(initial=...)`` (give them storage ids of your own)."""
        return tuple(p for o in self.items if o.where is Where.PERSISTENT for p in o.pieces)

    def nvidia_smi(self, peak_reserved: int) -> int:
        """What nvidia-smi would show for the process at the allocator's peak: segments plus driver lines."""
        return peak_reserved + self.driver_bytes

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
    cublaslt_unified: bool = True,
    cublaslt_workspace_kib: int = CUBLASLT_WORKSPACE_KIB,
    cudnn_workspace_bytes: int = 0,
) -> Overheads:
    """The default fixed costs of a training process on ``gpu``, each argument overriding one line.

    ``blas_workspaces`` counts (cuBLAS handle, stream) pairs that run a matmul (2 in a training step:
    forward and backward threads). ``cudnn_workspace_bytes`` is the extra a convolution allocates while
    it runs: torch sizes it by the engine cuDNN's heuristics pick (``run_conv_plan`` in
    ``aten/src/ATen/native/cudnn/Conv_v8.cpp`` allocates ``plan.getWorkspaceSize()`` from the caching
    allocator and frees it after the call), which cannot be known without the GPU, so it is 0 unless
    given; ``CUDNN_CONV_WSCAP_DBG`` (MiB) caps it on the real run.
    """
    for arg, value in (
        ("context_bytes", context_bytes),
        ("cudnn_workspace_bytes", cudnn_workspace_bytes),
        ("cublaslt_workspace_kib", cublaslt_workspace_kib),
    ):
        if value is not None and value < 0:
            raise InputSpecError(f"cuda_overheads: {arg} must be 0 or more bytes; got {value}.")
    if blas_workspaces < 0:
        raise InputSpecError(f"cuda_overheads: blas_workspaces counts workspaces, 0 or more; got {blas_workspaces}.")
    context = CONTEXT_BYTES if context_bytes is None else context_bytes
    items = (
        Overhead("cuda_context", context, Where.DRIVER, _context_why(context_bytes)),
        _cublas_line(gpu, cublas_workspace_config, blas_workspaces),
        _cublaslt_line(cublaslt_unified, cublaslt_workspace_kib, blas_workspaces),
        Overhead(
            "cudnn_workspace",
            cudnn_workspace_bytes,
            Where.TRANSIENT,
            "per convolution, engine-dependent (Conv_v8.cpp run_conv_plan); not predicted unless set",
        ),
    )
    return Overheads(gpu.name, items)


def _context_why(given: int | None) -> str:
    if given is not None:
        return "CUDA context, as given"
    return "CUDA context with lazy module loading: driver, kernels, cuBLAS/cuDNN handles; an estimate (see fxmem.overheads.CONTEXT_BYTES)"


def _cublas_line(gpu: GpuSpec, config: str | None, count: int) -> Overhead:
    each = cublas_workspace_size(gpu, config)
    shown = config if config is not None else f"default for sm_{gpu.compute_capability[0]}{gpu.compute_capability[1]}"
    why = f"{count} x {each} B cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG {shown}), one per thread that runs matmuls"
    return Overhead("cublas_workspace", count * each, Where.PERSISTENT, why, (each,) * count if each else ())


def _cublaslt_line(unified: bool, kib: int, count: int) -> Overhead:
    if unified:
        return Overhead(
            "cublaslt_workspace", 0, Where.PERSISTENT, "shares the cuBLAS workspace (TORCH_CUBLASLT_UNIFIED_WORKSPACE, default on)"
        )
    each = kib * 1024
    why = f"{count} x {each} B cuBLASLt workspace (CUBLASLT_WORKSPACE_SIZE={kib} KiB, not unified)"
    return Overhead("cublaslt_workspace", count * each, Where.PERSISTENT, why, (each,) * count if each else ())
