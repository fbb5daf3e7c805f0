"""Sketch generation by derivation rules (Ansor §4.1, Table 1; CPU rule order).

A sketch is the high-level structure of a program: which blocks are inlined, tiled,
fused into a producer's tile, rfactored or given a cache-write stage. What a sketch
leaves open (tile sizes, fusion level, compute locations, parallel granularity,
vector length, unroll depth) are *slots*, filled by random annotation
(`loopnest.build`) and changed by evolution.

Derivation (`derive`, shared by every rule set) visits the DAG's blocks from the
outputs towards the inputs. At each block the rules are tried in order; each returns
SKIP, APPLY (new states, and the current state also goes on to the next rule) or
APPLY_AND_SKIP_REST (new states only). The steps of both rule sets are defined here;
the CPU rules follow, the GPU rules are in `sketch_gpu.py`:

  1. AlwaysInline                  strictly inlineable            -> APPLY_AND_SKIP_REST
  2. UnrollTables                  indexes constant tables, the   -> APPLY_AND_SKIP_REST
                                   other iterators spatial
  3. AddRfactor                    reduction with little spatial  -> APPLY (inner, outer)
                                   parallelism
  4. AddCacheWrite                 needs tiling, no fusible       -> APPLY (block is
                                   consumer                          visited again)
  5. MultiLevelTilingWithFusion    needs tiling, fusible consumer -> APPLY, or
                                                                     APPLY_AND_SKIP_REST
                                                                     after a cache write
  6. MultiLevelTiling              needs tiling                   -> APPLY_AND_SKIP_REST
  7. Skip                          always                         -> APPLY

UnrollTables is Ansor's SimplifyComputeWithConstTensor, found from the block's structure
(`BlockSpec.table_iters`) rather than an attribute: the loops of the iterators that pick
constant table entries (a Winograd transform's matrix indices) are unrolled, so that every
entry folds to a constant and the zero terms vanish.

Both tiling rules add a LayoutRewrite step after the tile for every constant input
(a weight: `Workload.constants`) that the block alone reads with one iterator per
dimension: the weight is stored in the order of the tile loops (Ansor §4.2 "layout
rewrite"), transformed once outside the kernel (`tunefarm.layout`).

A finished state gets a ComputeLocation step for every remaining flexible block
(consumers first) and an Annotate step (parallel / vectorize / unroll) per block.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum

from tunefarm.gpu import GpuLimits
from tunefarm.search.space.dag import (
    AccessSpec,
    Affine,
    BlockSpec,
    BufferSpec,
    ComputeDag,
    IterSpec,
    OpCounts,
    fusible_consumer,
    inline_into_consumers,
    is_strictly_inlineable,
    layout_rewritable,
    needs_multi_level_tiling,
    reduce_size,
    spatial_size,
)

CPU_TILE_STRUCTURE = "SSRSRS"
"""Ansor's CPU multi-level tiling: i0 j0 | i1 j1 | k0 | i2 j2 | k1 | i3 j3."""

FUSE_LEVELS = (1, 2)
"""Spatial tile levels a fused consumer may be computed at (Ansor CPU: after S1 or S2)."""


# ------------------------------------------------------------------------------ steps


@dataclass(frozen=True)
class InlineStep:
    block: str


@dataclass(frozen=True)
class CacheWriteStep:
    """The block writes into a new buffer `<out>_<scope>`; block `<out>_<scope>` copies
    it out. CPU: "global" (a tile of the output kept compact); GPU: "local" (registers)."""

    block: str
    scope: str = "global"


@dataclass(frozen=True)
class RfactorStep:
    """Fuse the reduction loops, split them in two (slot `<block>.rfactor`) and factor
    the reduction over the inner part (`inner`, vectorizable) or the outer part
    (parallelizable) into block `<block>_rf`."""

    block: str
    inner: bool


@dataclass(frozen=True)
class TileStep:
    """Multi-level tiling: slot `<block>.tile.<iter>` per iterator."""

    block: str
    structure: str = CPU_TILE_STRUCTURE


