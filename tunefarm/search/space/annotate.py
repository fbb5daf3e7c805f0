"""The annotation step of the loop-nest model (Ansor's random annotation on CPU): which
loops run in parallel, which innermost loop is vectorized, and how far the nest is unrolled
(`pragma_auto_unroll_max_step`). `parallel_range` bounds the fused outer loops that run in
parallel, from their work per core.
"""

from __future__ import annotations

import math

from tunefarm.search.space.dag import (
    Affine,
)
from tunefarm.search.space.program import (
    MAX_UNROLLED_LANES,
    InvalidProgram,
    Loop,
    Nest,
    Program,
    unrolled_lanes,
)
from tunefarm.search.space.slots import ChoiceDomain, Decider, IntRange, TileDomain

UNROLL_STEPS = (0, 16, 64, 512)
"""Candidate values of `pragma_auto_unroll_max_step` (Ansor CPU)."""


MAX_VECTOR = 64
"""Longest loop the model vectorizes (Ansor: max_innermost_split_factor)."""


def annotate(prog: Program, name: str, decider: Decider, num_cores: int) -> None:
    """Ansor's InitVectorization, InitParallel and InitUnroll for one block, then the
    reduction's init split off (decompose_reduction), all as `realize.py` does them."""
    nest = prog.nests[name]
    spec = nest.spec
    at_root = nest.attach is None
    attached = prog.attached_keys()
    # -- vectorize
    if nest.rf_inner and not at_root:
        _rf_axis_innermost(prog, name)
    if at_root and not nest.tiled and not nest.rf_inner:
        _fuse_trailing_unit_loops(prog, name, attached)
    inward = _inward_vector_loop(prog, name, attached)
    if inward is not None and decider.decide(f"{name}.inward_vector", ChoiceDomain(2), default=0):
        _vectorize_inward(prog, name, inward, decider)
    elif nest.loops:
        last = nest.loops[-1]
        if at_root and not nest.tiled and not nest.rf_inner and not last.reduce and last.extent > 1 and last.key not in attached:
            outer_ext, vec = decider.decide(f"{name}.vector", TileDomain(last.extent, 2, MAX_VECTOR, min_innermost=2))
            prog.emit("split_inner", name, (outer_ext, vec))
            _split_last(prog, nest, outer_ext, vec)
            if vec > 1:
                nest.loops[-1].kind = "vectorized"
                prog.emit("vectorize", name)
        elif not last.reduce and 1 < last.extent <= MAX_VECTOR and last.key not in attached:
            last.kind = "vectorized"
            prog.emit("vectorize", name)
        elif not at_root and not nest.tiled and not last.reduce and last.extent > MAX_VECTOR and last.key not in attached:
            _vectorize_long_loop(prog, name, decider)
    # -- parallel
    if at_root:
        prefix = 0
        for lp in nest.loops:
            if lp.reduce or lp.kind in ("vectorized", "unrolled"):
                break
            prefix += 1
            if lp.key in attached:
                break
        if prefix:
            lo, hi = parallel_range([lp.extent for lp in nest.loops[:prefix]], num_cores)
            if math.prod(lp.extent for lp in nest.loops) <= SERIAL_WORK_LIMIT:
                lo = 0  # small enough that one thread may beat waking the pool: the search decides
            n = decider.decide(f"{name}.parallel", IntRange(lo, hi))
            nest.parallel = n
            for lp in nest.loops[:n]:
                lp.kind = "parallel"
            if n:
                prog.emit("parallel", name, n)
    # -- unroll (a block whose table loops are unrolled already has its straight-line body)
    if (spec.is_reduction or nest.tiled) and nest.loops and not any(lp.kind == "unrolled" for lp in nest.loops):
        nest.unroll = UNROLL_STEPS[decider.decide(f"{name}.unroll", ChoiceDomain(len(UNROLL_STEPS)))]
        if nest.unroll:
            own = len(nest.loops) - max(nest.parallel - 1, 0)  # own loops after the parallel fuse
            prog.emit("unroll", name, -own, nest.unroll)
            lanes = unrolled_lanes(nest.loops, nest.unroll)
            if lanes > MAX_UNROLLED_LANES:
                raise InvalidProgram(f"{name}: auto-unroll {nest.unroll} gives {lanes} lanes of straight-line code")


