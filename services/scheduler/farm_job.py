"""One job inside the scheduler service: embedded mode's session over the farm.

`FarmJob` builds, for a claimed job, exactly what `tunefarm tune` builds in embedded
mode (`tunefarm/tune.py`): one `SearchTask` and `TaskTuner` per task of the
model, the task scheduler of the job's strategy, one `TuningSession` with the job's
trial budget and latency target. Three things differ, and only by what is plugged in:

- the measurer is the `FarmMeasurer` (batches go to Postgres and the class's RQ build
  queue; agents measure; results come back from Postgres);
- the cost model is the class's shared model (`shared_model.SharedModelView`);
- the callbacks keep the job's precomputed progress rows up to date (`JobProgressRows`)
  instead of drawing a progress view; measurements are stored by the lease service.

A CPU class's job also tunes each 3x3 stride-1 convolution task's Winograd alternatives
(`tunefarm.models.alternatives`), as `tunefarm tune` does: `start` makes them again from
the model's task (the same workloads, keys and reference program every time), adds them
to the job as task rows after the model's (`farm_tasks.add_alternative`: where the build
workers find their modules, the measurements and confirmations their task), sizes the
job's rounds for the model's tasks and the alternatives together (the API, which cannot
see the alternatives, sized them for the model's tasks), and puts each alternative in one
task-scheduler group with its task; `finish` takes, per task, the fastest member
whose best was confirmed, and the build puts that program in the task's place.

Life cycle (driven by `service.SchedulerService`):

    start()   load the model (fused module and ONNX from the artifact root), make the
              tasks, resume every measurement of the job from Postgres (no candidate is
              ever proposed twice), adopt the batches still in flight, start the session
    step()    one turn of the session (propose while under the fair-share cap, collect)
    finish()  wait for the job's bests to be confirmed (`services.db.confirmations`: a best
              counts once a second measurement of its kernel agrees), build the tuned
              model with every task's fastest confirmed schedule (of its own program or
              an alternative's), have one of the class's
              agents run it and time it beside onnxruntime and OpenVINO (`model_check`:
              every class, this host's architecture included; the scheduler never times
              a tuned model), check its outputs against onnxruntime here, write the
              library (model.so, model.cuda.tar for a CUDA class: `library_name`),
              manifest.json, reference.onnx, records.jsonl, report.json and pack them
              into jobs/<id>/tuned.tar.gz (the API hands it out)

A CUDA class's job is the same session with the class's CUDA target: its tasks are made
for it (`make_task`: the GPU sketch rules), the build workers build `.cuda.tar` kernels,
agents started with `--gpu` measure them. Candidates that cannot be measured (run
errors: an agent whose GPU fails them) spend the budget like any error, and a task with
no valid measurement keeps TVM's default schedule (for a GPU, DLight's), so the job still
builds the model.
    cancel()  give the job's open batches up and stop
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from services.common import artifacts
from services.db import farm_tasks, job_store
from services.db.job_store import JobSetup
from services.db.session import transaction
from services.db.states import JobState
from services.protocol.signing import ArtifactSigner
from services.scheduler.exceptions import FinishInterrupted, JobFailed
from services.scheduler.model_check import DeviceRun, check_on_device
from services.scheduler.shared_model import ClassModel, SharedModelView
from tunefarm.errors import TunefarmError, WorkloadError
from tunefarm.gpu import is_gpu
from tunefarm.measure import MeasureBatch, Measurer
from tunefarm.models.alternatives import (
    ALGORITHMS,
    Choice,
    Member,
    alternatives_of,
    choices,
    rounds_with_alternatives,
)
from tunefarm.models.build import build_model_library
from tunefarm.models.check import exact_onnx_reference
from tunefarm.models.finish import (
    RECORDS_NAME,
    REFERENCE_NAME,
    REPORT_NAME,
    LoadedModel,
    ModelOutcome,
    archive_directory,
    model_report,
    onnx_reference,
    plain,
    write_records,
)
from tunefarm.models.importer import ImportedModel
from tunefarm.models.precision import FP32
from tunefarm.models.tasks import ModelTask, extract_tasks
from tunefarm.records import MeasureRecord, TensorSpec, TimingConfig
from tunefarm.search.config import TuneConfig
from tunefarm.search.run import TaskOutcome, Timeline, TuningSummary, build_session, summarize
from tunefarm.search.session import SessionCallback, TuningSession
from tunefarm.search.similar_programs import PER_TASK
from tunefarm.search.task import SearchTask, make_task
from tunefarm.search.tuner import TaskTuner

CONFIRM_POLL_SECS = 0.5
"""How often a finishing job looks whether its bests' confirmations are in."""

