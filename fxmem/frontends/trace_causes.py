"""Plain causes behind a failed trace, put first in its message.

torch.fx reports any Python ``if`` or ``assert`` on a placeholder as "symbolically traced variables
cannot be used as inputs to control flow", and torch.export a forward() argument nobody passed as
"missing a required argument". Two causes a user can fix at once hide behind those words: a
forward() argument the inputs do not give (``forward(self, x, mode)`` given only ``x``), and the
model's own ``assert`` (``assert x.shape[1] == 3, "expects RGB"``). ``plain_cause`` finds them.
"""

from __future__ import annotations

import ast
import re
import inspect
import sysconfig
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fxmem.errors import TraceError
from fxmem.inputs import InputSpec

__all__ = ["SourceLine", "data_dependent_error", "fixes_the_batch", "fx_assert_error", "missing_argument_error", "plain_cause", "source_line"]


def plain_cause(error: TraceError, model: nn.Module, specs: Sequence[InputSpec], name: str) -> TraceError | None:
    """The failure explained by its plain cause, where one is known: a missing forward() argument, or
    an ``assert`` of the model that the inputs fail; None otherwise."""
    if specs:
        missing = missing_argument_error(model, specs, name, error)
        if missing is not None:
            return missing
    return _failed_assert_error(error, specs, name) or _float_ids_error(error, model, specs, name)


def missing_argument_error(model: nn.Module, specs: Sequence[InputSpec], name: str, error: BaseException) -> TraceError | None:
    """forward()'s first required argument the specs do not give, as a TraceError (where the trace
    stopped at the end); None when they give every one."""
    param = next(iter(_missing_parameters(model, specs)), None)
    if param is None:
        return None
    tensor = param.annotation in (torch.Tensor, "torch.Tensor", "Tensor")
    way = (
        f"pass --input {param.name}=B,... (Python: inputs={{..., '{param.name}': 'B,...'}})"
        if tensor
        else f"pass --arg {param.name}=... (Python: inputs={{..., '{param.name}': ...}})"
    )
    stopped = next((line for line in map(source_line, _chain(error)) if line is not None), None)
    where = f" Without it the trace stopped at {stopped.where} ({stopped.text})." if stopped is not None else ""
    return TraceError(
        f"forward() of model '{name}' ({type(model).__name__}) needs argument '{param.name}', which the inputs do not give: "
        f"{way}.{where}"
    )


