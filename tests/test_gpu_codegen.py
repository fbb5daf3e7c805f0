"""CUDA code generation without a GPU: random GPU programs pass TVM's GPU code verifier
and use the shared and local memory the model says; a conv2d and a GEMM compile to
fatbins for sm_80 and sm_90; the running side refuses cleanly where there is no GPU.

Nothing here runs a kernel: that needs an NVIDIA GPU (see tunefarm/measure/runner.py).
"""

from __future__ import annotations

import json
import os
import random
import tarfile

import pytest
import tvm
import tvm_ffi
from gpu_machine import LOCAL_GPU, needs_nvcc

from tunefarm import cuda
from tunefarm.gpu import GpuLimits, gpu_compatible
from tunefarm.measure.builder import BuildError, build_module
from tunefarm.measure.runner import run_kernel
from tunefarm.measure.task_data import write_task_data
from tunefarm.records import RunInput, TimingConfig
from tunefarm.search.space.dag import analyse
from tunefarm.search.space.program import InvalidProgram
from tunefarm.search.space.realize import realize, trace_json
from tunefarm.search.space.rule_set import GpuRules
from tunefarm.search.space.slots import Decider
from tunefarm.workloads import registry

SM80 = {"kind": "cuda", "arch": "sm_80"}
RULES = GpuRules(GpuLimits.of(SM80))
FATBIN_MAGIC = bytes.fromhex("50ed55ba")  # 0xBA55ED50, little-endian

needs_gpu = pytest.mark.skipif(LOCAL_GPU is None, reason="no CUDA GPU on this machine (these run on a GPU machine)")


def _program(op: str, shape: dict, seed: int, unroll: int | None = None, rules: GpuRules = RULES):
    wl = registry.make(op, shape)
    dag = analyse(wl.mod["main"])
    sketches = rules.sketches(dag)
    rng = random.Random(seed)
    while True:
        decider = Decider(None, rng)
        try:
            prog = rules.build(dag, sketches[rng.randrange(len(sketches))], decider)
        except InvalidProgram:
            continue
        if unroll is not None:
            decisions = {k: (0 if k.endswith(".unroll") else v) for k, v in decider.decisions.items()}
            prog = rules.build(dag, sketches[0], Decider(decisions))
        return wl, prog


def _lowered_kernels(mod, target: dict = SM80):
    """The kernels of a scheduled module, lowered as the build worker lowers them."""
    pipeline = tvm.tirx.get_tir_pipeline("default")[0]
    with cuda.lowering(target):
        lowered = pipeline(tvm.tirx.transform.BindTarget(cuda.tvm_target(target))(mod))
    return [f for f in lowered.functions.values() if f.attrs is not None and f.attrs["target"].kind.name == "cuda"]


def _allocated_bytes(func, scope: str) -> int:
    """Bytes of `scope` buffers a lowered kernel allocates ("shared": static and dynamic)."""
    found = []
    tvm_ffi.structural_walk(func.body, (tvm.tirx.AllocBuffer, found.append))
    total = 0
    for node in found:
        buf = node.buffer
        if buf.scope() == scope or (scope == "shared" and buf.scope() == "shared.dyn"):
            n = 1
            for s in buf.shape:
                n *= int(s)
            total += n * tvm.DataType(str(buf.dtype)).bits // 8
    return total


CASES = [
    ("matmul_relu", {"M": 256, "N": 128, "K": 64}),
    ("batch_matmul", {"B": 2, "M": 64, "N": 64, "K": 32}),
    ("conv2d", {"N": 1, "C": 16, "H": 14, "W": 14, "F": 32}),
    ("depthwise_conv2d", {"N": 1, "C": 32, "H": 16, "W": 16}),
    ("softmax", {"B": 2, "M": 16, "N": 256}),
    ("layer_norm", {"M": 16, "N": 512}),
]


