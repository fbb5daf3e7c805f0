"""Example models, generated here with PyTorch and exported to ONNX (nothing is downloaded).

    python -m tunefarm.models.examples --list
    python -m tunefarm.models.examples resnet18 --out resnet18.onnx

Every model is built by the code below with fixed, seeded random weights (batch-norm
statistics included, so no layer is an identity), put in eval mode and exported by
`export_example`. Models:

- ``resnet18``: ResNet-18 (basic blocks, 1x3x224x224), written out here, no torchvision.
- ``mobilenet_v2``: MobileNetV2 (inverted residuals, depthwise convolutions, ReLU6).
- ``bert_layer``: one BERT-base encoder layer (sequence 128, hidden 768, 12 heads, FFN
  3072 with GELU, post-LayerNorm), input 1x128x768 float32.
- ``small_cnn``: four conv+bn+relu, a max-pool, a global average pool and a linear
  head on 1x3x32x32; small enough to tune every task in a few minutes (the demo).
- ``conv_bn_relu``: a stem conv+bn+relu and two identical conv+bn+relu blocks, so one
  fused task is used twice (weight 2). For task-extraction tests.
- ``dbnet``: a DBNet text detector at 256x256 (backbone, FPN with nearest and bilinear
  Resize and concat, ConvTranspose heads with sigmoid: probability and threshold maps);
  ``dbnet_tiny`` is the same structure with two backbone stages of one block, 8 and 16
  channels, at 32x32: it tunes in seconds (for tests).
- ``yolov8n_like``: a YOLOv8n-style detector on 1x3x320x320, the n model's widths
  (16..256 channels): C2f blocks (1x1 conv, split, bottlenecks, concat), SiLU as
  x*sigmoid(x), SPPF (three chained 5x5 max-pools, concat), an FPN/PAN neck (nearest
  2x upsampling and concat), decoupled box/class heads per level, the box distributions
  decoded by a softmax over 16 bins (DFL) into boxes, one 1x84x2100 output. Many small
  tasks: what limits it is overhead between kernels more than arithmetic.
- ``reshape_pattern``: a small CNN with a dynamic batch dimension whose flatten computes
  the Reshape target from Shape/Gather/ReduceProd/Div/Concat, as older converters emit it.
  TVM's Relax ONNX frontend rejects that graph ("Node /ReduceProd cannot handle ShapeExpr
  inputs", even with the batch fixed) until it is simplified with fixed input shapes.

Exporter. torch 2.13 has both exporters: ``torch.onnx.export(..., dynamo=True)`` (the
default, through torch.export and onnxscript) and the legacy TorchScript one
(``dynamo=False``, deprecated, "will be removed"). Both outputs import into TVM here.
The dynamo exporter is used for every model except ``reshape_pattern``: it is the
maintained one, and it folds batch-norm into the convolutions and every shape
computation into constant Reshape targets. That folding is exactly why it cannot produce
``reshape_pattern``: with one dynamic dimension it emits a constant ``[-1, ...]`` target
that TVM accepts, so that model alone uses the TorchScript exporter, which still emits
the Shape/Gather/Concat arithmetic real-world files carry. Dynamo exports take 3-10 s
each here (the TorchScript one well under a second).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunefarm.errors import ModelError, UsageError

SEED = 0
"""Seed of every example's weights and batch-norm statistics."""

OPSET = 18
"""ONNX opset of the exports (TVM's frontend converts opsets up to 23; 18 is widely read)."""


@dataclass(frozen=True)
class ExampleModel:
    name: str
    summary: str
    input_name: str
    input_shape: tuple[int, ...]
    build: Callable[[], Any]  # -> torch.nn.Module in eval mode
    dynamic_batch: bool = False  # export the first input dimension as "batch"
    legacy_exporter: bool = False  # use the TorchScript exporter (see the module docstring)
    output_names: tuple[str, ...] = ("y",)


def _torch():
    try:
        import torch
    except ImportError:
        raise UsageError("the example models need PyTorch: pip install 'tunefarm[torch]'") from None
    return torch


# -- architectures ---------------------------------------------------------------------------
# The classes are defined inside functions so that importing this module does not import torch.


def _conv_bn(torch, cin: int, cout: int, k: int, stride: int = 1, groups: int = 1):
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
    )


def _randomize_norms(torch, net) -> None:
    """Non-trivial batch-norm statistics and affine parameters (seeded by the caller)."""
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.2, 0.2)
        elif isinstance(m, torch.nn.LayerNorm):
            m.weight.data.uniform_(0.8, 1.2)
            m.bias.data.uniform_(-0.1, 0.1)


