"""Built-in workloads with shape parameters: `matmul`, `conv2d`, `softmax`, ...

Each op is one `OpDef`: its parameters with their defaults (the benchmark shapes), the TE
computation, the FLOP count and a numpy reference, kept next to each other below.
`make(name, params)` fills in the defaults, checks the values and returns a `Workload`
named with every parameter, e.g. `matmul(M=1024,N=1024,K=1024)`, so the name is a stable
identity for records.

Conventions:
- Every stage is a `te.compute` (no extern ops): the search engine schedules blocks.
  Inputs are placeholders named `A`/`B`, `data`/`weight` or `x`; padding is its own
  stage named `pad`.
- FLOPs count a multiply-add as 2. Ops without multiply-adds count a small documented
  constant per element.
- References take and return float32 arrays, compute in float64, and use BLAS-backed
  numpy calls (no Python loop over pixels), so they are fast at the default shapes.

To add an op: write `_<op>_build(p)` returning the TE tensors (inputs first, then
outputs) and `_<op>_reference(p)` returning a numpy function of the input arrays; below
them define the `OpDef` (defaults, flop formula, `check`) and list it in `OPS` at the
bottom. `p` is the dict of all parameters, defaults filled in. `check(p)` runs before
`build` and raises `UsageError` naming the bad parameter (`_sizes(op)` covers ops whose
parameters are all sizes). Then add a small shape for it to `SMALL` in
tests/test_workloads.py, which compiles it and compares it to the reference.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from tunefarm.errors import UsageError
from tunefarm.workloads.base import Reference, Workload, workload_from_te

Params = dict[str, int]
"""All parameters of an op, in canonical order, defaults filled in."""


@dataclass(frozen=True)
class OpDef:
    """One built-in op. `build`, `flops`, `reference` and `check` take the full `Params`."""

    name: str
    summary: str  # one line, for `tunefarm ops`-style listings
    params: Params  # parameter name -> default, in canonical (display) order
    build: Callable[[Params], list]  # -> TE tensors, inputs first, then outputs
    flops: Callable[[Params], float]
    reference: Callable[[Params], Reference]
    check: Callable[[Params], None]  # raises UsageError naming the bad parameter
    memory_bound: bool = False
    constants: tuple[str, ...] = ()  # inputs that are always constant (`Workload.constants`)

    def resolve(self, given: dict[str, int]) -> Params:
        """The defaults overridden by `given`; unknown names or non-integers raise UsageError."""
        unknown = [k for k in given if k not in self.params]
        if unknown:
            allowed = ", ".join(self.params)
            raise UsageError(f"{self.name}: unknown parameter {unknown[0]!r}; allowed: {allowed}")
        for k, v in given.items():
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise UsageError(f"{self.name}: parameter {k} must be an integer, got {v!r}")
        p = {k: int(given.get(k, default)) for k, default in self.params.items()}
        self.check(p)
        return p

    def display_name(self, p: Params) -> str:
        return f"{self.name}(" + ",".join(f"{k}={p[k]}" for k in self.params) + ")"


def make(name: str, params: dict[str, int] | None = None) -> Workload:
    """The registry op `name` at the given shape (missing parameters take their defaults)."""
    op = OPS.get(name)
    if op is None:
        raise UsageError(f"unknown op {name!r}; known: {', '.join(sorted(OPS))}")
    p = op.resolve(params or {})
    workload = workload_from_te(
        op.display_name(p),
        op.build(p),
        flops=float(op.flops(p)),
        reference=op.reference(p),
        memory_bound=op.memory_bound,
    )
    return workload.with_constants(op.constants) if op.constants else workload


# ---------------------------------------------------------------------------- helpers


def _te():
    """TVM is imported lazily so that listing the ops does not load it."""
    import tvm
    from tvm import te, topi

    return tvm, te, topi


def _check_positive(op: str, p: Params, names: Iterable[str]) -> None:
    for k in names:
        if p[k] < 1:
            raise UsageError(f"{op}: {k} must be positive, got {p[k]}")


def _check_nonnegative(op: str, p: Params, names: Iterable[str]) -> None:
    for k in names:
        if p[k] < 0:
            raise UsageError(f"{op}: {k} must be >= 0, got {p[k]}")


def _sizes(op: str) -> Callable[[Params], None]:
    """`check` for an op whose parameters are all sizes (each must be positive)."""
    return lambda p: _check_positive(op, p, p)


def _p(p: Params, keys: Iterable[str]) -> float:
    """Product of the named parameters: `_p(p, "MNK")`."""
    return float(math.prod(p[k] for k in keys))


def _f32(*arrays: np.ndarray) -> list[np.ndarray]:
    return [np.ascontiguousarray(a, dtype=np.float32) for a in arrays]


# ---------------------------------------------------------------------------- matmul family


def _matmul_build(p: Params) -> list:
    _, te, _ = _te()
    A = te.placeholder((p["M"], p["K"]), "float32", name="A")
    B = te.placeholder((p["K"], p["N"]), "float32", name="B")
    k = te.reduce_axis((0, p["K"]), name="k")
    C = te.compute((p["M"], p["N"]), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k), name="C")
    return [A, B, C]


HALF_INPUTS = "float16"
"""Input dtype of the reduced-precision GEMMs (`*_fp16`): float16 operands, products and
sums in float32 (cuBLAS's fp16 GEMM with fp32 accumulation; tensor cores on sm_70+)."""


def _half_matmul_build(batched: bool, b_transposed: bool) -> Callable[[Params], list]:
    """A GEMM of float16 inputs accumulated and stored in float32: C = sum_k f32(A) * f32(B)
    (B as [.., N, K] when `b_transposed`, a dense layer's weight)."""

    def build(p: Params) -> list:
        _, te, _ = _te()
        batch = (p["B"],) if batched else ()
        b_shape = (p["N"], p["K"]) if b_transposed else (p["K"], p["N"])
        A = te.placeholder((*batch, p["M"], p["K"]), HALF_INPUTS, name="A")
        B = te.placeholder((*batch, *b_shape), HALF_INPUTS, name="B")
        k = te.reduce_axis((0, p["K"]), name="k")

        def body(*idx):
            *b, i, j = idx
            rhs = B[(*b, j, k)] if b_transposed else B[(*b, k, j)]
            return te.sum(A[(*b, i, k)].astype("float32") * rhs.astype("float32"), axis=k)

        C = te.compute((*batch, p["M"], p["N"]), body, name="C")
        return [A, B, C]

    return build


def _half_matmul_reference(b_transposed: bool) -> Callable[[Params], Reference]:
    """float64 from the float16 inputs (their products are exact in float32: the
    reference differs from an fp32-accumulating kernel by the accumulation's rounding)."""

    def reference(p: Params) -> Reference:
        def run(a, b):
            b64 = b.astype(np.float64)
            return _f32(np.matmul(a.astype(np.float64), np.swapaxes(b64, -1, -2) if b_transposed else b64))

        return run

    return reference


def _matmul_relu_build(p: Params) -> list:
    tvm, te, _ = _te()
    A, B, C = _matmul_build(p)
    D = te.compute(C.shape, lambda i, j: te.max(C[i, j], tvm.tirx.const(0, "float32")), name="relu")
    return [A, B, D]


def _batch_matmul_build(p: Params) -> list:
    _, te, _ = _te()
    A = te.placeholder((p["B"], p["M"], p["K"]), "float32", name="A")
    B = te.placeholder((p["B"], p["K"], p["N"]), "float32", name="B")
    k = te.reduce_axis((0, p["K"]), name="k")
    C = te.compute(
        (p["B"], p["M"], p["N"]), lambda b, i, j: te.sum(A[b, i, k] * B[b, k, j], axis=k), name="C"
    )
    return [A, B, C]


def _matmul_reference(relu: bool) -> Callable[[Params], Reference]:
    def reference(p: Params) -> Reference:
        def run(a, b):
            c = np.matmul(a.astype(np.float64), b.astype(np.float64))
            return _f32(np.maximum(c, 0) if relu else c)

        return run

    return reference


MATMUL = OpDef(
    name="matmul",
    summary="C[i,j] = sum_k A[i,k] * B[k,j]",
    params=dict(M=1024, N=1024, K=1024),
    build=_matmul_build,
    flops=lambda p: 2 * _p(p, "MNK"),
    reference=_matmul_reference(relu=False),
    check=_sizes("matmul"),
)

MATMUL_RELU = OpDef(
    name="matmul_relu",
    summary="matmul followed by max(C, 0) as a separate stage",
    params=dict(M=512, N=512, K=512),
    build=_matmul_relu_build,
    flops=lambda p: 2 * _p(p, "MNK") + _p(p, "MN"),
    reference=_matmul_reference(relu=True),
    check=_sizes("matmul_relu"),
)

BATCH_MATMUL = OpDef(
    name="batch_matmul",
    summary="C[b,i,j] = sum_k A[b,i,k] * B[b,k,j]",
    params=dict(B=12, M=128, N=128, K=64),
    build=_batch_matmul_build,
    flops=lambda p: 2 * _p(p, "BMNK"),
    reference=_matmul_reference(relu=False),
    check=_sizes("batch_matmul"),
)


MATMUL_FP16 = OpDef(
    name="matmul_fp16",
    summary="C[i,j] = sum_k A[i,k] * B[k,j], float16 A and B, float32 accumulation and C",
    params=dict(M=1024, N=1024, K=1024),
    build=_half_matmul_build(batched=False, b_transposed=False),
    flops=lambda p: 2 * _p(p, "MNK"),
    reference=_half_matmul_reference(b_transposed=False),
    check=_sizes("matmul_fp16"),
)

DENSE_FP16 = OpDef(
    name="dense_fp16",
    summary="C[i,j] = sum_k A[i,k] * W[j,k] (a dense layer), float16 A and W, float32 accumulation and C",
    params=dict(M=128, N=1024, K=1024),
    build=_half_matmul_build(batched=False, b_transposed=True),
    flops=lambda p: 2 * _p(p, "MNK"),
    reference=_half_matmul_reference(b_transposed=True),
    check=_sizes("dense_fp16"),
    constants=("B",),
)

BATCH_MATMUL_FP16 = OpDef(
    name="batch_matmul_fp16",
    summary="C[b,i,j] = sum_k A[b,i,k] * B[b,k,j], float16 A and B, float32 accumulation and C",
    params=dict(B=12, M=128, N=128, K=64),
    build=_half_matmul_build(batched=True, b_transposed=False),
    flops=lambda p: 2 * _p(p, "BMNK"),
    reference=_half_matmul_reference(b_transposed=False),
    check=_sizes("batch_matmul_fp16"),
)


# ---------------------------------------------------------------------------- convolutions


@dataclass(frozen=True)
class _Conv:
    """An N-d convolution, NC[spatial] data and F,C/groups,[kernel] weight, square strides."""

    n: int
    c: int
    f: int
    size: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: int
    pad: int
    dilation: int
    groups: int

    @property
    def out(self) -> tuple[int, ...]:
        return tuple(
            (s + 2 * self.pad - self.dilation * (k - 1) - 1) // self.stride + 1
            for s, k in zip(self.size, self.kernel, strict=True)
        )

    @property
    def flops(self) -> float:
        return 2.0 * self.n * self.f * math.prod(self.out) * (self.c // self.groups) * math.prod(self.kernel)


def _conv_build(cv: _Conv, name: str) -> list:
    """data -> pad -> conv. Reduction axes of extent 1 are left out (1x1 kernels, depthwise)."""
    tvm, te, topi = _te()
    nd = len(cv.size)
    data = te.placeholder((cv.n, cv.c, *cv.size), "float32", name="data")
    weight = te.placeholder((cv.f, cv.c // cv.groups, *cv.kernel), "float32", name="weight")
    padded = topi.nn.pad(data, [0, 0] + [cv.pad] * nd, name="pad") if cv.pad else data
    cg, fg = cv.c // cv.groups, cv.f // cv.groups
    rc = te.reduce_axis((0, cg), name="rc") if cg > 1 else None
    rk = [te.reduce_axis((0, k), name=f"r{d}") if k > 1 else None for d, k in enumerate(cv.kernel)]
    axes = [a for a in [rc, *rk] if a is not None]
    zero = tvm.tirx.const(0, "int32")

    def body(n, f, *pos):
        taps = [r if r is not None else zero for r in rk]
        c_in = rc if rc is not None else zero  # input channel within f's group
        ch = c_in if cv.groups == 1 else (f if fg == 1 else f // fg) * cg + c_in
        x = padded[(n, ch, *(o * cv.stride + r * cv.dilation for o, r in zip(pos, taps, strict=True)))]
        prod = x * weight[(f, c_in, *taps)]
        return te.sum(prod, axis=axes) if axes else prod

    out = te.compute((cv.n, cv.f, *cv.out), body, name=name, varargs_names=[f"o{d}" for d in range(nd)])
    return [data, weight, out]


def _conv_reference(cv: _Conv) -> Reference:
    """One batched matmul per kernel position: out[n,g,f,P] += w[g,f,c] @ x[n,g,c,P]."""

    def run(x, w):
        nd, g = len(cv.size), cv.groups
        x = np.pad(x.astype(np.float64), [(0, 0), (0, 0)] + [(cv.pad, cv.pad)] * nd)
        w = w.astype(np.float64).reshape(g, cv.f // g, cv.c // g, *cv.kernel)
        out = np.zeros((cv.n, g, cv.f // g, math.prod(cv.out)))
        for pos in itertools.product(*(range(k) for k in cv.kernel)):
            window = tuple(
                slice(k * cv.dilation, k * cv.dilation + cv.stride * (o - 1) + 1, cv.stride)
                for k, o in zip(pos, cv.out, strict=True)
            )
            xs = x[(slice(None), slice(None), *window)].reshape(cv.n, g, cv.c // g, -1)
            out += np.matmul(w[(..., *pos)][None], xs)
        return _f32(out.reshape(cv.n, cv.f, *cv.out))

    return run


def _conv_check(op: str, dims: tuple[str, ...], kernel: tuple[str, ...]) -> Callable[[Params], None]:
    def check(p: Params) -> None:
        _check_positive(op, p, [k for k in p if k != "pad"])
        _check_nonnegative(op, p, [k for k in p if k == "pad"])
        if "groups" in p and (p["C"] % p["groups"] or p["F"] % p["groups"]):
            raise UsageError(f"{op}: groups={p['groups']} must divide C={p['C']} and F={p['F']}")
        pad, dil = p.get("pad", 0), p.get("dilation", 1)
        for d, k in zip(dims, kernel, strict=False):  # no kernel names: a 1x1 kernel always fits
            if (p[k] - 1) * dil + 1 > p[d] + 2 * pad:
                size = p[d] + 2 * pad
                raise UsageError(f"{op}: {k}={p[k]} (dilation {dil}) is larger than the padded {d}={size}")

    return check


def _conv_op(
    name: str,
    summary: str,
    params: Params,
    dims: tuple[str, ...],
    kernel: tuple[str, ...] = (),
    *,
    depthwise: bool = False,
) -> OpDef:
    """An OpDef for a convolution whose parameters are some of N, C, F, `dims`, `kernel`,
    stride, pad, dilation, groups (missing ones: 1x1 kernel, no pad, no dilation, one group;
    depthwise: F = groups = C)."""

    def conv(p: Params) -> _Conv:
        return _Conv(
            n=p["N"],
            c=p["C"],
            f=p["C"] if depthwise else p["F"],
            size=tuple(p[d] for d in dims),
            kernel=tuple(p[k] for k in kernel) if kernel else (1,) * len(dims),
            stride=p.get("stride", 1),
            pad=p.get("pad", 0),
            dilation=p.get("dilation", 1),
            groups=p["C"] if depthwise else p.get("groups", 1),
        )

    return OpDef(
        name=name,
        summary=summary,
        params=params,
        build=lambda p: _conv_build(conv(p), name),
        flops=lambda p: conv(p).flops,
        reference=lambda p: _conv_reference(conv(p)),
        check=_conv_check(name, dims, kernel),
    )


CONV1D = _conv_op(
    "conv1d",
    "1-D convolution, NCW data, FCW weight",
    dict(N=1, C=64, L=256, F=64, KW=3, stride=1, pad=1, dilation=1),
    dims=("L",),
    kernel=("KW",),
)

CONV2D = _conv_op(
    "conv2d",
    "2-D convolution, NCHW data, [F, C/groups, KH, KW] weight (grouped, depthwise, dilated)",
    dict(N=1, C=64, H=56, W=56, F=64, KH=3, KW=3, stride=1, pad=1, dilation=1, groups=1),
    dims=("H", "W"),
    kernel=("KH", "KW"),
)

CONV2D_1X1 = _conv_op(
    "conv2d_1x1",
    "pointwise 2-D convolution, NCHW data, [F, C, 1, 1] weight, no padding",
    dict(N=1, C=256, H=14, W=14, F=1024, stride=1),
    dims=("H", "W"),
)

DEPTHWISE_CONV2D = _conv_op(
    "depthwise_conv2d",
    "depthwise 2-D convolution, NCHW data, [C, 1, KH, KW] weight",
    dict(N=1, C=32, H=112, W=112, KH=3, KW=3, stride=1, pad=1, dilation=1),
    dims=("H", "W"),
    kernel=("KH", "KW"),
    depthwise=True,
)

CONV3D = _conv_op(
    "conv3d",
    "3-D convolution, NCDHW data, [F, C, KD, KH, KW] weight",
    dict(N=1, C=16, D=16, H=28, W=28, F=32, KD=3, KH=3, KW=3, stride=1, pad=1, dilation=1),
    dims=("D", "H", "W"),
    kernel=("KD", "KH", "KW"),
)


# 2-D convolutions in the layouts of the model pipeline (`tunefarm.models.tasks.CONV_LAYOUTS`):
# NHWC data, OHWI weight, NHWC output. `conv2d_nhwc` is the direct convolution (the blocks
# Relax's legalization gives a model's convolution: a padding, then one reduction);
# `conv2d_winograd` computes the same 3x3 stride-1 convolution with Winograd's F(m x m,
# 3 x 3) (`tunefarm.winograd`), its reference the direct convolution's, so that every tuned
# kernel is checked against it. Its weight is a constant (the weight transform runs once,
# outside the kernel), and its FLOPs are the direct convolution's, the work it stands for,
# so that the GFLOPS of both compare.


def _nhwc_conv(p: Params) -> _Conv:
    return _Conv(
        n=p["N"], c=p["C"], f=p["F"], size=(p["H"], p["W"]), kernel=(p.get("KH", 3), p.get("KW", 3)),
        stride=p.get("stride", 1), pad=p["pad"], dilation=p.get("dilation", 1), groups=1,
    )  # fmt: skip


def _conv2d_nhwc_build(p: Params) -> list:
    tvm, te, _ = _te()
    cv = _nhwc_conv(p)
    data = te.placeholder((cv.n, *cv.size, cv.c), "float32", name="data")
    weight = te.placeholder((cv.f, *cv.kernel, cv.c), "float32", name="weight")
    pad, (hp, wp) = cv.pad, (s + 2 * cv.pad for s in cv.size)

    def padded(n, y, x, c):
        inside = tvm.tirx.all(y >= pad, y < hp - pad, x >= pad, x < wp - pad)
        return tvm.tirx.if_then_else(inside, data[n, y - pad, x - pad, c], tvm.tirx.const(0.0, "float32"))

    padded_data = te.compute((cv.n, hp, wp, cv.c), padded, name="pad")
    ry = te.reduce_axis((0, cv.kernel[0]), name="ry")
    rx = te.reduce_axis((0, cv.kernel[1]), name="rx")
    rc = te.reduce_axis((0, cv.c), name="rc")
    s, d = cv.stride, cv.dilation
    out = te.compute(
        (cv.n, *cv.out, cv.f),
        lambda n, y, x, f: te.sum(
            padded_data[n, y * s + ry * d, x * s + rx * d, rc] * weight[f, ry, rx, rc], axis=[ry, rx, rc]
        ),
        name="conv2d_nhwc",
    )
    return [data, weight, out]


def _conv2d_nhwc_reference(p: Params) -> Reference:
    """The NCHW reference (`_conv_reference`) on transposed arrays."""
    nchw = _conv_reference(_nhwc_conv(p))

    def run(x, w):
        (out,) = nchw(x.transpose(0, 3, 1, 2), w.transpose(0, 3, 1, 2))
        return _f32(out.transpose(0, 2, 3, 1))

    return run


def _conv2d_winograd_build(p: Params) -> list:
    _, te, _ = _te()
    from tunefarm.winograd import winograd_conv2d_nhwc

    data = te.placeholder((p["N"], p["H"], p["W"], p["C"]), "float32", name="data")
    weight = te.placeholder((p["F"], 3, 3, p["C"]), "float32", name="weight")
    return [data, weight, winograd_conv2d_nhwc(data, weight, p["pad"], p["m"])]


def _conv2d_winograd_check(p: Params) -> None:
    from tunefarm.winograd import TILE_SIZES

    _conv_check("conv2d_winograd", ("H", "W"), ())(p)
    if p["m"] not in TILE_SIZES:
        raise UsageError(f"conv2d_winograd: m must be one of {', '.join(map(str, TILE_SIZES))} (the output tile), got {p['m']}")
    for d in ("H", "W"):
        if p[d] + 2 * p["pad"] < 3:
            raise UsageError(f"conv2d_winograd: the 3x3 filter is larger than the padded {d}={p[d] + 2 * p['pad']}")


CONV2D_NHWC = OpDef(
    name="conv2d_nhwc",
    summary="2-D convolution, NHWC data, OHWI weight (the model pipeline's layouts)",
    params=dict(N=1, C=64, H=56, W=56, F=64, KH=3, KW=3, stride=1, pad=1, dilation=1),
    build=_conv2d_nhwc_build,
    flops=lambda p: _nhwc_conv(p).flops,
    reference=_conv2d_nhwc_reference,
    check=_conv_check("conv2d_nhwc", ("H", "W"), ("KH", "KW")),
)

CONV2D_WINOGRAD = OpDef(
    name="conv2d_winograd",
    summary="3x3 stride-1 conv2d_nhwc by Winograd F(m x m, 3 x 3), m = 2 or 4; constant weight",
    params=dict(N=1, C=64, H=56, W=56, F=64, pad=1, m=4),
    build=_conv2d_winograd_build,
    flops=lambda p: _nhwc_conv(p).flops,
    reference=_conv2d_nhwc_reference,
    check=_conv2d_winograd_check,
    constants=("weight",),
)


# conv2d_transpose (PyTorch ConvTranspose2d): out[n,f,y,x] += data[n,c,i,j] * weight[c,f,ky,kx]
# where y = i*stride - pad + ky. Built as a conv of the flipped kernel over the input dilated by
# `stride` and padded by KH-1-pad; both happen in the one `pad` stage.


def _conv2d_transpose_out(p: Params) -> tuple[int, int]:
    s, pad = p["stride"], p["pad"]
    return (p["H"] - 1) * s - 2 * pad + p["KH"], (p["W"] - 1) * s - 2 * pad + p["KW"]


def _conv2d_transpose_build(p: Params) -> list:
    tvm, te, _ = _te()
    N, C, H, W, F, KH, KW, s, pad = (p[k] for k in ("N", "C", "H", "W", "F", "KH", "KW", "stride", "pad"))
    HO, WO = _conv2d_transpose_out(p)
    data = te.placeholder((N, C, H, W), "float32", name="data")
    weight = te.placeholder((C, F, KH, KW), "float32", name="weight")
    fd, md = tvm.tirx.floordiv, tvm.tirx.floormod

    def dilated(n, c, y, x):
        ty, tx = y - (KH - 1 - pad), x - (KW - 1 - pad)  # position in the stride-dilated input
        inside = tvm.tirx.all(ty >= 0, tx >= 0, md(ty, s) == 0, md(tx, s) == 0, fd(ty, s) < H, fd(tx, s) < W)
        return tvm.tirx.if_then_else(inside, data[n, c, fd(ty, s), fd(tx, s)], tvm.tirx.const(0, "float32"))

    padded = te.compute((N, C, HO + KH - 1, WO + KW - 1), dilated, name="pad")
    rc = te.reduce_axis((0, C), name="rc")
    ry = te.reduce_axis((0, KH), name="ry")
    rx = te.reduce_axis((0, KW), name="rx")
    out = te.compute(
        (N, F, HO, WO),
        lambda n, f, y, x: te.sum(
            padded[n, rc, y + ry, x + rx] * weight[rc, f, KH - 1 - ry, KW - 1 - rx], axis=[rc, ry, rx]
        ),
        name="conv2d_transpose",
    )
    return [data, weight, out]


def _conv2d_transpose_reference(p: Params) -> Reference:
    """Scatter each kernel tap into the uncropped output, then crop `pad` on each side."""
    N, C, H, W, F, KH, KW, s, pad = (p[k] for k in ("N", "C", "H", "W", "F", "KH", "KW", "stride", "pad"))
    HO, WO = _conv2d_transpose_out(p)

    def run(x, w):
        x = x.astype(np.float64).reshape(N, C, H * W)
        full = np.zeros((N, F, (H - 1) * s + KH, (W - 1) * s + KW))
        for ky, kx in itertools.product(range(KH), range(KW)):
            tap = np.matmul(w[:, :, ky, kx].T.astype(np.float64), x).reshape(N, F, H, W)
            full[:, :, ky : ky + s * (H - 1) + 1 : s, kx : kx + s * (W - 1) + 1 : s] += tap
        return _f32(full[:, :, pad : pad + HO, pad : pad + WO])

    return run


def _conv2d_transpose_check(p: Params) -> None:
    _check_positive("conv2d_transpose", p, [k for k in p if k != "pad"])
    _check_nonnegative("conv2d_transpose", p, ["pad"])
    for d, size in zip(("H", "W"), _conv2d_transpose_out(p), strict=True):
        if size < 1:
            raise UsageError(
                f"conv2d_transpose: pad={p['pad']} leaves no output along {d} (output size {size})"
            )


CONV2D_TRANSPOSE = OpDef(
    name="conv2d_transpose",
    summary="transposed 2-D convolution (PyTorch ConvTranspose2d), NCHW data, [C, F, KH, KW] weight",
    params=dict(N=1, C=64, H=28, W=28, F=32, KH=4, KW=4, stride=2, pad=1),
    build=_conv2d_transpose_build,
    # useful work only: each input pixel meets each kernel tap once (the zeros of the
    # dilated input that the TE program also multiplies are not counted)
    flops=lambda p: 2 * _p(p, ("N", "C", "H", "W", "F", "KH", "KW")),
    reference=_conv2d_transpose_reference,
    check=_conv2d_transpose_check,
)


# ---------------------------------------------------------------------------- reductions

SOFTMAX_FLOPS_PER_ELEMENT = 5
"""max, subtract, exp, add to the sum, divide (exp counted as one FLOP)."""


def _softmax_build(p: Params) -> list:
    _, te, topi = _te()
    x = te.placeholder((p["B"], p["M"], p["N"]), "float32", name="x")
    return [x, topi.nn.softmax(x, axis=-1)]  # stages T_softmax_{maxelem,exp,expsum,norm}


def _softmax_reference(p: Params) -> Reference:
    def run(x):
        e = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
        return _f32(e / e.sum(axis=-1, keepdims=True))

    return run


SOFTMAX = OpDef(
    name="softmax",
    summary="softmax over the last axis of a [B, M, N] tensor",
    params=dict(B=12, M=128, N=128),
    build=_softmax_build,
    flops=lambda p: SOFTMAX_FLOPS_PER_ELEMENT * _p(p, "BMN"),
    reference=_softmax_reference,
    check=_sizes("softmax"),
    memory_bound=True,
)

LAYER_NORM_EPS = 1e-5

LAYER_NORM_FLOPS_PER_ELEMENT = 8
"""mean: add; variance: subtract, square, add; output: subtract, times 1/std, times gamma, plus beta."""


def _layer_norm_build(p: Params) -> list:
    _, te, topi = _te()
    x = te.placeholder((p["M"], p["N"]), "float32", name="x")
    gamma = te.placeholder((p["N"],), "float32", name="gamma")
    beta = te.placeholder((p["N"],), "float32", name="beta")
    # stages x_sum, x_mean, x_var_sum, T_layer_norm
    return [x, gamma, beta, topi.nn.layer_norm(x, gamma, beta, axis=[-1], epsilon=LAYER_NORM_EPS)]


def _layer_norm_reference(p: Params) -> Reference:
    def run(x, gamma, beta):
        x = x.astype(np.float64)
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        return _f32((x - mean) / np.sqrt(var + LAYER_NORM_EPS) * gamma + beta)

    return run


LAYER_NORM = OpDef(
    name="layer_norm",
    summary="layer normalisation over the last axis of [M, N], gamma and beta [N], eps 1e-5",
    params=dict(M=128, N=768),
    build=_layer_norm_build,
    flops=lambda p: LAYER_NORM_FLOPS_PER_ELEMENT * _p(p, "MN"),
    reference=_layer_norm_reference,
    check=_sizes("layer_norm"),
    memory_bound=True,
)


NORM2_FLOPS_PER_ELEMENT = 2
"""square, add (the final square root is not counted)."""


def _norm2_build(p: Params) -> list:
    _, te, _ = _te()
    x = te.placeholder((p["M"], p["N"]), "float32", name="x")
    i = te.reduce_axis((0, p["M"]), name="i")
    j = te.reduce_axis((0, p["N"]), name="j")
    sum_sq = te.compute((1,), lambda _: te.sum(x[i, j] * x[i, j], axis=[i, j]), name="sum_sq")
    norm = te.compute((1,), lambda o: te.sqrt(sum_sq[o]), name="norm")
    return [x, norm]


def _norm2_reference(p: Params) -> Reference:
    return lambda x: _f32(np.sqrt(np.square(x.astype(np.float64)).sum()).reshape(1))


NORM2 = OpDef(
    name="norm2",
    summary="Frobenius norm sqrt(sum x^2) of an [M, N] matrix, output shape (1,)",
    params=dict(M=1024, N=1024),
    build=_norm2_build,
    flops=lambda p: NORM2_FLOPS_PER_ELEMENT * _p(p, "MN"),
    reference=_norm2_reference,
    check=_sizes("norm2"),
    memory_bound=True,
)


# ---------------------------------------------------------------------------- the registry

OPS: dict[str, OpDef] = {
    op.name: op
    for op in (
        MATMUL,
        MATMUL_RELU,
        BATCH_MATMUL,
        MATMUL_FP16,
        DENSE_FP16,
        BATCH_MATMUL_FP16,
        CONV1D,
        CONV2D,
        CONV2D_1X1,
        DEPTHWISE_CONV2D,
        CONV3D,
        CONV2D_NHWC,
        CONV2D_WINOGRAD,
        CONV2D_TRANSPOSE,
        SOFTMAX,
        LAYER_NORM,
        NORM2,
    )
}