PROGRESS_POINTS = 50
"""The curve gets a point when the estimate changes, and at least every 1/PROGRESS_POINTS
of the budget: at most ~PROGRESS_POINTS points plus one per improvement, whatever the
number of measurements."""


MeasurerFactory = Callable[[JobSetup, int], Measurer]
"""Makes a job's measurer: (the job, the last measurement id resumed from)."""


@dataclass
class RunnerContext:
    """What every job of a scheduler process shares."""

    sessions: Any  # sessionmaker[Session]
    artifact_root: Path
    measurer_factory: MeasurerFactory
    check_tuned_model: bool
    log: Callable[[str], None]
    # How long an agent of the class may take to run (and time) a tuned model.
    model_run_wait_secs: float = 1800.0
    # An agent that heartbeated this recently is live; a model run waits no longer than
    # this (after as long) while its class has none (`model_check`).
    agent_fresh_secs: float = 60.0
    # How long a finishing job waits for its bests' confirmations (then builds with the
    # confirmed ones it has).
    confirm_wait_secs: float = 600.0
    # Set when the service stops: a finish waiting for a device gives up (resumed later).
    stop: threading.Event = field(default_factory=threading.Event)
    # Signs the tuned models handed to agents (None: unsigned; agents with a key refuse them).
    signer: ArtifactSigner | None = None
    # How agents time each kernel (SchedulerSettings.timing).
    timing: TimingConfig = field(default_factory=TimingConfig)


