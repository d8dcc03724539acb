"""The HTML page: self-contained, one block per module, hover numbers equal to the JSON report's, and
drawn by a real browser (headless Chromium, skipped where none is installed)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import defaultdict
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxmem
from fxmem.errors import InputSpecError
from fxmem.output.charts import NO_STEP, thin
from fxmem.output.html_report import to_html
from fxmem.output.icicle import DEPTH
from fxmem.output.plot import CATEGORY_COLORS
from fxmem.output.render import render, to_dict
from fxmem.report import Report
from fxmem.results import Category

BATCH = 4


class _Block(nn.Module):
    """Modules inside modules, and ops of the block's own (sigmoid, mul) that no child holds."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.inner(x) * torch.sigmoid(x))


def _model() -> nn.Module:
    return nn.Sequential(_Block(), nn.Sequential(_Block(), nn.Linear(16, 4)))  # paths up to '1.0.inner.1': 4 levels


@pytest.fixture(scope="module")
def report() -> Report:
    return fxmem.analyze(_model(), ["B,16"], loss="cross_entropy", target="cpu", batch=BATCH, device_memory=2**20)


@pytest.fixture(scope="module")
def page(report: Report) -> str:
    return to_html(report)


# --- reading the page back ------------------------------------------------------------------------
_VOID = {"meta", "br", "hr", "img", "input", "link"}


