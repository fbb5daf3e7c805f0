"""The loop-nest model's GPU steps: shared-memory stages with cooperative fetching,
software pipelining, thread binding, and the checks that reject a program that cannot
launch.

Map of this module:
  apply(prog, step, decider, gpu)        dispatch one GPU sketch step
  draw_feasible_tiles                    a tiled block's pipeline depth (sm_80+) and tile
                                         sizes, drawn one level at a time within the
                                         GPU's limits (sampling only)
  TileLimits / TileLevels                those limits on tile sizes alone, the levels
  _cache_read_shared                     CacheReadStep: the stage, its region, the fetch
  _bind_tiled / _bind_cross_thread /     ThreadBindStep for a tiled block, a cross-thread
  _bind_fallback                         reduction, any other root block
  finish                                 after the sketch: software pipelines, dynamic
                                         shared memory
  check_program / check_tiled_block      threads, vthreads, shared memory, registers

The loops a GPU program gets (TVM's, which `realize.py` replays):
- tiled block `SSSRRSRS`: the loops of spatial levels 0, 1, 2 are fused and bound to
  blockIdx.x, vthread.x and threadIdx.x (the model keeps them as separate loops of that
  kind; `expected_tvm_loops` shows them fused);
- a shared stage computed at the outermost reduction tile: its loops fused, split into
  (rest, threads[, vector]), the threads bound to threadIdx.x (the same axis as its
  block's) and the vector vectorized. The model's loops are those; their binding to the
  stage's iterators is approximate (`exact=False`), as a fused-then-split index is not
  affine (the features only need its innermost strides);
- a cross-thread reduction: spatial loops fused to blockIdx.x, reduction loops fused and
  split into (rest, threads), the threads bound to threadIdx.x;
- any other root block: spatial loops fused and split into (blocks, threads).

Software pipelining (sm_80+; MetaSchedule's AddAsyncPipeline, cuBLAS's "stage3" kernels):
a tiled block with shared stages has a pipeline depth (slot `<block>.pipeline`, one of
`PIPELINE_DEPTHS`), decided with its tiles so that its stages fit `depth` times in the
block's shared memory. With a depth d > 1 its outermost reduction tile loops, where the
stages are computed, are fused into one loop annotated for TVM's InjectSoftwarePipeline:
the stages in pipeline stage 0, asynchronous (cp.async under `cuda.lowering`), the
computation in stage d - 1, so each stage gets d copies and the copies of the next d - 1
reduction tiles are in flight while the threads compute on the current one. A kernel
whose stages take more than the 48 KB a block may declare statically has them in dynamic
shared memory ("shared.dyn"), up to the GPU's opt-in limit (`GpuLimits`).

Validity (Ansor: `InitThreadBind` rejects, and TVM's `VerifyGPUCode` postprocessor):
threads per block within the GPU's limit and at least a warp (unless the whole space is
small: Ansor's 2 x warp rule), vthreads within `max_vthreads`, shared memory within the
block limit, and an estimate of the registers a thread's accumulators take.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from tunefarm.gpu import GpuLimits
from tunefarm.search.space.dag import AccessSpec, Affine, BlockSpec, BufferSpec, IterSpec, OpCounts
from tunefarm.search.space.program import (
    MAX_INNERMOST_TILE,
    MAX_UNROLLED_LANES,
    InvalidProgram,
    Loop,
    Program,
    add_root_nest,
    attach_region_nest,
    touched_region,
    tvm_position,
    union_region,
    unrolled_lanes,
)
from tunefarm.search.space.sketch import CacheReadStep, CrossThreadReductionStep, Step, ThreadBindStep
from tunefarm.search.space.slots import ChoiceDomain, Decider, TileDomain, divisors

GPU_UNROLL_STEPS = (0, 16, 64, 512, 1024)
"""Candidate values of `pragma_auto_unroll_max_step` on a GPU (Ansor and MetaSchedule)."""

THREAD_CHOICES = (32, 64, 128, 256, 512, 1024)
"""Threads per block of an untiled kernel or a cross-thread reduction (whole warps)."""

VECTOR_CHOICES = (1, 2, 4, 8, 16)
"""Vector lengths of a cooperative fetch, before the GPU's widest access (16 bytes) and
the alignment of the tile rule them out."""

PIPELINE_DEPTHS = (1, 2, 3, 4)
"""Software-pipeline depths of a tiled block's shared stages (slot `<block>.pipeline`
indexes them; 0, no pipeline, is what records made before the slot rebuild with): how
many copies of each stage the outer reduction loop cycles through. MetaSchedule tries 3
and 4 copies (its "stages" 4 and 5), cuBLAS's SIMT GEMM on sm_80 uses 3."""

ACCUMULATOR_REGISTER_SHARE = 0.75
"""Share of a thread's registers its accumulators may take (the rest holds addresses,
loop counters and the operands read from shared memory). An estimate: ptxas decides."""


