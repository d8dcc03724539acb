"""What a model's Python reads of its tensors while torch.export traces it, answered as the eager step answers.

Note [.data while exporting]
    ``weight.data`` is the tensor's storage without its autograd history: a new tensor sharing the
    storage, ``requires_grad=False`` (``THPVariable_get_data`` in torch/csrc/autograd/python_variable.cpp,
    ``variable_data()``). It is made outside the dispatcher, so non-strict torch.export's proxy mode never
    sees an op make it: the fake parameter's alias reaches the graph as a tensor constant, and export
    stops with "We found a fake tensor in the exported program constant's list". PEFT layers that
    build a new weight from the frozen one read it so: HRA (peft 0.21, tuners/hra/layer.py, ``forward``:
    ``orig_weight = self.get_base_layer().weight.data``), and SHiRA and MiSS's "bat" mode through
    ``BaseTunerLayer.get_base_weight`` (tuners/tuners_utils.py). Dynamo, torch.compile's own
    tracer, records ``.data`` as a graph op on the same tensor (torch/_dynamo/variables/tensor.py,
    ``method_attr_data``); here it is recorded as ``detach()``, which is the same alias (same storage,
    no history, ``requires_grad=False``) made through the dispatcher. Setting ``.data`` is left alone.

Note [A check that raises]
    Some layers check their weights' values in training and raise if they are unusable: VB-LoRA (peft
    0.21, tuners/vblora/layer.py, ``_get_lora_matrices``) has ``if self.training and
    vblora_logits_A[0, 0].isinf().any(): raise RuntimeError(...)``. On fake tensors the value is unknown
    and the ``if`` stops torch.export ("Could not guard on data-dependent expression"). But a step that
    runs at all took the branch that does not raise: such a check is what ``torch._check(not cond)``
    states (torch/__init__.py, ``_check``: "a condition ... that is expected to be true"), and the step
    fxmem predicts is the one that runs. So where a branch on a data-dependent value is an ``if`` whose
    body only raises (no ``else``), or an ``assert``, the value is the one that does not raise: False
    for the ``if``, True for the ``assert``, through ``not``, ``and`` and ``or`` where every operand
    needs the same value. The same holds for a check on a number read from a tensor: Poly's router
    (tuners/poly/router.py) has ``if task_ids.max().item() >= self.n_tasks: raise ValueError(...)``,
    a branch on a ``SymBool`` of the unbacked ``u0`` that ``.item()`` gave; the ShapeEnv is told the
    passing outcome with ``torch._check``, as the model's author would write it for export. Any other
    branch on a value is still refused with its line (``data_dependent_error`` in trace_causes.py).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import sys
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.overrides import TorchFunctionMode

__all__ = ["reading_as_eager"]

_DATA = torch._C.TensorBase.data.__get__
"""The getter of ``Tensor.data``, as a function mode receives it (a method-wrapper: compare with ==)."""

_NOT_USERS = (f"{torch.__path__[0]}/", f"{__file__.rpartition('/frontends/')[0]}/")


@contextlib.contextmanager
def reading_as_eager() -> Iterator[None]:
    """Inside an exported forward: ``.data`` as ``detach()`` (Note [.data while exporting]), and a
    data-dependent branch that only guards a raise taken as not raising (Note [A check that raises])."""
    original = torch.SymBool.__bool__

    def passing_bool(self: torch.SymBool) -> bool:
        try:
            return original(self)
        except GuardOnDataDependentSymNode:
            passing = _passing_value(_user_frame(sys._getframe(1)))
            if passing is None:
                raise
            torch._check(self if passing else torch.sym_not(self))
            return passing

    torch.SymBool.__bool__ = passing_bool  # type: ignore[method-assign]
    try:
        with _ExportedReads():
            yield
    finally:
        torch.SymBool.__bool__ = original  # type: ignore[method-assign]


class _ExportedReads(TorchFunctionMode):
    """While a forward is exported: ``.data`` as ``detach()`` (Note [.data while exporting]) and a
    data-dependent branch that only guards a raise taken as not raising (Note [A check that raises])."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func == _DATA:
            return args[0].detach()
        if getattr(func, "__name__", "") != "__bool__":
            return func(*args, **kwargs)
        try:
            return func(*args, **kwargs)
        except GuardOnDataDependentSymNode:
            passing = _passing_value(_user_frame(sys._getframe(1)))
            if passing is None:
                raise
            return passing


def _user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame outside torch and fxmem: the line whose branch asked for the value."""
    while frame is not None and frame.f_code.co_filename.startswith(_NOT_USERS):
        frame = frame.f_back
    return frame


def _passing_value(frame: FrameType | None) -> bool | None:
    """The truth value the branch at ``frame``'s line needs for the step to go on, where that branch is a
    check (Note [A check that raises]); None for any other branch."""
    if frame is None:
        return None
    try:
        lines, first = inspect.getsourcelines(frame.f_code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    line = frame.f_lineno - max(first, 1) + 1  # getsourcelines gives 0 for a module's own code
    checks = [n for n in ast.walk(tree) if isinstance(n, (ast.If, ast.Assert)) and n.test.lineno <= line <= (n.test.end_lineno or n.test.lineno)]
    if not checks:
        return None
    check = max(checks, key=lambda n: n.test.lineno)
    if isinstance(check, ast.Assert):
        return _uniform(check.test, True)
    raises_only = all(isinstance(s, ast.Raise) for s in check.body) and not check.orelse
    return _uniform(check.test, False) if raises_only else None


def _uniform(test: ast.expr, needed: bool) -> bool | None:
    """``needed`` for every operand of ``test`` reached through ``and``/``or``, flipped under ``not``;
    None where two operands need different values (which operand asked is then unknown)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _uniform(test.operand, not needed)
    if isinstance(test, ast.BoolOp):
        values = {_uniform(v, needed) for v in test.values}
        return values.pop() if len(values) == 1 else None
    return needed
