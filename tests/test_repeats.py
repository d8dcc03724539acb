"""A deep model's step extended from its 3- and 4-block copies is the step simulated whole, to the byte
(Note [Repeated blocks] in fxmem/frontends/blocks.py, Note [Extending a step by its middle block] in
fxmem/step/repeats.py).

Each case analyzes one model twice, once as fxmem does by default and once with the block stack
hidden (so the whole model is simulated, as before the fast path existed), and requires the same
timelines event for event (symbolic, B=1 and a concrete batch), the same op costs, baselines and
peaks, and the same report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from torch import nn

import fxmem
import fxmem.api
import fxmem.frontends.deepen
from fxmem.output.render import render
from fxmem.report import Report
from fxmem.results import Timeline
from models_zoo.gpt2_small import GPT
from models_zoo.vit_b16 import ViT

FAST = "from the model cut to 3 and 4 blocks"


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(self.norm(x)))


class ResidualStack(nn.Module):
    """A ModuleList of blocks with buffers (batch norm), run in a loop."""

    def __init__(self, depth: int = 7, width: int = 24) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Residual(width) for _ in range(depth))
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class EveryOther(ResidualStack):
    """Odd blocks get an extra op: the 3-block step extended to 4 blocks is not the 4-block step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            x = block(x) if i % 2 == 0 else torch.tanh(block(x))
        return self.out(x)


