"""A deep model's exported graph built from its 3- and 4-block exports is the graph torch.export gives
for the whole model (Note [An exported graph deepened from its copy] in fxmem/frontends/deepen.py).

Each case exports the whole model itself and compares: the Python code fx generates from each graph
(every node's name, op, target and arguments, in order), each node's module stack, and the weights
the graph reads (the same tensors, by name)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.fx as fx
from torch import nn

import fxmem.frontends.deepen
from fxmem.frontends.blocks import BlockStack, cut_to, find_block_stack
from fxmem.frontends.deepen import NotDeepened, deepened, trace_blocks
from fxmem.frontends.tracing import Traced, trace_model
from fxmem.inputs import InputSpec, parse_inputs
from models_zoo.gpt2_small import GPT
from tests.test_repeats import EveryOther

TOKENS = {"input_ids": "B,16:int64"}


def _hf(kind: str, layers: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        transformers = pytest.importorskip("transformers")
        small = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4)
        if kind == "llama":
            return transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, num_key_value_heads=2))
        if kind == "qwen2":
            return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small, num_key_value_heads=2))
        if kind == "bert":
            return transformers.BertForMaskedLM(transformers.BertConfig(**small))
        config = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=layers, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config)

    return build


def _meta(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        model = build()
    return model.train()


def _assert_same_graph(made: fx.GraphModule, exported: fx.GraphModule) -> None:
    assert made.code == exported.code
    stacks = lambda gm: [dict(n.meta.get("nn_module_stack") or {}) for n in gm.graph.nodes]
    assert stacks(made) == stacks(exported)
    weights = lambda gm: {
        n.target: gm.get_parameter(str(n.target)) for n in gm.graph.nodes if n.op == "get_attr" and "weight" in str(n.target)
    }
    made_weights, exported_weights = weights(made), weights(exported)
    assert made_weights.keys() == exported_weights.keys()
    assert all(made_weights[k] is exported_weights[k] for k in made_weights)


@pytest.mark.parametrize(
    ("build", "inputs"),
    [
        pytest.param(_hf("llama", 6), TOKENS, id="hf-llama-6"),
        pytest.param(_hf("llama", 9), TOKENS, id="hf-llama-9"),
        pytest.param(_hf("qwen2", 7), TOKENS, id="hf-qwen2-7"),
        pytest.param(_hf("gpt2", 7), TOKENS, id="hf-gpt2-7"),
        pytest.param(_hf("bert", 6), TOKENS, id="hf-bert-6"),
        pytest.param(lambda: GPT(97, 16, 32, 7, 4, dropout=0.0), ["B,16:int64"], id="zoo-gpt-7"),
    ],
)
def test_the_deepened_graph_is_the_exported_one(build: Callable[[], nn.Module], inputs: object, monkeypatch: pytest.MonkeyPatch) -> None:
    model, specs = _meta(build), parse_inputs(inputs)  # type: ignore[arg-type]
    stack = find_block_stack(model)
    assert stack is not None
    traced, shallow = _traced_at(model, specs, stack, monkeypatch, frontend="export")
    assert shallow is not None
    assert shallow[0] == stack
    graphs = shallow[1]
    assert sorted(graphs) == [3, 4]
    # the 4-block graph is the model cut to 4 blocks, exported; the whole graph is not exported here
    with cut_to(model, stack, 4):
        assert graphs[4].code == trace_model(model, specs, frontend="export").gm.code
    _assert_same_graph(traced.gm, trace_model(model, specs, frontend="export").gm)


def _traced_at(
    model: nn.Module, specs: tuple[InputSpec, ...], stack: BlockStack, monkeypatch: pytest.MonkeyPatch, frontend: str = "auto"
) -> tuple[Traced, object]:
    """trace_blocks, checked to have traced the model cut to 3 and 4 blocks only (never whole)."""
    depths: list[int] = []

    def spy(m: nn.Module, *args: object, **kwargs: object) -> Traced:
        depths.append(len(m.get_submodule(stack.path)))
        return trace_model(m, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(fxmem.frontends.deepen, "trace_model", spy)
    traced, shallow = trace_blocks(model, specs, name="m", frontend=frontend)
    monkeypatch.undo()
    assert depths == [3, 4], depths
    return traced, shallow


def test_hugging_face_models_are_deepened_under_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    model, specs = _meta(_hf("llama", 6)), parse_inputs(TOKENS)
    stack = find_block_stack(model)
    assert stack is not None
    traced, shallow = _traced_at(model, specs, stack, monkeypatch)
    assert traced.frontend == "export" and shallow is not None
    _assert_same_graph(traced.gm, trace_model(model, specs).gm)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class _ScaledStack(nn.Module):
    """Blocks, then a constant made in forward: torch.export lifts it out as an attribute of the
    exported module (``lifted_tensor_0``), which the model itself does not have."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x * torch.tensor([0.5])


def test_a_constant_lifted_out_of_the_forward_is_read_from_the_export(monkeypatch: pytest.MonkeyPatch) -> None:
    model, specs = _meta(_ScaledStack), parse_inputs(["B,8"])
    stack = find_block_stack(model)
    assert stack is not None
    traced, _ = _traced_at(model, specs, stack, monkeypatch, frontend="export")
    exported = trace_model(model, specs, frontend="export").gm
    constants = [str(n.target) for n in exported.graph.nodes if n.op == "get_attr" and "lifted" in str(n.target)]
    assert constants and not hasattr(model, constants[0])
    assert traced.gm.code == exported.code
    held = lambda gm, target: functools.reduce(getattr, target.split("."), gm)
    assert all(torch.equal(held(traced.gm, c), held(exported, c)) for c in constants)  # each export lifts its own copy
    assert dict(traced.gm.named_buffers()).keys() == dict(exported.named_buffers()).keys()  # held as the export holds it


def test_blocks_that_differ_are_not_deepened_and_the_model_is_exported_whole() -> None:
    """Odd blocks add a tanh between blocks: the 3-block graph deepened has one node fewer than the
    4-block graph, so the whole model is exported."""
    model, specs = _meta(EveryOther), parse_inputs(["B,8"])
    stack = find_block_stack(model)
    assert stack is not None
    graphs = {}
    for depth in (3, 4):
        with cut_to(model, stack, depth):
            graphs[depth] = trace_model(model, specs, frontend="export").gm
    with pytest.raises(NotDeepened, match="nodes"):
        deepened(model, graphs[3], graphs[4], stack)
    traced, _ = trace_blocks(model, specs, name="m", frontend="export")
    assert traced.gm.code == trace_model(model, specs, frontend="export").gm.code


def test_fx_traced_models_are_traced_whole() -> None:
    """fx traces the zoo's GPT: the whole trace is cheap, and nothing is deepened."""
    model, specs = _meta(lambda: GPT(97, 16, 32, 7, 4, dropout=0.0)), parse_inputs(["B,16:int64"])
    traced, shallow = trace_blocks(model, specs, name="m")
    assert traced.frontend == "fx" and shallow is not None
    assert traced.gm.code == trace_model(model, specs).gm.code
