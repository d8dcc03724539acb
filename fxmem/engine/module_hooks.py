"""Module hooks on a flattened graph: where each module's code begins and ends among the graph's
nodes, and the module's own forward hooks called there.

Note [Module hooks on a flattened graph]
    torch.distributed's parallelisms act through hooks on modules: ``fully_shard`` all-gathers a
    unit's weights in a forward pre-hook and frees them in a forward hook, where it also hooks the
    outputs for backward (torch/distributed/fsdp/_fully_shard/_fsdp_state.py, ``FSDPState.init``);
    tensor parallel moves inputs and outputs between layouts the same way. An fx graph traced through
    a module's forward has no call of it left (only ``torch.nn`` leaves stay calls), so those hooks
    would never fire. Every node keeps the module stack it was traced in (``nn_module_stack``); the
    nodes of one module are contiguous in the graph, as its code ran in one call. ``ModuleScopes``
    finds, for each hooked module, its first and last node, the values it reads from outside (its
    arguments, as the call received them) and the values it hands out (its outputs), and the
    interpreter calls the module's pre-hooks before the first node and its hooks after the last, in
    ``nn.Module._call_impl``'s order, with those values, and goes on with what the hooks return in
    their place, inside the module: an argument read again after it (the input of q_proj that k_proj
    reads next, a residual) is, as in eager, the caller's own value, not what the hooks made of it. The root module's scope is the whole graph, its arguments the graph's inputs, its
    output the graph's. A leaf module (a call_module node) fires its own hooks when it is called.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import nn

from fxmem.errors import CaptureError, FxmemError

__all__ = ["ModuleHooks", "ModuleScopes", "Scope", "call_forward_hooks", "call_pre_hooks", "within"]


@dataclass(frozen=True)
class Scope:
    """One module's stretch of the graph: Note [Module hooks on a flattened graph]."""

    path: str
    module: nn.Module
    first: fx.Node
    last: fx.Node
    inputs: tuple[fx.Node, ...]
    """Values made outside the module and read inside it: its arguments."""
    outputs: tuple[fx.Node, ...]
    """Values made inside the module and read after it: its outputs (the output node's for the root)."""


@dataclass(frozen=True)
class ModuleScopes:
    """The scopes of the hooked modules of a graph, by the node that opens and the node that closes them."""

    opening: Mapping[fx.Node, tuple[Scope, ...]]
    """Outermost first."""
    closing: Mapping[fx.Node, tuple[Scope, ...]]
    """Innermost first."""

    @classmethod
    def of(cls, gm: fx.GraphModule, paths: Iterable[str], model: str = "model") -> ModuleScopes:
        """The scopes of the modules at ``paths`` ("" the root) in ``gm``'s module tree."""
        scopes = [_scope(gm, path, model) for path in sorted(set(paths), key=_depth)]
        opening: dict[fx.Node, list[Scope]] = {}
        closing: dict[fx.Node, list[Scope]] = {}
        for s in scopes:
            opening.setdefault(s.first, []).append(s)
            closing.setdefault(s.last, []).insert(0, s)
        return cls({n: tuple(v) for n, v in opening.items()}, {n: tuple(v) for n, v in closing.items()})


def _depth(path: str) -> int:
    return 0 if not path else path.count(".") + 1


def _scope(gm: fx.GraphModule, path: str, model: str) -> Scope:
    module = gm.get_submodule(path)
    nodes = list(gm.graph.nodes)
    if not path:  # get_attr nodes may come before the inputs (torch.export's graphs): a weight is read where it is used
        inside = [n for n in nodes if n.op not in ("placeholder", "get_attr")]
    else:
        inside = [n for n in nodes if n.op not in ("placeholder", "get_attr", "output") and within(_path_of(n), path)]
    if not inside:
        raise CaptureError(
            f"model '{model}': module '{path}' ({type(module).__name__}) runs no operation in the traced graph, so its "
            "hooks have nowhere to fire; wrap a module that computes something in the forward."
        )
    members = set(inside)
    index = {n: i for i, n in enumerate(nodes)}
    span = nodes[index[inside[0]] : index[inside[-1]] + 1]
    inputs = _unique(i for n in inside for i in n.all_input_nodes if i not in members and i.op != "get_attr")
    leaving = _unique(n for n in span if n in members and any(u not in members for u in n.users))
    outputs = leaving if path else (inside[-1],)
    return Scope(path, module, inside[0], inside[-1], inputs, outputs)


