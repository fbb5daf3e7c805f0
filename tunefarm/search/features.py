"""Per-store features of a program, for the cost model (Ansor §5.2, Appendix B).

One row per innermost store statement (`loopnest.Store`); a program is a matrix of
rows and its predicted score is the sum of the rows' predictions ("pack-sum").
Everything is computed from the loop-nest model, never from TVM, so scoring a
candidate costs well under a millisecond.

Counts and sizes enter as log2(1 + x) (Ansor's `slog`), so trees split on orders of
magnitude. A feature version names a layout: saved cost models (one per device class)
and cached feature matrices are keyed by it, and it changes whenever its layout does.

- version 1 (`CPU_FEATURE_VERSION`): the groups below up to "other"; CPU programs.
- version 2: version 1's columns unchanged, then the GPU group (Ansor's is_gpu,
  blockIdx / vthread / threadIdx lengths, plus the kernel's shared and local memory).
- version 3: version 2's columns, then what decides a GPU kernel's speed beyond its
  sizes (`_GPU_MEMORY`): how many memory transactions a warp's global access takes along
  threadIdx.x (coalescing), shared-memory bank conflicts, and the kernel's occupancy and
  waves over the GPU's SMs (`tunefarm.gpu.GpuLimits.sm`).
- version 4 (`GPU_FEATURE_VERSION`): version 3's columns, then the tensor-core group
  (`_TENSOR_CORE`): whether the store is a warp-wide wmma operation, the warps of its
  kernel, the fragments a warp holds; a tensor-core kernel's occupancy counts its warps'
  threads (threadIdx.y x threadIdx.x, 32 lanes for a warp-wide store). GPU programs.
  CPU rows stay version 1, so the CPU models already trained keep working.
"""

from __future__ import annotations

import math

import numpy as np

from tunefarm import hreduce
from tunefarm.gpu import GpuLimits
from tunefarm.search.space.program import BOUND_KINDS, TENSORIZED, Access, Program, Store

CPU_FEATURE_VERSION = 1
GPU_FEATURE_VERSION = 4

WARP_TRANSACTION_BYTES = 32
"""A global memory transaction (one L2 sector)."""
SHARED_BANKS = 32
"""Shared-memory banks, each 4 bytes wide."""
BASE_REGISTERS_PER_THREAD = 24
"""Registers a thread holds besides its accumulators (addresses, loop counters, operands
read from shared memory): an estimate for occupancy, ptxas decides."""

CACHE_LINE_BYTES = 64
MAX_BUFFERS = 5
CURVE_SAMPLES = 10

# ---- layout: (name, meaning), in order. One comment per feature. ------------------
_COMPUTE = [
    ("float_add_sub", "float additions/subtractions executed (count x trip count)"),
    ("float_mul", "float multiplications executed"),
    ("float_div_mod", "float divisions executed"),
    ("float_cmp", "float min/max/comparisons executed"),
    ("float_math", "float math calls executed (exp, sqrt, ...)"),
    ("int_add_sub", "integer additions executed"),
    ("int_mul", "integer multiplications executed"),
    ("int_div_mod", "integer divisions/modulos executed"),
    ("int_cmp", "integer comparisons executed"),
    ("bool_op", "boolean and/or/not executed"),
    ("select", "if_then_else/select executed"),
    ("cast", "casts executed"),
]
_POSITIONS = ["none", "inner_spatial", "middle_spatial", "outer_spatial", "inner_reduce", "middle_reduce", "outer_reduce", "mixed"]
_ANNOTATION = []
for _kind in ("vec", "par"):
    _ANNOTATION += [
        (f"{_kind}_len", f"extent of the innermost {_kind} loop"),
        (f"{_kind}_prod", f"product of the extents of all {_kind} loops"),
        (f"{_kind}_num", f"number of {_kind} loops"),
    ]
    _ANNOTATION += [(f"{_kind}_pos_{p}", f"{_kind} loop position: {p}") for p in _POSITIONS]
