"""Frozen dataclasses and enums passed between the pipeline's stages (no logic beyond properties).

Results are keyed by fx node names and module paths (``fqn``), never by ``fx.Node`` objects, so they
can be compared, pickled and tested without a graph.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from torch import nn

from fxmem.inputs import InputSpec, check_batch
from fxmem.symbolic import ByteExpr

__all__ = ["Accounting", "Capture", "Kind", "LayerRow", "ModelSpec", "NodeInfo", "NodeRecord", "Report", "SavedTensor", "StateBytes", "Unsupported", "Verdict"]


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

    @property
    def total(self) -> int:
        return self.weights + self.buffers + self.gradients + self.optimizer


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
    """The answer to "which batch fits in this much memory"."""

    budget: int
    max_batch: int | None
    """None when even B=1 does not fit, or when memory does not grow with B (see ``unbounded``)."""
    floor: int
    """Total bytes at B=1: the least any batch size can cost."""
    unbounded: bool = False


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


@dataclass(frozen=True)
class Report:
    """Everything fxmem knows about one training step; ``str(report)`` is the table.

    Bytes are exact integers. Activations exclude the input batch and targets, which are reported on
    their own (``input_bytes``) and included in ``total_bytes``.
    """

    model: str
    inputs: tuple[InputSpec, ...]
    loss: str
    accounting: Accounting
    state: StateBytes
    batch: int = 32
    device_memory: int | None = None
    frontend: str = "fx"
    """How the graph was made: 'fx' (torch.fx.symbolic_trace) or 'export' (torch.export)."""
    seq_len: int | None = None
    """Where an input has a symbolic sequence axis S: the length every figure is evaluated at."""
    evaluate: Callable[[int], Mapping[str, int]] | None = field(default=None, compare=False, repr=False)
    _cache: dict[int, Mapping[str, int]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def nodes(self) -> tuple[NodeRecord, ...]:
        return self.accounting.nodes

    @property
    def activations(self) -> ByteExpr:
        """Activation bytes as ``per_sample * B + constant`` (exact for B >= 2 when ``linear``)."""
        return ByteExpr.total(n.saved for n in self.nodes)

    @property
    def batch_one_special(self) -> tuple[str, ...]:
        """Nodes whose exact bytes at B=1 differ from their line (see Note [Why B=1 is measured on its own])."""
        return tuple(n.name for n in self.nodes if 1 in n.exact and n.exact[1] != n.saved.at(1, self.seq_len))

    def node_bytes(self, batch: int) -> Mapping[str, int]:
        """Exact activation bytes per node at ``batch``."""
        check_batch(batch)
        if all(batch in n.exact for n in self.nodes) or self.accounting.linear or self.evaluate is None:
            return {n.name: n.at(batch, self.seq_len) for n in self.nodes}
        if batch not in self._cache:
            self._cache[batch] = self.evaluate(batch)
        return self._cache[batch]

    def activation_bytes(self, batch: int) -> int:
        return sum(self.node_bytes(batch).values())

    def input_bytes(self, batch: int) -> int:
        check_batch(batch)
        return self.accounting.inputs.at(batch, self.seq_len)

    def total_bytes(self, batch: int) -> int:
        """Model state + activations + the input batch, at ``batch``. Temporaries and the backward peak are not in it."""
        return self.state.total + self.activation_bytes(batch) + self.input_bytes(batch)

    def max_batch(self, budget_bytes: int) -> int | None:
        """The largest batch whose total fits in ``budget_bytes``; None if B=1 does not fit or nothing grows with B."""
        return self.verdict(budget_bytes).max_batch

    def verdict(self, budget_bytes: int) -> Verdict:
        floor = self.total_bytes(1)
        grows = self.total_bytes(2) > self.total_bytes(1)
        if floor > budget_bytes:
            return Verdict(budget_bytes, None, floor)
        if not grows:
            return Verdict(budget_bytes, None, floor, unbounded=True)
        return Verdict(budget_bytes, _largest_fitting(self.total_bytes, budget_bytes), floor)

    def layers(self, depth: int | None = None) -> tuple[LayerRow, ...]:
        from fxmem.report import group_layers

        return group_layers(self, depth)

    def to_dict(self) -> dict[str, object]:
        from fxmem.report import to_dict

        return to_dict(self)

    def __str__(self) -> str:
        from fxmem.report import render

        return render(self)


def _largest_fitting(total: Callable[[int], int], budget: int) -> int:
    """Largest B with total(B) <= budget, for a total that grows with B (exponential then binary search)."""
    lo, hi = 1, 2
    while total(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total(mid) <= budget else (lo, mid)
    return lo
