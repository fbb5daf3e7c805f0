"""The loop-nest model's program: the loops, nests and statements a sketch plus its
decisions gives, shared by the CPU steps (`loopnest`) and the GPU steps (`loopnest_gpu`).

`Program` is the model: one `Nest` (a block's own loops and iterator bindings) per block
in program order, the `Instr` list that `realize.py` replays on TVM, and `stores()`, one
`Store` per innermost statement (the feature extractor's input). The helpers here place
nests (`add_root_nest`, `attach_region_nest`) and compute the regions they touch
(`touched_region`, `union_region`, `region_elems`), for both kinds of target.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tunefarm.search.space.dag import AccessSpec, Affine, BlockSpec, BufferSpec, ComputeDag, OpCounts

MAX_UNROLLED_LANES = 8192
"""Largest straight-line body auto-unroll may produce, counted as unrolled statements
times vector lanes. LLVM's compile time grows much faster than linearly past it: a GEMM
body of 512 unrolled statements compiles in 0.8 s with 16 float lanes, 10 s with 32 and
75 s with 64 (znver4). Such a program is rejected as invalid rather than measured: its
build would cost more than a whole batch of ordinary ones."""


MAX_INNERMOST_TILE = 64


BOUND_KINDS = ("blockIdx.x", "vthread.x", "threadIdx.x", "threadIdx.y")
"""Loop kinds of GPU loops bound to a thread axis (threadIdx.y: the warps of a
tensor-core block). Consecutive loops bound to the same axis are one loop in TVM (they
are fused before binding)."""

TENSORIZED = "tensorized"
"""Kind of the model's loops inside a tensorized block (a wmma fragment's 16 x 16 (x 16)
elements, one warp-wide instruction): TVM has no loop there."""


FRAGMENT_SCOPES = ("wmma.matrix_a", "wmma.matrix_b", "wmma.accumulator")
"""Memory scopes of wmma fragments: registers, spread over the 32 threads of a warp."""

WARP_SIZE = 32


class InvalidProgram(Exception):
    """The decisions do not give a program (an impossible location, an empty domain)."""


@dataclass(frozen=True)
class Instr:
    """One schedule primitive for `realize.py` to replay on TVM, with every position
    already resolved by the model. Loop positions index `get_loops(block)`; negative
    ones count from the innermost loop.

      inline(block) | cache_write(block) -> new block | rfactor(block, factors, inner)
      tile(block, structure, factors per iterator, iterator put innermost or -1)
      reverse_compute_at(block, producer, pos)
      layout_rewrite(block, buffer, new dims as (buffer dim, stride, extent, dim extent))
      acc_layout(block, new dims of its output buffer, as for layout_rewrite)
      compute_at(block, consumer, pos) | split_inner(block, factors) | parallel(block, n)
      vectorize(block) | unroll(block, pos, max_step) | decompose(block, pos)
      move_innermost(block, pos) | fuse_last(block): its two innermost loops fused
      | split_inward(block, pos, factors): loop pos split, its inner part moved innermost
      GPU: cache_read(block, buffer, stage, pos) | coop_fetch(stage, loops, threads, vector)
      bind_tile / cross_thread / bind_fallback(block, ...)
      pipeline(block, pos, loops fused, stages, depth) | dynamic_shared(stage)
      tensor cores (`loopnest_tensor_core`): tc_blockize(block, loop positions split by 16)
      | bind_warps(block, block loops, warp loops) | tc_copy(block, intrinsic)
      | align_rows(stage, factor, offset) | coop_fetch_warps(stage, loops, warps, threads, vector)
      | tc_fragment(block, shared buffer, stage, pos, scope, intrinsic)
      | tc_decompose(block, pos, fill intrinsic, mma intrinsic)
    """

    op: str
    block: str
    args: tuple = ()

    def describe(self) -> str:
        return f"{self.op} {self.block}" + (f" {self.args}" if self.args else "")


@dataclass(slots=True)
class Loop:
    key: str  # unique name in the program, used as the variable in Affine forms
    extent: int
    reduce: bool  # drives a reduction iterator of its block
    kind: str = "serial"  # "serial", "parallel", "vectorized", or a GPU thread axis (BOUND_KINDS)


@dataclass
class Nest:
    """One block's own loops and how its iterators are bound to loop variables."""

    spec: BlockSpec
    loops: list[Loop]
    binding: dict[str, Affine]  # iterator -> Affine over loop keys
    attach: tuple[str, str] | None = None  # (owner block, loop key) it is computed under
    tiled: bool = False
    tile_groups: list[list[str]] = field(default_factory=list)  # loop keys per structure level
    tile_structure: str = ""  # e.g. "SSRSRS": the level kind of each tile group
    inner_axis: str | None = None  # spatial iterator moved innermost (None: iterator order)
    rf_inner: bool = False
    cross_thread: bool = False  # GPU: its reduction loop is bound to threadIdx (never decomposed)
    threads: int = 0  # GPU: threads per block of the kernel this root block launches
    footprint: int = 0  # elements of its output buffer after compaction, when the loops do not say
    lowering_shared_bytes: int = 0  # GPU: shared memory TVM's lowering adds (a cross-thread reduction's)
    parallel: int = 0  # number of leading own loops fused into one parallel loop
    unroll: int = 0  # pragma_auto_unroll_max_step on the outermost own loop
    pipeline: int = 1  # GPU: copies of its shared stages the software pipeline cycles through (1: none)
    tensor_core: object | None = None  # GPU: its `TensorCoreForm` when computed on tensor cores
    init_at: int | None = None  # own-loop index of decompose_reduction


