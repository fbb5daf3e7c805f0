"""A farm job's tuned model checked and timed on a device of its class: the job's headline
latency is a measurement made on an agent of the class, beside the peers (onnxruntime,
and OpenVINO where that agent has it) timed on the same agent, as `tunefarm tune` times
them (`tunefarm.models.finish.finish_model`: alternating rounds, same input, same
threads). Every class goes this way, the scheduler host's own architecture included:
the scheduler never runs nor times a tuned model (it needs no GPU, and its host is not
the class's device); `check_on_device` asks an agent of the class:

1. the library (built for the class) and the model's seeded inputs, one set per input
   kind of `tunefarm.models.check`, are stored under the artifact root
   (`model_runs/<job id>/<uuid>/`), and one `ModelRun` row per set, each queued once the
   previous one is done, runs them on the class (the first also times `repeat`
   inferences, the others only run once). The timed run also carries the ONNX graph the
   model was imported from (`model.onnx`, signed by the farm like the library) and its
   input names, for the peers; a CUDA class's does not (the peers run on the CPU, and
   `tune` does not time them beside a GPU's model either);
2. an agent of the class leases them before any batch, runs the model for its outputs
   (and times it beside the peers), and sends outputs and latencies back (the lease
   service stores them, with the agent's name and whether it is emulated);
3. here, the outputs are compared with the reference's on the same inputs (onnxruntime,
   run on this host: the reference does not depend on the device) by the same check a
   local run uses (`tunefarm.models.check`: every input kind, every element). A
   mismatch beyond float32 noise fails the job (the library is kept as
   `model.failed-check.so`, `model.failed-check.cuda.tar` for a CUDA class, never as the
   tuned model); a run the agent could not do fails it too, and that library is not kept.

The library is the one file the build wrote (`manifest.json`'s "library": `model.so`, or
`model.cuda.tar` for a CUDA class, which an agent started with `--gpu` unpacks next to it
and runs with its prebuilt fatbin).

The latencies are the device's (`latency`, `onnxruntime_latency`, `openvino_latency`:
`Latency.as_report()` as `tune`'s report has them, each with `emulated`), and
`ModelOutcome.measured_on` says where they came from: the agent, its class, its GPU
(`gpu`, `compute_capability`: the agent's registered capabilities, for an agent that has
one), and `emulated` when that agent runs under an emulator (then every latency, the
peers' too, is the emulator's, not the board's). A peer the agent could not time (not
installed, a model it cannot load, a graph it refused) is a note (`peer_notes`), never a
failed job. A model no agent ran within `wait_secs` is kept unchecked; the report says
why. So is one the class has no agent for: when, after `no_agent_secs` of waiting, no
agent of the class has heartbeated for `no_agent_secs`, the wait ends early (a class
whose agents are all gone, or a CUDA class with no GPU agent, would otherwise hold the
job for `wait_secs`).
"""

from __future__ import annotations

import io
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.common import artifacts
from services.db import job_store, model_checks, model_runs
from services.db.models import ModelRun
from services.db.session import SessionFactory, transaction
from services.db.states import ModelRunState
from services.protocol.signing import ArtifactSigner, SignedKind
from services.scheduler.exceptions import FinishInterrupted, JobFailed
from tunefarm.gpu import is_gpu
from tunefarm.models import check
from tunefarm.models.finish import (
    LoadedModel,
    ModelOutcome,
    check_inputs,
    failed_library_name,
    model_tolerance,
)
from tunefarm.models.peers import ONNXRUNTIME, OPENVINO
from tunefarm.models.runtime import RUN_TIMEOUT, load_manifest
from tunefarm.models.timing import Latency

POLL_SECS = 0.5
"""How often the model run's row is read while waiting for an agent."""

DEVICE_RUNS = 100
"""Timed inferences of a model run on a device, and of each peer beside it (a fixed count:
an emulated agent is slow)."""

ONNX_NAME = "model.onnx"
"""The ONNX graph of a timed model run, beside its library (the peers are timed on it)."""


