"""The training step as two line charts for the HTML page (fxmem/output/html_report.py): its live memory
over time by category with the peak marked, and its memory and throughput against the batch size.

Both draw what ``to_dict`` reports: ``Report.timeline`` and ``Report.peak`` at the page's batch, and
``Report.tradeoff``'s rows (the JSON's "tradeoff"), the same functions, so the figures agree.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fxmem.cost.tradeoff import TradeoffRow, batches_to_try
from fxmem.output.plot import CATEGORY_COLORS, category_series
from fxmem.output.render import format_bytes, format_rate, format_seconds
from fxmem.output.svg import WIDTH, Frame, Scale, byte_ticks, count_ticks, element, escape, frame_axes, points, title
from fxmem.results import Category, Peak, Timeline

if TYPE_CHECKING:
    from fxmem.report import Report

__all__ = ["NO_STEP", "draw_timeline", "draw_tradeoff", "thin", "tradeoff_note"]

NO_STEP = "The step was not simulated (analyze(..., peak=False) or --no-peak): no timeline, peak or throughput to draw."
_COLUMNS = 600
"""The most points the timeline draws per category (See Note [Thinning the timeline])."""


# Note [Thinning the timeline]
# A ResNet-50 step has thousands of allocations and releases; a point per event and category would
# make the page megabytes. Above _COLUMNS events, the events are cut into _COLUMNS runs and each run is
# drawn at its highest point (all categories at that event), so every local top keeps its height, and
# the peak's event is always one of the points drawn: the marker sits on the drawn curve.


def thin(totals: Sequence[int], keep: int, limit: int = _COLUMNS) -> list[int]:
    """The indices drawn: all of them up to ``limit``, else the highest of each run, the ends and ``keep``."""
    n = len(totals)
    if n <= limit:
        return list(range(n))
    size = -(-n // limit)
    tops = {max(range(i, min(i + size, n)), key=totals.__getitem__) for i in range(0, n, size)}
    return sorted(tops | {0, n - 1, keep})


def draw_timeline(report: Report) -> str:
    """The steady step at the report's batch as an inline SVG (stacked areas, phases, the peak), and its legend."""
    if report.steps is None:
        return f'<p class="none">{escape(NO_STEP)}</p>'
    b, frame = report.batch, Frame(WIDTH, 360, top=44)
    timeline, peak = report.timeline(b), report.peak(b)
    series = category_series(timeline, b, report.seq_len)
    order = [c for c in Category if any(series[c])]
    totals = [sum(series[c][i] for c in order) for i in range(len(timeline.events) + 1)]
    ticks = byte_ticks(int(max(totals) * 1.08))
    x = Scale(0, max(len(totals) - 1, 1), frame.left, frame.right)
    y = Scale(0, max(max(totals) * 1.08, ticks[-1][0]), frame.bottom, frame.top)
    body = frame_axes(frame, y, ticks, label="live memory")
    body += _areas(series, order, thin(totals, peak.event + 1), x, y)
    body += _phase_marks(timeline, x, frame) + _peak_mark(peak, x, y, frame)
    body += element("text", {"class": "axis", "x": (frame.left + frame.right) / 2, "y": frame.height - 8, "text-anchor": "middle"},
                    escape(f"allocations and releases, in order ({len(timeline.events)} events; {'first' if timeline.first_step else 'steady'} step)"))  # fmt: skip
    svg = element("svg", {"class": "chart timeline", "viewBox": f"0 0 {WIDTH} {frame.height}", "role": "img"}, body)
    return svg + _legend([(c.value, CATEGORY_COLORS[c]) for c in order])


def _areas(series: dict[Category, list[int]], order: Sequence[Category], cols: Sequence[int], x: Scale, y: Scale) -> str:
    """One polygon per category, stacked in ``order`` from the bottom."""
    below = [0] * len(cols)
    xs = [x(i) for i in cols]
    parts = []
    for c in order:
        above = [below[k] + series[c][i] for k, i in enumerate(cols)]
        outline = list(zip(xs, map(y, above))) + list(zip(reversed(xs), map(y, reversed(below))))
        attrs = {"class": "area", "data-category": c.value, "fill": CATEGORY_COLORS[c], "points": points(outline)}
        parts.append(element("polygon", attrs, title([c.value])))
        below = above
    return "".join(parts)


