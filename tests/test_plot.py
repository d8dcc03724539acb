"""Pictures: each PNG is opened and checked for its size and for drawn content, not only for existing."""

from __future__ import annotations

from pathlib import Path

import pytest

import fxmem
from fxmem.cli import main

image = pytest.importorskip("matplotlib.image")


def _assert_drawn(path: Path, min_width: int = 600) -> None:
    pixels = image.imread(str(path))
    height, width = pixels.shape[:2]
    assert width >= min_width and height >= 300
    rgb = pixels[..., :3]
    # Non-blank: many distinct colours (bars, stacked areas, text), not one background.
    distinct = {tuple(p) for p in rgb.reshape(-1, 3)[:: 7].tolist()}
    assert len(distinct) > 20
    assert rgb.std() > 0.05


def test_analyze_plot_draws_memory_against_batch_and_the_top_layers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "batches.png"
    assert main(["analyze", "zoo:resnet50:test", "--batch", "8", "--device-memory", "8MiB", "--plot", str(out)]) == 0
    assert f"Wrote {out}" in capsys.readouterr().out
    _assert_drawn(out)


def test_timeline_plot_draws_the_step_by_category(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "timeline.png"
    assert main(["timeline", "zoo:gpt2-small:test", "--batch", "4", "--plot", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Peak" in text and "backward" in text
    _assert_drawn(out)


def test_an_unwritable_plot_path_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "missing-dir" / "x.png"
    assert main(["timeline", "zoo:wide-mlp:test", "--batch", "2", "--plot", str(out)]) == 2
    err = capsys.readouterr().err  # a progress line may come first, where the step takes over a second
    assert err.splitlines()[-1].startswith("fxmem: error: cannot write the picture") and "Traceback" not in err


def test_plot_api_from_a_report(tmp_path: Path) -> None:
    from fxmem.output.plot import plot_batches, plot_timeline

    spec = fxmem.load_model("zoo:wide-mlp:test")
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, batch=4, target="cpu")
    _assert_drawn(plot_batches(report, tmp_path / "a.png"))
    _assert_drawn(plot_timeline(report.timeline(4), tmp_path / "b.png", title="wide-mlp", batch=4))