def _missing_parameters(model: nn.Module, specs: Sequence[InputSpec]) -> list[inspect.Parameter]:
    """forward()'s parameters without a default that neither a positional nor a keyword spec fills."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return []
    positional = sum(1 for s in specs if s.name is None)
    named = {s.name for s in specs if s.name is not None}
    fillable = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    by_position = [p for p in fillable if p.kind != p.KEYWORD_ONLY][:positional]
    return [p for p in fillable if p.default is p.empty and p not in by_position and p.name not in named]


def fx_assert_error(line: SourceLine | None, name: str, module: str, kind: str) -> TraceError | None:
    """torch.fx failed on an ``assert`` of the model: lead with the user's message and line, then the way
    out (torch.export runs the assert on the inputs' shapes); None when the failing line is no assert."""
    if line is None or not line.text.startswith("assert"):
        return None
    inside = f" in module '{module}' ({kind}), which --leaf {kind} keeps opaque," if module != "(top level)" else ""
    return TraceError(
        f"model '{name}': {line.lead()} at {line.where}: torch.fx cannot evaluate an assert{inside} because it runs "
        f"forward() on placeholders without shapes ({line.text}). Use --frontend export (frontend='export'), or the "
        "default auto, which runs the assert on the inputs' shapes."
    )


def _failed_assert_error(error: TraceError, specs: Sequence[InputSpec], name: str) -> TraceError | None:
    """torch.export ran an ``assert`` of the model and the inputs failed it."""
    failed = _assertion_in(error)
    if failed is None:
        return None
    line = source_line(failed)
    where = f" at {line.where}" if line is not None else ""
    message = str(failed).strip()
    lead = f'its own assert failed: "{message}"' if message else "its own assert failed"
    code = f" ({line.text})" if line is not None else ""
    shapes = ", ".join(str(s) for s in specs) or "none"
    return TraceError(
        f"model '{name}': {lead}{where}{code}, with the inputs {shapes}. Give inputs whose shape passes it (--input, or "
        "inputs= in Python)."
    )


def _float_ids_error(error: TraceError, model: nn.Module, specs: Sequence[InputSpec], name: str) -> TraceError | None:
    """torch.export ran an embedding on floating-point ids (``--input B,16`` without ``:int64``): name the
    embedding and the input's dtype; None for any other failure."""
    embedding = next((m for e in _chain(error) for m in _embeddings_on_stack(e)), None)
    floats = [s for s in specs if s.dims and s.dtype.is_floating_point]
    if embedding is None or not floats:
        return None
    path = next((p for p, m in model.named_modules() if m is embedding), "")
    spec = floats[0]
    keyword = f"{spec.name}=" if spec.name else ""
    return TraceError(
        f"model '{name}': Embedding '{path or '(top level)'}' needs integer ids, but the input '{spec}' is "
        f"{str(spec.dtype).removeprefix('torch.')}; give the input a dtype: --input {keyword}{','.join(map(str, spec.dims))}:int64. "
        "An embedding looks its rows up by index, so the input's dtype, not its shape, is wrong."
    )


def _embeddings_on_stack(e: BaseException) -> list[nn.Module]:
    """The nn.Embedding modules whose forward() is on ``e``'s traceback, innermost first."""
    found: list[nn.Module] = []
    tb = e.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self") if tb.tb_frame.f_code.co_name == "forward" else None
        if isinstance(owner, (nn.Embedding, nn.EmbeddingBag)):
            found.insert(0, owner)
        tb = tb.tb_next
    return found


def _assertion_in(error: BaseException) -> AssertionError | None:
    """The AssertionError that caused ``error``."""
    return next((e for e in _chain(error) if type(e) is AssertionError), None)


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and what caused it, outermost first, following ``raise ... from`` and implicit chaining."""
    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and all(e is not c for c in chain):
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


_NOT_USERS = (f"{torch.__path__[0]}/", f"{sysconfig.get_paths()['stdlib']}/")
"""Where torch's and Python's own frames live: never the user's line."""


@dataclass(frozen=True)
class SourceLine:
    """The innermost traceback frame outside torch and fxmem: where it is (file:line), and its code."""

    where: str
    text: str

    def lead(self) -> str:
        """The assert's own message, quoted, where it has a constant one; else the assert's words."""
        try:
            statement = ast.parse(self.text).body[0]
        except (SyntaxError, IndexError):  # an assert written over several lines: its first line only
            return "the model's assert"
        if isinstance(statement, ast.Assert) and isinstance(statement.msg, ast.Constant):
            return f'the model\'s assert "{statement.msg.value}"'
        return "the model's assert"


def source_line(e: BaseException) -> SourceLine | None:
    """Where ``e`` rose in the user's code: the innermost frame outside torch and fxmem."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(_NOT_USERS) and "/fxmem/" not in f.filename]
    if not frames:
        return None
    f = frames[-1]
    return SourceLine(f"{f.filename}:{f.lineno}", (f.line or "").strip())


def fixes_the_batch(error: BaseException) -> bool:
    """True where torch.export failed because the model fixed the batch to the example's size
    (Note [A model that fixes its batch in Python] in tracing.py)."""
    return any("Constraints violated (batch)" in str(e) for e in _chain(error))  # exporting.py's _BATCH_FIXED


def data_dependent_error(error: BaseException, name: str, model: nn.Module | None = None) -> TraceError | None:
    """A branch on tensor values, told from the user's line; None for other failures.

    torch.export's words ("Could not guard on data-dependent expression Eq(u0, 0)") name a symbol the
    user never wrote; the line that branched, its module, and what to do come first. ``--leaf`` is not
    offered: a leaf module runs on the same fake tensors and meets the same branch.
    """
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    guard = next((e for e in _chain(error) if isinstance(e, GuardOnDataDependentSymNode)), None)
    if guard is None:
        return None
    line = source_line(guard)
    where = f" at {line.where} ({line.text})" if line is not None else ""
    owner = _user_self(guard)
    path = next((p for p, m in model.named_modules() if m is owner), None) if model is not None and owner is not None else None
    module = f" in module '{path or '(top level)'}' ({type(owner).__name__})" if path is not None else ""
    message = str(guard).strip().splitlines()[0]
    counted = "Size-like symbols: u" in str(guard) or re.search(r"Eq\(u\d+, 0\)", message) is not None
    what = "a count that only the data fixes (torch.where, nonzero, a boolean mask)" if counted else "a tensor's value"
    return TraceError(
        f"model '{name}' branches on {what}{where}{module}: the path taken depends on the data, so no trace (torch.fx, "
        "torch.export, or --leaf, which runs the module on the same fake tensors) stands for every input. Rewrite it "
        "without a Python branch (torch.where(cond, a, b) computes both sides; an empty selection usually needs no special "
        "case), add torch._check(...) for what the code assumes of a size, or analyze the model with that path fixed. fxmem "
        "does follow the per-expert counts of top-k routing (one_hot, or == e on torch.topk's indices)."
    )


def _user_self(error: BaseException) -> object:
    """The ``self`` of the innermost frame of the user's code in ``error``'s traceback, or None."""
    owner, tb = None, error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if not frame.f_code.co_filename.startswith(_NOT_USERS) and "/fxmem/" not in frame.f_code.co_filename:
            code = frame.f_code
            owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        tb = tb.tb_next
    return owner
