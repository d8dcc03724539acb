"""fxmem/measure_ranks.py's own bookkeeping, on hand-made profiler events (the real multi-process runs
are tests/test_parallel.py, tests/test_tensor_parallel.py and tests/test_pipeline.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fxmem.measure_ranks import _backend_allocations

STEP, WORKER = 1, 2
"""Thread ids: the step's, and a gloo worker's."""


@dataclass
class _Op:
    name: str
    parent: Any = None


@dataclass
class _Alloc:
    """The fields of a profiler allocation event that ``_backend_allocations`` reads."""

    size: int
    allocation_id: int
    start_tid: int = STEP
    parent: Any = None

    @property
    def typed(self) -> tuple[None, Any]:
        return None, self

    @property
    def alloc_size(self) -> int:
        return self.size


def test_a_backend_allocation_and_its_free_only_are_left_out() -> None:
    """The case seen on a sequence-parallel rank: gloo's copy inside a reduce-scatter (8,192 B, id 86)
    is freed after the step has allocated a dropout mask (4,096 B) that the profiler gave the same id.
    Only the copy and its free are the backend's; the mask and its free are the step's. A worker
    thread's allocation is the backend's wherever it is freed. Events are in time order, most on
    the step's thread, so that thread is the step's."""
    inside = _Op("aten::clone", _Op("c10d::reduce_scatter_tensor_coalesced_"))
    copy, mask = _Alloc(8192, 86, parent=inside), _Alloc(4096, 86)
    mask_freed, copy_freed = _Alloc(-4096, 86), _Alloc(-8192, 86, WORKER)
    other, other_freed = _Alloc(512, 90, WORKER), _Alloc(-512, 90)
    step = [_Alloc(128, 1), _Alloc(-128, 1), _Alloc(256, 2)]
    events = [*step, copy, mask, other, mask_freed, copy_freed, other_freed]
    assert _backend_allocations(events) == {id(copy), id(copy_freed), id(other), id(other_freed)}


def test_a_free_of_an_allocation_made_before_the_profile_counts() -> None:
    """A backend tensor allocated before the profile began has no allocation in it: its free is not
    paired, and counts (``_highest`` counts every free; Note [Collective inputs a real rank holds
    longer] in tests/helpers.py)."""
    events = [_Alloc(64, 1), _Alloc(-1024, 7, WORKER), _Alloc(-64, 1), _Alloc(32, 3)]
    assert _backend_allocations(events) == set()