@dataclass(frozen=True)
class DeviceRun:
    """Where a tuned model runs and is timed: a device class's agents."""

    sessions: SessionFactory
    artifact_root: Path
    job_id: int
    device_class_id: int
    device_class: str
    wait_secs: float  # how long an agent of the class may take to pick it up and run it
    stop: threading.Event  # set when the scheduler stops: the job is finished by the next one
    repeat: int = DEVICE_RUNS
    warmup: int = 3
    timeout_secs: float = RUN_TIMEOUT  # the agent's limit for one whole run
    poll_secs: float = POLL_SECS
    signer: ArtifactSigner | None = None  # signs the library and ONNX graph for the agent (None: unsigned)
    # The wait ends early when no agent of the class has heartbeated for this long (the
    # scheduler's `agent_fresh_secs`: what counts as a live agent for its fair shares).
    no_agent_secs: float = 60.0


def check_on_device(
    m: LoadedModel, directory: Path, where: DeviceRun, *, log: Callable[[str], None] = lambda msg: None
) -> ModelOutcome:
    """Run the model built in `directory` on an agent of the class (see the module
    docstring), compare its outputs with the reference and keep its latency and its
    peers'. Raises `JobFailed` when the run failed or the outputs differ (the library is
    removed), and `FinishInterrupted` when the scheduler stops while waiting."""
    sets = check_inputs(m)
    manifest = load_manifest(directory)
    library = directory / manifest["library"]
    failed_name = failed_library_name(manifest["target"])
    # the peers run on the CPU: not beside a GPU's model (as `tune`)
    peers_onnx = m.reference_onnx if not is_gpu(manifest["target"]) else None
    # One run at a time: a new run of the job supersedes its open ones (a restarted
    # scheduler's), so each kind's run is queued once the previous one is done.
    runs: dict[str, int] = {}
    rows: dict[str, ModelRun | None] = {}
    for i, (kind, feeds) in enumerate(sets.items()):
        runs[kind] = _submit(where, library, [feeds[t.name] for t in m.imported.inputs], timed=i == 0,
                             onnx=peers_onnx if i == 0 else None, input_names=[t.name for t in m.imported.inputs])
        log(f"{m.name}: the tuned model is queued for an agent of {where.device_class} ({kind} input, model run {runs[kind]})")
        rows[kind], why = _wait(where, runs[kind])
        if rows[kind] is None or rows[kind].state is ModelRunState.FAILED:
            break
    timed_kind = next(iter(runs))
    if any(row is None for row in rows.values()):  # (the loop stopped at it)
        log(f"{m.name}: {why}; the tuned model is kept unchecked")
        checked = {"ok": None, "reference": m.reference_name, "problem": why}
        return ModelOutcome(m.name, directory, None, checked, None, None,
                            measured_on=_measured_on(where, runs[timed_kind], rows[timed_kind]))
    measured_on = _measured_on(where, runs[timed_kind], rows[timed_kind])
    failed = next((row for row in rows.values() if row.state is ModelRunState.FAILED), None)
    if failed is not None:
        library.unlink(missing_ok=True)
        raise JobFailed(f"{m.name}: the tuned model did not run on {_device_text(measured_on, where)}: {failed.error}")
    names = [t.name for t in m.imported.outputs]
    tolerance = model_tolerance(m)  # float32's, or the model's reduced precision's
    errors = []
    for kind, row in rows.items():
        assert row is not None
        errors += check.check_outputs(_outputs(where.artifact_root, row), m.reference(sets[kind]), sets[kind],
                                      input_kind=kind, names=names, exact=m.exact, tolerance=tolerance)
    result = check.ModelCheck(m.reference_name, tuple(errors), check.exact_name(errors, m.exact), tolerance)
    if not result.ok:
        library.replace(directory / failed_name)
        raise JobFailed(
            f"{m.name}: the tuned model's output on {_device_text(measured_on, where)} differs from "
            f"{m.reference_name}'s: {result.problem()}; kept as {failed_name} (not the tuned model)"
        )
    timed_row = rows[timed_kind]
    assert timed_row is not None
    emulated = measured_on["emulated"]
    latency = _latency(timed_row.result or {}, emulated)
    peers, notes = _peers(timed_row.peer_latencies, emulated) if peers_onnx is not None else ({}, {})
    device = f"{_device_text(measured_on, where)}{' (emulated)' if emulated else ''}"
    log(f"{m.name}: checked on {device}: max abs error {result.max_abs_error:.3g}")
    log(f"{m.name}: {_timed_text(latency, peers, notes, device)}")
    return ModelOutcome(
        m.name, directory, latency, result.as_report(), None, peers.get(ONNXRUNTIME), peers.get(OPENVINO),
        measured_on=measured_on, peer_notes=notes or None,
    )


