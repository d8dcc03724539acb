"""Pausing CPython's cycle collector while fxmem's passes run (Note [The cycle collector during analyze])."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["cycle_collector_paused"]

P = ParamSpec("P")
R = TypeVar("R")


def cycle_collector_paused(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` with CPython's cycle collector off while it runs; on again after, where it was on."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return run


# Note [The cycle collector during analyze]
#     The fake passes make millions of short-lived Python objects (fake tensors, SymInts, sympy
#     expressions, events), and each full collection of CPython's cycle collector walks every
#     object the process holds: 0.3 s of a 2.7-2.9 s default analyze of gpt-7b with its report
#     rendered (benchmarks/scale.py), for a few thousand objects found. Reference counting still
#     frees everything the moment it is last used, which is what the step's timeline watches (a
#     storage's death is its weakref's callback: Note [How the timeline sees memory] in
#     fxmem/step/timeline.py); the simulated step makes no cycles that hold a storage (its ``pack``
#     detaches the outputs it keeps for that reason: Note [What the step's saved-tensor hook keeps]),
#     so pausing the collector changes no event. What cycles there are wait for the next collection
#     once ``analyze`` (or ``render``, which may run a lazy pass) returns.
