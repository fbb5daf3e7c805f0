"""A farm in a known state, written through the farm's own functions (the API's `crud`, the
scheduler's `job_store`, the lease service's `services.db` operations), for the dashboard and /metrics
tests: two teams, a device class, a 3-task model, a running job of team A with measured
batches (valid kernels and errors by kind), its curve, a job of team B, two agents (one
alive, one silent), and batches left in the queue (`seed_farm`); and, for the dashboard,
a job of team A that succeeded on a second class, with its tuned model archive
(`seed_finished_job`).

The numbers the views must show are in `FarmState`.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from sqlalchemy import func, insert, select, update

from services.api import crud
from services.api.schemas import JobCreate
from services.api.storage import StoredFile
from services.common import artifacts
from services.db import (
    agents,
    batches,
    codec,
    device_classes,
    job_store,
    leases,
    measurements,
    teams,
    tokens,
    uploads,
)
from services.db.models import Agent, Batch, BatchCandidate, Job, JobTask
from services.db.session import transaction
from services.db.states import BatchState
from tunefarm.records import Candidate, ErrorKind, MeasureInput, MeasureRecord, TimingConfig

TASKS = (  # name, weight, flops per call
    ("fused_conv2d_add_relu(1x3x32x32)", 1, 2.0e6),
    ("max_pool2d(1x16x32x32)", 2, 1.0e5),
    ("fused_matmul_add(1x512,512x10)", 1, 1.0e4),
)

# Per task: the costs (seconds) measured, None for an error of the paired kind.
MEASURED = (
    [(4e-5, None), (3e-5, None), (None, ErrorKind.RUN_ERROR), (None, ErrorKind.RUN_TIMEOUT)],
    [(8e-6, None), (6e-6, None), (None, ErrorKind.RUN_ERROR)],
    [],  # never measured: "not yet" tuned
)

CURVE = ((8, 9e-5), (16, 7e-5), (24, 5.5e-5), (32, 4.2e-5))
"""(trials, estimated latency) points the scheduler wrote."""


@dataclass
class FarmState:
    device_class: str
    team_a_token: str
    team_b_token: str
    agent_token: str
    job_a: int
    job_b: int
    alive_agent: str
    silent_agent: str
    model_name: str
    trial_budget: int
    queued_batches: int  # ready, waiting for an agent
    proposed_batches: int
    errors_by_task: list[dict[str, int]] = field(default_factory=list)
    best_by_task: list[float | None] = field(default_factory=list)
    measured_by_alive: int = 0


def _record(inp: MeasureInput, name: str, cost: float | None, kind: ErrorKind | None) -> MeasureRecord:
    return MeasureRecord(
        task=inp.task, workload=name, target={"kind": "llvm"}, sketch=0, sketch_sig=inp.sketch_sig,
        decisions=inp.candidate.decisions, trace=inp.trace, costs=(cost,) if cost is not None else (),
        error_kind=kind or ErrorKind.NONE, error_msg="" if kind is None else "failed", build_secs=0.1,
        run_secs=0.01, verified=cost is not None, timestamp=1.0,
    )


def _batch(s, *, job_id: int, job_task_id: int, workload_id: int, class_id: int, task_key: str, n: int, salt: int):
    inputs = [MeasureInput(task_key, Candidate.make(0, {"t": i, "salt": salt}), "sig", [["trace"]]) for i in range(n)]
    batch_id = s.scalar(
        insert(Batch).values(job_id=job_id, job_task_id=job_task_id, workload_id=workload_id, device_class_id=class_id,
                             timing=codec.timing_to_json(TimingConfig()), build_timeout_secs=60, run_timeout_secs=30)
        .returning(Batch.id)
    )
    ids = list(s.scalars(insert(BatchCandidate).returning(BatchCandidate.id), [
        {"batch_id": batch_id, "position": i, "candidate_key": m.key, "input": codec.input_to_json(m)}
        for i, m in enumerate(inputs)
    ]))
    return batch_id, list(zip(ids, inputs))


def seed_farm(sessions, *, trial_budget: int = 64) -> FarmState:
    uid = uuid.uuid4().hex[:8]
    with transaction(sessions) as s:
        a = teams.ensure_team(s, name=f"ui-a-{uid}")
        b = teams.ensure_team(s, name=f"ui-b-{uid}")
        token_a, token_b = tokens.issue_team_token(s, team_id=a.id), tokens.issue_team_token(s, team_id=b.id)
        agent_token = tokens.issue_agent_token(s)
        dc = device_classes.ensure_device_class(s, name=f"ui-class-{uid}", target={"kind": "llvm", "num-cores": 2})
        intake = {
            "tasks": [
                {"position": i, "name": name, "key": f"{name}#{uid}{i}", "shapes": "-", "weight": w, "flops": f,
                 "share": 1 / len(TASKS), "module_json": "{}", "n_inputs": 2, "n_outputs": 1,
                 "const_inputs": [], "global_vars": [f"f{i}"]}
                for i, (name, w, f) in enumerate(TASKS)
            ],
            "inputs": [{"name": "x", "shape": [1, 3, 32, 32], "dtype": "float32"}],
            "outputs": [{"name": "y", "shape": [1, 10], "dtype": "float32"}],
            "warnings": [],
        }
        stored = StoredFile(path=f"models/{uid}.onnx", sha256="0" * 64, size=1)
        model_a = uploads.store_model(s, team_id=a.id, name=f"cnn-{uid}", input_shapes={"x": [1, 3, 32, 32]},
                                   onnx=stored, fused=stored, intake=intake)
        model_b = uploads.store_model(s, team_id=b.id, name=f"other-{uid}", input_shapes={"x": [1, 3, 32, 32]},
                                   onnx=stored, fused=stored, intake=intake)
        body = JobCreate(model_id=model_a.id, device_class=dc.name, trial_budget=trial_budget)
        job_a = crud.create_job(s, team_id=a.id, body=body, max_trial_budget=10_000).id
        job_b = crud.create_job(s, team_id=b.id, body=body.model_copy(update={"model_id": model_b.id}),
                                max_trial_budget=10_000).id
        class_id = dc.id
        model_name = model_a.name
    with transaction(sessions) as s:
        setup = job_store.claim_job(s, job_id=job_a)
        alive = agents.register_agent(s, name=f"agent-alive-{uid}", device_class_id=class_id, token_id=None,
                                       capabilities={"cpu_model": "Test CPU"})
        silent = agents.register_agent(s, name=f"agent-silent-{uid}", device_class_id=class_id, token_id=None,
                                        capabilities={"cpu_model": "Test CPU"})
        alive_id, silent_id, alive_name, silent_name = alive.id, silent.id, alive.name, silent.name
    state = FarmState(dc.name, token_a, token_b, agent_token, job_a, job_b, alive_name, silent_name, model_name,
                      trial_budget, queued_batches=1, proposed_batches=1)
    wl_ids = {}
    with transaction(sessions) as s:
        for jt in s.scalars(select(JobTask).where(JobTask.job_id == job_a).order_by(JobTask.position)):
            wl_ids[jt.position] = (jt.id, jt.workload_id, jt.task_key)
    for position, measured in enumerate(MEASURED):
        errors: dict[str, int] = {}
        costs = [c for c, _ in measured if c is not None]
        state.best_by_task.append(min(costs) if costs else None)
        if not measured:
            state.errors_by_task.append(errors)
            continue
        jt_id, wl_id, key = wl_ids[position]
        with transaction(sessions) as s:
            batch_id, cands = _batch(s, job_id=job_a, job_task_id=jt_id, workload_id=wl_id, class_id=class_id,
                                     task_key=key, n=len(measured), salt=position)
            batches.transition_batch(s, batch_id=batch_id, to=BatchState.BUILDING)
            batches.mark_batch_ready(s, batch_id=batch_id)
        with transaction(sessions) as s:
            lease = leases.lease_next_batch(s, agent_id=alive_id, lease_secs=30)
            assert lease is not None and lease.batch_id == batch_id
            items = []
            for (cid, inp), (cost, kind) in zip(cands, measured):
                items.append((cid, _record(inp, TASKS[position][0], cost, kind)))
                if kind is not None:
                    errors[str(kind)] = errors.get(str(kind), 0) + 1
            measurements.record_measurements(s, lease_id=lease.id, agent_id=alive_id, items=items, fingerprint={"t": 1})
            assert leases.finish_lease(s, lease_id=lease.id, agent_id=alive_id) is BatchState.DONE
        state.errors_by_task.append(errors)
        state.measured_by_alive += len(measured)
    # The queue: one batch ready (waiting for an agent), one just proposed (waiting for a build).
    jt_id, wl_id, key = wl_ids[2]
    with transaction(sessions) as s:
        ready_id, _ = _batch(s, job_id=job_a, job_task_id=jt_id, workload_id=wl_id, class_id=class_id, task_key=key,
                             n=2, salt=10)
        batches.transition_batch(s, batch_id=ready_id, to=BatchState.BUILDING)
        batches.mark_batch_ready(s, batch_id=ready_id)
        _batch(s, job_id=job_a, job_task_id=jt_id, workload_id=wl_id, class_id=class_id, task_key=key, n=2, salt=11)
    with transaction(sessions) as s:
        for trials, est in CURVE:
            job_store.write_progress(s, job_id=job_a, trials=trials, est_latency_secs=est)
        leases.heartbeat(s, agent_id=alive_id, lease_secs=30)  # holds no lease now: idle
        # The silent agent last heartbeat long ago (beyond any lease window).
        s.execute(update(Agent).where(Agent.id == silent_id).values(last_heartbeat_at=func.now() - timedelta(hours=1)))
        # Each task's best awaits its confirmation (services.db.confirmations): a ready batch too.
        confirmations = s.scalar(select(func.count()).select_from(Batch).where(
            Batch.job_id == job_a, Batch.confirms_measurement_id.is_not(None), Batch.state == BatchState.READY))  # fmt: skip
    assert setup.job_id == job_a and confirmations == sum(1 for b in state.best_by_task if b is not None)
    state.queued_batches += confirmations
    return state


FINISHED_MEASURED = (
    [(5e-5, None), (2.5e-5, None)],
    [(7e-6, None), (5e-6, None), (None, ErrorKind.RUN_ERROR)],
    [(2e-6, None)],
)
"""Per task of the finished job: what its agent measured (as MEASURED)."""

FINISHED_CURVE = ((8, 1.2e-4), (16, 8e-5), (24, 4e-5))

FINISHED_RESULT = {
    "stop_reason": "budget", "trials": 24,
    "latency": {"mean": 3.1e-5, "median": 3e-5, "p90": 3.4e-5, "p99": 4e-5, "threads": 2, "runs": 200},
    "onnxruntime_latency": {"mean": 7.6e-5, "median": 7.5e-5, "p90": 8e-5, "p99": 9e-5, "threads": 2, "runs": 200},
    "openvino_latency": {"mean": 6.1e-5, "median": 6e-5, "p90": 6.5e-5, "p99": 7e-5, "threads": 2, "runs": 200},
    "check": {"ok": True, "reference": "onnxruntime", "max_abs_error": 1e-7},
    "measured_on": {"on": "an agent of the class", "emulated": False},  # + its agent and class (finished_job)
}
"""The finished job's result: the tuned model measured 2.50x the speed of onnxruntime and
2.00x OpenVINO's (p50), on an agent of its class."""


