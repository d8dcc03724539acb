"""Pipeline parallel, the plan: which blocks each stage runs, and the traced graph cut into one
GraphModule per stage (the simulation of each rank's step is fxmem/step/pipeline.py).

Note [Pipeline stages]
    The split is torchtitan's manual one (torchtitan/distributed/pipeline_parallel.py,
    ``pipeline_module_split``): the repeated blocks (Note [Repeated blocks] in
    fxmem/frontends/blocks.py) cut into contiguous runs, the code before the first block (the
    embeddings) on the first stage, the code after the last (the final norm, the head) and the loss
    on the last. fxmem cuts the traced graph rather than the module tree: a node belongs to the stage
    of the last block whose code ran before it, so that a stage is a GraphModule of the nodes it runs,
    its parameters those its nodes read under their own paths (a weight two stages read, the zoo
    GPT's tied embedding and LM head, is held by both, as pipeline parallel holds it), its inputs the
    tensors an earlier stage made that it or a later one reads, passed along stage to stage as
    ``PipelineStage`` passes activations (only to the next stage). The same split runs in the real
    multi-process measurement (fxmem/measure_ranks.py), on real weights.

    ``PipelineStage`` passes tensors from one stage to the next and nothing else, so two kinds of
    value a model's body hands its blocks are not sent (Note [What a stage recomputes]), and the
    inputs only the last stage reads reach it as the schedule's target (Note [Labels as the target]).

Note [What a stage recomputes]
    A HF Llama computes its rotary embeddings (cos, sin) once, from ``arange`` and the ``inv_freq``
    buffer, before its first layer, and every layer reads them; its attention reshapes by the batch
    size, a SymInt read off ``input_ids``. Neither can be sent: a SymInt is no tensor, and the
    rotary tables are not activations of the first stage's (no gradient flows back through them).
    torchtitan keeps the rotary table on every stage (its ``freqs_cis`` buffer stays on each stage's
    module) and its HF backend calls ``rotary_emb`` in every stage's forward; fxmem does the same on
    the graph. A value is *derivable* when it reads no model input and no trainable parameter, only
    buffers, constants and other derivable values; a stage that reads a derivable value an earlier
    stage made copies the nodes that make it into its own graph and recomputes it every forward
    (so each microbatch on a later stage saves its own cos and sin where the attention keeps them).
    A ``sym_size`` of a tensor the stage does not hold is read off a tensor it does receive that
    has the same symbolic size (the residual stream's batch axis). Only what is neither is sent.

Note [Labels as the target]
    A HF model given ``labels`` computes its loss in its forward, the labels read only after the
    head, on the last stage. torchtitan hands the labels to the last stage as the schedule's
    ``target`` (``pp_schedule.step(target=labels)``), which the schedule splits into microbatches
    and passes to ``loss_fn(output, target)`` (``_PipelineSchedule._compute_loss``,
    torch/distributed/pipelining/schedules.py). fxmem does that: a model input that only the last
    stage reads is its target, and the nodes that read it (directly or through others: the shifted
    labels, the cross entropy) form the loss graph the schedule's ``loss_fn`` runs on the last
    stage's outputs and the target's microbatch. The first stage then neither holds nor sends the
    labels; the last holds the batch's labels as a target (``measure_pipeline`` does too).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.fx as fx
from torch import nn

from fxmem.engine.capture import node_fqn
from fxmem.errors import CaptureError, InputSpecError
from fxmem.frontends.blocks import BlockStack, _all_alike

__all__ = ["INTERLEAVED_STAGES_PER_RANK", "PipelinePlan", "Schedule", "StageGraphs", "pipeline_plan", "split_stages"]


class Schedule(StrEnum):
    """torch's pipeline schedules (torch/distributed/pipelining/schedules.py): ``GPIPE`` every forward
    then every backward; ``ONE_F_ONE_B`` one forward, one backward once warmed up; ``INTERLEAVED``
    (``ScheduleInterleaved1F1B``) 1F1B over several stages per rank, stage i on rank i mod P."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


