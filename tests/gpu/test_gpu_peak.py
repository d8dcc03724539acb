"""The cuda target against a real GPU: predicted peaks against measured ones, written to a JSON. Skipped without CUDA.

Cases: the six models an H200 measured (tests/h200_models.py; fp32 and bf16 autocast, first and steady
step, at the batch they were measured at) and the zoo's GPT, ResNet-50 and 3-D U-Net (B = 1 and 4,
steady step); AdamW with torch's default (foreach) implementation. For each, fxmem's prediction
(``analyze(..., target="cuda", gpu=...)``: the step replayed through the caching allocator with its
persistent workspaces) beside one real step (``fxmem.measure.measure_peak(device="cuda")``):

- ``allocated``: ``torch.cuda.max_memory_allocated`` against ``Peak.device.allocated``;
- ``requested``: the allocator's peak of requested bytes (before its 512-byte rounding) against the
  step's exact peak (``Peak.bytes``) plus the persistent workspaces (cuBLAS, cuBLASLt), which the
  allocator holds too.

Run by hand where a GPU is lent, never by CI (about two minutes on an H200):

    python -m pytest tests/gpu -q && python tests/gpu/test_gpu_peak.py --merge   # tests/gpu/last_run.json
    python tests/gpu/test_gpu_peak.py [OUT.json]     # the same cases, one after another, as a table

``FXMEM_GPU`` names the GPU (default: guessed from ``torch.cuda.get_device_name()``), ``FXMEM_GPU_JSON``
where the JSON goes. Each run's JSON carries the versions, so that runs can be compared.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fxmem
from fxmem.gpu.gpus import GPUS
from fxmem.measure import measure_peak
from tests.h200_models import H200_MODELS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOLERANCE = 0.01
"""Issue 16's bound for the six measured models' peaks; the zoo's cases are held to 2% (``ZOO_TOLERANCE``)."""
ZOO_TOLERANCE = 0.02
ZOO = (("gpt2-small:test", (1, 4)), ("resnet50", (1, 4, 32)), ("unet3d:test", (1, 4)))
"""ResNet-50 at B=32 too: its 1x1 weight gradients' cuDNN workspace grows with B (tests/test_cudnn_conv.py),
measured by the sweep at B <= 4 only."""
AMPS = (None, "bf16")
JSON = Path(os.environ.get("FXMEM_GPU_JSON", Path(__file__).with_name("last_run.json")))


@dataclass(frozen=True)
class Case:
    """One comparison: a model (an H200 model's name or a zoo spec), amp, batch and step."""

    model: str
    amp: str | None
    batch: int
    first_step: bool
    tolerance: float

    @property
    def label(self) -> str:
        return f"{self.model} {self.amp or 'fp32'} B={self.batch} {'first' if self.first_step else 'steady'}"


def cases() -> list[Case]:
    found = [
        Case(name, amp, spec.batch, first, TOLERANCE)
        for name, spec in H200_MODELS.items()
        if not spec.needs or importlib.util.find_spec(spec.needs) is not None
        for amp in AMPS
        for first in (False, True)
    ]
    found += [Case(f"zoo:{name}", amp, b, False, ZOO_TOLERANCE) for name, batches in ZOO for amp in AMPS for b in batches]
    return found


def gpu_name() -> str:
    """The fxmem name of this machine's GPU: FXMEM_GPU, or the first whose label matches the device's."""
    if "FXMEM_GPU" in os.environ:
        return os.environ["FXMEM_GPU"]
    device = torch.cuda.get_device_name().lower()
    for name in sorted(GPUS, key=len, reverse=True):
        if name.split("-")[0] in device:
            return name
    return "h100-80gb"


def _spec(model: str) -> tuple[Any, Any, str]:
    """(a meta model, its inputs, its loss) for a case's model name."""
    if model.startswith("zoo:"):
        spec = fxmem.load_model(model)
        return spec.model, spec.inputs, spec.loss
    h200 = H200_MODELS[model]
    with torch.device("meta"):
        return h200.build(), h200.inputs, h200.loss


