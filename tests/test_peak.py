"""The peak as a function of B: the upper envelope, checked on timelines whose arithmetic is done by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxmem
from fxmem.results import Category, MemoryEvent, Phase, Timeline
from fxmem.step.peak import StepPeaks, envelope, points
from fxmem.symbolic import ByteExpr


def _event(n: int, per_sample: int, fixed: int, alloc: bool = True, phase: Phase = Phase.FORWARD) -> MemoryEvent:
    return MemoryEvent(phase, alloc, ByteExpr(per_sample, fixed), Category.TEMPORARY, f"n{n}", "", "aten.x", n)


def _timeline() -> Timeline:
    # Baseline 100 B. Then: +10B (a), +50 (b), -10B (a), -50 (b), +3B+200 (c).
    # Live after each allocation: 10B+100, 10B+150, 3B+300.
    # 10B+150 is above 10B+100 everywhere; against 3B+300: 10B+150 > 3B+300 from 7B > 150, B >= 22.
    events = (
        _event(0, 10, 0),
        _event(1, 0, 50),
        _event(0, 10, 0, alloc=False),
        _event(1, 0, 50, alloc=False),
        _event(2, 3, 200, phase=Phase.BACKWARD),
    )
    return Timeline(None, True, {Category.PARAMETER: ByteExpr(fixed=100)}, events)


def test_envelope_pieces_follow_the_hand_computed_crossing() -> None:
    pieces = envelope(points(_timeline()))
    assert [(p.first_batch, p.last_batch, p.per_sample, p.fixed, p.node) for p in pieces] == [(2, 21, 3, 300, "n2"), (22, None, 10, 150, "n1")]


@pytest.mark.parametrize("batch", [2, 21, 22, 1000])
def test_peak_is_the_highest_point_at_every_batch(batch: int) -> None:
    peaks = StepPeaks(_timeline(), {})
    expected = max(10 * batch + 150, 3 * batch + 300)
    assert peaks.bytes(batch, first_step=True) == expected
    assert peaks.peak(batch, first_step=True).phase == (Phase.BACKWARD if batch <= 21 else Phase.FORWARD)


def test_the_breakdown_adds_up_to_the_peak() -> None:
    p = StepPeaks(_timeline(), {}).peak(50, first_step=True)
    assert sum(p.breakdown.values()) == p.bytes == 10 * 50 + 150
    assert p.breakdown == {Category.PARAMETER: 100, Category.TEMPORARY: 550}


def test_a_step_of_one_linear_layer_by_hand() -> None:
    # Linear(4 -> 2, no bias), input B x 4, loss 'sum', SGD without momentum (no state).
    # Weights 2*4*4 = 32 B; input 16 B per sample. The forward allocates the output (2 floats = 8 B per
    # sample, held by the caller: an activation); the loss a 4-byte scalar. Backward makes the weight
    # gradient (32 B, kept as p.grad). At the end of backward, live = 32 + 16B + 8B + 4 + 32 at least;
    # SGD updates in place, and zero_grad releases the gradient.
    with torch.device("meta"):
        model = nn.Linear(4, 2, bias=False)
    report = fxmem.analyze(model, ["B,4"], optimizer="sgd", target="cpu")
    t = report.timeline(8, first_step=True)
    grads = [e for e in t.events if e.category == Category.GRADIENT and e.alloc]
    assert [e.nbytes.at(8) for e in grads] == [32]
    assert [e.phase for e in t.events if e.category == Category.GRADIENT and not e.alloc] == [Phase.ZERO_GRAD]
    outputs = [e for e in t.events if e.category == Category.ACTIVATION and e.alloc]
    assert [e.nbytes for e in outputs] == [ByteExpr(per_sample=8)]
    assert t.baseline == {Category.PARAMETER: ByteExpr(fixed=32), Category.INPUT: ByteExpr(per_sample=16)}
    assert report.peak(8).bytes >= 32 + 16 * 8 + 8 * 8 + 4 + 32


def test_adamw_state_appears_inside_the_first_step_and_is_baseline_in_a_steady_one() -> None:
    # AdamW keeps exp_avg and exp_avg_sq (32 B each for the 2x4 weight) and a 4-byte step: 68 B.
    with torch.device("meta"):
        model = nn.Linear(4, 2, bias=False)
    report = fxmem.analyze(model, ["B,4"], optimizer="adamw", target="cpu")
    first, steady = report.timeline(8, first_step=True), report.timeline(8)
    made = [e.nbytes.at(8) for e in first.events if e.alloc and e.category == Category.OPTIMIZER_STATE]
    assert sorted(made) == [4, 32, 32] and all(
        e.phase == Phase.OPTIMIZER for e in first.events if e.category == Category.OPTIMIZER_STATE
    )
    assert steady.baseline[Category.OPTIMIZER_STATE] == ByteExpr(fixed=68)
    assert not any(e.category == Category.OPTIMIZER_STATE for e in steady.events)
    assert report.peak(8).bytes >= report.peak(8, first_step=True).bytes


def test_max_batch_uses_the_peak_and_says_so() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    report = fxmem.analyze(model, ["B,64"], device_memory=10**6, target="cpu")
    verdict = report.verdict(10**6)
    assert verdict.basis == "peak"
    fits = verdict.max_batch
    assert fits is not None and report.step_bytes(fits) <= 10**6 < report.step_bytes(fits + 1)
    assert fxmem.analyze(model, ["B,64"], peak=False, target="cpu").verdict(10**6).basis == "total"


def test_a_report_without_the_step_says_how_to_get_the_peak() -> None:
    report = fxmem.analyze(nn.Linear(4, 2), ["B,4"], peak=False, target="cpu")
    with pytest.raises(fxmem.FxmemError, match="peak=False"):
        report.peak(4)


def test_cpu_autocast_step_matches_the_measured_one() -> None:
    # --target cpu --amp bf16 runs the fake step under torch.autocast("cpu"), as measure_peak runs the
    # real one: the peak agrees to the byte on the GPT test config (no convolution, whose bf16 oneDNN
    # buffers have no rule yet).
    spec = fxmem.load_model("zoo:gpt2-small:test")
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, batch=4, target="cpu", amp="bf16")
    real = fxmem.load_model("zoo:gpt2-small:test", meta=False).model
    measured = fxmem.measure_peak(real, spec.inputs, 4, loss=spec.loss, amp="bf16")
    assert report.peak(4).bytes == measured.bytes


def test_death_notices_give_the_timeline_a_full_scan_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    # The tracker learns of released storages from weakref callbacks (Note [How the timeline sees
    # memory]); where torch would not keep a storage's Python object alive with the storage, it asks
    # every live storage expired() before every op instead. Both must see the same releases at the same
    # places, in the same order, at B=1 (simulated on its own) and B=3 (from the symbolic timeline).
    from fxmem.step import timeline

    assert timeline._storage_deaths_are_seen(), "this torch should let the tracker use death notices"

    def step() -> tuple[object, ...]:
        with torch.device("meta"):
            model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
        report = fxmem.analyze(model, ["B,3,8,8"], optimizer="adamw", target="cpu", batch=3)
        timelines = report.timeline(1, first_step=True), report.timeline(3, first_step=True)
        return tuple((t.batch, t.baseline, t.events) for t in timelines)  # (checks are functions)

    notices = step()
    monkeypatch.setattr(timeline, "_storage_deaths_are_seen", lambda: False)
    assert step() == notices


def test_silu_backward_runs_its_cpu_kernel_as_eager_does() -> None:
    # silu_backward has a CPU kernel and a decomposition; eager CPU runs the kernel (one output), and so
    # must the fake step: the decomposition's sigmoid, empty_like, mul and add make four (B, 16, 512)
    # temporaries where the kernel makes one, each 4 x 16 x 512 x 4 B = 128 KiB at B=4 (Llama's MLP).
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 512), nn.SiLU(), nn.Linear(512, 64))

    with torch.device("meta"):
        model = build()
    report = fxmem.analyze(model, ["B,16,64"], target="cpu", batch=4)
    torch.manual_seed(0)
    measured = fxmem.measure_peak(build(), ["B,16,64"], 4)
    assert report.peak(4).bytes == measured.bytes and report.peak(4).phase == measured.phase
    ops = {e.op for e in report.timeline(4).events if e.phase.value == "backward"}
    assert "aten.silu_backward" in ops and "aten.sigmoid" not in ops


def test_a_step_at_a_batch_where_another_kernel_runs_is_the_simulated_one() -> None:
    """Note [A symbolic step at a batch where another kernel runs]: ResNet-50's test config on the cuda
    target has convolution workspaces whose cuDNN choice changes with B, so the symbolic step is not
    exact at 256 or 4096. Made from the symbolic step with the kernels' bytes there, the step equals
    the one simulated at that batch, event for event, with its baseline and op costs; without it
    max_batch's search simulated 47 batches."""
    spec = fxmem.load_model("zoo:resnet50:test")
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, name="resnet50-test")
    steps = report.steps
    symbolic = steps.symbolic_timeline()
    assert symbolic is not None and symbolic.corrected and steps.simulate is not None
    at = lambda x, b: x.at(b, steps.seq)
    for batch in (256, 4096):
        assert not symbolic.exact_at(batch)
        made, simulated = symbolic.at_batch(batch, steps.seq), steps.simulate(batch)
        assert made is not None
        event = lambda e, b=batch: (e.phase, e.alloc, at(e.nbytes, b), e.category, e.node, e.fqn, e.op)
        assert [event(e) for e in made.events] == [event(e) for e in simulated.events]
        assert {k: at(v, batch) for k, v in made.baseline.items()} == {k: at(v, batch) for k, v in simulated.baseline.items()}
        cost = lambda c, b=batch: (c.op, c.node, at(c.flops, b), at(c.read, b), at(c.written, b))
        assert [cost(c) for c in made.costs] == [cost(c) for c in simulated.costs]
