"""Tiny hand-made ONNX graphs for the farm's tests (no torch export needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def tiny_onnx(path: Path, *, op: str = "Relu", dynamic: bool = True) -> Path:
    """conv3x3+relu then conv1x1+relu on a 1x3x8x8 input (four tasks: the two, and the
    transposes to NHWC and back); `op` replaces the first relu (an operator TVM does not
    know makes an unsupported model); `dynamic` leaves the batch dimension symbolic ("N")."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((4, 4, 1, 1)).astype(np.float32), "w2")
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node(op, ["c1"], ["r1"], name="act1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2"),
        helper.make_node("Relu", ["c2"], ["y"], name="act2"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N" if dynamic else 1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "tiny", [x], [y], [w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def gpu_mix_onnx(path: Path) -> Path:
    """A small network of the operators a GPU model is made of: a 3x3 convolution (+relu),
    a matmul on its flattened rows, layer norm and softmax, on a 1x3x8x8 input."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    consts = {
        "w": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
        "shape": np.array([8, 64], dtype=np.int64),
        "m": rng.standard_normal((64, 16)).astype(np.float32),
        "gamma": rng.standard_normal(16).astype(np.float32),
        "beta": rng.standard_normal(16).astype(np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "shape"], ["rows"], name="rows"),
        helper.make_node("MatMul", ["rows", "m"], ["mm"], name="matmul"),
        helper.make_node("LayerNormalization", ["mm", "gamma", "beta"], ["ln"], axis=-1, epsilon=1e-5, name="ln"),
        helper.make_node("Softmax", ["ln"], ["y"], axis=-1, name="softmax"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    graph = helper.make_graph(nodes, "gpu_mix", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def matmul_mlp_onnx(path: Path) -> Path:
    """Two dense layers on a 32x64 input whose extents are multiples of 16: a MatMul with
    bias and relu, then a Gemm with a transposed weight (transB), 64 -> 128 -> 64."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    consts = {
        "w1": rng.standard_normal((64, 128)).astype(np.float32) / 8,
        "b1": rng.standard_normal(128).astype(np.float32),
        "w2": rng.standard_normal((64, 128)).astype(np.float32) / 8,
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="dense1"),
        helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
        helper.make_node("Relu", ["hb"], ["r"], name="relu1"),
        helper.make_node("Gemm", ["r", "w2"], ["y"], transB=1, name="dense2"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    graph = helper.make_graph(nodes, "matmul_mlp", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path
