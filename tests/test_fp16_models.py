"""Whole models in reduced precision (`--precision fp16`, `tunefarm.models.precision`),
without a GPU: the conversion gives tensor-core-form matmul tasks (sketches on sm_80 and
sm_90), convolutions float16 in with float32 accumulators on the SIMT sketches, the
model builds with nvcc into wmma kernels, the float16 tolerance accepts the float16
model's rounding and still fails a wrong kernel, and reduced precision on a CPU target
is a usage error naming the option. On a GPU machine, a float16 model is tuned briefly,
built, checked and run.
"""

from __future__ import annotations

import json
import random
import tarfile

import numpy as np
import pytest
from gpu_machine import LOCAL_GPU, needs_nvcc

from tunefarm.errors import UsageError
from tunefarm.gpu import GpuLimits
from tunefarm.models import check
from tunefarm.models.precision import FLOAT16_EPS, FP16, FP32, check_precision, tolerance
from tunefarm.search.space.dag import analyse
from tunefarm.search.space.sketch import TensorCoreStep
from tunefarm.search.space.tensor_core import tensor_core_form

SM80 = {"kind": "cuda", "arch": "sm_80"}
SM90 = {"kind": "cuda", "arch": "sm_90"}
CPU = {"kind": "llvm", "num-cores": 2}


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    from onnx_models import matmul_mlp_onnx

    return matmul_mlp_onnx(tmp_path_factory.mktemp("mlp") / "mlp.onnx")


@pytest.fixture(scope="module")
def mlp16(mlp):
    from tunefarm.models.finish import load_model

    return load_model(mlp, name="mlp", precision=FP16)


@pytest.fixture(scope="module")
def mix16(tmp_path_factory):
    from onnx_models import gpu_mix_onnx

    from tunefarm.models.finish import load_model

    path = gpu_mix_onnx(tmp_path_factory.mktemp("mix") / "mix.onnx")
    return load_model(path, {"x": [1, 3, 8, 8]}, name="mix", precision=FP16)


def _forms(task, target):
    dag = analyse(task.workload.mod["main"])
    return [tensor_core_form(dag, b, GpuLimits.of(target)) for b in dag.blocks]


def _tensor_core_sketches(task, target) -> int:
    from tunefarm.search.task import make_task

    space = make_task(task.workload, target).space
    return sum(isinstance(s, TensorCoreStep) for sk in space.sketches for s in sk.steps)


def test_the_float16_conversion_gives_tensor_core_matmul_tasks(mlp, mlp16):
    """Both dense layers (the MatMul's weight [k, j], the Gemm's transposed one folded to
    [k, j] too) become float16 x float16 -> float32 blocks in tensor-core form, and get
    the tensor-core sketch on sm_80 and sm_90; the model's inputs and outputs stay
    float32; the float32 model's tasks have no float16 and no tensor-core sketch."""
    from tunefarm.models.finish import load_model

    assert mlp16.tasks.precision == FP16
    assert [t.dtype for t in (*mlp16.imported.inputs, *mlp16.imported.outputs)] == ["float32", "float32"]
    matmuls = [t for t in mlp16.tasks.tasks if "matmul" in t.name]
    assert len(matmuls) == 2
    for t in matmuls:
        forms = [f for f in _forms(t, SM80) if f is not None]
        assert len(forms) == 1 and not forms[0].batch, t.name
        assert [i.dtype for i in t.workload.inputs][:2] == ["float16", "float16"]
        for target in (SM80, SM90):
            assert _tensor_core_sketches(t, target) == 1, (t.name, target)
        assert _tensor_core_sketches(t, {"kind": "cuda", "arch": "sm_61"}) == 0  # no tensor cores
    plain = load_model(mlp, name="mlp")
    assert plain.tasks.precision == FP32
    assert not {t.key for t in plain.tasks.tasks} & {t.key for t in mlp16.tasks.tasks}
    for t in plain.tasks.tasks:
        assert all(i.dtype == "float32" for i in t.workload.inputs)
        assert _tensor_core_sketches(t, SM80) == 0


