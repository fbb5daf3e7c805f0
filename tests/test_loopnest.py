"""The loop-nest model against TVM: the model scores programs without TVM, so its loops
must be the ones TVM actually builds (a fast path checked against the reference path)."""

from __future__ import annotations

import random

import pytest

from tunefarm.search.features import NUM_FEATURES, batch_features, program_features
from tunefarm.search.space.dag import analyse
from tunefarm.search.space.loopnest import build
from tunefarm.search.space.program import InvalidProgram, expected_tvm_loops
from tunefarm.search.space.realize import loop_structure, realize
from tunefarm.search.space.sketch import FuseConsumerStep, generate_sketches
from tunefarm.search.space.slots import Decider
from tunefarm.workloads import registry

SMALL = {
    "matmul": {"M": 64, "N": 48, "K": 32},
    "matmul_relu": {"M": 32, "N": 64, "K": 16},
    "batch_matmul": {"B": 3, "M": 16, "N": 32, "K": 8},
    "conv2d": {"N": 1, "C": 8, "H": 14, "W": 14, "F": 16},
    "conv2d_nhwc": {"N": 1, "C": 8, "H": 14, "W": 14, "F": 16},
    "conv2d_winograd": {"N": 1, "C": 8, "H": 14, "W": 14, "F": 16, "m": 4},
    "conv2d_1x1": {"N": 1, "C": 16, "H": 7, "W": 7, "F": 32},
    "depthwise_conv2d": {"N": 1, "C": 8, "H": 16, "W": 16},
    "conv3d": {"N": 1, "C": 4, "D": 6, "H": 6, "W": 6, "F": 8},
    "conv2d_transpose": {"N": 1, "C": 4, "H": 6, "W": 6, "F": 8},
    "softmax": {"B": 2, "M": 8, "N": 32},
    "layer_norm": {"M": 8, "N": 96},
    "norm2": {"M": 32, "N": 64},
    "conv1d": {"N": 1, "C": 8, "L": 32, "F": 8},
}


def _sample(dag, sketch, rng):
    """A random valid program of `sketch` (invalid draws are skipped, as the sampler does)."""
    for _ in range(100):
        decider = Decider(None, rng)
        try:
            return decider, build(dag, sketch, decider, 2)
        except InvalidProgram:
            continue
    raise AssertionError("no valid program in 100 draws")


def _assert_model_loops_match_tvm(wl):
    dag = analyse(wl.mod["main"], wl.constants)
    sketches = generate_sketches(dag, num_cores=2)
    rng = random.Random(7)
    for i in range(2 * len(sketches) + 6):
        decider, prog = _sample(dag, sketches[i % len(sketches)], rng)
        sch = realize(wl.mod, prog.instructions)
        assert loop_structure(sch) == expected_tvm_loops(prog), (wl.name, decider.decisions)


@pytest.mark.parametrize("op", sorted(SMALL))
def test_model_loops_match_tvm(op):
    _assert_model_loops_match_tvm(registry.make(op, SMALL[op]))


def test_model_loops_match_tvm_with_a_silu_epilogue():
    # An expensive op inlined into its consumer (the sigmoid of x * sigmoid(x)), then fused
    # into the convolution's tile.
    from tvm import te, topi

    from tunefarm.workloads.base import workload_from_te

    data = te.placeholder((1, 6, 6, 8), name="data")
    w = te.placeholder((3, 3, 8, 16), name="w")
    x = topi.nn.conv2d_nhwc(data, w, 1, 1, 1)
    _assert_model_loops_match_tvm(workload_from_te("conv_silu", [data, w, topi.multiply(x, topi.sigmoid(x))]))


def test_te_buffers_of_one_name_are_renamed_and_a_gelu_epilogue_fuses():
    # TE names each multiply's buffer "T_multiply": the DAG used to merge them into one
    # buffer, and every sampled program of this GELU was invalid.
    from tvm import te, topi

    from tunefarm.workloads.base import workload_from_te

    a = te.placeholder((16, 8), name="a")
    w = te.placeholder((32, 8), name="w")
    x = topi.nn.dense(a, w)
    gelu = topi.multiply(topi.multiply(x, 0.5), topi.add(topi.erf(topi.multiply(x, 0.7071067811865476)), 1.0))
    wl = workload_from_te("dense_gelu", [a, w, gelu])
    dag = analyse(wl.mod["main"])
    writes = [b.write.buffer for b in dag.blocks]
    assert len(set(writes)) == len(writes) == 6
    sketches = generate_sketches(dag, num_cores=2)
    assert any(isinstance(s, FuseConsumerStep) for sk in sketches for s in sk.steps)
    _assert_model_loops_match_tvm(wl)


def test_only_the_vectorized_tile_knows_the_vector_width():
    wl = registry.make("conv2d", {"N": 1, "C": 8, "H": 14, "W": 14, "F": 16})
    dag = analyse(wl.mod["main"])
    sketch = next(sk for sk in generate_sketches(dag, num_cores=2) if not any(isinstance(s, FuseConsumerStep) for s in sk.steps))
    decider = Decider(None, random.Random(0))
    build(dag, sketch, decider, 2, vector_bytes=64)
    lanes = {slot: d.vector_lanes for slot, d in decider.domains.items() if ".tile." in slot}
    vectorized = [slot for slot, n in lanes.items() if n]
    # the innermost spatial iterator of the conv's output (float32: 16 lanes in 64 bytes)
    assert len(vectorized) == 1 and lanes[vectorized[0]] == 16
    assert dag.block(vectorized[0].split(".tile.")[0]).spatial[-1].name == vectorized[0].split(".tile.")[1]


