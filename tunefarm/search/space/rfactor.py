"""The rfactor step of the loop-nest model: a reduction split into an rf block that
computes partial results over its own reduction axis, and the final block that sums them
(TVM's `rfactor`: a block with loops (spatial..., k) fused/split into (k0, k1) gives an rf
block with loops (spatial..., k0, k1) and a final block with (spatial..., rf)).
"""

from __future__ import annotations

import math
from dataclasses import replace

from tunefarm.search.space.dag import (
    AccessSpec,
    Affine,
    BlockSpec,
    BufferSpec,
    ComputeDag,
    IterSpec,
    OpCounts,
)
from tunefarm.search.space.program import (
    MAX_INNERMOST_TILE,
    Nest,
    Program,
)
from tunefarm.search.space.sketch import (
    rfactor_names,
)
from tunefarm.search.space.slots import Decider, TileDomain


def rfactor(prog: Program, name: str, inner: bool, decider: Decider) -> None:
    spec = prog.nests[name].spec
    total = math.prod(it.extent for it in spec.reduce)
    f0, f1 = decider.decide(
        f"{name}.rfactor", TileDomain(total, 2, MAX_INNERMOST_TILE if inner else total)
    )
    # The rf axis goes last when it is the vectorized one (contiguous partial sums),
    # first when it is the parallel one (each thread owns a contiguous block).
    factor_axis = len(spec.spatial) if inner else 0
    prog.emit("rfactor", name, (f0, f1), inner, rfactor_names(name), len(spec.reduce), factor_axis)
    rf_spec, final_spec = _rfactor_blocks(prog, spec, inner, (f0, f1), factor_axis)
    _rfactor_nests(prog, spec, rf_spec, final_spec, inner, (f0, f1))


def _rfactor_blocks(
    prog: Program, spec: BlockSpec, inner: bool, factors: tuple[int, int], factor_axis: int
) -> tuple[BlockSpec, BlockSpec]:
    """The rf block and the final block that replace `spec` in the DAG (which gains the
    rf buffer): the rf block reduces (rest) into rf partial sums, the final block sums
    them."""
    name = spec.name
    f0, f1 = factors
    rf_ext, rest_ext = (f1, f0) if inner else (f0, f1)
    rf_iter = IterSpec(f"{name}.rf", rf_ext, "S")
    rest_iter = IterSpec(f"{name}.rest", rest_ext, "R")
    # Fused reduction index k = k0 * f1 + k1, with (k0, k1) = (rest, rf) or (rf, rest).
    k = (
        Affine.of({rest_iter.name: f1, rf_iter.name: 1})
        if inner
        else Affine.of({rf_iter.name: f1, rest_iter.name: 1})
    )
    red_names = [it.name for it in spec.reduce]
    new_buffers = list(prog.dag.buffers)
    reads = [_fuse_reduce_dims(prog.dag, acc, red_names, k, new_buffers) for acc in spec.reads]
    rf_name = rfactor_names(name)
    sp_shape = [it.extent for it in spec.spatial]
    sp_index = [Affine.of({it.name: 1}) for it in spec.spatial]
    rf_shape = (*sp_shape[:factor_axis], rf_ext, *sp_shape[factor_axis:])
    new_buffers.append(BufferSpec(rf_name, rf_shape, prog.dag.buffer(spec.write.buffer).dtype, "intermediate"))
    rf_index = (*sp_index[:factor_axis], Affine.of({rf_iter.name: 1}), *sp_index[factor_axis:])
    rf_spec = BlockSpec(
        name=rf_name,
        iters=(rf_iter, *spec.spatial, rest_iter),
        reads=tuple(reads),
        write=AccessSpec(rf_name, rf_index),
        ops=spec.ops,
        has_init=True,
        has_branch=spec.has_branch,
        has_expensive_op=spec.has_expensive_op,
    )
    final_iter = IterSpec(f"{name}.rf", rf_ext, "R")
    combine = OpCounts(float_cmp=1) if spec.ops.float_cmp and not spec.ops.float_add_sub else OpCounts(float_add_sub=1)
    final_spec = replace(
        spec,
        iters=(final_iter, *spec.spatial),  # TVM's order; its loops stay (spatial..., rf)
        reads=(AccessSpec(rf_name, (*sp_index[:factor_axis], Affine.of({final_iter.name: 1}), *sp_index[factor_axis:])),),
        ops=combine,
        has_branch=False,
        has_expensive_op=False,
    )
    blocks = []
    for b in prog.dag.blocks:
        blocks.extend([rf_spec, final_spec] if b.name == name else [b])
    prog.dag = prog.dag.replace_blocks(blocks, new_buffers)
    return rf_spec, final_spec


def _rfactor_nests(
    prog: Program, spec: BlockSpec, rf_spec: BlockSpec, final_spec: BlockSpec, inner: bool, factors: tuple[int, int]
) -> None:
    """The loops of the two blocks that replace `spec`: the rf block's (spatial..., k0,
    k1), the final block's (spatial..., rf)."""
    name = spec.name
    f0, f1 = factors
    del prog.nests[name]
    idx = prog.order.index(name)
    prog.order.remove(name)
    sp_loops = [prog.new_loop(it.extent, False) for it in spec.spatial]
    k0 = prog.new_loop(f0, reduce=inner)
    k1 = prog.new_loop(f1, reduce=not inner)
    binding = {it.name: Affine.of({lp.key: 1}) for it, lp in zip(spec.spatial, sp_loops)}
    binding[f"{name}.rf"] = Affine.of({(k1 if inner else k0).key: 1})
    binding[f"{name}.rest"] = Affine.of({(k0 if inner else k1).key: 1})
    prog.nests[rf_spec.name] = Nest(rf_spec, [*sp_loops, k0, k1], binding, rf_inner=inner)
    fsp = [prog.new_loop(it.extent, False) for it in spec.spatial]
    frf = prog.new_loop(f1 if inner else f0, True)
    fbinding = {it.name: Affine.of({lp.key: 1}) for it, lp in zip(spec.spatial, fsp)}
    fbinding[f"{name}.rf"] = Affine.of({frf.key: 1})
    prog.nests[name] = Nest(final_spec, [*fsp, frf], fbinding)
    prog.order[idx:idx] = [rf_spec.name, name]


def _fuse_reduce_dims(dag: ComputeDag, acc: AccessSpec, red: list[str], k: Affine, new_buffers: list) -> AccessSpec:
    """Rewrite an access so the fused reduction index `k` replaces the reduction
    iterators: a single one is substituted; several (consecutive dimensions, checked by
    `rfactor_possible`) are merged into one dimension of a flattened view."""
    dims = [i for i, ix in enumerate(acc.indices) if ix.vars & set(red)]
    if not dims:
        return acc
    if len(red) == 1:
        return AccessSpec(acc.buffer, tuple(ix.substitute({red[0]: k}) for ix in acc.indices))
    buf = dag.buffer(acc.buffer)
    lo, hi = dims[0], dims[-1] + 1
    merged = 1
    for s in buf.shape[lo:hi]:
        merged *= s
    view = BufferSpec(f"{buf.name}", (*buf.shape[:lo], merged, *buf.shape[hi:]), buf.dtype, buf.role)
    view_name = f"{buf.name}@{lo}:{hi}"
    view = replace(view, name=view_name)
    if all(b.name != view_name for b in new_buffers):
        new_buffers.append(view)
    return AccessSpec(view_name, (*acc.indices[:lo], k, *acc.indices[hi:]))
