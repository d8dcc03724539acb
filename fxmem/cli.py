"""The command line: ``fxmem analyze``, ``fxmem measure``, ``fxmem zoo``. The only module that prints.

An FxmemError becomes one paragraph on stderr and exit status 2; Ctrl-C exits 130 without a
traceback; any other exception is a bug in fxmem and shows its traceback (exit 1).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tabulate import tabulate

from fxmem.api import analyze
from fxmem.errors import FxmemError, InputSpecError
from fxmem.inputs import parse_dtype, parse_size
from fxmem.load import load_model
from fxmem.losses import LOSSES
from fxmem.measure import materialize, measure
from fxmem.report import FORMATS, format_bytes, render
from fxmem.results import ModelSpec, Report
from fxmem.rules.optimizers import OPTIMIZERS

__all__ = ["main"]

_SPEC_HELP = (
    "the model: zoo:NAME (see 'fxmem zoo'; zoo:NAME:test for its small config), package.module:factory, or "
    "path/to/file.py:factory. Loading a module or file RUNS ITS CODE with your permissions: load only code you "
    "trust. fxmem never unpickles weights; models are built on the meta device."
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help=_SPEC_HELP)
    p.add_argument("--input", action="append", metavar="SHAPE", help="an input shape with B on the batch axis, e.g. B,3,224,224 or input_ids=B,1024:int64; repeat for several inputs (default: the model's own)")
    p.add_argument("--loss", choices=list(LOSSES), help="the loss of the step (default: the model's own, else sum)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxmem", description="How much memory one training step of a PyTorch model needs, per layer, at every batch size.")
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("analyze", help="predict activations (a*B + c per layer), model state, totals and the batch that fits", description=_SPEC_HELP)
    _model_options(a)
    a.add_argument("--batch", type=_positive_int, default=32, help="the batch size to evaluate at (default 32)")
    a.add_argument("--optimizer", default="adamw", help=f"one of {', '.join(OPTIMIZERS.rules())} (default adamw)")
    a.add_argument("--param-dtype", help="count weights, gradients and optimizer state in this dtype (e.g. bfloat16)")
    a.add_argument("--device-memory", metavar="SIZE", help="device memory, e.g. 80GiB or 24GB: report the largest batch that fits")
    a.add_argument("--depth", type=int, help="group layers by module path truncated to this many components")
    a.add_argument("--top", type=_positive_int, help="show only the K layers that hold the most activation memory")
    a.add_argument("--format", choices=FORMATS, default="table")
    m = sub.add_parser("measure", help="run one real forward on the CPU and print measured beside predicted, per layer", description=_SPEC_HELP)
    _model_options(m)
    m.add_argument("--batch", type=_positive_int, default=2, help="the batch size of the real run (default 2)")
    sub.add_parser("zoo", help="list the zoo's models with their parameters and default inputs")
    return parser


def _load(args: argparse.Namespace) -> ModelSpec:
    spec = load_model(args.spec)
    inputs = args.input or spec.inputs
    if not inputs:
        raise InputSpecError(f"model '{args.spec}' has no default inputs; pass them with --input, e.g. --input B,3,224,224.")
    return ModelSpec(spec.model, inputs, args.loss or spec.loss, spec.name or args.spec)


def _analyze(args: argparse.Namespace) -> str:
    spec = _load(args)
    report = analyze(
        spec.model, spec.inputs, loss=spec.loss, optimizer=args.optimizer, batch=args.batch, name=args.spec,
        param_dtype=parse_dtype(args.param_dtype) if args.param_dtype else None,
        device_memory=parse_size(args.device_memory, "--device-memory") if args.device_memory else None,
    )  # fmt: skip
    return render(report, args.format, depth=args.depth, top=args.top)


def _measure(args: argparse.Namespace) -> str:
    spec = _load(args)
    report = analyze(spec.model, spec.inputs, loss=spec.loss, batch=args.batch, name=args.spec)
    measured = measure(materialize(spec.model), spec.inputs, args.batch, loss=spec.loss)
    return _comparison(report, measured.nodes, measured.total, args.batch)


def _comparison(report: Report, nodes: dict[str, int], total: int, batch: int) -> str:
    predicted = report.node_bytes(batch)
    rows = [
        [layer.fqn, format_bytes(sum(nodes.get(n, 0) for n in layer.nodes)), format_bytes(sum(predicted.get(n, 0) for n in layer.nodes))]
        for layer in report.layers()
    ]
    pred_total = report.activation_bytes(batch)
    rows.append(["Total (eager run)", format_bytes(total), format_bytes(pred_total)])
    verdict = "exact" if pred_total == total and all(nodes.get(k, 0) == v for k, v in predicted.items()) else f"differs by {pred_total - total:+d} B"
    table = tabulate(rows, headers=["Layer", f"Measured at B={batch}", "Predicted"], disable_numparse=True)
    return f"{table}\n\nActivations at B={batch}: measured {total} B, predicted {pred_total} B: {verdict}.\n"


def _zoo() -> str:
    from models_zoo import ZOO

    rows = []
    for name, build in ZOO.items():
        spec = load_model(f"zoo:{name}")
        params = sum(p.numel() for p in spec.model.parameters())
        summary = (sys.modules[build.__module__].__doc__ or "").strip().splitlines()[0]
        rows.append([name, f"{params / 1e6:,.1f}M", " ".join(spec.inputs), spec.loss, summary])
    return tabulate(rows, headers=["Model", "Params", "Default input", "Loss", "What it is"], disable_numparse=True) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fxmem`` script; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        text = {"analyze": _analyze, "measure": _measure, "zoo": lambda _a: _zoo()}[args.command](args)
    except FxmemError as e:
        print(f"fxmem: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fxmem: interrupted", file=sys.stderr)
        return 130
    sys.stdout.write(text)
    return 0
