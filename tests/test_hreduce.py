"""Horizontal reductions (`tunefarm.hreduce`): which loops the pass rewrites, which it leaves
alone, and that compiled kernels still compute the same values."""

from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")
tvm_ffi = pytest.importorskip("tvm_ffi")

from tvm import te, tirx, topi  # noqa: E402

from tunefarm import hreduce, tir_pipeline  # noqa: E402

TARGET = {"kind": "llvm", "num-cores": 2}


def _lowered_before_vectorize(mod):
    """`mod` through TVM's default pipeline up to the pass before which the rewrite runs."""
    pipeline, _, _ = tvm.tirx.get_tir_pipeline("default")
    mod = tvm.tirx.transform.BindTarget(tvm.target.Target(TARGET))(mod)
    return tir_pipeline.run_part(pipeline, mod, before_split=True)


def _shuffles(body) -> int:
    found = []
    tvm_ffi.structural_walk(body, (tirx.Shuffle, lambda n: found.append(n)))
    return len(found)


def _serial_loops(body, extent: int) -> int:
    found = []

    def visit(loop):
        if loop.kind == tirx.ForKind.SERIAL and isinstance(loop.extent, tirx.IntImm) and int(loop.extent.value) == extent:
            found.append(loop)

    tvm_ffi.structural_walk(body, (tirx.For, visit))
    return len(found)


def _row_softmax(rows: int, n: int, decompose: bool):
    """Softmax over rows of `n`, every stage computed at a block of 8 rows, the reductions'
    innermost loop walking the row (contiguous)."""
    x = te.placeholder((rows, n), name="x")
    mod = tvm.IRModule({"main": te.create_prim_func([x, topi.nn.softmax(x, axis=-1)])})
    sch = tvm.s_tir.Schedule(mod)
    norm = sch.get_sblock("T_softmax_norm")
    i, j = sch.get_loops(norm)
    io, _ = sch.split(i, [None, 8])
    for name in ("T_softmax_expsum", "T_softmax_exp", "T_softmax_maxelem"):
        sch.compute_at(sch.get_sblock(name), io)
    sch.parallel(io)
    sch.vectorize(j)
    if decompose:
        for name in ("T_softmax_maxelem", "T_softmax_expsum"):
            block = sch.get_sblock(name)
            sch.decompose_reduction(block, sch.get_loops(block)[-1])
    return sch.mod


def _run(mod, *arrays, out_shape, pipeline):
    tir_pipeline.register()
    lib = tvm.compile(mod, target=tvm.target.Target(TARGET), tir_pipeline=pipeline).jit()
    dev = tvm.cpu(0)
    out = tvm.runtime.empty(out_shape, "float32", dev)
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in arrays], out)
    return out.numpy()


@pytest.mark.parametrize("decompose", [True, False])
def test_a_softmax_over_short_rows_gets_its_max_and_sum_as_shuffle_trees(decompose):
    mod = _lowered_before_vectorize(_row_softmax(64, 16, decompose))
    body = mod["main"].body
    assert _serial_loops(body, 16) == 3  # the max, the exp and the sum walk each row
    rewritten = hreduce.rewrite(body)
    # the max and the sum loops are gone (the exp loop is no reduction), each a tree of
    # 4 levels of two halves
    assert _serial_loops(rewritten, 16) == 1
    assert _shuffles(rewritten) == 2 * 4 * 2


@pytest.mark.parametrize("n", [16, 24, 128])
@pytest.mark.parametrize("decompose", [True, False])
def test_a_softmax_compiled_through_the_pipeline_matches_numpy(n, decompose):
    rng = np.random.default_rng(n)
    x = rng.standard_normal((64, n)).astype("float32") * 4
    ref = np.exp(x - x.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    out = _run(_row_softmax(64, n, decompose), x, out_shape=x.shape, pipeline=tir_pipeline.PIPELINE)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-7)


def _reduce_rows(n: int, body, stride: int = 1):
    """out[i] = sum_k body(x[i, stride * k]) for k < n."""
    x = te.placeholder((32, n * stride), name="x")
    k = te.reduce_axis((0, n), name="k")
    out = te.compute((32,), lambda i: te.sum(body(x[i, stride * k]), axis=k), name="out")
    return tvm.IRModule({"main": te.create_prim_func([x, out])})


