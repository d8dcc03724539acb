"""The stack of identical blocks most deep models are made of, and the same model with fewer of them.

Note [Repeated blocks]
    A 7B transformer is 32 copies of one block; simulating its step op by op pays 32 times for what
    one block shows. fxmem runs the capture pass and simulates the step on the model cut to its first
    3 and 4 blocks instead, extends the 3-block results to the full depth by repeating the middle
    block's (fxmem/step/repeats.py), and keeps them only where the same extension of the 3-block
    results reproduces the 4-block ones exactly, event for event and storage for storage; anywhere
    else the whole model runs. The symbolic results, the costliest, come from the 3-block copy
    alone, checked by the B=1 pair (Note [The symbolic step from three blocks] in fxmem/step/repeats.py).
    Cutting the list keeps every block's own name (``blocks.0`` to
    ``blocks.2``), so the shallow results' names are the full model's. A model that only torch.export
    traces is not even exported whole: its graph is built from the 4-block export (Note [An exported
    graph deepened from its copy] in deepen.py).

    A stack qualifies when it is an ``nn.ModuleList`` or ``nn.Sequential`` of at least
    ``MIN_DEPTH`` modules of one class whose parameters and buffers have the same names, shapes,
    dtypes and ``requires_grad``, none of them shared with another module (a tied weight makes one
    block's gradient differ from the others'), and whose plain settings are equal but for one that
    holds the block's own index (``layer_idx``): a list mixing sliding-window and global attention
    layers is no stack. The model's forward must also run with fewer blocks: one that reads its
    depth from elsewhere (a stored layer count) fails to trace, or differs at 4 blocks, and runs
    whole. Not caught: a block that branches on its own index at run time where its first 4 blocks
    agree (every sixth block global, say); such code reads a setting, which the check above sees, in
    the models we know.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

__all__ = ["MIN_DEPTH", "BlockStack", "cut_to", "find_block_stack"]

MIN_DEPTH = 6
"""Fewer blocks than this are simulated in full: the two shallow depths (3 and 4) would cost as much."""


@dataclass(frozen=True)
class BlockStack:
    """A list of identical blocks inside a model: where it is, how deep, and what its blocks are."""

    path: str
    """Module path of the list (``"transformer.h"``)."""
    depth: int
    kind: str
    """The blocks' class name."""

    def layer_of(self, fqn: str) -> int | None:
        """The block a module path lies in (``transformer.h.3.attn`` -> 3), or None outside the list."""
        known = self._layers
        if fqn not in known:  # asked tens of thousands of times when a deep step is extended
            match = self._pattern.match(fqn)
            known[fqn] = int(match.group(1)) if match else None
        return known[fqn]

    def node_layer(self, n: fx.Node) -> int | None:
        """The block an fx node belongs to: a module call's or a weight's by its target (an exported
        graph's ``get_attr`` nodes carry no module stack), any other node's by its innermost module."""
        if n.op in ("call_module", "get_attr"):
            return self.layer_of(str(n.target))
        module_stack = n.meta.get("nn_module_stack") or {}
        return self.layer_of(str(list(module_stack.values())[-1][0])) if module_stack else None

    def with_layer(self, fqn: str, layer: int) -> str:
        """``fqn`` moved to block ``layer`` (unchanged outside the list)."""
        moved = self._moved
        if (fqn, layer) not in moved:
            moved[(fqn, layer)] = self._pattern.sub(lambda m: f"{self.path}.{layer}{m.group(2)}", fqn, count=1)
        return moved[(fqn, layer)]

    @functools.cached_property
    def _pattern(self) -> re.Pattern[str]:
        return re.compile(rf"^{re.escape(self.path)}\.(\d+)(\.|$)")

    @functools.cached_property
    def _layers(self) -> dict[str, int | None]:
        return {}

    @functools.cached_property
    def _moved(self) -> dict[tuple[str, int], str]:
        return {}


def find_block_stack(model: nn.Module) -> BlockStack | None:
    """The deepest qualifying block list in ``model`` (Note [Repeated blocks]), or None."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    found: BlockStack | None = None
    for path, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < MIN_DEPTH or not path:
            continue
        children = list(module)
        shared = any(uses[id(p)] > 1 for p in module.parameters())
        if not shared and _all_alike(children) and (found is None or len(children) > found.depth):
            found = BlockStack(path, len(children), type(children[0]).__name__)
    return found


@contextlib.contextmanager
def cut_to(model: nn.Module, stack: BlockStack, depth: int) -> Iterator[nn.Module]:
    """``model`` with its block list holding only its first ``depth`` blocks, put back on exit."""
    parent_path, _, name = stack.path.rpartition(".")
    parent = model.get_submodule(parent_path)
    full = getattr(parent, name)
    cut = copy.copy(full)  # the list's own class and forward, whatever its constructor takes
    cut._modules = dict(list(full._modules.items())[:depth])
    setattr(parent, name, cut)
    try:
        yield model
    finally:
        setattr(parent, name, full)


def _all_alike(children: list[nn.Module]) -> bool:
    """Same class, parameters, buffers and submodules, and each plain setting either the same in every
    block or each block's own index (``layer_idx``)."""
    first = _structure(children[0])
    if any(type(c) is not type(children[0]) or _structure(c) != first for c in children[1:]):
        return False
    settings = [_settings(c) for c in children]
    if any(s.keys() != settings[0].keys() for s in settings):
        return False
    for key, value in settings[0].items():
        values = [s[key] for s in settings]
        if values != [value] * len(values) and values != list(range(len(values))):
            return False
    return True


_PLAIN = (bool, int, float, str, type(None), torch.dtype)


def _structure(module: nn.Module) -> tuple[object, ...]:
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers())
    return params, buffers, tuple(type(m).__name__ for m in module.modules())


def _settings(module: nn.Module) -> dict[tuple[str, str], object]:
    """A block's plain settings (``attention_type = "sliding"``, ``layer_idx = 3``) by submodule and name."""
    return {
        (path, key): value
        for path, m in module.named_modules()
        for key, value in vars(m).items()
        if not key.startswith("_") and key != "training" and isinstance(value, _PLAIN)
    }