@dataclass(frozen=True, slots=True)
class Access:
    buffer: BufferSpec
    indices: tuple[Affine, ...]  # over loop keys
    is_write: bool
    is_read: bool


@dataclass(frozen=True)
class Store:
    """One innermost store statement: what the feature extractor looks at."""

    block: str
    loops: tuple[Loop, ...]  # root to innermost
    accesses: tuple[Access, ...]
    ops: OpCounts
    unroll: int  # the auto-unroll pragma in effect (0 = none)
    is_init: bool = False
    alloc: BufferSpec | None = None  # intermediate buffer this store fills, if any
    alloc_elems: int = 0  # its size after compaction (elements under its attach point)
    shared_bytes: int = 0  # GPU: shared memory of the kernel (thread block) the store is in
    local_bytes: int = 0  # GPU: registers/local memory of one thread of that kernel (wmma fragments included)


@dataclass
class Program:
    dag: ComputeDag
    nests: dict[str, Nest]  # program order
    order: list[str]
    counter: int = 0
    instructions: list[Instr] = field(default_factory=list)
    fused_producers: frozenset[str] = frozenset()  # tiled blocks whose consumer joins their tile
    gpu: bool = False  # built for a GPU (loops bound to thread axes, shared/local stages)

    def emit(self, op: str, block: str, *args) -> None:
        self.instructions.append(Instr(op, block, tuple(args)))

    def new_loop(self, extent: int, reduce: bool) -> Loop:
        self.counter += 1
        return Loop(f"l{self.counter}", int(extent), reduce)

    def chain(self, name: str) -> list[Loop]:
        nest = self.nests[name]
        if nest.attach is None:
            return list(nest.loops)
        owner, key = nest.attach
        outer = self.chain(owner)
        pos = next(i for i, lp in enumerate(outer) if lp.key == key)
        return outer[: pos + 1] + list(nest.loops)

    def attached_keys(self) -> set[str]:
        return {n.attach[1] for n in self.nests.values() if n.attach is not None}

    def consumers(self, name: str) -> list[str]:
        buf = self.nests[name].spec.write.buffer
        return [n for n in self.order if n != name and any(a.buffer == buf for a in self.nests[n].spec.reads)]

    def root_of(self, name: str) -> str:
        """The root block whose loop nest `name` is computed in (one GPU kernel each)."""
        nest = self.nests[name]
        return name if nest.attach is None else self.root_of(nest.attach[0])

    def kernel_bytes(self, root: str, scope: str) -> int:
        """Bytes of `scope` buffers ("shared": per block, "local": per thread) the stages
        computed under root block `root` allocate, after compaction."""
        total = 0
        for name in self.order:
            if self.root_of(name) != root:
                continue
            buf = self.dag.buffer(self.nests[name].spec.write.buffer)
            if buf.scope == scope:
                total += region_elems(self, name) * buf.elem_bytes
            if scope == "shared":
                total += self.nests[name].lowering_shared_bytes
        return total

    def fragment_bytes(self, root: str) -> int:
        """Bytes of wmma fragments (accumulators and operands) one warp of root block
        `root`'s kernel holds."""
        return sum(self.kernel_bytes(root, scope) for scope in FRAGMENT_SCOPES)

    def stores(self) -> list[Store]:
        out = []
        memory: dict[str, tuple[int, int]] = {}
        for name in self.order:
            nest = self.nests[name]
            chain = self.chain(name)
            unroll = self._unroll_in_effect(name)
            spec = nest.spec
            reads = [self._access(a, nest, is_write=False) for a in spec.reads]
            write = self._access(spec.write, nest, is_write=True)
            buf = self.dag.buffer(spec.write.buffer)
            alloc = buf if buf.role == "intermediate" else None
            alloc_elems = region_elems(self, name) if alloc is not None else 0
            if spec.is_reduction:  # C = C + ...: the output is read and written
                write = replace(write, is_read=True)
            shared = local = 0
            if self.gpu:
                root = self.root_of(name)
                if root not in memory:
                    fragments = self.fragment_bytes(root) // WARP_SIZE
                    memory[root] = (self.kernel_bytes(root, "shared"), self.kernel_bytes(root, "local") + fragments)
                shared, local = memory[root]
            out.append(
                Store(name, tuple(chain), (write, *reads), spec.ops, unroll, False, alloc, alloc_elems, shared, local)
            )
            if spec.has_init and nest.init_at is not None:
                n_outer = len(chain) - len(nest.loops)
                own_after = [lp for lp in nest.loops[nest.init_at :] if not lp.reduce]
                init_loops = chain[: n_outer + nest.init_at] + own_after
                init_write = replace(write, is_read=False)  # the same write, not read
                out.append(
                    Store(name, tuple(init_loops), (init_write,), OpCounts(), unroll, True, alloc, alloc_elems, shared, local)
                )
        return out

    def _access(self, acc: AccessSpec, nest: Nest, is_write: bool) -> Access:
        indices = tuple(ix.substitute(nest.binding) for ix in acc.indices)
        return Access(self.dag.buffer(acc.buffer), indices, is_write, not is_write)

    def _unroll_in_effect(self, name: str) -> int:
        nest = self.nests[name]
        if nest.unroll:
            return nest.unroll
        if nest.attach is not None:
            return self._unroll_in_effect(nest.attach[0])
        return 0


