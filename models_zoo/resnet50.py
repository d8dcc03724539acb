"""ResNet-50 (v1.5, torchvision layout, ~25.6M params) on 224x224 images.

Bottleneck blocks (3, 4, 6, 3) with the stride on the 3x3 conv, BatchNorm and
in-place ReLU as torchvision writes them, so the traced graph looks like the
one users of torchvision would get.
"""

from __future__ import annotations

import torch
from torch import nn

from fxmem.results import ModelSpec

__all__ = ["Bottleneck", "ResNet", "build"]


def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    """A bias-free conv followed by BatchNorm (padding keeps 'same' size at stride 1)."""
    return [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout)]


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (strided) -> 1x1 expand (x4), plus identity or 1x1 projection shortcut."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = conv_bn(cin, width, 1)
        self.conv2, self.bn2 = conv_bn(width, width, 3, stride)
        self.conv3, self.bn3 = conv_bn(width, cout, 1)
        self.relu = nn.ReLU(inplace=True)
        if stride != 1 or cin != cout:  # projection shortcut, torchvision's ``downsample``
            self.downsample: nn.Module = nn.Sequential(*conv_bn(cin, cout, 1, stride))
        else:
            self.downsample = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity  # fx records this as operator.add, as it does for torchvision
        return self.relu(out)


class ResNet(nn.Module):
    """7x7/2 stem, 3x3/2 maxpool, four bottleneck stages, global average pool, linear classifier."""

    def __init__(self, blocks: tuple[int, ...], width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.conv1, self.bn1 = conv_bn(3, width, 7, 2)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, cin = [], width
        for i, n in enumerate(blocks):
            w = width * 2**i
            stages.append(self._stage(cin, w, n, stride=1 if i == 0 else 2))
            cin = w * Bottleneck.expansion
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    @staticmethod
    def _stage(cin: int, width: int, n: int, stride: int) -> nn.Sequential:
        """``n`` bottlenecks; only the first one strides and changes the channel count."""
        cout = width * Bottleneck.expansion
        rest = (Bottleneck(cout, width, 1) for _ in range(n - 1))
        return nn.Sequential(Bottleneck(cin, width, stride), *rest)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build(test: bool = False) -> ModelSpec:
    """Full ResNet-50; ``test`` gives one block per stage, width 8, 64x64 images, 10 classes.

    64x64 rather than 32x32 leaves layer4 at 2x2, so BatchNorm still sees more than one
    value per channel when a training step runs at batch 1.
    """
    if test:
        model, size = ResNet((1, 1, 1, 1), width=8, classes=10), 64
    else:
        model, size = ResNet((3, 4, 6, 3)), 224
    return ModelSpec(model, [f"B,3,{size},{size}"], loss="cross_entropy", name="resnet50")
