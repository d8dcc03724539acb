"""The caching allocator with ``expandable_segments:True``: one segment per pool that grows page by page.

Note [Expandable segments]
~~~~~~~~~~~~~~~~~~~~~~~~~~
``c10/cuda/CUDACachingAllocator.cpp`` (``ExpandableSegment``, ``find_expandable_block``, ``map_block``,
``unmap_block``): each pool reserves a large range of virtual addresses once and maps physical pages
into it on demand, 2 MiB pages for the small pool and kLargeBuffer (20 MiB) for the large one. Reserved
memory is the mapped pages. A request that no mapped free block fits takes the lowest run of free and
unmapped address space large enough, maps the pages it lacks, and is split off its front; any
remainder of at least kMinBlockSize stays free (``should_split`` splits every expandable block so).
Freed blocks merge with free neighbours; pages stay mapped until memory runs out, when
``release_cached_blocks`` unmaps every whole page inside a free block (``unmap_block``), and the
allocation is tried again. So the segments' rounding of the default allocator is gone: what is wasted
is at most a page per pool plus the holes between live blocks.

Here each pool's range is larger than any device (torch reserves 9/8 of the device's memory in virtual
addresses per segment), so a request never outgrows it. As ``alloc_block`` does before it maps anything,
a memory fraction (``limit``) is checked against the request's segment size (``get_allocation_size``),
not the pages it lacks, so the pages mapped can pass the fraction by less than a page; mapping a run of
pages (``ExpandableSegment::map``, a ``cuMemCreate`` per page) fails only past ``capacity``, and then
maps none of that run (past out-of-memory the replay maps it anyway: Note [When cudaMalloc fails]).
``get_free_block`` keeps its ``max_split_size`` checks, and ranks a free block followed by unmapped space
by the size it could grow to: from the best fit it moves on to the next larger free block while that
one's such size is smaller.
"""

from __future__ import annotations

import bisect

from fxmem.gpu.alloc_conf import AllocatorConfig
from fxmem.gpu.blocks import K_LARGE_BUFFER, K_MIN_BLOCK_SIZE, K_SMALL_BUFFER, Block, allocation_size
from fxmem.gpu.segments import SegmentAllocator

__all__ = ["ExpandableAllocator"]

_RANGE = K_LARGE_BUFFER << 30
"""Virtual address space of one pool's segment: more than any device has, so a request never outgrows it.
A multiple of both page sizes, so that pages, which ``ExpandableSegment`` counts from the segment's start
(``segmentLeft``, ``segmentRight``), also start at multiples of the page size in these addresses."""


