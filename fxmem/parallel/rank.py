"""One rank of a composed parallel run: the plan (FSDP2's degree and units, tensor parallel's degree
and layers), the device mesh it runs on, and the plan applied to a private copy of a traced graph, or
to the real model a multi-process run measures, by the same code."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from fxmem.engine.binding import fake_like
from fxmem.engine.capture import SymbolicUnsupported, node_fqn
from fxmem.engine.module_hooks import ModuleScopes, within
from fxmem.errors import CaptureError, InputSpecError
from fxmem.frontends.checkpointing import deepcopy_graph
from fxmem.parallel.fake_group import fake_world
from fxmem.parallel.fsdp import fsdp_policy, offload_policy, shard_units, staged_copies
from fxmem.parallel.tensor import TpLayer, apply_tp, fused_split_error

__all__ = ["Meshes", "ParallelPlan", "apply_plan", "meshes_outside", "one_rank", "pipeline_meshes", "plan_mesh", "shard_graph", "shard_stage"]

Meshes = tuple[DeviceMesh | None, DeviceMesh | None]
"""(the FSDP2 mesh, the tensor-parallel mesh); None where that parallelism is off."""


@dataclass(frozen=True)
class ParallelPlan:
    """How one step is divided among ``fsdp * tp`` ranks: FSDP2 over ``fsdp`` data-parallel ranks
    (``units`` wrapped first, then the root) and tensor parallel over ``tp`` ranks (``tp_layers``),
    composed as torchtitan composes them: tensor parallel first, on the inner dimension of a 2-D mesh,
    then ``fully_shard`` on the outer one."""

    fsdp: int = 1
    units: tuple[str, ...] = ()
    reshard_after_forward: bool = True
    """FSDP2's default: a unit's gathered weights are freed after its forward and gathered again for
    its backward (the root's are kept, as ``fully_shard`` does for the root by default)."""
    mixed: bool = False
    """``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: weights
    gathered and computed in bf16, gradients reduced in fp32 into fp32 shards."""
    tp: int = 1
    tp_layers: tuple[TpLayer, ...] = ()
    offload: bool = False
    """``CPUOffloadPolicy``: the shards, their gradients and the optimizer state in host memory, each
    unit's shards copied to the device for its all-gather (Note [FSDP2's CPU offload] in fxmem/parallel/fsdp.py)."""

    def __post_init__(self) -> None:
        for option, value in (("--fsdp", self.fsdp), ("--tp", self.tp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputSpecError(f"{option} needs a whole number of ranks, 1 or more; got {value!r}.")

    @property
    def world_size(self) -> int:
        return self.fsdp * self.tp

    def policy(self) -> MixedPrecisionPolicy:
        """The ``mp_policy`` every ``fully_shard`` call gets."""
        return fsdp_policy(self.mixed)

    def within(self, gm: fx.GraphModule) -> ParallelPlan:
        """The plan for ``gm``, a copy of the model cut to fewer blocks (Note [Repeated blocks] in
        fxmem/frontends/blocks.py): the units and layers it still has."""
        present = {name for name, _ in gm.named_modules()}
        return replace(
            self, units=tuple(u for u in self.units if u in present), tp_layers=tuple(t for t in self.tp_layers if t.path in present)
        )

    @property
    def paths(self) -> tuple[str, ...]:
        """Every module ``fully_shard`` wraps, the root ("") last."""
        return (*self.units, "") if self.fsdp > 1 else ()

    def describe(self) -> str:
        """The run in words, for the step's path and the report's header."""
        offload = ", CPU offload" if self.offload else ""
        parts = [f"FSDP2 over {self.fsdp} (fully_shard on {len(self.units)} units and the root{offload})"] if self.fsdp > 1 else []
        sequence = ", sequence parallel" if any(t.style.startswith("sequence_") for t in self.tp_layers) else ""
        parts += [f"tensor parallel over {self.tp} ({len(self.tp_layers)} layers{sequence})"] if self.tp > 1 else []
        return " x ".join(parts)


def plan_mesh(plan: ParallelPlan) -> Meshes:
    """(the FSDP2 mesh, the tensor-parallel mesh) of the process group this process is in: one
    dimension for one parallelism, ("dp", "tp") for both. Made outside any fake mode: a mesh holds
    real rank numbers, which it reads to find this rank's coordinates."""
    if plan.fsdp > 1 and plan.tp > 1:
        mesh = init_device_mesh("cpu", (plan.fsdp, plan.tp), mesh_dim_names=("dp", "tp"))
        return mesh["dp"], mesh["tp"]
    mesh = init_device_mesh("cpu", (plan.world_size,))
    return (mesh, None) if plan.fsdp > 1 else (None, mesh)


def apply_plan(root: nn.Module, plan: ParallelPlan, meshes: Meshes, model: str = "model") -> None:
    """Apply ``plan`` to ``root`` in place, on ``meshes`` (``plan_mesh``'s)."""
    dp, tp = meshes
    if tp is not None:
        apply_tp(root, plan.tp_layers, tp, model)
    if dp is not None:
        shard_units(root, plan.units, dp, plan.reshard_after_forward, plan.policy(), model, offload_policy(plan.offload))


# Note [Data parallel inside pipeline stages]
#     torchtitan composes pipeline parallel with FSDP2 and tensor parallel on one device mesh whose
#     outermost dimension is the pipeline's ("pp", then "dp_shard", then "tp": torchtitan/distributed/
#     parallel_dims.py), so a stage's data- and tensor-parallel peers are consecutive ranks and pipeline
#     rank p is global rank p x (fsdp x tp). Each stage's module is parallelized on its own
#     (``parallelize_module`` on its layers, ``fully_shard`` on its blocks and then on the stage's
#     module, torchtitan/models/llama3/infra/parallelize.py) and handed to ``PipelineStage`` with the
#     "pp" dimension's group. The stage's module must be the FSDP2 root: ``PipelineStage`` checks
#     ``isinstance(submod, FSDPModule)`` to keep gradients unreduced and gathered weights unfreed across
#     the microbatches' backwards (``backward_maybe_with_nosync``) and to reduce-scatter once after the
#     last (``perform_reduce_grad``: each group's ``post_backward``), torch/distributed/pipelining/stage.py.
#     fxmem does the same on the simulated rank and on the real ones; the blocks inside a stage's
#     graph are flattened, so their hooks fire through ``ModuleScopes`` in both (Note [Module hooks on
#     a flattened graph] in fxmem/engine/module_hooks.py), which the one-rank FSDP2 tests hold to eager.


def pipeline_meshes(stages: int, plan: ParallelPlan | None) -> tuple[dist.ProcessGroup | None, Meshes]:
    """The pipeline's process group and (the FSDP2 mesh, the tensor-parallel mesh) of this process in a
    world of ``stages x plan.world_size`` ranks (Note [Data parallel inside pipeline stages]); (None,
    (None, None)) for a pipeline alone, whose group is the whole world. Made outside any fake mode."""
    if plan is None or plan.world_size == 1:
        return None, (None, None)
    dims = [("pp", stages), ("dp", plan.fsdp), ("tp", plan.tp)]
    kept = [(d, n) for d, n in dims if n > 1 or d == "pp"]
    mesh = init_device_mesh("cpu", tuple(n for _, n in kept), mesh_dim_names=tuple(d for d, _ in kept))
    return mesh["pp"].get_group(), (mesh["dp"] if plan.fsdp > 1 else None, mesh["tp"] if plan.tp > 1 else None)


def shard_stage(stage: nn.Module, gm: fx.GraphModule, plan: ParallelPlan, meshes: Meshes, model: str = "model") -> tuple[str, ...]:
    """Apply ``plan`` to one pipeline stage in place: the units and layers of it that ``gm`` (the
    stage's graph, a submodule of ``stage``) holds, then ``fully_shard`` on ``stage`` itself, the
    module ``PipelineStage`` calls (Note [Data parallel inside pipeline stages]). Returns the modules
    of ``gm`` whose hooks a run of the graph must call where their code begins and ends."""
    prefix = next(name for name, child in stage.named_children() if child is gm)
    local = plan.within(gm)
    inside = lambda path: f"{prefix}.{path}" if path else prefix
    placed = replace(local, units=tuple(inside(u) for u in local.units), tp_layers=tuple(replace(t, path=inside(t.path)) for t in local.tp_layers))
    apply_plan(stage, placed, meshes, model)
    hooked = (*local.units, *_flattened(gm, local.tp_layers))
    _read_arguments_past_casts(gm, hooked)
    return hooked


# Note [Sharding a copy of the graph]
#     ``fully_shard`` and ``parallelize_module`` change the modules they are given: their class, their
#     hooks, their parameters (now DTensors holding one rank's shard). A traced GraphModule shares its
#     parameters and its ``torch.nn`` leaves with the user's model, so the step shards a deep copy of
#     the graph module, made while its state is fake (``swapped_state``), which costs no real memory.
#     The copy keeps the module paths and node names of the original, so everything the step records
#     is named as without sharding. ``copy.deepcopy`` of a fake tensor makes one in a new fake mode,
#     whose ops the pass's mode sees as foreign inputs and copies (a view of a tied weight would get
#     a storage of its own and count as an activation), so the copy's state is made in the pass's
#     mode instead, each tensor once (tied weights stay tied).


def shard_graph(gm: fx.GraphModule, plan: ParallelPlan, meshes: Meshes, mode: FakeTensorMode, model: str = "model") -> fx.GraphModule:
    """A copy of ``gm`` (its state fake, in ``mode``) with ``plan`` applied on ``meshes``."""
    memo: dict[int, object] = {}
    with mode:
        for t in (*gm.parameters(), *gm.buffers()):
            memo.setdefault(id(t), fake_like(t))
    sharded = deepcopy_graph(gm, memo)
    with mode, meshes_outside():
        apply_plan(sharded, plan, meshes, model)
    return sharded


# Note [Meshes made while sharding]
#     ``fully_shard`` over parameters that tensor parallel already made DTensors joins the two meshes
#     into one (``DeviceMesh._concatenate`` in FSDPParam._init_sharding_spec_tp), and a new mesh reads
#     its own rank numbers from a tensor of them to find this rank's coordinates. Inside the pass's
#     fake mode that tensor would be fake and the coordinates unknowable, so meshes are joined with
#     the fake mode set aside: they are a few integers of bookkeeping, not the step's memory.


@contextlib.contextmanager
def meshes_outside() -> Iterator[None]:
    """Join device meshes outside the fake mode while the plan is applied (Note [Meshes made while sharding])."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    original = DeviceMesh._concatenate

    def concatenate(meshes: list[DeviceMesh]) -> DeviceMesh:
        with unset_fake_temporarily():
            return original(meshes)

    DeviceMesh._concatenate = staticmethod(concatenate)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(original)  # type: ignore[method-assign]


@contextlib.contextmanager
def one_rank(
    plan: ParallelPlan, gm: fx.GraphModule, mode: FakeTensorMode, model: str = "model"
) -> Iterator[tuple[fx.GraphModule, ModuleScopes]]:
    """For the length of one pass: ``gm`` as rank 0 of ``plan`` holds it (its state already fake, in
    ``mode``), on a fake process group, and the scopes of the modules whose hooks the pass calls: the
    FSDP2 units and root, and the tensor-parallel layers that are not calls of their own in the graph."""
    with fake_world(plan.world_size, model), staged_copies(plan.offload):
        sharded = shard_graph(gm, plan, plan_mesh(plan), mode, model)
        hooked = (*plan.paths, *_flattened(sharded, plan.tp_layers))
        _read_arguments_past_casts(sharded, hooked)
        with _explained_tp_failures(gm, plan, model):
            yield sharded, ModuleScopes.of(sharded, hooked, model)


@contextlib.contextmanager
def _explained_tp_failures(gm: fx.GraphModule, plan: ParallelPlan, model: str) -> Iterator[None]:
    """A pass that fails after a column-wise layer's output is split says so
    (Note [A fused projection split after a column-wise shard] in fxmem/parallel/tensor.py)."""
    try:
        yield
    except CaptureError as e:
        explained = fused_split_error(gm, plan.tp_layers, getattr(e, "node", ""), e.__cause__ or e, plan.tp, model)
        if explained is None:
            raise
        raise explained from e
    except SymbolicUnsupported as e:  # the concrete passes raise the symbolic pass's error where they fail alike
        if e.error is not None:
            e.error = fused_split_error(gm, plan.tp_layers, e.node, e.error.__cause__ or e.error, plan.tp, model) or e.error
        raise


def _flattened(gm: fx.GraphModule, layers: tuple[TpLayer, ...]) -> tuple[str, ...]:
    """The layers whose code the graph holds inline (torch.export's), rather than as a call of the
    module (torch.fx's leaves), which fires its hooks itself."""
    called = {str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    return tuple(t.path for t in layers if t.path not in called)


# Note [A module's argument behind a no-op cast]
#     HF's RMSNorm begins with ``hidden_states.to(torch.float32)``, which on a float32 input returns
#     the tensor itself; torch.export records an ``aten.to`` node all the same, and since the decoder
#     layer's residual is that same tensor, the residual add after the norm reads the cast node
#     (the same effect as Note [Outputs behind a cast that was a no-op when exported] in
#     fxmem/frontends/exporting.py). The cast then counts as a second output of the norm, and the
#     norm's forward hooks (sequence parallel's: Note [Sequence parallel] in
#     fxmem/parallel/tensor.py) get two values where eager's get its one output. In eager the add
#     reads the caller's own tensor, so in the sharded copy a read after a hooked module of such a
#     cast of the module's argument reads the argument again, the caller's value
#     (Note [Module hooks on a flattened graph] in fxmem/engine/module_hooks.py). The cast
#     allocates nothing, so nothing the step records changes but who holds the value.

_CASTS = (torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout)


def _read_arguments_past_casts(gm: fx.GraphModule, paths: tuple[str, ...]) -> None:
    """Reads after a hooked module of a no-op cast of its argument read the argument
    (Note [A module's argument behind a no-op cast])."""
    for n in gm.graph.nodes:
        owner = max((p for p in paths if p and within(node_fqn(n), p)), key=len, default=None)  # the innermost
        if owner is None or not _noop_cast(n) or within(node_fqn(n.args[0]), owner):
            continue
        for user in [u for u in n.users if not within(node_fqn(u), owner)]:
            user.replace_input_with(n, n.args[0])
    gm.recompile()


def _noop_cast(n: fx.Node) -> bool:
    if n.target not in _CASTS or not n.args or not isinstance(n.args[0], fx.Node) or n.kwargs.get("copy", False):
        return False
    before, after = n.args[0].meta.get("val"), n.meta.get("val")
    return isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.dtype == after.dtype
