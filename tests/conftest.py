"""Shared pytest configuration for fxmem's tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

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
        help="number of generated models tests/test_fuzz.py checks, shared out over the grammar's features, "
        "at least one each (default: the hypothesis profile's, 200 in CI)",
    )


# --- golden reports (tests/test_report.py) ----------------------------------------------------------
GOLDEN = Path(__file__).parent / "golden"


@pytest.hookimpl(specname="pytest_addoption")
def pytest_addoption_golden(parser: pytest.Parser) -> None:
    parser.addoption("--overwrite", action="store_true", help="rewrite tests/golden/*.txt from the current output")


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Callable[..., None]:
    """Compare text with tests/golden/<test name>.txt; ``--overwrite`` rewrites it (review the diff)."""

    def check(text: str, name: str | None = None) -> None:
        path = GOLDEN / f"{name or request.node.name}.txt"
        if request.config.getoption("--overwrite"):
            path.write_text(text)
        assert path.exists(), f"{path} is missing; create it with pytest --overwrite and review it"
        assert text == path.read_text(), f"{path} differs; rerun with --overwrite if the change is intended"

    return check


# --- CLI tests (tests/test_cli.py, tests/test_errors.py) ---------------------------------------------
@pytest.fixture
def at_repo_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Specs such as tests/models_for_errors.py:linear_8_4 are relative to the repo root; no progress lines."""
    from fxmem import cli

    monkeypatch.chdir(GOLDEN.parent.parent)
    monkeypatch.setattr(cli, "_SLOW_S", 1e9)


# --- the environment fxmem reads ------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _no_cublas_workspace_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """fxmem sizes cuBLAS workspaces by CUBLAS_WORKSPACE_CONFIG where it runs, and importing MONAI sets
    it (to ":4096:8", monai/utils/misc.py); tests expect torch's defaults unless they set it themselves."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)


# --- kernels whose buffers depend on the thread count --------------------------------------------
@pytest.fixture
def one_thread() -> Iterator[None]:
    """One OpenMP thread for the test: which oneDNN or native kernel runs, and what it allocates,
    depends on the thread count, and the rules these tests check are measured at one."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
