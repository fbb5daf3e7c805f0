"""Detectors: DBNet (a text detector, Liao et al., AAAI 2020) and a YOLOv8n-style object
detector, as deployed for inference."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tunefarm.models.zoo.layers import conv_bn, conv_bn_act

# -- DBNet ----------------------------------------------------------------------------------


class DbBasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(conv_bn_act(cin, cout, 3, stride), conv_bn(cout, cout, 3))
        self.down = conv_bn(cin, cout, 1, stride) if stride != 1 or cin != cout else None

    def forward(self, x):
        return torch.relu(self.body(x) + (x if self.down is None else self.down(x)))


class DbHead(nn.Module):
    """conv3x3+BN+ReLU, two ConvTranspose 2x2/2 (the first with BN+ReLU), a sigmoid."""

    def __init__(self, cin: int):
        super().__init__()
        mid = cin // 4
        self.conv = conv_bn_act(cin, mid, 3)
        self.up1 = nn.Sequential(nn.ConvTranspose2d(mid, mid, 2, stride=2), nn.BatchNorm2d(mid), nn.ReLU())
        self.up2 = nn.ConvTranspose2d(mid, 1, 2, stride=2)

    def forward(self, x):
        return torch.sigmoid(self.up2(self.up1(self.conv(x))))


class DBNet(nn.Module):
    """A ResNet-style backbone (`blocks` basic blocks per stage, one stage per width,
    strides 4, 8, ...), an FPN whose top-down path upsamples with nearest Resize and
    whose levels are brought to 1/4 resolution with bilinear Resize and concatenated,
    and two DB heads: the text probability map and the threshold map (both outputs)."""

    def __init__(self, widths: tuple[int, ...], inner: int, blocks: int = 2):
        super().__init__()
        self.stem = nn.Sequential(conv_bn_act(3, widths[0], 3, 2), nn.MaxPool2d(3, 2, 1))  # 1/4
        stages, cin = [], widths[0]
        for i, w in enumerate(widths):
            stages.append(nn.Sequential(DbBasicBlock(cin, w, 1 if i == 0 else 2),
                                        *(DbBasicBlock(w, w, 1) for _ in range(blocks - 1))))
            cin = w
        self.stages = nn.ModuleList(stages)  # 1/4, 1/8, 1/16, 1/32
        self.lateral = nn.ModuleList(nn.Conv2d(w, inner, 1, bias=False) for w in widths)
        self.smooth = nn.ModuleList(nn.Conv2d(inner, inner // 4, 3, padding=1, bias=False) for _ in widths)
        self.prob = DbHead(len(widths) * (inner // 4))  # the concatenated levels
        self.thresh = DbHead(len(widths) * (inner // 4))

    def forward(self, x):
        feats, x = [], self.stem(x)
        for stage in self.stages:
            x = stage(x)
            feats.append(x)
        laterals = [lat(f) for lat, f in zip(self.lateral, feats)]
        for i in range(len(laterals) - 1, 0, -1):  # top-down: nearest upsampling, add
            laterals[i - 1] = laterals[i - 1] + F.interpolate(laterals[i], scale_factor=2.0, mode="nearest")
        size = laterals[0].shape[-2:]
        levels = [
            F.interpolate(s(p), size=size, mode="bilinear", align_corners=False) if i else s(p)
            for i, (s, p) in enumerate(zip(self.smooth, laterals))
        ]
        fused = torch.cat(levels, dim=1)
        return self.prob(fused), self.thresh(fused)


# -- YOLOv8n-style ----------------------------------------------------------------------------


class ConvBnSiLU(nn.Module):
    def __init__(self, cin: int, cout: int, k: int = 1, stride: int = 1):
        super().__init__()
        self.conv = conv_bn(cin, cout, k, stride)

    def forward(self, x):
        x = self.conv(x)
        return x * torch.sigmoid(x)  # SiLU, written out as exporters often emit it


class YoloBottleneck(nn.Module):
    def __init__(self, c: int, shortcut: bool):
        super().__init__()
        self.cv1, self.cv2 = ConvBnSiLU(c, c, 3), ConvBnSiLU(c, c, 3)
        self.shortcut = shortcut

    def forward(self, x):
        y = self.cv2(self.cv1(x))
        return x + y if self.shortcut else y


class C2f(nn.Module):
    """1x1 conv, split in two halves, n bottlenecks on the second, concat of all, 1x1 conv."""

    def __init__(self, cin: int, cout: int, n: int, shortcut: bool):
        super().__init__()
        self.c = cout // 2
        self.cv1 = ConvBnSiLU(cin, 2 * self.c)
        self.cv2 = ConvBnSiLU((2 + n) * self.c, cout)
        self.m = nn.ModuleList(YoloBottleneck(self.c, shortcut) for _ in range(n))

    def forward(self, x):
        ys = list(self.cv1(x).split((self.c, self.c), 1))
        for m in self.m:
            ys.append(m(ys[-1]))
        return self.cv2(torch.cat(ys, 1))


class SPPF(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.cv1, self.cv2 = ConvBnSiLU(cin, cin // 2), ConvBnSiLU(cin * 2, cout)
        self.pool = nn.MaxPool2d(5, 1, 2)

    def forward(self, x):
        ys = [self.cv1(x)]
        for _ in range(3):
            ys.append(self.pool(ys[-1]))
        return self.cv2(torch.cat(ys, 1))


class Detect(nn.Module):
    """Decoupled box (4 x 16-bin distributions) and class heads per level; the box
    distributions are decoded with a softmax over the bins (DFL) into boxes."""

    def __init__(self, chans: tuple[int, ...], strides: tuple[int, ...], size: int, nc: int = 80, bins: int = 16):
        super().__init__()
        self.nc, self.bins = nc, bins
        c2, c3 = max(16, chans[0] // 4, 4 * bins), max(chans[0], min(nc, 100))
        self.box = nn.ModuleList(
            nn.Sequential(ConvBnSiLU(c, c2, 3), ConvBnSiLU(c2, c2, 3), nn.Conv2d(c2, 4 * bins, 1)) for c in chans
        )
        self.cls = nn.ModuleList(
            nn.Sequential(ConvBnSiLU(c, c3, 3), ConvBnSiLU(c3, c3, 3), nn.Conv2d(c3, nc, 1)) for c in chans
        )
        self.register_buffer("proj", torch.arange(bins, dtype=torch.float32).reshape(1, bins, 1, 1))
        anchors, scale = [], []
        for s in strides:  # anchor points at the cell centres, in grid units
            n = size // s
            ys, xs = torch.meshgrid(torch.arange(n) + 0.5, torch.arange(n) + 0.5, indexing="ij")
            anchors.append(torch.stack((xs, ys)).reshape(2, -1))
            scale.append(torch.full((1, n * n), float(s)))
        self.register_buffer("anchors", torch.cat(anchors, 1).unsqueeze(0))
        self.register_buffer("strides", torch.cat(scale, 1).unsqueeze(0))

    def forward(self, feats):
        outs = [torch.cat((b(f), c(f)), 1).flatten(2) for f, b, c in zip(feats, self.box, self.cls)]
        x = torch.cat(outs, 2)  # 1 x (4*bins + nc) x anchors
        dist, cls = x.split((4 * self.bins, self.nc), 1)
        a = dist.shape[-1]
        prob = dist.reshape(1, 4, self.bins, a).transpose(1, 2).softmax(1)  # 1 x bins x 4 x a
        dist = (prob * self.proj).sum(1)  # expected bin: 1 x 4 x a
        lt, rb = dist.chunk(2, 1)
        x1y1, x2y2 = self.anchors - lt, self.anchors + rb
        box = torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), 1) * self.strides
        return torch.cat((box, torch.sigmoid(cls)), 1)


class YoloV8nLike(nn.Module):
    """The n model: width 0.25 (channels 16..256), depth 0.33 (1-2 bottlenecks per C2f),
    an FPN/PAN neck (nearest 2x upsampling and concat), one (4 + 80) x anchors output."""

    def __init__(self, size: int = 320):
        super().__init__()
        self.stem = nn.Sequential(ConvBnSiLU(3, 16, 3, 2), ConvBnSiLU(16, 32, 3, 2), C2f(32, 32, 1, True))
        self.p3 = nn.Sequential(ConvBnSiLU(32, 64, 3, 2), C2f(64, 64, 2, True))
        self.p4 = nn.Sequential(ConvBnSiLU(64, 128, 3, 2), C2f(128, 128, 2, True))
        self.p5 = nn.Sequential(ConvBnSiLU(128, 256, 3, 2), C2f(256, 256, 1, True), SPPF(256, 256))
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.top_down4, self.top_down3 = C2f(384, 128, 1, False), C2f(192, 64, 1, False)
        self.down3, self.bottom_up4 = ConvBnSiLU(64, 64, 3, 2), C2f(192, 128, 1, False)
        self.down4, self.bottom_up5 = ConvBnSiLU(128, 128, 3, 2), C2f(384, 256, 1, False)
        self.detect = Detect((64, 128, 256), (8, 16, 32), size)

    def forward(self, x):
        p3 = self.p3(self.stem(x))
        p4 = self.p4(p3)
        p5 = self.p5(p4)
        t4 = self.top_down4(torch.cat((self.up(p5), p4), 1))
        n3 = self.top_down3(torch.cat((self.up(t4), p3), 1))
        n4 = self.bottom_up4(torch.cat((self.down3(n3), t4), 1))
        n5 = self.bottom_up5(torch.cat((self.down4(n4), p5), 1))
        return self.detect((n3, n4, n5))
