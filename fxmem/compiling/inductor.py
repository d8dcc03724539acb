"""torch.compile's own pipeline, run on fake tensors: what a compiled step allocates and saves.

``compile_on_fakes`` calls ``torch.compile(gm)`` (default mode) on a traced model with the pass's fake
weights and inputs, Inductor's ``compile_fx`` its backend (Note [Dynamo on the traced graph]). Everything
torch decides runs as it would on a real first call: Dynamo's capture, AOTAutograd's joint graph with Inductor's
decompositions, Inductor's joint-graph passes and its min-cut partitioner (what the forward saves
and what backward recomputes), the post-grad passes, lowering, fusion, scheduling and the wrapper's
buffer reuse. Only the compiled kernels are left out: see Note [Inductor on fake tensors].

Note [Inductor on fake tensors]
    Inductor's CPU output is a Python wrapper (``call(args)``) that allocates every buffer with
    ``empty_strided_cpu``, calls a C++ kernel or an ATen ("extern") kernel per fused group, frees
    buffers with ``del`` and hands dead buffers of the right size to later ones (``buf7 = buf6; del
    buf6  # reuse``; torch/_inductor/codegen/wrapper.py, ``memory_plan_reuse``). The C++ kernels are
    compiled when the wrapper's module is loaded (``async_compile.cpp_pybinding``), which takes g++
    seconds per kernel and needs real data. Here the module is loaded with a stand-in for
    ``AsyncCompile`` whose kernels do nothing, and ``empty_strided_cpu`` and ``reinterpret_tensor``
    (C functions that bypass the dispatcher) are replaced by ``torch.empty_strided`` and
    ``as_strided``, which dispatch, so that fake tensors come out and a dispatch mode sees every
    allocation. ATen kernels the wrapper calls (``extern_kernels.addmm(..., out=buf0)``, fallbacks)
    run on the fake tensors as in eager. The wrapper then runs as written: its allocations, frees and
    reuses are the compiled step's, and what AOTAutograd's ``CompiledFunction`` hands to
    ``ctx.save_for_backward`` is what the partitioner chose. Inductor's caches are off for the compile
    (``fx_graph_cache``, AOTAutograd's ``enable_autograd_cache``), so no stand-in kernel is ever stored
    where a real compile would find it, nor a real compile's artifact taken for a prediction.
    Checked against real compiled CPU steps in tests/test_compiling.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import tempfile
import types
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["CompiledModel", "SavedValue", "compile_on_fakes", "compiling", "inductor_settings", "saved_values"]


@dataclass
class CompiledModel:
    """The model as ``torch.compile`` runs it: call it with the graph's input values."""

    run: Callable[..., Any]
    """``torch.compile(gm)`` with Inductor's stand-in backend, compiled already for these inputs."""
    wrappers: tuple[str, ...]
    """Inductor's wrapper code of each compiled graph, in the order compiled (a forward, its backward; more with graph breaks)."""
    graphs: tuple[fx.GraphModule, ...] = ()
    """The graphs AOTAutograd's partitioner made, as Inductor received them, in the same order."""
    breaks: tuple[str, ...] = ()
    """Why Dynamo broke the graph, once per break (its ``counters["graph_break"]`` reasons): Note [Graph
    breaks of the traced graph]."""

    def __call__(self, *values: Any) -> Any:
        return self.run(*values)


# Note [Dynamo on the traced graph]
#     The partitioner's choices hang on details of the graph it is given: with equal-cost cuts it
#     keeps the first in the graph's order, and Dynamo lifts parameters and inputs as graph inputs in
#     the order the code first reaches them (a ViT's patch embedding: the convolution's weight and
#     bias, then the image). A graph built here with the parameters first saved the ViT test config's
#     first LayerNorm input instead of the embeddings' sum and its statistics, 272 B from a real
#     compiled run; a HF GPT-2's head input was left out likewise. So Dynamo itself captures the graph:
#     ``torch.compile(gm)`` on the traced graph with its fake parameters and fake inputs, called once
#     outside any mode, compiles it as a user's first call does (a module Dynamo leaves to eager, as
#     it leaves ``nn.LSTM``, runs eagerly in the step too: Note [Graph breaks of the traced graph]).
#     The step then calls the compiled graph under the timeline's dispatch modes, which declare
#     ``ignore_compile_internals`` (``SeesCompiledCode``): Dynamo runs the compiled code with them on
#     (torch/utils/_python_dispatch.py), so they see every buffer Inductor's wrapper allocates. The
#     target's function modes (``StepTarget.kernels``) stay off around the compiled call: Dynamo
#     guards on the function-mode stack, and a mode the compile did not see would make it recompile
#     with the mode traced into the graph. The saved-tensor hook runs inside the compiled forward, so
#     it is ``torch._dynamo.disable``d, else Dynamo would compile fxmem's own bookkeeping. Recompiles
#     are static (``automatic_dynamic_shapes`` off: each batch is a first call, as for a job with a
#     fixed batch) and use the stand-in kernels as well. Dynamo's garbage collection after each compile
#     (``run_gc_after_compile``, which frees a compile's leftovers sooner) is off: 0.4 s a compile here,
#     and nothing the step tracks is collected by it (its tensors are freed by reference counts).


