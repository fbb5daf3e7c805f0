"""Models of many small tasks (the YOLO-like detector): the example imports and its tasks
are extracted with SiLU fused into the convolutions."""

from __future__ import annotations

import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

from tunefarm.models import examples  # noqa: E402
from tunefarm.models.importer import import_model  # noqa: E402
from tunefarm.models.tasks import extract_tasks  # noqa: E402


@pytest.fixture(scope="module")
def yolo_tasks(tmp_path_factory):
    path = examples.export_example("yolov8n_like", tmp_path_factory.mktemp("models") / "yolo.onnx")
    imported = import_model(path)
    return imported, extract_tasks(imported), extract_tasks(imported, conv_layouts=None)


@pytest.mark.slow
def test_yolov8n_like_imports_and_its_tasks_are_extracted(yolo_tasks):
    imported, tasks, as_exported = yolo_tasks
    assert imported.input_shapes == {"x": (1, 3, 320, 320)}
    assert [o.shape for o in imported.outputs] == [(1, 84, 2100)]  # 4 box + 80 classes, 40^2 + 20^2 + 10^2 anchors
    assert 50 <= len(tasks.tasks) <= 80
    names = [t.name for t in tasks.tasks]
    convs = [n for n in names if n.startswith("fused_conv2d")]
    assert len(convs) >= 40
    # SiLU (x * sigmoid(x)) lands in the convolutions' epilogues, never in a task of its own
    assert sum("sigmoid_multiply" in n for n in convs) >= 35
    assert not any(n.startswith(("sigmoid", "multiply", "fused_sigmoid")) for n in names)
    assert tasks.total_flops > 1e9  # about 2.2 GFLOPs at 320x320
    # the convolutions compute in NHWC (channels innermost), their weights OHWI
    conv = next(t for t in tasks.tasks if t.name.startswith("fused_conv2d"))
    assert conv.name.startswith("fused_conv2d_add_tir_sigmoid_multiply(1x320x320x3,16x3x3x3,"), conv.name
    assert names[0] == "transpose(1x3x320x320)"  # the model's NCHW input, once
    assert as_exported.total_flops == pytest.approx(tasks.total_flops, rel=0.01)

    # In the model's own NCHW layout, the C2f/SPPF/neck concats and splits are views, not
    # kernels; left: the head's concat along the anchors (144 rows of 3 levels: not
    # contiguous) and the box decoding's concat of 2-row halves (16800-byte slices: not
    # 64-byte aligned), fused with its math
    nchw = [t.name for t in as_exported.tasks]
    assert sum("concatenate" in n or n.startswith("split") for n in nchw) <= 2, nchw
    assert any(n.startswith("split_slices") for n in as_exported.elided)


# -- concat and split as slices of one buffer (tunefarm.models.slices) ---------------------------


def test_contiguous_offsets_need_unit_outer_dims_and_aligned_slices():
    from tunefarm.models.slices import contiguous_offsets

    assert contiguous_offsets([(1, 16, 8, 8), (1, 32, 8, 8)], 1, 4) == [0, 16 * 64 * 4]
    assert contiguous_offsets([(2, 16, 8, 8), (2, 16, 8, 8)], 1, 4) is None  # batch 2: interleaved
    assert contiguous_offsets([(1, 3, 5), (1, 3, 5)], 1, 4) is None  # 60-byte slices: misaligned
    assert contiguous_offsets([(1, 64, 2100), (1, 80, 2100)], -2, 4) == [0, 64 * 2100 * 4]


def _call(binding, whole, pieces, offsets):
    from tunefarm.models.slices import CopyCall

    return CopyCall(binding, "f", whole, tuple(pieces), tuple(offsets))


def test_split_then_concat_puts_the_split_input_into_the_concat_buffer():
    """C2f: x = conv(...); a, b = split(x); m = conv(b); out = concat(a, b, m)."""
    from tunefarm.models.slices import plan_placement

    sizes = {"x": 128, "a": 64, "b": 64, "m": 64, "out": 192}
    plan = plan_placement(
        [_call(1, "x", ["a", "b"], [0, 64]), _call(3, "out", ["a", "b", "m"], [0, 64, 128])], sizes
    )
    assert len(plan.removed) == 2 and not plan.kept
    assert plan.root("x") == ("out", 0) and plan.root("b") == ("out", 64) and plan.root("m") == ("out", 128)