def apply(prog: Program, step: Step, decider: Decider, gpu: GpuLimits) -> None:
    match step:
        case CacheReadStep(block=b, buffer=buf):
            _cache_read_shared(prog, b, buf, decider, gpu)
        case CrossThreadReductionStep(block=b):
            prog.nests[b].cross_thread = True  # bound by its ThreadBindStep
        case ThreadBindStep(block=b):
            nest = prog.nests.get(b)
            if nest is None or nest.attach is not None:
                return  # inlined, or bound with the block it is computed in
            if nest.tiled:
                _bind_tiled(prog, b, decider, gpu)
            elif nest.cross_thread:
                _bind_cross_thread(prog, b, decider, gpu)
            else:
                _bind_fallback(prog, b, decider, gpu)
        case _:
            raise TypeError(step)


# ------------------------------------------------------------------- shared-memory stage


def _tile_levels(prog: Program, name: str, kind: str) -> list[list[str]]:
    nest = prog.nests[name]
    return [g for g, ch in zip(nest.tile_groups, nest.tile_structure) if ch == kind]


def _product(loops: list[Loop]) -> int:
    n = 1
    for lp in loops:
        n *= lp.extent
    return n


def _cache_read_shared(prog: Program, block: str, buffer: str, decider: Decider, gpu: GpuLimits) -> None:
    s_levels = _tile_levels(prog, block, "S")
    name, region = stage_in_shared(prog, block, buffer, frozenset(s_levels[1] + s_levels[2]))
    nest = prog.nests[block]
    stage_nest = prog.nests[name]
    tile_elems = stage_nest.footprint
    threads = _product([lp for lp in nest.loops if lp.key in s_levels[2]])
    vectors = vector_lengths(region, prog.dag.buffer(buffer), tile_elems, gpu)
    vec = vectors[decider.decide(f"{name}.vector", ChoiceDomain(len(vectors)))]
    _cooperative_fetch(prog, name, threads, vec)


def stage_in_shared(
    prog: Program, block: str, buffer: str, relaxed: frozenset[str]
) -> tuple[str, list[tuple[Affine, int]]]:
    """`buffer`, as tiled root block `block` reads it, staged in shared memory at the
    block's outermost reduction tile (a CacheReadStep's stage, a tensor-core block's
    operand): the stage block `<buffer>_shared`, computed there over the region the
    block's loops inside it and the `relaxed` ones (the loops of the threads that share
    it) touch. Returns the stage's name and that region; its footprint is the region's
    elements."""
    nest = prog.nests[block]
    if not nest.tiled or nest.attach is not None:
        raise InvalidProgram(f"{block} is not a tiled root block: nothing to stage {buffer} for")
    r_levels = _tile_levels(prog, block, "R")
    attach_key = r_levels[0][-1]
    chain = prog.chain(block)
    pos = next(i for i, lp in enumerate(chain) if lp.key == attach_key)
    buf = prog.dag.buffer(buffer)
    region = None
    for acc in nest.spec.reads:
        if acc.buffer == buffer:
            r = touched_region(prog, [ix.substitute(nest.binding) for ix in acc.indices], chain, pos, buf.shape, relaxed)
            region = r if region is None else union_region(region, r, buf.shape)
    if region is None:
        raise InvalidProgram(f"{block} does not read {buffer}")
    name = f"{buffer}_shared"
    iters = tuple(IterSpec(f"v{d}", int(e), "S") for d, e in enumerate(buf.shape))
    index = tuple(Affine.of({it.name: 1}) for it in iters)
    stage = BlockSpec(name=name, iters=iters, reads=(AccessSpec(buffer, index),), write=AccessSpec(name, index), ops=OpCounts())
    add_stage_block(prog, block, stage, BufferSpec(name, buf.shape, buf.dtype, "intermediate", "shared"), buffer)
    prog.emit("cache_read", block, buffer, name, tvm_position(chain, pos))
    add_root_nest(prog, stage, before=block)
    attach_region_nest(prog, name, block, attach_key, region)
    stage_nest = prog.nests[name]
    stage_nest.footprint = _product(stage_nest.loops)
    return name, region


def add_stage_block(prog: Program, block: str, stage: BlockSpec, buf: BufferSpec, buffer: str) -> None:
    """The DAG with `stage` (writing `buf`) before `block`, which reads `buffer` from it."""
    nest = prog.nests[block]
    reader = _reading(nest.spec, buffer, stage.name)
    blocks: list[BlockSpec] = []
    for b in prog.dag.blocks:
        if b.name == block:
            blocks.extend([stage, reader])
        else:
            blocks.append(b)
    prog.dag = prog.dag.replace_blocks(blocks, (*prog.dag.buffers, buf))
    nest.spec = reader


def _reading(spec: BlockSpec, buffer: str, stage: str) -> BlockSpec:
    return replace(spec, reads=tuple(AccessSpec(stage, a.indices) if a.buffer == buffer else a for a in spec.reads))


