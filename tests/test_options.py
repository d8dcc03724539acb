"""analyze() takes its settings as three option objects (Training, Hardware, Parallelism) or as the
plain keywords it always took; it leaves the model's modes as it found them, and a setting that
changes nothing warns at the caller's own line, named as the caller wrote it."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import nn

import fxmem
from fxmem.measure import measure, measure_peak
from fxmem.options import Hardware, Parallelism, Training
from fxmem.step.training import TrainingSetup


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def test_objects_and_keywords_give_the_same_report() -> None:
    model = _mlp()
    by_keywords = fxmem.analyze(model, ["B,8"], loss="mse", optimizer="sgd", target="cpu", batch=4)
    by_objects = fxmem.analyze(
        model, ["B,8"], batch=4, training=Training(loss="mse", optimizer="sgd"), hardware=Hardware(target="cpu")
    )
    mixed = fxmem.analyze(model, ["B,8"], batch=4, training=Training(loss="mse"), optimizer="sgd", target="cpu")
    for report in (by_objects, mixed):
        assert report.activations == by_keywords.activations
        assert report.state == by_keywords.state
        assert report.peak(4).bytes == by_keywords.peak(4).bytes
    assert by_keywords.state != fxmem.analyze(model, ["B,8"], loss="mse", target="cpu", batch=4).state  # adamw's moments


def test_the_common_case_stays_one_short_call() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    report = fxmem.analyze(model, ["B,3,8,8"], loss="cross_entropy")
    assert report.setup is not None and report.setup.target == "cuda" and report.setup.gpu == "h100-80gb"
    assert report.activations.per_sample > 0


def test_a_setting_given_twice_names_it() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(fxmem.InputSpecError, match=r"loss is given twice: Training.loss='mse' in training= and the keyword loss='sum'"):
        fxmem.analyze(model, ["B,4"], training=Training(loss="mse"), loss="sum", peak=False)
    with pytest.raises(fxmem.InputSpecError, match=r"gpu is given twice: Hardware.gpu='a100-40gb'"):
        fxmem.analyze(model, ["B,4"], hardware=Hardware(gpu="a100-40gb"), gpu="h100-80gb", peak=False)
    with pytest.raises(fxmem.InputSpecError, match=r"tp is given twice: Parallelism.tp=2 in parallel="):
        fxmem.analyze(model, ["B,4"], parallel=Parallelism(tp=2), tp=4, peak=False)
    # the same value twice says one thing; a keyword fills a field its object leaves at the default
    report = fxmem.analyze(model, ["B,4"], training=Training(loss="mse"), loss="mse", optimizer="sgd", target="cpu", peak=False)
    assert report.loss == "mse"
    with pytest.raises(fxmem.InputSpecError, match=r"training= takes a fxmem.Training, got Hardware"):
        fxmem.analyze(model, ["B,4"], training=Hardware(), peak=False)  # type: ignore[arg-type]


def test_the_objects_are_frozen_values() -> None:
    units = ["0", "1"]
    plan = {"0": "colwise"}
    parallel = Parallelism(fsdp=2, fsdp_units=units, tp_plan=plan, pp_splits=[3])  # type: ignore[arg-type]
    units.append("2")
    plan["1"] = "rowwise"
    assert parallel.fsdp_units == ("0", "1") and parallel.pp_splits == (3,) and parallel.tp_plan == {"0": "colwise"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        parallel.fsdp = 4  # type: ignore[misc]
    assert Training() == Training(loss="sum", optimizer="adamw") and Hardware().target == "cuda"
    with pytest.raises(fxmem.InputSpecError, match="Parallelism.fsdp_units takes a sequence"):
        Parallelism(fsdp_units="blocks.0")  # type: ignore[arg-type]


def test_the_setup_is_built_from_the_objects() -> None:
    setup = TrainingSetup.of(Training(amp="bf16", optimizer_impl="fused"), Hardware(gpu="a100-40gb"), Parallelism(fsdp=4, tp=2))
    assert (setup.world_size, setup.shard, setup.tp, setup.amp, setup.optimizer_impl, setup.gpu) == (4, "fsdp", 2, "bf16", "fused", "a100-40gb")
    with pytest.raises(fxmem.InputSpecError, match="cannot be combined"):
        TrainingSetup.of(Training(), Hardware(), Parallelism(fsdp=4, world_size=2, shard="zero2"))


class _IntOfBatch(nn.Module):
    """int(x.shape[0]) fixes B (kept a leaf): every batch is a concrete pass, made when it is asked for."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.ones(int(x.shape[0]), 1)


def _fixed() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.BatchNorm1d(16), _IntOfBatch(), nn.ReLU())