def test_convolutions_take_float16_operands_and_stay_on_simt_sketches(mix16):
    """The mix's 3x3 convolution computes float16 operands into a float32 accumulator
    (a window, not a matrix multiply: no tensor-core form), and its 8x64x16 matmul is
    not in tensor-core form either (8 rows: not a multiple of 16)."""
    conv = next(t for t in mix16.tasks.tasks if "conv2d" in t.name)
    dag = analyse(conv.workload.mod["main"])
    block = next(b for b in dag.blocks if b.name.startswith("conv2d"))
    assert {dag.buffer(r.buffer).dtype for r in block.reads} == {"float16"}
    assert dag.buffer(block.write.buffer).dtype == "float32"
    assert _forms(conv, SM80) == [None] * len(dag.blocks) and _tensor_core_sketches(conv, SM80) == 0
    matmul = next(t for t in mix16.tasks.tasks if "matmul" in t.name)
    assert all(f is None for f in _forms(matmul, SM80))


def test_reduced_precision_needs_a_cuda_target_with_tensor_cores():
    assert check_precision(FP32, CPU) == FP32 and check_precision(FP16, SM80) == FP16
    with pytest.raises(UsageError, match="--precision fp16 needs a CUDA target"):
        check_precision(FP16, CPU)
    with pytest.raises(UsageError, match="tensor cores"):
        check_precision(FP16, {"kind": "cuda", "arch": "sm_61"})
    with pytest.raises(UsageError, match="choose one of fp32, fp16"):
        check_precision("bf16", SM80)