def vector_lengths(region: list[tuple[Affine, int]], buf: BufferSpec, tile_elems: int, gpu: GpuLimits) -> list[int]:
    """Vector lengths a cooperative fetch of this tile may use: within the widest access,
    dividing the tile's innermost extent and the buffer's rows, and starting aligned (the
    tile's start in the innermost dimension a multiple of the vector, so a float4 load
    reads 16 aligned bytes). Only from an argument of the kernel: an intermediate (a
    padding block, inlined into the stage afterwards) reads at offsets. Always [1, ...]."""
    start, inner = region[-1]
    out = [1]
    if buf.role == "intermediate":
        return out
    for v in VECTOR_CHOICES[1:]:
        if v * buf.elem_bytes > gpu.max_vector_bytes or tile_elems % v:
            continue
        aligned = start.exact and start.const % v == 0 and all(c % v == 0 for _, c in start.terms)
        if inner % v == 0 and int(buf.shape[-1]) % v == 0 and aligned:
            out.append(v)
    return out


def _cooperative_fetch(prog: Program, name: str, threads: int, vec: int, warps: int = 0) -> None:
    """The stage's loops fused and split into (rest, threads[, vec]); threads bound to
    threadIdx.x, the vector vectorized. With `warps` (a tensor-core block's threads,
    `warps` x `threads`): (rest, warps, threads[, vec]), the warps bound to threadIdx.y."""
    nest = prog.nests[name]
    own = nest.loops
    n = _product(own)
    if not own:  # one element per tile: every thread may store it
        return
    if warps:
        prog.emit("coop_fetch_warps", name, len(own), warps, threads, vec)
    else:
        prog.emit("coop_fetch", name, len(own), threads, vec)
    rest = -(-n // (max(warps, 1) * threads * vec))
    outer = prog.new_loop(rest, False)
    thread = prog.new_loop(threads, False)
    thread.kind = "threadIdx.x"
    loops = [outer, thread]
    inner = {thread.key: vec, outer.key: max(warps, 1) * threads * vec}
    if warps:
        warp = prog.new_loop(warps, False)
        warp.kind = "threadIdx.y"
        loops = [outer, warp, thread]
        inner[warp.key] = threads * vec
    if vec > 1:
        lane = prog.new_loop(vec, False)
        lane.kind = "vectorized"
        loops.append(lane)
        inner[lane.key] = 1
    keys = {lp.key for lp in own}
    last_dim_var = None
    for it in nest.spec.iters:
        if any(v in keys for v in nest.binding[it.name].vars):
            last_dim_var = it.name
    for it in nest.spec.iters:
        aff = nest.binding[it.name]
        if not any(v in keys for v in aff.vars):
            continue
        outside = {v: c for v, c in aff.terms if v not in keys}
        terms = dict(inner) if it.name == last_dim_var else {outer.key: 1}
        nest.binding[it.name] = Affine.of({**outside, **terms}, aff.const, exact=False)
    nest.loops = loops


# ------------------------------------------------------------------------ tile sampling

WARP_MULTIPLE_SHARE = 0.5
"""Share of the thread-level draws made among the thread counts that are whole warps
(where the limits leave any): a block of 48 threads idles half its second warp, and
the fast kernels use whole warps. A preference, not a rule: the other draws are uniform
over every thread count that fits."""

REGISTER_TILE_SHARE = 0.5
"""Share of the inner-level draws made among the register tiles that fill at least
`REGISTER_TILE_FILL` of the accumulator budget (where the limits leave any): uniform
draws over the combinations of factors favour small tiles, and a fast GEMM holds 64
accumulators in each of 256 threads, a third of the budget."""

REGISTER_TILE_FILL = 0.25

PICK_TRIES = 8
"""Random picks of a level's options tried before they are all checked (`_pick`)."""


def draw_feasible_tiles(prog: Program, name: str, structure: str, decider: Decider, gpu: GpuLimits) -> None:
    """Draw a tiled block's tile sizes so that its kernel can launch. Ansor draws each
    split alone and rejects the program afterwards: on a 1024^3 GEMM fewer than 2% of
    such draws pass the GPU checks. Here the splits are drawn one tile level at a time,
    each level uniform over its options that still leave a valid program (`_draw_tiling`):
    the thread factors (threads per block in [warp, max]; half the draws among whole
    warps), the vthread factors (at most `max_vthreads`), the inner factors (accumulators
    within the registers those threads leave), then each reduction tile (the shared
    stages, times the pipeline depth, within the block's shared memory). The checks are
    `check_tiled_block`'s, from the tile sizes alone (`TileLimits`). The draw fails only
    where no tiling at all fits beside the slots already given (mutation, crossover,
    records), which are kept (a given one outside its domain is refit where the decider
    refits, else drawn); InvalidProgram then. Nothing is drawn without an rng, so a
    measured program rebuilds from its decisions as it was. The chosen values become
    given slots, so `_tile` takes them as it would any.

    On sm_80+ a block with shared stages first gets its pipeline depth (`_decide_depth`):
    a given one is kept, a drawn one is uniform over the depths beside which some tiling
    fits the given slots (depths tried in random order, the first that fits taken)."""
    spec = prog.nests[name].spec
    rng = decider.rng
    n_s, n_r = structure.count("S"), structure.count("R")
    if n_s < 4:
        return  # not a GPU tiling (check_tiled_block rejects it)
    limits = TileLimits.of(prog, spec, gpu)
    pipelined = gpu.async_copy and bool(limits.staged) and any(it.kind == "R" for it in spec.iters)
    draw_depth = pipelined and rng is not None and _depth_slot(name) not in decider.given
    if pipelined and not draw_depth:
        limits = replace(limits, depth=_decide_depth(prog, name, decider))
    if rng is None:
        return  # nothing to draw
    slots = {it.name: f"{name}.tile.{it.name}" for it in spec.iters}
    domains = {it.name: TileDomain(it.extent, n_s if it.kind == "S" else n_r, MAX_INNERMOST_TILE) for it in spec.iters}
    fixed: dict[str, tuple[int, ...]] = {}
    for it in spec.iters:
        value = decider.given.get(slots[it.name])
        domain = domains[it.name]
        if value is not None and not domain.contains(value) and decider.refit:
            value = domain.nearest(value)
        if value is not None and domain.contains(value):
            fixed[it.name] = value
    if draw_depth:
        order = list(range(len(PIPELINE_DEPTHS)))
        rng.shuffle(order)
        drawn, index = None, 0
        for i in order:
            drawn = _draw_preferring_static(replace(limits, depth=PIPELINE_DEPTHS[i]), domains, fixed, rng)
            if drawn is not None:
                index = i
                break
        decider.given = {**decider.given, _depth_slot(name): index}
        _decide_depth(prog, name, decider)
    if len(fixed) == len(spec.iters):
        return
    if not draw_depth:
        drawn = _draw_preferring_static(limits, domains, fixed, rng)
    if drawn is None:
        given = ", ".join(f"{slots[k]}={v}" for k, v in fixed.items())
        raise InvalidProgram(f"{name}: no tiling fits the GPU's limits beside {given or 'nothing'}")
    decider.given = {**decider.given, **{slots[k]: v for k, v in drawn.items()}}


def _depth_slot(name: str) -> str:
    return f"{name}.pipeline"


def _decide_depth(prog: Program, name: str, decider: Decider) -> int:
    """The block's pipeline depth (slot `<block>.pipeline`, no pipeline where records
    made before the slot lack it), kept on its nest for `finish`."""
    index = decider.decide(_depth_slot(name), ChoiceDomain(len(PIPELINE_DEPTHS)), default=0)
    depth = PIPELINE_DEPTHS[index]
    prog.nests[name].pipeline = depth
    return depth


@dataclass(frozen=True)
class StagedRead:
    """A buffer a tiled block stages in shared memory: per dimension, the tiled block's
    iterators in its index with their |coefficient|, and the dimension's extent."""

    dims: tuple[tuple[tuple[tuple[str, int], ...], int], ...]
    elem_bytes: int

    def elems(self, span: dict[str, int]) -> int:
        n = 1
        for terms, dim in self.dims:
            n *= min(1 + sum(c * (span[v] - 1) for v, c in terms if v in span), dim)
        return n


@dataclass(frozen=True)
class TileLimits:
    """`check_tiled_block`'s checks from a tiled block's tile sizes alone, on the level
    factors of its iterators: per spatial iterator its vthread, thread and inner
    (product of the levels inside the thread level) factors, per reduction iterator its
    span (the levels inside the outermost, the shared stages' extent along it)."""

    gpu: GpuLimits
    spatial: tuple[str, ...]
    min_threads: int  # a warp, unless the whole space is small (Ansor's 2 x warp rule)
    accumulator_bytes: int
    staged: tuple[StagedRead, ...]  # the global buffers the block reads (its shared stages)
    depth: int = 1  # copies of each stage (the software pipeline's depth)
    shared_limit: int | None = None  # bytes the stages may take; None: the GPU's per-block limit

    @staticmethod
    def of(prog: Program, spec: BlockSpec, gpu: GpuLimits) -> TileLimits:
        spatial = tuple(it.name for it in spec.iters if it.kind == "S")
        space = _prod(it.extent for it in spec.iters if it.kind == "S")
        staged = []
        for buffer in dict.fromkeys(a.buffer for a in spec.reads):
            buf = prog.dag.buffer(buffer)
            if buf.scope != "global":
                continue
            acc = next(a for a in spec.reads if a.buffer == buffer)
            dims = tuple(
                (tuple((v, abs(c)) for v, c in ix.terms), int(dim)) for ix, dim in zip(acc.indices, buf.shape)
            )
            staged.append(StagedRead(dims, buf.elem_bytes))
        return TileLimits(
            gpu,
            spatial,
            gpu.warp_size if space > 2 * gpu.warp_size else 1,
            prog.dag.buffer(spec.write.buffer).elem_bytes,
            tuple(staged),
        )

    def max_accumulators(self, threads: int) -> int:
        """Accumulators one of `threads` threads may hold (`check_tiled_block`'s budget)."""
        budget = min(self.gpu.max_registers_per_thread, self.gpu.registers_per_block // max(threads, 1))
        return int(ACCUMULATOR_REGISTER_SHARE * budget) * 4 // self.accumulator_bytes

    def shared_bytes(self, span: dict[str, int]) -> int:
        """Shared memory of the block's stages (`depth` copies of each), `span`: each
        iterator's tile extent."""
        return self.depth * sum(s.elems(span) * s.elem_bytes for s in self.staged)

    def fits(self, levels: TileLevels) -> bool:
        th, vth, inner = levels.threads, levels.vthreads, levels.inner
        threads = _prod(th.values())
        if not self.min_threads <= threads <= self.gpu.max_threads_per_block:
            return False
        if _prod(vth.values()) > self.gpu.max_vthreads:
            return False
        if _prod(vth[n] * inner[n] for n in self.spatial) > self.max_accumulators(threads):
            return False
        span = {**levels.spans, **{n: vth[n] * th[n] * inner[n] for n in self.spatial}}
        limit = self.gpu.max_shared_memory_per_block if self.shared_limit is None else self.shared_limit
        return self.shared_bytes(span) <= limit


@dataclass
class TileLevels:
    """A tiled block's level factors, drawn or given; an iterator not drawn yet has 1 at
    every level it has not drawn (the least it may take: each limit but the lower bound
    on threads only grows with a factor, so a level whose options are checked with the
    later levels at 1 never leaves the later ones without a valid option)."""

    threads: dict[str, int]
    vthreads: dict[str, int]
    inner: dict[str, int]  # spatial: product of the levels inside the thread level
    spans: dict[str, int]  # reduction: product of the levels inside the outermost

    @staticmethod
    def of(limits: TileLimits, iters: list[str], fixed: dict[str, tuple[int, ...]]) -> TileLevels:
        spatial = set(limits.spatial)
        levels = TileLevels({}, {}, {}, {})
        for n in iters:
            f = fixed.get(n)
            if n in spatial:
                levels.vthreads[n], levels.threads[n], levels.inner[n] = (f[1], f[2], _prod(f[3:])) if f else (1, 1, 1)
            else:
                levels.spans[n] = _prod(f[1:]) if f else 1
        return levels

    def with_(self, field: str, values: dict[str, int]) -> TileLevels:
        return replace(self, **{field: {**getattr(self, field), **values}})


def _draw_preferring_static(
    limits: TileLimits, domains: dict[str, TileDomain], fixed: dict[str, tuple[int, ...]], rng
) -> dict[str, tuple[int, ...]] | None:
    """`_draw_tiling`, where the GPU allows dynamic shared memory above the static limit
    mostly (`STATIC_SHARED_PREFERENCE`) within the static limit when a tiling fits there:
    the stages of fast kernels are small (cuBLAS's sm_80 SIMT GEMM: 3 x 6 KB), and a
    block that takes much of an SM's shared memory leaves it few blocks to switch between."""
    static = limits.gpu.static_shared_memory_per_block
    if static < limits.gpu.max_shared_memory_per_block and rng.random() < STATIC_SHARED_PREFERENCE:
        drawn = _draw_tiling(replace(limits, shared_limit=static), domains, fixed, rng)
        if drawn is not None:
            return drawn
    return _draw_tiling(limits, domains, fixed, rng)


STATIC_SHARED_PREFERENCE = 0.75
"""Share of fresh tile draws kept within the static shared memory limit where a tiling fits
there (the rest range up to the GPU's dynamic limit). Not measured on a GPU yet: a prior."""


def _draw_tiling(
    limits: TileLimits, domains: dict[str, TileDomain], fixed: dict[str, tuple[int, ...]], rng
) -> dict[str, tuple[int, ...]] | None:
    """The tilings of the iterators not in `fixed`, drawn level by level (see
    `draw_feasible_tiles`); None where no tiling beside `fixed` fits.

    Spatial tilings are (block, vthread, thread, inner...): for the free spatial
    iterators together, the thread factors first, then the vthread factors, then the
    inner factors (each a divisor of what the earlier levels left), each level uniform
    over the combinations that fit with the later levels at 1; the inner factor is split
    over the inner levels (innermost at most `MAX_INNERMOST_TILE`), the block level takes
    what is left. Then each free reduction tiling (in random order), uniform over its
    domain's tilings that fit with the reductions still to draw untiled."""
    levels = TileLevels.of(limits, list(domains), fixed)
    free = [n for n in limits.spatial if n not in fixed]
    gpu = limits.gpu
    rest = {n: domains[n].extent for n in free}
    if free:
        base = _prod(levels.threads.values())
        low = -(-limits.min_threads // base)
        options, whole_warps = _level_options(
            tuple(rest.values()), low, gpu.max_threads_per_block // base, gpu.warp_size // math.gcd(gpu.warp_size, base), low
        )  # fmt: skip
        levels = _pick_level(levels, "threads", free, options, whole_warps, WARP_MULTIPLE_SHARE, limits, rng)
        if levels is None:
            return None
        rest = {n: rest[n] // levels.threads[n] for n in free}
        high = gpu.max_vthreads // _prod(levels.vthreads.values())
        options, _ = _level_options(tuple(rest.values()), 1, high, 1, 1)
        levels = _pick_level(levels, "vthreads", free, options, (), 0.0, limits, rng)
        if levels is None:
            return None
        rest = {n: rest[n] // levels.vthreads[n] for n in free}
        accumulators = _prod(levels.vthreads[n] * levels.inner[n] for n in limits.spatial)
        budget = limits.max_accumulators(_prod(levels.threads.values()))
        full = -(-int(budget * REGISTER_TILE_FILL) // accumulators)
        options, large = _level_options(tuple(rest.values()), 1, budget // accumulators, 1, full)
        levels = _pick_level(levels, "inner", free, options, large, REGISTER_TILE_SHARE, limits, rng)
        if levels is None:
            return None
    elif not limits.fits(levels):
        return None
    drawn: dict[str, tuple[int, ...]] = {}
    for n in free:
        inner = levels.inner[n]
        split = TileDomain(inner, domains[n].parts - 3, MAX_INNERMOST_TILE).sample(rng)
        drawn[n] = (rest[n] // inner, levels.vthreads[n], levels.threads[n], *split)
    reductions = [n for n in domains if n not in limits.spatial and n not in fixed]
    rng.shuffle(reductions)
    for n in reductions:
        options = domains[n].options()
        choice = _pick(options, lambda o, n=n, lv=levels: limits.fits(lv.with_("spans", {n: _prod(o[1:])})), rng)
        if choice is None:
            return None
        levels = levels.with_("spans", {n: _prod(choice[1:])})
        drawn[n] = choice
    return drawn


def _pick_level(
    levels: TileLevels, field: str, free: list[str], options: tuple[tuple[int, ...], ...],
    preferred: tuple[tuple[int, ...], ...], share: float, limits: TileLimits, rng,
) -> TileLevels | None:
    """`levels` with one level's factors of the `free` iterators drawn uniformly from
    the `options` that fit; with probability `share` (when there are `preferred`
    options), from the `preferred` ones that fit, if any do."""

    def with_level(combo: tuple[int, ...]) -> TileLevels:
        return levels.with_(field, dict(zip(free, combo)))

    def fits(combo: tuple[int, ...]) -> bool:
        return limits.fits(with_level(combo))

    combo = _pick(preferred, fits, rng) if preferred and rng.random() < share else None
    if combo is None:
        combo = _pick(options, fits, rng)
    return None if combo is None else with_level(combo)


def _pick(options, fits, rng):
    """One of `options` that `fits`, uniformly among them (a few random picks, then all
    of them checked); None when none does."""
    if not options:
        return None
    for _ in range(PICK_TRIES):
        option = options[rng.randrange(len(options))]
        if fits(option):
            return option
    fitting = [o for o in options if fits(o)]
    return rng.choice(fitting) if fitting else None


@lru_cache(maxsize=4096)
def _level_options(
    extents: tuple[int, ...], low: int, high: int, multiple: int, at_least: int
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """Every combination of a divisor of each extent whose product lies in [low, high],
    and those of them whose product is a multiple of `multiple` and at least `at_least`."""
    combos: list[tuple[int, ...]] = [()]
    products = [1]
    for e in extents:
        step_c, step_p = [], []
        for c, p in zip(combos, products):
            for d in divisors(e):
                if p * d > high:
                    break
                step_c.append((*c, d))
                step_p.append(p * d)
        combos, products = step_c, step_p
    options = tuple(c for c, p in zip(combos, products) if p >= low)
    preferred = tuple(c for c, p in zip(combos, products) if p >= max(low, at_least) and p % multiple == 0)
    return options, preferred


def _prod(values) -> int:
    n = 1
    for v in values:
        n *= v
    return n


# ------------------------------------------------------------------------------ binding


def _bind_tiled(prog: Program, name: str, decider: Decider, gpu: GpuLimits) -> None:
    nest = prog.nests[name]
    s_levels = _tile_levels(prog, name, "S")
    if len(s_levels) < 4:
        raise InvalidProgram(f"{name}: a GPU tiling needs four spatial levels, it has {len(s_levels)}")
    by_key = {lp.key: lp for lp in nest.loops}
    for level, kind in zip(s_levels[:3], ("blockIdx.x", "vthread.x", "threadIdx.x")):
        for key in level:
            by_key[key].kind = kind
    # Accumulators per thread: the output elements of the vthread and inner spatial levels.
    nest.footprint = _product([by_key[k] for lv in (s_levels[1], *s_levels[3:]) for k in lv])
    nest.threads = _product([by_key[k] for k in s_levels[2]])
    prog.emit("bind_tile", name, len(s_levels[0]), len(s_levels[1]), len(s_levels[2]))
    _unroll(prog, name, decider)


# ------------------------------------------------------------ pipelines, dynamic memory


def finish(prog: Program, gpu: GpuLimits) -> None:
    """Called after the sketch's steps, before the checks: each tiled block's software
    pipeline (where its depth is > 1), then dynamic shared memory for the stages of each
    kernel whose stages pass the static limit (sm_80+)."""
    for name in list(prog.order):
        nest = prog.nests[name]
        if nest.attach is None and nest.tiled and nest.pipeline > 1:
            _software_pipeline(prog, name, nest.pipeline)
    if not gpu.async_copy:
        return
    for name in prog.order:
        nest = prog.nests[name]
        if nest.tensor_core is not None:
            continue  # its stages were placed with its tiles (`loopnest_tensor_core`)
        if nest.attach is None and nest.tiled and prog.kernel_bytes(name, "shared") > gpu.static_shared_memory_per_block:
            for stage in _shared_stages(prog, name):
                prog.emit("dynamic_shared", stage)


def _shared_stages(prog: Program, root: str) -> list[str]:
    return [
        n for n in prog.order
        if n != root and prog.root_of(n) == root and prog.dag.buffer(prog.nests[n].spec.write.buffer).scope == "shared"
    ]  # fmt: skip


def _software_pipeline(prog: Program, name: str, depth: int) -> None:
    """The block's outermost reduction tile loops (its shared stages' attach point) fused
    into one loop and pipelined: the loop's body is the stages, then the rest of the
    block's loops; each stage gets `depth` copies."""
    nest = prog.nests[name]
    r0 = _tile_levels(prog, name, "R")[0]
    stages = [n for n in prog.order if prog.nests[n].attach == (name, r0[-1])]
    if not stages:  # every buffer it reads is staged by another block
        return
    pos = next(i for i, lp in enumerate(nest.loops) if lp.key == r0[0])
    prog.emit("pipeline", name, tvm_position(nest.loops, pos), len(r0), len(stages), depth)
    fused = _fuse_loops(prog, name, pos, len(r0))
    nest.tile_groups = [[fused.key] if group == r0 else group for group in nest.tile_groups]
    for stage in stages:
        prog.nests[stage].attach = (name, fused.key)
        prog.nests[stage].footprint *= depth


def _fuse_loops(prog: Program, name: str, pos: int, n: int) -> Loop:
    """Root block `name`'s own loops [pos, pos + n) fused into one (TVM's `fuse`): the
    blocks of its kernel bound to the fused loop instead. The index of a fused loop is a
    floordiv/mod of the new one, not affine: the innermost loop of extent > 1 becomes the
    new loop (exact when it is the only one), the outer ones drop out (inexact)."""
    nest = prog.nests[name]
    old = nest.loops[pos : pos + n]
    fused = prog.new_loop(_product(old), old[0].reduce)
    wide = [lp for lp in old if lp.extent > 1]
    env = {lp.key: Affine() for lp in old}
    for lp in wide:
        env[lp.key] = Affine.of({}, exact=False)
    if wide:
        env[wide[-1].key] = Affine.of({fused.key: 1}, exact=len(wide) == 1)
    for other in prog.order:
        if prog.root_of(other) == name:
            o = prog.nests[other]
            o.binding = {it: aff.substitute(env) for it, aff in o.binding.items()}
    nest.loops = [*nest.loops[:pos], fused, *nest.loops[pos + n :]]
    return fused


def check_program(prog: Program, gpu: GpuLimits) -> None:
    """Called when a GPU program is built: every kernel within the GPU's limits (a
    tensor-core block's: `loopnest_tensor_core.check_tensor_core_block`)."""
    for name in prog.order:
        nest = prog.nests[name]
        if nest.attach is None and nest.tiled and nest.tensor_core is None:
            check_tiled_block(prog, name, gpu)


def check_tiled_block(prog: Program, name: str, gpu: GpuLimits) -> None:
    """Reject a tiled block's kernel that cannot launch or would spill (InvalidProgram)."""
    nest = prog.nests[name]
    s_levels = _tile_levels(prog, name, "S")
    by_key = {lp.key: lp for lp in nest.loops}
    threads = nest.threads
    vthreads = _product([by_key[k] for k in s_levels[1]])
    space = _product([lp for lp in nest.loops if not lp.reduce])
    if threads > gpu.max_threads_per_block:
        raise InvalidProgram(f"{name}: {threads} threads per block (the GPU allows {gpu.max_threads_per_block})")
    if threads < gpu.warp_size and space > 2 * gpu.warp_size:
        raise InvalidProgram(f"{name}: {threads} threads per block, less than a warp ({gpu.warp_size})")
    if vthreads > gpu.max_vthreads:
        raise InvalidProgram(f"{name}: {vthreads} virtual threads (at most {gpu.max_vthreads})")
    shared = prog.kernel_bytes(name, "shared")
    if shared > gpu.max_shared_memory_per_block:
        raise InvalidProgram(
            f"{name}: {shared} bytes of shared memory per block (the GPU allows {gpu.max_shared_memory_per_block})"
        )
    words = -(-prog.kernel_bytes(name, "local") // 4)
    budget = min(gpu.max_registers_per_thread, gpu.registers_per_block // max(threads, 1))
    if words > ACCUMULATOR_REGISTER_SHARE * budget:
        raise InvalidProgram(f"{name}: {words} accumulator registers per thread (budget {budget} with {threads} threads)")


def _thread_choices(extent: int, gpu: GpuLimits) -> list[int]:
    """Threads per block for `extent` parallel iterations: whole warps, no more than
    the GPU allows nor (beyond one warp) than there is work for."""
    return [t for t in THREAD_CHOICES if t <= gpu.max_threads_per_block and t <= max(gpu.warp_size, extent)]


def _bind_cross_thread(prog: Program, name: str, decider: Decider, gpu: GpuLimits) -> None:
    nest = prog.nests[name]
    spatial = [lp for lp in nest.loops if not lp.reduce]
    reduce = [lp for lp in nest.loops if lp.reduce]
    if nest.loops[: len(spatial)] != spatial:
        raise InvalidProgram(f"{name}: reduction loops are not innermost")
    total = _product(reduce)
    choices = _thread_choices(total, gpu)
    threads = choices[decider.decide(f"{name}.threads", ChoiceDomain(len(choices)))]
    prog.emit("cross_thread", name, len(spatial), len(reduce), threads)
    outer = prog.new_loop(-(-total // threads), True)
    inner = prog.new_loop(threads, True)
    inner.kind = "threadIdx.x"
    fused = {outer.key: threads, inner.key: 1}
    _rebind(nest, reduce, fused, {outer.key: 1})
    if not spatial:
        spatial = [prog.new_loop(1, False)]
    for lp in spatial:
        lp.kind = "blockIdx.x"
    nest.loops = [*spatial, outer, inner]
    nest.threads = threads
    # TVM's LowerCrossThreadReduction: warp shuffles, then one value per warp and the
    # result in shared memory when the block has more than one warp.
    elem = prog.dag.buffer(nest.spec.write.buffer).elem_bytes
    nest.lowering_shared_bytes = elem * (threads // gpu.warp_size + 1) if threads > gpu.warp_size else 0
    _unroll(prog, name, decider)


def _bind_fallback(prog: Program, name: str, decider: Decider, gpu: GpuLimits) -> None:
    """Ansor's InitThreadBind for a stage the rules did not tile (MetaSchedule's
    AutoBind): the leading spatial loops fused and split over blocks of threads."""
    nest = prog.nests[name]
    n_spatial = 0
    for lp in nest.loops:
        if lp.reduce:
            break
        n_spatial += 1
    spatial = nest.loops[:n_spatial]
    rest = nest.loops[n_spatial:]
    if not spatial:  # nothing to spread: one block of one thread
        prog.emit("bind_fallback", name, 0, 1)
        unit = prog.new_loop(1, False)
        unit.kind = "blockIdx.x"
        nest.loops = [unit, *rest]
        nest.threads = 1
    else:
        total = _product(spatial)
        choices = _thread_choices(total, gpu)
        threads = choices[decider.decide(f"{name}.threads", ChoiceDomain(len(choices)))]
        prog.emit("bind_fallback", name, n_spatial, threads)
        blocks = prog.new_loop(-(-total // threads), False)
        blocks.kind = "blockIdx.x"
        thread = prog.new_loop(threads, False)
        thread.kind = "threadIdx.x"
        _rebind(nest, spatial, {blocks.key: threads, thread.key: 1}, {blocks.key: 1})
        nest.loops = [blocks, thread, *rest]
        nest.threads = threads
    if nest.spec.is_reduction:
        _unroll(prog, name, decider)


def _rebind(nest, old: list[Loop], innermost: dict[str, int], others: dict[str, int]) -> None:
    """Iterators driven by `old` loops (now fused and split) bound to the new loops: the
    one of the innermost old loop gets `innermost` strides, the others `others`
    (approximate: a fused-then-split index is floordiv/mod, not affine)."""
    keys = [lp.key for lp in old]
    if not keys:
        return
    last = keys[-1]
    for it, aff in list(nest.binding.items()):
        used = [v for v in aff.vars if v in keys]
        if not used:
            continue
        outside = {v: c for v, c in aff.terms if v not in keys}
        exact = aff.exact and len(keys) == 1
        terms = innermost if last in used else others
        nest.binding[it] = Affine.of({**outside, **terms}, aff.const, exact)


def _unroll(prog: Program, name: str, decider: Decider) -> None:
    """Ansor's InitUnroll on a GPU: an auto-unroll pragma on the kernel's outermost loop."""
    nest = prog.nests[name]
    if not (nest.spec.is_reduction or nest.tiled):
        return
    step = GPU_UNROLL_STEPS[decider.decide(f"{name}.unroll", ChoiceDomain(len(GPU_UNROLL_STEPS)))]
    nest.unroll = step
    if not step:
        return
    prog.emit("unroll", name, 0, step)
    lanes = unrolled_lanes(nest.loops, step)
    if lanes > MAX_UNROLLED_LANES:
        raise InvalidProgram(f"{name}: auto-unroll {step} gives {lanes} statements of straight-line code")