def add_root_nest(prog: Program, spec: BlockSpec, after: str | None = None, before: str | None = None) -> Nest:
    loops = [prog.new_loop(it.extent, it.kind == "R") for it in spec.iters]
    binding = {it.name: Affine.var(lp.key) for it, lp in zip(spec.iters, loops)}
    nest = Nest(spec, loops, binding)
    prog.nests[spec.name] = nest
    if after is not None:
        prog.order.insert(prog.order.index(after) + 1, spec.name)
    elif before is not None:
        prog.order.insert(prog.order.index(before), spec.name)
    else:
        prog.order.append(spec.name)
    return nest


def touched_region(
    prog: Program, indices: list[Affine], chain: list[Loop], pos: int, shape, relaxed: frozenset[str] = frozenset()
) -> list[tuple[Affine, int]]:
    """Per dimension: (start over the loops up to `pos`, extent) of what `indices`
    touch while the loops after `pos` run (and the loops `relaxed`: e.g. the thread
    loops a shared buffer is shared by); clipped to the buffer."""
    inner = {lp.key: lp.extent for i, lp in enumerate(chain) if i > pos or lp.key in relaxed}
    out = []
    for d, ix in enumerate(indices):
        ext = 1
        low = 0
        outer_terms = {}
        for v, c in ix.terms:
            if v in inner:
                ext += abs(c) * (inner[v] - 1)
                if c < 0:
                    low += c * (inner[v] - 1)
            else:
                outer_terms[v] = c
        ext = max(1, min(ext, int(shape[d])))
        out.append((Affine.of(outer_terms, ix.const + low, ix.exact), ext))
    return out


def tvm_position(chain: list[Loop], pos: int) -> int:
    """The index in TVM's `get_loops` of the model's loop `chain[pos]`: consecutive loops
    bound to one GPU thread axis are one fused loop in TVM."""
    out = -1
    for i in range(pos + 1):
        if not (i > 0 and chain[i].kind in BOUND_KINDS and chain[i].kind == chain[i - 1].kind):
            out += 1
    return out


