"""A Report as text (table, markdown, csv), as an HTML fragment for notebooks, or as a JSON-ready dict. Never prints.

The per-layer rows always add up to the activation total: every node's bytes land in exactly one row.
"""

from __future__ import annotations

import csv
import io
import json
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import TYPE_CHECKING, Any, Literal

from tabulate import tabulate

from fxmem.collector import cycle_collector_paused
from fxmem.errors import InputSpecError
from fxmem.frontends.tracing import WHOLE_MODEL
from fxmem.inputs import Constant, InputSpec, dtype_name, format_dims
from fxmem.results import DevicePeak, LayerRow, NodeRecord, Peak, Phase, StateBytes, Timeline

if TYPE_CHECKING:
    from fxmem.parallel.pipeline_report import PipelineRun
    from fxmem.report import Report
from fxmem.cost.tradeoff import flop_exprs, memory_bound, node_costs, node_flop_exprs
from fxmem.symbolic import ByteExpr

__all__ = [
    "CSV_SUMMARY",
    "FORMATS",
    "MAX_ROWS",
    "Depth",
    "abbreviate_ops",
    "choose_depth",
    "dominating_rows",
    "format_bytes",
    "format_count",
    "group_layers",
    "render",
    "render_timeline",
    "to_dict",
]

FORMATS = ("table", "markdown", "csv", "json")
"""What ``fxmem analyze --format`` offers; ``render`` also writes "html", the fragment a notebook shows."""
TOP_LEVEL = "(top level)"
MARK = "*"
"""Marks the dominating rows of a screen table (``dominating_rows``), explained under it."""
_TOTAL_AND_PEAK = (
    "Held = model state (per GPU) + saved activations + the input batch: what the step keeps from forward "
    "to backward, not its peak. Peak = the highest point of a whole training step (forward, loss, backward, "
    "optimizer step), temporaries included, "
)
NOT_INCLUDED = _TOTAL_AND_PEAK + (
    "as the CPU allocator sees it; not included: allocator rounding and caching, and memory outside tensors "
    "(CUDA context, library workspaces)."
)
ON_GPU = _TOTAL_AND_PEAK + (
    "in exact tensor bytes; the GPU lines replay it through the CUDA caching allocator against the device's "
    "memory (max_memory_allocated, reserved; out of memory, it releases its cache and retries as torch does) "
    "and add the fixed costs outside tensors. The verdict is that replay's: a batch fits where torch would "
    "raise no out-of-memory error."
)
NO_PEAK = "The step was not simulated (peak=False): the batch that fits is judged on the total, without temporaries."


def format_bytes(n: int) -> str:
    """Binary units, three significant digits: 1536 -> '1.50 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.3g} {unit}" if abs(value) < 1000 else f"{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_count(n: int) -> str:
    """Parameter counts as people say them: 950, 12.3K, 25.6M, 6.74B."""
    for scale, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def format_expr(expr: ByteExpr) -> str:
    """'1.50 KiB·B + 8 B', with higher powers of B (and terms in S) first when there are any."""
    if expr.seq_terms:
        return f"{expr.polynomial()} B"
    parts = [f"{format_bytes(c)}·B^{k + 2}" for k, c in reversed(list(enumerate(expr.higher))) if c]
    parts += [f"{format_bytes(expr.per_sample)}·B"] if expr.per_sample else []
    parts += [format_bytes(expr.fixed)] if expr.fixed or not parts else []
    return " + ".join(parts)


Depth = int | Literal["all"] | None
"""How the rows group module paths: a number of path components (0: one row for the whole model), "all"
for the full paths, or None for the view's default (Note [Depth by default])."""

MAX_ROWS = 25
"""The most layer rows (the Total row aside) a screen table shows by default: see ``choose_depth``."""

OPS_WIDTH = 40
"""The widest op list a screen table's Op column shows: see ``abbreviate_ops``."""

# Note [Depth by default]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A person reads the table on a screen; a program reads JSON or CSV. So ``depth=None`` means two
# things, on purpose. The screen views (table, markdown, html) choose the depth: the deepest one whose
# table has at most MAX_ROWS layer rows (``choose_depth``), so that the title, the answer lines and the
# table fit one terminal, as torchinfo's summary does (ResNet-50 has 125 module paths that save
# tensors, and 21 at depth 2). With ``top`` they group by full module path, as before: K already bounds
# the rows. The data views (JSON, CSV, ``group_layers``, ``Report.layers``) give every module path in
# full, so that what a program gets does not change with the model's size. ``depth="all"`` asks any
# view for the full paths, and a number for that depth.


def _group_key(node: NodeRecord, depth: int | None) -> str:
    fqn = node.fqn or TOP_LEVEL
    if depth is None or fqn.startswith("("):
        return fqn
    return ".".join(fqn.split(".")[:depth]) if depth > 0 else "(model)"


def _checked_depth(depth: Depth) -> int | None:
    """``depth`` as a number of components, None for the full paths; anything else is refused here."""
    if depth is None or depth == "all":
        return None
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise InputSpecError(f"depth={depth!r}: give a whole number of module-path components (0 or more), 'all', or None.")
    return depth


def group_layers(report: Report, depth: Depth = None) -> tuple[LayerRow, ...]:
    """Rows by module path truncated to ``depth`` components (None or "all": the full paths), in graph
    order, nodes with bytes only: every node lands in exactly one row. A data view: None gives the full
    paths here (Note [Depth by default])."""
    cut = _checked_depth(depth)
    groups: dict[str, list[NodeRecord]] = defaultdict(list)
    for node in report.nodes:
        if not node.saved.is_zero or any(node.exact.values()):
            groups[_group_key(node, cut)].append(node)
    return tuple(_layer_row(fqn, nodes) for fqn, nodes in groups.items())


def choose_depth(report: Report, max_rows: int = MAX_ROWS) -> int | None:
    """The deepest module depth whose table has at most ``max_rows`` layer rows; None where the full
    module paths fit (the deepest grouping of all), 0 where no depth from 1 on does.

    Rows only multiply as the depth grows (a row at depth d is split among rows at d + 1), so the answer
    is the depth just before the count first exceeds ``max_rows``; the count reaches the full paths' at
    the deepest path, which ends the search. ResNet-50: 125 module paths save tensors, 9 rows at depth 1,
    21 at depth 2 and 121 at depth 3, so depth 2.
    """
    if len(group_layers(report)) <= max_rows:
        return None
    depth = 0
    while len(group_layers(report, depth + 1)) <= max_rows:
        depth += 1
    return depth


def _screen_depth(report: Report, depth: Depth, top: int | None) -> int | None:
    """The depth a screen view shows (Note [Depth by default])."""
    if depth is not None:
        return _checked_depth(depth)
    return None if top is not None else choose_depth(report)


def _layer_row(fqn: str, nodes: Sequence[NodeRecord]) -> LayerRow:
    exact: dict[int, int] = defaultdict(int)
    for n in nodes:
        for b, v in n.exact.items():
            exact[b] += v
    ops = tuple(dict.fromkeys(n.info.target for n in nodes))
    return LayerRow(
        fqn, ops, nodes[-1].info.output_shape, ByteExpr.total(n.saved for n in nodes), dict(exact), tuple(n.name for n in nodes)
    )


