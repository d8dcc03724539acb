"""The six models whose training steps an H200 measured (shared/gpu/steps_h200.json), as its ``input`` fields define them.

Each entry builds the model (on whatever device is current: meta for fxmem, cuda for a real run) and
says its inputs, its loss and the batch its peak was measured at. tests/test_h200.py holds fxmem's
predictions to the figures measured for them; tests/gpu/ measures them again where a GPU is lent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["H200_MODELS", "H200Model", "LastStepLSTM", "toy_mlp"]


@dataclass(frozen=True)
class H200Model:
    """One measured model: ``build()`` makes it, ``inputs`` and ``loss`` are fxmem's, ``batch`` the peak's B."""

    name: str
    build: Callable[[], nn.Module]
    inputs: list[str] | dict[str, str]
    loss: str
    batch: int
    needs: str = ""
    """A package the model needs beyond torch ('transformers', 'monai'), for a skip where it is missing."""


def toy_mlp() -> nn.Module:
    """x float32[B,1024] -> 2048 -> ReLU -> 10 classes (steps_h200.json's toy_mlp: its saved bytes name modules 0, 1, 2)."""
    return nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 10))


class LastStepLSTM(nn.Module):
    """nn.LSTM(64->256, 2 layers, batch_first) + Linear(256, 10) on the last step (steps_h200.json's lstm)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(64, 256, num_layers=2, batch_first=True)
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lstm(x)[0]
        return self.head(out[:, -1])


def gpt2() -> nn.Module:
    """GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab=5000, n_positions=128), SDPA attention, dropout 0.1."""
    import transformers

    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=5000, n_positions=128, use_cache=False)
    config._attn_implementation = "sdpa"
    return transformers.GPT2LMHeadModel(config)


def bert() -> nn.Module:
    """BertConfig(hidden=256, layers=4, heads=4, ffn=1024, vocab=5000), masked LM on every token, dropout 0.1.

    128 positions: the measured baseline (parameters, buffers and the batch, 18,186,784 B) is that
    model's to the byte; with the default 512 positions it would be 391,168 B more (98,304 position
    weights and 768 int64 buffer entries). tests/data/h200/trace_steps.json.gz traced the default 512.
    """
    import transformers

    config = transformers.BertConfig(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024, vocab_size=5000, max_position_embeddings=128
    )
    return transformers.BertForMaskedLM(config)


def monai_unet3d() -> nn.Module:
    """MONAI's UNet(spatial_dims=3, channels=(16, 32, 64, 128), strides=(2, 2, 2), num_res_units=2), 1 -> 2 channels."""
    from monai.networks.nets import UNet

    return UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(16, 32, 64, 128), strides=(2, 2, 2), num_res_units=2)


def resnet50() -> nn.Module:
    """torchvision's ResNet-50 (1000 classes), as the zoo defines it."""
    from models_zoo import resnet50 as zoo

    return zoo.build().model


_LM = {"input_ids": "B,128:int64", "labels": "B,128:int64"}
H200_MODELS: dict[str, H200Model] = {
    m.name: m
    for m in (
        H200Model("toy_mlp", toy_mlp, ["B,1024"], "cross_entropy", 64),
        H200Model("gpt2", gpt2, _LM, "model", 4, needs="transformers"),
        H200Model("bert", bert, _LM, "model", 4, needs="transformers"),
        H200Model("lstm", LastStepLSTM, ["B,128,64"], "cross_entropy", 4),
        H200Model("monai_unet3d", monai_unet3d, ["B,1,64,64,64"], "cross_entropy", 2, needs="monai"),
        H200Model("resnet50", resnet50, ["B,3,224,224"], "cross_entropy", 4),
    )
}