def test_analyze_leaves_each_module_in_its_mode() -> None:
    model = _fixed().eval()
    model[2].train()  # a mix: each module's own flag comes back
    before = [m.training for m in model.modules()]
    report = fxmem.analyze(model, ["B,8"], target="cpu", batch=4, leaf_types=(_IntOfBatch,))
    assert [m.training for m in model.modules()] == before
    # the step is still the training step, in analyze and in the passes the report makes later
    trained = fxmem.analyze(_fixed().train(), ["B,8"], target="cpu", batch=4, leaf_types=(_IntOfBatch,))
    assert report.accounting.method == "concrete"
    assert report.activations == trained.activations
    for b in (3, 64):  # batches no pass ran at during analyze
        assert report.peak(b).bytes == trained.peak(b).bytes
    assert [m.training for m in model.modules()] == before


class _Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) @ torch.ones(3, 3)  # wrong inner size: the step cannot run


def test_analyze_restores_the_modes_when_it_raises() -> None:
    model = _Fails().eval()
    with pytest.raises(fxmem.FxmemError):
        fxmem.analyze(model, ["B,4"], target="cpu", peak=False)
    assert not any(m.training for m in model.modules())


def test_an_unused_setting_warns_at_the_callers_line_in_its_api_name() -> None:
    model = nn.Linear(4, 4)
    with pytest.warns(fxmem.FxmemWarning, match=r"seq_len=8 has no effect") as record:
        fxmem.analyze(model, ["B,4"], target="cpu", seq_len=8, peak=False)
    assert [w.filename for w in record] == [__file__]
    with pytest.warns(fxmem.FxmemWarning, match=r"Hardware.gpu describes the cuda target and has no effect with Hardware.target='cpu'") as record:
        fxmem.analyze(model, ["B,4"], hardware=Hardware(target="cpu", gpu="a100-40gb"), peak=False)
    assert [w.filename for w in record] == [__file__]
    with pytest.warns(fxmem.FxmemWarning, match=r"Parallelism.world_size=4 without Parallelism.shard changes nothing") as record:
        fxmem.analyze(model, ["B,4"], world_size=4, peak=False)
    assert [w.filename for w in record] == [__file__]
    with pytest.warns(
        fxmem.FxmemWarning,
        match=r"Parallelism.microbatches=4, Parallelism.schedule='gpipe': pipeline options, with no effect without Parallelism.pp=P",
    ) as record:
        fxmem.analyze(model, ["B,4"], target="cpu", parallel=Parallelism(microbatches=4, schedule="gpipe"), peak=False)
    assert [w.filename for w in record] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxmem.FxmemWarning)
        fxmem.analyze(model, ["B,4"], hardware=Hardware(target="cpu"), peak=False)  # nothing unused: no warning


def test_the_cli_mode_names_the_flags() -> None:
    model = nn.Linear(4, 4)
    with pytest.warns(fxmem.FxmemWarning) as record:
        fxmem.analyze(model, ["B,4"], target="cpu", seq_len=8, gpu="a100-40gb", microbatches=2, pp_splits=[1], peak=False, _flags=True)
    said = [str(w.message) for w in record]
    assert any(s.startswith("--gpu describes the cuda target and has no effect with --target cpu") for s in said), said
    assert any(s.startswith("--microbatches 2, --pp-split 1: pipeline options, with no effect without --pp P") for s in said), said
    assert any(s.startswith("--seq-len 8 has no effect") for s in said), said


def test_measure_takes_the_training_object() -> None:
    model, inputs = nn.Sequential(nn.Linear(8, 8), nn.ReLU()), ["B,8"]
    assert measure(model, inputs, 4, training=Training(loss="mse")) == measure(model, inputs, 4, loss="mse")
    peak = measure_peak(model, inputs, 2, training=Training(loss="mse", optimizer="sgd"))
    assert peak == measure_peak(model, inputs, 2, loss="mse", optimizer="sgd")
    with pytest.raises(fxmem.InputSpecError, match=r"Training.precision='bf16' has no real form here"):
        measure_peak(model, inputs, 2, training=Training(precision="bf16"))
    with pytest.raises(fxmem.InputSpecError, match="loss is given twice"):
        measure(model, inputs, 2, training=Training(loss="mse"), loss="cross_entropy")


def test_plan_takes_the_objects() -> None:
    model, inputs = nn.Sequential(nn.Linear(8, 8), nn.ReLU()), ["B,8"]
    by_objects = fxmem.plan(
        model, inputs, training=Training(optimizer="sgd"), hardware=Hardware(target="cpu", device_memory=2**20), allow=["batch"]
    )
    by_keywords = fxmem.plan(model, inputs, optimizer="sgd", target="cpu", memory=2**20, allow=["batch"])
    assert by_objects.best is not None and by_keywords.best is not None
    assert (by_objects.memory, by_objects.best.micro_batch) == (by_keywords.memory, by_keywords.best.micro_batch)
    with pytest.raises(fxmem.InputSpecError, match=r"Training.amp='bf16'"):
        fxmem.plan(model, inputs, training=Training(amp="bf16"), target="cpu", memory=2**20)