def _register_tile(decisions, block: str, lanes: int) -> tuple[int, int]:
    """(accumulator vectors, vectors of the vectorized operand) of a GEMM's innermost tiles."""
    rows = decisions[f"{block}.tile.v_i"][-1]
    vectors = -(-decisions[f"{block}.tile.v_j"][-1] // lanes)
    return rows * vectors, vectors


@pytest.mark.parametrize("registers", [32, 16])
def test_drawn_register_tiles_fit_the_vector_registers(registers):
    # 8 rows x 64 columns on AVX-512 is 32 zmm accumulators + 4 + 1: LLVM spilled them
    wl = registry.make("matmul", {"M": 512, "N": 512, "K": 64})
    dag = analyse(wl.mod["main"])
    sketch = generate_sketches(dag, 2)[1]  # plain multi-level tiling
    rng = random.Random(5)

    def over_budget(**registers_known) -> list[bool]:
        over = []
        for _ in range(300):
            decider = Decider(None, rng)
            try:
                build(dag, sketch, decider, 2, vector_bytes=64, **registers_known)
            except InvalidProgram:  # e.g. too much unrolling: skipped, as the sampler does
                continue
            acc, vectors = _register_tile(decider.decisions, "C", 16)
            over.append(acc + vectors + 1 > registers)
        return over

    unbounded, bounded = over_budget(), over_budget(vector_registers=registers)
    assert sum(unbounded) > 30  # without the bound, uniform draws often overflow the registers
    assert len(bounded) > 100 and sum(bounded) == 0


def test_a_measured_program_over_the_register_budget_still_rebuilds():
    wl = registry.make("matmul", {"M": 512, "N": 512, "K": 64})
    dag = analyse(wl.mod["main"])
    sketch = generate_sketches(dag, 2)[1]
    given = {"C.tile.v_i": (2, 2, 16, 8), "C.tile.v_j": (2, 2, 2, 64), "C.tile.v_k": (4, 16), "C.parallel": 1, "C.unroll": 0}
    decider = Decider(given)  # no random source: the record's decisions, as measured
    build(dag, sketch, decider, 2, vector_bytes=64, vector_registers=32)
    assert decider.decisions["C.tile.v_i"] == (2, 2, 16, 8)
    drawn = Decider(given, random.Random(0))  # the search: a value over the budget is drawn anew
    build(dag, sketch, drawn, 2, vector_bytes=64, vector_registers=32)
    acc, vectors = _register_tile(drawn.decisions, "C", 16)
    assert acc + vectors + 1 <= 32 and drawn.decisions["C.tile.v_i"] != (2, 2, 16, 8)


def test_batched_features_equal_one_by_one():
    wl = registry.make("conv2d", SMALL["conv2d"])
    dag = analyse(wl.mod["main"])
    sketches = generate_sketches(dag, 2)
    rng = random.Random(3)
    progs = [_sample(dag, sketches[i % len(sketches)], rng)[1] for i in range(12)]
    batched = batch_features(progs)
    for prog, mat in zip(progs, batched):
        single = program_features(prog)
        assert mat.shape == single.shape and mat.shape[1] == NUM_FEATURES
        assert (mat == single).all()


def test_features_tell_tilings_apart():
    wl = registry.make("matmul", {"M": 256, "N": 256, "K": 256})
    dag = analyse(wl.mod["main"])
    sk = generate_sketches(dag, 2)[1]  # plain tiling
    base = {"C.tile.v_i": (4, 4, 4, 4), "C.tile.v_j": (4, 4, 4, 4), "C.tile.v_k": (16, 16), "C.parallel": 1, "C.unroll": 0}
    other = dict(base, **{"C.tile.v_j": (1, 1, 16, 16)})
    fa = program_features(build(dag, sk, Decider(base), 2))
    fb = program_features(build(dag, sk, Decider(other), 2))
    assert fa.shape == fb.shape and not (fa == fb).all()


def test_unroll_that_would_take_minutes_to_compile_is_rejected():
    """512 unrolled steps of a 64-lane vector take LLVM over a minute to compile: the
    sampler rejects that program instead of sending it to a builder; with 16 lanes the
    same program is fine."""
    wl = registry.make("matmul", {"M": 256, "N": 384, "K": 512})
    dag = analyse(wl.mod["main"])
    sketch = generate_sketches(dag, num_cores=2)[0]  # cache write + SSRSRS + fused write-back
    slow = {
        "C.tile.v_i": (16, 2, 8, 1),
        "C.tile.v_j": (1, 6, 1, 64),
        "C.tile.v_k": (8, 64),
        "C_global.fuse_level": 1,
        "C.parallel": 1,
        "C.unroll": 3,  # 512
    }
    with pytest.raises(InvalidProgram, match="straight-line"):
        build(dag, sketch, Decider(slow, None), 2)
    fine = dict(slow, **{"C.tile.v_j": (4, 6, 1, 16)})
    assert build(dag, sketch, Decider(fine, None), 2).instructions


def test_derived_dags_are_made_once_and_equal_a_fresh_derivation():
    from tunefarm.search.space.dag import _inline_into_consumers, inline_into_consumers
    from tunefarm.search.space.sketch import _apply_cache_write, apply_cache_write

    dag = analyse(registry.make("conv2d", {"N": 1, "C": 8, "H": 14, "W": 14, "F": 16}).mod["main"])
    pad, conv = dag.blocks[0].name, dag.blocks[1].name
    inlined = inline_into_consumers(dag, pad)
    assert inlined is inline_into_consumers(dag, pad)
    assert inlined == _inline_into_consumers(dag, pad) and inlined != dag
    cached = apply_cache_write(inlined, conv)
    assert cached is apply_cache_write(inlined, conv)
    assert cached == _apply_cache_write(inlined, conv, "global")
    assert apply_cache_write(inlined, conv, "local") != cached