def _layer_bytes(report: Report, rows: Sequence[LayerRow], batch: int) -> list[int]:
    per_node = report.node_bytes(batch)
    return [sum(per_node.get(n, 0) for n in row.nodes) for row in rows]


def dominating_rows(at: Sequence[int]) -> tuple[bool, ...]:
    """Which rows dominate: the fewest that together hold at least half of ``sum(at)``, taken largest
    first (the earlier row first among equals). Nothing dominates an empty total.

    These are the rows to read first, and the ones shrinking (checkpointing, a smaller dtype) pays for.

    >>> dominating_rows([10, 60, 30])
    (False, True, False)
    """
    total, held = sum(at), 0
    marked = [False] * len(at)
    for i in sorted(range(len(at)), key=lambda i: -at[i]):
        if 2 * held >= total:
            break
        marked[i], held = True, held + at[i]
    return tuple(marked)


def abbreviate_ops(ops: Sequence[str], width: int = OPS_WIDTH) -> str:
    """The op names joined with '+', within ``width`` characters: as many whole names as fit, then how
    many more there are. A name is never cut: a name cut mid-way reads as another op, or as none.

    >>> abbreviate_ops(["GroupNorm", "sigmoid", "mul", "Conv2d", "MultiheadAttention", "add", "gelu"], 30)
    'GroupNorm+sigmoid+mul+4 more'

    A single name wider than ``width`` is shown whole; several that leave no room for a first name
    read 'N ops'.
    """
    joined = "+".join(ops)
    if len(joined) <= width or len(ops) == 1:
        return joined
    for keep in range(len(ops) - 1, 0, -1):
        text = "+".join(ops[:keep]) + f"+{len(ops) - keep} more"
        if len(text) <= width:
            return text
    return f"{len(ops)} ops"


@dataclass(frozen=True)
class _Grouped:
    """The layer rows a table shows, with their bytes at the report's batch and their marks."""

    rows: tuple[LayerRow, ...]
    at: tuple[int, ...]
    marked: tuple[bool, ...]
    """Whether each row is among the dominating rows of all rows at its depth (``dominating_rows``)."""
    total: int
    """Activation bytes at the report's batch: all rows', shown or not."""
    dominating: tuple[int, int]
    """How many rows dominate, and their bytes together (``top`` may leave some out)."""
    depth: int | None
    top: int | None


def _grouped(report: Report, depth: int | None, top: int | None) -> _Grouped:
    rows = group_layers(report, depth)
    at = tuple(_layer_bytes(report, rows, report.batch))
    marked = dominating_rows(at)
    total = sum(report.node_bytes(report.batch).values())
    dominating = (sum(marked), sum(a for a, m in zip(at, marked) if m))
    order = range(len(rows)) if top is None else sorted(range(len(rows)), key=lambda i: -at[i])[:top]
    pick = lambda xs: tuple(xs[i] for i in order)
    return _Grouped(pick(rows), pick(at), pick(marked), total, dominating, depth, top)


def _share(part: int, total: int) -> str:
    return f"{100 * part / total:.1f}%" if total else "-"


@dataclass(frozen=True)
class _Table:
    """A table of the report: with headers a grid, without them label-value-detail lines."""

    rows: tuple[tuple[Any, ...], ...]
    headers: tuple[str, ...] = ()


_Part = str | _Table
"""A piece of the screen report: a paragraph (its lines kept apart) or a table."""


def _at(report: Report) -> str:
    return f"B={report.batch}" + (f", S={report.seq_len}" if report.seq_len is not None else "")


def _layer_table(report: Report, g: _Grouped, *, raw: bool) -> _Table:
    """The rows, then the Total row (not with ``top``). ``raw`` (CSV): integers, whole op lists, no marks;
    otherwise sizes, abbreviated op lists and a last column with the dominating rows' mark."""
    fmt = (lambda n: n) if raw else format_bytes
    seq = report.seq_len is not None
    bytes_of = (lambda e: [e.polynomial()]) if seq else (lambda e: [fmt(e.per_sample), fmt(e.fixed)])
    ops = (lambda r: "+".join(r.ops)) if raw else (lambda r: abbreviate_ops(r.ops))
    mark = (lambda m: []) if raw else (lambda m: [MARK if m else ""])
    headers = ("Layer", "Op", "Output shape", *(["Bytes (B, S)"] if seq else ["Per sample", "Constant"]), f"At {_at(report)}", "Share")
    body = [
        (r.fqn, ops(r), format_dims(r.output_shape) if r.output_shape else "", *bytes_of(r.saved), fmt(a), _share(a, g.total), *mark(m))
        for r, a, m in zip(g.rows, g.at, g.marked)
    ]
    if g.top is None:
        body.append(("Total activations", "", "", *bytes_of(report.activations), fmt(g.total), _share(g.total, g.total), *mark(False)))
    return _Table(tuple(body), (*headers, *([] if raw else [""])))


def _caption(report: Report, g: _Grouped, chosen: bool) -> str:
    """The lines under the table: what the mark means, the depth chosen for the screen, the top K's share."""
    lines = []
    count, held = g.dominating
    if count:
        layers = f"{count} layer" + ("s" if count > 1 else "")
        lines.append(
            f"{MARK} marks the fewest layers that together hold at least half of activation memory at {_at(report)}: "
            f"{layers}, {_share(held, g.total)}."
        )
    if chosen and g.depth is not None:
        paths = len(group_layers(report))
        lines.append(f"Module paths grouped to depth {g.depth} to fit {MAX_ROWS} rows; --depth all lists all {paths}.")
    if g.top is not None:
        lines.append(f"{len(g.rows)} layers hold {_share(sum(g.at), g.total)} of activation memory at B={report.batch}.")
    return "\n".join(lines)


@cycle_collector_paused  # it may run a lazy pass (the B=1 step): Note [The cycle collector during analyze]
def render(report: Report, fmt: str = "table", *, depth: Depth = None, top: int | None = None) -> str:
    """The report as text in one of FORMATS, or as "html": a fragment for notebooks (``Report._repr_html_``).

    ``depth`` None lets the screen views (table, markdown, html) choose the deepest grouping of at most
    MAX_ROWS rows, and gives JSON and CSV every module path (Note [Depth by default]); "all" gives every
    module path, a number groups paths to that many components. ``top`` shows the K largest rows.

    CSV holds two tables, as a spreadsheet shows them one under the other: first the summary, a
    ``Summary,Value`` header then one row per figure (CSV_SUMMARY's keys, in that order), then an empty
    row, then the layer table (a header, one row per layer, the Total activations row). Bytes are integers
    in both; a figure that does not apply (``fits`` without device memory, ``peak`` with ``peak=False``)
    is an empty cell; ``fits`` is ``true`` or ``false``. A program splits the two at the empty row::

        rows = list(csv.reader(io.StringIO(text)))
        blank = rows.index([])
        summary, layers = dict(rows[1:blank]), rows[blank + 1 :]
    """
    if fmt == "json":
        return json.dumps(to_dict(report, depth=depth), indent=2)
    if fmt == "csv":
        return _as_csv(report, _grouped(report, _checked_depth(depth), top))
    writers = {"table": _as_text, "markdown": _as_markdown, "html": _as_html}
    if fmt not in writers:
        raise InputSpecError(f"format {fmt!r}: use one of {', '.join(FORMATS)}, or html (a fragment for notebooks).")
    return writers[fmt](_parts(report, depth, top))


