"""Replaying a step's allocations through PyTorch's CUDA caching allocator, on the CPU.

The simulated step yields storages being allocated and freed. On a GPU each of them goes through
``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator::malloc`` and ``free``), which rounds
the request, carves it out of a cached segment or ``cudaMalloc``s a new one, and gives segments back
only when memory runs out (or ``empty_cache``). ``replay`` runs those rules for one stream, with the
settings of ``PYTORCH_CUDA_ALLOC_CONF`` that change memory (``fxmem/gpu/alloc_conf.py``: torch's
defaults unless asked; expandable segments are fxmem/gpu/expandable.py), and returns what
``torch.cuda.max_memory_allocated()`` and ``max_memory_reserved()`` would report.

>>> MiB = 2**20
>>> r = replay([(0, 5 * MiB), (1, 5 * MiB), (0, FREE), (2, 1)])
>>> r.peak_allocated // MiB, r.peak_reserved // MiB   # both 5 MiB blocks share one 20 MiB segment
(10, 22)
>>> r.final_allocated                                  # 5 MiB + the 1-byte request rounded to 512
5243392

Events are ``(storage_id, nbytes)`` pairs: ``nbytes >= 0`` allocates, a negative ``nbytes`` (``FREE``)
frees the storage allocated under that id. A third element ``True`` marks an allocation the caller
survives without (a cuDNN workspace: Note [A workspace that does not fit]). Ids can be reused after a free. A zero-byte storage takes
no block: ``NativeCachingAllocator::allocate`` only calls ``malloc`` when ``size != 0``.

Note [Where the replay can differ from the GPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
- Addresses. Free blocks are ordered by (size, address) (``BlockComparatorSize``), so among equal-sized
  free blocks the lowest address wins. ``cudaMalloc`` picks real addresses; we give each new segment an
  address above all earlier ones, which is what a fresh process usually sees but is not guaranteed.
- Other streams (NCCL, user streams, ``record_stream``) delay frees and keep separate free lists; we
  model one stream.
- Memory that bypasses the caching allocator (the CUDA context, cuBLAS's own workspace when PyTorch does
  not hand it one, NCCL buffers) is not here; see fxmem/gpu/overheads.py.
- Out of memory. Without ``capacity`` the GPU is unbounded. See Note [When cudaMalloc fails].
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fxmem.errors import InputSpecError
from fxmem.gpu.alloc_conf import DEFAULT_ALLOC_CONF, AllocatorConfig
from fxmem.gpu.blocks import (
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    Block,
    allocation_size,
    round_size,
)
from fxmem.gpu.expandable import ExpandableAllocator
from fxmem.gpu.segments import SegmentAllocator

__all__ = [
    "FREE",
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "AllocatorReplay",
    "allocation_size",
    "replay",
    "round_size",
]

FREE = -1
"""The ``nbytes`` of an event that frees its storage."""

# Note [When cudaMalloc fails]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``DeviceCachingAllocator::malloc`` (c10/cuda/CUDACachingAllocator.cpp), when no cached block fits:
#   1. with a memory fraction set and ``garbage_collection_threshold`` > 0, ``garbage_collect_cached_blocks``:
#      once reserved memory passes threshold x allowed, release whole cached large-pool segments whose
#      age (free-block searches of the pool since the block was put back, ``gc_count``) is at least the
#      average, repeating until enough is reclaimed or none is left;
#   2. ``alloc_block``: ``cudaMalloc`` the segment; it fails past the fraction's ``allowed_memory_maximum``
#      or past what the device has free;
#   3. ``release_available_cached_blocks`` (only with ``max_split_size_mb``): free one cached oversize block
#      large enough, else the largest oversize ones until enough is freed, and try again;
#   4. ``release_cached_blocks``: free every cached segment that holds no live block, and try again;
#   5. raise ``OutOfMemoryError``.
# ``capacity`` is what ``cudaMalloc`` can have (the device less what the driver and other libraries
# hold outside the allocator) and ``limit`` the fraction's ``allowed_memory_maximum``. Where step 5 is
# reached the replay records the event in ``oom_at`` and carries on as if the memory existed, so that
# the peaks still say how much the step wanted and by how much it is short.
#
# Note [A workspace that does not fit]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ATen's cuDNN convolutions (aten/src/ATen/native/cudnn/Conv_v8.cpp, ``try_plans`` and
# ``try_configs``, cudnn.benchmark off) allocate the workspace of the engine cuDNN's heuristics rank first
# through the caching allocator; an ``OutOfMemoryError`` there (raised after step 4 above, so the cache
# has been released) is caught and the next engine config is tried. An event marked optional is such a
# workspace: where it does not fit, the replay gives it no memory (the cache released as torch released
# it) and counts it in ``shrunk``. Its true replacement is the next config's workspace, which fxmem
# does not know; cuDNN's fallback engines include implicit-GEMM ones that need none, so 0 B is the
# figure, and the report says the step then runs a slower engine there.


@dataclass(frozen=True)
class AllocatorReplay:
    """What the caching allocator's statistics say after a replay.

    ``peak_allocated`` is ``torch.cuda.max_memory_allocated()``: the highest sum of allocated *block*
    sizes, which exceeds the sum of requests by the 512-byte rounding and by blocks too big to split.
    ``peak_reserved`` is ``max_memory_reserved()``: the highest sum of segment sizes. The ``*_at`` fields
    are the index, in ``events``, of the event that first reached the peak (-1: reached while placing
    ``initial``). ``oom_at`` is the first event that would not fit in ``capacity`` (-1: one in
    ``initial``; None: all fitted, or no capacity given).
    """

    peak_allocated: int
    peak_allocated_at: int
    peak_reserved: int
    peak_reserved_at: int
    final_allocated: int
    final_reserved: int
    segments: int
    """Segments held at the end (for expandable segments: mapped runs of pages)."""
    oom_at: int | None = None
    shrunk: tuple[int, ...] = ()
    """Indices of optional allocations (workspaces) that did not fit and got no memory: Note [A workspace that does not fit]."""
    retries: int = 0
    """``num_alloc_retries``: how often the cache was released to retry a ``cudaMalloc``."""

    @property
    def cached_at_peak_reserved(self) -> int:
        """Not a statistic torch keeps; ``peak_reserved - peak_allocated`` bounds the caching overhead."""
        return self.peak_reserved - self.peak_allocated

    @property
    def fits(self) -> bool:
        """No allocation ran out of memory (an optional one that gave way does not count)."""
        return self.oom_at is None


@dataclass
class _Peaks:
    allocated: int = 0
    allocated_at: int = -1
    reserved: int = 0
    reserved_at: int = -1
    oom_at: int | None = None


def replay(
    events: Iterable[tuple[int, ...]],
    *,
    initial: Iterable[tuple[int, int]] = (),
    capacity: int | None = None,
    limit: int | None = None,
    config: AllocatorConfig = DEFAULT_ALLOC_CONF,
) -> AllocatorReplay:
    """Run ``events`` through the caching allocator and report its peak statistics.

    ``initial`` are allocations already live when the step starts (weights, buffers, the input batch,
    library workspaces), placed in order before ``events``; they count in the peaks. To reproduce a
    steady-state step, whose allocator still caches the segments of the steps before it, replay a
    warm-up step first and read the peaks over both, as ``torch.cuda.max_memory_allocated()`` would.
    ``capacity`` is the memory ``cudaMalloc`` may hand out (the GPU's, less the CUDA context and other
    memory outside the allocator) and ``limit`` a memory fraction's ``allowed_memory_maximum``; see
    Note [When cudaMalloc fails]. ``config`` is ``PYTORCH_CUDA_ALLOC_CONF``'s settings.
    """
    for name, bound in (("capacity", capacity), ("limit", limit)):
        if bound is not None and bound < 0:
            raise InputSpecError(f"replay: {name} must be a number of bytes, 0 or more; got {bound}.")
    if config.expandable_segments:
        alloc: SegmentAllocator = ExpandableAllocator(capacity, limit, config)
    else:
        alloc = SegmentAllocator(capacity, limit, config)
    peaks, live, zero, shrunk = _Peaks(), dict[int, Block](), set[int](), list[int]()
    for event in initial:
        _apply(alloc, live, zero, event, index=-1, peaks=peaks, shrunk=shrunk)
    for index, event in enumerate(events):
        _apply(alloc, live, zero, event, index=index, peaks=peaks, shrunk=shrunk)
    return AllocatorReplay(
        peak_allocated=peaks.allocated,
        peak_allocated_at=peaks.allocated_at,
        peak_reserved=peaks.reserved,
        peak_reserved_at=peaks.reserved_at,
        final_allocated=alloc.allocated,
        final_reserved=alloc.reserved,
        segments=alloc.segments,
        oom_at=peaks.oom_at,
        shrunk=tuple(shrunk),
        retries=alloc.retries,
    )


def _apply(
    alloc: SegmentAllocator, live: dict[int, Block], zero: set[int], event: tuple[int, ...], *, index: int, peaks: _Peaks, shrunk: list[int]
) -> None:
    """One event: allocate or free, then move the peaks."""
    sid, nbytes = event[0], event[1]
    if nbytes < 0:
        _free(alloc, live, zero, sid, index)
        return
    if sid in live or sid in zero:
        where = "in initial" if index < 0 else f"at event {index}"
        raise InputSpecError(f"replay: storage {sid} allocated again {where} while still live; free it first (nbytes={FREE}).")
    if nbytes == 0:
        zero.add(sid)
        return
    ooms = alloc.ooms
    block = alloc.malloc(nbytes, optional=len(event) > 2 and bool(event[2]))
    if block is None:
        shrunk.append(index)
        zero.add(sid)
        return
    live[sid] = block
    if alloc.ooms > ooms and peaks.oom_at is None:
        peaks.oom_at = index
    if alloc.allocated > peaks.allocated:
        peaks.allocated, peaks.allocated_at = alloc.allocated, index
    if alloc.reserved > peaks.reserved:
        peaks.reserved, peaks.reserved_at = alloc.reserved, index


def _free(alloc: SegmentAllocator, live: dict[int, Block], zero: set[int], sid: int, index: int) -> None:
    if sid in zero:
        zero.discard(sid)
        return
    block = live.pop(sid, None)
    if block is None:
        where = "in initial" if index < 0 else f"at event {index}"
        raise InputSpecError(f"replay: storage {sid} freed {where} but it is not live; each free must follow an allocation of the same id.")
    alloc.free(block)
