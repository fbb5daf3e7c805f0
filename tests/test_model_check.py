"""The output check of a tuned model (`tunefarm.models.check`) and how a model is timed
(`tunefarm.models.timing`): element-wise tolerances on several input kinds, a detector
(sigmoid heads, upsampling, concat) tuned end to end that matches onnxruntime on every
kind, summation noise told from a wrong kernel against a float64 run of the model, a
deliberately wrong kernel that the check catches (the library is kept under another
name, the task to suspect is named, the command fails with one line), and `tunefarm run` timing the model and onnxruntime alike."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tunefarm.models import check
from tunefarm.models.check import ModelCheck, check_inputs, compare_output
from tunefarm.models.timing import Latency, round_ratios, speedup, time_calls, time_interleaved

TARGET = {"kind": "llvm", "num-cores": 2}


def _sigmoid_map() -> np.ndarray:
    x = np.linspace(-9.0, 9.0, 4096).reshape(1, 1, 64, 64)
    return (1 / (1 + np.exp(-x))).astype(np.float32)


def test_small_elements_are_held_to_their_own_scale():
    """A probability map wrong by 5e-4 wherever it is below 0.01: within 1e-3 of its
    largest value (the old criterion), but 5% off those elements."""
    want = _sigmoid_map()
    got = np.where(want < 0.01, want + 5e-4, want).astype(np.float32)
    assert np.max(np.abs(got - want)) <= 1e-5 + 1e-3 * np.max(np.abs(want))  # what used to pass
    err = compare_output(got, want, input_kind="uniform", output="prob")
    assert not err.ok and err.mismatched == int((want < 0.01).sum())
    index, value, reference = err.worst
    assert reference < 0.01 and value == pytest.approx(reference + 5e-4, abs=1e-6)
    assert "output prob on uniform input" in err.describe()
    assert compare_output(want * (1 + 1e-6), want, input_kind="uniform", output="prob").ok  # float32 noise passes


def test_non_finite_values_shapes_and_counts():
    want = np.array([1.0, np.inf, -np.inf, np.nan, 0.0], np.float32)
    assert compare_output(want.copy(), want, input_kind="normal", output="y").ok
    wrong = want.copy()
    wrong[1] = 3.0
    assert compare_output(wrong, want, input_kind="normal", output="y").mismatched == 1
    assert compare_output(np.array([np.nan], np.float32), np.array([1.0], np.float32), input_kind="n", output="y").mismatched == 1
    assert compare_output(np.zeros(3, np.float32), np.zeros(3, np.float32), input_kind="n", output="y").ok
    assert not compare_output(np.zeros(2), np.zeros(3), input_kind="n", output="y").ok
    (count,) = check.compare_outputs([], [want], input_kind="n")
    assert not count.ok and "0 outputs" in count.problem


def test_input_kinds_cover_the_ranges_a_first_layer_may_expect():
    sets = check_inputs({"img": (1, 3, 16, 16), "ids": (1, 8)}, {"img": "float32", "ids": "int64"})
    assert list(sets) == ["normal", "uniform", "pixels"]
    assert sets["normal"]["img"].min() < 0 < sets["normal"]["img"].max()
    assert 0 <= sets["uniform"]["img"].min() and sets["uniform"]["img"].max() < 1
    assert 0 <= sets["pixels"]["img"].min() and 100 < sets["pixels"]["img"].max() < 255
    assert all(s["img"].dtype == np.float32 and set(np.unique(s["ids"])) <= {0, 1} for s in sets.values())
    again = check_inputs({"img": (1, 3, 16, 16)}, {"img": "float32"})
    assert np.array_equal(again["pixels"]["img"], sets["pixels"]["img"])  # seeded


def test_the_check_compares_every_kind_and_reports_the_tolerance():
    def reference(feeds):
        return [feeds["x"] * 2.0]

    def run(feeds):  # wrong only for inputs above 10: only the real-range kind has them
        x = feeds["x"]
        return [np.where(x > 10.0, x * 2.01, x * 2.0)]

    shapes, dtypes = {"x": (4, 4)}, {"x": "float32"}
    result = check.check_model(run, reference, check_inputs(shapes, dtypes), reference_name="onnxruntime",
                               output_names=["y"])
    assert not result.ok and [e.ok for e in result.errors] == [True, True, False]
    report = result.as_report()
    assert report["tolerance"]["rtol"] == check.RTOL and report["tolerance"]["atol_of_scale"] == check.ATOL_OF_SCALE
    assert [(r["input"], r["output"], r["ok"]) for r in report["outputs"]] == [
        ("normal", "y", True), ("uniform", "y", True), ("pixels", "y", False)]
    assert "output y on pixels input" in report["problem"]
    assert ModelCheck("torch", ()).ok is False  # nothing compared is no match


def _saturated_head(seed: int, noise: float) -> tuple[np.ndarray, np.ndarray]:
    """A sigmoid head saturated low (outputs around 1e-5, like a text detector's map on an
    image with no text), exactly and as a float32 engine computes it: the rounding error
    of the pre-activation, a long sum of large terms, becomes a relative error of
    `noise` on every output."""
    exact = 1e-5 * (1 + np.random.default_rng(0).random((1, 1, 32, 32)))
    rng = np.random.default_rng(seed)
    return exact, (exact * (1 + noise * rng.standard_normal(exact.shape))).astype(np.float32)


def test_summation_noise_beyond_the_tolerance_is_told_from_a_wrong_kernel():
    exact, reference = _saturated_head(0, 2e-3)  # onnxruntime: 2e-3 relative off the exact result
    _, noisy = _saturated_head(1, 2e-3)  # the tuned model: as far off, summed in another order
    _, wrong = _saturated_head(1, 5e-2)  # a kernel 25x as far off: wrong, not noisy
    strict = compare_output(noisy, reference, input_kind="pixels", output="prob")
    assert not strict.ok  # the element-wise tolerance alone refuses the noisy model

    judged = check.judge_noise(strict, noisy, reference, exact)
    assert judged.ok and judged.within_noise
    assert judged.exact_error <= check.NOISE_FACTOR * judged.reference_noise
    assert "within 10x its noise" in judged.describe()
    refused = check.judge_noise(compare_output(wrong, reference, input_kind="pixels", output="prob"), wrong, reference, exact)
    assert not refused.ok and "beyond 10x its noise" in refused.describe()
    # A float32 reference far from the exact one (one of them is wrong, not noisy): no judgment.
    far = (reference + 0.05 * reference.max()).astype(np.float32)
    assert not check.judge_noise(compare_output(noisy, far, input_kind="pixels", output="prob"), noisy, far, exact).ok


def test_the_model_check_asks_the_exact_reference_only_for_what_fails():
    exact, reference = _saturated_head(0, 2e-3)
    _, noisy = _saturated_head(1, 2e-3)
    asked = []

    def run_exact(feeds):
        asked.append(feeds["x"].dtype)
        return [exact]

    inputs = {"normal": {"x": np.zeros(2, np.float32)}}
    result = check.check_model(lambda f: [noisy], lambda f: [reference], inputs, reference_name="onnxruntime",
                               output_names=["prob"], exact=check.ExactReference("float64 test", run_exact))
    assert result.ok and len(asked) == 1
    report = result.as_report()
    assert report["exact_reference"] == "float64 test" and report["outputs"][0]["within_noise"] is True
    assert report["tolerance"]["noise_factor"] == check.NOISE_FACTOR
    same = check.check_model(lambda f: [reference], lambda f: [reference], inputs, reference_name="onnxruntime",
                             exact=check.ExactReference("float64 test", run_exact))
    assert same.ok and len(asked) == 1 and "exact_reference" not in same.as_report()  # nothing to judge

    def broken(feeds):
        raise RuntimeError("no float64 kernel for this op")

    kept = check.check_model(lambda f: [noisy], lambda f: [reference], inputs, reference_name="onnxruntime",
                             exact=check.ExactReference("float64 test", broken))
    assert not kept.ok  # the tolerance's verdict stands


def test_the_exact_reference_runs_an_example_model_in_float64(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    from tunefarm.models import examples
    from tunefarm.models.importer import run_onnxruntime

    path = examples.export_example("dbnet_tiny", tmp_path / "dbnet_tiny.onnx")  # Resize, ConvTranspose, sigmoid
    feeds = check_inputs({"x": (1, 3, 32, 32)}, {"x": "float32"})["pixels"]
    exact = check.exact_onnx_reference(path.read_bytes()).run(feeds)
    ort = run_onnxruntime(path.read_bytes(), feeds)
    assert [e.dtype for e in exact] == [np.float64] * len(ort)
    for e, o in zip(exact, ort):
        assert e.shape == o.shape and np.max(np.abs(e - o)) <= 1e-5 * np.max(np.abs(e))


def test_timing_warms_up_and_reports_percentiles_and_threads():
    calls = []
    samples = time_calls(lambda: calls.append(1), runs=50, warmup_secs=0.01)
    assert len(samples) == 50 and len(calls) > 50  # the warm-up calls are not samples
    lat = Latency.of(samples, threads=3)
    assert lat.median <= lat.p90 <= lat.p99 and lat.mean > 0 and lat.runs == 50
    assert lat.as_report()["threads"] == 3 and "samples" not in lat.as_report()


def test_interleaved_timing_alternates_blocks_and_splits_the_runs():
    calls = []

    def contender(name, secs):
        def block(runs, budget_secs, warmup_secs, min_runs):
            calls.append((name, runs, warmup_secs > 0))
            return [secs] * runs, 2

        return block

    timed = time_interleaved({"a": contender("a", 2.0), "b": contender("b", 1.0)}, runs=7, rounds=3, settle_secs=0)
    # one block each per round, the order reversed every other round; 7 runs as 2 + 2 + 3
    assert [c[0] for c in calls] == ["a", "b", "b", "a", "a", "b"]
    assert [c[1] for c in calls if c[0] == "a"] == [2, 2, 3]
    assert [c[2] for c in calls if c[0] == "b"] == [True, False, False]  # only the first block warms up fully
    assert timed["a"].runs == 7 and timed["a"].round_medians == (2.0, 2.0, 2.0) and timed["b"].median == 1.0
    assert round_ratios(timed["a"].as_report(), timed["b"].as_report()) == [2.0, 2.0, 2.0]
    assert round_ratios(timed["a"].as_report(), Latency.of([1.0], 2).as_report()) == []  # not timed in rounds
    calls.clear()
    time_interleaved({"a": contender("a", 1.0)}, runs=2, rounds=5, settle_secs=0)
    assert [c[1] for c in calls] == [1, 1]  # never more blocks than runs


def test_the_speedup_of_engines_timed_in_rounds_is_the_median_of_their_round_ratios():
    """A machine whose speed comes in phases: each round both engines run fast (0.6 ms)
    or slow (1.1 ms), and the tuned model is 5% faster in every round. Pooled, the
    model's samples fall more in slow rounds and the peer's more in fast ones, so p50 over
    p50 says under 0.6x; the rounds, paired, say 1.05x."""
    phases = [0.6e-3, 1.1e-3, 1.1e-3, 0.6e-3, 1.1e-3]
    model_counts, peer_counts = [5, 15, 15, 5, 15], [15, 5, 5, 15, 5]
    model = Latency.of([p / 1.05 for p, n in zip(phases, model_counts) for _ in range(n)], 2,
                       [p / 1.05 for p in phases]).as_report()  # fmt: skip
    peer = Latency.of([p for p, n in zip(phases, peer_counts) for _ in range(n)], 2, phases).as_report()
    assert peer["median"] / model["median"] < 0.6  # what pooling would have said
    assert speedup(peer, model) == pytest.approx(1.05)
    # without rounds (a single block each): p50 over p50
    assert speedup(Latency.of([2.0], 2).as_report(), Latency.of([1.0], 2).as_report()) == 2.0
    assert speedup(None, model) is None

# -- end to end ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tuned_detector(tmp_path_factory):
    """dbnet_tiny (sigmoid heads, nearest and bilinear Resize, concat, ConvTranspose)
    tuned with one trial per task, through the command line."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    from tunefarm.models import examples
    from tunefarm_app.cli import main

    work = tmp_path_factory.mktemp("detector")
    onnx_path = examples.export_example("dbnet_tiny", work / "dbnet_tiny.onnx")
    out = work / "tuned"
    code = main(["tune", str(onnx_path), "--trials", "16", "--out", str(out), "--target", json.dumps(TARGET),
                 "--no-progress"])
    return onnx_path, out, code


