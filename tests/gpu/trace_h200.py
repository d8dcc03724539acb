"""Record what a GPU allocates, block by block, for the six shared models and for single kernels.

A diagnostic, never run by CI: ``python tests/gpu/trace_h200.py OUT_DIR [--quick | --conv-batches]``. For each model of
tests/h200_models.py, in fp32 and under bf16 autocast, it records the CUDA caching allocator's trace
(``torch.cuda.memory._record_memory_history``) of a first and a second training step, with a marker
allocation between phases, and the blocks alive before the step with the Python line that made each.
It then sweeps single kernels (convolutions, LSTM/GRU, SDPA) the same way. Each record is one JSON
file in OUT_DIR, read by the scripts that fit fxmem's cuda rules.
"""

from __future__ import annotations

import contextlib
import gzip
import inspect
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.h200_models import H200_MODELS

DEV = "cuda" if torch.cuda.is_available() else "cpu"
"""cpu only to smoke-test this script where no GPU is: the allocator's history and counters then read empty."""
if DEV == "cpu":
    for _name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        setattr(torch.cuda, _name, lambda *a, **k: None)
    torch.cuda.memory_allocated = torch.cuda.max_memory_allocated = lambda *a, **k: 0
    torch.cuda.memory._record_memory_history = lambda *a, **k: None
    torch.cuda.memory._snapshot = lambda *a, **k: {"segments": [], "device_traces": [[]]}
    torch.cuda.current_device = lambda: 0

MARK = 512 * 9001
"""A marker block's size (a multiple of 512, so its trace size is exact), plus 512 * phase number."""
PHASES = ("forward", "loss", "backward", "optimizer_step", "zero_grad")


def frames(entry: dict[str, Any], keep: int = 3) -> list[str]:
    """The innermost Python frames of a trace entry that are not in torch's own Python files."""
    out = []
    for f in entry.get("frames", []):
        name = f.get("filename", "")
        if "torch/cuda/memory" in name or (name.endswith("trace_h200.py") and f.get("name") == "mark"):
            continue
        out.append(f"{os.path.basename(name)}:{f.get('line')}:{f.get('name')}")
        if len(out) == keep:
            break
    return out


def history(on: bool) -> None:
    """Turn the allocator's history on (cleared, where this torch can clear it) or off."""
    if not on:
        torch.cuda.memory._record_memory_history(enabled=None)
        return
    params = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    extra = {"clear_history": True} if "clear_history" in params else {}
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python", **extra)


def trace_rows(since: int = 0) -> list[Any]:
    """The trace recorded so far (from entry ``since``), as [action, size, frames] rows."""
    torch.cuda.synchronize()
    entries = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()][since:]
    keep = ("alloc", "free_requested", "segment_alloc", "segment_free")
    return [[e["action"], e["size"], frames(e)] for e in entries if e["action"] in keep]


def trace_length() -> int:
    return len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()])


@contextlib.contextmanager
def recording() -> Iterator[list[Any]]:
    """The allocator's trace of the body, as [action, size, frames] rows (alloc, free_requested, ...)."""
    torch.cuda.synchronize()
    history(True)
    since = trace_length()
    rows: list[Any] = []
    try:
        yield rows
        rows.extend(trace_rows(since))
    finally:
        history(False)


def mark(code: int) -> None:
    torch.empty(MARK + 512 * code, dtype=torch.uint8, device=DEV)


def live_blocks() -> list[Any]:
    """Every active block now, with the frames that allocated it (history must be on since then)."""
    snap = torch.cuda.memory._snapshot()
    out = []
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                hist = b.get("frames") or (b.get("history") or [{}])[-1].get("frames", [])
                out.append([b["size"], b.get("requested_size", b["size"]), frames({"frames": hist}, 6)])
    return out