class JobProgressRows(SessionCallback):
    """Keeps the job's precomputed progress up to date after every round: a curve point
    (when the estimate changed, or every 1/PROGRESS_POINTS of the budget), the job's
    estimated latency (and its first complete estimate), and why tasks were given up.
    Trial counts and per-task bests are kept by the lease service with each measurement."""

    def __init__(self, runner: FarmJob):
        self.runner = runner
        self.last_est: float | None = None
        self.last_trials = -1

    def on_round(self, session: TuningSession, tuner: TaskTuner, summary) -> None:
        runner = self.runner
        runner.shared.dirty = True  # the class's model learns this round's measurements
        est = runner.estimate()
        step = max(1, runner.setup.trial_budget // PROGRESS_POINTS)
        dead = {
            session.tuners[i].key: str(st.dead_reason) for i, st in enumerate(session.scheduler.states) if st.dead_reason
        }
        write_point = est != self.last_est or session.trials - self.last_trials >= step
        with transaction(runner.ctx.sessions) as s:
            if write_point:
                job_store.write_progress(s, job_id=runner.job_id, trials=session.trials, est_latency_secs=est)
            if dead:
                job_store.set_dead_reasons(s, job_id=runner.job_id, reasons=dead)
        if write_point:
            self.last_est, self.last_trials = est, session.trials


class FarmJob:
    """One claimed job in the scheduler: its model, tasks, tuners, session and measurer,
    stepped by the service until its trials are spent, then finished (the tuned model
    built, checked and stored)."""

    def __init__(self, ctx: RunnerContext, setup: JobSetup, shared: ClassModel):
        self.ctx = ctx
        self.setup = setup
        self.shared = shared
        self.job_id = setup.job_id
        self.log = lambda msg: ctx.log(f"job {setup.job_id}: {msg}")
        self.model: LoadedModel | None = None
        self.tasks: list[SearchTask] = []  # the model's tasks, then their alternatives
        # per task of the model (workload key) the workload keys of its group: itself first,
        # then its alternatives (itself alone when it has none)
        self.groups: dict[str, list[str]] = {}
        self.tuners: list[TaskTuner] = []
        self.session: TuningSession | None = None
        self.measurer: Measurer | None = None
        self.timeline = Timeline()
        # Measurements per round: the API sized them for the model's tasks; `start` sizes
        # them again once the alternatives are known, as `tunefarm tune` does.
        self.batch_size = 32
        self.first_step_done = setup.start_model_trained_on is not None
        self.started = time.perf_counter()
        # Taken from the session when the search ends (`begin_finishing`), for the report.
        self.summary: TuningSummary | None = None
        self.outcomes: dict[str, TaskOutcome] = {}

    # -- starting ---------------------------------------------------------------------------

    def load_model(self) -> LoadedModel:
        """The job's model from the artifact root: the fused module the API stored, and
        the uploaded ONNX as the reference."""
        import tvm

        root = self.ctx.artifact_root
        s = self.setup
        try:
            fused = tvm.ir.load_json((root / self.fused_path()).read_text())
            onnx_bytes = (root / s.onnx_path).read_bytes()
        except OSError as exc:
            raise JobFailed(f"the model's files are missing from the artifact root ({exc})") from None
        tasks = extract_tasks(fused, name=s.model_name, fused=True, precision=self.precision())
        imported = ImportedModel(
            s.model_name,
            fused,
            tuple(TensorSpec(t["name"], tuple(t["shape"]), t["dtype"]) for t in s.inputs),
            tuple(TensorSpec(t["name"], tuple(t["shape"]), t["dtype"]) for t in s.outputs),
            onnx_bytes,
            tuple(s.warnings),
        )
        return LoadedModel(
            imported, tasks, onnx_reference(onnx_bytes), "onnxruntime", onnx_bytes, exact_onnx_reference(onnx_bytes)
        )

    def precision(self) -> str:
        """What the job's model computes in (`JobCreate.precision`; a job made before the
        choice existed, or a float32 one: fp32)."""
        return str(self.setup.config.get("precision", FP32))

    def fused_path(self) -> str:
        """The fused module the job tunes: the model converted to the job's precision when
        that is not float32 (the API's `take_in_variant`), else the model's own."""
        return str(self.setup.config.get("fused_path", self.setup.fused_path))

    def transferred_programs(self) -> list[MeasureRecord]:
        """When the class's model descends from another class's (`ClassModel.transferred_from`),
        that class's best programs of the job's workloads: each task's search starts from
        them (`SimilarPrograms` puts the same workload first), as its model starts from
        that class's model."""
        source = self.shared.transferred_from
        if source is None:
            return []
        with transaction(self.ctx.sessions) as db:
            found = job_store.best_records_of_class(
                db,
                device_class=source.device_class,
                workload_keys=[t.workload.key for t in self.tasks],
                per_workload=PER_TASK,
            )
        if found:
            self.log(f"{len(found)} programs of class {source.device_class} seed the tasks' searches")
        return found

    def config(self) -> TuneConfig:
        c = self.setup.config
        return TuneConfig(
            trials=self.setup.trial_budget,
            batch_size=self.batch_size,
            seed=int(c.get("seed", 1)),
            strategy=str(c.get("strategy", "gradient")),
            timing=self.ctx.timing,
        )

    def algorithms(self) -> tuple[str, ...]:
        """The other algorithms the job's tasks are also tuned by: the job's choice
        (`JobCreate.winograd`; a job made before the choice existed: `ALGORITHMS`), none on a
        GPU class, as `tunefarm tune` does."""
        if is_gpu(self.setup.target):
            return ()
        chosen = self.setup.config.get("algorithms", ALGORITHMS)
        return tuple(a for a in ALGORITHMS if a in chosen)

    def start(self) -> None:
        """Build the session, resume it from Postgres and adopt the batches in flight."""
        s = self.setup
        rows = {r.workload_key: r for r in s.tasks if r.alternative_of is None}
        self.batch_size = int(s.config.get("batch_size", 32))
        try:
            self.model = self.load_model()
            model_tasks = [t for t in self.model.tasks.tasks if t.key in rows]
            if len(model_tasks) != len(rows):
                raise JobFailed("the model's tasks no longer match the job's (the stored model changed)")
            self.tasks = [make_task(t.workload, s.target) for t in model_tasks]
            alternatives = self._alternatives(model_tasks)
        except TunefarmError as exc:
            raise JobFailed(str(exc)) from None
        if alternatives:
            self._add_alternatives({t.key: rows[t.key].id for t in model_tasks}, alternatives)
        # The alternatives come after all the model's tasks (their job task rows too): each
        # group's first member is its task, whose warm-up round comes before any
        # alternative's (a small budget still tunes every task of the model).
        self.tasks += [alt for _, alt in alternatives]
        self.groups = {t.key: [t.key] for t in model_tasks}
        weights = {t.key: t.weight for t in model_tasks}
        group_of: dict[str, str] = {}  # workload key -> its group (`TaskInfo.group`: the task's key)
        for task, alt in alternatives:
            self.groups[task.key].append(alt.workload.key)
            weights[alt.workload.key] = task.weight
            group_of[task.key] = group_of[alt.workload.key] = task.key
        config = self.config()
        self.log(
            f"{len(model_tasks)} tasks of {s.model_name} on {s.device_class}"
            + (f" and {len(alternatives)} Winograd alternatives" if alternatives else "")
            + f": {config.trials} trials, batches of {config.batch_size}, seed {config.seed}, "
            f"{config.strategy} task scheduler"
        )
        # Order matters for exactly-once: the measurer reports measurements after `seen`;
        # the batches in flight are read next (their unmeasured candidates), and the
        # job's records last, so each measurement is resumed, or awaited, or both (the
        # tuner ingests a candidate once and ignores it the second time).
        with transaction(self.ctx.sessions) as db:
            seen = job_store.last_measurement_id(db, job_id=self.job_id)
            job_store.note_cost_model(db, job_id=self.job_id, version_id=self.shared.start_version_id,
                                      pretrained=self.shared.pretrained)  # fmt: skip
        measurer = self.ctx.measurer_factory(s, seen)
        self.measurer = measurer
        in_flight: Callable[[], list[MeasureBatch]] | None = getattr(measurer, "in_flight_batches", None)
        batches = in_flight() if in_flight is not None else []
        with transaction(self.ctx.sessions) as db:
            records = job_store.job_records(db, job_id=self.job_id)
        self.session = build_session(
            self.tasks, [{s.model_name: weights[t.workload.key]} for t in self.tasks], measurer, config,
            SharedModelView(self.shared), records=records, seeds=self.transferred_programs(),
            callbacks=[JobProgressRows(self), self.timeline],
            targets={s.model_name: s.latency_target_secs} if s.latency_target_secs else None,
            groups=[group_of.get(t.workload.key, "") for t in self.tasks], log=self.log,
        )  # fmt: skip
        self.tuners = self.session.tuners
        adopted = 0
        index = {t.key: i for i, t in enumerate(self.tasks)}
        for batch in batches:
            if batch.task.key in index:
                self.session.adopt(index[batch.task.key], batch)
                adopted += len(batch.inputs)
        if records or adopted:
            self.log(f"resuming: {len(records)} measurements in Postgres, {adopted} candidates still in flight")
        self.session.start()

    def _alternatives(self, model_tasks: list[ModelTask]) -> list[tuple[ModelTask, SearchTask]]:
        """The alternatives of the model's tasks as search tasks for the class's target,
        each with its task, in the tasks' order; an alternative no sketch fits is left out,
        and all of them where the budget does not give each a round. With alternatives,
        the job's rounds (`batch_size`) become those `tunefarm tune` gives the same tasks
        (`rounds_with_alternatives`), never larger than the API's."""
        out = []
        for t in model_tasks:
            for alt in alternatives_of(t.workload, self.algorithms()):
                try:
                    out.append((t, make_task(alt, self.setup.target)))
                except WorkloadError as exc:
                    self.log(f"{alt.name} is not tuned: {exc}")
        if not out:
            return out
        trials = self.setup.trial_budget
        batch_size = rounds_with_alternatives(trials, len(model_tasks) + len(out), largest=self.batch_size)
        if batch_size is None:
            self.log(f"{trials} trials do not give the {len(out)} Winograd alternatives a round each: "
                     "the tasks are tuned as they are")  # fmt: skip
            return []
        self.batch_size = batch_size  # rounds sized for the alternatives too
        return out

    def _add_alternatives(self, row_ids: dict[str, int], alternatives: list[tuple[ModelTask, SearchTask]]) -> None:
        """The alternatives' workload and job task rows (none twice: a restarted job finds
        the rows its first start added, under the same keys)."""
        with transaction(self.ctx.sessions) as db:
            for task, alt in alternatives:
                workload_id = farm_tasks.store_workload(db, workload=farm_tasks.workload_fields(alt.workload))
                assert workload_id is not None
                farm_tasks.add_alternative(db, of_job_task_id=row_ids[task.key], workload_id=workload_id, task_key=alt.key)

    @property
    def search_tasks(self) -> dict[str, SearchTask]:
        return {t.key: t for t in self.tasks}

    # -- running ----------------------------------------------------------------------------

    def step(self, wait: float, max_in_flight: int) -> bool:
        """One turn of the session under the fair-share cap; False once the budget is
        spent (or every task is done) and nothing is in flight."""
        assert self.session is not None
        self.session.max_in_flight = max(1, max_in_flight)
        if not self.first_step_done:
            # The first batch is proposed in this step, ranked by the class's model as it
            # is now (random scores while it has learnt nothing).
            with transaction(self.ctx.sessions) as db:
                job_store.note_cost_model(db, job_id=self.job_id, trained_on=self.shared.model.trained_on)
            self.first_step_done = True
        return self.session.step(wait=wait)

    def estimate(self) -> float | None:
        """The model's estimated latency with the best kernels so far; None while some
        task has no valid measurement."""
        assert self.session is not None
        est = self.session.scheduler.estimate()
        if est.unknown_tasks:
            return None
        value = est.per_model.get(self.setup.model_name)
        return float(value) if value is not None and math.isfinite(value) else None

    def close(self) -> None:
        """Stop the session and the measurer (batches in flight stay in the farm)."""
        if self.session is not None:
            session, self.session = self.session, None
            try:
                session.close()
            except Exception as exc:  # a callback failing at the end must not keep the job
                self.log(f"closing the session: {exc}")
        if self.measurer is not None:
            measurer, self.measurer = self.measurer, None
            measurer.close()

    def cancel(self) -> None:
        self.close()
        with transaction(self.ctx.sessions) as db:
            n = job_store.fail_open_batches(db, job_id=self.job_id, reason="the job was cancelled")
            job_store.set_job_state(db, job_id=self.job_id, state=JobState.CANCELLED)
        self.log(f"cancelled ({n} open batches given up)")

    # -- finishing --------------------------------------------------------------------------

    def begin_finishing(self) -> None:
        """The search is over: the job is finishing (a restart resumes it there)."""
        assert self.session is not None
        final = self.session
        est = self.estimate()
        outcomes, self.summary = summarize(final, self.timeline)
        self.outcomes = {t.workload.key: o for t, o in zip(self.tasks, outcomes)}
        self.close()
        with transaction(self.ctx.sessions) as db:
            job_store.write_progress(db, job_id=self.job_id, trials=final.trials, est_latency_secs=est)
            job_store.set_job_state(db, job_id=self.job_id, state=JobState.FINISHING)

    def finish(self) -> None:
        """Build, check, archive and store the tuned model; the job succeeds. Runs in a
        worker thread of the service (the build runs in isolated child processes)."""
        assert self.model is not None and self.summary is not None
        m, s = self.model, self.setup
        self._await_confirmations()
        bests = self._confirmed_bests()
        self.outcomes = {key: replace(o, best=bests.get(key)) for key, o in self.outcomes.items()}
        chosen = self._choose_members()
        schedules = {c.schedule_key: c.chosen.best.trace for c in chosen.values() if c.chosen is not None}
        searched = {t.workload.key: (t.workload.name, tuner.state.best) for t, tuner in zip(self.tasks, self.tuners)}
        unconfirmed = unconfirmed_bests(searched, bests, self.groups, chosen)
        if unconfirmed:
            self.log(f"the fastest kernels of {', '.join(unconfirmed)} were not confirmed: not used")
        root = self.ctx.artifact_root
        staging = root / artifacts.STAGING_DIR
        staging.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f"job-{self.job_id}-", dir=staging))
        try:
            directory = work / "tuned"
            outcome = self._build(m, directory, schedules)
            if outcome.error:
                raise JobFailed(outcome.error)
            with transaction(self.ctx.sessions) as db:
                records = job_store.job_records(db, job_id=self.job_id)
            write_records(directory / RECORDS_NAME, records)
            # each task's row is the outcome of the program the model took
            by_key = {key: self.outcomes[c.chosen.key if c.chosen else key] for key, c in chosen.items()}
            report = model_report(
                [m], [outcome], by_key, self.summary, s.target, s.trial_budget, time.perf_counter() - self.started,
                choices=chosen,
            )  # fmt: skip
            report["algorithms"] = list(self.algorithms())
            report["precision"] = self.precision()
            report["models"][0]["directory"] = "."
            report["farm"] = {"job": self.job_id, "device_class": s.device_class, "model_id": s.model_id}
            (directory / REPORT_NAME).write_text(json.dumps(plain(report), indent=1) + "\n")
            rel = artifacts.job_archive_path(self.job_id)
            archive = archive_directory(directory, root / rel)
            sha, size = artifacts.file_sha256(archive), archive.stat().st_size
            result = job_result(self.summary, outcome, report["models"][0]["tasks"], unconfirmed, self.precision())
            with transaction(self.ctx.sessions) as db:
                job_store.finish_job(
                    db, job_id=self.job_id, artifact_path=rel, artifact_sha256=sha, artifact_size=size, result=result
                )
        finally:
            shutil.rmtree(work, ignore_errors=True)
        self.log(f"succeeded: tuned model in {rel} ({size} bytes)")

    def _await_confirmations(self) -> None:
        """Wait until the job's bests are confirmed or disputed (no confirmation batch of
        the job is open), at most `confirm_wait_secs`."""
        deadline = time.monotonic() + self.ctx.confirm_wait_secs
        while True:
            with transaction(self.ctx.sessions) as db:
                open_ = job_store.open_confirmations(db, job_id=self.job_id)
            if not open_:
                return
            if time.monotonic() >= deadline:
                self.log(f"{open_} confirmations still open after {self.ctx.confirm_wait_secs:g} s; building without them")
                return
            if self.ctx.stop.wait(CONFIRM_POLL_SECS):
                raise FinishInterrupted("the scheduler stopped while the job's bests awaited confirmation")

    def _confirmed_bests(self) -> dict[str, MeasureRecord | None]:
        """Each task's (by workload key) fastest kernel that the search verified and a
        second measurement confirmed; None where there is none."""
        with transaction(self.ctx.sessions) as db:
            confirmed = job_store.confirmed_keys(db, job_id=self.job_id)
        out: dict[str, MeasureRecord | None] = {}
        for t, tuner in zip(self.tasks, self.tuners):
            keys = confirmed.get(t.key, set())
            usable = [r for r in tuner.state.records if r.is_valid and r.verified and r.candidate.key in keys]
            out[t.workload.key] = min(usable, key=lambda r: r.cost) if usable else None
        return out

    def _choose_members(self) -> dict[str, Choice]:
        """Per task of the model (workload key) the program the tuned model takes: the
        fastest of the task and its alternatives by their confirmed bests."""
        members = {}
        for t in self.tasks:
            o = self.outcomes[t.workload.key]
            members[t.workload.key] = Member(t.workload.name, t.workload.key, o.best, o.trials)
        return choices(self.groups, members)

    def _build(self, m: LoadedModel, directory: Path, schedules: dict[str, Any]) -> ModelOutcome:
        """Build the tuned model here; check and time it on an agent of the class
        (`model_check`), whatever the class: the scheduler's host times nothing."""
        s = self.setup
        try:
            build_model_library(
                m.tasks.fused_mod,
                directory,
                target=s.target,
                inputs=m.imported.inputs,
                outputs=m.imported.outputs,
                schedules=schedules,  # a task's own key, or its chosen alternative's
                name=m.name,
                precision=m.tasks.precision,
            )
            if m.reference_onnx is not None:  # `tunefarm run`'s onnxruntime column, as `tune` writes it
                (directory / REFERENCE_NAME).write_bytes(m.reference_onnx)
            if not self.ctx.check_tuned_model:
                check = {"ok": None, "reference": "onnxruntime", "problem": "disabled"}
                return ModelOutcome(m.name, directory, None, check, None, None)
            where = DeviceRun(
                self.ctx.sessions,
                self.ctx.artifact_root,
                job_id=self.job_id,
                device_class_id=s.device_class_id,
                device_class=s.device_class,
                wait_secs=self.ctx.model_run_wait_secs,
                stop=self.ctx.stop,
                signer=self.ctx.signer,
                no_agent_secs=self.ctx.agent_fresh_secs,
            )
            return check_on_device(m, directory, where, log=self.log)
        except TunefarmError as exc:
            raise JobFailed(str(exc)) from None