def inductor_settings() -> dict[str, object]:
    """Inductor's configuration for a prediction: its defaults, with the caches off (Note [Inductor on
    fake tensors]) and the CPU's vector ISA taken from its flags unbuilt (Note [The vector ISA unbuilt])."""
    return {"fx_graph_cache": False, "fx_graph_remote_cache": False, "autotune_local_cache": False, "cpp.vec_isa_ok": True, "compile_threads": 1}


# Note [The vector ISA unbuilt]
#     Inductor's C++ backend picks the widest vector ISA the CPU's flags list (AVX512, else AVX2; or
#     as ``ATEN_CPU_CAPABILITY`` says), and the ISA sets the loops' tiling, which decides whether a
#     softmax's outer loops fuse with a kernel-local buffer (``codegen_outer_loop_node`` in
#     torch/_inductor/codegen/cpp.py). Before trusting an ISA it builds a probe library with g++ and
#     loads it in a Python subprocess (``VecISA.check_build``): over a second per process, spent on
#     kernels the stand-ins never build. ``cpp.vec_isa_ok`` skips that probe; the pick from the flags
#     is the same wherever the compiler builds for them, as it must for a real compiled step to run.


def compile_on_fakes(gm: fx.GraphModule, values: Sequence[Any], budget: float = 1.0) -> CompiledModel:
    """``torch.compile(gm)`` (default mode) compiled by one call on the pass's fake state and input
    ``values`` (Note [Dynamo on the traced graph]), the partitioner held to ``budget``
    (``activation_memory_budget``). Call outside any mode: a function mode on the stack would be
    traced into the graph, and guarded on."""
    wrappers: list[str] = []
    graphs: list[fx.GraphModule] = []
    backend = functools.partial(_stand_in_inductor, wrappers=wrappers, graphs=graphs, budget=budget)
    compiled = torch.compile(gm, backend=backend)
    before = _breaks()
    with _disable_current_modes(), compiling(), _buffers_in(torch._guards.detect_fake_mode(values)):
        compiled(*values)
    breaks = _breaks() - before
    return CompiledModel(compiled, tuple(wrappers), tuple(graphs), tuple(breaks.elements()))


def _breaks() -> Counter[str]:
    """Dynamo's graph breaks so far, by reason: those it resumed after (``graph_break``) and those that
    made it run a whole frame eagerly (``unimplemented``)."""
    from torch._dynamo.utils import counters

    return Counter(counters["graph_break"]) + Counter(counters["unimplemented"])


# Note [Graph breaks of the traced graph]
#     Dynamo runs on the traced graph, not on the user's code. Where it compiles the whole forward as
#     one graph, the two are the same program and so is the compiled step. Where it breaks the graph
#     (an ``nn.LSTM``, which it leaves to eager; a data-dependent op), what it compiles around the
#     break follows Python frames: in the user's code each module's ``forward`` is a frame Dynamo can
#     compile on its own, while the traced graph is one frame with the library's modules as calls. A
#     fuzzed model with an RNN inside a wrapper module and two RMSNorms in a block after it: the real
#     run compiled the block as one graph and saved 436 B at B=1; the traced graph, skipped as a whole
#     frame at the break, compiled each RMSNorm alone and saved 652 B. So a compiled step with graph
#     breaks is reported as an estimate, with Dynamo's reasons.


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Dynamo's settings for a prediction's compiles and for the compiled step's run (Note [Dynamo on the traced graph])."""
    import torch._dynamo

    settings: dict[str, object] = {"automatic_dynamic_shapes": False, "recompile_limit": 1024, "accumulated_recompile_limit": 1 << 16}
    if hasattr(torch._dynamo.config, "run_gc_after_compile"):
        settings["run_gc_after_compile"] = False
    with torch._dynamo.config.patch(settings):
        yield


