"""Transposes moved below reshapes, concats, splits, softmax and reductions
(tunefarm.models.transpose_sinking): the rewrites against numpy, and a detection head whose
NCHW reshapes and concats, after its convolutions compute in NHWC, would otherwise put a
transposing copy on every level."""

from __future__ import annotations

import random

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from tunefarm.models.build import build_default_library  # noqa: E402
from tunefarm.models.importer import import_model  # noqa: E402
from tunefarm.models.runtime import check_library  # noqa: E402
from tunefarm.models.tasks import extract_tasks  # noqa: E402
from tunefarm.models.transpose_sinking import reduced_axes_order, reshape_of_transposed  # noqa: E402

TARGET = {"kind": "llvm", "num-cores": 2}


@pytest.mark.parametrize(
    ("shape", "axes", "out"),
    [
        ((1, 40, 40, 144), (0, 3, 1, 2), (1, 144, 1600)),  # an NHWC level flattened as NCHW
        ((1, 2100, 64), (0, 2, 1), (1, 4, 16, 2100)),  # a split of the channels
        ((1, 2100, 64), (0, 2, 1), (64, 2100)),
        ((2, 3, 4), (2, 0, 1), (4, 6)),
        ((3, 1, 4, 1), (3, 2, 1, 0), (1, 2, 2, 3, 1)),
    ],
)
def test_a_reshape_of_a_transpose_is_a_transpose_of_a_reshape(shape, axes, out):
    s, q = reshape_of_transposed(shape, axes, out)
    t = np.arange(np.prod(shape)).reshape(shape)
    assert np.array_equal(t.reshape(s).transpose(q), t.transpose(axes).reshape(out))


def test_random_reshapes_of_transposes_are_rewritten_exactly_or_not_at_all():
    rng = random.Random(0)
    rewritten = 0
    for _ in range(2000):
        shape = tuple(rng.choice([1, 2, 3, 4, 6]) for _ in range(rng.randint(1, 4)))
        axes = list(range(len(shape)))
        rng.shuffle(axes)
        dims = [shape[a] for a in axes]
        total = int(np.prod(shape))
        out = rng.choice([(total,), (1, total), tuple(d for d in dims if d != 1), (*dims, 1), (dims[0], total // dims[0])])
        moved = reshape_of_transposed(shape, axes, out)
        if moved is None:
            continue
        t = np.arange(total).reshape(shape)
        assert np.array_equal(t.reshape(moved[0]).transpose(moved[1]), t.transpose(axes).reshape(out))
        rewritten += 1
    assert rewritten > 1000
    # merging dimensions that are not neighbours in the source: no rewrite
    assert reshape_of_transposed((2, 3, 4), (1, 0, 2), (3, 8)) is None


def test_a_reduction_of_a_transpose_is_a_transpose_of_a_reduction():
    rng = random.Random(1)
    for _ in range(300):
        shape = tuple(rng.choice([1, 2, 3, 4]) for _ in range(rng.randint(1, 4)))
        axes = list(range(len(shape)))
        rng.shuffle(axes)
        reduced = sorted(rng.sample(range(len(shape)), rng.randint(1, len(shape))))
        t = np.random.default_rng(0).standard_normal(shape)
        t_axes, order = reduced_axes_order(axes, reduced)
        np.testing.assert_allclose(t.sum(axis=t_axes).transpose(order), t.transpose(axes).sum(axis=tuple(reduced)))


def _detection_head() -> bytes:
    """Two levels of box (8 channels) and class (5 channels) convolutions, each level's
    outputs concatenated over channels and flattened (NCHW), the levels concatenated,
    split into boxes and classes, a distribution-focal softmax over 4 bins of each box side
    reduced with its bin weights, the classes through a sigmoid: YOLOv8's head in small."""
    rng = np.random.default_rng(5)

    def const(name, value):
        return numpy_helper.from_array(np.asarray(value), name)

    init = [
        const("wb0", rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.5),
        const("wc0", rng.standard_normal((5, 3, 3, 3)).astype(np.float32) * 0.5),
        const("wd", rng.standard_normal((3, 3, 3, 3)).astype(np.float32) * 0.5),
        const("wb1", rng.standard_normal((8, 3, 1, 1)).astype(np.float32)),
        const("wc1", rng.standard_normal((5, 3, 1, 1)).astype(np.float32)),
        const("flat0", np.array([1, 13, 36], np.int64)),
        const("flat1", np.array([1, 13, 9], np.int64)),
        const("sizes", np.array([8, 5], np.int64)),
        const("bins", np.array([1, 2, 4, 45], np.int64)),
        const("weights", np.arange(4, dtype=np.float32).reshape(1, 4, 1, 1)),
        const("axis1", np.array([1], np.int64)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "wb0"], ["b0"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "wc0"], ["c0"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "wd"], ["d"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Conv", ["d", "wb1"], ["b1"]),
        helper.make_node("Conv", ["d", "wc1"], ["c1"]),
        helper.make_node("Concat", ["b0", "c0"], ["l0"], axis=1),
        helper.make_node("Concat", ["b1", "c1"], ["l1"], axis=1),
        helper.make_node("Reshape", ["l0", "flat0"], ["f0"]),
        helper.make_node("Reshape", ["l1", "flat1"], ["f1"]),
        helper.make_node("Concat", ["f0", "f1"], ["levels"], axis=2),
        helper.make_node("Split", ["levels", "sizes"], ["box", "cls"], axis=1),
        helper.make_node("Reshape", ["box", "bins"], ["box4"]),
        helper.make_node("Transpose", ["box4"], ["bins_first"], perm=[0, 2, 1, 3]),
        helper.make_node("Softmax", ["bins_first"], ["p"], axis=1),
        helper.make_node("Mul", ["p", "weights"], ["pw"]),
        helper.make_node("ReduceSum", ["pw", "axis1"], ["dist"], keepdims=0),
        helper.make_node("Sigmoid", ["cls"], ["scores"]),
        helper.make_node("Concat", ["dist", "scores"], ["y"], axis=1),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 7, 45])
    model = helper.make_model(helper.make_graph(nodes, "head", [x], [y], init), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def test_a_detection_heads_transposes_sink_to_its_output(tmp_path):
    onnx_bytes = _detection_head()
    model = import_model(onnx_bytes, name="head")
    tasks = extract_tasks(model)
    names = [t.name for t in tasks.tasks]
    # the input's transpose to NHWC and one at the output; none per level or before the softmax
    assert sum("transpose" in n for n in names) == 2, names
    assert any(n.startswith("transpose(") for n in names), names
    softmax = next(t for t in tasks.tasks if "softmax" in t.name)
    assert tuple(int(d) for d in softmax.workload.inputs[0].shape)[-1] == 4, softmax.shape_summary  # over the last axis
    built = build_default_library(tasks.fused_mod, tmp_path / "head", target=TARGET, inputs=model.inputs,
                                  outputs=model.outputs, name="head")  # fmt: skip
    check = check_library(built.directory, onnx_bytes)
    assert check.ok, check.problem()
