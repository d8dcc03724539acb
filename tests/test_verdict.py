"""The verdict: which batches fit the device, judged by replaying the step through the caching allocator.

``Report.fits``, ``Report.max_batch`` / ``verdict`` and the text, JSON and ``--check`` exit status must
never disagree (Note [The largest batch] in fxmem/report.py). The models are tiny and built on the
meta device; a replay costs well under a millisecond, so batches are judged exhaustively where the
claim is about every batch.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import fxmem
from fxmem import cli
from fxmem.api import analyze
from fxmem.errors import InputSpecError
from fxmem.frontends.load import load_model
from fxmem.report import Report, largest_fitting
from fxmem.results import Verdict
from tests.test_account import _Masked  # y[y > 0] saved for backward: a size that depends on the data

MiB = 2**20
NO_DRIVER = {"cuda_context": 0, "cublas_kernels": 0, "cudnn_kernels": 0}
"""The fixed costs only nvidia-smi sees, left out: the budget is then what the allocator may reserve
(the two 32 MiB cuBLAS workspaces stay: they go through the allocator)."""
MLP = "zoo:wide-mlp:test"


def _mlp() -> nn.Module:
    """fp32, SGD: 8.39M parameters (weights 32 MiB + gradients 32 MiB); the ReLU saves (B, 4096), 16 KiB per sample."""
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))


def _on_gpu(device_memory: int, batch: int = 64, **kw: object) -> Report:
    kw.setdefault("overheads", NO_DRIVER)
    return fxmem.analyze(
        _mlp(), ["B,1024"], optimizer="sgd", batch=batch, target="cuda", device_memory=device_memory, **kw  # type: ignore[arg-type]
    )


def _claims_fit(v: Verdict, b: int) -> bool | None:
    """What ``Verdict.describe`` says of batch ``b``: "every batch up to N fits (except gaps); N + 1 does
    not" where the replayed window reaches B=1, else only the batches of the window (None: no claim)."""
    assert v.max_batch is not None and v.checked is not None
    if b < v.checked[0]:
        return None
    return b <= v.max_batch and b not in v.gaps


def _verdict_line(report: Report) -> str:
    return next(line for line in str(report).splitlines() if line.startswith("Verdict at "))


# --- largest_fitting on predicates made by hand ----------------------------------------------------


def _largest(fits: object, *, below: int = 10_000) -> int:
    return max(b for b in range(1, below) if fits(b))  # type: ignore[operator]


def test_a_monotone_predicate_has_no_gaps() -> None:
    assert largest_fitting(lambda b: b <= 877) == (877, (853, 901), ())
    assert largest_fitting(lambda b: b <= 1, scan=4) == (1, (1, 5), ())  # the window stops at B=1


def test_a_hole_below_the_answer_is_named() -> None:
    # Doubling 2..512 fits, 1024 does not; bisection lands on 1000; 990 and 995 lie in the window below it.
    fits = lambda b: b <= 1000 and b not in (990, 995)
    assert largest_fitting(fits) == (1000, (976, 1024), (990, 995))


def test_a_fitting_batch_above_the_bisection_moves_the_answer_up() -> None:
    # Doubling stops at 128 (lo 64); bisection: 96 fits, 112 no, 104 no, 100 fits, 102 no, 101 no -> 100.
    # The scan above 100 finds 110 (window now to 134), then 120 (window to 144): the true largest.
    fits = lambda b: b <= 100 or b in (110, 120)
    seen: list[int] = []
    n, checked, gaps = largest_fitting(lambda b: seen.append(b) or fits(b))
    assert 100 in seen and not fits(101)  # the bisection's own answer was 100
    assert n == _largest(fits) == 120
    assert checked == (96, 144)
    assert gaps == (*range(101, 110), *range(111, 120))


def test_a_hole_at_the_window_bottom_is_returned_as_it_is() -> None:
    # The caching allocator's shape (see test_every_batch_the_verdict_names_is_judged_as_it_says): requests
    # under 10 MiB take a 20 MiB segment, so batches below 640 can cost more than 640 itself.
    fits = lambda b: b <= 393 or b in (512, 640)
    n, checked, gaps = largest_fitting(fits)
    assert (n, checked, gaps) == (640, (616, 664), tuple(range(616, 640)))
    # largest_fitting names only what it replayed; whether batches below 616 fit is Verdict's claim to make.


