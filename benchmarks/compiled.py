"""Eager against torch.compile, predicted and measured, per zoo model (test configs), on this CPU.

    python benchmarks/compiled.py [--models wide-mlp,gpt2-small] [--batch 4] [--large]

For each model: the saved bytes and the steady step's peak (AdamW), eager and compiled, predicted by
``fxmem.analyze(..., compile=True)`` and measured by real CPU runs (``fxmem.measure`` and
``fxmem.measure_peak``, with ``compile=True`` for the compiled ones: Inductor's C++ backend), and the
time each analysis took. ``--large`` adds the analysis time of gpt-7b (full size, on the meta device)
eager and compiled at B=1 on the default cuda target, side by side, as ``fxmem analyze`` commands and in
one process (the issue's target: the compiled analysis within 3x the eager one).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import warnings

import torch

import fxmem

MODELS = {"wide-mlp": 256, "gpt2-small": 4, "vit-b16": 4, "resnet50": 4, "unet3d": 2, "lstm-lm": 4}
"""Each zoo model's test config, at a batch where its activations matter."""


def _row(name: str, batch: int) -> list[str]:
    spec = fxmem.load_model(f"zoo:{name}:test")
    start = time.perf_counter()
    eager = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, batch=batch, target="cpu", peak=True)
    eager.peak(batch)
    eager_s = time.perf_counter() - start
    start = time.perf_counter()
    report = fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, batch=batch, target="cpu", compile=True)
    compiled_s = time.perf_counter() - start - eager_s  # analyze(compile=True) makes the eager report too
    real = fxmem.load_model(f"zoo:{name}:test", meta=False)
    torch.manual_seed(0)
    saved_eager = fxmem.measure(real.model, spec.inputs, batch, loss=spec.loss).total
    saved_compiled = fxmem.measure(real.model, spec.inputs, batch, loss=spec.loss, compile=True).total
    peak_eager = fxmem.measure_peak(real.model, spec.inputs, batch, loss=spec.loss).bytes
    peak_compiled = fxmem.measure_peak(real.model, spec.inputs, batch, loss=spec.loss, compile=True).bytes
    c = report.compiled
    pct = lambda p, m: f"{100 * (p - m) / m:+.2f}%"
    return [
        name, str(batch),
        f"{eager.activation_bytes(batch)} / {saved_eager}", f"{c.saved} / {saved_compiled}",
        f"{eager.peak(batch).bytes} / {peak_eager} ({pct(eager.peak(batch).bytes, peak_eager)})",
        f"{c.peak().bytes} / {peak_compiled} ({pct(c.peak().bytes, peak_compiled)})",
        f"{eager_s:.1f} s", f"{compiled_s:.1f} s",
    ]  # fmt: skip


def _large() -> None:
    """gpt-7b at B=1 on the default cuda target, eager and compiled, side by side: in this process
    (``fxmem.analyze``, imports paid already) and as a user runs it (``fxmem analyze``, a fresh process each)."""
    spec = fxmem.load_model("zoo:gpt-7b")
    fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, batch=1)  # the imports and first-use costs, out of both timings
    times = {}
    for compile_ in (False, True):
        start = time.perf_counter()
        fxmem.analyze(spec.model, spec.inputs, loss=spec.loss, batch=1, compile=compile_)
        times[compile_] = time.perf_counter() - start
    cli = {}
    for compile_ in (False, True):
        command = [sys.executable, "-m", "fxmem", "analyze", "zoo:gpt-7b", "--batch", "1", *(["--compile"] if compile_ else [])]
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        cli[compile_] = time.perf_counter() - start
    print(f"\ngpt-7b at B=1 (cuda target), eager vs --compile (the issue's target: within 3x):")
    print(f"  fxmem analyze, a fresh process each:  {cli[False]:.1f} s vs {cli[True]:.1f} s: {cli[True] / cli[False]:.1f}x")
    print(f"  fxmem.analyze in one process:        {times[False]:.1f} s vs {times[True]:.1f} s: {times[True] / times[False]:.1f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS), help="zoo models, comma-separated (default all of them)")
    parser.add_argument("--batch", type=int, help="one batch for every model (default each model's own)")
    parser.add_argument("--large", action="store_true", help="also time gpt-7b's analysis, eager and compiled")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    from tabulate import tabulate

    rows = [_row(name, args.batch or MODELS.get(name, 4)) for name in args.models.split(",")]
    headers = ["model", "B", "eager saved pred / meas", "compiled saved pred / meas", "eager peak pred / meas", "compiled peak pred / meas", "eager analysis", "compile analysis"]
    print(tabulate(rows, headers=headers, disable_numparse=True))
    if args.large:
        _large()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
