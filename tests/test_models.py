"""Whole models: ONNX/PyTorch import and its error messages, task extraction and sharing,
building a model with one task scheduled, and checking it against onnxruntime.

Small models only (conv_bn_relu, reshape_pattern, a tiny MLP, hand-made ONNX graphs).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxslim")

import tvm  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from tunefarm.errors import ModelError, UsageError  # noqa: E402
from tunefarm.models import examples  # noqa: E402
from tunefarm.models.build import apply_schedules, build_model_library  # noqa: E402
from tunefarm.models.importer import import_model, random_inputs, run_onnxruntime  # noqa: E402
from tunefarm.models.runtime import check_library, run_model  # noqa: E402
from tunefarm.models.tasks import canonical_name, extract_tasks, merge_tasks  # noqa: E402

TARGET = {"kind": "llvm", "num-cores": 2}


@pytest.fixture(scope="module")
def conv_bn_relu_onnx(tmp_path_factory) -> bytes:
    pytest.importorskip("torch")
    path = examples.export_example("conv_bn_relu", tmp_path_factory.mktemp("models") / "conv_bn_relu.onnx")
    return path.read_bytes()


@pytest.fixture(scope="module")
def reshape_pattern_path(tmp_path_factory):
    pytest.importorskip("torch")
    return examples.export_example(
        "reshape_pattern", tmp_path_factory.mktemp("models") / "reshape_pattern.onnx"
    )


def _graph_model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _gemm_relu_model():
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((16, 8)).astype("float32"), "w")
    b = numpy_helper.from_array(rng.standard_normal(8).astype("float32"), "b")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"]), helper.make_node("Relu", ["g"], ["y"])]
    return _graph_model(nodes, [x], [y], [w, b])


def _changed_weights(model, *args, **kwargs):
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.full(8, 5.0, np.float32), "b"))
    return out


def _failing_slim(model, *args, **kwargs):
    raise RuntimeError("simplifier bug")


# -- task extraction ---------------------------------------------------------------------------


def test_conv_bn_relu_tasks(conv_bn_relu_onnx):
    model = import_model(conv_bn_relu_onnx, name="net")
    assert [t.name for t in model.inputs] == ["x"] and model.inputs[0].shape == (1, 3, 16, 16)
    assert model.outputs[0].shape == (1, 8, 16, 16) and model.warnings == ()
    tasks = extract_tasks(model)
    # the input to NHWC, the stem, the repeated block, the output back to the model's NCHW
    assert [t.weight for t in tasks.tasks] == [1, 1, 2, 1]
    to_nhwc, stem, block, to_nchw = tasks.tasks
    assert to_nhwc.name == "transpose(1x3x16x16)" and to_nchw.name == "transpose(1x16x16x8)"
    assert stem.name == "fused_conv2d_add_relu(1x16x16x3,8x3x3x3,1x1x1x8)"  # NHWC data, OHWI weights
    assert block.name == "fused_conv2d_add_relu(1x16x16x8,8x3x3x8,1x1x1x8)"
    assert stem.const_inputs == block.const_inputs == (1, 2)  # weight and bias, not the activation
    assert block.flops == pytest.approx(2 * 8 * 8 * 9 * 16 * 16, rel=0.2)
    assert all(len(t.global_vars) == 1 for t in tasks.tasks)
    rows = tasks.table()
    assert [r.weight for r in rows] == [1, 1, 2, 1]
    assert sum(r.share for r in rows) == pytest.approx(1.0)
    assert rows[2].total_flops == pytest.approx(2 * block.flops)
    # each task is an ordinary PrimFunc workload: the weights are inputs, the output last
    assert [tuple(s.shape) for s in block.workload.inputs] == [(1, 16, 16, 8), (8, 3, 3, 8), (1, 1, 1, 8)]
    assert block.workload.outputs[0].shape == (1, 16, 16, 8)
    # the model's own layout, on request
    as_exported = extract_tasks(model, conv_layouts=None)
    assert [t.name for t in as_exported.tasks] == [
        "fused_conv2d_add_relu(1x3x16x16,8x3x3x3,1x8x1x1)", "fused_conv2d_add_relu(1x8x16x16,8x8x3x3,1x8x1x1)"
    ]


def test_identical_subgraphs_get_identical_keys_and_merge(conv_bn_relu_onnx, tmp_path):
    path = tmp_path / "again.onnx"
    path.write_bytes(conv_bn_relu_onnx)
    a = extract_tasks(import_model(conv_bn_relu_onnx, name="a"))
    b = extract_tasks(import_model(path))
    assert b.name == "again"
    assert [t.key for t in a.tasks] == [t.key for t in b.tasks]
    shared = merge_tasks([a, b])
    assert [s.key for s in shared] == [t.key for t in a.tasks]
    assert [s.weights for s in shared][1:3] == [(("a", 1), ("again", 1)), (("a", 2), ("again", 2))]
    assert [s.weight for s in shared] == [2, 2, 4, 2]
    assert shared[2].const_inputs == (1, 2)


def test_canonical_name_strips_fusetir_numbering():
    assert canonical_name("fused_conv2d10_add7_add8_relu4") == "fused_conv2d_add_add_relu"
    assert canonical_name("reshape4") == "reshape"
    assert canonical_name("max_pool2d") == "max_pool2d"
    assert canonical_name("layer_norm1") == "layer_norm"


# -- ONNX import and its errors --------------------------------------------------------------------


def test_reshape_pattern_needs_input_shape(reshape_pattern_path):
    with pytest.raises(UsageError) as err:
        import_model(reshape_pattern_path)
    text = str(err.value)
    assert "'x'" in text and "0 ('batch')" in text and "--input-shape x=" in text and "\n" not in text

    model = import_model(reshape_pattern_path, {"x": (2, 3, 16, 16)})
    assert model.inputs[0].shape == (2, 3, 16, 16) and model.outputs[0].shape == (2, 10)
    assert model.warnings == ()
    # the converted graph is the simplified one: no shape arithmetic left
    ops = {n.op_type for n in onnx.load_from_string(model.onnx_bytes).graph.node}
    assert not ops & {"Shape", "Gather", "ReduceProd"}
    tasks = extract_tasks(model)
    assert tasks.tasks and all(t.workload.inputs[0].shape[0] == 2 for t in tasks.tasks[:1])


def test_reshape_pattern_is_rejected_by_tvm_without_simplification(reshape_pattern_path):
    from tunefarm.models.importer import _convert_onnx

    raw = onnx.load(str(reshape_pattern_path))
    with pytest.raises(ModelError, match="ReduceProd"):
        _convert_onnx(raw, {"x": (1, 3, 16, 16)})


@pytest.mark.parametrize(
    ("shapes", "words"),
    [
        ({"x": (1, 3, 16)}, ["rank 3", "rank 4"]),
        ({"x": (1, 4, 16, 16)}, ["contradicts", "dimension(s) 1"]),
        ({"x": (1, 3, 16, 16), "y": (1,)}, ["'y'", "inputs are 'x'"]),
    ],
)
def test_bad_input_shapes(reshape_pattern_path, shapes, words):
    with pytest.raises(UsageError) as err:
        import_model(reshape_pattern_path, shapes)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_malformed_and_truncated_files(conv_bn_relu_onnx, tmp_path):
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(conv_bn_relu_onnx[: len(conv_bn_relu_onnx) // 3])
    text = tmp_path / "text.onnx"
    text.write_text("this is not a model\n" * 20)
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    for source in (truncated, text, empty, b"\x08\x07\xff\xff garbage", tmp_path / "missing.onnx"):
        with pytest.raises(ModelError) as err:
            import_model(source)
        message = str(err.value)
        assert "\n" not in message and "Traceback" not in message
        assert "not a valid ONNX model" in message or "no such file" in message


def test_unsupported_operator_names_op_and_node():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu_0"),
        helper.make_node("Celu", ["r"], ["y"], name="my_celu", alpha=0.5),
    ]
    with pytest.raises(ModelError) as err:
        import_model(_graph_model(nodes, [x], [y]))
    assert "Celu" in str(err.value) and "'my_celu'" in str(err.value)


def test_converter_failure_names_the_node():
    # Pad whose pads come from a graph input: TVM's Pad converter raises "Dynamic pads"
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    pads = helper.make_tensor_value_info("pads", TensorProto.INT64, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu_0"),
        helper.make_node("Pad", ["r", "pads"], ["y"], name="the_pad"),
    ]
    with pytest.raises(ModelError) as err:
        import_model(_graph_model(nodes, [x, pads], [y]))
    assert "'the_pad' (Pad)" in str(err.value) and "\n" not in str(err.value)


def test_onnx_helper_model_converts_and_matches_onnxruntime():
    model = import_model(_gemm_relu_model(), {"x": (3, 16)})
    assert [(t.name, t.shape) for t in model.outputs] == [("y", (3, 8))]
    feeds = random_inputs({"x": (3, 16)}, {"x": "float32"})
    vm = tvm.relax.VirtualMachine(tvm.compile(model.mod, tvm.target.Target(TARGET)), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(feeds["x"])).numpy()
    np.testing.assert_allclose(got, run_onnxruntime(model.onnx_bytes, feeds)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("slim", "words"), [(_changed_weights, "changes output 0"), (_failing_slim, "simplifier bug")]
)
def test_simplifier_problems_fall_back_with_a_warning(monkeypatch, slim, words):
    import onnxslim

    monkeypatch.setattr(onnxslim, "slim", slim)
    model = import_model(_gemm_relu_model(), {"x": (3, 16)})
    assert len(model.warnings) == 1 and words in model.warnings[0] and "unsimplified" in model.warnings[0]
    assert model.onnx_bytes == _gemm_relu_model().SerializeToString()  # the original graph was converted


# -- PyTorch import --------------------------------------------------------------------------------


def test_torch_module_import():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    x = torch.randn(2, 16)
    model = import_model(net, example_inputs=(x,), name="mlp")
    assert model.name == "mlp" and model.onnx_bytes is None
    assert [t.shape for t in model.inputs] == [(2, 16)] and [t.shape for t in model.outputs] == [(2, 4)]
    tasks = extract_tasks(model)
    assert [t.weight for t in tasks.tasks] == [1, 1]
    assert all(t.const_inputs == (1, 2) for t in tasks.tasks)  # weight and bias of each linear
    vm = tvm.relax.VirtualMachine(tvm.compile(tasks.fused_mod, tvm.target.Target(TARGET)), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x.numpy()))
    out = out[0] if not isinstance(out, tvm.runtime.Tensor) else out
    with torch.no_grad():
        np.testing.assert_allclose(out.numpy(), net(x).numpy(), rtol=1e-5, atol=1e-5)


# -- schedules and building ------------------------------------------------------------------------


def _schedule_output_block(workload) -> list:
    """A real schedule of the workload's last block: fuse+parallel the outer loops, split and
    vectorize the innermost one. Returns the trace as plain JSON data."""
    sch = tvm.s_tir.Schedule(workload.mod)
    block = sch.get_child_blocks(sch.get_sblock("root"))[-1]
    loops = sch.get_loops(block)
    sch.parallel(sch.fuse(loops[0], loops[1]))
    _, inner = sch.split(loops[-1], factors=[None, 8])
    sch.vectorize(inner)
    return json.loads(json.dumps(sch.trace.as_json(), default=lambda o: o.value))


def test_apply_schedules_replaces_only_the_scheduled_task(conv_bn_relu_onnx):
    tasks = extract_tasks(import_model(conv_bn_relu_onnx))
    _, stem, block, _ = tasks.tasks
    before = tasks.fused_mod[block.global_vars[0]]
    scheduled = apply_schedules(
        tasks.fused_mod,
        {
            block.key: _schedule_output_block(block.workload),
            stem.key: None,
            "other#0000000000000000": [[], []],
        },
    )
    new = scheduled[block.global_vars[0]]
    assert tvm_ffi_equal(tasks.fused_mod[block.global_vars[0]], before)  # input not mutated
    assert not tvm_ffi_equal(new, before)
    assert bool(new.attrs["tirx.is_scheduled"]) and "global_symbol" not in new.attrs
    assert all(new.attrs[k] == v for k, v in before.attrs.items())  # the fused function's own attrs
    assert tvm_ffi_equal(scheduled[stem.global_vars[0]], tasks.fused_mod[stem.global_vars[0]])


def test_apply_schedules_bad_trace_names_the_task(conv_bn_relu_onnx):
    tasks = extract_tasks(import_model(conv_bn_relu_onnx))
    bad = [[["GetSBlock", [], ["no_such_block", "main"], ["b0"]]], []]
    with pytest.raises(ModelError, match="does not replay"):
        apply_schedules(tasks.fused_mod, {tasks.tasks[1].key: bad}, tasks=tasks)


def tvm_ffi_equal(a, b) -> bool:
    import tvm_ffi

    return bool(tvm_ffi.structural_equal(a, b))


@pytest.mark.slow
def test_build_tuned_model_matches_onnxruntime(conv_bn_relu_onnx, tmp_path):
    model = import_model(conv_bn_relu_onnx, name="net")
    tasks = extract_tasks(model)
    block = tasks.tasks[1]
    built = build_model_library(
        tasks.fused_mod,
        tmp_path / "net",
        target=TARGET,
        inputs=model.inputs,
        outputs=model.outputs,
        schedules={block.key: _schedule_output_block(block.workload)},
        name="net",
    )
    assert built.library.is_file() and built.scheduled_tasks == (block.key,)
    manifest = json.loads(built.manifest.read_text())
    assert manifest["inputs"] == [{"name": "x", "shape": [1, 3, 16, 16], "dtype": "float32"}]
    assert manifest["outputs"][0]["shape"] == [1, 8, 16, 16] and len(manifest["usage"]) == 3
    check = check_library(built.directory, model.onnx_bytes)
    assert check.ok and check.max_abs_error < 1e-4, check.problem()
    assert {e.input_kind for e in check.errors} == {"normal", "uniform", "pixels"}
    run = run_model(built.directory, random_inputs({"x": (1, 3, 16, 16)}, {"x": "float32"}), repeat=5)
    assert run.outputs[0].shape == (1, 8, 16, 16)
    lat = run.latency
    assert lat is not None and lat.runs == 5 and lat.threads == 2
    assert 0 < lat.median <= lat.p90 <= lat.p99 and lat.mean > 0


@pytest.mark.slow
def test_build_failure_is_a_model_error(conv_bn_relu_onnx, tmp_path):
    model = import_model(conv_bn_relu_onnx)
    tasks = extract_tasks(model)
    with pytest.raises(ModelError, match="building"):
        build_model_library(
            tasks.fused_mod,
            tmp_path / "x",
            target={"kind": "no_such_kind"},
            inputs=model.inputs,
            outputs=model.outputs,
        )


# -- the examples module ------------------------------------------------------------------------------


def test_examples_list_and_unknown_name(capsys):
    assert examples.main(["--list"]) == 0
    listed = capsys.readouterr().out
    for name in ("resnet18", "mobilenet_v2", "bert_layer", "small_cnn", "conv_bn_relu", "reshape_pattern"):
        assert name in listed
    with pytest.raises(UsageError, match="unknown example"):
        examples.export_example("no_such_model", "x.onnx")
