"""Replaying a step's allocations through PyTorch's CUDA caching allocator, on the CPU.

The simulated step yields storages being allocated and freed. On a GPU each of them goes through
``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator::malloc`` and ``free``), which rounds
the request, carves it out of a cached segment or ``cudaMalloc``s a new one, and never gives segments
back unless asked. ``replay`` runs those rules for one stream with the default settings (no
``expandable_segments``, no ``max_split_size_mb``, no garbage collection, no ``empty_cache``) and
returns what ``torch.cuda.max_memory_allocated()`` and ``max_memory_reserved()`` would report.

>>> MiB = 2**20
>>> r = replay([(0, 5 * MiB), (1, 5 * MiB), (0, FREE), (2, 1)])
>>> r.peak_allocated // MiB, r.peak_reserved // MiB   # both 5 MiB blocks share one 20 MiB segment
(10, 22)
>>> r.final_allocated                                  # 5 MiB + the 1-byte request rounded to 512
5243392

Events are ``(storage_id, nbytes)`` pairs: ``nbytes >= 0`` allocates, a negative ``nbytes`` (``FREE``)
frees the storage allocated under that id. Ids can be reused after a free. A zero-byte storage takes
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
- Out of memory. Without ``capacity`` the GPU is unbounded. With it, a ``cudaMalloc`` that would not
  fit first frees every cached segment that holds no live block (``release_cached_blocks``; with the
  default ``max_split_size`` ``release_available_cached_blocks`` does nothing) and tries again; if that
  fails too, the event is recorded in ``oom_at`` and the replay carries on as if the memory existed, so
  the peaks still say how much the step wanted.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from fxmem.errors import InputSpecError

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

# Constants of c10/cuda/CUDACachingAllocator.cpp (namespace c10::cuda::CUDACachingAllocator and its
# Native namespace; torch 2.x; newer versions read kLargeBuffer through
# AcceleratorAllocatorConfig::large_segment_size(), whose default is the same 20 MiB).
K_MIN_BLOCK_SIZE = 512
"""kMinBlockSize: every size is rounded up to a multiple of 512 bytes."""
K_SMALL_SIZE = 1 << 20
"""kSmallSize: requests of 1 MiB or less go to the small pool."""
K_SMALL_BUFFER = 2 << 20
"""kSmallBuffer: small-pool segments are 2 MiB."""
K_MIN_LARGE_ALLOC = 10 << 20
"""kMinLargeAlloc: large requests below 10 MiB get a kLargeBuffer segment."""
K_LARGE_BUFFER = 20 << 20
"""kLargeBuffer: the 20 MiB segment that 1-10 MiB requests are packed into."""
K_ROUND_LARGE = 2 << 20
"""kRoundLarge: segments for requests of 10 MiB or more are rounded up to 2 MiB."""

FREE = -1
"""The ``nbytes`` of an event that frees its storage."""


def round_size(nbytes: int) -> int:
    """The block size a request gets: ``DeviceCachingAllocator::round_size`` without
    ``roundup_power2_divisions`` (off by default), i.e. up to a multiple of kMinBlockSize, at least one.

    >>> round_size(1), round_size(512), round_size(513)
    (512, 512, 1024)
    """
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(size: int) -> int:
    """The segment ``cudaMalloc``ed for a rounded request that no cached block fits:
    ``DeviceCachingAllocator::get_allocation_size``.

    >>> [allocation_size(s) // 2**20 for s in (512, 5 * 2**20, 12 * 2**20 + 512)]
    [2, 20, 14]
    """
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


def _should_split(small: bool, remaining: int) -> bool:
    """``DeviceCachingAllocator::should_split`` with the default (unlimited) max_split_size: a small-pool
    block is split when at least kMinBlockSize is left over, a large-pool block when more than kSmallSize is."""
    return remaining >= K_MIN_BLOCK_SIZE if small else remaining > K_SMALL_SIZE


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
    """Segments held at the end."""
    oom_at: int | None = None

    @property
    def cached_at_peak_reserved(self) -> int:
        """Not a statistic torch keeps; ``peak_reserved - peak_allocated`` bounds the caching overhead."""
        return self.peak_reserved - self.peak_allocated


class _Block:
    """A block of a segment (``struct Block``): neighbours in the same segment are linked."""

    __slots__ = ("addr", "allocated", "next", "prev", "size", "small")

    def __init__(self, addr: int, size: int, small: bool) -> None:
        self.addr, self.size, self.small = addr, size, small
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _Allocator:
    """``DeviceCachingAllocator`` for one stream: two pools of free blocks kept sorted by (size, address)
    (``BlockPool::blocks`` with ``BlockComparatorSize``), searched with bisect for the best fit."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.free_keys: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self.free_blocks: dict[int, _Block] = {}  # addr -> free block
        self.next_addr = 0
        self.allocated = self.reserved = self.segments = 0
        self.ooms = 0

    def malloc(self, nbytes: int) -> _Block:
        """``DeviceCachingAllocator::malloc``: best fit from the pool, else a new segment; then split."""
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE  # get_pool
        block = self._take_free(small, size) or self._new_segment(small, allocation_size(size))
        remaining = block.size - size
        if _should_split(small, remaining):  # alloc_found_block: the front is handed out, the rest stays free
            rest = _Block(block.addr + size, remaining, small)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert_free(rest)
        block.allocated = True
        self.allocated += block.size
        return block

    def free(self, block: _Block) -> None:
        """``DeviceCachingAllocator::free`` -> ``free_block``: merge with free neighbours, back to the pool."""
        block.allocated = False
        self.allocated -= block.size
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated:  # try_merge_blocks(block, prev): [prev block]
            self._remove_free(prev)
            block.addr, block.size, block.prev = prev.addr, prev.size + block.size, prev.prev
            if block.prev is not None:
                block.prev.next = block
        if nxt is not None and not nxt.allocated:  # try_merge_blocks(block, next): [block next]
            self._remove_free(nxt)
            block.size, block.next = block.size + nxt.size, nxt.next
            if block.next is not None:
                block.next.prev = block
        self._insert_free(block)

    def _take_free(self, small: bool, size: int) -> _Block | None:
        """``get_free_block``: the smallest free block of at least ``size`` (lowest address on ties)."""
        keys = self.free_keys[small]
        i = bisect.bisect_left(keys, (size, -1))
        if i == len(keys):
            return None
        _, addr = keys.pop(i)
        return self.free_blocks.pop(addr)

    def _new_segment(self, small: bool, nbytes: int) -> _Block:
        """``alloc_block``: a ``cudaMalloc`` of ``nbytes`` at an address above all earlier segments."""
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            self._release_cached()
            self.ooms += self.reserved + nbytes > self.capacity
        block = _Block(self.next_addr, nbytes, small)
        self.next_addr += nbytes
        self.reserved += nbytes
        self.segments += 1
        return block

    def _release_cached(self) -> None:
        """``release_cached_blocks`` -> ``release_blocks``: ``cudaFree`` every free block that is a whole segment."""
        whole = [b for b in self.free_blocks.values() if b.prev is None and b.next is None]
        for block in whole:
            self._remove_free(block)
            self.reserved -= block.size
            self.segments -= 1

    def _insert_free(self, block: _Block) -> None:
        bisect.insort(self.free_keys[block.small], (block.size, block.addr))
        self.free_blocks[block.addr] = block

    def _remove_free(self, block: _Block) -> None:
        keys = self.free_keys[block.small]
        del keys[bisect.bisect_left(keys, (block.size, block.addr))]
        del self.free_blocks[block.addr]


@dataclass
class _Peaks:
    allocated: int = 0
    allocated_at: int = -1
    reserved: int = 0
    reserved_at: int = -1
    oom_at: int | None = None


def replay(
    events: Iterable[tuple[int, int]],
    *,
    initial: Iterable[tuple[int, int]] = (),
    capacity: int | None = None,
) -> AllocatorReplay:
    """Run ``events`` through the caching allocator and report its peak statistics.

    ``initial`` are allocations already live when the step starts (weights, buffers, the input batch,
    library workspaces), placed in order before ``events``; they count in the peaks. To reproduce a
    steady-state step, whose allocator still caches the segments of the steps before it, replay a
    warm-up step first and read the peaks over both, as ``torch.cuda.max_memory_allocated()`` would.
    ``capacity`` is the memory ``cudaMalloc`` may hand out (the GPU's, less the CUDA context and other
    memory outside the allocator); see Note [Where the replay can differ from the GPU].
    """
    if capacity is not None and capacity < 0:
        raise InputSpecError(f"replay: capacity must be a number of bytes, 0 or more; got {capacity}.")
    alloc, peaks = _Allocator(capacity), _Peaks()
    live: dict[int, _Block] = {}
    zero: set[int] = set()
    for event in initial:
        _apply(alloc, live, zero, event, index=-1, peaks=peaks)
    for index, event in enumerate(events):
        _apply(alloc, live, zero, event, index=index, peaks=peaks)
    return AllocatorReplay(
        peak_allocated=peaks.allocated,
        peak_allocated_at=peaks.allocated_at,
        peak_reserved=peaks.reserved,
        peak_reserved_at=peaks.reserved_at,
        final_allocated=alloc.allocated,
        final_reserved=alloc.reserved,
        segments=alloc.segments,
        oom_at=peaks.oom_at,
    )


def _apply(alloc: _Allocator, live: dict[int, _Block], zero: set[int], event: tuple[int, int], *, index: int, peaks: _Peaks) -> None:
    """One event: allocate or free, then move the peaks."""
    sid, nbytes = event
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
    live[sid] = alloc.malloc(nbytes)
    if alloc.ooms > ooms and peaks.oom_at is None:
        peaks.oom_at = index
    if alloc.allocated > peaks.allocated:
        peaks.allocated, peaks.allocated_at = alloc.allocated, index
    if alloc.reserved > peaks.reserved:
        peaks.reserved, peaks.reserved_at = alloc.reserved, index


def _free(alloc: _Allocator, live: dict[int, _Block], zero: set[int], sid: int, index: int) -> None:
    if sid in zero:
        zero.discard(sid)
        return
    block = live.pop(sid, None)
    if block is None:
        where = "in initial" if index < 0 else f"at event {index}"
        raise InputSpecError(f"replay: storage {sid} freed {where} but it is not live; each free must follow an allocation of the same id.")
    alloc.free(block)