# --- a real model: max_batch and the per-batch verdict ----------------------------------------------


def test_max_batch_and_fits_agree_and_a_fitting_total_is_within_the_budget() -> None:
    budget = 140 * MiB
    report = _on_gpu(budget)
    v = report.verdict()
    # B=1 needs the state (64 MiB), two cuBLAS workspaces (64 MiB) and one 2 MiB small segment: 130 MiB.
    assert v.floor == report.step_bytes(1) == 130 * MiB and v.floor_fits
    assert v.max_batch == report.max_batch() == 128 and v.checked == (104, 152) and v.gaps == ()
    assert report.fits(128) and not report.fits(129)
    lo, hi = v.checked
    assert not any(report.fits(b) for b in range(129, hi + 1))
    assert all(report.fits(b) for b in range(lo, 128) if b not in v.gaps)
    for b in range(1, 129):
        assert report.step_bytes(b) <= budget, b  # the GPU total shown for a fitting batch
    assert report.step_bytes(129) > budget  # 150 MiB: the (B, 4096) blocks pass 2 MiB


def test_the_driver_lines_are_taken_off_the_budget_once() -> None:
    # With the default fixed costs, the CUDA context and cuBLAS kernels are in nvidia-smi's total and
    # outside the allocator: the same step fits the same batches in driver + 140 MiB as in 140 MiB without them.
    probe = _on_gpu(10 * 2**30, overheads=None)
    driver = probe.steps.device.overheads.driver_bytes
    assert driver > 600 * MiB  # ~700 MiB: what a budget of a few hundred MiB must first cover
    report = _on_gpu(driver + 140 * MiB, overheads=None)
    assert report.max_batch() == 128
    assert report.step_bytes(128) <= driver + 140 * MiB < report.step_bytes(129)


@pytest.mark.parametrize("mib", [140, 150, 160])
def test_every_batch_the_verdict_names_is_judged_as_it_says(mib: int) -> None:
    # "every batch up to N fits (except gaps); N + 1 does not" is a claim about every batch from 1 to N.
    # Near a segment-size step of the allocator it is not monotonic far below the window: a (B, 4096)
    # fp32 block under 10 MiB (B < 640) takes a 20 MiB segment, at 640 and above it is rounded to 2 MiB.
    # At 150 MiB, 251..256 do not fit while 257..301 do; at 160 MiB, 394..511 and 513..639 do not
    # while 512 and 640 do.
    report = _on_gpu(mib * MiB)
    v = report.verdict()
    assert v.max_batch is not None and v.checked is not None
    wrong = [b for b in range(1, v.checked[1] + 1) if _claims_fit(v, b) not in (None, report.fits(b))]
    assert wrong == [], f"{v.describe()!r}, but fits() is the opposite at {wrong[:8]}{' ...' if len(wrong) > 8 else ''}"


def test_a_batch_that_does_not_fit_says_so_in_the_verdict_and_the_tradeoff_table() -> None:
    # At 150 MiB B=256 does not fit (its 4 MiB blocks take 20 MiB segments) though 301 does: the
    # trade-off table lists the powers of two up to the largest batch, so 256 has a row.
    report = _on_gpu(150 * MiB, batch=256)
    assert not report.fits(256)
    line = _verdict_line(report)
    assert line.split()[3:6] == ["does", "not", "fit"] and "B=256 does not fit" in line
    row = next(r for r in str(report).splitlines() if r.startswith("256 "))
    assert "(does not fit)" in row
    # The same line must not then claim that 256 fits.
    assert _claims_fit(report.verdict(), 256) is not True, line


def test_a_batch_past_the_largest_says_does_not_fit() -> None:
    report = _on_gpu(140 * MiB, batch=129)
    line = _verdict_line(report)
    assert "B=129 does not fit" in line and "largest batch 128, 129 does not fit (batches 104 to 152 each replayed)" in line
    assert report.to_dict()["verdict"]["short"] == report.steps.device_peak(129, budget=140 * MiB).short > 0


