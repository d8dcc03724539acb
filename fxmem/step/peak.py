"""The highest point of the step as a function of B, from the timeline.

After each allocation the live bytes are a polynomial ``p_i(B)`` (in B and S): the baseline plus
every allocation so far minus every release. The step's peak is their upper envelope,
``max_i p_i(B)``; where every ``p_i`` is a line ``a_i*B + c_i`` the envelope is a chain of pieces,
each the line of one moment of the step, exact at every B >= 2 (B=1 has its own timeline; see Note
[Why B=1 is measured on its own] in account.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from fxmem.errors import CaptureError
from fxmem.gpu.device import DeviceModel, replay_step
from fxmem.results import Category, DevicePeak, EnvelopePiece, EstimatedBytes, Peak, Phase, Timeline
from fxmem.step.state import HeldState, hold_state
from fxmem.step.timeline import steady_step
from fxmem.symbolic import ByteExpr

__all__ = ["Points", "StepPeaks", "envelope", "points"]

_NO_PHASE = Phase.FORWARD
"""The phase reported for a step that allocates nothing (its peak is the baseline, before the forward)."""


@dataclass(frozen=True)
class Points:
    """The live bytes right after each allocation of a timeline (``event`` indexes ``timeline.events``)."""

    timeline: Timeline
    event: tuple[int, ...]
    totals: tuple[ByteExpr, ...]

    @property
    def linear(self) -> bool:
        return all(t.is_linear and not t.seq_terms for t in self.totals)

    def highest(self, batch: int, seq: int | None) -> tuple[int, int]:
        """(bytes, position) of the first point that reaches the maximum at ``batch``."""
        values = [t.at(batch, seq) for t in self.totals]
        best = max(values)
        return best, values.index(best)


def points(timeline: Timeline) -> Points:
    live = ByteExpr.total(timeline.baseline.values())
    event: list[int] = []
    totals: list[ByteExpr] = []
    for n, e in enumerate(timeline.events):
        live = live + e.nbytes if e.alloc else live - e.nbytes
        if e.alloc:
            event.append(n)
            totals.append(live)
    if not event:  # a step that allocates nothing still holds its baseline
        event.append(-1)
        totals.append(live)
    return Points(timeline, tuple(event), tuple(totals))


def envelope(pts: Points, first_batch: int = 2) -> tuple[EnvelopePiece, ...]:
    """The pieces of ``max_i (a_i*B + c_i)`` for integer B >= ``first_batch``; linear points only.

    From ``first_batch`` on, the highest line is followed until a steeper one overtakes it, at the
    first integer B where it is strictly higher; ties keep the earlier moment of the step.
    """
    lines = [(t.per_sample, t.fixed) for t in pts.totals]
    best_per_slope: dict[int, tuple[int, int]] = {}
    for k, (a, c) in enumerate(lines):
        if a not in best_per_slope or c > lines[best_per_slope[a][1]][1]:
            best_per_slope[a] = (c, k)
    candidates = sorted((a, c, k) for a, (c, k) in best_per_slope.items())
    value = lambda a, c, b: a * b + c
    b = first_batch
    top = max(candidates, key=lambda x: (value(x[0], x[1], b), x[0], -x[2]))
    pieces: list[EnvelopePiece] = []
    while True:
        steeper = [x for x in candidates if x[0] > top[0]]
        overtakes = [(_overtake(top, x), x) for x in steeper]
        if not overtakes:
            pieces.append(_piece(pts, b, None, top))
            return tuple(pieces)
        at = min(o for o, _ in overtakes)
        nxt = max((x for o, x in overtakes if o == at), key=lambda x: (value(x[0], x[1], at), x[0]))
        pieces.append(_piece(pts, b, at - 1, top))
        b, top = at, nxt


def _overtake(top: tuple[int, int, int], other: tuple[int, int, int]) -> int:
    """The first integer B at which ``other`` (steeper) is strictly above ``top``."""
    (a0, c0, _), (a1, c1, _) = top, other
    return max((c0 - c1) // (a1 - a0) + 1, 0)


def _piece(pts: Points, first: int, last: int | None, line: tuple[int, int, int]) -> EnvelopePiece:
    e = pts.timeline.events[pts.event[line[2]]] if pts.event[line[2]] >= 0 else None
    return EnvelopePiece(first, last, line[0], line[1], e.phase if e else _NO_PHASE, e.node if e else "")


@dataclass
class StepPeaks:
    """The step's peak at any batch size, first step or steady, from the timelines fxmem simulated.

    ``symbolic`` is the first step's timeline with B symbolic (valid for B >= 2), or None where only
    concrete timelines are exact; ``exact`` holds concrete ones (B=1 where a step can run on one
    sample); ``simulate`` makes another concrete one on demand. ``make_symbolic`` and
    ``make_batch_one``, where given, make those two timelines the first time they are needed: a report
    at B=1 never needs the symbolic one unless asked about other batches.
    """

    symbolic: Timeline | None
    exact: dict[int, Timeline]
    simulate: Callable[[int], Timeline] | None = None
    seq: int | None = None
    note: str = ""
    batch_one_error: str = ""
    """Why the step cannot run at B=1 (BatchNorm on one sample); B=1 then follows the symbolic timeline."""
    make_symbolic: Callable[[], tuple[Timeline | None, str]] | None = field(default=None, repr=False)
    """Returns the symbolic timeline, or None and why not (then concrete timelines serve every B)."""
    make_batch_one: Callable[[], Timeline] | None = field(default=None, repr=False)
    device: DeviceModel | None = None
    """For a cuda target: how the GPU holds the step (allocator, fixed costs, per-GPU state)."""
    held: HeldState | None = None
    """What one GPU holds of the state beyond the simulated step's (a recipe's fp32 master copy and
    optimizer state, a sharding stage's shares): the peak counts it; ``timeline`` stays as simulated.
    See Note [The state the peak holds] in fxmem/step/state.py."""
    path: str = ""
    """What was simulated: the whole model, or its repeated blocks from a shallow copy (Note [Repeated blocks])."""
    _points: dict[tuple[int | None, bool], Points] = field(default_factory=dict, repr=False)
    _device: dict[tuple[int, bool, int | None], DevicePeak] = field(default_factory=dict, repr=False)
    _steady: dict[int, tuple[Timeline, Timeline]] = field(default_factory=dict, repr=False)

    def at_length(self, seq: int) -> StepPeaks:
        """The same step with its sequence axis evaluated at ``seq``: exact for B >= 2 where the symbolic
        timeline has S symbolic (Note [The longest padded batch] in fxmem/cost/tradeoff.py)."""
        return replace(self, seq=seq, _points={}, _device={}, _steady={})

    def timeline(self, batch: int, *, first_step: bool = False) -> Timeline:
        first = self._first(batch)
        return first if first_step else self._steady_of(first)

    def _steady_of(self, first: Timeline) -> Timeline:
        """``steady_step(first)``, made once per first-step timeline (the report asks it of a few, often)."""
        if id(first) not in self._steady:
            self._steady[id(first)] = (first, steady_step(first))  # ``first`` kept, so its id is not reused
        return self._steady[id(first)][1]

    def symbolic_timeline(self) -> Timeline | None:
        """The first step's timeline with B symbolic, made on first use; None where only concrete ones are exact."""
        if self.make_symbolic is not None:
            make, self.make_symbolic = self.make_symbolic, None
            self.symbolic, note = make()
            self.note = self.note or note
        return self.symbolic

    def _batch_one(self) -> None:
        """Make the B=1 timeline; if a step cannot run on one sample, B=1 follows the symbolic timeline."""
        make, self.make_batch_one = self.make_batch_one, None
        if make is None:
            return
        try:
            self.exact[1] = make()
        except CaptureError as e:
            if self.symbolic_timeline() is None:
                raise
            self.batch_one_error = str(e)

    def _first(self, batch: int) -> Timeline:
        if batch == 1:
            self._batch_one()
        if batch in self.exact:
            return self.exact[batch]
        symbolic = self.symbolic_timeline() if batch >= 2 or self.batch_one_error else None
        if symbolic is not None and (self.simulate is None or symbolic.exact_at(batch)):
            return symbolic
        there = symbolic.at_batch(batch, self.seq) if symbolic is not None else None
        if there is not None:
            self.exact[batch] = there
            return there
        if self.simulate is None:
            raise ValueError(f"no timeline covers B={batch}")
        self.exact[batch] = self.simulate(batch)
        return self.exact[batch]

    def _points_for(self, batch: int, first_step: bool) -> Points:
        first = self._first(batch)
        key = (first.batch, first_step)
        if key not in self._points:
            self._points[key] = points(hold_state(first if first_step else self._steady_of(first), self.held))
        return self._points[key]

    def bytes(self, batch: int, *, first_step: bool = False) -> int:
        """The peak of the step's storages at ``batch`` (the tensors alone, unrounded), its state as one GPU holds it."""
        return self._points_for(batch, first_step).highest(batch, self.seq)[0]

    def device_peak(self, batch: int, *, first_step: bool = False, budget: int | None = None) -> DevicePeak | None:
        """The step through the target GPU's allocator at ``batch``, against ``budget`` bytes of device
        memory (default the device model's); None for a cpu target."""
        if self.device is None:
            return None
        budget = None if budget == self.device.memory else budget
        key = (batch, first_step, budget)
        if key not in self._device:
            model = self.device if budget is None else replace(self.device, budget=budget)
            self._device[key] = replay_step(self._replayable(batch, first_step), batch, self.seq, model)
        return self._device[key]

    def _replayable(self, batch: int, first_step: bool) -> Timeline:
        """The step at ``batch`` for an allocator replay: its timeline where one is made already, else
        the symbolic one at that batch without the ops' costs (a largest-batch search replays dozens of
        batches whose FLOPs nobody asks for), not kept."""
        symbolic = self.symbolic if batch >= 2 and self.make_symbolic is None else None
        if batch in self.exact or symbolic is None or symbolic.exact_at(batch):
            return self.timeline(batch, first_step=first_step)
        light = symbolic.at_batch(batch, self.seq, costs=False)
        if light is None:
            return self.timeline(batch, first_step=first_step)
        return light if first_step else steady_step(light)

    def device_bytes(self, batch: int, budget: int | None = None) -> int:
        """What the device must hold for a steady step at ``batch``: nvidia-smi's total on a GPU, the
        tensors' peak on the CPU."""
        device = self.device_peak(batch, budget=budget)
        return device.total if device is not None else self.bytes(batch)

    def fits(self, batch: int, budget: int) -> bool:
        """Whether a steady step at ``batch`` fits in ``budget`` bytes: on a GPU, replayed through the
        caching allocator with no out-of-memory error (fxmem/gpu/device.py); on the CPU, its peak."""
        device = self.device_peak(batch, budget=budget)
        return device.fits if device is not None else self.bytes(batch) <= budget

    def peak(self, batch: int, *, first_step: bool = False) -> Peak:
        pts = self._points_for(batch, first_step)
        top, where = pts.highest(batch, self.seq)
        index = pts.event[where]
        timeline = pts.timeline
        breakdown = _breakdown(timeline, index, batch, self.seq)
        device = self.device_peak(batch, first_step=first_step)
        estimated, upper = _estimated(timeline, index, batch, self.seq)
        if index < 0:
            return Peak(batch, top, first_step, _NO_PHASE, "", "", "", breakdown, device=device, estimated=estimated, upper=upper)
        e = timeline.events[index]
        return Peak(batch, top, first_step, e.phase, e.node, e.fqn, e.op, breakdown, index, device, estimated, upper)

    def envelope(self, *, first_step: bool = False) -> tuple[EnvelopePiece, ...]:
        """The peak's pieces for B >= 2 where the symbolic timeline is linear in B; else ()."""
        symbolic = self.symbolic_timeline()
        if symbolic is None:
            return ()
        if 2 in self.exact:
            pts = points(hold_state(symbolic if first_step else self._steady_of(symbolic), self.held))
        else:
            pts = self._points_for(2, first_step)
        return envelope(pts) if pts.linear else ()


