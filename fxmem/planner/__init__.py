"""The planner: the levers that make a step fit, searched (search.py: ``fxmem.plan``), activation
checkpointing chosen under a memory budget, emitted as code (emit.py, show.py), and verified for real.

``plan_checkpointing`` chooses (block_ops.py records each block's ATen ops on fake tensors, cut.py cuts
them with networkx, checkpoint.py picks per block with a knapsack); ``emit_source`` and
``compile_plan`` turn the choice into code; ``measure_plan`` runs that code on the real model.
"""

from __future__ import annotations

from fxmem.planner.checkpoint import BlockChoice, CheckpointPlan, OpKey, plan_checkpointing
from fxmem.planner.emit import compile_plan, emit_source
from fxmem.planner.verify import PlanMeasurement, measure_plan

__all__ = [
    "BlockChoice",
    "CheckpointPlan",
    "OpKey",
    "PlanMeasurement",
    "compile_plan",
    "emit_source",
    "measure_plan",
    "plan_checkpointing",
]