def _path_of(n: fx.Node) -> str:
    if n.op == "call_module":
        return str(n.target)
    stack = n.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def within(fqn: str, path: str) -> bool:
    """Whether module path ``fqn`` is ``path`` or inside it."""
    return fqn == path or fqn.startswith(path + ".")


def _unique(nodes: Iterable[fx.Node]) -> tuple[fx.Node, ...]:
    return tuple(dict.fromkeys(nodes))


def call_pre_hooks(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The module's forward pre-hooks, in ``nn.Module._call_impl``'s order and with its conventions."""
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def call_forward_hooks(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    """The module's forward hooks, in ``nn.Module._call_impl``'s order; the output they leave."""
    for hook_id, hook in list(module._forward_hooks.items()):
        with_kwargs = hook_id in module._forward_hooks_with_kwargs
        result = hook(module, args, kwargs, output) if with_kwargs else hook(module, args, output)
        if result is not None:
            output = result
    return output


# Note [Module hooks inside a checkpoint]
#     A checkpointed region runs as one step of the interpreter (fxmem/engine/recompute.py), at its
#     first node, so the main loop reaches the region's inner nodes only after the whole region ran.
#     Eager calls a module's hooks where its code begins and ends, inside the checkpointed function
#     when the module is inside it: torch.utils.checkpoint wraps only the function it is given, and an
#     exported graph's region starts before a block's first op (at the ops feeding it), so an FSDP2
#     unit's all-gather must run as the region's forward reaches the unit, not after the region.
#     ``run_region_node`` runs the hooks there and the main loop skips them for those nodes; a module
#     opened already (at the region's first node, by the main loop) is not opened again. Backward's
#     recomputation reruns the function alone (``checkpoint`` reruns ``forward``, not ``__call__``):
#     no hooks, and each parameter read as the module holds it then (FSDP2's pre-backward hook has
#     gathered it), not as the forward's closure captured it (the shard, before the unit opened).


class ModuleHooks(fx.Interpreter):
    """What an interpreter of a flattened graph adds to call its hooked modules' hooks (mixed in
    before the interpreter class): Note [Module hooks on a flattened graph]. With ``scopes`` None it
    runs as the interpreter it is mixed into."""

    scopes: ModuleScopes | None = None

    def run_node(self, n: fx.Node) -> Any:
        scopes = self.scopes
        if scopes is None or n in self._hooked():  # none, or they ran inside a checkpointed region's forward
            self._hooked().discard(n)
            return super().run_node(n)
        self._open_at(scopes, n)
        out = self._close_at(scopes, n, super().run_node(n))
        self._hooked().discard(n)  # a region's first node, run inside its region too
        return out

    def run_region_node(self, n: fx.Node, run: Callable[[fx.Node], Any]) -> Any:
        """A node of a checkpointed region, run as the region's forward reaches it: the hooks of the
        modules that open or close there run around it (Note [Module hooks inside a checkpoint]), and
        the main loop skips them for that node. In backward's recomputation no hook runs (checkpoint
        reruns ``forward``, not ``__call__``), and the parameters are read as the hooks left them then."""
        scopes = self.scopes
        if scopes is None:
            return run(n)
        if not getattr(self, "_forward", True):  # recomputed in backward (RegionInterpreter's flag)
            self._refresh(n)
            return run(n)
        self._open_at(scopes, n)
        out = self._close_at(scopes, n, run(n))
        self._hooked().add(n)
        return out

    def _hooked(self) -> set[fx.Node]:
        """Nodes whose hooks already ran inside a checkpointed region's forward (``run_region_node``)."""
        if not hasattr(self, "_hooked_nodes"):
            self._hooked_nodes: set[fx.Node] = set()
        return self._hooked_nodes

    def _open_at(self, scopes: ModuleScopes, n: fx.Node) -> None:
        for scope in scopes.opening.get(n, ()):
            if scope.path not in self._calls():  # opened already, at its region's first node
                self._enter(scope)
        self._refresh(n)

    def _refresh(self, n: fx.Node) -> None:
        for i in n.all_input_nodes:  # a parameter as the hooks left it now (gathered or sharded), not as first read
            if i.op == "get_attr":
                self.env[i] = self.fetch_attr(str(i.target))

    def _close_at(self, scopes: ModuleScopes, n: fx.Node, out: Any) -> Any:
        for scope in scopes.closing.get(n, ()):
            if scope.path in self._calls():  # closed once, where the node ran
                out = self._leave(scope, n, out)
                self.left(scope)
        return out

    def hooks_run(self, scope: Scope, node: fx.Node) -> None:
        """Called as a module's hooks are about to run at ``node``: subclasses note where they are."""

    def entered(self, scope: Scope) -> None:
        """Called after a module's pre-hooks ran (its parameters are now what its code uses)."""

    def left(self, scope: Scope) -> None:
        """Called once a module's forward hooks ran and its call's arguments were let go: what dies
        now dies as the module's call ends, not when the next node starts (which may be another
        module's, or none)."""

    def _enter(self, scope: Scope) -> None:
        """Call a module's pre-hooks with its arguments and go on with what they return."""
        self.hooks_run(scope, scope.first)
        args = tuple(self.env[i] for i in scope.inputs)
        new_args, kwargs = self._hooks(scope, scope.first, "forward pre-hooks", lambda: call_pre_hooks(scope.module, args, {}))
        for i, value in zip(scope.inputs, new_args):
            self.env[i] = value
        self._calls()[scope.path] = (tuple(new_args), kwargs, args)
        self.entered(scope)

    def _leave(self, scope: Scope, n: fx.Node, out: Any) -> Any:
        """Call a module's forward hooks with its outputs and go on with what they return."""
        self.hooks_run(scope, n)
        values = tuple(out if o is n else self.env[o] for o in scope.outputs)
        args, kwargs, given_args = self._calls().pop(scope.path)
        for i, value in zip(scope.inputs, given_args):
            if i in self.env:  # still read after the module: the caller's value again
                self.env[i] = value
        given = values[0] if len(values) == 1 else values
        result = self._hooks(scope, n, "forward hooks", lambda: call_forward_hooks(scope.module, args, kwargs, given))
        returned = (result,) if len(values) == 1 else tuple(result)
        for o, value in zip(scope.outputs, returned):
            if o is n:
                out = value
            else:
                self.env[o] = value
        return out

    def _hooks(self, scope: Scope, n: fx.Node, which: str, call: Callable[[], Any]) -> Any:
        """Run a module's hooks; their failure (the engine refusing what the model does) as one error."""
        try:
            return call()
        except FxmemError:
            raise
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            where = f"module '{scope.path}'" if scope.path else "the root module"
            raise CaptureError(
                f"model '{getattr(self, 'model_label', 'model')}': the {which} of {where} ({type(scope.module).__name__}), called at "
                f"node '{n.name}', failed: {type(e).__name__}: {first}. A real run calls them at the same point; check the "
                "units given to the sharding engine (fsdp_units)."
            ) from e

    def _calls(self) -> dict[str, tuple[tuple[Any, ...], dict[str, Any], tuple[Any, ...]]]:
        """The arguments each hooked module's pre-hooks returned, and those it was given, kept until
        its hooks run (eager's frames hold them as long)."""
        if not hasattr(self, "_module_calls"):
            self._module_calls: dict[str, tuple[tuple[Any, ...], dict[str, Any], tuple[Any, ...]]] = {}
        return self._module_calls
