"""The NVIDIA rule set: GPU sketches, the loop-nest model against TVM's schedules, and
the validity checks (no GPU needed: nothing here runs a kernel)."""

from __future__ import annotations

import random

import pytest

from tunefarm.errors import TargetError
from tunefarm.gpu import GpuLimits
from tunefarm.search.features import (
    GPU_FEATURE_NAMES,
    GPU_FEATURE_VERSION,
    NUM_FEATURES,
    batch_features,
    feature_width,
    program_features,
    slog,
)
from tunefarm.search.space.dag import analyse
from tunefarm.search.space.program import InvalidProgram, expected_tvm_loops
from tunefarm.search.space.realize import loop_structure, realize
from tunefarm.search.space.rule_set import CpuRules, GpuRules, rule_set_for
from tunefarm.search.space.sketch import (
    CacheReadStep,
    CacheWriteStep,
    CrossThreadReductionStep,
    FuseConsumerStep,
    InlineStep,
    ThreadBindStep,
    TileStep,
)
from tunefarm.search.space.slots import Decider
from tunefarm.workloads import registry

SM80 = {"kind": "cuda", "arch": "sm_80"}
RULES = GpuRules(GpuLimits.of(SM80))

SMALL = {
    "matmul_relu": {"M": 64, "N": 64, "K": 32},
    "batch_matmul": {"B": 2, "M": 32, "N": 64, "K": 16},
    "conv2d": {"N": 1, "C": 8, "H": 14, "W": 14, "F": 32},
    "depthwise_conv2d": {"N": 1, "C": 16, "H": 16, "W": 16},
    "softmax": {"B": 2, "M": 8, "N": 128},
    "layer_norm": {"M": 8, "N": 256},
    "norm2": {"M": 32, "N": 64},
}


def _dag(op: str):
    wl = registry.make(op, SMALL[op])
    return wl, analyse(wl.mod["main"])


def sample_valid(dag, sketch, rng, tries: int = 400):
    """A random valid program of `sketch` (invalid draws skipped, as the sampler does)."""
    for _ in range(tries):
        decider = Decider(None, rng)
        try:
            return decider, RULES.build(dag, sketch, decider)
        except InvalidProgram:
            continue
    raise AssertionError("no valid program")


def test_rule_set_follows_the_target_kind():
    assert isinstance(rule_set_for(SM80), GpuRules)
    assert isinstance(rule_set_for({"kind": "llvm", "num-cores": 2}), CpuRules)
    with pytest.raises(TargetError, match="arch"):
        rule_set_for({"kind": "cuda"})


def test_gemm_with_epilogue_gets_the_gpu_structure():
    """Register cache whose write-back is inlined into the epilogue, SSSRRSRS tiling
    bound right away, both operands staged in shared memory, the epilogue fused at the
    threadIdx level."""
    _, dag = _dag("matmul_relu")
    (sketch,) = RULES.sketches(dag)
    assert sketch.steps == (
        CacheWriteStep("C", "local"),
        InlineStep("C_local"),
        TileStep("C", "SSSRRSRS"),
        ThreadBindStep("C"),
        CacheReadStep("C", "A"),
        CacheReadStep("C", "B"),
        FuseConsumerStep("relu", "C", 3),
        ThreadBindStep("relu"),
    )


def test_conv2d_stages_both_operands_and_inlines_padding_into_the_stage():
    """The padded input is staged, then the padding block is inlined into the stage: the
    shared tile holds the halo with its zeros and the inner loop has no branch."""
    _, dag = _dag("conv2d")
    (sketch,) = RULES.sketches(dag)
    steps = list(sketch.steps)
    assert {s.buffer for s in steps if isinstance(s, CacheReadStep)} == {"pad", "weight"}
    assert steps.index(InlineStep("pad")) > steps.index(CacheReadStep("conv2d", "pad"))


def test_reductions_with_little_parallelism_get_a_cross_thread_sketch():
    _, dag = _dag("layer_norm")
    sketches = RULES.sketches(dag)
    crossed = [{s.block for s in sk.steps if isinstance(s, CrossThreadReductionStep)} for sk in sketches]
    assert set() in crossed and any(crossed)  # with and without, per Ansor's kApply


@pytest.mark.parametrize("op", sorted(SMALL))
def test_model_loops_match_tvm_on_gpu_schedules(op):
    """The model's loops (extents and thread axes) are TVM's, block by block."""
    wl, dag = _dag(op)
    sketches = RULES.sketches(dag)
    rng = random.Random(11)
    for i in range(2 * len(sketches) + 2):
        decider, prog = sample_valid(dag, sketches[i % len(sketches)], rng)
        sch = realize(wl.mod, prog.instructions)
        assert loop_structure(sch) == expected_tvm_loops(prog), (op, decider.decisions)