@dataclass(frozen=True)
class UnrollTableStep:
    """The block's table iterators (`BlockSpec.table_iters`) unrolled, innermost but for
    the vector lanes; each other iterator (all spatial) split in two (slot
    `<block>.tile.<iter>`): outer parts, inner parts, the unrolled table loops, then the
    inner part of the last other iterator, to vectorize (Ansor's
    SimplifyComputeWithConstTensor, with the vector axis moved inside)."""

    block: str


@dataclass(frozen=True)
class LayoutRewriteStep:
    """Store constant input `buffer` in the order `block`'s tile loops read it (Ansor §4.2
    layout rewrite; MetaSchedule's RewriteLayout): its dimensions become the tile loops
    that index it, outermost first, so the inner tiles read contiguous panels. The copy
    into that layout is done once, outside the kernel (`tunefarm.layout`). No slot: the
    layout follows from the block's tile sizes."""

    block: str
    buffer: str


@dataclass(frozen=True)
class FuseConsumerStep:
    """Compute `consumer` inside `producer`'s tile: after spatial tile level `level`, or
    (None) at a level chosen from FUSE_LEVELS (slot `<consumer>.fuse_level`)."""

    consumer: str
    producer: str
    level: int | None = None


@dataclass(frozen=True)
class ComputeLocationStep:
    """Root, inline (spatial blocks) or under a loop of its consumers (slot `<block>.location`)."""

    block: str


@dataclass(frozen=True)
class AnnotateStep:
    """Parallel outer loops, vectorize the inner loop, auto-unroll pragma (Ansor §4.2)."""

    block: str


@dataclass(frozen=True)
class CacheReadStep:
    """GPU: `buffer`, as `block` reads it, staged in shared memory under the block's
    outermost reduction tile, and fetched cooperatively by the block's threads (fused,
    split by the thread count, optionally vectorized: slot `<buffer>_shared.vector`)."""

    block: str
    buffer: str


@dataclass(frozen=True)
class CrossThreadReductionStep:
    """GPU: the block's reduction is split over the threads of a block (slot
    `<block>.threads`) and combined across them; its spatial loops become blocks."""

    block: str


@dataclass(frozen=True)
class ThreadBindStep:
    """GPU annotation: a tiled block's spatial tile levels bound to blockIdx / vthread /
    threadIdx; a cross-thread reduction bound as such; any other block at the root
    fused and split over blocks of `<block>.threads` threads. Plus the auto-unroll pragma
    (slot `<block>.unroll`) on blocks with a reduction."""

    block: str


@dataclass(frozen=True)
class TensorCoreStep:
    """GPU (sm_70+): the block computed on tensor cores (`tensor_core.py`): blockized
    into 16x16x16 wmma fragments, tiled over them (slot `<block>.tile.<iter>`, in
    fragments; spatial levels 0 and 1 bound to blockIdx.x and to the warps of a block),
    its accumulators in wmma.accumulator fragments stored per warp, each operand staged
    in shared memory (fetched by all the block's threads: slot `<buffer>_shared.vector`)
    then in wmma.matrix_a / matrix_b fragments, the fragment operations tensorized; an
    auto-unroll pragma (slot `<block>.unroll`) and on sm_80+ a software pipeline of the
    shared stages (slot `<block>.pipeline`)."""

    block: str


Step = (
    InlineStep
    | TensorCoreStep
    | CacheWriteStep
    | CacheReadStep
    | CrossThreadReductionStep
    | ThreadBindStep
    | RfactorStep
    | TileStep
    | UnrollTableStep
    | LayoutRewriteStep
    | FuseConsumerStep
    | ComputeLocationStep
    | AnnotateStep
)


@dataclass(frozen=True)
class Sketch:
    steps: tuple[Step, ...]

    def describe(self) -> list[str]:
        return [describe_step(s) for s in self.steps]

    @property
    def signature(self) -> str:
        """Identity of the sketch's structure, stored with records to match them on resume."""
        return hashlib.sha1("\n".join(self.describe()).encode()).hexdigest()[:12]


