"""The loop-nest model of a block computed on tensor cores (`TensorCoreStep`; the
MetaSchedule design of MultiLevelTilingTensorCore, with TVM's wmma intrinsics).

Map of this module:
  apply(prog, step, decider, gpu)     the step: tile draw, accumulator fragments, tiling
                                      over fragments, warps, shared and fragment stages
  draw_tensor_core_tiles              tile sizes (in fragments) and pipeline depth,
                                      drawn within the GPU's limits (sampling only)
  TensorCoreLimits                    those limits from the tile sizes alone
  finish / check_program              after the sketch: pipelined fragment copies, the
                                      limits on the built program (`check_tensor_core_block`)

The program TVM gets (`realize.py` replays it), for `C[b, i, j] += A[b, i, k] * B[b, k, j]`:
- `cache_write(C, "wmma.accumulator")`, then the block is blockized over 16x16x16
  fragments (i, j, k split by 16, the 16s innermost: the outer block's iterators count
  fragments);
- the outer block is tiled `SSRRSRS` over fragments: spatial level 0 fused and bound to
  blockIdx.x, level 1 to threadIdx.y (the block's warps; each warp computes its tile of
  fragments with warp-wide instructions, so its 32 lanes have no loop), levels 2 and 3
  the fragments each warp accumulates; reduction level 0 is where the operands are
  staged in shared memory, level 1 where each warp loads its fragments of them;
- the accumulators are stored to C per warp, after its tile (wmma store_matrix_sync);
- each operand: a shared stage (padded rows, `SHARED_ROW_ALIGN`, against bank
  conflicts) fetched by all warps x 32 threads (threadIdx.y, threadIdx.x, vector), then
  a wmma.matrix_a / matrix_b stage of the warp's fragments (load_matrix_sync);
- the init (fill_fragment) and the update (mma_sync) tensorized last, with the
  reduction decomposed; on sm_80+ the shared stages may be software-pipelined
  (`loopnest_gpu.finish`, slot `<block>.pipeline`), and stages beyond the static 48 KB
  are in dynamic shared memory (decided here, with the tiles: the fragment loads read
  through the scope's intrinsic).

In the model each tensorized block keeps its element-level iterators: the loops TVM
has, then one loop of kind `TENSORIZED` per fragment dimension (16 each), so the
features count the elements, bytes and strides each fragment instruction moves.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from tunefarm.gpu import GpuLimits
from tunefarm.search.space.dag import AccessSpec, Affine, BlockSpec, BufferSpec, IterSpec, OpCounts
from tunefarm.search.space.loopnest_gpu import (
    PIPELINE_DEPTHS,
    STATIC_SHARED_PREFERENCE,
    _cooperative_fetch,
    _depth_slot,
    _unroll,
    add_stage_block,
    stage_in_shared,
    vector_lengths,
)
from tunefarm.search.space.program import (
    FRAGMENT_SCOPES,
    MAX_INNERMOST_TILE,
    TENSORIZED,
    InvalidProgram,
    Loop,
    Program,
    add_root_nest,
    attach_region_nest,
    region_elems,
    touched_region,
    tvm_position,
)
from tunefarm.search.space.sketch import TensorCoreStep, apply_cache_write, cache_write_names
from tunefarm.search.space.slots import ChoiceDomain, Decider, TileDomain
from tunefarm.search.space.tensor_core import FRAGMENT, TensorCoreForm, tensor_core_form

TC_TILE_STRUCTURE = "SSRRSRS"
"""Spatial levels: blocks, warps, then two levels of each warp's fragments; reduction
levels: shared stage, fragment stage, innermost."""

FRAGMENT_REGISTERS = 8
"""32-bit registers one 16x16 fragment takes in each thread of its warp (an
accumulator's 256 float32s over 32 lanes; float16 operand fragments as many on
sm_70+, whose wmma fragments hold 16 halves a thread)."""

FRAGMENT_REGISTER_SHARE = 0.75
"""Share of a thread's registers its fragments may take (the rest: addresses, loop
counters). An estimate: ptxas decides."""

SHARED_ROW_ALIGN = (32, 8)
"""(factor, offset): a shared stage's rows are padded to a length = offset (mod factor)
elements (TVM's storage_align, MetaSchedule's choice for float16 tensor-core operands):
a fragment load reads 16 rows at once, which a row length of a multiple of 64 bytes
puts in the same banks."""

PIPELINED_FRAGMENT_COPIES = 2
"""Copies of each operand fragment of a software-pipelined tensor-core block (at any
depth d > 1) whose pipelined loop runs at least d times: TVM's InjectSoftwarePipeline
versions the fragment buffers of the loop's steady state (found on the lowered kernels;
a shorter loop is all prologue and epilogue, one copy). `finish_tensor_core_block`."""

DRAW_TRIES = 64
"""Random tilings tried per level before a tile draw gives up (`_draw`)."""


def apply(prog: Program, step: TensorCoreStep, decider: Decider, gpu: GpuLimits) -> None:
    name = step.block
    nest = prog.nests[name]
    form = tensor_core_form(prog.dag, nest.spec, gpu)
    if form is None or nest.attach is not None or nest.tiled:
        raise InvalidProgram(f"{name}: not a root block in tensor-core form on {gpu.arch}")
    limits = TensorCoreLimits.of(prog, form, nest.spec, gpu)
    draw_tensor_core_tiles(prog, name, form, limits, decider)
    factors = {
        it.name: decider.decide(f"{name}.tile.{it.name}", _domain(it, form)) for it in nest.spec.iters
    }
    depth = prog.nests[name].pipeline
    dynamic = gpu.async_copy and limits.shared_bytes(_spans(factors, form), depth) > gpu.static_shared_memory_per_block
    copy_name = _accumulator_cache(prog, name)
    _blockize_and_tile(prog, name, form, factors)
    _store_accumulators(prog, name, copy_name, form)
    warps = prog.nests[name].threads // gpu.warp_size
    scope = "shared.dyn" if dynamic else "shared"
    for operand, buffer in (("a", form.a), ("b", form.b)):
        stage = _shared_operand(prog, name, buffer, warps, dynamic, decider, gpu)
        _fragment_operand(prog, name, stage, operand, form.load_intrinsic(operand, scope), scope)
    prog.nests[name].tensor_core = form
    _unroll(prog, name, decider)


# ------------------------------------------------------------------------------ tiling


def _domain(it: IterSpec, form: TensorCoreForm) -> TileDomain:
    unit = FRAGMENT if it.name in form.fragment_iters else 1
    parts = TC_TILE_STRUCTURE.count(it.kind)
    return TileDomain(it.extent // unit, parts, MAX_INNERMOST_TILE)


def _spans(factors: dict[str, tuple[int, ...]], form: TensorCoreForm) -> dict[str, int]:
    """Elements of each iterator one block's shared stages cover: the spatial levels
    inside the block level, the reduction levels inside the outermost."""
    out = {}
    for it, f in factors.items():
        unit = FRAGMENT if it in form.fragment_iters else 1
        out[it] = unit * math.prod(f[1:])
    return out


@dataclass(frozen=True)
class TensorCoreLimits:
    """`check_tensor_core_block`'s limits on the tile sizes alone (in fragments)."""

    gpu: GpuLimits
    form: TensorCoreForm
    extents: dict[str, int]  # elements per iterator
    operand_dims: tuple[tuple[tuple[str, ...], int], ...]  # per operand: the iterators of its dims, elem bytes

    @staticmethod
    def of(prog: Program, form: TensorCoreForm, spec: BlockSpec, gpu: GpuLimits) -> TensorCoreLimits:
        dims = []
        for buffer in (form.a, form.b):
            acc = next(a for a in spec.reads if a.buffer == buffer)
            dims.append((tuple(ix.is_single_var() or "" for ix in acc.indices), prog.dag.buffer(buffer).elem_bytes))
        return TensorCoreLimits(gpu, form, {it.name: it.extent for it in spec.iters}, tuple(dims))

    def warps(self, factors: dict[str, tuple[int, ...]]) -> int:
        return math.prod(f[1] for it, f in factors.items() if it != self.form.k)

    def fragments(self, factors: dict[str, tuple[int, ...]], depth: int) -> int:
        """Fragments one warp holds: accumulators, and the operands of one fragment-stage
        step (twice over in a pipelined block)."""
        f = self.form
        warp = {it: math.prod(v[2:]) for it, v in factors.items() if it != f.k}
        batch = math.prod(warp[b] for b in f.batch)
        k_inner = factors[f.k][2]
        copies = PIPELINED_FRAGMENT_COPIES if depth > 1 else 1
        return batch * (warp[f.i] * warp[f.j] + copies * (warp[f.i] + warp[f.j]) * k_inner)

    def shared_bytes(self, spans: dict[str, int], depth: int) -> int:
        """Shared memory of both operand stages (padded rows), `depth` copies each."""
        total = 0
        for names, elem in self.operand_dims:
            rows = math.prod(spans[n] for n in names[:-1])
            total += rows * padded_row(spans[names[-1]]) * elem
        return depth * total

    def problems(self, factors: dict[str, tuple[int, ...]], depth: int, shared_limit: int | None = None) -> list[str]:
        """What breaks the GPU's limits (nothing: [])."""
        gpu = self.gpu
        out = []
        threads = self.warps(factors) * gpu.warp_size
        if threads > gpu.max_threads_per_block:
            out.append(f"{threads} threads per block (the GPU allows {gpu.max_threads_per_block})")
        registers = FRAGMENT_REGISTERS * self.fragments(factors, depth)
        budget = min(gpu.max_registers_per_thread, gpu.registers_per_block // max(threads, 1))
        if registers > FRAGMENT_REGISTER_SHARE * budget:
            out.append(f"{registers} fragment registers per thread (budget {budget} with {threads} threads)")
        shared = self.shared_bytes(_spans(factors, self.form), depth)
        limit = gpu.max_shared_memory_per_block if shared_limit is None else shared_limit
        if shared > limit:
            out.append(f"{shared} bytes of shared memory per block (the GPU allows {limit})")
        return out


def padded_row(length: int) -> int:
    """A shared stage row of `length` elements, padded (`SHARED_ROW_ALIGN`)."""
    factor, offset = SHARED_ROW_ALIGN
    return length + (offset - length) % factor


def draw_tensor_core_tiles(prog: Program, name: str, form: TensorCoreForm, limits: TensorCoreLimits, decider: Decider) -> None:
    """The block's pipeline depth (sm_80+, slot `<block>.pipeline`) and tile sizes, so
    that its kernel launches: given slots are kept (refit where the decider refits), the
    others drawn (only with an rng: a measured program rebuilds from its decisions).
    Each missing tiling is drawn uniformly among those that fit beside the ones drawn
    before it (`DRAW_TRIES` random picks, then every option checked), the depth first,
    most draws within the static shared memory (`STATIC_SHARED_PREFERENCE`).
    InvalidProgram where no tiling fits beside the given slots."""
    spec = prog.nests[name].spec
    gpu = limits.gpu
    rng = decider.rng
    if gpu.async_copy:
        index = decider.decide(_depth_slot(name), ChoiceDomain(len(PIPELINE_DEPTHS)), default=0)
        prog.nests[name].pipeline = PIPELINE_DEPTHS[index]
    depth = prog.nests[name].pipeline
    if rng is None:
        return
    domains = {it.name: _domain(it, form) for it in spec.iters}
    fixed: dict[str, tuple[int, ...]] = {}
    for it in spec.iters:
        value = decider.given.get(f"{name}.tile.{it.name}")
        domain = domains[it.name]
        if value is not None and not domain.contains(value) and decider.refit:
            value = domain.nearest(value)
        if value is not None and domain.contains(value):
            fixed[it.name] = value
    if len(fixed) == len(domains):
        return
    drawn = None
    static = gpu.static_shared_memory_per_block
    if static < gpu.max_shared_memory_per_block and rng.random() < STATIC_SHARED_PREFERENCE:
        drawn = _draw(limits, domains, fixed, depth, rng, static)
    if drawn is None:
        drawn = _draw(limits, domains, fixed, depth, rng, None)
    if drawn is None:
        raise InvalidProgram(f"{name}: no tensor-core tiling fits the GPU's limits beside {fixed or 'nothing'}")
    decider.given = {**decider.given, **{f"{name}.tile.{it}": v for it, v in drawn.items()}}


def _draw(limits: TensorCoreLimits, domains: dict[str, TileDomain], fixed: dict, depth: int, rng: random.Random,
          shared_limit: int | None) -> dict[str, tuple[int, ...]] | None:  # fmt: skip
    """The free tilings, one iterator at a time (random order), each uniform over the
    options that fit with the iterators still free untiled (all in the outermost level:
    every limit only grows with the inner levels, so a fit stays possible)."""
    free = [n for n in domains if n not in fixed]
    rng.shuffle(free)
    chosen = dict(fixed)
    for n in free:
        chosen[n] = (domains[n].extent,) + (1,) * (domains[n].parts - 1)
    for n in free:
        options = domains[n].options()

        def fits(option, n=n):
            return not limits.problems({**chosen, n: option}, depth, shared_limit)

        pick = None
        for _ in range(DRAW_TRIES):
            option = options[rng.randrange(len(options))]
            if fits(option):
                pick = option
                break
        if pick is None:
            fitting = [o for o in options if fits(o)]
            if not fitting:
                return None
            pick = rng.choice(fitting)
        chosen[n] = pick
    return {n: chosen[n] for n in free}


def finish(prog: Program) -> None:
    """Called after `loopnest_gpu.finish` (the software pipelines): each tensor-core block's
    `finish_tensor_core_block`."""
    for name in prog.order:
        if prog.nests[name].tensor_core is not None:
            finish_tensor_core_block(prog, name)


def check_program(prog: Program, gpu: GpuLimits) -> None:
    """Called when a GPU program is built: every tensor-core kernel within the GPU's limits."""
    for name in prog.order:
        if prog.nests[name].tensor_core is not None:
            check_tensor_core_block(prog, name, gpu)


def finish_tensor_core_block(prog: Program, name: str) -> None:
    """After its software pipeline (`loopnest_gpu.finish`): a pipelined block's operand
    fragments in `PIPELINED_FRAGMENT_COPIES` copies (see there)."""
    nest = prog.nests[name]
    r0 = next(g for g, ch in zip(nest.tile_groups, nest.tile_structure) if ch == "R")
    pipelined = next(lp for lp in nest.loops if lp.key == r0[0])
    if nest.pipeline <= 1 or pipelined.extent < nest.pipeline:
        return
    for n in prog.order:
        scope = prog.dag.buffer(prog.nests[n].spec.write.buffer).scope
        if prog.root_of(n) == name and scope in ("wmma.matrix_a", "wmma.matrix_b"):
            prog.nests[n].footprint *= PIPELINED_FRAGMENT_COPIES


def check_tensor_core_block(prog: Program, name: str, gpu: GpuLimits) -> None:
    """Reject a tensor-core kernel that cannot launch or would spill (InvalidProgram)."""
    nest = prog.nests[name]
    threads = nest.threads
    if threads > gpu.max_threads_per_block:
        raise InvalidProgram(f"{name}: {threads} threads per block (the GPU allows {gpu.max_threads_per_block})")
    shared = prog.kernel_bytes(name, "shared")
    if shared > gpu.max_shared_memory_per_block:
        raise InvalidProgram(
            f"{name}: {shared} bytes of shared memory per block (the GPU allows {gpu.max_shared_memory_per_block})"
        )
    registers = FRAGMENT_REGISTERS * _fragment_count(prog, name)
    budget = min(gpu.max_registers_per_thread, gpu.registers_per_block // max(threads, 1))
    if registers > FRAGMENT_REGISTER_SHARE * budget:
        raise InvalidProgram(f"{name}: {registers} fragment registers per thread (budget {budget} with {threads} threads)")


def _fragment_count(prog: Program, root: str) -> int:
    """16x16 fragments one warp of the kernel holds (each scope's region, in fragments)."""
    total = 0
    for n in prog.order:
        if prog.root_of(n) != root:
            continue
        buf = prog.dag.buffer(prog.nests[n].spec.write.buffer)
        if buf.scope in FRAGMENT_SCOPES:
            total += region_elems(prog, n) // (FRAGMENT * FRAGMENT)
    return total


# ---------------------------------------------------------------------------- the nests


def _accumulator_cache(prog: Program, name: str) -> str:
    """cache_write into wmma.accumulator: the block writes the fragments, a new root
    block copies them out (placed under the warps by `_store_accumulators`)."""
    copy_name, _ = cache_write_names(prog.dag, name, "wmma.accumulator")
    prog.emit("cache_write", name, copy_name, "wmma.accumulator")
    prog.dag = apply_cache_write(prog.dag, name, "wmma.accumulator")
    for b in prog.dag.blocks:
        if b.name in prog.nests:
            prog.nests[b.name].spec = b
    add_root_nest(prog, prog.dag.block(copy_name), after=name)
    return copy_name


def _blockize_and_tile(prog: Program, name: str, form: TensorCoreForm, factors: dict[str, tuple[int, ...]]) -> None:
    nest = prog.nests[name]
    spec = nest.spec
    positions = [i for i, it in enumerate(spec.iters) if it.name in form.fragment_iters]
    prog.emit("tc_blockize", name, tuple(positions))
    prog.emit("tile", name, TC_TILE_STRUCTURE, tuple(tuple(factors[it.name]) for it in spec.iters), -1)
    level = {"S": 0, "R": 0}
    groups: list[list[str]] = []
    loops: list[Loop] = []
    by_iter: dict[str, list[Loop]] = {it.name: [] for it in spec.iters}
    for ch in TC_TILE_STRUCTURE:
        lv = level[ch]
        level[ch] += 1
        group = []
        for it in spec.iters:
            if it.kind != ch:
                continue
            lp = prog.new_loop(factors[it.name][lv], ch == "R")
            by_iter[it.name].append(lp)
            group.append(lp.key)
            loops.append(lp)
        groups.append(group)
    inner: dict[str, Loop] = {}
    for n in form.fragment_iters:
        lp = prog.new_loop(FRAGMENT, n == form.k)
        lp.kind = TENSORIZED
        inner[n] = lp
        loops.append(lp)
    binding = {}
    for it in spec.iters:
        stride = FRAGMENT if it.name in inner else 1
        terms = {}
        for lp in reversed(by_iter[it.name]):
            terms[lp.key] = stride
            stride *= lp.extent
        if it.name in inner:
            terms[inner[it.name].key] = 1
        binding[it.name] = Affine.of(terms)
    for key in groups[0]:
        next(lp for lp in loops if lp.key == key).kind = "blockIdx.x"
    for key in groups[1]:
        next(lp for lp in loops if lp.key == key).kind = "threadIdx.y"
    nest.loops = loops
    nest.binding = binding
    nest.tiled = True
    nest.tile_groups = groups
    nest.tile_structure = TC_TILE_STRUCTURE
    warps = math.prod(factors[it.name][1] for it in spec.iters if it.kind == "S")
    nest.threads = warps * 32
    # accumulators of one warp: its spatial tile below the warp level, in elements
    nest.footprint = math.prod(
        (FRAGMENT if it.name in inner else 1) * math.prod(factors[it.name][2:]) for it in spec.iters if it.kind == "S"
    )
    prog.emit("bind_warps", name, len(groups[0]), len(groups[1]))


def _split_fragments(prog: Program, name: str) -> None:
    """A fragment stage's two innermost loops (the matrix dimensions, multiples of 16)
    split into (fragments, 16): [.., rows/16, cols/16, 16, 16], the 16s tensorized."""
    nest = prog.nests[name]
    *rest, rows, cols = nest.loops
    outer = [prog.new_loop(lp.extent // FRAGMENT, lp.reduce) for lp in (rows, cols)]
    inner = [prog.new_loop(FRAGMENT, lp.reduce) for lp in (rows, cols)]
    for lp in inner:
        lp.kind = TENSORIZED
    env = {
        rows.key: Affine.of({outer[0].key: FRAGMENT, inner[0].key: 1}),
        cols.key: Affine.of({outer[1].key: FRAGMENT, inner[1].key: 1}),
    }
    nest.binding = {it: aff.substitute(env) for it, aff in nest.binding.items()}
    nest.loops = [*rest, *outer, *inner]


def _store_accumulators(prog: Program, name: str, copy_name: str, form: TensorCoreForm) -> None:
    """The copy of the accumulators to the output, computed after each warp's tile."""
    nest = prog.nests[name]
    warp_key = nest.tile_groups[1][-1]
    chain = prog.chain(name)
    pos = next(i for i, lp in enumerate(chain) if lp.key == warp_key)
    out = prog.dag.buffer(nest.spec.write.buffer)
    region = touched_region(prog, [ix.substitute(nest.binding) for ix in nest.spec.write.indices], chain, pos, out.shape)
    attach_region_nest(prog, copy_name, name, warp_key, region)
    prog.emit("reverse_compute_at", copy_name, name, tvm_position(chain, pos))
    _split_fragments(prog, copy_name)
    prog.emit("tc_copy", copy_name, form.store_intrinsic)


def _shared_operand(
    prog: Program, name: str, buffer: str, warps: int, dynamic: bool, decider: Decider, gpu: GpuLimits
) -> str:
    """The operand staged in shared memory at the outermost reduction tile, shared by
    every warp, its rows padded, fetched by warps x 32 threads."""
    nest = prog.nests[name]
    stage, region = stage_in_shared(prog, name, buffer, frozenset(nest.tile_groups[1]))
    if dynamic:
        prog.emit("dynamic_shared", stage)
    factor, offset = SHARED_ROW_ALIGN
    prog.emit("align_rows", stage, factor, offset)
    stage_nest = prog.nests[stage]
    extents = [ext for _, ext in region]
    stage_nest.footprint = math.prod(extents[:-1]) * padded_row(extents[-1])
    vectors = vector_lengths(region, prog.dag.buffer(buffer), math.prod(extents), gpu)
    vec = vectors[decider.decide(f"{stage}.vector", ChoiceDomain(len(vectors)))]
    _cooperative_fetch(prog, stage, gpu.warp_size, vec, warps=warps)
    return stage


def _fragment_operand(prog: Program, name: str, shared: str, operand: str, intrinsic: str, shared_scope: str) -> None:
    """The warp's fragments of a shared operand, loaded at the fragment-stage tile (TVM
    names the stage's buffer `<name>_shared.dyn` once it is in dynamic shared memory)."""
    nest = prog.nests[name]
    r_groups = [g for g, ch in zip(nest.tile_groups, nest.tile_structure) if ch == "R"]
    key = r_groups[1][-1]
    chain = prog.chain(name)
    pos = next(i for i, lp in enumerate(chain) if lp.key == key)
    buf = prog.dag.buffer(shared)
    scope = f"wmma.matrix_{operand}"
    frag = f"{shared}_{scope}"
    iters = tuple(IterSpec(f"v{d}", int(e), "S") for d, e in enumerate(buf.shape))
    index = tuple(Affine.of({it.name: 1}) for it in iters)
    stage = BlockSpec(name=frag, iters=iters, reads=(AccessSpec(shared, index),), write=AccessSpec(frag, index), ops=OpCounts())
    acc = next(a for a in nest.spec.reads if a.buffer == shared)
    region = touched_region(prog, [ix.substitute(nest.binding) for ix in acc.indices], chain, pos, buf.shape)
    add_stage_block(prog, name, stage, BufferSpec(frag, buf.shape, buf.dtype, "intermediate", scope), shared)
    tvm_buffer = shared if shared_scope == "shared" else f"{shared}_{shared_scope}"
    prog.emit("tc_fragment", name, tvm_buffer, frag, tvm_position(chain, pos), scope, intrinsic)
    add_root_nest(prog, stage, before=name)
    attach_region_nest(prog, frag, name, key, region)
    prog.nests[frag].footprint = math.prod(ext for _, ext in region)
    _split_fragments(prog, frag)
