"""FSDP2 (``fully_shard``) on a module tree, as a training script applies it: each unit, then the root;
and its CPU offload, as the simulated rank's device sees it (Note [FSDP2's CPU offload])."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from fxmem.errors import CaptureError, InputSpecError
from fxmem.results import Category, Phase, Timeline

__all__ = ["device_timeline", "fsdp_policy", "gathered_parameters", "gathered_weights", "offload_policy", "shard_units", "staged_copies"]


def fsdp_policy(mixed: bool) -> MixedPrecisionPolicy:
    """FSDP2's default policy, or with ``mixed`` bf16 gathered weights and compute, fp32 reductions."""
    if not mixed:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def offload_policy(offload: bool) -> OffloadPolicy:
    """FSDP2's default (nothing offloaded), or with ``offload`` its CPU offload, unpinned
    (Note [FSDP2's CPU offload]: pinning is refused here, and changes no device byte)."""
    return CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()


def shard_units(
    root: nn.Module,
    units: tuple[str, ...],
    mesh: DeviceMesh,
    reshard: bool,
    policy: MixedPrecisionPolicy,
    model: str,
    offload: OffloadPolicy | None = None,
) -> None:
    """``fully_shard`` each unit (freeing its gathered weights after forward when ``reshard``), then
    the root (which keeps them, ``fully_shard``'s default for the root), each with ``offload``."""
    offload = offload if offload is not None else OffloadPolicy()
    for path in units:
        try:
            unit = root.get_submodule(path)
        except AttributeError as e:
            raise InputSpecError(f"model '{model}': --fsdp unit '{path}' is not a module of the model ({e}); name a module path.") from e
        _shard(unit, path, mesh, reshard, policy, model, offload)
    _shard(root, "", mesh, False, policy, model, offload)


def _shard(
    module: nn.Module, path: str, mesh: DeviceMesh, reshard: bool, policy: MixedPrecisionPolicy, model: str, offload: OffloadPolicy
) -> None:
    from torch.distributed.fsdp import fully_shard

    try:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, offload_policy=offload)
    except Exception as e:
        where = f"module '{path}'" if path else "the root module"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise CaptureError(
            f"model '{model}': fully_shard refused {where} ({type(module).__name__}): {type(e).__name__}: {first}; "
            "choose other FSDP units (fsdp_units=...)."
        ) from e


def gathered_parameters(gm: nn.Module) -> dict[str, torch.Tensor]:
    """{parameter name: the full-size parameter FSDP2 gathers it into}, for the parameters gathered
    so far: the forward uses those, so autograd accumulates their gradients before they are sharded."""
    names = {id(p): name for name, p in gm.named_parameters()}
    return {names[id(p.sharded_param)]: gathered for p, gathered in _gathered(gm) if id(p.sharded_param) in names}


def gathered_weights(model: nn.Module) -> list[torch.Tensor]:
    """The full-size parameters FSDP2 gathers into, for every unit of ``model``, whether or not they
    are registered on the module now (``gathered_parameters`` names them by the registered shards,
    which a unit still gathered after forward has swapped out)."""
    return [gathered for _, gathered in _gathered(model)]


def _gathered(model: nn.Module) -> Iterator[tuple[Any, torch.Tensor]]:
    """Each FSDP2 parameter of ``model``'s units (an ``FSDPParam``) that has gathered so far, with the
    full-size parameter it gathers into."""
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        for group in state()._fsdp_param_groups:
            for param in group.fsdp_params:
                gathered = getattr(param, "_unsharded_param", None)
                if gathered is not None:
                    yield param, gathered


