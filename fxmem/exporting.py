"""Stage 2, second frontend: ``torch.export`` for models ``torch.fx.symbolic_trace`` cannot trace.

Hugging Face transformers, models with Python control flow on shapes, models that build masks from
``x.shape``: torch.export (non-strict) runs their Python for real on fake inputs, with a ``Dim`` for
the batch, and returns an ATen-level fx graph whose nodes carry ``nn_module_stack``, so the report
groups them by the same module paths as ``print(model)`` shows. The graph then goes through the same
capture stage as an fx-traced one.

Note [Cleaning an exported graph for re-execution]
    The model is exported on the meta device, so device arguments in the graph say ``meta``; they
    become ``cpu``, the device the capture stage fakes. ``_assert_tensor_metadata`` checks and the
    ``_guards_fn`` submodule re-check the export-time example inputs; they are dropped, since capture
    feeds its own symbolic or concrete batch.
"""

from __future__ import annotations

import contextlib
import inspect
import io
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import map_aggregate

from fxmem.errors import TraceError
from fxmem.inputs import InputSpec

__all__ = ["export_model", "export_reason"]

_EXAMPLE_BATCH = 4
"""Export-time batch size: any value above 1 (ShapeEnv treats 0 and 1 as special)."""
_EXAMPLE_SEQ = 16
"""Export-time length of a symbolic sequence axis S (unlike the batch's, so no equality is assumed)."""


def export_model(model: nn.Module, specs: Sequence[InputSpec], *, name: str = "model") -> fx.GraphModule:
    """Export ``model`` with the batch axis of every input as one dynamic ``Dim``; clean the graph."""
    device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
    args = tuple(_example(s, device) for s in specs if s.name is None)
    kwargs = {s.name: _example(s, device) for s in specs if s.name is not None}
    dims = {"B": torch.export.Dim("batch"), "S": torch.export.Dim("seq")}
    try:
        dynamic = _dynamic_shapes(model, specs, dims)
        with _muted():  # export prints graph dumps on some failures; fxmem never prints from the library
            program = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False)
    except Exception as e:
        raise _export_error(name, model, e) from e
    gm = program.module()
    _clean(gm)
    return gm


@contextlib.contextmanager
def _muted() -> Iterator[None]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _example(spec: InputSpec, device: torch.device) -> torch.Tensor:
    return torch.zeros(spec.shape_at(_EXAMPLE_BATCH, _EXAMPLE_SEQ), dtype=spec.dtype, device=device)


def _dynamic_shapes(model: nn.Module, specs: Sequence[InputSpec], dims: dict[str, Any]) -> dict[str, Any]:
    """{forward() parameter: {axis: Dim}} for the B and S axes; inputs caught by ``**kwargs`` nest under its name."""
    params = inspect.signature(model.forward).parameters
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_kw = next((p.name for p in params.values() if p.kind == p.VAR_KEYWORD), None)
    out: dict[str, Any] = {}
    for i, spec in enumerate(s for s in specs if s.name is None):
        out[positional[i].name] = _axes(spec, dims)
    for spec in (s for s in specs if s.name is not None):
        axes = _axes(spec, dims)
        if spec.name in params or var_kw is None:
            out[spec.name] = axes  # type: ignore[index]
        else:
            out.setdefault(var_kw, {})[spec.name] = axes
    return out


def _axes(spec: InputSpec, dims: dict[str, Any]) -> dict[int, Any]:
    return {i: dims[d] for i, d in enumerate(spec.dims) if isinstance(d, str)}


def _clean(gm: fx.GraphModule) -> None:
    """See Note [Cleaning an exported graph for re-execution]."""
    meta, cpu = torch.device("meta"), torch.device("cpu")
    to_cpu = lambda a: cpu if isinstance(a, torch.device) and a == meta else a
    for n in list(gm.graph.nodes):
        if (n.op == "call_module" and str(n.target).startswith("_guards")) or n.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(n)
            continue
        n.args, n.kwargs = map_aggregate(n.args, to_cpu), map_aggregate(n.kwargs, to_cpu)
    gm.graph.lint()
    gm.recompile()


def _export_error(name: str, model: nn.Module, e: Exception) -> TraceError:
    return TraceError(
        f"model '{name}' ({type(model).__name__}): torch.export cannot trace it: {export_reason(e)}. If the model "
        "fixes the batch size (a guard on x.shape[0]), it cannot be analyzed for every B; otherwise make the "
        "failing code traceable (torch.where instead of a branch on values)."
    )


def export_reason(e: BaseException) -> str:
    """torch.export's own reason, shortened to its first sentence (its messages append graph dumps)."""
    cause = e.__cause__ if isinstance(e, TraceError) and e.__cause__ is not None else e
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    first = next((line for line in lines if not line.startswith(("def ", "#", "File"))), type(cause).__name__)
    return f"{type(cause).__name__}: {first[:240].rstrip('.')}"
