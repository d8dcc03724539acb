"""The module tree as an icicle: one block per module path and level, its width the bytes it saves
for backward at the page's batch (an inline SVG for the HTML page, fxmem/output/html_report.py).

An icicle is a flame graph drawn top-down: the whole on top, each module's children under it. Its
rows are the JSON report's rows at each depth (``group_layers``), so a block's hover numbers are the
figures ``to_dict(report, depth=level)`` gives for that path.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fxmem.output.render import format_bytes, group_layers
from fxmem.output.svg import WIDTH, element, escape, title
from fxmem.results import LayerRow
from fxmem.symbolic import ByteExpr

if TYPE_CHECKING:
    from fxmem.report import Report

__all__ = ["DEPTH", "Block", "draw_icicle", "hover_lines", "icicle_blocks", "icicle_note", "level_of", "shown_depth"]

DEPTH = 6
"""The deepest level of the module tree the icicle draws; deeper modules are merged into their
ancestor at this depth (See Note [Icicle levels])."""
_ROW = 22
"""A level's height in SVG units."""


# Note [Icicle levels]
# Level d of the icicle is group_layers(report, d), the JSON report's rows at depth d, less the rows
# whose path is shorter than d (a leaf such as "conv1" stops at level 1). So each module path with
# bytes has one block per level it reaches, and a block's a, c and bytes are its row's: the sum over
# its subtree. A module that runs ops itself (a residual add in "layer1.0") holds more than its
# children, and the rest shows as a gap under it. Special rows ("(loss)", "(top level)") sit at
# level 1. Paths deeper than ``depth`` are merged into their ancestor at that depth, as group_layers
# merges them.


@dataclass(frozen=True)
class Block:
    """One module path on one level of the icicle: its row, where it starts (in bytes from the left) and its bytes."""

    row: LayerRow
    level: int
    start: int
    nbytes: int
    group: int
    """Which top-level module it belongs to (its colour)."""


def level_of(fqn: str) -> int:
    """How deep a module path sits: 'layer1.0.conv1' is 3; '(loss)' and '(top level)' are top-level rows."""
    return 1 if fqn.startswith("(") else fqn.count(".") + 1


def shown_depth(report: Report, depth: int = DEPTH) -> int:
    """The levels the icicle draws: the tree's own depth, at most ``depth``."""
    return min(depth, max((level_of(r.fqn) for r in group_layers(report)), default=0))


def icicle_blocks(report: Report, depth: int = DEPTH) -> list[Block]:
    """Every block of the icicle, level by level, each child placed after its earlier siblings under
    its parent (See Note [Icicle levels])."""
    per_node = report.node_bytes(report.batch)
    start: dict[str, int] = {"": 0}
    used: dict[str, int] = defaultdict(int)
    group: dict[str, int] = {}
    blocks = []
    for level in range(1, shown_depth(report, depth) + 1):
        for row in group_layers(report, level):
            if level_of(row.fqn) != level:
                continue
            parent = row.fqn.rpartition(".")[0] if level > 1 else ""
            if parent not in start:
                raise AssertionError(f"icicle: '{row.fqn}' has no block for its parent '{parent}' on level {level - 1}")
            nbytes = sum(per_node.get(n, 0) for n in row.nodes)
            start[row.fqn] = start[parent] + used[parent]
            used[parent] += nbytes
            group[row.fqn] = group[parent] if level > 1 else len(group)
            blocks.append(Block(row, level, start[row.fqn], nbytes, group[row.fqn]))
    return blocks


def hover_lines(name: str, expr: ByteExpr, nbytes: int, total: int, at: str) -> list[str]:
    """A block's tooltip: a and c of ``a*B + c`` in bytes, the bytes at the page's batch and their share."""
    lines = [
        name,
        f"a = {expr.per_sample} B per sample ({format_bytes(expr.per_sample)}·B)",
        f"c = {expr.fixed} B ({format_bytes(expr.fixed)})",
    ]
    if expr.higher or expr.seq_terms:
        lines.append(f"bytes = {expr.polynomial()}")
    share = f"{100 * nbytes / total:.1f}%" if total else "-"
    return [*lines, f"at {at}: {nbytes} B ({format_bytes(nbytes)})", f"share: {share} of the saved activations"]


