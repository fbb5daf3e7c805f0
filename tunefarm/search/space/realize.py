"""Realize a program in TVM: replay the model's instructions as schedule primitives.

The loop-nest model (`loopnest.py`) resolves every decision and loop position; this
module only maps each `Instr` to the matching `tvm.s_tir.Schedule` call. A TVM error
means the model allowed something TVM does not: the candidate is rejected as invalid
(counted, never measured).
"""

from __future__ import annotations

import json

from tunefarm import wmma
from tunefarm.layout import PREPROC_ATTR
from tunefarm.search.space.program import Instr


class RealizeError(Exception):
    """TVM refused one of the program's primitives."""


def realize(mod, instructions: list[Instr]):
    """A fresh `tvm.s_tir.Schedule` of `mod` with the instructions applied."""
    from tvm.s_tir import Schedule

    # Checks on: the builder replays the trace with TVM's default checks, so a program
    # that only passes unchecked must be rejected here, before it costs a trial.
    sch = Schedule(mod, error_render_level="none")
    blocks: dict[str, object] = {}
    if any(ins.op in _TENSOR_CORE_OPS for ins in instructions):
        wmma.register()

    def rv(name: str):
        if name not in blocks:
            blocks[name] = sch.get_sblock(name)
        return blocks[name]

    for ins in instructions:
        try:
            _apply(sch, ins, rv, blocks)
        except Exception as exc:  # ScheduleError, ValueError, TVMError
            msg = str(exc).strip().splitlines()
            raise RealizeError(f"{ins.describe()}: {msg[-1] if msg else type(exc).__name__}") from None
    return sch


_OWN_LOOP_OPS = frozenset({"split_inner", "split_inward", "fuse_last", "parallel", "move_innermost", "vectorize", "unroll", "decompose"})
"""The instructions on the loops of their own block (`_apply_to_own_loops`); the others
make, place, tile or bind blocks (`_apply_to_blocks`)."""

_TENSOR_CORE_OPS = frozenset({"tc_blockize", "tc_copy", "tc_fragment", "tc_decompose"})
"""The instructions that tensorize with `tunefarm.wmma`'s intrinsics."""


def _apply(sch, ins: Instr, rv, blocks: dict) -> None:
    if ins.op in _OWN_LOOP_OPS:
        _apply_to_own_loops(sch, ins, rv)
    else:
        _apply_to_blocks(sch, ins, rv, blocks)


def _apply_to_blocks(sch, ins: Instr, rv, blocks: dict) -> None:
    b = ins.block
    match ins.op:
        case "inline":
            sch.compute_inline(rv(b))
        case "cache_write":
            copy_name, scope = ins.args
            blocks[copy_name] = sch.cache_write(rv(b), 0, scope)
        case "cache_read":
            buffer, stage, pos = ins.args
            blocks[stage] = _shared_stage(sch, rv(b), buffer, pos)
        case "coop_fetch":
            n_own, threads, vec = ins.args
            _cooperative_fetch(sch, rv(b), n_own, threads, vec)
        case "bind_tile":
            _bind_tile(sch, rv(b), ins.args)
        case "pipeline":
            pos, n_loops, n_stages, depth = ins.args
            _software_pipeline(sch, rv(b), pos, n_loops, n_stages, depth)
        case "dynamic_shared":
            sch.set_scope(rv(b), 0, "shared.dyn")
        case "tc_blockize":
            (positions,) = ins.args
            blocks[b] = _blockize_fragments(sch, rv(b), positions)
        case "bind_warps":
            n_blocks, n_warps = ins.args
            loops = sch.get_loops(rv(b))
            sch.bind(_fuse(sch, loops[:n_blocks]), "blockIdx.x")
            sch.bind(_fuse(sch, sch.get_loops(rv(b))[1 : 1 + n_warps]), "threadIdx.y")
        case "tc_copy":
            (intrinsic,) = ins.args
            _tensorize_fragments(sch, rv(b), intrinsic)
        case "align_rows":
            factor, offset = ins.args
            sch.storage_align(rv(b), 0, axis=-2, factor=factor, offset=offset)
        case "coop_fetch_warps":
            n_own, warps, threads, vec = ins.args
            _cooperative_fetch(sch, rv(b), n_own, threads, vec, warps)
        case "tc_fragment":
            shared, stage, pos, scope, intrinsic = ins.args
            frag = sch.cache_read(rv(b), _read_index(sch, rv(b), shared), scope)
            sch.compute_at(frag, sch.get_loops(rv(b))[pos], preserve_unit_loops=False)
            blocks[stage] = frag
            _tensorize_fragments(sch, frag, intrinsic)
        case "tc_decompose":
            pos, fill, sync = ins.args
            _decompose_tensorized(sch, rv(b), pos, fill, sync)
        case "cross_thread":
            n_spatial, n_reduce, threads = ins.args
            _bind_cross_thread(sch, rv(b), n_spatial, n_reduce, threads)
        case "bind_fallback":
            n_spatial, threads = ins.args
            _bind_fallback(sch, rv(b), n_spatial, threads)
        case "rfactor":
            factors, inner, rf_name, n_reduce, factor_axis = ins.args
            blocks[rf_name] = _rfactor(sch, rv(b), factors, inner, n_reduce, factor_axis)
        case "tile":
            structure, factors, inner = ins.args
            _tile(sch, rv(b), structure, factors, inner)
        case "acc_layout":
            (dims,) = ins.args
            sch.transform_layout(rv(b), ("write", 0), _tile_order_map(dims))
        case "unroll_tables":
            factors, vector_pos = ins.args
            _unroll_tables(sch, rv(b), factors, vector_pos)
        case "layout_rewrite":
            buffer, dims = ins.args
            _layout_rewrite(sch, rv(b), buffer, dims)
        case "reverse_compute_at":
            producer, pos = ins.args
            sch.reverse_compute_at(rv(b), sch.get_loops(rv(producer))[pos], preserve_unit_loops=False)
        case "compute_at":
            consumer, pos = ins.args
            sch.compute_at(rv(b), sch.get_loops(rv(consumer))[pos], preserve_unit_loops=False)
        case _:
            raise ValueError(f"unknown instruction {ins.op}")


