"""Layout rewrite of constant inputs (weights): the search space, the builder's library,
the runner's pre-transform, `apply-best`, and whole models built with folded weights.

Property: a program that stores a constant in the layout its tile loops read computes
what the naive program computes, through the production path (the trace replayed by the
builder, the transform run once by the runner, the kernel checked against the reference).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import tvm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tunefarm import layout
from tunefarm.errors import WorkloadError
from tunefarm.measure.builder import build_module
from tunefarm.measure.runner import run_kernel
from tunefarm.measure.task_data import write_task_data
from tunefarm.records import ErrorKind, RunInput, TimingConfig
from tunefarm.search.space.dag import analyse
from tunefarm.search.space.loopnest import build
from tunefarm.search.space.program import InvalidProgram, expected_tvm_loops
from tunefarm.search.space.realize import loop_structure, realize, trace_json
from tunefarm.search.space.sketch import LayoutRewriteStep, generate_sketches
from tunefarm.search.space.slots import Decider
from tunefarm.search.task import make_task
from tunefarm.workloads import registry

CASES = {
    "matmul_relu": ({"M": 24, "N": 32, "K": 16}, ("B",)),
    "batch_matmul": ({"B": 2, "M": 8, "N": 16, "K": 12}, ("A", "B")),
    "conv2d": ({"N": 1, "C": 4, "H": 9, "W": 9, "F": 8, "stride": 2}, ("weight",)),
    "conv2d_1x1": ({"N": 1, "C": 16, "H": 7, "W": 7, "F": 32}, ("weight",)),
    "conv1d": ({"N": 1, "C": 8, "L": 20, "F": 16}, ("weight",)),
}

ONE_RUN = TimingConfig(repeat=1, min_repeat_ms=1.0)


def _workload(op: str):
    params, consts = CASES[op]
    return registry.make(op, params).with_constants(consts)


def _build_and_run(wl, trace, tmp: Path, tag: str):
    wl_path = tmp / f"{tag}.json"
    wl_path.write_text(wl.to_json())
    data = tmp / f"{tag}.npz"
    if not data.exists():
        write_task_data(data, wl, seed=0)
    lib = tmp / f"{tag}.so"
    build_module(str(wl_path), trace, _target(), str(lib))
    run = run_kernel(RunInput(tag, str(lib), str(data), len(wl.inputs), len(wl.outputs), True, ONE_RUN))
    return lib, run


def _target():
    from tunefarm.target import host_target_dict

    return host_target_dict()


# -- the search space ------------------------------------------------------------------------------


def test_only_constants_read_by_a_tiled_block_are_rewritten():
    def rewritten(wl):
        task = make_task(wl, _target())
        return {s.buffer for sk in task.sketches for s in sk.steps if isinstance(s, LayoutRewriteStep)}

    gemm = registry.make("matmul", {"M": 32, "N": 32, "K": 32})
    assert rewritten(gemm) == set()
    assert rewritten(gemm.with_constants(["B"])) == {"B"}
    assert rewritten(gemm.with_constants([0, 1])) == {"A", "B"}
    # A flipped kernel index (KH-1-ky) is not a reordering of tile loops: left as it is.
    tconv = registry.make("conv2d_transpose", {"N": 1, "C": 3, "H": 5, "W": 5, "F": 4}).with_constants(
        ["weight"]
    )
    assert rewritten(tconv) == set()
    # Layer norm's gamma and beta are constants, but no block is tiled.
    assert (
        rewritten(registry.make("layer_norm", {"M": 4, "N": 32}).with_constants(["gamma", "beta"])) == set()
    )


def test_constants_are_part_of_the_workload_identity():
    gemm = registry.make("matmul", {"M": 32, "N": 32, "K": 32})
    with_b = gemm.with_constants(["B"])
    assert with_b.constants == (1,) and with_b.key != gemm.key and with_b.key == gemm.with_constants([1]).key
    with pytest.raises(WorkloadError, match="no input named"):
        gemm.with_constants(["W"])


@pytest.mark.parametrize("op", sorted(CASES))
def test_model_loops_match_tvm_with_rewritten_layouts(op):
    wl = _workload(op)
    dag = analyse(wl.mod["main"], wl.constants)
    sketches = generate_sketches(dag, num_cores=2)
    rng = random.Random(11)
    checked = 0
    for i in range(24):
        decider = Decider(None, rng)
        try:
            prog = build(dag, sketches[i % len(sketches)], decider, 2)
        except InvalidProgram:
            continue
        sch = realize(wl.mod, prog.instructions)
        assert loop_structure(sch) == expected_tvm_loops(prog), (op, decider.decisions)
        checked += 1
    assert checked >= 12


# -- programs compute the reference -------------------------------------------------------------------


@pytest.mark.parametrize("op", sorted(CASES))
@given(seed=st.integers(1, 2**30))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_rewritten_programs_compute_the_reference(op, seed, tmp_path_factory):
    wl = _workload(op)
    task = make_task(wl, _target())
    built = task.space.sample_many(1, random.Random(seed))[0]
    assert any(i.op == "layout_rewrite" for i in built.program.instructions)
    trace = trace_json(realize(wl.mod, built.program.instructions))
    _, run = _build_and_run(wl, trace, tmp_path_factory.mktemp(op), op)
    assert run.error_kind is ErrorKind.NONE, (built.candidate.key, run.error_msg)
    assert run.verified


def test_library_describes_and_transforms_its_rewritten_input(tmp_path):
    wl = registry.make("matmul", {"M": 32, "N": 48, "K": 64}).with_constants(["B"])
    task = make_task(wl, _target())
    decisions = {
        "C.tile.v_i": (2, 2, 2, 4), "C.tile.v_j": (1, 3, 1, 16), "C.tile.v_k": (4, 16),
        "C.parallel": 1, "C.unroll": 0,
    }  # fmt: skip
    sketch = next(i for i, sk in enumerate(task.sketches) if "cache-write C" not in sk.describe())
    built = task.space.build(sketch, decisions)
    trace = trace_json(realize(wl.mod, built.program.instructions))
    lib_path, run = _build_and_run(wl, trace, tmp_path, "gemm")
    assert run.verified
    lib = tvm.runtime.load_module(str(lib_path))
    layouts = layout.read_layouts(lib)
    assert layouts is not None and len(layouts.rewritten) == 1
    r = layouts.rewritten[0]
    # B[k, j] -> [j1 (3), k0 (4), k1 (16), j3 (16)]: the loops over j and k, outermost first.
    assert (r.input, r.name, r.shape, r.dtype) == (1, "B", (3, 4, 16, 16), "float32")
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal(t.shape).astype("float32") for t in wl.inputs)
    packed = tvm.runtime.empty(r.shape, "float32")
    lib[layout.TRANSFORM](tvm.runtime.tensor(b), packed)
    np.testing.assert_array_equal(packed.numpy(), b.reshape(4, 16, 3, 16).transpose(2, 0, 1, 3))
    c = tvm.runtime.empty((32, 48), "float32")
    lib["main"](tvm.runtime.tensor(a), packed, c)
    np.testing.assert_allclose(c.numpy(), a @ b, rtol=1e-4, atol=1e-4)
    assert layout.KernelLayouts.from_json(layouts.to_json()) == layouts


def test_a_library_without_rewrite_has_no_layouts(tmp_path):
    wl = registry.make("matmul", {"M": 16, "N": 16, "K": 16})
    task = make_task(wl, _target())
    built = task.space.sample_many(1, random.Random(2))[0]
    lib_path, run = _build_and_run(
        wl, trace_json(realize(wl.mod, built.program.instructions)), tmp_path, "plain"
    )
    assert run.verified
    assert layout.read_layouts(tvm.runtime.load_module(str(lib_path))) is None


def test_apply_best_rebuilds_the_rewritten_kernel_and_says_so(tmp_path):
    from tunefarm.records import Candidate, MeasureRecord
    from tunefarm.store import JsonlRecordStore
    from tunefarm_app.apply import build_best, find_best, layout_notes

    wl = registry.make("matmul", {"M": 32, "N": 32, "K": 32}).with_constants(["B"])
    task = make_task(wl, _target())
    built = task.space.sample_many(1, random.Random(5))[0]
    trace = trace_json(realize(wl.mod, built.program.instructions))
    store = JsonlRecordStore(tmp_path / "r.jsonl")
    store.put_workload(task.key, wl.name, wl.to_json())
    rec = MeasureRecord(
        task.key, wl.name, _target(), built.candidate.sketch, task.sketch_signature(built.candidate.sketch),
        Candidate.make(built.candidate.sketch, built.candidate.as_dict()).decisions, trace, (1e-4,),
        ErrorKind.NONE, "", 0.1, 0.1, True, 0.0,
    )  # fmt: skip
    store.append([rec])
    out = build_best(find_best(tmp_path / "r.jsonl"), tmp_path / "k.so")
    notes = layout_notes(out)
    assert notes and "input 1 (B)" in notes[1] and layout.TRANSFORM in notes[-1]


# -- whole models -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_model_built_with_rewritten_weights_matches_onnxruntime(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    from tunefarm.models import examples
    from tunefarm.models.build import apply_schedules, build_model_library
    from tunefarm.models.importer import import_model
    from tunefarm.models.runtime import check_library
    from tunefarm.models.tasks import extract_tasks

    path = examples.export_example("conv_bn_relu", tmp_path / "m.onnx")
    model = import_model(path.read_bytes(), name="net")
    tasks = extract_tasks(model)
    target = {"kind": "llvm", "num-cores": 2}
    schedules = {}
    convolutions = [t for t in tasks.tasks if t.const_inputs]  # not the transposes to NHWC and back
    assert len(convolutions) == 2
    for t in convolutions:
        assert t.workload.constants == t.const_inputs  # weights and biases
        task = make_task(t.workload, target)
        built = task.space.sample_many(1, random.Random(3))[0]
        assert any(i.op == "layout_rewrite" for i in built.program.instructions)
        schedules[t.key] = trace_json(realize(t.workload.mod, built.program.instructions))
    # The transforms are folded into the weights: no transform is left to run per inference.
    folded = layout.fold_layout_rewrites(apply_schedules(tasks.fused_mod, schedules, tasks=tasks))
    names = [gv.name_hint for gv in folded.get_global_vars()]
    assert not [n for n in names if n.endswith("_weight_prepack")]
    assert all(
        layout.has_layout_rewrite(f) is False for gv, f in folded.functions.items() if gv.name_hint != "main"
    )
    built = build_model_library(
        tasks.fused_mod, tmp_path / "net", target=target, inputs=model.inputs, outputs=model.outputs,
        schedules=schedules, name="net",
    )  # fmt: skip
    assert set(built.scheduled_tasks) == set(schedules)
    check = check_library(built.directory, model.onnx_bytes)
    assert check.ok and check.max_abs_error < 1e-4, check.problem()
    json.loads(built.manifest.read_text())  # a readable manifest
