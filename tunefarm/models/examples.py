"""Example models, generated here with PyTorch and exported to ONNX (nothing is downloaded).

    python -m tunefarm.models.examples --list
    python -m tunefarm.models.examples resnet18 --out resnet18.onnx

Every model is built by the code in `tunefarm.models.zoo` with fixed, seeded random weights (batch-norm
statistics included, so no layer is an identity), put in eval mode and exported by
`export_example`. Models:

- ``resnet18``, ``resnet50``: ResNet-18 (basic blocks) and ResNet-50 (bottlenecks),
  1x3x224x224, written out here, no torchvision.
- ``mobilenet_v2``: MobileNetV2 (inverted residuals, depthwise convolutions, ReLU6);
  ``mobilenet_v3``: MobileNetV3-Small (hard-swish, squeeze-and-excitation with
  hard-sigmoid), both 1x3x224x224.
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
import importlib
import io
import logging
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


def _net(module: str, cls: str, *args: Any) -> Callable[[], Any]:
    """A builder of the network class `cls` of `tunefarm.models.zoo.<module>` (imported
    when built: importing this module does not import torch)."""

    def build() -> Any:
        _torch()  # a clear error when PyTorch is missing
        return getattr(importlib.import_module(f"tunefarm.models.zoo.{module}"), cls)(*args)

    return build


EXAMPLES: dict[str, ExampleModel] = {
    m.name: m
    for m in (
        ExampleModel("resnet18", "ResNet-18, 1x3x224x224", "x", (1, 3, 224, 224), _net("resnet", "ResNet18")),
        ExampleModel(
            "resnet50", "ResNet-50 (bottleneck blocks), 1x3x224x224", "x", (1, 3, 224, 224), _net("resnet", "ResNet50")
        ),
        ExampleModel(
            "mobilenet_v2",
            "MobileNetV2 (depthwise convs, ReLU6), 1x3x224x224",
            "x",
            (1, 3, 224, 224),
            _net("mobilenet", "MobileNetV2"),
        ),
        ExampleModel(
            "mobilenet_v3",
            "MobileNetV3-Small (hard-swish, squeeze-and-excitation), 1x3x224x224",
            "x",
            (1, 3, 224, 224),
            _net("mobilenet", "MobileNetV3Small"),
        ),
        ExampleModel("bert_layer", "one BERT-base encoder layer, 1x128x768", "x", (1, 128, 768), _net("transformer", "BertLayer")),
        ExampleModel(
            "small_cnn", "4 conv+bn+relu, pooling, linear head, 1x3x32x32", "x", (1, 3, 32, 32), _net("small", "SmallCNN")
        ),
        ExampleModel(
            "conv_bn_relu",
            "stem + 2 identical conv+bn+relu blocks, 1x3x16x16",
            "x",
            (1, 3, 16, 16),
            _net("small", "conv_bn_relu_net"),
        ),
        ExampleModel(
            "reshape_pattern",
            "dynamic batch, Reshape target computed from Shape/Gather/Concat, 1x3x16x16",
            "x",
            (1, 3, 16, 16),
            _net("small", "ReshapePattern"),
            dynamic_batch=True,
            legacy_exporter=True,
        ),
        ExampleModel(
            "dbnet",
            "DBNet text detector: ResNet-style backbone, FPN (nearest + bilinear Resize, concat), "
            "ConvTranspose+sigmoid heads, 1x3x256x256",
            "x",
            (1, 3, 256, 256),
            _net("detectors", "DBNet", (16, 32, 64, 128), 64),
            output_names=("prob", "thresh"),
        ),
        ExampleModel(
            "dbnet_tiny",
            "dbnet's structure with two stages of one block, 8-16 channels, 1x3x32x32 (for tests)",
            "x",
            (1, 3, 32, 32),
            _net("detectors", "DBNet", (8, 16), 16, 1),
            output_names=("prob", "thresh"),
        ),
        ExampleModel(
            "yolov8n_like",
            "YOLOv8n-style detector (C2f, SiLU, SPPF, FPN/PAN, DFL heads), 1x3x320x320",
            "x",
            (1, 3, 320, 320),
            _net("detectors", "YoloV8nLike", 320),
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
    from tunefarm.models.zoo.layers import randomize_norms

    spec = get_example(name)
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        net = spec.build()
        randomize_norms(net)
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
            shape = ",".join(map(str, m.input_shape))  # as --input-shape takes it
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
