"""How fast does the command line answer when it has nothing to compute? (issue 36, item 2)

``fxmem --help``, ``fxmem --version`` and ``fxmem analyze --help`` need only the parser, which is built
from torch-free names (Note [A parser without torch] in fxmem/cli.py), so each should take well under a
second: the target is 1 s, and under a third of ``python -c "import torch"`` on the same machine, the
floor any command that does compute must pay. Each case runs as its own subprocess, as a user's shell
runs it, ``--repeat`` times (default 5), and the table gives the median wall time beside the
``import torch`` one of the same run.

    python benchmarks/cli_speed.py
    python benchmarks/cli_speed.py --repeat 11
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

CASES = {
    "python -m fxmem --help": [sys.executable, "-m", "fxmem", "--help"],
    "fxmem --version": ["fxmem", "--version"],
    "fxmem analyze --help": ["fxmem", "analyze", "--help"],
    "python -m fxmem analyze --bach 8 (usage error)": [sys.executable, "-m", "fxmem", "analyze", "zoo:resnet50", "--bach", "8"],
}
FLOOR = ("python -c 'import torch'", [sys.executable, "-c", "import torch"])
TARGET_S = 1.0


def _script(argv: list[str]) -> list[str]:
    """The ``fxmem`` console script beside this Python (a venv's bin/), else the one on PATH."""
    if argv[0] != "fxmem":
        return argv
    local = os.path.join(os.path.dirname(sys.executable), "fxmem")
    found = local if os.path.exists(local) else shutil.which("fxmem")
    if found is None:
        sys.exit("the fxmem script is not installed: pip install -e . first")
    return [found, *argv[1:]]


def wall_s(argv: list[str], repeat: int) -> float:
    """The median wall time of ``argv`` as a fresh process (its output discarded)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of each case; the median is shown (default 5)")
    args = parser.parse_args()
    wall_s(FLOOR[1], 1)  # warm the file cache: the first torch import reads ~1 GB of libraries
    floor = wall_s(FLOOR[1], args.repeat)
    rows = [(name, wall_s(_script(argv), args.repeat)) for name, argv in CASES.items()]
    width = max(len(name) for name, _ in [*rows, FLOOR])
    print(f"{'command':<{width}}  {'median':>8}  {'/ import torch':>14}  target {TARGET_S:.0f} s")
    print(f"{FLOOR[0]:<{width}}  {floor:>7.3f}s  {1.0:>14.2f}")
    for name, t in rows:
        print(f"{name:<{width}}  {t:>7.3f}s  {t / floor:>14.2f}  {'ok' if t < TARGET_S else 'SLOW'}")


if __name__ == "__main__":
    main()
