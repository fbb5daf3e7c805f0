"""Sketch derivation rules for NVIDIA GPUs (Ansor §4.1 Table 1 and §4.3; the GPU rule
order of TVM v0.13 `sketch_policy.cc`, with MetaSchedule's `DefaultCUDA` where TIR
needs it).

The enumeration is the CPU one (`sketch.derive`); the rules differ:

  1. AlwaysInline              any spatial non-output block with an elementwise write
                               (GPU: branches and exp are inlined too), unless a
                               tensor-core block reads it          -> APPLY_AND_SKIP_REST
  1b. TensorCore               sm_70+, a float16 x float16 -> float32 multiply-
                               accumulate in tensor-core form (`tensor_core.py`)
                                                                   -> APPLY_AND_SKIP_REST
  2. CrossThreadReduction      a reduction with little spatial parallelism: a tiled
                               one with space <= max threads and space < reduce, any
                               other with reduce > warp size       -> APPLY
  3. AddCacheWrite             needs multi-level tiling            -> APPLY_AND_SKIP_REST
                               (block visited again)
  4. MultiLevelTilingWithFusion  needs tiling (its consumer: the register cache's
                               write-back, or the epilogue)        -> APPLY_AND_SKIP_REST
  5. Skip                      always                              -> APPLY

Where TIR differs from Ansor's TE:
- Rule 3 always writes the tile into registers (`cache_write(..., "local")`, as
  MetaSchedule's reuse_write "must"/"local"): TE infers an intermediate's scope from
  where it is computed, TIR does not. When the block's only consumer is an elementwise
  epilogue (bias, ReLU...), the write-back is inlined into it, so the epilogue reads the
  registers and is computed in the tile ("epilogue fusion").
- Rule 4 tiles with `SSSRRSRS` (spatial levels 0, 1, 2 become blockIdx, vthread and
  threadIdx at annotation) and computes the consumer after spatial level 3, the
  threadIdx level (Ansor GPU fuses at level 3; MetaSchedule reuse_write levels [3]).
  It also adds Ansor's AddCacheRead for every buffer the block reads: staged in shared
  memory at the outermost reduction tile (MetaSchedule reuse_read levels [4]) and
  fetched cooperatively.
- Blocks the rules neither inline, tile nor fuse stay at the root; annotation fuses
  their spatial loops over blocks of threads (Ansor's InitThreadBind for untiled
  stages; MetaSchedule's AutoBind).

TensorCore (MetaSchedule's MultiLevelTilingTensorCore, in one step: `TensorCoreStep`)
takes the place of rules 2-4 for its block: a tensor-core GEMM's peak is 8-16 times the
SIMT peak on sm_80+, so the SIMT sketches of that block would only take trials from it.
Its elementwise consumer is not fused (the accumulators go to global memory by warp-wide
stores): it stays a kernel of its own. Its producers are not inlined, as the operands it
stages in shared memory are their float16 outputs. Blocks of any other dtype or arch get
exactly the sketches they had.

A tiled block is bound (ThreadBindStep) right after its TileStep, and a finished
state gets a ThreadBindStep for every other block (the GPU annotation: thread binding,
cooperative-fetch vectors and unroll, `loopnest_gpu`). On sm_80+ a tiled block's shared
stages are also software-pipelined with asynchronous copies (MetaSchedule's
AddAsyncPipeline sub-rule of multi-level tiling): not a sketch step but a slot of its
TileStep (`<block>.pipeline`, decided with the tile sizes, which must fit the stages'
copies) applied after the sketch's steps (`loopnest_gpu.finish`), so the sketches, and
the signatures records are matched by, are those of older targets.
"""

from __future__ import annotations

from tunefarm.gpu import GpuLimits
from tunefarm.search.space.dag import (
    Affine,
    BlockSpec,
    ComputeDag,
    fusible_consumer,
    inline_into_consumers,
    needs_multi_level_tiling,
    reduce_size,
    spatial_size,
)
from tunefarm.search.space.sketch import (
    CacheReadStep,
    CacheWriteStep,
    CrossThreadReductionStep,
    DerivationState,
    FuseConsumerStep,
    Hardware,
    InlineStep,
    RuleResult,
    Sketch,
    Step,
    TensorCoreStep,
    ThreadBindStep,
    TileStep,
    apply_cache_write,
    cache_write_names,
    derive,
    rule_skip,
)
from tunefarm.search.space.tensor_core import tensor_core_form

GPU_TILE_STRUCTURE = "SSSRRSRS"
"""Ansor's GPU multi-level tiling: three spatial levels for blockIdx, vthread and
threadIdx, two reduction levels (shared-memory stage, registers), then S R S."""

GPU_FUSE_LEVEL = 3
"""Spatial tile level the consumer of a tiled block is computed after (threadIdx)."""


def generate_gpu_sketches(dag: ComputeDag, gpu: GpuLimits) -> list[Sketch]:
    """All GPU sketches of a DAG, in a deterministic order."""
    return derive(dag, GPU_RULES, Hardware(num_cores=1, gpu=gpu), finish_gpu)


# -------------------------------------------------------------------------- predicates


def is_gpu_inlineable(dag: ComputeDag, block: BlockSpec) -> bool:
    """Ansor's GPU AlwaysInline: every spatial, non-output block with consumers whose
    write is exactly its iterators in order (branches and expensive ops included)."""
    if block.is_reduction or dag.is_output(block.name) or not dag.consumers(block.name):
        return False
    return block.write.indices == tuple(Affine.of({it.name: 1}) for it in block.iters)