def _stand_in_inductor(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, wrappers: list[str], graphs: list[fx.GraphModule], budget: float = 1.0
) -> Any:
    """Inductor as torch.compile's default backend, with the stand-in kernels (Note [Inductor on fake tensors])."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(graph: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        graphs.append(graph)
        return compile_fx_inner(graph, *args, **kwargs)

    # backward now, under the stand-ins; and no AOTAutograd cache, which could hand back a real compile's artifact
    lowering = functorch_config.patch(force_non_lazy_backward_lowering=True, enable_autograd_cache=False, activation_memory_budget=budget)
    with config.patch(inductor_settings()), lowering, _stand_in_kernels(wrappers):
        return compile_fx(gm, example_inputs, inner_compile=inner)


class _NoKernels:
    """``AsyncCompile`` whose kernels do nothing (Note [Inductor on fake tensors])."""

    def __init__(self, *_: object, **__: object) -> None:
        pass

    def wait(self, scope: object) -> None:
        pass

    def __getattr__(self, name: str) -> Callable[..., Callable[..., None]]:
        return lambda *_, **__: _no_kernel


def _no_kernel(*_: object, **__: object) -> None:
    return None


_FIRST_CALL_MODE: contextvars.ContextVar[Any] = contextvars.ContextVar("fxmem_first_call_mode", default=None)
"""The inputs' FakeTensorMode while ``compile_on_fakes`` makes its first call outside every mode."""


@contextlib.contextmanager
def _buffers_in(mode: Any) -> Iterator[None]:
    """The first call's buffers fake, in the inputs' mode (Note [The first call's buffers])."""
    token = _FIRST_CALL_MODE.set(mode)
    try:
        yield
    finally:
        _FIRST_CALL_MODE.reset(token)


# Note [The first call's buffers]
#     ``compile_on_fakes`` compiles by calling the compiled model once outside every mode (Note
#     [Dynamo on the traced graph]). Its inputs are fake, but a buffer the wrapper allocates there is
#     not: ``torch.empty_strided`` outside a FakeTensorMode makes a real tensor, and an ATen kernel whose
#     inputs are all such buffers ran for real on them (a fake mode with ``allow_non_fake_inputs``
#     lets real and fake meet): gpt-7b's flash attention at B=2 x 2048 took half a second per block on
#     uninitialised memory, a third of its compiled analysis, and more with the batch. So during that
#     call the buffers are made in the inputs' own fake mode; in the step, under the timeline's modes,
#     they are fake already and seen by its tracker.


def _empty_strided(size: Sequence[Any], stride: Sequence[Any], dtype: torch.dtype, *_: object) -> torch.Tensor:
    mode = _FIRST_CALL_MODE.get()
    with mode if mode is not None else contextlib.nullcontext():
        return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


def _reinterpret(t: torch.Tensor, size: Sequence[Any], stride: Sequence[Any], offset: Any) -> torch.Tensor:
    return t.as_strided(size, stride, t.storage_offset() + offset)


@contextlib.contextmanager
def _stand_in_kernels(wrappers: list[str]) -> Iterator[None]:
    """Load every wrapper Inductor writes with kernels that do nothing, and keep its code; write the C++
    kernels' scalar loops only (Note [The C++ kernels' vector loops unwritten])."""
    from torch._inductor.graph import GraphLowering

    original = GraphLowering._compile_to_module_lines
    paths: list[str] = []

    def load(self: GraphLowering, wrapper_code: Any) -> types.ModuleType:
        return _load_wrapper(self, wrapper_code.value, wrappers, paths)

    GraphLowering._compile_to_module_lines = load  # type: ignore[method-assign]
    try:
        with _scalar_kernels_only():
            yield
    finally:
        GraphLowering._compile_to_module_lines = original  # type: ignore[method-assign]
        for path in paths:  # read back by CompiledFxGraph as it was made
            with contextlib.suppress(OSError):
                os.remove(path)


# Note [The C++ kernels' vector loops unwritten]
#     For each fused group the C++ backend writes a scalar kernel, then picks a tiling and writes the
#     vectorized kernels and their tails (``CppKernelProxy.codegen_functions`` in
#     torch/_inductor/codegen/cpp.py); ``KernelGroup.finalize_kernel`` then writes the loops around
#     them. What the wrapper allocates is decided by the scalar kernel alone: only its removed and
#     in-place buffers join the graph's (``V.graph.removed_buffers |= scalar_kernel.removed_buffers``),
#     the vector kernels being written with ``inplace_buffers`` off. The tiling matters in one more
#     place: an outer-loop fusion keeps its kernel-local buffers only where its kernels' loops are
#     tiled alike (``check_outer_fusion_loop_level_attr``), so there the tiling is still chosen
#     (``TilingSelect``) and applied to the loop nest. The vector kernels and the loops' code, which
#     no stand-in kernel runs, are not written: a third of a compile of a transformer block here.
#     Checked in tests/test_compiling.py: the wrappers' code outside the kernels is the same either way.