def describe_step(step: Step) -> str:
    match step:
        case InlineStep(block=b):
            return f"inline {b}"
        case CacheWriteStep(block=b, scope=scope):
            return f"cache-write {b}" if scope == "global" else f"cache-write {b} ({scope})"
        case CacheReadStep(block=b, buffer=buf):
            return f"cache-read {buf} into shared memory for {b} (cooperative fetch)"
        case CrossThreadReductionStep(block=b):
            return f"cross-thread reduction {b}"
        case ThreadBindStep(block=b):
            return f"bind threads {b}"
        case TensorCoreStep(block=b):
            return f"tensor-core tile {b} (wmma 16x16x16 float16 -> float32; shared and fragment stages)"
        case RfactorStep(block=b, inner=inner):
            return f"rfactor {b} ({'inner' if inner else 'outer'} part)"
        case TileStep(block=b, structure=s):
            return f"tile {b} {s}"
        case UnrollTableStep(block=b):
            return f"unroll the constant tables of {b}"
        case LayoutRewriteStep(block=b, buffer=buf):
            return f"layout-rewrite {buf} for {b}"
        case FuseConsumerStep(consumer=c, producer=p, level=level):
            at = "" if level is None else f" (level {level})"
            return f"fuse {c} into the tile of {p}{at}"
        case ComputeLocationStep(block=b):
            return f"compute-location {b}"
        case AnnotateStep(block=b):
            return f"annotate {b}"
    raise TypeError(step)


# ----------------------------------------------------------- DAG views of derived blocks


def cache_write_names(dag: ComputeDag, block: str, scope: str = "global") -> tuple[str, str]:
    """(copy block name, cache buffer name): TVM names both `<out buffer>_<scope>`."""
    name = f"{dag.block(block).write.buffer}_{scope}"
    return name, name


def apply_cache_write(dag: ComputeDag, block: str, scope: str = "global") -> ComputeDag:
    """The DAG after `cache_write(block)`: the block writes a cache buffer and a new
    elementwise block copies it to the original buffer."""
    return dag.derived(("cache_write", block, scope), lambda: _apply_cache_write(dag, block, scope))


def _apply_cache_write(dag: ComputeDag, block: str, scope: str) -> ComputeDag:
    b = dag.block(block)
    out = dag.buffer(b.write.buffer)
    copy_name, cache_name = cache_write_names(dag, block, scope)
    iters = tuple(IterSpec(f"v{d}", extent, "S") for d, extent in enumerate(out.shape))
    index = tuple(Affine.of({it.name: 1}) for it in iters)
    copy = BlockSpec(
        name=copy_name,
        iters=iters,
        reads=(AccessSpec(cache_name, index),),
        write=AccessSpec(out.name, index),
        ops=OpCounts(),
    )
    compute = replace(b, write=AccessSpec(cache_name, b.write.indices))
    blocks = []
    for x in dag.blocks:
        if x.name == block:
            blocks.extend([compute, copy])
        else:
            blocks.append(x)
    buffers = (*dag.buffers, BufferSpec(cache_name, out.shape, out.dtype, "intermediate", scope))
    return dag.replace_blocks(blocks, buffers)


def rfactor_names(block: str) -> str:
    return f"{block}_rf"


def rfactor_possible(block: BlockSpec) -> bool:
    """The reduction iterators can be fused into one affine index: a single one, or
    several that every read uses as consecutive dimensions in iterator order."""
    red = [it.name for it in block.reduce]
    if len(red) <= 1:
        return len(red) == 1
    for acc in block.reads:
        used = [i for i, ix in enumerate(acc.indices) if ix.vars & set(red)]
        if not used:
            continue
        names = [acc.indices[i].is_single_var() for i in used]
        if names != red or used != list(range(used[0], used[0] + len(red))):
            return False
    return True


# ------------------------------------------------------------------------- derivation


class RuleResult(Enum):
    SKIP = 0
    APPLY = 1
    APPLY_AND_SKIP_REST = 2


@dataclass(frozen=True)
class Hardware:
    """What the derivation rules know of the target: its cores, and a GPU's limits."""

    num_cores: int
    gpu: GpuLimits | None = None


@dataclass(frozen=True)
class DerivationState:
    """A partial sketch while the rules run (Ansor's (state, stage id) pair)."""

    dag: ComputeDag
    steps: tuple[Step, ...]
    pending: tuple[str, ...]  # blocks still to visit, next first
    cache_written: frozenset[str] = frozenset()
    tiled: frozenset[str] = frozenset()
    fused: frozenset[str] = frozenset()  # consumers computed inside a producer's tile
    rfactored: frozenset[str] = frozenset()
    cross_thread: frozenset[str] = frozenset()  # GPU: reductions split over a block's threads
    tensor_cores: frozenset[str] = frozenset()  # GPU: blocks computed on tensor cores

    def advance(self, **changes) -> DerivationState:
        return replace(self, pending=self.pending[1:], **changes)


