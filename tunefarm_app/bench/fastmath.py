"""How much the vectorized math lowerings (`tunefarm.fastmath`) buy, against torch.

    tunefarm bench math [--threads 1] [--passes 5] [--records softmax=FILE ...]

Each op is built several ways from one fixed schedule (rows in parallel, the last axis
vectorized 16 wide, reductions rfactored 16 wide), so that only the math lowering differs:

  libm       TVM's own lowering: a scalar expf/erff call per element (the status quo)
  fastmath   `tunefarm.fastmath.install()`: polynomial lowerings, vectorized
  topi-fast  the workload written with topi.fast_exp / fast_erf / fast_tanh instead
             (TVM's Relax FastMathTransform does this rewrite at the graph level)
  libmvec    glibc's vector functions (_ZGVeN16v_expf...), called by a lowering rule of
             this script; x86-64 with glibc >= 2.35 only (LLVM's own -vector-library
             option is not reachable through TVM 0.27's target)
  torch      PyTorch on the same input, same thread count

`--records op=FILE` (repeatable) adds the best tuned kernel of a tunefarm records file,
rebuilt with TVM's lowering and with fastmath (rows `<file stem>+libm`, `<file stem>+fastmath`). Timing: the variants of an op run in alternation for
`--passes` passes; each keeps the best of its per-pass medians (noise on a shared machine
only slows things down). Caches are not flushed between calls, for torch neither. The
accuracy column is the maximum relative error against float64 numpy on a dense sweep
of inputs of the op's own range.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

LANES = 16
LIBMVEC = {"tirx.exp": "expf", "tirx.erf": "erff", "tirx.tanh": "tanhf"}


# -- workloads ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    name: str
    shapes: list[tuple[int, ...]]  # inputs; the output has the shape of the first
    build: Callable[[Any, bool], list]  # (te, fast) -> [inputs..., output]; fast: topi.fast_*
    torch_fn: Callable[..., Any]
    reference: Callable[..., np.ndarray]  # float64 numpy


def _softmax(te: Any, fast: bool) -> list:
    from tvm import topi

    x = te.placeholder((12, 128, 128), "float32", name="x")
    return [x, (topi.nn.fast_softmax if fast else topi.nn.softmax)(x, axis=-1)]


def _layer_norm(te: Any, fast: bool) -> list:
    from tvm import topi

    x = te.placeholder((128, 768), "float32", name="x")
    g = te.placeholder((768,), "float32", name="g")
    b = te.placeholder((768,), "float32", name="b")
    return [x, g, b, topi.nn.layer_norm(x, g, b, axis=[-1], epsilon=1e-5)]


def _gelu(kind: str) -> Callable[[Any, bool], list]:
    def build(te: Any, fast: bool) -> list:
        from tvm import topi

        x = te.placeholder((128, 3072), "float32", name="x")
        if kind == "erf":
            inner = te.compute(x.shape, lambda i, j: x[i, j] * (1 / math.sqrt(2)), name="scaled")
            f = (
                topi.fast_erf(inner)
                if fast
                else te.compute(x.shape, lambda i, j: te.erf(inner[i, j]), name="f")
            )
        else:
            c = math.sqrt(2 / math.pi)
            inner = te.compute(
                x.shape, lambda i, j: c * (x[i, j] + 0.044715 * x[i, j] * x[i, j] * x[i, j]), name="scaled"
            )
            f = (
                topi.fast_tanh(inner)
                if fast
                else te.compute(x.shape, lambda i, j: te.tanh(inner[i, j]), name="f")
            )
        return [x, te.compute(x.shape, lambda i, j: 0.5 * x[i, j] * (1.0 + f[i, j]), name="gelu")]

    return build


def _silu(te: Any, fast: bool) -> list:
    from tvm import topi

    x = te.placeholder((128, 3072), "float32", name="x")
    if fast:  # no topi.fast_sigmoid: 1 / (1 + fast_exp(-x))
        e = topi.fast_exp(te.compute(x.shape, lambda i, j: -x[i, j], name="neg"))
        return [x, te.compute(x.shape, lambda i, j: x[i, j] / (1.0 + e[i, j]), name="silu")]
    return [x, te.compute(x.shape, lambda i, j: x[i, j] * te.sigmoid(x[i, j]), name="silu")]


def _np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _np_layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(x.var(axis=-1, keepdims=True) + 1e-5) * g + b


def _np_gelu_erf(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _np_gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _ops() -> dict[str, Op]:
    import torch.nn.functional as F

    return {
        op.name: op
        for op in (
            Op("softmax", [(12, 128, 128)], _softmax, lambda x: F.softmax(x, -1), _np_softmax),
            Op(
                "layer_norm",
                [(128, 768), (768,), (768,)],
                _layer_norm,
                lambda x, g, b: F.layer_norm(x, (768,), g, b, 1e-5),
                _np_layer_norm,
            ),
            Op("gelu_erf", [(128, 3072)], _gelu("erf"), F.gelu, _np_gelu_erf),
            Op(
                "gelu_tanh",
                [(128, 3072)],
                _gelu("tanh"),
                lambda x: F.gelu(x, approximate="tanh"),
                _np_gelu_tanh,
            ),
            Op("silu", [(128, 3072)], _silu, F.silu, lambda x: x / (1 + np.exp(-x))),
        )
    }


# -- one fixed schedule for every variant -----------------------------------------------------


def fixed_schedule(mod: Any) -> Any:
    """Rows of the output in parallel, its last axis vectorized; every other block computed
    per row, spatial ones vectorized, reductions rfactored LANES wide (elementwise
    intermediates are inlined)."""
    import tvm

    sch = tvm.s_tir.Schedule(mod)
    root = sch.get_sblock("root")
    blocks = [sch.get(b).name_hint for b in sch.get_child_blocks(root)]
    out_name = blocks[-1]
    reductions = [n for n in blocks[:-1] if _is_reduction(sch, n)]
    for n in blocks[:-1]:
        if n not in reductions and len(sch.get_consumers(sch.get_sblock(n))) == 1:
            sch.compute_inline(sch.get_sblock(n))
    rf = {}
    for n in reductions:
        k = sch.get_loops(sch.get_sblock(n))[-1]
        if sch.get(k).extent.value % LANES == 0:
            _, ki = sch.split(k, [None, LANES])
            rf[n] = sch.get(
                sch.rfactor(ki, factor_axis=len(sch.get(sch.get_sblock(n)).iter_vars) - 1)
            ).name_hint
    out = sch.get_sblock(out_name)
    *rows, col = sch.get_loops(out)
    row = sch.fuse(*rows) if len(rows) > 1 else rows[0]
    if len(rows) > 1 or sch.get(col).extent.value % LANES == 0:
        sch.vectorize(sch.split(col, [None, LANES])[1])
    remaining = [n for n in blocks[:-1] if _exists(sch, n)]
    order = [m for n in remaining for m in ([rf[n]] if n in rf else []) + [n]]
    for n in reversed(order):
        sch.compute_at(sch.get_sblock(n), row)
    decompose = []
    for n in order:
        b = sch.get_sblock(n)
        loops = sch.get_loops(b)[1:]
        if n in rf.values():  # loops (rf, rest): reduce outside, the LANES partial results inside
            sch.reorder(loops[1], loops[0])
            sch.vectorize(loops[0])
            decompose.append((b, loops[1]))
        elif _is_reduction(sch, n):
            decompose.append((b, loops[0]))
        elif loops and sch.get(loops[-1]).extent.value % LANES == 0:
            sch.vectorize(sch.split(loops[-1], [None, LANES])[1])
    sch.parallel(row)
    for b, loop in decompose:  # after the parallel annotation, which TVM checks on the reduction
        sch.decompose_reduction(b, loop)
    return sch.mod


def _is_reduction(sch: Any, name: str) -> bool:
    return any(int(iv.iter_type) == 2 for iv in sch.get(sch.get_sblock(name)).iter_vars)


def _exists(sch: Any, name: str) -> bool:
    try:
        sch.get_sblock(name)
    except Exception:  # inlined
        return False
    return True


# -- the libmvec option, as a lowering rule of this script ------------------------------------


class LibmvecRule:
    """While `active`, float32 calls of exp/erf/tanh with 16 (or 8) lanes become calls of
    glibc's libmvec variants; anything else goes to the rule that was there before."""

    def __init__(self) -> None:
        import tvm

        from tunefarm import fastmath

        was = fastmath.is_installed()
        fastmath.install()  # register fastmath's rules first, so that this one falls back to them
        if not was:
            fastmath.uninstall()
        ctypes.CDLL("libmvec.so.1", mode=ctypes.RTLD_GLOBAL)  # the JIT resolves symbols from the process
        self.active = False
        for op_name, base in LIBMVEC.items():
            previous = tvm.ir.Op.get(op_name).get_attr("llvm.FLowerIntrinsic")
            tvm.tirx.register_intrin_lowering(op_name, "llvm", f=self._rule(base, previous), level=90)

    def _rule(self, base: str, previous: Any) -> Callable[[Any], Any]:
        from tvm import tirx

        def lower(call: Any) -> Any:
            dt = call.ty.dtype
            isa = {16: "e", 8: "d"}.get(dt.lanes)
            if self.active and dt.type_code == 2 and dt.bits == 32 and isa:
                return tirx.call_pure_extern(str(dt), f"_ZGV{isa}N{dt.lanes}v_{base}", call.args[0])
            return previous(call) if previous is not None else call

        return lower