def _phase_marks(timeline: Timeline, x: Scale, frame: Frame) -> str:
    """A dotted line where each phase starts, its name above the chart; a name that would run into the
    one before it (the loss is a few events long) goes up a row, as fxmem/output/plot.py does."""
    starts: dict[str, int] = {}
    for i, e in enumerate(timeline.events):
        starts.setdefault(e.phase.value, i + 1)
    parts, row, last = [], 0, None
    for name, i in starts.items():
        row = 1 - row if last is not None and x(i) - last < 90 else 0
        last = x(i)
        parts.append(element("line", {"class": "phase", "x1": x(i), "x2": x(i), "y1": frame.top, "y2": frame.bottom}))
        parts.append(element("text", {"class": "tick", "x": x(i) + 3, "y": frame.top - 6 - 14 * row}, escape(name)))
    return "".join(parts)


def _peak_mark(peak: Peak, x: Scale, y: Scale, frame: Frame) -> str:
    """The peak: a dashed line at its event, a dot at its height, and its bytes, phase, node and split on hover."""
    px, py = x(peak.event + 1), y(peak.bytes)
    where = f"in {peak.phase.value} at {peak.node} ({peak.op})" + (f", {peak.fqn}" if peak.fqn and peak.fqn != peak.node else "")
    lines = [f"peak at B={peak.batch}: {peak.bytes} B ({format_bytes(peak.bytes)})", where]
    lines += [f"{c.value}: {n} B ({format_bytes(n)})" for c, n in peak.breakdown.items()]
    anchor, dx = ("end", -8) if px > frame.right - 260 else ("start", 8)
    body = title(lines) + element("line", {"x1": px, "x2": px, "y1": frame.top, "y2": frame.bottom})
    body += element("circle", {"cx": px, "cy": py, "r": 5})
    body += element("text", {"class": "peaklabel", "x": px + dx, "y": max(py - 8, frame.top + 12), "text-anchor": anchor},
                    escape(f"peak {format_bytes(peak.bytes)} ({peak.phase.value})"))  # fmt: skip
    return element("g", {"class": "peak tip", "data-bytes": peak.bytes, "data-event": peak.event}, body)


def _legend(entries: Sequence[tuple[str, str]]) -> str:
    spans = "".join(f'<span><i style="background:{colour}"></i>{escape(name)}</span>' for name, colour in entries)
    return f'<div class="legend">{spans}</div>'


# --- memory and throughput against B ------------------------------------------------------------------


@dataclass(frozen=True)
class _Line:
    label: str
    colour: str
    values: tuple[float, ...]
    right: bool = False
    """Drawn on the right axis (samples per second) rather than the left (bytes)."""


def tradeoff_note(report: Report) -> str:
    """The sentence above the batch-size chart: what its lines are."""
    if report.steps is None:
        return "Model state and the total (state + activations + inputs) at each batch size; " + NO_STEP
    return (
        f"Memory at each batch size, and on the right axis a roofline upper bound on samples per second on {report.gpu.label} "
        "(an estimate, not a benchmark). Hover a batch size for its numbers."
    )


def draw_tradeoff(report: Report) -> str:
    """Memory (and the bound on throughput) against B as an inline SVG: the trade-off's rows where the step was
    simulated, the totals without it; and its legend."""
    budget = report.device_memory
    largest = report.max_batch(budget) if budget is not None else None
    if report.steps is None:
        batches = batches_to_try(largest, report.batch)
        lines = [
            _Line("model state", "#4c72b0", tuple(float(report.state.total) for _ in batches)),
            _Line("total: state + activations + inputs", "#222222", tuple(float(report.total_bytes(b)) for b in batches)),
        ]
        hovers = [[f"B={b}", f"total {report.total_bytes(b)} B ({format_bytes(report.total_bytes(b))})"] for b in batches]
        columns = [{"data-batch": b, "data-total": report.total_bytes(b)} for b in batches]
    else:
        rows = report.tradeoff()
        batches = [r.batch for r in rows]
        lines = [
            _Line("model state", "#4c72b0", tuple(float(r.state) for r in rows)),
            _Line("peak of the step", "#222222", tuple(float(r.peak) for r in rows)),
            *(
                [_Line("GPU total (nvidia-smi)", "#dd8452", tuple(float(r.device) for r in rows))]
                if report.steps.device is not None
                else []
            ),
            _Line(f"samples/s, upper bound on {report.gpu.label}", "#8172b3", tuple(r.samples_per_second for r in rows), right=True),
        ]
        hovers = [_row_hover(r, report.gpu.label) for r in rows]
        columns = [
            {"data-batch": r.batch, "data-peak": r.peak, "data-device": r.device, "data-state": r.state, "data-activations": r.activations}
            for r in rows
        ]
    chart = _line_chart(batches, lines, budget, largest, columns, hovers)
    legend = [(line.label, line.colour) for line in lines] + ([(f"device {format_bytes(budget)}", "#c44e52")] if budget is not None else [])
    return chart + _legend(legend)


