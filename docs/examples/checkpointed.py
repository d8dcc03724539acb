"""The README's activation-checkpointing example: four residual MLP blocks, each checkpointed.

    fxmem analyze docs/examples/checkpointed.py:build --input B,64,256 --target cpu --batch 8
    fxmem analyze docs/examples/checkpointed.py:plain --input B,64,256 --target cpu --batch 8
    fxmem measure docs/examples/checkpointed.py:build --input B,64,256 --batch 8 --peak
"""

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)


class Blocks(nn.Module):
    def __init__(self, width: int = 256, depth: int = 4, checkpointed: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x)


def build() -> nn.Module:
    return Blocks()


def plain() -> nn.Module:
    return Blocks(checkpointed=False)
