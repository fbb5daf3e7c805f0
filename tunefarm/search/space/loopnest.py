"""The loop-nest model: a sketch plus decisions, applied without TVM.

Map of this module (the `Program` it builds is `program.py`'s; GPU steps are
`loopnest_gpu`'s):
  build(dag, sketch, decider, num_cores) -> Program    apply every step, filling slots
  _tile / _fuse_consumer / _compute_location / ...     one function per sketch step
  annotate, parallel_range                            vectorize, parallelize, unroll

Why a model: the evolutionary search scores thousands of programs per round, and
replaying a schedule in TVM costs ~5 ms each on this machine, so the search works on
this model (tens of microseconds) and only the programs picked for measurement are
realized in TVM (`realize.py`). Both follow the same steps in the same order, and a
test checks that the model's loops match TVM's on random programs.

Semantics mirrored from TVM's schedule primitives:
- split loops keep extent-1 parts; `compute_at` / `reverse_compute_at` create one loop
  per block iterator whose region extent is > 1, in iterator order;
- `decompose_reduction` at the first reduction loop copies the spatial loops inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tunefarm.gpu import GpuLimits
from tunefarm.search.space import loopnest_gpu, loopnest_tensor_core
from tunefarm.search.space.annotate import annotate
from tunefarm.search.space.dag import (
    AccessSpec,
    Affine,
    BufferSpec,
    ComputeDag,
    inline_into_consumers,
    is_elementwise_write,
)
from tunefarm.search.space.program import (
    MAX_INNERMOST_TILE,
    InvalidProgram,
    Loop,
    Nest,
    Program,
    add_root_nest,
    attach_region_nest,
    touched_region,
    tvm_position,
    union_region,
)
from tunefarm.search.space.rfactor import rfactor
from tunefarm.search.space.sketch import (
    FUSE_LEVELS,
    AnnotateStep,
    CacheReadStep,
    CacheWriteStep,
    ComputeLocationStep,
    CrossThreadReductionStep,
    FuseConsumerStep,
    InlineStep,
    LayoutRewriteStep,
    RfactorStep,
    Sketch,
    TensorCoreStep,
    ThreadBindStep,
    TileStep,
    UnrollTableStep,
    apply_cache_write,
    cache_write_names,
    describe_step,
)
from tunefarm.search.space.slots import ChoiceDomain, Decider, TileDomain

# ------------------------------------------------------------------------------ build


def build(
    dag: ComputeDag,
    sketch: Sketch,
    decider: Decider,
    num_cores: int,
    gpu: GpuLimits | None = None,
    vector_bytes: int = 0,
    vector_registers: int = 0,
) -> Program:
    """Apply a sketch's steps in order; slots are filled by `decider`. `gpu`: the
    limits of the GPU a GPU sketch is built for (its steps are `loopnest_gpu`'s).
    `vector_bytes`, `vector_registers`: the CPU's vector register width and count
    (0: unknown), see `_tile`."""
    fused = frozenset(s.producer for s in sketch.steps if isinstance(s, FuseConsumerStep))
    prog = Program(dag, {}, [], fused_producers=fused, gpu=gpu is not None)
    for b in dag.blocks:
        add_root_nest(prog, b)
    for step in sketch.steps:
        match step:
            case InlineStep(block=b):
                _inline(prog, b)
            case CacheWriteStep(block=b, scope=scope):
                _cache_write(prog, b, scope)
            case RfactorStep(block=b, inner=inner):
                rfactor(prog, b, inner, decider)
            case TileStep(block=b, structure=s):
                if gpu is not None:
                    loopnest_gpu.draw_feasible_tiles(prog, b, s, decider, gpu)
                registers = VectorRegisters(vector_bytes, vector_registers) if gpu is None else VectorRegisters()
                _tile(prog, b, s, decider, choose_inner_axis=gpu is None, registers=registers)
            case UnrollTableStep(block=b):
                _unroll_tables(prog, b, decider, VectorRegisters(vector_bytes, vector_registers))
            case LayoutRewriteStep(block=b, buffer=buf):
                _layout_rewrite(prog, b, buf)
            case FuseConsumerStep(consumer=c, producer=p, level=level):
                _fuse_consumer(prog, c, p, decider, level)
            case ComputeLocationStep(block=b):
                if b in prog.nests:
                    _compute_location(prog, b, decider)
            case AnnotateStep(block=b):
                if b in prog.nests:  # gone when a location decision inlined it
                    annotate(prog, b, decider, num_cores)
            case TensorCoreStep():
                if gpu is None:
                    raise InvalidProgram(f"{describe_step(step)}: a GPU step, and no GPU to build for")
                loopnest_tensor_core.apply(prog, step, decider, gpu)
            case CacheReadStep() | CrossThreadReductionStep() | ThreadBindStep():
                if gpu is None:
                    raise InvalidProgram(f"{describe_step(step)}: a GPU step, and no GPU to build for")
                loopnest_gpu.apply(prog, step, decider, gpu)
            case _:
                raise TypeError(step)
    if gpu is not None:
        loopnest_gpu.finish(prog, gpu)
        loopnest_tensor_core.finish(prog)
        loopnest_gpu.check_program(prog, gpu)
        loopnest_tensor_core.check_program(prog, gpu)
    _decompose_reductions(prog)
    return prog


def _decompose_reductions(prog: Program) -> None:
    """Split every reduction's init off at its first reduction loop. Last, after all
    parallel annotations: TVM will not parallelize a loop over a decomposed reduction."""
    for name in prog.order:
        nest = prog.nests[name]
        if nest.spec.has_init and not nest.cross_thread:
            nest.init_at = next((i for i, lp in enumerate(nest.loops) if lp.reduce), None)
            if nest.init_at is None:
                continue
            if nest.tensor_core is not None:  # TVM's loop position; the init and update tensorized
                form = nest.tensor_core
                pos = tvm_position(nest.loops, nest.init_at)
                prog.emit("tc_decompose", name, pos, form.fill_intrinsic, form.sync_intrinsic)
            else:
                prog.emit("decompose", name, -(len(nest.loops) - nest.init_at))


def _refresh_specs(prog: Program) -> None:
    for b in prog.dag.blocks:
        if b.name in prog.nests:
            prog.nests[b.name].spec = b


def _inline(prog: Program, name: str) -> None:
    if prog.dag.is_output(name) or prog.nests[name].spec.is_reduction:
        raise InvalidProgram(f"{name} cannot be inlined")
    prog.emit("inline", name)
    prog.dag = inline_into_consumers(prog.dag, name)
    del prog.nests[name]
    prog.order.remove(name)
    _refresh_specs(prog)


def _cache_write(prog: Program, name: str, scope: str) -> None:
    copy_name, _ = cache_write_names(prog.dag, name, scope)
    prog.emit("cache_write", name, copy_name, scope)
    prog.dag = apply_cache_write(prog.dag, name, scope)
    _refresh_specs(prog)
    add_root_nest(prog, prog.dag.block(copy_name), after=name)


@dataclass(frozen=True)
class VectorRegisters:
    """The CPU's float vector registers: width in bytes and count (0: unknown)."""

    bytes: int = 0
    count: int = 0


def _tile(
    prog: Program, name: str, structure: str, decider: Decider, choose_inner_axis: bool = True,
    registers: VectorRegisters = VectorRegisters(),
) -> None:
    """Multi-level tiling. The spatial iterator whose innermost tile becomes the
    innermost loop (the one `annotate` vectorizes) draws its factors with a preference
    for whole vectors when the target's vector width is known (`TileDomain.vector_lanes`):
    uniform draws rarely give an extent like 80 a 16-wide inner tile (3 tilings in 140),
    and a 10-wide one, which the search had settled on in a YOLO-like model, ran an
    80-channel convolution 1.5x slower than the 16-wide tile.

    The innermost spatial tiles are the register tile: inside the last reduction loop,
    each of their points is an accumulator that LLVM keeps in a vector register across
    that loop. When the register count is known, new draws keep the accumulators, the
    vectors of the other operand and a broadcast within the registers (`_register_limits`):
    a GEMM tile of 8 rows x 64 columns (32 zmm accumulators + 4 + 1 on AVX-512's 32) made
    LLVM spill and rotate registers through every iteration. Given decisions (a program
    already measured, rebuilt without a random source) are taken as they are."""
    nest = prog.nests[name]
    if nest.attach is not None or nest.tiled:
        raise InvalidProgram(f"{name} cannot be tiled here")
    spec = nest.spec
    n_s, n_r = structure.count("S"), structure.count("R")
    inner = _inner_axis(prog, name, decider) if choose_inner_axis else None
    spatial = [it.name for it in spec.iters if it.kind == "S"]
    vector_axis = inner or (spatial[-1] if spatial else None)
    lanes = registers.bytes // prog.dag.buffer(spec.write.buffer).elem_bytes if registers.bytes else 0
    limit_registers = lanes > 1 and registers.count > 0 and decider.rng is not None
    # the vector axis first: its vectors bound how many points the other axes may add
    order = sorted(spec.iters, key=lambda it: it.name != vector_axis)
    factors: dict[str, tuple[int, ...]] = {}
    accumulators = 0  # the register budget's points left for the spatial axes still to draw
    for it in order:
        parts = n_s if it.kind == "S" else n_r
        max_inner = MAX_INNERMOST_TILE
        if limit_registers and it.kind == "S":
            if it.name == vector_axis:
                max_inner = min(max_inner, lanes * ((registers.count - 1) // 2))
            else:
                max_inner = max(1, min(max_inner, accumulators))
        domain = TileDomain(it.extent, parts, max_inner, vector_lanes=lanes if it.name == vector_axis else 0)
        factors[it.name] = decider.decide(f"{name}.tile.{it.name}", domain)
        if limit_registers and it.kind == "S":
            if it.name == vector_axis:
                vectors = -(-factors[it.name][-1] // lanes)
                accumulators = (registers.count - vectors - 1) // vectors
            else:
                accumulators //= factors[it.name][-1]
    inner_pos = next((i for i, it in enumerate(spec.iters) if it.name == inner), -1)
    prog.emit("tile", name, structure, tuple(factors[it.name] for it in spec.iters), inner_pos)
    last_order = [it for it in spec.iters if it.name != inner] + [it for it in spec.iters if it.name == inner]
    loops: list[Loop] = []
    groups: list[list[str]] = []
    terms: dict[str, dict[str, int]] = {it.name: {} for it in spec.iters}
    level = {"S": 0, "R": 0}
    for ch in structure:
        lv = level[ch]
        level[ch] += 1
        group = []
        last_s = ch == "S" and lv == n_s - 1
        for it in last_order if last_s else spec.iters:
            if it.kind != ch:
                continue
            f = factors[it.name]
            stride = 1
            for x in f[lv + 1 :]:
                stride *= x
            lp = prog.new_loop(f[lv], ch == "R")
            loops.append(lp)
            group.append(lp.key)
            terms[it.name][lp.key] = stride
        groups.append(group)
    nest.loops = loops
    nest.binding = {it: Affine.of(t) for it, t in terms.items()}
    nest.tiled = True
    nest.tile_groups = groups
    nest.tile_structure = structure
    nest.inner_axis = inner


def _unroll_tables(prog: Program, name: str, decider: Decider, registers: VectorRegisters) -> None:
    """`UnrollTableStep`: every iterator that picks no table entry (all spatial) split in
    two (slot `<block>.tile.<iter>`); loops: the outer parts, the inner parts, the table
    iterators (unrolled, in iterator order: a reduction's spatial ones first), and last
    the inner part of the last other iterator, which `annotate` vectorizes (its draws
    prefer whole vectors, as `_tile`'s vector axis does)."""
    nest = prog.nests[name]
    if nest.attach is not None or nest.tiled:
        raise InvalidProgram(f"{name} cannot be unrolled here")
    spec = nest.spec
    other = spec.untabled
    vector_axis = other[-1].name
    lanes = registers.bytes // prog.dag.buffer(spec.write.buffer).elem_bytes if registers.bytes else 0
    factors: dict[str, tuple[int, ...]] = {}
    for it in other:
        domain = TileDomain(it.extent, 2, MAX_INNERMOST_TILE, vector_lanes=lanes if it.name == vector_axis else 0)
        factors[it.name] = decider.decide(f"{name}.tile.{it.name}", domain)
    vector_pos = next(i for i, it in enumerate(spec.iters) if it.name == vector_axis)
    prog.emit("unroll_tables", name, tuple(factors.get(it.name, ()) for it in spec.iters), vector_pos)
    outer = {it.name: prog.new_loop(factors[it.name][0], False) for it in other}
    inner = {it.name: prog.new_loop(factors[it.name][1], False) for it in other}
    table = {}
    for it in spec.iters:
        if it.name in spec.table_iters:
            table[it.name] = prog.new_loop(it.extent, it.kind == "R")
            table[it.name].kind = "unrolled"
    nest.loops = [
        *outer.values(),
        *(lp for it, lp in inner.items() if it != vector_axis),
        *table.values(),
        inner[vector_axis],
    ]
    binding = {it: Affine.var(lp.key) for it, lp in table.items()}
    for it in other:
        binding[it.name] = Affine.of({outer[it.name].key: factors[it.name][1], inner[it.name].key: 1})
    nest.binding = binding
    nest.tiled = True


def _inner_axis(prog: Program, name: str, decider: Decider) -> str | None:
    """Which spatial iterator the innermost tile level puts last, so that it is the one
    vectorized (slot `<block>.inner_axis`; 0 keeps the iterator order). Offered to a block
    whose consumer joins its tile: its output tile is then a compact buffer that takes the
    same order (`_acc_layout`), so the vector accumulators stay contiguous. E.g. the
    output channels of an NCHW convolution, whose weights the layout rewrite then packs
    with those channels innermost."""
    if name not in prog.fused_producers:
        return None
    spatial = [it.name for it in prog.nests[name].spec.spatial if it.extent > 1]
    if len(spatial) < 2:
        return None
    choice = decider.decide(f"{name}.inner_axis", ChoiceDomain(len(spatial)), default=0)
    return spatial[-1 - choice] if choice else None


def _tile_order_dims(nest: Nest, indices: tuple[Affine, ...], shape) -> tuple[list[tuple[int, int, int, int]], list[Loop]]:
    """A buffer dimension per tile loop (extent > 1) of the iterators that index it
    (`indices`, one iterator each), outermost first: [(buffer dim, stride, extent,
    dim extent)] (new index = (old index // stride) % extent), and those loops."""
    dim_of = {ix.is_single_var(): d for d, ix in enumerate(indices) if ix.is_single_var() is not None}
    owner: dict[str, tuple[str, int]] = {}  # loop key -> (iterator, stride)
    for it in nest.spec.iters:
        for key, stride in nest.binding[it.name].terms:
            owner[key] = (it.name, stride)
    dims: list[tuple[int, int, int, int]] = []
    loops: list[Loop] = []
    for lp in nest.loops:
        it, stride = owner.get(lp.key, (None, 0))
        if it in dim_of and lp.extent > 1:
            d = dim_of[it]
            dims.append((d, stride, lp.extent, int(shape[d])))
            loops.append(lp)
    return dims, loops


def _layout_rewrite(prog: Program, name: str, buffer: str) -> None:
    """The constant `buffer` stored in the order of `name`'s tile loops: one dimension
    per loop (extent > 1) of the iterators that index it, outermost first. The block then
    reads it at exactly its loop variables; the copy happens outside the kernel, so the
    model has no block for it. Emits, per new dimension, (buffer dimension, stride,
    extent): new index = (old index // stride) % extent."""
    nest = prog.nests[name]
    if not nest.tiled:
        raise InvalidProgram(f"{name} is not tiled: no layout to follow")
    spec = nest.spec
    acc = next(a for a in spec.reads if a.buffer == buffer)
    buf = prog.dag.buffer(buffer)
    dims, loops = _tile_order_dims(nest, acc.indices, buf.shape)
    if not dims:
        return
    prog.emit("layout_rewrite", name, buffer, tuple(dims))
    packed = BufferSpec(f"{buffer}@layout", tuple(lp.extent for lp in loops), buf.dtype, "constant")
    new_acc = AccessSpec(packed.name, tuple(Affine.var(lp.key) for lp in loops))
    new_spec = replace(spec, reads=tuple(new_acc if a.buffer == buffer else a for a in spec.reads))
    blocks = [new_spec if b.name == name else b for b in prog.dag.blocks]
    prog.dag = prog.dag.replace_blocks(blocks, (*prog.dag.buffers, packed))
    nest.spec = new_spec


def _owner_of(prog: Program, loop_key: str) -> str:
    for n, nest in prog.nests.items():
        if any(lp.key == loop_key for lp in nest.loops):
            return n
    raise KeyError(loop_key)


def _fuse_consumer(prog: Program, consumer: str, producer: str, decider: Decider, level: int | None) -> None:
    p = prog.nests[producer]
    c = prog.nests[consumer]
    if not p.tiled or c.attach is not None:
        raise InvalidProgram(f"cannot fuse {consumer} into {producer}")
    s_groups = [g for g, ch in zip(p.tile_groups, p.tile_structure) if ch == "S"]
    if level is None:
        level = FUSE_LEVELS[decider.decide(f"{consumer}.fuse_level", ChoiceDomain(len(FUSE_LEVELS)))]
    attach_key = s_groups[level - 1][-1]
    chain = prog.chain(producer)
    pos = next(i for i, lp in enumerate(chain) if lp.key == attach_key)
    write = [ix.substitute(p.binding) for ix in p.spec.write.indices]
    shape = prog.dag.buffer(p.spec.write.buffer).shape
    region = touched_region(prog, write, chain, pos, shape)
    prog.emit("reverse_compute_at", consumer, producer, tvm_position(chain, pos))
    # The consumer reads the producer's buffer at its own write index (elementwise),
    # so dimension d of the producer's output is dimension d of the consumer's.
    attach_region_nest(prog, consumer, producer, attach_key, region)
    if p.inner_axis is not None:
        _acc_layout(prog, producer, consumer, pos)


def _acc_layout(prog: Program, producer: str, consumer: str, attach_pos: int) -> None:
    """The producer's output tile stored in the order of its tile loops (see
    `_inner_axis`), so that the vectorized inner axis is contiguous in it: the buffer
    gets one dimension per tile loop, which compaction under the consumer's attach point
    reduces to the inner tile. The consumer reads it back in its own (iterator) order."""
    p = prog.nests[producer]
    c = prog.nests[consumer]
    buf = prog.dag.buffer(p.spec.write.buffer)
    dims, loops = _tile_order_dims(p, p.spec.write.indices, buf.shape)
    if not dims:
        return
    prog.emit("acc_layout", producer, tuple(dims))
    packed = BufferSpec(f"{buf.name}@acc", tuple(lp.extent for lp in loops), buf.dtype, "intermediate")
    write = AccessSpec(packed.name, tuple(Affine.var(lp.key) for lp in loops))
    outer = {lp.key for lp in prog.chain(producer)[: attach_pos + 1]}
    own = {lp.key for lp in c.loops}
    read = next(a for a in c.spec.reads if a.buffer == buf.name)
    indices = []
    for (d, _, _, _), lp in zip(dims, loops):
        if lp.key in outer:
            indices.append(Affine.var(lp.key))
            continue
        # (consumer loop // stride) % extent: approximated by the consumer's loop of that dimension
        it = read.indices[d].is_single_var()
        keys = [k for k, _ in c.binding[it].terms if k in own] if it is not None else []
        indices.append(Affine.of({keys[0]: 1}, exact=False) if keys else Affine())
    c_spec = replace(c.spec, reads=tuple(AccessSpec(packed.name, tuple(indices)) if a.buffer == buf.name else a for a in c.spec.reads))
    p_spec = replace(p.spec, write=write)
    blocks = [p_spec if b.name == producer else c_spec if b.name == consumer else b for b in prog.dag.blocks]
    prog.dag = prog.dag.replace_blocks(blocks, (*prog.dag.buffers, packed))
    p.spec, c.spec = p_spec, c_spec


def _can_inline(prog: Program, name: str) -> bool:
    spec = prog.nests[name].spec
    return (
        not spec.is_reduction
        and not prog.dag.is_output(name)
        and is_elementwise_write(spec)
        and len(spec.write.indices) == len(spec.iters)
        and bool(prog.consumers(name))
    )


def _compute_location(prog: Program, name: str, decider: Decider) -> None:
    consumers = prog.consumers(name)
    nest = prog.nests[name]
    if not consumers or nest.attach is not None or nest.tiled:
        return
    chains = [prog.chain(c) for c in consumers]
    common: list[Loop] = []
    for loops in zip(*chains):
        # never under an unrolled loop (`UnrollTableStep`): the block would be copied as often
        if all(lp.key == loops[0].key for lp in loops) and loops[0].kind != "unrolled":
            common.append(loops[0])
        else:
            break
    options: list[str] = ["root"]
    if _can_inline(prog, name):
        options.append("inline")
    if is_elementwise_write(nest.spec) or not nest.spec.spatial:
        options.extend(lp.key for lp in common)
    choice = options[decider.decide(f"{name}.location", ChoiceDomain(len(options)))]
    if choice == "root":
        return
    if choice == "inline":
        _inline(prog, name)
        return
    buf = nest.spec.write.buffer
    shape = prog.dag.buffer(buf).shape
    pos = next(i for i, lp in enumerate(common) if lp.key == choice)
    region: list[tuple[Affine, int]] | None = None
    for c, chain in zip(consumers, chains):
        cnest = prog.nests[c]
        for acc in cnest.spec.reads:
            if acc.buffer != buf:
                continue
            idx = [ix.substitute(cnest.binding) for ix in acc.indices]
            r = touched_region(prog, idx, chain, pos, shape)
            region = r if region is None else union_region(region, r, shape)
    assert region is not None
    prog.emit("compute_at", name, consumers[0], tvm_position(common, pos))
    attach_region_nest(prog, name, _owner_of(prog, choice), choice, region)


    # The reduction's init is split off later, by `_decompose_reductions`.