def test_placements_that_cannot_hold_keep_the_copy():
    from tunefarm.models.slices import plan_placement

    sizes = {"a": 64, "b": 64, "out": 128, "out2": 128}
    # a piece that is not the function's own allocation (a parameter or a constant)
    assert plan_placement([_call(1, "out", ["p", "b"], [0, 64])], sizes).kept
    # the same tensor twice
    assert plan_placement([_call(1, "out", ["a", "a"], [0, 64])], sizes).kept
    # a tensor already placed in one concat cannot be in another as well
    plan = plan_placement([_call(1, "out", ["a", "b"], [0, 64]), _call(2, "out2", ["b", "a"], [0, 64])], sizes)
    assert len(plan.removed) == 1 and len(plan.kept) == 1
    # y = f(a) placed over the split input's other slice: overlapping unrelated tensors
    sizes = {"x": 128, "a": 64, "b": 64, "y": 128, "out": 192}
    plan = plan_placement([_call(1, "x", ["a", "b"], [0, 64]), _call(3, "out", ["y", "b"], [0, 128])], sizes)
    assert len(plan.kept) == 1


def _c2f_like_onnx(piece_from_input: bool = False):
    """conv+SiLU -> split -> conv -> concat of all -> conv; max-pool; a nearest 2x Resize
    into a concat; with `piece_from_input` one concat piece is the graph's input itself
    (which cannot be placed: its copy must stay)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def conv(x, cin, cout, k, name):
        w = const(f"{name}_w", (rng.standard_normal((cout, cin, k, k)) * 0.3).astype("float32"))
        b = const(f"{name}_b", rng.standard_normal(cout).astype("float32"))
        nodes.append(helper.make_node("Conv", [x, w, b], [name], pads=[k // 2] * 4))
        nodes.append(helper.make_node("Sigmoid", [name], [f"{name}_s"]))
        nodes.append(helper.make_node("Mul", [name, f"{name}_s"], [f"{name}_silu"]))
        return f"{name}_silu"

    a = conv("x", 16, 32, 1, "c1")
    nodes.append(helper.make_node("Split", [a, const("sp", np.array([16, 16], np.int64))], ["s0", "s1"], axis=1))
    b = conv("s1", 16, 16, 3, "c2")
    pieces = ["x" if piece_from_input else "s0", "s1", b]
    nodes.append(helper.make_node("Concat", pieces, ["cat"], axis=1))
    d = conv("cat", 48, 16, 1, "c3")
    nodes.append(helper.make_node("MaxPool", [d], ["mp"], kernel_shape=[3, 3], pads=[1] * 4, strides=[1, 1]))
    scales = const("scales", np.array([1, 1, 2, 2], np.float32))
    nodes.append(helper.make_node("Resize", ["mp", "", scales], ["up"], mode="nearest"))
    nodes.append(helper.make_node("Resize", [conv("x", 16, 16, 3, "c4"), "", scales], ["up2"], mode="nearest"))
    nodes.append(helper.make_node("Concat", ["up", "up2"], ["y"], axis=1))
    graph = helper.make_graph(
        nodes, "c2f", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _build_and_check(data: bytes, out):
    from tunefarm.models.build import build_default_library
    from tunefarm.models.check import compare_outputs
    from tunefarm.models.finish import load_model, model_inputs
    from tunefarm.models.runtime import run_model

    m = load_model(data, name="c2f", conv_layouts=None)  # NCHW: channel concats are contiguous
    build_default_library(
        m.tasks.fused_mod, out, target={"kind": "llvm", "num-cores": 2}, inputs=m.imported.inputs,
        outputs=m.imported.outputs,
    )
    feeds = model_inputs(m)
    return m, compare_outputs(run_model(out, feeds, repeat=0).outputs, m.reference(feeds), input_kind="normal")


def test_concats_and_splits_become_views_and_the_model_still_matches_onnxruntime(tmp_path):
    m, check = _build_and_check(_c2f_like_onnx(), tmp_path / "views")
    names = [t.name for t in m.tasks.tasks]
    assert not any("concatenate" in n or "split" in n for n in names), names  # no copy kernel to tune or run
    assert any(n.startswith("concatenate_slices") for n in m.tasks.elided)
    assert any(n.startswith("split_slices") for n in m.tasks.elided)
    assert any(n.startswith("resize2d") for n in names)  # the Resize writes into the concat's buffer itself
    assert check and all(e.ok for e in check), [e.describe() for e in check]

    # where its time goes: every kernel call of an inference, by task
    from tunefarm.models.finish import model_inputs
    from tunefarm.models.profile import in_model_breakdown, kernel_symbols, profile_model

    feeds = model_inputs(m)
    prof = profile_model(tmp_path / "views", [feeds["x"]], kernel_symbols(m.tasks), threads=2)
    assert len(prof.calls) == sum(t.weight for t in m.tasks.tasks)
    assert all(c.seconds > 0 and c.warm_seconds > 0 for c in prof.calls)  # in the model's sequence, and warm
    assert prof.latency > 0 and prof.copy_bandwidth > 0 and prof.cached_copy_bandwidth > 0
    rows = in_model_breakdown(m.tasks, prof)
    assert set(rows) == {t.key for t in m.tasks.tasks}
    assert all(r["holds_back"] and r["seconds"] > 0 for r in rows.values())
    resize = next(rows[t.key] for t in m.tasks.tasks if t.name.startswith("resize2d"))
    assert any(h.startswith("data movement") for h in resize["holds_back"])


def test_what_holds_a_task_back_follows_its_measurements():
    from tunefarm.models.profile import holds_back

    def row(seconds_per_call, overhead_share, gbps, gflops, flops_per_byte, calls=1, nbytes=1 << 16):
        return {"seconds_per_call": seconds_per_call, "overhead_share": overhead_share, "gbps": gbps,
                "gflops": gflops, "flops_per_byte": flops_per_byte, "calls": calls, "bytes_per_call": nbytes}

    tiny = holds_back(row(2e-6, 0.7, 5.0, 0.0, 0.0, calls=3), 5e-6, 50e9)
    assert tiny[0].startswith("launch-bound (kernel 2.0 us, 70%") and "data movement: 3 separate kernels" in tiny[1]
    streaming = holds_back(row(50e-6, 0.1, 40.0, 2.0, 0.25, nbytes=8 << 20), 5e-6, 50e9)
    assert streaming[0].startswith("memory-bound (40.0 GB/s vs 50.0 GB/s") and "from memory" in streaming[0]
    assert streaming[1] == "elementwise, unfused: 1 separate kernel of 0.25 FLOP/byte"
    assert holds_back(row(300e-6, 0.02, 3.0, 60.0, 40.0), 5e-6, 50e9) == ["compute (60.0 GFLOPS, 40 FLOP/byte)"]
    # 300 us in the model's sequence against 200 us with its data in cache: cold data, after what else holds it back
    cold = holds_back({**row(300e-6, 0.02, 3.0, 60.0, 40.0), "warm_seconds_per_call": 200e-6}, 5e-6, 50e9)
    assert cold == ["compute (60.0 GFLOPS, 40 FLOP/byte)",
                    "cold data (300.0 us per call in the model's sequence, 200.0 us with its data in cache)"]
    assert len(holds_back({**row(300e-6, 0.02, 3.0, 60.0, 40.0), "warm_seconds_per_call": 250e-6}, 5e-6, 50e9)) == 1


def test_a_concat_of_the_graph_input_keeps_its_copy_and_matches_onnxruntime(tmp_path):
    m, check = _build_and_check(_c2f_like_onnx(piece_from_input=True), tmp_path / "copy")
    kept = [t for t in m.tasks.tasks if t.name.startswith("concatenate_slices")]
    assert len(kept) == 1 and kept[0].weight == 1  # the one whose piece is the input
    assert check and all(e.ok for e in check), [e.describe() for e in check]


# -- one thread for small kernels (tunefarm.search.space.loopnest) ----------------------------------


def test_small_blocks_may_run_on_one_thread_and_stay_correct(host_target):
    import random

    import numpy as np
    import tvm

    from tunefarm.search.space.dag import analyse
    from tunefarm.search.space.loopnest import build
    from tunefarm.search.space.program import InvalidProgram, expected_tvm_loops
    from tunefarm.search.space.realize import realize
    from tunefarm.search.space.sketch import generate_sketches
    from tunefarm.search.space.slots import Decider
    from tunefarm.workloads import registry

    def sample(wl, seed):
        dag = analyse(wl.mod["main"])
        sketch = generate_sketches(dag, 2)[0]
        rng = random.Random(seed)
        for _ in range(100):
            decider = Decider(None, rng)
            try:
                build(dag, sketch, decider, 2)
                return dag, sketch, decider
            except InvalidProgram:
                continue
        raise AssertionError("no valid program")

    big = sample(registry.make("matmul", {"M": 256, "N": 256, "K": 256}), 1)[2]  # 2^24 iterations
    assert all(d.lo >= 1 for s, d in big.domains.items() if s.endswith(".parallel"))

    wl = registry.make("softmax", {"B": 2, "M": 8, "N": 32})
    dag, sketch, decider = sample(wl, 5)
    slots = [s for s in decider.decisions if s.endswith(".parallel")]
    assert slots and all(decider.domains[s].lo == 0 for s in slots)
    serial = build(dag, sketch, Decider({**decider.decisions, **dict.fromkeys(slots, 0)}), 2)
    assert all(kind != "parallel" for loops in expected_tvm_loops(serial).values() for _, kind in loops)
    ex = tvm.compile(realize(wl.mod, serial.instructions).mod, target=tvm.target.Target(host_target))
    x = np.random.default_rng(0).uniform(-1, 1, wl.inputs[0].shape).astype("float32")
    out = tvm.runtime.empty(wl.outputs[0].shape, "float32", tvm.cpu())
    ex["main"](tvm.runtime.tensor(x), out)
    np.testing.assert_allclose(out.numpy(), wl.reference(x)[0], rtol=1e-5, atol=1e-6)