@pytest.mark.parametrize("op, shape", CASES, ids=[c[0] for c in CASES])
def test_random_gpu_programs_verify_and_use_the_memory_the_model_says(op, shape):
    """Property: every valid sample of the GPU space lowers, passes TVM's GPU code
    verifier within sm_80's limits, and allocates exactly the shared memory (per block)
    and the registers (per thread) the model's validity checks counted."""
    limits = RULES.gpu.verifier_constraints()
    for seed in range(4):
        _, prog = _program(op, shape, seed=100 + seed)
        sch = realize(registry.make(op, shape).mod, prog.instructions)
        kernels = _lowered_kernels(sch.mod)
        assert kernels
        for k in kernels:
            assert tvm.s_tir.analysis.verify_gpu_code(k, limits), (op, seed)
        roots = [n for n in prog.order if prog.nests[n].attach is None]
        assert len(kernels) == len(roots)
        for k, root in zip(kernels, roots):
            assert _allocated_bytes(k, "shared") == prog.kernel_bytes(root, "shared"), (op, seed, root)
            if prog.nests[root].tiled:
                assert _allocated_bytes(k, "local") == prog.kernel_bytes(root, "local"), (op, seed, root)


SM90 = {"kind": "cuda", "arch": "sm_90"}
AT_THE_LIMITS = [
    ("matmul", {"M": 1024, "N": 1024, "K": 1024}),
    ("conv2d_nhwc", {"N": 1, "C": 128, "H": 28, "W": 28, "F": 128}),
]


def _at_the_limits(op: str, shape: dict, unroll: int | None = None):
    """Of 120 fresh sm_90 samples, the program with the most threads per block and the
    one with the most shared memory (the GPU's limits: 1024 threads, 227 KB), rebuilt
    from their decisions (with auto-unroll 0 when `unroll` is 0: faster to compile)."""
    from tunefarm.search.space.program_space import ProgramSpace

    rules = GpuRules(GpuLimits.of(SM90))
    wl = registry.make(op, shape)
    dag = analyse(wl.mod["main"])
    space = ProgramSpace(dag, rules.sketches(dag), rules)
    samples = space.sample_many(120, random.Random(11))
    root = next(n for n in samples[0].program.order if samples[0].program.nests[n].tiled)
    picks = [
        max(samples, key=lambda b: (b.program.nests[root].threads, b.program.kernel_bytes(root, "shared"))),
        max(samples, key=lambda b: (b.program.kernel_bytes(root, "shared"), b.program.nests[root].threads)),
    ]
    progs = []
    for b in picks:
        decisions = b.candidate.as_dict()
        if unroll is not None:
            decisions = {k: (unroll if k.endswith(".unroll") else v) for k, v in decisions.items()}
        progs.append(space.build(b.candidate.sketch, decisions).program)
    return wl, root, progs


@pytest.mark.parametrize("op, shape", AT_THE_LIMITS, ids=[c[0] for c in AT_THE_LIMITS])
def test_sampled_programs_at_the_limits_pass_the_verifier_with_the_memory_the_model_says(op, shape):
    """The tile draw reaches the GPU's limits (a block of 1024 threads, software-pipelined
    shared stages of over 128 KB, dynamic shared memory) and what it draws there is still
    a kernel TVM's verifier accepts within sm_90's limits, allocating the shared memory
    and registers the model counted."""
    wl, root, progs = _at_the_limits(op, shape)
    assert progs[0].nests[root].threads == 1024
    assert progs[1].kernel_bytes(root, "shared") >= 128 * 1024
    limits = GpuLimits.of(SM90).verifier_constraints()
    for prog in progs:
        (kernel,) = _lowered_kernels(realize(wl.mod, prog.instructions).mod, SM90)
        assert tvm.s_tir.analysis.verify_gpu_code(kernel, limits)
        assert _allocated_bytes(kernel, "shared") == prog.kernel_bytes(root, "shared")
        assert _allocated_bytes(kernel, "local") == prog.kernel_bytes(root, "local")


@needs_nvcc
def test_sampled_gemms_at_the_limits_compile_for_sm_90(tmp_path):
    """The build worker's path for those GEMMs: replay, verify, nvcc for sm_90."""
    op, shape = AT_THE_LIMITS[0]
    wl, _, progs = _at_the_limits(op, shape, unroll=0)
    wl_path = tmp_path / "wl.json"
    wl_path.write_text(wl.to_json())
    for i, prog in enumerate(progs):
        out = tmp_path / f"{op}-{i}{cuda.CUDA_KERNEL_SUFFIX}"
        build_module(str(wl_path), trace_json(realize(wl.mod, prog.instructions)), SM90, str(out))
        assert cuda.read_manifest(out)["arch"] == "sm_90"


