"""The farm's measurer: a `Measurer` over PostgreSQL, RQ build workers and device agents.

    prepare(workload)  -> the workload row (with its buffers' bytes, for the timing floor),
                          its task data file under the artifact root
                          (inputs; expected outputs from the numpy reference or from the
                          unscheduled program run once on this host, within a bounded
                          time, as `LocalMeasurer` does) and the job's task row
    submit(batch)      -> one transaction (the batch and its candidates, each input as
                          JSON) and one RQ job, `build_batch(batch_id)`, on the device
                          class's build queue; build workers build, agents measure
    collect(timeout)   -> the job's measurements newer than the last one seen: their
                          stored records, decoded once (one query per poll)

Every submitted input comes back exactly once: measured by an agent, a build error
recorded by the build worker, an error the lease service recorded for a batch no agent
could finish, or, for a batch whose build job failed for good, an error recorded here
(`measurements.abandon_batch`). Builds are watched (`_check_batches`, every
`stuck_check_secs`): Postgres is the source of truth, Redis only carries the jobs. A batch
proposed or building that no worker holds the build lock of (`services.db.build_locks`)
and whose RQ job is not waiting in its queue (its worker was killed, Redis lost its data,
the job failed; a job started by a worker that has not taken the lock at two checks in a
row) is enqueued again: up to `max_requeues` times after failed jobs,
`max_lost_builds` after lost ones.

After a restart of the scheduler, `in_flight_batches()` gives the batches submitted
before and not finished, with their unmeasured inputs, for `TuningSession.adopt`.

Confirmation batches (`services.db.confirmations`: a best measured again) belong to the
job but not to its search: their results are confirmations, not measurements, so they
never come back from `collect`, and a restart adopts none of them.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common import artifacts
from services.common.queues import BUILD_JOB, build_job_id
from services.db import (
    batches,
    build_locks,
    codec,
    device_classes,
    farm_batches,
    farm_tasks,
    job_store,
    measurements,
)
from services.db.session import Session, SessionFactory, transaction
from services.db.states import BatchState
from services.scheduler.decoded_records import DecodedRecords
from tunefarm.measure import MeasureBatch, Measurer, MeasureTask
from tunefarm.measure.local import REFERENCE_TIMEOUT_SECS, LocalMeasurer
from tunefarm.records import (
    BuildResult,
    ErrorKind,
    MeasureInput,
    MeasureRecord,
    MeasureResult,
    RunResult,
)
from tunefarm.workloads import Workload as WorkloadSpec

if TYPE_CHECKING:
    from redis import Redis

POLL_INTERVAL_SECS = 0.1
"""How often `collect` looks for new measurements while it waits."""

STUCK_CHECK_SECS = 5.0
"""How often the states of the batches in flight and their build jobs are checked."""

MAX_POLL_ROWS = 5000
"""Measurements read per poll at most (the rest come with the next one)."""

WORKLOAD_REF = "farm:workload:"
TASK_DATA_REF = "farm:task_data:"
"""`MeasureTask.workload` / `.task_data` in the farm: ids, resolved by the services."""

_BUILD_KINDS = (ErrorKind.BUILD_ERROR, ErrorKind.BUILD_TIMEOUT)

_WAITING = ("queued", "scheduled", "deferred")
"""RQ job statuses of a build that still waits for a worker."""


@dataclass
class _Task:
    workload_id: int
    job_task_id: int
    measure_task: MeasureTask


@dataclass
class _InFlight:
    """A batch of this job whose results are still awaited."""

    batch_id: int
    waiting: set[str]  # candidate keys without a result yet
    requeues: int = 0  # builds enqueued again after their job failed
    lost: int = 0  # builds enqueued again after nobody was doing them (a dead worker, Redis's data lost)
    inputs: dict[str, MeasureInput] = field(default_factory=dict)


class FarmMeasurer(Measurer):
    def __init__(
        self,
        sessions: SessionFactory,
        redis: Redis,
        *,
        artifact_root: str | os.PathLike[str],
        job_id: int,
        device_class: str,
        queue_prefix: str = "tunefarm",
        reference_timeout: float = REFERENCE_TIMEOUT_SECS,
        poll_interval: float = POLL_INTERVAL_SECS,
        stuck_check_secs: float = STUCK_CHECK_SECS,
        max_requeues: int = 2,
        max_lost_builds: int = 10,
        build_job_timeout: int = 1800,
        after_measurement_id: int | None = None,
        decoded: DecodedRecords | None = None,
        log: Callable[[str], None] = lambda msg: None,
    ):
        """`after_measurement_id`: results are the job's measurements after this id (a
        restarted scheduler passes the last one it resumed from); default: the job's
        newest measurement now. `decoded`: the process's decoded records (shared with the
        class model, `DecodedRecords`)."""
        self.sessions = sessions
        self.decoded = decoded if decoded is not None else DecodedRecords()
        self.redis = redis
        self.artifact_root = Path(artifact_root)
        self.job_id = job_id
        self.device_class = device_class
        self.queue_prefix = queue_prefix
        self.reference_timeout = reference_timeout
        self.poll_interval = poll_interval
        self.stuck_check_secs = stuck_check_secs
        self.max_requeues = max_requeues
        self.max_lost_builds = max_lost_builds
        self._suspects: set[int] = set()  # batches whose started build job had no lock at the last check
        self.build_job_timeout = build_job_timeout
        self.log = log
        self._tasks: dict[str, _Task] = {}
        self._flight: dict[int, _InFlight] = {}
        self._reference: LocalMeasurer | None = None
        self._closed = False
        self._last_check = time.monotonic()
        with transaction(sessions) as s:
            dc = device_classes.find_device_class(s, name=device_class)
            if dc is None:
                raise ValueError(f"device class {device_class!r} does not exist")
            self.device_class_id = dc.id
            self.target = dict(dc.target)
            if after_measurement_id is None:
                after_measurement_id = job_store.last_measurement_id(s, job_id=job_id)
        self._last_id = int(after_measurement_id or 0)

    # -- preparing a task ---------------------------------------------------------------

    def prepare(self, workload: WorkloadSpec, task_key: str, target: dict[str, Any]) -> MeasureTask:
        """The workload row, its task data (computed once per workload, shared by every
        job), and this job's task row."""
        fields = farm_tasks.workload_fields(workload)
        with transaction(self.sessions) as s:
            workload_id = farm_tasks.store_workload(s, workload=fields)
            assert workload_id is not None
            td = farm_tasks.task_data_of(s, workload_id=workload_id)
            have = td is not None and _is_file(self.artifact_root, td.path)
        if not have:
            self._write_task_data(workload, workload_id, task_key)
        with transaction(self.sessions) as s:
            td = farm_tasks.required_task_data(s, workload_id=workload_id)
            job_task_id = farm_tasks.add_job_task(s, job_id=self.job_id, workload_id=workload_id, task_key=task_key)
            task = MeasureTask(
                key=task_key,
                workload=f"{WORKLOAD_REF}{workload_id}",
                workload_name=workload.name,
                target=target,
                task_data=f"{TASK_DATA_REF}{td.id}",
                n_inputs=len(workload.inputs),
                n_outputs=len(workload.outputs),
                verify=td.has_expected,
            )
        assert job_task_id is not None
        self._tasks[task_key] = _Task(workload_id, job_task_id, task)
        return task

    def _write_task_data(self, workload: WorkloadSpec, workload_id: int, task_key: str) -> None:
        """Task data as `LocalMeasurer.prepare` makes it (the unscheduled program runs on
        this host, so it is built for this host whatever the class's target), copied
        under the artifact root."""
        from tunefarm.target import host_target_dict

        local = self._reference_measurer().prepare(workload, task_key, host_target_dict())
        rel = artifacts.task_data_path(workload_id)
        dest = self.artifact_root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
        shutil.copyfile(local.task_data, tmp)
        os.replace(tmp, dest)
        sha256, size = artifacts.file_sha256(dest), dest.stat().st_size
        with transaction(self.sessions) as s:
            farm_tasks.store_task_data(
                s, workload_id=workload_id, path=rel, sha256=sha256, size=size, has_expected=local.verify
            )

    def _reference_measurer(self) -> LocalMeasurer:
        if self._reference is None:
            from tunefarm.measure.builder import LocalBuilder
            from tunefarm.measure.runner import LocalRunner
            from tunefarm.target import physical_cores

            work = self.artifact_root / artifacts.scheduler_work_dir(os.getpid())
            self._reference = LocalMeasurer(
                LocalBuilder(work / artifacts.KERNELS_DIR, n_workers=1),
                LocalRunner(physical_cores()),
                work,
                reference_timeout=self.reference_timeout,
                log=self.log,
            )
        return self._reference

    # -- Measurer -----------------------------------------------------------------------

    def submit(self, batch: MeasureBatch) -> None:
        """One transaction (the batch and its candidates) and one RQ job."""
        if self._closed:
            raise RuntimeError("the measurer is closed")
        task = self._task(batch.task.key)
        inputs = list({m.key: m for m in batch.inputs}.values())  # a key once per batch
        row = farm_batches.NewBatch(
            job_id=self.job_id,
            job_task_id=task.job_task_id,
            workload_id=task.workload_id,
            device_class_id=self.device_class_id,
            timing=batch.timing,
            build_timeout_secs=batch.build_timeout,
            run_timeout_secs=batch.run_timeout,
        )
        with transaction(self.sessions) as s:
            batch_id = farm_batches.add_batch(s, batch=row, inputs=inputs)
        self._flight[batch_id] = _InFlight(batch_id, {m.key for m in inputs}, inputs={m.key: m for m in inputs})
        self._enqueue(batch_id)

    def collect(self, timeout: float | None = None) -> list[MeasureRecord]:
        if self.pending == 0:
            return []
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            out = self._poll()
            if time.monotonic() - self._last_check >= self.stuck_check_secs:
                out += self._check_batches()
            if out or self._closed:
                return out
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return []
            wait = self.poll_interval if deadline is None else min(self.poll_interval, deadline - now)
            time.sleep(max(0.0, wait))

    @property
    def pending(self) -> int:
        return sum(len(f.waiting) for f in self._flight.values())

    def close(self) -> None:
        """Stop using the measurer. Batches in flight are left to the farm: a restarted
        scheduler adopts them (`in_flight_batches`); `cancel_pending` gives them up."""
        if self._closed:
            return
        self._closed = True
        if self._reference is not None:
            self._reference.close()
            self._reference = None

    # -- restarts and cancellation -------------------------------------------------------

    def in_flight_batches(self) -> list[MeasureBatch]:
        """The job's batches that are not finished, with their unmeasured inputs, as
        `MeasureBatch`es (id "farm-<batch id>") for `TuningSession.adopt`; their results
        come from `collect` from now on."""
        with transaction(self.sessions) as s:
            open_ = farm_batches.open_search_batches(s, job_id=self.job_id)
            tasks = {o.batch.job_task_id: self._task_of_row(s, o.batch.job_task_id) for o in open_}
        out = []
        for o in open_:
            b, inputs = o.batch, o.unmeasured
            if not inputs:
                continue
            task = tasks[b.job_task_id]
            self._flight.setdefault(b.id, _InFlight(b.id, {m.key for m in inputs}, inputs={m.key: m for m in inputs}))
            out.append(
                MeasureBatch(
                    id=f"farm-{b.id}",
                    task=task.measure_task,
                    inputs=tuple(inputs),
                    timing=codec.timing_from_json(b.timing),
                    build_timeout=b.build_timeout_secs,
                    run_timeout=b.run_timeout_secs,
                )
            )
        return out

    def cancel_pending(self, reason: str = "cancelled") -> int:
        """Give up every batch in flight (a cancelled job): their unmeasured candidates
        are recorded as errors and come back from `collect`. Returns how many."""
        n = 0
        with transaction(self.sessions) as s:
            for batch_id in sorted(self._flight):
                n += measurements.abandon_batch(s, batch_id=batch_id, reason=reason, error_kind=ErrorKind.RUN_ERROR)
        return n

    # -- internals ----------------------------------------------------------------------

    def _task(self, task_key: str) -> _Task:
        task = self._tasks.get(task_key)
        if task is None:
            with transaction(self.sessions) as s:
                job_task_id = farm_tasks.job_task_id(s, job_id=self.job_id, task_key=task_key)
                if job_task_id is None:
                    raise KeyError(f"task {task_key!r} was not prepared for job {self.job_id}")
                task = self._task_of_row(s, job_task_id)
        return task

    def _task_of_row(self, s: Session, job_task_id: int) -> _Task:
        """The `_Task` of a job task row (prepared before a restart)."""
        for task in self._tasks.values():
            if task.job_task_id == job_task_id:
                return task
        row = farm_tasks.prepared_task(s, job_task_id=job_task_id)
        measure_task = MeasureTask(
            key=row.task_key,
            workload=f"{WORKLOAD_REF}{row.workload_id}",
            workload_name=row.workload_name,
            target=self.target,
            task_data=f"{TASK_DATA_REF}{row.task_data_id}",
            n_inputs=row.n_inputs,
            n_outputs=row.n_outputs,
            verify=bool(row.has_expected),
        )
        task = _Task(row.workload_id, job_task_id, measure_task)
        self._tasks[row.task_key] = task
        return task

    def _enqueue(self, batch_id: int) -> None:
        """The batch's build job; a Redis failure is only logged (the batch check enqueues
        it again)."""
        from redis.exceptions import RedisError
        from rq import Retry

        from services.worker.build_job import build_queue

        queue = build_queue(self.redis, self.device_class, self.queue_prefix)
        try:
            queue.enqueue(
                BUILD_JOB,
                batch_id,
                job_id=build_job_id(batch_id, self.queue_prefix),
                job_timeout=self.build_job_timeout,
                retry=Retry(max=1),
                result_ttl=3600,
                failure_ttl=7 * 86400,
                description=f"build batch {batch_id} of job {self.job_id}",
            )
        except RedisError as exc:
            self.log(f"batch {batch_id}: cannot enqueue its build ({exc}); trying again later")

    def _poll(self) -> list[MeasureRecord]:
        """The job's measurements after the last one seen, for batches in flight."""
        with transaction(self.sessions) as s:
            rows = farm_batches.measurements_after(s, job_id=self.job_id, after_id=self._last_id, limit=MAX_POLL_ROWS)
        out = []
        for mid, batch_id, data in rows:
            self._last_id = max(self._last_id, mid)
            result = self._take(mid, batch_id, data)
            if result is not None:
                out.append(result)
        return out

    def _take(self, measurement_id: int, batch_id: int, data: dict[str, Any]) -> MeasureRecord | None:
        flight = self._flight.get(batch_id)
        record = self.decoded.decode(measurement_id, data)
        if flight is None or record.candidate.key not in flight.waiting:
            return None
        flight.waiting.discard(record.candidate.key)
        if not flight.waiting:
            del self._flight[batch_id]
        return record

    def _check_batches(self) -> list[MeasureRecord]:
        """Finished batches whose results were missed, and builds nobody is doing: a
        batch proposed or building whose build lock no worker holds (`build_locks`) and
        whose RQ job is not waiting in its queue (gone with Redis's data, left started
        by a killed worker, failed) is enqueued again."""
        from redis.exceptions import RedisError

        self._last_check = time.monotonic()
        ids = sorted(self._flight)
        if not ids:
            return []
        unbuilt = (BatchState.PROPOSED, BatchState.BUILDING)
        with transaction(self.sessions) as s:
            states = farm_batches.batch_states(s, batch_ids=ids)
            building = build_locks.held(s, [i for i, st in states.items() if st in unbuilt])
        out: list[MeasureRecord] = []
        suspects: set[int] = set()
        for batch_id in ids:
            state = states.get(batch_id)
            if state in (BatchState.DONE, BatchState.FAILED):
                out += self._leftovers(batch_id)
            elif state in unbuilt and batch_id not in building:
                try:
                    status, why = self._build_job(batch_id)
                except RedisError as exc:  # Redis away: look again next time
                    self.log(f"cannot check the build of batch {batch_id}: {exc}")
                    continue
                if status in _WAITING:
                    continue
                if status == "started" and batch_id not in self._suspects:
                    # A worker took the job and may not hold the lock yet: lost only if
                    # it still does not at the next check.
                    suspects.add(batch_id)
                    continue
                self._build_again(batch_id, why, failed=status == "failed")
        self._suspects = suspects
        return out

    def _build_job(self, batch_id: int) -> tuple[str | None, str]:
        """The batch's RQ job status (None: Redis does not have it, or not readably) and
        why it failed (`build_job_status`)."""
        from services.worker.build_job import build_job_status

        return build_job_status(self.redis, build_job_id(batch_id, self.queue_prefix))

    def _build_again(self, batch_id: int, why: str, *, failed: bool) -> None:
        """Enqueue a batch's build again, or give the batch up after `max_requeues` failed
        builds (or `max_lost_builds` lost ones). The state is read again under the batch's
        row lock, with its build lock: a worker that took it meanwhile keeps it."""
        flight = self._flight[batch_id]
        count, limit = (flight.requeues, self.max_requeues) if failed else (flight.lost, self.max_lost_builds)
        reason = f"the build of batch {batch_id} {'failed' if failed else 'was lost'}: {why}"
        with transaction(self.sessions) as s:
            state = batches.lock_batch(s, batch_id=batch_id)
            if state not in (BatchState.PROPOSED, BatchState.BUILDING) or build_locks.held(s, [batch_id]):
                return  # built, or being built, after all
            again = count < limit
            if not again:
                measurements.abandon_batch(s, batch_id=batch_id, reason=reason, error_kind=ErrorKind.BUILD_ERROR)
            elif state is BatchState.BUILDING:
                batches.transition_batch(s, batch_id=batch_id, to=BatchState.PROPOSED)
        if not again:
            self.log(f"{reason}; giving it up")
            return
        if failed:
            flight.requeues += 1
        else:
            flight.lost += 1
        self.log(f"{reason}; building it again ({count + 1}/{limit})")
        self._enqueue(batch_id)

    def _failed(self, inp: MeasureInput, reason: str, *, built: bool) -> MeasureRecord:
        """The record of a candidate the farm will never measure (its build failed, or its
        batch was given up)."""
        if not built:
            result = MeasureResult(inp, BuildResult(inp.key, None, 0.0, ErrorKind.BUILD_ERROR, reason), None)
        else:
            run = RunResult(inp.key, (), 0.0, ErrorKind.RUN_ERROR, reason)
            result = MeasureResult(inp, BuildResult(inp.key, None, 0.0), run)
        task = self._task(inp.task).measure_task
        return MeasureRecord.of(result, workload=task.workload_name, target=task.target, timestamp=time.time())

    def _leftovers(self, batch_id: int) -> list[MeasureRecord]:
        """Results of a finished batch that `_poll` did not see (measured before
        `after_measurement_id`, or never: a batch failed before its candidates got any)."""
        flight = self._flight.get(batch_id)
        if flight is None:
            return []
        out = self._poll()  # whatever landed just before the batch finished
        flight = self._flight.get(batch_id)
        if flight is None:
            return out
        with transaction(self.sessions) as s:
            rows = farm_batches.candidates_left(s, batch_id=batch_id, keys=sorted(flight.waiting))
            reason = farm_batches.batch_build_error(s, batch_id=batch_id) or "the batch failed"
        for key, artifact, data, record in rows:
            if record is not None:
                out.append(codec.record_from_json(record))
            else:
                inp = flight.inputs.get(key) or codec.input_from_json(data)
                out.append(self._failed(inp, reason, built=artifact is not None))
            flight.waiting.discard(key)
        for key in list(flight.waiting):  # not in the database at all (cannot happen)
            out.append(self._failed(flight.inputs[key], reason, built=False))
        self._flight.pop(batch_id, None)
        return out


def _is_file(root: Path, rel: str) -> bool:
    try:
        return artifacts.resolve(root, rel).is_file()
    except artifacts.OutsideArtifactRoot:
        return False


__all__ = ["FarmMeasurer"]
