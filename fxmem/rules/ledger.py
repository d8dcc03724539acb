"""The report's "Code path" ledger: what the passes of one analysis chose or modelled, said in words.

Rules and frontends alike tell it (transformers' eager code paths while exporting, the key/value
cache a training forward builds, the 4-bit matmuls' kernels modelled from their source); ``analyze``
opens it around its passes and puts what it collected on the report (``Report.paths``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = ["code_paths_taken", "note_code_path"]

_TAKEN: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("fxmem_code_paths", default=None)


@contextlib.contextmanager
def code_paths_taken() -> Iterator[set[str]]:
    """Collect, in words, what the passes inside chose or modelled, for the report."""
    taken: set[str] = set()
    token = _TAKEN.set(taken)
    try:
        yield taken
    finally:
        _TAKEN.reset(token)


def note_code_path(words: str) -> None:
    """Tell the report, in ``words``, a code path the traced step took (where a ledger is open)."""
    taken = _TAKEN.get()
    if taken is not None:
        taken.add(words)
