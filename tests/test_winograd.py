"""Winograd convolution (`tunefarm.winograd`, registry op `conv2d_winograd`): its maths, its
float32 error against the direct convolution, the weight transform split off the kernel,
the search's view of it (the transform left out of the kernel, the constant tables
unrolled: the model's loops against TVM's), every sampled program checked against the
direct convolution through the production path, a short `tune-op` search, and a wrong
transform caught by the runner's check.

Tolerance: the runner's check (`kernel_output_mismatch`: |out - ref| <= 1e-3 x |ref| +
1e-3 x max(1, max |ref|)) stays as it is. Measured on 64->64 56x56, 128->128 28x28 and
256->256 14x14 with uniform and normal inputs and weights, the largest error relative to
max |ref| was 1.1e-5 for F(4,3), 7e-7 for F(2,3) and 1.9e-6 for the direct float32
convolution: F(4,3) uses at most 1/90 of the runner's tolerance and 1/12 of the model
check's (1e-4 x max |ref| + 1e-3 x |ref|). `ERROR_BOUND` below holds the tests' small
shapes to that.
"""

from __future__ import annotations

import random
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import te

from tunefarm import layout, winograd
from tunefarm.errors import WorkloadError
from tunefarm.measure.builder import build_module
from tunefarm.measure.runner import kernel_output_mismatch, run_kernel
from tunefarm.measure.task_data import write_task_data
from tunefarm.records import ErrorKind, RunInput, TimingConfig
from tunefarm.search.config import SearchConfig, TuneConfig
from tunefarm.search.space.dag import analyse
from tunefarm.search.space.loopnest import build
from tunefarm.search.space.program import InvalidProgram, expected_tvm_loops
from tunefarm.search.space.realize import loop_structure, realize, trace_json
from tunefarm.search.space.sketch import LayoutRewriteStep, UnrollTableStep, generate_sketches, unrolls_tables
from tunefarm.search.space.slots import Decider
from tunefarm.search.task import make_task
from tunefarm.workloads import registry, workload_from_te

ERROR_BOUND = {2: 2e-6, 4: 3e-5}
"""Largest error relative to max |direct conv| each tile size may show here (10x the
largest seen on the benchmark shapes of the module docstring, 3x for F(4,3))."""

ONE_RUN = TimingConfig(repeat=1, min_repeat_ms=1.0)

SMALL = {"N": 1, "C": 8, "H": 10, "W": 9, "F": 16}


def _target():
    from tunefarm.target import host_target_dict

    return host_target_dict()


def _direct(x: np.ndarray, w: np.ndarray, pad: tuple[int, int, int, int]) -> np.ndarray:
    """The direct NHWC/OHWI convolution in float64, by kernel tap."""
    top, left, bottom, right = pad
    xp = np.pad(x.astype(np.float64), [(0, 0), (top, bottom), (left, right), (0, 0)])
    ho, wo = xp.shape[1] - 2, xp.shape[2] - 2
    out = np.zeros((x.shape[0], ho, wo, w.shape[0]))
    for ky in range(3):
        for kx in range(3):
            out += xp[:, ky : ky + ho, kx : kx + wo, :] @ w[:, ky, kx, :].astype(np.float64).T
    return out


def _compile_and_run(mod, inputs: list[np.ndarray], out_shape) -> np.ndarray:
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"}))
    out = tvm.runtime.empty(tuple(out_shape), "float32")
    ex["main"](*[tvm.runtime.tensor(a) for a in inputs], out)
    return out.numpy()


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got.astype(np.float64) - want).max() / np.abs(want).max())


# -- the maths ------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", winograd.TILE_SIZES)
def test_the_matrices_compute_a_correlation_exactly(m):
    # A^T [(G g) * (B^T d)] is the correlation of d with g, in exact rational arithmetic.
    tf = winograd.transform(m)
    rng = random.Random(m)
    for _ in range(5):
        d = [Fraction(rng.randint(-9, 9)) for _ in range(tf.alpha)]
        g = [Fraction(rng.randint(-9, 9)) for _ in range(3)]
        gg = [sum(row[k] * g[k] for k in range(3)) for row in tf.G]
        dd = [sum(row[k] * d[k] for k in range(tf.alpha)) for row in tf.BT]
        y = [sum(row[k] * gg[k] * dd[k] for k in range(tf.alpha)) for row in tf.AT]
        assert y == [sum(d[i + k] * g[k] for k in range(3)) for i in range(m)]


