"""The engines a user would deploy instead (`tunefarm.models.peers`): onnxruntime and
OpenVINO run the same ONNX graph, in float32, and OpenVINO's layers are paired with the
tuned model's tasks by shape (`tunefarm.models.peer_layers`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tunefarm.models.peer_layers import PeerLayer, match_tasks, task_signature
from tunefarm.models.peers import ONNXRUNTIME, OPENVINO, available_peers, latency_key, openvino_config


def _task(key: str, inputs: list[tuple[int, ...]], output: tuple[int, ...], const_inputs: tuple[int, ...],
          flops: float = 1e6):  # fmt: skip
    spec = lambda shape: SimpleNamespace(shape=shape)  # noqa: E731
    workload = SimpleNamespace(inputs=[spec(s) for s in inputs], outputs=[spec(output)])
    return SimpleNamespace(key=key, workload=workload, const_inputs=const_inputs, flops=flops)


def test_tasks_are_paired_with_openvino_layers_by_shape_whatever_the_layout():
    conv = _task("conv", [(1, 32, 32, 3), (16, 3, 3, 3), (1, 1, 1, 16)], (1, 32, 32, 16), (1, 2))  # NHWC, OHWI
    dense = _task("dense", [(1, 64), (64, 10), (10,)], (1, 10), (1, 2))
    repeated = _task("block", [(1, 8, 8, 32), (32, 3, 3, 32)], (1, 8, 8, 32), (1,))
    pool = _task("pool", [(1, 32, 32, 16)], (1, 16, 16, 16), ())
    unmatched = _task("softmax", [(1, 10)], (1, 10), ())
    layers = [
        PeerLayer("c0", "Convolution", 28e-6, (1, 16, 32, 32), (16, 3, 3, 3), "node_Conv_0,node_relu"),  # NCHW, OIHW
        PeerLayer("fc", "FullyConnected", 16e-6, (1, 10), (10, 64), "y"),
        PeerLayer("b1", "Convolution", 10e-6, (1, 32, 8, 8), (32, 32, 3, 3), "node_Conv_1"),
        PeerLayer("b2", "Convolution", 14e-6, (1, 32, 8, 8), (32, 32, 3, 3), "node_Conv_2"),
        PeerLayer("p", "Pooling", 5e-6, (1, 16, 16, 16), (), "node_max_pool"),
        PeerLayer("w", "Const", 0.0, (10, 64), (), "weights"),
    ]
    matched = match_tasks([conv, dense, repeated, pool, unmatched], layers)
    assert matched["conv"]["openvino_seconds_per_call"] == pytest.approx(28e-6)
    assert matched["dense"]["openvino_layers"] == ["FullyConnected fc"]
    assert matched["block"]["openvino_seconds_per_call"] == pytest.approx(12e-6)  # the same layer twice: the mean
    assert matched["pool"]["openvino_seconds_per_call"] == pytest.approx(5e-6)
    assert "softmax" not in matched  # the output (1, 10) alone: the FC layer has weights, so no pair
    assert task_signature((1, 32, 32, 16), [(1, 1, 1, 16), (16, 3, 3, 3)]) == ((16, 32, 32), (3, 3, 3, 16))
    assert task_signature((1, 12, 128, 64), []) == ((1, 12, 64, 128), ())  # no weights: every dimension counts


def test_layers_of_different_kinds_with_one_signature_pair_with_no_task():
    """A head-split copy and the attention matmul both write 1x12x128x64 without weights.
    A copy pairs only with a node that moves data, and a matmul only with one that
    computes (a copy kernel once got a 325 us matmul as its peer: "OpenVINO 75x slower");
    two computing kinds with one signature leave the shapes unable to say which is the
    task's layer, so neither is paired."""
    copy = _task("copy", [(128, 768)], (1, 12, 128, 64), (), flops=0.0)
    pv = _task("pv", [(1, 12, 128, 128), (1, 12, 128, 64)], (1, 12, 128, 64), ())
    layers = [
        PeerLayer("t", "Transpose", 6e-6, (1, 12, 128, 64), (), "node_Transpose_1"),
        PeerLayer("mm", "MatMul", 325e-6, (1, 12, 128, 64), (), "node_MatMul_4"),
        PeerLayer("t2", "Transpose", 7e-6, (1, 12, 64, 128), (), "node_Transpose_2"),
    ]
    matched = match_tasks([copy, pv], layers)
    assert matched["copy"]["openvino_layers"] == ["Transpose t", "Transpose t2"]  # one multiset of dimensions
    assert matched["pv"]["openvino_seconds_per_call"] == pytest.approx(325e-6)
    attention = PeerLayer("att", "Subgraph", 150e-6, (1, 128, 12, 64), (), "node_softmax,node_matmul_1")
    assert "pv" not in match_tasks([copy, pv], [*layers, attention])  # MatMul or Subgraph: no pair
    assert match_tasks([copy], [attention]) == {}  # a copy is never a fused attention's peer


