"""Model zoo checks: test configs train on CPU, full configs build on meta and trace with fx."""

from __future__ import annotations

import importlib
import time
from collections.abc import Mapping, Sequence

import pytest
import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from fxmem.results import ModelSpec
from models_zoo import ZOO

BATCH = 2
LOSSES = {"sum", "mse", "cross_entropy", "lm_cross_entropy"}

# Full-size parameter counts (tied weights counted once), low and high bounds.
PARAM_RANGE = {
    "gpt2-small": (123e6, 126e6),
    "gpt-7b": (6.0e9, 7.5e9),
    "wide-mlp": (130e6, 150e6),
    "resnet50": (25.4e6, 25.7e6),
    "unet3d": (3e6, 10e6),
    "vit-b16": (86e6, 87e6),
    "lstm-lm": (30e6, 45e6),
}

# The only buffers a zoo model may hold: ones the engine can rebuild with reset_parameters().
SAFE_BUFFER_OWNERS = (nn.modules.batchnorm._BatchNorm,)


def parse_spec(spec: str) -> tuple[tuple[str | int, ...], torch.dtype]:
    """``"B,3,32,32:float32"`` -> (("B", 3, 32, 32), torch.float32); dtype defaults to float32."""
    dims, _, dtype = spec.replace(" ", "").partition(":")
    shape = tuple(d if d == "B" else int(d) for d in dims.split(","))
    return shape, getattr(torch, dtype or "float32")


def make_input(spec: str, batch: int) -> torch.Tensor:
    """A real tensor for ``spec``; integer inputs are zeros, as the engine feeds them."""
    shape, dtype = parse_spec(spec)
    size = [batch if d == "B" else d for d in shape]
    if dtype.is_floating_point:
        return torch.randn(size, dtype=dtype)
    return torch.zeros(size, dtype=dtype)


def make_inputs(inputs: Sequence[str] | Mapping[str, str], batch: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Positional specs become args, a mapping of specs becomes kwargs."""
    if isinstance(inputs, Mapping):
        return [], {k: make_input(v, batch) for k, v in inputs.items()}
    return [make_input(s, batch) for s in inputs], {}


def compute_loss(kind: str, out: torch.Tensor) -> torch.Tensor:
    """The loss the spec names, against random targets of the matching shape."""
    if kind == "sum":
        return out.sum()
    if kind == "mse":
        return F.mse_loss(out, torch.randn_like(out))
    if kind == "cross_entropy":
        target = torch.randint(out.size(1), (out.size(0), *out.shape[2:]))
        return F.cross_entropy(out, target)
    assert kind == "lm_cross_entropy"
    logits = out.flatten(0, -2)
    return F.cross_entropy(logits, torch.randint(out.size(-1), (logits.size(0),)))


def train_step(spec: ModelSpec, batch: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward + loss + backward; returns the output and the positional inputs."""
    args, kwargs = make_inputs(spec.inputs, batch)
    spec.model.zero_grad(set_to_none=True)
    out = spec.model(*args, **kwargs)
    compute_loss(spec.loss, out).backward()
    return out, args


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Run this module single-threaded: the test models are tiny, and on a loaded machine
    OpenMP workers spinning at barriers can make a millisecond step take seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def step_seconds(spec: ModelSpec, batch: int, repeats: int = 3) -> float:
    """Best-of-``repeats`` time of one training step (the minimum shrugs off a busy machine)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        train_step(spec, batch)
        times.append(time.perf_counter() - start)
    return min(times)


def test_zoo_keys() -> None:
    assert set(ZOO) == set(PARAM_RANGE)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_module_docstring(name: str) -> None:
    doc = importlib.import_module(ZOO[name].__module__).__doc__
    assert doc and doc.strip(), f"{name} has no module docstring"
    lines = doc.strip().splitlines()
    one_line = len(lines) == 1 or not lines[1].strip()
    assert lines[0].strip() and one_line, "the first line must be a one-line summary"


@pytest.mark.parametrize("name", sorted(ZOO))
def test_specs_differ_only_in_sizes(name: str) -> None:
    with torch.device("meta"):
        full, small = ZOO[name](), ZOO[name](test=True)
    assert full.name == small.name == name
    assert full.loss == small.loss and full.loss in LOSSES
    assert type(full.inputs) is type(small.inputs)
    keys = list(full.inputs) if isinstance(full.inputs, Mapping) else range(len(full.inputs))
    assert len(full.inputs) == len(small.inputs)
    for k in keys:
        (fs, fd), (ss, sd) = parse_spec(full.inputs[k]), parse_spec(small.inputs[k])
        assert fd == sd and len(fs) == len(ss)
        assert [d == "B" for d in fs] == [d == "B" for d in ss] and fs[0] == "B"


@pytest.mark.parametrize("name", sorted(ZOO))
def test_small_config_trains_on_cpu(name: str) -> None:
    torch.manual_seed(0)
    spec = ZOO[name](test=True)
    spec.model.train()
    out, args = train_step(spec, BATCH)

    assert out.shape[0] == BATCH and torch.isfinite(out).all()
    if spec.loss == "lm_cross_entropy":
        assert out.dim() == 3 and out.shape[:2] == args[0].shape
    if name == "unet3d":
        assert out.shape[2:] == args[0].shape[2:]
    missing = [n for n, p in spec.model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"

    assert step_seconds(spec, 5) < 0.5, "test config too slow for a batch-5 step"
    train_step(spec, 1)  # the engine also runs concrete steps at batch 1 (BatchNorm needs >1 value)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_full_config_meta_traces(name: str) -> None:
    with torch.device("meta"):
        spec = ZOO[name]()
    model = spec.model
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    lo, hi = PARAM_RANGE[name]
    count = sum(p.numel() for p in model.parameters())
    assert lo <= count <= hi, f"{name}: {count:,} parameters"
    for mod_name, mod in model.named_modules():
        if list(mod.buffers(recurse=False)):
            assert isinstance(mod, SAFE_BUFFER_OWNERS), f"{name}.{mod_name} holds a buffer"
    graph = torch.fx.symbolic_trace(model).graph
    assert sum(n.op == "placeholder" for n in graph.nodes) == len(spec.inputs)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_meta_build_materializes(name: str) -> None:
    """The engine's path (meta build, ``to_empty()``, ``reset_parameters()``) gives a CPU model."""
    torch.manual_seed(0)
    with torch.device("meta"):
        spec = ZOO[name](test=True)
    model = spec.model.to_empty(device="cpu")
    for mod in model.modules():
        if hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
    real = sum(p.numel() for p in ZOO[name](test=True).model.parameters())
    assert sum(p.numel() for p in model.parameters()) == real, "weight tying lost in to_empty()"
    out, _ = train_step(spec, BATCH)
    assert torch.isfinite(out).all()