def test_tile_sizes_without_matrices_and_wrong_filters_are_refused():
    data = te.placeholder((1, 8, 8, 4), name="data")
    with pytest.raises(WorkloadError, match="m=3"):
        winograd.winograd_conv2d_nhwc(data, te.placeholder((4, 3, 3, 4), name="w"), 1, 3)
    with pytest.raises(WorkloadError, match="3x3 filter"):
        winograd.winograd_conv2d_nhwc(data, te.placeholder((4, 5, 5, 4), name="w"), 1, 2)
    with pytest.raises(WorkloadError, match="input channels"):
        winograd.winograd_conv2d_nhwc(data, te.placeholder((4, 3, 3, 2), name="w"), 1, 2)


@pytest.mark.parametrize(
    "m, shape, co, pad",
    [
        (2, (1, 9, 7, 5), 6, 1),
        (4, (1, 9, 7, 5), 6, 1),
        (2, (2, 10, 11, 3), 4, (0, 2, 1, 0)),  # asymmetric padding, a batch of 2
        (4, (2, 10, 11, 3), 4, (0, 2, 1, 0)),
        (4, (1, 14, 14, 16), 8, 0),  # 12x12: whole tiles, no padding
        (4, (1, 6, 5, 8), 16, 2),  # 8x7: a partial tile each way
    ],
)
def test_the_compute_equals_the_direct_convolution(m, shape, co, pad):
    data = te.placeholder(shape, name="data")
    weight = te.placeholder((co, 3, 3, shape[3]), name="weight")
    out = winograd.winograd_conv2d_nhwc(data, weight, pad, m)
    rng = np.random.default_rng(m)
    x = rng.uniform(-1, 1, shape).astype("float32")
    w = rng.uniform(-1, 1, (co, 3, 3, shape[3])).astype("float32")
    got = _compile_and_run(tvm.IRModule({"main": te.create_prim_func([data, weight, out])}), [x, w], out.shape)
    want = _direct(x, w, winograd.normalize_padding(pad))
    assert got.shape == want.shape
    assert kernel_output_mismatch([got], [want.astype(np.float32)]) == ""
    assert _relative_error(got, want) < ERROR_BOUND[m]


def test_its_parameters_are_those_of_the_direct_convolution_it_replaces():
    # A model's convolution as Relax legalizes it (NHWC, OHWI, int64 shapes): placeholders
    # made from its parameters give a Winograd PrimFunc with the very same parameters.
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 4), "float32"))
    w = relax.Var("w", relax.TensorType((6, 3, 3, 4), "float32"))
    with bb.function("main", [x, w]):
        bb.emit_func_output(bb.emit(relax.op.nn.conv2d(x, w, padding=1, data_layout="NHWC", kernel_layout="OHWI")))
    legalized = relax.transform.LegalizeOps()(bb.get())
    direct = next(f for f in legalized.functions.values() if isinstance(f, tvm.tirx.PrimFunc))
    data, weight, out = (te.placeholder(p.shape, p.dtype, name=str(p.name)) for p in direct.params)
    func = te.create_prim_func([data, weight, winograd.winograd_conv2d_nhwc(data, weight, 1, 4, name=out.name)])

    def signature(f):
        return [(str(p.name), str(p.dtype), [(str(s.ty), int(s)) for s in p.shape]) for p in f.params]

    assert signature(func) == signature(direct)
    assert signature(func)[2][2][0] == ("int64", 1)


# -- the weight transform runs outside the kernel ------------------------------------------------------


