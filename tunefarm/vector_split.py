"""Whole vectors: a vectorized loop whose length is not a power of two becomes an unrolled
loop over vectors of the largest power of two that divides it, in every CPU kernel this
project compiles.

Why: TVM turns a vectorized loop of `L` lanes into one LLVM vector of `L` lanes. LLVM
splits a power-of-two vector into registers (16 floats: two AVX2 registers), but widens
one of another length (24, 48, 96 floats) and shuffles and spills around it: a matmul
whose 4-row micro-tile spans 24 columns ran at 13.7 GFLOPS on an AVX2 core pair where
the same tile over 16 columns ran at 185, and a tile of 48 columns ran at 18.6 GFLOPS on
AVX-512. Channel counts such as 24, 40, 48, 72, 96 or 120 (MobileNets, detector heads)
make such vectors the natural tile, so the search met them and had to learn to avoid
them. Split, 24 lanes are three 8-lane vectors and run as fast as 16 (184.7 GFLOPS).

What: `rewrite()`, run on each function's body with `tunefarm.hreduce`'s before TVM
vectorizes loops (`tunefarm.tir_pipeline`), rewrites

    for v in vectorized(L):            # L = m * w, w the largest power of two dividing L
        body(v)

into

    for o in unrolled(m):
        for i in vectorized(w):
            body(o * w + i)

when `w` is at least `MIN_LANES`. A loop of another shape (an odd length, a symbolic
extent, a step) is left alone, and the program's values are unchanged.
"""

from __future__ import annotations

from typing import Any

MIN_LANES = 4
"""The shortest vector a loop is split into (4 floats: one SSE/NEON register); a loop
whose power-of-two part is shorter is left whole."""


def rewrite(body: Any) -> Any:
    """`body` with every vectorized loop of a length that is not a power of two split."""
    import tvm_ffi
    from tvm import tirx

    return tvm_ffi.structural_map(body, (tirx.For, _split))


def split_lanes(extent: int) -> tuple[int, int] | None:
    """(unrolled count, vector lanes) for a vectorized loop of `extent`, or None to leave it."""
    lanes = extent & -extent
    if lanes == extent or lanes < MIN_LANES:
        return None
    return extent // lanes, lanes


def _split(loop) -> Any:
    import tvm_ffi
    from tvm import tirx

    if loop.kind != tirx.ForKind.VECTORIZED or not isinstance(loop.extent, tirx.IntImm):
        return loop
    if getattr(loop, "step", None) is not None and not (isinstance(loop.step, tirx.IntImm) and int(loop.step.value) == 1):
        return loop
    parts = split_lanes(int(loop.extent.value))
    if parts is None:
        return loop
    count, lanes = parts
    dtype = str(loop.extent.ty.dtype)
    var = loop.loop_var
    outer = tirx.Var(f"{var.name}_o", dtype)
    inner = tirx.Var(f"{var.name}_v", dtype)
    index = outer * lanes + inner + loop.min
    body = tvm_ffi.structural_map(loop.body, (tirx.Var, lambda v: index if v.same_as(var) else v))
    vector = tirx.For(inner, tirx.IntImm(dtype, 0), tirx.IntImm(dtype, lanes), tirx.ForKind.VECTORIZED, body)
    return tirx.For(outer, tirx.IntImm(dtype, 0), tirx.IntImm(dtype, count), tirx.ForKind.UNROLLED, vector)
