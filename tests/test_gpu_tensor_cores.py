"""Tensor cores (sm_70+, float16 inputs, float32 accumulation), without a GPU: which
blocks get the tensor-core sketch, the sampled programs stay within the GPU's limits and
use the memory the model says, replay from their traces, mutate and rebuild, have
features, and build with nvcc into wmma kernels (HMMA in the SASS where cuobjdump is
installed). On a GPU machine, random tensor-core programs run and match the reference.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
import tvm
import tvm_ffi
from gpu_machine import LOCAL_GPU, needs_nvcc

from tunefarm import cuda, wmma
from tunefarm.gpu import STATIC_SHARED_MEMORY_BYTES, GpuLimits
from tunefarm.measure.builder import build_module
from tunefarm.search.features import batch_features, feature_names, feature_width, slog
from tunefarm.search.space.dag import analyse
from tunefarm.search.space.loopnest_tensor_core import FRAGMENT_REGISTER_SHARE, FRAGMENT_REGISTERS
from tunefarm.search.space.program import InvalidProgram
from tunefarm.search.space.program_space import ProgramSpace
from tunefarm.search.space.realize import realize, trace_json
from tunefarm.search.space.rule_set import GpuRules
from tunefarm.search.space.sketch import TensorCoreStep
from tunefarm.workloads import registry

SM61 = {"kind": "cuda", "arch": "sm_61"}
SM70 = {"kind": "cuda", "arch": "sm_70"}
SM75 = {"kind": "cuda", "arch": "sm_75"}
SM80 = {"kind": "cuda", "arch": "sm_80"}
SM90 = {"kind": "cuda", "arch": "sm_90"}

GEMM = ("matmul_fp16", {"M": 256, "N": 256, "K": 256})
DENSE = ("dense_fp16", {"M": 64, "N": 128, "K": 256})  # the right operand transposed
BATCH = ("batch_matmul_fp16", {"B": 4, "M": 64, "N": 64, "K": 64})
CASES = [GEMM, DENSE, BATCH]


def _space(case, target) -> ProgramSpace:
    op, shape = case
    rules = GpuRules(GpuLimits.of(target))
    dag = analyse(registry.make(op, shape).mod["main"])
    return ProgramSpace(dag, rules.sketches(dag), rules)


def _has_tensor_cores(space: ProgramSpace) -> bool:
    return any(isinstance(s, TensorCoreStep) for sk in space.sketches for s in sk.steps)


def _lowered(mod, target):
    pipeline = tvm.tirx.get_tir_pipeline("default")[0]
    with cuda.lowering(target):
        lowered = pipeline(tvm.tirx.transform.BindTarget(cuda.tvm_target(target))(mod))
    return [f for f in lowered.functions.values() if f.attrs is not None and f.attrs["target"].kind.name == "cuda"]


def _allocations(func) -> dict[str, int]:
    """{scope: bytes} of a lowered kernel's buffers."""
    found = []
    tvm_ffi.structural_walk(func.body, (tvm.tirx.AllocBuffer, found.append))
    out: dict[str, int] = {}
    for node in found:
        buf = node.buffer
        n = 1
        for s in buf.shape:
            n *= int(s)
        out[buf.scope()] = out.get(buf.scope(), 0) + n * tvm.DataType(str(buf.dtype)).bits // 8
    return out


def test_only_float16_gemms_on_sm_70_and_newer_get_the_tensor_core_sketch():
    """The tensor-core sketch is the only sketch of a float16 -> float32 GEMM on sm_70,
    sm_75, sm_80 and sm_90; an sm_61 target, a float32 GEMM, and a float16 GEMM whose
    extents are not multiples of 16 keep the SIMT sketches (no tensor-core step)."""
    for target in (SM70, SM75, SM80, SM90):
        for case in CASES:
            space = _space(case, target)
            assert len(space.sketches) == 1 and _has_tensor_cores(space), (case, target)
    assert not _has_tensor_cores(_space(GEMM, SM61))
    for op, shape in [("matmul", {"M": 256, "N": 256, "K": 256}), ("batch_matmul", BATCH[1]), ("matmul_relu", {})]:
        space = _space((op, shape), SM90)
        assert not _has_tensor_cores(space) and not any("tensor-core" in d for sk in space.sketches for d in sk.describe())
    assert not _has_tensor_cores(_space(("matmul_fp16", {"M": 100, "N": 256, "K": 256}), SM80))


