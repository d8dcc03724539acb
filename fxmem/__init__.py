"""fxmem: how much memory one training step of a PyTorch model needs, per layer, at every batch size.

>>> import fxmem, torch.nn as nn
>>> report = fxmem.analyze(nn.Sequential(nn.Linear(512, 512), nn.ReLU()), ["B,512"], optimizer="adam")
>>> report.activations.per_sample     # the ReLU keeps its 512 float32 outputs; the Linear keeps the input batch
2048

The names below are imported on first use (PEP 562): ``import fxmem`` alone loads no torch, so that
``fxmem --help`` and ``fxmem --version`` answer at once (see Note [A parser without torch] in fxmem/cli.py).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fxmem.api import analyze
    from fxmem.cost.roofline import StepTime
    from fxmem.cost.tradeoff import FlopCount, TradeoffRow
    from fxmem.errors import (
        CaptureError,
        DuplicateRuleError,
        FxmemError,
        FxmemWarning,
        InputSpecError,
        LoadError,
        NonLinearBatchError,
        NotSimulatedError,
        TraceError,
    )
    from fxmem.frontends.load import load_model
    from fxmem.gpu.gpus import GPUS, GpuSpec
    from fxmem.inputs import Constant, InputSpec, parse_inputs, parse_size
    from fxmem.measure import Measurement, PeakMeasurement, measure, measure_peak
    from fxmem.options import Hardware, Parallelism, Training
    from fxmem.planner import CheckpointPlan, plan_checkpointing
    from fxmem.planner.search import Candidate, Plan, plan, verify
    from fxmem.report import Report
    from fxmem.results import (
        Category,
        DevicePeak,
        EnvelopePiece,
        Kind,
        MemoryEvent,
        ModelSpec,
        NodeRecord,
        OpCostRecord,
        Peak,
        Phase,
        StateBytes,
        Timeline,
    )
    from fxmem.rules.ops import register_op_rule
    from fxmem.rules.optimizers import OptimizerRule, register_optimizer
    from fxmem.step.precision import RECIPES, PrecisionRecipe
    from fxmem.step.training import TrainingSetup
    from fxmem.symbolic import ByteExpr

try:
    __version__ = version("fxmem")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "fxmem.api": ("analyze",),
    "fxmem.cost.roofline": ("StepTime",),
    "fxmem.cost.tradeoff": ("FlopCount", "TradeoffRow"),
    "fxmem.errors": (
        "CaptureError", "DuplicateRuleError", "FxmemError", "FxmemWarning", "InputSpecError", "LoadError", "NonLinearBatchError",
        "NotSimulatedError", "TraceError",
    ),
    "fxmem.frontends.load": ("load_model",),
    "fxmem.gpu.gpus": ("GPUS", "GpuSpec"),
    "fxmem.inputs": ("Constant", "InputSpec", "parse_inputs", "parse_size"),
    "fxmem.measure": ("Measurement", "PeakMeasurement", "measure", "measure_peak"),
    "fxmem.options": ("Hardware", "Parallelism", "Training"),
    "fxmem.planner": ("CheckpointPlan", "plan_checkpointing"),
    "fxmem.planner.search": ("Candidate", "Plan", "plan", "verify"),
    "fxmem.report": ("Report",),
    "fxmem.results": (
        "Category", "DevicePeak", "EnvelopePiece", "Kind", "MemoryEvent", "ModelSpec", "NodeRecord", "OpCostRecord", "Peak", "Phase",
        "StateBytes", "Timeline",
    ),
    "fxmem.rules.ops": ("register_op_rule",),
    "fxmem.rules.optimizers": ("OptimizerRule", "register_optimizer"),
    "fxmem.step.precision": ("RECIPES", "PrecisionRecipe"),
    "fxmem.step.training": ("TrainingSetup",),
    "fxmem.symbolic": ("ByteExpr",),
}  # fmt: skip
"""Each public name's module, imported on first access by ``__getattr__``."""
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "GPUS",
    "RECIPES",
    "ByteExpr",
    "Candidate",
    "CaptureError",
    "Category",
    "CheckpointPlan",
    "Constant",
    "DevicePeak",
    "DuplicateRuleError",
    "EnvelopePiece",
    "FlopCount",
    "FxmemError",
    "FxmemWarning",
    "GpuSpec",
    "Hardware",
    "InputSpec",
    "InputSpecError",
    "Kind",
    "LoadError",
    "Measurement",
    "MemoryEvent",
    "ModelSpec",
    "NodeRecord",
    "NonLinearBatchError",
    "NotSimulatedError",
    "OpCostRecord",
    "OptimizerRule",
    "Parallelism",
    "Peak",
    "PeakMeasurement",
    "Phase",
    "Plan",
    "PrecisionRecipe",
    "Report",
    "StateBytes",
    "StepTime",
    "Timeline",
    "TraceError",
    "TradeoffRow",
    "Training",
    "TrainingSetup",
    "__version__",
    "analyze",
    "load_model",
    "measure",
    "measure_peak",
    "parse_inputs",
    "parse_size",
    "plan",
    "plan_checkpointing",
    "register_op_rule",
    "register_optimizer",
    "verify",
]
"""Every name of ``_EXPORTS`` and ``__version__`` (tests/test_cli.py holds the two equal)."""


def __getattr__(name: str) -> Any:
    """``fxmem.analyze`` and the other public names: import the module that defines it, once (PEP 562)."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'fxmem' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
