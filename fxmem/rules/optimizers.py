"""Optimizer state per parameter tensor, one decorated rule per optimizer.

State is created inside the first ``step()``; these rules give what exists after it. Each rule gets a
parameter's element count and element size and returns its state bytes; ``make`` builds the real
torch optimizer so tests can check the rule against ``optimizer.state`` after a real step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from fxmem.rules import Registry

__all__ = ["OPTIMIZERS", "OptimizerRule", "register_optimizer"]

_STEP_BYTES = 4
"""Adam, AdamW, Adagrad and RMSprop keep ``step`` as a 0-dim float32 tensor per parameter
(torch/optim/adam.py: ``torch.tensor(0.0, dtype=_get_scalar_dtype())`` unless fused/capturable).
On CUDA that tensor stays on the host, so device targets leave it out; the CPU counts it."""


@dataclass(frozen=True)
class OptimizerRule:
    """How much state one parameter tensor costs, and how to build the real optimizer."""

    name: str
    summary: str
    buffers: int
    """Parameter-sized state buffers per parameter tensor."""
    step_tensor: bool
    make: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]

    def state_bytes(self, numel: int, element_size: int) -> int:
        return self.buffers * numel * element_size + (_STEP_BYTES if self.step_tensor else 0)


OPTIMIZERS: Registry[str, OptimizerRule] = Registry("optimizer")


def register_optimizer(rule: OptimizerRule) -> OptimizerRule:
    OPTIMIZERS.register(rule.name)(rule)
    return rule


register_optimizer(OptimizerRule("sgd", "plain SGD: no state", 0, False, lambda p: torch.optim.SGD(p, lr=0.1)))
register_optimizer(
    OptimizerRule("sgd-momentum", "SGD with momentum: one momentum buffer", 1, False, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
)
register_optimizer(OptimizerRule("adam", "Adam: exp_avg and exp_avg_sq, plus a step scalar", 2, True, lambda p: torch.optim.Adam(p)))
register_optimizer(OptimizerRule("adamw", "AdamW: exp_avg and exp_avg_sq, plus a step scalar", 2, True, lambda p: torch.optim.AdamW(p)))
register_optimizer(OptimizerRule("adagrad", "Adagrad: one sum buffer, plus a step scalar", 1, True, lambda p: torch.optim.Adagrad(p)))
register_optimizer(OptimizerRule("rmsprop", "RMSprop: square_avg, plus a step scalar", 1, True, lambda p: torch.optim.RMSprop(p)))
register_optimizer(
    OptimizerRule(
        "rmsprop-momentum",
        "RMSprop with momentum: square_avg and a momentum buffer, plus a step scalar",
        2,
        True,
        lambda p: torch.optim.RMSprop(p, momentum=0.9),
    )
)