def reduce_loops_innermost(block: BlockSpec) -> bool:
    """The reduction iterators come after every spatial one (so their loops can be
    fused and split across threads)."""
    kinds = [it.kind for it in block.iters]
    return "R" in kinds and "S" not in kinds[kinds.index("R") :]


def needs_cross_thread_reduction(block: BlockSpec, gpu: GpuLimits) -> bool:
    """Ansor's GPU condition: little spatial parallelism against the reduction."""
    if not block.is_reduction or not reduce_loops_innermost(block):
        return False
    space, red = spatial_size(block), reduce_size(block)
    if needs_multi_level_tiling(block):
        return space <= gpu.max_threads_per_block and space < red
    return red > gpu.warp_size


# ------------------------------------------------------------------------------- rules


def _rule_always_inline(st: DerivationState, b: BlockSpec, hw: Hardware):
    if not is_gpu_inlineable(st.dag, b) or any(c.name in st.tensor_cores for c in st.dag.consumers(b.name)):
        return RuleResult.SKIP, []
    new = st.advance(dag=inline_into_consumers(st.dag, b.name), steps=(*st.steps, InlineStep(b.name)))
    return RuleResult.APPLY_AND_SKIP_REST, [new]


def _rule_tensor_core(st: DerivationState, b: BlockSpec, hw: Hardware):
    if b.name in st.cache_written or not needs_multi_level_tiling(b) or tensor_core_form(st.dag, b, hw.gpu) is None:
        return RuleResult.SKIP, []
    new = st.advance(
        steps=(*st.steps, TensorCoreStep(b.name)), tiled=st.tiled | {b.name}, tensor_cores=st.tensor_cores | {b.name}
    )
    return RuleResult.APPLY_AND_SKIP_REST, [new]


def _rule_cross_thread_reduction(st: DerivationState, b: BlockSpec, hw: Hardware):
    assert hw.gpu is not None
    if b.name in st.cache_written or not needs_cross_thread_reduction(b, hw.gpu):
        return RuleResult.SKIP, []
    new = st.advance(steps=(*st.steps, CrossThreadReductionStep(b.name)), cross_thread=st.cross_thread | {b.name})
    return RuleResult.APPLY, [new]


def _rule_add_cache_write(st: DerivationState, b: BlockSpec, hw: Hardware):
    if b.name in st.cache_written or not needs_multi_level_tiling(b):
        return RuleResult.SKIP, []
    dag = apply_cache_write(st.dag, b.name, "local")
    steps: tuple[Step, ...] = (*st.steps, CacheWriteStep(b.name, "local"))
    copy_name, _ = cache_write_names(st.dag, b.name, "local")
    epilogue = fusible_consumer(dag, dag.block(copy_name))
    if epilogue is not None:  # the epilogue reads the registers: the write-back goes
        dag = inline_into_consumers(dag, copy_name)
        steps = (*steps, InlineStep(copy_name))
    new = DerivationState(
        dag, steps, st.pending, st.cache_written | {b.name}, st.tiled, st.fused, st.rfactored, st.cross_thread
    )  # not advanced: the block is visited again and gets tiling with fusion
    return RuleResult.APPLY_AND_SKIP_REST, [new]


def _rule_tiling_with_fusion(st: DerivationState, b: BlockSpec, hw: Hardware):
    if not needs_multi_level_tiling(b) or b.name not in st.cache_written:
        return RuleResult.SKIP, []
    consumer = fusible_consumer(st.dag, b)
    if consumer is None:
        return RuleResult.SKIP, []
    # Bound right after tiling: TVM relaxes the thread loops of a shared stage's region
    # only when they are bound before the stage is computed at its tile.
    steps: list[Step] = [TileStep(b.name, GPU_TILE_STRUCTURE), ThreadBindStep(b.name)]
    for buf in _cached_reads(st, b):
        steps.append(CacheReadStep(b.name, buf))
    steps.append(FuseConsumerStep(consumer.name, b.name, GPU_FUSE_LEVEL))
    new = st.advance(
        steps=(*st.steps, *steps),
        tiled=st.tiled | {b.name},
        fused=st.fused | {consumer.name},
    )
    return RuleResult.APPLY_AND_SKIP_REST, [new]


def _cached_reads(st: DerivationState, b: BlockSpec) -> list[str]:
    """The buffers a tiled block stages in shared memory: each one it reads, once (TVM
    names the stage `<buffer>_shared`, so a buffer another tiled block already stages
    is left in global memory here)."""
    taken = {s.buffer for s in st.steps if isinstance(s, CacheReadStep)}
    out: list[str] = []
    for acc in b.reads:
        if acc.buffer not in out and acc.buffer not in taken and st.dag.buffer(acc.buffer).scope == "global":
            out.append(acc.buffer)
    return out


GPU_RULES = (
    _rule_always_inline,
    _rule_tensor_core,
    _rule_cross_thread_reduction,
    _rule_add_cache_write,
    _rule_tiling_with_fusion,
    rule_skip,
)


def finish_gpu(st: DerivationState) -> Sketch:
    """A ThreadBindStep for every block not tiled (those are bound when tiled), in
    program order; the shared-memory stages are bound with their block's threads."""
    return Sketch((*st.steps, *(ThreadBindStep(b.name) for b in st.dag.blocks if b.name not in st.tiled)))