_ANNOTATION += [
    ("unroll_max_step", "auto-unroll pragma in effect (max step)"),
    ("unroll_num", "innermost loops the pragma unrolls"),
    ("unroll_prod", "product of the extents of the unrolled loops"),
]
_BUFFER = [
    ("acc_read", "access type: read only"),
    ("acc_write", "access type: write only"),
    ("acc_rw", "access type: read and write"),
    ("bytes", "bytes accessed over the whole nest"),
    ("unique_bytes", "distinct bytes accessed (footprint)"),
    ("lines", "cache lines accessed"),
    ("unique_lines", "distinct cache lines accessed"),
    ("reuse_loop", "reuse type: a loop re-reads the same data"),
    ("reuse_serial", "reuse type: several accesses to the buffer in the statement"),
    ("reuse_none", "reuse type: none"),
    ("reuse_dis_iter", "iterations between reuses (inner loops of the reuse loop)"),
    ("reuse_dis_bytes", "bytes touched between reuses"),
    ("reuse_ct", "times the data is reused"),
    ("bytes_d_reuse_ct", "bytes / reuse count"),
    ("unique_bytes_d_reuse_ct", "unique bytes / reuse count"),
    ("lines_d_reuse_ct", "lines / reuse count"),
    ("unique_lines_d_reuse_ct", "unique lines / reuse count"),
    ("stride", "elements between consecutive iterations of the innermost loop used"),
]
_CURVE = [(f"intensity_{i}", f"arithmetic intensity (flops/byte) at loop depth sample {i}") for i in range(CURVE_SAMPLES)]
_ALLOC = [
    ("alloc_is_intermediate", "the store fills an intermediate buffer"),
    ("alloc_bytes", "its size after compaction"),
    ("alloc_outer_prod", "times it is (re)filled: product of the loops above its attach point"),
    ("alloc_inner_prod", "iterations of the store's own loops"),
]
_OTHER = [
    ("outer_prod", "trip count of the whole nest"),
    ("num_loops", "loops around the store"),
    ("is_init", "the store is a reduction's initialisation"),
    ("is_reduction_update", "the store accumulates (reads and writes its output)"),
]

_GPU = [
    ("is_gpu", "the program runs on a GPU (always 1 in GPU rows)"),
    ("blockIdx_len", "thread blocks the store's kernel launches (product of its blockIdx.x loops)"),
    ("vthread_len", "virtual threads around the store (product of its vthread.x loops)"),
    ("threadIdx_len", "threads per block around the store (product of its threadIdx.x loops)"),
    ("shared_bytes", "shared memory one block of the store's kernel allocates"),
    ("local_bytes", "local memory (registers) one thread of the store's kernel allocates"),
    ("writes_shared", "the store fills a shared-memory stage (a cooperative fetch)"),
    ("writes_local", "the store writes registers (an accumulator)"),
]

FEATURE_NAMES: list[str] = (
    [n for n, _ in _COMPUTE]
    + [n for n, _ in _ANNOTATION]
    + [f"b{i}_{n}" for i in range(MAX_BUFFERS) for n, _ in _BUFFER]
    + [n for n, _ in _CURVE]
    + [n for n, _ in _ALLOC]
    + [n for n, _ in _OTHER]
)
"""Version 1 (CPU rows)."""
NUM_FEATURES = len(FEATURE_NAMES)
_GPU_MEMORY = [
    ("global_transactions", "32-byte transactions of one warp's global access of the store, the most over its "
     "accesses (along its fastest threadIdx.x loop: 4 for consecutive float32s, 32 for a 32-float stride)"),
    ("uncoalesced_accesses", "global accesses of the store whose consecutive threads are more than one element apart"),
    ("bank_conflict_ways", "shared-memory bank conflict degree of the store's worst shared access in a warp (1: none)"),
    ("occupancy", "resident warps per SM over the SM's maximum for the store's kernel (threads, shared memory, "
     "estimated registers)"),
    ("blocks_per_sm", "resident blocks per SM of the store's kernel"),
    ("waves", "waves of the kernel's blocks over the GPU's SMs (rounded up)"),
    ("wave_efficiency", "share of the SM slots of all waves that the kernel's blocks fill (1: no partial last wave)"),
]