def make_inputs(spec: Any, batch: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    from fxmem.inputs import make_tensor, parse_inputs

    specs = parse_inputs(spec.inputs)
    tensors = [make_tensor(s, batch, None).to(DEV) for s in specs]
    args = [t for s, t in zip(specs, tensors) if s.name is None]
    kwargs = {s.name: t for s, t in zip(specs, tensors) if s.name is not None}
    if "labels" in kwargs:
        kwargs["labels"] = torch.randint(0, 5000, kwargs["labels"].shape, device=DEV)
    return args, kwargs


def model_step(
    model: nn.Module,
    args: list[torch.Tensor],
    kwargs: dict[str, torch.Tensor],
    target: torch.Tensor | None,
    opt: Any,
    amp: bool,
    marks: bool,
) -> None:
    ctx = torch.autocast(DEV, torch.bfloat16) if amp else contextlib.nullcontext()
    m = mark if marks else (lambda code: None)
    with ctx:
        m(0)
        out = model(*args, **kwargs)
        m(1)
        value = out.loss if target is None else F.cross_entropy(out, target)
    m(2)
    value.backward()
    m(3)
    opt.step()
    m(4)
    opt.zero_grad(set_to_none=True)
    m(5)
    del out, value


def trace_model(name: str, amp: bool) -> dict[str, Any]:
    """The whole trace from the model's creation to the end of a second step (markers between phases),
    the blocks alive before each step, and a second step's peak without markers."""
    spec = H200_MODELS[name]
    torch.manual_seed(0)
    torch.cuda.empty_cache()
    record: dict[str, Any] = {
        "model": name,
        "amp": "bf16" if amp else "fp32",
        "batch": spec.batch,
        "allocated_at_start": torch.cuda.memory_allocated(),
    }
    history(True)
    since = trace_length()
    model = spec.build().to(DEV).train()
    args, kwargs = make_inputs(spec, spec.batch)
    target = None
    if spec.loss == "cross_entropy":
        with torch.no_grad():
            out = model(*args, **kwargs)
        target = torch.randint(0, out.shape[1], (out.shape[0], *out.shape[2:]), device=DEV)
        del out
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in ("cold", "warm"):
        torch.cuda.synchronize()
        record[f"blocks_before_{step}"] = live_blocks()
        record[f"allocated_before_{step}"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model_step(model, args, kwargs, target, opt, amp, marks=True)
        torch.cuda.synchronize()
        record[f"max_allocated_{step}_with_marks"] = torch.cuda.max_memory_allocated()
    record["trace"] = trace_rows(since)
    history(False)
    record["allocated_before_plain"] = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model_step(model, args, kwargs, target, opt, amp, marks=False)
    torch.cuda.synchronize()
    record["max_allocated_plain"] = torch.cuda.max_memory_allocated()
    del model, opt, args, kwargs, target
    return record


def kernel_trace(run: Callable[[], None]) -> dict[str, Any]:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with recording() as rows:
        run()
    return {"allocated_before": before, "max_allocated": torch.cuda.max_memory_allocated(), "trace": rows}


def conv_cases() -> Iterator[dict[str, Any]]:
    shapes2 = [
        (3, 64, 7, 2, 3, 1, 224), (64, 64, 3, 1, 1, 1, 56), (64, 256, 1, 1, 0, 1, 56), (256, 64, 1, 1, 0, 1, 56),
        (128, 128, 3, 2, 1, 1, 56), (256, 256, 3, 1, 1, 1, 14), (512, 512, 3, 1, 1, 1, 7), (1024, 2048, 1, 2, 0, 1, 14),
        (96, 96, 7, 1, 3, 96, 56), (192, 192, 7, 1, 3, 192, 28), (384, 384, 7, 1, 3, 384, 14), (768, 768, 7, 1, 3, 768, 7),
        (3, 96, 4, 4, 0, 1, 224), (96, 384, 1, 1, 0, 1, 56), (384, 96, 1, 1, 0, 1, 56), (32, 32, 3, 1, 1, 32, 112),
        (16, 16, 3, 1, 1, 1, 128), (32, 64, 5, 1, 2, 1, 64), (144, 144, 5, 2, 2, 144, 56), (64, 64, 3, 1, 1, 2, 56),
    ]  # fmt: skip
    shapes3 = [
        (1, 16, 3, 2, 1, 64), (16, 16, 3, 1, 1, 32), (16, 32, 3, 2, 1, 32), (32, 32, 3, 1, 1, 16), (32, 64, 3, 2, 1, 16),
        (64, 64, 3, 1, 1, 8), (64, 128, 3, 1, 1, 8), (128, 128, 3, 1, 1, 8), (1, 16, 3, 1, 1, 64), (16, 16, 3, 1, 1, 64),
        (32, 64, 1, 1, 0, 16), (64, 32, 3, 1, 1, 16), (8, 8, 3, 1, 1, 96), (4, 32, 5, 1, 2, 48),
    ]  # fmt: skip
    transposed3 = [(192, 32, 3, 2, 1, 8), (64, 16, 3, 2, 1, 16), (32, 1, 3, 2, 1, 32), (128, 64, 2, 2, 0, 8), (32, 2, 3, 1, 1, 64)]
    for cin, cout, k, s, p, g, hw in shapes2:
        yield {
            "kind": "Conv2d",
            "args": dict(in_channels=cin, out_channels=cout, kernel_size=k, stride=s, padding=p, groups=g),
            "spatial": [hw, hw],
        }
    for cin, cout, k, s, p, d in shapes3:
        yield {"kind": "Conv3d", "args": dict(in_channels=cin, out_channels=cout, kernel_size=k, stride=s, padding=p), "spatial": [d, d, d]}
    for cin, cout, k, s, p, d in transposed3:
        op = 1 if s == 2 and k == 3 else 0
        yield {
            "kind": "ConvTranspose3d",
            "args": dict(in_channels=cin, out_channels=cout, kernel_size=k, stride=s, padding=p, output_padding=op),
            "spatial": [d, d, d],
        }


def trace_conv(case: dict[str, Any], batch: int, amp: bool, input_grad: bool) -> dict[str, Any]:
    layer = getattr(nn, case["kind"])(**case["args"]).to(DEV)
    x = torch.randn(batch, case["args"]["in_channels"], *case["spatial"], device=DEV, requires_grad=input_grad)

    def run() -> None:
        with torch.autocast(DEV, torch.bfloat16) if amp else contextlib.nullcontext():
            mark(0)
            y = layer(x)
            mark(1)
        y.sum().backward()
        mark(2)

    record = kernel_trace(run)
    record.update(case=case, batch=batch, amp="bf16" if amp else "fp32", input_grad=input_grad, output=list(layer(x).shape))
    return record


def batch_conv_cases() -> Iterator[dict[str, Any]]:
    """ResNet-50's pointwise convolutions (and a few 3x3 ones): the sweep above stops at B = 4, and
    the per-sample partials of a 1x1 weight gradient were seen to stop growing somewhere beyond."""
    shapes = [
        (64, 64, 1, 56), (64, 256, 1, 56), (256, 64, 1, 56), (256, 128, 1, 56), (128, 512, 1, 28), (512, 128, 1, 28),
        (512, 256, 1, 28), (256, 1024, 1, 14), (1024, 256, 1, 14), (1024, 512, 1, 14), (512, 2048, 1, 7), (2048, 512, 1, 7),
        (64, 64, 3, 56), (128, 128, 3, 28), (256, 256, 3, 14), (512, 512, 3, 7),
    ]  # fmt: skip
    for cin, cout, k, hw in shapes:
        args = dict(in_channels=cin, out_channels=cout, kernel_size=k, stride=1, padding=k // 2, groups=1)
        yield {"kind": "Conv2d", "args": args, "spatial": [hw, hw]}


def rnn_cases() -> Iterator[dict[str, Any]]:
    for kind in ("LSTM", "GRU"):
        for inp, hid, layers, bi in ((64, 256, 2, False), (32, 128, 1, True), (300, 1000, 1, False), (128, 512, 3, True)):
            for seq in (16, 128):
                yield dict(kind=kind, input_size=inp, hidden_size=hid, num_layers=layers, bidirectional=bi, seq=seq)


def trace_rnn(case: dict[str, Any], batch: int, amp: bool) -> dict[str, Any]:
    args = {k: case[k] for k in ("input_size", "hidden_size", "num_layers", "bidirectional")}
    layer = getattr(nn, case["kind"])(**args, batch_first=True).to(DEV)
    x = torch.randn(batch, case["seq"], case["input_size"], device=DEV, requires_grad=True)

    def run() -> None:
        with torch.autocast(DEV, torch.bfloat16) if amp else contextlib.nullcontext():
            mark(0)
            y = layer(x)[0]
            mark(1)
        y.float().sum().backward()
        mark(2)

    record = kernel_trace(run)
    record.update(case=case, batch=batch, amp="bf16" if amp else "fp32")
    return record


def sdpa_cases() -> Iterator[dict[str, Any]]:
    for dtype in ("float32", "bfloat16", "float16"):
        for d in (32, 64, 80, 96, 128, 160, 192, 256, 320, 512):
            for mask in ("none", "causal", "bool", "float", "bool_b"):
                for heads in ((8, 8), (8, 2)):
                    for p in (0.0, 0.1):
                        for s in (256, 1000):
                            if s == 1000 and (heads != (8, 8) or p != 0.0):
                                continue
                            yield dict(dtype=dtype, head_dim=d, mask=mask, heads=list(heads), dropout=p, seq=s)


def run_sdpa_case(case: dict[str, Any]) -> dict[str, Any]:
    dtype = getattr(torch, case["dtype"])
    b, s, d = 2, case["seq"], case["head_dim"]
    hq, hk = case["heads"]
    q = torch.randn(b, hq, s, d, device=DEV, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hk, s, d, device=DEV, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hk, s, d, device=DEV, dtype=dtype, requires_grad=True)
    mask: torch.Tensor | None = None
    causal = case["mask"] == "causal"
    if case["mask"] == "bool":
        mask = torch.ones(s, s, dtype=torch.bool, device=DEV).tril()
    elif case["mask"] == "bool_b":
        mask = torch.ones(b, 1, s, s, dtype=torch.bool, device=DEV).tril()
    elif case["mask"] == "float":
        mask = torch.zeros(b, 1, s, s, dtype=dtype, device=DEV)
    saved: list[Any] = []
    ids = {id(t) for t in (q, k, v, mask) if t is not None}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in ids and t.untyped_storage().data_ptr() not in {
            x.untyped_storage().data_ptr() for x in (q, k, v, mask) if x is not None
        }:
            saved.append([list(t.shape), str(t.dtype).replace("torch.", ""), t.untyped_storage().nbytes(), list(t.stride())])
        return t

    out: dict[str, Any] = dict(case)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=case["dropout"], is_causal=causal, enable_gqa=hq != hk)
        out["grad_fn"] = type(o.grad_fn).__name__
        out["saved"] = list(saved)
        out["output_is_saved"] = any(x[0] == list(o.shape) and x[1] == str(o.dtype).replace("torch.", "") for x in saved)
        del o
        saved.clear()

        def step() -> None:
            mark(0)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=case["dropout"], is_causal=causal, enable_gqa=hq != hk)
            mark(1)
            o.backward(torch.ones_like(o))
            mark(2)

        out["trace"] = kernel_trace(step)
    except Exception as e:  # noqa: BLE001 (a failure is recorded, the sweep goes on)  # a call the GPU refuses is a result too
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return out


def write(out_dir: Path, name: str, payload: Any) -> None:
    with gzip.open(out_dir / f"{name}.json.gz", "wt") as f:
        json.dump(payload, f)


def main() -> int:
    out_dir = Path(sys.argv[1])
    quick = "--quick" in sys.argv
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.backends.cudnn.benchmark = False
    start = time.perf_counter()
    env = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
        "capability": list(torch.cuda.get_device_capability()) if DEV == "cuda" else [],
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "allocated_at_import": torch.cuda.memory_allocated(),
    }  # fmt: skip
    if "--conv-batches" in sys.argv:  # python tests/gpu/trace_h200.py OUT_DIR --conv-batches
        convs = [trace_conv(c, b, amp, True) for c in batch_conv_cases() for b in (1, 4, 8, 16, 32, 64) for amp in (False, True)]
        write(out_dir, "conv_batches", {"env": env, "cases": convs})
        print(f"conv batches {len(convs)} {time.perf_counter() - start:.0f} s", flush=True)
        return 0
    models = []
    for name in H200_MODELS:
        for amp in (False, True):
            try:
                models.append(trace_model(name, amp))
            except Exception:  # noqa: BLE001 (a failure is recorded, the sweep goes on)
                models.append({"model": name, "amp": "bf16" if amp else "fp32", "error": traceback.format_exc()[-2000:]})
            print(f"{name} {'bf16' if amp else 'fp32'} {time.perf_counter() - start:.0f} s", flush=True)
    write(out_dir, "steps", {"env": env, "models": models})
    convs = []
    for case in conv_cases():
        for batch in (1, 2, 4) if not quick else (2,):
            for amp in (False, True):
                for input_grad in (True, False) if case["args"]["in_channels"] in (1, 3) else (True,):
                    try:
                        convs.append(trace_conv(case, batch, amp, input_grad))
                    except Exception as e:  # noqa: BLE001 (a failure is recorded, the sweep goes on)
                        convs.append({"case": case, "batch": batch, "amp": amp, "error": repr(e)[:300]})
    write(out_dir, "conv", convs)
    print(f"conv {len(convs)} {time.perf_counter() - start:.0f} s", flush=True)
    rnns = []
    for case in rnn_cases():
        for batch in (1, 3, 8):
            for amp in (False, True):
                try:
                    rnns.append(trace_rnn(case, batch, amp))
                except Exception as e:  # noqa: BLE001 (a failure is recorded, the sweep goes on)
                    rnns.append({"case": case, "batch": batch, "amp": amp, "error": repr(e)[:300]})
    write(out_dir, "rnn", rnns)
    print(f"rnn {len(rnns)} {time.perf_counter() - start:.0f} s", flush=True)
    sdpa = [run_sdpa_case(c) for c in sdpa_cases()]
    write(out_dir, "sdpa", {"env": env, "cases": sdpa})
    print(f"sdpa {len(sdpa)} {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
