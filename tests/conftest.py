"""Shared fixtures. ``--overwrite`` rewrites golden report files from the current output."""

from __future__ import annotations

from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--overwrite", action="store_true", help="rewrite tests/golden/*.txt from current output")


@pytest.fixture
def golden(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Compare text with tests/golden/<test name>.txt (or write it with --overwrite)."""

    def check(text: str, name: str | None = None) -> None:
        path = GOLDEN / f"{name or request.node.name}.txt"
        if request.config.getoption("--overwrite"):
            path.write_text(text)
        assert path.exists(), f"{path} is missing; create it with pytest --overwrite and review it"
        assert text == path.read_text(), f"{path} differs; rerun with --overwrite if the change is intended"

    return check
