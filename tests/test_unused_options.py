"""An option that changes nothing says so, once, on stderr (the CLI) or as an FxmemWarning (the API);
an option that matters says nothing."""

from __future__ import annotations

import warnings

import pytest
from torch import nn

import fxmem
from fxmem.cli import main


def _notes(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[str]:
    assert main(argv) == 0
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("fxmem: note:")]


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--seq-len", "64", "--target", "cpu"], "--seq-len 64 has no effect: no input has a symbolic sequence axis S"),
        (["--world-size", "1", "--shard", "zero3"], "--shard zero3 with --world-size 1 divides nothing"),
        (["--world-size", "4"], "--world-size 4 without --shard changes nothing here"),
        (["--target", "cpu", "--gpu", "a100-80gb"], "--gpu describes the cuda target and has no effect with --target cpu"),
    ],
)
def test_an_option_without_effect_is_one_note(capsys: pytest.CaptureFixture[str], options: list[str], says: str) -> None:
    notes = _notes(capsys, ["analyze", "zoo:wide-mlp:test", "--no-peak", *options])
    assert len(notes) == 1 and says in notes[0], notes


def test_options_that_matter_say_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert _notes(capsys, ["analyze", "zoo:wide-mlp:test", "--no-peak", "--world-size", "4", "--shard", "zero3"]) == []
    assert _notes(capsys, ["analyze", "zoo:gpt2-small:test", "--no-peak", "--input", "B,S:int64", "--seq-len", "16"]) == []


def test_the_timeline_command_notes_once(capsys: pytest.CaptureFixture[str]) -> None:
    """``timeline`` analyzes and then simulates the step: the same note is shown once, not per pass."""
    notes = _notes(capsys, ["timeline", "zoo:wide-mlp:test", "--batch", "2", "--seq-len", "8", "--target", "cpu"])
    assert len(notes) == 1


def test_the_api_warns() -> None:
    model = nn.Linear(4, 4)
    # From Python the warning names analyze's own argument, and points at this line, not at fxmem.
    with pytest.warns(fxmem.FxmemWarning, match="seq_len=8 has no effect") as seen:
        fxmem.analyze(model, ["B,4"], loss="sum", target="cpu", seq_len=8, peak=False)
    assert seen[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxmem.FxmemWarning)
        fxmem.analyze(model, ["B,4"], loss="sum", target="cpu", peak=False)  # nothing unused: no warning
