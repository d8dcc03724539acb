"""The caching allocator with ``cudaMalloc``ed segments (torch's default), for one stream.

The rules are ``DeviceCachingAllocator``'s in ``c10/cuda/CUDACachingAllocator.cpp``; fxmem/gpu/allocator.py
replays a step through this class (or its expandable-segments form, fxmem/gpu/expandable.py) and
explains what happens when memory runs out (Note [When cudaMalloc fails]).
"""

from __future__ import annotations

from fxmem.gpu.alloc_conf import AllocatorConfig
from fxmem.gpu.blocks import K_LARGE_BUFFER, K_MIN_BLOCK_SIZE, K_SMALL_SIZE, Block, FreePool, allocation_size, round_size

__all__ = ["SegmentAllocator"]


class SegmentAllocator:
    """``DeviceCachingAllocator`` for one stream, with ``cudaMalloc``ed segments: best fit from the pool
    of the request's size, else a new segment (Note [When cudaMalloc fails]); then split."""

    def __init__(self, capacity: int | None, limit: int | None, config: AllocatorConfig) -> None:
        self.capacity, self.limit, self.config = capacity, limit, config
        self.pool = FreePool()
        self.next_addr = 0
        self.allocated = self.reserved = self.segments = 0
        self.ooms = self.retries = 0

    def malloc(self, nbytes: int, optional: bool = False) -> Block | None:
        """A block for ``nbytes``; None where ``optional`` and out of memory."""
        size = round_size(nbytes)
        small = size <= K_SMALL_SIZE  # get_pool
        block = self._take_free(small, size) or self._grow(small, size)
        if block is None:
            if optional:
                return None
            self.ooms += 1
            block = self._past_capacity(small, size)
        if self._should_split(block, size):  # alloc_found_block: the front is handed out, the rest stays free
            self.pool.insert(block.split(size))
        block.allocated = True
        self.allocated += block.size
        return block

    def free(self, block: Block) -> None:
        """``DeviceCachingAllocator::free`` -> ``free_block``: merge with free neighbours, back to the pool."""
        block.allocated = False
        self.allocated -= block.size
        self._pool_merged(block)

    def _pool_merged(self, block: Block) -> None:
        """``try_merge_blocks`` with each free neighbour, then the block back into the pool."""
        for neighbour in (block.prev, block.next):
            if self.pool.is_free(neighbour):
                assert neighbour is not None
                self.pool.remove(neighbour)
                block.absorb(neighbour)
        self.pool.insert(block)

    def _should_split(self, block: Block, size: int) -> bool:
        """``should_split``: a small-pool block when at least kMinBlockSize is left over, a large-pool one
        when more than kSmallSize is and the request is under ``max_split_size``."""
        remaining = block.size - size
        if block.small:
            return remaining >= K_MIN_BLOCK_SIZE
        limit = self.config.max_split_size
        return (limit is None or size < limit) and remaining > K_SMALL_SIZE

    def _take_free(self, small: bool, size: int) -> Block | None:
        """``get_free_block``: the best fit, unless ``max_split_size`` forbids it (an oversize block for a
        small request, or one more than kLargeBuffer larger than an oversize request)."""
        self.pool.searches[small] += 1
        block = self._best_fit(small, size)
        limit = self.config.max_split_size
        if block is None or (limit is not None and _oversize_refused(size, block.size, limit)):
            return None
        self.pool.remove(block)
        return block

    def _best_fit(self, small: bool, size: int) -> Block | None:
        """``get_free_block``'s ``pool.blocks.lower_bound``: the smallest free block that fits."""
        return self.pool.lowest_fit(small, size)

    def _grow(self, small: bool, size: int) -> Block | None:
        """Steps 1-4 of Note [When cudaMalloc fails]: a new segment, or None."""
        nbytes = allocation_size(size)
        if self.limit is not None and self.config.garbage_collection_threshold > 0:
            self._collect_garbage()
        if self._room(nbytes):
            return self._segment(small, nbytes)
        if self._release_available(small, size) and self._room(nbytes):
            return self._segment(small, nbytes)
        self.retries += 1
        self._release_all()
        return self._segment(small, nbytes) if self._room(nbytes) else None

    def _past_capacity(self, small: bool, size: int) -> Block:
        """The segment the request would have had, placed as if the memory existed (Note [When cudaMalloc fails])."""
        return self._segment(small, allocation_size(size))

    def _room(self, nbytes: int) -> bool:
        """Whether ``cudaMalloc(nbytes)`` succeeds: within the fraction's limit and the device's free memory."""
        return all(bound is None or self.reserved + nbytes <= bound for bound in (self.capacity, self.limit))

    def _segment(self, small: bool, nbytes: int) -> Block:
        """``alloc_block``: a ``cudaMalloc`` of ``nbytes`` at an address above all earlier segments."""
        block = Block(self.next_addr, nbytes, small)
        self.next_addr += nbytes
        self.reserved += nbytes
        self.segments += 1
        return block

    def _release(self, block: Block) -> None:
        """``release_block``: ``cudaFree`` a cached whole segment."""
        self.pool.remove(block)
        self.reserved -= block.size
        self.segments -= 1

    def _release_all(self) -> None:
        """``release_cached_blocks`` -> ``release_blocks``: every cached whole segment, both pools."""
        for block in [b for b in self.pool.blocks.values() if b.whole]:
            self._release(block)

    def _release_available(self, small: bool, size: int) -> bool:
        """``release_available_cached_blocks``: with ``max_split_size``, one cached oversize block of at
        least max(size, max_split_size), else the largest oversize ones until that much is freed."""
        limit = self.config.max_split_size
        if limit is None:
            return False
        want = max(size, limit)
        found = self.pool.lowest_fit(small, want)
        if found is not None:
            if found.whole:
                self._release(found)
            return found.whole
        freed = 0
        for _, addr in reversed(list(self.pool.keys[small])):
            block = self.pool.blocks[addr]
            if freed >= want or block.size < limit:
                break
            if block.whole:
                freed += block.size
                self._release(block)
        return freed >= want

    def _collect_garbage(self) -> None:
        """``garbage_collect_cached_blocks``: past threshold x limit, release the oldest cached large segments."""
        assert self.limit is not None
        threshold = int(self.config.garbage_collection_threshold * self.limit)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        now = self.pool.searches[False]
        candidates = [b for b in self.pool.blocks.values() if not b.small and b.whole]
        total_age, count = sum(now - b.age for b in candidates), len(candidates)
        while reclaimed < target and count > 0:
            average = total_age / count
            old = [b for b in candidates if b.addr in self.pool.blocks and now - b.age >= average]
            if not old:
                return
            for block in old:
                reclaimed += block.size
                total_age -= now - block.age
                count -= 1
                self._release(block)
            candidates = [b for b in candidates if b.addr in self.pool.blocks]


def _oversize_refused(size: int, found: int, limit: int) -> bool:
    """``get_free_block``'s two ``max_split_size`` checks (the second with ``max_non_split_rounding_size``'s
    default, kLargeBuffer)."""
    return (size < limit <= found) or (size >= limit and found >= size + K_LARGE_BUFFER)
