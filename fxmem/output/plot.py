"""Pictures of a report: memory against batch size with the top layers, and the step's timeline.

The only module that imports matplotlib, an optional extra (``pip install fxmem[plot]``), imported
when a picture is asked for, with the non-interactive Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxmem.errors import InputSpecError
from fxmem.output.render import format_bytes
from fxmem.results import Category, Timeline

if TYPE_CHECKING:
    from fxmem.report import Report

__all__ = ["CATEGORY_COLORS", "category_series", "plot_batches", "plot_timeline"]

_GIB = 2**30
CATEGORY_COLORS = {
    Category.PARAMETER: "#4c72b0",
    Category.BUFFER: "#64b5cd",
    Category.GRADIENT: "#dd8452",
    Category.OPTIMIZER_STATE: "#8172b3",
    Category.INPUT: "#937860",
    Category.ACTIVATION: "#55a868",
    Category.TEMPORARY: "#c44e52",
    Category.COMMUNICATION: "#da8bc3",
}
"""One colour per category, shared by the PNG and the HTML page (fxmem/output/html_report.py)."""


def _unit(largest: float) -> tuple[str, float]:
    """The unit a y axis is drawn in: GiB for large figures, MiB below 1 GiB, KiB below 1 MiB."""
    for name, scale in (("GiB", _GIB), ("MiB", 2**20)):
        if largest >= scale:
            return name, scale
    return "KiB", 1024


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise InputSpecError("pictures need matplotlib: pip install 'fxmem[plot]' (or pip install matplotlib), then run again.") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _batches(report: Report, budget: int | None) -> list[int]:
    """Batch sizes to draw: powers of two up to past the largest that fits (or past the report's batch)."""
    end = max(report.batch, 2)
    if budget is not None:
        fits = report.max_batch(budget)
        end = max(end, fits or 1)
    sizes, b = [], 1
    while b < 2 * end:
        sizes.append(b)
        b *= 2
    return sorted({*sizes, report.batch})


def plot_batches(report: Report, path: str | Path, *, top: int = 10) -> Path:
    """Memory against batch size (state, activations, inputs, peak, device line, largest batch), and
    the top layers' activation bytes at the report's batch as bars."""
    plt = _pyplot()
    budget = report.device_memory
    sizes = _batches(report, budget)
    unit, scale = _unit(max(report.total_bytes(sizes[-1]), budget or 0))
    state = [report.state.total / scale] * len(sizes)
    acts = [report.activation_bytes(b) / scale for b in sizes]
    inputs = [report.input_bytes(b) / scale for b in sizes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1.2, 1]})
    left.stackplot(sizes, state, acts, inputs, labels=["model state", "saved activations", "input batch"], colors=["#4c72b0", "#55a868", "#937860"], alpha=0.6)
    if report.steps is not None:
        label = "GPU total of the step (nvidia-smi)" if report.steps.device is not None else "peak of the step"
        left.plot(sizes, [report.step_bytes(b) / scale for b in sizes], "k-", lw=2, label=label)
    if budget is not None:
        left.axhline(budget / scale, color="#c44e52", ls="--", label=f"device {format_bytes(budget)}")
        fits = report.max_batch(budget)
        if fits is not None:
            left.axvline(fits, color="#c44e52", ls=":", label=f"largest batch {fits}")
    left.set_xscale("log", base=2)
    left.set_xlabel("batch size B")
    left.set_ylabel(unit)
    left.set_title(f"{report.model}: memory against batch size")
    left.legend(loc="upper left", fontsize=8)
    if report.steps is not None:
        _throughput(left, report, sizes)
    _layer_bars(right, report, top)
    fig.tight_layout()
    return _save(fig, plt, path)


