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
