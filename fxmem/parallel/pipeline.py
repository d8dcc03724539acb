"""Pipeline parallel: the model's repeated blocks split into P contiguous stages, one per rank, and
each rank's training step simulated by running torch's own pipeline schedule on a fake process group.

Note [Pipeline stages]
    The split is torchtitan's manual one (torchtitan/distributed/pipeline_parallel.py,
    ``pipeline_module_split``): the repeated blocks (Note [Repeated blocks] in
    fxmem/frontends/blocks.py) cut into P contiguous runs, the code before the first block (the
    embeddings) on the first stage, the code after the last (the final norm, the head) and the loss
    on the last. fxmem cuts the traced graph rather than the module tree: a node belongs to the stage
    of the last block whose code ran before it, so that a stage is a GraphModule of the nodes it runs,
    its parameters those its nodes read under their own paths (a weight two stages read, the zoo
    GPT's tied embedding and LM head, is held by both, as pipeline parallel holds it), its inputs the
    tensors an earlier stage made that it or a later one reads, passed along stage to stage as
    ``PipelineStage`` passes activations (only to the next stage). The same split runs in the real
    multi-process measurement (fxmem/measure_ranks.py), on real weights.

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
    microbatch's output (the logits) until the next step begins.

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
    operations send, which it keeps as the real work does.
    Interleaved 1F1B (several stages per rank, ``ScheduleInterleaved1F1B``) is not simulated yet.
"""

from __future__ import annotations

import contextlib
import copy
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from fxmem.engine.binding import bind_inputs, fake_like, storage_of
from fxmem.engine.capture import LOSS_NODE, FakeBatch, fake_batch, node_fqn, quiet_fake_tensor_log
from fxmem.engine.dispatch import LayoutRule, OpRule, OpRuleMode
from fxmem.engine.losses import Loss
from fxmem.errors import CaptureError, InputSpecError
from fxmem.frontends.blocks import BlockStack, _all_alike
from fxmem.inputs import InputSpec, make_input
from fxmem.results import Category, Phase, Timeline
from fxmem.rules.optimizers import OptimizerRule
from fxmem.symbolic import ByteExpr

__all__ = [
    "PipelinePlan",
    "PipelineRank",
    "PipelineRun",
    "Schedule",
    "StageStep",
    "build_schedule",
    "pipeline_plan",
    "pipeline_world",
    "receive_buffers",
    "simulate_stage",
    "split_stages",
    "stage_examples",
]  # fmt: skip


