"""The second frontend: ``torch.export`` for models ``torch.fx.symbolic_trace`` cannot trace.

Hugging Face transformers, models with Python control flow on shapes, models that build masks from
``x.shape``: torch.export (non-strict) runs their Python for real on fake inputs, with a ``Dim`` for
the batch, and returns an ATen-level fx graph whose nodes carry ``nn_module_stack``, so the report
groups them by the same module paths as ``print(model)`` shows. The graph then goes through the same
capture stage as an fx-traced one.

Note [Cleaning an exported graph for re-execution]
    A model on the meta device that is not exported on the CPU's kernels (Note [Exporting a meta
    model on the CPU's kernels]) leaves device arguments in the graph that say ``meta``; they become
    ``cpu``, the device the capture stage fakes. ``_assert_tensor_metadata`` checks and the
    ``_guards_fn`` submodule re-check the export-time example inputs; they are dropped, since capture
    feeds its own symbolic or concrete batch. So are the runtime asserts on data-dependent sizes
    (``_assert_scalar`` of ``u0 >= 16``): export derives them from the example batch's range (B >= 2),
    and each pass tells its own ShapeEnv the routed counts again (Note [Routed sizes] in
    fxmem/rules/routing.py), where B=1 gives ``u0 == 8``.

Note [Exporting a meta model on the CPU's kernels]
    What a graph records depends on the strides its ops return at export time, and those depend on
    the device: SDPA on the meta device reports the math kernel's (B, H, S, D) layout, on the CPU the
    flash kernel's (B, S, H, D) one, so ``out.transpose(1, 2).contiguous()`` records a ``contiguous``
    node on meta and none on the CPU (where it is a no-op). The capture stage fakes the CPU, and
    measure exports the real CPU model, so a meta model is exported as if it were on the CPU: its
    parameters and buffers are faked as CPU tensors (``torch.export._trace._fakify_params_buffers``,
    private, wrapped only during the export and only if it exists), with CPU example inputs. No
    memory is allocated; the exported program still holds the meta parameters.

Note [Outputs behind a cast that was a no-op when exported]
    The graph is exported in the model's own dtype, where ``logits.float()`` on float32 logits
    returns the tensor itself; export still records an ``aten.to`` node, and because it returned the
    same tensor, every later use of the logits, the graph's output included, now reads that node.
    Under autocast the cast is real, and which of the two the user's code returned matters: the caller
    holds it for the whole step. Hugging Face models (transformers 5) return the logits as the head
    made them and cast only inside their loss function, so an output that reads such a node is given
    back its source. Measured on an H200 (GPT-2 under bf16 autocast, shared/gpu/steps_h200.json): what
    is alive after the loss holds the bf16 logits, 5,120,000 B at B=4, not their fp32 copy. A model
    that returns ``logits.float()`` itself holds 2 bytes per element more than fxmem then counts.

Note [Exporting the eager step's code paths]
    The measured truth is the model's eager forward, and some libraries take other code paths when
    they detect tracing (see Note [Eager code paths under torch.export] in hf_paths.py for Hugging Face
    transformers). The export runs inside ``eager_code_paths``, which makes the data-independent ones
    decide as in eager. Should that export fail (an eager decision that guards on a symbolic length:
    a sliding window shorter than some S), it is exported again on the traced code paths, and should
    that fail too, once more as before any of this: on the model's own device. The error reported is
    the last attempt's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import map_aggregate
from torch.utils._pytree import tree_map

from fxmem.errors import TraceError
from fxmem.frontends.autograd_functions import functions_kept_whole
from fxmem.frontends.dynamo_view import viewing_compiled
from fxmem.frontends.checkpointing import attach_exported_regions, tagging_checkpoints
from fxmem.frontends.exported_reads import reading_as_eager
from fxmem.frontends.hf_paths import eager_code_paths, forward_input_names, has_eager_code_paths
from fxmem.frontends.huggingface import prepared_for_training
from fxmem.frontends.kv_cache import cache_cats_as_ops, without_caches
from fxmem.frontends.python_scopes import ExportLocals, name_exported_holds
from fxmem.frontends.random_structure import RandomStructure, watching_random_decisions
from fxmem.inputs import Constant, InputSpec
from fxmem.rules.nf4_ops import quantized_linears_as_ops
from fxmem.rules.routing import RoutedSizes

__all__ = ["export_model", "export_reason"]

_EXAMPLE_BATCH = 4
"""Export-time batch size: any value above 1 (ShapeEnv treats 0 and 1 as special)."""
_EXAMPLE_SEQ = 16
"""Export-time length of a symbolic sequence axis S (unlike the batch's, so no equality is assumed)."""


def export_model(model: nn.Module, specs: Sequence[InputSpec], *, name: str = "model") -> fx.GraphModule:
    """Export ``model`` with the batch axis of every input as one dynamic ``Dim``; clean the graph."""
    # Any meta tensor makes the model a meta one: transformers' wav2vec2 builds ``masked_spec_embed`` with the
    # legacy ``torch.Tensor(n)``, which ignores the meta device the rest of the model is built on.
    tensors = [*model.parameters(), *model.buffers()]
    device = torch.device("meta") if any(t.is_meta for t in tensors) else next((t.device for t in tensors), torch.device("cpu"))
    dims = {"B": torch.export.Dim("batch"), "S": torch.export.Dim("seq")}
    try:
        with _muted():  # export prints graph dumps on some failures; fxmem never prints from the library
            try:
                exported = _export_first_that_works(model, specs, _dynamic_shapes(model, specs, dims), device)
            except Exception as e:
                bounded = _suggested_dims(str(e), dims)
                if bounded is None or _BATCH_FIXED in str(e):
                    raise
                exported = _export_first_that_works(model, specs, _dynamic_shapes(model, specs, bounded), device)
    except Exception as e:
        random_draw = next((c for c in _causes(e) if isinstance(c, RandomStructure)), None)
        if random_draw is not None:
            raise random_draw.for_model(name, model) from None
        raise _export_error(name, model, e) from e
    program, checkpoints = exported
    gm = program.module()
    _clean(gm)
    name_exported_holds(gm.graph)  # Note [Python locals on an exported graph] in python_scopes.py
    lost = attach_exported_regions(gm, checkpoints)  # See Note [Checkpointed regions]
    if lost:
        raise TraceError(
            f"model '{name}' calls torch.utils.checkpoint in a way fxmem cannot rebuild from torch.export's graph "
            f"({lost} call{'s' if lost > 1 else ''}: with use_reentrant=True, or nested in another checkpoint); "
            "counting it as if nothing were recomputed would overstate what the step keeps. Use one level of "
            "use_reentrant=False checkpoints (what PyTorch recommends), make the model traceable by torch.fx "
            "(--frontend fx says why it is not), or turn checkpointing off for the analysis to see the figures without it."
        )
    return gm


_BATCH_FIXED = "Constraints violated (batch)"
"""torch.export's words for a batch the model's code fixed (Note [A model that fixes its batch in Python] in tracing.py)."""

_SUGGESTION = re.compile(r"(\w+) = Dim\('(\w+)'((?:, (?:min|max)=\d+)*)\)")


def _suggested_dims(message: str, dims: dict[str, Any]) -> dict[str, Any] | None:
    """The dims with the bounds torch.export suggests ("Suggested fixes: seq = Dim('seq', max=64)"), or None.

    A model can constrain an axis (BERT's sequence by its position embeddings, T5's by shifting its
    labels): export then rejects an unbounded ``Dim`` and says which bounds it needs. Only bounds
    are taken; a suggestion to make an axis a constant is not (the axis must stay symbolic), nor one
    that leaves out the export-time example size.
    """
    found = {m.group(2): dict(re.findall(r"(min|max)=(\d+)", m.group(3))) for m in _SUGGESTION.finditer(message)}
    if not found:
        return None
    examples = {"batch": _EXAMPLE_BATCH, "seq": _EXAMPLE_SEQ}
    bounded = dict(dims)
    for key, dim in dims.items():
        bounds = {k: int(v) for k, v in found.get(dim.__name__, {}).items()}
        if not bounds:
            continue
        if not bounds.get("min", 0) <= examples.get(dim.__name__, 0) <= bounds.get("max", 10**18):
            return None
        bounded[key] = torch.export.Dim(dim.__name__, **bounds)
    return bounded


def _export_first_that_works(model: nn.Module, specs: Sequence[InputSpec], dynamic: dict[str, Any], device: torch.device) -> Any:
    """See Note [Exporting the eager step's code paths]: the most faithful export that succeeds; the last one's error."""
    on_cpu, eager_paths = device.type == "meta", has_eager_code_paths() and not viewing_compiled()
    attempts = list(dict.fromkeys([(on_cpu, eager_paths), (on_cpu, False), (False, False)]))  # distinct ones, in order
    first: Exception | None = None
    for cpu, eager in attempts[:-1]:
        try:
            return _export(model, specs, dynamic, device, on_cpu=cpu, eager_paths=eager)
        except Exception as e:  # any failure: the next, less faithful attempt
            first = first or e
    cpu, eager = attempts[-1]
    try:
        return _export(model, specs, dynamic, device, on_cpu=cpu, eager_paths=eager)
    except Exception as last:
        # A batch fixed by the model's code is the model's own cause; a later attempt's failure on the
        # meta device would hide it (Note [A model that fixes its batch in Python] in tracing.py).
        if first is not None and _BATCH_FIXED in str(first):
            raise first from None
        raise last from None


def _export(
    model: nn.Module, specs: Sequence[InputSpec], dynamic: dict[str, Any], device: torch.device, *, on_cpu: bool, eager_paths: bool
) -> Any:
    """One non-strict export (a meta model faked ``on_cpu``, transformers on its ``eager_paths``), and
    the checkpoint calls it traced through (Note [Checkpointed regions])."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(prepared_for_training(model))  # See Note [A Hugging Face model passed as an object]
        if on_cpu:
            device = stack.enter_context(_meta_faked_on_cpu(device))
        if eager_paths:
            stack.enter_context(eager_code_paths(forward_input_names(model, specs)))
        stack.enter_context(_symbolic_len(model))
        stack.enter_context(quantized_linears_as_ops(model))  # Notes [bitsandbytes' 4-bit matmul in a graph], [torchao's NF4 linear in a graph] in fxmem/rules/nf4_ops.py
        stack.enter_context(functions_kept_whole())  # Note [A custom autograd.Function in an exported graph]
        stack.enter_context(_watched_forward(model))
        args = tuple(_example(s, device) for s in specs if s.name is None)
        kwargs = {s.name: _example(s, device) for s in specs if s.name is not None}
        with tagging_checkpoints() as checkpoints:
            return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic, strict=False), checkpoints


# Note [len() of a batch-sized tensor]
#     Python's len() must return an int (the sq_length / mp_length slot), so ``len(t)`` on a tensor
#     whose first axis is the batch B guards B to the example's size: torch.export then reports the
#     dynamic batch "specialized to a constant". transformers' CLIP loss does exactly this:
#     ``cross_entropy(logits, torch.arange(len(logits)))`` (models/clip/modeling_clip.py,
#     ``contrastive_loss``). While exporting, a module that defines one of the model's classes and has
#     no ``len`` of its own sees one that returns a tensor's first size as it is, a SymInt, which
#     torch.arange and every other tensor factory take; where the caller needs a Python int
#     (``range(len(t))``) the SymInt guards as len() did, so nothing traces that did not before.


@contextlib.contextmanager
def _watched_forward(model: nn.Module) -> Iterator[None]:
    """While exporting, the model's forward runs under three function modes: ``ExportLocals`` records the
    Python locals that keep traced values alive (Note [Python locals on an exported graph] in
    python_scopes.py), ``RoutedSizes`` tells the ShapeEnv the counts of mixture-of-experts routing (Note
    [Routed sizes] in fxmem/rules/routing.py), and random decisions are refused (Note [Random structure]
    in random_structure.py).

    Inside forward, not around ``torch.export.export``: export's own function modes, pushed after any
    mode entered outside, take the user's calls first and never hand them down. The locals are read from
    this wrapper's frame on: the frames above it are export's and the caller's, which eager does not have."""
    forward = model.forward

    @functools.wraps(forward)
    def watched(*args: Any, **kwargs: Any) -> Any:
        recorder = ExportLocals(sys._getframe())
        with reading_as_eager(), recorder, RoutedSizes(record=False), watching_random_decisions(), cache_cats_as_ops():  # Notes [.data while exporting], [A check that raises], [The cache a training forward builds]
            out = forward(*args, **kwargs)
        recorder.close()
        return without_caches(out)  # Note [The cache a training forward builds]

    with mock.patch.object(model, "forward", watched):  # an instance attribute for the export, whatever was there before
        yield


def _len(value: Any) -> Any:
    """len() that keeps a tensor's first size symbolic. See Note [len() of a batch-sized tensor]."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value.shape[0]
    return len(value)


@contextlib.contextmanager
def _symbolic_len(model: nn.Module) -> Iterator[None]:
    """See Note [len() of a batch-sized tensor]."""
    names = {type(m).__module__ for m in model.modules()}
    modules = [m for m in (sys.modules.get(n) for n in names) if m is not None and "len" not in vars(m)]
    for module in modules:
        module.len = _len  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in modules:
            del module.len


@contextlib.contextmanager
def _meta_faked_on_cpu(device: torch.device) -> Iterator[torch.device]:
    """See Note [Exporting a meta model on the CPU's kernels]; yields the device for the example inputs."""
    trace = _export_trace_module()
    fakify = getattr(trace, "_fakify_params_buffers", None)
    if device.type != "meta" or not callable(fakify):
        yield device
        return

    def fakify_on_cpu(fake_mode: Any, mod: nn.Module) -> dict[str, torch.Tensor]:
        fakes = fakify(fake_mode, mod)
        moved: dict[int, torch.Tensor] = {}
        for t in fakes.values():
            if t.device.type == "meta" and id(t) not in moved:
                moved[id(t)] = _fake_on_cpu(fake_mode, t)
        return {key: moved.get(id(t), t) for key, t in fakes.items()}

    trace._fakify_params_buffers = fakify_on_cpu
    try:
        yield torch.device("cpu")
    finally:
        trace._fakify_params_buffers = fakify


def _export_trace_module() -> Any:
    try:
        import torch.export._trace as trace
    except ImportError:
        return None
    return trace


def _fake_on_cpu(fake_mode: Any, t: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor with ``t``'s shape, strides, dtype and parameter-ness (tied ones stay one object)."""
    with fake_mode:
        cpu = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    cpu.requires_grad_(t.requires_grad)
    if isinstance(t, nn.Parameter):
        cpu._is_param = True  # what FakeTensorMode.from_tensor marks a parameter with
    return cpu


@contextlib.contextmanager
def _muted() -> Iterator[None]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _example(spec: InputSpec, device: torch.device) -> Any:
    if isinstance(spec, Constant):
        return spec.value
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


def _axes(spec: InputSpec, dims: dict[str, Any]) -> Any:
    """The symbolic axes of one input; for a constant, which torch.export specializes on, None at each
    of its leaves (torch.export wants the input's own structure)."""
    if isinstance(spec, Constant):
        return tree_map(lambda _: None, spec.value)
    return {i: dims[d] for i, d in enumerate(spec.dims) if isinstance(d, str)}


def _clean(gm: fx.GraphModule) -> None:
    """See Note [Cleaning an exported graph for re-execution]."""
    meta, cpu = torch.device("meta"), torch.device("cpu")
    to_cpu = lambda a: cpu if isinstance(a, torch.device) and a == meta else a
    for n in list(gm.graph.nodes):
        if (n.op == "call_module" and str(n.target).startswith("_guards")) or n.target is torch.ops.aten._assert_tensor_metadata.default or _unbacked_assert(n):
            gm.graph.erase_node(n)
            continue
        n.args, n.kwargs = map_aggregate(n.args, to_cpu), map_aggregate(n.kwargs, to_cpu)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = map_aggregate(output.args, _before_noop_cast)
    gm.graph.lint()
    gm.recompile()


def _unbacked_assert(n: fx.Node) -> bool:
    """A runtime assert on a data-dependent size (``u0 >= 16``); see Note [Cleaning an exported graph for re-execution]."""
    return n.target is torch.ops.aten._assert_scalar.default and bool(re.search(r"\bu\d+\b", str(n.args[1:])))


_CASTS = (torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout)


def _before_noop_cast(a: Any) -> Any:
    """The source of an output that reads a dtype cast which changed nothing at export time.
    See Note [Outputs behind a cast that was a no-op when exported]."""
    if not (isinstance(a, fx.Node) and a.target in _CASTS and a.args and isinstance(a.args[0], fx.Node)):
        return a
    before, after = a.args[0].meta.get("val"), a.meta.get("val")
    same = isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.dtype == after.dtype
    return a.args[0] if same and not a.kwargs.get("copy", False) else a


def _causes(e: BaseException) -> Iterator[BaseException]:
    """``e`` and what caused it, outermost first."""
    seen: list[BaseException] = []
    while e is not None and all(e is not c for c in seen):
        seen.append(e)
        yield e
        e = e.__cause__ or e.__context__  # type: ignore[assignment]


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
