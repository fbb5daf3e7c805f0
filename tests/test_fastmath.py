"""tunefarm.fastmath: vectorizable float32 exp / tanh / erf lowerings for LLVM builds.

Each lowering is checked on a dense sweep against float64 numpy (with TVM's own
vectorization and with LLVM's loop vectorizer), on special values, in a softmax-like
PrimFunc, in a whole Relax model, and in the generated code (no libm calls left).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from tvm import te, tirx, topi  # noqa: E402

from tunefarm import fastmath  # noqa: E402

MAX_REL = {"exp": 1.5e-7, "tanh": 2e-7, "erf": 4e-7, "sigmoid": 2.5e-7}
"""The maxima of the module docstring's table (measured over all float32 inputs), rounded up."""

_erf64 = np.vectorize(math.erf, otypes=[np.float64])

FUNCS = {
    # name: (TIR op, float64 reference, dense range whose results are normal floats)
    "exp": (tirx.exp, np.exp, (-87.3, 88.7)),
    "tanh": (tirx.tanh, np.tanh, (-12.0, 12.0)),
    "erf": (tirx.erf, _erf64, (-5.0, 5.0)),
    "sigmoid": (tirx.sigmoid, lambda v: 1.0 / (1.0 + np.exp(-v)), (-87.0, 30.0)),
}

LIBM_CALL = re.compile(r"(?:call|jmp)\w*\s+\S*\b(expf|erff|tanhf|exp|erf|tanh|__\w*expf\w*)\b")
"""A call (or tail call) of a scalar libm function in x86 assembly (`callq expf@PLT`)."""


@pytest.fixture(scope="module")
def target(host_target):
    return tvm.target.Target(host_target)


def _elementwise(fn, n: int, lanes: int, dtype: str = "float32"):
    """out[i] = fn(x[i]); `lanes` > 0 vectorizes in TVM, 0 leaves it to LLVM's loop vectorizer."""
    x = te.placeholder((n,), dtype, name="x")
    y = te.compute((n,), lambda i: fn(x[i]), name="y")
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": te.create_prim_func([x, y])}))
    if lanes:
        (i,) = sch.get_loops(sch.get_sblock("y"))
        _, inner = sch.split(i, [None, lanes])
        sch.vectorize(inner)
    return sch.mod


def _run(ex, *arrays, out_shape, dtype="float32"):
    args = [tvm.runtime.tensor(a) for a in arrays]
    out = tvm.runtime.empty(out_shape, dtype)
    ex["main"](*args, out)
    return out.numpy()


def _build(mod, target, enabled=True):
    with fastmath.installed(enabled):
        return tvm.compile(mod, target=target)


def _sweep(lo: float, hi: float) -> np.ndarray:
    rng = np.random.default_rng(0)
    xs = np.concatenate([np.linspace(lo, hi, 1 << 17), rng.uniform(lo, hi, 1 << 15), [lo, hi, 0.0]])
    return xs.astype(np.float32)


@pytest.mark.parametrize("lanes", [16, 0], ids=["tvm-vectorized", "llvm-vectorized"])
@pytest.mark.parametrize("name", sorted(FUNCS))
def test_dense_range_within_bound(name, lanes, target):
    fn, ref, (lo, hi) = FUNCS[name]
    xs = _sweep(lo, hi)
    got = _run(_build(_elementwise(fn, xs.size, lanes), target), xs, out_shape=xs.shape).astype(np.float64)
    want = ref(xs.astype(np.float64))
    rel = np.abs(got - want) / np.abs(want).clip(min=np.finfo(np.float32).tiny)
    assert rel.max() <= MAX_REL[name], f"{name}: max rel error {rel.max():.3g} at x={xs[rel.argmax()]}"


def test_small_arguments_keep_relative_accuracy(target):
    """tanh and erf near 0 (TVM's own tanh loses all digits there: 1 - exp(-2x) cancels)."""
    xs = np.concatenate([np.geomspace(1e-38, 0.5, 4000), -np.geomspace(1e-38, 0.5, 4000)]).astype(np.float32)
    for name in ("tanh", "erf"):
        fn, ref, _ = FUNCS[name]
        got = _run(_build(_elementwise(fn, xs.size, 16), target), xs, out_shape=xs.shape).astype(np.float64)
        want = ref(xs.astype(np.float64))
        assert (np.abs(got - want) / np.abs(want)).max() <= MAX_REL[name], name


def test_exp_subnormal_results_and_overflow(target):
    """Results below the smallest normal float are rounded once (within one subnormal
    ulp), tiny enough ones flush to 0, and large arguments overflow to inf."""
    xs = np.linspace(-104.0, -87.0, 20001).astype(np.float32)
    got = _run(_build(_elementwise(tirx.exp, xs.size, 16), target), xs, out_shape=xs.shape).astype(np.float64)
    want = np.exp(xs.astype(np.float64))
    assert (np.abs(got - want) / 2.0**-149).max() <= 1.0
    big = np.array([88.7228, 88.72284, 88.7229, 89.0, 100.0, 1e30], np.float32)
    got = _run(_build(_elementwise(tirx.exp, big.size, 0), target), big, out_shape=big.shape)
    with np.errstate(over="ignore"):
        want = np.exp(big.astype(np.float64)).astype(np.float32)
    assert np.array_equal(got, want)


SPECIAL_INPUTS = np.array(
    [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 1e-30, 3.4e38, -3.4e38, 1e30, -1e30, -200.0],
    np.float32,
)


