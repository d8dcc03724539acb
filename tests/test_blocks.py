"""Which block lists fxmem treats as repeated, and the model cut to fewer blocks (Note [Repeated
blocks] in fxmem/frontends/blocks.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fxmem.frontends.blocks import MIN_DEPTH, cut_to, find_block_stack


def _stack(depth: int, width: int = 4) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))


class Twin(nn.Module):
    """A deep list and a deeper one: the deeper is the stack."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(nn.Linear(4, 4) for _ in range(MIN_DEPTH))
        self.decoder = nn.ModuleList(nn.Linear(4, 4) for _ in range(MIN_DEPTH + 2))


def test_the_deepest_list_of_alike_blocks() -> None:
    stack = find_block_stack(Twin())
    assert stack is not None
    assert (stack.path, stack.depth, stack.kind) == ("decoder", MIN_DEPTH + 2, "Linear")


def test_too_shallow_different_shapes_or_shared_weights_are_no_stack() -> None:
    assert find_block_stack(nn.Sequential(_stack(MIN_DEPTH - 1))) is None
    mixed = nn.Sequential(nn.Sequential(*(nn.Linear(4, 4) for _ in range(MIN_DEPTH)), nn.Linear(4, 5)))
    assert find_block_stack(mixed) is None
    tied = nn.Sequential(_stack(MIN_DEPTH))
    tied[0][1].weight = tied[0][0].weight  # two blocks share one weight
    assert find_block_stack(tied) is None


def test_module_paths_move_between_blocks() -> None:
    stack = find_block_stack(nn.Sequential(nn.Linear(4, 4), _stack(MIN_DEPTH)))
    assert stack is not None and stack.path == "1"
    assert stack.layer_of("1.3") == 3 and stack.layer_of("1.3.weight") == 3
    assert stack.layer_of("0") is None and stack.layer_of("13.2") is None
    assert stack.with_layer("1.3.weight", 5) == "1.5.weight"
    assert stack.with_layer("0.weight", 5) == "0.weight"


def test_cut_to_keeps_the_first_blocks_and_puts_them_back() -> None:
    model = nn.Sequential(nn.Linear(4, 4), _stack(MIN_DEPTH + 1))
    stack = find_block_stack(model)
    assert stack is not None
    blocks = list(model[1])
    with cut_to(model, stack, 3) as cut:
        assert [id(b) for b in cut[1]] == [id(b) for b in blocks[:3]]
        assert cut(torch.ones(2, 4)).shape == (2, 4)
    assert [id(b) for b in model[1]] == [id(b) for b in blocks]


class Attention(nn.Module):
    def __init__(self, layer_idx: int, kind: str) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # Hugging Face's blocks know their index: that alone is no difference
        self.kind = kind
        self.proj = nn.Linear(4, 4)


def test_blocks_that_differ_only_by_a_setting_are_no_stack() -> None:
    alike = nn.Sequential(nn.ModuleList(Attention(i, "global") for i in range(MIN_DEPTH)))
    assert find_block_stack(alike) is not None
    mixed = nn.Sequential(nn.ModuleList(Attention(i, "global" if i % 3 == 2 else "sliding") for i in range(MIN_DEPTH)))
    assert find_block_stack(mixed) is None


def test_hugging_face_layers_that_alternate_attention_are_no_stack() -> None:
    # Gemma 2 alternates sliding-window and global attention layers (a per-layer setting); Llama's are alike.
    transformers = pytest.importorskip("transformers")
    sizes = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": MIN_DEPTH}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    with torch.device("meta"):
        gemma = transformers.AutoModelForCausalLM.from_config(transformers.Gemma2Config(**sizes, **heads))
        llama = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**sizes, **heads))
    assert find_block_stack(gemma) is None
    stack = find_block_stack(llama)
    assert stack is not None and (stack.path, stack.depth) == ("model.layers", MIN_DEPTH)


class Blocks(nn.Sequential):
    """A Sequential subclass whose constructor takes no modules: cut_to must not call it."""

    def __init__(self, depth: int) -> None:
        super().__init__(*(nn.Linear(4, 4) for _ in range(depth)))


def test_cut_to_keeps_a_list_subclass_and_its_forward() -> None:
    model = nn.Sequential(Blocks(MIN_DEPTH))
    stack = find_block_stack(model)
    assert stack is not None
    with cut_to(model, stack, 3) as cut:
        assert type(cut[0]) is Blocks and len(cut[0]) == 3
        assert cut(torch.ones(2, 4)).shape == (2, 4)
    assert len(model[0]) == MIN_DEPTH