@pytest.mark.slow
def test_tuned_detector_matches_onnxruntime_on_every_input_kind(tuned_detector, capsys):
    from tunefarm_app.cli import main

    _, out, code = tuned_detector
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    (model,) = report["models"]
    assert sum(t["schedule"] == "tuned" for t in model["tasks"]) >= 12  # most tasks run tuned kernels
    checked = model["check"]
    assert checked["ok"] and checked["reference"] == "onnxruntime"
    assert {(r["input"], r["output"]) for r in checked["outputs"]} == {
        (k, o) for k in ("normal", "uniform", "pixels") for o in ("prob", "thresh")}
    assert all(r["mismatched"] == 0 and r["max_rel_error"] < 1e-4 for r in checked["outputs"])
    assert checked["tolerance"]["rule"].startswith("|out - ref|")
    for key in ("latency", "onnxruntime_latency", "openvino_latency"):  # OpenVINO: the dev extra installs it
        lat = model[key]
        assert lat["threads"] == 2 and lat["runs"] >= 20 and 0 < lat["median"] <= lat["p90"] <= lat["p99"]
        assert len(lat["round_medians"]) == 5  # timed in alternating blocks
    assert (out / "reference.onnx").is_file()

    capsys.readouterr()
    assert main(["run", str(out), "--threads", "1", "--repeat", "25"]) == 0
    text = capsys.readouterr().out
    assert "p50" in text and "p99" in text
    assert text.count("(25 runs, 1 threads)") == 3  # the tuned model, onnxruntime and OpenVINO, alike
    assert "x the speed of onnxruntime" in text and "over 5 alternating rounds" in text