def finished_result(agent_name: str, class_name: str) -> dict:
    """FINISHED_RESULT as measured on the finished job's agent."""
    on = {**FINISHED_RESULT["measured_on"], "agent": agent_name, "device_class": class_name}
    return {**FINISHED_RESULT, "measured_on": on}


@dataclass
class FinishedJob:
    """A job of team A that succeeded, on a second class (`device_class`) whose agent
    `agent` measured it (a second agent of the class has measured nothing), its tuned
    model archive under the artifact root."""

    job_id: int
    device_class: str
    agent: str
    agent_id: int
    archive: bytes
    sha256: str
    best_by_task: list[float | None]
    speedup: float


def _measure(sessions, *, job_id: int, class_id: int, agent_id: int, task: tuple[int, int, str], position: int,
             measured) -> None:
    """One batch of `measured` (cost, error kind) for the job's task, leased and measured by the agent."""
    jt_id, wl_id, key = task
    with transaction(sessions) as s:
        batch_id, cands = _batch(s, job_id=job_id, job_task_id=jt_id, workload_id=wl_id, class_id=class_id,
                                 task_key=key, n=len(measured), salt=100 + position)
        batches.transition_batch(s, batch_id=batch_id, to=BatchState.BUILDING)
        batches.mark_batch_ready(s, batch_id=batch_id)
    with transaction(sessions) as s:
        lease = leases.lease_next_batch(s, agent_id=agent_id, lease_secs=30)
        assert lease is not None and lease.batch_id == batch_id
        items = [(cid, _record(inp, TASKS[position][0], cost, kind)) for (cid, inp), (cost, kind) in zip(cands, measured)]
        measurements.record_measurements(s, lease_id=lease.id, agent_id=agent_id, items=items, fingerprint={"t": 1})
        assert leases.finish_lease(s, lease_id=lease.id, agent_id=agent_id) is BatchState.DONE


