"""Step passes that also give the saved tensors: one fake pass where analyze had two (Note [One pass
for the capture and the step] in fxmem/step/timeline.py).

``analyze`` asks for the capture first (the symbolic pass, then B=1) and for the step's timelines
later, of the same graphs at the same batches. Where it simulates the step at all, the capture is
taken from the step's own forward, and the step's timeline is kept until the step asks for it.
Where the step cannot run (a kernel that needs concrete sizes in backward, an optimizer that
fails), the capture is made by its own pass, as before, and the step's failure is kept for the
step to raise when it asks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch.fx as fx

from fxmem.engine.capture import BatchSpecialized, StepCapture, SymbolicUnsupported
from fxmem.errors import FxmemError
from fxmem.results import Capture, Timeline

__all__ = ["SHARED_BATCHES", "SharedPasses", "Simulate"]

Simulate = Callable[[fx.GraphModule, int | None, Callable[[StepCapture], None] | None], Timeline]
"""Simulates the step of a graph at a batch (None: B symbolic), handing its capture to the callback if one is given."""

SHARED_BATCHES = (None, 1)
"""The passes both ask for: the symbolic one and B=1. The concrete passes a capture needs where the
symbolic one fails are its own (the step asks for other batches, when it asks at all)."""

_STEP_FAILURES = (FxmemError, SymbolicUnsupported, BatchSpecialized)
"""What a step may raise that its callers handle (a fallback to concrete passes, an error for the user)."""


@dataclass
class SharedPasses:
    """The step's passes, each run once for the capture and the timeline of the same graph and batch."""

    simulate: Simulate
    kept: dict[tuple[int, int | None], Timeline | Exception] = field(default_factory=dict)
    """What a capture's step gave (its timeline, or why it failed), until the step asks for it."""

    def capture(self, gm: fx.GraphModule, batch: int | None, alone: Callable[[], Capture]) -> Capture:
        """The saved tensors of ``gm`` at ``batch``, recorded by a step simulated now; ``alone`` (the
        capture's own pass) where the step or its record fails, which then says why in its own terms."""
        recorded: list[StepCapture] = []
        try:
            self.kept[(id(gm), batch)] = self.simulate(gm, batch, recorded.append)
        except _STEP_FAILURES as e:
            self.kept[(id(gm), batch)] = e
            return alone()
        try:
            return recorded[0].capture(batch) if recorded else alone()
        except _STEP_FAILURES:
            return alone()

    def step(self, gm: fx.GraphModule, batch: int | None) -> Timeline:
        """The step of ``gm`` at ``batch``: the one a capture ran (its failure raised again), else simulated now."""
        found = self.kept.pop((id(gm), batch), None)
        if found is None:
            return self.simulate(gm, batch, None)
        if isinstance(found, Exception):
            raise found
        return found