@pytest.mark.slow
def test_a_wrong_kernel_fails_the_check_its_library_is_kept_aside_and_its_task_named(tuned_detector, tmp_path):
    """The tuned schedules, but the sigmoid head's task gets one that stores the
    transposed convolution's sums as integers (every kernel of a run is checked on its
    own, but a model is built from records that can come from anywhere)."""
    from tvm.s_tir import Schedule

    from tunefarm.models.finish import finish_model, load_model
    from tunefarm.search.space.realize import trace_json
    from tunefarm.store import JsonlRecordStore

    onnx_path, out, _ = tuned_detector
    loaded = load_model(onnx_path, name="dbnet_tiny")
    schedules = {}
    for r in sorted(JsonlRecordStore(out / "records.jsonl").load(), key=lambda r: -r.cost):
        if r.is_valid and r.verified:
            schedules[r.task.rsplit("@", 1)[0]] = r.trace  # the fastest last
    head = next(t for t in loaded.tasks.tasks if "sigmoid" in t.name)
    sch = Schedule(head.workload.mod)
    sch.unsafe_set_dtype(sch.get_sblock("conv2d_transpose_nhwc"), 0, "int32")
    schedules[head.key] = trace_json(sch)

    outcome = finish_model(loaded, tmp_path / "wrong", TARGET, schedules)
    assert outcome.directory is None and not (tmp_path / "wrong" / "model.so").exists()
    assert (tmp_path / "wrong" / "model.failed-check.so").is_file()  # the work is kept, under another name
    assert "differs from onnxruntime's: output" in outcome.error and "model.failed-check.so" in outcome.error
    assert outcome.check["ok"] is False and any(r["mismatched"] for r in outcome.check["outputs"])
    # Beyond noise: judged against the float64 model, the wrong kernel is far further off than onnxruntime.
    judged = [r for r in outcome.check["outputs"] if not r["ok"]]
    assert judged and all(r["within_noise"] is False for r in judged)
    assert outcome.check["exact_reference"].startswith("ONNX reference evaluator")
    assert outcome.check["suspects"]["tasks"] == [head.name]  # the bisection finds the injected kernel
    assert f"suspect task(s): {head.name}" in outcome.error
    assert outcome.latency is None
