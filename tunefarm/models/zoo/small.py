"""Small networks for the demo and tests: `SmallCNN`, `conv_bn_relu_net`, `ReshapePattern`."""

from __future__ import annotations

import torch
from torch import nn

from tunefarm.models.zoo.layers import conv_bn, conv_bn_act, global_pool_flat


class SmallCNN(nn.Module):
    """Four conv+bn+relu, a max-pool, global average pooling and a linear head (32x32)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            conv_bn(3, 16, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 32x32 -> 16x16
            conv_bn(16, 32, 3),
            nn.ReLU(),
            conv_bn(32, 32, 3),
            nn.ReLU(),
            conv_bn(32, 64, 3, stride=2),
            nn.ReLU(),  # -> 8x8
        )
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.fc(global_pool_flat(self.features(x)))


def conv_bn_relu_net() -> nn.Sequential:
    """A stem (3 -> 8) then two blocks 8 -> 8 with the same shapes: one task of weight 2."""
    return nn.Sequential(conv_bn_act(3, 8, 3), conv_bn_act(8, 8, 3), conv_bn_act(8, 8, 3))


class ReshapePattern(nn.Module):
    """A conv and a linear head whose flatten is written with numel: Shape -> ReduceProd
    -> Div -> Concat -> Reshape in the TorchScript exporter's graph."""

    def __init__(self):
        super().__init__()
        self.conv = conv_bn(3, 8, 3)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
        x = x.reshape(x.shape[0], x.numel() // x.shape[0])
        return self.fc(x)