@contextlib.contextmanager
def _scalar_kernels_only() -> Iterator[None]:
    """See Note [The C++ kernels' vector loops unwritten]; a no-op where this torch's C++ backend lacks the methods patched."""
    try:
        from torch._inductor.codegen import cpp
        from torch._inductor.config import patch as config_patch
        from torch._inductor.virtualized import V
    except ImportError:
        yield
        return
    proxy, group = getattr(cpp, "CppKernelProxy", None), getattr(cpp, "KernelGroup", None)
    if not (hasattr(proxy, "codegen_functions") and hasattr(group, "finalize_kernel") and hasattr(cpp, "TilingSelect") and hasattr(cpp, "LocalBufferContext")):
        yield
        return
    write_functions, finalize = proxy.codegen_functions, group.finalize_kernel

    def scalar_functions(self: Any, fn_list: list[Any], var_sizes_list: list[Any]) -> None:
        isa, self.picked_vec_isa = self.picked_vec_isa, None  # the scalar kernel, and the loop nest
        try:
            write_functions(self, fn_list, var_sizes_list)
        finally:
            self.picked_vec_isa = isa
        if isa and self.itervars and isinstance(V.local_buffer_context, cpp.LocalBufferContext):
            with config_patch(inplace_buffers=False):
                factors, indices, _ = cpp.TilingSelect().select_tiling(fn_list, var_sizes_list)
            for index in indices:  # the second of a 2-D tiling takes the first's factor too
                self.loop_nest.tile(index, factor=factors[0])

    def scheduled_only(self: Any, new_kernel: Any, nodes: list[Any]) -> None:
        self.scheduled_nodes += nodes

    proxy.codegen_functions, group.finalize_kernel = scalar_functions, scheduled_only
    try:
        yield
    finally:
        proxy.codegen_functions, group.finalize_kernel = write_functions, finalize


def _load_wrapper(graph: Any, code: str, wrappers: list[str], paths: list[str]) -> types.ModuleType:
    """The wrapper's module as ``PyCodeCache.load_by_key_path`` would make it, with stand-in kernels;
    its source in a temporary file, which ``CompiledFxGraph`` reads back."""
    import torch._inductor.async_compile as async_compile

    wrappers.append(code)
    module = types.ModuleType(f"fxmem_inductor_{len(wrappers)}")
    handle, path = tempfile.mkstemp(prefix="fxmem_inductor_", suffix=".py")
    with os.fdopen(handle, "w") as f:
        f.write(code)
    module.__file__ = path
    paths.append(path)
    real = async_compile.AsyncCompile
    async_compile.AsyncCompile = _NoKernels  # type: ignore[misc,assignment]
    try:
        exec(compile(code, path, "exec"), module.__dict__)
    finally:
        async_compile.AsyncCompile = real  # type: ignore[misc]
    for name, value in {**graph.constants, **graph.torchbind_constants}.items():
        setattr(module, name, value)
    module.empty_strided_cpu = _empty_strided  # type: ignore[attr-defined]
    module.reinterpret_tensor = _reinterpret  # type: ignore[attr-defined]
    graph.cache_key, graph.cache_path, graph.cache_linemap = f"fxmem{len(wrappers)}", path, []
    return module


@dataclass(frozen=True)
class SavedValue:
    """One value the compiled forward hands to its backward (the partitioner's choice)."""

    name: str
    """The forward graph's node."""
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    held: bool
    """A parameter, buffer or input (or a view of one): saved, but no activation memory."""


def saved_values(compiled: CompiledModel) -> tuple[SavedValue, ...]:
    """What the partitioner saved, over every compiled graph: each backward graph's inputs that are
    not incoming gradients (``tangents_*``), tensors only (a saved size is a SymInt, no memory).
    Parameters and the model's inputs (``primals_*``) are among them where backward reads them."""
    found: list[SavedValue] = []
    forward: dict[str, fx.Node] = {}
    for graph in compiled.graphs:
        placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
        if not any(n.name.startswith("tangents") for n in placeholders):
            forward = {n.name: n for n in graph.graph.nodes}  # a forward: its backward comes next, if it has one
            continue
        for n in placeholders:
            value = n.meta.get("val")
            if n.name.startswith("tangents") or not isinstance(value, torch.Tensor):
                continue
            dtype = str(value.dtype).removeprefix("torch.")
            found.append(SavedValue(n.name, tuple(int(d) for d in value.shape), dtype, _nbytes(value), _held_before(forward.get(n.name))))
    return tuple(found)


def _nbytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes()) if t.numel() else 0


def _held_before(node: fx.Node | None) -> bool:
    """Whether a forward value is a parameter, a buffer or an input, or a view of one (a weight's
    transpose): its memory is the state's or the batch's, not the saved activations'."""
    while node is not None and node.op == "call_function":
        target = node.target
        if not (isinstance(target, torch._ops.OpOverload) and target.is_view) or not node.args:
            return False
        node = node.args[0] if isinstance(node.args[0], fx.Node) else None
    return node is not None and node.op == "placeholder"