def needs_rfactor(block: BlockSpec, num_cores: int) -> bool:
    """Ansor's NeedsRfactor: little spatial parallelism against the reduction."""
    if not block.is_reduction or not rfactor_possible(block):
        return False
    space, red = spatial_size(block), reduce_size(block)
    if needs_multi_level_tiling(block):
        return space < red and space <= 16 * num_cores
    return red > num_cores


def _rule_always_inline(st: DerivationState, b: BlockSpec, hw: Hardware):
    if b.name in st.cache_written or not is_strictly_inlineable(st.dag, b):
        return RuleResult.SKIP, []
    new = st.advance(dag=inline_into_consumers(st.dag, b.name), steps=(*st.steps, InlineStep(b.name)))
    return RuleResult.APPLY_AND_SKIP_REST, [new]


MAX_TABLE_EXTENT = 16
"""Longest table iterator UnrollTables unrolls: a constant matrix is small (a Winograd
transform's side is m + 2), while an equality test on a long loop (`i == 0` over 1000
elements) is no table, and its block gets the ordinary rules."""

MAX_UNROLLED_TABLE = 4096
"""Most iterations of a block's table loops that UnrollTables unrolls into straight-line
code (zero entries fold away afterwards): F(4x4, 3x3)'s input transform has 6^4 = 1296."""


def unrolls_tables(block: BlockSpec) -> bool:
    """Whether UnrollTables applies: the block indexes small constant tables
    (`MAX_TABLE_EXTENT`, `MAX_UNROLLED_TABLE`), and its other iterators, at least one,
    are all spatial (they are tiled, the table loops unrolled)."""
    other = block.untabled
    if not block.table_iters or not other or any(it.kind != "S" for it in other):
        return False
    extents = [block.iter(name).extent for name in block.table_iters]
    return max(extents) <= MAX_TABLE_EXTENT and math.prod(extents) <= MAX_UNROLLED_TABLE


def _rule_unroll_tables(st: DerivationState, b: BlockSpec, hw: Hardware):
    if b.name in st.cache_written or not unrolls_tables(b):
        return RuleResult.SKIP, []
    new = st.advance(steps=(*st.steps, UnrollTableStep(b.name)), tiled=st.tiled | {b.name})
    return RuleResult.APPLY_AND_SKIP_REST, [new]


def _rule_add_rfactor(st: DerivationState, b: BlockSpec, hw: Hardware):
    if b.name in st.cache_written or not needs_rfactor(b, hw.num_cores):
        return RuleResult.SKIP, []
    out = []
    for inner in (True, False):
        out.append(
            st.advance(
                steps=(*st.steps, RfactorStep(b.name, inner)),
                rfactored=st.rfactored | {b.name},
            )
        )
    return RuleResult.APPLY, out


def _rule_add_cache_write(st: DerivationState, b: BlockSpec, hw: Hardware):
    if b.name in st.cache_written or not needs_multi_level_tiling(b) or fusible_consumer(st.dag, b):
        return RuleResult.SKIP, []
    new = replace(
        st,
        dag=apply_cache_write(st.dag, b.name),
        steps=(*st.steps, CacheWriteStep(b.name)),
        cache_written=st.cache_written | {b.name},
    )  # not advanced: the block is visited again and gets tiling with fusion
    return RuleResult.APPLY, [new]


def _tile_steps(dag: ComputeDag, b: BlockSpec) -> tuple[Step, ...]:
    """Multi-level tiling of `b`, and the layout rewrite of the constants it reads."""
    return (TileStep(b.name), *(LayoutRewriteStep(b.name, buf) for buf in layout_rewritable(dag, b)))