def _gemm_decisions(**over):
    base = {
        "C.tile.v_i": (2, 2, 8, 2, 1),
        "C.tile.v_j": (2, 1, 8, 1, 4),
        "C.tile.v_k": (4, 2, 4),
        "A_shared.vector": 0,
        "B_shared.vector": 0,
        "C.unroll": 0,
    }
    base.update(over)
    return base


def test_validity_checks_reject_what_cannot_launch():
    _, dag = _dag("matmul_relu")
    (sketch,) = RULES.sketches(dag)
    prog = RULES.build(dag, sketch, Decider(_gemm_decisions()))
    assert prog.nests["C"].threads == 64
    too_many_threads = _gemm_decisions(**{"C.tile.v_i": (1, 1, 64, 1, 1), "C.tile.v_j": (1, 1, 32, 1, 2)})
    with pytest.raises(InvalidProgram, match="threads per block"):
        RULES.build(dag, sketch, Decider(too_many_threads))
    too_few = _gemm_decisions(**{"C.tile.v_i": (8, 2, 2, 2, 1), "C.tile.v_j": (8, 1, 2, 1, 4)})
    with pytest.raises(InvalidProgram, match="less than a warp"):
        RULES.build(dag, sketch, Decider(too_few))
    vthreads = _gemm_decisions(**{"C.tile.v_i": (1, 4, 8, 2, 1), "C.tile.v_j": (1, 4, 4, 1, 4)})
    with pytest.raises(InvalidProgram, match="virtual threads"):
        RULES.build(dag, sketch, Decider(vthreads))


def test_shared_memory_and_registers_are_checked():
    wl = registry.make("matmul", {"M": 1024, "N": 1024, "K": 1024})
    dag = analyse(wl.mod["main"])
    (sketch,) = RULES.sketches(dag)
    d = {
        "C.tile.v_i": (8, 1, 16, 8, 1),
        "C.tile.v_j": (8, 1, 16, 1, 8),
        "C.tile.v_k": (4, 64, 4),  # A and B tiles of 128 x 256 floats: 256 KB of shared memory
        "A_shared.vector": 0,
        "B_shared.vector": 0,
        "C.unroll": 0,
    }
    with pytest.raises(InvalidProgram, match="shared memory"):
        RULES.build(dag, sketch, Decider(d))
    d.update({"C.tile.v_k": (256, 1, 4), "C.tile.v_i": (8, 1, 8, 16, 1), "C.tile.v_j": (8, 1, 4, 1, 32)})
    with pytest.raises(InvalidProgram, match="accumulator registers"):
        RULES.build(dag, sketch, Decider(d))
    d.update({"C.tile.v_i": (8, 1, 16, 8, 1), "C.tile.v_j": (8, 1, 16, 1, 8)})
    prog = RULES.build(dag, sketch, Decider(d))
    assert prog.kernel_bytes("C", "shared") == (128 * 4 + 4 * 128) * 4
    assert prog.kernel_bytes("C", "local") == 64 * 4


def test_cooperative_fetch_vectors_only_where_aligned():
    """A float4 fetch needs the tile's innermost extent and start to be multiples of 4;
    a padded convolution's input tile starts at -1, so it is fetched by scalars."""
    _, dag = _dag("matmul_relu")
    (sketch,) = RULES.sketches(dag)
    d = Decider(_gemm_decisions(**{"B_shared.vector": 2}))
    prog = RULES.build(dag, sketch, d)
    fetch = [i for i in prog.instructions if i.op == "coop_fetch" and i.block == "B_shared"]
    assert fetch and fetch[0].args[-1] == 4
    _, conv = _dag("conv2d")
    (csk,) = RULES.sketches(conv)
    rng = random.Random(5)
    for _ in range(5):
        decider, cprog = sample_valid(conv, csk, rng)
        assert decider.domains["pad_shared.vector"].n == 1