def seed_finished_job(sessions, state: FarmState, artifact_root) -> FinishedJob:
    """Team A's model tuned on a second class: measured by that class's agent, its curve,
    then finished as the scheduler finishes a job (`job_store.finish_job`) with
    FINISHED_RESULT and an archive written where the scheduler writes it."""
    uid = uuid.uuid4().hex[:8]
    with transaction(sessions) as s:
        dc = device_classes.ensure_device_class(s, name=f"{state.device_class}-big-{uid}",
                                                target={"kind": "llvm", "num-cores": 4})
        team_a = s.scalar(select(Job.team_id).where(Job.id == state.job_a))
        model_id = s.scalar(select(Job.model_id).where(Job.id == state.job_a))
        body = JobCreate(model_id=model_id, device_class=dc.name, trial_budget=24)
        job_id = crud.create_job(s, team_id=team_a, body=body, max_trial_budget=10_000).id
        class_id, class_name = dc.id, dc.name
    with transaction(sessions) as s:
        job_store.claim_job(s, job_id=job_id)
        agent = agents.register_agent(s, name=f"agent-big-{uid}", device_class_id=class_id, token_id=None,
                                      capabilities={"cpu_model": "Big CPU", "logical_cores": 4})
        # A second agent of the class: the confirmations of the first's bests wait for it.
        agents.register_agent(s, name=f"agent-big-peer-{uid}", device_class_id=class_id, token_id=None,
                              capabilities={"cpu_model": "Big CPU", "logical_cores": 4})
        agent_id, agent_name = agent.id, agent.name
        tasks = [(jt.id, jt.workload_id, jt.task_key)
                 for jt in s.scalars(select(JobTask).where(JobTask.job_id == job_id).order_by(JobTask.position))]
    for position, measured in enumerate(FINISHED_MEASURED):
        _measure(sessions, job_id=job_id, class_id=class_id, agent_id=agent_id, task=tasks[position],
                 position=position, measured=measured)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        content = f"the tuned model of job {job_id}\n".encode()
        info = tarfile.TarInfo("tuned/manifest.json")
        info.size = len(content)
        tar.addfile(info, io.BytesIO(content))
    archive = buffer.getvalue()
    relative = artifacts.job_archive_path(job_id)
    path = Path(artifact_root) / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(archive)
    sha256 = hashlib.sha256(archive).hexdigest()
    with transaction(sessions) as s:
        for trials, est in FINISHED_CURVE:
            job_store.write_progress(s, job_id=job_id, trials=trials, est_latency_secs=est)
        leases.heartbeat(s, agent_id=agent_id, lease_secs=30)
        job_store.finish_job(s, job_id=job_id, artifact_path=relative, artifact_sha256=sha256,
                             artifact_size=len(archive), result=finished_result(agent_name, class_name))
    bests = [min((c for c, _ in m if c is not None), default=None) for m in FINISHED_MEASURED]
    speedup = FINISHED_RESULT["onnxruntime_latency"]["median"] / FINISHED_RESULT["latency"]["median"]
    return FinishedJob(job_id, class_name, agent_name, agent_id, archive, sha256, bests, speedup)