def test_the_verifier_rejects_a_kernel_over_the_limits(tmp_path):
    wl, prog = _program("matmul_relu", {"M": 256, "N": 128, "K": 64}, seed=3, unroll=0)
    threads = prog.nests["C"].threads
    small = {**SM80, "max_threads_per_block": threads // 2}
    sch = realize(wl.mod, prog.instructions)
    assert cuda.verify(sch.mod, SM80) == []
    assert cuda.verify(sch.mod, small) == ["main_kernel"]
    wl_path = tmp_path / "wl.json"
    wl_path.write_text(wl.to_json())
    with pytest.raises(BuildError, match="GPU code verifier rejects kernel main_kernel"):
        build_module(str(wl_path), trace_json(sch), small, str(tmp_path / "k.cuda.tar"))


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_conv2d_and_gemm_compile_to_fatbins(arch, tmp_path):
    """The build worker's path: replay, verify, compile, nvcc for the arch, one artifact."""
    target = {"kind": "cuda", "arch": arch}
    for op, shape in [("matmul", {"M": 128, "N": 128, "K": 64}), ("conv2d", {"N": 1, "C": 16, "H": 14, "W": 14, "F": 32})]:
        wl, prog = _program(op, shape, seed=7, unroll=0)
        sch = realize(wl.mod, prog.instructions)
        wl_path = tmp_path / f"{op}.json"
        wl_path.write_text(wl.to_json())
        out = tmp_path / f"{op}-{arch}{cuda.CUDA_KERNEL_SUFFIX}"
        build_module(str(wl_path), trace_json(sch), target, str(out))
        with tarfile.open(out) as tar:
            assert sorted(tar.getnames()) == ["kernel.cu", "kernel.fatbin", "kernel.so", "manifest.json"]
            fatbin = tar.extractfile("kernel.fatbin").read()
            source = tar.extractfile("kernel.cu").read().decode()
        manifest = cuda.read_manifest(out)
        assert manifest["arch"] == arch
        assert fatbin[:4] == FATBIN_MAGIC and arch.encode() in fatbin
        assert "__global__" in source and "__shared__" in source
        assert manifest["source_sha256"] == cuda._sha256(source.encode())


def test_prebuilt_binaries_answer_only_for_their_source():
    binaries = cuda._PrebuiltBinaries()
    binaries.binaries[cuda._sha256(b"__global__ void k() {}")] = b"FATBIN"
    assert binaries.compile("__global__ void k() {}") == b"FATBIN"
    with pytest.raises(RuntimeError, match="no prebuilt binary"):
        binaries.compile("__global__ void other() {}")


def test_a_cuda_kernel_without_a_gpu_is_a_clear_error(tmp_path):
    """What an agent's runner does with a CUDA kernel on a machine with no GPU: it
    raises NoGpuError (a RUN_ERROR with that message), before touching the artifact."""
    wl = registry.make("matmul", {"M": 16, "N": 16, "K": 16})
    data = tmp_path / "data.npz"
    write_task_data(data, wl, seed=0, with_expected=True)
    inp = RunInput("k", str(tmp_path / f"k{cuda.CUDA_KERNEL_SUFFIX}"), str(data), 2, 1, True, TimingConfig(repeat=1))
    try:
        cuda.cuda_device()
    except cuda.NoGpuError:
        with pytest.raises(cuda.NoGpuError, match="no CUDA GPU on this machine"):
            run_kernel(inp)
    else:
        pytest.skip("this machine has a GPU")


def test_a_loaded_kernel_is_never_unpacked_over_and_a_changed_one_gets_its_own_directory(tmp_path, monkeypatch):
    """`load_kernel` unpacks by content: loading an artifact again leaves the kernel.so
    the process runs from untouched, and a new artifact at the same path goes elsewhere."""
    loaded = []
    monkeypatch.setattr(cuda, "cuda_device", lambda index=0: None)  # the GPU is not what is tested
    monkeypatch.setattr(tvm.runtime, "load_module", lambda p: loaded.append(p) or p)

    def artifact(source: str) -> str:
        out = tmp_path / f"k{cuda.CUDA_KERNEL_SUFFIX}"
        files = {"kernel.so": b"ELF", "kernel.fatbin": b"FATBIN-" + source.encode(), "kernel.cu": source.encode()}
        manifest = {"arch": "sm_80", "source_sha256": cuda._sha256(source.encode()),
                    "fatbin_sha256": cuda._sha256(files["kernel.fatbin"])}  # fmt: skip
        files["manifest.json"] = json.dumps(manifest).encode()
        for name, data in files.items():
            (tmp_path / name).write_bytes(data)
        with tarfile.open(out, "w") as tar:
            for name in files:
                tar.add(tmp_path / name, arcname=name)
        return str(out)

    work = tmp_path / "unpacked"
    path = artifact("__global__ void a() {}")
    first = cuda.load_kernel(path, work)
    stamp = os.stat(first).st_mtime_ns
    assert cuda.load_kernel(path, work) == first
    assert os.stat(first).st_mtime_ns == stamp
    second = cuda.load_kernel(artifact("__global__ void b() {}"), work)
    assert second != first and os.path.dirname(second) != os.path.dirname(first)
    assert len(list(work.iterdir())) == 2


def test_a_cuda_class_takes_agents_whose_gpu_runs_its_kernels():
    assert gpu_compatible(SM80, "") == "this agent has no CUDA GPU"
    assert "older" in gpu_compatible(SM80, "7.5")
    assert gpu_compatible(SM80, "8.0") == gpu_compatible(SM80, "8.6") == gpu_compatible(SM80, "9.0") == ""
    # sm_80+: up to the opt-in limit per block (dynamic beyond 48 KB); older: the static 48 KB
    assert json.loads(json.dumps(GpuLimits.of(SM80).verifier_constraints()))["max_shared_memory_per_block"] == 166912
    assert GpuLimits.of({"kind": "cuda", "arch": "sm_75"}).verifier_constraints()["max_shared_memory_per_block"] == 49152


def test_cli_shows_gpu_sketches_and_refuses_to_tune_without_a_gpu(capsys, tmp_path, monkeypatch):
    from tunefarm_app.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["sketches", "conv2d", "--target", json.dumps(SM80)]) == 0
    out = capsys.readouterr().out
    assert "tile conv2d SSSRRSRS" in out and "cache-read weight into shared memory" in out and "cuda arch=sm_80" in out
    assert main(["tune-op", "matmul", "--target", '{"kind": "cuda"}']) == 2
    assert "arch" in capsys.readouterr().err
    try:
        cuda.cuda_device()
    except cuda.NoGpuError:
        assert main(["tune-op", "matmul", "--target", '{"kind": "cuda", "arch": "sm_90"}', "--trials", "4"]) == 2
        err = capsys.readouterr().err.strip()
        assert "no CUDA GPU on this machine" in err and len(err.splitlines()) == 1
        assert not list(tmp_path.glob("*.jsonl"))  # nothing written