def _estimated(timeline: Timeline, index: int, batch: int, seq: int | None) -> tuple[tuple[EstimatedBytes, ...], int | None]:
    """The estimated workspaces alive right after event ``index``, and the step's peak with every
    estimated workspace at its bound (None where the step has none). See ``results.Estimated``."""
    if not any(e.bound is not None for e in timeline.events):
        return (), None
    level = sum(n.at(batch, seq) for n in timeline.baseline.values())
    extra: dict[int, int] = {}
    what: dict[int, str] = {}
    sizes: dict[int, int] = {}
    upper, at_peak = level, tuple[EstimatedBytes, ...]()
    for i, e in enumerate(timeline.events):
        n = e.nbytes.at(batch, seq)
        if e.alloc:
            sizes[e.storage] = n
            level += n
            if e.bound is not None:
                extra[e.storage] = max(0, e.bound.at(batch) - n)
                what[e.storage] = e.bound.what
        else:
            level -= sizes.pop(e.storage, 0)
            extra.pop(e.storage, None)
        upper = max(upper, level + sum(extra.values()))
        if i == index:
            at_peak = tuple(
                EstimatedBytes(what[x.storage], x.node, x.fqn, x.op, sizes[x.storage], sizes[x.storage] + extra[x.storage])
                for x in timeline.events[: i + 1]
                if x.alloc and x.storage in extra
            )
    return at_peak, upper


def _breakdown(timeline: Timeline, index: int, batch: int, seq: int | None) -> dict[Category, int]:
    """Live bytes by category right after event ``index`` (the baseline alone for -1)."""
    live = {c: e.at(batch, seq) for c, e in timeline.baseline.items()}
    for e in timeline.events[: index + 1]:
        sign = 1 if e.alloc else -1
        live[e.category] = live.get(e.category, 0) + sign * e.nbytes.at(batch, seq)
    return {c: live.get(c, 0) for c in Category if live.get(c, 0)}