def _latency(timed: dict[str, Any], emulated: bool) -> dict[str, Any] | None:
    """A latency the agent measured (the model's `result`, or a peer's entry of
    `peer_latencies`) as the report has it, flagged `emulated` or not; None without
    samples. An agent older than peer timing reports no threads (0) nor rounds."""
    samples = [float(x) for x in timed.get("latency_samples", [])]
    if not samples:
        return None
    measured = Latency.of(samples, int(timed.get("threads") or 0), [float(x) for x in timed.get("round_medians") or []])
    return {**measured.as_report(), "emulated": emulated}


def _peers(stored: dict[str, Any] | None, emulated: bool) -> tuple[dict[str, dict], dict[str, str]]:
    """The peers' latencies the agent measured (by peer) and, for each peer it did not
    time, why (a note of the result, never a failed job)."""
    if not stored:
        return {}, {ONNXRUNTIME: "the agent timed no peers (an agent older than peer timing)"}
    latencies: dict[str, dict] = {}
    notes: dict[str, str] = {}
    for peer, timed in stored.items():
        latency = _latency(timed, emulated) if not timed.get("error") else None
        if latency is not None:
            latencies[peer] = latency
        else:
            notes[peer] = str(timed.get("error") or "no samples")
    return latencies, notes


def _timed_text(latency: dict | None, peers: dict[str, dict], notes: dict[str, str], device: str) -> str:
    """The log line of where the model was timed: "timed on arm-1: p50 40.1 us; onnxruntime
    p50 61.0 us; openvino not timed (...)"."""
    if latency is None:
        return f"not timed on {device}"
    parts = [f"timed on {device}: p50 {latency['median'] * 1e6:.1f} us"]
    parts += [f"{peer} p50 {lat['median'] * 1e6:.1f} us" for peer, lat in peers.items()]
    parts += [f"{peer} not timed ({why})" for peer, why in notes.items()]
    return "; ".join(parts)


def _submit(
    where: DeviceRun, library: Path, inputs: list[np.ndarray], *, timed: bool, onnx: bytes | None,
    input_names: list[str],
) -> int:
    """Store the run's files and queue it; with `onnx`, the agent times the peers on it."""
    rel = artifacts.model_run_dir(where.job_id, uuid.uuid4().hex)
    buffer = io.BytesIO()
    np.savez(buffer, *inputs)
    # the library keeps its name: the agent picks its loader by the suffix (`.cuda.tar`: the GPU's)
    lib_sha, lib_size = artifacts.put(where.artifact_root, f"{rel}/{library.name}", library)
    in_sha, in_size = artifacts.put(where.artifact_root, f"{rel}/{artifacts.MODEL_RUN_INPUTS_NAME}", buffer.getvalue())
    graph = None
    if onnx is not None:
        onnx_sha, onnx_size = artifacts.put(where.artifact_root, f"{rel}/{ONNX_NAME}", onnx)
        graph = model_runs.StoredFile(f"{rel}/{ONNX_NAME}", onnx_sha, onnx_size)
    with transaction(where.sessions) as s:
        run = model_runs.create_model_run(
            s,
            job_id=where.job_id,
            device_class_id=where.device_class_id,
            library=model_runs.StoredFile(f"{rel}/{library.name}", lib_sha, lib_size),
            inputs=model_runs.StoredFile(f"{rel}/{artifacts.MODEL_RUN_INPUTS_NAME}", in_sha, in_size),
            repeat=where.repeat if timed else 0,
            warmup=where.warmup,
            timeout_secs=where.timeout_secs,
            onnx=graph,
            input_names=input_names if graph is not None else None,
        )
        if where.signer is not None:  # bound to this run: not replayable onto another
            run.library_signature = where.signer.sign(SignedKind.MODEL_LIBRARY, run.id, lib_sha).hex()
            if graph is not None:
                run.onnx_signature = where.signer.sign(SignedKind.MODEL_ONNX, run.id, graph.sha256).hex()
        return run.id


