"""The model's code as Dynamo runs it (fxmem/frontends/dynamo_view.py), against torch.compile itself."""

from __future__ import annotations

import torch
from torch import nn

import fxmem.frontends.dynamo_view as dynamo_view_module
from fxmem.frontends.dynamo_view import dynamo_view
from fxmem.frontends.tracing import trace_model
from fxmem.inputs import parse_inputs


class Branches(nn.Module):
    """Doubles its input when compiled, negates it otherwise: the branch shows in the graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if torch.compiler.is_compiling() else -x


def _ops(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_the_compiled_branch_is_the_one_torch_compile_takes() -> None:
    """torch.compile (the eager backend, so that only Dynamo's view of the code matters) doubles; the
    trace for a compiled step takes that branch, the eager trace the other, and both say it was asked."""
    x = torch.ones(2)
    assert torch.equal(torch.compile(Branches(), backend="eager")(x), 2 * x)
    eager = trace_model(Branches(), parse_inputs(["B"]))
    compiled = trace_model(Branches(), parse_inputs(["B"]), compiling=True)
    assert eager.asks_compiling and compiled.asks_compiling
    assert any("mul" in op for op in _ops(compiled.gm)) and not any("mul" in op for op in _ops(eager.gm))
    assert any("neg" in op for op in _ops(eager.gm))


def test_a_model_that_never_asks_is_not_traced_again() -> None:
    assert not trace_model(nn.Linear(2, 2), parse_inputs(["B,2"])).asks_compiling


def test_torch_itself_is_told_the_truth() -> None:
    """fx and torch.export run inside the view: torch's own calls get the real answer (False here)."""
    with dynamo_view(compiling=True) as asked:
        told = eval("torch.compiler.is_compiling()", {"torch": torch, "__name__": "torch.fake_module"})
    assert told is False and not asked.asked
    with dynamo_view(compiling=True) as asked:
        assert torch.compiler.is_compiling() is True  # this test's module is the model's code here
    assert asked.asked and dynamo_view_module.viewing_compiled() is False