def test_gpu_feature_rows_are_the_cpu_layout_plus_the_gpu_group():
    """GPU rows: version 1's columns, then blockIdx / vthread / threadIdx lengths and the
    kernel's shared and local memory, then coalescing, bank conflicts, occupancy and
    waves, then the tensor-core group (zero but for the warps' 1 on a SIMT kernel). CPU
    rows keep version 1's width."""
    _, dag = _dag("matmul_relu")
    (sketch,) = RULES.sketches(dag)
    prog = RULES.build(dag, sketch, Decider(_gemm_decisions()))
    rows = program_features(prog, GPU_FEATURE_VERSION)
    assert rows.shape == (len(prog.stores()), feature_width(GPU_FEATURE_VERSION))
    assert feature_width(GPU_FEATURE_VERSION) == NUM_FEATURES + 8 + 7 + 3
    col = {n: i for i, n in enumerate(GPU_FEATURE_NAMES)}
    at = next(i for i, st in enumerate(prog.stores()) if st.block == "C" and not st.is_init)
    c = rows[at]
    assert c[col["is_gpu"]] == 1
    assert c[col["blockIdx_len"]] == pytest.approx(slog(4))  # (2 * 2) blocks
    assert c[col["vthread_len"]] == pytest.approx(slog(2))
    assert c[col["threadIdx_len"]] == pytest.approx(slog(64))  # 8 x 8 threads
    assert c[col["shared_bytes"]] == pytest.approx(slog((32 * 8 + 8 * 32) * 4))  # A and B tiles
    assert c[col["local_bytes"]] == pytest.approx(slog(2 * 2 * 4 * 4))  # 16 accumulators
    stage = next(i for i, st in enumerate(prog.stores()) if st.block == "A_shared")
    assert rows[stage][col["writes_shared"]] == 1 and c[col["writes_local"]] == 1
    assert (c[col["tensor_core"]], c[col["warps_len"]], c[col["fragment_bytes"]]) == (0, pytest.approx(slog(1)), 0)
    cpu_wl = registry.make("matmul", {"M": 64, "N": 64, "K": 64})
    cpu_dag = analyse(cpu_wl.mod["main"])
    cpu = CpuRules(2)
    cpu_prog = cpu.build(cpu_dag, cpu.sketches(cpu_dag)[0], Decider(None, random.Random(1)))
    assert program_features(cpu_prog).shape[1] == NUM_FEATURES
    rng = random.Random(4)
    progs = [sample_valid(dag, sketch, rng)[1] for _ in range(4)]
    for p, m in zip(progs, batch_features(progs, GPU_FEATURE_VERSION)):
        assert (m == program_features(p, GPU_FEATURE_VERSION)).all()


def test_gpu_mutation_changes_gpu_slots():
    """The evolution's mutation on a GPU space: tile sizes, unroll and threads."""
    from tunefarm.search.config import SearchConfig
    from tunefarm.search.space.program_space import ProgramSpace, slot_kind

    _, dag = _dag("layer_norm")
    space = ProgramSpace(dag, RULES.sketches(dag), RULES)
    weights = RULES.mutation_weights(SearchConfig())
    assert weights == SearchConfig().gpu_mutation_weights
    rng = random.Random(2)
    parents = space.sample_many(8, rng)
    changed = set()
    for p in parents:
        for _ in range(6):
            child = space.mutate(p, rng, weights)
            if child is not None:
                a, b = p.candidate.as_dict(), child.candidate.as_dict()
                changed |= {slot_kind(s) for s in a if a[s] != b.get(s)}
    assert {"threads", "unroll"} <= changed


# -- sampling valid programs directly ----------------------------------------------------------


WHOLE_MODEL_SHAPES = {
    "gemm1024": ("matmul", {"M": 1024, "N": 1024, "K": 1024}),
    "conv2d": ("conv2d", {"N": 1, "C": 64, "H": 56, "W": 56, "F": 64}),
    "conv2d_nhwc": ("conv2d_nhwc", {"N": 1, "C": 128, "H": 28, "W": 28, "F": 128}),
    "bmm": ("batch_matmul", {"B": 12, "M": 128, "N": 128, "K": 64}),
    "dense_m16": ("matmul", {"M": 16, "N": 4096, "K": 1024}),
    "softmax": ("softmax", {"B": 12, "M": 128, "N": 128}),
    "layer_norm": ("layer_norm", {"M": 128, "N": 768}),
}
"""Layers of the NVIDIA whole models: a GEMM, a ResNet convolution in both layouts, an
attention batch matmul, a dense layer with few rows, and the memory-bound reductions."""


def _space(name: str, arch: str, **limits):
    from tunefarm.search.space.program_space import ProgramSpace

    op, shape = WHOLE_MODEL_SHAPES[name]
    rules = GpuRules(GpuLimits.of({"kind": "cuda", "arch": arch, **limits}))
    dag = analyse(registry.make(op, shape).mod["main"])
    return ProgramSpace(dag, rules.sketches(dag), rules)


