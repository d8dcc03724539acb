"""Fuzz fxmem outside pytest: check the property of tests/test_fuzz.py on N random models, keep going
past failures, then shrink one example of each distinct failure to a minimal model.

    python benchmarks/fuzz.py --examples 2000 [--seed 0] [--no-shrink]
    python benchmarks/fuzz.py --compile --examples 150 --no-shrink   # saved bytes under torch.compile

Prints the examples tried, the failures (mismatches between fxmem.analyze and fxmem.measure, and
crashes), the time taken, and for each distinct failure the smallest model hypothesis found that
fails the same way. Exits 1 when anything failed.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch
from fuzz_grammar import FEATURES, FuzzCase, GrammarError, Mismatch, check_case, check_compiled, check_peak, fuzz_cases, peak_checkable
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException

_QUIET = list(HealthCheck)
CASES = st.sampled_from(list(FEATURES)).flatmap(lambda feature: fuzz_cases(feature=feature))
"""Models from the whole grammar, each built around one feature (see FEATURES), so all layers turn up."""


@dataclass
class Failure:
    signature: str
    index: int
    case: str
    error: str


def signature(e: BaseException) -> str:
    """What makes two failures the same bug: the layers of the differing nodes, or the error's first line."""
    if isinstance(e, Mismatch):
        return f"mismatch at {', '.join(e.targets)}"
    first = (str(e).strip().splitlines() or [""])[0]
    first = re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'…'", first))[:160]
    return f"{'grammar' if isinstance(e, GrammarError) else 'crash'}: {type(e).__name__}: {first}"


VERBOSE = {"on": False}
"""With --verbose, each failure's model and message are printed as it is found."""
CHECK = {"check": check_case}
"""What each example is held to: its saved bytes (default), or with --peak its step's peak as well."""


def run_case(case: FuzzCase) -> BaseException | None:
    try:
        CHECK["check"](case)
    except (KeyboardInterrupt, HypothesisException):
        raise
    except Exception as e:  # noqa: BLE001 - every failure is recorded, none stops the run
        return e
    return None


def _bytes_and_peak(case: FuzzCase) -> None:
    """Saved bytes exact, and where fxmem claims it (``peak_checkable``), the step's peak within 1%."""
    check_case(case)
    if peak_checkable(case):
        with contextlib.suppress(GrammarError):  # no parameter reaches the loss: no step to hold the peak to
            check_peak(case)


def _compiled(case: FuzzCase) -> None:
    """Saved bytes under torch.compile exact against a real compiled run; other dtypes and devices skipped."""
    with contextlib.suppress(GrammarError):
        check_compiled(case)
        COMPILED["checked"] += 1


COMPILED = {"checked": 0}
"""How many examples the compiled check held (the rest were skipped or failed)."""


def explore(examples: int, seed_value: int) -> tuple[int, list[Failure]]:
    """Run ``examples`` models; return how many ran and every failure (no shrinking)."""
    failures: list[Failure] = []
    tried = 0

    @seed(seed_value)
    @settings(
        max_examples=examples, deadline=None, database=None, suppress_health_check=_QUIET, phases=[Phase.generate]
    )
    @given(case=CASES)
    def prop(case: FuzzCase) -> None:
        nonlocal tried
        tried += 1
        e = run_case(case)
        if e is not None:
            detail = "".join(traceback.format_exception_only(type(e), e)).strip()
            failures.append(Failure(signature(e), tried, repr(case), detail[:2000]))
            print(f"  [{tried}] {failures[-1].signature}", flush=True)
            if VERBOSE["on"]:
                print(f"{failures[-1].case}\n  {failures[-1].error}", flush=True)
        elif tried % 100 == 0:
            print(f"  {tried} examples, {len(failures)} failures", flush=True)

    prop()
    return tried, failures


def shrink(target: Failure, examples: int, seed_value: int) -> str | None:
    """Replay the run (same seed and example count, so the same models), fail only on ``target``'s
    signature, and let hypothesis shrink the first such model. None if the replay never fails."""
    smallest: list[str] = []

    @seed(seed_value)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=_QUIET,
        phases=[Phase.generate, Phase.shrink],
        report_multiple_bugs=False,
    )
    @given(case=CASES)
    def prop(case: FuzzCase) -> None:
        e = run_case(case)
        if e is not None and signature(e) == target.signature:
            smallest.append(f"{case!r}\n  {''.join(traceback.format_exception_only(type(e), e)).strip()[:1500]}")
            raise AssertionError(target.signature)

    try:
        prop()
    except AssertionError:
        return smallest[-1]
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=2000, help="random models to check (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed, for a reproducible run (default 0)")
    parser.add_argument("--no-shrink", action="store_true", help="report failures as found, without shrinking")
    parser.add_argument("--verbose", action="store_true", help="print each failure's model and message as it is found")
    parser.add_argument("--peak", action="store_true", help="also check the step's peak against measure_peak (float32 CPU models; within 1%%)")
    parser.add_argument("--compile", action="store_true", help="instead hold the saved bytes under torch.compile to a real compiled CPU run (float32 models; others are skipped)")
    args = parser.parse_args(argv)
    if args.peak:
        CHECK["check"] = _bytes_and_peak
    if args.compile:
        CHECK["check"] = _compiled
    VERBOSE["on"] = args.verbose
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")

    start = time.perf_counter()
    tried, failures = explore(args.examples, args.seed)
    elapsed = time.perf_counter() - start
    by_signature = Counter(f.signature for f in failures)
    print(f"\nexamples tried: {tried}")
    print(f"failures:       {len(failures)} ({len(by_signature)} distinct)")
    if args.compile:
        print(f"compiled:       {COMPILED['checked']} models held to a real compiled run, exact")
    print(f"time:           {elapsed:.1f} s ({elapsed / max(tried, 1) * 1000:.0f} ms per example)")
    for sig, count in by_signature.most_common():
        first = next(f for f in failures if f.signature == sig)
        print(f"\n=== {count}x {sig} (first at example {first.index})")
        minimal = None if args.no_shrink else shrink(first, args.examples, args.seed)
        if minimal is not None:
            print(f"minimal:\n{minimal}")
        else:
            print(f"as found:\n{first.case}\n  {first.error}")
    if failures and not args.no_shrink:
        print(f"\ntotal time with shrinking: {time.perf_counter() - start:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
