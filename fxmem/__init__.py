"""fxmem: how much memory one training step of a PyTorch model needs, per layer, at every batch size.

>>> import fxmem, torch.nn as nn
>>> report = fxmem.analyze(nn.Sequential(nn.Linear(512, 512), nn.ReLU()), ["B,512"], optimizer="adam")
>>> report.activations.per_sample     # the ReLU keeps its 512 float32 outputs; the Linear keeps the input batch
2048
"""

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

__version__ = "0.1.0"

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