def test_a_gpu_agent_takes_its_gpus_target():
    from services.agent import capabilities
    from services.protocol.errors import BadRequest

    with pytest.raises(BadRequest, match="no CUDA GPU"):
        capabilities.with_gpu_target({"target_json": "{}"})
    caps = capabilities.with_gpu_target(
        {"gpu_name": "NVIDIA A100-SXM4-40GB", "gpu_compute_capability": "8.0", "gpu_max_threads_per_block": 1024}
    )
    target = json.loads(caps["target_json"])
    assert target == {"kind": "cuda", "arch": "sm_80", "max_threads_per_block": 1024}
    assert GpuLimits.of(target).max_threads_per_block == 1024
    assert capabilities.default_device_class(caps) == "cuda-sm_80-nvidia-a100-sxm4-40gb"


@needs_nvcc
@pytest.mark.slow
def test_a_gpu_task_goes_from_proposal_to_a_runner_that_has_no_gpu(tmp_path):
    """Embedded mode's whole path for a CUDA target, up to where a GPU is needed: the
    tuner proposes programs (realized in TVM), build workers verify and compile them
    with nvcc into CUDA artifacts, and the runner (no GPU here) reports each as a
    run_error naming the missing GPU; the records keep that. On a GPU machine the same
    path times the kernels (not run here)."""
    from tunefarm.measure import MeasureBatch
    from tunefarm.measure.builder import LocalBuilder
    from tunefarm.measure.local import LocalMeasurer
    from tunefarm.measure.runner import LocalRunner
    from tunefarm.records import ErrorKind
    from tunefarm.search.config import TuneConfig
    from tunefarm.search.cost_model.random_model import RandomCostModel
    from tunefarm.search.task import make_task
    from tunefarm.search.tuner import TaskTuner

    try:
        cuda.cuda_device()
        pytest.skip("this machine has a GPU: the path runs for real elsewhere")
    except cuda.NoGpuError:
        pass
    wl = registry.make("matmul", {"M": 64, "N": 64, "K": 64})
    task = make_task(wl, SM80)
    tuner = TaskTuner(task, TuneConfig(trials=2, batch_size=2), RandomCostModel(seed=1))
    proposal = tuner.propose(2)
    assert len(proposal.inputs) == 2
    measurer = LocalMeasurer(LocalBuilder(tmp_path / "build", n_workers=1), LocalRunner(1), tmp_path)
    try:
        mtask = measurer.prepare(wl, task.key, SM80)
        assert mtask.verify  # numpy reference outputs
        measurer.submit(MeasureBatch("b0", mtask, proposal.inputs, build_timeout=300, run_timeout=120))
        results = []
        while len(results) < 2:
            results += measurer.collect(timeout=600)
    finally:
        measurer.close()
    for res in results:  # built (a build error would be a BUILD_ERROR), refused at run time
        assert res.error_kind is ErrorKind.RUN_ERROR and "no CUDA GPU on this machine" in res.error_msg
        assert res.build_secs > 0
    records = tuner.ingest(results)
    assert [r.error_kind for r in records] == [ErrorKind.RUN_ERROR] * 2