def _apply_to_own_loops(sch, ins: Instr, rv) -> None:
    b = ins.block
    match ins.op:
        case "split_inner":
            (outer, inner) = ins.args[0]
            sch.split(sch.get_loops(rv(b))[-1], [outer, inner])
        case "split_inward":
            pos, (outer, inner) = ins.args
            loops = sch.get_loops(rv(b))
            after = loops[pos:][1:]
            _, inner_loop = sch.split(loops[pos], [outer, inner])
            if after:
                sch.reorder(*after, inner_loop)
        case "parallel":
            (n,) = ins.args
            loops = sch.get_loops(rv(b))[:n]
            sch.parallel(sch.fuse(*loops) if n > 1 else loops[0])
        case "fuse_last":
            sch.fuse(*sch.get_loops(rv(b))[-2:])
        case "move_innermost":
            (pos,) = ins.args
            own = sch.get_loops(rv(b))[pos:]
            sch.reorder(*own[1:], own[0])
        case "vectorize":
            sch.vectorize(sch.get_loops(rv(b))[-1])
        case "unroll":
            pos, step = ins.args
            loop = sch.get_loops(rv(b))[pos]
            sch.annotate(loop, "pragma_auto_unroll_max_step", step)
            sch.annotate(loop, "pragma_unroll_explicit", 1)
        case "decompose":
            (pos,) = ins.args
            sch.decompose_reduction(rv(b), sch.get_loops(rv(b))[pos])
        case _:
            raise ValueError(f"unknown instruction {ins.op}")


def _read_index(sch, block, buffer: str) -> int:
    return [str(r.source.name) for r in sch.get(block).reads].index(buffer)


def _shared_stage(sch, block, buffer: str, pos: int):
    """A shared-memory copy of `buffer` for `block`, computed at its loop `pos`."""
    stage = sch.cache_read(block, _read_index(sch, block, buffer), "shared")
    sch.compute_at(stage, sch.get_loops(block)[pos], preserve_unit_loops=False)
    return stage


def _rfactor(sch, block, factors, inner: bool, n_reduce: int, factor_axis: int):
    """The block's reduction loops fused, split by `factors`, factored over the inner (or
    outer) part; the rf block."""
    red = sch.get_loops(block)[-n_reduce:]
    k0, k1 = sch.split(_fuse(sch, red), list(factors))
    return sch.rfactor(k1 if inner else k0, factor_axis=factor_axis)


