"""The plan of a parallel run, checked against the model: FSDP2's units, tensor parallel's layers
(``--tp-plan``, or with ``--sp`` the model's sequence-parallel plan), and what torch's optimizers
refuse of tensor parallel alone. ``fxmem.analyze`` asks for it once per run (per stage's rank with ``--pp``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn

from fxmem.errors import InputSpecError
from fxmem.parallel import ParallelPlan, default_tp_plan, tp_layers
from fxmem.step.sharding import fsdp_units
from fxmem.step.training import TrainingSetup

__all__ = ["check_tp_optimizer", "parallel_plan", "sequence_plan"]


def parallel_plan(
    model: nn.Module, setup: TrainingSetup, units: Iterable[str] | None, tp_plan: Mapping[str, str] | None, peak: bool, name: str
) -> ParallelPlan | None:
    """The plan of a ``--fsdp`` / ``--tp`` run (None otherwise): FSDP2's units and tensor parallel's
    layers, checked against the model."""
    if units is not None and not setup.fsdp:
        raise InputSpecError("fsdp_units names FSDP2's units, which only --fsdp N (N > 1) uses; pass fsdp=N too.")
    if tp_plan is not None and setup.tp == 1:
        raise InputSpecError("tp_plan names tensor parallel's layers, which only --tp T (T > 1) uses; pass tp=T too.")
    if not setup.engine:
        return None
    if not peak:
        raise InputSpecError(
            f"model '{name}': --fsdp and --tp simulate one rank's training step, which --no-peak (peak=False) skips; drop one."
        )
    chosen = _fsdp_units(model, units, name) if setup.fsdp else ()
    layers = tp_layers(model, setup.tp, tp_plan, name) if setup.tp > 1 else ()
    return ParallelPlan(
        setup.world_size if setup.fsdp else 1, chosen, mixed=setup.fsdp_mixed, tp=setup.tp, tp_layers=layers, offload=setup.offload
    )


def sequence_plan(model: nn.Module, tp: int, tp_plan: Mapping[str, str] | None, sp: object, name: str) -> Mapping[str, str] | None:
    """The tensor-parallel plan: ``tp_plan``, or with ``sp`` the model's sequence-parallel one."""
    if not isinstance(sp, bool):
        raise InputSpecError(f"sp must be True or False; got {sp!r}.")
    if not sp:
        return tp_plan
    if tp == 1:
        raise InputSpecError("sp (--sp) splits the sequence among tensor-parallel ranks: pass tp=T (--tp T) with T > 1 too.")
    if tp_plan is not None:
        raise InputSpecError(
            "sp (--sp) takes the model's own sequence-parallel plan; with tp_plan= (--tp-plan), write the sequence styles in it instead."
        )
    return default_tp_plan(model, sequence_parallel=True, name=name)


def check_tp_optimizer(model: nn.Module, plan: ParallelPlan | None, impl: str, name: str) -> None:
    """Tensor parallel alone leaves the parameters outside its layers plain tensors beside the layers'
    DTensors, and torch's foreach and fused optimizers refuse such a mix ("got mixed torch.Tensor and
    DTensor"), in a real run as in the simulated one: say so before the step is simulated."""
    if plan is None or plan.tp == 1 or plan.fsdp > 1 or impl == "for-loop":
        return
    sharded = {
        f"{layer.path}.{p}" if layer.path else p for layer in plan.tp_layers for p, _ in model.get_submodule(layer.path).named_parameters()
    }
    plain = [n for n, p in model.named_parameters() if p.requires_grad and n not in sharded]
    if plain:
        raise InputSpecError(
            f"model '{name}': with --tp {plan.tp} alone, parameter '{plain[0]}' (and {len(plain) - 1} more) stays a plain tensor "
            f"beside the tensor-parallel layers' DTensors, and the {impl} optimizer refuses that mix in a real run too; pass "
            "--optimizer-impl for-loop (optimizer_impl='for-loop'), add --fsdp N (FSDP2 makes every parameter a DTensor), "
            "or give those modules a style in the plan."
        )


def _fsdp_units(model: nn.Module, units: Iterable[str] | None, name: str) -> tuple[str, ...]:
    """FSDP2's units: ``units``, else each repeated block; checked against the model."""
    chosen = tuple(units) if units is not None else fsdp_units(model)
    modules = dict(model.named_modules())
    missing = [u for u in chosen if not isinstance(u, str) or u not in modules or not u]
    if missing:
        raise InputSpecError(
            f"model '{name}': FSDP unit {missing[0]!r} is not a submodule path of the model; name modules such as "
            f"{', '.join(repr(u) for u in fsdp_units(model)[:3]) or repr(next(iter(modules), ''))}."
        )
    return chosen