class Schedule(StrEnum):
    """torch's pipeline schedules (torch/distributed/pipelining/schedules.py): ``GPIPE`` every forward
    then every backward; ``ONE_F_ONE_B`` one forward, one backward once warmed up; ``INTERLEAVED``
    several stages per rank (not simulated yet)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


@dataclass(frozen=True)
class PipelinePlan:
    """P stages over the blocks of ``stack``: stage s runs blocks ``bounds[s][0]`` to ``bounds[s][1] - 1``
    (the embeddings before them on stage 0, the head and the loss after them on stage P - 1), over
    ``microbatches`` microbatches per step in the order ``schedule`` gives."""

    stages: int
    microbatches: int
    schedule: Schedule
    stack: str
    bounds: tuple[tuple[int, int], ...]

    def role(self, rank: int) -> str:
        if self.stages == 1:
            return "only"
        return "first" if rank == 0 else "last" if rank == self.stages - 1 else "middle"

    def blocks(self, rank: int) -> str:
        """The blocks stage ``rank`` runs, as module paths ("blocks.0-1")."""
        start, end = self.bounds[rank]
        return f"{self.stack}.{start}" if end - start == 1 else f"{self.stack}.{start}-{end - 1}"

    def describe(self) -> str:
        return f"pipeline parallel over {self.stages} stages ({self.schedule.value}, {self.microbatches} microbatches)"


def pipeline_plan(
    model: nn.Module, stages: int, microbatches: int, schedule: str, splits: Sequence[int] | None = None, name: str = "model"
) -> PipelinePlan:
    """The plan for ``stages`` ranks, checked against the model and what torch's schedules accept.

    ``splits``: the first block of each stage after the first (P - 1 increasing block indices);
    default as even as the blocks allow, earlier stages taking the remainder."""
    for option, value in (("--pp", stages), ("--microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputSpecError(f"{option} needs a whole number, 1 or more; got {value!r}.")
    kind = _schedule(schedule)
    if kind is Schedule.INTERLEAVED:
        if microbatches % stages:
            raise InputSpecError(
                f"model '{name}': the interleaved schedule runs microbatches in rounds of one per stage: {microbatches} "
                f"microbatches is not a multiple of {stages} stages; choose --microbatches {stages * max(1, microbatches // stages)}."
            )
        raise InputSpecError(
            f"model '{name}': --schedule interleaved (several stages per rank) is not simulated yet; use gpipe or 1f1b "
            "(Note [Pipeline stages] in fxmem/parallel/pipeline.py)."
        )
    if kind is Schedule.ONE_F_ONE_B and microbatches < stages:
        raise InputSpecError(
            f"model '{name}': the 1f1b schedule needs at least one microbatch per stage (torch's Schedule1F1B refuses "
            f"fewer): {microbatches} microbatches for {stages} stages; pass --microbatches {stages} or more, or --schedule gpipe."
        )
    stack = _block_list(model)
    if stack is None:
        raise InputSpecError(
            f"model '{name}' ({type(model).__name__}) has no repeated blocks for pipeline stages to split (a ModuleList or "
            "Sequential of alike modules, Note [Repeated blocks]); --pp needs them."
        )
    return PipelinePlan(stages, microbatches, kind, stack.path, _bounds(stack, stages, splits, name))


def _block_list(model: nn.Module) -> BlockStack | None:
    """The longest ModuleList or Sequential of two or more alike blocks (the test of Note [Repeated
    blocks], without its minimum depth: a pipeline needs as many blocks as stages, no more)."""
    found: BlockStack | None = None
    for path, module in model.named_modules():
        alike = isinstance(module, (nn.ModuleList, nn.Sequential)) and path and len(module) >= 2 and _all_alike(list(module))
        if alike and (found is None or len(module) > found.depth):
            found = BlockStack(path, len(module), type(module[0]).__name__)
    return found


def _schedule(schedule: str) -> Schedule:
    try:
        return Schedule(schedule)
    except ValueError as e:
        raise InputSpecError(f"--schedule '{schedule}' is not one of {', '.join(s.value for s in Schedule)}.") from e


def _bounds(stack: BlockStack, stages: int, splits: Sequence[int] | None, name: str) -> tuple[tuple[int, int], ...]:
    """[start, end) of each stage's blocks; every stage needs one at least (torchtitan's split does too)."""
    if stages > stack.depth:
        raise InputSpecError(
            f"model '{name}': {stack.depth} blocks in '{stack.path}' cannot fill {stages} pipeline stages (each stage "
            f"runs one block at least); use --pp {stack.depth} or fewer."
        )
    if splits is None:
        size, extra = divmod(stack.depth, stages)
        starts = [s * size + min(s, extra) for s in range(stages)]
    else:
        starts = [0, *splits]
        if (
            len(starts) != stages
            or any(not isinstance(s, int) for s in starts)
            or starts != sorted(set(starts))
            or starts[-1] >= stack.depth
        ):
            raise InputSpecError(
                f"model '{name}': pipeline split points {list(splits)} must be {stages - 1} increasing block indices in "
                f"1..{stack.depth - 1} of '{stack.path}' (the first block of each stage after the first), so no stage is empty."
            )
    return tuple(zip(starts, [*starts[1:], stack.depth]))


# Splitting the traced graph (Note [Pipeline stages]) ------------------------------------------------------------

_KEPT = ("get_attr", "output")


def split_stages(gm: fx.GraphModule, plan: PipelinePlan, name: str = "model") -> tuple[fx.GraphModule, ...]:
    """One GraphModule per stage, cut from ``gm`` (Note [Pipeline stages]); a stage's module paths and
    node names are the whole graph's."""
    stage_of = _stage_of(gm, plan)
    nodes = list(gm.graph.nodes)
    for s in range(plan.stages):
        if not any(stage_of[n] == s and n.op not in ("placeholder", *_KEPT) for n in nodes):
            raise CaptureError(
                f"model '{name}': pipeline stage {s} ({plan.blocks(s)}) has no code in the traced graph; choose other split points."
            )
    return tuple(_stage_graph(gm, nodes, stage_of, s, plan.stages, name) for s in range(plan.stages))


def _stage_of(gm: fx.GraphModule, plan: PipelinePlan) -> dict[fx.Node, int]:
    """Each node's stage: that of the last block whose code ran at or before it."""
    pattern = re.compile(rf"{re.escape(plan.stack)}\.(\d+)(\.|$)")
    block_stage = {b: s for s, (start, end) in enumerate(plan.bounds) for b in range(start, end)}
    found, current = {}, 0
    for n in gm.graph.nodes:
        m = pattern.match(node_fqn(n))
        if m is not None:
            current = block_stage[int(m.group(1))]
        found[n] = current
    return found