@pytest.mark.parametrize("lanes", [16, 0], ids=["tvm-vectorized", "llvm-vectorized"])
@pytest.mark.parametrize("name", sorted(FUNCS))
def test_special_values(name, lanes, target):
    fn, ref, _ = FUNCS[name]
    xs = np.tile(SPECIAL_INPUTS, 2)  # 28: LLVM's vectorizer makes a 16-lane body and a scalar remainder
    got = _run(_build(_elementwise(fn, xs.size, lanes and 4), target), xs, out_shape=xs.shape)
    with np.errstate(all="ignore"):
        want = ref(xs.astype(np.float64)).astype(np.float32)
    assert np.isnan(got[np.isnan(xs)]).all(), "NaN must stay NaN"
    fin = ~np.isnan(xs)
    if name == "sigmoid":  # TVM's 1 / (1 + exp(-x)): 0 below x = -88.7, where the truth is < 3e-39
        want[fin & (xs < -88.7)] = 0.0
    np.testing.assert_allclose(got[fin], want[fin], rtol=MAX_REL[name], atol=0)
    # Signs of zeros and infinities are exact (assert_allclose ignores the sign of 0).
    assert np.array_equal(np.signbit(got[fin]), np.signbit(want[fin]))


def test_generated_code_has_no_libm_calls(target):
    """The point of the module: a vectorized kernel keeps no scalar libm call."""
    mod = _elementwise(lambda v: tirx.exp(v) + tirx.erf(v) + tirx.tanh(v) + tirx.sigmoid(v), 1024, 16)
    before = _build(mod, target, enabled=False).mod.inspect_source("asm")
    after = _build(mod, target).mod.inspect_source("asm")
    assert LIBM_CALL.search(before), "TVM's own lowering calls libm (else this test checks nothing)"
    assert not LIBM_CALL.search(after), LIBM_CALL.search(after).group(0)
    ir = _build(mod, target).mod.inspect_source("ll")
    assert "@llvm.exp" not in ir and "@erff" not in ir and "@expf" not in ir


def _softmax_mod(shape):
    """topi's softmax scheduled the way tuned kernels look: one parallel row at a time,
    the exp and the normalisation vectorized."""
    x = te.placeholder(shape, "float32", name="x")
    sch = tvm.s_tir.Schedule(tvm.IRModule({"main": te.create_prim_func([x, topi.nn.softmax(x, axis=-1)])}))
    norm = sch.get_sblock("T_softmax_norm")
    *rows, col = sch.get_loops(norm)
    row = sch.fuse(*rows)
    sch.vectorize(sch.split(col, [None, 16])[1])
    for name in ("T_softmax_expsum", "T_softmax_exp", "T_softmax_maxelem"):
        sch.compute_at(sch.get_sblock(name), row)
    exp = sch.get_sblock("T_softmax_exp")
    sch.vectorize(sch.split(sch.get_loops(exp)[-1], [None, 16])[1])
    sch.parallel(row)
    return sch.mod


def test_softmax_primfunc_matches_numpy(target):
    shape = (3, 17, 80)
    xs = (np.random.default_rng(1).standard_normal(shape) * 8).astype(np.float32)
    xs[0, 0, :5] = [-np.inf, 0, 1, 2, 3]  # a masked position, as in attention
    ex = _build(_softmax_mod(shape), target)
    got = _run(ex, xs, out_shape=shape)
    e = np.exp(xs.astype(np.float64) - xs.max(axis=-1, keepdims=True))
    want = e / e.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-9)
    assert not LIBM_CALL.search(ex.mod.inspect_source("asm"))


def test_whole_relax_model_uses_the_lowerings(target):
    """tvm.compile of a Relax module legalizes softmax, GELU (erf and tanh forms) and SiLU
    into PrimFuncs; with the lowerings installed none of them calls libm."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 96), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            outs = [
                bb.emit(relax.op.nn.softmax(x, axis=-1)),
                bb.emit(relax.op.nn.gelu(x)),
                bb.emit(relax.op.nn.gelu_tanh(x)),
                bb.emit(relax.op.nn.silu(x)),
            ]
            result = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(result)
    mod = bb.get()
    xs = (np.random.default_rng(2).standard_normal((4, 96)) * 3).astype(np.float32)
    for enabled in (False, True):
        ex = _build(mod, target, enabled)
        asm = "".join(m.inspect_source("asm") for m in ex.mod.imports)
        assert bool(LIBM_CALL.search(asm)) is not enabled
    vm = relax.VirtualMachine(ex, tvm.cpu())
    got = [o.numpy() for o in vm["main"](tvm.runtime.tensor(xs))]
    v = xs.astype(np.float64)
    e = np.exp(v - v.max(axis=-1, keepdims=True))
    want = [
        e / e.sum(axis=-1, keepdims=True),
        0.5 * v * (1 + _erf64(v / math.sqrt(2))),
        0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3))),
        v / (1 + np.exp(-v)),
    ]
    for g, w in zip(got, want):
        # GELU's 1 + erf(x) cancels for negative x in any float32 evaluation: absolute bound
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * np.abs(w).max())


def test_other_dtypes_keep_tvm_lowering(target):
    xs = np.linspace(-30, 30, 1000)
    ex = _build(_elementwise(tirx.exp, xs.size, 4, "float64"), target)
    got = _run(ex, xs, out_shape=xs.shape, dtype="float64")
    np.testing.assert_allclose(got, np.exp(xs), rtol=1e-15)


def test_install_is_idempotent_and_switchable(target):
    was = fastmath.is_installed()
    try:
        fastmath.install()
        fastmath.install()
        assert fastmath.is_installed()
        with fastmath.installed(False):
            assert not fastmath.is_installed()
            assert LIBM_CALL.search(
                tvm.compile(_elementwise(tirx.exp, 64, 16), target=target).mod.inspect_source("asm")
            )
        assert fastmath.is_installed()
    finally:
        fastmath.install() if was else fastmath.uninstall()
