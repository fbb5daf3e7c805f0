"""ResNets (He et al., 2016): ResNet-18 with basic blocks, ResNet-50 with bottlenecks."""

from __future__ import annotations

import torch
from torch import nn

from tunefarm.models.zoo.layers import conv_bn, global_pool_flat


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a shortcut (1x1 projection when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = conv_bn(cin, cout, 3, stride)
        self.conv2 = conv_bn(cout, cout, 3)
        self.down = conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        return torch.relu(self.conv2(torch.relu(self.conv1(x))) + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (stride here, as torchvision's v1.5), 1x1 expand by 4, shortcut."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * 4
        self.conv1 = conv_bn(cin, width, 1)
        self.conv2 = conv_bn(width, width, 3, stride)
        self.conv3 = conv_bn(width, cout, 1)
        self.down = conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        y = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return torch.relu(self.conv3(y) + identity)


class ResNet18(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.stem = conv_bn(3, 64, 7, 2)
        self.pool = nn.MaxPool2d(3, 2, 1)
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.blocks(self.pool(torch.relu(self.stem(x))))
        return self.fc(global_pool_flat(x))


class ResNet50(nn.Module):
    """Stages of 3, 4, 6 and 3 bottlenecks (widths 64..512, outputs 256..2048)."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.stem = conv_bn(3, 64, 7, 2)
        self.pool = nn.MaxPool2d(3, 2, 1)
        blocks, cin = [], 64
        for width, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(n):
                blocks.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * 4
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x):
        x = self.blocks(self.pool(torch.relu(self.stem(x))))
        return self.fc(global_pool_flat(x))