def test_the_split_gives_main_the_transformed_weight(tmp_path):
    wl = registry.make("conv2d_winograd", {**SMALL, "m": 2})
    assert wl.constants == (1,)
    lib_mod = layout.kernel_library_module(wl.mod)
    assert {gv.name_hint for gv in lib_mod.get_global_vars()} == {layout.KERNEL, layout.TRANSFORM, layout.LAYOUTS}
    main = lib_mod[layout.KERNEL]
    # main takes U = G g G^T (alpha, alpha, C, F) where the weight was; nothing else changes
    assert [tuple(int(s) for s in p.shape) for p in main.params] == [(1, 10, 9, 8), (4, 4, 8, 16), (1, 10, 9, 16)]
    ex = tvm.compile(lib_mod, target=tvm.target.Target({"kind": "llvm"}))
    lib_path = tmp_path / "k.so"
    ex.export_library(str(lib_path))
    lib = tvm.runtime.load_module(str(lib_path))
    layouts = layout.read_layouts(lib)
    assert layouts is not None and len(layouts.rewritten) == 1
    r = layouts.rewritten[0]
    assert (r.input, r.name, r.shape) == (1, "weight", (4, 4, 8, 16))
    assert r.mapping.startswith("computed from weight")
    rng = np.random.default_rng(0)
    x, w = (rng.uniform(-1, 1, t.shape).astype("float32") for t in wl.inputs)
    x_dev, w_dev = tvm.runtime.tensor(x), tvm.runtime.tensor(w)
    _, u = layout.pretransform(lib, [x_dev, w_dev])
    g = np.array(winograd.transform(2).G, dtype=np.float64)
    want_u = np.einsum("er,frsc,ns->encf", g, w.astype(np.float64), g)
    np.testing.assert_allclose(u.numpy(), want_u, rtol=1e-5, atol=1e-5)
    out = tvm.runtime.empty(wl.outputs[0].shape, "float32")
    lib[layout.KERNEL](x_dev, u, out)
    assert kernel_output_mismatch([out.numpy()], wl.reference(x, w)) == ""


def test_the_search_leaves_the_weight_transform_out_and_unrolls_the_tables():
    wl = registry.make("conv2d_winograd", {**SMALL, "m": 4})
    dag = analyse(wl.mod["main"], wl.constants)
    assert dag.outside == ("weight_transform",)
    assert not dag.has_block("weight_transform")
    assert dag.buffer("weight_transform").role == "constant"
    tables = {b.name: b.table_iters for b in dag.blocks if b.table_iters}
    assert tables == {
        "input_transform": ("v_eps", "v_nu", "v_ra", "v_rb"),
        "inverse_transform": ("v_i", "v_j", "v_ka", "v_kb"),
    }
    steps = {s for sk in generate_sketches(dag, num_cores=2) for s in sk.steps}
    assert UnrollTableStep("input_transform") in steps and UnrollTableStep("inverse_transform") in steps
    assert LayoutRewriteStep("batched_gemm", "weight_transform") in steps
    # a padding's bounds test and a transposed convolution's stride test index no table
    direct = analyse(registry.make("conv2d_nhwc", {"N": 1, "C": 4, "H": 6, "W": 6, "F": 4}).mod["main"]).blocks
    tconv = analyse(registry.make("conv2d_transpose", {"N": 1, "C": 3, "H": 5, "W": 5, "F": 4}).mod["main"]).blocks
    assert not any(b.table_iters for b in (*direct, *tconv))


def test_an_equality_test_on_a_long_loop_is_no_table_to_unroll():
    x = te.placeholder((100, 16), name="x")
    first = te.compute(
        (100, 16), lambda i, j: tvm.tirx.Select(i == 0, x[i, j], x[i, j] * 2.0), name="first_row_kept"
    )
    block = analyse(workload_from_te("first_row", [x, first]).mod["main"]).blocks[0]
    assert block.table_iters == ("v_i",)
    assert not unrolls_tables(block)


def test_a_weight_transform_of_an_input_that_is_not_constant_is_refused():
    wl = registry.make("conv2d_winograd", {**SMALL, "m": 2})
    plain = replace(wl, constants=())
    with pytest.raises(WorkloadError, match="weight_transform .* declare its input constant"):
        make_task(plain, _target())