# -- on a machine with a GPU (skipped elsewhere, CI included) ---------------------------------


@needs_gpu
@needs_nvcc
@pytest.mark.parametrize("op, shape", CASES, ids=[c[0] for c in CASES])
def test_on_a_gpu_random_programs_run_match_the_reference_and_are_timed(op, shape, tmp_path):
    """The agent's CUDA measuring path on this machine's GPU: random programs of the GPU
    space, built for its arch into artifacts (here, as a build worker does), run by the
    agent's runner (`LocalRunner`: `run_kernel` in an isolated process), their outputs
    checked against the numpy reference, then timed on the GPU."""
    from tunefarm.measure.runner import LocalRunner

    rules = GpuRules(GpuLimits.of(LOCAL_GPU))
    data = tmp_path / "data.npz"
    write_task_data(data, registry.make(op, shape), seed=0, with_expected=True)
    inputs = []
    for seed in range(3):
        wl, prog = _program(op, shape, seed=200 + seed, rules=rules)
        wl_path = tmp_path / "wl.json"
        wl_path.write_text(wl.to_json())
        artifact = tmp_path / f"{op}-{seed}{cuda.CUDA_KERNEL_SUFFIX}"
        build_module(str(wl_path), trace_json(realize(wl.mod, prog.instructions)), LOCAL_GPU, str(artifact))
        timing = TimingConfig(repeat=3)
        inputs.append(RunInput(f"k{seed}", str(artifact), str(data), len(wl.inputs), len(wl.outputs), True, timing))
    runner = LocalRunner(1)
    try:
        results = runner.run(inputs + inputs)  # twice: an artifact loaded again runs again
    finally:
        runner.close()
    for res in results:
        assert not res.error_kind.is_error, (res.candidate_key, res.error_msg)
        assert res.verified and len(res.costs) == 3 and all(0 < c < 1.0 for c in res.costs), res


@needs_gpu
def test_on_a_gpu_the_agent_probe_reports_it_and_takes_its_class():
    from services.agent import capabilities

    caps = capabilities.with_gpu_target(capabilities.probe_tvm())
    assert json.loads(caps["target_json"])["arch"] == LOCAL_GPU["arch"]
    assert capabilities.default_device_class(caps).startswith(f"cuda-{LOCAL_GPU['arch']}-")
    assert gpu_compatible(LOCAL_GPU, caps["gpu_compute_capability"]) == ""


@needs_gpu
@needs_nvcc
def test_on_a_gpu_tune_op_measures_there_and_its_best_kernel_is_verified(capsys, tmp_path, monkeypatch):
    """Embedded tuning for this machine's GPU, through the command line: every trial is
    built, run on the GPU and timed; the best kernel was checked against the reference."""
    from tunefarm_app.cli import main

    monkeypatch.chdir(tmp_path)
    target = json.dumps(LOCAL_GPU)
    assert main(["tune-op", "matmul", "--shape", "M=256,N=256,K=256", "--target", target, "--trials", "16"]) == 0
    out = capsys.readouterr().out
    assert "verified: yes" in out, out
    records = list(tmp_path.glob("tunefarm-records/*.jsonl"))
    assert len(records) == 1
    lines = [json.loads(line) for line in records[0].read_text().splitlines() if line.strip()]
    assert len(lines) >= 16
