"""FSDP2's CPU offload (``offload=True``: ``fully_shard(..., offload_policy=CPUOffloadPolicy())``),
simulated on one rank (Note [FSDP2's CPU offload] in fxmem/parallel/fsdp.py): the sharded state in
host memory, the device holding only the copies that pass through it."""

from __future__ import annotations

import functools

import pytest
import torch.distributed as dist

import fxmem
from fxmem.errors import InputSpecError
from fxmem.parallel import ParallelPlan
from fxmem.results import Category, Phase
from models_zoo.gpt2_small import build

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

BATCH = 4
FP32 = 4

# The zoo's GPT test model (vocab 101, context 16, d=32, 2 blocks, MLP 4d, the LM head tied to the
# token embedding), each parameter cut by FSDP2 over 2 ranks into ceil(rows / 2) rows of dim 0; rank 0
# holds the first, full, chunk. Parameter elements of rank 0's shards:
ROOT = 51 * 32 + 8 * 32 + 16 + 16  # tok (101 x 32: 51 rows), pos (16 x 32: 8 rows), ln_f weight and bias (32: 16 each)
BLOCK = (
    4 * 16  # ln1, ln2: weight and bias, 32 each
    + 48 * 32 + 48  # attn.qkv: 96 x 32 and 96
    + 16 * 32 + 16  # attn.proj: 32 x 32 and 32
    + 64 * 32 + 64  # mlp.0: 128 x 32 and 128
    + 16 * 128 + 16  # mlp.2: 32 x 128 and 32
)
SHARDS = (ROOT + 2 * BLOCK) * FP32  # 14,624 elements: 58,496 B of fp32 weights
MOMENTS = 2 * SHARDS  # AdamW's exp_avg and exp_avg_sq, each shaped like its shard
STEPS = 28 * FP32  # AdamW's fp32 ``step`` tensor per parameter tensor (28 of them), host memory on the CPU target


def _analyze(offload: bool, **kw: object) -> fxmem.Report:
    spec = build(test=True)
    return fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, batch=BATCH, target="cpu", fsdp=2, offload=offload, **kw)


@pytest.fixture(scope="module")
def reports() -> tuple[fxmem.Report, fxmem.Report]:
    return _analyze(False), _analyze(True)


def test_offload_leaves_the_sharded_state_to_the_host(reports: tuple[fxmem.Report, fxmem.Report]) -> None:
    """Both peaks are in backward of blocks.1's MLP, before any reduce-scatter: then the device holds
    the weights' shards and the optimizer state without offload, and neither with it. The staging copies
    of the shards are gone by then (each is dropped once it fills the all-gather buffer), so what
    remains on the device of the engine is the same gathered weights: the peak falls by exactly the
    shards and AdamW's state (3 x 58,496 + 112 = 175,600 B: 793,720 B against 618,120 B)."""
    plain, offloaded = reports
    before, after = plain.peak(BATCH), offloaded.peak(BATCH)
    staged_at_peak = after.breakdown[Category.COMMUNICATION] - before.breakdown[Category.COMMUNICATION]
    assert staged_at_peak == 0
    assert before.bytes - after.bytes == SHARDS + MOMENTS + STEPS - staged_at_peak
    assert offloaded.step_bytes(BATCH) == after.bytes
    assert (after.phase, after.node) == (before.phase, before.node) == (Phase.BACKWARD, "blocks_1_mlp_2")
    assert Category.PARAMETER not in after.breakdown and Category.OPTIMIZER_STATE not in after.breakdown
    assert offloaded.activation_bytes(BATCH) == plain.activation_bytes(BATCH)
    assert (before.breakdown[Category.PARAMETER], before.breakdown[Category.OPTIMIZER_STATE]) == (SHARDS, MOMENTS + STEPS)


def test_offload_stages_each_units_shards_and_sends_gradients_home(reports: tuple[fxmem.Report, fxmem.Report]) -> None:
    """The device side of the offloaded step: before each unit's all-gather in forward, one copy of its
    padded shards (the root's 1,920 elements, each block's 6,352); in backward, each unit's
    reduce-scatter output (its gradient shard) is freed once copied to the host, not kept as ``.grad``;
    the optimizer step and zero_grad run on the host and allocate nothing on the device."""
    timeline = reports[1].timeline(BATCH)
    staged = [e for e in timeline.events if e.alloc and e.phase == Phase.FORWARD and e.op == "FSDP::all_gather: aten.clone"]
    per_unit: dict[str, int] = {}
    for e in staged:
        per_unit[e.node] = per_unit.get(e.node, 0) + e.nbytes.at(BATCH)
    assert sorted(per_unit.values()) == [ROOT * FP32, BLOCK * FP32, BLOCK * FP32]
    released = {e.storage for e in timeline.events if not e.alloc}
    outputs = [e for e in timeline.events if e.alloc and e.op.startswith("FSDP::post_backward_reduce")]
    assert outputs and all(e.storage in released for e in outputs)
    assert sum(e.nbytes.at(BATCH) for e in outputs if e.category == Category.COMMUNICATION) == 3 * SHARDS  # inputs 2x, outputs 1x
    assert not [e for e in timeline.events if e.phase in (Phase.OPTIMIZER, Phase.ZERO_GRAD) or e.category == Category.GRADIENT]
    assert Category.PARAMETER not in timeline.baseline


