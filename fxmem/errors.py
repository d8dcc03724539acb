"""Errors a user can cause, each a one-paragraph message that names the culprit and the way out.

Hierarchy::

    * FxmemError              base of everything fxmem raises on purpose; the CLI prints it and exits 2
      x LoadError             a model spec that cannot be imported, built or called
      x InputSpecError        a malformed input shape, dtype, size or option value
      x TraceError            torch.fx cannot trace the model (names the module and source line)
      x CaptureError          the fake-tensor run failed at a node (names node, layer, shapes)
      x NonLinearBatchError   a caller asked for a*B + c where the bytes are not linear in B
      x DuplicateRuleError    a rule registered twice for the same key

Anything else that escapes is a bug in fxmem, and the CLI shows its traceback.
"""

from __future__ import annotations

__all__ = [
    "CaptureError",
    "DuplicateRuleError",
    "FxmemError",
    "FxmemWarning",
    "InputSpecError",
    "LoadError",
    "NonLinearBatchError",
    "TraceError",
    "first_line",
]


def first_line(e: BaseException, width: int = 300) -> str:
    """An exception's cause in one line, as a message quotes it: its first line (torch's messages go on
    with tracebacks and hints), or its type where it says nothing."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:width]


class FxmemWarning(UserWarning):
    """An option given that changes nothing in this analysis (``--seq-len`` without an S axis, a
    sharding stage on one GPU): the report is right, but the user likely meant something else."""


class FxmemError(Exception):
    """Base class: the message is meant for the user, as one paragraph.

    ``str()`` is the message given at construction, whatever is appended to ``args`` later: the fx
    Interpreter appends "While executing ..." and the whole stack trace to any exception passing
    through ``Interpreter.run`` (torch/fx/interpreter.py, ``extra_traceback``), which would turn a
    one-paragraph message into a screenful.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.message = str(args[0]) if args else ""

    def __str__(self) -> str:
        return self.message


class LoadError(FxmemError):
    """The model spec could not be resolved to an ``nn.Module``."""


class InputSpecError(FxmemError):
    """An input shape, dtype, size or option value is malformed."""


class TraceError(FxmemError):
    """``torch.fx.symbolic_trace`` failed on the model."""


class CaptureError(FxmemError):
    """Running the traced graph on fake tensors failed at a node."""


class NonLinearBatchError(FxmemError):
    """The saved bytes are a polynomial of degree > 1 in the batch, where a*B + c was required."""


class DuplicateRuleError(FxmemError):
    """A registry key was registered twice."""


class NotSimulatedError(FxmemError):
    """The step's peak was asked of a report made without simulating the step (``peak=False``)."""