CSV_SUMMARY = {
    "model": "the model's name",
    "batch": "the batch every figure below is at",
    "seq_len": "the sequence length S where an input has one, else empty",
    "target": "what the step runs on (device, GPU, precision, sharding)",
    "device_memory": "the budget the verdict is judged against, in bytes; empty where none was given",
    "verdict": "the verdict line in words, as the table's first line",
    "fits": "true or false: whether a steady step at the batch fits device_memory (Report.fits)",
    "max_batch": "the largest batch that fits (Report.max_batch); empty where none does or any does",
    "peak": "the steady step's peak at the batch, in exact tensor bytes (Report.peak)",
    "gpu_total": "on a GPU target, nvidia-smi's total at the batch (allocator blocks, segments, fixed costs)",
    "state": "the model state one GPU holds (Report.state_per_gpu)",
    "held": "state + saved activations + inputs at the batch (Report.total_bytes): not the peak",
    "floor": "what the least batch costs (Report.step_bytes at floor_batch)",
    "floor_batch": "the least batch a step runs: 1, or 2 where the model cannot train on one sample",
}
"""The summary rows of ``render(report, "csv")``, key -> what its value is."""


def _summary_values(report: Report) -> dict[str, object]:
    """CSV_SUMMARY's values: integers for bytes and batches, None where a figure does not apply."""
    b, least, budget = report.batch, report.least_batch, report.device_memory
    device = report.steps.device_peak(b, budget=budget) if report.steps is not None and report.steps.device is not None else None
    return {
        "model": report.model,
        "batch": b,
        "seq_len": report.seq_len,
        "target": report.setup.describe() if report.setup is not None else None,
        "device_memory": budget,
        "verdict": _verdict_lines(report)[0][2],
        "fits": None if budget is None else "true" if report.fits() else "false",
        "max_batch": None if budget is None else report.max_batch(),
        "peak": report.peak(b).bytes if report.steps is not None else None,
        "gpu_total": device.total if device is not None else None,
        "state": report.state_per_gpu,
        "held": report.total_bytes(b),
        "floor": report.step_bytes(least),
        "floor_batch": least,
    }


def _as_csv(report: Report, g: _Grouped) -> str:
    """The summary rows, an empty row, the layer table: see ``render``."""
    values = _summary_values(report)
    summary = [("Summary", "Value"), *((key, "" if values[key] is None else values[key]) for key in CSV_SUMMARY)]
    table = _layer_table(report, g, raw=True)
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([*summary, (), table.headers, *table.rows])
    return out.getvalue()


def _parts(report: Report, depth: Depth, top: int | None) -> list[_Part]:
    """The screen report in reading order: the title, the answer (Note [The answer first]), the layers,
    the other figures, the notes, and on a GPU target the batch-size trade-off."""
    g = _grouped(report, _screen_depth(report, depth, top), top)
    parts: list[_Part] = [
        _title(report),
        _Table(tuple(tuple(line) for line in _answer_lines(report))),
        *_compiled_parts(report),
        _layer_table(report, g, raw=False),
        _caption(report, g, chosen=depth is None),
        _Table(tuple(tuple(line) for line in _detail_lines(report))),
        _notes(report),
        *_tradeoff_parts(report),
    ]
    return [p for p in parts if (p.rows if isinstance(p, _Table) else p)]


def _as_text(parts: Sequence[_Part]) -> str:
    """The terminal's report: tabulate's simple tables; label-value-detail lines without rules."""
    out = []
    for p in parts:
        if isinstance(p, str):
            out.append(p)
        else:
            out.append(tabulate(p.rows, headers=p.headers, tablefmt="simple" if p.headers else "plain", disable_numparse=True))
    return "\n\n".join(out) + "\n"


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_|<>\[\]#])")
"""What could start emphasis, code, a link, HTML or a cell in markdown; escaped with a backslash (CommonMark 2.4)."""


def _md(cell: object) -> str:
    return _MARKDOWN_SPECIAL.sub(r"\\\1", str(cell))


def _as_markdown(parts: Sequence[_Part]) -> str:
    """GitHub markdown: every table a pipe table (headerless ones get an empty header row), every line
    of a paragraph a paragraph of its own (markdown would join them)."""
    out = []
    for p in parts:
        if isinstance(p, str):
            out += [_md(line) for line in p.splitlines()]
            continue
        headers = [_md(h) for h in p.headers] or [""] * len(p.rows[0])
        out.append(tabulate([[_md(c) for c in row] for row in p.rows], headers=headers, tablefmt="github", disable_numparse=True))
    return "\n\n".join(out) + "\n"


_LEFT = ' style="text-align:left"'
"""Inline, as no stylesheet is assumed: notebooks right-align table cells, and these are words."""


def _as_html(parts: Sequence[_Part]) -> str:
    """An HTML fragment with plain tables, every text escaped: no JavaScript, no stylesheet, well-formed XML."""
    return '<div class="fxmem-report">\n' + "\n".join(_html_part(p) for p in parts) + "\n</div>\n"


def _html_part(p: _Part) -> str:
    if isinstance(p, str):
        return "<p>" + "<br/>".join(escape(line) for line in p.splitlines()) + "</p>"
    cells = lambda row, tag: "".join(f"<{tag}{_LEFT}>{escape(str(c))}</{tag}>" for c in row)
    head = f"<thead><tr>{cells(p.headers, 'th')}</tr></thead>" if p.headers else ""
    body = "".join(f"<tr>{cells(row, 'td')}</tr>" for row in p.rows)
    return f"<table>{head}<tbody>{body}</tbody></table>"


def _title(report: Report) -> str:
    inputs = ", ".join(str(s) for s in report.inputs)
    how = "one symbolic pass + B=1" if report.accounting.method == "symbolic" else "concrete passes"
    graph = {"fx": "torch.fx", "export": "torch.export"}.get(report.frontend, "the model run whole")
    if report.checkpointed:
        graph += f", {report.checkpointed} checkpointed region{'s' if report.checkpointed > 1 else ''}"
    target = f"\ntarget: {report.setup.describe(_as_built(report.state))}" if report.setup is not None else ""
    return (
        f"fxmem: {report.model}  inputs: {inputs}  loss: {report.loss}  optimizer: {report.state.optimizer_name}  ({graph}, {how}){target}"
    )


def _as_built(state: StateBytes) -> str | None:
    """The weights' dtypes in words where they are not all fp32: "bfloat16 frozen, float32 trainable"."""
    frozen, trainable = sorted(state.frozen_by_dtype), sorted(state.trainable_by_dtype)
    if set(frozen) | set(trainable) <= {"float32"}:
        return None
    if not frozen or not trainable:
        return " and ".join(frozen or trainable) + " weights"
    return f"{' and '.join(frozen)} frozen, {' and '.join(trainable)} trainable"