def icicle_note(report: Report, depth: int, at: str) -> str:
    """The sentence above the icicle: what a block is, how many levels are drawn, whether deeper ones were merged."""
    levels = shown_depth(report, depth)
    merged = f"; modules deeper than {depth} levels are merged into their ancestor" if levels == depth and _deeper(report, depth) else ""
    return f"Each block is a module, its width the bytes it saves for backward at {at}; children sit under their parent ({levels} levels{merged}). Hover a block for a, c, its bytes and share."


def _deeper(report: Report, depth: int) -> bool:
    return any(level_of(r.fqn) > depth for r in group_layers(report))


def draw_icicle(report: Report, depth: int, at: str) -> str:
    """The icicle as an inline SVG: the whole step's saved bytes on top, then one row per level of modules."""
    total = report.activation_bytes(report.batch)
    if total <= 0:
        return f'<p class="none">Nothing is saved for backward at {escape(at)}.</p>'
    blocks = icicle_blocks(report, depth)
    height = (shown_depth(report, depth) + 1) * _ROW + 2
    lines = hover_lines("all saved activations", report.activations, total, total, at)
    root = element("rect", {"class": "root tip", "data-bytes": total, "x": 0, "y": 0, "width": WIDTH, "height": _ROW - 1}, title(lines))
    body = root + _label(0.0, 0, float(WIDTH), f"all saved activations: {format_bytes(total)} at {at}", dark=True)
    body += "".join(_block_svg(b, total, at) for b in blocks)
    return element("svg", {"class": "chart icicle", "viewBox": f"0 0 {WIDTH} {height}", "role": "img"}, body)


def _block_svg(block: Block, total: int, at: str) -> str:
    x, w, y = WIDTH * block.start / total, WIDTH * block.nbytes / total, block.level * _ROW
    expr = block.row.saved
    attrs = {
        "class": "module tip", "data-fqn": block.row.fqn, "data-depth": block.level, "data-a": expr.per_sample, "data-c": expr.fixed,
        "data-bytes": block.nbytes, "x": x, "y": y, "width": w, "height": _ROW - 1, "fill": _fill(block.group, block.level),
    }  # fmt: skip
    rect = element("rect", attrs, title(hover_lines(block.row.fqn, expr, block.nbytes, total, at)))
    name = block.row.fqn if block.level == 1 else _short(block.row.fqn)
    return rect + _label(x, y, w, name, dark=_lightness(block.level) > 60)


def _short(fqn: str) -> str:
    """A block's label: the last name of its path, with the one before where it is an index ('layer1.0', 'h.3')."""
    parts = fqn.split(".")
    keep = 2 if len(parts) > 1 and parts[-1].isdigit() else 1
    return ".".join(parts[-keep:])


def _lightness(level: int) -> int:
    return min(34 + 9 * level, 84)


def _fill(group: int, level: int) -> str:
    """A hue per top-level module (the golden angle keeps neighbours apart), lighter the deeper the block."""
    return f"hsl({(210 + 137.5 * group) % 360:.0f},45%,{_lightness(level)}%)"


def _label(x: float, y: float, width: float, text: str, *, dark: bool) -> str:
    """A block's name inside it, cut to fit; none where the block is too narrow to read."""
    fits = int((width - 6) / 6.5)
    if fits < 3:
        return ""
    shown = text if len(text) <= fits else text[: fits - 1] + "…"
    return element("text", {"class": "label" + ("" if dark else " light"), "x": x + 4, "y": y + _ROW - 7}, escape(shown))