class _Elements(HTMLParser):
    """Every element as {"tag", attrs..., "title": its <title> child's text, "index", "parent": its parent's
    index}, in document order."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[dict[str, Any]] = []
        self.open: list[dict[str, Any]] = []
        self.text: dict[str, list[str]] = defaultdict(list)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        parent = self.open[-1]["index"] if self.open else None
        record: dict[str, Any] = {"tag": tag, **{k: v or "" for k, v in attrs}, "title": "", "index": len(self.found), "parent": parent}
        self.found.append(record)
        if tag not in _VOID:
            self.open.append(record)

    def handle_endtag(self, tag: str) -> None:
        while self.open and self.open.pop()["tag"] != tag:
            pass

    def handle_data(self, data: str) -> None:
        if not self.open:
            return
        top = self.open[-1]
        self.text[top["tag"]].append(data)
        if top["tag"] == "title" and len(self.open) > 1:
            self.open[-2]["title"] += data


def _parse(text: str) -> _Elements:
    parser = _Elements()
    parser.feed(text)
    parser.close()
    return parser


def _with_class(elements: _Elements, tag: str, name: str) -> list[dict[str, Any]]:
    return [e for e in elements.found if e["tag"] == tag and name in e.get("class", "").split()]


def _number(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not in {text!r}"
    return int(match.group(1))


# --- what the report says, derived here from its nodes ------------------------------------------------
def _path(fqn: str) -> list[str]:
    name = fqn or "(top level)"
    return [name] if name.startswith("(") else name.split(".")


def _expected_blocks(report: Report, batch: int, depth: int) -> dict[int, dict[str, int]]:
    """{level: {module path cut to that level: bytes at batch}} from the nodes with bytes, each node
    counted under every ancestor it has down to ``depth`` (deeper ones merged into it)."""
    levels: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for node in report.nodes:
        nbytes = report.node_bytes(batch)[node.name]
        parts = _path(node.fqn)
        for level in range(1, min(len(parts), depth) + 1) if nbytes else ():
            levels[level][".".join(parts[:level])] += nbytes
    return {level: dict(blocks) for level, blocks in levels.items()}


def _fqn_of(report: Report, node: str) -> str:
    return next(n.fqn for n in report.nodes if n.name == node)


# --- the page, read as HTML --------------------------------------------------------------------------
def test_the_page_fetches_nothing(page: str) -> None:
    elements = _parse(page)
    for e in elements.found:
        for attr in ("src", "href", "xlink:href", "action", "srcset", "poster"):
            assert attr not in e, f"<{e['tag']}> has {attr}={e[attr]!r}: the page must not load anything"
    assert [e["tag"] for e in elements.found].count("style") == 1
    code = "".join(elements.text["style"] + elements.text["script"])
    for fetch in ("url(", "@import", "http:", "https:", "//cdn", "fetch(", "XMLHttpRequest", "import("):
        assert fetch not in code
    assert not re.search(r"(src|href)\s*=\s*[\"']?\s*(https?:)?//", page)


def test_one_block_per_module_at_each_level(report: Report, page: str) -> None:
    expected = _expected_blocks(report, BATCH, DEPTH)
    assert max(expected) == 4 < DEPTH  # the whole tree is shown: '1.0.inner.1' is 4 levels deep
    blocks = _with_class(_parse(page), "rect", "module")
    shown: dict[int, dict[str, int]] = defaultdict(dict)
    for b in blocks:
        assert b["data-fqn"] not in shown[int(b["data-depth"])], f"two blocks for {b['data-fqn']}"
        shown[int(b["data-depth"])][b["data-fqn"]] = int(b["data-bytes"])
    assert dict(shown) == expected
    assert {"0", "1", "(loss)"} <= set(expected[1])


def test_a_shallow_icicle_merges_the_deeper_modules(report: Report) -> None:
    blocks = _with_class(_parse(to_html(report, depth=2)), "rect", "module")
    shown = {(int(b["data-depth"]), b["data-fqn"]): int(b["data-bytes"]) for b in blocks}
    assert shown == {(level, fqn): n for level, row in _expected_blocks(report, BATCH, 2).items() for fqn, n in row.items()}
    below = sum(n for name, n in report.node_bytes(BATCH).items() if (_fqn_of(report, name) + ".").startswith("1.0."))
    assert shown[(2, "1.0")] == below  # '1.0' itself and all of '1.0.inner', '1.0.norm' (3 and 4 levels deep)


def test_children_sit_under_their_parent(page: str) -> None:
    blocks = {b["data-fqn"]: b for b in _with_class(_parse(page), "rect", "module")}
    span = lambda b: (float(b["x"]), float(b["x"]) + float(b["width"]))
    for fqn, b in blocks.items():
        if int(b["data-depth"]) == 1:
            continue
        parent = blocks[fqn.rpartition(".")[0]]
        assert float(b["y"]) > float(parent["y"])
        assert span(parent)[0] - 0.1 <= span(b)[0] and span(b)[1] <= span(parent)[1] + 0.2, (fqn, span(b), span(parent))
    top = [b for b in blocks.values() if b["data-depth"] == "1"]
    assert sum(float(b["width"]) for b in top) == pytest.approx(1200, abs=0.1 * len(top))


def test_hover_numbers_are_the_json_reports(report: Report, page: str) -> None:
    elements = _parse(page)
    data = to_dict(report)
    total = data["at_batch"]["activations"]
    by_depth = {d: {row["layer"]: row for row in to_dict(report, depth=d)["layers"]} for d in range(1, DEPTH + 1)}
    blocks = _with_class(elements, "rect", "module")
    for b in blocks:
        row, tip = by_depth[int(b["data-depth"])][b["data-fqn"]], b["title"]
        a, c, at = row["saved"]["per_sample"], row["saved"]["constant"], row["bytes_at_batch"]
        assert _number(r"\ba = (\d+) B per sample", tip) == int(b["data-a"]) == a
        assert _number(r"\bc = (\d+) B", tip) == int(b["data-c"]) == c
        assert _number(rf"at B={BATCH}: (\d+) B", tip) == int(b["data-bytes"]) == at == a * BATCH + c
        assert f"share: {100 * at / total:.1f}%" in tip
    root = _with_class(elements, "rect", "root")[0]
    assert _number(rf"at B={BATCH}: (\d+) B", root["title"]) == int(root["data-bytes"]) == total
    assert _number(r"\ba = (\d+) B", root["title"]) == data["activations"]["per_sample"]


def test_the_peak_marker_is_the_reports_peak(report: Report, page: str) -> None:
    elements = _parse(page)
    (mark,) = _with_class(elements, "g", "peak")
    peak = report.peak(BATCH)
    assert int(mark["data-bytes"]) == peak.bytes == to_dict(report)["peak"]["steady_step"]["bytes"]
    assert _number(rf"peak at B={BATCH}: (\d+) B", mark["title"]) == peak.bytes
    assert int(mark["data-event"]) == peak.event
    timeline = report.timeline(BATCH)
    present = {e.category.value for e in timeline.events} | {c.value for c, e in timeline.baseline.items() if e.at(BATCH)}
    assert {a["data-category"] for a in _with_class(elements, "polygon", "area")} == present
    (dot,) = [e for e in elements.found if e["tag"] == "circle" and e["parent"] == mark["index"]]
    top = _with_class(elements, "polygon", "area")[-1]["points"].split()
    assert f"{dot['cx']},{dot['cy']}" in top  # the marker sits on the drawn curve: the peak's event is drawn


def test_thinning_keeps_every_top_the_peak_and_the_ends() -> None:
    totals = [(i * 7919) % 1000 for i in range(5000)]
    totals[3210] = 5000
    kept = thin(totals, keep=17, limit=600)
    assert kept == sorted(set(kept)) and len(kept) <= 603
    assert {0, 4999, 17, 3210} <= set(kept)
    assert thin(totals[:600], keep=3, limit=600) == list(range(600))


def test_the_batch_tradeoff_is_the_json_tradeoff(report: Report, page: str) -> None:
    rows = to_dict(report)["tradeoff"]
    assert rows and rows[-1]["batch"] == report.max_batch(2**20)
    columns = _with_class(_parse(page), "rect", "batch")
    assert [int(c["data-batch"]) for c in columns] == [r["batch"] for r in rows]
    for c, r in zip(columns, rows):
        assert int(c["data-peak"]) == r["peak"] == _number(r"peak (\d+) B", c["title"])
        assert int(c["data-device"]) == r["device"] == _number(r"device (\d+) B", c["title"])
        assert int(c["data-activations"]) == r["activations"]


def test_the_summary_is_the_text_reports(report: Report, page: str) -> None:
    summary = page[page.index('<div class="summary">') :]
    assert render(report, "html") in summary


def test_another_batch_draws_every_figure_there(report: Report) -> None:
    elements = _parse(to_html(report, 3))
    blocks = {(int(b["data-depth"]), b["data-fqn"]): int(b["data-bytes"]) for b in _with_class(elements, "rect", "module")}
    assert blocks == {(level, fqn): n for level, row in _expected_blocks(report, 3, DEPTH).items() for fqn, n in row.items()}
    (mark,) = _with_class(elements, "g", "peak")
    assert int(mark["data-bytes"]) == report.peak(3).bytes
    assert "at B=3: " in _with_class(elements, "rect", "root")[0]["title"]


def test_without_the_step_the_page_says_so() -> None:
    report = fxmem.analyze(_model(), ["B,16"], loss="cross_entropy", target="cpu", batch=BATCH, peak=False)
    page = to_html(report)
    elements = _parse(page)
    assert NO_STEP in elements.text["p"]
    assert not _with_class(elements, "g", "peak") and not _with_class(elements, "polygon", "area")
    assert len(_with_class(elements, "rect", "module")) == sum(len(row) for row in _expected_blocks(report, BATCH, DEPTH).values())
    columns = _with_class(elements, "rect", "batch")
    assert columns and all(int(c["data-total"]) == report.total_bytes(int(c["data-batch"])) for c in columns)


# --- the page in a real browser ---------------------------------------------------------------------
def _chromium() -> str:
    found = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"))), None)
    if found is None:
        pytest.skip("no chromium: apt-get install chromium")
    return found


def _browse(tmp_path: Path, page: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """Headless Chromium on the page as a file: no sandbox (CI runs as root), no GPU, a profile of its own."""
    path = tmp_path / "report.html"
    path.write_text(page)
    command = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
        *flags,
        path.as_uri(),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)


def test_chromium_builds_the_same_charts(report: Report, page: str, tmp_path: Path) -> None:
    run = _browse(tmp_path, page, "--dump-dom", "--enable-logging=stderr", "--v=0")
    assert "Uncaught" not in run.stderr  # the page's script ran without an error (console errors are logged to stderr)
    dom = _parse(run.stdout)  # the DOM after the script ran
    static = _parse(page)
    for tag, name in (("rect", "module"), ("rect", "root"), ("rect", "batch"), ("g", "peak"), ("polygon", "area")):
        seen = [(e.get("data-fqn"), e.get("data-bytes"), e.get("data-batch"), e["title"]) for e in _with_class(dom, tag, name)]
        assert seen == [(e.get("data-fqn"), e.get("data-bytes"), e.get("data-batch"), e["title"]) for e in _with_class(static, tag, name)]
        assert seen, f"no {tag}.{name} in the browser's DOM"
    (mark,) = _with_class(dom, "g", "peak")
    assert _number(rf"peak at B={BATCH}: (\d+) B", mark["title"]) == report.peak(BATCH).bytes


def test_chromium_draws_the_charts(page: str, tmp_path: Path) -> None:
    image = pytest.importorskip("matplotlib.image")
    shot = tmp_path / "report.png"
    _browse(tmp_path, page, f"--screenshot={shot}", "--window-size=1280,2000")
    pixels = image.imread(str(shot))[..., :3]
    assert pixels.shape[:2] == (2000, 1280)
    rgb = (pixels * 255).round().astype(int).reshape(-1, 3)
    assert len({tuple(p) for p in rgb[::7].tolist()}) > 50  # charts and text, not a blank page
    green = CATEGORY_COLORS[Category.ACTIVATION]
    activation = (abs(rgb - [int(green[i : i + 2], 16) for i in (1, 3, 5)]).max(axis=1) <= 2).sum()  # the timeline's area
    peak = (abs(rgb - [0xBB, 0x00, 0x00]).max(axis=1) <= 2).sum()  # the peak marker (#b00 in the page's style)
    assert activation > 2000 and peak > 20, (activation, peak)


def test_the_cli_writes_the_page_and_the_report_method_gives_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``fxmem analyze ... --html FILE`` writes the same page as ``Report.to_html()``; an unwritable path
    is a one-line error naming the option."""
    from fxmem import cli

    out = tmp_path / "report.html"
    assert cli.main(["analyze", "zoo:wide-mlp:test", "--batch", "4", "--target", "cpu", "--html", str(out)]) == 0
    assert f"Wrote {out}." in capsys.readouterr().out
    spec = fxmem.load_model("zoo:wide-mlp:test")
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, batch=4, name="zoo:wide-mlp:test", target="cpu")
    assert out.read_text(encoding="utf-8") == report.to_html() == to_html(report)
    with pytest.raises(InputSpecError, match="batch must be a positive integer"):
        report.to_html(0)
    assert cli.main(["analyze", "zoo:wide-mlp:test", "--target", "cpu", "--html", str(tmp_path / "missing" / "r.html")]) == 2
    assert "--html: cannot write the page" in capsys.readouterr().err