def _crossing(nodes: list[fx.Node], stage_of: Mapping[fx.Node, int], boundary: int) -> list[fx.Node]:
    """The values made before stage ``boundary`` that it or a later stage reads: what it receives."""
    return [
        n
        for n in nodes
        if n.op not in _KEPT and stage_of[n] < boundary and any(stage_of[u] >= boundary and u.op != "output" for u in n.users)
    ]


def _stage_graph(
    gm: fx.GraphModule, nodes: list[fx.Node], stage_of: Mapping[fx.Node, int], s: int, count: int, name: str
) -> fx.GraphModule:
    graph, env = fx.Graph(), {}
    received = [n for n in nodes if n.op == "placeholder"] if s == 0 else _crossing(nodes, stage_of, s)
    for n in received:
        env[n] = graph.node_copy(n) if n.op == "placeholder" else graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in nodes:
        if n.op in ("placeholder", *_KEPT) or stage_of[n] != s:
            continue
        for arg in n.all_input_nodes:  # a weight is read where it is used: each stage that uses it holds it
            if arg.op == "get_attr" and arg not in env:
                env[arg] = graph.node_copy(arg)
        env[n] = graph.node_copy(n, lambda a: env[a])
    if s == count - 1:
        output = next(n for n in nodes if n.op == "output")
        graph.output(fx.map_arg(output.args[0], lambda a: env[a]))
    else:
        sent = _crossing(nodes, stage_of, s + 1)
        _check_tensors(sent, s, name)
        graph.output(tuple(env[n] for n in sent))
    return fx.GraphModule(gm, graph, class_name=f"Stage{s}")


def _check_tensors(sent: list[fx.Node], s: int, name: str) -> None:
    """A stage sends tensors only (``PipelineStage`` refuses anything else)."""
    if not sent:
        raise CaptureError(f"model '{name}': pipeline stage {s} hands nothing to stage {s + 1}; the split cuts no activation.")
    for n in sent:
        value = n.meta.get("val", n.meta.get("example_value"))
        if value is not None and not isinstance(value, torch.Tensor):
            raise CaptureError(
                f"model '{name}': pipeline stage {s} would hand '{n.name}' ({type(value).__name__}, made at '{node_fqn(n) or 'the top'}') "
                f"to stage {s + 1}, and pipeline stages pass tensors only; choose other split points."
            )


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
    submodule: nn.Module,
    rank: int,
    plan: PipelinePlan,
    inputs: tuple[torch.Tensor, ...],
    outputs: tuple[torch.Tensor, ...],
    loss_fn: Callable[..., Any],
) -> Any:
    """torch's stage and schedule for ``rank``, static shapes given (Note [Pipeline stages]); used by
    the simulation and the real ranks alike."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = PipelineStage(
        submodule, rank, plan.stages, torch.device("cpu"), input_args=_with_grad(inputs, rank > 0), output_args=_with_grad(outputs, True)
    )
    kind = ScheduleGPipe if plan.schedule is Schedule.GPIPE else Schedule1F1B
    return kind(stage, plan.microbatches, loss_fn=loss_fn)


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


class _StageModule(nn.Module):
    """The submodule ``PipelineStage`` calls: fxmem's interpreter over the stage's graph."""

    def __init__(self, gm: fx.GraphModule, run: Callable[..., Any]) -> None:
        super().__init__()
        self.gm = gm
        self._run = run

    def forward(self, *args: Any) -> Any:
        return self._run(*args)


def simulate_stage(
    stages: Sequence[fx.GraphModule],
    rank: int,
    plan: PipelinePlan,
    specs: Sequence[InputSpec],
    *,
    loss: Loss,
    optimizer: OptimizerRule,
    batch: int | None,
    rules: Mapping[str, OpRule],
    workspaces: Mapping[str, Any],
    model: str = "model",
    seq: int | None = None,
    kernels: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    optimizer_impl: str | None = None,
    state_dtype: torch.dtype | None = None,
    layouts: Mapping[str, LayoutRule] | None = None,
) -> StageStep:
    """Rank ``rank``'s first training step (``batch`` the microbatch, None: symbolic B), torch's
    schedule run on a fake process group under the timeline's tracker (Note [Pipeline stages])."""
    from fxmem.step import timeline as tl

    fake = fake_batch(specs, batch, seq, state_dtype)
    with quiet_fake_tensor_log(), pipeline_world(rank, plan.stages, model):
        held = [_fake_copy(s, fake) for s in stages[: rank + 1]]
        gm = held[rank]
        micro = _microbatches(fake, specs, plan.microbatches, seq)
        first = [bind_inputs(held[0], specs, m, model) for m in micro]
        with fake.mode:
            example_in, example_out = stage_examples(held, rank, first[0])
        tracker = tl._Tracker(rules, workspaces)
        run = _Run(tracker, fake, loss, model, kernels)
        stage_module = _StageModule(gm, run.forward)
        params = dict(gm.named_parameters())
        with fake.mode:
            schedule = build_schedule(stage_module, rank, plan, example_in, example_out, run.loss)
            targets = _targets(loss, example_out, plan, rank, model)
            args = [tuple(f) for f in first] if rank == 0 else [() for _ in range(plan.microbatches)]
            _initialize(schedule, args[0], targets)
        _adopt_baseline(tracker, gm, schedule._stage, micro if rank == 0 else [], targets or [])
        with fake.mode:
            trainable = [p for p in params.values() if p.requires_grad]
            opt = optimizer.make(trainable, optimizer_impl) if trainable else None
            with tracker, OpRuleMode({}, {}, layouts), tl._host_rng_states(tracker), _sends_held():
                categories = run.step(schedule, args, targets, opt, params)
    fake.check_symbols()
    timeline = tl._timeline(tracker, categories, batch, fake)
    return StageStep(timeline, _saved_per_node(timeline, run.first_saved))


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