def _sample(dag, sketch, rng):
    for _ in range(100):
        decider = Decider(None, rng)
        try:
            return decider, build(dag, sketch, decider, 2, vector_bytes=64, vector_registers=32)
        except InvalidProgram:
            continue
    raise AssertionError("no valid program in 100 draws")


@pytest.mark.parametrize("m", winograd.TILE_SIZES)
def test_model_loops_match_tvm(m):
    wl = registry.make("conv2d_winograd", {**SMALL, "m": m})
    dag = analyse(wl.mod["main"], wl.constants)
    sketches = generate_sketches(dag, num_cores=2)
    rng = random.Random(5 + m)
    for i in range(4 * len(sketches) + 4):
        decider, prog = _sample(dag, sketches[i % len(sketches)], rng)
        sch = realize(wl.mod, prog.instructions)
        assert loop_structure(sch) == expected_tvm_loops(prog), decider.decisions
        # the weight transform is where it was: at the root, in its own loops
        transform = sch.get_sblock("weight_transform")
        assert [int(sch.get(lp).extent) for lp in sch.get_loops(transform)] == [m + 2, m + 2, 8, 16, 3, 3]
        assert layout.has_layout_rewrite(sch.mod["main"])


# -- through the production path --------------------------------------------------------------------


def _build_and_run(wl, trace, tmp: Path, tag: str):
    wl_path = tmp / "workload.json"
    wl_path.write_text(wl.to_json())
    data = tmp / "data.npz"
    if not data.exists():
        write_task_data(data, wl, seed=0)
    lib = tmp / f"{tag}.so"
    build_module(str(wl_path), trace, _target(), str(lib))
    return run_kernel(RunInput(tag, str(lib), str(data), len(wl.inputs), len(wl.outputs), True, ONE_RUN))


@pytest.mark.parametrize("m", winograd.TILE_SIZES)
def test_random_programs_compute_the_direct_convolution(m, tmp_path):
    wl = registry.make("conv2d_winograd", {**SMALL, "m": m})
    task = make_task(wl, _target())
    rng = random.Random(11 * m)
    for i, built in enumerate(task.space.sample_many(3, rng)):
        run = _build_and_run(wl, trace_json(realize(wl.mod, built.program.instructions)), tmp_path, f"p{i}")
        assert run.error_kind is ErrorKind.NONE, (built.candidate.key, run.error_msg)
        assert run.verified


def test_a_wrong_transform_entry_fails_the_check(tmp_path):
    right = winograd.transform(4)
    bt = [list(row) for row in right.BT]
    bt[1][2] = Fraction(-5)  # -4 in Lavin's B^T
    wrong = replace(right, BT=tuple(tuple(row) for row in bt))
    data = te.placeholder((1, 10, 9, 8), name="data")
    weight = te.placeholder((16, 3, 3, 8), name="weight")
    direct = registry.make("conv2d_winograd", {**SMALL, "m": 4}).reference
    wl = workload_from_te(
        "winograd_wrong", [data, weight, winograd.winograd_conv2d_nhwc(data, weight, 1, wrong)], reference=direct
    ).with_constants(["weight"])
    task = make_task(wl, _target())
    (built,) = task.space.sample_many(1, random.Random(3))
    run = _build_and_run(wl, trace_json(realize(wl.mod, built.program.instructions)), tmp_path, "wrong")
    assert run.error_kind is ErrorKind.WRONG_RESULT
    assert "max abs error" in run.error_msg


def test_a_short_tune_op_search_verifies_every_kernel(tmp_path):
    from tunefarm.tune import tune_workload

    wl = registry.make("conv2d_winograd", {**SMALL, "m": 2})
    config = TuneConfig(
        trials=4, batch_size=4, seed=2, timing=TimingConfig(repeat=2, min_repeat_ms=2.0),
        search=SearchConfig(population=16, generations=1),
    )  # fmt: skip
    result = tune_workload(wl, _target(), config, records=tmp_path / "records.jsonl", work_dir=tmp_path / "work",
                           log=lambda _: None)  # fmt: skip
    _, state, outcome = result.single()
    assert outcome.best is not None
    measured = [r for r in state.records if r.error_kind is ErrorKind.NONE]
    assert len(measured) >= 3 and all(r.verified for r in measured)
