"""How fast and how lean is fxmem on LLM-sized graphs? Analyze gpt-7b and a 70B-class config.

The table times the activation analysis (``peak=False``); the command lines below it time what users
type: ``analyze`` without and with the simulated step, and ``timeline``.

Each case runs in a fresh subprocess, so its peak RSS is its own. The floor is what any fx + fake-tensor
tool must spend: ``torch.fx.symbolic_trace`` plus one fake-tensor forward of the same model (with
autograd on, no hooks); the ratio says what fxmem adds on top (its extra passes and bookkeeping).

When gpt-7b is benchmarked, a last block sets fxmem's *default* analyze (what ``fxmem analyze
zoo:gpt-7b --batch 8`` runs after loading the model: peak, GPU replay, FLOPs, trade-off table, the
report rendered) beside PyTorch's ``MemTracker`` following one fake-tensor training step of the same
model at B=8 (forward, cross-entropy, backward, AdamW step). The headline is the ratio MemTracker time /
fxmem time: MemTracker answers one batch size per step, fxmem every batch size at once, so the target is
fxmem at least 5x faster. Below it, fxmem's time split by stage: a stage starts when ``analyze()``'s
progress callback names it and runs until the next one, so work the renderer does after a lazy pass it
triggered (the B=1 step, say) is billed to that pass. Model construction is timed by neither side.

    python benchmarks/scale.py                            # both cases, then the block for gpt-7b
    python benchmarks/scale.py gpt-7b                     # one
    python benchmarks/scale.py --default-vs-memtracker    # only the default-analyze vs MemTracker block
    python benchmarks/scale.py --by-depth                 # only the default analyze at 8, 32 and 80 layers
    python benchmarks/scale.py --in-process               # only the default analyze of the 70B-class GPT and Llama-3.1-8B, by stage
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CASES = {
    # name: (layers, dim, heads, vocab, context)
    "gpt-7b": (32, 4096, 32, 32000, 2048),
    "gpt-70b": (80, 8192, 64, 32000, 2048),
}
BATCH = 8
VERSUS = "--default-vs-memtracker"
BY_DEPTH = "--by-depth"
IN_PROCESS = "--in-process"
LLAMA = "llama-3.1-8b"
"""The Llama-3.1-8B config (benchmarks/configs), analyzed at 4096 tokens and B=1 as its CLI line is."""
LLAMA_TOKENS = 4096
IN_PROCESS_TARGET_S = 4.0
"""Issue 19's in-process target for the 70B-class GPT's and Llama-3.1-8B's default analyze."""
DEPTHS = (8, 32, 80)
"""Layer counts of the depth rows: gpt-7b's width (4096, 32 heads) at each."""
RENDERING = "rendering the report"
BEFORE_FIRST = "checking arguments (before the first stage)"


def _build(name: str):  # type: ignore[no-untyped-def]
    import torch

    from models_zoo.gpt2_small import GPT

    if name == LLAMA:  # built by the hf: loader on the meta device, as the CLI builds it (--seq-len sets the inputs' length)
        from fxmem.frontends.load import load_model

        spec = load_model(f"hf:{Path(__file__).parent / 'configs' / 'llama-3.1-8b.json'}", seq_len=LLAMA_TOKENS)
        return spec.model, spec.inputs

    if name.startswith("depth-"):  # gpt-7b's width at another depth
        layers, (_, dim, heads, vocab, ctx) = int(name.removeprefix("depth-")), CASES["gpt-7b"]
    else:
        layers, dim, heads, vocab, ctx = CASES[name]
    with torch.device("meta"):
        return GPT(vocab, ctx, dim, layers, heads, dropout=0.0, tied=False), [f"B,{ctx}:int64"]


def _child(name: str, what: str) -> None:
    """Run one measurement in this process and print a JSON line, so its peak RSS is its own."""
    import resource

    model, inputs = _build(name)
    measure = {"fxmem": _activations, "floor": _floor, "default": _default_analyze, "memtracker": _memtracker_step}[what]
    result = measure(model, inputs, name)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({**result, "peak_rss": rss}))