_TENSOR_CORE = [
    ("tensor_core", "the store is a warp-wide tensor-core operation (a wmma fragment load, fill, multiply-accumulate "
     "or store: its innermost loops are the fragment's 16 x 16 (x 16) elements)"),
    ("warps_len", "warps per block around the store (product of its threadIdx.y loops: a tensor-core kernel's)"),
    ("fragment_bytes", "bytes of wmma fragments (accumulators and operands) one warp of the store's kernel holds"),
]

GPU_FEATURE_NAMES: list[str] = (
    FEATURE_NAMES + [n for n, _ in _GPU] + [n for n, _ in _GPU_MEMORY] + [n for n, _ in _TENSOR_CORE]
)
"""Version 4 (GPU rows)."""


def feature_names(version: int) -> list[str]:
    """The columns of a feature version."""
    if version == CPU_FEATURE_VERSION:
        return FEATURE_NAMES
    if version == GPU_FEATURE_VERSION:
        return GPU_FEATURE_NAMES
    if version == GPU_FEATURE_VERSION - 1:  # rows stored before the tensor-core group (read, never made)
        return GPU_FEATURE_NAMES[: -len(_TENSOR_CORE)]
    raise ValueError(f"unknown feature version {version}")


def feature_width(version: int) -> int:
    return len(feature_names(version))


def slog(x):
    """log2(1 + x) for x >= 0 (0 elsewhere), elementwise on arrays."""
    x = np.asarray(x, dtype=np.float64)
    return np.log2(1.0 + np.maximum(x, 0.0))


def program_features(prog: Program, version: int = CPU_FEATURE_VERSION, gpu: GpuLimits | None = None) -> np.ndarray:
    """(n_stores, feature_width(version)) float32 matrix of one program."""
    return batch_features([prog], version, gpu)[0]


def batch_features(
    progs: list[Program], version: int = CPU_FEATURE_VERSION, gpu: GpuLimits | None = None
) -> list[np.ndarray]:
    """Feature matrices of many programs at once: all stores of all programs are
    padded into arrays and every feature is computed with a few numpy operations.
    `gpu`: the limits of the GPU a GPU program is for (its SMs; default sm_80's)."""
    width = feature_width(version)
    stores: list[Store] = []
    owner: list[int] = []
    fragments: list[int] = []  # GPU: wmma fragment bytes per warp of each store's kernel
    for i, prog in enumerate(progs):
        per_root: dict[str, int] = {}
        for st in prog.stores():
            stores.append(st)
            owner.append(i)
            if version == GPU_FEATURE_VERSION:
                root = prog.root_of(st.block)
                if root not in per_root:
                    per_root[root] = prog.fragment_bytes(root)
                fragments.append(per_root[root])
    if not stores:
        return [np.zeros((0, width), dtype=np.float32) for _ in progs]
    rows = _store_rows(stores)
    if version == GPU_FEATURE_VERSION:
        limits = gpu if gpu is not None else GpuLimits(arch="sm_80")
        rows = np.concatenate(
            [rows, _gpu_rows(stores), _gpu_memory_rows(stores, limits), _tensor_core_rows(stores, fragments)], axis=1
        )
    counts = np.bincount(np.asarray(owner), minlength=len(progs))
    splits = np.split(rows, np.cumsum(counts)[:-1])
    return [np.ascontiguousarray(m, dtype=np.float32) for m in splits]


