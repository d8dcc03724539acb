"""How long does ``fxmem plan`` take on the questions people ask, and what does each configuration cost?

Issue 37's targets, each run in this one process, one after another, on this machine's CPU:

- Llama-3.1-8B (benchmarks/configs, 4096 tokens) on 8 x H100 with the default levers: under 60 s;
- a 7B model (the zoo's gpt-7b) on one H100: under 10 s;
- the 70B-class GPT (80 layers, d=8192; built as benchmarks/scale.py builds it) on 64 x H100: under 2 minutes.

For each: the wall time, its ratio to the target, the best configuration (or what would fit), and
the search's own account of every configuration it considered (``Plan.evaluated``: simulated, with its
seconds, or ruled out unsimulated and why; Note [What each configuration costs] in
fxmem/planner/search.py).

    python benchmarks/plan_speed.py            # all three, about 3 minutes on 2 cores
    python benchmarks/plan_speed.py --only 0   # one case (an index into CASES)

benchmarks/plan.py runs the same cases after its tables (``time_case``), with the checkpointing comparison.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

if TYPE_CHECKING:
    from fxmem.planner.search import Plan


def _llama() -> tuple[object, list[str], str]:
    from fxmem.frontends.load import load_model

    spec = load_model(f"hf:{Path(__file__).parent / 'configs' / 'llama-3.1-8b.json'}", seq_len=4096)
    return spec.model, spec.inputs, spec.loss


def _gpt(name: str) -> Callable[[], tuple[object, list[str], str]]:
    def build() -> tuple[object, list[str], str]:
        from scale import _build

        model, inputs = _build(name)
        return model, inputs, "lm_cross_entropy"

    return build


CASES = (
    ("Llama-3.1-8B, 4096 tokens, 8 x H100", _llama, 8, 60.0),
    ("gpt-7b, 1 x H100", _gpt("gpt-7b"), 1, 10.0),
    ("70B-class GPT, 64 x H100", _gpt("gpt-70b"), 64, 120.0),
)


@dataclass(frozen=True)
class Timing:
    """One case of CASES: how long ``plan`` took against its target, and what it found."""

    label: str
    wall: float
    target: float
    found: Plan

    @property
    def ratio(self) -> float:
        return self.wall / self.target

    @property
    def met(self) -> bool:
        return self.wall <= self.target


def time_case(index: int) -> Timing:
    """Build case ``index`` of CASES and time ``fxmem.planner.search.plan`` on it (the build is not timed)."""
    from fxmem.planner.search import plan

    label, build, gpus, target = CASES[index]
    model, inputs, loss = build()
    start = time.perf_counter()
    found = plan(model, inputs, loss=loss, gpu="h100-80gb", gpus=gpus, name=label)  # type: ignore[arg-type]
    return Timing(label, time.perf_counter() - start, target, found)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=int, help="run one case, an index into CASES")
    args = parser.parse_args(argv)
    for index in range(len(CASES)) if args.only is None else [args.only]:
        t = time_case(index)
        print(f"## {t.label}: {t.wall:.1f} s wall, {t.ratio:.2f} x the {t.target:.0f} s target ({'met' if t.met else 'missed'})")
        print(t.found.verdict())
        for e in t.found.evaluated:
            print(f"  {e.seconds:6.1f} s  {e.outcome:<14.14}  {e.config}")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