def _resnet18():
    torch = _torch()
    nn = torch.nn

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.conv1 = _conv_bn(torch, cin, cout, 3, stride)
            self.conv2 = _conv_bn(torch, cout, cout, 3)
            self.down = _conv_bn(torch, cin, cout, 1, stride) if stride != 1 or cin != cout else None

        def forward(self, x):
            identity = x if self.down is None else self.down(x)
            return torch.relu(self.conv2(torch.relu(self.conv1(x))) + identity)

    class ResNet18(nn.Module):
        def __init__(self, num_classes: int = 1000):
            super().__init__()
            self.stem = _conv_bn(torch, 3, 64, 7, 2)
            self.pool = nn.MaxPool2d(3, 2, 1)
            blocks, cin = [], 64
            for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
                blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
                cin = cout
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(512, num_classes)

        def forward(self, x):
            x = self.blocks(self.pool(torch.relu(self.stem(x))))
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    return ResNet18()


def _mobilenet_v2():
    torch = _torch()
    nn = torch.nn

    def conv_bn_relu6(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1):
        return nn.Sequential(_conv_bn(torch, cin, cout, k, stride, groups), nn.ReLU6())

    class InvertedResidual(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int, expand: int):
            super().__init__()
            hidden = cin * expand
            layers = [conv_bn_relu6(cin, hidden, 1)] if expand != 1 else []
            layers += [
                conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
                _conv_bn(torch, hidden, cout, 1),
            ]
            self.body = nn.Sequential(*layers)
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            return x + self.body(x) if self.residual else self.body(x)

    class MobileNetV2(nn.Module):
        # (expansion t, channels c, repeats n, first stride s), as in the paper's table 2
        CONFIG = (
            (1, 16, 1, 1),
            (6, 24, 2, 2),
            (6, 32, 3, 2),
            (6, 64, 4, 2),
            (6, 96, 3, 1),
            (6, 160, 3, 2),
            (6, 320, 1, 1),
        )

        def __init__(self, num_classes: int = 1000):
            super().__init__()
            layers, cin = [conv_bn_relu6(3, 32, 3, 2)], 32
            for t, c, n, s in self.CONFIG:
                for i in range(n):
                    layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                    cin = c
            layers.append(conv_bn_relu6(cin, 1280, 1))
            self.features = nn.Sequential(*layers)
            self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

        def forward(self, x):
            x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
            return self.classifier(torch.flatten(x, 1))

    return MobileNetV2()


def _bert_layer():
    torch = _torch()
    nn = torch.nn

    class BertLayer(nn.Module):
        def __init__(self, hidden: int = 768, heads: int = 12, ffn: int = 3072, seq: int = 128):
            super().__init__()
            self.heads, self.head_dim, self.seq = heads, hidden // heads, seq
            self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
            self.attn_out = nn.Linear(hidden, hidden)
            self.attn_norm = nn.LayerNorm(hidden, eps=1e-12)
            self.intermediate = nn.Linear(hidden, ffn)
            self.output = nn.Linear(ffn, hidden)
            self.out_norm = nn.LayerNorm(hidden, eps=1e-12)

        def split_heads(self, x):  # (1, seq, hidden) -> (1, heads, seq, head_dim)
            return x.reshape(1, self.seq, self.heads, self.head_dim).permute(0, 2, 1, 3)

        def forward(self, x):
            q, k, v = (
                self.split_heads(self.query(x)),
                self.split_heads(self.key(x)),
                self.split_heads(self.value(x)),
            )
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
            context = torch.matmul(torch.softmax(scores, dim=-1), v)
            context = context.permute(0, 2, 1, 3).reshape(1, self.seq, self.heads * self.head_dim)
            x = self.attn_norm(x + self.attn_out(context))
            return self.out_norm(x + self.output(nn.functional.gelu(self.intermediate(x))))

    return BertLayer()


def _small_cnn():
    torch = _torch()
    nn = torch.nn

    class SmallCNN(nn.Module):
        def __init__(self, num_classes: int = 10):
            super().__init__()
            self.features = nn.Sequential(
                _conv_bn(torch, 3, 16, 3),
                nn.ReLU(),
                nn.MaxPool2d(2),  # 32x32 -> 16x16
                _conv_bn(torch, 16, 32, 3),
                nn.ReLU(),
                _conv_bn(torch, 32, 32, 3),
                nn.ReLU(),
                _conv_bn(torch, 32, 64, 3, stride=2),
                nn.ReLU(),  # -> 8x8
            )
            self.fc = nn.Linear(64, num_classes)

        def forward(self, x):
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))

    return SmallCNN()