def _inward_vector_loop(prog: Program, name: str, attached: set[str]) -> int | None:
    """The loop a reduction over a non-contiguous axis may vectorize inside its reduction
    loops, or None: its last spatial loop, when the innermost loop is a reduction, that
    spatial loop runs along the last dimension, with unit stride, of the output and of
    every input the reduction loops walk, and nothing is computed at it or inside it.

    Such a block (a max pool or a global average in NHWC, a softmax over the channels of
    an NCHW tensor) otherwise gets no vector loop: its innermost loop reduces over a
    strided axis, so the whole kernel ran scalar (yolo's DFL softmax over 16 bins of
    1x16x4x2100: 165 us, against OpenVINO's 22 us)."""
    nest = prog.nests[name]
    if nest.tiled or nest.rf_inner or not nest.spec.is_reduction or not nest.loops or not nest.loops[-1].reduce:
        return None
    idx = next((i for i in range(len(nest.loops) - 1, -1, -1) if not nest.loops[i].reduce and nest.loops[i].extent > 1), None)
    if idx is None or any(lp.key in attached for lp in nest.loops[idx:]):
        return None
    reduce_keys = {lp.key for lp in nest.loops[idx:] if lp.reduce and lp.extent > 1}
    if not reduce_keys:
        return None
    key = nest.loops[idx].key

    def unit_stride(indices) -> bool:
        return bool(indices) and indices[-1].substitute(nest.binding).coeff(key) == 1

    def reduced(indices) -> bool:
        return any(reduce_keys & ix.substitute(nest.binding).vars for ix in indices)

    streamed = [a.indices for a in nest.spec.reads if reduced(a.indices)]
    if not streamed or not unit_stride(nest.spec.write.indices) or not all(unit_stride(ix) for ix in streamed):
        return None
    return idx


def _vectorize_inward(prog: Program, name: str, idx: int, decider: Decider) -> None:
    """Split loop `idx` in two (slot `<block>.vector`) and move the inner part innermost,
    inside the reduction loops, vectorized: each step of the reductions then updates a
    vector of outputs, which stays in registers across them."""
    nest = prog.nests[name]
    lp = nest.loops[idx]
    outer_ext, vec = decider.decide(f"{name}.vector", TileDomain(lp.extent, 2, MAX_VECTOR, min_innermost=2))
    prog.emit("split_inward", name, idx - len(nest.loops), (outer_ext, vec))
    outer, inner = _split_loop(prog, nest, idx, outer_ext, vec)
    nest.loops[idx : idx + 1] = [outer]
    nest.loops.append(inner)
    if vec > 1:
        inner.kind = "vectorized"
        prog.emit("vectorize", name)


def _vectorize_long_loop(prog: Program, name: str, decider: Decider) -> None:
    """Split the innermost loop of a block computed at a consumer's loop, longer than
    `MAX_VECTOR`, in two (slot `<block>.vector`) and vectorize the inner part: such a loop
    was left scalar. A softmax's exp computed at each row of 128 ran 128 scalar
    polynomials per row, and the softmax of BERT's attention scores (12 x 128 x 128) took
    49 us after 32 trials, with its max and sum vectorized. The slot's default keeps the
    loop whole and scalar, the program that records made before it measured."""
    nest = prog.nests[name]
    last = nest.loops[-1]
    domain = TileDomain(last.extent, 2, MAX_VECTOR)
    outer_ext, vec = decider.decide(f"{name}.vector", domain, default=(last.extent, 1))
    if vec > 1:
        prog.emit("split_inner", name, (outer_ext, vec))
        _split_last(prog, nest, outer_ext, vec)
        nest.loops[-1].kind = "vectorized"
        prog.emit("vectorize", name)


