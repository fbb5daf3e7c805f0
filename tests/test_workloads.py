"""The built-in registry (every op, compiled by TVM and compared to its numpy reference) and
the loader (`file.py:function`, TVMScript files, and their error messages)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import tvm

from tunefarm.errors import UsageError, WorkloadError
from tunefarm.workloads import load_workload, registry
from tunefarm.workloads.loader import parse_shape

# Small shapes, one or more per op; odd sizes, strides, padding and groups on purpose.
SMALL = [
    ("matmul", {"M": 16, "N": 24, "K": 8}),
    ("matmul_relu", {"M": 16, "N": 8, "K": 12}),
    ("batch_matmul", {"B": 3, "M": 5, "N": 7, "K": 4}),
    ("matmul_fp16", {"M": 16, "N": 24, "K": 8}),
    ("dense_fp16", {"M": 5, "N": 7, "K": 12}),
    ("batch_matmul_fp16", {"B": 2, "M": 5, "N": 7, "K": 4}),
    ("conv1d", {"N": 2, "C": 3, "L": 17, "F": 5, "KW": 3, "stride": 2, "pad": 1, "dilation": 2}),
    (
        "conv2d",
        {"N": 1, "C": 4, "H": 9, "W": 9, "F": 6, "KH": 3, "KW": 3, "stride": 2, "pad": 1, "groups": 2},
    ),
    ("conv2d", {"N": 2, "C": 3, "H": 8, "W": 7, "F": 4, "KH": 3, "KW": 2, "pad": 2, "dilation": 2}),
    ("conv2d", {"N": 1, "C": 4, "H": 6, "W": 6, "F": 8, "KH": 3, "KW": 3, "groups": 4}),  # depthwise x2
    ("conv2d_1x1", {"N": 2, "C": 8, "H": 5, "W": 5, "F": 6, "stride": 2}),
    ("depthwise_conv2d", {"N": 1, "C": 4, "H": 10, "W": 10, "KH": 3, "KW": 3, "stride": 2, "pad": 1}),
    ("conv3d", {"N": 1, "C": 2, "D": 5, "H": 6, "W": 6, "F": 3, "KD": 3, "KH": 2, "KW": 3}),
    ("conv2d_nhwc", {"N": 2, "C": 3, "H": 8, "W": 7, "F": 4, "KH": 3, "KW": 2, "stride": 2, "pad": 2, "dilation": 2}),
    ("conv2d_winograd", {"N": 2, "C": 3, "H": 7, "W": 6, "F": 5, "pad": 1, "m": 2}),
    ("conv2d_winograd", {"N": 1, "C": 4, "H": 9, "W": 6, "F": 3, "pad": 0, "m": 4}),
    ("conv2d_transpose", {"N": 1, "C": 3, "H": 5, "W": 4, "F": 2, "KH": 4, "KW": 3, "stride": 2, "pad": 1}),
    ("conv2d_transpose", {"N": 2, "C": 2, "H": 3, "W": 3, "F": 3, "KH": 2, "KW": 2, "stride": 3, "pad": 0}),
    ("softmax", {"B": 2, "M": 3, "N": 17}),
    ("layer_norm", {"M": 5, "N": 33}),
    ("norm2", {"M": 7, "N": 9}),
]

LLVM = {"kind": "llvm"}


def _case_id(case) -> str:
    name, params = case
    return name + "-" + "-".join(f"{k}{v}" for k, v in params.items())


def _run(wl, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Compile the unscheduled program and run it once."""
    ex = tvm.compile(wl.mod, target=tvm.target.Target(LLVM))
    dev = tvm.cpu()
    outs = [tvm.runtime.empty(o.shape, o.dtype, dev) for o in wl.outputs]
    ex["main"](*[tvm.runtime.tensor(a, dev) for a in inputs], *outs)
    return [o.numpy() for o in outs]


def _random_inputs(wl, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, size=t.shape).astype(t.dtype) for t in wl.inputs]


def test_every_op_has_a_small_case():
    assert {name for name, _ in SMALL} == set(registry.OPS)


@pytest.mark.parametrize("case", SMALL, ids=_case_id)
def test_op_matches_reference(case):
    name, params = case
    wl = registry.make(name, params)
    inputs = _random_inputs(wl)
    got = _run(wl, inputs)
    want = wl.reference(*inputs)
    assert len(got) == len(want) == len(wl.outputs)
    for g, w, spec in zip(got, want, wl.outputs, strict=True):
        assert w.dtype == np.float32 and w.shape == spec.shape
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_defaults_build_and_name_every_parameter():
    for name, op in registry.OPS.items():
        wl = registry.make(name, {})
        assert wl.name == name + "(" + ",".join(f"{k}={v}" for k, v in op.params.items()) + ")"
        assert wl.flops > 0 and wl.inputs and wl.outputs
        assert wl.memory_bound == op.memory_bound
    # a parameter given explicitly with its default value names the same workload
    assert registry.make("matmul", {"K": 1024}).name == "matmul(M=1024,N=1024,K=1024)"
    assert registry.make("matmul", {"K": 64}).name == "matmul(M=1024,N=1024,K=64)"


