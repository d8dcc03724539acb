"""fxmem/measure_ranks.py's own bookkeeping, on hand-made profiler events, and a model given as
``file.py:factory`` reaching the rank processes (the real multi-process runs of zoo models are
tests/test_parallel.py, tests/test_tensor_parallel.py and tests/test_pipeline.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from fxmem.cli import main
from fxmem.frontends import load
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


MODEL_FILE = """
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).relu()


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def factory():
    return Stack()
"""
"""Two repeated blocks and a head: FSDP2 units, or two pipeline stages."""


@pytest.fixture
def model_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A model file; the imports of it undone afterwards (sys.path, sys.modules, load's record)."""
    monkeypatch.setattr(sys, "path", [*sys.path])
    monkeypatch.setattr(load, "_USER_FILES", {})
    path = tmp_path / "stack.py"
    path.write_text(MODEL_FILE)
    yield path
    for name in load.user_files():
        sys.modules.pop(name, None)


def test_a_file_model_reaches_the_fsdp_ranks(model_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The file's classes are pickled under this process's module name (``fxmem_user_<hash>``); each
    rank imports the file under that name before it unpickles the step."""
    args = ["measure", f"{model_file}:factory", "--input", "B,8", "--peak", "--target", "cpu", "--fsdp", "2", "--batch", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "rank 0" in out and "rank 1" in out, out


@pytest.mark.parametrize("loss", ["mse", "sum"])
def test_a_file_model_reaches_the_pipeline_ranks(model_file: Path, capsys: pytest.CaptureFixture[str], loss: str) -> None:
    """The same for ``--pp 2`` (fxmem/measure_pipeline.py), whose ranks read the same step file; with
    mse (a target the schedule splits) and with the default sum, which makes no target: torch's
    schedule indexes one anyway, so the last stage hands it an empty one (``_schedule_target``)."""
    args = ["measure", f"{model_file}:factory", "--input", "B,8", "--peak", "--target", "cpu", "--pp", "2", "--microbatches", "2"]
    assert main([*args, "--batch", "2", "--loss", loss]) == 0
    out = capsys.readouterr().out
    assert "rank 0 (first)" in out and "rank 1 (last)" in out, out