# --- capacity: the replay near the limit releases its cache -----------------------------------------


def test_the_replay_near_the_limit_holds_what_torch_would_hold() -> None:
    # Without a bound (the old figure) the allocator keeps every segment it made; B=640 then reserves
    # 170 MiB, over a 160 MiB device, and would be judged out of memory. Against 160 MiB, where a
    # cudaMalloc fails torch frees its cached segments and retries (release_cached_blocks), so the
    # reserved peak is what that leaves, 160 MiB: it fits. The blocks the step holds are the same either
    # way: max_memory_allocated does not depend on the budget.
    budget = 160 * MiB
    report = _on_gpu(budget)
    steps = report.steps
    big, tight = steps.device_peak(640, budget=1 << 40), steps.device_peak(640, budget=budget)
    assert big.fits and big.total > budget
    assert tight.fits and tight.reserved < big.reserved and tight.total <= budget
    assert tight.allocated == big.allocated
    lo, hi = report.verdict().checked
    for b in range(lo, hi + 1):
        big, tight = steps.device_peak(b, budget=1 << 40), steps.device_peak(b, budget=budget)
        assert tight.reserved <= big.reserved and tight.allocated == big.allocated, b


def test_a_batch_that_does_not_fit_shows_a_total_over_the_budget() -> None:
    # The converse of the fitting case: where the replay ran out, the figures it carries on with say by
    # how much, so the GPU total shown is over the budget and `short` is that excess, not 1 B. With
    # expandable segments the large pool maps 20 MiB pages; B=1 needs 142 MiB unbounded.
    budget = 140 * MiB
    for conf in ("", "expandable_segments:True"):
        report = _on_gpu(budget, alloc_conf=conf)
        for b in (1, 64, 129, 300):
            d = report.steps.device_peak(b, budget=budget)
            if not d.fits:
                assert d.total > budget and d.short == d.reserved - budget, (conf, b, d.reserved, d.short)


# --- --check, and the JSON --------------------------------------------------------------------------


@pytest.mark.usefixtures("at_repo_root")
def test_check_exits_0_when_the_batch_fits_and_3_when_not(capsys: pytest.CaptureFixture[str]) -> None:
    memory = "745MiB"  # the default fixed costs (~684 MiB outside the allocator) and ~60 MiB for the step
    spec = load_model(MLP)
    report = analyze(spec.model, spec.inputs, loss=spec.loss, device_memory=745 * MiB, batch=8)
    n = report.max_batch()
    assert n is not None and 10 <= n <= 1000  # tens or hundreds: the replay, not the 80 GB GPU, decides
    argv = ["analyze", MLP, "--check", "--device-memory", memory]
    assert cli.main([*argv, "--batch", str(n)]) == 0
    assert f"B={n} fits" in capsys.readouterr().out
    assert cli.main([*argv, "--batch", str(n + 1), "--format", "json"]) == cli.EXIT_DOES_NOT_FIT == 3
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False is report.fits(n + 1)
    assert out["max_batch"] == out["verdict"]["max_batch"] == n
    assert out["verdict"]["checked"] == list(report.verdict().checked) and out["verdict"]["gaps"] == list(report.verdict().gaps)
    assert out["verdict"]["short"] > 0 and out["verdict"]["in_words"] == report.verdict().describe()


