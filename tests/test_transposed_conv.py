"""Transposed convolutions in sub-pixel form (tunefarm.models.transposed_conv) and the
transposes around them moved and cancelled (tunefarm.models.transpose_sinking): the
compute against PyTorch, the tasks a model gets, and the built model against onnxruntime."""

from __future__ import annotations

import math

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from tunefarm.models.build import build_default_library  # noqa: E402
from tunefarm.models.importer import import_model  # noqa: E402
from tunefarm.models.runtime import check_library  # noqa: E402
from tunefarm.models.tasks import extract_tasks  # noqa: E402
from tunefarm.models.transpose_sinking import composed_axes, is_identity, moves_only_unit_dims  # noqa: E402
from tunefarm.models.transposed_conv import subpixel_compute, subpixel_weights  # noqa: E402

TARGET = {"kind": "llvm", "num-cores": 2}


def _reference(x, w, strides, pads, output_padding):
    """ConvTranspose by its definition: every input pixel scatters its kernel window."""
    n, c, h, wd = x.shape
    _, o, kh, kw = w.shape
    (sh, sw), (pt, pl, pb, pr), (oph, opw) = strides, pads, output_padding
    full = np.zeros((n, o, (h - 1) * sh + kh + oph, (wd - 1) * sw + kw + opw), dtype=np.float64)
    for i in range(h):
        for j in range(wd):
            full[:, :, i * sh : i * sh + kh, j * sw : j * sw + kw] += np.einsum("nc,cokl->nokl", x[:, :, i, j], w)
    return full[:, :, pt : full.shape[2] - pb, pl : full.shape[3] - pr]


@pytest.mark.parametrize(
    ("c", "o", "h", "w", "kernel", "strides", "pads", "output_padding"),
    [
        (8, 16, 6, 5, (2, 2), (2, 2), (0, 0, 0, 0), (0, 0)),  # the upsampling head's 2x2/2
        (4, 5, 7, 6, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),  # kernel not a multiple of the stride
        (3, 2, 5, 5, (4, 4), (2, 2), (1, 1, 1, 1), (0, 0)),  # 4x4/2, padding 1 (GAN/FCN upsampling)
        (3, 2, 5, 6, (3, 3), (1, 1), (1, 1, 1, 1), (0, 0)),  # stride 1: a convolution
        (2, 3, 4, 5, (5, 3), (3, 2), (2, 1, 2, 1), (2, 1)),  # unequal strides and kernel sides
        (2, 2, 3, 3, (1, 1), (3, 3), (0, 0, 0, 0), (2, 2)),  # output padding past the last input
    ],
)
def test_the_subpixel_compute_equals_the_transposed_convolution(c, o, h, w, kernel, strides, pads, output_padding):
    import tvm
    from tvm import te

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, c, h, w)).astype(np.float32)
    weight = rng.standard_normal((c, o, *kernel)).astype(np.float32)
    ref = _reference(x, weight, strides, pads, output_padding)
    v = subpixel_weights(weight, strides)
    m = [math.ceil(k / s) for k, s in zip(kernel, strides, strict=True)]
    assert v.shape == (*strides, *m, c, o)
    data, packed = te.placeholder((1, h, w, c), name="x"), te.placeholder(v.shape, name="v")
    out = subpixel_compute(data, packed, ref.shape[2:], (pads[0], pads[1]))
    f = tvm.compile(te.create_prim_func([data, packed, out]), target="llvm")
    got = tvm.runtime.empty((1, *ref.shape[2:], o), "float32")
    f(tvm.runtime.tensor(np.ascontiguousarray(x.transpose(0, 2, 3, 1))), tvm.runtime.tensor(v), got)
    np.testing.assert_allclose(got.numpy().transpose(0, 3, 1, 2), ref, rtol=1e-5, atol=1e-5)


