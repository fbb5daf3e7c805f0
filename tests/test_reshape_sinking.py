"""Elementwise chains after a flattened MatMul fuse into it (tunefarm.models.reshape_sinking):
the tasks a model gets, and the built model still equal to onnxruntime's."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxslim")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from tunefarm.models.build import build_default_library  # noqa: E402
from tunefarm.models.importer import import_model  # noqa: E402
from tunefarm.models.reshape_sinking import _regrouped_in_front  # noqa: E402
from tunefarm.models.runtime import check_library  # noqa: E402
from tunefarm.models.tasks import extract_tasks  # noqa: E402

TARGET = {"kind": "llvm", "num-cores": 2}


def _model(nodes, initializers, out_shape):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)
    graph = helper.make_graph(nodes, "g", [x], [y], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _const(name, value):
    return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)


def _shape(name, dims):
    return numpy_helper.from_array(np.asarray(dims, dtype=np.int64), name)


def dense_gelu_residual() -> bytes:
    """What exporters make of a transformer's dense layer on 1x4x8: flatten, MatMul, bias,
    reshape back, GELU (x * 0.5 * (1 + erf(x / sqrt 2))), residual add, softmax."""
    rng = np.random.default_rng(0)
    init = [_const("w", rng.standard_normal((8, 8))), _const("b", rng.standard_normal(8)), _const("sqrt2", 1.4142135),
            _const("one", 1.0), _const("half", 0.5), _shape("flat", [4, 8]), _shape("back", [1, 4, 8])]  # fmt: skip
    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["xf"]),
        helper.make_node("MatMul", ["xf", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["mb"]),
        helper.make_node("Reshape", ["mb", "back"], ["h"]),
        helper.make_node("Div", ["h", "sqrt2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["half", "e1"], ["e2"]),
        helper.make_node("Mul", ["h", "e2"], ["g"]),
        helper.make_node("Add", ["x", "g"], ["r"]),
        helper.make_node("Softmax", ["r"], ["y"], axis=-1),
    ]
    return _model(nodes, init, [1, 4, 8])


def regrouped_trailing() -> bytes:
    """A reshape that splits the last dimension (4x8 -> 1x4x2x4) before a bias over the new
    last one: the bias cannot be read at the flattened positions, so nothing sinks."""
    rng = np.random.default_rng(1)
    init = [_const("w", rng.standard_normal((8, 8))), _const("b4", rng.standard_normal(4)),
            _shape("flat", [4, 8]), _shape("split", [1, 4, 2, 4])]  # fmt: skip
    nodes = [
        helper.make_node("Reshape", ["x", "flat"], ["xf"]),
        helper.make_node("MatMul", ["xf", "w"], ["m"]),
        helper.make_node("Reshape", ["m", "split"], ["s"]),
        helper.make_node("Add", ["s", "b4"], ["y"]),
    ]
    return _model(nodes, init, [1, 4, 2, 4])


def _tasks_and_check(onnx_bytes: bytes, tmp_path):
    model = import_model(onnx_bytes, name="net")
    tasks = extract_tasks(model)
    built = build_default_library(tasks.fused_mod, tmp_path / "net", target=TARGET, inputs=model.inputs,
                                  outputs=model.outputs, name="net")  # fmt: skip
    return tasks, check_library(built.directory, onnx_bytes)


def test_gelu_and_the_residual_add_fuse_into_the_flattened_matmul(tmp_path):
    tasks, check = _tasks_and_check(dense_gelu_residual(), tmp_path)
    names = [t.name for t in tasks.tasks]
    # one kernel for the matmul with its bias, GELU and the residual add; the softmax
    # (not position-wise) stays its own; no elementwise or copy kernel in between
    assert len(names) == 2, names
    dense = next(t for t in tasks.tasks if t.name.startswith("fused_matmul"))
    assert all(op in dense.name for op in ("erf", "multiply", "add")), dense.name
    assert check.ok, check.problem()


def test_a_bias_over_a_split_dimension_is_not_moved_and_the_model_stays_right(tmp_path):
    tasks, check = _tasks_and_check(regrouped_trailing(), tmp_path)
    assert check.ok, check.problem()
    assert not any("matmul" in t.name and "add" in t.name for t in tasks.tasks), [t.name for t in tasks.tasks]


@pytest.mark.parametrize(
    ("shape", "out", "base", "same_positions"),
    [
        ((), (1, 4, 8), (4, 8), True),  # a scalar
        ((8,), (1, 4, 8), (4, 8), True),  # a bias over the last dimension, kept by the reshape
        ((4, 8), (1, 4, 8), (4, 8), True),  # spans the dimensions the reshape kept
        ((4,), (1, 4, 2, 4), (4, 8), False),  # the reshape split the last dimension
        ((2, 4), (1, 4, 2, 4), (4, 8), False),  # spanning both halves: it would need a reshape too
        ((4, 1), (1, 4, 8), (4, 8), True),  # a per-row value, rows kept
        ((4, 8), (2, 2, 8), (4, 8), False),  # the rows were regrouped in front of its span
    ],
)
def test_which_broadcast_operands_read_the_same_values_after_the_reshape(shape, out, base, same_positions):
    assert _regrouped_in_front(shape, out, base) is same_positions
    if same_positions:  # numpy agrees: broadcasting then reshaping == reshaping then broadcasting
        operand = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
        x = np.random.default_rng(0).standard_normal(out).astype(np.float32)
        assert np.array_equal((x + operand).reshape(base), x.reshape(base) + operand)
