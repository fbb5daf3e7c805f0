"""Whole vectors (`tunefarm.vector_split`): a vectorized loop of a length that is not a
power of two becomes an unrolled loop over power-of-two vectors; other loops are left
alone, and compiled kernels compute the same values."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
tvm_ffi = pytest.importorskip("tvm_ffi")

from tvm import te, tirx  # noqa: E402

from tunefarm import tir_pipeline, vector_split  # noqa: E402

TARGET = {"kind": "llvm", "num-cores": 2}


def _scaled_rows(cols: int, lanes: int):
    """out[i, j] = x[i, j] * 2 + 1, the column loop split by `lanes` and its inner part vectorized."""
    x = te.placeholder((8, cols), name="x")
    out = te.compute((8, cols), lambda i, j: x[i, j] * 2.0 + 1.0, name="out")
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": te.create_prim_func([x, out])}))
    _, j = sch.get_loops(sch.get_sblock("out"))
    _, inner = sch.split(j, [None, lanes])
    sch.vectorize(inner)
    return sch.mod


def _before_vectorize(mod):
    pipeline, _, _ = tvm.tirx.get_tir_pipeline("default")
    mod = tvm.tirx.transform.BindTarget(tvm.target.Target(TARGET))(mod)
    return tir_pipeline.run_part(pipeline, mod, before_split=True)


def _loops(body) -> list[tuple[str, int]]:
    found = []

    kinds = {tirx.ForKind.SERIAL: "serial", tirx.ForKind.UNROLLED: "unrolled", tirx.ForKind.VECTORIZED: "vectorized"}

    def visit(loop):
        found.append((kinds.get(loop.kind, "other"), int(loop.extent.value)))

    tvm_ffi.structural_walk(body, (tirx.For, visit))
    return found


@pytest.mark.parametrize(("extent", "expected"), [(24, (3, 8)), (48, (3, 16)), (40, (5, 8)), (12, (3, 4)),
                                                  (96, (3, 32)), (16, None), (8, None), (6, None), (9, None)])
def test_split_lanes_keeps_the_largest_power_of_two_of_at_least_four_lanes(extent, expected):
    assert vector_split.split_lanes(extent) == expected


def test_a_vector_of_24_lanes_becomes_three_unrolled_vectors_of_8():
    body = _before_vectorize(_scaled_rows(48, 24))["main"].body
    loops = _loops(vector_split.rewrite(body))
    assert ("vectorized", 8) in loops and ("unrolled", 3) in loops
    assert ("vectorized", 24) not in loops


@pytest.mark.parametrize("lanes", [16, 6])
def test_vectors_of_a_power_of_two_or_without_a_whole_register_are_left_alone(lanes):
    body = _before_vectorize(_scaled_rows(48, lanes))["main"].body
    assert tvm_ffi.structural_equal(vector_split.rewrite(body), body)


@pytest.mark.parametrize("lanes", [24, 40, 12])
def test_a_split_kernel_compiled_through_the_pipeline_matches_numpy(lanes):
    tir_pipeline.register()
    cols = 2 * lanes
    lib = tvm.compile(_scaled_rows(cols, lanes), target=tvm.target.Target(TARGET), tir_pipeline=tir_pipeline.PIPELINE).jit()
    dev = tvm.cpu(0)
    x = np.random.default_rng(lanes).standard_normal((8, cols)).astype("float32")
    out = tvm.runtime.empty((8, cols), "float32", dev)
    lib["main"](tvm.runtime.tensor(x, dev), out)
    np.testing.assert_array_equal(out.numpy(), x * 2 + 1)