# -- building, checking, timing ---------------------------------------------------------------


@dataclass
class Variant:
    label: str
    run: Callable[[], Any]  # one call
    timer: Callable[[], float] | None  # TVM's time_evaluator (median of a pass), else None
    max_rel: float
    best: float = math.inf


def _compile(mod: Any, target: Any, how: str, libmvec: LibmvecRule | None) -> Any:
    import tvm

    from tunefarm import fastmath

    if libmvec is not None:
        libmvec.active = how == "libmvec"
    with fastmath.installed(how == "fastmath"):
        ex = tvm.compile(mod, target=target)
    if libmvec is not None:
        libmvec.active = False
    return ex.jit()


def _tvm_variant(label: str, lib: Any, data: list[np.ndarray], ref: np.ndarray) -> Variant:
    import tvm

    args = [tvm.runtime.tensor(a) for a in data]
    out = tvm.runtime.empty(ref.shape, "float32")
    lib["main"](*args, out)
    err = _max_rel(out.numpy(), ref)
    evaluator = lib.time_evaluator("main", tvm.cpu(), number=10, repeat=5, min_repeat_ms=20)

    def timer() -> float:
        return float(evaluator(*args, out).median)

    return Variant(label, lambda: lib["main"](*args, out), timer, err)


def _max_rel(got: np.ndarray, ref: np.ndarray) -> float:
    """Largest error relative to the output's scale (the tuner's atol is relative to it too)."""
    scale = np.maximum(np.abs(ref), 1e-3 * np.abs(ref).max())
    return float((np.abs(got.astype(np.float64) - ref) / scale).max())


