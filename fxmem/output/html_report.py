"""A Report as one self-contained HTML page: where the memory goes, drawn without a network. Never prints.

memray answers "where did the memory go" with a flame graph in one HTML file; this page does the same
for one training step. It holds three charts and the text summary:

- an icicle of the module tree, each module's width its saved bytes at B (hover: a, c, bytes at B, share);
- the step's live memory over time, stacked by category, with its peak marked;
- memory (and, where the step was simulated, the roofline bound on throughput) against B;
- the summary lines of the text report.

The charts are inline SVG made in Python (fxmem/output/icicle.py, fxmem/output/charts.py, with the
pieces of fxmem/output/svg.py), so the page draws with scripts off and fetches nothing: no CDN,
no font, no image. Hover text is SVG's own ``<title>``, the browser's tooltip, as in Brendan Gregg's
flamegraph.pl (https://github.com/brendangregg/FlameGraph, flamegraph.pl); the one small script only
shows that text at once, next to the pointer. Every number comes from the functions the JSON report
uses (``fxmem/output/render.py``: ``group_layers``, ``Report.node_bytes``, ``Report.peak``,
``Report.tradeoff``), so the page and ``to_dict`` agree figure for figure (tests/test_html.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fxmem.output.charts import draw_timeline, draw_tradeoff, tradeoff_note
from fxmem.output.icicle import DEPTH, draw_icicle, icicle_note
from fxmem.output.render import render
from fxmem.output.svg import escape

if TYPE_CHECKING:
    from fxmem.report import Report

__all__ = ["to_html"]


def to_html(report: Report, batch: int | None = None, *, depth: int = DEPTH) -> str:
    """The report as one self-contained HTML page at ``batch`` (default: the report's own batch).

    Write it to a file and open that in any browser; it needs no network and no script to draw:

    >>> page = to_html(report, 8)                            # doctest: +SKIP
    >>> Path("report.html").write_text(page)                 # doctest: +SKIP
    """
    if batch is not None and batch != report.batch:
        report = dataclasses.replace(report, batch=batch)  # every figure on the page, the summary's too, at one B
    at = f"B={report.batch}" + (f", S={report.seq_len}" if report.seq_len is not None else "")
    sections = [
        _section("Where the saved activations are", icicle_note(report, depth, at), draw_icicle(report, depth, at)),
        _section("One training step", f"Live memory at {at}, stacked by category; the dashed line marks the peak.", draw_timeline(report)),
        _section("Batch size", tradeoff_note(report), draw_tradeoff(report)),
        _section("Summary", "The lines of the text report (fxmem analyze), at the same B.", _summary_text(report)),
    ]
    return _page(f"fxmem: {report.model} at {at}", sections)


def _summary_text(report: Report) -> str:
    """The screen report as render's HTML fragment (every text escaped there): the same lines as ``fxmem analyze``."""
    return f'<div class="summary">\n{render(report, "html")}</div>'


def _section(heading: str, note: str, body: str) -> str:
    return f'<section>\n<h2>{escape(heading)}</h2>\n<p class="note">{escape(note)}</p>\n{body}\n</section>'


_STYLE = """
body { font: 14px system-ui, sans-serif; color: #222; max-width: 1240px; margin: 20px auto; padding: 0 16px; }
h1 { font-size: 20px; margin: 0 0 8px; } h2 { font-size: 16px; margin: 26px 0 2px; }
p.note, p.none { color: #555; margin: 2px 0 8px; }
svg.chart { width: 100%; height: auto; display: block; }
svg text { font: 11px system-ui, sans-serif; fill: #333; }
svg text.label { pointer-events: none; fill: #111; } svg text.label.light { fill: #fff; }
svg text.axis { font-size: 12px; } svg text.peaklabel { font-size: 12px; font-weight: 600; fill: #b00; }
rect.root { fill: #d9d9d9; } rect.module, rect.root { stroke: #fff; stroke-width: 0.5; }
rect.module:hover, rect.root:hover { stroke: #000; stroke-width: 1.5; }
line.grid { stroke: #e6e6e6; } line.phase { stroke: #555; stroke-dasharray: 2 3; }
g.peak line { stroke: #b00; stroke-width: 1.5; stroke-dasharray: 5 3; } g.peak circle { fill: #b00; }
polygon.area { stroke: none; } polyline { fill: none; stroke-width: 2; }
line.budget { stroke: #c44e52; stroke-dasharray: 6 4; } line.largest { stroke: #c44e52; stroke-dasharray: 2 3; }
rect.batch { fill: transparent; } rect.batch:hover { fill: rgba(0, 0, 0, 0.06); }
.legend span { display: inline-block; margin: 4px 16px 0 0; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 5px; vertical-align: -1px; }
div.summary { font: 12px ui-monospace, monospace; background: #f6f6f6; padding: 4px 10px; overflow-x: auto; }
div.summary table { border-collapse: collapse; margin: 6px 0; } div.summary td, div.summary th { padding: 1px 10px 1px 0; vertical-align: top; }
#hover { position: fixed; background: #fffff4; border: 1px solid #999; padding: 4px 8px; font: 12px ui-monospace, monospace;
  white-space: pre; pointer-events: none; }
"""

_SCRIPT = """
// A nicety only: the charts draw without this. It shows the hovered element's <title> at once, next to
// the pointer (the browser's own tooltip shows the same text, after a delay).
const box = document.getElementById("hover");
document.addEventListener("mousemove", (e) => {
  const tip = e.target.closest && e.target.closest(".tip");
  const text = tip && tip.querySelector(":scope > title");
  box.hidden = !text;
  if (!text) return;
  box.textContent = text.textContent;
  box.style.left = Math.max(4, Math.min(e.clientX + 14, innerWidth - box.offsetWidth - 8)) + "px";
  box.style.top = Math.min(e.clientY + 14, innerHeight - box.offsetHeight - 8) + "px";
});
"""


def _page(heading: str, sections: Sequence[str]) -> str:
    head = f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{escape(heading)}</title>\n<style>{_STYLE}</style>\n</head>'
    body = [
        f"<body>\n<h1>{escape(heading)}</h1>",
        *sections,
        '<div id="hover" hidden></div>',
        f"<script>{_SCRIPT}</script>\n</body>\n</html>\n",
    ]
    return head + "\n" + "\n".join(body)
