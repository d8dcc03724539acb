"""3D U-Net for volumetric segmentation (1-channel 128^3 volumes, 3 classes).

Activation memory, not weights, dominates here: every encoder level keeps its
output alive for the skip concatenation until the decoder reaches it.
"""

from __future__ import annotations

import torch
from torch import nn

from fxmem.results import ModelSpec

__all__ = ["UNet3D", "build", "conv_bn_relu", "double_conv"]


def conv_bn_relu(cin: int, cout: int) -> list[nn.Module]:
    """Bias-free 3^3 conv (BatchNorm supplies the shift), BatchNorm3d, in-place ReLU."""
    conv = nn.Conv3d(cin, cout, 3, padding=1, bias=False)
    return [conv, nn.BatchNorm3d(cout), nn.ReLU(inplace=True)]


def double_conv(cin: int, cout: int) -> nn.Sequential:
    """Two (Conv3d 3^3 -> BatchNorm3d -> ReLU) stages at constant resolution."""
    return nn.Sequential(*conv_bn_relu(cin, cout), *conv_bn_relu(cout, cout))


class UNet3D(nn.Module):
    """Encoder of double convs + 2^3 max-pools, transposed-conv decoder with skip concatenation.

    ``features[-1]`` is the bottleneck width; the volume side must be divisible by
    ``2 ** (len(features) - 1)``.
    """

    def __init__(self, cin: int, classes: int, features: tuple[int, ...]) -> None:
        super().__init__()
        self.downs = nn.ModuleList()
        for c in features[:-1]:
            self.downs.append(double_conv(cin, c))
            cin = c
        self.pool = nn.MaxPool3d(2)
        self.bottleneck = double_conv(features[-2], features[-1])
        self.ups, self.decs = nn.ModuleList(), nn.ModuleList()
        for c_low, c in zip(features[:0:-1], features[-2::-1]):
            self.ups.append(nn.ConvTranspose3d(c_low, c, 2, stride=2))
            self.decs.append(double_conv(2 * c, c))
        self.head = nn.Conv3d(features[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, D, H, W) volume -> (B, classes, D, H, W) per-voxel logits."""
        skips = []
        for down in self.downs:
            x = down(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, dec, skip in zip(self.ups, self.decs, reversed(skips)):
            x = dec(torch.cat([skip, up(x)], dim=1))
        return self.head(x)


def build(test: bool = False) -> ModelSpec:
    """Features 32-64-128-256 on 128^3; ``test`` gives 4-8-16 on 16^3."""
    features, size = ((4, 8, 16), 16) if test else ((32, 64, 128, 256), 128)
    model = UNet3D(1, 3, features)
    return ModelSpec(model, [f"B,1,{size},{size},{size}"], loss="cross_entropy", name="unet3d")
