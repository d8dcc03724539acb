"""ViT-B/16 (~86.6M params): 16x16 patches of a 224x224 image, 12 pre-LN blocks, d=768.

The class token and position embedding are plain Parameters (not buffers), so a
meta-built model materializes them like any other weight.
"""

from __future__ import annotations

import torch
from torch import nn

from fxmem.results import ModelSpec

from ._transformer import Block

__all__ = ["ViT", "build"]


class ViT(nn.Module):
    """Conv patch embedding, class token, learned positions, encoder, head on the class token."""

    def __init__(
        self,
        image: int,
        patch: int,
        dim: int,
        layers: int,
        heads: int,
        mlp: int,
        classes: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.empty(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.empty(1, (image // patch) ** 2 + 1, dim))
        self.drop = nn.Dropout(dropout)
        blocks = (Block(dim, heads, mlp, dropout, causal=False) for _ in range(layers))
        self.blocks = nn.Sequential(*blocks)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Init the two bare Parameters (submodules reset their own), e.g. after ``to_empty()``."""
        nn.init.zeros_(self.cls_token)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) images -> (B, classes) logits."""
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, N, D)
        cls = self.cls_token.expand(x.size(0), -1, -1)
        x = self.drop(torch.cat([cls, x], dim=1) + self.pos_embed)
        return self.head(self.norm(self.blocks(x))[:, 0])


def build(test: bool = False) -> ModelSpec:
    """ViT-B/16 at 224; ``test`` gives 32x32 images, 8x8 patches, 2 blocks of d=32, 10 classes."""
    if test:
        image, patch, dim, layers, heads, mlp, classes = 32, 8, 32, 2, 4, 64, 10
    else:
        image, patch, dim, layers, heads, mlp, classes = 224, 16, 768, 12, 12, 3072, 1000
    model = ViT(image, patch, dim, layers, heads, mlp, classes, dropout=0.1)
    return ModelSpec(model, [f"B,3,{image},{image}"], loss="cross_entropy", name="vit-b16")