class ExpandableAllocator(SegmentAllocator):
    """``DeviceCachingAllocator`` with expandable segments, for one stream (Note [Expandable segments])."""

    def __init__(self, capacity: int | None, limit: int | None, config: AllocatorConfig) -> None:
        super().__init__(capacity, limit, config)
        self.heads = {small: _segment(small) for small in (True, False)}
        """Per pool, a zero-byte sentinel before its segment's first block (it never merges)."""

    def _should_split(self, block: Block, size: int) -> bool:
        return block.size - size >= K_MIN_BLOCK_SIZE

    def _best_fit(self, small: bool, size: int) -> Block | None:
        """``get_free_block`` with expandable segments: from the smallest free block that fits, on to the next
        larger one while its ``expandable_size`` (its size, plus the unmapped block after it) is smaller."""
        keys, blocks = self.pool.keys[small], self.pool.blocks
        i = bisect.bisect_left(keys, (size, -1))
        if i == len(keys):
            return None
        while i + 1 < len(keys) and _reach(blocks[keys[i + 1][1]]) < _reach(blocks[keys[i][1]]):
            i += 1
        return blocks[keys[i][1]]

    def _grow(self, small: bool, size: int) -> Block | None:
        """``alloc_block`` -> ``try_allocate_expandable_block``, and after ``release_cached_blocks`` once more."""
        block = self._map_run(small, size) if self._within_limit(size) else None
        if block is None:
            self.retries += 1
            self._release_all()
            block = self._map_run(small, size) if self._within_limit(size) else None
        return block

    def _past_capacity(self, small: bool, size: int) -> Block:
        """Past out-of-memory, the lowest run's pages mapped as if the device had them."""
        capacity, self.capacity = self.capacity, None
        try:
            block = self._map_run(small, size)
        finally:
            self.capacity = capacity
        assert block is not None
        return block

    def _within_limit(self, size: int) -> bool:
        """``alloc_block``'s check of the memory fraction: what is mapped plus the request's segment size."""
        return self.limit is None or self.reserved + allocation_size(size) <= self.limit

    def _map_run(self, small: bool, size: int) -> Block | None:
        """``try_allocate_expandable_block``: map what the lowest free-or-unmapped run of ``size`` bytes
        lacks, block by block; the run, merged and out of the pool, or None where a map fails."""
        block: Block | None = self._lowest_run(small, size)
        assert block is not None
        if not block.mapped:
            block = self._map(block, min(block.size, size))
        while block is not None and block.size < size:
            unmapped = block.next  # a mapped free block merges with the free neighbours it has
            assert unmapped is not None and not unmapped.mapped
            block = self._map(unmapped, min(unmapped.size, size - block.size))
        if block is not None:
            self.pool.remove(block)
        return block

    def _lowest_run(self, small: bool, size: int) -> Block:
        """``find_expandable_block``: walking the segment, the first unmapped block (taken with the free
        block just before it) from which free and unmapped blocks add up to ``size``."""
        block = self.heads[small].next
        while block is not None:
            if not block.mapped:
                start = block.prev if self.pool.is_free(block.prev) else block
                assert start is not None
                if sum(b.size for b in self._run(start, size)) >= size:
                    return start
            block = block.next
        raise AssertionError("an expandable segment's address range ran out")

    def _run(self, start: Block, size: int) -> list[Block]:
        """Consecutive free or unmapped blocks from ``start`` until they hold ``size`` bytes."""
        run: list[Block] = []
        total, block = 0, start
        while block is not None and total < size and not block.allocated:
            run.append(block)
            total += block.size
            block = block.next
        return run

    def _map(self, block: Block, nbytes: int) -> Block | None:
        """``map_block``: map the pages covering the first ``nbytes`` of an unmapped block (None where they
        do not fit in ``capacity``), merge it with its free neighbours and put it in the pool."""
        page = K_SMALL_BUFFER if block.small else K_LARGE_BUFFER
        nbytes = min(-(-nbytes // page) * page, block.size)
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            return None
        if nbytes < block.size:
            rest = block.split(nbytes)
            rest.mapped = False
        block.mapped = True
        self.reserved += nbytes
        self.segments += 1 - _in_run(block.prev) - _in_run(block.next)
        self._pool_merged(block)
        return block

    def _release_all(self) -> None:
        """``release_cached_blocks`` with expandable segments: ``unmap_block`` every free block's whole pages."""
        for block in list(self.pool.blocks.values()):
            self._unmap(block)

    def _unmap(self, block: Block) -> None:
        """Unmap the pages wholly inside a free block; what is left either side stays mapped and free."""
        page = K_SMALL_BUFFER if block.small else K_LARGE_BUFFER
        begin = -(-block.addr // page) * page
        end = (block.addr + block.size) // page * page
        if end <= begin:
            return
        self.pool.remove(block)
        if begin > block.addr:
            head = block
            block = head.split(begin - head.addr)
            self.pool.insert(head)
        if end < block.addr + block.size:
            self.pool.insert(block.split(end - block.addr))
        block.mapped = False
        self.reserved -= block.size
        self.segments += _in_run(block.prev) + _in_run(block.next) - 1
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.mapped:
                block.absorb(neighbour)


def _reach(block: Block) -> int:
    """``get_free_block``'s ``expandable_size``: a free block's size plus the unmapped block after it."""
    return block.size + (block.next.size if block.next is not None and not block.next.mapped else 0)


def _in_run(block: Block | None) -> int:
    """1 where ``block`` is mapped memory of a segment (not its zero-byte sentinel): a mapped run's part."""
    return int(block is not None and block.mapped and block.size > 0)


def _segment(small: bool) -> Block:
    """A pool's segment: a sentinel, then the whole range unmapped (the two pools' ranges do not overlap)."""
    base = 0 if small else _RANGE
    head, rest = Block(base, 0, small), Block(base, _RANGE, small, mapped=False)
    head.allocated = True
    head.next, rest.prev = rest, head
    return head
