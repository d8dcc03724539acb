"""How fast and how lean is fxmem on LLM-sized graphs? Analyze gpt-7b and a 70B-class config.

The table times the activation analysis (``peak=False``); the command lines below it time what users
type: ``analyze`` without and with the simulated step, and ``timeline``.

Each case runs in a fresh subprocess, so its peak RSS is its own. The floor is what any fx + fake-tensor
tool must spend: ``torch.fx.symbolic_trace`` plus one fake-tensor forward of the same model (with
autograd on, no hooks); the ratio says what fxmem adds on top (its extra passes and bookkeeping).

    python benchmarks/scale.py            # both cases
    python benchmarks/scale.py gpt-7b     # one
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

CASES = {
    # name: (layers, dim, heads, vocab, context)
    "gpt-7b": (32, 4096, 32, 32000, 2048),
    "gpt-70b": (80, 8192, 64, 32000, 2048),
}
BATCH = 8


def _build(name: str):  # type: ignore[no-untyped-def]
    import torch

    from models_zoo.gpt2_small import GPT

    layers, dim, heads, vocab, ctx = CASES[name]
    with torch.device("meta"):
        return GPT(vocab, ctx, dim, layers, heads, dropout=0.0, tied=False), [f"B,{ctx}:int64"]


def _child(name: str, what: str) -> None:
    """Run one measurement in this process and print a JSON line."""
    import resource

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fxmem
    from fxmem.inputs import parse_inputs

    model, inputs = _build(name)
    start = time.perf_counter()
    if what == "fxmem":
        report = fxmem.analyze(model, inputs, loss="lm_cross_entropy", batch=BATCH, peak=False, target="cpu")
        extra = {"params": report.state.parameters, "total_at_batch": report.total_bytes(BATCH)}
    else:
        gm = torch.fx.symbolic_trace(model)
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            params = {k: torch.nn.Parameter(torch.empty(v.shape, dtype=v.dtype)) for k, v in gm.named_parameters()}
            x = torch.zeros(parse_inputs(inputs)[0].shape_at(BATCH), dtype=torch.int64)
            torch.func.functional_call(gm, params, (x,)).sum()
        extra = {"mode": str(type(mode).__name__)}
    wall = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"wall_s": wall, "peak_rss": rss, **extra}))


def _run(name: str, what: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--child", name, what], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _cli(*args: str) -> tuple[float, int]:
    """Wall time and peak RSS of the whole command a user types, imports included (GNU time's report)."""
    start = time.perf_counter()
    out = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, "-m", "fxmem", *args], capture_output=True, text=True)
    lines = out.stderr.strip().splitlines()
    if out.returncode != 0:
        said = next((line for line in reversed(lines) if line.startswith("fxmem: error")), lines[-2] if len(lines) > 1 else "")
        raise SystemExit(f"`fxmem {' '.join(args)}` failed (exit {out.returncode}): {said}")
    return time.perf_counter() - start, int(lines[-1]) * 1024


def _has_transformers() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        _child(argv[1], argv[2])
        return 0
    names = argv or list(CASES)
    print(f"{'model':<10}{'params':>10}{'fxmem s':>10}{'floor s':>10}{'ratio':>8}{'peak RSS':>12}{'floor RSS':>12}")
    for name in names:
        ours, floor = _run(name, "fxmem"), _run(name, "floor")
        print(
            f"{name:<10}{ours['params'] / 1e9:>9.2f}B{ours['wall_s']:>10.2f}{floor['wall_s']:>10.2f}"
            f"{ours['wall_s'] / floor['wall_s']:>8.2f}{ours['peak_rss'] / 2**30:>10.2f}GB{floor['peak_rss'] / 2**30:>10.2f}GB"
        )
    print(f"(analysis at B={BATCH}, lm_cross_entropy loss; wall time excludes the ~3 s of `import torch`)")
    if "gpt-7b" in names:
        for command, targets in (
            (["analyze", "--no-peak"], "10 s, 1 GB: saved activations and state"),
            (["analyze"], "the default: also the whole step's peak, at B and at B=1"),
            (["timeline"], "20 s, 1.5 GB: the step's timeline"),
        ):
            wall, rss = _cli(command[0], "zoo:gpt-7b", "--batch", str(BATCH), *command[1:])
            line = f"fxmem {command[0]} zoo:gpt-7b --batch {BATCH} {' '.join(command[1:])}".rstrip()
            print(f"{line}: {wall:.2f} s wall, {rss / 2**30:.2f} GB peak RSS (target {targets})")
    if _has_transformers():
        llama = str(Path(__file__).parent / "configs" / "llama-3.1-8b.json")
        for extra, targets in (
            (["--no-peak"], "30 s, 1.5 GB: saved activations and state"),
            ([], "the default: also the whole step's peak, at B=1 and, for the trade-off table, B=2"),
        ):
            wall, rss = _cli("analyze", f"hf:{llama}", "--seq-len", "4096", "--batch", "1", *extra)
            line = f"fxmem analyze hf:<Llama-3.1-8B config> --seq-len 4096 --batch 1 {' '.join(extra)}".rstrip()
            print(f"{line}: {wall:.2f} s wall, {rss / 2**30:.2f} GB peak RSS (target {targets})")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    raise SystemExit(main(sys.argv[1:]))
