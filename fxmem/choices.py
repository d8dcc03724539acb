"""The names the command line offers, without importing torch: ``fxmem --help`` builds its parser from these.

Each is a copy of a registry or constant that lives beside the code it names, which imports torch:
loading those modules takes seconds, and ``--help``, ``--version`` and a mistyped option should answer
at once (issue 36). tests/test_cli.py holds every copy equal to its source, so that neither can change
alone; the source is named beside each.

See Note [A parser without torch] in fxmem/cli.py.
"""

from __future__ import annotations

__all__ = [
    "AMP_DTYPES",
    "BF16_WEIGHT_RECIPES",
    "BN_THRESHOLD",
    "DEFAULT_GPU",
    "DEFAULT_LEVERS",
    "FORMATS",
    "FRONTENDS",
    "GPUS",
    "IMPLS",
    "LEVERS",
    "LOSSES",
    "MAX_ROWS",
    "OPTIMIZERS",
    "RECIPES",
    "SCHEDULES",
    "SHARDS",
    "TARGETS",
    "ZERO_GRAD_PLACES",
]

LOSSES = ("sum", "mse", "cross_entropy", "lm_cross_entropy", "model", "auto")
"""fxmem.engine.losses.LOSSES, its keys."""
FRONTENDS = ("auto", "fx", "export")
"""fxmem.frontends.tracing.FRONTENDS."""
GPUS = (
    "a100-40gb", "a100-80gb", "h100-80gb", "h100-pcie", "h100-nvl", "h200", "l4", "l40s", "l40", "a40", "a10", "a6000",
    "rtx4090", "rtx3090", "rtx3080", "v100-32gb", "t4",
)  # fmt: skip
"""fxmem.gpu.gpus.GPUS, its keys in order."""
DEFAULT_GPU = "h100-80gb"
"""fxmem.step.training.DEFAULT_GPU."""
TARGETS = ("cuda", "cpu")
"""fxmem.step.training.TARGETS."""
AMP_DTYPES = ("bf16", "fp16")
"""fxmem.step.training.AMP_DTYPES, its keys."""
SHARDS = ("none", "zero1", "zero2", "zero3", "fsdp")
"""fxmem.step.sharding.STAGES (fxmem.step.training.SHARDS)."""
IMPLS = ("for-loop", "foreach", "fused")
"""fxmem.rules.optimizers.IMPLS."""
OPTIMIZERS = (
    "sgd", "sgd-momentum", "adam", "adamw", "adagrad", "rmsprop", "rmsprop-momentum", "lion", "adam8bit", "adafactor",
)  # fmt: skip
"""fxmem.rules.optimizers.OPTIMIZERS.rules(), its keys in order (the built-in ones)."""
RECIPES = {
    "fp32": "fp32 weights, gradients and optimizer state (4 + 4 bytes + state)",
    "amp": "torch.autocast over fp32 weights: state as fp32 (4 + 4 + state); the bf16/fp16 weight copies are activations",
    "bf16": "pure bf16, model.to(torch.bfloat16): weights, gradients and optimizer state in bf16 (2 + 2 + state)",
    "mixed": "Megatron/DeepSpeed mixed precision: bf16/fp16 weights and gradients, fp32 master copy and optimizer state (2 + 2 + 4 + state)",
    "mixed-fp32-grads": "bf16 weights, fp32 gradient accumulation, fp32 master copy and optimizer state (2 + 4 + 4 + state)",
}
"""fxmem.step.precision.RECIPES: each recipe's ``summary``."""
BF16_WEIGHT_RECIPES = ("bf16", "mixed", "mixed-fp32-grads")
"""The recipes of fxmem.step.precision.RECIPES whose ``weight_dtype`` is torch.bfloat16."""
FORMATS = ("table", "markdown", "csv", "json")
"""fxmem.output.render.FORMATS."""
MAX_ROWS = 25
"""fxmem.output.render.MAX_ROWS."""
LEVERS = ("batch", "precision", "optimizer-impl", "checkpoint", "shard", "offload", "optimizer", "compile")
"""fxmem.planner.search.LEVERS."""
DEFAULT_LEVERS = LEVERS[:-3]
"""fxmem.planner.search.DEFAULT_LEVERS."""
BN_THRESHOLD = 16
"""fxmem.cost.tradeoff.BN_THRESHOLD."""
SCHEDULES = ("1f1b", "gpipe", "interleaved")
"""fxmem.parallel.pipeline_split.Schedule, its values (1f1b first: the default)."""
ZERO_GRAD_PLACES = ("after-step", "before-backward")
"""fxmem.results.ZERO_GRAD_PLACES (the default first)."""
