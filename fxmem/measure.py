"""The truth that predictions are tested against: one real forward (and loss) on the CPU.

``measure`` materializes the weights with random values, feeds random floats and zero integers, and
records every tensor autograd saves with ``saved_tensors_hooks``, each storage once, leaving out
parameters, buffers, inputs and targets. It does this twice, independently:

- eagerly, by calling the model itself, without fx: the total a user can reproduce by hand;
- through the traced graph, with the same recorder the fake pass uses: the per-node split.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from fxmem.account import node_bytes_at
from fxmem.capture import record_real
from fxmem.errors import CaptureError, FxmemError
from fxmem.inputs import InputSpec, InputSpecs, check_batch, make_tensor, parse_inputs
from fxmem.losses import Loss, get_loss
from fxmem.tracing import trace_model

__all__ = ["Measurement", "materialize", "measure"]


@dataclass(frozen=True)
class Measurement:
    """Measured activation bytes at one batch size: in total (eager run) and per fx node."""

    batch: int
    total: int
    nodes: dict[str, int]

    @property
    def graph_total(self) -> int:
        """The per-node bytes summed; equals ``total`` unless tracing changed what the model saves."""
        return sum(self.nodes.values())


def measure(
    model: nn.Module,
    inputs: InputSpecs,
    batch: int,
    *,
    loss: str = "sum",
    seed: int = 0,
    leaf_types: tuple[type, ...] = (),
    frontend: str = "auto",
    seq_len: int | None = None,
) -> Measurement:
    """Run the model for real on the CPU at ``batch`` and measure the activation bytes saved for backward.

    ``leaf_types`` and ``frontend`` must be the ones given to ``analyze`` so that the per-node split uses
    the same graph.
    """
    check_batch(batch)
    specs, loss_fn = parse_inputs(inputs), get_loss(loss)
    torch.manual_seed(seed)
    real = materialize(model).train()
    try:
        total = _eager_total(real, specs, loss_fn, batch, seq_len)
    except FxmemError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise CaptureError(
            f"model '{type(model).__name__}': the real CPU run at B={batch} failed ({type(e).__name__}: {first}); "
            "fake tensors cannot see this (they carry shapes, not values), so check the --input shapes and values "
            "the model expects (token ids are zeros, sequence lengths within its context)."
        ) from e
    traced = trace_model(real, specs, leaf_types=leaf_types, frontend=frontend)
    capture = record_real(traced.gm, specs, loss=loss_fn, batch=batch, seq=seq_len)
    return Measurement(batch, total, node_bytes_at(capture))


def materialize(model: nn.Module) -> nn.Module:
    """A CPU copy with real weights if any tensor is on the meta device, else the model itself.

    ``to_empty`` gives every module its own new parameter, which would untie tied weights (an LM head
    sharing the embedding matrix); the ties are restored afterwards, so the copy has the same state.
    """
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return model
    real = copy.deepcopy(model)
    ties = _parameter_slots(real)
    real.to_empty(device="cpu")
    _retie(real, ties)
    with torch.no_grad():
        for b in real.buffers():
            b.zero_()
        for p in real.parameters():
            p.normal_(0.0, 0.02)
        for m in real.modules():
            reset = getattr(m, "reset_parameters", None)
            if callable(reset):
                reset()
    return real


def _parameter_slots(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every (module, attribute) slot that holds each parameter object, by the object's id."""
    slots: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                slots[id(p)].append((module, name))
    return slots


def _retie(model: nn.Module, slots: dict[int, list[tuple[nn.Module, str]]]) -> None:
    for places in slots.values():
        first_module, first_name = places[0]
        for module, name in places[1:]:
            module._parameters[name] = first_module._parameters[first_name]


def _eager_total(model: nn.Module, specs: Sequence[InputSpec], loss: Loss, batch: int, seq: int | None = None) -> int:
    """Saved activation bytes of ``model(...)`` plus the loss, without fx: the independent total."""
    tensors = [make_tensor(s, batch, seq) for s in specs]
    args = [t for s, t in zip(specs, tensors) if s.name is None]
    kwargs = {s.name: t for s, t in zip(specs, tensors) if s.name is not None}
    excluded = {StorageWeakRef(t.untyped_storage()) for t in [*model.parameters(), *model.buffers(), *tensors]}
    seen: dict[StorageWeakRef, int] = {}
    alive: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        alive.append(t)
        seen.setdefault(StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*args, **kwargs)
        output = loss.select(out, type(model).__name__)
        target = loss.make_target(output)
        if target is not None:
            excluded.add(StorageWeakRef(target.untyped_storage()))
        loss.compute(output, target)
    return sum(n for key, n in seen.items() if key not in excluded)