@dataclass(frozen=True)
class PipelinePlan:
    """``stages`` ranks (P) running ``virtual`` stages each over the blocks of ``stack``: stage s runs
    blocks ``bounds[s][0]`` to ``bounds[s][1] - 1`` (the embeddings before them on stage 0, the head
    and the loss after them on the last) and sits on rank s mod P, as torch's looped schedules
    place them; ``microbatches`` microbatches per step in the order ``schedule`` gives."""

    stages: int
    microbatches: int
    schedule: Schedule
    stack: str
    bounds: tuple[tuple[int, int], ...]
    virtual: int = 1
    """Stages per rank: 1, or several under the interleaved schedule."""

    def local(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` runs (``generate_stage_to_rank_mapping``'s loop style)."""
        return tuple(range(rank, len(self.bounds), self.stages))

    def role(self, rank: int) -> str:
        if self.stages == 1:
            return "only"
        return "first" if rank == 0 else "last" if rank == self.stages - 1 else "middle"

    def blocks(self, rank: int) -> str:
        """The blocks rank ``rank``'s stages run, as module paths ("blocks.0-1", "blocks.0, blocks.2")."""
        return ", ".join(self.stage_blocks(s) for s in self.local(rank))

    def stage_blocks(self, stage: int) -> str:
        start, end = self.bounds[stage]
        return f"{self.stack}.{start}" if end - start == 1 else f"{self.stack}.{start}-{end - 1}"

    def describe(self) -> str:
        where = f"{self.stages} stages" if self.virtual == 1 else f"{self.stages} ranks, {len(self.bounds)} stages"
        return f"pipeline parallel over {where} ({self.schedule.value}, {self.microbatches} microbatches)"


def pipeline_plan(
    model: nn.Module,
    stages: int,
    microbatches: int,
    schedule: str,
    splits: Iterable[int] | None = None,
    name: str = "model",
    stages_per_rank: int | None = None,
) -> PipelinePlan:
    """The plan for ``stages`` ranks, checked against the model and what torch's schedules accept.

    ``splits``: the first block of each stage after the first (increasing block indices, one fewer than
    the stages: P - 1, or V x P - 1 interleaved);
    default as even as the blocks allow, earlier stages taking the remainder. ``stages_per_rank`` (V):
    the interleaved schedule's stages on each rank (default ``INTERLEAVED_STAGES_PER_RANK``); the
    other schedules run one."""
    for option, value in (
        ("--pp", stages),
        ("--microbatches", microbatches),
        ("--stages-per-rank", 1 if stages_per_rank is None else stages_per_rank),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputSpecError(f"{option} needs a whole number, 1 or more; got {value!r}.")
    kind = _schedule(schedule)
    virtual = _stages_per_rank(kind, stages_per_rank, name)
    rounds = max(1, microbatches // stages)
    if kind is Schedule.INTERLEAVED and microbatches % rounds:
        raise InputSpecError(
            f"model '{name}': the interleaved schedule runs microbatches in rounds (torch's ScheduleInterleaved1F1B: "
            f"max(1, M // P) = {rounds} of them for {microbatches} microbatches over {stages} ranks), and {microbatches} "
            f"microbatches do not split into {rounds} equal rounds; choose --microbatches {rounds * stages}."
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
    bounds = _bounds(stack, stages, virtual, None if splits is None else list(splits), name)
    return PipelinePlan(stages, microbatches, kind, stack.path, bounds, virtual)


INTERLEAVED_STAGES_PER_RANK = 2
"""Stages per rank under the interleaved schedule where none is given (torchtitan's default for looped
schedules is stages enough for its layers-per-stage; two is the smallest that interleaves)."""


def _stages_per_rank(kind: Schedule, given: int | None, name: str) -> int:
    """V: as given under the interleaved schedule (2 or more: one stage per rank is 1f1b), else 1."""
    if kind is not Schedule.INTERLEAVED:
        if given not in (None, 1):
            raise InputSpecError(
                f"model '{name}': --stages-per-rank {given} applies to --schedule interleaved (torch's "
                f"ScheduleInterleaved1F1B); {kind.value} runs one stage per rank. Pass --schedule interleaved, or drop it."
            )
        return 1
    if given is None:
        return INTERLEAVED_STAGES_PER_RANK
    if given < 2:
        raise InputSpecError(
            f"model '{name}': --stages-per-rank {given} under --schedule interleaved leaves nothing to interleave; "
            "pass 2 or more, or --schedule 1f1b for one stage per rank."
        )
    return given


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


def _bounds(stack: BlockStack, ranks: int, virtual: int, splits: Sequence[int] | None, name: str) -> tuple[tuple[int, int], ...]:
    """[start, end) of each stage's blocks; every stage needs one at least (torchtitan's split does too)."""
    stages = ranks * virtual
    if stages > stack.depth:
        per = f", {virtual} per rank," if virtual > 1 else ""
        fewer = [f"--pp {stack.depth // virtual} or fewer"] if stack.depth // virtual >= 2 else []
        if virtual > 1 and stack.depth // ranks >= 2:
            fewer.append(f"--stages-per-rank {stack.depth // ranks} or fewer")
        raise InputSpecError(
            f"model '{name}': {stack.depth} blocks in '{stack.path}' cannot fill {stages} pipeline stages{per} (each stage "
            f"runs one block at least); use {' or '.join(fewer) or '--schedule 1f1b (one stage per rank)'}."
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


@dataclass(frozen=True)
class StageGraphs:
    """The traced graph cut into stages, and the loss graph the last stage's ``loss_fn`` runs where
    the model reads inputs there only (Note [Labels as the target])."""

    whole: fx.GraphModule
    """The traced graph: its placeholders are the model's inputs, which ``bind_inputs`` lines up."""
    stages: tuple[fx.GraphModule, ...]
    loss: fx.GraphModule | None = None
    """Runs on (the last stage's outputs..., the target's microbatch); None: the last stage's output is the model's."""
    target: int | None = None
    """Which of ``whole``'s inputs the last stage receives as the schedule's target (None: none)."""

    def first_inputs(self, values: Sequence[object]) -> list[object]:
        """The first stage's arguments, from the model's bound inputs (the target's left out)."""
        return [v for i, v in enumerate(values) if i != self.target]

    def target_of(self, values: Sequence[object]) -> object:
        return None if self.target is None else values[self.target]

    @property
    def target_name(self) -> str:
        """The name of the input that is the target ("" for none)."""
        inputs = [str(n.target) for n in self.whole.graph.nodes if n.op == "placeholder"]
        return "" if self.target is None else inputs[self.target]


_KEPT = ("get_attr", "output")
_SYM_SIZE = torch.ops.aten.sym_size.int


def split_stages(gm: fx.GraphModule, plan: PipelinePlan, name: str = "model") -> StageGraphs:
    """One GraphModule per stage, cut from ``gm`` (Note [Pipeline stages]); a stage's module paths and
    node names are the whole graph's."""
    stage_of = _stage_of(gm, plan)
    nodes = list(gm.graph.nodes)
    count = len(plan.bounds)
    for s in range(count):
        if not any(stage_of[n] == s and n.op not in ("placeholder", *_KEPT) for n in nodes):
            raise CaptureError(
                f"model '{name}': pipeline stage {s} ({plan.stage_blocks(s)}) has no code in the traced graph; choose other split points."
            )
    late = _late_input(nodes, stage_of, count, name)
    if late is not None:  # the loss graph runs as one stage more (Note [Labels as the target])
        output = next(n for n in nodes if n.op == "output")
        stage_of.update(dict.fromkeys([*_readers(nodes, late), output], count))
    cut, total = _Cut(gm, nodes, stage_of, _derivable(gm), name), count + (late is not None)
    graphs = tuple(cut.stage(s, total, late) for s in range(total))
    target = None if late is None else [n for n in nodes if n.op == "placeholder"].index(late)
    return StageGraphs(gm, graphs[:count], graphs[count] if late is not None else None, target)


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


def _late_input(nodes: list[fx.Node], stage_of: Mapping[fx.Node, int], count: int, name: str) -> fx.Node | None:
    """The model input only the last stage reads, if any (Note [Labels as the target])."""
    late = [n for n in nodes if n.op == "placeholder" and n.users and count > 1 and all(stage_of[u] == count - 1 for u in n.users)]
    if len(late) > 1:
        raise CaptureError(
            f"model '{name}': only the last pipeline stage reads the inputs {', '.join(str(n.target) for n in late)}, "
            "and a schedule hands the last stage one target; pass all but one of them as the model computes them."
        )
    return late[0] if late else None


def _readers(nodes: list[fx.Node], source: fx.Node) -> list[fx.Node]:
    """``source`` and every node that reads it, directly or through others (the output left out)."""
    found = {source}
    for n in nodes:
        if n.op != "output" and any(a in found for a in n.all_input_nodes):
            found.add(n)
    return [n for n in nodes if n in found]


def _derivable(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes any stage can recompute: no model input, no trainable parameter in what they read
    (Note [What a stage recomputes]); a ``sym_size`` counts, read off a received tensor."""
    trainable = {name for name, p in gm.named_parameters() if p.requires_grad}
    found: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            ok = str(n.target) not in trainable
        elif n.op in ("placeholder", "output"):
            ok = False
        else:
            ok = n.target is _SYM_SIZE or all(a in found for a in n.all_input_nodes)
        if ok:
            found.add(n)
    return found


class _Cut:
    """Builds each stage's graph from the whole one: the nodes it runs, what it receives as
    placeholders, what it recomputes (Note [What a stage recomputes])."""

    def __init__(
        self, gm: fx.GraphModule, nodes: list[fx.Node], stage_of: Mapping[fx.Node, int], derivable: set[fx.Node], name: str
    ) -> None:
        self.gm, self.nodes, self.stage_of, self.derivable, self.name = gm, nodes, stage_of, derivable, name

    def crossing(self, boundary: int) -> list[fx.Node]:
        """The values made before stage ``boundary`` that it or a later stage reads and cannot
        recompute: what it receives."""
        return [
            n
            for n in self.nodes
            if n.op not in _KEPT
            and n not in self.derivable
            and self.stage_of[n] < boundary
            and any(self.stage_of[u] >= boundary for u in n.users)
        ]

    def stage(self, s: int, count: int, late: fx.Node | None) -> fx.GraphModule:
        graph, env = fx.Graph(), {}
        if s == 0:
            received = [n for n in self.nodes if n.op == "placeholder" and n is not late]
        else:
            received = self.crossing(s) + ([late] if late is not None and s == count - 1 else [])
        for n in received:
            env[n] = graph.node_copy(n) if n.op == "placeholder" else graph.placeholder(n.name)
            env[n].meta = dict(n.meta)
        build = _StageBuilder(graph, env, received, self.derivable, self.name, s)
        for n in self.nodes:
            if self.stage_of[n] == s and n.op not in ("placeholder", *_KEPT):
                build.copy(n)
        if s == count - 1:
            output = next(n for n in self.nodes if n.op == "output")
            graph.output(fx.map_arg(output.args[0], build.value))
        else:
            sent = self.crossing(s + 1)
            _check_tensors(sent, s, self.name)
            graph.output(tuple(build.value(n) for n in sent))
        return fx.GraphModule(self.gm, graph, class_name=f"Stage{s}")


@dataclass
class _StageBuilder:
    """Copies nodes into one stage's graph, the values they read looked up or recomputed."""

    graph: fx.Graph
    env: dict[fx.Node, fx.Node]
    received: list[fx.Node]
    derivable: set[fx.Node]
    name: str
    stage: int

    def copy(self, n: fx.Node) -> None:
        if n not in self.env:
            self.env[n] = self.graph.node_copy(n, self.value)

    def value(self, n: fx.Node) -> fx.Node:
        """The stage's node for ``n``: received or made here already, else recomputed here."""
        if n not in self.env:
            if n.op != "get_attr" and n not in self.derivable:
                raise AssertionError(f"pipeline stage {self.stage} reads '{n.name}', neither received nor derivable")
            if n.target is _SYM_SIZE and n.args[0] not in self.env:
                self.env[n] = self._size_from_received(n)
            else:  # a weight is read where it is used: each stage that uses it holds it
                self.env[n] = self.graph.node_copy(n, self.value)
        return self.env[n]

    def _size_from_received(self, n: fx.Node) -> fx.Node:
        """A ``sym_size`` of a tensor this stage lacks, read off one it receives with the same size."""
        wanted = n.meta.get("val")
        for r in self.received:
            value = r.meta.get("val")
            for dim, size in enumerate(value.shape if isinstance(value, torch.Tensor) else ()):
                if isinstance(size, torch.SymInt) and isinstance(wanted, torch.SymInt) and size.node.expr == wanted.node.expr:
                    node = self.graph.create_node("call_function", _SYM_SIZE, (self.env[r], dim), name=n.name)
                    node.meta = dict(n.meta)
                    return node
        raise CaptureError(
            f"model '{self.name}': pipeline stage {self.stage} needs the size '{n.name}' ({wanted}) of "
            f"'{n.args[0]}', which an earlier stage holds, and receives no tensor of that size to read it from; "
            "choose other split points."
        )


def _check_tensors(sent: Iterable[fx.Node], s: int, name: str) -> None:
    """A stage sends tensors only (``PipelineStage`` refuses anything else)."""
    sent = list(sent)
    if not sent:
        raise CaptureError(f"model '{name}': pipeline stage {s} hands nothing to stage {s + 1}; the split cuts no activation.")
    for n in sent:
        value = n.meta.get("val", n.meta.get("example_value"))
        if value is not None and not isinstance(value, torch.Tensor):
            raise CaptureError(
                f"model '{name}': pipeline stage {s} would hand '{n.name}' ({type(value).__name__}, made at '{node_fqn(n) or 'the top'}') "
                f"to stage {s + 1}, and pipeline stages pass tensors only; choose other split points."
            )
