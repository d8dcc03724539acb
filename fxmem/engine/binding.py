"""Binding a graph to its inputs and state: placeholders lined up with input specs, and parameters
and buffers swapped for fake copies for the length of a pass (tied ones by the same copy)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from fxmem.errors import InputSpecError
from fxmem.inputs import Constant, InputSpec
from fxmem.results import Kind

__all__ = ["bind_inputs", "fake_like", "local_tensor", "state_kinds", "storage_of", "storage_parts", "swapped_state"]


def bind_inputs(gm: fx.GraphModule, specs: Sequence[InputSpec], tensors: Sequence[torch.Tensor], model: str) -> list[Any]:
    """Line up input tensors with the graph's placeholders: positional first, then by keyword name."""
    positional = [t for s, t in zip(specs, tensors) if s.name is None]
    values: list[Any] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = [str(p.target).lstrip("*") for p in placeholders]
    keyword = _keywords(specs, tensors, names)
    unknown = sorted(set(keyword) - set(names))
    if unknown or len(positional) > len(placeholders):
        raise InputSpecError(
            f"model '{model}' takes inputs ({', '.join(names)}), but was given "
            f"{len(positional)} positional input(s) and keyword(s) {unknown or sorted(keyword)}; "
            "match --input to the forward() signature."
        )
    for i, (p, name) in enumerate(zip(placeholders, names)):
        if i < len(positional):
            values.append(positional[i])
        elif name in keyword:
            values.append(keyword[name])
        elif p.args:
            values.append(p.args[0])
        else:
            raise InputSpecError(
                f"model '{model}' needs input '{name}' of forward(), which was not given; add an "
                f"--input for it (e.g. --input {name}=B,...)."
            )
    return values


def _keywords(specs: Sequence[InputSpec], values: Sequence[Any], names: Sequence[str]) -> dict[str, Any]:
    """{placeholder name: value} for the keyword inputs. torch.export flattens a structured constant
    (``note=[1, 2]``) into one placeholder a leaf, ``note_0`` and ``note_1``, in the leaves' order."""
    found: dict[str, Any] = {}
    for spec, value in zip(specs, values):
        if spec.name is None:
            continue
        parts = [n for n in names if n.startswith(f"{spec.name}_")] if isinstance(spec, Constant) and spec.name not in names else []
        leaves = tree_leaves(value)
        if parts and len(parts) == len(leaves):
            found.update(zip(parts, leaves))
        else:
            found[spec.name] = value
    return found


@contextlib.contextmanager
def swapped_state(gm: fx.GraphModule, replace: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Temporarily replace every parameter and buffer (tied ones by the same object), then restore."""
    originals: list[tuple[dict[str, Any], str, Any]] = []
    cache: dict[int, torch.Tensor] = {}
    for module in gm.modules():
        slot_dicts: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for slots in slot_dicts:
            for name, value in slots.items():
                if value is None:
                    continue
                originals.append((slots, name, value))
                if id(value) not in cache:
                    cache[id(value)] = replace(value)
                slots[name] = cache[id(value)]
    try:
        yield
    finally:
        for slots, name, value in originals:
            slots[name] = value


def fake_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty copy of ``t`` (a Parameter stays one), in ``dtype`` where given."""
    fake = torch.empty_strided(t.shape, t.stride(), dtype=dtype or t.dtype, device="cpu")
    return torch.nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else fake


def state_kinds(gm: fx.GraphModule) -> dict[Hashable, Kind]:
    """The kind of each parameter's and buffer's storage, by its StorageWeakRef."""
    kinds: dict[Hashable, Kind] = {StorageWeakRef(storage_of(b)): Kind.BUFFER for b in gm.buffers()}
    kinds.update({StorageWeakRef(storage_of(p)): Kind.PARAM for p in gm.parameters()})
    return kinds


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s storage in this process: a DTensor's (a sharded parameter's) local shard, else ``t``."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage holding ``t`` in this process (a DTensor's is its local shard's)."""
    return local_tensor(t).untyped_storage()


# Note [A sparse tensor's storages]
#     A sparse COO tensor owns no storage of its own ("Cannot access storage of SparseTensorImpl"): its
#     memory is its indices (int64, ndim x nnz) and its values (nnz x dense dims), two strided tensors.
#     ``torch.sparse_coo_tensor(indices, values, size)`` keeps both as given, without a copy (they are
#     ``_indices()`` and ``_values()`` of the result), and autograd saves the sparse result itself
#     (``SparseCooTensorWithDimsAndTensorsBackward0`` keeps it for ``grad.sparse_mask``): SHiRA (peft 0.21,
#     tuners/shira/layer.py, ``get_delta_weight``) adds such a tensor to its weight in every step. What
#     is saved, allocated or held of a sparse tensor is counted as those two tensors' storages.


def storage_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The strided tensors whose storages hold ``t``: a sparse COO tensor's indices and values (Note [A
    sparse tensor's storages]), ``(t,)`` for any other."""
    if t.layout == torch.sparse_coo:
        return (t._indices(), t._values())
    return (t,)