def _activations(model: Any, inputs: list[str], name: str) -> dict[str, Any]:
    """The table's fxmem column: the activation analysis alone (no simulated step), CPU target."""
    import fxmem

    start = time.perf_counter()
    report = fxmem.analyze(model, inputs, loss="lm_cross_entropy", batch=BATCH, peak=False, target="cpu")
    wall = time.perf_counter() - start
    return {"wall_s": wall, "params": report.state.parameters, "total_at_batch": report.total_bytes(BATCH)}


def _floor(model: Any, inputs: list[str], name: str) -> dict[str, Any]:
    """What any fx + fake-tensor tool must spend: symbolic_trace plus one fake forward with autograd on."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxmem.inputs import parse_inputs

    start = time.perf_counter()
    gm = torch.fx.symbolic_trace(model)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        params: dict[str, torch.Tensor] = {k: torch.nn.Parameter(torch.empty(v.shape, dtype=v.dtype)) for k, v in gm.named_parameters()}
        x = torch.zeros(parse_inputs(inputs)[0].shape_at(BATCH), dtype=torch.int64)
        torch.func.functional_call(gm, params, (x,)).sum()
    return {"wall_s": time.perf_counter() - start, "mode": str(type(mode).__name__)}


def _default_analyze(model: Any, inputs: list[str], name: str) -> dict[str, Any]:
    """What ``fxmem analyze zoo:<name> --batch 8`` runs once the model is loaded, rendering included.

    Every keyword the CLI passes by default is analyze()'s own default (cuda target, peak on, adamw, no
    overheads...), so only the loss, batch, name and progress are spelled out. The render is timed
    because it is where lazy passes run (the B=1 step, the trade-off table) that the user waits for.
    """
    import fxmem
    from fxmem.output.render import render

    marks: list[tuple[str, float]] = [(BEFORE_FIRST, time.perf_counter())]
    say = lambda message: marks.append((message, time.perf_counter()))
    if name == LLAMA:  # as `fxmem analyze hf:<config> --seq-len 4096 --batch 1` runs it: the inputs are B,4096 already
        setting = {"loss": "auto", "batch": 1, "name": f"hf:{name}"}
    else:
        setting = {"loss": "lm_cross_entropy", "batch": BATCH, "name": f"zoo:{name}"}
    report = fxmem.analyze(model, inputs, peak=True, target="cuda", progress=say, **setting)
    say(RENDERING)
    text = render(report, "table")
    end = time.perf_counter()
    path = {"saved tensors": report.accounting.path, "step": report.steps.path}
    return {"wall_s": end - marks[0][1], "stages": _stages(marks, end), "report_chars": len(text), "path": path}


def _stages(marks: list[tuple[str, float]], end: float) -> list[tuple[str, float]]:
    """Each progress message with the seconds until the next one (or ``end``): the per-stage split."""
    times = [t for _, t in marks[1:]] + [end]
    return [(message, stop - start) for (message, start), stop in zip(marks, times)]


def _memtracker_step(model: Any, inputs: list[str], name: str) -> dict[str, Any]:
    """MemTracker following one fake-tensor training step, the way benchmarks/peers.py drives it.

    The weights are made fake from the meta model's shapes (to_empty under FakeTensorMode), so no byte
    of the 6.7B model is allocated and construction stays out of the timing, as on fxmem's side.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxmem.inputs import parse_inputs

    shape = parse_inputs(inputs)[0].shape_at(BATCH)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = model.to_empty(device="cpu").train()
        optimizer = torch.optim.AdamW(fake.parameters())
        tokens, targets = torch.zeros(shape, dtype=torch.int64), torch.zeros(shape, dtype=torch.int64)
        start = time.perf_counter()
        result = _tracked_step(fake, optimizer, tokens, targets)
        wall = time.perf_counter() - start
    return {"wall_s": wall, **result}


