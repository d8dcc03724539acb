"""Turn the passes' saved storages into activation bytes per node, as a*B + c.

Note [Why B=1 is measured on its own]
    ShapeEnv assumes a symbolic size is neither 0 nor 1 (0/1 specialization), so the symbolic pass
    describes B >= 2. At B=1 some kernels take another path (a reshape that is a view at B=1 and a
    copy above it, a squeeze that drops the batch axis). B=1 is the floor users ask about ("does one
    sample fit?"), so a concrete pass at B=1 supplies its exact bytes, and the report says where
    they differ from the line.

Note [Concrete passes]
    Some models fix the batch symbol to a constant (a guard on B) and some kernels cannot run with
    symbolic sizes (the CPU LSTM). Then concrete passes at several batch sizes fit a*B + c through
    two of them and verify it on a third; where the line does not hold (page-rounded kernel
    workspaces), exact bytes at any B come from a further concrete pass, never from the line.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from fxmem.results import Accounting, Capture, Kind, NodeInfo, NodeRecord, SavedTensor, Unsupported
from fxmem.symbolic import ByteExpr, fit_linear

__all__ = ["Accounting", "account_bytes", "activation_total", "node_bytes_at"]

FIT_BATCHES = (2, 3)
"""Concrete batch sizes that fix a*B + c when the symbolic pass cannot run (see Note [Concrete passes])."""
VERIFY_BATCH = 5
"""A further batch size on which a fitted line is checked."""


def activation_total(capture: Capture) -> ByteExpr:
    """All activation bytes of one pass (each storage once)."""
    return ByteExpr.total(s.nbytes for s in capture.saved if s.kind == Kind.ACTIVATION)


def _by_node(capture: Capture) -> dict[str, list[SavedTensor]]:
    charged: dict[str, list[SavedTensor]] = defaultdict(list)
    for s in capture.saved:
        if s.kind == Kind.ACTIVATION:
            charged[s.node].append(s)
    return charged


def node_bytes_at(capture: Capture) -> dict[str, int]:
    """Activation bytes per node of a concrete pass (measure.py's real run, or a fake one)."""
    assert capture.batch is not None
    return {node: sum(s.nbytes.at(capture.batch) for s in ts) for node, ts in _by_node(capture).items()}


def account_bytes(
    symbolic: Capture | None, concrete: Mapping[int, Capture], *, note: str = "", batch_one_error: str = ""
) -> Accounting:
    """Merge a symbolic pass (if it ran) with concrete passes into one record per node."""
    exact = {b: node_bytes_at(c) for b, c in concrete.items()}
    if symbolic is not None:
        lines = {node: ByteExpr.total(s.nbytes for s in ts) for node, ts in _by_node(symbolic).items()}
        base, linear, method = symbolic, True, "symbolic"
    else:
        lines, linear = _fit_nodes(exact)
        base, method = concrete[min(b for b in concrete if b != 1)], "concrete"
    tensors = _by_node(base)
    records = tuple(_record(info, lines, exact, tensors) for info in base.nodes)
    unsupported = _merge_unsupported([base, *concrete.values()])
    inputs = base.inputs if symbolic is not None else _fit_inputs(concrete)
    return Accounting(records, inputs, method, linear, unsupported, note, batch_one_error)


def _record(
    info: NodeInfo,
    lines: Mapping[str, ByteExpr],
    exact: Mapping[int, Mapping[str, int]],
    tensors: Mapping[str, list[SavedTensor]],
) -> NodeRecord:
    at = {b: per.get(info.name, 0) for b, per in exact.items()}
    return NodeRecord(info, lines.get(info.name, ByteExpr()), at, tuple(tensors.get(info.name, ())))


def _fit_nodes(exact: Mapping[int, Mapping[str, int]]) -> tuple[dict[str, ByteExpr], bool]:
    """Fit each node's line through FIT_BATCHES and check it at the other concrete batches >= 2."""
    names = {n for per in exact.values() for n in per}
    lines: dict[str, ByteExpr] = {}
    linear = True
    for name in names:
        samples = {b: exact[b].get(name, 0) for b in FIT_BATCHES}
        try:
            line = fit_linear(samples)
        except ValueError:
            line, linear = _slope_through(samples), False
        linear &= all(line.at(b) == per.get(name, 0) for b, per in exact.items() if b >= 2)
        lines[name] = line
    return lines, linear


def _slope_through(samples: Mapping[int, int]) -> ByteExpr:
    (b0, y0), (b1, y1) = sorted(samples.items())[:2]
    slope = (y1 - y0) // (b1 - b0)
    return ByteExpr(per_sample=slope, fixed=y0 - slope * b0)


def _fit_inputs(concrete: Mapping[int, Capture]) -> ByteExpr:
    return fit_linear({b: concrete[b].inputs.at(b) for b in FIT_BATCHES})


def _merge_unsupported(captures: Sequence[Capture]) -> tuple[Unsupported, ...]:
    seen: dict[tuple[str, str], Unsupported] = {}
    for c in captures:
        for u in c.unsupported:
            seen.setdefault((u.node, u.reason), u)
    return tuple(seen.values())
