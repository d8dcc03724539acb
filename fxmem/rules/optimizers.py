"""Optimizer state per parameter tensor, one rule per optimizer.

State is created inside the first ``step()``; these rules give what exists after it. Each rule gets a
parameter's shape and element size and returns its state bytes; ``make`` builds the real optimizer
(torch's, or fxmem/rules/extra_optimizers.py's for those torch lacks) so that tests can check the rule against
``optimizer.state`` after a real step, and the timeline can run its step on fake tensors.

Implementations (``impl``): "for-loop" (one parameter at a time), "foreach" (torch._foreach_* over
all of them) and "fused" (one kernel); None leaves the choice to the optimizer, which picks as
``default_impl`` says. Only the step counter's place depends on it, see ``OptimizerRule.step_bytes``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from fxmem.errors import InputSpecError
from fxmem.rules import Registry
from fxmem.rules.extra_optimizers import Adafactor, Adam8bit, Lion, adam8bit_state_bytes

__all__ = ["IMPLS", "OPTIMIZERS", "OptimizerRule", "default_impl", "register_optimizer"]

IMPLS = ("for-loop", "foreach", "fused")
_TORCH_IMPLS = ("for-loop", "foreach")
"""What every torch optimizer used here accepts: a ``foreach=`` argument (torch/optim/*.py)."""
_WITH_FUSED = ("for-loop", "foreach", "fused")
"""SGD, Adam, AdamW and Adagrad also take ``fused=`` in torch 2.13; RMSprop and Adafactor do not (their
``__init__`` has no such argument). Fused SGD works without momentum too: ``_fused_sgd`` passes an
empty momentum list when ``momentum == 0`` (torch/optim/sgd.py)."""


@dataclass(frozen=True)
class OptimizerRule:
    """How much state one parameter tensor costs, and how to build the real optimizer."""

    name: str
    summary: str
    buffers: int
    """Parameter-sized state buffers per parameter tensor (ignored when ``state_fn`` is set)."""
    step_tensor: bool
    """Whether the optimizer keeps ``step`` as a 0-dim tensor per parameter (else a Python number)."""
    build: Callable[..., torch.optim.Optimizer]
    """``build(params, **flags)`` -> the optimizer; ``flags`` are ``foreach=``/``fused=`` (see ``make``)."""
    impls: tuple[str, ...] = ("for-loop",)
    """The implementations ``build`` offers (``build`` takes ``foreach=`` when "foreach" is among them)."""
    state_fn: Callable[[tuple[int, ...], int], int] | None = None
    """For state that is not ``buffers`` parameter-sized tensors: (shape, element size) -> bytes."""
    auto_foreach: bool = True
    """Whether ``foreach=None`` turns into foreach on CUDA (see ``default_impl``)."""

    def make(self, params: Iterable[torch.nn.Parameter], impl: str | None = None) -> torch.optim.Optimizer:
        """The real optimizer over ``params``, running ``impl`` (None: the optimizer's own default)."""
        return self.build(list(params), **self.flags(impl))

    def flags(self, impl: str | None) -> dict[str, bool]:
        """The keyword arguments that select ``impl``; InputSpecError if this optimizer lacks it."""
        if impl is None:
            return {}
        if impl not in IMPLS:
            raise InputSpecError(f"unknown optimizer implementation '{impl}'; use one of: {', '.join(IMPLS)}.")
        if impl not in self.impls:
            raise InputSpecError(
                f"optimizer '{self.name}' has no {impl} implementation (it offers: {', '.join(self.impls)}); "
                "pick one of those with --optimizer-impl, or leave it out for the default."
            )
        if impl == "fused":
            return {"fused": True}
        return {"foreach": impl == "foreach"} if "foreach" in self.impls else {}

    def state_bytes(self, shape: int | Sequence[int], element_size: int, *, impl: str | None = None, target: str = "cpu") -> int:
        """Device bytes of one parameter tensor's state on ``target`` ("cpu" or "cuda") with ``impl``.

        ``shape`` may be an element count when the state does not depend on the shape.
        """
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        state = self.state_fn(dims, element_size) if self.state_fn is not None else self.buffers * math.prod(dims) * element_size
        return state + self.step_bytes(impl, target)

    def step_bytes(self, impl: str | None, target: str) -> int:
        """The step counter's device bytes. See Note [Where step lives]."""
        if not self.step_tensor:
            return 0
        impl = impl or default_impl(self, target)
        if impl == "fused":
            return _FUSED_STEP_BYTES
        return _host_step_bytes() if target == "cpu" else 0


# Note [Where step lives]
# Adam, AdamW, Adagrad, RMSprop and Adafactor keep ``step`` as a 0-dim tensor per parameter. Unless the
# optimizer is fused (or capturable, which fxmem does not offer), it is made without a device
# (``torch.tensor(0.0, dtype=_get_scalar_dtype())`` in torch/optim/adam.py ``_init_group``, adagrad.py
# ``__init__``, rmsprop.py and _adafactor.py ``_init_group``): on a CUDA target it sits in host memory and
# costs the GPU nothing; on the CPU it costs 4 bytes (8 when the default dtype is float64,
# ``_get_scalar_dtype`` in torch/optim/optimizer.py). Fused optimizers put it on the parameter's device
# as float32 whatever the default dtype (``_get_scalar_dtype(is_fused=True)``).
_FUSED_STEP_BYTES = 4


def _host_step_bytes() -> int:
    return 8 if torch.get_default_dtype() == torch.float64 else 4


def default_impl(rule: OptimizerRule, target: str) -> str:
    """What the optimizer runs when not told: foreach on CUDA where it has one, else the for-loop.

    torch picks with ``_default_to_fused_or_foreach(params, differentiable=False, use_fused=False)``
    (torch/optim/optimizer.py): never fused by default, foreach only when every parameter is on a
    device in ``_get_foreach_kernels_supported_devices()`` (torch/utils/_foreach_utils.py: cuda, xpu,
    mtia, the privateuse1 backend; not cpu). fxmem's Lion picks the same way. Adafactor does not ask:
    ``adafactor()`` in torch/optim/_adafactor.py runs the for-loop unless ``foreach`` is truthy.
    """
    return "foreach" if target != "cpu" and rule.auto_foreach and "foreach" in rule.impls else "for-loop"


def _adafactor_state(shape: tuple[int, ...], element_size: int) -> int:
    """torch.optim.Adafactor (_adafactor.py ``_init_group``): a parameter of 2 or more dims keeps a row
    factor (the shape with the last dim 1) and a column factor (the second-to-last dim 1) of the second
    moment; a smaller one keeps the whole ``variance``. No first moment. Both in the gradient's dtype."""
    if len(shape) < 2:
        return math.prod(shape) * element_size
    rows = math.prod(shape[:-1])
    cols = math.prod(shape[:-2]) * shape[-1]
    return (rows + cols) * element_size


OPTIMIZERS: Registry[str, OptimizerRule] = Registry("optimizer")


def register_optimizer(rule: OptimizerRule) -> OptimizerRule:
    OPTIMIZERS.register(rule.name)(rule)
    return rule


register_optimizer(OptimizerRule("sgd", "plain SGD: no state", 0, False, lambda p, **f: torch.optim.SGD(p, lr=0.1, **f), _WITH_FUSED))
register_optimizer(
    OptimizerRule(
        "sgd-momentum", "SGD with momentum: one momentum buffer", 1, False, lambda p, **f: torch.optim.SGD(p, lr=0.1, momentum=0.9, **f), _WITH_FUSED
    )
)
register_optimizer(
    OptimizerRule("adam", "Adam: exp_avg and exp_avg_sq, plus a step scalar", 2, True, lambda p, **f: torch.optim.Adam(p, **f), _WITH_FUSED)
)
register_optimizer(
    OptimizerRule("adamw", "AdamW: exp_avg and exp_avg_sq, plus a step scalar", 2, True, lambda p, **f: torch.optim.AdamW(p, **f), _WITH_FUSED)
)
register_optimizer(
    OptimizerRule("adagrad", "Adagrad: one sum buffer, plus a step scalar", 1, True, lambda p, **f: torch.optim.Adagrad(p, **f), _WITH_FUSED)
)
register_optimizer(
    OptimizerRule("rmsprop", "RMSprop: square_avg, plus a step scalar", 1, True, lambda p, **f: torch.optim.RMSprop(p, **f), _TORCH_IMPLS)
)
register_optimizer(
    OptimizerRule(
        "rmsprop-momentum",
        "RMSprop with momentum: square_avg and a momentum buffer, plus a step scalar",
        2,
        True,
        lambda p, **f: torch.optim.RMSprop(p, momentum=0.9, **f),
        _TORCH_IMPLS,
    )
)
register_optimizer(OptimizerRule("lion", "Lion (Chen et al. 2023): one exp_avg buffer, no step", 1, False, lambda p, **f: Lion(p, **f), _TORCH_IMPLS))
register_optimizer(
    OptimizerRule(
        "adam8bit",
        "bitsandbytes-style blockwise 8-bit Adam: two uint8 moments + fp32 absmax per 256 elements (fp32 below 4096 elements)",
        2,
        False,
        lambda p, **f: Adam8bit(p, **f),
        ("for-loop",),
        lambda shape, _size: adam8bit_state_bytes(math.prod(shape)),
    )
)
register_optimizer(
    OptimizerRule(
        "adafactor",
        "Adafactor (torch.optim.Adafactor): factored second moment, row + column vectors for >= 2-D params, plus a step scalar",
        1,
        True,
        lambda p, **f: Adafactor(p, **f),  # torch.optim.Adafactor's state; a step that runs on fake tensors
        _TORCH_IMPLS,
        _adafactor_state,
        auto_foreach=False,
    )
)
