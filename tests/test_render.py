"""The screen report (fxmem/output/render.py): a table that fits a screen, abbreviated op lists, the
dominating rows marked, and the same report as HTML and markdown for notebooks."""

from __future__ import annotations

import csv
import doctest
import io
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest
from torch import nn

import fxmem
import fxmem.output.render
from fxmem.errors import InputSpecError
from fxmem.output.render import MAX_ROWS, abbreviate_ops, dominating_rows, render
from fxmem.report import Report
from tests.helpers import analyze_on_meta

SIZE = re.compile(r"\d[\d.,]* (?:B|KiB|MiB|GiB|TiB)\b")
"""A size as format_bytes writes it."""


def _small() -> Report:
    """The golden table's CNN (tests/test_report.py), with a device budget so that every answer line shows."""
    return analyze_on_meta(
        lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 16 * 16, 10)),
        ["B,3,32,32"], "cross_entropy", optimizer="sgd-momentum", batch=64, device_memory=2**30,
    )  # fmt: skip


def _table_rows(text: str) -> list[list[str]]:
    """The layer table's rows from the text report, split on runs of 2+ spaces, Total row excluded."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Layer ")) + 2  # header, rule
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("Total activations") or not lines[i].strip())
    return [re.split(r"\s{2,}", line.strip()) for line in lines[start:end]]


def _paths(report: Report) -> list[str]:
    """Module paths of the nodes that save bytes, in graph order, each once (what 'all' shows)."""
    kept = [n for n in report.nodes if not n.saved.is_zero or any(n.exact.values())]
    return list(dict.fromkeys(n.fqn or "(top level)" for n in kept))


def test_docstring_examples() -> None:
    result = doctest.testmod(fxmem.output.render)
    assert result.attempted >= 2 and result.failed == 0


def test_default_depth_fits_a_screen_for_resnet50() -> None:
    spec = fxmem.load_model("zoo:resnet50")
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, peak=False, target="cpu")
    paths = _paths(report)
    assert len(paths) > MAX_ROWS  # every path would not fit: the choice is real
    rows = [row[0] for row in _table_rows(str(report))]
    assert 0 < len(rows) <= MAX_ROWS
    depth = max(len(r.split(".")) for r in rows if not r.startswith("("))
    # the deepest that fits: one component more would give more than MAX_ROWS rows
    deeper = {p if p.startswith("(") else ".".join(p.split(".")[: depth + 1]) for p in paths}
    assert len(deeper) > MAX_ROWS
    assert rows == list(dict.fromkeys(p if p.startswith("(") else ".".join(p.split(".")[:depth]) for p in paths))
    assert f"grouped to depth {depth} to fit {MAX_ROWS} rows; --depth all lists all {len(paths)}" in str(report)


def test_depth_all_lists_every_module_path() -> None:
    spec = fxmem.load_model("zoo:resnet50")
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, peak=False, target="cpu")
    rows = [row[0] for row in _table_rows(render(report, depth="all"))]
    assert rows == _paths(report)
    # in ResNet-50 each node that saves bytes is the only one of its module path: one row per node
    assert len(rows) == sum(1 for n in report.nodes if not n.saved.is_zero or any(n.exact.values()))
    assert [r.fqn for r in report.layers("all")] == [r.fqn for r in report.layers()] == rows


def test_a_bad_depth_names_the_argument() -> None:
    report = _small()
    for bad in (-1, "every", 1.5):
        with pytest.raises(InputSpecError, match=r"^depth="):
            render(report, depth=bad)  # type: ignore[arg-type]


def test_op_lists_are_abbreviated_on_names() -> None:
    ops = ["GroupNorm", "sigmoid", "mul", "Conv2d", "MultiheadAttention", "add", "gelu"]
    assert abbreviate_ops(ops, 30) == "GroupNorm+sigmoid+mul+4 more"  # 21 + len("+4 more") = 28 <= 30; one more name is 35
    assert abbreviate_ops(ops, 200) == "+".join(ops)
    assert abbreviate_ops(ops, 15) == "7 ops"  # "GroupNorm+6 more" is 16: no room for a first name
    for width in range(16, 60):
        text = abbreviate_ops(ops, width)
        assert len(text) <= width
        names, more = text.rsplit("+", 1) if text.endswith(" more") else (text, "0 more")
        kept = names.split("+")
        assert kept == ops[: len(kept)]  # whole names, in order, none cut
        assert int(more.split()[0]) == len(ops) - len(kept)
        # as many as fit: one more whole name would not
        if len(kept) < len(ops) - 1:
            assert len("+".join(ops[: len(kept) + 1]) + f"+{len(ops) - len(kept) - 1} more") > width
    assert abbreviate_ops(["MultiheadAttentionWithAVeryLongName"], 10) == "MultiheadAttentionWithAVeryLongName"  # never cut
    assert abbreviate_ops(["MultiheadAttention", "LayerNorm"], 10) == "2 ops"


def test_dominating_rows_are_the_fewest_holding_half() -> None:
    assert dominating_rows([10, 60, 30]) == (False, True, False)  # 60 of 100 is already half
    assert dominating_rows([30, 20, 25, 25]) == (True, False, True, False)  # 30 + 25 = 55 >= 50; ties: the earlier
    assert dominating_rows([0, 0]) == (False, False)
    assert dominating_rows([]) == ()


def test_marked_rows_hold_at_least_half_of_the_bytes() -> None:
    report = _small()
    rows = _table_rows(str(report))
    at = {r.fqn: sum(report.node_bytes(report.batch)[n] for n in r.nodes) for r in report.layers()}
    marked = sorted((at[row[0]] for row in rows if row[-1] == "*"), reverse=True)
    total = report.activation_bytes(report.batch)
    assert marked and 2 * sum(marked) >= total
    assert 2 * sum(marked[:-1]) < total  # the fewest: without the smallest marked row, less than half
    assert all(at[row[0]] <= marked[-1] for row in rows if row[-1] != "*")  # none left out is larger
    assert f"* marks the fewest layers that together hold at least half of activation memory at B=64: {len(marked)} layers" in str(report)


def test_the_answer_comes_before_the_layers() -> None:
    text = str(_small())
    table = text.index("\nLayer ")
    for line in ("Peak at B=64 (steady step)", "Floor at B=1", "State : activations"):
        assert text.index(line) < table
    assert text.index("Model state") > table
    # The verdict is the first line under the title, in words: the batch, fits, the bytes of the budget,
    # and the largest batch (Note [The answer first]).
    first = next(line for line in text.splitlines()[1:] if line and not line.startswith("target:"))
    assert first.startswith("Verdict at B=64") and "B=64 fits: " in first and "of 1 GiB" in first
    assert ("every batch up to" in first or "largest batch" in first) and " does not" in first


class _Tags(HTMLParser):
    """Every start and end tag, to check that the HTML has no script, no stylesheet and closes what it opens."""

    def __init__(self) -> None:
        super().__init__()
        self.opened: list[str] = []
        self.seen: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.seen.add(tag)
        if tag != "br":
            self.opened.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag != "br":
            assert self.opened.pop() == tag


def test_repr_html_is_well_formed_and_carries_the_same_numbers() -> None:
    report = analyze_on_meta(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU()), ["B,8"], name="<b>&mlp", device_memory=2**20)
    html = report._repr_html_()
    root = ET.fromstring(html)  # well-formed XML, so well-formed HTML; an unescaped "<b>&mlp" would not parse
    assert root.tag == "div" and root.find(".//table/thead/tr/th") is not None
    assert "<b>&mlp" in "".join(root.itertext()) and "&lt;b&gt;&amp;mlp" in html
    tags = _Tags()
    tags.feed(html)
    assert tags.opened == [] and not tags.seen & {"script", "style", "link", "iframe"}
    text = str(report)
    assert sorted(SIZE.findall(" ".join(" ".join(root.itertext()).split()))) == sorted(SIZE.findall(" ".join(text.split())))
    assert set(re.findall(r"\d+\.\d%", text)) == set(re.findall(r"\d+\.\d%", "".join(root.itertext())))


def test_repr_markdown_is_a_markdown_table() -> None:
    report = _small()
    md = report._repr_markdown_()
    lines = md.splitlines()
    head = next(i for i, line in enumerate(lines) if re.match(r"^\| Layer +\| Op +\|", line))
    assert re.match(r"^\|(-+\|)+$", lines[head + 1])
    body = [line for line in lines[head + 2 :] if line.startswith("|")]
    body = body[: next(i for i, line in enumerate(body) if "Total activations" in line) + 1]
    assert body[-1].split("|")[1].strip() == "Total activations"
    assert [line.split("|")[1].strip() for line in body[:-1]] == [r.fqn for r in report.layers()]
    assert "cross\\_entropy" in md  # markdown's emphasis characters are escaped
    assert sorted(SIZE.findall(" ".join(md.split()))) == sorted(SIZE.findall(" ".join(str(report).split())))


def _estimated_peak(upper: int) -> fxmem.results.Peak:
    """A peak of 22,440,000,000 B (22.44e9 / 2^30 = 20.899 GiB, printed 20.9 GiB) holding one estimated
    cuDNN workspace of 1 MiB, and the step's peak ``upper`` with every such workspace at its bound."""
    from fxmem.results import Category, EstimatedBytes, Peak, Phase

    x = EstimatedBytes("cuDNN convolution workspace", "conv3d_12", "decs.2.0", "aten.convolution_backward", 2**20, 2**20 + 3 * 1024)
    return Peak(8, 22_440_000_000, False, Phase.BACKWARD, "conv3d_12", "decs.2.0", "aten.convolution_backward",
                {Category.TEMPORARY: 22_440_000_000}, estimated=(x,), upper=upper)  # fmt: skip