def test_a_reduction_of_an_expression_of_the_row_is_rewritten_and_exact_within_rounding():
    mean = 0.25
    mod = _reduce_rows(48, lambda v: (v - mean) * (v - mean))
    body = _lowered_before_vectorize(mod)["main"].body
    assert _shuffles(hreduce.rewrite(body)) > 0
    x = np.random.default_rng(0).standard_normal((32, 48)).astype("float32")
    out = _run(mod, x, out_shape=(32,), pipeline=tir_pipeline.PIPELINE)
    np.testing.assert_allclose(out, ((x - mean) ** 2).sum(-1), rtol=1e-5)


@pytest.mark.parametrize(
    "mod",
    [
        pytest.param(_reduce_rows(16, lambda v: v, stride=2), id="strided-row"),
        pytest.param(_reduce_rows(4, lambda v: v), id="shorter-than-MIN_LANES"),
        pytest.param(_reduce_rows(9, lambda v: v), id="odd-length"),
    ],
)
def test_loops_that_are_no_contiguous_reduction_of_a_usable_length_are_left_alone(mod):
    body = _lowered_before_vectorize(mod)["main"].body
    rewritten = hreduce.rewrite(body)
    assert _shuffles(rewritten) == 0
    assert tvm_ffi.structural_equal(rewritten, body)


def test_a_reduction_inside_a_vectorized_loop_is_left_to_tvm():
    # out[i, j] = sum_k x[i, k, j] with j vectorized outside k: the loop over k reads
    # x[i, k, j] with stride 16 in k anyway, but the check must not even look inside
    x = te.placeholder((4, 16, 16), name="x")
    k = te.reduce_axis((0, 16), name="k")
    out = te.compute((4, 16), lambda i, j: te.sum(x[i, j, k], axis=k), name="out")
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": te.create_prim_func([x, out])}))
    block = sch.get_sblock("out")
    i, j, kk = sch.get_loops(block)
    sch.vectorize(j)
    body = _lowered_before_vectorize(sch.mod)["main"].body
    assert tvm_ffi.structural_equal(hreduce.rewrite(body), body)


def _store(row_coeff: int, extent: int, *, outer_kind: str = "serial", write_uses_k: bool = False):
    """A max over the innermost loop `k`: out[i] = max(out[i], x[i, row_coeff * k])."""
    from tunefarm.search.space.dag import Affine, BufferSpec, OpCounts
    from tunefarm.search.space.program import Access, Loop, Store

    i, k = Loop("i", 64, False, outer_kind), Loop("k", extent, True)
    x = BufferSpec("x", (64, extent * row_coeff), "float32", "input")
    out = BufferSpec("out", (64, extent) if write_uses_k else (64,), "float32", "output")
    write_ix = (Affine.var("i"), Affine.var("k")) if write_uses_k else (Affine.var("i"),)
    return Store(
        "out",
        (i, k),
        (Access(out, write_ix, True, True), Access(x, (Affine.var("i"), Affine.of({"k": row_coeff})), False, True)),
        OpCounts(float_add_sub=1),
        0,
    )


def test_the_features_count_a_horizontally_reduced_loop_as_vectorized():
    from tunefarm.search import features

    assert features.reduces_horizontally(_store(1, 16))
    assert not features.reduces_horizontally(_store(2, 16))  # strided: stays a scalar chain
    assert not features.reduces_horizontally(_store(1, 4))  # shorter than MIN_LANES
    assert not features.reduces_horizontally(_store(1, 16, outer_kind="vectorized"))
    assert not features.reduces_horizontally(_store(1, 16, write_uses_k=True))
    # the same rows as a store whose loop is marked vectorized in the loop-nest model
    from dataclasses import replace

    store = _store(1, 16)
    marked = replace(store, loops=(store.loops[0], replace(store.loops[1], kind="vectorized")))
    rows = features._store_rows([store, marked])
    np.testing.assert_array_equal(rows[0], rows[1])