def test_offload_report_says_the_state_is_in_host_memory(reports: tuple[fxmem.Report, fxmem.Report]) -> None:
    plain, offloaded = reports
    share = offloaded.per_gpu
    assert (share.weights.nbytes, share.gradients.nbytes, share.optimizer.nbytes, offloaded.state_per_gpu) == (0, 0, 0, 0)
    for line, nbytes in ((share.weights, SHARDS), (share.gradients, SHARDS), (share.optimizer, MOMENTS + STEPS)):
        assert "in host memory" in line.why and f"{nbytes:,} B" in line.why
    # the host holds what the device held without offload
    held = plain.per_gpu
    assert (held.weights.nbytes, held.gradients.nbytes, held.optimizer.nbytes) == (SHARDS, SHARDS, MOMENTS + STEPS)
    assert "in host memory" in str(offloaded) and "CPU offload" in str(offloaded)


def test_offload_extends_a_deep_step_from_three_blocks() -> None:
    """An 8-block GPT's offloaded step is extended from the 3- and 4-block steps (Note [Repeated blocks]),
    as without offload: the device timeline numbers its storages as the simulation does. Its peak is
    the one simulating all 8 blocks gives (1,607,304 B, found when this was written; the fast path's
    check against the 4-block step is what holds it), which is the peak without offload (2,240,536 B)
    less the host state, ``offloaded_state``'s shards and AdamW state: 210,944 + 422,288 B."""
    from fxmem.step.sharding import offloaded_state
    from fxmem.step.state import get_optimizer
    from models_zoo.gpt2_small import GPT

    model = GPT(101, 16, 32, 8, 2, dropout=0.1, tied=True)
    offloaded = fxmem.analyze(model, ["B,16:int64"], loss="lm_cross_entropy", batch=BATCH, target="cpu", fsdp=2, offload=True)
    assert "cut to 3 and 4 blocks" in offloaded.steps.path
    weights, _, optimizer = offloaded_state(model, 2, get_optimizer("adamw"), "for-loop")
    assert (weights, optimizer) == (210_944, 422_288)
    assert offloaded.peak(BATCH).bytes == 1_607_304 == 2_240_536 - weights - optimizer


def test_offload_on_real_cpu_ranks(monkeypatch: pytest.MonkeyPatch, reports: tuple[fxmem.Report, fxmem.Report]) -> None:
    """Two real gloo ranks run FSDP2 with ``CPUOffloadPolicy(pin_memory=False)`` (a CPU-only torch
    refuses pinning). On CPU ranks host and device are one memory and FSDP2's copies to and from the
    "device" are no-ops, so a real CPU run cannot check what the device holds; it checks what is the
    same on either: the activations each rank saves, and that the state a rank starts the step with
    is the host state the report names (the shards and AdamW's state) beside the batch and target."""
    from fxmem import measure_ranks as ranks_module

    monkeypatch.setattr(ranks_module, "ParallelPlan", functools.partial(ParallelPlan, offload=True))
    spec = build(test=True)
    offloaded = reports[1]
    ranks = ranks_module.measure_ranks(spec.model, spec.inputs, BATCH, fsdp=2, units=offloaded.fsdp_units, loss=spec.loss)
    assert [m.saved for m in ranks] == [offloaded.activation_bytes(BATCH)] * 2
    batch_and_target = 2 * BATCH * 16 * 8  # int64 tokens and their shifted targets
    assert ranks[0].baseline == SHARDS + MOMENTS + STEPS + batch_and_target


def test_offload_without_fsdp_is_one_paragraph() -> None:
    spec = build(test=True)
    with pytest.raises(InputSpecError) as e:
        fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, batch=BATCH, target="cpu", offload=True)
    message = str(e.value)
    assert "\n" not in message and "offload" in message and "fsdp=N" in message and "CPUOffloadPolicy" in message


@pytest.mark.parametrize(
    ("options", "words"),
    [({"fsdp": 2, "pp": 2}, "pipeline"), ({"fsdp": 2, "tp": 2}, "tensor parallel"), ({"fsdp": 2, "offload": "yes"}, "True or False")],
)
def test_offload_refuses_what_it_does_not_model(options: dict[str, object], words: str) -> None:
    spec = build(test=True)
    options.setdefault("offload", True)
    with pytest.raises(InputSpecError, match=words):
        fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, batch=BATCH, target="cpu", **options)