def _rule_tiling_with_fusion(st: DerivationState, b: BlockSpec, hw: Hardware):
    if not needs_multi_level_tiling(b):
        return RuleResult.SKIP, []
    consumer = fusible_consumer(st.dag, b)
    if consumer is None:
        return RuleResult.SKIP, []
    new = st.advance(
        steps=(*st.steps, *_tile_steps(st.dag, b), FuseConsumerStep(consumer.name, b.name)),
        tiled=st.tiled | {b.name},
        fused=st.fused | {consumer.name},
    )
    result = RuleResult.APPLY_AND_SKIP_REST if b.name in st.cache_written else RuleResult.APPLY
    return result, [new]


def _rule_tiling(st: DerivationState, b: BlockSpec, hw: Hardware):
    if not needs_multi_level_tiling(b):
        return RuleResult.SKIP, []
    new = st.advance(steps=(*st.steps, *_tile_steps(st.dag, b)), tiled=st.tiled | {b.name})
    return RuleResult.APPLY_AND_SKIP_REST, [new]


def rule_skip(st: DerivationState, b: BlockSpec, hw: Hardware):
    """The last rule of every rule list: leave the block as it is and go to the next."""
    return RuleResult.APPLY, [st.advance()]


CPU_RULES = (
    _rule_always_inline,
    _rule_unroll_tables,
    _rule_add_rfactor,
    _rule_add_cache_write,
    _rule_tiling_with_fusion,
    _rule_tiling,
    rule_skip,
)


Rule = Callable[[DerivationState, BlockSpec, Hardware], tuple[RuleResult, list[DerivationState]]]
Finish = Callable[[DerivationState], "Sketch"]


def generate_sketches(dag: ComputeDag, num_cores: int) -> list[Sketch]:
    """All CPU sketches of a DAG, in a deterministic order."""
    return derive(dag, CPU_RULES, Hardware(num_cores), finish_cpu)


def derive(dag: ComputeDag, rules: Sequence[Rule], hw: Hardware, finish: Finish) -> list[Sketch]:
    """Run the derivation rules over the blocks from the outputs towards the inputs
    (the enumeration every rule set shares); `finish` turns each final state into a
    sketch. Deterministic order, duplicates dropped."""
    pending = tuple(b.name for b in reversed(dag.blocks))
    stack = [DerivationState(dag, (), pending)]
    finished: list[DerivationState] = []
    while stack:
        st = stack.pop()
        if not st.pending:
            finished.append(st)
            continue
        block = st.dag.block(st.pending[0])
        produced: list[DerivationState] = []
        for rule in rules:
            result, new_states = rule(st, block, hw)
            if result is RuleResult.SKIP:
                continue
            produced.extend(new_states)
            if result is RuleResult.APPLY_AND_SKIP_REST:
                break
        stack.extend(reversed(produced))
    sketches = []
    seen = set()
    for st in finished:
        sk = finish(st)
        if sk.steps not in seen:
            seen.add(sk.steps)
            sketches.append(sk)
    return sketches


def derived_dag(dag: ComputeDag, sketch: Sketch) -> ComputeDag:
    """The DAG view after a sketch's inline, cache-write and rfactor steps (the rfactor
    view is built by the loop-nest model, which needs the split sizes; here the rf
    block is left out)."""
    for step in sketch.steps:
        if isinstance(step, InlineStep):
            dag = inline_into_consumers(dag, step.block)
        elif isinstance(step, CacheWriteStep):
            dag = apply_cache_write(dag, step.block, step.scope)
    return dag


def finish_cpu(st: DerivationState) -> Sketch:
    """Add compute-location steps (consumers first) and annotation steps."""
    steps = list(st.steps)
    names = [b.name for b in st.dag.blocks]
    rf_blocks = {rfactor_names(b) for b in st.rfactored}
    # Block order of the final program: the rf block comes right before its block.
    order: list[str] = []
    for n in names:
        if n in st.rfactored:
            order.append(rfactor_names(n))
        order.append(n)
    flexible = []
    for n in reversed(order):
        if n in st.tiled or n in st.fused:
            continue
        if n in rf_blocks:
            flexible.append(n)  # its consumer is always the final reduction block
        elif st.dag.consumers(n):
            flexible.append(n)
    steps.extend(ComputeLocationStep(n) for n in flexible)
    steps.extend(AnnotateStep(n) for n in order)
    return Sketch(tuple(steps))
