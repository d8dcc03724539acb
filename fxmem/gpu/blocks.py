"""The caching allocator's sizes and blocks, shared by its two segment kinds (fxmem/gpu/allocator.py and
fxmem/gpu/expandable.py): the constants and rounding of ``c10/cuda/CUDACachingAllocator.cpp``, its
``Block`` and a pool of free blocks ordered as ``BlockComparatorSize`` orders them.
"""

from __future__ import annotations

import bisect

__all__ = [
    "K_LARGE_BUFFER",
    "K_MIN_BLOCK_SIZE",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "K_SMALL_BUFFER",
    "K_SMALL_SIZE",
    "Block",
    "FreePool",
    "allocation_size",
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



class Block:
    """A block of a segment (``struct Block``): neighbours in the same segment are linked. ``mapped`` is
    False only for the unmapped address space of an expandable segment; ``age`` is the pool's count of
    free-block searches when the block was last put back (``gc_count_base``)."""

    __slots__ = ("addr", "age", "allocated", "mapped", "next", "prev", "size", "small")

    def __init__(self, addr: int, size: int, small: bool, mapped: bool = True) -> None:
        self.addr, self.size, self.small, self.mapped = addr, size, small, mapped
        self.allocated = False
        self.age = 0
        self.prev: Block | None = None
        self.next: Block | None = None

    @property
    def whole(self) -> bool:
        """A whole segment (``!is_split()``): the only kind ``release_block`` can ``cudaFree``."""
        return self.prev is None and self.next is None

    def split(self, size: int) -> Block:
        """Keep the first ``size`` bytes; the rest becomes a new block linked after this one."""
        rest = Block(self.addr + size, self.size - size, self.small, self.mapped)
        rest.prev, rest.next = self, self.next
        if self.next is not None:
            self.next.prev = rest
        self.next, self.size = rest, size
        return rest

    def absorb(self, other: Block) -> None:
        """``try_merge_blocks``: take in a neighbour (before or after) of the same segment."""
        if other is self.prev:
            self.addr, self.prev = other.addr, other.prev
            if self.prev is not None:
                self.prev.next = self
        else:
            self.next = other.next
            if self.next is not None:
                self.next.prev = self
        self.size += other.size


class FreePool:
    """The free (mapped) blocks of the two pools, each kept sorted by (size, address) and searched by
    bisection for the best fit (``BlockPool::blocks`` with ``BlockComparatorSize``). ``searches`` counts
    ``get_free_block`` calls per pool, the clock of garbage collection's ages."""

    def __init__(self) -> None:
        self.keys: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        self.blocks: dict[int, Block] = {}
        self.searches = {True: 0, False: 0}

    def insert(self, block: Block) -> None:
        bisect.insort(self.keys[block.small], (block.size, block.addr))
        self.blocks[block.addr] = block
        block.age = self.searches[block.small]

    def remove(self, block: Block) -> None:
        keys = self.keys[block.small]
        del keys[bisect.bisect_left(keys, (block.size, block.addr))]
        del self.blocks[block.addr]

    def lowest_fit(self, small: bool, size: int) -> Block | None:
        """The smallest free block of at least ``size`` (lowest address on ties), left in the pool."""
        keys = self.keys[small]
        i = bisect.bisect_left(keys, (size, -1))
        return self.blocks[keys[i][1]] if i < len(keys) else None

    def is_free(self, block: Block | None) -> bool:
        return block is not None and not block.allocated and block.mapped and self.blocks.get(block.addr) is block
