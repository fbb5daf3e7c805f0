"""Layers the example networks share."""

from __future__ import annotations

import torch
from torch import nn


def conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1) -> nn.Sequential:
    """A convolution with `k // 2` padding and no bias, then batch norm."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    )


def conv_bn_act(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act: type = nn.ReLU) -> nn.Sequential:
    """`conv_bn` then the activation `act` (a module class)."""
    return nn.Sequential(conv_bn(cin, cout, k, stride, groups), act())


def randomize_norms(net: nn.Module) -> None:
    """Non-trivial batch-norm statistics and affine parameters (seeded by the caller), so
    that no normalization is an identity."""
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
        elif isinstance(m, nn.LayerNorm):
            m.weight.data.uniform_(0.8, 1.2)
            m.bias.data.uniform_(-0.1, 0.1)


def global_pool_flat(x: torch.Tensor) -> torch.Tensor:
    """Global average pooling to (N, C)."""
    return torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