def test_matmul_flops_match_tvm_estimate():
    from tvm.s_tir.analysis import estimate_tir_flops

    wl = registry.make("matmul", {"M": 64, "N": 48, "K": 32})
    assert wl.flops == 2 * 64 * 48 * 32 == estimate_tir_flops(wl.mod)


def test_conv2d_transpose_reference_follows_the_definition():
    """out[n,f,i*stride-pad+ky, j*stride-pad+kx] += x[n,c,i,j] * w[c,f,ky,kx] (PyTorch)."""
    p = {"N": 1, "C": 2, "H": 3, "W": 4, "F": 3, "KH": 3, "KW": 2, "stride": 2, "pad": 1}
    wl = registry.make("conv2d_transpose", p)
    x, w = _random_inputs(wl, seed=1)
    out = np.zeros(wl.outputs[0].shape)
    _, _, ho, wo = out.shape
    for c, i, j, f, ky, kx in np.ndindex(p["C"], p["H"], p["W"], p["F"], p["KH"], p["KW"]):
        y, z = i * p["stride"] - p["pad"] + ky, j * p["stride"] - p["pad"] + kx
        if 0 <= y < ho and 0 <= z < wo:
            out[0, f, y, z] += x[0, c, i, j] * w[c, f, ky, kx]
    np.testing.assert_allclose(wl.reference(x, w)[0], out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "name, params, word",
    [
        ("matmul", {"Q": 3}, "Q"),
        ("matmul", {"M": 0}, "M"),
        ("conv2d", {"C": 6, "F": 6, "groups": 4}, "groups"),
        ("conv2d", {"H": 2, "W": 2, "KH": 5, "pad": 1}, "KH"),
        ("conv2d", {"pad": -1}, "pad"),
        ("conv2d_transpose", {"H": 1, "KH": 2, "stride": 1, "pad": 1}, "pad"),
        ("softmax", {"N": -3}, "N"),
    ],
)
def test_bad_parameters_raise_usage_error_naming_them(name, params, word):
    with pytest.raises(UsageError, match=word) as info:
        registry.make(name, params)
    assert "\n" not in str(info.value)


def test_unknown_parameter_lists_the_allowed_ones():
    with pytest.raises(UsageError, match="allowed: M, N, K"):
        registry.make("matmul", {"Q": 3})


# ---------------------------------------------------------------------------- loader

TE_FILE = """
from tvm import te

def matmul(M=8, N=8, K=8):
    assert all(type(v) is int for v in (M, N, K)), "shape values must arrive as ints"
    A = te.placeholder((M, K), "float32", name="A")
    B = te.placeholder((K, N), "float32", name="B")
    k = te.reduce_axis((0, K), name="k")
    C = te.compute((M, N), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k), name="C")
    return [A, B, C]

def boom():
    raise RuntimeError("kaput")

def not_tensors():
    return 42
"""

PRIM_FUNC = """
@T.prim_func(s_tir=True)
def {name}(A: T.Buffer((8, 4), "float32"), B: T.Buffer((8, 4), "float32")):
    for i, j in T.grid(8, 4):
        with T.sblock("B"):
            vi, vj = T.axis.remap("SS", [i, j])
            B[vi, vj] = A[vi, vj] * T.float32(2)
"""

TVMSCRIPT_HEADER = "from tvm.script import tirx as T\n"


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_parse_shape():
    assert parse_shape(None) == {} and parse_shape("") == {}
    assert parse_shape("M=1024, N=512,") == {"M": 1024, "N": 512}


@pytest.mark.parametrize(
    "text, word", [("M=abc", "M must be an integer"), ("M1024", "NAME=INT"), ("=3", "NAME=INT")]
)
def test_parse_shape_rejects_bad_text(text, word):
    with pytest.raises(UsageError, match=word):
        parse_shape(text)


def test_load_registry_op_with_shape():
    wl = load_workload("matmul", "M=16,N=8")
    assert wl.name == "matmul(M=16,N=8,K=1024)"
    with pytest.raises(UsageError, match="Q"):
        load_workload("matmul", "Q=4")


