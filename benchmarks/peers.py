"""fxmem against its peers: who predicts the bytes a training step saves for backward, and how well?

For each zoo model and batch size this runs, in one process:

- the truth: ``fxmem.measure(...).total``, a real CPU forward + loss that records every tensor autograd
  saves (each storage once; parameters, buffers, inputs and targets left out);
- fxmem: ``analyze(..., target="cpu").activation_bytes(B)`` from a trace on fake tensors;
- torchinfo: ``summary(..., mode="train")``'s "Forward/backward pass size" (a real forward with hooks);
- PyTorch's MemTracker: its Activation category after one fake forward + loss (then backward).

and prints one markdown table, with each tool's error ``(predicted - measured) / measured`` and wall time.

    pip install -e .[peers]                          # torchinfo; MemTracker ships with torch
    python benchmarks/peers.py                       # table on stdout
    python benchmarks/peers.py --write docs/peers.md # and into that file, with how it was produced

Times are for the estimate alone: building the model (meta for fxmem, real for torchinfo and the truth,
fake for MemTracker) is left out of every column. fxmem's analysis does not depend on B; it is rerun on
every row anyway so each row's time is what that question costs on its own.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import fxmem
from fxmem.engine.losses import get_loss
from fxmem.inputs import InputSpec, make_tensor

T = TypeVar("T")
MIB = 2**20


@dataclass(frozen=True)
class Case:
    """One zoo model (``NAME`` or ``NAME:test``), its input (None: the zoo default) and the batch sizes."""

    model: str
    inputs: tuple[str, ...] | None
    batches: tuple[int, ...]


# Large enough to be meaningful, small enough that the real CPU measurement (two forwards) and
# torchinfo's real forward stay quick on 2 cores. gpt-7b is left out: its truth cannot be measured here.
CASES: tuple[Case, ...] = (
    Case("resnet50", None, (1, 4)),
    Case("vit-b16", None, (1, 4)),
    Case("gpt2-small", ("B,256:int64",), (1, 4)),  # full model, 256 of its 1024 positions
    Case("wide-mlp", None, (1, 64)),
    Case("unet3d", ("B,1,64,64,64",), (1, 2)),  # full widths, 64^3 instead of 128^3
    Case("lstm-lm", ("B,64:int64",), (1, 4)),  # full model, 64 of its 256 tokens
)


@dataclass(frozen=True)
class Estimate:
    """One tool's answer for one row: bytes (None when it could not run, with the reason) and wall seconds."""

    nbytes: int | None
    seconds: float
    why: str = ""


@dataclass(frozen=True)
class Row:
    """Everything printed for one (model, batch): the truth, the three estimates, and reference totals."""

    model: str
    config: str
    batch: int
    measured: int
    measure_s: float
    fxmem: Estimate
    torchinfo: Estimate
    memtracker: Estimate
    fxmem_weights: int
    fxmem_total: int
    torchinfo_params: int | None
    torchinfo_total: int | None


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()`` and its wall time in seconds."""
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def require_torchinfo() -> ModuleType:
    """Import torchinfo or stop with the install command: it is an optional extra, not an fxmem dependency."""
    try:
        import torchinfo
    except ImportError:
        raise SystemExit(
            "benchmarks/peers.py compares against torchinfo, which is not installed; "
            "run `pip install -e .[peers]` (or `pip install torchinfo`) and try again."
        ) from None
    return torchinfo


def failure(e: BaseException) -> str:
    """A one-line reason for the table: exception type and the first line of its message, kept short."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:90]}".replace("|", "/")


def run_fxmem(meta_model: nn.Module, inputs: Sequence[str], loss: str, batch: int) -> tuple[Estimate, fxmem.Report]:
    """fxmem's predicted saved activations at ``batch`` (the report is kept for the reference totals)."""
    report, seconds = timed(lambda: fxmem.analyze(meta_model, inputs, loss=loss, optimizer="adamw", target="cpu"))
    return Estimate(report.activation_bytes(batch), seconds), report


def run_torchinfo(
    torchinfo: ModuleType, real_model: nn.Module, specs: Sequence[InputSpec], batch: int
) -> tuple[Estimate, object | None]:
    """torchinfo's "Forward/backward pass size": ``ModelStatistics.total_output_bytes``.

    torchinfo 1.8 computes it as twice ("x2 for gradients") the output bytes of every leaf module that
    has parameters, from one real forward under ``no_grad``; it is the number it offers for activations.
    """
    try:
        stats, seconds = timed(
            lambda: torchinfo.summary(
                real_model,
                input_size=[s.shape_at(batch) for s in specs],
                dtypes=[s.dtype for s in specs],
                mode="train",
                device="cpu",
                verbose=0,
            )
        )
    except Exception as e:  # noqa: BLE001 - a peer failing is a result to report, not a crash
        return Estimate(None, 0.0, failure(e)), None
    return Estimate(int(stats.total_output_bytes), seconds), stats