def _tracked_step(model: Any, optimizer: Any, tokens: Any, targets: Any) -> dict[str, Any]:
    """Forward, cross-entropy, backward and AdamW step under MemTracker; the phases that ran and its peak.

    A phase that fails stops the step there: the result then says which phases ran and why the rest did
    not, and the peak is that of the partial step, so a short step is never passed off as a whole one.
    """
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    done: list[str] = []
    error = ""
    with tracker:
        try:
            logits = model(tokens)
            done.append("forward")
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            done.append("loss")
            del logits
            loss.backward()
            done.append("backward")
            optimizer.step()
            done.append("optimizer step")
        except Exception as e:  # noqa: BLE001 - a phase MemTracker cannot run is a result to print, not a crash
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    peak = tracker.get_tracker_snapshot("peak")
    return {
        "phases": done,
        "error": error,
        "optimizer_state_tensors": sum(len(s) for s in optimizer.state.values()),
        "peak_bytes": sum(int(per_device["Total"]) for per_device in peak.values()),
    }


def _run(name: str, what: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", name, what], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


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


def _table(names: list[str]) -> None:
    """The activation analysis against the fx + fake-tensor floor, one row per case."""
    print(f"{'model':<10}{'params':>10}{'fxmem s':>10}{'floor s':>10}{'ratio':>8}{'peak RSS':>12}{'floor RSS':>12}")
    for name in names:
        ours, floor = _run(name, "fxmem"), _run(name, "floor")
        print(
            f"{name:<10}{ours['params'] / 1e9:>9.2f}B{ours['wall_s']:>10.2f}{floor['wall_s']:>10.2f}"
            f"{ours['wall_s'] / floor['wall_s']:>8.2f}{ours['peak_rss'] / 2**30:>10.2f}GB{floor['peak_rss'] / 2**30:>10.2f}GB"
        )
    print(f"(analysis at B={BATCH}, lm_cross_entropy loss; wall time excludes the ~3 s of `import torch`)")


def _gpt_7b_commands() -> None:
    """The commands a user types on gpt-7b, timed whole."""
    for command, targets in (
        (["analyze", "--no-peak"], "10 s, 1 GB: saved activations and state"),
        (["analyze"], "the default: also the whole step's peak, at B and at B=1"),
        (["timeline"], "20 s, 1.5 GB: the step's timeline"),
    ):
        wall, rss = _cli(command[0], "zoo:gpt-7b", "--batch", str(BATCH), *command[1:])
        line = f"fxmem {command[0]} zoo:gpt-7b --batch {BATCH} {' '.join(command[1:])}".rstrip()
        print(f"{line}: {wall:.2f} s wall, {rss / 2**30:.2f} GB peak RSS (target {targets})")


def _llama_commands() -> None:
    """analyze on the Llama-3.1-8B config through transformers, without and with the simulated step."""
    llama = str(Path(__file__).parent / "configs" / "llama-3.1-8b.json")
    for extra, targets in (
        (["--no-peak"], "30 s, 1.5 GB: saved activations and state"),
        ([], "the default: also the whole step's peak, at B=1 and, for the trade-off table, B=2"),
    ):
        wall, rss = _cli("analyze", f"hf:{llama}", "--seq-len", "4096", "--batch", "1", *extra)
        line = f"fxmem analyze hf:<Llama-3.1-8B config> --seq-len 4096 --batch 1 {' '.join(extra)}".rstrip()
        print(f"{line}: {wall:.2f} s wall, {rss / 2**30:.2f} GB peak RSS (target {targets})")


def _default_vs_memtracker() -> None:
    """fxmem's default analyze of gpt-7b beside MemTracker's fake step, the ratio, and fxmem's split."""
    ours, theirs = _run("gpt-7b", "default"), _run("gpt-7b", "memtracker")
    print(
        f"default analyze, gpt-7b B={BATCH} (peak, GPU replay, FLOPs, trade-off): "
        f"{ours['wall_s']:.2f} s in process, {ours['peak_rss'] / 2**30:.2f} GB RSS"
    )
    print(
        f"MemTracker fake step, same model, B={BATCH} (one batch size):            "
        f"{theirs['wall_s']:.2f} s, {theirs['peak_rss'] / 2**30:.2f} GB RSS, peak {theirs['peak_bytes'] / 2**30:.2f} GiB"
    )
    _memtracker_caveat(theirs)
    for what, path in ours["path"].items():
        print(f"  fxmem's {what}: {path}")
    print(f"ratio MemTracker / fxmem: {theirs['wall_s'] / ours['wall_s']:.2f}x (target: >= 5x, answering every batch size)")
    print()
    print(_split_table(ours["stages"], ours["wall_s"]))


def _by_depth() -> None:
    """fxmem's default analyze at gpt-7b's width and DEPTHS layers: repeated blocks make it nearly flat."""
    from tabulate import tabulate

    rows = []
    for layers in DEPTHS:
        ours = _run(f"depth-{layers}", "default")
        rows.append([layers, f"{ours['wall_s']:.2f}", f"{ours['peak_rss'] / 2**30:.2f}", ours["path"]["step"].split(" (")[0]])
    print(tabulate(rows, headers=["layers", "default analyze s", "GB RSS", "step simulated from"], disable_numparse=True))


def _in_process() -> None:
    """fxmem's default analyze of the 70B-class GPT (B=8) and of Llama-3.1-8B (4096 tokens, B=1) in
    process, each against IN_PROCESS_TARGET_S, with its time by stage."""
    names = ["gpt-70b"] + ([LLAMA] if _has_transformers() else [])
    for name in names:
        ours = _run(name, "default")
        print(
            f"default analyze, {name} in process: {ours['wall_s']:.2f} s (target {IN_PROCESS_TARGET_S:.0f} s), "
            f"{ours['peak_rss'] / 2**30:.2f} GB RSS; step from {ours['path']['step'].split(' (')[0]}"
        )
        print(_split_table(ours["stages"], ours["wall_s"]))
        print()


def _memtracker_caveat(theirs: dict[str, Any]) -> None:
    """Say plainly when MemTracker did not run the whole step, so its time is not read as a full step's."""
    missing = [p for p in ("forward", "loss", "backward", "optimizer step") if p not in theirs["phases"]]
    if missing:
        print(f"  MemTracker ran only {', '.join(theirs['phases']) or 'nothing'}; {', '.join(missing)} failed: {theirs['error']}")
    elif theirs["optimizer_state_tensors"] == 0:
        print("  MemTracker ran every phase, but AdamW made no state: its step did not run as in training")


def _split_table(stages: list[list[Any]], wall: float) -> str:
    """Where fxmem's time goes: stage, seconds, share of the whole."""
    from tabulate import tabulate

    rows = [[message, f"{seconds:.2f}", f"{100 * seconds / wall:.1f}"] for message, seconds in stages]
    rows.append(["total", f"{wall:.2f}", "100.0"])
    return tabulate(rows, headers=["fxmem stage", "seconds", "share %"], colalign=("left", "right", "right"), disable_numparse=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        _child(argv[1], argv[2])
        return 0
    if argv == [VERSUS]:
        _default_vs_memtracker()
        return 0
    if argv == [BY_DEPTH]:
        _by_depth()
        return 0
    if argv == [IN_PROCESS]:
        _in_process()
        return 0
    names = argv or list(CASES)
    _table(names)
    if "gpt-7b" in names:
        _gpt_7b_commands()
    if _has_transformers():
        _llama_commands()
    if "gpt-7b" in names:
        print()
        _default_vs_memtracker()
        print()
        _by_depth()
        print()
        _in_process()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    raise SystemExit(main(sys.argv[1:]))
