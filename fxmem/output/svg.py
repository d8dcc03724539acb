"""The few SVG pieces the HTML page draws with: escaped elements, scales and axes. Never prints.

Inline SVG needs no ``xmlns`` inside an HTML document (the HTML parser puts ``<svg>`` in the SVG
namespace itself: https://html.spec.whatwg.org/multipage/embedded-content-other.html#svg-0), so the
page holds no URL at all. Coordinates are rounded to 0.1 of a unit: the charts are 1200 units wide,
finer positions would only make the file bigger.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fxmem.output.render import format_bytes, format_count

__all__ = ["WIDTH", "Frame", "Scale", "byte_ticks", "count_ticks", "element", "escape", "frame_axes", "points", "title"]

WIDTH = 1200
"""Every chart's width in SVG units; the page scales the charts to the window."""


def escape(text: object) -> str:
    """Text or an attribute value made safe for HTML and SVG (quotes included)."""
    return html.escape(str(text), quote=True)


def _value(v: object) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".") if isinstance(v, float) else escape(v)


def element(name: str, attrs: Mapping[str, object], body: str = "") -> str:
    """``<name a="1">body</name>``; attributes whose value is None are left out, floats rounded to 0.1."""
    text = "".join(f' {k}="{_value(v)}"' for k, v in attrs.items() if v is not None)
    return f"<{name}{text}>{body}</{name}>"


def title(lines: Sequence[str]) -> str:
    """An SVG ``<title>``: the browser shows it as the element's tooltip (SVG 2, section 5.9:
    https://www.w3.org/TR/SVG2/struct.html#TitleElement), one line per entry."""
    return f"<title>{escape(chr(10).join(lines))}</title>"


def points(xy: Sequence[tuple[float, float]]) -> str:
    """A ``points`` attribute for a polyline or polygon."""
    return " ".join(f"{_value(float(x))},{_value(float(y))}" for x, y in xy)


@dataclass(frozen=True)
class Scale:
    """Maps data from [lo, hi] to pixels [start, end], linearly or in log2 (batch sizes)."""

    lo: float
    hi: float
    start: float
    end: float
    log2: bool = False

    def __call__(self, v: float) -> float:
        f = math.log2 if self.log2 else float
        lo, hi = f(self.lo), f(self.hi)
        share = (f(v) - lo) / (hi - lo) if hi != lo else 0.0
        return self.start + share * (self.end - self.start)


def _nice_step(span: float, count: int) -> float:
    """1, 2, 2.5 or 5 times a power of ten, so that about ``count`` steps cover ``span``."""
    raw = max(span / count, 1e-12)
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)


def byte_ticks(hi: int, count: int = 5) -> list[tuple[int, str]]:
    """Ticks from 0 to ``hi`` bytes at round values in the unit of the largest (KiB, MiB, GiB)."""
    unit = next((u for u in (2**40, 2**30, 2**20, 2**10) if hi >= u), 1)
    step = _nice_step(hi / unit, count) * unit
    return [(round(k * step), format_bytes(round(k * step))) for k in range(int(hi // step) + 1)]


def count_ticks(hi: float, count: int = 5) -> list[tuple[float, str]]:
    """Ticks from 0 to ``hi`` at round values, labelled as counts are said (250K, 1.5M; 0.25 below one)."""
    step = _nice_step(hi, count)
    label = (lambda v: format_count(round(v))) if step >= 1 else (lambda v: f"{v:.3g}")
    return [(k * step, label(k * step)) for k in range(int(hi // step) + 1)]


@dataclass(frozen=True)
class Frame:
    """A chart's plotting area inside its SVG: ``left``..``right``, ``top``..``bottom`` in pixels."""

    width: float
    height: float
    left: float = 70.0
    right_margin: float = 90.0
    top: float = 30.0
    bottom_margin: float = 40.0

    @property
    def right(self) -> float:
        return self.width - self.right_margin

    @property
    def bottom(self) -> float:
        return self.height - self.bottom_margin


def frame_axes(frame: Frame, y: Scale, ticks: Sequence[tuple[float, str]], *, side: str = "left", label: str = "") -> str:
    """Grid lines and labels of a y axis (left or right), with its label written along it."""
    x, anchor, dx = (frame.left, "end", -6) if side == "left" else (frame.right, "start", 6)
    parts = [
        element("line", {"class": "grid", "x1": frame.left, "x2": frame.right, "y1": y(v), "y2": y(v)}) if side == "left" else ""
        for v, _ in ticks
    ]
    parts += [element("text", {"class": "tick", "x": x + dx, "y": y(v) + 4, "text-anchor": anchor}, escape(t)) for v, t in ticks]
    if label:
        lx = 14 if side == "left" else frame.width - 10
        cy = (frame.top + frame.bottom) / 2
        parts.append(
            element(
                "text",
                {"class": "axis", "x": lx, "y": cy, "transform": f"rotate(-90 {lx} {cy:.1f})", "text-anchor": "middle"},
                escape(label),
            )
        )
    return "".join(parts)
