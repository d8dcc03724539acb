"""FSDP2 (``fully_shard``) applied to a private copy of a traced graph's modules, as a training script
applies it to the model: each unit, then the root."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from fxmem.engine.module_hooks import ModuleScopes
from fxmem.errors import CaptureError, InputSpecError
from fxmem.parallel.fake_group import fake_world

__all__ = ["FsdpPlan", "gathered_parameters", "one_rank", "shard_graph"]


@dataclass(frozen=True)
class FsdpPlan:
    """How the step is sharded: ``world_size`` ranks, and the modules ``fully_shard`` wraps as units
    before it wraps the root (torchtitan's recipe: each transformer block, then the whole model)."""

    world_size: int
    units: tuple[str, ...] = ()
    reshard_after_forward: bool = True
    """FSDP2's default: a unit's gathered weights are freed after its forward and gathered again for
    its backward (the root's are kept, as ``fully_shard`` does for the root by default)."""
    mixed: bool = False
    """``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: weights
    gathered and computed in bf16, gradients reduced in fp32 into fp32 shards."""

    def policy(self) -> MixedPrecisionPolicy:
        """The ``mp_policy`` every ``fully_shard`` call gets."""
        if not self.mixed:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or isinstance(self.world_size, bool) or self.world_size < 1:
            raise InputSpecError(f"--fsdp needs a whole number of ranks, 1 or more; got {self.world_size!r}.")

    def within(self, gm: fx.GraphModule) -> FsdpPlan:
        """The plan for ``gm``, a copy of the model cut to fewer blocks (Note [Repeated blocks] in
        fxmem/frontends/blocks.py): the units it still has."""
        present = {name for name, _ in gm.named_modules()}
        return replace(self, units=tuple(u for u in self.units if u in present))

    @property
    def paths(self) -> tuple[str, ...]:
        """Every module ``fully_shard`` wraps, the root ("") last."""
        return (*self.units, "")


# Note [Sharding a copy of the graph]
#     ``fully_shard`` changes the module it wraps: its class, its hooks, its parameters (now DTensors
#     holding one rank's shard). A traced GraphModule shares its parameters and its ``torch.nn``
#     leaves with the user's model, so the step shards a deep copy of the graph module, made while its
#     state is fake (``swapped_state``), which costs no real memory. The copy keeps the module paths
#     and node names of the original, so everything the step records is named as without sharding.


def shard_graph(gm: fx.GraphModule, plan: FsdpPlan, mesh: DeviceMesh, model: str = "model") -> fx.GraphModule:
    """A copy of ``gm`` with ``fully_shard`` applied to ``plan``'s units and then its root."""
    with warnings.catch_warnings():  # deepcopy asks each fake parameter for its data pointer, which fake tensors warn of
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
        sharded = copy.deepcopy(gm)
    for path in plan.units:
        try:
            unit = sharded.get_submodule(path)
        except AttributeError as e:
            raise InputSpecError(f"model '{model}': --fsdp unit '{path}' is not a module of the model ({e}); name a module path.") from e
        _shard(unit, path, mesh, plan.reshard_after_forward, plan.policy(), model)
    _shard(sharded, "", mesh, False, plan.policy(), model)
    return sharded


@contextlib.contextmanager
def one_rank(
    plan: FsdpPlan, gm: fx.GraphModule, mode: FakeTensorMode, model: str = "model"
) -> Iterator[tuple[fx.GraphModule, ModuleScopes]]:
    """For the length of one pass: ``gm`` sharded as rank 0 of ``plan`` holds it (its state already
    fake, in ``mode``), on a fake process group, and the scopes of the modules whose hooks the pass calls."""
    with fake_world(plan.world_size, model) as mesh:
        with mode:
            sharded = shard_graph(gm, plan, mesh, model)
        yield sharded, ModuleScopes.of(sharded, plan.paths, model)


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


def gathered_parameters(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """{parameter name: the full-size parameter FSDP2 gathers it into}, for the parameters gathered
    so far: the forward uses those, so autograd accumulates their gradients before they are sharded."""
    names = {id(p): name for name, p in gm.named_parameters()}
    found: dict[str, torch.Tensor] = {}
    for module in gm.modules():
        state = getattr(module, "_get_fsdp_state", None)
        if state is None:
            continue
        for group in state()._fsdp_param_groups:
            for param in group.fsdp_params:
                gathered = getattr(param, "_unsharded_param", None)
                if gathered is not None and id(param.sharded_param) in names:
                    found[names[id(param.sharded_param)]] = gathered
    return found