def unconfirmed_bests(
    searched: dict[str, tuple[str, MeasureRecord | None]],
    confirmed: dict[str, MeasureRecord | None],
    groups: dict[str, list[str]],
    chosen: dict[str, Choice],
) -> list[str]:
    """The names of the tasks and alternatives (`searched`: workload key -> name and the
    search's best) whose fastest kernel was not confirmed and would have beaten what the
    model took for their task (its group's `chosen` confirmed program, or the default
    schedule): the job's `unconfirmed_bests`. An alternative whose unconfirmed best was
    slower than the program its task took anyway changes nothing, and is not listed."""
    task_of = {member: task for task, members in groups.items() for member in members}
    out = []
    for key, (name, best) in searched.items():
        if best is None or confirmed.get(key) == best:
            continue
        choice = chosen.get(task_of.get(key, key))
        taken = choice.chosen.best if choice is not None and choice.chosen is not None else None
        if taken is None or best.cost < taken.cost:
            out.append(name)
    return out


def job_result(
    summary: TuningSummary, outcome: ModelOutcome, task_rows: list[dict], unconfirmed: list[str], precision: str = FP32
) -> dict:
    """A finished job's `result` (the API's job, `tunefarm status`): how the search ended,
    the model measured on an agent of its class beside its peers, its check, and the
    precision it computes in."""
    return plain(
        {
            "stop_reason": summary.stop_reason,
            "trials": summary.trials,
            "latency": outcome.latency,
            "onnxruntime_latency": outcome.onnxruntime_latency,
            "openvino_latency": outcome.openvino_latency,
            "check": outcome.check,
            "measured_on": outcome.measured_on,
            # peers the agent could not time, and why (a note, not a failure)
            "peer_notes": outcome.peer_notes,
            "tuned_tasks": sum(1 for r in task_rows if r["schedule"] == "tuned"),
            # what the model computes in (`tunefarm.models.precision`): its check's tolerance is that precision's
            "precision": precision,
            "tasks": len(task_rows),
            # Tasks (and alternatives) whose fastest measured kernel no second measurement
            # confirmed, where it would have beaten what the model uses: their fastest
            # confirmed one, another member's, or the default schedule (`unconfirmed_bests`).
            "unconfirmed_bests": unconfirmed,
        }
    )