def _conv_bn_relu_net():
    torch = _torch()
    nn = torch.nn

    def block(cin: int, cout: int):
        return nn.Sequential(_conv_bn(torch, cin, cout, 3), nn.ReLU())

    # stem (3 -> 8) then two blocks 8 -> 8 with the same shapes: one task of weight 2
    return nn.Sequential(block(3, 8), block(8, 8), block(8, 8))


def _reshape_pattern():
    torch = _torch()
    nn = torch.nn

    class ReshapePattern(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = _conv_bn(torch, 3, 8, 3)
            self.fc = nn.Linear(8 * 8 * 8, 10)

        def forward(self, x):
            x = nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
            # the flatten written with numel: Shape -> ReduceProd -> Div -> Concat -> Reshape
            x = x.reshape(x.shape[0], x.numel() // x.shape[0])
            return self.fc(x)

    return ReshapePattern()


def _dbnet(widths: tuple[int, ...], inner: int, blocks: int = 2):
    """A DBNet text detector (Liao et al., AAAI 2020) as deployed for inference: a
    ResNet-style backbone (`blocks` basic blocks per stage, one stage per width, strides
    4, 8, ...), an FPN whose top-down path
    upsamples with nearest Resize and whose four levels are brought to 1/4 resolution
    with bilinear Resize and concatenated, and the DB head: conv3x3+BN+ReLU, two
    ConvTranspose 2x2/2 (the first with BN+ReLU) and a sigmoid, giving the text
    probability map at the input's resolution; a second, identical head gives the
    threshold map (both are outputs)."""
    torch = _torch()
    nn = torch.nn
    F = nn.functional

    def conv_bn_relu(cin: int, cout: int, k: int, stride: int = 1):
        return nn.Sequential(_conv_bn(torch, cin, cout, k, stride), nn.ReLU())

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.body = nn.Sequential(conv_bn_relu(cin, cout, 3, stride), _conv_bn(torch, cout, cout, 3))
            self.down = _conv_bn(torch, cin, cout, 1, stride) if stride != 1 or cin != cout else None

        def forward(self, x):
            return torch.relu(self.body(x) + (x if self.down is None else self.down(x)))

    class Head(nn.Module):
        def __init__(self, cin: int):
            super().__init__()
            mid = cin // 4
            self.conv = conv_bn_relu(cin, mid, 3)
            self.up1 = nn.Sequential(nn.ConvTranspose2d(mid, mid, 2, stride=2), nn.BatchNorm2d(mid), nn.ReLU())
            self.up2 = nn.ConvTranspose2d(mid, 1, 2, stride=2)

        def forward(self, x):
            return torch.sigmoid(self.up2(self.up1(self.conv(x))))

    class DBNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(conv_bn_relu(3, widths[0], 3, 2), nn.MaxPool2d(3, 2, 1))  # 1/4
            stages, cin = [], widths[0]
            for i, w in enumerate(widths):
                stages.append(nn.Sequential(BasicBlock(cin, w, 1 if i == 0 else 2),
                                            *(BasicBlock(w, w, 1) for _ in range(blocks - 1))))
                cin = w
            self.stages = nn.ModuleList(stages)  # 1/4, 1/8, 1/16, 1/32
            self.lateral = nn.ModuleList(nn.Conv2d(w, inner, 1, bias=False) for w in widths)
            self.smooth = nn.ModuleList(nn.Conv2d(inner, inner // 4, 3, padding=1, bias=False) for _ in widths)
            self.prob = Head(len(widths) * (inner // 4))  # the concatenated levels
            self.thresh = Head(len(widths) * (inner // 4))

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

    return DBNet()


def yolov8n_like(size: int = 320):
    """The ``yolov8n_like`` example's network for a `size` x `size` input (a multiple of 32)."""
    torch = _torch()
    if size % 32:
        raise UsageError(f"yolov8n_like needs an input size that is a multiple of 32, not {size}")
    nn = torch.nn

    class ConvBnSiLU(nn.Module):
        def __init__(self, cin: int, cout: int, k: int = 1, stride: int = 1):
            super().__init__()
            self.conv = _conv_bn(torch, cin, cout, k, stride)

        def forward(self, x):
            x = self.conv(x)
            return x * torch.sigmoid(x)  # SiLU, written out as exporters often emit it

    class Bottleneck(nn.Module):
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
            self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(n))

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
        # the n model: width 0.25 (channels 16..256), depth 0.33 (1-2 bottlenecks per C2f)
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

    return YoloV8nLike(size)


EXAMPLES: dict[str, ExampleModel] = {
    m.name: m
    for m in (
        ExampleModel("resnet18", "ResNet-18, 1x3x224x224", "x", (1, 3, 224, 224), _resnet18),
        ExampleModel(
            "mobilenet_v2",
            "MobileNetV2 (depthwise convs, ReLU6), 1x3x224x224",
            "x",
            (1, 3, 224, 224),
            _mobilenet_v2,
        ),
        ExampleModel("bert_layer", "one BERT-base encoder layer, 1x128x768", "x", (1, 128, 768), _bert_layer),
        ExampleModel(
            "small_cnn", "4 conv+bn+relu, pooling, linear head, 1x3x32x32", "x", (1, 3, 32, 32), _small_cnn
        ),
        ExampleModel(
            "conv_bn_relu",
            "stem + 2 identical conv+bn+relu blocks, 1x3x16x16",
            "x",
            (1, 3, 16, 16),
            _conv_bn_relu_net,
        ),
        ExampleModel(
            "reshape_pattern",
            "dynamic batch, Reshape target computed from Shape/Gather/Concat, 1x3x16x16",
            "x",
            (1, 3, 16, 16),
            _reshape_pattern,
            dynamic_batch=True,
            legacy_exporter=True,
        ),
        ExampleModel(
            "dbnet",
            "DBNet text detector: ResNet-style backbone, FPN (nearest + bilinear Resize, concat), "
            "ConvTranspose+sigmoid heads, 1x3x256x256",
            "x",
            (1, 3, 256, 256),
            lambda: _dbnet((16, 32, 64, 128), 64),
            output_names=("prob", "thresh"),
        ),
        ExampleModel(
            "dbnet_tiny",
            "dbnet's structure with two stages of one block, 8-16 channels, 1x3x32x32 (for tests)",
            "x",
            (1, 3, 32, 32),
            lambda: _dbnet((8, 16), 16, blocks=1),
            output_names=("prob", "thresh"),
        ),
        ExampleModel(
            "yolov8n_like",
            "YOLOv8n-style detector (C2f, SiLU, SPPF, FPN/PAN, DFL heads), 1x3x320x320",
            "x",
            (1, 3, 320, 320),
            yolov8n_like,
        ),
    )
}


def get_example(name: str) -> ExampleModel:
    try:
        return EXAMPLES[name]
    except KeyError:
        raise UsageError(f"unknown example model {name!r}; choose one of: {', '.join(EXAMPLES)}") from None


def build_example(name: str):
    """The example as a `torch.nn.Module` in eval mode, with its seeded weights, and an
    example input tensor (seeded too)."""
    torch = _torch()
    spec = get_example(name)
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        net = spec.build()
        _randomize_norms(torch, net)
        x = torch.randn(*spec.input_shape)
    return net.eval(), x


def export_example(name: str, path: str | Path) -> Path:
    """Write the example model `name` to `path` as ONNX and return the path."""
    torch = _torch()
    spec = get_example(name)
    net, x = build_example(name)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {"input_names": [spec.input_name], "output_names": list(spec.output_names), "opset_version": OPSET}
    if spec.legacy_exporter:
        kwargs["dynamo"] = False
        if spec.dynamic_batch:
            kwargs["dynamic_axes"] = {spec.input_name: {0: "batch"}}
    else:
        kwargs.update(dynamo=True, external_data=False, verbose=False)
        if spec.dynamic_batch:
            kwargs["dynamic_shapes"] = {spec.input_name: {0: torch.export.Dim("batch")}}
    # The exporters print progress, deprecation notes and log lines about optional
    # packages (torchvision); keep the caller's output clean.
    onnx_logger = logging.getLogger("torch.onnx")
    level = onnx_logger.level
    onnx_logger.setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(net, (x,), str(path), **kwargs)
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelError(f"exporting the example {name} to ONNX failed: {first}") from None
        finally:
            onnx_logger.setLevel(level)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tunefarm.models.examples", description="Write an example model as ONNX."
    )
    parser.add_argument("name", nargs="?", help="example model name (see --list)")
    parser.add_argument("--out", help="output .onnx file (default: NAME.onnx)")
    parser.add_argument("--list", action="store_true", help="list the example models")
    args = parser.parse_args(argv)
    if args.list or not args.name:
        for m in EXAMPLES.values():
            shape = "x".join(map(str, m.input_shape))
            print(f"{m.name:16} {m.input_name}={shape:12} {m.summary}")
        return 0
    try:
        path = export_example(args.name, args.out or f"{args.name}.onnx")
    except (UsageError, ModelError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