# Note [The answer first]
# ~~~~~~~~~~~~~~~~~~~~~~~
# People run fxmem to learn whether a step fits and what it costs, so the verdict is the first line
# under the title, in words ("B=32 fits 1 x NVIDIA H100 80GB SXM: 3.99 of 79.6 GiB (5%); every batch up
# to 970 fits; 971 does not"), then what it rests on: the step's peak, what the GPU holds and why (its
# fixed costs, the estimated workspaces), the floor, and which pile dominates. The figures that explain
# them (the activation and state piles, what is held, FLOPs, time) follow the layer table.


def _answer_lines(report: Report) -> list[list[str]]:
    """Verdict, peak, GPU total, floor and which pile dominates (Note [The answer first])."""
    b, state = report.batch, report.state_per_gpu
    scaled = report.total_bytes(b) - state
    lines = [
        *_verdict_lines(report),
        *_peak_lines(report, b, _at(report)),
        *_gpu_lines(report, b, _at(report)),
        _floor_line(report),
        *_length_lines(report, b),
    ]
    lines.append(["State : activations", _ratio(state, scaled), _reading(state, scaled)])
    return lines


def _compiled_parts(report: Report) -> list[_Part]:
    """Eager and ``torch.compile`` side by side (``Training(compile=True)``): saved, peak, largest batch."""
    c = report.compiled
    if c is None:
        return []
    b, budget, gpu = report.batch, report.device_memory, report.steps.device is not None
    eager_peak, compiled_peak = report.peak(b), c.peak()
    rows = [
        [f"Saved for backward at B={b}", format_bytes(report.activation_bytes(b)), format_bytes(c.saved)],
        ["Saved as a*B + c", format_expr(report.activations), format_expr(c.line) if c.line is not None else f"none ({c.why_no_line})"],
        [f"Peak at B={b}", format_bytes(eager_peak.bytes), format_bytes(compiled_peak.bytes)],
        ["Peak in phase", eager_peak.phase.value, compiled_peak.phase.value],
    ]
    if gpu:
        rows.append([f"GPU total at B={b}", format_bytes(report.steps.device_bytes(b)), format_bytes(c.device_bytes())])
    if budget is not None:
        largest, (fits, fails) = c.max_batch(budget, report.least_batch)
        compiled = "none" if largest is None else f"B={largest} (B={fails} does not fit)"
        rows.append([f"Largest batch in {format_bytes(budget)}", _largest_eager(report), compiled])
    kept = sum(1 for v in c.values if not v.held)
    copy = "" if c.path == "the whole model" else f" ({c.path}" + (f"; the counts are the {c.listed_from}-block copy's)" if c.listed_from else ")")
    how = (
        f"torch.compile (default mode) as Inductor compiles it at each batch{copy}: {kept} tensors saved by the compiled forward, "
        f"{c.kernels()} kernel calls; the loss and the optimizer step run eagerly."
    )
    if c.estimate:
        how += f" An estimate: {c.estimate}."
    return [_Table(tuple(tuple(r) for r in rows), ("", "eager", "torch.compile")), how]


def _largest_eager(report: Report) -> str:
    largest = report.max_batch()
    return "none" if largest is None else f"B={largest}"


def _where_it_runs(report: Report) -> str:
    """" 1 x NVIDIA H100 80GB SXM" on a GPU target; "" on the CPU, where the budget says it all."""
    if report.steps is not None and report.steps.device is not None:
        ranks = report.setup.ranks if report.setup is not None else 1
        return f" {ranks} x {report.gpu.label}" + (" (per GPU)" if ranks > 1 else "")
    return ""


def _verdict_lines(report: Report) -> list[list[str]]:
    """One line that answers "does my batch fit, and what is the largest that does"."""
    if report.device_memory is None:
        return [["Verdict", "", "no device memory to fit in: give --device-memory (e.g. 24GiB) for a verdict and the largest batch"]]
    b, v = report.batch, report.verdict()
    need, budget = report.step_bytes(b), report.device_memory
    largest = v.describe()
    if report.fits(b):
        head = f"B={b} fits{_where_it_runs(report)}: {format_bytes(need)} of {format_bytes(budget)} ({need / budget:.0%})"
        return [[f"Verdict at B={b}", "fits", f"{head}; {largest}"]]
    short = report.steps.device_peak(b, budget=budget) if report.steps is not None else None
    gap = short.short if short is not None else need - budget
    where = f", out of memory at {short.oom_node}" if short is not None and short.oom_node else ""
    head = f"B={b} does not fit{_where_it_runs(report)}: {format_bytes(gap)} short{where}"
    return [[f"Verdict at B={b}", "does not fit", f"{head}; {largest}"]]


def _length_lines(report: Report, b: int) -> list[list[str]]:
    """What ``--seq-len`` stands for: the longest padded batch (Note [The longest padded batch])."""
    if report.seq_len is None:
        return []
    S = report.seq_len
    said = f"the longest padded batch: every figure here is for batches padded to {S}"
    rows = report.length_peaks(b) if report.steps is not None else ()
    if not rows:
        return [["Sequence length", f"S={S}", said]]
    worst_bytes, worst_at = max((n, s) for s, n in rows)
    at_longest = dict(rows)[S]
    if worst_bytes > at_longest:
        said += f"; a batch padded to S={worst_at} needs more, {format_bytes(worst_bytes)} (the trade-off table shows each batch's worst length)"
    else:
        said += f"; shorter ones need less ({format_bytes(rows[0][1])} at S={rows[0][0]})"
    return [["Sequence length", f"S={S}", said]]


def _floor_line(report: Report) -> list[str]:
    """The least any batch costs: at B=1, or at B=2 where the model cannot train on one sample."""
    least = report.least_batch
    if least > 1:
        why = f"{_basis(report)} at B={least}: the model cannot train at B=1 (see the notes), so B={least} is the least it runs"
        return [f"Floor at B={least}", format_bytes(report.step_bytes(least)), why]
    return ["Floor at B=1", format_bytes(report.step_bytes(1)), f"{_basis(report)} with one sample"]