def _time_python(fn: Callable[[], Any], min_secs: float = 0.1) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    fn()
    per = max(1, int(0.005 / max(time.perf_counter() - t0, 1e-9)))
    samples = []
    start = time.perf_counter()
    while len(samples) < 5 or time.perf_counter() - start < min_secs:
        t0 = time.perf_counter()
        for _ in range(per):
            fn()
        samples.append((time.perf_counter() - t0) / per)
    return statistics.median(samples)


def _tuned_mod(path: str) -> Any:
    import tvm

    from tunefarm import wmma
    from tunefarm.store import JsonlRecordStore

    store = JsonlRecordStore(path)
    valid = [r for r in store.load() if r.is_valid]
    if not valid:
        raise SystemExit(f"{path}: no valid record")
    best = min(valid, key=lambda r: r.cost)
    stored = store.get_workload(best.task)
    if stored is None:
        raise SystemExit(f"{path}: workload sidecar missing")
    sch = tvm.s_tir.Schedule(tvm.ir.load_json(stored[1]))
    if wmma.uses_wmma(best.trace):
        wmma.register()
    tvm.s_tir.Trace.apply_json_to_schedule(best.trace, sch)
    return sch.mod


def bench_op(op: Op, target: Any, libmvec: LibmvecRule | None, records: list[str], passes: int) -> None:
    import torch
    import tvm
    from tvm import te

    rng = np.random.default_rng(0)
    data = [
        (rng.standard_normal(s) * (4 if i == 0 else 1)).astype(np.float32) for i, s in enumerate(op.shapes)
    ]
    ref = op.reference(*[a.astype(np.float64) for a in data])
    plain = fixed_schedule(tvm.IRModule({"main": te.create_prim_func(op.build(te, False))}))
    hows = ["libm", "fastmath"] + (["libmvec"] if libmvec is not None else [])
    variants = [_tvm_variant(h, _compile(plain, target, h, libmvec), data, ref) for h in hows]
    fast_mod = fixed_schedule(tvm.IRModule({"main": te.create_prim_func(op.build(te, True))}))
    variants.append(_tvm_variant("topi-fast", _compile(fast_mod, target, "libm", None), data, ref))
    for path in records:
        tuned = _tuned_mod(path)
        for h in ("libm", "fastmath"):
            label = f"{os.path.basename(path).split('.')[0]}+{h}"
            variants.append(_tvm_variant(label, _compile(tuned, target, h, libmvec), data, ref))
    tdata = [torch.from_numpy(a) for a in data]
    got = op.torch_fn(*tdata).numpy()
    variants.append(Variant("torch", lambda: op.torch_fn(*tdata), None, _max_rel(got, ref)))
    for _ in range(passes):
        for v in variants:
            time.sleep(0.02)  # let TVM's pool threads go idle before the next variant
            v.best = min(v.best, v.timer() if v.timer else _time_python(v.run))
    nbytes = sum(a.nbytes for a in data) + ref.size * 4
    t_torch = variants[-1].best
    print(f"\n{op.name} {'x'.join(map(str, op.shapes[0]))} ({nbytes / 1e6:.2f} MB moved per call)")
    print(f"  {'variant':16s} {'us':>9s} {'GB/s':>7s} {'vs torch':>9s} {'max rel err':>12s}")
    for v in variants:
        print(
            f"  {v.label:16s} {v.best * 1e6:9.1f} {nbytes / v.best / 1e9:7.1f} {t_torch / v.best:8.2f}x {v.max_rel:12.2e}"
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads", type=int, default=1, help="TVM and torch threads (default 1: a shared machine)"
    )
    p.add_argument("--passes", type=int, default=5, help="timing passes; each op keeps its best (default 5)")
    p.add_argument("--ops", default="softmax,layer_norm,gelu_erf,gelu_tanh,silu", help="comma-separated ops to time")
    p.add_argument(
        "--records", action="append", default=[], metavar="OP=FILE", help="add a tuned kernel (repeatable)"
    )
    p.add_argument("--no-libmvec", action="store_true", help="leave out the glibc libmvec column")


def add_command(bsub) -> None:
    """`tunefarm bench math`."""
    add_arguments(bsub.add_parser("math", help="the vectorized math lowerings against libm, libmvec and torch"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tunefarm_app.bench.fastmath", description=__doc__.splitlines()[0]
    )
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    os.environ["TVM_NUM_THREADS"] = str(args.threads)  # read when TVM's thread pool starts
    import torch
    import tvm

    from tunefarm.target import host_target_dict

    torch.set_num_threads(args.threads)
    target_dict = host_target_dict()
    target = tvm.target.Target(target_dict)
    libmvec = None
    if not args.no_libmvec:
        try:
            libmvec = LibmvecRule()
        except OSError as exc:
            print(f"libmvec unavailable ({exc}); skipped", file=sys.stderr)
    records: dict[str, list[str]] = {}
    for item in args.records:
        name, _, path = item.partition("=")
        records.setdefault(name, []).append(path)
    ops = _ops()
    print(
        f"target {target_dict}, {args.threads} thread(s), torch {torch.__version__}, best of {args.passes} passes"
    )
    for name in args.ops.split(","):
        bench_op(ops[name], target, libmvec, records.get(name, []), args.passes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
