"""MobileNets: V2 (Sandler et al., 2018: inverted residuals, depthwise convolutions,
ReLU6) and V3-Small (Howard et al., 2019: hard-swish, squeeze-and-excitation)."""

from __future__ import annotations

import torch
from torch import nn

from tunefarm.models.zoo.layers import conv_bn, conv_bn_act, global_pool_flat


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        layers = [conv_bn_act(cin, hidden, 1, act=nn.ReLU6)] if expand != 1 else []
        layers += [conv_bn_act(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6), conv_bn(hidden, cout, 1)]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


class MobileNetV2(nn.Module):
    # (expansion t, channels c, repeats n, first stride s), as in the paper's table 2
    CONFIG = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        layers, cin = [conv_bn_act(3, 32, 3, 2, act=nn.ReLU6)], 32
        for t, c, n, s in self.CONFIG:
            for i in range(n):
                layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        layers.append(conv_bn_act(cin, 1280, 1, act=nn.ReLU6))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x):
        return self.classifier(global_pool_flat(self.features(x)))


def _divisible(v: float, by: int = 8) -> int:
    """Channels rounded to a multiple of `by`, never more than 10% below `v` (the paper's rule)."""
    out = max(by, int(v + by / 2) // by * by)
    return out + by if out < 0.9 * v else out


class SqueezeExcite(nn.Module):
    """Global pool, 1x1 reduce + ReLU, 1x1 expand + hard-sigmoid, scale the input."""

    def __init__(self, c: int):
        super().__init__()
        mid = _divisible(c / 4)
        self.reduce, self.expand = nn.Conv2d(c, mid, 1), nn.Conv2d(mid, c, 1)

    def forward(self, x):
        s = nn.functional.adaptive_avg_pool2d(x, 1)
        return x * nn.functional.hardsigmoid(self.expand(torch.relu(self.reduce(s))))


class Bneck(nn.Module):
    """MobileNetV3's block: 1x1 expand, k x k depthwise (stride), optional SE, 1x1 project."""

    def __init__(self, cin: int, k: int, expand: int, cout: int, se: bool, act: type, stride: int):
        super().__init__()
        layers = [conv_bn_act(cin, expand, 1, act=act)] if expand != cin else []
        layers.append(conv_bn_act(expand, expand, k, stride, groups=expand, act=act))
        if se:
            layers.append(SqueezeExcite(expand))
        layers.append(conv_bn(expand, cout, 1))
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


class MobileNetV3Small(nn.Module):
    # (kernel, expansion, out, SE, activation, stride), the paper's table 2
    CONFIG = (
        (3, 16, 16, True, nn.ReLU, 2),
        (3, 72, 24, False, nn.ReLU, 2),
        (3, 88, 24, False, nn.ReLU, 1),
        (5, 96, 40, True, nn.Hardswish, 2),
        (5, 240, 40, True, nn.Hardswish, 1),
        (5, 240, 40, True, nn.Hardswish, 1),
        (5, 120, 48, True, nn.Hardswish, 1),
        (5, 144, 48, True, nn.Hardswish, 1),
        (5, 288, 96, True, nn.Hardswish, 2),
        (5, 576, 96, True, nn.Hardswish, 1),
        (5, 576, 96, True, nn.Hardswish, 1),
    )

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        layers, cin = [conv_bn_act(3, 16, 3, 2, act=nn.Hardswish)], 16
        for k, e, c, se, act, s in self.CONFIG:
            layers.append(Bneck(cin, k, e, c, se, act, s))
            cin = c
        layers.append(conv_bn_act(cin, 576, 1, act=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Linear(576, 1024), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(1024, num_classes))

    def forward(self, x):
        return self.head(global_pool_flat(self.features(x)))
