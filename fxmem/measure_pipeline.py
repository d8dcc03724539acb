"""The truth for a pipeline step: one rank of ``measure_ranks``'s real gloo run, its stage cut from the
real model as the simulation cuts it (``split_stages`` in fxmem/parallel/pipeline_split.py) and run by
torch's own ``PipelineStage`` and schedule, ``step()`` as a training loop calls it.

What a rank holds before its step (its baseline) is its stage's parameters and buffers, the batch
(first stage) or the targets (last stage), the optimizer state of a steady step, and the receive
buffers the stage made in its first step and keeps (Note [Pipeline schedules on a fake group] in
fxmem/step/pipeline.py). Its saved bytes are
those autograd saves in one microbatch's forward through the stage (and, on the last stage, its
loss), each storage once, leaving out that baseline: what the simulation calls the rank's saved
bytes per microbatch.

With FSDP2 inside the stages (``measure_ranks(pp=P, fsdp=N)``), each stage's module is sharded as the
simulation shards it (``shard_stage``, Note [Data parallel inside pipeline stages] in
fxmem/parallel/rank.py) on P x N processes, and its graph, whose blocks are flattened, runs through an
interpreter that calls the units' hooks where their code begins and ends (``ModuleScopes``, the
mechanism the one-rank FSDP2 tests hold to eager modules). The weights FSDP2 gathers are left out of
the saved bytes, as ``measure_ranks`` leaves them out of a sharded rank's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef

from fxmem.engine.binding import bind_inputs, storage_of
from fxmem.engine.losses import get_loss
from fxmem.engine.module_hooks import ModuleHooks, ModuleScopes
from fxmem.frontends.tracing import trace_model
from fxmem.inputs import make_input
from fxmem.measure import _optimizer
from fxmem.parallel import ParallelPlan, pipeline_meshes, shard_stage
from fxmem.parallel.fsdp import gathered_weights
from fxmem.results import Phase
from fxmem.step.pipeline import (
    PipelinePlan,
    StageGraphs,
    StageLoss,
    build_schedule,
    receive_buffers,
    schedule_stages,
    split_stages,
    stage_examples,
)
from fxmem.step.state import get_optimizer

__all__ = ["PipelineRankStep"]

Around = Callable[[Phase], contextlib.AbstractContextManager[object]]


class _Hooked(ModuleHooks, fx.Interpreter):
    """The stage's graph, its FSDP2 units' hooks called where their code begins and ends."""

    def __init__(self, gm: fx.GraphModule, scopes: ModuleScopes) -> None:
        super().__init__(gm)
        self.scopes = scopes


class _Ranged(nn.Module):
    """The stage's graph module, each forward inside the profiler's forward range; through
    ``_Hooked`` where the stage is sharded (``scopes``)."""

    def __init__(self, gm: fx.GraphModule, around: list[Around]) -> None:
        super().__init__()
        self.gm = gm
        self._around = around
        self.scopes: ModuleScopes | None = None

    def forward(self, *args: Any) -> Any:
        with self._around[0](Phase.FORWARD):
            if self.scopes is None:
                return self.gm(*args)
            return _Hooked(self.gm, self.scopes).run(*args)


class PipelineRankStep:
    """One rank's stages and schedule, built from the config ``measure_ranks`` hands every rank."""

    def __init__(self, config: dict[str, Any], rank: int) -> None:
        plan: PipelinePlan = config["pipeline"]
        sharding: ParallelPlan = config["plan"]
        rank //= sharding.world_size  # the pipeline rank of this process (Note [Data parallel inside pipeline stages])
        self.plan, self.rank, self.name = plan, rank, config["name"]
        model, specs = config["model"].train(), config["specs"]
        graphs = split_stages(trace_model(model, specs, name=self.name).gm, plan, self.name)
        self.last_loss = StageLoss(get_loss(config["loss"]), self.name, graphs.loss)
        torch.manual_seed(config["seed"])
        whole = [make_input(s, plan.microbatches * config["batch"], config["seq_len"]) for s in specs]
        bound = bind_inputs(graphs.whole, specs, whole, self.name)
        self.values = graphs.first_inputs(bound)
        first = [v[: config["batch"]] if isinstance(v, torch.Tensor) else v for v in self.values]
        local = plan.local(rank)
        examples = [stage_examples(graphs.stages, s, first) for s in local]
        self.around: list[Around] = [lambda _: contextlib.nullcontext()]
        ranged = [_Ranged(graphs.stages[s], self.around) for s in local]
        group, meshes = pipeline_meshes(plan.stages, sharding)
        if sharding.world_size > 1:
            for module in ranged:
                module.scopes = ModuleScopes.of(module.gm, shard_stage(module, module.gm, sharding, meshes, self.name), self.name)
        self.modules = nn.ModuleList(ranged)
        self.last = local[-1] == len(graphs.stages) - 1
        self.target = self._target(graphs, bound, examples[-1][1]) if self.last else None
        self.schedule = build_schedule(list(self.modules), rank, plan, examples, self._loss, group)
        self.stages = schedule_stages(self.schedule)
        for stage in self.stages:
            self._range_backward(stage)
        self.opt = _optimizer(self.modules, get_optimizer(config["optimizer"]))

    def _target(self, graphs: StageGraphs, bound: list[Any], example_out: tuple[torch.Tensor, ...]) -> Any:
        """The whole batch's target, which the schedule splits into microbatches: the labels the
        model reads on its last stage (Note [Labels as the target]), or one the loss rule makes."""
        if graphs.target is not None:
            return self.last_loss.target(graphs, bound, example_out)
        out = self.last_loss.rule.select(example_out[0] if len(example_out) == 1 else example_out, self.name)
        return self.last_loss.rule.make_target(torch.cat([out] * self.plan.microbatches))

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        with self.around[0](Phase.LOSS):
            return self.last_loss(output, target if self.target is not None else None)

    def _schedule_target(self) -> torch.Tensor | None:
        """The target handed to the schedule. A loss that makes none (``sum``) still gets one on the last
        stage: torch's schedule indexes the target's microbatch splits whenever it has a loss function
        (``_maybe_compute_loss``: ``target_mbs[mb_index]``), so it gets an empty tensor of one row per
        microbatch, 0 bytes, which ``_loss`` turns back into None."""
        if self.target is not None or not self.last:
            return self.target
        return torch.empty(self.plan.microbatches, 0)

    def _range_backward(self, stage: Any) -> None:
        original = stage.backward_one_chunk

        def backward(*args: Any, **kwargs: Any) -> Any:
            with self.around[0](Phase.BACKWARD):
                return original(*args, **kwargs)

        stage.backward_one_chunk = backward

    def step(self, around: Around) -> None:
        """One training step: the schedule's microbatches, the optimizer step, ``zero_grad``."""
        self.around[0] = around
        args = self.values if self.rank == 0 else []
        self.schedule.step(*args, target=self._schedule_target(), return_outputs=False)
        with around(Phase.OPTIMIZER):
            self.opt.step()
        with around(Phase.ZERO_GRAD):
            self.opt.zero_grad(set_to_none=True)
        self.around[0] = lambda _: contextlib.nullcontext()

    def held(self) -> list[torch.Tensor]:
        """What exists before a step: state, batch or targets, receive buffers (see the module docstring)."""
        found = [*self.modules.parameters(), *self.modules.buffers(), *(t for s in self.stages for t in receive_buffers(s))]
        found += [v for v in self.values if isinstance(v, torch.Tensor)] if self.rank == 0 else []
        found += [self.target] if isinstance(self.target, torch.Tensor) else []
        found += [t for state in self.opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        return found

    def saved_bytes(self, batch: int) -> int:
        """Bytes autograd saves in one microbatch's forward through each of the rank's stages (and the
        loss, on the last), each storage once, the baseline left out."""
        held = {StorageWeakRef(storage_of(t)) for t in [*self.held(), *gathered_weights(self.modules)]}
        saved: dict[StorageWeakRef, torch.UntypedStorage] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = storage_of(t)
            saved.setdefault(StorageWeakRef(storage), storage)
            return t

        roots = []
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for module, stage in zip(self.modules, self.stages, strict=True):
                out = module(*self._first_inputs(stage, batch))
                if stage.is_last:
                    target = self.target[:batch] if isinstance(self.target, torch.Tensor) else None
                    out = self._loss(out, target)
                roots += list(out) if isinstance(out, tuple) else [out]
        total = sum(s.nbytes() for key, s in saved.items() if key not in held)
        torch.autograd.backward(roots, [torch.ones_like(o) for o in roots])
        self.opt.zero_grad(set_to_none=True)
        return total

    def _first_inputs(self, stage: Any, batch: int) -> list[Any]:
        """The first microbatch's inputs as the stage receives them: the batch's first samples (first
        stage) or its first receive buffers, as a leaf that requires gradients."""
        if stage.is_first:
            return [v[:batch] if isinstance(v, torch.Tensor) else v for v in self.values]
        infos = stage.args_recv_info[0]
        return [i.buffer.detach().requires_grad_(i.buffer.is_floating_point()) for i in infos]