def _fake_copy(gm: fx.GraphModule, fake: FakeBatch) -> fx.GraphModule:
    """A copy of a stage with its state fake in the pass's mode, tied weights still tied (Note [Sharding a copy of the graph])."""
    memo: dict[int, object] = {}
    with fake.mode:
        for t in (*gm.parameters(), *gm.buffers()):
            memo.setdefault(id(t), fake_like(t, fake.state_dtype if t.is_floating_point() else None))
            if isinstance(t, nn.Parameter):
                memo[id(t)] = nn.Parameter(memo[id(t)], requires_grad=t.requires_grad)  # type: ignore[arg-type]
    return copy.deepcopy(gm, memo)


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


def _targets(loss: Loss, example_out: tuple[torch.Tensor, ...], plan: PipelinePlan, rank: int, model: str) -> list[Any] | None:
    """The last stage's targets, one per microbatch (held by the caller, like the batch)."""
    if rank != plan.stages - 1:
        return None
    out = example_out[0] if len(example_out) == 1 else example_out
    return [loss.make_target(loss.select(out, model)) for _ in range(plan.microbatches)]


def _initialize(schedule: Any, args: tuple[Any, ...], targets: list[Any] | None) -> None:
    """Make the stage's receive buffers as the schedule's first step does, in its static mode, the
    warm-up vote skipped (Note [Pipeline stages])."""
    from torch.distributed.pipelining._utils import InferenceMode

    def static(stages: list[Any], *_: object) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = static
    schedule._stage.has_backward = True
    schedule._initialize_stage(args, {}, targets[0] if targets else None)