def attach_region_nest(prog: Program, name: str, owner: str, loop_key: str, region: list[tuple[Affine, int]]) -> None:
    """Put block `name` under `loop_key`: one loop per iterator whose region extent is
    > 1, in iterator order, bound to region start + loop."""
    nest = prog.nests[name]
    spec = nest.spec
    dim_of = {}
    for d, ix in enumerate(spec.write.indices):
        v = ix.is_single_var()
        if v is not None:
            dim_of[v] = d
    loops = []
    binding = {}
    for it in spec.iters:
        if it.kind == "S":
            if it.name not in dim_of:
                raise InvalidProgram(f"{name}: iterator {it.name} is not a dimension of its output")
            start, ext = region[dim_of[it.name]]
        else:
            start, ext = Affine(), it.extent
        if ext > 1:
            lp = prog.new_loop(ext, it.kind == "R")
            loops.append(lp)
            binding[it.name] = Affine.of({**dict(start.terms), lp.key: 1}, start.const, start.exact)
        else:
            binding[it.name] = start
    nest.loops = loops
    nest.binding = binding
    nest.attach = (owner, loop_key)


def union_region(a: list[tuple[Affine, int]], b: list[tuple[Affine, int]], shape) -> list[tuple[Affine, int]]:
    out = []
    for d, ((sa, ea), (sb, eb)) in enumerate(zip(a, b)):
        if sa.terms == sb.terms:
            lo = min(sa.const, sb.const)
            hi = max(sa.const + ea, sb.const + eb)
            out.append((Affine(sa.terms, lo, sa.exact and sb.exact), min(hi - lo, int(shape[d]))))
        else:
            out.append((sa, min(max(ea, eb), int(shape[d]))))
    return out


def region_elems(prog: Program, name: str) -> int:
    """Elements of a block's output after buffer compaction: its write footprint under
    the loop it is computed at (the whole buffer at the root)."""
    nest = prog.nests[name]
    if nest.footprint:
        return nest.footprint
    n = 1
    for ix in nest.spec.write.indices:
        ext = 1
        for v, c in ix.substitute(nest.binding).terms:
            lp = next((x for x in nest.loops if x.key == v), None)
            if lp is not None:
                ext += abs(c) * (lp.extent - 1)
        n *= ext
    return n


def unrolled_lanes(loops: list[Loop], max_step: int) -> int:
    """Size of the body TVM's UnrollLoop pass makes under `pragma_auto_unroll_max_step =
    max_step`: inner loops are unrolled from the innermost out while the product of their
    extents stays within `max_step` (a vectorized loop is one statement by then, of that
    many lanes). Returns unrolled statements x lanes."""
    lanes, steps = 1, 1
    inner = list(loops)
    if inner and inner[-1].kind == "vectorized":
        lanes = inner.pop().extent
    for lp in reversed(inner):
        if lp.kind != "serial" or steps * lp.extent > max_step:
            break
        steps *= lp.extent
    return steps * lanes


def expected_tvm_loops(prog: Program) -> dict[str, list[tuple[int, str]]]:
    """What TVM's loop nest should look like for this program: {block: [(extent, kind)]},
    with parallel prefixes fused into one loop and decomposed reductions split into
    `<block>_init` / `<block>_update` (the names TVM gives them)."""

    def collapse(name: str, loops: list[Loop]) -> list[tuple[int, str]]:
        out: list[tuple[int, str]] = []
        i = 0
        # Parallel prefixes belong to root blocks; in a chain they are the leading loops.
        while i < len(loops):
            lp = loops[i]
            if lp.kind == TENSORIZED:
                i += 1
                continue
            if lp.kind == "parallel" or lp.kind in BOUND_KINDS:
                ext = 1
                while i < len(loops) and loops[i].kind == lp.kind:
                    ext *= loops[i].extent
                    i += 1
                out.append((ext, lp.kind))
                continue
            out.append((lp.extent, lp.kind))
            i += 1
        return out

    result: dict[str, list[tuple[int, str]]] = {}
    for store in prog.stores():
        nest = prog.nests[store.block]
        decomposed = nest.spec.has_init and nest.init_at is not None
        name = store.block if not decomposed else f"{store.block}_{'init' if store.is_init else 'update'}"
        result[name] = collapse(name, list(store.loops))
    return result
