"""The README cannot drift: its report is the CLI's output, its numbers are real, CI runs its test command,
every documented command parses and every link into docs/ exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

import fxmem
from fxmem.cli import _parser, main
from models_zoo import ZOO

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
USAGE = (ROOT / "docs" / "usage.md").read_text()  # the Python example's page


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
    assert f"report.activations            # {report.activations!r}" in USAGE


def _documented_commands() -> list[tuple[str, str]]:
    """(page, command) for each `fxmem ...` in a ```bash block, or after `$ ` in a ```text block, of the
    README and docs/*.md: the command alone, without its ` # comment` or what comes before `&&`."""
    commands = []
    for page in [ROOT / "README.md", *DOCS]:
        text = page.read_text()
        lines = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]
        lines += [line[2:] for block in re.findall(r"```text\n(.*?)```", text, re.S)
                  for line in block.splitlines() if line.startswith("$ ")]
        for line in lines:
            for part in line.split("&&"):
                command = part.split(" #")[0].strip()
                if command.startswith("fxmem "):
                    commands.append((page.name, command))
    return commands


COMMANDS = _documented_commands()


def test_the_docs_document_commands() -> None:
    assert len(COMMANDS) >= 10, COMMANDS
    assert {page for page, _ in COMMANDS} >= {"README.md", "usage.md"}


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[f"{p}:{c}" for p, c in COMMANDS])
def test_documented_command_parses(page: str, command: str) -> None:
    try:
        args = _parser().parse_args(shlex.split(command)[1:])
    except (Exception, SystemExit) as e:  # the parser raises _UsageError where argparse would exit
        pytest.fail(f"{page}: `{command}` does not parse: {e}")
    spec = getattr(args, "spec", None) or ""
    if spec.startswith("zoo:"):
        name = spec.split(":")[1]
        assert name in ZOO, f"{page}: `{command}` names {name!r}, not in models_zoo.ZOO"


def _relative_links(text: str) -> list[str]:
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_readme_links_to_docs_exist() -> None:
    links = _relative_links(README)
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"


@pytest.mark.parametrize("page", DOCS, ids=[p.name for p in DOCS])
def test_docs_links_exist(page: Path) -> None:
    missing = [link for link in _relative_links(page.read_text()) if not (page.parent / link).exists()]
    assert not missing, f"{page.name} links to missing files: {missing}"