def test_load_te_function_passes_shape_as_ints(tmp_path):
    path = _write(tmp_path, "ops.py", TE_FILE)
    wl = load_workload(f"{path}:matmul", "N=6,M=4")
    assert wl.name == "ops.py:matmul(M=4,N=6,K=8)"  # signature order, defaults included
    assert [t.shape for t in wl.inputs] == [(4, 8), (8, 6)]
    assert [t.shape for t in wl.outputs] == [(4, 6)]
    assert wl.flops == 2 * 4 * 6 * 8
    a, b = _random_inputs(wl)
    np.testing.assert_allclose(_run(wl, [a, b])[0], a @ b, rtol=1e-5, atol=1e-5)
    assert load_workload(f"{path}:matmul").name == "ops.py:matmul(M=8,N=8,K=8)"


def test_load_tvmscript_file(tmp_path):
    path = _write(tmp_path, "double.py", TVMSCRIPT_HEADER + PRIM_FUNC.format(name="double"))
    wl = load_workload(path)
    assert wl.name == "double.py:double"
    assert [t.name for t in wl.inputs] == ["A"] and [t.name for t in wl.outputs] == ["B"]
    (a,) = _random_inputs(wl)
    np.testing.assert_allclose(_run(wl, [a])[0], 2 * a)


@pytest.mark.parametrize(
    "spec, shape, error, word",
    [
        ("{dir}/missing.py:f", None, WorkloadError, "no such file"),
        ("{dir}/ops.py:nope", None, WorkloadError, "no function 'nope'"),
        ("{dir}/ops.py:boom", None, WorkloadError, "RuntimeError: kaput"),
        ("{dir}/ops.py:matmul", "Q=2", WorkloadError, "calling ops.py:matmul"),
        ("{dir}/ops.py:not_tensors", None, WorkloadError, "list of TE tensors"),
        ("{dir}/two.py", None, WorkloadError, "several PrimFuncs"),
        ("{dir}/ops.py", None, WorkloadError, "defines no @T.prim_func"),
        ("{dir}/broken.py", None, WorkloadError, "importing .* failed"),
        ("{dir}/two.py", "M=2", UsageError, "--shape"),
        ("no_such_op", None, UsageError, "unknown workload"),
        ("matmul", "M=x", UsageError, "M must be an integer"),
    ],
)
def test_loader_errors_are_one_line(tmp_path, spec, shape, error, word):
    _write(tmp_path, "ops.py", TE_FILE)
    _write(tmp_path, "broken.py", "import no_such_module_anywhere\n")
    two = PRIM_FUNC.format(name="first") + PRIM_FUNC.format(name="second")
    _write(tmp_path, "two.py", TVMSCRIPT_HEADER + two)
    with pytest.raises(error, match=word) as info:
        load_workload(spec.format(dir=tmp_path), shape)
    assert "\n" not in str(info.value)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize(
    ("spec", "shape", "blocks"),
    [
        ("my_ops.py:capsule_conv2d", "H=6,W=6,CI=4,CO=4", {"padded", "capsule_conv2d"}),
        ("my_ops.py:bias_gelu", "M=8,N=16", {"biased", "gelu"}),
        ("kernel.py", None, {"C"}),
    ],
)
def test_the_readme_example_workloads_load_and_get_sketches(spec, shape, blocks):
    """The example files the README points at load as workloads and get sketches; the
    capsule convolution's data-reuse block gets multi-level tiling."""
    from tunefarm.search.space.dag import analyse
    from tunefarm.search.space.sketch import TileStep, generate_sketches

    wl = load_workload(str(EXAMPLES / spec), shape)
    dag = analyse(wl.mod["main"])
    assert {b.name for b in dag.blocks} == blocks
    sketches = generate_sketches(dag, num_cores=2)
    assert sketches
    if "capsule" in spec:
        assert any(isinstance(st, TileStep) and st.block == "capsule_conv2d" for sk in sketches for st in sk.steps)


def test_buffers_of_one_name_are_renamed_and_a_function_without_them_is_kept_as_it_is(monkeypatch):
    """TE names tensors after their operator, so two buffers may share a name ("T_add"): the
    search addresses buffers by name, and the workload gets one name each (a TVMScript round
    trip). Loop variables repeat their names in every nest and are no buffers: a function
    whose buffers are distinct is kept, with no round trip (it cost ~0.75 s a fused task)."""
    from tvm import te, topi

    from tunefarm.workloads import base

    trips = []
    real = tvm.script.from_source
    monkeypatch.setattr(tvm.script, "from_source", lambda src: trips.append(src) or real(src))
    x = te.placeholder((8, 8), name="x")
    twice = topi.add(topi.add(x, x), x)  # both adds' outputs are named "T_add"
    wl = base.workload_from_te("adds", [x, twice])
    names = [b.name for b in wl.mod["main"].params]
    assert len(trips) == 1 and len(set(names)) == len(names)
    trips.clear()
    base.workload_from_te("gemm", registry.OPS["matmul"].build({"M": 8, "N": 8, "K": 8}))  # loops i, j, k twice
    assert trips == []