def _tiled_roots(prog) -> list[str]:
    return [n for n in prog.order if prog.nests[n].tiled and prog.nests[n].attach is None]


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("name", list(WHOLE_MODEL_SHAPES))
def test_fresh_gpu_samples_are_valid_programs(name, arch):
    """Tile sizes are drawn one level at a time, each level among its options that still
    leave a valid program (threads in [warp, max], vthreads, registers, then shared
    memory), so no fresh sample is invalid (`ProgramSpace.sample` counts the invalid
    ones). The draws still spread: many thread counts and tilings."""
    space = _space(name, arch)
    rng = random.Random(3)
    samples = [space.sample(rng) for _ in range(200)]
    assert space.invalid_draws == 0 and None not in samples
    threads = {b.program.nests[n].threads for b in samples for n in b.program.order if b.program.nests[n].threads}
    assert len(threads) >= 4
    if any(_tiled_roots(b.program) for b in samples):
        assert len({b.candidate.key for b in samples}) >= 190


def test_fresh_samples_fit_tighter_limits_a_target_declares():
    """The same where a target declares smaller limits (fewer threads, less shared
    memory and registers per block): the draw is conditioned on the GPU's limits, not
    on defaults."""
    space = _space("gemm1024", "sm_90", max_threads_per_block=128, max_shared_memory_per_block=8192,
                   registers_per_block=8192)  # fmt: skip
    rng = random.Random(5)
    for _ in range(100):
        b = space.sample(rng)
        assert b is not None
        assert b.program.nests["C"].threads <= 128 and b.program.kernel_bytes("C", "shared") <= 8192


def test_half_the_thread_draws_are_whole_warps():
    """A preference, not a rule: half the thread-level draws are made among the thread
    counts that are whole warps, so a convolution whose extents (28 = 4 x 7) give many
    other counts still mostly gets whole warps (55% of kernels with uniform draws), and
    some that are not."""
    space = _space("conv2d_nhwc", "sm_90")
    rng = random.Random(4)
    threads = [b.program.nests[n].threads for b in space.sample_many(200, rng) for n in _tiled_roots(b.program)]
    whole = sum(t % 32 == 0 for t in threads) / len(threads)
    assert 0.7 <= whole < 1.0


def test_samples_rebuild_from_their_decisions_unchanged_and_repeat_with_the_seed():
    """A measured program is rebuilt from its decisions without a random source (records,
    the build worker): the tile draw takes given decisions as they are, so the rebuild
    is the same program; and with a random source every given slot is kept too. The
    same seed gives the same samples."""
    for name in ("gemm1024", "conv2d", "dense_m16"):
        space = _space(name, "sm_90")
        first = [space.sample(random.Random(seed)) for seed in range(20)]
        again = [space.sample(random.Random(seed)) for seed in range(20)]
        assert [b.candidate.key for b in first] == [b.candidate.key for b in again]
        for b in first:
            rebuilt = space.rebuild(b.candidate)
            assert rebuilt is not None and rebuilt.program.instructions == b.program.instructions
            redrawn = space.build(b.candidate.sketch, b.candidate.as_dict(), random.Random(99))
            assert redrawn.candidate.key == b.candidate.key


def test_a_given_reduction_tile_gets_spatial_tiles_that_fit_around_it():
    """The draw around given slots (crossover, a repaired mutation) is conditioned on
    them: on a GPU that declares 48 KB of shared memory per block, a K tile of 1024
    staged in shared memory leaves room only for a 4 x 8 block tile ((4 + 8) x 1024
    floats) with every point a thread and no software pipeline (two copies would not
    fit), and every draw finds it (the spatial levels drawn without regard to shared
    memory found it in none of 64 tries)."""
    space = _space("gemm1024", "sm_90", max_shared_memory_per_block=48 * 1024)
    for seed in range(10):
        b = space.build(0, {"C.tile.v_k": (1, 1024, 1)}, random.Random(seed))
        d = b.candidate.as_dict()
        spans = sorted((d["C.tile.v_i"][1:], d["C.tile.v_j"][1:]))
        assert spans in ([(1, 4, 1, 1), (1, 8, 1, 1)],), d
        assert d["C.pipeline"] == 0 and b.program.kernel_bytes("C", "shared") == 48 * 1024


def test_a_draw_that_nothing_fits_beside_the_given_slots_is_an_invalid_program():
    """Where the given slots leave no valid tiling (a mutated slot with 16 vthreads of
    its own), the draw says so instead of handing over an invalid random tiling."""
    space = _space("gemm1024", "sm_90")
    with pytest.raises(InvalidProgram, match="no tiling fits"):
        space.build(0, {"C.tile.v_i": (1, 16, 64, 1, 1)}, random.Random(0))


