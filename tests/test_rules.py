"""Sketch derivation rules on small DAGs (Ansor §4.1)."""

from __future__ import annotations

import pytest
import tvm
from tvm import te, topi

from tunefarm.search.space.dag import analyse, is_strictly_inlineable, needs_multi_level_tiling
from tunefarm.search.space.sketch import (
    AnnotateStep,
    CacheWriteStep,
    ComputeLocationStep,
    FuseConsumerStep,
    InlineStep,
    RfactorStep,
    TileStep,
    generate_sketches,
    needs_rfactor,
)


def _dag(tensors):
    return analyse(te.create_prim_func(tensors))


def _matmul_relu(n=64):
    a = te.placeholder((n, n), name="A")
    b = te.placeholder((n, n), name="B")
    k = te.reduce_axis((0, n), name="k")
    c = te.compute((n, n), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="C")
    d = te.compute((n, n), lambda i, j: te.max(c[i, j], tvm.tirx.const(0, "float32")), name="D")
    return [a, b, d]


def test_matmul_relu_gets_tiling_with_fusion():
    sketches = generate_sketches(_dag(_matmul_relu()), num_cores=2)
    steps = [set(s.steps) for s in sketches]
    assert any({TileStep("C"), FuseConsumerStep("D", "C")} <= s for s in steps)
    # Without a cache-write stage the plain tiling sketch is derived too (rule APPLY).
    assert any(TileStep("C") in s and not any(isinstance(x, FuseConsumerStep) for x in s) for s in steps)
    # The fused consumer gets no compute-location choice of its own.
    for s in sketches:
        if FuseConsumerStep("D", "C") in s.steps:
            assert ComputeLocationStep("D") not in s.steps


def test_matmul_without_consumer_gets_cache_write_then_fusion():
    a = te.placeholder((64, 32), name="A")
    b = te.placeholder((32, 48), name="B")
    k = te.reduce_axis((0, 32), name="k")
    c = te.compute((64, 48), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="C")
    sketches = generate_sketches(_dag([a, b, c]), num_cores=2)
    assert len(sketches) == 2
    cw = [s for s in sketches if CacheWriteStep("C") in s.steps]
    assert len(cw) == 1
    assert cw[0].steps[:3] == (CacheWriteStep("C"), TileStep("C"), FuseConsumerStep("C_global", "C"))


def test_reduction_with_small_output_gets_rfactor():
    x = te.placeholder((4, 4096), name="x")
    k = te.reduce_axis((0, 4096), name="k")
    s = te.compute((4,), lambda i: te.sum(x[i, k] * x[i, k], axis=k), name="S")
    dag = _dag([x, s])
    block = dag.block("S")
    assert needs_rfactor(block, num_cores=2)
    sketches = generate_sketches(dag, num_cores=2)
    kinds = {tuple(st for st in sk.steps if isinstance(st, RfactorStep)) for sk in sketches}
    assert kinds == {(RfactorStep("S", True),), (RfactorStep("S", False),), ()}


def test_large_spatial_reduction_gets_no_rfactor():
    dag = _dag(_matmul_relu(128))
    assert not needs_rfactor(dag.block("C"), num_cores=2)
    assert not any(isinstance(st, RfactorStep) for sk in generate_sketches(dag, 2) for st in sk.steps)


def test_elementwise_nodes_are_inlined():
    data = te.placeholder((1, 8, 10, 10), name="data")
    w = te.placeholder((8, 8, 3, 3), name="w")
    bias = te.placeholder((1, 8, 1, 1), name="bias")
    out = topi.nn.relu(topi.add(topi.nn.conv2d_nchw(data, w, 1, 1, 1), bias))
    dag = _dag([data, w, bias, out])
    assert is_strictly_inlineable(dag, dag.block("T_add"))
    assert not is_strictly_inlineable(dag, dag.block("compute"))  # the output
    assert not is_strictly_inlineable(dag, dag.block("pad_temp"))  # has a branch
    assert needs_multi_level_tiling(dag.block("conv2d_nchw"))
    sketches = generate_sketches(dag, 2)
    for sk in sketches:
        assert sk.steps[0] == InlineStep("T_add")
        assert ComputeLocationStep("pad_temp") in sk.steps
    # after inlining the bias add, relu is conv's single elementwise consumer
    assert any(FuseConsumerStep("compute", "conv2d_nchw") in sk.steps for sk in sketches)


def _conv_silu():
    data = te.placeholder((1, 6, 6, 8), name="data")
    w = te.placeholder((3, 3, 8, 16), name="w")
    bias = te.placeholder((1, 1, 1, 16), name="bias")
    x = topi.add(topi.nn.conv2d_nhwc(data, w, 1, 1, 1), bias)
    return [data, w, bias, topi.multiply(x, topi.sigmoid(x))]


def test_sigmoid_read_once_by_its_consumer_is_inlined_and_the_epilogue_fuses():
    # x * sigmoid(x): the sigmoid (expensive) is read once per element by the multiply, so
    # inlining computes nothing twice; the multiply becomes the conv's fused consumer.
    dag = _dag(_conv_silu())
    assert is_strictly_inlineable(dag, dag.block("compute"))
    sketches = generate_sketches(dag, 2)
    assert all(InlineStep("compute") in sk.steps for sk in sketches)
    assert any(FuseConsumerStep("T_multiply", "conv2d_nhwc") in sk.steps for sk in sketches)


def test_expensive_elementwise_is_not_inlined_but_flexible():
    x = te.placeholder((8, 16), name="x")
    sketches = generate_sketches(_dag([x, topi.nn.softmax(x, axis=-1)]), num_cores=2)
    for sk in sketches:
        assert InlineStep("T_softmax_exp") not in sk.steps
        assert ComputeLocationStep("T_softmax_exp") in sk.steps
        assert all(isinstance(s, AnnotateStep) for s in sk.steps[-3:])


@pytest.mark.parametrize("n", [16, 64])
def test_sketches_are_deterministic(n):
    a = generate_sketches(_dag(_matmul_relu(n)), 2)
    b = generate_sketches(_dag(_matmul_relu(n)), 2)
    assert [s.signature for s in a] == [s.signature for s in b]
    assert len({s.signature for s in a}) == len(a)
