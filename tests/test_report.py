"""The arithmetic users read off a report, the rows-sum-to-total invariant, JSON keys and a golden table."""

from __future__ import annotations

import json
import re

import pytest
from torch import nn

from fxmem.output.render import format_bytes, render
from fxmem.report import Report
from fxmem.results import Accounting, NodeInfo, NodeRecord, StateBytes
from fxmem.symbolic import ByteExpr
from tests.helpers import analyze_on_meta

GB = 10**9
MB = 10**6


def _synthetic(state_total: int, per_sample: int, fixed: int = 0) -> Report:
    node = NodeRecord(NodeInfo("act", "call_function", "relu", "body", ("B", 1)), ByteExpr(per_sample, fixed), {}, ())
    accounting = Accounting((node,), ByteExpr(), "symbolic", True, ())
    state = StateBytes(1, 1, state_total, {"float32": state_total}, 0, 0, 0, "sgd")
    return Report("synthetic", (), "sum", accounting, state)


def test_worked_example_only_the_activation_pile_shrinks() -> None:
    # State 12 GB, 250 MB per sample: B=32 -> 12 + 32*0.25 = 20 GB; B=16 -> 12 + 4 = 16 GB, which saves
    # 4/20 = 20% (not 50%); the floor at B=1 is 12 + 0.25 = 12.25 GB.
    report = _synthetic(12 * GB, 250 * MB)
    assert report.total_bytes(32) == 20 * GB
    assert report.total_bytes(16) == 16 * GB
    assert (report.total_bytes(32) - report.total_bytes(16)) / report.total_bytes(32) == pytest.approx(0.20)
    assert report.total_bytes(1) == 12 * GB + 250 * MB


def test_max_batch_and_the_no_fit_verdict() -> None:
    report = _synthetic(12 * GB, 250 * MB)
    # (80 GB - 12 GB) / 250 MB = 272 samples exactly.
    assert report.max_batch(80 * GB) == 272
    assert report.max_batch(80 * GB - 1) == 271
    # 12.25 GB does not fit in 12 GB: no batch size rescues the run.
    verdict = report.verdict(12 * GB)
    assert verdict.max_batch is None and not verdict.unbounded and verdict.floor == 12 * GB + 250 * MB
    assert _synthetic(GB, 0, 10).verdict(2 * GB).unbounded


def test_rows_sum_to_the_total_at_every_depth() -> None:
    report = analyze_on_meta(lambda: nn.Sequential(nn.Sequential(nn.Linear(8, 32), nn.ReLU()), nn.LayerNorm(32), nn.Linear(32, 4)), ["B,8"], "cross_entropy")
    for depth in (None, "all", 0, 1, 2):
        rows = report.layers(depth)
        for b in (1, 7):
            assert sum(r.at(b) for r in rows) == report.activation_bytes(b)


def test_json_has_the_documented_keys_with_exact_integers() -> None:
    report = analyze_on_meta(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU()), ["B,8"], batch=4, device_memory=10**6)
    data = json.loads(render(report, "json"))
    for key in ("model", "inputs", "model_state", "activations", "nodes", "layers", "at_batch", "max_batch", "device_memory"):
        assert key in data
    assert set(data["model_state"]) >= {"parameters", "weights", "buffers", "gradients", "optimizer", "optimizer_name", "total"}
    assert data["activations"] == {"per_sample": 64, "constant": 0}  # ReLU keeps (B,16) float32
    relu = next(n for n in data["nodes"] if n["name"] == "_1")
    assert relu["saved"] == {"per_sample": 64, "constant": 0}
    assert relu["saved_tensors"][0]["shape"] == ["B", 16] and relu["saved_tensors"][0]["saved_by"] == ["_1"]
    assert data["inputs"][0] == {"name": None, "shape": ["B", 8], "dtype": "float32", "bytes": {"per_sample": 32, "constant": 0}}
    assert data["at_batch"]["activations"] == 4 * 64


def test_csv_and_markdown_carry_the_same_rows() -> None:
    report = analyze_on_meta(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU()), ["B,8"])
    csv_text = render(report, "csv").split("\n\n")[1].splitlines()  # after the summary rows
    assert csv_text[0].startswith("Layer,Op,Output shape,Per sample")
    assert csv_text[1].split(",")[:2] == ["1", "ReLU"]  # the layer is the module path "1" (node _1)
    assert "| 1 " in render(report, "markdown")


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3 GiB"
    assert format_bytes(1023 * 2**20 + 2**19) == "1024 MiB"


def test_golden_table(golden) -> None:  # type: ignore[no-untyped-def]
    report = analyze_on_meta(
        lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 16 * 16, 10)),
        ["B,3,32,32"], "cross_entropy", optimizer="sgd-momentum", batch=64, device_memory=2**30,
    )  # fmt: skip
    golden(str(report))


def test_repr_is_short_and_names_the_model_and_the_verdict() -> None:
    # The dataclass repr dumped every field (58 KB for a small model, issue 36); the repr is now one line.
    report = analyze_on_meta(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU()), ["B,8"], batch=4, device_memory=10**6, name="tiny_mlp")
    text = repr(report)
    assert len(text) < 500 and "\n" not in text
    assert "tiny_mlp" in text and "B=4" in text and "B,8:float32" in text
    assert f"largest batch {report.max_batch()}" in text and ("fits" if report.fits() else "does not fit") in text
    assert f"peak {format_bytes(report.peak().bytes)}" in text
    assert len(str(report)) > len(text)  # str stays the full report


def test_repr_without_device_memory_or_step() -> None:
    report = analyze_on_meta(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU()), ["B,8"], peak=False, name="tiny_mlp")
    text = repr(report)
    assert text.startswith("<Report tiny_mlp (B,8:float32) at B=32") and "no device memory" in text
    assert f"held {format_bytes(report.total_bytes(32))}" in text


def test_to_dict_docstring_names_every_top_level_key() -> None:
    report = analyze_on_meta(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU()), ["B,8"], batch=4, device_memory=10**6)
    documented = set(re.findall(r"``(\w+)``", Report.to_dict.__doc__ or "")) - {"per_sample", "constant", "to_dict"}
    assert documented == set(report.to_dict())


def test_budget_defaults_are_documented() -> None:
    for method in (Report.fits, Report.max_batch, Report.verdict):
        assert "default ``device_memory``" in " ".join((method.__doc__ or "").split()), method.__name__
