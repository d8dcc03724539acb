"""Shared pytest configuration for fxmem's tests."""

from __future__ import annotations

import pytest


# --- fuzzing (tests/test_fuzz.py) -----------------------------------------------------------------
# A hook implementation under its own name (specname) so that other options can add their own
# pytest_addoption to this file without touching this one.
@pytest.hookimpl(specname="pytest_addoption")
def pytest_addoption_fuzz(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fuzz-examples",
        type=int,
        default=None,
        metavar="N",
        help="number of generated models tests/test_fuzz.py checks (default: the hypothesis profile's, 200 in CI)",
    )