def test_float32_sketch_signatures_are_unchanged():
    """The signatures records of float32 programs are matched by, as the GPU rules gave
    them before the tensor-core rule (computed then)."""
    expected = {"matmul": "3182901fb1a9", "matmul_relu": "aad17686cbd6", "conv2d": "c6bb5850b67e"}
    for op, signature in expected.items():
        shape = {"M": 256, "N": 256, "K": 256} if op == "matmul" else {}
        assert [sk.signature for sk in _space((op, shape), SM80).sketches] == [signature], op


@pytest.mark.parametrize("target", [SM70, SM80, SM90], ids=["sm_70", "sm_80", "sm_90"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tensor_core_programs_verify_and_use_the_memory_the_model_says(case, target):
    """Samples of the tensor-core space: every draw valid; each realized program lowers,
    passes TVM's GPU verifier, allocates exactly the shared memory the model counted
    (padded rows, `depth` copies; dynamic exactly where it passes 48 KB on sm_80+), its
    fragments within the model's register budget, and threads in whole warps."""
    space = _space(case, target)
    gpu = space.rules.gpu
    samples = space.sample_many(40, random.Random(3))
    assert len(samples) == 40 and space.invalid_draws == 0
    depths = {b.candidate.as_dict().get("C.pipeline", 0) for b in samples}
    assert depths == ({0, 1, 2, 3} if gpu.async_copy else {0})
    wl = registry.make(*case)
    seen_dynamic = False
    for b in samples[:6] + [max(samples, key=lambda b: b.program.kernel_bytes("C", "shared"))]:
        prog = b.program
        nest = prog.nests["C"]
        assert nest.threads % gpu.warp_size == 0 and nest.threads <= gpu.max_threads_per_block
        shared = prog.kernel_bytes("C", "shared")
        assert shared <= gpu.max_shared_memory_per_block
        budget = min(gpu.max_registers_per_thread, gpu.registers_per_block // nest.threads)
        fragments = prog.kernel_bytes("C", "wmma.accumulator") // 1024 + (
            prog.kernel_bytes("C", "wmma.matrix_a") + prog.kernel_bytes("C", "wmma.matrix_b")
        ) // 512  # 16 x 16 float32 / float16
        assert FRAGMENT_REGISTERS * fragments <= FRAGMENT_REGISTER_SHARE * budget
        (kernel,) = _lowered(realize(wl.mod, prog.instructions).mod, target)
        assert tvm.s_tir.analysis.verify_gpu_code(kernel, gpu.verifier_constraints())
        alloc = _allocations(kernel)
        dynamic = gpu.async_copy and shared > STATIC_SHARED_MEMORY_BYTES
        scope = "shared.dyn" if dynamic else "shared"
        assert {k: v for k, v in alloc.items() if k.startswith("shared")} == {scope: shared}, b.candidate.as_dict()
        assert {k: v for k, v in alloc.items() if k.startswith("wmma.")} == {
            s: prog.kernel_bytes("C", s) for s in ("wmma.matrix_a", "wmma.matrix_b", "wmma.accumulator")
        }
        seen_dynamic |= dynamic
    assert seen_dynamic or not gpu.async_copy or case is not GEMM  # the largest GEMM stages pass 48 KB


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tensor_core_programs_replay_from_their_traces(case):
    """The trace of a realized program (pipelined ones included), as JSON, replays on a
    fresh schedule of the workload into the same module."""
    space = _space(case, SM80)
    wl = registry.make(*case)
    for b in space.sample_many(4, random.Random(5)):
        sch = realize(wl.mod, b.program.instructions)
        text = json.dumps(trace_json(sch))
        assert wmma.uses_wmma(json.loads(text))
        replayed = tvm.s_tir.Schedule(wl.mod)
        tvm.s_tir.Trace.apply_json_to_schedule(json.loads(text), replayed)
        assert tvm_ffi.structural_equal(replayed.mod, sch.mod)


def test_tensor_core_programs_mutate_rebuild_and_have_features():
    """Mutation (tile sizes, pipeline depth, vectors, unroll) gives valid programs of
    the same sketch; a program rebuilds from its decisions alone; the features are
    finite rows of the GPU layout, one per store."""
    space = _space(GEMM, SM80)
    rng = random.Random(7)
    parents = space.sample_many(20, rng)
    weights = {"tile": 0.7, "pipeline": 0.1, "unroll": 0.1, "threads": 0.1}
    children = [c for c in (space.mutate(p, rng, weights) for p in parents * 3) if c is not None]
    assert len(children) >= 40
    tiles_changed = 0
    for parent, child in zip(parents * 3, children):
        rebuilt = space.rebuild(child.candidate)
        assert rebuilt is not None and rebuilt.program.instructions == child.program.instructions
        tiles_changed += any(
            child.candidate.as_dict()[s] != parent.candidate.as_dict()[s] for s in child.candidate.as_dict() if ".tile." in s
        )
    assert tiles_changed > 10
    version = space.rules.feature_version
    feats = batch_features([b.program for b in children], version, space.rules.gpu)
    col = {n: i for i, n in enumerate(feature_names(version))}
    for b, f in zip(children, feats):
        assert f.shape == (len(b.program.stores()), feature_width(version)) and np.isfinite(f).all()
        stores = b.program.stores()
        update = next(i for i, st in enumerate(stores) if st.block == "C" and not st.is_init)
        assert f[update, col["tensor_core"]] == 1 and f[update, col["fragment_bytes"]] > 0
        warps = b.program.nests["C"].threads // 32
        assert f[update, col["warps_len"]] == pytest.approx(slog(warps))
        assert f[update, col["float_mul"]] == pytest.approx(slog(256**3), rel=1e-6)  # every product, once
        shared_stage = next(i for i, st in enumerate(stores) if st.block == "A_shared")
        assert f[shared_stage, col["tensor_core"]] == 0


def test_the_tuner_proposes_tensor_core_programs_that_replay():
    """The evolutionary search (random cost model) over a float16 GEMM on sm_90: every
    program it proposes is a tensor-core one whose trace replays in a fresh schedule."""
    from tunefarm.search.config import TuneConfig
    from tunefarm.search.cost_model.random_model import RandomCostModel
    from tunefarm.search.task import make_task
    from tunefarm.search.tuner import TaskTuner

    wl = registry.make("matmul_fp16", {"M": 512, "N": 512, "K": 512})
    tuner = TaskTuner(make_task(wl, SM90), TuneConfig(trials=8, batch_size=8), RandomCostModel(seed=1))
    proposal = tuner.propose(8)
    assert len(proposal.inputs) == 8
    for inp in proposal.inputs:
        assert wmma.uses_wmma(inp.trace)
        sch = tvm.s_tir.Schedule(wl.mod)
        tvm.s_tir.Trace.apply_json_to_schedule(inp.trace, sch)


def test_reduced_precision_bench_ops_run_only_when_named():
    from tunefarm_app.bench.suite import select_ops

    assert not any(op.registry.endswith("_fp16") for op in select_ops(None))
    (op,) = select_ops("gemm1024_fp16")
    wl = op.workload()
    assert [t.dtype for t in wl.inputs] == ["float16", "float16"] and wl.outputs[0].dtype == "float32"
    rules = GpuRules(GpuLimits.of(SM90))
    (sketch,) = rules.sketches(analyse(wl.mod["main"], wl.constants))
    assert isinstance(sketch.steps[0], TensorCoreStep)


def test_a_tiling_over_the_limits_is_rejected_and_repaired():
    """Given tile sizes that need more than 1024 threads (64 warps) are rejected; a
    mutation that breaks the limits is repaired around the mutated slot."""
    space = _space(("matmul_fp16", {"M": 1024, "N": 1024, "K": 1024}), SM80)
    b = space.sample_many(1, random.Random(1))[0]
    decisions = {**b.candidate.as_dict(), "C.tile.v_i0": (1, 8, 1, 8), "C.tile.v_i1": (1, 8, 8, 1)}
    with pytest.raises(InvalidProgram, match="threads per block"):
        space.build(0, decisions)
    repaired = space._repair(0, decisions, "C.tile.v_i0", random.Random(0))
    assert repaired is not None and repaired.candidate.as_dict()["C.tile.v_i0"] == (1, 8, 1, 8)
    assert repaired.program.nests["C"].threads <= 1024


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found and shutil.which("nvdisasm"):
        return found
    nvcc = cuda.nvcc_path()
    if nvcc and Path(nvcc).with_name("cuobjdump").is_file() and Path(nvcc).with_name("nvdisasm").is_file():
        return str(Path(nvcc).with_name("cuobjdump"))
    return None


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tensor_core_programs_build_into_wmma_kernels(arch, tmp_path):
    """The build worker's path (replay the trace in a fresh module, verify, compile, nvcc
    for the arch) for tensor-core GEMMs, one of them pipelined (cp.async) in dynamic
    shared memory, and a transposed-operand dense layer: the kernel source multiplies
    with wmma::mma_sync on fragments loaded with load_matrix_sync (HMMA in the SASS
    where cuobjdump is installed)."""
    target = {"kind": "cuda", "arch": arch}
    progs = []
    gemm = _space(GEMM, target)
    samples = gemm.sample_many(30, random.Random(11))
    pipelined = max(
        (b for b in samples if b.candidate.as_dict()["C.pipeline"] > 0), key=lambda b: b.program.kernel_bytes("C", "shared")
    )
    progs.append((GEMM, gemm.build(0, {**pipelined.candidate.as_dict(), "C.unroll": 0}).program))
    dense = _space(DENSE, target).sample_many(1, random.Random(12))[0]
    progs.append((DENSE, dense.program))
    for i, ((op, shape), prog) in enumerate(progs):
        wl = registry.make(op, shape)
        wl_path = tmp_path / f"{op}.json"
        wl_path.write_text(wl.to_json())
        out = tmp_path / f"{op}-{i}{cuda.CUDA_KERNEL_SUFFIX}"
        build_module(str(wl_path), trace_json(realize(wl.mod, prog.instructions)), target, str(out))
        with tarfile.open(out) as tar:
            source = tar.extractfile("kernel.cu").read().decode()
            fatbin = tar.extractfile("kernel.fatbin").read()
        assert "wmma::mma_sync" in source and "wmma::load_matrix_sync" in source, (op, i)
        assert "wmma::store_matrix_sync" in source and "wmma::fill_fragment" in source
        if i == 0:  # the pipelined one
            assert "cp.async" in source
            if prog.kernel_bytes("C", "shared") > STATIC_SHARED_MEMORY_BYTES:
                assert "extern __shared__" in source
        tool = _cuobjdump()
        if tool is not None:
            binary = tmp_path / f"k{i}.fatbin"
            binary.write_bytes(fatbin)
            sass = subprocess.run([tool, "-sass", str(binary)], capture_output=True, text=True, check=True).stdout
            assert "HMMA" in sass, (op, i)


# -- on a machine with a GPU (skipped elsewhere, CI included) ---------------------------------



@needs_nvcc
@pytest.mark.skipif(
    LOCAL_GPU is None or not GpuLimits.of(LOCAL_GPU).tensor_cores, reason="needs an sm_70+ GPU (runs on a GPU machine)"
)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_on_a_gpu_random_tensor_core_programs_match_the_reference(case, tmp_path):
    """Random tensor-core programs (every pipeline depth the GPU allows) built for this
    GPU and run by the agent's runner: their float32 outputs match the float64 reference
    of the float16 inputs within the runner's tolerance (products of float16s are exact
    in float32; only the accumulation rounds)."""
    from tunefarm.measure.runner import LocalRunner
    from tunefarm.measure.task_data import write_task_data
    from tunefarm.records import RunInput, TimingConfig

    op, shape = case
    wl = registry.make(op, shape)
    space = _space(case, LOCAL_GPU)
    data = tmp_path / "data.npz"
    write_task_data(data, wl, seed=0, with_expected=True)
    wl_path = tmp_path / "wl.json"
    wl_path.write_text(wl.to_json())
    inputs = []
    for i, b in enumerate(space.sample_many(6, random.Random(21))):
        artifact = tmp_path / f"{op}-{i}{cuda.CUDA_KERNEL_SUFFIX}"
        build_module(str(wl_path), trace_json(realize(wl.mod, b.program.instructions)), LOCAL_GPU, str(artifact))
        inputs.append(RunInput(f"k{i}", str(artifact), str(data), len(wl.inputs), len(wl.outputs), True, TimingConfig(repeat=1)))
    runner = LocalRunner(1)
    try:
        results = runner.run(inputs)
    finally:
        runner.close()
    for res in results:
        assert not res.error_kind.is_error and res.verified, (res.candidate_key, res.error_msg)