class _Batch:
    """Stores and their (merged-by-buffer) accesses as padded arrays.

    S stores, A accesses, L = longest loop chain, D = most dimensions. Loops are left
    aligned; padding loops have extent 1 and no coefficient, so they change nothing.
    """

    def __init__(self, stores: list[Store]):
        S = len(stores)
        L = max(1, max(len(st.loops) for st in stores))
        accs: list[tuple[int, Access, int]] = []
        for si, st in enumerate(stores):
            for acc, count in _merge_accesses(st.accesses):
                accs.append((si, acc, count))
        A = len(accs)
        D = max(1, max((len(a.indices) for _, a, _ in accs), default=1))
        self.S, self.L, self.A, self.D = S, L, A, D
        # every loop of every store, flat: (store, position) and its extent, reduce flag, kind
        nloops = [len(st.loops) for st in stores]
        loop_store = np.repeat(np.arange(S), nloops)
        loop_pos = np.concatenate([np.arange(n) for n in nloops]) if loop_store.size else loop_store
        loops = [lp for st in stores for lp in st.loops]
        kinds = [lp.kind for lp in loops]
        self.ext = np.ones((S, L))
        self.ext[loop_store, loop_pos] = [lp.extent for lp in loops]
        self.reduce = np.zeros((S, L), dtype=bool)
        self.reduce[loop_store, loop_pos] = [lp.reduce for lp in loops]
        self.vec = np.zeros((S, L), dtype=bool)
        self.vec[loop_store, loop_pos] = [k == "vectorized" for k in kinds]
        for si, st in enumerate(stores):  # compiled as a vector and a shuffle tree
            if reduces_horizontally(st):
                self.vec[si, len(st.loops) - 1] = True
        self.par = np.zeros((S, L), dtype=bool)
        self.par[loop_store, loop_pos] = [k == "parallel" for k in kinds]
        self.nloops = np.array(nloops, dtype=np.int64)
        self.ops = np.array([st.ops.as_tuple() for st in stores], dtype=np.float64)
        self.unroll = np.array([st.unroll for st in stores], dtype=np.float64)
        self.is_init = np.array([st.is_init for st in stores], dtype=np.float64)
        self.alloc = np.array(  # (is intermediate, bytes)
            [(1.0, st.alloc_elems * st.alloc.elem_bytes) if st.alloc is not None else (0.0, 0.0) for st in stores],
            dtype=np.float64,
        ).reshape(S, 2)
        # |coefficient| of loop j in dimension d of access a (each loop variable once per index)
        positions = [{lp.key: j for j, lp in enumerate(st.loops)} for st in stores]
        where: list[tuple[int, int, int]] = []
        coefs: list[int] = []
        for ai, (si, acc, _) in enumerate(accs):
            pos = positions[si]
            for d, ix in enumerate(acc.indices):
                for v, c in ix.terms:
                    j = pos.get(v)
                    if j is not None:
                        where.append((ai, d, j))
                        coefs.append(abs(c))
        coef = np.zeros((A, D, L))
        if where:
            a_i, d_i, j_i = np.array(where, dtype=np.int64).T
            coef[a_i, d_i, j_i] = coefs
        self.coef = coef
        dims = np.ones((A, D))
        for ai, (_, acc, _) in enumerate(accs):
            shape = acc.buffer.shape
            dims[ai, : len(shape)] = shape
        self.dims = dims
        self.acc_store = np.array([si for si, _, _ in accs], dtype=np.int64)
        self.elem = np.array([a.buffer.elem_bytes for _, a, _ in accs], dtype=np.float64)
        self.count = np.array([n for _, _, n in accs], dtype=np.float64)
        self.is_read = np.array([a.is_read for _, a, _ in accs], dtype=bool)
        self.is_write = np.array([a.is_write for _, a, _ in accs], dtype=bool)
        self.ndim = np.array([len(a.indices) for _, a, _ in accs], dtype=np.int64)


def reduces_horizontally(store: Store) -> bool:
    """Whether the store's innermost loop becomes vector code in a CPU build although it
    is no vectorized loop: a serial reduction loop over `hreduce.MIN_LANES` to
    `MAX_LANES` elements (even), that the written element does not depend on and that
    every access depending on it walks with unit stride along the last dimension, inside
    no vectorized loop (`tunefarm.hreduce`). The features then count it as vectorized."""
    if not store.loops or store.is_init:
        return False
    inner = store.loops[-1]
    if not inner.reduce or inner.kind != "serial" or any(lp.kind == "vectorized" or lp.kind in BOUND_KINDS for lp in store.loops):
        return False
    if not hreduce.MIN_LANES <= inner.extent <= hreduce.MAX_LANES or inner.extent % 2:
        return False
    for acc in store.accesses:
        uses = [ix.coeff(inner.key) for ix in acc.indices]
        if acc.is_write and any(uses):
            return False
        if any(uses) and (uses[-1] != 1 or any(uses[:-1])):
            return False
    return True


