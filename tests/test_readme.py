"""The README cannot drift: its report is the CLI's output, its numbers are real, CI runs its test command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import fxmem
from fxmem.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, re.S)


def test_ci_runs_the_readme_test_command() -> None:
    test_command = _bash_blocks()[1].strip()
    assert "pytest" in test_command
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_readme_report_is_the_cli_output(capsys: pytest.CaptureFixture[str]) -> None:
    match = re.search(r"```text\n\$ fxmem (.*?)\n(.*?)```", README, re.S)
    assert match, "README has no report block"
    assert main(match.group(1).split()) == 0
    assert capsys.readouterr().out == match.group(2)


def test_readme_python_example_numbers_are_real() -> None:
    from models_zoo.resnet50 import build

    with torch.device("meta"):
        spec = build()
    report = fxmem.analyze(spec.model, ["B,3,224,224"], loss="cross_entropy", optimizer="adamw")
    assert f"report.activations            # {report.activations!r}" in README
