"""Rows the farm's benchmarks make up and read back (`tunefarm bench farm`, `bench farm-load`,
the progress endpoint under pollers): jobs as the farm's services would have left them,
inserted in bulk, and the counts and times the benchmarks report. The farm's services
never call these.

Every function works inside the caller's transaction and commits nothing itself.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from services.db import codec
from services.db.models import (
    Agent,
    Batch,
    BatchCandidate,
    Job,
    JobProgress,
    JobTask,
    Lease,
    Measurement,
    Model,
    ModelTask,
    WorkloadRow,
)
from services.db.states import BatchState, JobState, LeaseState
from tunefarm.records import Candidate, ErrorKind, MeasureInput, MeasureRecord, TimingConfig

# -- making jobs up -----------------------------------------------------------------------------


def add_model_and_jobs(
    session: Session,
    *,
    team_id: int,
    device_class_id: int,
    name: str,
    n_jobs: int,
    trial_budget: int,
    running: bool = False,
) -> list[int]:
    """A model of the team with no tasks and `n_jobs` jobs of it on the class (queued, or
    `running` since now); their ids."""
    model = Model(
        team_id=team_id, name=name, input_shapes={}, onnx_path="-", onnx_sha256="0" * 64,
        onnx_size=0, fused_path="-", fused_sha256="0" * 64, fused_size=0, task_table=[],
    )  # fmt: skip
    session.add(model)
    session.flush()
    started = {"state": JobState.RUNNING, "started_at": func.now()} if running else {}
    jobs = [
        Job(
            team_id=team_id,
            model_id=model.id,
            device_class_id=device_class_id,
            trial_budget=trial_budget,
            **started,
        )
        for _ in range(n_jobs)
    ]
    session.add_all(jobs)
    session.flush()
    return [j.id for j in jobs]


@dataclass(frozen=True)
class SyntheticJob:
    """A running job of a made-up model (`add_job_with_tasks`): its rows' ids and the
    model's task table."""

    job_id: int
    device_class_id: int
    workload_ids: list[int]
    job_task_ids: list[int]
    table: list[dict]


def add_job_with_tasks(
    session: Session,
    *,
    uid: str,
    team_id: int,
    device_class_id: int,
    tasks: int,
    trial_budget: int,
    batch_size: int,
) -> SyntheticJob:
    """A model of `tasks` tasks (workloads named after `uid`) and a running job of it."""
    wl_ids = list(
        session.scalars(
            insert(WorkloadRow).returning(WorkloadRow.id),
            [
                {"key": f"bench_{uid}_{i}#{i:016x}", "name": f"bench_task_{i}", "module_json": "{}",
                 "flops": 1e6 * (i + 1), "n_inputs": 2, "n_outputs": 1}
                for i in range(tasks)
            ],
        )
    )  # fmt: skip
    table = [
        {"position": i, "name": f"bench_task_{i}", "key": f"bench_{uid}_{i}#{i:016x}", "shapes": "-",
         "weight": 1, "flops": 1e6 * (i + 1), "share": 1 / tasks}
        for i in range(tasks)
    ]  # fmt: skip
    model = Model(team_id=team_id, name=f"bench-{uid}", input_shapes={}, onnx_path="-", onnx_sha256="0" * 64,
                  onnx_size=1, fused_path="-", fused_sha256="0" * 64, fused_size=1, task_table=table)  # fmt: skip
    session.add(model)
    session.flush()
    session.execute(insert(ModelTask), [{"model_id": model.id, "workload_id": w, "position": i, "weight": 1,
                                         "const_inputs": [], "global_vars": []} for i, w in enumerate(wl_ids)])  # fmt: skip
    job = Job(team_id=team_id, model_id=model.id, device_class_id=device_class_id, trial_budget=trial_budget,
              state=JobState.RUNNING, config={"strategy": "gradient", "seed": 1, "batch_size": batch_size})  # fmt: skip
    session.add(job)
    session.flush()
    jt_ids = list(
        session.scalars(
            insert(JobTask).returning(JobTask.id),
            [{"job_id": job.id, "workload_id": w, "task_key": f"{table[i]['key']}@bench", "position": i,
              "weight": 1} for i, w in enumerate(wl_ids)],
        )
    )  # fmt: skip
    return SyntheticJob(job.id, device_class_id, wl_ids, jt_ids, table)


def add_done_batch(session: Session, job: SyntheticJob, i: int, first: int, n: int) -> list[float]:
    """A done batch of task `i` with `n` measurements (candidates numbered from `first`);
    their costs."""
    task = f"{job.table[i]['key']}@bench"
    batch_id = session.scalar(
        insert(Batch).values(job_id=job.job_id, job_task_id=job.job_task_ids[i], workload_id=job.workload_ids[i],
                             device_class_id=job.device_class_id, state=BatchState.DONE,
                             timing=codec.timing_to_json(TimingConfig()), build_timeout_secs=60, run_timeout_secs=30)
        .returning(Batch.id)
    )  # fmt: skip
    inputs = [MeasureInput(task, Candidate.make(0, {"t": first + k}), "sig", [["trace"]]) for k in range(n)]
    cand_ids = list(
        session.scalars(
            insert(BatchCandidate).returning(BatchCandidate.id),
            [{"batch_id": batch_id, "position": k, "candidate_key": m.key, "input": codec.input_to_json(m)}
             for k, m in enumerate(inputs)],
        )
    )  # fmt: skip
    rows, costs = [], []
    for k, (cid, m) in enumerate(zip(cand_ids, inputs)):
        cost = 1e-4 * (1 + ((first + k) * 7919 % 1000) / 1000)
        costs.append(cost)
        rec = MeasureRecord(task=m.task, workload=job.table[i]["name"], target={"kind": "llvm"}, sketch=0,
                            sketch_sig="sig", decisions=m.candidate.decisions, trace=m.trace, costs=(cost,),
                            error_kind=ErrorKind.NONE, error_msg="", build_secs=0.1, run_secs=0.01,
                            verified=True, timestamp=time.time())  # fmt: skip
        rows.append({"batch_candidate_id": cid, "job_id": job.job_id, "job_task_id": job.job_task_ids[i],
                     "workload_id": job.workload_ids[i], "device_class_id": job.device_class_id,
                     "candidate_key": m.key, "cost": cost, "error_kind": ErrorKind.NONE,
                     "record": codec.record_to_json(rec), "fingerprint": {"tvm": "bench"}})  # fmt: skip
    session.execute(insert(Measurement), rows)
    return costs