def _store_rows(stores: list[Store]) -> np.ndarray:
    b = _Batch(stores)
    S = b.S
    trip = np.prod(b.ext, axis=1)  # (S,)
    cols: list[np.ndarray] = []
    # -- compute: op counts x trip count
    cols.append(slog(b.ops * trip[:, None]))
    # -- vectorize / parallel / unroll
    cols.append(_annotation(b.vec, b))
    cols.append(_annotation(b.par, b))
    cols.append(_unroll(b))
    # -- buffers
    cols.append(_buffers(b, trip))
    # -- arithmetic intensity curve
    cols.append(b._curve)
    # -- allocation
    alloc_elems_over = np.where(b.alloc[:, 1] > 0, trip / np.maximum(b.alloc[:, 1], 1.0), 0.0)
    cols.append(
        np.stack(
            [b.alloc[:, 0], slog(b.alloc[:, 1]), b.alloc[:, 0] * slog(alloc_elems_over), b.alloc[:, 0] * slog(trip)],
            axis=1,
        )
    )
    # -- other
    is_update = np.zeros(S)
    np.maximum.at(is_update, b.acc_store, (b.is_read & b.is_write).astype(float))
    cols.append(np.stack([slog(trip), b.nloops.astype(float), b.is_init, is_update], axis=1))
    out = np.concatenate(cols, axis=1)
    assert out.shape[1] == NUM_FEATURES
    return out


def _gpu_rows(stores: list[Store]) -> np.ndarray:
    """The GPU group (Ansor's is_gpu and thread-axis lengths, and the kernel's memory)."""

    def bound(st: Store, axis: str) -> float:
        n = 1.0
        for lp in st.loops:
            if lp.kind == axis:
                n *= lp.extent
        return n

    rows = []
    for st in stores:
        scope = st.alloc.scope if st.alloc is not None else "global"
        rows.append(
            [
                1.0,
                bound(st, "blockIdx.x"),
                bound(st, "vthread.x"),
                bound(st, "threadIdx.x"),
                st.shared_bytes,
                st.local_bytes,
                float(scope == "shared"),
                float(scope == "local"),
            ]
        )
    out = np.array(rows, dtype=np.float64)
    out[:, 1:6] = slog(out[:, 1:6])
    return out


