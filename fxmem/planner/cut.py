"""The min-cut that decides which op outputs a selectively checkpointed block keeps: networkx enters fxmem here.

Note [The cut a selective checkpoint makes]
    torch's min-cut partitioner (torch/_functorch/partitioners.py, ``solve_min_cut``) builds a flow
    graph whose cut edges are the tensors to save, each costing its bytes, and recomputes only what
    backward needs from them. A selective checkpoint in eager mode cannot prune like that: in
    backward it reruns the block's Python code, and every op whose output it did not cache runs again,
    needed or not, up to the early stop (torch/utils/checkpoint.py, ``_CachedTorchDispatchMode``
    returns a cached output or calls the op; Note [Where a checkpointed block stops recomputing] in
    block_ops.py). So the choice is, per op, "cache its outputs" (pay their storages' bytes once,
    however many ops share them: a view, the three outputs of a LayerNorm) or "run it again" (pay
    its FLOPs). With a price ``lam`` in FLOPs per byte that is a project-selection problem, which is
    a minimum s-t cut (Picard 1976; Kleinberg & Tardos, "Algorithm Design", section 7.11):

        source --flops(op)--> op --(infinite)--> storage --lam*bytes(storage)--> sink

    An op left on the source side is kept and forces its storages there, whose edges to the sink
    are cut (their bytes paid); an op on the sink side has its source edge cut (its FLOPs paid).
    Storages kept anyway (the block's inputs, state, what the rest of the model keeps) have no sink
    edge: caching an op whose outputs are all such storages is free. Capacities are integers
    (``lam`` a Fraction scales both sides), so the cut is exact.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import networkx as nx

__all__ = ["CutOp", "cut_block"]

_SOURCE, _SINK = "source", "sink"


@dataclass(frozen=True)
class CutOp:
    """An op the cut may keep: its FLOPs (what rerunning it costs) and its output storages."""

    index: int
    flops: int
    outputs: tuple[int, ...]


def cut_block(ops: Sequence[CutOp], nbytes: Mapping[int, int], free: Collection[int], lam: Fraction) -> frozenset[int]:
    """The ops to keep (by index) that minimize ``FLOPs rerun + lam * bytes kept``; see Note [The cut a selective checkpoint makes].

    >>> ops = [CutOp(0, flops=100, outputs=(7,)), CutOp(1, flops=30, outputs=(8,))]
    >>> sorted(cut_block(ops, {7: 10, 8: 20}, free=(), lam=Fraction(4)))   # keep op 0: 40 < 100; rerun op 1: 30 < 80
    [0]
    """
    graph = nx.DiGraph()
    graph.add_nodes_from((_SOURCE, _SINK))
    for op in ops:
        graph.add_edge(_SOURCE, ("op", op.index), capacity=op.flops * lam.denominator)
        for storage in op.outputs:
            if storage not in free:
                graph.add_edge(("op", op.index), ("storage", storage))  # no capacity: infinite (networkx's convention)
                graph.add_edge(("storage", storage), _SINK, capacity=nbytes[storage] * lam.numerator)
    _value, (reachable, _rest) = nx.minimum_cut(graph, _SOURCE, _SINK)
    return frozenset(node[1] for node in reachable if isinstance(node, tuple) and node[0] == "op")
