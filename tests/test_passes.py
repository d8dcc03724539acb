"""The saved tensors recorded by the step's own forward are those the capture's own pass records (Note
[One pass for the capture and the step] in fxmem/step/timeline.py, fxmem/step/passes.py).

``analyze(peak=True)`` takes its saved tensors from the step's passes; ``peak=False`` simulates no
step, so it runs the capture's own passes, as every analyze did before. Each case requires the two
accountings to be equal, node for node and storage for storage (bytes in B and S, the nodes charged
and the savers, shapes, kinds, the exact B=1 figures, the unsupported list, the path taken)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import fxmem
from fxmem.results import Accounting
from models_zoo import ZOO
from tests.helpers import tiny_llama
from tests.test_checkpointing import INPUTS as CHECKPOINTED_INPUTS
from tests.test_checkpointing import MODELS as CHECKPOINTED


def _both(make: Callable[[], nn.Module], inputs: object, **kw: object) -> tuple[Accounting, Accounting, fxmem.Report]:
    """Each analyze gets a model of its own: fx names a traced constant after those traced before it."""
    torch.manual_seed(0)
    shared = fxmem.analyze(make(), inputs, peak=True, **kw)  # type: ignore[arg-type]
    torch.manual_seed(0)
    alone = fxmem.analyze(make(), inputs, peak=False, **kw)  # type: ignore[arg-type]
    return shared.accounting, alone.accounting, shared


@pytest.mark.parametrize("target", ["cuda", "cpu"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_models_record_what_the_capture_records(name: str, target: str) -> None:
    spec = ZOO[name](test=True)
    shared, alone, report = _both(lambda: ZOO[name](test=True).model, spec.inputs, loss=spec.loss, target=target, batch=3, name=name)
    assert shared == alone
    assert report.steps is not None and report.steps.peak(3).bytes > 0


def test_repeated_blocks_take_the_shared_passes_too() -> None:
    """The zoo's test configs have too few blocks for Note [Repeated blocks]; a 6-block GPT has enough:
    both accountings come from the 3- and 4-block copies, and are equal."""
    from models_zoo.gpt2_small import GPT

    shared, alone, _ = _both(lambda: GPT(97, 16, 32, 6, 4, dropout=0.1, tied=True), ["B,16:int64"], loss="lm_cross_entropy", batch=2)
    assert "from the model cut to 3 and 4 blocks" in shared.path
    assert shared == alone


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_autocast_records_what_the_capture_records(amp: str) -> None:
    spec = ZOO["vit-b16"](test=True)
    shared, alone, _ = _both(lambda: ZOO["vit-b16"](test=True).model, spec.inputs, loss=spec.loss, amp=amp, batch=2)
    assert shared == alone


@pytest.mark.parametrize("name", sorted(CHECKPOINTED))
def test_checkpointed_models_record_what_the_capture_records(name: str) -> None:
    """Inside a checkpointed region the checkpoint's hooks decide what is saved, and backward runs the
    region again: the recording must see the forward's packing only (a selective policy's cache too)."""
    shared, alone, _ = _both(CHECKPOINTED[name], CHECKPOINTED_INPUTS, target="cpu", batch=3)
    assert shared == alone


def test_hugging_face_llama_records_what_the_capture_records() -> None:
    pytest.importorskip("transformers")
    shared, alone, _ = _both(tiny_llama, {"input_ids": "B,S:int64"}, loss="auto", seq_len=16, batch=2, target="cpu")
    assert shared == alone


class _Traced(nn.Module):
    """A mask fx computes while tracing (a constant in the graph, which the step copies afresh)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(8, 8).tril()
        return torch.relu(self.fc(x) * mask)


@pytest.mark.parametrize("make", [_Traced, lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())])
def test_constants_and_buffers_keep_their_kinds(make: Callable[[], nn.Module]) -> None:
    shared, alone, _ = _both(make, ["B,8,8"] if make is _Traced else ["B,8"], target="cpu", batch=3)
    assert shared == alone


def test_a_step_that_fails_leaves_the_capture_to_its_own_pass() -> None:
    """A model whose step cannot run on one sample (batch norm) still has its B=1 figures explained:
    the capture's own pass fails there too, and the report says why, as without the shared passes."""
    shared, alone, _ = _both(lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), ["B,8"], target="cpu", batch=3)
    assert shared == alone and shared.batch_one_error