def test_the_command_line_refuses_fp16_on_a_cpu_target_naming_the_option(mlp, tmp_path, capsys):
    from tunefarm_app.cli import main

    code = main(["tune", str(mlp), "--trials", "4", "--out", str(tmp_path / "out"), "--precision", "fp16",
                 "--target", json.dumps(CPU), "--no-progress"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "--precision fp16" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # refused before anything was imported or written


def test_the_float16_tolerance_states_its_precision_and_grows_with_the_reductions():
    assert tolerance(FP32, 0) is check.FLOAT32_TOLERANCE
    one, many = tolerance(FP16, 1), tolerance(FP16, 16)
    u = FLOAT16_EPS / 2
    assert one.rtol == one.atol_of_scale == pytest.approx(8 * u) and many.rtol == pytest.approx(4 * one.rtol)
    report = check.tolerance_report(many)
    assert report["precision"] == FP16 and report["derivation"]["reductions_per_run"] == 16
    assert "fp16 eps (0.000977) * max|ref|" in report["noise_rule"]
    assert "precision" not in check.tolerance_report()  # a float32 model's report as it was
    # A matrix product of float16-rounded operands, accumulated in float32, passes float16's
    # tolerance (one reduction), not float32's; one 5% off fails even that of 16 reductions.
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((256, 256)).astype(np.float32), rng.standard_normal((256, 64)).astype(np.float32)
    want = a @ b
    rounded = a.astype(np.float16).astype(np.float32) @ b.astype(np.float16).astype(np.float32)
    assert check.compare_output(rounded, want, input_kind="normal", output="y", tolerance=one).ok
    assert not check.compare_output(rounded, want, input_kind="normal", output="y").ok
    off = want * 1.05
    assert not check.compare_output(off, want, input_kind="normal", output="y", tolerance=many).ok


def _check(m, directory):
    from tunefarm.models.finish import check_built

    return check_built(m, directory)


def test_the_float16_model_passes_its_check_and_a_wrong_kernel_fails_it(mix16, tmp_path):
    """The float16 mix built for the CPU (TVM's default build: the same float16 arithmetic
    a GPU's kernels do, float32 accumulation) matches onnxruntime's float32 results within
    the float16 tolerance on every input kind, although not within float32's; a matmul
    kernel that accumulates in int32 (it truncates every partial sum) fails it."""
    from tvm.s_tir import Schedule

    from tunefarm.models.build import build_model_library, manifest_tolerance
    from tunefarm.models.finish import model_tolerance
    from tunefarm.models.runtime import load_manifest
    from tunefarm.search.space.realize import trace_json

    m = mix16
    built = build_model_library(m.tasks.fused_mod, tmp_path / "ok", target=CPU, inputs=m.imported.inputs,
                                outputs=m.imported.outputs, precision=FP16)  # fmt: skip
    manifest = load_manifest(built.directory)
    assert manifest["precision"] == FP16 and manifest_tolerance(manifest) == model_tolerance(m)
    result = _check(m, built.directory)
    assert result.ok, result.problem()
    report = result.as_report()
    assert report["tolerance"]["precision"] == FP16
    assert result.max_rel_error > check.ATOL_OF_SCALE  # beyond float32's bound: float16's rounding

    matmul = next(t for t in m.tasks.tasks if "matmul" in t.name)
    sch = Schedule(matmul.workload.mod)
    sch.unsafe_set_dtype(sch.get_sblock("matmul"), 0, "int32")
    wrong = build_model_library(m.tasks.fused_mod, tmp_path / "wrong", target=CPU, inputs=m.imported.inputs,
                                outputs=m.imported.outputs, schedules={matmul.key: trace_json(sch)},
                                precision=FP16)  # fmt: skip
    assert wrong.scheduled_tasks == (matmul.key,)
    failed = _check(m, wrong.directory)
    assert not failed.ok and any(e.mismatched for e in failed.errors)
    assert all(not e.within_noise for e in failed.errors if not e.ok)


@needs_nvcc
@pytest.mark.parametrize("target", [SM80, SM90], ids=["sm_80", "sm_90"])
def test_a_float16_model_builds_with_tensor_core_kernels(mlp16, target, tmp_path):
    """The model build (tuned matmuls applied to the whole model, the rest on TVM's
    default GPU schedules, float16 elementwise kernels included) compiles with nvcc; the
    tuned kernels multiply with wmma fragments; the manifest says fp16."""
    from tunefarm.models.build import CUDA_LIBRARY_NAME, build_model_library
    from tunefarm.models.runtime import load_manifest
    from tunefarm.search.space.realize import realize, trace_json
    from tunefarm.search.task import make_task

    m = mlp16
    schedules = {}
    for i, task in enumerate(t for t in m.tasks.tasks if "matmul" in t.name):
        space = make_task(task.workload, target).space
        prog = space.sample_many(1, random.Random(i))[0].program
        schedules[task.key] = trace_json(realize(task.workload.mod, prog.instructions))
    built = build_model_library(
        m.tasks.fused_mod, tmp_path / "tuned", target=target, inputs=m.imported.inputs,
        outputs=m.imported.outputs, schedules=schedules, precision=FP16,
    )  # fmt: skip
    assert built.library.name == CUDA_LIBRARY_NAME and set(built.scheduled_tasks) == set(schedules)
    assert load_manifest(built.directory)["precision"] == FP16
    with tarfile.open(built.library) as tar:
        source = tar.extractfile("kernel.cu").read().decode()
    assert source.count("wmma::mma_sync") >= 2 and "half" in source


# -- on a machine with a GPU (skipped elsewhere, CI included) ---------------------------------



@needs_nvcc
@pytest.mark.skipif(
    LOCAL_GPU is None or not GpuLimits.of(LOCAL_GPU).tensor_cores, reason="needs an sm_70+ GPU (runs on a GPU machine)"
)
def test_on_a_gpu_a_float16_model_is_tuned_built_checked_and_run(mlp, tmp_path):
    """`tune_models(..., precision="fp16")` on this GPU with a few trials: the matmul tasks
    are measured on tensor cores, the model is built, checked against onnxruntime's
    float32 results within the float16 tolerance, and runs; the report says fp16."""
    from tunefarm.models.runtime import run_model
    from tunefarm.tune import tune_models

    result = tune_models([mlp], trials=16, out=tmp_path / "out", target=LOCAL_GPU, precision=FP16,
                         cost_model=None, pretrained=False, log=lambda msg: None)  # fmt: skip
    report = result.report
    (model,) = report["models"]
    assert report["precision"] == FP16 and model["precision"] == FP16
    assert model["error"] is None and model["check"]["ok"], model["check"].get("problem")
    assert model["check"]["tolerance"]["precision"] == FP16
    matmuls = [t for t in model["tasks"] if "matmul" in t["name"]]
    assert matmuls and all(t["schedule"] == "tuned" for t in matmuls)
    x = np.random.default_rng(1).standard_normal((32, 64)).astype(np.float32)
    out = run_model(tmp_path / "out", {"x": x}, repeat=3)
    assert out.outputs[0].shape == (32, 64) and np.isfinite(out.outputs[0]).all()
