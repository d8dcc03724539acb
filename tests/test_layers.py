"""The package's layers hold: no module imports one from a stage above it (pyproject.toml, [tool.importlinter]).

import-linter reads every import, those inside functions too (only ``TYPE_CHECKING`` blocks are left
out), so a lazy import cannot slip a cycle back in.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter is not installed (pip install 'fxmem[test]')")
def test_the_layers_contract_is_kept() -> None:
    run = subprocess.run(["lint-imports"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "1 kept, 0 broken" in run.stdout