def _fuse_trailing_unit_loops(prog: Program, name: str, attached: set[str]) -> None:
    """Fuse a trailing spatial loop of extent 1 into the loop before it, so that the loop
    to vectorize is that one: an NHWC tensor with one channel (a segmentation or heat map,
    (1, 256, 256, 1)) would otherwise keep a vector length of 1, and its elementwise
    epilogue (a sigmoid) ran scalar."""
    nest = prog.nests[name]
    while len(nest.loops) >= 2:
        last, before = nest.loops[-1], nest.loops[-2]
        if last.extent != 1 or last.reduce or before.reduce or last.key in attached or before.key in attached:
            return
        nest.loops.pop()
        for it, aff in list(nest.binding.items()):
            if aff.coeff(last.key):  # the loop variable is always 0
                nest.binding[it] = Affine.of({v: c for v, c in aff.terms if v != last.key}, aff.const, aff.exact)
        prog.emit("fuse_last", name)


def _rf_axis_innermost(prog: Program, name: str) -> None:
    """Move the rf axis of a computed-at rf block innermost, so that it can be vectorized.

    `compute_at` recreates a block's loops in its iterator order, and an rf block's rf
    iterator comes first: the vectorizable axis would end up outside the reduction loop
    (a 16-lane max reduction becoming 16 scalar chains)."""
    nest = prog.nests[name]
    rf_vars = nest.binding[nest.spec.iters[0].name].vars
    own = [i for i, lp in enumerate(nest.loops) if lp.key in rf_vars]
    attached = prog.attached_keys()
    if len(own) != 1 or own[0] == len(nest.loops) - 1:
        return
    idx = own[0]
    if any(lp.key in attached for lp in nest.loops[idx:]):
        return
    pos = idx - len(nest.loops)
    nest.loops.append(nest.loops.pop(idx))
    prog.emit("move_innermost", name, pos)


SERIAL_WORK_LIMIT = 1 << 18
"""A root block whose loop nest runs at most this many iterations may also run on one
thread (parallel decision 0). Waking TVM's thread pool and joining it costs microseconds
per kernel, far more on a busy machine: on the shared 2-core VM this was written on (load
~20), a vectorized elementwise kernel of 2^10 floats took 0.12 us serially and 25 us with
a parallel loop, 2^16 floats 8.9 vs 74 us, 2^18 40 vs 388 us, 2^20 4.7 vs 4.5 ms. Below
this bound one thread can win; which side does is measured, not assumed: 0 is one more
value of the parallel slot. Bigger blocks are always parallel (their search space stays
as it was)."""


PARALLEL_JOBS_PER_CORE = 16
"""Fusing outer loops past this many parallel jobs per core gains nothing (Ansor and
MetaSchedule both stop at 16 x cores)."""


def parallel_range(extents: list[int], num_cores: int) -> tuple[int, int]:
    """How many leading loops the parallel loop may fuse: from the fewest that give every
    core work to the fewest that give 16 jobs per core (Ansor's InitParallel default)."""
    prod, lo, hi = 1, None, len(extents)
    for k, e in enumerate(extents, 1):
        prod *= e
        if lo is None and prod >= num_cores:
            lo = k
        if prod > PARALLEL_JOBS_PER_CORE * num_cores:
            hi = k
            break
    if lo is None:  # too little parallelism anywhere: fuse all of it
        lo = hi
    return lo, hi


def _split_last(prog: Program, nest: Nest, outer_ext: int, inner_ext: int) -> None:
    nest.loops[-1:] = _split_loop(prog, nest, len(nest.loops) - 1, outer_ext, inner_ext)


def _split_loop(prog: Program, nest: Nest, idx: int, outer_ext: int, inner_ext: int) -> tuple[Loop, Loop]:
    """Two new loops for `nest.loops[idx]` split (outer, inner), with the iterator bindings
    rewritten to them; the caller places them in `nest.loops`."""
    old = nest.loops[idx]
    outer = prog.new_loop(outer_ext, old.reduce)
    inner = prog.new_loop(inner_ext, old.reduce)
    for it, aff in list(nest.binding.items()):
        c = aff.coeff(old.key)
        if c:
            terms = {v: x for v, x in aff.terms if v != old.key}
            terms[outer.key] = c * inner_ext
            terms[inner.key] = c
            nest.binding[it] = Affine.of(terms, aff.const, aff.exact)
    return outer, inner