def _detail_lines(report: Report) -> list[list[str]]:
    """The piles behind the answer (activations, inputs, state and each GPU's share), the totals, FLOPs and time."""
    b, s, at = report.batch, report.state, _at(report)
    half = max(1, b // 2)
    total = report.total_bytes(b)
    held = "state + saved activations + inputs, not the peak: the step's temporaries come on top"
    lines = [
        ["Activations", format_expr(report.activations), f"{format_bytes(report.activation_bytes(b))} at {at}"],
        ["Input batch", format_expr(report.accounting.inputs), f"{format_bytes(report.input_bytes(b))} at {at}"],
        [f"Model state ({s.optimizer_name})", format_bytes(s.total), _state_parts(report)],
        *_per_gpu_lines(report),
        [f"Held at {at}", format_bytes(total), f"{held}; {_share(total - report.state_per_gpu, total)} scales with the batch"],
        *([[f"Held at B={half}", format_bytes(report.total_bytes(half)), _saving(report, b, half)]] if half != b else []),
    ]
    return lines + _compute_lines(report, b, at)


def _notes(report: Report) -> str:
    """What the figures include and leave out, and every caveat the analysis met, one per line."""
    gpu = report.steps is not None and report.steps.device is not None
    notes = [ON_GPU if gpu else NOT_INCLUDED if report.steps is not None else NOT_INCLUDED + " " + NO_PEAK]
    if report.steps is not None and report.steps.note:
        notes.append(f"Peak: {report.steps.note}.")
    notes += _path_lines(report)
    if report.frontend == WHOLE_MODEL:
        notes.append(
            "Traced: the model fixes the batch in its own Python or numpy code, so no graph holds for every B; it ran whole, "
            "as one operation, at each batch (exact there), and the layer table has one row for it."
        )
    if report.accounting.batch_one_error:
        notes.append(
            "The model cannot train at B=1, so B=1 figures follow the line: " + " ".join(report.accounting.batch_one_error.split())[:300]
        )
    if report.batch_one_special:
        notes.append(
            f"B=1 is special: {', '.join(report.batch_one_special[:5])} save different bytes at B=1 than the line predicts; B=1 figures are exact."
        )
    if not report.accounting.linear:
        notes.append(f"Saved bytes are not exactly linear in B ({report.accounting.note}); every figure at a given B is exact.")
    elif report.accounting.method == "concrete":
        notes.append(f"The batch could not stay symbolic; a*B + c fitted and verified by {report.accounting.note}.")
    if report.activations.higher:
        notes.append(f"Activations grow faster than linearly in B: {report.activations.polynomial()} bytes.")
    notes += [f"Code path: {p}." for p in report.paths]
    notes += [f"Routing: {r}." for r in report.routed]
    notes += [f"Unsupported: node {u.node} ({u.fqn}): {u.reason}; counted as 0 B." for u in report.accounting.unsupported]
    caveat = report.batchnorm_caveat()
    notes += [caveat] if caveat else []
    return "\n".join(notes)


def format_flops(n: float) -> str:
    """Decimal units, three significant digits: 1.5e12 -> '1.50 TFLOP'."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} FLOP"


def format_rate(r: float) -> str:
    """Samples per second: whole numbers from 100 up, three significant digits below."""
    return f"{r:,.0f}" if r >= 100 else f"{r:.3g}"


def format_seconds(t: float) -> str:
    """Three significant digits in s, ms or µs."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if t >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t / 1e-6:.3g} µs"


def _compute_lines(report: Report, b: int, at: str) -> list[list[str]]:
    """FLOPs and the roofline bound on step time at the report's batch (needs the simulated step)."""
    if report.steps is None:
        return []
    f, t = report.flops(b), report.step_time(b)
    names = ", ".join(op.removeprefix("aten.") for op, _ in f.missing[:4]) + (", ..." if len(f.missing) > 4 else "")
    calls, kinds = f.missing_calls, len(f.missing)
    subject = f"{calls} op calls ({kinds} kind{'s' if kinds > 1 else ''}) have" if calls > 1 else "1 op call (1 kind) has"
    missing = f"; {subject} no FLOP formula, counted for bytes only: {names}" if f.missing else ""
    gpu = report.gpu
    bound = memory_bound(node_costs(report.timeline(b), b, gpu, report.seq_len), top=3)
    slow = ", ".join(n.fqn or n.node for n in bound)
    share = sum(p.seconds for p in t.phases if p.phase == Phase.OPTIMIZER)
    return [
        [f"FLOPs at {at}", format_flops(f.total), f"forward {format_flops(f.forward)}, backward {format_flops(f.backward)}, optimizer {format_flops(f.optimizer)} (torch.utils.flop_counter){missing}"],
        [
            f"Step time at {at}", f">= {format_seconds(t.seconds)}",
            f"roofline lower bound on {gpu.label}, not a benchmark: <= {format_rate(t.samples_per_second(b))} samples/s, "
            f"{t.peak_share:.0%} of {'tf32' if t.tf32 else _dtype_label(t.dtype)} peak; optimizer step {format_seconds(share)}"
            + (f"; most memory-bound: {slow}" if slow else ""),
        ],
    ]  # fmt: skip


def _dtype_label(dtype: Any) -> str:
    return dtype_name(dtype) if dtype is not None else "no"


WHOLE = "the whole model"
"""What the passes ran on where the model has no repeated blocks to extend (Note [Repeated blocks])."""


def _path_lines(report: Report) -> list[str]:
    """Which model the passes ran on: the whole one, or its repeated blocks from a shallow copy."""
    step = report.steps.path if report.steps is not None else ""
    saved = report.accounting.path
    if {step, saved} <= {"", WHOLE}:
        return []  # no repeated blocks: nothing to say
    if not step or step == saved:
        return [f"Simulated: {saved}."]
    return [f"Simulated: saved tensors: {saved}; the step: {step}."]


def _tradeoff_parts(report: Report) -> list[_Part]:
    """Memory and estimated throughput from B=1 to the largest batch that fits, on a GPU target."""
    if report.steps is None or report.steps.device is None or report.device_memory is None:
        return []
    rows = tuple(
        (
            r.batch, format_bytes(r.state), format_bytes(r.activations), format_bytes(r.peak),
            format_bytes(r.device) + ("" if report.fits(r.batch) else " (does not fit)"),
            format_seconds(r.seconds), format_rate(r.samples_per_second), f"{r.peak_share:.0%}",
        )
        + ((_worst_length(r, report),) if report.seq_len is not None else ())
        for r in report.tradeoff()
    )  # fmt: skip
    headers = ("B", "State", "Activations", "Peak", "GPU total", "Step time >=", "Samples/s <=", "Of peak FLOP/s")
    if report.seq_len is not None:
        headers += (f"Worst length <= {report.seq_len}",)
    heading = f"Batch size trade-off on {report.gpu.label} (step time is a roofline lower bound, not a benchmark):"
    return [heading, _Table(rows, headers)]


def _worst_length(row: Any, report: Report) -> str:
    """The batch padded to the length (S/8 to S) that needs the most: Note [The longest padded batch]."""
    if row.worst_length is None:
        return "n/a"
    nbytes, length = row.worst_length
    fits = report.device_memory is None or nbytes <= report.device_memory
    return f"{format_bytes(nbytes)} at S={length}" + ("" if fits else " (does not fit)")


def _peak_lines(report: Report, b: int, at: str) -> list[list[str]]:
    if report.steps is None:
        return []
    lines = []
    for first, label in ((False, "steady step"), (True, "first step")):
        p = report.peak(b, first_step=first)
        where = f"in {p.phase} at {p.node}" + (f" ({p.fqn})" if p.fqn and p.fqn != p.node else "")
        parts = f"state {format_bytes(p.state)}, activations {format_bytes(p.saved)}, temporaries {format_bytes(p.temporaries)}, inputs {format_bytes(p.inputs)}"
        if p.communication:
            parts += f", {report.setup.engine_name if report.setup else 'engine'} buffers {format_bytes(p.communication)}"
        lines.append([f"Peak at {at} ({label})", format_bytes(p.bytes), f"{where}: {parts}"])
    return lines


def _basis(report: Report) -> str:
    if report.steps is None:
        return "total"
    return "nvidia-smi total" if report.steps.device is not None else "peak"


def _gpu_lines(report: Report, b: int, at: str) -> list[list[str]]:
    """The steady step on the target GPU: allocator counters, then the fixed costs and the estimated workspaces."""
    if report.steps is None or report.steps.device is None:
        return []
    d = report.steps.device_peak(b, budget=report.device_memory)
    assert d is not None
    counters = f"max_memory_allocated {format_bytes(d.allocated)}, reserved {format_bytes(d.reserved)}"
    if not d.fits:
        counters += f"; past the device: the allocator released its cache, retried and ran out at {d.oom_node} ({format_bytes(d.short)} short)"
    conf = f"; allocator: {d.alloc_conf}" if d.alloc_conf != "torch defaults" else ""
    lines = [[f"GPU at {at}", format_bytes(d.total), f"nvidia-smi total; {counters}{conf}"]]
    lines += [[f"+ {name}", format_bytes(n), why] for name, n, why in d.overheads if n]
    if d.shrunk:
        lines.append([
            "Workspaces given way", "",
            f"near the limit cuDNN's first engine's workspace did not fit at {_listed(d.shrunk)}: torch then runs an engine "
            "that needs none (counted as 0 B), slower; Note [A workspace that does not fit] in fxmem/gpu/allocator.py",
        ])  # fmt: skip
    return lines + _estimate_lines(report.peak(b))


def _listed(names: Sequence[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _estimate_lines(p: Peak) -> list[list[str]]:
    """The workspaces the peak holds that are estimates (cuDNN picks its engine when it runs), with their
    bounds, and the step's peak were each at its bound: a named line, never a silent figure."""
    if p.upper is None:
        return []
    bound, peak = format_bytes(p.upper), format_bytes(p.bytes)
    rise = f"with every such workspace at its bound the step's peak would be {bound}, not {peak}"
    if bound == peak:  # the two print alike: say by how much they differ, which the rounding hides
        more = f"{format_bytes(p.upper - p.bytes)} higher ({p.upper - p.bytes:,} B), still {peak}" if p.upper > p.bytes else f"the same {peak}"
        rise = f"with every such workspace at its bound the step's peak would be {more}"
    if not p.estimated:
        return [
            ["Estimated workspaces", "", f"cuDNN convolution workspaces are estimates (its engine is cuDNN's choice at run time); {rise}"]
        ]
    return [
        [
            "Estimated at the peak",
            format_bytes(x.nbytes),
            f"{x.what} of {x.fqn or x.node} ({x.op.split()[0]}), its engine cuDNN's choice at run time: at most {format_bytes(x.bound)}; {rise}",
        ]
        for x in p.estimated
    ]


def _per_gpu_lines(report: Report) -> list[list[str]]:
    """One GPU's share of the state, where a recipe or sharding makes it differ from one copy of everything."""
    setup, share = report.setup, report.per_gpu
    if setup is None or share is None or not setup.distributed:
        return []
    how = f"{setup.ranks} ranks, {setup.engine_name} run" if setup.engine else f"{setup.world_size} x {setup.shard}"
    head = [f"State per GPU ({how})", format_bytes(share.total), "of the model state above, on each GPU"]
    shown = lambda line: line.nbytes or (setup.offload and "host memory" in line.why)  # Note [FSDP2's CPU offload]: 0 B on the device
    return [head, *([f"· {name}", format_bytes(line.nbytes), line.why] for name, line in share.lines() if shown(line))]


def _state_parts(report: Report) -> str:
    s = report.state
    frozen = s.frozen_weights
    split = f" ({format_count(s.trainable)} trainable)" if s.trainable != s.parameters else ""
    weights = f"{format_bytes(s.weights)}" + (f" ({format_bytes(frozen)} frozen, {format_bytes(s.weights - frozen)} trainable)" if frozen else "")
    return (
        f"{format_count(s.parameters)} params{split}: weights {weights}, buffers {format_bytes(s.buffers)}, "
        f"gradients {format_bytes(s.gradients)}, "
        + (f"fp32 master {format_bytes(s.master)}, " if s.master else "")
        + f"optimizer {format_bytes(s.optimizer)}"
        + (f" ({s.precision})" if s.precision else "")
    )


def _saving(report: Report, b: int, half: int) -> str:
    full, small = report.total_bytes(b), report.total_bytes(half)
    return f"halving the batch saves {_share(full - small, full)} of what is held" if half != b else ""


def _ratio(state: int, scaled: int) -> str:
    return f"1 : {scaled / state:.2f}" if state else "no state"


def _reading(state: int, scaled: int) -> str:
    if scaled > state:
        return "activation-heavy: batch size is the strong lever"
    return "state-heavy: the batch barely matters; shard or shrink the state (precision, optimizer)"


def _saved_tensor_dict(t: Any, batch: int) -> dict[str, Any]:
    return {
        "shape": list(t.shape),
        "dtype": t.dtype,
        "bytes": {"per_sample": t.nbytes.per_sample, "constant": t.nbytes.fixed},
        "saved_by": list(t.saved_by),
    }


def _expr_dict(e: ByteExpr) -> dict[str, Any]:
    out: dict[str, Any] = {"per_sample": e.per_sample, "constant": e.fixed}
    if e.higher or e.seq_terms:
        out["polynomial"] = e.polynomial()
    return out


def to_dict(report: Report, *, depth: Depth = None) -> dict[str, Any]:
    """The JSON view: bytes are integers; per_sample and constant are the exact a and c. JSON is for
    programs, so its layers are every module path unless ``depth`` says otherwise: a program should not
    get a grouping that changes with the model's size (Note [Depth by default])."""
    b, s = report.batch, report.state
    layers = group_layers(report, depth)
    symbolic = report.steps.symbolic_timeline() if report.steps is not None else None
    flops = node_flop_exprs(symbolic) if symbolic is not None else {}
    out: dict[str, Any] = {
        "model": report.model,
        "loss": report.loss,
        "method": report.accounting.method,
        "frontend": report.frontend,
        "checkpointed_regions": report.checkpointed,
        "linear_in_batch": report.accounting.linear,
        "inputs": [_input_dict(i) for i in report.inputs],
        "input_bytes": _expr_dict(report.accounting.inputs),
        "model_state": {
            "parameters": s.parameters,
            "trainable_parameters": s.trainable,
            "weights": s.weights,
            "weights_by_dtype": dict(s.weights_by_dtype),
            "frozen_weights_by_dtype": dict(s.frozen_by_dtype),
            "buffers": s.buffers,
            "gradients": s.gradients,
            "optimizer": s.optimizer,
            "optimizer_name": s.optimizer_name,
            "total": s.total,
        },
        "activations": _expr_dict(report.activations),
        "nodes": [_node_dict(n, flops.get(n.name)) for n in report.nodes],
        "layers": [
            {"layer": r.fqn, "ops": list(r.ops), "nodes": list(r.nodes), "saved": _expr_dict(r.saved), "bytes_at_batch": a}
            for r, a in zip(layers, _layer_bytes(report, layers, b))
        ],
        "routing": list(report.routed),
        "code_paths": list(report.paths),
        "batch_one_special": list(report.batch_one_special),
        "batch_one_error": report.accounting.batch_one_error or None,
        "seq_len": report.seq_len,
        "at_batch": {
            "batch": b,
            "activations": report.activation_bytes(b),
            "inputs": report.input_bytes(b),
            "total": report.total_bytes(b),
        },
        "floor": report.step_bytes(1),
        "device_memory": report.device_memory,
        "fits": report.fits() if report.device_memory is not None else None,
        "max_batch": report.max_batch() if report.device_memory is not None else None,
        "max_batch_basis": _basis(report),
        "verdict": _verdict_dict(report),
        "target": _setup_dict(report),
        "per_gpu_state": {name: line.nbytes for name, line in report.per_gpu.lines()} if report.per_gpu is not None else None,
        "peak": _peak_dict(report) if report.steps is not None else None,
        **(_compute_dict(report) if report.steps is not None else {"flops": None, "roofline": None, "tradeoff": None}),
        "batchnorm": {"layers": list(report.bn_layers), "threshold": report.bn_threshold, "caveat": report.batchnorm_caveat() or None},
        "unsupported": [{"node": u.node, "layer": u.fqn, "reason": u.reason} for u in report.accounting.unsupported],
        "pipeline": _pipeline_dict(report.pipeline, b, report.seq_len) if report.pipeline is not None else None,
        "compiled": _compiled_dict(report) if report.compiled is not None else None,
    }
    return out


def _compiled_dict(report: Report) -> dict[str, Any]:
    """The step under torch.compile (``Report.compiled``): bytes exact integers, as the rest."""
    c, budget = report.compiled, report.device_memory
    largest = c.max_batch(budget, report.least_batch) if budget is not None else None
    lines = c.value_lines()
    return {
        "batch": c.batch,
        "path": c.path,
        "saved": c.saved,
        "saved_line": _expr_dict(c.line) if c.line is not None else None,
        "why_no_line": c.why_no_line or None,
        "values": [
            {"name": v.name, "shape": list(v.shape), "dtype": v.dtype, "bytes": v.nbytes, "state_or_input": v.held,
             "line": _expr_dict(lines[v.name]) if v.name in lines else None}
            for v in c.values
        ],  # fmt: skip
        "peak": c.peak().bytes,
        "peak_phase": c.peak().phase.value,
        "device_total": c.device_bytes() if report.steps is not None and report.steps.device is not None else None,
        "max_batch": largest[0] if largest is not None else None,
        "estimate": c.estimate or None,
    }


def _verdict_dict(report: Report) -> dict[str, Any] | None:
    """The verdict's parts (Note [The largest batch] in fxmem/report.py), None without device memory."""
    if report.device_memory is None:
        return None
    v = report.verdict()
    d = report.steps.device_peak(report.batch, budget=report.device_memory) if report.steps is not None else None
    return {
        "batch": report.batch,
        "fits": report.fits(),
        "needs": report.step_bytes(report.batch),
        "budget": v.budget,
        "short": (d.short if d is not None else max(0, report.step_bytes(report.batch) - v.budget)) if not report.fits() else 0,
        "out_of_memory_at": d.oom_node if d is not None and d.oom_node else None,
        "workspaces_given_way": list(d.shrunk) if d is not None else [],
        "max_batch": v.max_batch,
        "unbounded": v.unbounded,
        "checked": list(v.checked) if v.checked is not None else None,
        "gaps": list(v.gaps),
        "exact": v.exact,
        "in_words": v.describe(),
    }


def _pipeline_dict(run: PipelineRun, batch: int, seq: int | None) -> dict[str, Any]:
    """With ``--pp``: the plan, and per rank what the report's pipeline lines say (fxmem/output/pipeline.py),
    at the microbatch ``batch``; ``peak`` above is the highest rank's."""
    plan = run.plan
    ranks = []
    for r in run.ranks:
        steady, first = r.peak(batch), r.peak(batch, first_step=True)
        change = run.change(r.rank, batch) if run.one_gpu is not None else None
        ranks.append({
            "rank": r.rank, "role": r.role, "blocks": r.blocks, "parameters": r.parameters,
            "saved_per_microbatch": _expr_dict(r.activations), "saved_at_batch": r.activations.at(batch, seq),
            "steady_step": {"bytes": steady.bytes, "phase": steady.phase.value, "node": steady.node, "device": _device_dict(steady.device)},
            "first_step": {"bytes": first.bytes, "phase": first.phase.value, "node": first.node, "device": _device_dict(first.device)},
            "microbatches_in_flight": r.in_flight(batch),
            "against_one_gpu": None if change is None else {
                "state": change.state, "activations_at_peak": change.activations, "receive_buffers": change.receive_buffers,
                "sharding_buffers": change.sharding,
            },
        })  # fmt: skip
    return {
        "describe": run.describe(), "stages": plan.stages, "stages_per_rank": plan.virtual, "microbatches": plan.microbatches,
        "schedule": plan.schedule.value, "blocks": plan.stack, "bounds": [list(b) for b in plan.bounds],
        "fsdp": run.within.fsdp if run.within is not None else 1, "tp": run.within.tp if run.within is not None else 1,
        "one_gpu_state": run.one_gpu.state if run.one_gpu is not None else None, "ranks": ranks,
    }  # fmt: skip


def _peak_dict(report: Report) -> dict[str, Any]:
    """``first_step`` and ``steady_step``: the peak at the report's batch and its envelope's pieces."""
    out: dict[str, Any] = {}
    for first, key in ((True, "first_step"), (False, "steady_step")):
        p = report.peak(report.batch, first_step=first)
        out[key] = {
            "batch": p.batch, "bytes": p.bytes, "phase": p.phase.value, "node": p.node, "layer": p.fqn, "op": p.op,
            "breakdown": {c.value: n for c, n in p.breakdown.items()},
            "split": {"state": p.state, "activations": p.saved, "temporaries": p.temporaries, "inputs": p.inputs, "communication": p.communication},
            "device": _device_dict(p.device),
            "estimated": [{"what": x.what, "node": x.node, "layer": x.fqn, "op": x.op, "bytes": x.nbytes, "at_most": x.bound} for x in p.estimated],
            "with_estimates_at_their_bounds": p.upper,
            "envelope": [
                {"from_batch": e.first_batch, "to_batch": e.last_batch, "per_sample": e.per_sample, "constant": e.fixed, "phase": e.phase.value, "node": e.node}
                for e in report.envelope(first_step=first)
            ],
        }  # fmt: skip
    return out


def _compute_dict(report: Report) -> dict[str, Any]:
    """``flops`` (per phase, {per_sample, constant} and the figure at the report's batch), ``roofline``
    (the lower bound at the report's batch) and ``tradeoff`` (one row per batch size)."""
    b = report.batch
    symbolic = report.steps.symbolic_timeline()
    exprs = flop_exprs(symbolic) if symbolic is not None else None
    f, t = report.flops(b), report.step_time(b)
    flops: dict[str, Any] = {}
    for phase, at_b in (("forward", f.forward), ("backward", f.backward), ("optimizer", f.optimizer)):
        flops[phase] = {**(_expr_dict(exprs[phase]) if exprs is not None else {}), "at_batch": at_b}
    flops["without_formula"] = dict(f.missing)
    nodes = node_costs(report.timeline(b), b, report.gpu, report.seq_len)
    roofline = {
        "gpu": report.gpu.name, "batch": b, "seconds": t.seconds, "samples_per_second": t.samples_per_second(b),
        "peak_share": t.peak_share, "dtype": _dtype_label(t.dtype), "is_lower_bound": True,
        "phases": {p.phase.value: {"seconds": p.seconds, "flops": p.flops, "bytes": p.moved_bytes} for p in t.phases},
        "memory_bound_nodes": [n.node for n in memory_bound(nodes)],
        "nodes": [
            {"node": n.node, "layer": n.fqn, "flops": n.flops, "bytes_moved": n.moved_bytes, "intensity": n.intensity if n.moved_bytes else None, "seconds": n.seconds, "bound": n.bound.value}
            for n in nodes
        ],
    }  # fmt: skip
    tradeoff = [r.__dict__ for r in report.tradeoff()] if report.device_memory is not None else None
    return {"flops": flops, "roofline": roofline, "tradeoff": tradeoff}


def _setup_dict(report: Report) -> dict[str, Any] | None:
    t = report.setup
    if t is None:
        return None
    return {
        "target": t.target, "gpu": t.gpu if t.cuda else None, "amp": t.amp, "precision": t.recipe,
        "world_size": t.world_size, "shard": t.shard, "optimizer_impl": t.optimizer_impl, "torch_version": t.torch_version,
        "alloc_conf": t.alloc_conf if t.cuda else None, "memory_fraction": t.memory_fraction if t.cuda else None,
    }  # fmt: skip


def _device_dict(d: DevicePeak | None) -> dict[str, Any] | None:
    if d is None:
        return None
    return {
        "gpu": d.gpu, "max_memory_allocated": d.allocated, "max_memory_reserved": d.reserved, "nvidia_smi_total": d.total,
        "capacity": d.capacity, "overheads": {name: n for name, n, _ in d.overheads}, "per_gpu_extra": {name: n for name, n, _ in d.extra},
        "fits": d.fits, "short": d.short, "out_of_memory_at": d.oom_node or None, "workspaces_given_way": list(d.shrunk),
        "allocator": d.alloc_conf,
    }  # fmt: skip


def _input_dict(spec: InputSpec) -> dict[str, Any]:
    """One input in the JSON: a tensor's shape, dtype and bytes, or a pass-through value's repr."""
    if isinstance(spec, Constant):
        return {"name": spec.name, "value": repr(spec.value)}
    return {"name": spec.name, "shape": list(spec.dims), "dtype": dtype_name(spec.dtype), "bytes": _expr_dict(_input_expr(spec))}


def _input_expr(spec: Any) -> ByteExpr:
    import torch

    per = torch.empty((), dtype=spec.dtype).element_size()
    for d in spec.dims:
        per *= 1 if d == "B" else int(d)
    return ByteExpr(per_sample=per)


def _node_dict(n: NodeRecord, flops: dict[str, ByteExpr] | None = None) -> dict[str, Any]:
    """One fx node: its saved bytes, and (where the step was simulated with a symbolic batch) its FLOPs
    forward and backward, each {per_sample, constant}."""
    return {
        "name": n.name,
        "op": n.info.op,
        "target": n.info.target,
        "layer": n.fqn,
        "output_shape": list(n.info.output_shape) if n.info.output_shape is not None else None,
        "saved": _expr_dict(n.saved),
        "saved_at_1": n.exact.get(1),
        "saved_tensors": [_saved_tensor_dict(t, 1) for t in n.tensors],
        "flops": {side: _expr_dict(e) for side, e in flops.items()} if flops is not None else None,
    }


def render_timeline(timeline: Timeline, peak: Peak, batch: int, seq: int | None, model: str, *, top: int = 8) -> str:
    """The step phase by phase (memory at its start, its highest point and where, at its end), then
    what is alive at the step's peak: by category, and the largest storages made during the step."""
    at = lambda e: e.at(batch, seq)
    live = sum(at(e) for e in timeline.baseline.values())
    rows: list[list[str]] = []
    current: list[Any] = []
    for e in timeline.events:
        if not current or current[0] != e.phase:
            if current:
                rows.append(_phase_row(current, live))
            current = [e.phase, live, live, ""]
        live += at(e.nbytes) if e.alloc else -at(e.nbytes)
        if live > current[2]:
            current[2], current[3] = live, f"{e.node} ({e.op})"
    if current:
        rows.append(_phase_row(current, live))
    kind = (
        "first step: the optimizer state is made in step()"
        if timeline.first_step
        else "steady step: the optimizer state exists from the start"
    )
    head = f"fxmem timeline: {model} at B={batch}" + (f", S={seq}" if seq is not None else "") + f" ({kind})"
    table = tabulate(rows, headers=["Phase", "At start", "Highest", "Where (node, op)", "At end"], disable_numparse=True)
    split = ", ".join(f"{c.value} {format_bytes(n)}" for c, n in peak.breakdown.items())
    lines = [
        head,
        table,
        f"Peak {format_bytes(peak.bytes)} ({peak.bytes} B) in {peak.phase} at {peak.node} ({peak.op}). Alive there: {split}.",
    ]
    if peak.device is not None:
        d = peak.device
        lines.append(
            f"On the GPU ({d.gpu}), with the caching allocator and the fixed costs: max_memory_allocated {format_bytes(d.allocated)}, "
            f"reserved {format_bytes(d.reserved)}, nvidia-smi {format_bytes(d.total)}."
        )
    alive = _alive_at_peak(timeline, peak, batch, seq)
    if alive:
        body = [[e.category.value, e.node, e.op, format_bytes(n)] for e, n in alive[:top]]
        lines.append(f"Largest storages made during the step and alive at the peak (of {len(alive)}):\n"
                     + tabulate(body, headers=["Category", "Made by", "Op", "Bytes"], disable_numparse=True))  # fmt: skip
    return "\n\n".join(lines) + "\n"


def _phase_row(current: list[Any], end: int) -> list[str]:
    phase, start, high, where = current
    return [phase.value, format_bytes(start), format_bytes(high), where, format_bytes(end)]


def _alive_at_peak(timeline: Timeline, peak: Peak, batch: int, seq: int | None) -> list[tuple[Any, int]]:
    """Storages allocated during the step and still alive right after the peak's allocation, largest first."""
    live: dict[int, Any] = {}
    for e in timeline.events[: peak.event + 1]:
        if e.alloc:
            live[e.storage] = e
        else:
            live.pop(e.storage, None)
    return sorted(((e, e.nbytes.at(batch, seq)) for e in live.values()), key=lambda x: -x[1])
