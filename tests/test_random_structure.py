"""Random structure refused with its cause (Note [Random structure] in fxmem/frontends/random_structure.py),
random values left alone. The refusal's words for small models are in tests/test_errors.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import fxmem
from fxmem.frontends.random_structure import RandomStructure


def _wav2vec2(layerdrop: float) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
        conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, layerdrop=layerdrop, mask_time_prob=0.0,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.Wav2Vec2Model(config)


def test_wav2vec2s_layerdrop_is_named_with_its_config_field() -> None:
    """transformers' wav2vec2 draws ``torch.rand([])`` per layer and skips it below ``config.layerdrop``
    (0.1 by default): left alone, torch.export refused it with a guard on ``u0``, cut mid-sentence."""
    with pytest.raises(RandomStructure) as refused:
        fxmem.analyze(_wav2vec2(0.1), ["input_values=B,1600"], batch=2, target="cpu")
    message = str(refused.value)
    for words in ("modeling_wav2vec2.py:", "in module 'encoder' (Wav2Vec2Encoder)", "LayerDrop", "Set config.layerdrop (now 0.1) to 0", "--config layerdrop=0"):
        assert words in message
    fxmem.analyze(_wav2vec2(0.0), ["input_values=B,1600"], batch=2, target="cpu", peak=False)  # what the message says to do works


class _RandomValues(nn.Module):
    """Random numbers that change values, never which code runs: a noise scale drawn with numpy, a mask with torch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + 0.1 * np.random.random()
        return self.lin(x * scale) * (torch.rand(x.shape) > 0.5)


def test_random_values_are_not_random_structure() -> None:
    report = fxmem.analyze(_RandomValues(), ["B,8"], batch=4, target="cpu", peak=False)
    assert report.activation_bytes(4) == fxmem.measure(_RandomValues(), ["B,8"], 4).total
