"""The scheduler service (`tunefarm scheduler`): runs every runnable job's search.

One loop, one pass at a time (`SchedulerService.run_once`):

1. pick runnable jobs (queued, running, finishing; oldest first, up to `max_jobs`) that
   no other scheduler holds (a Postgres advisory lock per job, held on one connection
   for as long as this process runs the job: a scheduler that dies releases its jobs),
   claim them (queued -> running) and build their sessions (`farm_job.FarmJob`):
   after a restart a job resumes from its measurements in Postgres and adopts its
   batches still in flight, so no measurement is lost and none is repeated;
2. fair shares, team first: a class with A live agents and T teams running jobs on it
   gives each team an equal part of it, shared by the team's J running jobs: each job
   keeps ceil(batches_per_agent * A / T / J) batches in flight (at least one). The lease
   service hands a class's ready batches to the team holding the fewest of its agents,
   then to that team's job holding the fewest (`leases.lease_next_batch`), so a team
   with 25 jobs and a team with one get the class's agents in turns, and a job alone on
   a class gets all of them;
3. step every job once, round-robin (propose under its cap, collect what landed); a
   job whose cancel was requested stops and gives its open batches up; a job whose
   budget is spent starts finishing: the tuned model is built, checked against
   onnxruntime and archived in a worker thread (the builds run in child processes; the
   model is run and timed, beside onnxruntime and OpenVINO, by one of its class's
   agents, which the thread waits for: `model_check`), and the job succeeds (or fails
   with the reason);
4. the shared cost models (`shared_model.ClassModels`) learn the measurements that
   landed, per class, and save a new version every so often and whenever a job ends.

A pass with nothing new sleeps `poll_interval_secs`. SIGTERM or SIGINT end the loop
after the pass: sessions are closed (batches in flight stay in the farm for the next
start), the cost models are saved, the locks released.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
import threading
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from services.db import job_store
from services.db.exceptions import Contention, DatabaseError, Unavailable
from services.db.job_locks import JobLocks
from services.db.job_store import JobSetup, RunningJob
from services.db.session import SessionFactory, make_session_factory, transaction
from services.db.states import JobState
from services.protocol.signing import ArtifactSigner, KeyFileError
from services.scheduler.decoded_records import DecodedRecords
from services.scheduler.exceptions import FinishInterrupted, JobFailed, JobVanished
from services.scheduler.farm_job import FarmJob, MeasurerFactory, RunnerContext
from services.scheduler.settings import SchedulerSettings
from services.scheduler.shared_model import ClassModels
from tunefarm.isolation import WITHOUT_TORCH, block_imports

log = logging.getLogger("tunefarm.scheduler")

FINISHING_THREADS = 4
"""Jobs finished at the same time (each builds its model in a child process)."""


def fair_share(batches_per_agent: int, live_agents: int, team_jobs: int, teams: int = 1) -> int:
    """Batches in flight one job of a class may keep: ceil(batches_per_agent x agents /
    teams / its team's jobs), at least one (a class without live agents still gets a
    batch ready per job, measured as soon as an agent comes)."""
    return max(1, math.ceil(batches_per_agent * live_agents / max(1, teams) / max(1, team_jobs)))


def fair_caps(batches_per_agent: int, live_agents: dict[int, int], running: list[RunningJob]) -> dict[int, int]:
    """Each running job's `fair_share` (job id -> batches in flight): its class's agents
    split between the teams running jobs on it, then between the team's jobs."""
    jobs_of: dict[int, Counter[int]] = defaultdict(Counter)  # class -> team -> running jobs
    for job in running:
        jobs_of[job.device_class_id][job.team_id] += 1
    return {
        job.id: fair_share(
            batches_per_agent,
            live_agents.get(job.device_class_id, 0),
            jobs_of[job.device_class_id][job.team_id],
            teams=len(jobs_of[job.device_class_id]),
        )
        for job in running
    }