def _upsampling_head() -> bytes:
    """conv 3x3 (NHWC after layout conversion) -> ConvTranspose 2x2/2 with bias -> Relu ->
    ConvTranspose 3x3/2 pad 1 output_padding 1 to one channel -> Sigmoid: a segmentation head."""
    rng = np.random.default_rng(2)
    init = [
        numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w0"),
        numpy_helper.from_array(rng.standard_normal((8, 8, 2, 2)).astype(np.float32) * 0.3, "w1"),
        numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((8, 1, 3, 3)).astype(np.float32) * 0.3, "w2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"]),
        helper.make_node("ConvTranspose", ["r0", "w1", "b1"], ["t1"], strides=[2, 2]),
        helper.make_node("Relu", ["t1"], ["r1"]),
        helper.make_node("ConvTranspose", ["r1", "w2"], ["t2"], strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1]),
        helper.make_node("Sigmoid", ["t2"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 32, 32])
    model = helper.make_model(helper.make_graph(nodes, "head", [x], [y], init), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def test_an_upsampling_head_gets_subpixel_kernels_with_their_epilogues_and_no_copy_kernels(tmp_path):
    onnx_bytes = _upsampling_head()
    model = import_model(onnx_bytes, name="head")
    tasks = extract_tasks(model)
    names = [t.name for t in tasks.tasks]
    # the input's transpose to NHWC, one conv, two transposed convs: no transpose between them
    assert len(names) == 4, names
    assert sum(n.startswith("transpose") for n in names) == 1, names
    tconvs = [t for t in tasks.tasks if "conv2d_transpose" in t.name]
    assert len(tconvs) == 2, names
    assert "relu" in tconvs[0].name and "sigmoid" in tconvs[1].name, names  # epilogues fused
    # multiply-adds only on the input's values: 2x2/2 -> 1 tap per output, 3x3/2 -> 2x2
    # taps (over the zero-dilated input they would be 2x2 and 3x3), plus the epilogue's
    for task, macs in zip(tconvs, (16 * 16 * 8 * 8 * 1, 32 * 32 * 1 * 8 * 4), strict=True):
        assert 2 * macs <= task.workload.flops <= 2.5 * macs, (task.name, task.workload.flops)
    built = build_default_library(tasks.fused_mod, tmp_path / "head", target=TARGET, inputs=model.inputs,
                                  outputs=model.outputs, name="head")  # fmt: skip
    check = check_library(built.directory, onnx_bytes)
    assert check.ok, check.problem()


@pytest.mark.parametrize(
    ("inner", "outer"),
    [((0, 3, 1, 2), (0, 2, 3, 1)), ((0, 2, 3, 1), (0, 3, 1, 2)), ((2, 0, 1), (1, 2, 0)), ((1, 0, 2), (0, 2, 1))],
)
def test_two_transposes_compose_as_numpy_does(inner, outer):
    x = np.arange(2 * 3 * 4 * (5 if len(inner) == 4 else 1)).reshape((2, 3, 4, 5)[: len(inner)])
    axes = composed_axes(inner, outer)
    assert np.array_equal(x.transpose(inner).transpose(outer), x.transpose(axes))
    assert is_identity(axes) == np.array_equal(x.transpose(axes), x)


@pytest.mark.parametrize(
    ("shape", "axes", "is_reshape"),
    [
        ((1, 256, 256, 1), (0, 3, 1, 2), True),  # a one-channel NHWC output to NCHW
        ((1, 4, 4, 8), (0, 3, 1, 2), False),
        ((1, 1, 5, 1, 7), (4, 0, 1, 2, 3), False),  # the 7 moves in front of the 5
        ((2, 1, 3), (1, 0, 2), True),
    ],
)
def test_a_transpose_moving_only_unit_dimensions_is_a_reshape(shape, axes, is_reshape):
    x = np.arange(int(np.prod(shape))).reshape(shape)
    assert moves_only_unit_dims(shape, axes) is is_reshape
    same_order = np.array_equal(x.transpose(axes).ravel(), x.ravel())
    assert same_order is is_reshape


def _one_channel_head_workload():
    """The sub-pixel 2x2/2 transposed convolution to one channel with a sigmoid: a
    segmentation head's last layer, (1, 16, 16, 8) -> (1, 32, 32, 1)."""
    from tvm import te, topi

    from tunefarm.workloads.base import workload_from_prim_func

    rng = np.random.default_rng(3)
    weight = rng.standard_normal((8, 1, 2, 2)).astype(np.float32)
    v = subpixel_weights(weight, (2, 2))
    data, packed = te.placeholder((1, 16, 16, 8), name="x"), te.placeholder(v.shape, name="v")
    out = topi.sigmoid(subpixel_compute(data, packed, (32, 32), (0, 0)))

    def reference(x, vv):
        ref = _reference(x.transpose(0, 3, 1, 2), weight, (2, 2), (0, 0, 0, 0), (0, 0))
        return [(1 / (1 + np.exp(-ref))).transpose(0, 2, 3, 1).astype(np.float32)]

    wl = workload_from_prim_func("subpixel_sigmoid", te.create_prim_func([data, packed, out]), reference=reference)
    return wl, v


def test_a_one_channel_subpixel_head_is_tiled_and_its_sampled_programs_compute_it(host_target):
    """Its accesses read y through y // 2 and y % 2: reuse although they use every spatial
    iterator, so the search tiles it (it got no tiled sketch, and its best program ran the
    sigmoid scalar and serial); a root epilogue over (1, 32, 32, 1) fuses the trailing unit
    loop and vectorizes the loop before it."""
    import random

    import tvm

    from tunefarm.search.space.dag import needs_multi_level_tiling
    from tunefarm.search.space.realize import realize
    from tunefarm.search.task import make_task

    wl, v = _one_channel_head_workload()
    task = make_task(wl, host_target)
    conv = next(b for b in task.dag.blocks if b.is_reduction)
    assert needs_multi_level_tiling(conv)
    assert all(any(d.startswith("tile ") for d in sk.describe()) for sk in task.sketches)
    rng = np.random.default_rng(4)
    x = rng.uniform(-1, 1, size=(1, 16, 16, 8)).astype(np.float32)
    want = wl.reference(x, v)[0]
    at_root = 0
    for built in task.space.sample_many(8, random.Random(5)):
        ins = built.program.instructions
        epilogue = [i for i in ins if i.block == "compute"]
        if not any(i.op == "reverse_compute_at" for i in epilogue):  # left at the root
            at_root += 1
            ops = [i.op for i in epilogue]
            assert "fuse_last" in ops and "vectorize" in ops, [i.describe() for i in epilogue]
        ex = tvm.compile(realize(wl.mod, ins).mod, target=tvm.target.Target(host_target))
        got = tvm.runtime.empty((1, 32, 32, 1), "float32", tvm.cpu())
        ex["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(v), got)
        np.testing.assert_allclose(got.numpy(), want, rtol=2e-4, atol=2e-5)
    assert at_root, "no sampled program left the epilogue at the root"