def run_memtracker(meta_model: nn.Module, inputs: Sequence[str], loss_name: str, batch: int) -> Estimate:
    """MemTracker's Activation bytes after forward + loss, on a fake-tensor copy of the model (CPU device).

    MemTracker has no notion of "saved for backward": it files every live storage created in forward as
    ACT and frees it when the storage dies. Right after the loss, with the model's output no longer
    referenced, the forward tensors still alive are exactly those autograd keeps (plus the 4-byte loss),
    so ``current[ACT]`` at that moment is its closest analogue to saved activations. It is also the
    highest ACT gets: backward only frees activations. The "peak" snapshot is not used because it is taken
    at the peak of the *total*, inside backward, where part of ACT is already gone and gradients and
    temporaries are counted instead. Backward is still run so the step is the one the brief describes.
    """
    start = time.perf_counter()
    try:
        from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

        model = copy.deepcopy(meta_model)
        # Fake weights from the meta model's shapes: calling the factory under FakeTensorMode would run its
        # initializers, and some (ViT's trunc_normal_) read values, which fake tensors cannot give.
        with FakeTensorMode(allow_non_fake_inputs=True):  # only to_empty sees the meta tensors
            model = model.to_empty(device="cpu").train()
            specs, loss = fxmem.parse_inputs(list(inputs)), get_loss(loss_name)
            tensors = [make_tensor(s, batch) for s in specs]  # made outside the tracker: not counted
            start = time.perf_counter()  # building the fake model is not MemTracker's cost
            tracker = MemTracker()
            tracker.track_external(model)
            with tracker:
                out = model(*tensors)
                target = loss.make_target(out)
                if target is not None:  # data from the loader in a real loop, as the truth treats it: file as Other
                    tracker.track_external(target)
                value = loss.compute(out, target)
                del out  # only the loss is referenced now; what else is alive, autograd holds
                snapshot = tracker.get_tracker_snapshot("current")
                value.backward()  # type: ignore[no-untyped-call]
        act = sum(dev[_MemRefType.ACT] for dev in snapshot.values())
    except Exception as e:  # noqa: BLE001 - e.g. torch.distributed missing: report why, keep going
        return Estimate(None, time.perf_counter() - start, failure(e))
    return Estimate(act, time.perf_counter() - start)


def run_case(case: Case, torchinfo: ModuleType) -> list[Row]:
    """All batch sizes of one model; the real model is built once and shared by the truth and torchinfo."""
    meta = fxmem.load_model(f"zoo:{case.model}")
    torch.manual_seed(0)
    real = fxmem.load_model(f"zoo:{case.model}", meta=False).model
    rows = []
    for batch in case.batches:
        rows.append(run_row(case.model, meta, real, list(case.inputs or meta.inputs), batch, torchinfo))
        print(f"  {case.model} B={batch}: done", file=sys.stderr, flush=True)
    return rows


def run_row(
    label: str, meta: fxmem.ModelSpec, real: nn.Module, inputs: list[str], batch: int, torchinfo: ModuleType
) -> Row:
    """The truth and the three estimates for one model at one batch size."""
    truth, measure_s = timed(lambda: fxmem.measure(real, inputs, batch, loss=meta.loss).total)
    ours, report = run_fxmem(meta.model, inputs, meta.loss, batch)
    info, stats = run_torchinfo(torchinfo, real, fxmem.parse_inputs(inputs), batch)
    tracked = run_memtracker(meta.model, inputs, meta.loss, batch)
    config = " ".join(inputs) if inputs == list(meta.inputs) else f"{' '.join(inputs)} (zoo: {' '.join(meta.inputs)})"
    return Row(
        label, config, batch, truth, measure_s, ours, info, tracked,
        report.state.weights, report.total_bytes(batch),
        getattr(stats, "total_param_bytes", None), _torchinfo_total(stats),
    )  # fmt: skip


def warm_up(torchinfo: ModuleType) -> None:
    """Run every tool once on a tiny model, so one-off costs (lazy imports, first fake-tensor dispatch)
    are not billed to whichever tool happens to go first on the first row."""
    run_case(Case("wide-mlp:test", None, (2,)), torchinfo)


def _torchinfo_total(stats: object | None) -> int | None:
    """torchinfo's "Estimated Total Size": input + forward/backward pass + parameter bytes, as it prints it."""
    if stats is None:
        return None
    return int(stats.total_input + stats.total_output_bytes + stats.total_param_bytes)  # type: ignore[attr-defined]


def mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / MIB:,.1f}"