def _gpu_memory_rows(stores: list[Store], gpu: GpuLimits) -> np.ndarray:
    """The `_GPU_MEMORY` group: coalescing and bank conflicts along each store's fastest
    threadIdx.x loop (its innermost), occupancy and waves of its kernel."""
    rows = []
    for st in stores:
        thread_loop = next((lp.key for lp in reversed(st.loops) if lp.kind == "threadIdx.x"), None)
        transactions, uncoalesced, conflicts = 1.0, 0.0, 1.0
        for acc in st.accesses:
            stride = abs(_flat_stride(acc, thread_loop)) if thread_loop is not None else 0
            nbytes = acc.buffer.elem_bytes
            if acc.buffer.scope == "global":
                span = gpu.warp_size * stride * nbytes if stride else nbytes
                transactions = max(transactions, min(float(gpu.warp_size), -(-span // WARP_TRANSACTION_BYTES)))
                uncoalesced += float(stride > 1)
            elif acc.buffer.scope == "shared" and stride:
                words = stride * nbytes / 4
                ways = math.gcd(int(words), SHARED_BANKS) if words >= 1 and float(words).is_integer() else 1
                conflicts = max(conflicts, float(ways))
        rows.append([transactions, uncoalesced, conflicts, *_occupancy(st, gpu)])
    out = np.array(rows, dtype=np.float64)
    out[:, [0, 1, 2, 4, 5]] = slog(out[:, [0, 1, 2, 4, 5]])
    return out


def _tensor_core_rows(stores: list[Store], fragment_bytes: list[int]) -> np.ndarray:
    """The `_TENSOR_CORE` group."""
    rows = []
    for st, frags in zip(stores, fragment_bytes):
        warps = 1.0
        for lp in st.loops:
            if lp.kind == "threadIdx.y":
                warps *= lp.extent
        rows.append([float(any(lp.kind == TENSORIZED for lp in st.loops)), warps, float(frags)])
    out = np.array(rows, dtype=np.float64).reshape(len(stores), 3)
    out[:, 1:] = slog(out[:, 1:])
    return out


def _flat_stride(acc: Access, loop: str) -> int:
    """Elements between the addresses two consecutive iterations of `loop` touch
    (row-major over the buffer's shape)."""
    stride, inner = 0, 1
    for ix, dim in zip(reversed(acc.indices), reversed(acc.buffer.shape)):
        stride += ix.coeff(loop) * inner
        inner *= int(dim)
    return stride


def _occupancy(st: Store, gpu: GpuLimits) -> tuple[float, float, float, float]:
    """(occupancy, blocks per SM, waves, wave efficiency) of the store's kernel."""
    threads = blocks = 1
    for lp in st.loops:
        if lp.kind in ("threadIdx.x", "threadIdx.y"):
            threads *= lp.extent
        elif lp.kind == "blockIdx.x":
            blocks *= lp.extent
    if any(lp.kind == TENSORIZED for lp in st.loops) and not any(lp.kind == "threadIdx.x" for lp in st.loops):
        threads *= gpu.warp_size  # a warp-wide operation: its lanes have no loop
    sm = gpu.sm
    warps = -(-threads // gpu.warp_size)
    registers = min(gpu.max_registers_per_thread, BASE_REGISTERS_PER_THREAD + -(-st.local_bytes // 4))
    fits = [sm.max_blocks, sm.max_threads // max(threads, 1), sm.registers // max(registers * warps * gpu.warp_size, 1)]
    if st.shared_bytes:
        fits.append(sm.shared_memory // st.shared_bytes)
    per_sm = max(0, min(fits))
    occupancy = per_sm * warps * gpu.warp_size / sm.max_threads
    slots = sm.multiprocessors * max(per_sm, 1)
    waves = -(-blocks // slots)
    return occupancy, float(per_sm), float(waves), blocks / (waves * slots)


def _annotation(mask: np.ndarray, b: _Batch) -> np.ndarray:
    S, L = mask.shape
    idx = np.arange(L)[None, :]
    n = b.nloops[:, None]
    num = mask.sum(axis=1)
    prod = np.prod(np.where(mask, b.ext, 1.0), axis=1)
    last = np.where(mask, idx, -1).max(axis=1)
    length = np.where(last >= 0, b.ext[np.arange(S), np.maximum(last, 0)], 0.0)
    where = np.where(idx == n - 1, 0, np.where(idx == 0, 2, 1))  # inner, middle, outer
    cat = 1 + where + 3 * b.reduce  # 1..6 as in _POSITIONS
    cat_m = np.where(mask, cat, 0)
    first_cat = cat_m.max(axis=1)
    mixed = (np.where(mask, cat, 99).min(axis=1) != first_cat) & (num > 0)
    pos = np.where(num == 0, 0, np.where(mixed, 7, first_cat))
    onehot = np.zeros((S, len(_POSITIONS)))
    onehot[np.arange(S), pos] = 1.0
    return np.concatenate([np.stack([slog(length), slog(np.where(num > 0, prod, 0.0)), num.astype(float)], axis=1), onehot], axis=1)


def _unroll(b: _Batch) -> np.ndarray:
    """TVM's UnrollLoop unrolls the innermost loops while their extent product stays
    within the pragma's max step (vectorized loops are left to the vectorizer)."""
    S, L = b.ext.shape
    ext = np.where(b.vec, 1.0, b.ext)
    rev = ext[:, ::-1]
    cum = np.cumprod(rev, axis=1)
    real = (np.arange(L)[None, :] < b.nloops[:, None])[:, ::-1]
    within = (cum <= b.unroll[:, None]) & real
    # count leading True of `within` per row
    stop = np.where(~within, np.arange(L)[None, :], L).min(axis=1)
    prod = np.where(stop > 0, cum[np.arange(S), np.maximum(stop - 1, 0)], 1.0)
    on = b.unroll > 0
    return np.stack([slog(b.unroll), np.where(on, stop, 0).astype(float), np.where(on, slog(prod), 0.0)], axis=1)


def _buffers(b: _Batch, trip: np.ndarray) -> np.ndarray:
    L, A = b.L, b.A
    ext = b.ext[b.acc_store]  # (A, L)
    span = b.coef * (ext - 1.0)[:, None, :]  # (A, D, L)
    suffix = np.cumsum(span[:, :, ::-1], axis=2)[:, :, ::-1]  # footprint - 1 when loops j.. vary
    foot = np.minimum(1.0 + suffix, b.dims[:, :, None])  # (A, D, L)
    elems_at = np.concatenate([np.prod(foot, axis=1), np.ones((A, 1))], axis=1)  # (A, L+1)
    unique = elems_at[:, 0]
    used = b.coef.sum(axis=1) > 0  # (A, L)
    used_trip = np.prod(np.where(used, ext, 1.0), axis=1)
    last_dim = np.maximum(b.ndim - 1, 0)
    ar = np.arange(A)
    # innermost loop the access depends on
    j_used = np.where(used, np.arange(L)[None, :], -1).max(axis=1)
    has_used = j_used >= 0
    jj = np.maximum(j_used, 0)
    # element stride of that loop (row-major flattening)
    dim_stride = _row_major_strides(b.dims, b.ndim)
    coef_j = b.coef[ar, :, jj]  # (A, D)
    stride = np.where(has_used, (coef_j * dim_stride).sum(axis=1), 0.0)
    c_last = coef_j[ar, last_dim]
    c_other = coef_j.sum(axis=1) - c_last
    contiguous = has_used & (c_other == 0) & (c_last * b.elem < CACHE_LINE_BYTES)
    frac = np.maximum(c_last * b.elem / CACHE_LINE_BYTES, 1.0 / np.maximum(ext[ar, jj], 1.0))
    lines = np.where(contiguous, used_trip * frac, used_trip) * b.count
    last_foot = foot[ar, last_dim, 0]
    unique_lines = unique / np.maximum(last_foot, 1.0) * np.ceil(last_foot * b.elem / CACHE_LINE_BYTES)
    nbytes = trip[b.acc_store] * b.elem * b.count
    unique_bytes = unique * b.elem
    loop_reuse, dis_iter, dis_bytes, reuse_ct, store_bytes_at = _reuse(b, ext, used, elems_at)
    serial = (~loop_reuse) & (b.count > 1)
    none = (~loop_reuse) & (b.count <= 1)
    ct = np.maximum(reuse_ct, 1.0)
    feats = np.stack(
        [
            (b.is_read & ~b.is_write).astype(float),
            (b.is_write & ~b.is_read).astype(float),
            (b.is_write & b.is_read).astype(float),
            slog(nbytes),
            slog(unique_bytes),
            slog(lines),
            slog(unique_lines),
            loop_reuse.astype(float),
            serial.astype(float),
            none.astype(float),
            slog(dis_iter),
            slog(dis_bytes),
            slog(reuse_ct),
            slog(nbytes / ct),
            slog(unique_bytes / ct),
            slog(lines / ct),
            slog(unique_lines / ct),
            slog(stride),
        ],
        axis=1,
    )  # (A, 18)
    # arithmetic intensity curve, per store (needs all of a store's accesses)
    b._curve = _curve(b, store_bytes_at)
    return _in_slots(b, feats, nbytes)


def _reuse(b: _Batch, ext: np.ndarray, used: np.ndarray, elems_at: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per access, its reuse loop (the innermost loop with extent > 1 it does not depend
    on): whether it has one, the iterations and the bytes (of all its store's accesses)
    between reuses, and the reuse count; and per store the bytes touched inside each loop."""
    S, L, A = b.S, b.L, b.A
    ar = np.arange(A)
    cand = (~used) & (ext > 1)
    j_reuse = np.where(cand, np.arange(L)[None, :], -1).max(axis=1)
    loop_reuse = j_reuse >= 0
    jr = np.maximum(j_reuse, 0)
    inner_iter = np.concatenate([np.cumprod(ext[:, ::-1], axis=1)[:, ::-1][:, 1:], np.ones((A, 1))], axis=1)  # iterations strictly inside loop j
    dis_iter = np.where(loop_reuse, inner_iter[ar, jr], np.where(b.count > 1, 1.0, 0.0))
    # bytes every access of the same store touches inside the reuse loop
    bytes_inside = elems_at * b.elem[:, None]  # (A, L+1)
    store_bytes_at = np.zeros((S, L + 1))
    np.add.at(store_bytes_at, b.acc_store, bytes_inside)
    dis_bytes = np.where(loop_reuse, store_bytes_at[b.acc_store, jr + 1], 0.0)
    reuse_ct = np.where(loop_reuse, ext[ar, jr], np.where(b.count > 1, b.count, 0.0))
    return loop_reuse, dis_iter, dis_bytes, reuse_ct, store_bytes_at


def _in_slots(b: _Batch, feats: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Each store's access features in its buffer slots, largest bytes first."""
    out = np.zeros((b.S, MAX_BUFFERS, len(_BUFFER)))
    order = np.lexsort((-nbytes, b.acc_store))
    slot = np.zeros(b.A, dtype=np.int64)
    sorted_store = b.acc_store[order]
    first = np.searchsorted(sorted_store, sorted_store, side="left")
    slot[order] = np.arange(b.A) - first
    keep = slot < MAX_BUFFERS
    out[b.acc_store[keep], slot[keep]] = feats[keep]
    return out.reshape(b.S, MAX_BUFFERS * len(_BUFFER))


def _row_major_strides(dims: np.ndarray, ndim: np.ndarray) -> np.ndarray:
    """Elements per step of each dimension of a row-major buffer (padding dims: 0)."""
    A, D = dims.shape
    valid = np.arange(D)[None, :] < ndim[:, None]
    d = np.where(valid, dims, 1.0)
    rev = np.cumprod(d[:, ::-1], axis=1)[:, ::-1]  # product of dims from d on
    strides = np.concatenate([rev[:, 1:], np.ones((A, 1))], axis=1)
    return np.where(valid, strides, 0.0)


def _curve(b: _Batch, store_bytes_at: np.ndarray) -> np.ndarray:
    S, L = b.ext.shape
    flops = b.ops[:, :5].sum(axis=1)  # float arithmetic per iteration
    inner_trip = np.concatenate([np.cumprod(b.ext[:, ::-1], axis=1)[:, ::-1], np.ones((S, 1))], axis=1)  # (S, L+1)
    intensity = flops[:, None] * inner_trip / np.maximum(store_bytes_at, 1.0)
    out = np.zeros((S, CURVE_SAMPLES))
    for si in range(S):
        n = int(b.nloops[si])
        if n == 0 or flops[si] == 0:
            continue
        xs = np.linspace(0.0, n, CURVE_SAMPLES)
        out[si] = np.interp(xs, np.arange(n + 1), intensity[si, : n + 1])
    return slog(out)


def _merge_accesses(accesses: tuple[Access, ...]) -> list[tuple[Access, int]]:
    """Group the accesses by buffer: (representative access, number of accesses)."""
    if len({a.buffer.name for a in accesses}) == len(accesses):  # one access per buffer
        return [(a, 1) for a in accesses]
    groups: dict[str, list[Access]] = {}
    for a in accesses:
        groups.setdefault(a.buffer.name, []).append(a)
    out = []
    for accs in groups.values():
        first = accs[0]
        is_read = any(a.is_read for a in accs)
        is_write = any(a.is_write for a in accs)
        out.append((Access(first.buffer, first.indices, is_write, is_read), len(accs)))
    return out
