"""Trace the model into an fx graph, with ``torch.fx.symbolic_trace``'s tracer or torch.export.

Standard ``torch.nn`` modules stay leaves (one node each), as fx does by default; ``leaf_types``
adds more. A model fx cannot trace gets a TraceError that names the module being traced when it
failed and the user's source line; with ``frontend="auto"`` it is exported instead (exporting.py).
"""

from __future__ import annotations

import bisect
import dis
import inspect
import operator
import sys
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxmem.errors import InputSpecError, TraceError
from fxmem.frontends.checkpointing import attach_regions, recording_checkpoints
from fxmem.frontends.dynamo_view import dynamo_view
from fxmem.frontends.exporting import export_model, export_reason
from fxmem.frontends.huggingface import prepared_for_training
from fxmem.frontends.python_scopes import LocalsRecorder
from fxmem.frontends.random_structure import RandomStructure, watching_random_decisions
from fxmem.frontends.trace_causes import data_dependent_error, fixes_the_batch, fx_assert_error, missing_argument_error, plain_cause, source_line
from fxmem.inputs import InputSpec
from fxmem.rules.nf4_ops import quantized_linears_as_ops

__all__ = ["FRONTENDS", "WHOLE_MODEL", "Traced", "trace_model"]

FRONTENDS = ("auto", "fx", "export")


WHOLE_MODEL = "whole model"
"""The frontend of a model run whole, as one operation, at each batch (Note [A model that fixes its batch in Python])."""


# Note [A model that fixes its batch in Python]
#     Some models compute a size from the batch in Python or numpy, outside torch: a SpecAugment mask
#     (transformers' ``_compute_mask_indices((batch_size, sequence_length), ...)`` in wav2vec2, HuBERT,
#     WavLM) is drawn with numpy from ``hidden_states.shape[0]``. torch.fx cannot trace the numpy call on
#     a proxy, and torch.export specializes the batch to the example's size ("Constraints violated
#     (batch)"), so there is no graph for every B. The model can still run: fxmem then runs it whole, as
#     one operation (the graph a bare leaf model gets), on fake tensors at each concrete batch, where
#     the numpy code sees an integer. Saved bytes and the step's peak are exact at those batches (the
#     passes at several B that fix the line); the layer table has the model as one row. The report says
#     so (frontend "whole model"). Other export failures are not taken this way: they are errors.


@dataclass(frozen=True)
class Traced:
    """The graph to run, and which frontend made it (the report says so): "fx", "export", or ``WHOLE_MODEL``."""

    gm: fx.GraphModule
    frontend: str
    asks_compiling: bool = False
    """Whether the model's code asked ``torch.compiler.is_compiling()`` (or ``is_exporting()``) while it was
    traced: its compiled step is then traced again as Dynamo sees the code (Note [The code Dynamo runs]
    in dynamo_view.py)."""


# Note [Unpacking a tensor]
#     ``a, b, c = t`` on a tensor calls ``Tensor.__iter__``, which is ``iter(t.unbind(0))``
#     (torch/_tensor.py): three views, and in backward one ``stack`` of their gradients. fx's Proxy
#     cannot know whether it stands for a tensor or a tuple, and unpacks any value into getitem nodes:
#     on a tensor, three ``select``s, whose backward makes three zero-filled gradients of t's size and
#     adds them up. The bytes saved are the same, but a backward peak held up to twice t's size more:
#     an attention block that unpacked its (3, B, H, S, D) projections was 10% high at B=4 (measured
#     against a real CPU step, tests/test_tracing.py). fxmem's proxies unpack through ``unpacked``,
#     which at run time unbinds a tensor as eager does and passes any other value through.


def unpacked(value: Any) -> Any:
    """What ``a, b, ... = value`` binds to: a tensor's ``unbind(0)``, as ``Tensor.__iter__`` gives;
    any other value (a module's tuple of outputs) as it is. See Note [Unpacking a tensor]."""
    return value.unbind(0) if isinstance(value, torch.Tensor) else value


