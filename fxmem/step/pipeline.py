"""Pipeline parallel, the step: each rank's training step simulated by running torch's own pipeline
schedule on a fake process group, over the stages ``split_stages`` cut (fxmem/parallel/pipeline_split.py,
Note [Pipeline stages] there); its results are fxmem/parallel/pipeline_report.py's.

Note [Pipeline schedules on a fake group]
    Which microbatch runs forward or backward when, and so how many microbatches' saved tensors a
    stage holds at each moment, is not a formula here: the step of rank r is torch's own
    ``PipelineStage`` and ``ScheduleGPipe`` / ``Schedule1F1B`` (torch/distributed/pipelining/
    stage.py, schedules.py), run as rank r of a fake process group of P ranks
    (Note [A fake process group] in fxmem/parallel/fake_group.py) under the timeline's tracker
    (Note [How the timeline sees memory] in fxmem/step/timeline.py), the stage's submodule running
    fxmem's interpreter over the stage's graph. Its ``_step_microbatches`` (what ``step()`` calls after
    splitting the batch) decides the order: GPipe runs every forward, then every backward (M
    microbatches in flight on every stage); 1F1B warms up with ``num_stages - stage_index`` forwards
    and then alternates a backward and a forward (``Schedule1F1B._step_microbatches``), so stage s
    holds at most P - s microbatches. torch's schedule IR for 1F1B (``Schedule1F1B._get_pipeline_order``)
    was not used: on torch 2.13 it lists the last rank's forwards as 1..M (no microbatch 0), while the
    runtime runs 0..M-1. Everything else the schedule does is seen as it allocates: the receive
    buffers (one per microbatch for the activations a non-first stage receives and for the gradients
    a non-last stage receives, made when the schedule first runs and kept by the stage, so they are
    the step's baseline, as ``measure_ranks`` counts them), the stage outputs it caches until their
    backward, the gradient scaling by 1/M after the last backward (``perform_reduce_grad``). The
    fake process group's send and receive return at once, so the receive buffers keep whatever they
    hold, which fake tensors do not have. Two things are set, not inferred: the stage's input and
    output shapes are given to ``PipelineStage`` (its static mode; the dynamic one exchanges them
    with the neighbours, which a fake group cannot), and the warm-up vote that picks the mode, a
    tensor received from the neighbour, is skipped (a fake receive would read 0, "dynamic").
    ``step()`` runs with ``return_outputs=False``: the last stage would otherwise keep every
    microbatch's output (the logits) until the next step begins. Where the model reads its labels
    on the last stage only, they are the schedule's target and its ``loss_fn`` runs the loss graph
    (Note [Labels as the target] in fxmem/parallel/pipeline_split.py), in the loss phase.

    The interleaved schedule runs the same way with several stages per rank (stage i on rank i mod
    P): ``ScheduleInterleaved1F1B`` is a ``_PipelineScheduleRuntime`` that executes a precomputed
    order of actions (forward, full backward, send, receive, per stage and microbatch), in which rank
    r warms up with (V - 1) x M / rounds + 2 (P - 1 - r) forwards (``_get_warmup_ops``, rounds =
    max(1, M // P)) before it alternates; the simulation builds one ``PipelineStage`` per local
    stage, as a real rank does, and the same static shapes and skipped vote.

Note [Sends a real rank holds]
    A real backend's send keeps the tensor it sends for as long as its work object lives, after
    ``wait()`` too (gloo's ``SendWork`` holds ``tensor_``, torch/csrc/distributed/c10d/
    ProcessGroupGloo.cpp; NCCL's work stashes its tensors likewise), and the schedules keep their
    send works in local variables: ``Schedule1F1B._step_microbatches`` keeps the first warm-up
    forward's ``send_work`` until after its 1F1B loop, GPipe's ``fwd_sends_to_wait`` lives until the
    step ends. The stage output of microbatch 0 thus outlives its backward on a real first stage
    (measured: a 1F1B first stage on gloo peaked 8,192 B above a simulation without this, one
    (B, S, D) fp32 output of the zoo GPT test config at B=4). The fake group's works hold nothing,
    so for the simulated step each work ``_batch_p2p`` returns is wrapped with the tensors its
    operations send, which it keeps as the real work does. ``ScheduleInterleaved1F1B`` keeps every
    send's work in ``send_ops`` until its step ends (``_PipelineScheduleRuntime._step_microbatches``),
    so there every stage output it sends lives until then.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from fxmem.engine.binding import bind_inputs, fake_like, storage_of
from fxmem.engine.capture import LOSS_NODE, FakeBatch, fake_batch, quiet_fake_tensor_log
from fxmem.engine.dispatch import OpRuleMode
from fxmem.engine.losses import Loss
from fxmem.engine.module_hooks import ModuleScopes
from fxmem.errors import CaptureError, InputSpecError
from fxmem.inputs import InputSpec, make_input
from fxmem.parallel import ParallelPlan, gathered_parameters, pipeline_meshes, shard_stage
from fxmem.parallel.pipeline_report import OneGpu, PipelineRank, PipelineRun, RankChange
from fxmem.parallel.pipeline_split import PipelinePlan, Schedule, StageGraphs, pipeline_plan, split_stages
from fxmem.parallel.rank import Meshes, meshes_outside
from fxmem.results import Category, Phase, Timeline
from fxmem.rules.optimizers import OptimizerRule
from fxmem.step import timeline as tl
from fxmem.symbolic import ByteExpr

__all__ = [
    "OneGpu",
    "PipelinePlan",
    "PipelineRank",
    "PipelineRun",
    "RankChange",
    "Schedule",
    "StageGraphs",
    "StageLoss",
    "StageStep",
    "build_schedule",
    "pipeline_plan",
    "pipeline_world",
    "receive_buffers",
    "schedule_stages",
    "simulate_stage",
    "split_stages",
    "stage_examples",
]  # fmt: skip


# The fake process group and torch's schedule ----------------------------------------------------------------------


@contextlib.contextmanager
def pipeline_world(rank: int, size: int, name: str = "model") -> Iterator[None]:
    """A fake process group of ``size`` ranks in which this process is ``rank`` (Note [A fake process group])."""
    if dist.is_initialized():
        raise InputSpecError(
            f"model '{name}': this process already has a torch.distributed process group, and simulating a pipeline "
            f"rank needs its own fake one; run fxmem outside the distributed job."
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def build_schedule(
    submodules: Sequence[nn.Module],
    rank: int,
    plan: PipelinePlan,
    examples: Sequence[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]],
    loss_fn: Callable[..., Any],
    group: dist.ProcessGroup | None = None,
) -> Any:
    """torch's stages and schedule for ``rank`` (a submodule and its (inputs, outputs) example per
    stage of ``plan.local(rank)``), static shapes given (Note [Pipeline schedules on a fake group]);
    used by the simulation and the real ranks alike. ``group``: the pipeline's own process group
    where the stages are sharded too (Note [Data parallel inside pipeline stages] in
    fxmem/parallel/rank.py); None for the whole world."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    count = len(plan.bounds)
    stages: list[Any] = [
        PipelineStage(
            module, s, count, torch.device("cpu"), input_args=_with_grad(inputs, s > 0), output_args=_with_grad(outputs, True), group=group
        )
        for module, s, (inputs, outputs) in zip(submodules, plan.local(rank), examples, strict=True)
    ]
    if plan.schedule is Schedule.INTERLEAVED:
        return ScheduleInterleaved1F1B(stages, plan.microbatches, loss_fn=loss_fn)
    kind = ScheduleGPipe if plan.schedule is Schedule.GPIPE else Schedule1F1B
    return kind(stages[0], plan.microbatches, loss_fn=loss_fn)


