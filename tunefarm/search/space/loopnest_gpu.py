"""The loop-nest model's GPU steps: shared-memory stages with cooperative fetching,
thread binding, and the checks that reject a program that cannot launch.

Map of this module:
  apply(prog, step, decider, gpu)        dispatch one GPU sketch step
  draw_feasible_tiles                    a tiled block's tile sizes drawn jointly until
                                         they fit the GPU (sampling only)
  _cache_read_shared                     CacheReadStep: the stage, its region, the fetch
  _bind_tiled / _bind_cross_thread /     ThreadBindStep for a tiled block, a cross-thread
  _bind_fallback                         reduction, any other root block
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

Validity (Ansor: `InitThreadBind` rejects, and TVM's `VerifyGPUCode` postprocessor):
threads per block within the GPU's limit and at least a warp (unless the whole space is
small: Ansor's 2 x warp rule), vthreads within `max_vthreads`, shared memory within the
block limit, and an estimate of the registers a thread's accumulators take.
"""

from __future__ import annotations

from dataclasses import replace

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
    nest = prog.nests[block]
    if not nest.tiled or nest.attach is not None:
        raise InvalidProgram(f"{block} is not a tiled root block: nothing to stage {buffer} for")
    s_levels, r_levels = _tile_levels(prog, block, "S"), _tile_levels(prog, block, "R")
    attach_key = r_levels[0][-1]
    chain = prog.chain(block)
    pos = next(i for i, lp in enumerate(chain) if lp.key == attach_key)
    # Shared by the block's threads: the thread and vthread loops are relaxed too.
    relaxed = frozenset(s_levels[1] + s_levels[2])
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
    reader = _reading(nest.spec, buffer, name)
    blocks: list[BlockSpec] = []
    for b in prog.dag.blocks:
        if b.name == block:
            blocks.extend([stage, reader])
        else:
            blocks.append(b)
    shared = BufferSpec(name, buf.shape, buf.dtype, "intermediate", "shared")
    prog.dag = prog.dag.replace_blocks(blocks, (*prog.dag.buffers, shared))
    nest.spec = reader
    prog.emit("cache_read", block, buffer, name, tvm_position(chain, pos))
    add_root_nest(prog, stage, before=block)
    attach_region_nest(prog, name, block, attach_key, region)
    stage_nest = prog.nests[name]
    tile_elems = _product(stage_nest.loops)
    stage_nest.footprint = tile_elems
    threads = _product([lp for lp in nest.loops if lp.key in s_levels[2]])
    vectors = vector_lengths(region, buf, tile_elems, gpu)
    vec = vectors[decider.decide(f"{name}.vector", ChoiceDomain(len(vectors)))]
    _cooperative_fetch(prog, name, threads, vec)


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