def _unpack_count(frame: Any) -> int | None:
    """How many names the instruction running in ``frame`` unpacks into, if it is UNPACK_SEQUENCE (the
    test fx's own Proxy.__iter__ makes)."""
    instructions = list(dis.get_instructions(frame.f_code))
    if sys.version_info >= (3, 11):  # f_lasti is a byte offset, and instructions have inline caches
        at = bisect.bisect_left(instructions, frame.f_lasti, key=lambda i: i.offset)
    else:
        at = frame.f_lasti // 2
    if at < len(instructions) and instructions[at].opname == "UNPACK_SEQUENCE":
        return int(instructions[at].argval)
    return None


class _UnpackingProxy(fx.Proxy):
    """A Proxy that unpacks as eager does: Note [Unpacking a tensor]."""

    def __iter__(self) -> Iterator[fx.Proxy]:
        frame = inspect.currentframe()
        count = _unpack_count(frame.f_back) if frame is not None and frame.f_back is not None else None
        if count is None:
            return super().__iter__()
        whole = self.tracer.create_proxy("call_function", unpacked, (self,), {})
        return iter([self.tracer.create_proxy("call_function", operator.getitem, (whole, i), {}) for i in range(count)])


class _Tracer(fx.Tracer):
    """An fx Tracer that remembers which module it was inside when tracing failed."""

    def __init__(self, leaf_types: Sequence[type]) -> None:
        super().__init__()
        self.record_stack_traces = False  # the tracer writes them: Note [The user's frames of a node]
        self.leaf_types = tuple(leaf_types)
        self.inside: list[str] = []
        self.scopes = LocalsRecorder()

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.stack_trace = _user_frames(sys._getframe(1))
        self.scopes.observe(node)  # See Note [Python locals keep values alive]
        return node

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _UnpackingProxy(node, self)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, self.leaf_types) or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        self.inside.append(self.path_of_module(m))
        out = super().call_module(m, forward, args, kwargs)
        self.inside.pop()
        return out


# Note [The user's frames of a node]
#     An error names the line of the user's code that made the failing node (``_source_line`` in
#     fxmem/engine/capture.py). fx's own ``record_stack_traces`` formats the whole Python stack of
#     every node it creates, which was most of the time of tracing a deep model (gpt-7b traced in
#     0.30 s with it, 0.12 s without, benchmarks/scale.py); the tracer writes the same lines itself, in the same format, for the
#     frames the model's code runs in (those inside ``Tracer.trace``, as fx keeps) outside torch and
#     fxmem, read straight off the frame objects.

_SKIPPED = (f"{torch.__path__[0]}/", f"{__file__.rpartition('/frontends/')[0]}/")
"""Where torch's and fxmem's own frames live."""
_TRACE = inspect.unwrap(fx.Tracer.trace).__code__
"""The frame the model's code runs inside: the frames beyond it are the caller's, not the model's."""


def _user_frames(frame: Any) -> str:
    """The model's frames outside torch and fxmem that lead to ``frame``, outermost first, as a traceback writes them."""
    lines: list[str] = []
    while frame is not None and frame.f_code is not _TRACE:
        path = frame.f_code.co_filename
        if not path.startswith(_SKIPPED):
            lines.append(f'  File "{path}", line {frame.f_lineno}, in {frame.f_code.co_name}\n')
        frame = frame.f_back
    return "".join(reversed(lines))


def trace_model(
    model: nn.Module,
    specs: Sequence[InputSpec] = (),
    *,
    name: str = "model",
    leaf_types: Sequence[type] = (),
    frontend: str = "auto",
    compiling: bool = False,
) -> Traced:
    """Trace ``model`` (usually on the meta device): fx first, torch.export when fx fails and ``frontend="auto"``;
    ``compiling``: the model's code is traced as ``torch.compile`` runs it (Note [The code Dynamo runs] in dynamo_view.py)."""
    if frontend not in FRONTENDS:
        raise InputSpecError(f"unknown frontend '{frontend}'; use one of: {', '.join(FRONTENDS)}.")
    with prepared_for_training(model), dynamo_view(compiling) as asked:  # See Note [A Hugging Face model passed as an object]
        traced = _trace(model, specs, name, leaf_types, frontend)
    return replace(traced, asks_compiling=asked.asked)