def test_an_estimate_that_rounds_alike_says_by_how_much_it_differs() -> None:
    # Issue 35: 3 KiB more on 20.9 GiB printed "would be 20.9 GiB, not 20.9 GiB". The bound is 3,072 B
    # above the peak, which both print as 20.9 GiB, so the line gives the difference instead.
    (line,) = fxmem.output.render._estimate_lines(_estimated_peak(22_440_000_000 + 3 * 1024))
    assert line[2].endswith("with every such workspace at its bound the step's peak would be 3 KiB higher (3,072 B), still 20.9 GiB")
    # 1 GiB more prints apart: 23,513,741,824 B / 2^30 = 21.899, printed 21.9 GiB.
    (line,) = fxmem.output.render._estimate_lines(_estimated_peak(22_440_000_000 + 2**30))
    assert line[2].endswith("would be 21.9 GiB, not 20.9 GiB")
    (line,) = fxmem.output.render._estimate_lines(_estimated_peak(22_440_000_000))  # the workspace already at its bound
    assert line[2].endswith("would be the same 20.9 GiB")


def test_csv_holds_the_summary_then_the_layers() -> None:
    report = _small()
    rows = list(csv.reader(io.StringIO(render(report, "csv"))))
    blank = rows.index([])
    assert rows[0] == ["Summary", "Value"] and all(len(r) == 2 for r in rows[1:blank])
    summary = dict(rows[1:blank])
    assert list(summary) == list(fxmem.output.render.CSV_SUMMARY)
    assert summary["model"] == report.model and int(summary["batch"]) == report.batch == 64
    assert int(summary["peak"]) == report.peak().bytes
    assert int(summary["max_batch"]) == report.max_batch() and summary["fits"] == ("true" if report.fits() else "false")
    assert int(summary["held"]) == report.total_bytes(64) and int(summary["state"]) == report.state_per_gpu
    assert int(summary["floor"]) == report.step_bytes(report.least_batch) and summary["gpu_total"] == ""  # a cpu target
    header, *layers, total = rows[blank + 1 :]
    assert header[:3] == ["Layer", "Op", "Output shape"] and total[0] == "Total activations"
    assert sum(int(r[5]) for r in layers) == int(total[5]) == report.activation_bytes(64)


def test_csv_summary_leaves_what_does_not_apply_empty() -> None:
    report = analyze_on_meta(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU()), ["B,8"], peak=False)
    rows = list(csv.reader(io.StringIO(render(report, "csv"))))
    summary = dict(rows[1 : rows.index([])])
    assert summary["fits"] == summary["max_batch"] == summary["peak"] == summary["device_memory"] == ""
    assert int(summary["held"]) == report.total_bytes(32)