def _throughput(ax: Any, report: Report, sizes: list[int]) -> None:
    """Samples per second against B on a second axis: the roofline bound of ``Report.step_time``."""
    twin = ax.twinx()
    rates = [report.step_time(b).samples_per_second(b) for b in sizes]
    twin.plot(sizes, rates, color="#8172b3", marker="o", ms=3, lw=1.5, label="samples/s (roofline upper bound)")
    twin.set_ylabel(f"samples/s on {report.gpu.label} (upper bound)")
    twin.set_ylim(bottom=0)
    twin.legend(loc="lower right", fontsize=8)


def _layer_bars(ax: Any, report: Report, top: int) -> None:
    rows = report.layers(1)
    per_node = report.node_bytes(report.batch)
    sized = sorted(((sum(per_node.get(n, 0) for n in r.nodes), r.fqn) for r in rows), reverse=True)[:top]
    names = [name for _, name in reversed(sized)]
    values = [v / 2**20 for v, _ in reversed(sized)]
    ax.barh(names, values, color="#55a868")
    ax.set_xlabel(f"saved activations at B={report.batch} (MiB)")
    ax.set_title(f"top {len(names)} layers")
    ax.tick_params(axis="y", labelsize=8)


def plot_timeline(timeline: Timeline, path: str | Path, *, title: str = "", seq: int | None = None, batch: int | None = None) -> Path:
    """The step's live memory over time (one tick per allocation or release), stacked by category,
    with the phases marked, like torch.profiler's memory timeline."""
    plt = _pyplot()
    b = timeline.batch if timeline.batch is not None else batch
    if b is None:
        raise InputSpecError("plot_timeline: a timeline with a symbolic batch needs batch=B to be drawn.")
    series = category_series(timeline, b, seq)
    fig, ax = plt.subplots(figsize=(12, 5))
    xs = list(range(len(series[Category.PARAMETER])))
    order = [c for c in Category if any(series[c])]
    unit, scale = _unit(max(sum(series[c][i] for c in Category) for i in xs))
    ax.stackplot(
        xs, *[[v / scale for v in series[c]] for c in order], labels=[c.value for c in order], colors=[CATEGORY_COLORS[c] for c in order]
    )
    _mark_phases(ax, timeline)
    ax.set_xlabel("allocations and releases, in order")
    ax.set_ylabel(unit)
    kind = "first step" if timeline.first_step else "steady step"
    ax.set_title(f"{title}: one training step at B={b} ({kind})", pad=26)  # room for the phase names
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return _save(fig, plt, path)


def category_series(timeline: Timeline, batch: int, seq: int | None) -> dict[Category, list[int]]:
    """Live bytes per category before the first event (index 0) and after each event (index i + 1)."""
    live = {c: timeline.baseline.get(c, None) for c in Category}
    now = {c: (e.at(batch, seq) if e is not None else 0) for c, e in live.items()}
    series: dict[Category, list[int]] = {c: [now[c]] for c in Category}
    for e in timeline.events:
        now[e.category] += (1 if e.alloc else -1) * e.nbytes.at(batch, seq)
        for c in Category:
            series[c].append(now[c])
    return series


def _mark_phases(ax: Any, timeline: Timeline) -> None:
    """A dotted line where each phase starts, named above the plot (clear of the legend); a name that
    would run into the one before it (the loss is a few events long) goes up a row."""
    starts: dict[str, int] = {}
    for i, e in enumerate(timeline.events):
        starts.setdefault(e.phase.value, i + 1)
    crowded = max(len(timeline.events), 1) * 0.08
    row, last = 0, None
    for name, x in starts.items():
        row = 1 - row if last is not None and x - last < crowded else 0
        last = x
        ax.axvline(x, color="0.3", lw=0.8, ls=":")
        ax.text(x, 1.01 + 0.05 * row, f" {name}", transform=ax.get_xaxis_transform(), fontsize=8, va="bottom")


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    out = Path(path)
    try:
        fig.savefig(out, dpi=110)
    except OSError as e:
        raise InputSpecError(f"cannot write the picture to '{out}': {e.strerror or e}; pick a writable path ending in .png.") from e
    finally:
        plt.close(fig)
    return out