def _trace(model: nn.Module, specs: Sequence[InputSpec], name: str, leaf_types: Sequence[type], frontend: str) -> Traced:
    if frontend == "export":
        return _exported(model, specs, name)
    try:
        return Traced(_fx_trace(model, name, leaf_types), "fx")
    except RandomStructure:
        raise  # the same draw would stop torch.export: Note [Random structure]
    except TraceError as fx_error:
        missing = missing_argument_error(model, specs, name, fx_error) if specs else None
        if missing is not None:  # torch.export would fail on it too
            raise missing from fx_error
        if frontend == "fx" or not specs:
            raise
        try:
            return Traced(export_model(model, specs, name=name), "export")
        except RandomStructure:
            raise
        except TraceError as export_error:
            plain = plain_cause(export_error, model, specs, name) or data_dependent_error(export_error, name, model)
            if plain is not None:
                raise plain from export_error
            if fixes_the_batch(export_error):  # Note [A model that fixes its batch in Python]
                return Traced(_single_node_graph(model), WHOLE_MODEL)
            reason = export_reason(export_error)
            raise TraceError(f"{fx_error} torch.export cannot trace it either ({reason}).") from export_error


def _exported(model: nn.Module, specs: Sequence[InputSpec], name: str) -> Traced:
    """torch.export's graph; a failure whose plain cause is known leads with it (trace_causes.py)."""
    try:
        return Traced(export_model(model, specs, name=name), "export")
    except RandomStructure:
        raise
    except TraceError as e:
        plain = plain_cause(e, model, specs, name) or data_dependent_error(e, name, model)
        if plain is None:
            raise
        raise plain from e


def _fx_trace(model: nn.Module, name: str, leaf_types: Sequence[type]) -> fx.GraphModule:
    tracer = _Tracer(leaf_types)
    if tracer.is_leaf_module(model, ""):
        return _single_node_graph(model)
    try:
        with recording_checkpoints(tracer) as regions, watching_random_decisions(), quantized_linears_as_ops(model):  # Notes [Checkpointed regions], [Random structure], [torchao's NF4 linear in a graph]
            graph = tracer.trace(model)
    except RandomStructure as e:
        raise e.for_model(name, model) from None
    except Exception as e:
        raise _trace_error(name, model, tracer, e) from e
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    attach_regions(gm, regions)
    return gm


def _single_node_graph(model: nn.Module) -> fx.GraphModule:
    """A model that is itself a leaf (a bare nn.LSTM): one call_module node, placeholders from forward()."""
    name = type(model).__name__.lower()
    graph = fx.Graph()
    args = []
    for param in inspect.signature(model.forward).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        default = param.default if param.default is not param.empty else inspect.Signature.empty
        args.append(graph.placeholder(param.name, default_value=default))
    graph.output(graph.call_module(name, tuple(args)))
    root = nn.Module()
    root.add_module(name, model)
    return fx.GraphModule(root, graph, type(model).__name__)


def _trace_error(name: str, model: nn.Module, tracer: _Tracer, e: Exception) -> TraceError:
    module = tracer.inside[-1] if tracer.inside and tracer.inside[-1] else "(top level)"
    kind = type(model.get_submodule(module)).__name__ if module != "(top level)" else type(model).__name__
    assertion = fx_assert_error(source_line(e), name, module, kind)
    if assertion is not None:
        return assertion
    line = _user_line(e)
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    way_out = (
        f"if it branches on a shape, keep the module opaque with --leaf {kind} (leaf_types=({kind},) in the API); "
        "if it branches on tensor values, rewrite the branch (torch.where)"
        if module != "(top level)"
        else "move the branch into a submodule and keep that opaque with --leaf, or rewrite it (torch.where)"
    )
    return TraceError(
        f"model '{name}': torch.fx cannot trace module '{module}' ({kind}){line}: {reason.rstrip('.')}. fx runs "
        f"forward() on placeholders, so Python control flow on tensors fails; {way_out}."
    )


def _user_line(e: BaseException) -> str:
    """The innermost traceback frame outside torch, as ' at file:line (code)'."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/torch/" not in f.filename and "/fxmem/" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno} ({(f.line or '').strip()})"