def _row_hover(r: TradeoffRow, gpu: str) -> list[str]:
    """The tooltip of one batch size: its row of the trade-off, bytes exact."""
    return [
        f"B={r.batch}",
        f"peak {r.peak} B ({format_bytes(r.peak)})",
        f"device {r.device} B ({format_bytes(r.device)})",
        f"state {r.state} B, activations {r.activations} B",
        f"step >= {format_seconds(r.seconds)}, <= {format_rate(r.samples_per_second)} samples/s on {gpu} ({r.peak_share:.0%} of peak FLOP/s)",
    ]


def _line_chart(
    batches: Sequence[int],
    lines: Sequence[_Line],
    budget: int | None,
    largest: int | None,
    columns: Sequence[Mapping[str, object]],
    hovers: Sequence[list[str]],
) -> str:
    """Lines against B on a log2 axis: bytes on the left, samples/s on the right, the device's memory
    dashed across and the largest batch that fits dotted up; a hover column per batch size."""
    frame = Frame(WIDTH, 360)
    hi = max([*(v for line in lines if not line.right for v in line.values), *([budget] if budget is not None else [])])
    ticks = byte_ticks(int(hi * 1.05))
    x = Scale(batches[0], max(batches[-1], batches[0] + 1), frame.left + 10, frame.right - 10, log2=True)
    y = Scale(0, max(hi * 1.05, ticks[-1][0]), frame.bottom, frame.top)
    body = frame_axes(frame, y, ticks, label="memory")
    rates = [v for line in lines if line.right for v in line.values]
    yr = Scale(0, max(rates) * 1.1 if rates else 1.0, frame.bottom, frame.top)
    if rates:
        body += frame_axes(frame, yr, count_ticks(max(rates) * 1.1), side="right", label="samples/s (upper bound)")
    body += _budget_marks(budget, largest, x, y, frame)
    for line in lines:
        scale = yr if line.right else y
        xy = [(x(b), scale(v)) for b, v in zip(batches, line.values)]
        body += element("polyline", {"points": points(xy), "stroke": line.colour})
        body += "".join(element("circle", {"cx": px, "cy": py, "r": 3, "fill": line.colour}) for px, py in xy)
    body += _batch_axis(batches, x, frame) + _hover_columns(batches, columns, hovers, x, frame)
    return element("svg", {"class": "chart tradeoff", "viewBox": f"0 0 {WIDTH} {frame.height}", "role": "img"}, body)


def _budget_marks(budget: int | None, largest: int | None, x: Scale, y: Scale, frame: Frame) -> str:
    if budget is None:
        return ""
    out = element("line", {"class": "budget", "x1": frame.left, "x2": frame.right, "y1": y(budget), "y2": y(budget)})
    if largest is not None:
        out += element("line", {"class": "largest", "x1": x(largest), "x2": x(largest), "y1": frame.top, "y2": frame.bottom})
        out += element(
            "text", {"class": "tick", "x": x(largest) - 4, "y": frame.top + 12, "text-anchor": "end"}, escape(f"largest batch {largest}")
        )
    return out


def _batch_axis(batches: Sequence[int], x: Scale, frame: Frame) -> str:
    """The batch sizes under the axis; where two would overlap the larger one stays (the last is the largest that fits)."""
    kept: list[int] = []
    for b in reversed(batches):
        if not kept or x(kept[-1]) - x(b) >= 8 * len(str(kept[-1])) + 8:
            kept.append(b)
    ticks = "".join(element("text", {"class": "tick", "x": x(b), "y": frame.bottom + 16, "text-anchor": "middle"}, str(b)) for b in kept)
    return ticks + element(
        "text", {"class": "axis", "x": (frame.left + frame.right) / 2, "y": frame.height - 6, "text-anchor": "middle"}, "batch size B"
    )


def _hover_columns(
    batches: Sequence[int], columns: Sequence[Mapping[str, object]], hovers: Sequence[list[str]], x: Scale, frame: Frame
) -> str:
    """A transparent column around each batch size whose tooltip is that row of the trade-off."""
    edges = [frame.left, *((x(a) + x(b)) / 2 for a, b in itertools.pairwise(batches)), frame.right]
    return "".join(
        element(
            "rect",
            {"class": "batch tip", **data, "x": lo, "y": frame.top, "width": hi - lo, "height": frame.bottom - frame.top},
            title(lines),
        )
        for lo, hi, data, lines in zip(edges, edges[1:], columns, hovers)
    )
