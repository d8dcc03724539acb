"""FSDP2 (``fully_shard``) on a module tree, as a training script applies it: each unit, then the root."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from fxmem.errors import CaptureError, InputSpecError

__all__ = ["fsdp_policy", "gathered_parameters", "gathered_weights", "shard_units"]


def fsdp_policy(mixed: bool) -> MixedPrecisionPolicy:
    """FSDP2's default policy, or with ``mixed`` bf16 gathered weights and compute, fp32 reductions."""
    if not mixed:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_units(root: nn.Module, units: tuple[str, ...], mesh: DeviceMesh, reshard: bool, policy: MixedPrecisionPolicy, model: str) -> None:
    """``fully_shard`` each unit (freeing its gathered weights after forward when ``reshard``), then
    the root (which keeps them, ``fully_shard``'s default for the root)."""
    for path in units:
        try:
            unit = root.get_submodule(path)
        except AttributeError as e:
            raise InputSpecError(f"model '{model}': --fsdp unit '{path}' is not a module of the model ({e}); name a module path.") from e
        _shard(unit, path, mesh, reshard, policy, model)
    _shard(root, "", mesh, False, policy, model)


def _shard(module: nn.Module, path: str, mesh: DeviceMesh, reshard: bool, policy: MixedPrecisionPolicy, model: str) -> None:
    from torch.distributed.fsdp import fully_shard

    try:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
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