def schedule_stages(schedule: Any) -> list[Any]:
    """The ``PipelineStage``s a schedule runs on this rank (one, or several for a looped schedule)."""
    return list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]


def _with_grad(tensors: tuple[torch.Tensor, ...], grad: bool) -> tuple[torch.Tensor, ...]:
    """Example tensors as the stage sees them: floating ones that carry gradients require them (a
    static stage derives its gradient buffers from these)."""
    return tuple(t.detach().requires_grad_(grad and t.is_floating_point()) for t in tensors)


def stage_examples(
    stages: Sequence[nn.Module], rank: int, first: Sequence[Any]
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(inputs, outputs) of stage ``rank`` for one microbatch whose model inputs are ``first``, by
    running the stages up to it without gradients."""
    values: tuple[Any, ...] = tuple(first)
    with torch.no_grad():
        for s in range(rank + 1):
            inputs = values
            out = stages[s](*values)
            values = out if isinstance(out, tuple) else (out,)
    return tuple(inputs), tuple(values)


# One rank's step, simulated ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageStep:
    """One rank's simulated first step, and the bytes autograd saved for one microbatch's forward
    (and, on the last stage, its loss) per node, sized as the timeline sizes them."""

    timeline: Timeline
    saved: Mapping[str, ByteExpr]
    marks: tuple[tuple[int, int], ...] = ()
    """Where each microbatch's forward began (+1) and its backward ended (-1), as storage numbers
    (the number the next allocation gets): the microbatches in flight at an allocation are the sum
    of the marks at or before its number."""


class _StageModule(nn.Module):
    """The submodule ``PipelineStage`` calls: fxmem's interpreter over the stage's graph."""

    def __init__(self, gm: fx.GraphModule, run: Callable[..., Any]) -> None:
        super().__init__()
        self.gm = gm
        self._run = run

    def forward(self, *args: Any) -> Any:
        return self._run(*args)


def simulate_stage(
    graphs: StageGraphs,
    rank: int,
    plan: PipelinePlan,
    specs: Sequence[InputSpec],
    *,
    loss: Loss,
    optimizer: OptimizerRule,
    batch: int | None,
    target: tl.StepTarget,
    model: str = "model",
    seq: int | None = None,
    parallel: ParallelPlan | None = None,
) -> StageStep:
    """Rank ``rank``'s first training step (``batch`` the microbatch, None: symbolic B), its ops as
    ``target`` runs them, torch's schedule run on a fake process group under the timeline's tracker
    (Note [Pipeline schedules on a fake group]). With ``parallel``, each stage is sharded by it too,
    on a world of ``plan.stages x parallel.world_size`` ranks (Note [Data parallel inside pipeline
    stages] in fxmem/parallel/rank.py), and the step is the pipeline rank's first data- and
    tensor-parallel rank's."""
    kernels = target.kernels

    fake = fake_batch(specs, batch, seq, target.state_dtype)
    local = plan.local(rank)
    width = parallel.world_size if parallel is not None else 1
    with quiet_fake_tensor_log(), pipeline_world(rank * width, plan.stages * width, model):
        group, meshes = pipeline_meshes(plan.stages, parallel)
        held = _fake_copies(graphs.stages[: local[-1] + 1], fake)
        bound = [bind_inputs(graphs.whole, specs, m, model) for m in _microbatches(fake, specs, plan.microbatches, seq)]
        first = [tuple(graphs.first_inputs(b)) for b in bound]
        args = first if rank == 0 else [() for _ in bound]
        tracker = tl._Tracker(target.rules, target.workspaces)
        last = len(graphs.stages) - 1 in local
        loss_graph = _fake_copies([graphs.loss], fake)[0] if graphs.loss is not None and last else None
        run = _Run(
            tracker, fake, StageLoss(loss, model, loss_graph, _interpreted(loss_graph, tracker, fake, model, kernels)), model, kernels
        )
        with fake.mode:
            examples = [stage_examples(held, s, first[0]) for s in local]
            modules = [_StageModule(held[s], run.forward_of(held[s])) for s in local]
            if parallel is not None:
                run.shard(modules, parallel, meshes)
            schedule = build_schedule(modules, rank, plan, examples, run.loss, group)
            targets = _targets(graphs, loss, examples[-1][1], bound, plan, last, model)
            _initialize(schedule, args[0], targets)
        params = {name: p for s in local for name, p in held[s].named_parameters()}
        tracker._sharded = parallel is not None
        _adopt_baseline(tracker, [held[s] for s in local], schedule_stages(schedule), [list(a) for a in args], targets or [])
        with fake.mode:
            trainable = [p for p in params.values() if p.requires_grad]
            opt = optimizer.make(trainable, target.optimizer_impl) if trainable else None
            resizes = tl._resizes_seen(tracker) if parallel is not None else contextlib.nullcontext()
            with tracker, OpRuleMode({}, {}, target.layouts), tl._host_rng_states(tracker), _sends_held(), resizes:
                categories = run.step(schedule, args, targets, opt, params)
    fake.check_symbols()
    timeline = tl._timeline(tracker, categories, batch, fake)
    return StageStep(timeline, _saved_per_node(timeline, run.first_saved - tracker.communication), tuple(run.marks))


def _interpreted(
    gm: fx.GraphModule | None, tracker: Any, fake: FakeBatch, model: str, kernels: Callable[[], AbstractContextManager[object]]
) -> Callable[..., Any] | None:
    """``gm`` run by the timeline's interpreter, its nodes charged as a stage's are."""

    if gm is None:
        return None
    return lambda *values: tl._Forward(gm, tracker, fake, model, kernels).run(*values)


@dataclass(frozen=True)
class StageLoss:
    """The last stage's ``loss_fn(output, target)``: where the model reads its labels there only,
    first the loss graph on the stage's outputs and the labels' microbatch (Note [Labels as the
    target] in fxmem/parallel/pipeline_split.py), then the loss rule on what it returns. The same
    on a real rank (fxmem/measure_pipeline.py), ``run`` there the loss graph itself."""

    rule: Loss
    model: str
    graph: fx.GraphModule | None = None
    run: Callable[..., Any] | None = None
    """How to run ``graph`` (default: call it); the simulation runs it through fxmem's interpreter."""

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        if self.graph is not None:
            values = output if isinstance(output, tuple) else (output,)
            output, target = (self.run or self.graph)(*values, target), None
        return self.rule.compute(self.rule.select(output, self.model), target)

    def target(self, graphs: StageGraphs, bound: Sequence[Any], example_out: Any) -> Any:
        """The target of one microbatch (or of the batch), from its bound model inputs."""
        if graphs.target is not None:
            if self.rule.own is False and self.rule.target(self.rule.select(example_out, self.model)) is not None:
                raise InputSpecError(
                    f"model '{self.model}': its last pipeline stage reads the input "
                    f"'{graphs.target_name}' as the schedule's target, and loss "
                    f"'{self.rule.name}' needs a target of its own, and a schedule hands the last stage one; use --loss model (the model's own loss on its labels)."
                )
            return graphs.target_of(bound)
        out = example_out[0] if len(example_out) == 1 else example_out
        return self.rule.make_target(self.rule.select(out, self.model))


class _HeldWork:
    """A send's work with the tensors it sends, kept while the work lives (Note [Sends a real rank holds])."""

    def __init__(self, work: Any, tensors: list[torch.Tensor]) -> None:
        self.work, self.tensors = work, tensors

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self.work.wait(*args, **kwargs)


@contextlib.contextmanager
def _sends_held() -> Iterator[None]:
    """Let each work of the schedule's point-to-point batches hold the tensors it sends."""
    from torch.distributed.pipelining import schedules

    original = schedules._batch_p2p

    def batch_p2p(ops: list[Any], desc: str | None = None) -> list[Any]:
        sent = [op.tensor for op in ops if op.op is dist.isend]
        return [_HeldWork(w, sent) for w in original(ops, desc)]

    schedules._batch_p2p = batch_p2p  # type: ignore[assignment]
    try:
        yield
    finally:
        schedules._batch_p2p = original


def _fake_copies(graphs: Sequence[fx.GraphModule], fake: FakeBatch) -> list[fx.GraphModule]:
    """Copies of stages with their state fake in the pass's mode, a weight two of them read one
    tensor, as it is in the real stages cut from one graph (Note [Sharding a copy of the graph])."""
    memo: dict[int, object] = {}
    with fake.mode:
        for gm in graphs:
            for t in (*gm.parameters(), *gm.buffers()):
                if id(t) not in memo:
                    memo[id(t)] = fake_like(t, fake.state_dtype if t.is_floating_point() else None)
                    if isinstance(t, nn.Parameter):
                        memo[id(t)] = nn.Parameter(memo[id(t)], requires_grad=t.requires_grad)  # type: ignore[arg-type]
    return [copy.deepcopy(gm, dict(memo)) for gm in graphs]


def _microbatches(fake: FakeBatch, specs: Sequence[InputSpec], count: int, seq: int | None) -> list[list[Any]]:
    """The batch's microbatches, each of B samples: the pass's own inputs first, then more alike."""
    values = [fake.inputs]
    batch = _batch_size(fake, specs)
    with fake.mode:
        size = fake.inputs[0].shape[1] if seq is None and any("S" in s.dims for s in specs) else seq
        for _ in range(count - 1):
            values.append([make_input(s, batch, size) for s in specs])
    return values


def _batch_size(fake: FakeBatch, specs: Sequence[InputSpec]) -> Any:
    for spec, value in zip(specs, fake.inputs):
        if isinstance(value, torch.Tensor) and "B" in spec.dims:
            return value.shape[spec.dims.index("B")]
    raise InputSpecError("pipeline parallel splits the batch into microbatches: mark the batch axis B in an input.")


def _targets(
    graphs: StageGraphs, loss: Loss, example_out: Any, bound: list[list[Any]], plan: PipelinePlan, last: bool, model: str
) -> list[Any] | None:
    """The last stage's targets, one per microbatch (held by the caller, like the batch)."""
    if not last:
        return None
    stage_loss = StageLoss(loss, model, graphs.loss)
    return [stage_loss.target(graphs, b, example_out) for b in bound]


def _initialize(schedule: Any, args: tuple[Any, ...], targets: list[Any] | None) -> None:
    """Make the stages' receive buffers as the schedule's first step does, in its static mode, the
    warm-up vote skipped (Note [Pipeline schedules on a fake group])."""
    from torch.distributed.pipelining._utils import InferenceMode

    def static(stages: list[Any], *_: object) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = static
    for stage in schedule_stages(schedule):
        stage.has_backward = True
    target = targets[0] if targets else None
    if hasattr(schedule, "_stages"):
        schedule._initialize_stages(args, {}, target)
    else:
        schedule._initialize_stage(args, {}, target)


def receive_buffers(stage: Any) -> list[torch.Tensor]:
    """The buffers a stage receives activations and gradients into, one per microbatch each."""
    infos = [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
    return [i.buffer for group in infos for i in group if isinstance(getattr(i, "buffer", None), torch.Tensor)]


def _adopt_baseline(tracker: Any, graphs: list[fx.GraphModule], stages: list[Any], micro: list[list[Any]], targets: list[Any]) -> None:
    """What exists when the step starts: the stages' weights and buffers, the batch (first stage), the
    targets (last stage), and the receive buffers the schedule keeps from step to step."""

    for gm in graphs:
        for name, p in gm.named_parameters():
            tracker.adopt(p, Category.PARAMETER)
            tracker.names[StorageWeakRef(storage_of(p))] = name
        for name, b in gm.named_buffers():
            if not tl._traced_constant(name.rpartition(".")[2]):
                tracker.adopt(b, Category.BUFFER)
    for values in [*micro, targets]:
        for t in values:
            if isinstance(t, torch.Tensor):
                tracker.adopt(t, Category.INPUT)
    for stage in stages:
        for t in receive_buffers(stage):
            tracker.adopt(t, Category.COMMUNICATION)


@dataclass
class _Run:
    """The hooks through which the schedule's forwards, losses and backwards reach the tracker."""

    tracker: Any
    fake: FakeBatch
    last: StageLoss
    model: str
    kernels: Callable[[], AbstractContextManager[object]]
    microbatch: int = -1
    """The microbatch the schedule runs forward now (``forward_one_chunk``'s ``fwd_chunk_id``)."""
    first_saved: set[int] = field(default_factory=set)
    """Storage numbers autograd saved in the first microbatch's forward and loss."""
    categories: dict[int, Category] = field(default_factory=dict)
    marks: list[tuple[int, int]] = field(default_factory=list)
    """See ``StageStep.marks``."""
    scopes: dict[int, ModuleScopes] = field(default_factory=dict)
    """By stage graph (``id``): the modules inside it whose hooks its forward calls, where the stage is sharded."""
    stages: list[nn.Module] = field(default_factory=list)
    """The sharded stages' modules (the FSDP2 roots), whose gathered weights backward accumulates into."""

    def shard(self, modules: Sequence[_StageModule], parallel: ParallelPlan, meshes: Meshes) -> None:
        """Shard each stage as a real rank does (Note [Data parallel inside pipeline stages]), with the
        fake mode set aside while meshes are joined (Note [Meshes made while sharding])."""
        for module in modules:
            with meshes_outside():
                hooked = shard_stage(module, module.gm, parallel, meshes, self.model)
            self.scopes[id(module.gm)] = ModuleScopes.of(module.gm, hooked, self.model)
        self.stages = list(modules)

    def labelled(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``params`` and, where the stages are sharded, the full-size parameters FSDP2 gathers them into."""
        # named from the stage's module, which holds the root's FSDP2 state: its own attribute ("gm.") dropped
        gathered = {name.partition(".")[2]: t for m in self.stages for name, t in gathered_parameters(m).items()}
        return {**params, **gathered}

    def forward_of(self, gm: fx.GraphModule) -> Callable[..., Any]:
        """The forward of the stage whose graph is ``gm``."""
        return lambda *args: self.forward(gm, *args)

    def forward(self, gm: fx.GraphModule, *args: Any) -> Any:

        self.marks.append((len(self.tracker.raw), 1))
        self.tracker.poll()
        self.tracker.phase = Phase.FORWARD
        with self.kernels():
            out = tl._Forward(gm, self.tracker, self.fake, self.model, self.kernels, self.scopes.get(id(gm))).run(*args)
        self.tracker.poll()
        tl._mark(self.tracker, self.categories, out, Category.ACTIVATION)  # the stage caches its output until backward
        return out

    def loss(self, output: Any, target: Any) -> torch.Tensor:

        self.tracker.phase, self.tracker.node, self.tracker.fqn = Phase.LOSS, LOSS_NODE, "(loss)"
        with self.kernels():
            value = self.last(output, target)
        tl._label_autograd(value, (LOSS_NODE, "(loss)"))
        self.tracker.poll()
        return value

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        number = self.tracker.number(t)
        if number is not None:
            self.categories[number] = Category.ACTIVATION
            if self.microbatch == 0:
                self.first_saved.add(number)
        return t.detach()

    def step(
        self, schedule: Any, args: list[Any], targets: list[Any] | None, opt: Any, params: Mapping[str, torch.Tensor]
    ) -> dict[int, Category]:
        """The schedule's microbatches, then the optimizer step and ``zero_grad``, as ``_run_step`` in
        fxmem/step/timeline.py takes them."""

        for stage in schedule_stages(schedule):
            self._hook_stage(stage, params)
        with torch.autograd.graph.saved_tensors_hooks(self.pack, tl._unpack):
            _guarded(self.model, lambda: schedule._step_microbatches(args, [{} for _ in args], targets, None, return_outputs=False))
        self.tracker.poll()
        self.tracker.phase, self.tracker.node, self.tracker.fqn = Phase.OPTIMIZER, "optimizer.step", ""
        for name, p in params.items():
            if p.grad is not None:
                tl._mark(self.tracker, self.categories, p.grad, Category.GRADIENT)
                self.tracker.names[StorageWeakRef(storage_of(p.grad))] = name
        if opt is not None:
            _guarded(self.model, opt.step)
            self.tracker.poll()
            tl._mark(self.tracker, self.categories, [list(s.values()) for s in opt.state.values()], Category.OPTIMIZER_STATE)
            self.tracker.phase, self.tracker.node = Phase.ZERO_GRAD, "zero_grad"
            opt.zero_grad(set_to_none=True)
            self.tracker.poll()
        for number in self.tracker.communication:  # Note [What a sharded step's engine allocates] in fxmem/step/timeline.py
            if self.categories.get(number) not in (Category.GRADIENT, Category.OPTIMIZER_STATE):
                self.categories[number] = Category.COMMUNICATION
        return self.categories

    def _hook_stage(self, stage: Any, params: Mapping[str, torch.Tensor]) -> None:
        """Note which microbatch each forward runs; run each microbatch's backward in the BACKWARD
        phase, its gradients charged to the nodes and parameters they are for, sums made in place
        as eager makes them (``_node_hooks``)."""

        original, forward_one_chunk = stage.backward_one_chunk, stage.forward_one_chunk

        def forward(chunk: int, *args: Any, **kwargs: Any) -> Any:
            self.microbatch = chunk
            return forward_one_chunk(chunk, *args, **kwargs)

        def backward(chunk: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False) -> None:
            self.tracker.poll()
            self.tracker.phase = Phase.BACKWARD
            root = loss if loss is not None else stage.fwd_cache[chunk][0][0]
            tl._label_accumulators(self.labelled(params), root)
            with tl._node_hooks(self.tracker, root):
                original(chunk, loss=loss, full_backward=full_backward, last_backward=last_backward)
            self.tracker.poll()
            self.marks.append((len(self.tracker.raw), -1))

        stage.backward_one_chunk, stage.forward_one_chunk = backward, forward


def _guarded(model: str, run: Callable[[], Any]) -> Any:
    try:
        return run()
    except (InputSpecError, CaptureError):
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise CaptureError(f"model '{model}': the simulated pipeline step failed: {type(e).__name__}: {first}") from e


def _saved_per_node(timeline: Timeline, numbers: set[int]) -> dict[str, ByteExpr]:
    """Bytes of the storages autograd saved in the first microbatch, per node that made them."""
    found: dict[str, ByteExpr] = {}
    for e in timeline.events:
        if e.alloc and e.storage in numbers:
            found[e.node] = found.get(e.node, ByteExpr()) + e.nbytes
    return found