# Note [FSDP2's CPU offload]
#     ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` keeps each rank's state in host memory and
#     moves only what a unit needs through the device, by these lines of torch 2.13
#     (torch/distributed/fsdp/_fully_shard/):
#     * The padded shard of every parameter is made on the host (``padded_sharded_param.cpu()``, pinned
#       where ``pin_memory``: _fsdp_param.py:312-315), and ``fully_shard`` refuses parameters that are
#       not on the CPU (``_validate_cpu_offload_params``, _fsdp_param_group.py:1041-1055). So are the
#       gradient shards and the optimizer state: "the optimizer step runs on CPU with CPU optimizer
#       states" (``CPUOffloadPolicy``'s docstring, _fsdp_api.py:183-197).
#     * Before a unit's all-gather each shard is copied to the device (``sharded_param_data.to(self.device,
#       non_blocking=True)``, then cast to ``param_dtype`` where one is set: ``FSDPParam.all_gather_inputs``,
#       _fsdp_param.py:896-901; offloaded parameters skip the foreach-copy fast path, _fsdp_collectives.py:
#       388-393). ``foreach_all_gather`` copies these into the all-gather output and drops them
#       (``del param_all_gather_inputs``, _fsdp_collectives.py:337-361): a staging copy of the unit's
#       shards lives on the device from the copy until the all-gather buffer is filled.
#     * The gathered weights, the reduce-scatter input and its output are device memory as without
#       offload. Each gradient shard, a view of the reduce-scatter output, is copied to the host
#       (``new_sharded_grad.to(torch.device("cpu"), ...)``, _fsdp_collectives.py:711-743), and the host
#       copy becomes ``.grad``: the output is freed when ``foreach_reduce`` returns instead of living on
#       as the gradients.
#     The fake world's mesh is a CPU mesh, so FSDP2's device is the CPU (``_get_device_from_mesh``,
#     _fsdp_init.py:219-221) and both copies are no-ops there (``Tensor.to`` of a tensor already on
#     the device returns it). ``staged_copies`` makes them copies while a step runs, at the same two
#     places and of the same sizes (a padded shard; an unpadded gradient shard); everything else is
#     torch's own ``fully_shard`` with the policy. ``device_timeline`` then leaves out what is host
#     memory: the parameters (the shards), the gradients (the host copies), the optimizer state and
#     whatever the optimizer step and ``zero_grad`` make, since they run on the CPU. Pinning is the
#     one change to the policy: fake tensors refuse it (``NYI: aten._pin_memory.default``) and so does
#     a CPU-only torch ("Cannot access accelerator device when none is available"), and it moves no
#     byte on or off the device (pinned pages are host memory; it only lets the copies overlap
#     compute), so the simulated and the real CPU runs use ``CPUOffloadPolicy(pin_memory=False)``.
#     A real run on CPU ranks (gloo) cannot tell host from device, since both are the CPU: it checks
#     what the step saves for backward, not where the state lives.


@contextlib.contextmanager
def staged_copies(offload: bool) -> Iterator[None]:
    """While a simulated step runs, the H2D copy of each shard before its all-gather and the D2H copy of
    each reduce-scattered gradient shard, which are no-ops on the CPU mesh (Note [FSDP2's CPU offload])."""
    if not offload:
        yield
        return
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    original_inputs, original_reduce = _fsdp_param.FSDPParam.all_gather_inputs, _fsdp_param_group.foreach_reduce

    def all_gather_inputs(self: Any) -> list[torch.Tensor]:
        staged = self.offload_to_cpu and self.sharded_state == _fsdp_param.ShardedState.SHARDED
        if not staged or hasattr(self._sharded_local_tensor, "fsdp_pre_all_gather"):
            return original_inputs.fget(self)  # type: ignore[no-any-return]
        return [_fsdp_param._to_dtype_if_needed(self._sharded_param_data.clone(), self.param_dtype)]  # the H2D copy

    def foreach_reduce(fsdp_params: list[Any], *args: Any, **kwargs: Any) -> Any:
        new = [p for p in fsdp_params if p.offload_to_cpu and p.sharded_param.grad is None]
        result = original_reduce(fsdp_params, *args, **kwargs)
        for p in new:
            if p.sharded_param.grad is not None:  # the D2H copy becomes .grad; the device's view dies
                p.sharded_param.grad = p.to_sharded_dtensor(p.sharded_param.grad._local_tensor.clone())
        return result

    _fsdp_param.FSDPParam.all_gather_inputs = property(all_gather_inputs)  # type: ignore[method-assign,assignment]
    _fsdp_param_group.foreach_reduce = foreach_reduce
    try:
        yield
    finally:
        _fsdp_param.FSDPParam.all_gather_inputs = original_inputs  # type: ignore[method-assign]
        _fsdp_param_group.foreach_reduce = original_reduce


_HOST_CATEGORIES = (Category.GRADIENT, Category.OPTIMIZER_STATE)
_HOST_PHASES = (Phase.OPTIMIZER, Phase.ZERO_GRAD)


def device_timeline(timeline: Timeline) -> Timeline:
    """``timeline`` (one rank's step under CPU offload) without what lives in host memory: the
    parameters' shards, the gradient shards, the optimizer state and what the CPU's optimizer step
    makes (Note [FSDP2's CPU offload])."""
    host = {e.storage for e in timeline.events if e.alloc and (e.category in _HOST_CATEGORIES or e.phase in _HOST_PHASES)}
    kept = [i for i, e in enumerate(timeline.events) if e.storage not in host]
    events = [timeline.events[i] for i in kept]
    # a storage is numbered by its allocation's place among the events (``_Tracker._allocated_storage``
    # in fxmem/step/timeline.py; fxmem/step/repeats.py extends steps by it): number the kept ones anew
    number = {e.storage: k for k, e in enumerate(events) if e.alloc}
    return replace(
        timeline,
        baseline={c: n for c, n in timeline.baseline.items() if c != Category.PARAMETER},
        baseline_storages=tuple((c, n) for c, n in timeline.baseline_storages if c != Category.PARAMETER),
        events=tuple(replace(e, storage=number[e.storage]) for e in events),
        contexts=tuple(timeline.contexts[i] for i in kept) if timeline.contexts else (),
    )