class Indexed(ResidualStack):
    """Reads its depth from elsewhere: cut to 3 blocks, it does not trace, so it is simulated whole."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = len(self.blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i in range(self.depth):
            x = self.blocks[i](x)
        return self.out(x)


def _meta(factory: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return factory()


SIMULATED: list[tuple[int, int | None]] = []
"""(blocks, batch) of each step the last ``_analyze`` simulated (None: B symbolic)."""


def _analyze(model: nn.Module, inputs: object, loss: str, whole: bool, **kw: object) -> Report:
    """fxmem.analyze, with the block stack hidden where ``whole`` (the whole model is simulated);
    the steps it simulates listed in SIMULATED."""
    found, simulator = fxmem.frontends.deepen.find_block_stack, fxmem.api._step_simulator
    stack = found(model)
    if whole:
        fxmem.frontends.deepen.find_block_stack = lambda model: None  # type: ignore[assignment]
    SIMULATED.clear()

    def recording(*args: object, **kwargs: object) -> Callable[..., Timeline]:
        simulate = simulator(*args, **kwargs)  # type: ignore[arg-type]

        def run(graph: torch.fx.GraphModule, b: int | None, captured: object) -> Timeline:
            SIMULATED.append((_blocks(graph, stack.path) if stack else 0, b))
            return simulate(graph, b, captured)  # type: ignore[arg-type]

        return run

    fxmem.api._step_simulator = recording  # type: ignore[assignment]
    try:
        return fxmem.analyze(model, inputs, loss=loss, batch=8, **kw)  # type: ignore[arg-type]
    finally:
        fxmem.frontends.deepen.find_block_stack, fxmem.api._step_simulator = found, simulator


def _blocks(graph: torch.fx.GraphModule, path: str) -> int:
    """How many blocks of the list at ``path`` a graph (the model, or its copy cut to fewer blocks) holds."""
    prefix = path + "."
    return len({name[len(prefix) :].split(".")[0] for name, _ in graph.named_parameters() if name.startswith(prefix)})


def _same_step(a: Timeline, b: Timeline) -> None:
    assert len(a.events) == len(b.events)
    for k, (x, y) in enumerate(zip(a.events, b.events)):
        assert x == y, f"event {k}: {x} != {y}"
    assert a.costs == b.costs
    assert a.baseline == b.baseline
    assert a.baseline_storages == b.baseline_storages


def _without_path(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("Simulated:"))


def _assert_fast_equals_whole(model: nn.Module, inputs: object, loss: str, *, four_symbolic: bool = False, **kw: object) -> Report:
    """The fast report is the whole model's; its symbolic step came from the 3-block one alone (Note
    [The symbolic step from three blocks]) unless ``four_symbolic`` (the 4-block symbolic pass ran too)."""
    fast = _analyze(model, inputs, loss, False, **kw)
    assert (3, None) in SIMULATED and ((4, None) in SIMULATED) == four_symbolic, SIMULATED
    whole = _analyze(model, inputs, loss, True, **kw)
    assert fast.steps.path.split(" (")[0].endswith(FAST), fast.steps.path
    assert whole.steps.path.split(";")[0] == whole.accounting.path == "the whole model"
    assert fast.accounting == replace(whole.accounting, path=fast.accounting.path)
    for first in (True, False):
        for batch in (1, 2, 5):
            _same_step(fast.timeline(batch, first_step=first), whole.timeline(batch, first_step=first))
        for batch in (1, 3, 8, 64):
            assert fast.peak(batch, first_step=first) == whole.peak(batch, first_step=first)
    _same_step(fast.steps.symbolic_timeline(), whole.steps.symbolic_timeline())
    assert fast.steps.path in render(fast, "table")
    assert _without_path(render(fast, "table")) == _without_path(render(whole, "table"))
    return fast


@pytest.mark.parametrize("target", ["cuda", "cpu"])
def test_gpt_step_from_three_blocks(target: str) -> None:
    model = _meta(lambda: GPT(101, 16, 32, 7, 4, dropout=0.0, tied=False))
    _assert_fast_equals_whole(model, ["B,16:int64"], "lm_cross_entropy", target=target)


def test_vit_with_dropout_on_the_gpu() -> None:
    model = _meta(lambda: ViT(32, 8, 32, 6, 4, 64, 10, dropout=0.1))
    report = _assert_fast_equals_whole(model, ["B,3,32,32"], "cross_entropy", target="cuda")
    assert report.accounting.path == report.steps.path  # saved tensors from the shallow copies too


def test_blocks_with_buffers_and_sgd_momentum() -> None:
    # Batch norm cannot train on one sample: without the B=1 pair, the 3-block symbolic step is checked against the 4-block one.
    _assert_fast_equals_whole(_meta(ResidualStack), ["B,8"], "sum", target="cpu", optimizer="sgd-momentum", four_symbolic=True)


def test_hugging_face_llama_through_export() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2
    )
    model = _meta(lambda: transformers.LlamaForCausalLM(config))
    report = _assert_fast_equals_whole(model, {"input_ids": "B,16:int64"}, "lm_cross_entropy", target="cuda")
    assert report.accounting.path == report.steps.path  # export's lifted weights repeat with their blocks


def test_hugging_face_llama_as_one_rank_of_fsdp2() -> None:
    # fully_shard's units found in the graph built from the 4-block export (fxmem/frontends/deepen.py), as in a whole export.
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2
    )
    model = _meta(lambda: transformers.LlamaForCausalLM(config))
    report = _assert_fast_equals_whole(model, {"input_ids": "B,16:int64"}, "lm_cross_entropy", target="cuda", fsdp=2)
    assert "one rank of FSDP2 over 2 (fully_shard on 6 units and the root)" in report.steps.path


def test_an_exported_stack_with_a_lifted_constant() -> None:
    # torch.export's graph built from the 4-block export (fxmem/frontends/deepen.py), a constant lifted
    # out of the forward included, gives the report of the whole model exported and simulated.
    from tests.test_deepen import _ScaledStack

    _assert_fast_equals_whole(_meta(_ScaledStack), ["B,8"], "sum", frontend="export", target="cpu")


def test_blocks_that_differ_fall_back_to_the_whole_model() -> None:
    model = _meta(EveryOther)
    fast, whole = _analyze(model, ["B,8"], "sum", False, target="cpu"), _analyze(model, ["B,8"], "sum", True, target="cpu")
    assert fast.peak(8) == whole.peak(8)
    assert fast.steps.path.startswith("the whole model (its blocks do not repeat exactly"), fast.steps.path
    _same_step(fast.steps.symbolic_timeline(), whole.steps.symbolic_timeline())


def test_a_model_that_needs_all_its_blocks_is_simulated_whole() -> None:
    report = _analyze(_meta(Indexed), ["B,8"], "sum", False, target="cpu")
    assert report.steps.path == "the whole model"
    assert report.peak(4).bytes > 0


def test_gpt_under_autocast_with_fused_adamw_and_zero3() -> None:
    # A fused optimizer is one op over every parameter, outside the sweeps (Note [One cost for all the parameters]).
    model = _meta(lambda: GPT(101, 16, 32, 6, 4, dropout=0.1, tied=False))
    options = {"amp": "bf16", "optimizer_impl": "fused", "world_size": 4, "shard": "zero3"}
    _assert_fast_equals_whole(model, ["B,16:int64"], "lm_cross_entropy", target="cuda", **options)


def test_gpt_as_one_rank_of_fsdp2() -> None:
    # FSDP2's all-gathers, prefetches and reduce-scatters repeat with the blocks they shard (fxmem/parallel):
    # the 3-block rank's step extends to the whole model's event for event, the root's gathered weights included.
    model = _meta(lambda: GPT(101, 16, 32, 7, 4, dropout=0.0))
    report = _assert_fast_equals_whole(model, ["B,16:int64"], "lm_cross_entropy", target="cuda", fsdp=4)
    assert "one rank of FSDP2 over 4 (fully_shard on 7 units and the root)" in report.steps.path