@pytest.mark.parametrize("name", ["gemm1024", "conv2d", "conv2d_nhwc", "bmm", "dense_m16"])
def test_mutations_of_valid_gpu_programs_stay_valid(name):
    """A mutation that breaks a limit is repaired around the mutated slot, or another
    value of that slot is tried: of 200 mutations of valid programs at most 1% are
    rejected (none on these seeds; 2-9% were before repair drew around the kept slot
    within every limit and tried other values), and each child rebuilds from its
    decisions alone into a valid program."""
    from tunefarm.search.config import SearchConfig

    space = _space(name, "sm_90")
    rng = random.Random(6)
    parents = space.sample_many(50, rng)
    weights = space.rules.mutation_weights(SearchConfig())
    children = 0
    for _ in range(200):
        child = space.mutate(rng.choice(parents), rng, weights)
        if child is not None:
            children += 1
            assert space.rebuild(child.candidate) is not None
    assert space.invalid_draws <= 2 and children >= 190


def test_a_mutation_that_breaks_the_launch_limits_is_repaired_around_the_mutated_tile():
    """A tile mutation that moves a factor to the thread level can push the block over the
    GPU's threads: the program is repaired (the mutated slot kept, the block's other tile
    slots drawn anew within the limits) rather than thrown away."""
    from tunefarm.search.space.program_space import ProgramSpace

    _, dag = _dag("matmul_relu")
    space = ProgramSpace(dag, RULES.sketches(dag), RULES)
    decisions = _gemm_decisions(**{"C.tile.v_i": (1, 1, 64, 1, 1), "C.tile.v_j": (1, 1, 32, 1, 2)})
    with pytest.raises(InvalidProgram, match="threads per block"):
        space.build(0, decisions)
    repaired = space._repair(0, decisions, "C.tile.v_i", random.Random(0))
    assert repaired is not None
    kept = repaired.candidate.as_dict()
    assert kept["C.tile.v_i"] == (1, 1, 64, 1, 1)
    assert repaired.program.nests["C"].threads <= RULES.gpu.max_threads_per_block
    assert kept["C.tile.v_j"][2] * 64 <= RULES.gpu.max_threads_per_block


def test_gpu_features_see_coalescing_bank_conflicts_occupancy_and_waves():
    """The GEMM's A stage is fetched along threadIdx.x from a row-major global buffer: the
    features count a warp's transactions (4 for consecutive float32s; the stride-K read
    of a transposed fetch needs one per thread); occupancy and waves follow the block's
    threads and count over the GPU's SMs."""
    from tunefarm.search.features import _flat_stride, _occupancy

    h100 = GpuLimits.of({"kind": "cuda", "arch": "sm_90"})
    _, dag = _dag("matmul_relu")
    (sketch,) = RULES.sketches(dag)
    prog = RULES.build(dag, sketch, Decider(_gemm_decisions()))
    rows = program_features(prog, GPU_FEATURE_VERSION, h100)
    col = {n: i for i, n in enumerate(GPU_FEATURE_NAMES)}
    stores = prog.stores()
    for st, row in zip(stores, rows):
        thread = next((lp.key for lp in reversed(st.loops) if lp.kind == "threadIdx.x"), None)
        globals_ = [a for a in st.accesses if a.buffer.scope == "global"]
        if thread is None or not globals_:
            continue
        strides = [abs(_flat_stride(a, thread)) for a in globals_]
        want = max(min(32, -(-(32 * s * 4 if s else 4) // 32)) for s in strides)
        assert row[col["global_transactions"]] == pytest.approx(slog(want)), st.block
        assert row[col["uncoalesced_accesses"]] == pytest.approx(slog(sum(s > 1 for s in strides)))
    c = next(r for st, r in zip(stores, rows) if st.block == "C" and not st.is_init)
    # 64 threads, (2 * 2) blocks on 132 SMs: one partial wave
    assert c[col["waves"]] == pytest.approx(slog(1))
    occupancy, per_sm, waves, efficiency = _occupancy(next(st for st in stores if st.block == "C"), h100)
    # registers bound it: (24 + 16 accumulators) x 64 threads of the SM's 65536
    assert per_sm == 65536 // (40 * 64) and occupancy == pytest.approx(per_sm * 64 / 2048) and waves == 1
    assert efficiency == pytest.approx(4 / (132 * per_sm))
    assert c[col["occupancy"]] == pytest.approx(occupancy)