@pytest.mark.usefixtures("at_repo_root")
def test_check_on_the_cpu_needs_device_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["analyze", MLP, "--batch", "4", "--check", "--target", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("fxmem: error: ") and err.count("\n") == 1, err
    assert "--check" in err and "--device-memory" in err


# --- data-dependent sizes: a batch, not a bound -----------------------------------------------------


def test_data_dependent_sizes_make_the_largest_batch_not_a_bound() -> None:
    with torch.device("meta"):
        model = _Masked()
    report = fxmem.analyze(model, ["B,8"], target="cuda", device_memory=80 * MiB, overheads=NO_DRIVER)
    assert [u.node for u in report.accounting.unsupported] == ["getitem"]
    v = report.verdict()
    assert v.exact is False and v.max_batch is not None
    assert v.describe().endswith("not a bound)")
    assert "not a bound" in _verdict_line(report)
    assert report.to_dict()["verdict"]["exact"] is False


# --- the allocator's settings reach the replay ------------------------------------------------------


def test_a_memory_fraction_caps_what_the_allocator_may_reserve() -> None:
    # Half of 280 MiB is 140 MiB: the same batches fit as on a 140 MiB device.
    half = _on_gpu(280 * MiB, memory_fraction=0.5)
    assert half.max_batch() == _on_gpu(140 * MiB).max_batch() == 128
    d = half.peak(129).device
    assert d.alloc_conf == "memory fraction 0.5" and not d.fits and d.total < 280 * MiB
    assert "allocator memory fraction 0.5" in str(half).splitlines()[1]


def test_expandable_segments_change_the_replay_and_are_named() -> None:
    # B=129's (B, 4096) blocks (2.02 MiB) each take a 20 MiB segment by default; expandable segments map
    # 20 MiB pages of one growing segment instead: a different reserved peak, the same blocks.
    default, expandable = _on_gpu(1 << 40), _on_gpu(1 << 40, alloc_conf="expandable_segments:True")
    d, e = default.peak(129).device, expandable.peak(129).device
    assert e.alloc_conf == "expandable_segments:True" and d.alloc_conf == "torch defaults"
    assert e.allocated == d.allocated and e.reserved != d.reserved
    assert "allocator expandable_segments:True" in str(expandable).splitlines()[1]


def test_a_bad_alloc_conf_names_the_key() -> None:
    with pytest.raises(InputSpecError, match="unknown key 'expandable_segment'"):
        _on_gpu(140 * MiB, alloc_conf="expandable_segment:True")
    with pytest.raises(InputSpecError, match="expandable_segments:yes"):
        _on_gpu(140 * MiB, alloc_conf="expandable_segments:yes")


# --- the figures around the verdict -------------------------------------------------------------------


def test_what_is_held_counts_one_gpus_share_of_the_state() -> None:
    # Linear(1024, 1024, bias=False) with AdamW in fp32: P = 1,048,576 parameters, 4P weights + 4P
    # gradients + 8P moments = 16 MiB of state. ZeRO-3 over 8 GPUs keeps 1/8 of each on a GPU: 2 MiB.
    # The all-gathered parameters are transient (alive while the unit runs), so they are not "held".
    report = fxmem.analyze(nn.Linear(1024, 1024, bias=False), ["B,1024"], world_size=8, shard="zero3", batch=4)
    assert report.state.total == 16 * MiB and report.state_per_gpu == 2 * MiB
    assert report.total_bytes(4) == 2 * MiB + report.activation_bytes(4) + report.input_bytes(4)
    held = next(line for line in str(report).splitlines() if line.startswith("Held at B=4"))
    assert "not the peak" in held


def test_a_model_that_cannot_train_on_one_sample_starts_at_two() -> None:
    # BatchNorm1d raises on one sample in training ("Expected more than 1 value per channel"), so B=1
    # does not fit any device; the floor and the verdict start at B=2. On the CPU target the peak is
    # the envelope of lines that do not fall, so the largest batch speaks for every smaller one.
    report = fxmem.analyze(nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)), ["B,8"], target="cpu", device_memory=MiB)
    v = report.verdict()
    assert not report.fits(1) and report.fits(2) and v.least == 2
    assert v.max_batch is not None and v.checked is not None and v.checked[0] == 2
    assert report.steps.bytes(v.max_batch) <= MiB < report.steps.bytes(v.max_batch + 1)
    assert v.describe() == f"every batch from 2 up to {v.max_batch} fits; {v.max_batch + 1} does not"
    text = str(report)
    assert "Floor at B=2" in text and "Floor at B=1" not in text


def test_the_json_device_lines_carry_the_verdict_and_the_allocator() -> None:
    report = _on_gpu(140 * MiB, batch=129, alloc_conf="expandable_segments:True")
    d = report.to_dict()
    device = d["peak"]["steady_step"]["device"]
    assert d["target"]["alloc_conf"] == "expandable_segments:True"
    assert d["verdict"]["fits"] is report.fits() is device["fits"] is False  # B=129 > 128 (above)
    assert device["allocator"] == "expandable_segments:True" and device["short"] == d["verdict"]["short"] > 0
