"""TVM tensor intrinsics for CUDA's warp matrix multiply-accumulate (wmma) API: the
16x16x16 float16 x float16 -> float32 fragment operations the tensor-core rule
(`tunefarm.search.space.tensor_core`) tensorizes with.

Each intrinsic is a pair of PrimFuncs: a description (what the 16x16(x16) loops compute,
which `Schedule.tensorize` matches against the block) and an implementation (the
`tvm_load_matrix_sync` / `tvm_mma_sync` / `tvm_fill_fragment` / `tvm_store_matrix_sync`
call TVM's CUDA codegen turns into `nvcuda::wmma`). A fragment is addressed by its index
in its buffer: row block * fragments per row + column block.

They are registered under tunefarm's own names (`register`, once per process, before a
schedule that uses them is made or replayed). TVM ships the same operations in
`tvm.s_tir.tensor_intrin.cuda`, but importing that module parses about a hundred
intrinsics of every kind (minutes on a loaded two-core build machine); these few parse
in about a second.
"""

from __future__ import annotations

import threading

FRAGMENT = 16
"""m = n = k of the wmma shape."""

PREFIX = "tunefarm_wmma_"
"""Every intrinsic name here starts with it (a trace that uses them needs `register`)."""

FILL_F32 = PREFIX + "fill_f32"
STORE_F32_GLOBAL = PREFIX + "store_f32_global"
SYNC = PREFIX + "sync_f16f16f32"
SYNC_B_TRANSPOSED = PREFIX + "sync_f16f16f32_b_transposed"


def load_name(operand: str, shared_scope: str, col_major: bool = False) -> str:
    """The load of operand "a" or "b" from `shared_scope` ("shared" or "shared.dyn");
    `col_major`: the shared tile holds the operand transposed (B as [n, k])."""
    scope = shared_scope.replace(".", "_")
    return f"{PREFIX}load_{operand}_{scope}" + ("_col_major" if col_major else "")


_LOCK = threading.Lock()
_REGISTERED = False


def register() -> None:
    """Register every intrinsic of this module with TVM (once per process)."""
    global _REGISTERED
    with _LOCK:
        if _REGISTERED:
            return
        from tvm.s_tir import TensorIntrin

        for name, (desc, impl) in _intrinsics().items():
            if TensorIntrin.get(name, allow_missing=True) is None:
                TensorIntrin.register(name, desc, impl)
        _REGISTERED = True


def uses_wmma(trace) -> bool:
    """Whether a trace (`Trace.as_json` data) tensorizes with these intrinsics."""
    return PREFIX in str(trace)


def _fragment_index(buf, stride):
    return buf.elem_offset // stride // FRAGMENT * (stride // FRAGMENT) + buf.elem_offset % stride // FRAGMENT


def _intrinsics() -> dict:
    out = {FILL_F32: _fill(), STORE_F32_GLOBAL: _store(), SYNC: _sync(False), SYNC_B_TRANSPOSED: _sync(True)}
    for scope in ("shared", "shared.dyn"):
        out[load_name("a", scope)] = _load("a", scope, False)
        out[load_name("b", scope)] = _load("b", scope, False)
        out[load_name("b", scope, col_major=True)] = _load("b", scope, True)
    return out


def _load(operand: str, shared_scope: str, col_major: bool):
    from tvm.script import tirx as T

    F = FRAGMENT
    frag_scope = f"wmma.matrix_{operand}"
    layout = "col_major" if col_major else "row_major"

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (F, F), "float16", align=64, offset_factor=F, scope=shared_scope)
        C = T.match_buffer(c, (F, F), "float16", align=64, offset_factor=F, scope=frag_scope)
        with T.sblock("root"):
            T.reads(A[0:F, 0:F])
            T.writes(C[0:F, 0:F])
            for i, j in T.grid(F, F):
                with T.sblock("load"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vi, vj] = A[vi, vj]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, c: T.handle) -> None:
        s1 = T.int32()
        s0 = T.int32()
        d1 = T.int32()
        d0 = T.int32()
        A = T.match_buffer(a, (F, F), "float16", align=64, offset_factor=F, scope=shared_scope, strides=[s1, s0])
        C = T.match_buffer(c, (F, F), "float16", align=64, offset_factor=F, scope=frag_scope, strides=[d1, d0])
        with T.sblock("root"):
            T.reads(A[0:F, 0:F])
            T.writes(C[0:F, 0:F])
            T.evaluate(
                T.tvm_load_matrix_sync(
                    C.data, F, F, F, _fragment_index(C, d1), A.access_ptr("r", ptr_type="float16"), s1, layout,
                    dtype="void",
                )
            )

    return desc, impl