def test_a_dense_layer_pairs_with_openvinos_fully_connected_through_its_folded_weights(tmp_path):
    """OpenVINO runs a MatMul by a constant as a FullyConnected whose weights come through
    a Transpose of the Const, and writes the batch-1 output as 1x8x32 where the task's is
    8x32: the weights' shape pairs them all the same."""
    pytest.importorskip("openvino")
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from tunefarm.models.peer_layers import openvino_layers

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])],
        "dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 32])],
        [numpy_helper.from_array(rng.standard_normal((16, 32)).astype("float32"), "w"),
         numpy_helper.from_array(rng.standard_normal(32).astype("float32"), "b")],
    )  # fmt: skip
    path = tmp_path / "dense.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    layers = openvino_layers(path, {"x": rng.standard_normal((1, 8, 16)).astype("float32")}, 1, runs=2)
    dense = [layer for layer in layers if layer.kind == "FullyConnected"]
    assert len(dense) == 1 and sorted(dense[0].const_shape) == [16, 32]
    task = _task("dense", [(8, 16), (16, 32), (32,)], (8, 32), (1, 2))
    assert match_tasks([task], layers)["dense"]["openvino_layers"] == [f"FullyConnected {dense[0].name}"]


def test_openvino_is_a_peer_in_float32_with_the_model_threads():
    config = openvino_config(2, profile=True)
    assert config["INFERENCE_PRECISION_HINT"] == "f32" and config["INFERENCE_NUM_THREADS"] == 2
    assert config["PERFORMANCE_HINT"] == "LATENCY" and config["PERF_COUNT"] is True
    assert ONNXRUNTIME in available_peers()  # the onnx extra
    assert latency_key(OPENVINO) == "openvino_latency"


def test_openvino_reports_each_layer_of_an_example_model(tmp_path):
    pytest.importorskip("openvino")
    pytest.importorskip("torch")
    from tunefarm.models import examples
    from tunefarm.models.finish import load_model, model_inputs
    from tunefarm.models.peer_layers import openvino_layers
    from tunefarm.models.peers import peer_run

    path = examples.export_example("small_cnn", tmp_path / "small_cnn.onnx")
    model = load_model(path, name="small_cnn")
    feeds = model_inputs(model)
    layers = openvino_layers(path, feeds, 2, runs=3)
    convs = [layer for layer in layers if layer.kind == "Convolution"]
    assert len(convs) == 4 and all(layer.seconds > 0 for layer in convs)
    assert {layer.const_shape for layer in convs} >= {(16, 3, 3, 3), (64, 32, 3, 3)}
    matched = match_tasks(model.tasks.tasks, layers)
    conv_tasks = [t for t in model.tasks.tasks if "conv2d" in t.name]
    assert len(conv_tasks) == 4 and all(t.key in matched for t in conv_tasks)
    # OpenVINO's outputs agree with onnxruntime's in float32
    ov, ort = (peer_run(p, str(path), feeds, 2) for p in (OPENVINO, ONNXRUNTIME))
    assert np.allclose(ov[0], ort[0], rtol=1e-4, atol=1e-5)
