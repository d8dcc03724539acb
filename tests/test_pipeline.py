"""Pipeline parallel (fxmem/step/pipeline.py): the zoo GPT's blocks split into two stages, each
rank's step simulated by torch's own schedule on a fake process group, against the same step on two
real CPU processes (torchrun, gloo, torch's PipelineStage and schedule), each rank profiled."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fxmem
from fxmem.cli import main
from fxmem.engine.losses import get_loss
from fxmem.errors import InputSpecError
from fxmem.frontends.tracing import trace_model
from fxmem.inputs import parse_inputs
from fxmem.measure_ranks import measure_ranks
from fxmem.output.pipeline import render_pipeline
from fxmem.output.render import render
from fxmem.parallel import default_tp_plan
from fxmem.results import Category
from fxmem.step.pipeline import StageLoss, pipeline_plan, split_stages
from models_zoo.gpt2_small import GPT, build
from tests.helpers import assert_rank_peaks, tiny_llama

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")

BATCH = 4  # samples per microbatch
MICRO = 4  # microbatches per step
FLOAT = 4


def _gpt() -> tuple[nn.Module, list[str]]:
    spec = build(test=True)  # 2 pre-LN blocks, d=32, 4 heads, context 16, vocab 101, tied embedding and LM head
    return spec.model, list(spec.inputs)


def test_plan_refuses_what_the_engine_refuses() -> None:
    """Each refusal names the model and the number at fault."""
    model, _ = _gpt()
    with pytest.raises(InputSpecError, match=r"2 blocks in 'blocks' cannot fill 3 pipeline stages .* use --pp 2 or fewer\.$"):
        pipeline_plan(model, 3, 4, "gpipe", name="gpt")
    with pytest.raises(InputSpecError, match=r"1f1b schedule needs at least one microbatch per stage.*1 microbatches for 2 stages"):
        pipeline_plan(model, 2, 1, "1f1b", name="gpt")
    with pytest.raises(InputSpecError, match=r"max\(1, M // P\) = 2 of them for 5 microbatches .* choose --microbatches 4"):
        pipeline_plan(model, 2, 5, "interleaved", name="gpt")
    with pytest.raises(InputSpecError, match=r"2 blocks in 'blocks' cannot fill 4 pipeline stages, 2 per rank, .* use --schedule 1f1b"):
        pipeline_plan(model, 2, 4, "interleaved", name="gpt")
    with pytest.raises(InputSpecError, match=r"split points \[2\] must be 1 increasing block indices in 1\.\.1"):
        pipeline_plan(model, 2, 4, "gpipe", splits=[2], name="gpt")
    with pytest.raises(InputSpecError, match=r"has no repeated blocks"):
        pipeline_plan(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), 2, 2, "gpipe")
    with pytest.raises(InputSpecError, match=r"--schedule 'zigzag' is not one of"):
        pipeline_plan(model, 2, 4, "zigzag")
    with pytest.raises(InputSpecError, match=r"--stages-per-rank 3 applies to --schedule interleaved .* 1f1b runs one stage per rank"):
        pipeline_plan(model, 2, 4, "1f1b", name="gpt", stages_per_rank=3)
    with pytest.raises(InputSpecError, match=r"--stages-per-rank 1 under --schedule interleaved leaves nothing to interleave"):
        pipeline_plan(model, 2, 4, "interleaved", name="gpt", stages_per_rank=1)
    with pytest.raises(InputSpecError, match=r"--stages-per-rank needs a whole number, 1 or more; got 0"):
        pipeline_plan(model, 2, 4, "interleaved", name="gpt", stages_per_rank=0)
    with pytest.raises(
        InputSpecError, match=r"6 blocks in 'blocks' cannot fill 8 pipeline stages, 4 per rank, .* use --stages-per-rank 3 or fewer\.$"
    ):
        pipeline_plan(_gpt6(), 2, 4, "interleaved", name="gpt", stages_per_rank=4)


def test_stages_hold_their_own_parameters() -> None:
    """torchtitan's split: the embeddings and block 0 on stage 0; block 1, the final norm and the LM
    head on stage 1, which reads the tied embedding matrix and so holds its own copy of it."""
    model, inputs = _gpt()
    gm = trace_model(model, parse_inputs(inputs), name="gpt").gm
    graphs = split_stages(gm, pipeline_plan(model, 2, MICRO, "1f1b"))
    first, last = graphs.stages
    assert graphs.loss is None and graphs.target is None  # the GPT reads no labels: the loss is fxmem's, on the logits
    names = lambda stage: {n for n, _ in stage.named_parameters()}
    block = {n for n, _ in model.get_submodule("blocks.0").named_parameters()}
    assert names(first) == {"tok.weight", "pos.weight"} | {f"blocks.0.{n}" for n in block}
    assert names(last) == {"tok.weight", "ln_f.weight", "ln_f.bias"} | {f"blocks.1.{n}" for n in block}
    assert [n.name for n in last.graph.nodes if n.op == "placeholder"] == ["add_2"]  # the residual stream after block 0


@pytest.fixture(scope="module")
def one_f_one_b() -> fxmem.Report:
    model, inputs = _gpt()
    return fxmem.analyze(model, inputs, loss="lm_cross_entropy", batch=BATCH, target="cpu", pp=2, microbatches=MICRO, schedule="1f1b")


def test_rank_state_and_saved_bytes(one_f_one_b: fxmem.Report) -> None:
    """Per rank, by hand. Parameters: stage 0 holds tok (101 x 32), pos (16 x 32) and one block; stage
    1 one block, ln_f (2 x 32) and tok again (the tied head). A block is 12,704 floats: ln1 and ln2
    (2 x 2 x 32), qkv (96 x 32 + 96), proj (32 x 32 + 32), mlp (128 x 32 + 128, 32 x 128 + 32)."""
    block = 2 * 2 * 32 + (96 * 32 + 96) + (32 * 32 + 32) + (128 * 32 + 128) + (32 * 128 + 32)
    first, last = one_f_one_b.pipeline.ranks
    assert (first.role, first.blocks, last.role, last.blocks) == ("first", "blocks.0", "last", "blocks.1")
    assert first.parameters == FLOAT * (101 * 32 + 16 * 32 + block)
    assert last.parameters == FLOAT * (block + 2 * 32 + 101 * 32)
    # Saved per microbatch as a*B + c, B the microbatch: the symbolic pass's line, exact at B=1 too
    # where the line holds (the real ranks below measure it at B=4).
    assert first.activations.per_sample > 0 and last.activations.per_sample > 0
    assert one_f_one_b.peak(BATCH).bytes == max(r.peak(BATCH).bytes for r in (first, last))


def test_what_the_pipeline_changed_against_one_gpu(one_f_one_b: fxmem.Report) -> None:
    """The report's line per rank, by hand. State between steps: the stage's weights and AdamW's two
    moments (3 x its parameters) and a 4-byte step count per parameter tensor (the CPU's AdamW),
    14 tensors on stage 0 (tok, pos, a block's 12), 15 on stage 1 (a block's 12, ln_f's 2, tok);
    one GPU holds all 29,216 parameters (tok 101 x 32, pos 16 x 32, two blocks, ln_f) in 28 tensors.
    1F1B warms stage s up with P - s forwards, so 2 microbatches are in flight at stage 0's peak and
    1 at stage 1's; each rank keeps M receive buffers of one (B, 16, 32) fp32 tensor."""
    run = one_f_one_b.pipeline
    first, last = (run.change(r, BATCH) for r in (0, 1))
    assert first.state == 3 * run.ranks[0].parameters + 4 * 14 and last.state == 3 * run.ranks[1].parameters + 4 * 15
    assert run.one_gpu.state == 3 * FLOAT * 29216 + 4 * 28
    assert (first.microbatches, last.microbatches) == (2, 1)
    assert first.receive_buffers == last.receive_buffers == MICRO * BATCH * 16 * 32 * FLOAT
    assert run.one_gpu.saved(BATCH) == one_f_one_b.activation_bytes(BATCH)
    assert first.activations >= 2 * run.ranks[0].activations.at(BATCH)  # both microbatches' saved tensors
    text = render_pipeline(run, BATCH)
    assert "2 microbatches in flight" in text and "1 microbatch in flight" in text and "receive buffers 32 KiB" in text


@pytest.mark.parametrize("first_step", [False, True], ids=["steady", "first"])
def test_1f1b_ranks_match_real_ranks(one_f_one_b: fxmem.Report, first_step: bool) -> None:
    """Every rank's saved bytes per microbatch exact, its peak within 1% (on this machine: to the byte)."""
    model, inputs = _gpt()
    measured = measure_ranks(
        model, inputs, BATCH, pp=2, microbatches=MICRO, schedule="1f1b", loss="lm_cross_entropy", first_step=first_step
    )
    for m, r in zip(measured, one_f_one_b.pipeline.ranks, strict=True):
        assert m.saved == r.activations.at(BATCH), (m.rank, m.saved, r.activations)
        predicted = r.peak(BATCH, first_step=first_step)
        assert abs(predicted.bytes - m.peak) <= 0.01 * m.peak, (m.rank, predicted.bytes, m.peak)
        assert predicted.phase == m.phase
        baseline = r.steps.timeline(BATCH, first_step=first_step).baseline
        # The receive buffers (Note [Pipeline schedules on a fake group]): 4 microbatches x one (B, 16, 32) fp32 tensor,
        # gradients received on stage 0, activations on stage 1. A real first step makes them inside
        # its step (its peak counts them there); the simulation starts with them.
        assert baseline[Category.COMMUNICATION].at(BATCH) == MICRO * BATCH * 16 * 32 * FLOAT
        made_in_step = MICRO * BATCH * 16 * 32 * FLOAT if first_step else 0
        assert m.baseline + made_in_step == sum(v.at(BATCH) for v in baseline.values())


def test_gpipe_holds_every_microbatch() -> None:
    """GPipe runs all M forwards before any backward, 1F1B at most P - s on stage s: the first stage
    saves M = 4 microbatches at once under GPipe and 2 under 1F1B, so its peak is higher; both
    against the real ranks."""
    model, inputs = _gpt()
    report = fxmem.analyze(model, inputs, loss="lm_cross_entropy", batch=BATCH, target="cpu", pp=2, microbatches=MICRO, schedule="gpipe")
    measured = measure_ranks(model, inputs, BATCH, pp=2, microbatches=MICRO, schedule="gpipe", loss="lm_cross_entropy")
    for m, r in zip(measured, report.pipeline.ranks, strict=True):
        assert m.saved == r.activations.at(BATCH)
        assert abs(r.peak(BATCH).bytes - m.peak) <= 0.01 * m.peak, (m.rank, r.peak(BATCH).bytes, m.peak)
    first = report.pipeline.ranks[0]
    saved = first.activations.at(BATCH)
    assert first.peak(BATCH).breakdown[Category.ACTIVATION] >= MICRO * saved
    assert [r.in_flight(BATCH) for r in report.pipeline.ranks] == [MICRO, MICRO]


def test_pipeline_options_without_pp_warn() -> None:
    model, inputs = _gpt()
    with pytest.warns(
        fxmem.FxmemWarning,
        match=r"Parallelism\.microbatches=4, Parallelism\.schedule='interleaved', Parallelism\.stages_per_rank=3: pipeline options, with no effect without Parallelism\.pp=P",
    ):
        fxmem.analyze(model, inputs, microbatches=4, schedule="interleaved", stages_per_rank=3, peak=False)


def test_cli_analyze_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "zoo:gpt2-small:test", "--target", "cpu", "--pp", "2", "--microbatches", "2", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "Pipeline: pipeline parallel over 2 stages (1f1b, 2 microbatches)" in out
    assert "rank 0 (first, blocks.0)" in out and "rank 1 (last, blocks.1)" in out and "against one GPU: state" in out
    assert main(["analyze", "zoo:gpt2-small:test", "--target", "cpu", "--pp", "4", "--microbatches", "4"]) == 2
    err = capsys.readouterr().err
    assert "2 blocks in 'blocks' cannot fill 4 pipeline stages" in err and len(err.strip().splitlines()) == 1


def test_cli_fsdp_inside_stages(capsys: pytest.CaptureFixture[str]) -> None:
    """``analyze --pp 2 --fsdp 2`` names the sharding in the pipeline's line and FSDP2's buffers per
    rank; ``measure --peak`` runs the 4 ranks and lists each beside its stage's simulated rank; with
    ``--tp 2`` instead, the 4 real ranks are split by tensor parallel too."""
    args = ["zoo:gpt2-small:test", "--target", "cpu", "--pp", "2", "--fsdp", "2", "--microbatches", "2", "--batch", "2"]
    assert main(["analyze", *args]) == 0
    out = capsys.readouterr().out
    assert "each stage FSDP2 over 2 (fully_shard on 2 units and the root)" in out and out.count("FSDP2's buffers") == 2
    assert main(["measure", "--peak", *args]) == 0
    out = capsys.readouterr().out
    assert all(f"rank {r} ({role})" in out for r, role in ((0, "first"), (1, "first"), (2, "last"), (3, "last"))), out
    assert "saved per microbatch exact" in out
    tensor_parallel = ["zoo:gpt2-small:test", "--target", "cpu", "--pp", "2", "--tp", "2", "--microbatches", "2", "--batch", "2"]
    assert main(["measure", "--peak", *tensor_parallel]) == 0  # the real ranks split by tensor parallel too, each beside its stage's
    out = capsys.readouterr().out
    assert "each stage tensor parallel over 2" in out and "rank 3 (last)" in out and "saved per microbatch exact" in out


def test_cuda_ranks_replay_their_own_state_through_the_allocator(capsys: pytest.CaptureFixture[str]) -> None:
    """On the cuda target each rank's step goes through the caching allocator on top of the fixed
    costs, with the state of its own stages: under mixed precision (bf16 weights, fp32 master copies)
    a rank's master weights are 4 bytes per element of its stages' parameters, counted here from the
    model: rank 0 the embeddings and block 0, rank 1 block 1, the final norm and the tied LM head
    (the token embedding, which the last stage holds a copy of)."""
    model, inputs = _gpt()
    report = fxmem.analyze(model, inputs, pp=2, microbatches=2, batch=2, loss="lm_cross_entropy", precision="mixed")
    elements = lambda *modules: sum(p.numel() for m in modules for p in m.parameters())
    stages = [(model.tok, model.pos, model.blocks[0]), (model.blocks[1], model.ln_f, model.tok)]
    for rank, modules in zip(report.pipeline.ranks, stages, strict=True):
        device = rank.peak(2).device
        assert device is not None
        assert dict((name, nbytes) for name, nbytes, _ in device.extra) == {"master weights": 4 * elements(*modules)}
        assert device.allocated >= rank.peak(2).bytes and device.total > device.reserved >= device.allocated
    assert report.peak(2).device == max((r.peak(2).device for r in report.pipeline.ranks), key=lambda d: d.total)
    assert main(["analyze", "zoo:gpt2-small:test", "--pp", "2", "--microbatches", "2", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("; on the h100-80gb: allocated ") == 2, out


LLAMA_INPUTS = {"input_ids": "B,64:int64", "labels": "B,64:int64"}
LLAMA_BATCH, LLAMA_MICRO = 2, 2


def test_llama_stages_recompute_rotary_and_take_labels_as_target() -> None:
    """A HF Llama computes cos, sin and reads the batch size once, before its first layer; stage 1
    recomputes them rather than receiving them (Note [What a stage recomputes]), and the labels,
    read only after the head, reach it as the schedule's target, not through stage 0 (Note [Labels
    as the target])."""
    pytest.importorskip("transformers")
    model = tiny_llama()
    gm = trace_model(model, parse_inputs(LLAMA_INPUTS), name="llama").gm
    graphs = split_stages(gm, pipeline_plan(model, 2, LLAMA_MICRO, "1f1b", name="llama"), "llama")
    first, last = graphs.stages
    placeholders = lambda g: [n for n in g.graph.nodes if n.op == "placeholder"]
    assert [str(n.target) for n in placeholders(first)] == ["input_ids"]
    (received,) = placeholders(last)  # the residual stream after layer 0, nothing else
    assert tuple(received.meta["val"].shape[1:]) == (64, 32)
    made = {str(n.target) for n in last.graph.nodes if n.op == "call_function"}
    assert {"aten.cos.default", "aten.sin.default", "aten.sym_size.int"} <= made
    assert graphs.loss is not None and str(placeholders(graphs.loss)[-1].target) == "labels" and graphs.target == 1
    # The schedule hands the last stage one target: a loss that needs its own besides the labels is refused.
    logits = (torch.zeros(LLAMA_BATCH, 64, 97),)
    with pytest.raises(InputSpecError, match=r"reads the input 'labels' as the schedule's target, and loss 'lm_cross_entropy'"):
        StageLoss(get_loss("lm_cross_entropy"), "llama", graphs.loss).target(graphs, [None, None], logits)


def test_llama_ranks_match_real_ranks() -> None:
    """The HF Llama test config over 2 stages (1F1B, 2 microbatches of 2): every rank's saved bytes
    per microbatch exact, its peak within 1% (on this machine: to the byte), first and steady step."""
    pytest.importorskip("transformers")
    run = dict(pp=2, microbatches=LLAMA_MICRO, schedule="1f1b", loss="model")
    report = fxmem.analyze(tiny_llama(), LLAMA_INPUTS, batch=LLAMA_BATCH, target="cpu", **run)  # type: ignore[arg-type]
    for first_step in (False, True):
        measured = measure_ranks(tiny_llama(), LLAMA_INPUTS, LLAMA_BATCH, first_step=first_step, **run)  # type: ignore[arg-type]
        for m, r in zip(measured, report.pipeline.ranks, strict=True):
            assert m.saved == r.activations.at(LLAMA_BATCH), (first_step, m.rank, m.saved, r.activations)
            predicted = r.peak(LLAMA_BATCH, first_step=first_step)
            assert abs(predicted.bytes - m.peak) <= 0.01 * m.peak, (first_step, m.rank, predicted.bytes, m.peak)
            assert predicted.phase == m.phase
    # What each rank holds as input, by hand: M = 2 microbatches x (B=2, 64) int64 = 2,048 B, the
    # input ids on rank 0, the labels (the target) on rank 1; and its receive buffers, 2 x one
    # (2, 64, 32) fp32 tensor = 32,768 B (gradients on rank 0, activations on rank 1).
    for r in report.pipeline.ranks:
        baseline = r.steps.timeline(LLAMA_BATCH).baseline
        assert baseline[Category.INPUT].at(LLAMA_BATCH) == LLAMA_MICRO * LLAMA_BATCH * 64 * 8
        assert baseline[Category.COMMUNICATION].at(LLAMA_BATCH) == LLAMA_MICRO * LLAMA_BATCH * 64 * 32 * FLOAT


def _gpt4() -> nn.Module:
    """The zoo GPT's test config with 4 blocks: two stages on each of 2 ranks."""
    return GPT(101, 16, 32, 4, 4, dropout=0.1, tied=True)


def test_interleaved_ranks_match_real_ranks() -> None:
    """torch's ScheduleInterleaved1F1B, 2 stages per rank (stage i on rank i mod 2: blocks 0 and 2 on
    rank 0, 1 and 3 on rank 1), 4 microbatches of 4, against the real ranks (steady step; the first
    is exact too: 1,461,504 and 1,092,372 B measured). In flight at the peak, from torch's
    ``_get_warmup_ops``: rank r warms up with (V - 1) x M/rounds + 2 x (P - 1 - r) forwards (4 on
    rank 0, 2 on rank 1), one more before its first backward: 5 and 3 (stage, microbatch) pairs."""
    _, inputs = _gpt()
    run = dict(pp=2, microbatches=MICRO, schedule="interleaved", loss="lm_cross_entropy")
    report = fxmem.analyze(_gpt4(), inputs, batch=BATCH, target="cpu", **run)  # type: ignore[arg-type]
    plan = report.pipeline.plan
    assert (plan.local(0), plan.local(1), report.pipeline.ranks[0].blocks) == ((0, 2), (1, 3), "blocks.0, blocks.2")
    measured = measure_ranks(_gpt4(), inputs, BATCH, **run)  # type: ignore[arg-type]
    for m, r in zip(measured, report.pipeline.ranks, strict=True):
        assert m.saved == r.activations.at(BATCH), (m.rank, m.saved, r.activations)
        predicted = r.peak(BATCH)
        assert abs(predicted.bytes - m.peak) <= 0.01 * m.peak, (m.rank, predicted.bytes, m.peak)
        assert predicted.phase == m.phase
    assert [r.in_flight(BATCH) for r in report.pipeline.ranks] == [5, 3]
    # Receive buffers, M x one (B, 16, 32) fp32 tensor (8 KiB) each: rank 0's stage 0 receives
    # gradients, its stage 2 activations and gradients; rank 1's stage 1 both, its stage 3 activations.
    assert [report.pipeline.change(r, BATCH).receive_buffers for r in (0, 1)] == [3 * MICRO * BATCH * 16 * 32 * FLOAT] * 2


def _gpt6() -> nn.Module:
    """The zoo GPT's test config with 6 blocks: three stages on each of 2 ranks."""
    return GPT(101, 16, 32, 6, 4, dropout=0.1, tied=True)


@pytest.mark.parametrize("first_step", [False, True])
def test_three_stages_per_rank_match_real_ranks(first_step: bool) -> None:
    """ScheduleInterleaved1F1B with V = 3 stages per rank (stage i on rank i mod 2: blocks 0, 2, 4 on
    rank 0 and 1, 3, 5 on rank 1), 4 microbatches of 4, against the real ranks. In flight at the
    peak, from torch's ``_get_warmup_ops``: rank r warms up with (V - 1) x M/rounds + 2 x (P - 1 - r)
    forwards, rounds = max(1, M // P) = 2: (3 - 1) x 2 + 2 = 6 on rank 0 and 4 on rank 1, and runs one
    more before its first backward: 7 and 5."""
    _, inputs = _gpt()
    run = dict(pp=2, microbatches=MICRO, schedule="interleaved", loss="lm_cross_entropy", stages_per_rank=3)
    report = fxmem.analyze(_gpt6(), inputs, batch=BATCH, target="cpu", **run)  # type: ignore[arg-type]
    plan = report.pipeline.plan
    assert (plan.local(0), plan.local(1), report.pipeline.ranks[1].blocks) == ((0, 2, 4), (1, 3, 5), "blocks.1, blocks.3, blocks.5")
    assert "2 ranks, 6 stages" in plan.describe()
    measured = measure_ranks(_gpt6(), inputs, BATCH, first_step=first_step, **run)  # type: ignore[arg-type]
    for m, r in zip(measured, report.pipeline.ranks, strict=True):
        assert m.saved == r.activations.at(BATCH), (m.rank, m.saved, r.activations)
        predicted = r.peak(BATCH, first_step=first_step)
        assert abs(predicted.bytes - m.peak) <= 0.01 * m.peak, (m.rank, predicted.bytes, m.peak)
        assert predicted.phase == m.phase
    assert [r.in_flight(BATCH) for r in report.pipeline.ranks] == [7, 5]
    # Receive buffers, M x one (B, 16, 32) fp32 tensor each: rank 0's stage 0 receives gradients, its
    # stages 2 and 4 activations and gradients; rank 1's stages 1 and 3 both, its stage 5 activations.
    assert [report.pipeline.change(r, BATCH).receive_buffers for r in (0, 1)] == [5 * MICRO * BATCH * 16 * 32 * FLOAT] * 2


# FSDP2 inside the stages (Note [Data parallel inside pipeline stages] in fxmem/parallel/rank.py) ----------------------

BLOCK = 2 * 2 * 32 + (96 * 32 + 96) + (32 * 32 + 32) + (128 * 32 + 128) + (32 * 128 + 32)
"""Floats in one block of the GPT test config (see test_rank_state_and_saved_bytes): 12,704."""
SENT = BATCH * 16 * 32 * FLOAT
"""What a stage of the GPT test config sends per microbatch: its (B, 16, 32) fp32 output or input gradient."""


@pytest.fixture(scope="module")
def sharded_stages() -> fxmem.Report:
    model, inputs = _gpt()
    return fxmem.analyze(model, inputs, loss="lm_cross_entropy", batch=BATCH, target="cpu", pp=2, microbatches=MICRO, fsdp=2)


def test_fsdp_shards_each_stage(sharded_stages: fxmem.Report, one_f_one_b: fxmem.Report) -> None:
    """Two stages, each sharded by FSDP2 over 2 ranks (4 in all): each block a unit, then the stage.
    Parameters per rank by hand: FSDP2 splits every parameter along dim 0 into 2 chunks, padding it to
    a multiple of 2 rows, and rank 0 holds the first chunk: tok 101 rows -> 51 x 32, pos 16 -> 8 x 32,
    a block's 12,704 floats (every dim 0 even) -> 6,352, ln_f's 2 x 32 -> 2 x 16. FSDP2 moves no
    activation: each rank saves per microbatch what the unsharded pipeline's rank saves."""
    first, last = sharded_stages.pipeline.ranks
    assert first.parameters == FLOAT * (51 * 32 + 8 * 32 + BLOCK // 2)
    assert last.parameters == FLOAT * (BLOCK // 2 + 2 * 16 + 51 * 32)
    for sharded, whole in zip(sharded_stages.pipeline.ranks, one_f_one_b.pipeline.ranks, strict=True):
        assert sharded.saved == whole.saved
    assert sharded_stages.fsdp_units == ("blocks.0", "blocks.1")
    text = render_pipeline(sharded_stages.pipeline, BATCH)
    assert "each stage FSDP2 over 2 (fully_shard on 2 units and the root)" in text
    assert [sharded_stages.pipeline.change(r, BATCH).sharding > 0 for r in (0, 1)] == [True, True]
    assert "FSDP2's buffers" in text
    data = json.loads(render(sharded_stages, "json"))["pipeline"]  # the JSON says what the lines say
    assert (data["stages"], data["fsdp"], data["tp"], data["bounds"]) == (2, 2, 1, [[0, 1], [1, 2]])
    assert [r["parameters"] for r in data["ranks"]] == [first.parameters, last.parameters]
    assert [r["steady_step"]["bytes"] for r in data["ranks"]] == [first.peak(BATCH).bytes, last.peak(BATCH).bytes]
    assert [r["against_one_gpu"]["sharding_buffers"] for r in data["ranks"]] == [sharded_stages.pipeline.change(r, BATCH).sharding for r in (0, 1)]


@pytest.mark.parametrize("first_step", [False, True], ids=["steady", "first"])
def test_fsdp_inside_stages_matches_real_ranks(sharded_stages: fxmem.Report, first_step: bool) -> None:
    """Four real processes (2 stages x 2 FSDP2 ranks, gloo), each stage's module sharded by the same
    plan: every rank's saved bytes per microbatch exact, and the peaks of a stage's two ranks within
    ``assert_rank_peaks``'s bound of the simulated one (seen here: the first data-parallel rank exact,
    the second 256 B lower on both stages, its chunk of tok 50 rows; before the ranks paused after each
    wait, a rank a block's 50,816 B higher on most runs, Note [Ranks of one real step] in
    fxmem/measure_ranks.py)."""
    model, inputs = _gpt()
    measured = measure_ranks(
        model, inputs, BATCH, pp=2, microbatches=MICRO, fsdp=2, units=sharded_stages.fsdp_units, loss="lm_cross_entropy", first_step=first_step
    )
    assert [m.rank for m in measured] == [0, 1, 2, 3]
    for stage, r in enumerate(sharded_stages.pipeline.ranks):
        group = [m for m in measured if m.rank // 2 == stage]
        assert [m.saved for m in group] == [r.activations.at(BATCH)] * 2
        assert_rank_peaks([m.peak for m in group], r.peak(BATCH, first_step=first_step).bytes, FLOAT * BLOCK, SENT)


def test_fsdp_inside_interleaved_stages_matches_real_ranks() -> None:
    """ScheduleInterleaved1F1B, 2 stages on each of 2 pipeline ranks, each stage its own FSDP2 root
    over 2 ranks: the same checks as above on the 4-block GPT (seen here: exact on the first
    data-parallel rank of each stage)."""
    _, inputs = _gpt()
    run = dict(pp=2, microbatches=MICRO, schedule="interleaved", loss="lm_cross_entropy", fsdp=2)
    report = fxmem.analyze(_gpt4(), inputs, batch=BATCH, target="cpu", **run)  # type: ignore[arg-type]
    measured = measure_ranks(_gpt4(), inputs, BATCH, units=report.fsdp_units, **run)  # type: ignore[arg-type]
    for stage, r in enumerate(report.pipeline.ranks):
        group = [m for m in measured if m.rank // 2 == stage]
        assert [m.saved for m in group] == [r.activations.at(BATCH)] * 2
        assert_rank_peaks([m.peak for m in group], r.peak(BATCH).bytes, FLOAT * BLOCK, SENT)


def test_tensor_parallel_inside_stages_matches_real_ranks() -> None:
    """Two stages, each split by tensor parallel over 2 ranks with the GPT's own plan (Megatron's: qkv
    and the MLP's first layer column-wise, the projections row-wise, embeddings, norms and the tied
    head replicated). Parameters per rank by hand: a block keeps its norms (2 x 2 x 32) and row-wise
    biases (32 + 32) whole, half of qkv (48 x 32 + 48), of the MLP's first layer (64 x 32 + 64) and of
    each projection's weight (32 x 16, 32 x 64): 6,448 floats. Saved per microbatch exact on all 4
    real ranks; peaks within ``assert_rank_peaks``'s bound, the largest tensor a tensor-parallel
    collective holds being a row-wise output, (B, 16, 32) fp32 like a sent one (seen here: every rank
    to the byte; before the ranks paused after each wait, Note [Ranks of one real step], 1 to 5 such
    tensors over on three ranks of four in every run)."""
    model, inputs = _gpt()
    run = dict(pp=2, microbatches=MICRO, tp=2, loss="lm_cross_entropy")
    report = fxmem.analyze(model, inputs, batch=BATCH, target="cpu", **run)  # type: ignore[arg-type]
    block = 2 * 2 * 32 + 32 + 32 + (48 * 32 + 48) + (64 * 32 + 64) + 32 * 16 + 32 * 64
    first, last = report.pipeline.ranks
    assert (first.parameters, last.parameters) == (FLOAT * (101 * 32 + 16 * 32 + block), FLOAT * (block + 2 * 32 + 101 * 32))
    assert "each stage tensor parallel over 2" in report.pipeline.describe()
    measured = measure_ranks(model, inputs, BATCH, **run)  # type: ignore[arg-type]
    for stage, r in enumerate(report.pipeline.ranks):
        group = [m for m in measured if m.rank // 2 == stage]
        assert [m.saved for m in group] == [r.activations.at(BATCH)] * 2
        assert_rank_peaks([m.peak for m in group], r.peak(BATCH).bytes, SENT, SENT)


def test_fsdp_and_tensor_parallel_inside_stages_match_real_ranks() -> None:
    """All three: 2 stages x FSDP2 over 2 x tensor parallel over 2, 8 real processes. FSDP2 shards each
    tensor-parallel shard along dim 0 again, so rank 0 holds half of a block's 6,448 floats per
    tensor-parallel rank (every dim 0 even: 3,224), 51 rows of tok, 8 of pos. Saved bytes exact on all
    8 ranks, peaks within the bound (seen here: the first data-parallel rank of each stage to the byte,
    the second 256 B lower, its chunk of tok a row shorter)."""
    model, inputs = _gpt()
    run = dict(pp=2, microbatches=MICRO, tp=2, fsdp=2, loss="lm_cross_entropy")
    report = fxmem.analyze(model, inputs, batch=BATCH, target="cpu", **run)  # type: ignore[arg-type]
    assert report.pipeline.ranks[0].parameters == FLOAT * (51 * 32 + 8 * 32 + 3224)
    assert "each stage FSDP2 over 2 (fully_shard on 2 units and the root) x tensor parallel over 2" in report.pipeline.describe()
    measured = measure_ranks(model, inputs, BATCH, units=report.fsdp_units, **run)  # type: ignore[arg-type]
    assert [m.rank for m in measured] == list(range(8))
    for stage, r in enumerate(report.pipeline.ranks):
        group = [m for m in measured if m.rank // 4 == stage]
        assert [m.saved for m in group] == [r.activations.at(BATCH)] * 4
        assert_rank_peaks([m.peak for m in group], r.peak(BATCH).bytes, FLOAT * BLOCK // 2, SENT)


def test_sharding_options_inside_a_pipeline_are_checked() -> None:
    """What the sharding refuses without a pipeline it refuses inside one, by name."""
    model, inputs = _gpt()
    with pytest.raises(InputSpecError, match=r"fsdp_units names FSDP2's units, which only --fsdp N"):
        fxmem.analyze(model, inputs, batch=2, pp=2, microbatches=2, fsdp_units=["blocks.0"])
    with pytest.raises(InputSpecError, match=r"sp \(--sp\) splits the sequence among tensor-parallel ranks"):
        fxmem.analyze(model, inputs, batch=2, pp=2, microbatches=2, sp=True)
    with pytest.raises(InputSpecError, match=r"model 'GPT': --sp inside pipeline stages is not modelled yet"):
        fxmem.analyze(model, inputs, batch=2, pp=2, microbatches=2, tp=2, sp=True)
    with pytest.raises(InputSpecError, match=r"model 'GPT': sequence parallel inside pipeline stages is not modelled yet"):
        measure_ranks(model, inputs, 2, pp=2, microbatches=2, tp=2, tp_plan=default_tp_plan(model, sequence_parallel=True))
    with pytest.raises(InputSpecError, match=r"--pp 2 simulates each rank's training step, which --no-peak"):
        fxmem.analyze(model, inputs, batch=2, pp=2, microbatches=2, peak=False)
