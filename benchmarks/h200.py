"""The cuda target against what a real H200 measured: the README's table, in one run.

For each of the six models of tests/h200_models.py, fp32 and bf16 autocast: the saved bytes at B=3 and
the step's peak (first and steady step) as the H200 measured them (tests/test_h200.py's ``MEASURED``,
copied from shared/gpu/steps_h200.json) beside fxmem's prediction for the H200 on torch 2.11, the
release it ran, and the error. Prints a markdown table; no GPU is used.

    python benchmarks/h200.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fxmem.output.render import format_bytes
from tests.test_h200 import HOST, MEASURED, report


def _error(predicted: int, measured: int) -> str:
    diff = predicted - measured
    return "exact" if diff == 0 else f"{diff:+,} B" if abs(diff) < 100_000 else f"{diff / measured:+.2%}"


def main() -> int:
    start = time.perf_counter()
    head = "| model | amp | saved at B=3, measured | fxmem | error | B | steady peak, measured | fxmem | error | first-step peak, measured | fxmem | error |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for (name, amp), m in sorted(MEASURED.items()):
        r = report(name, amp)
        saved_measured = m.a * 3 + m.c - HOST.get((name, amp), 0)
        saved = r.activation_bytes(3)
        steady, first = r.peak(m.batch), r.peak(m.batch, first_step=True)
        print(
            f"| {name} | {amp} | {format_bytes(saved_measured)} | {format_bytes(saved)} | {_error(saved, saved_measured)} | {m.batch} "
            f"| {format_bytes(m.steady)} | {format_bytes(steady.bytes)} | {_error(steady.bytes, m.steady)} "
            f"| {format_bytes(m.first)} | {format_bytes(first.bytes)} | {_error(first.bytes, m.first)} |",
            flush=True,
        )
    print(f"\n({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
