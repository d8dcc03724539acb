"""Frozen dataclasses and enums passed between the pipeline's stages: data only, importing no stage.

Results are keyed by fx node names and module paths (``fqn``), never by ``fx.Node`` objects, so they
can be compared, pickled and tested without a graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from torch import nn

from fxmem.symbolic import ByteExpr

__all__ = [
    "Accounting",
    "Capture",
    "Category",
    "DevicePeak",
    "EnvelopePiece",
    "Estimated",
    "EstimatedBytes",
    "Kind",
    "LayerRow",
    "Loop",
    "MemoryEvent",
    "ModelSpec",
    "NodeInfo",
    "NodeRecord",
    "OpCostRecord",
    "Peak",
    "PerGpuState",
    "Phase",
    "SavedTensor",
    "ShardLine",
    "StateBytes",
    "Timeline",
    "Unsupported",
    "Verdict",
    "WorkspaceBound",
    "WorkspaceLines",
    "ZERO_GRAD_PLACES",
]


class Kind(StrEnum):
    """What a saved storage is, which decides the pile it belongs to.

    - PARAM: a parameter (model state; saving it costs nothing extra).
    - BUFFER: a registered buffer such as BatchNorm's running statistics (model state).
    - INPUT: the input batch or a loss target; the data loader holds it anyway, so it is reported
      on its own line, not among the activations.
    - ACTIVATION: anything the step allocated and autograd keeps until backward.
    """

    PARAM = "param"
    BUFFER = "buffer"
    INPUT = "input"
    ACTIVATION = "activation"


class Phase(StrEnum):
    """The parts of one training step, in the order they run."""

    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    CLIP = "clip_grad_norm"
    """``torch.nn.utils.clip_grad_norm_`` between backward and the optimizer step, where the loop clips (``Loop.clip_grad_norm``)."""
    OPTIMIZER = "optimizer step"
    ZERO_GRAD = "zero_grad"


class Category(StrEnum):
    """What a live storage is, in the categories of torch.profiler's memory timeline.

    - ACTIVATION: made by the forward or the loss and kept until backward (saved for it), or the
      model's output, which the caller holds for the whole step.
    - TEMPORARY: anything else the step makes and releases: the forward's intermediate values, the
      gradients flowing through backward, the optimizer's per-parameter scratch tensors.
    - COMMUNICATION: what a sharded step's engine allocates for its collectives (FSDP2's all-gather
      buffers and the full-size weights it gathers into, its reduce-scatter buffers); fxmem/parallel.
    """

    PARAMETER = "parameter"
    BUFFER = "buffer"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer state"
    INPUT = "input"
    ACTIVATION = "activation"
    TEMPORARY = "temporary"
    COMMUNICATION = "communication"


STATE_CATEGORIES = (Category.PARAMETER, Category.BUFFER, Category.GRADIENT, Category.OPTIMIZER_STATE)
"""The categories that make up model state."""


@dataclass(frozen=True)
class MemoryEvent:
    """One storage allocated (``alloc``) or released during the step, with its bytes in B (and S)."""

    phase: Phase
    alloc: bool
    nbytes: ByteExpr
    category: Category
    node: str
    """The fx node running (forward; backward runs the node's gradient), 'loss', or the parameter the optimizer updates."""
    fqn: str
    op: str
    storage: int
    """A number per storage, the same for its allocation and its release."""
    bound: WorkspaceBound | None = field(default=None, compare=False, repr=False)
    """For a kernel workspace whose size is an estimate (the library picks its engine when it runs):
    what it is and the most it can be. None where the size is known."""
    at_batch: Callable[[int], int | None] | None = field(default=None, compare=False, repr=False)
    """For one line of a kernel workspace (``WorkspaceLines``): at a concrete batch, the bytes to add,
    or None where the line is not there (Note [A symbolic step at a batch where another kernel runs])."""


@dataclass(frozen=True)
class OpCostRecord:
    """What one op of the step computes and moves (fxmem/engine/flops.py), as polynomials in B (and S).

    ``flops`` follows torch.utils.flop_counter's formulas; ``has_formula`` is False for ops it has none
    for (elementwise ops, norms), whose FLOPs are then 0 and which reports list by name. ``read`` and
    ``written`` are the bytes of the op's distinct inputs and outputs (an unfused kernel's traffic).
    """

    phase: Phase
    node: str
    fqn: str
    op: str
    dtype: str
    """The dtype of the op's first floating input: which peak rate its FLOPs run at."""
    flops: ByteExpr
    read: ByteExpr
    written: ByteExpr
    has_formula: bool


@dataclass(frozen=True)
class WorkspaceLines:
    """A kernel workspace that is the largest of ``lines`` (bytes in B) at every B >= 2 where
    ``exact_at(B)``; elsewhere another kernel runs (Note [Kernel choices that change with the batch])."""

    lines: tuple[object, ...]
    exact_at: Callable[[int], bool] = lambda batch: True
    at_batch: tuple[Callable[[int], int | None], ...] | None = None
    """Per line, at a concrete batch: the bytes to add to it for the kernel that runs there, or None
    where that line is not there at all; None where the rule cannot say (a batch ``exact_at`` refuses
    is then simulated). See Note [A symbolic step at a batch where another kernel runs]."""


@dataclass(frozen=True)
class WorkspaceBound:
    """An estimated workspace's name ("cuDNN convolution workspace") and ``at(batch)``, the most it can be."""

    what: str
    at: Callable[[int], int]


@dataclass(frozen=True)
class Estimated:
    """What a workspace rule returns where the library chooses the kernel at run time: its best estimate
    (bytes, or ``WorkspaceLines``), charged like any workspace, and its bound."""

    found: object
    bound: WorkspaceBound


@dataclass(frozen=True)
class EstimatedBytes:
    """An estimated workspace alive at a peak: what fxmem charged and the most it could be (``bound``)."""

    what: str
    node: str
    fqn: str
    op: str
    nbytes: int
    bound: int


ZERO_GRAD_PLACES = ("after-step", "before-backward")
"""Where a training loop calls ``optimizer.zero_grad()``: after ``optimizer.step()``, or after the loss,
just before ``loss.backward()``."""


@dataclass(frozen=True)
class Loop:
    """What the training loop around the step does beyond forward, loss, backward and the optimizer
    step. The defaults are the loop fxmem simulates unless told otherwise: no clipping, and
    ``zero_grad(set_to_none=True)`` after ``optimizer.step()``, ``out`` and the loss dropped each step.
    See Note [What a loop holds from the step before] in fxmem/step/timeline.py."""

    clip_grad_norm: float | None = None
    """``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` between backward and the step, at this max_norm."""
    zero_grad: str = "after-step"
    """One of ``ZERO_GRAD_PLACES``: where ``optimizer.zero_grad(set_to_none=True)`` runs."""
    keep_outputs: bool = False
    """The loop holds each step's output and loss until the next ones replace them (``out = model(x)``)."""

    @property
    def plain(self) -> bool:
        """Whether this is the default loop, whose steady step holds nothing of the step before but state."""
        return self == Loop()

    def describe(self) -> str:
        """The loop's settings that differ from the defaults, in words ("" for the default loop)."""
        parts = [f"clip_grad_norm_(max_norm={self.clip_grad_norm:g})"] if self.clip_grad_norm is not None else []
        parts += ["zero_grad before backward"] if self.zero_grad == "before-backward" else []
        return ", ".join(parts + (["outputs kept across steps"] if self.keep_outputs else []))


@dataclass(frozen=True)
class Timeline:
    """Every allocation and release of one training step, in order, on top of what lives before it.

    ``baseline`` is what exists when the step starts: weights, buffers, the input batch and targets,
    and, in a steady step, the optimizer state (a first step creates it inside ``optimizer.step()``).
    ``batch`` is None for a timeline with a symbolic batch, valid for every B >= 2.
    """

    batch: int | None
    first_step: bool
    baseline: Mapping[Category, ByteExpr]
    events: tuple[MemoryEvent, ...]
    baseline_storages: tuple[tuple[Category, ByteExpr], ...] = ()
    """The baseline storage by storage, in the order they were made (an allocator replays them first)."""
    costs: tuple[OpCostRecord, ...] = ()
    """Every op's FLOPs and bytes moved, in order (views and metadata queries left out)."""
    checks: tuple[Callable[[int], bool], ...] = ()
    """For a symbolic timeline, whether its bytes are the step's at a batch, one per kernel whose
    buffers depend on the batch otherwise than by a line (Note [Kernel choices that change with the
    batch] in fxmem/step/timeline.py); where one says no, a concrete timeline serves that batch."""

    contexts: tuple[str, ...] = field(default=(), compare=False, repr=False)
    """Per event of a first step, the module path of the op running when it happened: which block
    it belongs to when a deep model's step is extended from a shallow one (fxmem/step/repeats.py)."""
    corrected: tuple[Callable[[int], bool], ...] = ()
    """Checks like ``checks`` whose kernels' events say what they are at any batch (``MemoryEvent.at_batch``):
    where one says no, ``at_batch`` gives the step there without simulating it."""
    loop: Loop = Loop()
    """The training loop the step runs in, which decides what a steady step holds from the step before
    (``steady_step`` in fxmem/step/timeline.py)."""

    def exact_at(self, batch: int) -> bool:
        return all(check(batch) for check in self.checks) and all(check(batch) for check in self.corrected)

    def at_batch(self, batch: int, seq: int | None, *, costs: bool = True) -> Timeline | None:
        """This symbolic step at a concrete ``batch`` (and ``seq``), its workspaces those of the kernels
        that run there: every size a number, as a step simulated at that batch has them. None where a
        check that no event can correct refuses the batch. See Note [A symbolic step at a batch where
        another kernel runs]. ``costs=False`` leaves the ops' FLOPs and bytes moved out (an allocator
        replay needs only the events: half the work)."""
        if not all(check(batch) for check in self.checks):
            return None
        done: dict[int, ByteExpr] = {}  # by identity: a deep step's copied events share their ByteExprs

        def at(x: ByteExpr) -> ByteExpr:
            found = done.get(id(x))
            if found is None:
                found = done[id(x)] = ByteExpr(fixed=x.at(batch, seq))
            return found

        events = []
        for e in self.events:
            if e.at_batch is None:
                events.append(MemoryEvent(e.phase, e.alloc, at(e.nbytes), e.category, e.node, e.fqn, e.op, e.storage, e.bound))
                continue
            extra = e.at_batch(batch)
            nbytes = None if extra is None else e.nbytes.at(batch, seq) + extra
            if nbytes:  # a workspace of 0 is none, and one that is not there (None) neither
                events.append(replace(e, nbytes=ByteExpr(fixed=nbytes), at_batch=None))
        costs = tuple(
            OpCostRecord(c.phase, c.node, c.fqn, c.op, c.dtype, at(c.flops), at(c.read), at(c.written), c.has_formula)
            for c in (self.costs if costs else ())
        )
        return replace(
            self,
            batch=batch,
            baseline={k: at(v) for k, v in self.baseline.items()},
            events=tuple(events),
            baseline_storages=tuple((k, at(v)) for k, v in self.baseline_storages),
            costs=costs,
            checks=(),
            corrected=(),
            contexts=(),
        )


@dataclass(frozen=True)
class EnvelopePiece:
    """One piece of the peak as a function of B: from ``first_batch`` to ``last_batch`` (None: no end),
    the peak is ``per_sample * B + fixed``, reached in ``phase`` at ``node``."""

    first_batch: int
    last_batch: int | None
    per_sample: int
    fixed: int
    phase: Phase
    node: str


@dataclass(frozen=True)
class DevicePeak:
    """What a GPU shows for one step at one batch size (fxmem/gpu/device.py), in torch's and nvidia-smi's terms."""

    gpu: str
    allocated: int
    """``torch.cuda.max_memory_allocated()``: the peak of the caching allocator's blocks (rounded)."""
    reserved: int
    """``torch.cuda.max_memory_reserved()``: the peak of its segments."""
    total: int
    """What nvidia-smi would show: the reserved peak plus what only the driver holds (the CUDA context)."""
    capacity: int
    """The device memory the step was replayed against (the GPU's as nvidia-smi shows it, or ``--device-memory``)."""
    overheads: tuple[tuple[str, int, str], ...]
    """The fixed costs as (name, bytes, why); see fxmem/gpu/overheads.py."""
    extra: tuple[tuple[str, int, str], ...] = ()
    """Per-GPU storages beyond the simulated step (master weights, gathered units) as (name, bytes, why)."""
    fits: bool = True
    """No allocation ran out of memory when replayed against ``capacity`` (the allocator released its
    cache and retried first, as torch does; Note [When cudaMalloc fails] in fxmem/gpu/allocator.py)."""
    oom_node: str = ""
    """Where it first ran out: the node (and phase) whose allocation failed; "" when it fits."""
    shrunk: tuple[str, ...] = ()
    """Nodes whose cuDNN workspace did not fit and whose convolution then runs an engine without one
    (Note [A workspace that does not fit] in fxmem/gpu/allocator.py)."""
    alloc_conf: str = "torch defaults"
    """The allocator's settings the replay followed (``PYTORCH_CUDA_ALLOC_CONF``, memory fraction)."""
    short: int = 0
    """How many bytes more the allocator would have needed (its reserved peak, carried on past the
    failure, over what it could have); 0 when the step fits."""


@dataclass(frozen=True)
class Peak:
    """The highest point of one training step at one batch size, and what is alive there."""

    batch: int
    bytes: int
    first_step: bool
    phase: Phase
    node: str
    fqn: str
    op: str
    breakdown: Mapping[Category, int]
    event: int = -1
    """Index of the allocation at the peak in its timeline's ``events`` (-1: the baseline, before any)."""
    device: DevicePeak | None = None
    """For a cuda target: the same step through the GPU's allocator, with its fixed costs."""
    estimated: tuple[EstimatedBytes, ...] = ()
    """Estimated workspaces alive at the peak (a cuDNN convolution's), each with its bound."""
    upper: int | None = None
    """Where the step has estimated workspaces: its peak with each of them at its bound; else None."""

    @property
    def state(self) -> int:
        """Weights, buffers, gradients and optimizer state alive at the peak."""
        return sum(self.breakdown.get(c, 0) for c in STATE_CATEGORIES)

    @property
    def saved(self) -> int:
        """Activations alive at the peak (saved for backward, and the model output)."""
        return self.breakdown.get(Category.ACTIVATION, 0)

    @property
    def temporaries(self) -> int:
        return self.breakdown.get(Category.TEMPORARY, 0)

    @property
    def inputs(self) -> int:
        return self.breakdown.get(Category.INPUT, 0)

    @property
    def communication(self) -> int:
        """A sharded step's engine buffers alive at the peak (FSDP2's gathered weights, its collectives' buffers)."""
        return self.breakdown.get(Category.COMMUNICATION, 0)


@dataclass(frozen=True)
class ModelSpec:
    """What a model factory may return: the module, its default input specs and its default loss.

    ``inputs`` are spec strings with the batch symbol ``B`` (``"B,3,224,224"``, ``"B,128:int64"``),
    a list for positional inputs or a mapping for keyword inputs.
    """

    model: nn.Module
    inputs: Sequence[str] | Mapping[str, str]
    loss: str = "sum"
    name: str = ""
    extra: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class SavedTensor:
    """One storage that autograd keeps for backward, counted once at its full size.

    ``node`` is the node whose execution allocated the storage (it is charged there);
    ``saved_by`` lists the nodes that saved a view of it. ``shape`` is the first saved view's shape.
    """

    storage: int
    node: str
    saved_by: tuple[str, ...]
    shape: tuple[int | str, ...]
    dtype: str
    nbytes: ByteExpr
    kind: Kind


@dataclass(frozen=True)
class NodeInfo:
    """An fx node as the report shows it: its name, what it calls, and the module it belongs to."""

    name: str
    op: str
    target: str
    fqn: str
    output_shape: tuple[int | str, ...] | None


@dataclass(frozen=True)
class Unsupported:
    """A node whose saved bytes could not be taken at face value, and why."""

    node: str
    fqn: str
    reason: str


@dataclass(frozen=True)
class Capture:
    """What one pass over the graph saw: at a concrete batch, or symbolic (``batch is None``)."""

    batch: int | None
    nodes: tuple[NodeInfo, ...]
    saved: tuple[SavedTensor, ...]
    inputs: ByteExpr
    unsupported: tuple[Unsupported, ...] = ()


@dataclass(frozen=True)
class NodeRecord:
    """One node's activation bytes: ``saved`` as a polynomial in B, and exact values where measured.

    ``exact`` holds the bytes at batch sizes evaluated by a concrete pass (always B=1); they win over
    ``saved.at(B)`` where the two differ (see Note [Why B=1 is measured on its own] in account.py).
    """

    info: NodeInfo
    saved: ByteExpr
    exact: Mapping[int, int]
    tensors: tuple[SavedTensor, ...]

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def fqn(self) -> str:
        return self.info.fqn

    def at(self, batch: int, seq: int | None = None) -> int:
        """Bytes at ``batch``; ``exact`` values were taken at the report's sequence length."""
        return self.exact.get(batch, self.saved.at(batch, seq))


@dataclass(frozen=True)
class StateBytes:
    """Model state: everything that depends only on the parameters, not on the batch."""

    parameters: int
    trainable: int
    weights: int
    weights_by_dtype: Mapping[str, int]
    buffers: int
    gradients: int
    optimizer: int
    optimizer_name: str
    master: int = 0
    """An fp32 master copy of the trainable weights the optimizer updates (mixed-precision recipes)."""
    precision: str = ""
    """The recipe of fxmem/step/precision.py the bytes follow; "" when each parameter kept its own dtype."""
    frozen_by_dtype: Mapping[str, int] = field(default_factory=dict)
    """The part of ``weights_by_dtype`` held by parameters that do not require grad (a fine-tuned base
    under a PEFT adapter): they have no gradient, master copy or optimizer state."""

    @property
    def total(self) -> int:
        return self.weights + self.buffers + self.gradients + self.master + self.optimizer

    @property
    def frozen_weights(self) -> int:
        return sum(self.frozen_by_dtype.values())

    @property
    def trainable_by_dtype(self) -> dict[str, int]:
        """Weight bytes of the trainable parameters by dtype."""
        left = {d: n - self.frozen_by_dtype.get(d, 0) for d, n in self.weights_by_dtype.items()}
        return {d: n for d, n in left.items() if n}


@dataclass(frozen=True)
class LayerRow:
    """Activation bytes of one module path (or a group of them at a depth)."""

    fqn: str
    ops: tuple[str, ...]
    output_shape: tuple[int | str, ...] | None
    saved: ByteExpr
    exact: Mapping[int, int]
    nodes: tuple[str, ...]

    def at(self, batch: int, seq: int | None = None) -> int:
        return self.exact.get(batch, self.saved.at(batch, seq))


@dataclass(frozen=True)
class Verdict:
    """The answer to "which batch fits in this much memory" (Note [The largest batch] in fxmem/report.py)."""

    budget: int
    max_batch: int | None
    """The largest batch that fits; None when even B=1 does not fit, or when memory does not grow with B
    (see ``unbounded``)."""
    floor: int
    """Bytes at the least batch (B=1, or 2 where the model cannot train on one sample): the least any batch costs."""
    unbounded: bool = False
    basis: str = "peak"
    """'peak': the training step's peak (steady step); 'device total': nvidia-smi's total on the GPU, replayed through
    its caching allocator against the budget; 'total': state + activations + inputs, where the report
    was made without simulating the step."""
    checked: tuple[int, int] | None = None
    """The batches tried one by one around ``max_batch`` (first, last): every one above ``max_batch``
    failed, and every one below it fitted except ``gaps``."""
    gaps: tuple[int, ...] = ()
    """Batches below ``max_batch`` that do not fit (the total is not monotonic in B near the limit)."""
    exact: bool = True
    """False where some saved tensor's size depends on the data and was counted as 0 B: the batch is
    then what fits if those tensors were empty, not a bound."""
    floor_fits: bool = True
    """Whether the least batch fits (False also where ``max_batch`` is None for that reason)."""
    least: int = 1
    """The smallest batch a step can run: 2 where the model cannot train on one sample (BatchNorm)."""

    def describe(self) -> str:
        """The largest batch in words that cannot be misread: "every batch up to 877 fits; 878 does not"."""
        if self.unbounded:
            return "fits at any batch: memory does not grow with B"
        if self.max_batch is None:
            return "no batch fits: one sample does not" if self.least == 1 else f"no batch fits: B={self.least}, the least the model trains at, does not"
        n = self.max_batch
        first, last = self.checked if self.checked is not None else (1, n + 1)
        if first <= self.least:
            since = "" if self.least == 1 else f"from {self.least} "
            gaps = f" (except {_listed(self.gaps)}, which do not)" if self.gaps else ""
            words = f"every batch {since}up to {n} fits{gaps}; {n + 1} does not"
        else:
            gaps = f"; {_listed(self.gaps)} below it do not fit either" if self.gaps else ""
            words = f"largest batch {n}, {n + 1} does not fit (batches {first} to {last} each replayed{gaps})"
        return words if self.exact else words + " (if the data-dependent tensors listed below were empty: not a bound)"


def _listed(batches: tuple[int, ...]) -> str:
    shown = ", ".join(str(b) for b in batches[:5])
    return shown + (f" and {len(batches) - 5} more" if len(batches) > 5 else "")


@dataclass(frozen=True)
class Accounting:
    """Per-node activation bytes and how they were obtained."""

    nodes: tuple[NodeRecord, ...]
    inputs: ByteExpr
    method: str
    """'symbolic' (one pass with B as a symbol) or 'concrete' (passes at several fixed B)."""
    linear: bool
    """True when ``saved.at(B)`` is exact for every B >= 2; False when only concrete passes are exact."""
    unsupported: tuple[Unsupported, ...]
    note: str = ""
    batch_one_error: str = ""
    """Why a training step cannot run at B=1 (BatchNorm on one sample), or "" when it can."""
    path: str = ""
    """What the passes ran on: the whole model, or its repeated blocks from a shallow copy (Note [Repeated blocks])."""


@dataclass(frozen=True)
class ShardLine:
    """One kind of state on each GPU, and why it is that size."""

    nbytes: int
    why: str


@dataclass(frozen=True)
class PerGpuState:
    """The model state one of ``world_size`` GPUs holds under ``stage``."""

    stage: str
    world_size: int
    weights: ShardLine
    buffers: ShardLine
    gradients: ShardLine
    master: ShardLine
    optimizer: ShardLine
    gathered: ShardLine
    """Transient: full-size parameters (and for FSDP a unit's gradient) alive while a unit runs."""

    def lines(self) -> Iterator[tuple[str, ShardLine]]:
        for name in ("weights", "buffers", "gradients", "master", "optimizer", "gathered"):
            yield name, getattr(self, name)

    @property
    def total(self) -> int:
        return sum(line.nbytes for _, line in self.lines())