def _cooperative_fetch(prog: Program, name: str, threads: int, vec: int) -> None:
    """The stage's loops fused and split into (rest, threads[, vec]); threads bound to
    threadIdx.x, the vector vectorized."""
    nest = prog.nests[name]
    own = nest.loops
    n = _product(own)
    if not own:  # one element per tile: every thread may store it
        return
    prog.emit("coop_fetch", name, len(own), threads, vec)
    rest = -(-n // (threads * vec))
    outer = prog.new_loop(rest, False)
    thread = prog.new_loop(threads, False)
    thread.kind = "threadIdx.x"
    loops = [outer, thread]
    inner = {thread.key: vec, outer.key: threads * vec}
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

MAX_TILE_DRAWS = 64
"""Draws of a block's tile sizes before the sampler gives up on the block (a level-wise
draw fails only where a fixed slot leaves no room, e.g. a mutated thread factor)."""


def draw_feasible_tiles(prog: Program, name: str, structure: str, decider: Decider, gpu: GpuLimits) -> None:
    """Draw a tiled block's tile sizes so that its kernel can launch. Ansor draws each
    split alone and rejects the program afterwards: on a 1024^3 GEMM fewer than 2% of
    such draws pass the GPU checks; drawing all splits together and rejecting left a
    third of fresh GEMM samples invalid. Here the splits are drawn one tile level at a
    time, each level conditioned on the levels and the slots already chosen
    (`_draw_levels`): threads per block in [warp, max], at most `max_vthreads` virtual
    threads, the accumulators within the registers those threads leave, then each
    reduction tile within the shared memory a block may have. The checks are those of
    `check_tiled_block` (`_tiles_fit`). Slots already given (mutation, crossover,
    records) are kept; nothing is drawn without an rng. The chosen values become given
    slots, so `_tile` takes them as it would any."""
    spec = prog.nests[name].spec
    rng = decider.rng
    slots = {it.name: f"{name}.tile.{it.name}" for it in spec.iters}
    missing = [it for it in spec.iters if slots[it.name] not in decider.given]
    if rng is None or not missing:
        return
    n_s, n_r = structure.count("S"), structure.count("R")
    domains = {it.name: TileDomain(it.extent, n_s if it.kind == "S" else n_r, MAX_INNERMOST_TILE) for it in spec.iters}
    fixed = {it.name: decider.given[slots[it.name]] for it in spec.iters if it not in missing}
    draw: dict[str, tuple[int, ...]] = {}
    for _ in range(MAX_TILE_DRAWS):
        drawn = _draw_levels(prog, spec, domains, fixed, missing, gpu, rng)
        draw = drawn if drawn is not None else {**fixed, **{it.name: domains[it.name].sample(rng) for it in missing}}
        if all(domains[k].contains(v) for k, v in draw.items()) and _tiles_fit(prog, spec, draw, gpu):
            break
    decider.given = {**decider.given, **{slots[it.name]: draw[it.name] for it in missing}}


def _draw_levels(
    prog: Program, spec: BlockSpec, domains: dict[str, TileDomain], fixed: dict[str, tuple[int, ...]],
    missing: list[IterSpec], gpu: GpuLimits, rng,
) -> dict[str, tuple[int, ...]] | None:
    """One level-wise draw of the `missing` iterators' tilings beside the `fixed` ones
    (see `draw_feasible_tiles`); None where the fixed ones leave no valid choice.

    Spatial tilings are (block, vthread, thread, inner...): the thread factors first,
    their product within [warp, max] (below a warp only for a block with little work),
    then the vthread factors (product at most `max_vthreads`), then the inner factors
    (accumulators per thread: vthread x inner over all spatial iterators, within the
    register share those threads leave), split over the inner levels with the innermost
    at most `MAX_INNERMOST_TILE`; the block level takes what is left. Reduction tilings
    are drawn from their domain among those whose shared stages still fit."""
    spatial = [it for it in spec.iters if it.kind == "S"]
    if any(domains[it.name].parts < 4 for it in spatial):
        return None  # not a GPU tiling (check_tiled_block rejects it)
    free = [it for it in spatial if it in missing]
    rest = {it.name: it.extent for it in free}
    fixed_s = [fixed[it.name] for it in spatial if it.name in fixed]
    space = _prod(it.extent for it in spatial)
    low = gpu.warp_size if space > 2 * gpu.warp_size else 1
    threads_fixed = _prod(f[2] for f in fixed_s)
    threads = _draw_factors(free, rest, rng, base=threads_fixed, low=low, high=gpu.max_threads_per_block)
    if threads is None:
        return None
    rest = {k: rest[k] // threads[k] for k in rest}
    vthreads = _draw_factors(free, rest, rng, base=_prod(f[1] for f in fixed_s), low=1, high=gpu.max_vthreads)
    if vthreads is None:
        return None
    rest = {k: rest[k] // vthreads[k] for k in rest}
    n_threads = threads_fixed * _prod(threads.values())
    budget = min(gpu.max_registers_per_thread, gpu.registers_per_block // max(n_threads, 1))
    elem_bytes = prog.dag.buffer(spec.write.buffer).elem_bytes
    max_accumulators = int(ACCUMULATOR_REGISTER_SHARE * budget) * 4 // elem_bytes
    fixed_acc = _prod(f[1] * _prod(f[3:]) for f in fixed_s) * _prod(vthreads.values())
    inner = _draw_factors(free, rest, rng, base=fixed_acc, low=1, high=max_accumulators)
    if inner is None:
        return None
    draw = dict(fixed)
    for it in free:
        n_inner = domains[it.name].parts - 3
        split = TileDomain(inner[it.name], n_inner, MAX_INNERMOST_TILE).sample(rng) if n_inner > 0 else ()
        block = rest[it.name] // inner[it.name]
        draw[it.name] = (block, vthreads[it.name], threads[it.name], *split)
    reduction = [it for it in spec.iters if it.kind != "S" and it in missing]
    rng.shuffle(reduction)
    for it in reduction:  # the others still untiled: (extent, 1, ...)
        pending = {r.name: (r.extent,) + (1,) * (domains[r.name].parts - 1) for r in reduction if r.name not in draw}
        fits = [o for o in domains[it.name].options() if _tiles_fit(prog, spec, {**pending, **draw, it.name: o}, gpu)]
        if not fits:
            return None
        draw[it.name] = rng.choice(fits)
    return draw


def _draw_factors(
    iters: list[IterSpec], extents: dict[str, int], rng, *, base: int, low: int, high: int
) -> dict[str, int] | None:
    """A divisor of each iterator's extent, drawn one iterator at a time (in random order),
    such that `base` times their product lies in [low, high]; None when none can."""
    order = list(iters)
    rng.shuffle(order)
    chosen: dict[str, int] = {}
    product = base
    for i, it in enumerate(order):
        reach = _prod(extents[o.name] for o in order[i + 1 :])  # the most the others can add
        options = [d for d in divisors(extents[it.name]) if product * d <= high and product * d * reach >= low]
        if not options:
            return None
        chosen[it.name] = rng.choice(options)
        product *= chosen[it.name]
    return chosen if low <= product <= high else None


def _prod(values) -> int:
    n = 1
    for v in values:
        n *= v
    return n


def _tiles_fit(prog: Program, spec: BlockSpec, factors: dict[str, tuple[int, ...]], gpu: GpuLimits) -> bool:
    def prod(xs) -> int:
        n = 1
        for x in xs:
            n *= x
        return n

    spatial = [it for it in spec.iters if it.kind == "S"]
    threads = prod(factors[it.name][2] for it in spatial)
    vthreads = prod(factors[it.name][1] for it in spatial)
    space = prod(it.extent for it in spatial)
    if threads > gpu.max_threads_per_block or vthreads > gpu.max_vthreads:
        return False
    if threads < gpu.warp_size and space > 2 * gpu.warp_size:
        return False
    out = prog.dag.buffer(spec.write.buffer)
    accumulators = prod(factors[it.name][1] * prod(factors[it.name][3:]) for it in spatial)
    budget = min(gpu.max_registers_per_thread, gpu.registers_per_block // max(threads, 1))
    if -(-accumulators * out.elem_bytes // 4) > ACCUMULATOR_REGISTER_SHARE * budget:
        return False
    # A block's tile of every buffer it reads, for one step of the outer reduction tile.
    span = {it.name: prod(factors[it.name][1:]) for it in spec.iters}
    shared = 0
    for buffer in dict.fromkeys(a.buffer for a in spec.reads):
        buf = prog.dag.buffer(buffer)
        if buf.scope != "global":
            continue
        elems = 1
        acc = next(a for a in spec.reads if a.buffer == buffer)
        for ix, dim in zip(acc.indices, buf.shape):
            ext = 1 + sum(abs(c) * (span.get(v, 1) - 1) for v, c in ix.terms)
            elems *= min(ext, int(dim))
        shared += elems * buf.elem_bytes
    return shared <= gpu.max_shared_memory_per_block


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


def check_program(prog: Program, gpu: GpuLimits) -> None:
    """Called when a GPU program is built: every kernel within the GPU's limits."""
    for name in prog.order:
        nest = prog.nests[name]
        if nest.attach is None and nest.tiled:
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