def farm_measurer_factory(
    settings: SchedulerSettings, sessions: SessionFactory, redis: Any, logger: Callable[[str], None],
    decoded: DecodedRecords,
) -> MeasurerFactory:
    """Jobs measure through the farm: Postgres, the class's RQ build queue, the agents."""
    from services.scheduler.farm_measurer import FarmMeasurer

    def make(setup: JobSetup, seen: int) -> FarmMeasurer:
        return FarmMeasurer(
            sessions,
            redis,
            artifact_root=settings.artifact_root,
            job_id=setup.job_id,
            device_class=setup.device_class,
            queue_prefix=settings.queue_prefix,
            stuck_check_secs=settings.build_check_secs,
            after_measurement_id=seen,
            decoded=decoded,
            log=lambda msg: logger(f"job {setup.job_id}: {msg}"),
        )

    return make


class SchedulerService:
    def __init__(
        self,
        settings: SchedulerSettings,
        *,
        sessions: SessionFactory | None = None,
        measurer_factory: MeasurerFactory | None = None,
        logger: Callable[[str], None] | None = None,
    ):
        self.settings = settings
        self.log = logger or log.info
        self.sessions = sessions or make_session_factory(settings)
        settings.artifact_root.mkdir(parents=True, exist_ok=True)
        self._redis = None
        decoded = DecodedRecords()  # one decoding of each measurement, for its job and its class model
        if measurer_factory is None:
            import redis

            self._redis = redis.Redis.from_url(settings.redis_url)
            measurer_factory = farm_measurer_factory(settings, self.sessions, self._redis, self.log, decoded)
        self.ctx = RunnerContext(
            sessions=self.sessions,
            artifact_root=settings.artifact_root,
            measurer_factory=measurer_factory,
            check_tuned_model=settings.check_tuned_model,
            log=self.log,
            model_run_wait_secs=settings.model_run_wait_secs,
            agent_fresh_secs=settings.agent_fresh_secs,
            confirm_wait_secs=settings.confirm_wait_secs,
            timing=settings.timing(),
            signer=ArtifactSigner.from_file(settings.signing_key_file) if settings.signing_key_file else None,
        )
        self.models = ClassModels(
            self.sessions,
            settings.artifact_root,
            warmup=settings.cost_model_warmup,
            save_every=settings.cost_model_save_every,
            catch_up_secs=settings.cost_model_catch_up_secs,
            transfer=settings.cost_model_transfer,
            pretrained=settings.cost_model_pretrained,
            pretrained_dir=settings.pretrained_dir,
            decoded=decoded,
            log=self.log,
        )
        self.runners: dict[int, FarmJob] = {}
        self.finishing: dict[int, tuple[FarmJob, Future[None]]] = {}
        # Finishing jobs: one may wait long for an agent to run its model while others build.
        self._executor = ThreadPoolExecutor(max_workers=FINISHING_THREADS, thread_name_prefix="finish")
        self._locks = JobLocks(self.sessions)  # the jobs this process runs (`services.db.job_locks`)

    # -- the loop ---------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Pass after pass until `stop` is set; then `close`."""
        self.log(f"scheduler up (artifacts in {self.settings.artifact_root}, queues {self.settings.queue_prefix}:*)")
        try:
            while not stop.is_set():
                try:
                    busy = self.run_once()
                except (Unavailable, Contention) as exc:
                    self.log(f"database trouble ({exc}); retrying")
                    self._drop_locks()
                    busy = False
                self._beat()
                if not busy:
                    stop.wait(self.settings.poll_interval_secs)
        finally:
            self.close()

    def _beat(self) -> None:
        path = self.settings.scheduler_heartbeat_file
        if path is not None:
            path.touch()

    def run_once(self) -> bool:
        """One pass (see the module docstring); True if any job moved."""
        moved = self._reap_finished()
        moved |= self._pick_jobs()
        if not self.runners:
            self._learn()
            return moved
        caps = self._fair_caps()
        with transaction(self.sessions) as db:
            cancels = job_store.cancel_requests(db, job_ids=self.runners)
        for job_id, runner in list(self.runners.items()):
            if job_id in cancels:
                self._end(job_id, runner.cancel)
                moved = True
                continue
            moved |= self._step(job_id, runner, caps.get(job_id, 1))
        self._learn()
        return moved

    def _step(self, job_id: int, runner: FarmJob, cap: int) -> bool:
        session = runner.session
        assert session is not None
        before = (session.trials, session.in_flight)
        try:
            more = runner.step(self.settings.step_wait_secs, cap)
        except JobFailed as exc:
            message = str(exc)
            self._end(job_id, lambda: self._fail(job_id, message), runner)
            return True
        except (Unavailable, Contention):
            self._drop(job_id)
            raise
        except Exception as exc:  # a bug must not take the other jobs down
            self.log(f"job {job_id}: step failed:\n{traceback.format_exc()}")
            message = f"internal error: {type(exc).__name__}: {exc}"
            self._end(job_id, lambda: self._fail(job_id, message), runner)
            return True
        if not more:
            self._start_finishing(job_id, runner)
            return True
        return (session.trials, session.in_flight) != before

    # -- picking jobs -----------------------------------------------------------------------

    def _pick_jobs(self) -> bool:
        room = self.settings.max_jobs - len(self.runners) - len(self.finishing)
        if room <= 0:
            return False
        with transaction(self.sessions) as db:
            runnable = job_store.runnable_jobs(db, limit=self.settings.max_jobs * 4)
        picked = False
        for job in runnable:
            if room <= 0:
                break
            if job.id in self.runners or job.id in self.finishing or not self._lock(job.id):
                continue
            picked = True
            if job.cancel_requested:
                self._end(job.id, lambda job_id=job.id: self._cancel_unstarted(job_id))
                continue
            room -= 1
            self._start(job.id)
        return picked

    def _start(self, job_id: int) -> None:
        try:
            with transaction(self.sessions) as db:
                setup = job_store.claim_job(db, job_id=job_id)
            if setup is None:
                raise JobVanished(f"job {job_id} is no longer runnable")
            shared = self.models.get(setup.device_class_id)
            runner = FarmJob(self.ctx, setup, shared)
            runner.start()
        except JobVanished:
            self._unlock(job_id)
            return
        except JobFailed as exc:
            message = str(exc)
            self._end(job_id, lambda: self._fail(job_id, message))
            return
        except (Unavailable, Contention):
            self._unlock(job_id)
            raise
        except Exception as exc:
            self.log(f"job {job_id}: cannot start:\n{traceback.format_exc()}")
            message = f"cannot start: {type(exc).__name__}: {exc}"
            self._end(job_id, lambda: self._fail(job_id, message))
            return
        if setup.state is JobState.FINISHING:
            self._start_finishing(job_id, runner)
        else:
            self.runners[job_id] = runner

    def _cancel_unstarted(self, job_id: int) -> None:
        with transaction(self.sessions) as db:
            job_store.fail_open_batches(db, job_id=job_id, reason="the job was cancelled")
            job_store.set_job_state(db, job_id=job_id, state=JobState.CANCELLED)
        self.log(f"job {job_id}: cancelled")

    # -- fairness ---------------------------------------------------------------------------

    def _fair_caps(self) -> dict[int, int]:
        """Batches in flight each running job may keep (see the module docstring)."""
        with transaction(self.sessions) as db:
            live = job_store.live_agents_by_class(db, fresh_secs=self.settings.agent_fresh_secs)
            running = job_store.running_jobs(db)
        return fair_caps(self.settings.batches_per_agent, live, running)

    # -- finishing --------------------------------------------------------------------------

    def _start_finishing(self, job_id: int, runner: FarmJob) -> None:
        self.runners.pop(job_id, None)
        try:
            runner.begin_finishing()
        except (Unavailable, Contention):
            self._unlock(job_id)  # still running in the database: picked up again, it finishes then
            raise
        except Exception as exc:
            self.log(f"job {job_id}: cannot finish:\n{traceback.format_exc()}")
            message = f"cannot finish: {type(exc).__name__}: {exc}"
            self._end(job_id, lambda: self._fail(job_id, message), runner)
            return
        self.finishing[job_id] = (runner, self._executor.submit(runner.finish))

    def _reap_finished(self) -> bool:
        done = [job_id for job_id, (_, future) in self.finishing.items() if future.done()]
        for job_id in done:
            runner, future = self.finishing.pop(job_id)
            error = future.exception()
            if isinstance(error, JobFailed):
                self._fail(job_id, str(error))
            elif isinstance(error, FinishInterrupted):
                self.log(f"job {job_id}: {error}; it finishes on the next pick")
            elif isinstance(error, (Unavailable, Contention)):
                self.log(f"job {job_id}: database trouble while finishing ({error}); it finishes on the next pick")
            elif error is not None:
                self.log(f"job {job_id}: finishing failed: {''.join(traceback.format_exception(error))}")
                self._fail(job_id, f"finishing failed: {type(error).__name__}: {error}")
            self._unlock(job_id)
            self._save_class_model(runner.setup.device_class_id)
        return bool(done)

    # -- ending -----------------------------------------------------------------------------

    def _end(self, job_id: int, action: Callable[[], None], runner: FarmJob | None = None) -> None:
        """Run `action` (fail or cancel the job), then forget the job and release it."""
        self.runners.pop(job_id, None)
        try:
            if runner is not None:
                runner.close()
            action()
        except DatabaseError as exc:
            self.log(f"job {job_id}: could not record its end ({exc}); it is picked up again")
        finally:
            self._unlock(job_id)
        if runner is not None:
            self._save_class_model(runner.setup.device_class_id)

    def _fail(self, job_id: int, error: str) -> None:
        with transaction(self.sessions) as db:
            job_store.fail_open_batches(db, job_id=job_id, reason="the job failed")
            job_store.set_job_state(db, job_id=job_id, state=JobState.FAILED, error=error)
        self.log(f"job {job_id}: failed: {error}")

    def _drop(self, job_id: int) -> None:
        """Stop running a job without changing its state (it is picked up again)."""
        runner = self.runners.pop(job_id, None)
        if runner is not None:
            try:
                runner.close()
            except Exception:
                pass
        self._unlock(job_id)

    # -- the shared cost models -------------------------------------------------------------

    def _learn(self) -> None:
        for class_id, shared in list(self.models.models.items()):
            if not self.models.due(shared):
                continue
            tasks = {k: t for r in self.runners.values() if r.setup.device_class_id == class_id for k, t in r.search_tasks.items()}
            self.models.catch_up(shared, tasks)
            self.models.maybe_save(shared)

    def _save_class_model(self, class_id: int) -> None:
        shared = self.models.models.get(class_id)
        if shared is None:
            return
        try:
            self.models.catch_up(shared)
            self.models.maybe_save(shared, force=True)
        except DatabaseError as exc:
            self.log(f"class {class_id}: cost model not saved ({exc})")

    # -- locks ------------------------------------------------------------------------------

    def _lock(self, job_id: int) -> bool:
        """Hold the job (no other scheduler runs it); raises `Unavailable`."""
        return self._locks.try_lock(job_id)

    def _unlock(self, job_id: int) -> None:
        if not self._locks.unlock(job_id):
            self._drop_locks()

    def _drop_locks(self) -> None:
        """The lock connection is gone (and its locks with it): stop running the jobs."""
        for job_id in list(self.runners):
            self._drop(job_id)
        self._locks.close()

    # -- shutting down ----------------------------------------------------------------------

    def close(self) -> None:
        """Stop every job where it is (batches in flight stay in the farm), save the cost
        models, release the locks."""
        self.ctx.stop.set()  # a finish waiting for a device gives up; the job stays finishing
        for job_id in list(self.runners):
            self._drop(job_id)
        self._executor.shutdown(wait=False, cancel_futures=True)
        for class_id in list(self.models.models):
            self._save_class_model(class_id)
        self._locks.close()
        if self._redis is not None:
            self._redis.close()


def main(argv: list[str] | None = None) -> int:
    """`tunefarm scheduler`: run the scheduler service until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(prog="tunefarm scheduler", description="the farm's scheduler service")
    parser.parse_args(argv)
    # The jobs' searches import TVM, whose FFI imports torch whenever it is installed
    # (seconds of the first job's start, hundreds of MB); nothing the scheduler runs uses
    # torch (the farm's models are ONNX graphs; the model builds run in children that
    # block it too).
    block_imports(WITHOUT_TORCH)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = SchedulerSettings()
    from services.db.migrate import check_schema

    check_schema(settings.database_url)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        service = SchedulerService(settings)
    except KeyFileError as exc:
        print(f"tunefarm scheduler: error: {exc}", file=sys.stderr, flush=True)
        return 2
    service.run(stop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