def _tile(sch, block, structure: str, factors, inner: int) -> None:
    """Split each loop by its factors and reorder the parts by `structure` ("SSRSRS"):
    level by level, spatial and reduction parts in iterator order, except that iterator
    `inner` (when >= 0) goes last in the innermost spatial level."""
    kinds = _iter_kinds(sch, block)
    parts = [sch.split(lp, list(f)) for lp, f in zip(sch.get_loops(block), factors)]
    level = {"S": 0, "R": 0}
    n_s = structure.count("S")
    last = [i for i in range(len(parts)) if i != inner] + ([inner] if inner >= 0 else [])
    order = []
    for ch in structure:
        lv = level[ch]
        level[ch] += 1
        its = last if ch == "S" and lv == n_s - 1 else range(len(parts))
        order.extend(parts[i][lv] for i in its if kinds[i] == ch)
    sch.reorder(*order)


def _unroll_tables(sch, block, factors, vector_pos: int) -> None:
    """Split each loop with factors in two, unroll the others (the table iterators'), and
    order them: outer parts, inner parts, table loops, the inner part at `vector_pos`."""
    outer, inner, table = [], [], []
    vector = None
    for i, (lp, f) in enumerate(zip(sch.get_loops(block), factors)):
        if not f:
            table.append(lp)
            continue
        o, n = sch.split(lp, list(f))
        outer.append(o)
        if i == vector_pos:
            vector = n
        else:
            inner.append(n)
    sch.reorder(*outer, *inner, *table, vector)
    for lp in table:
        sch.unroll(lp)


def _layout_rewrite(sch, block, buffer: str, dims) -> None:
    """Read constant `buffer` in the tile loops' order. An input of the function: a copy
    marked for pre-processing (done once, outside the kernel) and the block's read through
    the new layout. A buffer that a pre-processing block computes (a Winograd weight
    transform): that block writes it in the new layout directly."""
    idx = _read_index(sch, block, buffer)
    if buffer in {str(p.name) for p in sch.mod["main"].params}:
        copy = sch.cache_read(block, idx, "global")
        sch.annotate(copy, PREPROC_ATTR, 1)
    sch.transform_layout(block, ("read", idx), _tile_order_map(dims))


def _fuse(sch, loops):
    return sch.fuse(*loops) if len(loops) > 1 else loops[0]


def _cooperative_fetch(sch, block, n_own: int, threads: int, vec: int, warps: int = 0) -> None:
    """A shared stage's own loops fused, split into (rest, threads[, vec]); the threads
    bound to threadIdx.x (its block's axis), the vector lanes vectorized. With `warps`
    (a tensor-core block's): (rest, warps, threads[, vec]), the warps on threadIdx.y."""
    fused = _fuse(sch, sch.get_loops(block)[-n_own:])
    if vec > 1:
        fused, lane = sch.split(fused, [None, vec])
        sch.vectorize(lane)
    rest, thread = sch.split(fused, [None, threads])
    sch.bind(thread, "threadIdx.x")
    if warps:
        _, warp = sch.split(rest, [None, warps])
        sch.bind(warp, "threadIdx.y")


def _blockize_fragments(sch, block, positions):
    """The loops at `positions` (a GEMM's i, j, k) split by the fragment size, the 16s
    moved innermost (in that order) and blockized: the outer block, whose iterators
    count fragments."""
    loops = sch.get_loops(block)
    outer, inner = [], []
    for i, lp in enumerate(loops):
        if i in positions:
            o, n = sch.split(lp, [None, wmma.FRAGMENT])
            outer.append(o)
            inner.append(n)
        else:
            outer.append(lp)
    sch.reorder(*outer, *inner)
    return sch.blockize(inner[0])


def _tensorize_fragments(sch, block, intrinsic: str) -> None:
    """A fragment copy's two innermost loops split by the fragment size, the 16 x 16
    innermost, tensorized with `intrinsic`."""
    *_, rows, cols = sch.get_loops(block)
    r0, r1 = sch.split(rows, [None, wmma.FRAGMENT])
    c0, c1 = sch.split(cols, [None, wmma.FRAGMENT])
    sch.reorder(r0, c0, r1, c1)
    sch.tensorize(r1, intrinsic)


def _decompose_tensorized(sch, block, pos: int, fill: str, sync: str) -> None:
    """The blockized reduction's init split off at loop `pos`; the init's 16 x 16 loops
    tensorized with `fill`, the update's 16 x 16 x 16 with `sync`."""
    init = sch.decompose_reduction(block, sch.get_loops(block)[pos])
    (init_inner,) = sch.get_child_blocks(init)
    sch.tensorize(sch.get_loops(init_inner)[-2], fill)
    (inner,) = sch.get_child_blocks(block)
    sch.tensorize(sch.get_loops(inner)[-3], sync)