def _wait(where: DeviceRun, run_id: int) -> tuple[ModelRun | None, str]:
    """The run's row once it is done or failed; (None, why) after `wait_secs`, or
    sooner, once `no_agent_secs` have passed, while nobody has it and the class has no
    live agent (none heartbeated within the last `no_agent_secs`): a run nobody can take
    is not waited for (an agent that comes within that grace still takes it)."""
    start = time.monotonic()
    deadline = start + where.wait_secs
    while True:
        with transaction(where.sessions) as s:
            row = model_checks.read_model_run(s, model_run_id=run_id)
            if row is None:
                raise JobFailed(f"model run {run_id} vanished")
            if row.state.is_terminal:
                return row, ""
            waiting = row.state is ModelRunState.READY
            live = job_store.live_agents_by_class(s, fresh_secs=where.no_agent_secs).get(where.device_class_id, 0)
        why = ""
        if waiting and not live and time.monotonic() - start >= where.no_agent_secs:
            why = (
                f"not run: no agent of {where.device_class} is online "
                f"(none heartbeated in the last {where.no_agent_secs:.0f} s)"
            )
        elif time.monotonic() >= deadline:
            why = f"not run: no agent of {where.device_class} ran it within {where.wait_secs:.0f} s"
        if why:
            with transaction(where.sessions) as s:
                model_runs.give_up_model_run(s, model_run_id=run_id, reason=why)
            return None, why
        if where.stop.wait(where.poll_secs):
            raise FinishInterrupted(f"the scheduler stopped while model run {run_id} was waiting")


def _outputs(root: Path, row: ModelRun) -> list[np.ndarray]:
    if not row.outputs_path:
        raise JobFailed(f"model run {row.id} is done but has no outputs")
    try:
        with np.load(artifacts.resolve(root, row.outputs_path), allow_pickle=False) as data:
            return [data[f"arr_{i}"] for i in range(len(data.files))]
    except (OSError, ValueError, KeyError) as exc:
        raise JobFailed(f"the outputs of model run {row.id} are unreadable: {exc}") from None


def _measured_on(where: DeviceRun, run_id: int, row: ModelRun | None) -> dict[str, Any]:
    """Where the model ran: the agent and, for an agent with a GPU, the GPU's name and
    compute capability (its registered capabilities, which the lease service copies
    into each run's fingerprint)."""
    result = (row.result if row is not None else None) or {}
    fingerprint = result.get("fingerprint") or {}
    out: dict[str, Any] = {
        "on": "an agent of the class",
        "device_class": where.device_class,
        "agent": result.get("agent"),
        "emulated": bool(result.get("emulated", False)),
        "model_run": run_id,
    }
    if fingerprint.get("gpu_name"):
        out["gpu"] = str(fingerprint["gpu_name"])
        out["compute_capability"] = str(fingerprint.get("gpu_compute_capability") or "")
    return out


def _device_text(measured_on: dict[str, Any], where: DeviceRun) -> str:
    """The agent (and its GPU) a message names: "gpu-1 (NVIDIA H100 80GB HBM3)"."""
    agent = measured_on.get("agent") or f"an agent of {where.device_class}"
    return f"{agent} ({measured_on['gpu']})" if measured_on.get("gpu") else agent