def _fill():
    from tvm.script import tirx as T

    F = FRAGMENT

    @T.prim_func(s_tir=True)
    def desc(c: T.handle) -> None:
        C = T.match_buffer(c, (F, F), "float32", align=64, offset_factor=F, scope="wmma.accumulator")
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:F, 0:F])
            for i, j in T.grid(F, F):
                with T.sblock("init"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vi, vj] = T.float32(0)

    @T.prim_func(s_tir=True)
    def impl(c: T.handle) -> None:
        d1 = T.int32()
        d0 = T.int32()
        C = T.match_buffer(c, (F, F), "float32", align=64, offset_factor=F, scope="wmma.accumulator", strides=[d1, d0])
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:F, 0:F])
            T.evaluate(T.tvm_fill_fragment(C.data, F, F, F, _fragment_index(C, d1), T.float32(0), dtype="void"))

    return desc, impl


def _store():
    from tvm.script import tirx as T

    F = FRAGMENT

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (F, F), "float32", align=64, offset_factor=F, scope="wmma.accumulator")
        C = T.match_buffer(c, (F, F), "float32", align=64, offset_factor=F, scope="global")
        with T.sblock("root"):
            T.reads(A[0:F, 0:F])
            T.writes(C[0:F, 0:F])
            for i, j in T.grid(F, F):
                with T.sblock("store"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vi, vj] = A[vi, vj]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, c: T.handle) -> None:
        s1 = T.int32()
        s0 = T.int32()
        d1 = T.int32()
        d0 = T.int32()
        A = T.match_buffer(a, (F, F), "float32", align=64, offset_factor=F, scope="wmma.accumulator", strides=[d1, d0])
        C = T.match_buffer(c, (F, F), "float32", align=64, offset_factor=F, scope="global", strides=[s1, s0])
        with T.sblock("root"):
            T.reads(A[0:F, 0:F])
            T.writes(C[0:F, 0:F])
            T.evaluate(
                T.tvm_store_matrix_sync(
                    A.data, F, F, F, _fragment_index(A, d1), C.access_ptr("w", ptr_type="float32"), s1, "row_major",
                    dtype="void",
                )
            )

    return desc, impl


def _sync(b_transposed: bool):
    from tvm.script import tirx as T

    F = FRAGMENT

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (F, F), "float16", align=64, offset_factor=F, scope="wmma.matrix_a")
        B = T.match_buffer(b, (F, F), "float16", align=64, offset_factor=F, scope="wmma.matrix_b")
        C = T.match_buffer(c, (F, F), "float32", align=64, offset_factor=F, scope="wmma.accumulator")
        with T.sblock("root"):
            T.reads(C[0:F, 0:F], A[0:F, 0:F], B[0:F, 0:F])
            T.writes(C[0:F, 0:F])
            for i, j, k in T.grid(F, F, F):
                with T.sblock(""):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    b0, b1 = T.meta_var((vj, vk) if b_transposed else (vk, vj))
                    C[vi, vj] = C[vi, vj] + T.Cast("float32", A[vi, vk]) * T.Cast("float32", B[b0, b1])

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        a1 = T.int32()
        a0 = T.int32()
        b1 = T.int32()
        b0 = T.int32()
        c1 = T.int32()
        c0 = T.int32()
        A = T.match_buffer(a, (F, F), "float16", align=64, offset_factor=F, scope="wmma.matrix_a", strides=[a1, a0])
        B = T.match_buffer(b, (F, F), "float16", align=64, offset_factor=F, scope="wmma.matrix_b", strides=[b1, b0])
        C = T.match_buffer(c, (F, F), "float32", align=64, offset_factor=F, scope="wmma.accumulator", strides=[c1, c0])
        with T.sblock("root"):
            T.reads(C[0:F, 0:F], A[0:F, 0:F], B[0:F, 0:F])
            T.writes(C[0:F, 0:F])
            T.evaluate(
                T.tvm_mma_sync(
                    C.data, _fragment_index(C, c1), A.data, _fragment_index(A, a1), B.data, _fragment_index(B, b1),
                    C.data, _fragment_index(C, c1), dtype="void",
                )
            )

    return desc, impl
