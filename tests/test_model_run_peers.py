"""A device agent's model run times the tuned model beside its peers, as `tunefarm tune`
does: onnxruntime (and OpenVINO where installed) on the model's ONNX graph, in the same
alternating rounds, on the same input and thread count (`LocalRunner.run_model`,
`tunefarm.models.runtime.time_beside_peers`), and the agent reports the peers' samples
in its `ModelRunResult` (services/agent/model_runs.py). A peer that cannot be timed is
left out with why; the model is timed all the same. No test asserts on timings (those
that build and time a model are slow)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tvm")
pytest.importorskip("onnxruntime")

from onnx_models import tiny_onnx  # noqa: E402

from services.agent.model_runs import FetchedRun, model_run_message  # noqa: E402
from tunefarm.errors import ModelRunError  # noqa: E402
from tunefarm.measure.runner import LocalRunner, ModelRunInput  # noqa: E402
from tunefarm.models.peers import ONNXRUNTIME, OPENVINO, available_peers  # noqa: E402
from tunefarm.models.runtime import time_beside_peers  # noqa: E402
from tunefarm.models.timing import ROUNDS  # noqa: E402

RUNS = 10
THREADS = 1


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A tiny ONNX model built for this host: (its library, its inputs .npz in the model's
    input order, its ONNX graph)."""
    from tunefarm.models.build import build_model_library
    from tunefarm.models.finish import load_model, model_inputs
    from tunefarm.target import host_target_dict

    d = tmp_path_factory.mktemp("model-run")
    onnx = tiny_onnx(d / "tiny.onnx")
    m = load_model(onnx, {"x": [1, 3, 8, 8]}, name="tiny")
    built = build_model_library(
        m.tasks.fused_mod, d / "tuned", target=host_target_dict(), inputs=m.imported.inputs, outputs=m.imported.outputs
    )
    feeds = model_inputs(m)
    np.savez(d / "inputs.npz", *[feeds[t.name] for t in m.imported.inputs])
    return built.library, d / "inputs.npz", onnx


@pytest.fixture(scope="module")
def runner():
    with LocalRunner(THREADS) as r:
        yield r


def model_run(tiny_run, tmp_path: Path, onnx: Path | None) -> ModelRunInput:
    library, inputs, _ = tiny_run
    return ModelRunInput(str(library), str(inputs), str(tmp_path / "outputs.npz"), RUNS, 1, 120.0,
                         onnx_model=str(onnx) if onnx else "", input_names=("x",))  # fmt: skip


@pytest.mark.slow
def test_the_model_is_timed_beside_onnxruntime_on_the_same_input_and_threads(tiny_run, runner, tmp_path):
    inp = model_run(tiny_run, tmp_path, tiny_run[2])
    ran = runner.run_model(inp)
    assert ran.error == ""
    assert len(ran.latency_samples) == RUNS and ran.threads == THREADS and len(ran.round_medians) == ROUNDS
    peers = {p.peer: p for p in ran.peers}
    expected = {ONNXRUNTIME} | ({OPENVINO} & set(available_peers()))
    assert set(peers) == expected
    for peer in expected:
        assert peers[peer].error == "", peers[peer].error
        assert len(peers[peer].latency_samples) == RUNS and all(s > 0 for s in peers[peer].latency_samples)
        assert peers[peer].threads == THREADS and len(peers[peer].round_medians) == ROUNDS

    message = model_run_message(ran, FetchedRun(inp))  # what the agent reports
    assert list(message.latency_samples) == list(ran.latency_samples) and message.threads == THREADS
    ort = next(p for p in message.peers if p.peer == ONNXRUNTIME)
    assert len(ort.latency_samples) == RUNS and ort.threads == THREADS and not ort.error
    with np.load(tmp_path / "outputs.npz") as out:
        assert message.outputs_npz == (tmp_path / "outputs.npz").read_bytes() and out["arr_0"].shape == (1, 4, 8, 8)


@pytest.mark.slow
def test_a_peer_that_cannot_load_the_graph_is_a_note_and_the_model_is_still_timed(tiny_run, runner, tmp_path):
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not an onnx graph")
    ran = runner.run_model(model_run(tiny_run, tmp_path, broken))
    assert ran.error == "" and len(ran.latency_samples) == RUNS
    peers = {p.peer: p for p in ran.peers}
    assert "timing onnxruntime failed" in peers[ONNXRUNTIME].error and not peers[ONNXRUNTIME].latency_samples


@pytest.mark.slow
def test_a_graph_the_agent_refused_is_reported_for_each_peer(tiny_run, runner, tmp_path):
    inp = model_run(tiny_run, tmp_path, None)  # refused: the runner times no peer
    ran = runner.run_model(inp)
    assert ran.error == "" and ran.peers == () and len(ran.latency_samples) == RUNS
    message = model_run_message(ran, FetchedRun(inp, no_peers="the ONNX graph is unavailable: not loaded: unsigned"))
    notes = {p.peer: p.error for p in message.peers}
    assert notes[ONNXRUNTIME] == "the ONNX graph is unavailable: not loaded: unsigned"


def test_a_peer_failing_midway_is_left_out_and_the_rounds_taken_again():
    calls = {"model": 0}

    def model(runs, budget, warmup, min_runs):
        calls["model"] += 1
        return [1e-3] * (runs or 1), 2

    def flaky(runs, budget, warmup, min_runs):
        raise ModelRunError("timing flaky failed (crashed): died")

    def steady(runs, budget, warmup, min_runs):
        return [2e-3] * (runs or 1), 2

    timed = time_beside_peers(("tuned", model), {"flaky": flaky, "steady": steady}, runs=6, rounds=3)
    assert set(timed.latencies) == {"tuned", "steady"} and timed.failed == {"flaky": "timing flaky failed (crashed): died"}
    assert timed.latencies["tuned"].runs == 6 == timed.latencies["steady"].runs
    assert calls["model"] == 4  # one block before the failure, then three rounds again without it

    def broken(runs, budget, warmup, min_runs):
        raise ModelRunError("timing tuned failed")

    with pytest.raises(ModelRunError):  # the model's own failure is the run's
        time_beside_peers(("tuned", broken), {"steady": steady}, runs=3, rounds=3)
