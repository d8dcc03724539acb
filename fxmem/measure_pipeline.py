"""The truth for a pipeline step: one rank of ``measure_ranks``'s real gloo run, its stage cut from the
real model as the simulation cuts it (``split_stages`` in fxmem/parallel/pipeline.py) and run by
torch's own ``PipelineStage`` and schedule, ``step()`` as a training loop calls it.

What a rank holds before its step (its baseline) is its stage's parameters and buffers, the batch
(first stage) or the targets (last stage), the optimizer state of a steady step, and the receive
buffers the stage made in its first step and keeps (Note [Pipeline stages]). Its saved bytes are
those autograd saves in one microbatch's forward through the stage (and, on the last stage, its
loss), each storage once, leaving out that baseline: what the simulation calls the rank's saved
bytes per microbatch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef

from fxmem.engine.binding import bind_inputs, storage_of
from fxmem.engine.losses import Loss, get_loss
from fxmem.frontends.tracing import trace_model
from fxmem.inputs import make_input
from fxmem.measure import _optimizer
from fxmem.parallel.pipeline import PipelinePlan, build_schedule, receive_buffers, split_stages, stage_examples
from fxmem.results import Phase
from fxmem.step.state import get_optimizer

__all__ = ["PipelineRankStep"]

Around = Callable[[Phase], contextlib.AbstractContextManager[object]]


class _Ranged(nn.Module):
    """The stage's graph module, each forward inside the profiler's forward range."""

    def __init__(self, gm: fx.GraphModule, around: list[Around]) -> None:
        super().__init__()
        self.gm = gm
        self._around = around

    def forward(self, *args: Any) -> Any:
        with self._around[0](Phase.FORWARD):
            return self.gm(*args)


class PipelineRankStep:
    """One rank's stage and schedule, built from the config ``measure_ranks`` hands every rank."""

    def __init__(self, config: dict[str, Any], rank: int) -> None:
        plan: PipelinePlan = config["pipeline"]
        self.plan, self.rank, self.name = plan, rank, config["name"]
        model, specs = config["model"].train(), config["specs"]
        stages = split_stages(trace_model(model, specs, name=self.name).gm, plan, self.name)
        self.loss_rule: Loss = get_loss(config["loss"])
        torch.manual_seed(config["seed"])
        whole = [make_input(s, plan.microbatches * config["batch"], config["seq_len"]) for s in specs]
        self.values = bind_inputs(stages[0], specs, whole, self.name)
        first = [v[: config["batch"]] if isinstance(v, torch.Tensor) else v for v in self.values]
        example_in, example_out = stage_examples(stages, rank, first)
        self.around: list[Around] = [lambda _: contextlib.nullcontext()]
        self.module = _Ranged(stages[rank], self.around)
        self.last = rank == plan.stages - 1
        out = self.loss_rule.select(example_out[0] if len(example_out) == 1 else example_out, self.name)
        self.target = self.loss_rule.make_target(torch.cat([out] * plan.microbatches)) if self.last else None
        self.schedule = build_schedule(self.module, rank, plan, example_in, example_out, self._loss)
        self._range_backward()
        self.opt = _optimizer(self.module, get_optimizer(config["optimizer"]))

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        with self.around[0](Phase.LOSS):
            return self.loss_rule.compute(self.loss_rule.select(output, self.name), target)

    def _range_backward(self) -> None:
        stage = self.schedule._stage
        original = stage.backward_one_chunk

        def backward(*args: Any, **kwargs: Any) -> Any:
            with self.around[0](Phase.BACKWARD):
                return original(*args, **kwargs)

        stage.backward_one_chunk = backward

    def step(self, around: Around) -> None:
        """One training step: the schedule's microbatches, the optimizer step, ``zero_grad``."""
        self.around[0] = around
        args = self.values if self.rank == 0 else []
        self.schedule.step(*args, target=self.target, return_outputs=False)
        with around(Phase.OPTIMIZER):
            self.opt.step()
        with around(Phase.ZERO_GRAD):
            self.opt.zero_grad(set_to_none=True)
        self.around[0] = lambda _: contextlib.nullcontext()

    def held(self) -> list[torch.Tensor]:
        """What exists before a step: state, batch or targets, receive buffers (see the module docstring)."""
        found = [*self.module.parameters(), *self.module.buffers(), *receive_buffers(self.schedule._stage)]
        found += [v for v in self.values if isinstance(v, torch.Tensor)] if self.rank == 0 else []
        found += [self.target] if isinstance(self.target, torch.Tensor) else []
        found += [t for state in self.opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        return found

    def saved_bytes(self, batch: int) -> int:
        """Bytes autograd saves in one microbatch's forward (and loss, last stage), each storage once,
        the baseline left out."""
        held = {StorageWeakRef(storage_of(t)) for t in self.held()}
        saved: dict[StorageWeakRef, torch.UntypedStorage] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = storage_of(t)
            saved.setdefault(StorageWeakRef(storage), storage)
            return t

        inputs = self._first_inputs(batch)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.module(*inputs)
            if self.last:
                target = self.target[:batch] if isinstance(self.target, torch.Tensor) else None
                out = self._loss(out, target)
        total = sum(s.nbytes() for key, s in saved.items() if key not in held)
        outputs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
        self.opt.zero_grad(set_to_none=True)
        return total

    def _first_inputs(self, batch: int) -> list[Any]:
        """The first microbatch's inputs as the stage receives them: the batch's first samples (first
        stage) or its first receive buffers, as a leaf that requires gradients."""
        if self.rank == 0:
            return [v[:batch] if isinstance(v, torch.Tensor) else v for v in self.values]
        infos = self.schedule._stage.args_recv_info[0]
        return [i.buffer.detach().requires_grad_(i.buffer.is_floating_point()) for i in infos]