def set_job_totals(
    session: Session, job: SyntheticJob, best: list[float], measurements: int, curve_points: int
) -> None:
    """The job's and its tasks' counts and bests (`best` per task, inf: none), and a
    progress curve of `curve_points` points."""
    for i, jt in enumerate(job.job_task_ids):
        trials = session.scalar(select(func.count()).where(Measurement.job_task_id == jt))
        session.execute(update(JobTask).where(JobTask.id == jt).values(
            trials=trials, best_cost=best[i] if math.isfinite(best[i]) else None))  # fmt: skip
    est = sum(b for b in best if math.isfinite(b)) or None
    session.execute(update(Job).where(Job.id == job.job_id).values(
        trials_used=measurements, est_latency_secs=est, est_latency_start_secs=est and est * 2))  # fmt: skip
    points = [{"job_id": job.job_id, "trials": max(1, measurements) * (p + 1) // curve_points,
               "elapsed_secs": p * 1.0, "est_latency_secs": est and est * (2 - p / curve_points)}
              for p in range(curve_points)]  # fmt: skip
    session.execute(insert(JobProgress), list({p["trials"]: p for p in points}.values()))


def move_batches(session: Session, batch_ids: Sequence[int], device_class_id: int) -> None:
    """Hand the batches to another class's agents (all at once)."""
    session.execute(
        update(Batch).where(Batch.id.in_(list(batch_ids))).values(device_class_id=device_class_id)
    )


# -- reading back -------------------------------------------------------------------------------


def agent_capabilities(session: Session, names: Sequence[str]) -> list[tuple[str, dict[str, Any] | None]]:
    """(name, capabilities) of the named agents that have registered."""
    return [
        (n, caps)
        for n, caps in session.execute(
            select(Agent.name, Agent.capabilities).where(Agent.name.in_(list(names)))
        )
    ]


def agents_in_class(session: Session, device_class_id: int) -> int:
    """How many agents have registered for the class."""
    return int(
        session.scalar(
            select(func.count()).select_from(Agent).where(Agent.device_class_id == device_class_id)
        )
    )


def batch_ids(session: Session, job_id: int) -> set[int]:
    """The job's batches."""
    return set(session.scalars(select(Batch.id).where(Batch.job_id == job_id)))


def batch_states(session: Session, ids: Sequence[int]) -> list[BatchState]:
    """The state of each of these batches."""
    return list(session.scalars(select(Batch.state).where(Batch.id.in_(list(ids)))))


def batch_times(session: Session, ids: Sequence[int]) -> list[tuple[datetime, datetime, datetime, datetime]]:
    """For each of these batches (measured, leased): when it was made, built, first
    leased, and its last measurement stored (the database's clock)."""
    rows = session.execute(
        select(Batch.created_at, Batch.ready_at, func.min(Lease.granted_at), func.max(Measurement.created_at))
        .join(Lease, Lease.batch_id == Batch.id)
        .join(BatchCandidate, BatchCandidate.batch_id == Batch.id)
        .join(Measurement, Measurement.batch_candidate_id == BatchCandidate.id)
        .where(Batch.id.in_(list(ids)))
        .group_by(Batch.id)
    )
    return [tuple(row) for row in rows]  # type: ignore[misc]


def lease_states(session: Session, job_ids: Sequence[int]) -> dict[LeaseState, int]:
    """How many of the jobs' leases are in each state."""
    return dict(session.execute(  # type: ignore[arg-type]
        select(Lease.state, func.count()).join(Batch, Batch.id == Lease.batch_id)
        .where(Batch.job_id.in_(list(job_ids))).group_by(Lease.state)
    ).all())  # fmt: skip


def measurement_count(session: Session, job_ids: Sequence[int]) -> int:
    """The jobs' measurements."""
    n = session.scalar(
        select(func.count()).select_from(Measurement).where(Measurement.job_id.in_(list(job_ids)))
    )
    return int(n or 0)


def measurements_per_candidate(session: Session, job_ids: Sequence[int]) -> list[int]:
    """For each candidate of the jobs' search batches, how many measurements it has (a
    confirmation batch's re-measurement is a `Confirmation`, not a measurement)."""
    return list(session.scalars(
        select(func.count(Measurement.id)).select_from(BatchCandidate)
        .join(Batch, Batch.id == BatchCandidate.batch_id)
        .outerjoin(Measurement, Measurement.batch_candidate_id == BatchCandidate.id)
        .where(Batch.job_id.in_(list(job_ids)), Batch.confirms_measurement_id.is_(None))
        .group_by(BatchCandidate.id)
    ))  # fmt: skip


def batches_not_done(session: Session, job_ids: Sequence[int]) -> int:
    """The jobs' batches not done."""
    n = session.scalar(
        select(func.count())
        .select_from(Batch)
        .where(Batch.job_id.in_(list(job_ids)), Batch.state != BatchState.DONE)
    )
    return int(n or 0)