def receive_buffers(stage: Any) -> list[torch.Tensor]:
    """The buffers a stage receives activations and gradients into, one per microbatch each."""
    infos = [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
    return [i.buffer for group in infos for i in group if isinstance(getattr(i, "buffer", None), torch.Tensor)]


def _adopt_baseline(tracker: Any, gm: fx.GraphModule, stage: Any, micro: list[list[Any]], targets: list[Any]) -> None:
    """What exists when the step starts: the stage's weights and buffers, the batch (first stage), the
    targets (last stage), and the receive buffers the schedule keeps from step to step."""
    from fxmem.step import timeline as tl

    for name, p in gm.named_parameters():
        tracker.adopt(p, Category.PARAMETER)
        tracker.names[StorageWeakRef(storage_of(p))] = name
    for name, b in gm.named_buffers():
        if not tl._traced_constant(name.rpartition(".")[2]):
            tracker.adopt(b, Category.BUFFER)
    for values in micro:
        for t in values:
            if isinstance(t, torch.Tensor):
                tracker.adopt(t, Category.INPUT)
    for t in targets:
        if isinstance(t, torch.Tensor):
            tracker.adopt(t, Category.INPUT)
    for t in receive_buffers(stage):
        tracker.adopt(t, Category.COMMUNICATION)


@dataclass
class _Run:
    """The hooks through which the schedule's forwards, losses and backwards reach the tracker."""

    tracker: Any
    fake: FakeBatch
    loss_rule: Loss
    model: str
    kernels: Callable[[], AbstractContextManager[object]]
    chunk: int = -1
    gm: Any = None
    first_saved: set[int] = field(default_factory=set)
    """Storage numbers autograd saved in the first microbatch's forward and loss."""
    categories: dict[int, Category] = field(default_factory=dict)

    def forward(self, *args: Any) -> Any:
        from fxmem.step import timeline as tl

        self.chunk += 1
        self.tracker.poll()
        self.tracker.phase = Phase.FORWARD
        with self.kernels():
            out = tl._Forward(self.gm, self.tracker, self.fake, self.model, self.kernels).run(*args)
        self.tracker.poll()
        tl._mark(self.tracker, self.categories, out, Category.ACTIVATION)  # the stage caches its output until backward
        return out

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        from fxmem.step import timeline as tl

        self.tracker.phase, self.tracker.node, self.tracker.fqn = Phase.LOSS, LOSS_NODE, "(loss)"
        with self.kernels():
            value = self.loss_rule.compute(self.loss_rule.select(output, self.model), target)
        tl._label_autograd(value, (LOSS_NODE, "(loss)"))
        self.tracker.poll()
        return value

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        number = self.tracker.number(t)
        if number is not None:
            self.categories[number] = Category.ACTIVATION
            if self.chunk == 0:
                self.first_saved.add(number)
        return t.detach()

    def step(
        self, schedule: Any, args: list[Any], targets: list[Any] | None, opt: Any, params: Mapping[str, torch.Tensor]
    ) -> dict[int, Category]:
        """The schedule's microbatches, then the optimizer step and ``zero_grad``, as ``_run_step`` in
        fxmem/step/timeline.py takes them."""
        from fxmem.step import timeline as tl

        self.gm = schedule._stage.submod.gm
        self._hook_backward(schedule._stage, params)
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
        return self.categories

    def _hook_backward(self, stage: Any, params: Mapping[str, torch.Tensor]) -> None:
        """Run each microbatch's backward in the BACKWARD phase, its gradients charged to the nodes and
        parameters they are for, sums made in place as eager makes them (``_node_hooks``)."""
        from fxmem.step import timeline as tl

        original = stage.backward_one_chunk

        def backward(chunk: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False) -> None:
            self.tracker.poll()
            self.tracker.phase = Phase.BACKWARD
            root = loss if loss is not None else stage.fwd_cache[chunk][0][0]
            tl._label_accumulators(params, root)
            with tl._node_hooks(self.tracker, root):
                original(chunk, loss=loss, full_backward=full_backward, last_backward=last_backward)
            self.tracker.poll()

        stage.backward_one_chunk = backward


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


# The ranks, for the report -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineRank:
    """One rank of the pipeline: its stage, its model state, what it saves per microbatch, and its
    simulated step (a ``fxmem.step.peak.StepPeaks``: ``steps.peak(B)``)."""

    rank: int
    role: str
    blocks: str
    parameters: int
    """Bytes of the stage's parameters (a weight two stages read counts on both)."""
    saved: Mapping[str, ByteExpr]
    steps: Any = field(compare=False, repr=False)

    @property
    def activations(self) -> ByteExpr:
        """Bytes autograd saves for one microbatch on this rank, a*B + c (B the microbatch)."""
        return ByteExpr.total(self.saved.values())

    def peak(self, batch: int, *, first_step: bool = False) -> Any:
        return self.steps.peak(batch, first_step=first_step)


@dataclass(frozen=True)
class PipelineRun:
    """Every rank of a pipeline-parallel step (``Report.pipeline``)."""

    plan: PipelinePlan
    ranks: tuple[PipelineRank, ...]

    def render(self, batch: int, seq: int | None = None) -> str:
        """The report's lines per rank: what its stage runs, holds and peaks at."""
        return _render_ranks(self.plan, self.ranks, batch, seq)


def _render_ranks(plan: PipelinePlan, ranks: Sequence[PipelineRank], batch: int, seq: int | None = None) -> str:
    from fxmem.output.render import format_bytes

    lines = [f"Pipeline: {plan.describe()}, B={batch} per microbatch (a step takes {plan.microbatches * batch} samples)"]
    for r in ranks:
        steady, first = r.peak(batch), r.peak(batch, first_step=True)
        lines.append(
            f"  rank {r.rank} ({r.role}, {r.blocks}): parameters {format_bytes(r.parameters)}, saved per microbatch "
            f"{format_bytes(r.activations.at(batch, seq))}, peak {format_bytes(steady.bytes)} steady / {format_bytes(first.bytes)} first step, "
            f"in {steady.phase.value} at {steady.node}"
        )
    return "\n".join(lines) + "\n"
