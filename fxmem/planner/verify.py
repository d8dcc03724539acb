"""The truth a checkpointing plan is tested against: the emitted code applied to the real model on the CPU.

Note [What a selectively checkpointed step keeps]
    Inside a checkpointed region the checkpoint's own saved-tensor hooks are the innermost, so hooks
    around the step see only what the checkpoint saves through them: the region's positional inputs
    (``_CheckpointFrame.save_inputs``). What the policy keeps does not pass through any hook: the
    forward's ``_CachingTorchDispatchMode`` holds it in its ``storage`` (one ``_VersionWrapper`` per
    kept output, ``_RECOMPUTE`` for the rest; torch/utils/checkpoint.py). So the measurement counts
    the distinct storages that the hooks see, as fxmem/measure.py does, together with those of the
    tensors the caching modes hold once the forward has run; parameters, buffers, the batch and the
    target are left out, as there.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from fxmem.engine.losses import Loss, get_loss
from fxmem.frontends.huggingface import prepared_for_training
from fxmem.inputs import InputSpec, InputSpecs, make_input, parse_inputs, tensors_of
from fxmem.measure import materialize
from fxmem.planner.checkpoint import CheckpointPlan
from fxmem.planner.emit import compile_plan

__all__ = ["PlanMeasurement", "measure_plan"]


@dataclass(frozen=True)
class PlanMeasurement:
    """A real CPU step under a plan: the bytes saved for backward, and the FLOPs backward recomputed."""

    batch: int
    saved: int
    """Distinct storages saved for backward or kept by the policy (Note [What a selectively checkpointed step keeps])."""
    unplanned: int
    """The same count for the model without checkpointing."""
    backward_flops: int
    """``FlopCounterMode``'s total for backward under the plan."""
    plain_backward_flops: int
    """The same for the model without checkpointing."""

    @property
    def recompute_flops(self) -> int:
        """The FLOPs of the forward ops backward reran: backward with checkpointing minus backward without."""
        return self.backward_flops - self.plain_backward_flops


def measure_plan(
    model: nn.Module, inputs: InputSpecs, plan: CheckpointPlan, *, loss: str = "sum", seed: int = 0, seq_len: int | None = None
) -> PlanMeasurement:
    """Apply ``plan`` (its emitted code, ``compile_plan``) to a copy of the real model and run one forward,
    loss and backward at ``plan.batch`` on the CPU; the same for a plain copy, for comparison."""
    specs, loss_fn = parse_inputs(inputs), get_loss(loss)
    torch.manual_seed(seed)
    real = materialize(model).train()
    values = [make_input(s, plan.batch, seq_len) for s in specs]
    plain, checkpointed = copy.deepcopy(real), compile_plan(plan)(copy.deepcopy(real))
    with prepared_for_training(plain, cache=False):  # the step the plan was made for (no key/value cache)
        plain_saved, plain_flops = _step(plain, specs, values, loss_fn, plan.model)
    with prepared_for_training(checkpointed, cache=False):
        saved, flops = _step(checkpointed, specs, values, loss_fn, plan.model)
    return PlanMeasurement(plan.batch, saved, plain_saved, flops, plain_flops)


def _step(model: nn.Module, specs: Sequence[InputSpec], values: list[Any], loss: Loss, name: str) -> tuple[int, int]:
    """(bytes saved by the forward and loss, FLOPs of the backward) of one real step."""
    args = [v for s, v in zip(specs, values) if s.name is None]
    kwargs = {s.name: v for s, v in zip(specs, values) if s.name is not None}
    held: list[torch.Tensor] = []
    with _caching_modes() as modes, torch.autograd.graph.saved_tensors_hooks(_keeper(held), lambda t: t):
        output = loss.select(model(*args, **kwargs), name)
        target = loss.make_target(output)
        value = loss.compute(output, target)
    excluded = [*model.parameters(), *model.buffers(), *tensors_of(specs, values), *([target] if target is not None else [])]
    saved = _distinct_bytes([*held, *_cached(modes)], excluded)
    with FlopCounterMode(display=False) as counter:
        value.backward()
    return saved, counter.get_total_flops()


def _keeper(held: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def pack(t: torch.Tensor) -> torch.Tensor:
        held.append(t)
        return t

    return pack


@contextlib.contextmanager
def _caching_modes() -> Iterator[list[Any]]:
    """The forward contexts every ``create_selective_checkpoint_contexts`` call makes while this is open.

    The emitted code looks the function up on ``torch.utils.checkpoint`` at each call, so standing in
    for it there sees every region's caching mode."""
    made: list[Any] = []
    original = torch_checkpoint.create_selective_checkpoint_contexts

    def observed(*args: Any, **kwargs: Any) -> Any:
        contexts = original(*args, **kwargs)
        made.append(contexts[0])
        return contexts

    torch_checkpoint.create_selective_checkpoint_contexts = observed
    try:
        yield made
    finally:
        torch_checkpoint.create_selective_checkpoint_contexts = original


def _cached(modes: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors the caching modes keep (Note [What a selectively checkpointed step keeps])."""
    found = []
    for mode in modes:
        for entries in mode.storage.values():
            for entry in entries.values() if isinstance(entries, dict) else entries:
                found += [w.val for w in tree_leaves(entry) if isinstance(w, torch_checkpoint._VersionWrapper)]
    return [t for t in found if isinstance(t, torch.Tensor)]


def _distinct_bytes(tensors: Sequence[torch.Tensor], excluded: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors``, leaving out those of ``excluded``."""
    left_out = {StorageWeakRef(t.untyped_storage()) for t in excluded}
    sizes = {StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for key, n in sizes.items() if key not in left_out)
