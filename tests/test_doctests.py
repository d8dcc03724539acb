"""The examples in docstrings are real: each module's doctests run here."""

from __future__ import annotations

import doctest

import pytest

import fxmem
import fxmem.api
import fxmem.inputs
import fxmem.planner.checkpoint
import fxmem.planner.cut
import fxmem.planner.search
import fxmem.symbolic

MODULES = [fxmem, fxmem.api, fxmem.inputs, fxmem.symbolic, fxmem.planner.checkpoint, fxmem.planner.cut, fxmem.planner.search]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)  # type: ignore[arg-type]
    assert result.attempted > 0 and result.failed == 0