@cache
def _report(model: str, amp: str | None) -> fxmem.Report:
    meta, inputs, loss = _spec(model)
    batch = H200_MODELS[model].batch if model in H200_MODELS else 4
    return fxmem.analyze(meta, inputs, loss=loss, optimizer="adamw", batch=batch, target="cuda", gpu=gpu_name(), amp=amp)


def compare(case: Case) -> dict[str, Any]:
    """Predicted beside measured for one case, as a JSON-ready dict."""
    report = _report(case.model, case.amp)
    peak = report.peak(case.batch, first_step=case.first_step)
    assert peak.device is not None
    workspaces = sum(n for name, n, _ in peak.device.overheads if name in ("cublas_workspace", "cublaslt_workspace"))
    _meta, inputs, loss = _spec(case.model)
    real = fxmem.load_model(case.model, meta=False).model if case.model.startswith("zoo:") else H200_MODELS[case.model].build()
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    measured = measure_peak(
        real,
        inputs,
        case.batch,
        loss=loss,
        optimizer="adamw",
        device="cuda",
        amp=case.amp,
        first_step=case.first_step,
        seq_len=report.seq_len,
    )
    del real
    return {
        "case": case.label, **asdict(case),
        "allocated": {"predicted": peak.device.allocated, "measured": measured.bytes, "error": peak.device.allocated / measured.bytes - 1},
        "requested": {"predicted": peak.bytes + workspaces, "measured": measured.requested, "error": (peak.bytes + workspaces) / (measured.requested or 1) - 1},
        "phase": {"predicted": peak.phase.value, "measured": measured.phase.value},
        "measured_phases": {p.value: n for p, n in measured.phases.items()},
        "allocated_before_case": before,
    }  # fmt: skip


def environment() -> dict[str, Any]:
    return {
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "gpu": torch.cuda.get_device_name(), "fxmem_gpu": gpu_name(),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"), "date": time.strftime("%Y-%m-%d %H:%M"),
    }  # fmt: skip


_RESULTS: list[dict[str, Any]] = []


def _record(result: dict[str, Any]) -> None:
    """Add ``result`` to this process's JSON (one file per pytest-xdist worker, merged by ``merge``)."""
    _RESULTS.append(result)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    path = JSON.with_name(f"{JSON.stem}.{worker}.json") if worker else JSON
    path.write_text(json.dumps({"environment": environment(), "results": _RESULTS}, indent=1))


def merge(path: Path = JSON) -> Path:
    """Merge the per-worker JSONs of a ``pytest -n`` run into ``path`` (sorted by case), and remove them."""
    parts = sorted(path.parent.glob(f"{path.stem}.gw*.json"))
    runs = [json.loads(p.read_text()) for p in parts]
    if runs:
        results = sorted((r for run in runs for r in run["results"]), key=lambda r: r["case"])
        path.write_text(json.dumps({"environment": runs[0]["environment"], "results": results}, indent=1))
        for p in parts:
            p.unlink()
    return path


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.label)
def test_peak_against_the_gpu(case: Case) -> None:
    result = compare(case)
    _record(result)
    allocated, requested = result["allocated"], result["requested"]
    assert result["phase"]["predicted"] == result["phase"]["measured"], result
    assert abs(allocated["error"]) <= case.tolerance, result
    assert abs(requested["error"]) <= case.tolerance, result


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to compare")
        return 0
    global JSON
    if sys.argv[1:2] == ["--merge"]:
        print(f"merged into {merge()}")
        return 0
    if len(sys.argv) > 1:
        JSON = Path(sys.argv[1])
    start = time.perf_counter()
    print(f"GPU {torch.cuda.get_device_name()} as fxmem's '{gpu_name()}'")
    print(f"{'case':<40}{'allocated pred':>16}{'measured':>12}{'error':>9}{'requested err':>15}  phase")
    for case in cases():
        r = compare(case)
        _record(r)
        a = r["allocated"]
        print(
            f"{case.label:<40}{a['predicted']:>16}{a['measured']:>12}{a['error']:>+9.2%}{r['requested']['error']:>+15.2%}  {r['phase']}",
            flush=True,
        )
    print(f"done in {time.perf_counter() - start:.0f} s; wrote {JSON}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