def _software_pipeline(sch, block, pos: int, n_loops: int, n_stages: int, depth: int) -> None:
    """The block's loops [pos, pos + n_loops) fused and annotated for TVM's
    InjectSoftwarePipeline: the loop body's first `n_stages` statements (the shared
    stages) in pipeline stage 0, asynchronous, the last (the computation) in stage
    `depth - 1`, in their order (MetaSchedule's AddAsyncPipeline)."""
    loop = _fuse(sch, sch.get_loops(block)[pos : pos + n_loops])
    sch.annotate(loop, "software_pipeline_stage", [0] * n_stages + [depth - 1])
    sch.annotate(loop, "software_pipeline_order", list(range(n_stages + 1)))
    sch.annotate(loop, "software_pipeline_async_stages", [0])


def _bind_tile(sch, block, level_sizes) -> None:
    """The first three spatial tile levels (the block's outermost loops) fused, each
    bound to its axis: blockIdx.x, vthread.x, threadIdx.x."""
    for i, (n, axis) in enumerate(zip(level_sizes, ("blockIdx.x", "vthread.x", "threadIdx.x"))):
        loops = sch.get_loops(block)
        sch.bind(_fuse(sch, loops[i : i + n]), axis)


def _bind_cross_thread(sch, block, n_spatial: int, n_reduce: int, threads: int) -> None:
    loops = sch.get_loops(block)
    if n_spatial == 0:
        sch.add_unit_loop(loops[0])
        loops = sch.get_loops(block)
        n_spatial = 1
    _, inner = sch.split(_fuse(sch, loops[n_spatial : n_spatial + n_reduce]), [None, threads])
    sch.bind(inner, "threadIdx.x")
    sch.bind(_fuse(sch, sch.get_loops(block)[:n_spatial]), "blockIdx.x")


def _bind_fallback(sch, block, n_spatial: int, threads: int) -> None:
    loops = sch.get_loops(block)
    if n_spatial == 0:
        sch.bind(sch.add_unit_loop(loops[0] if loops else block), "blockIdx.x")
        return
    blocks, thread = sch.split(_fuse(sch, loops[:n_spatial]), [None, threads])
    sch.bind(blocks, "blockIdx.x")
    sch.bind(thread, "threadIdx.x")


def _tile_order_map(dims):
    """Index map of a layout rewrite: new dimension i = (old index d // stride) % extent."""

    def index_map(*old):
        out = []
        for d, stride, extent, full in dims:
            e = old[d] // stride if stride > 1 else old[d]
            out.append(e % extent if stride * extent < full else e)
        return tuple(out)

    return index_map


def _iter_kinds(sch, block) -> list[str]:
    return [{0: "S", 2: "R"}.get(int(iv.iter_type), "O") for iv in sch.get(block).iter_vars]


def trace_json(sch) -> list:
    """The schedule's TVM trace as plain JSON data (IntImm/FloatImm unwrapped)."""
    return json.loads(json.dumps(sch.trace.as_json(), default=lambda o: o.value))


def loop_structure(sch) -> dict[str, list[tuple[int, str]]]:
    """{block: [(extent, kind), ...]} of every leaf block of the kernel (layout
    transforms left out), root to innermost: used by the test that holds the model to TVM."""
    import tvm

    kinds = {0: "serial", 1: "parallel", 2: "vectorized", 3: "unrolled"}

    def kind(loop) -> str:
        if loop.thread_binding is not None:
            return str(loop.thread_binding.thread_tag)
        return kinds.get(int(loop.kind), "other")
    out: dict[str, list[tuple[int, str]]] = {}

    def walk(stmt, loops):
        from tvm.s_tir import SBlockRealize

        if isinstance(stmt, tvm.tirx.SeqStmt):
            for s in stmt.seq:
                walk(s, loops)
        elif isinstance(stmt, tvm.tirx.For):
            walk(stmt.body, [*loops, (int(stmt.extent), kind(stmt))])
        elif isinstance(stmt, SBlockRealize):
            blk = stmt.block
            if PREPROC_ATTR in blk.annotations:  # a layout transform: not part of the kernel
                return
            if blk.name_hint != "root":
                out[str(blk.name_hint)] = loops
            walk(blk.body, loops)
        elif hasattr(stmt, "body"):
            walk(stmt.body, loops)

    walk(sch.mod["main"].body, [])
    return out