def error(e: Estimate, truth: int) -> str:
    """Signed percent error against the measured truth, or the reason the tool gave no number."""
    if e.nbytes is None:
        return f"n/a: {e.why}"
    if e.nbytes == truth:
        return "exact"  # to the byte; a rounded "+0.00%" would hide whether it is
    return f"{100 * (e.nbytes - truth) / truth:+.2f}%"


def seconds(e: Estimate) -> str:
    return "-" if e.nbytes is None else f"{e.seconds:.2f}"


def main_table(rows: Sequence[Row]) -> str:
    """Saved activations, MiB: measured truth and each tool's estimate, error and time."""
    head = (
        "| model | input | B | measured MiB | measure s | fxmem MiB | fxmem err | fxmem s "
        "| torchinfo MiB | torchinfo err | torchinfo s | MemTracker MiB | MemTracker err | MemTracker s |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        cells = [
            r.model, r.config, str(r.batch), mib(r.measured), f"{r.measure_s:.2f}",
            mib(r.fxmem.nbytes), error(r.fxmem, r.measured), seconds(r.fxmem),
            mib(r.torchinfo.nbytes), error(r.torchinfo, r.measured), seconds(r.torchinfo),
            mib(r.memtracker.nbytes), error(r.memtracker, r.measured), seconds(r.memtracker),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def totals_table(rows: Sequence[Row]) -> str:
    """Whole-step totals for reference only: nothing here is measured, and the two define 'total' differently."""
    head = "| model | B | fxmem weights MiB | torchinfo params MiB | fxmem total (AdamW) MiB | torchinfo Estimated Total Size MiB |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [
            r.model,
            str(r.batch),
            mib(r.fxmem_weights),
            mib(r.torchinfo_params),
            mib(r.fxmem_total),
            mib(r.torchinfo_total),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


NOTES = """\
- *measured*: `fxmem.measure(...).total`, a real CPU forward + loss recording every tensor autograd saves (each storage once; parameters, buffers, inputs, targets excluded). *measure s* covers its eager run and its second, traced run.
- *fxmem*: `fxmem.analyze(..., target="cpu").activation_bytes(B)`, one fake-tensor analysis (valid for every B; rerun per row for the timing).
- *torchinfo*: `summary(model, input_size, dtypes, mode="train").total_output_bytes`, its "Forward/backward pass size": 2 x the output bytes of each leaf module with parameters.
- *MemTracker*: `torch.distributed._tools.mem_tracker.MemTracker` under `FakeTensorMode` (CPU device): its Activation bytes right after forward + loss, with the output dropped, i.e. the forward tensors still alive, which is what autograd keeps (plus the scalar loss); the loss target is filed as Other, as the truth leaves targets out; backward is then run.
- torchinfo's params size (totals table) sums the parameters of leaf modules only: one held directly by a container module (ViT's class token and position embedding) is not in it.
- Errors are (predicted - measured) / measured. Times exclude building the model (meta, real or fake); every tool ran once on a tiny model first, so no row pays one-off warm-up costs. MiB = 2^20 bytes."""


def render(rows: Sequence[Row]) -> str:
    return (
        "### Saved activations for one training step\n\n" + main_table(rows) + "\n\n" + NOTES + "\n\n"
        "### Totals, for reference (not measured; fxmem adds gradients and AdamW state, torchinfo adds the input)\n\n"
        + totals_table(rows) + "\n"
    )  # fmt: skip


def preamble(command: str, wall: float, torchinfo: ModuleType) -> str:
    """Two lines saying how the tables were produced, so a reader can reproduce them."""
    today = datetime.date.today().isoformat()
    return (
        f"Produced by `{command}` on {today} in {wall:.0f} s: torch {torch.__version__}, torchinfo {torchinfo.__version__}, "
        f"fxmem {fxmem.__version__}, Python {sys.version.split()[0]}.\n"
        f"Machine: CPU only, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads; every number below comes from that one run.\n"
    )


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="PATH", help="also write the tables, with how they were produced, to PATH")
    parser.add_argument("--only", nargs="+", metavar="MODEL", help="run only these zoo models")
    args = parser.parse_args(argv)
    torchinfo = require_torchinfo()
    cases = [c for c in CASES if not args.only or c.model in args.only]
    start = time.perf_counter()
    warm_up(torchinfo)
    rows = [row for case in cases for row in run_case(case, torchinfo)]
    wall = time.perf_counter() - start
    text = render(rows)
    print(text)
    print(f"(whole run: {wall:.0f} s)", file=sys.stderr)
    if args.write:
        command = "python benchmarks/peers.py " + " ".join(argv)
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write).write_text(preamble(command.strip(), wall, torchinfo) + "\n" + text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main(sys.argv[1:]))
