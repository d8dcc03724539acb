"""The caching-allocator replay on hand-computed sequences, against a naive model, and for speed.

Every expected figure is worked out in the comments from the rules of
c10/cuda/CUDACachingAllocator.cpp: sizes round up to 512 B; requests <= 1 MiB use 2 MiB small-pool
segments; 1-10 MiB requests get 20 MiB segments; larger ones a segment rounded up to 2 MiB; a found
block is split if the rest is >= 512 B (small pool) or > 1 MiB (large pool); freed blocks merge with
free neighbours.
"""

from __future__ import annotations

import doctest
import random
import time

import pytest

import fxmem.gpu.allocator
from fxmem.errors import InputSpecError
from fxmem.gpu.alloc_conf import AllocatorConfig
from fxmem.gpu.allocator import FREE, AllocatorReplay, allocation_size, replay, round_size

KiB, MiB = 2**10, 2**20


def test_docstring_examples() -> None:
    result = doctest.testmod(fxmem.gpu.allocator, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_one_byte_takes_a_512_byte_block_in_a_2_mib_segment() -> None:
    r = replay([(0, 1)])
    assert (r.peak_allocated, r.peak_reserved, r.segments) == (512, 2 * MiB, 1)
    assert round_size(0) == 512 and round_size(1000) == 1024 and round_size(1024) == 1024


def test_small_allocations_share_one_segment() -> None:
    # 100,000 B rounds to 196 * 512 = 100,352 B; three of them (301,056 B) fit one 2 MiB segment.
    r = replay([(0, 100_000), (1, 100_000), (2, 100_000)])
    assert r.peak_allocated == 3 * 100_352
    assert (r.peak_reserved, r.segments) == (2 * MiB, 1)


def test_a_full_small_segment_makes_a_second_one() -> None:
    # Two 1 MiB requests fill a 2 MiB segment exactly (the first split leaves 1 MiB >= 512 B; the
    # second takes all of it); the third needs a new segment.
    r = replay([(0, MiB), (1, MiB), (2, MiB)])
    assert (r.peak_allocated, r.peak_reserved, r.segments) == (3 * MiB, 4 * MiB, 2)


def test_5_mib_takes_a_20_mib_segment_and_the_next_5_mib_reuses_it() -> None:
    # 5 MiB is large (> 1 MiB) and < 10 MiB: a 20 MiB segment, split (15 MiB left > 1 MiB).
    first = replay([(0, 5 * MiB)])
    assert (first.peak_allocated, first.peak_reserved) == (5 * MiB, 20 * MiB)
    # The second 5 MiB is carved from the 15 MiB remainder: no new segment.
    both = replay([(0, 5 * MiB), (1, 5 * MiB)])
    assert (both.peak_allocated, both.peak_reserved, both.segments) == (10 * MiB, 20 * MiB, 1)


def test_12_mib_gets_a_12_mib_segment() -> None:
    # >= 10 MiB: the segment is the request rounded up to 2 MiB, 12 MiB; nothing left to split.
    r = replay([(0, 12 * MiB)])
    assert (r.peak_allocated, r.peak_reserved) == (12 * MiB, 12 * MiB)
    assert allocation_size(12 * MiB) == 12 * MiB and allocation_size(12 * MiB + 1) == 14 * MiB


def test_unsplit_block_counts_whole_in_allocated() -> None:
    # 11 MiB + 1 B rounds to 11 MiB + 512 and gets a 12 MiB segment; the 1 MiB - 512 B left is not
    # > 1 MiB, so the block is not split and max_memory_allocated sees the whole 12 MiB.
    r = replay([(0, 11 * MiB + 1)])
    assert (r.peak_allocated, r.peak_reserved) == (12 * MiB, 12 * MiB)


def test_freed_large_block_reused_without_split_when_remainder_is_at_most_1_mib() -> None:
    # Free a 12 MiB block, then ask 11 MiB: best fit is that block; 1 MiB left is not > 1 MiB, so the
    # request gets all 12 MiB. Asking 10.5 MiB instead leaves 1.5 MiB > 1 MiB: split, 10.5 MiB allocated.
    exact_mib = replay([(0, 12 * MiB), (0, FREE), (1, 11 * MiB)])
    assert (exact_mib.final_allocated, exact_mib.peak_reserved) == (12 * MiB, 12 * MiB)
    split = replay([(0, 12 * MiB), (0, FREE), (1, 10 * MiB + 512 * KiB)])
    assert (split.final_allocated, split.peak_reserved) == (10 * MiB + 512 * KiB, 12 * MiB)


def test_best_fit_picks_the_smallest_block_that_fits() -> None:
    # Segments of 14 MiB (12 MiB + 1 rounds up to 14) and 12 MiB, both freed. A 11.5 MiB request
    # takes the 12 MiB one (0.5 MiB left: unsplit), not the 14 MiB one, so the next 13 MiB request
    # still finds the 14 MiB block: no third segment.
    r = replay([(0, 12 * MiB + 1), (1, 12 * MiB), (0, FREE), (1, FREE), (2, 11 * MiB + 512 * KiB), (3, 13 * MiB)])
    assert (r.peak_reserved, r.segments) == (26 * MiB, 2)
    # 12 MiB (unsplit) + 14 MiB (13 MiB leaves exactly 1 MiB: unsplit) allocated at the end.
    assert r.final_allocated == 26 * MiB


def test_freed_neighbours_merge_and_serve_a_larger_request() -> None:
    # Two 5 MiB blocks A, B and a free 10 MiB tail in one 20 MiB segment. Freeing A then B merges
    # A+B (10 MiB) with the tail: one free 20 MiB block, which an 18 MiB request takes (2 MiB left,
    # > 1 MiB: split). Without merging, 18 MiB would need an 18 MiB segment (38 MiB reserved).
    events = [(0, 5 * MiB), (1, 5 * MiB), (0, FREE), (1, FREE), (2, 18 * MiB)]
    r = replay(events)
    assert (r.final_allocated, r.peak_reserved, r.segments) == (18 * MiB, 20 * MiB, 1)


def test_a_free_block_between_live_ones_does_not_merge() -> None:
    # Free only A: free blocks are A (5 MiB) and the 10 MiB tail, apart (B is live between them).
    # 15 MiB fits neither: a new segment, 15 MiB >= 10 MiB rounded up to 16 MiB; 20 + 16 = 36 MiB.
    # Its 1 MiB rest is not > 1 MiB, so the block stays whole: 5 MiB (B) + 16 MiB allocated.
    r = replay([(0, 5 * MiB), (1, 5 * MiB), (0, FREE), (2, 15 * MiB)])
    assert (r.peak_reserved, r.segments, r.final_allocated) == (36 * MiB, 2, 21 * MiB)


def test_pools_do_not_share_blocks() -> None:
    # A free 2 MiB small segment cannot serve a 1.5 MiB (large) request: a 20 MiB segment is made.
    r = replay([(0, MiB), (0, FREE), (1, MiB + MiB // 2)])
    assert r.peak_reserved == 2 * MiB + 20 * MiB


def test_reserved_never_shrinks() -> None:
    events = [(0, 5 * MiB), (1, 30 * MiB), (2, 100), (0, FREE), (1, FREE), (2, FREE)]
    r = replay(events)
    # Segments: 20 MiB (5 MiB), 30 MiB (30 MiB >= 10 MiB, already a multiple of 2 MiB), 2 MiB (100 B).
    assert r.peak_reserved == r.final_reserved == 52 * MiB
    assert r.final_allocated == 0 and r.segments == 3
    assert r.peak_allocated == 5 * MiB + 30 * MiB + 512
    assert r.cached_at_peak_reserved == 52 * MiB - r.peak_allocated


def test_peak_indices_point_at_the_event_that_reached_them() -> None:
    r = replay([(0, 5 * MiB), (1, 5 * MiB), (0, FREE), (2, 30 * MiB)])
    # allocated: 5, 10, 5, 35 MiB -> peak at event 3; reserved: 20, 20, 20, 50 MiB -> event 3.
    assert (r.peak_allocated, r.peak_allocated_at) == (35 * MiB, 3)
    assert (r.peak_reserved, r.peak_reserved_at) == (50 * MiB, 3)
    first = replay([(0, 5 * MiB), (1, 5 * MiB), (1, FREE), (0, FREE)])
    assert (first.peak_allocated_at, first.peak_reserved_at) == (1, 0)


def test_initial_allocations_count_and_come_first() -> None:
    # Weights of 12 MiB live before the step; the step's 5 MiB goes into a 20 MiB segment of its own.
    r = replay([(1, 5 * MiB), (1, FREE)], initial=[(0, 12 * MiB)])
    assert (r.peak_allocated, r.peak_allocated_at) == (17 * MiB, 0)
    assert (r.final_allocated, r.final_reserved) == (12 * MiB, 32 * MiB)
    only_initial = replay([], initial=[(0, 12 * MiB)])
    assert (only_initial.peak_allocated_at, only_initial.peak_reserved_at) == (-1, -1)


def test_zero_byte_storages_take_nothing() -> None:
    r = replay([(0, 0), (0, FREE), (0, 0)])
    assert (r.peak_allocated, r.peak_reserved, r.segments) == (0, 0, 0)


def test_ids_can_be_reused_after_a_free() -> None:
    r = replay([(0, 100), (0, FREE), (0, 100)])
    assert r.final_allocated == 512


@pytest.mark.parametrize(
    ("events", "match"),
    [
        ([(0, 100), (0, 100)], "storage 0 allocated again at event 1"),
        ([(3, FREE)], "storage 3 freed at event 0 but it is not live"),
        ([(0, 100), (0, FREE), (0, FREE)], "storage 0 freed at event 2"),
    ],
)
def test_inconsistent_events_are_input_errors(events: list[tuple[int, int]], match: str) -> None:
    with pytest.raises(InputSpecError, match=match):
        replay(events)


def test_capacity_releases_cached_segments_before_running_out() -> None:
    # 40 MiB for the allocator. The freed 5 MiB leaves its 20 MiB segment whole and cached; a 30 MiB
    # segment would make 50 MiB, so the cached segment is cudaFree'd first: 30 MiB reserved, no OOM.
    r = replay([(0, 5 * MiB), (0, FREE), (1, 30 * MiB)], capacity=40 * MiB)
    assert r.oom_at is None
    assert (r.final_reserved, r.peak_reserved, r.segments) == (30 * MiB, 30 * MiB, 1)
    # The same without a capacity keeps both segments.
    assert replay([(0, 5 * MiB), (0, FREE), (1, 30 * MiB)]).final_reserved == 50 * MiB


def test_capacity_reports_the_first_event_that_does_not_fit() -> None:
    # The 5 MiB block is live, so its segment cannot be released: 20 + 30 > 40 MiB at event 1. The
    # replay goes on as if it fitted, so the peaks still say what the step wanted.
    r = replay([(0, 5 * MiB), (1, 30 * MiB), (2, 30 * MiB)], capacity=40 * MiB)
    assert r.oom_at == 1
    assert r.peak_reserved == 80 * MiB
    with pytest.raises(InputSpecError, match="capacity"):
        replay([], capacity=-1)


def _naive_replay(events: list[tuple[int, int]]) -> tuple[int, int, int, int]:
    """The same rules with a flat list of blocks and linear scans: slow, but hard to get wrong."""
    blocks: list[list[int]] = []  # [segment, addr, size, small, allocated]
    live: dict[int, list[int]] = {}
    allocated = reserved = peak_a = peak_r = 0
    top = seg = 0
    for sid, nbytes in events:
        if nbytes < 0:
            b = live.pop(sid)
            b[4] = 0
            allocated -= b[2]
            _merge(blocks)
            continue
        size = max(512, -(-nbytes // 512) * 512)
        small = int(size <= MiB)
        fits = [b for b in blocks if not b[4] and b[3] == small and b[2] >= size]
        if fits:
            b = min(fits, key=lambda x: (x[2], x[1]))
        else:
            alloc = 2 * MiB if small else 20 * MiB if size < 10 * MiB else -(-size // (2 * MiB)) * 2 * MiB
            b = [seg, top, alloc, small, 0]
            seg, top, reserved = seg + 1, top + alloc, reserved + alloc
            blocks.append(b)
        rest = b[2] - size
        if (rest >= 512) if small else (rest > MiB):
            blocks.append([b[0], b[1] + size, rest, small, 0])
            b[2] = size
        b[4] = 1
        live[sid] = b
        allocated += b[2]
        peak_a, peak_r = max(peak_a, allocated), max(peak_r, reserved)
    return peak_a, peak_r, allocated, reserved


def _merge(blocks: list[list[int]]) -> None:
    """Join every run of free neighbours in the same segment (after a free there is at most one run)."""
    blocks.sort(key=lambda x: x[1])
    i = 0
    while i + 1 < len(blocks):
        a, b = blocks[i], blocks[i + 1]
        if a[0] == b[0] and not a[4] and not b[4]:
            a[2] += b[2]
            del blocks[i + 1]
        else:
            i += 1


def _random_events(seed: int, n: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    events, live, next_id = [], [], 0
    for _ in range(n):
        if live and rng.random() < 0.45:
            events.append((live.pop(rng.randrange(len(live))), FREE))
            continue
        kind = rng.randrange(4)
        nbytes = (rng.randrange(1, 4 * KiB), rng.randrange(1, MiB + 1), rng.randrange(MiB, 12 * MiB), rng.randrange(10 * MiB, 64 * MiB))[
            kind
        ]
        events.append((next_id, nbytes))
        live.append(next_id)
        next_id += 1
    return events


@pytest.mark.parametrize("seed", range(6))
def test_agrees_with_a_naive_model(seed: int) -> None:
    events = _random_events(seed, 600)
    r = replay(events)
    assert (r.peak_allocated, r.peak_reserved, r.final_allocated, r.final_reserved) == _naive_replay(events)


def test_tens_of_thousands_of_events_replay_quickly() -> None:
    # A 7B-parameter step has tens of thousands of storage events; the sorted free lists keep each
    # event logarithmic to find (its linear list insertions are cheap memmoves). 0.1 s here, measured.
    events = _random_events(7, 60_000)
    start = time.perf_counter()
    r = replay(events)
    assert time.perf_counter() - start < 10.0
    assert isinstance(r, AllocatorReplay) and r.peak_allocated <= r.peak_reserved


# PYTORCH_CUDA_ALLOC_CONF, the device's capacity and the memory fraction. The figures follow
# DeviceCachingAllocator::malloc in c10/cuda/CUDACachingAllocator.cpp: get_free_block, else
# garbage_collect_cached_blocks (with a fraction and a threshold), alloc_block, then
# release_available_cached_blocks (with max_split_size_mb) and alloc_block again, then
# release_cached_blocks and alloc_block(isRetry=true), which counts num_alloc_retries; else OutOfMemoryError.

EXPANDABLE = AllocatorConfig(expandable_segments=True)
MAX_SPLIT_64 = AllocatorConfig(max_split_size=64 * MiB)
GC_HALF = AllocatorConfig(garbage_collection_threshold=0.5)


def test_releasing_the_cache_lets_a_step_fit_and_each_release_is_a_retry() -> None:
    # Capacity 50 MiB. Segments: 12 MiB -> 12 MiB, 5 MiB -> 20 MiB (get_allocation_size, 1-10 MiB; the
    # 12 MiB one is full), 1000 B -> a 2 MiB small one: 34 MiB. Freeing the 5 MiB and the 1000 B leaves
    # those two segments whole and cached. 30 MiB: get_free_block finds nothing >= 30 MiB; alloc_block:
    # 34 + 30 > 50; release_available_cached_blocks does nothing without max_split_size_mb;
    # release_cached_blocks cudaFrees both cached segments (both pools): 12 MiB; the retry: 12 + 30 = 42 MiB.
    # (Had the 5 MiB come first, the 12 MiB would have been split off its segment's 15 MiB rest.)
    events = [(0, 12 * MiB), (1, 5 * MiB), (2, 1000), (1, FREE), (2, FREE), (3, 30 * MiB)]
    r = replay(events, capacity=50 * MiB)
    assert (r.fits, r.oom_at, r.retries) == (True, None, 1)
    assert (r.peak_reserved, r.peak_reserved_at, r.final_reserved, r.segments) == (42 * MiB, 5, 42 * MiB, 2)
    assert (r.peak_allocated, r.peak_allocated_at) == (42 * MiB, 5)  # 12 + 30 > 5 + 12 + 1024 B before
    # Then free the 30 MiB and ask 36 MiB: the cached 30 MiB segment is too small, 42 + 36 > 50, so it is
    # released (a second retry) and 12 + 36 = 48 MiB fits.
    more = replay([*events, (3, FREE), (4, 36 * MiB)], capacity=50 * MiB)
    assert (more.fits, more.retries, more.peak_reserved, more.peak_reserved_at) == (True, 2, 48 * MiB, 7)
    # Unbounded, nothing is released: 20 + 12 + 2 + 30 = 64 MiB.
    unbounded = replay(events)
    assert (unbounded.peak_reserved, unbounded.retries) == (64 * MiB, 0)


def test_when_the_released_cache_is_not_enough_the_replay_carries_on_past_capacity() -> None:
    # Capacity 40 MiB: 12 MiB (live) and 5 MiB (a 20 MiB segment, freed and cached): 32 MiB reserved.
    # 30 MiB: 32 + 30 > 40; release_cached_blocks frees the cached 20 MiB (retry 1); 12 + 30 = 42 > 40
    # still: OutOfMemoryError at event 3. The replay places it anyway: 42 MiB reserved.
    # 1 MiB (small pool, empty): a 2 MiB segment, 42 + 2 > 40, nothing cached to release (retry 2): out of
    # memory again; oom_at keeps the first, and the peaks go on to 44 MiB.
    events = [(0, 12 * MiB), (1, 5 * MiB), (1, FREE), (2, 30 * MiB), (3, MiB)]
    r = replay(events, capacity=40 * MiB)
    assert (r.fits, r.oom_at, r.retries) == (False, 3, 2)
    assert (r.peak_reserved, r.peak_reserved_at) == (44 * MiB, 4)
    assert r.peak_allocated == 12 * MiB + 30 * MiB + MiB


def test_a_memory_fraction_fails_below_the_capacity() -> None:
    # A 100 MiB device with set_per_process_memory_fraction(0.3): allowed_memory_maximum is 30 MiB.
    # alloc_block checks total_allocated_memory + the segment's size against it: two 5 MiB requests share
    # one 20 MiB segment (20 <= 30); 12 MiB needs a 12 MiB segment: 20 + 12 > 30; nothing is cached to
    # release (retry 1): out of memory at event 2 though the device has 68 MiB free.
    events = [(0, 5 * MiB), (1, 5 * MiB), (2, 12 * MiB)]
    limited = replay(events, capacity=100 * MiB, limit=30 * MiB)
    assert (limited.fits, limited.oom_at, limited.retries) == (False, 2, 1)
    assert limited.peak_reserved == 32 * MiB  # placed anyway
    assert replay(events, limit=30 * MiB).oom_at == 2  # the fraction alone bounds the same way
    assert replay(events, capacity=100 * MiB).fits


def test_a_workspace_that_does_not_fit_gets_nothing_and_the_step_still_fits() -> None:
    # Note [A workspace that does not fit]. Capacity 40 MiB: 12 MiB live (a 12 MiB segment), 5 MiB in a
    # 20 MiB segment, freed and cached: 32 MiB. The optional 30 MiB: nothing cached fits; 32 + 30 > 40;
    # release_cached_blocks frees the 20 MiB (retry 1); 12 + 30 > 40: the OutOfMemoryError that cuDNN's
    # try_plans catches. The workspace gets no memory and is listed in shrunk; the step fits. The cache
    # stays released, so the 8 MiB after it needs a new 20 MiB segment: 12 + 20 = 32 MiB.
    events = [(0, 12 * MiB), (1, 5 * MiB), (1, FREE), (2, 30 * MiB, True), (2, FREE), (3, 8 * MiB)]
    r = replay(events, capacity=40 * MiB)
    assert (r.fits, r.oom_at, r.shrunk, r.retries) == (True, None, (3,), 1)
    assert (r.peak_reserved, r.peak_reserved_at, r.final_reserved) == (32 * MiB, 1, 32 * MiB)
    assert (r.peak_allocated, r.peak_allocated_at) == (20 * MiB, 5)  # 12 + 8; the workspace never counted
    # The same allocation, required: out of memory at event 3, placed anyway (12 + 30 = 42 MiB). Freed,
    # its 30 MiB segment serves the 8 MiB (best fit, split: 22 MiB left > 1 MiB): no new segment.
    required = replay([event[:2] for event in events], capacity=40 * MiB)
    assert (required.fits, required.oom_at, required.shrunk) == (False, 3, ())
    assert (required.peak_reserved, required.final_reserved, required.segments) == (42 * MiB, 42 * MiB, 2)
    # Where it fits, an optional allocation is an allocation like any other: 32 + 30 <= 80.
    roomy = replay(events, capacity=80 * MiB)
    assert (roomy.shrunk, roomy.retries, roomy.peak_allocated, roomy.peak_reserved) == ((), 0, 42 * MiB, 62 * MiB)


def test_an_oversize_cached_block_does_not_serve_a_smaller_request() -> None:
    # max_split_size_mb:64. A freed 70 MiB segment is oversize (>= 64 MiB). get_free_block: "Do not
    # return an oversized block for a large request": 60 MiB < 64 MiB may not take it, and a 60 MiB
    # segment is made: 130 MiB. By default 60 MiB takes the 70 MiB block (split: 10 MiB left > 1 MiB).
    events = [(0, 70 * MiB), (0, FREE), (1, 60 * MiB)]
    r = replay(events, config=MAX_SPLIT_64)
    assert (r.peak_reserved, r.final_allocated, r.segments) == (130 * MiB, 60 * MiB, 2)
    default = replay(events)
    assert (default.peak_reserved, default.final_allocated, default.segments) == (70 * MiB, 60 * MiB, 1)


def test_an_oversize_block_is_not_split_and_rounds_up_by_less_than_20_mib() -> None:
    # 66 MiB >= 64 MiB may take the freed 70 MiB block (70 < 66 + 20: max_non_split_rounding_size, by
    # default kLargeBuffer), but should_split is false for a request >= max_split_size: all 70 MiB are
    # allocated. By default the 4 MiB left (> 1 MiB) is split off: 66 MiB allocated.
    events = [(0, 70 * MiB), (0, FREE), (1, 66 * MiB)]
    assert replay(events, config=MAX_SPLIT_64).final_allocated == 70 * MiB
    assert replay(events).final_allocated == 66 * MiB
    # A freed 90 MiB block: 70 MiB may not take it (90 >= 70 + 20): a 70 MiB segment, 160 MiB; 71 MiB may
    # (90 < 91), unsplit: 90 MiB allocated, nothing new reserved.
    refused = replay([(0, 90 * MiB), (0, FREE), (1, 70 * MiB)], config=MAX_SPLIT_64)
    assert (refused.peak_reserved, refused.final_allocated) == (160 * MiB, 70 * MiB)
    taken = replay([(0, 90 * MiB), (0, FREE), (1, 71 * MiB)], config=MAX_SPLIT_64)
    assert (taken.peak_reserved, taken.final_allocated) == (90 * MiB, 90 * MiB)


def test_release_available_cached_blocks_frees_one_oversize_block_before_the_whole_cache() -> None:
    # max_split_size_mb:64, capacity 150 MiB. Segments 70 MiB, 12 MiB and 20 MiB (for 5 MiB): 102 MiB.
    # Free the 70 and the 5 MiB: both segments cached whole. 60 MiB: get_free_block refuses the oversize
    # 70 MiB block (60 < 64); alloc_block: 102 + 60 > 150. release_available_cached_blocks finds one cached
    # block >= max(60, 64) MiB, the 70 MiB one, and releases it: 32 MiB; alloc_block: 32 + 60 = 92 MiB.
    # release_cached_blocks is never reached: no retry, and the 20 MiB segment stays cached.
    events = [(0, 70 * MiB), (1, 12 * MiB), (2, 5 * MiB), (0, FREE), (2, FREE), (3, 60 * MiB)]
    r = replay(events, capacity=150 * MiB, config=MAX_SPLIT_64)
    assert (r.fits, r.retries) == (True, 0)
    assert (r.peak_reserved, r.final_reserved, r.segments) == (102 * MiB, 92 * MiB, 3)  # 12 + 20 + 60


def test_release_available_cached_blocks_frees_the_largest_oversize_blocks_until_enough() -> None:
    # max_split_size_mb:32, capacity 140 MiB. Segments 40 and 36 MiB (oversize), 12 MiB and 20 MiB (for
    # 5 MiB, which comes last so that the 12 MiB is not split off its rest): 108 MiB. Free all but the 12 MiB. 70 MiB: nothing cached fits; 108 + 70 > 140.
    # release_available_cached_blocks finds no single block >= max(70, 32) MiB and frees oversize blocks
    # from the largest down while less than 70 MiB is freed: 40, then 36 (76 >= 70); 32 + 70 = 102 MiB
    # fits. The 20 MiB segment (not oversize) stays cached, and there is no retry.
    conf = AllocatorConfig(max_split_size=32 * MiB)
    events = [(0, 40 * MiB), (1, 36 * MiB), (3, 12 * MiB), (2, 5 * MiB), (0, FREE), (1, FREE), (2, FREE), (4, 70 * MiB)]
    r = replay(events, capacity=140 * MiB, config=conf)
    assert (r.fits, r.retries, r.final_reserved, r.segments) == (True, 0, 102 * MiB, 3)
    # 100 MiB instead: 40 + 36 = 76 < 100 and the next block (20 MiB) is not oversize, so after freeing
    # the two it reports failure; release_cached_blocks frees the 20 MiB too (retry 1): 12 + 100 = 112 MiB.
    short = replay([*events[:-1], (4, 100 * MiB)], capacity=140 * MiB, config=conf)
    assert (short.fits, short.retries, short.final_reserved, short.segments) == (True, 1, 112 * MiB, 2)


def _gc_events() -> list[tuple[int, int]]:
    return [(0, 12 * MiB), (1, 14 * MiB), (2, 16 * MiB), (0, FREE), (3, 18 * MiB), (1, FREE), (3, FREE), (4, 20 * MiB)]


def test_garbage_collection_releases_cached_segments_older_than_average() -> None:
    # garbage_collection_threshold:0.5 under a 100 MiB fraction: collection once reserved passes 50 MiB.
    # Each malloc calls get_free_block on the large pool once, which ticks its get_free_blocks_call_count;
    # a block's gc_count is the ticks since insert_into_blocks put it back in the pool.
    #   events 0-2: ticks 1-3, no cached block fits; 12, 14, 16 MiB segments (42 MiB <= 50: no collection).
    #   event 3: the 12 MiB is put back at tick 3.
    #   event 4: tick 4; nothing cached >= 18 MiB; 42 <= 50; an 18 MiB segment: 60 MiB.
    #   events 5, 6: the 14 and the 18 MiB are put back at tick 4.
    #   event 7: tick 5; nothing cached >= 20 MiB; 60 > 50: garbage_collect_cached_blocks, target 10 MiB.
    #     ages 12 MiB: 5 - 3 = 2, 14 MiB: 1, 18 MiB: 1; average 4/3: only the 12 MiB is as old, released:
    #     12 >= 10 reclaimed. Then the 20 MiB segment: 48 + 20 = 68 MiB.
    r = replay(_gc_events(), limit=100 * MiB, config=GC_HALF)
    assert (r.fits, r.retries) == (True, 0)
    assert (r.peak_reserved, r.final_reserved, r.segments) == (68 * MiB, 68 * MiB, 4)
    # No collection without the threshold, nor without a fraction (it needs allowed_memory_maximum):
    # all five segments stay, 12 + 14 + 16 + 18 + 20 = 80 MiB.
    assert replay(_gc_events(), limit=100 * MiB).peak_reserved == 80 * MiB
    assert replay(_gc_events(), config=GC_HALF).peak_reserved == 80 * MiB


def test_garbage_collection_repeats_with_a_new_average_until_its_target_is_reclaimed() -> None:
    # The same events under a 90 MiB fraction: collection past 45 MiB (events 0-4 stay at or below it);
    # at event 7 the target is 60 - 45 = 15 MiB. First pass (average 4/3): the 12 MiB, 12 < 15. Second
    # pass: ages 1 and 1 left, average 2/2 = 1: both go (14 + 18 MiB). 60 - 44 = 16 MiB, then 20: 36 MiB.
    r = replay(_gc_events(), limit=90 * MiB, config=GC_HALF)
    assert (r.peak_reserved, r.peak_reserved_at, r.final_reserved, r.segments) == (60 * MiB, 4, 36 * MiB, 2)


def test_expandable_segments_map_20_mib_pages_for_the_large_pool() -> None:
    # Note [Expandable segments]: reserved is the mapped pages. 30 MiB maps two kLargeBuffer pages, 40 MiB
    # (the default allocator cudaMallocs a 30 MiB segment). The 10 MiB left on the second page serves a
    # 10 MiB request; the next 30 MiB finds no free block and maps two more pages: 80 MiB. The default
    # makes 30, 10 and 30 MiB segments: 70 MiB.
    events = [(0, 30 * MiB), (1, 10 * MiB), (2, 30 * MiB)]
    one = replay(events[:1], config=EXPANDABLE)
    assert (one.peak_allocated, one.peak_reserved, one.segments) == (30 * MiB, 40 * MiB, 1)
    assert replay(events[:1]).peak_reserved == 30 * MiB
    r = replay(events, config=EXPANDABLE)
    assert (r.peak_allocated, r.peak_reserved, r.segments) == (70 * MiB, 80 * MiB, 1)  # one mapped run
    assert replay(events).peak_reserved == 70 * MiB


def test_expandable_segments_map_2_mib_pages_for_the_small_pool() -> None:
    # 1000 B rounds to 1024 B and maps one 2 MiB page of the small pool's segment. Two 1 MiB requests
    # (kSmallSize: still small) fill the rest but 1024 B, so the second maps a second page: 4 MiB, one run.
    # 1.5 MiB is large: a 20 MiB page of the large pool's own segment.
    events = [(0, 1000), (1, MiB), (2, MiB), (3, MiB + MiB // 2)]
    small = replay(events[:1], config=EXPANDABLE)
    assert (small.peak_allocated, small.peak_reserved) == (1024, 2 * MiB)
    r = replay(events, config=EXPANDABLE)
    assert (r.peak_allocated, r.peak_reserved, r.segments) == (1024 + 3 * MiB + MiB // 2, 24 * MiB, 2)
    # Default: 1024 B + 1 MiB in one 2 MiB segment, the second 1 MiB in another, a 20 MiB one: 24 MiB too.
    assert replay(events).peak_reserved == 24 * MiB


def test_expandable_segments_grow_one_segment_where_the_default_makes_one_per_size() -> None:
    # Growing requests, each freed before the next: 12, 14, 16 MiB. The default's cached 12 MiB segment
    # serves neither 14 nor 16 MiB: 12 + 14 + 16 = 42 MiB. Expandable: 12 MiB maps one 20 MiB page; freed,
    # the whole page is one free block and serves 14 MiB, then 16 MiB: 20 MiB.
    events = [(0, 12 * MiB), (0, FREE), (1, 14 * MiB), (1, FREE), (2, 16 * MiB)]
    assert replay(events).peak_reserved == 42 * MiB
    assert replay(events, config=EXPANDABLE).peak_reserved == 20 * MiB


def test_expandable_pages_are_unmapped_only_when_memory_runs_out() -> None:
    # Capacity 70 MiB. 30 MiB maps [0, 40) and takes [0, 30); 5 MiB takes [30, 35) of the free rest; freeing
    # the 30 MiB leaves [0, 30) free and still mapped: 40 MiB reserved.
    # 45 MiB: no free block is that large. find_expandable_block: the lowest unmapped block, [40, ...), with
    # the free [35, 40) before it, lacks 40 MiB, two pages: 40 + 40 > 70, the map fails.
    # release_cached_blocks -> unmap_block unmaps the whole pages inside free blocks: [0, 20) of [0, 30),
    # none of [35, 40): 20 MiB reserved. The retry maps [40, 80): 60 MiB, one mapped run [20, 80).
    events = [(0, 30 * MiB), (1, 5 * MiB), (0, FREE), (2, 45 * MiB)]
    r = replay(events, capacity=70 * MiB, config=EXPANDABLE)
    assert (r.fits, r.retries, r.segments) == (True, 1, 1)
    assert (r.peak_reserved, r.final_reserved) == (60 * MiB, 60 * MiB)
    assert r.final_allocated == 50 * MiB  # 5 + 45: an expandable block is split down to the request
    # Unbounded, nothing is unmapped: 80 MiB.
    assert (replay(events, config=EXPANDABLE).peak_reserved, replay(events, config=EXPANDABLE).retries) == (80 * MiB, 0)
    # Default, capacity 70 MiB: segments 30 and 20 MiB (5 MiB); the cached 30 MiB is cudaFreed (retry 1)
    # for a 46 MiB segment (45 MiB rounded up to 2 MiB; 1 MiB left is not > 1 MiB: unsplit): 66 MiB.
    default = replay(events, capacity=70 * MiB)
    assert (default.fits, default.retries, default.peak_reserved, default.final_allocated) == (True, 1, 66 * MiB, 51 * MiB)


def test_unmapped_pages_are_mapped_again_at_the_lowest_address() -> None:
    # Capacity 140 MiB, large pool, addresses in MiB from the segment's start.
    #   0: 50 MiB maps [0, 60), takes [0, 50).        1: 8 MiB takes [50, 58) of the free [50, 60).
    #   2: 45 MiB: the free [58, 60) and three new pages [60, 120); takes [58, 103).
    #   3: 15 MiB takes [103, 118) of the free [103, 120).   4, 5: free [0, 50) and [58, 103). 120 MiB.
    #   6: 55 MiB: no free block fits; the lowest run that can hold it is [118, 120) + unmapped, lacking
    #      three pages: 120 + 60 > 140. unmap_block unmaps [60, 100) (of [58, 103)) and [0, 40) (of
    #      [0, 50)): 40 MiB. The retry (1): [0, 40) + [40, 50) = 50 MiB and [58, 60) + [60, 100) + [100, 103)
    #      = 45 MiB are too short; [118, 120) + [120, 180): 100 MiB; takes [118, 173).
    #   7: 38 MiB: no free block fits (10, 7, 3, 2 MiB); the lowest run is the unmapped [0, 40): map_block
    #      maps both pages (140 MiB) and merges the free [40, 50) after them; takes [0, 38), [38, 50) free.
    #   8: 12 MiB takes [38, 50): nothing more mapped.
    events = [(0, 50), (1, 8), (2, 45), (3, 15), (0, FREE), (2, FREE), (4, 55), (5, 38), (6, 12)]
    events = [(sid, nbytes * MiB if nbytes > 0 else nbytes) for sid, nbytes in events]
    r = replay(events, capacity=140 * MiB, config=EXPANDABLE)
    assert (r.fits, r.retries) == (True, 1)
    assert (r.peak_reserved, r.peak_reserved_at, r.final_reserved) == (140 * MiB, 7, 140 * MiB)
    assert (r.final_allocated, r.segments) == ((8 + 15 + 55 + 38 + 12) * MiB, 2)  # runs [0, 60), [100, 180)
    # Default: segments 50, 20, 46, 16 MiB (132 MiB); 55 MiB: the cached 50 and 46 MiB are released
    # (retry 1) for a 56 MiB segment (92 MiB); 38 MiB: a 38 MiB segment (130); 12 MiB fits the 12 MiB left
    # of the 20 MiB segment.
    default = replay(events, capacity=140 * MiB)
    assert (default.fits, default.retries, default.peak_reserved, default.final_reserved) == (True, 1, 132 * MiB, 130 * MiB)


def test_the_lowest_run_is_taken_even_where_the_end_would_need_fewer_pages() -> None:
    # As above to event 6, under a capacity of 120 MiB (event 2 reaches it, event 6 fails at 180 and
    # retries at 100 MiB as before), then 25 MiB: the free blocks (10, 7, 3, 2 MiB) are too small; the
    # lowest run is the unmapped [0, 40) (with the free [40, 50)), and 25 MiB from its start needs two
    # pages: 100 + 40 > 120. No free block holds a whole page to unmap (retry 2): out of memory, though
    # the free [173, 180) and one page after it (120 MiB) would have held it.
    events = [(0, 50), (1, 8), (2, 45), (3, 15), (0, FREE), (2, FREE), (4, 55), (5, 25)]
    events = [(sid, nbytes * MiB if nbytes > 0 else nbytes) for sid, nbytes in events]
    r = replay(events, capacity=120 * MiB, config=EXPANDABLE)
    assert (r.fits, r.oom_at, r.retries) == (False, 7, 2)


def test_expandable_segments_check_the_memory_fraction_against_the_segment_size() -> None:
    # alloc_block checks total_allocated_memory + get_allocation_size(request) against
    # allowed_memory_maximum before try_allocate_expandable_block maps pages; mapping (cuMemCreate) fails
    # only when the device is out of memory. So the pages mapped can pass the fraction, and a request can
    # be refused although the pages it lacks would have fitted under it.
    # Fraction 75 MiB: 40 MiB maps [0, 40); 30 MiB: 40 + 30 <= 75, and two more pages are mapped: 80 MiB.
    over = replay([(0, 40 * MiB), (1, 30 * MiB)], limit=75 * MiB, config=EXPANDABLE)
    assert (over.fits, over.peak_reserved) == (True, 80 * MiB)
    # Fraction 65 MiB: 25 MiB maps [0, 40); 30 MiB lacks 15 MiB, one page (60 MiB), but 40 + 30 > 65:
    # refused; release_cached_blocks finds no whole page inside the free [25, 40); refused again.
    under = replay([(0, 25 * MiB), (1, 30 * MiB)], limit=65 * MiB, config=EXPANDABLE)
    assert (under.fits, under.oom_at, under.retries) == (False, 1, 1)


def test_expandable_best_fit_passes_over_a_block_that_can_grow() -> None:
    # get_free_block, expandable: a free block followed by unmapped space counts as the size it can grow
    # to, so the search moves on from it to the next larger block while that one's such size is smaller.
    # 12 MiB maps [0, 20); 2 MiB takes [12, 14); freeing the 12 MiB leaves [0, 12) and, at the end, [14, 20).
    # 5 MiB: the best fit [14, 20) can grow; [0, 12) cannot: 5 MiB is split off [0, 12), [5, 12) stays free.
    # 10 MiB: neither [5, 12) nor [14, 20) fits; the lowest run is [14, 20) + unmapped, a page more: 40 MiB.
    # (The plain best fit would have kept [0, 12) for the 10 MiB: 20 MiB.) The default: segments 12 and 20
    # MiB; 5 MiB splits the 12 MiB one, 10 MiB the 18 MiB left of the 20 MiB one: 32 MiB.
    events = [(0, 12 * MiB), (1, 2 * MiB), (0, FREE), (2, 5 * MiB), (3, 10 * MiB)]
    assert replay(events, config=EXPANDABLE).peak_reserved == 40 * MiB
    assert replay(events).peak_reserved == 32 * MiB


def test_expandable_segments_keep_get_free_blocks_max_split_size_checks() -> None:
    # get_free_block's max_split_size checks apply to expandable blocks too. max_split_size_mb:64: 70 MiB
    # maps [0, 80); 5 MiB takes [70, 75); freeing the 70 MiB leaves [0, 70) free, oversize. 30 MiB < 64 may
    # not take it; the lowest run, [75, 80) + unmapped, lacks 25 MiB: two pages, 120 MiB. Without
    # max_split_size_mb, 30 MiB is split off [0, 70): 80 MiB.
    events = [(0, 70 * MiB), (1, 5 * MiB), (0, FREE), (2, 30 * MiB)]
    conf = AllocatorConfig(expandable_segments=True, max_split_size=64 * MiB)
    assert replay(events, config=conf).peak_reserved == 120 * MiB
    assert replay(events, config=EXPANDABLE).peak_reserved == 80 * MiB


_CONFIGS = {
    "defaults": AllocatorConfig(),
    "max_split_size_mb:32": AllocatorConfig(max_split_size=32 * MiB),
    "garbage_collection_threshold:0.5": GC_HALF,
    "expandable_segments:True": EXPANDABLE,
    "expandable_segments:True,max_split_size_mb:32": AllocatorConfig(expandable_segments=True, max_split_size=32 * MiB),
}


def _live_requests_peak(events: list[tuple[int, ...]], shrunk: set[int]) -> int:
    """The highest sum of live requests rounded to 512 B (optional ones that gave way hold nothing)."""
    live: dict[int, int] = {}
    total = peak = 0
    for index, (sid, nbytes, *_) in enumerate(events):
        if nbytes < 0:
            total -= live.pop(sid, 0)
        elif nbytes and index not in shrunk:
            live[sid] = round_size(nbytes)
            total += live[sid]
            peak = max(peak, total)
    return peak


@pytest.mark.parametrize("name", sorted(_CONFIGS))
@pytest.mark.parametrize("seed", range(8))
def test_random_steps_keep_the_allocators_invariants(name: str, seed: int) -> None:
    # Random steps (one allocation in ten optional) under every config, unbounded and under bounds around
    # the unbounded peaks: blocks hold at least the rounded requests (exactly, with expandable segments,
    # whose blocks are always split down to them: should_split), segments hold the blocks, and a replay
    # that fits never reserved past the capacity (nor, without expandable segments, the fraction).
    config = _CONFIGS[name]
    rng = random.Random(seed)
    events: list[tuple[int, ...]] = [(*e, True) if e[1] > 0 and rng.random() < 0.1 else e for e in _random_events(seed, 400)]
    free = replay(events, config=config)
    assert (free.fits, free.retries, free.shrunk) == (True, 0, ())
    bounds: list[tuple[int | None, int | None]] = [(int(share * free.peak_reserved), None) for share in (0.95, 0.9, 0.8)]
    bounds += [(None, int(0.9 * free.peak_reserved)), (int(0.8 * free.peak_allocated), free.peak_allocated)]
    for capacity, limit in bounds:
        r = replay(events, capacity=capacity, limit=limit, config=config)
        requested = _live_requests_peak(events, set(r.shrunk))
        assert r.peak_allocated >= requested
        if config.expandable_segments:
            assert r.peak_allocated == requested
        assert r.peak_reserved >= r.peak_allocated and r.final_reserved >= r.final_allocated
        if r.fits and capacity is not None:
            assert r.peak_reserved <= capacity
        if r.fits and limit is not None and not config.expandable_segments:
            assert r.peak_reserved <= limit
    # The unbounded peak reserved is a capacity under which nothing is ever released: the same replay.
    same = replay(events, capacity=free.peak_reserved, config=config)
    assert (same.peak_reserved, same.peak_allocated, same.retries, same.fits) == (free.peak_reserved, free.peak_allocated, 0, True)
