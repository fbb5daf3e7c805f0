"""A tuning session: many tasks, one budget, one cost model, one task scheduler.

The driver (`TuningSession.step`, looped by `run` in embedded mode and by the farm's
scheduler service):

    while trials < budget:
        task = scheduler.next_task()              # Ansor §6: where does time gain most?
        proposal = tuners[task].propose(n)          # the task's evolutionary search
        measurer.submit(batch)                      # build + run, elsewhere
        as measurements arrive: records = tuners[task].ingest(measurer.collect()); on_records(...)
        on_round(...)                               # retrain the shared cost model, progress
        scheduler.on_round_done(task, ...)

Several rounds may be in flight (`max_in_flight`; the farm measures on many agents);
results are matched to their round by task and candidate, in whatever order they come.

The side effects after a measurement are small named callbacks (`SessionCallback`):
`StoreRecords` appends them to the record store at once, `RetrainCostModel` gives each
batch to the one cost model every task shares (retraining it as often as its time allows,
`retrain_due`), and the progress views of the app
layer draw what happened. A single-operator run is a session with one task.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tunefarm.measure import MeasureBatch, Measurer, MeasureTask
from tunefarm.records import MeasureRecord
from tunefarm.search.config import TuneConfig
from tunefarm.search.cost_model import CostModel
from tunefarm.search.similar_programs import SimilarPrograms
from tunefarm.search.task_scheduler import TaskInfo, TaskScheduler, make_scheduler
from tunefarm.search.tuner import TaskTuner
from tunefarm.store import RecordStore

COLLECT_WAIT_SECS = 1.0
"""How long one `collect` call waits before the loop checks again (results stream in)."""


@dataclass(frozen=True)
class RoundSummary:
    """One finished round, as the callbacks and the report see it."""

    index: int  # rounds of the session so far, from 0 (resumed ones not counted)
    task: int
    task_key: str
    measured: int
    best_cost: float  # the task's best seconds after the round (inf: none valid)
    trials: int  # measurements of the whole session after the round, resumed ones included
    search_secs: float  # proposing this round (retraining after it is in SessionStats)
    measure_secs: float
    elapsed: float  # seconds since the session started
    records: tuple[MeasureRecord, ...] = ()  # the round's measurements


class SessionCallback:
    """Side effects of a session; every method is optional."""

    def on_start(self, session: TuningSession) -> None:
        """Called once, after resume, before the first round."""

    def on_records(self, session: TuningSession, tuner: TaskTuner, records: list[MeasureRecord]) -> None:
        """Called as soon as measurements of a round arrive (possibly several times per round)."""

    def on_round(self, session: TuningSession, tuner: TaskTuner, summary: RoundSummary) -> None:
        """Called when every measurement of a round is in."""

    def on_end(self, session: TuningSession) -> None:
        """Called once when the session stops (budget, every task done, or an interruption)."""


class StoreRecords(SessionCallback):
    """Append every measurement to the record store the moment it arrives."""

    def __init__(self, store: RecordStore):
        self.store = store

    def on_records(self, session: TuningSession, tuner: TaskTuner, records: list[MeasureRecord]) -> None:
        self.store.append(records)


class ShareBestPrograms(SessionCallback):
    """Keep every task's best programs where the tasks similar to it find them
    (`similar_programs.SimilarPrograms`)."""

    def __init__(self, similar: SimilarPrograms):
        self.similar = similar

    def on_records(self, session: TuningSession, tuner: TaskTuner, records: list[MeasureRecord]) -> None:
        self.similar.add(records)


def program_id(record: MeasureRecord) -> str:
    """A short identity of a measured program (its task and decisions)."""
    return hashlib.sha1(f"{record.task}|{record.candidate.key}".encode()).hexdigest()[:16]


def retrain_due(untrained: int, measure_secs_per_trial: float | None, last_training_secs: float | None,
                share: float) -> bool:
    """Whether the cost model retrains after a round: once the `untrained` programs measured
    since its last training took at least `last_training_secs / share` to measure, so that
    retraining, which grows with the history, takes about `share` of the measuring time
    (`SearchConfig.retrain_share`). Always while either time is unknown, and while
    retraining costs less than that share of measuring one round."""
    if untrained <= 0:
        return False
    if last_training_secs is None or measure_secs_per_trial is None:
        return True
    return untrained * measure_secs_per_trial * share >= last_training_secs


class RetrainCostModel(SessionCallback):
    """Give the shared cost model each finished round's measurements, and have it retrain
    on its history when `retrain_due` says so; labels are normalised per task inside the
    model.

    `learnt`: the `program_id` of every program the model has learnt, in the order it
    learnt them (a model kept from earlier runs comes with its list), extended here as
    it learns; resumed records already in it are not learnt twice. None: not tracked."""

    def __init__(self, model: CostModel, learnt: list[str] | None = None, *, share: float = 1.0):
        self.model = model
        self.learnt = learnt
        self.share = share
        self.untrained = 0  # programs added since the model last retrained
        self.last_training_secs: float | None = None

    def on_start(self, session: TuningSession) -> None:
        if not self.model.learns_from_updates:
            return
        known = set(self.learnt or ())
        feats, costs, groups = [], [], []
        for tuner, records in zip(session.tuners, session.resumed_usable):
            records = [r for r in records if program_id(r) not in known]
            feats += tuner.features(records)
            costs += [r.cost for r in records]
            groups += [tuner.key] * len(records)
            self._note(records)
        if feats:
            self.model.update(feats, costs, groups)

    def on_round(self, session: TuningSession, tuner: TaskTuner, summary: RoundSummary) -> None:
        records = list(summary.records)
        if records and self.model.learns_from_updates:  # (no features for a model that learns elsewhere)
            self.untrained += len(records)
            train = retrain_due(self.untrained, tuner.pace.measure_secs_per_trial, self.last_training_secs, self.share)
            t0 = time.perf_counter()
            self.model.update(tuner.features(records), [r.cost for r in records], [tuner.key] * len(records),
                              train=train)  # fmt: skip
            if train:
                self.last_training_secs = time.perf_counter() - t0
                self.untrained = 0
            self._note(records)
        tuner.trim_caches()

    def _note(self, records: list[MeasureRecord]) -> None:
        if self.learnt is not None:
            self.learnt += [program_id(r) for r in records]


@dataclass
class SessionStats:
    rounds: list[RoundSummary] = field(default_factory=list)
    search_secs: float = 0.0  # proposing (sampling, evolution, realizing) and retraining
    train_secs: float = 0.0  # of which retraining the cost model
    measure_secs: float = 0.0  # building and running (wall time from submit to the last result)
    wall_secs: float = 0.0
    stop_reason: str = "budget"


class TuningSession:
    def __init__(
        self,
        tuners: Sequence[TaskTuner],
        infos: Sequence[TaskInfo],
        measure_tasks: Sequence[MeasureTask],
        measurer: Measurer,
        config: TuneConfig,
        *,
        model: CostModel,
        callbacks: Sequence[SessionCallback] = (),
        targets: dict[str, float] | None = None,
        max_in_flight: int = 1,
        learnt_programs: list[str] | None = None,
        log: Callable[[str], None] = lambda msg: None,
    ):
        if not tuners or not len(tuners) == len(infos) == len(measure_tasks):
            raise ValueError("one TaskInfo and one MeasureTask per tuner, and at least one tuner")
        self.tuners = list(tuners)
        self.infos = list(infos)
        self.measure_tasks = list(measure_tasks)
        self.measurer = measurer
        self.config = config
        self.model = model
        self.callbacks = list(callbacks)
        self.log = log
        self.scheduler: TaskScheduler = make_scheduler(
            config.strategy, self.infos, config=config.scheduler_config(), targets=targets
        )
        self.stats = SessionStats()
        self.resumed_usable: list[list[MeasureRecord]] = [[] for _ in self.tuners]
        # Retraining is the first callback: it is part of the search's time, and the
        # progress views after it see the retrained model.
        self._retrain = RetrainCostModel(model, learnt_programs, share=config.search.retrain_share)
        # Rounds measured at the same time: 1 in embedded mode (a kernel is timed alone on
        # this machine's cores); a farm keeps one per free agent.
        self.max_in_flight = max_in_flight
        self._rounds: dict[str, _Round] = {}
        self._batches = 0
        self._t0 = time.perf_counter()

    # -- state ------------------------------------------------------------------------------

    @property
    def trials(self) -> int:
        return sum(t.state.trials for t in self.tuners)

    @property
    def resumed(self) -> int:
        return sum(t.state.resumed for t in self.tuners)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def eta(self) -> float | None:
        new = self.trials - self.resumed
        if new <= 0:
            return None
        return self.elapsed / new * max(0, self.config.trials - self.trials)

    # -- resume -----------------------------------------------------------------------------

    def resume(self, records_by_task: Sequence[Sequence[MeasureRecord]]) -> None:
        """Hand each task its records from an earlier run; the scheduler gets their rounds
        (in batches of the configured size) and the cost model learns from them at start."""
        batch = self.config.batch_size
        for i, (tuner, records) in enumerate(zip(self.tuners, records_by_task)):
            self.resumed_usable[i] = tuner.resume(records)
            rounds = []
            best = math.inf
            for start in range(0, len(records), batch):
                chunk = records[start : start + batch]
                best = min([best, *(r.cost for r in chunk if r.is_valid)])
                rounds.append((best, len(chunk)))
            if rounds:
                self.scheduler.restore(i, rounds)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> SessionStats:
        """Tune until the budget is spent or every task is done (embedded mode)."""
        self.start()
        try:
            while self.step(wait=COLLECT_WAIT_SECS):
                pass
        finally:
            self.close()
        return self.stats

    def start(self) -> None:
        """Called once, after `resume`: the cost model learns the resumed records."""
        self._t0 = time.perf_counter()
        t0 = time.perf_counter()
        self._retrain.on_start(self)
        self.stats.train_secs += time.perf_counter() - t0
        self.stats.search_secs += time.perf_counter() - t0
        for cb in self.callbacks:
            cb.on_start(self)

    def close(self) -> None:
        """Called once when the session stops (done, cancelled or interrupted)."""
        self.stats.wall_secs = self.elapsed
        for cb in self.callbacks:
            cb.on_end(self)

    @property
    def in_flight(self) -> int:
        """Programs submitted whose results have not been ingested."""
        return sum(len(r.waiting) for r in self._rounds.values())

    def step(self, wait: float | None = COLLECT_WAIT_SECS) -> bool:
        """One turn of the driver: start rounds while fewer than `max_in_flight` are out
        (and budget is left), then take whatever results arrive within `wait` seconds
        and finish the rounds that are complete. Returns False once nothing is left to do:
        the budget is spent or every task is done, and no round is in flight."""
        while len(self._rounds) < self.max_in_flight and self._start_round():
            pass
        if not self._rounds:
            return False
        self._collect(wait)
        return True

    def adopt(self, task: int, batch: MeasureBatch) -> None:
        """Take over a batch submitted before this session existed (the farm's scheduler
        restarted): its results are ingested when they arrive, as if proposed here."""
        tuner = self.tuners[task]
        tuner.in_flight.update(m.key for m in batch.inputs if m.key not in tuner.measured)
        waiting = {m.key for m in batch.inputs if m.key not in tuner.measured}
        if waiting:
            self.scheduler.restore_in_flight(task)
            self._rounds[batch.id] = _Round(task, waiting, [], time.perf_counter(), 0.0)

    def _start_round(self) -> bool:
        cfg = self.config
        remaining = cfg.trials - self.trials - self.in_flight
        if remaining <= 0:
            if not self._rounds:
                self.stats.stop_reason = "budget"
            return False
        index = self.scheduler.next_task()
        if index is None:
            if not self._rounds:
                self.stats.stop_reason = "every task is done"
            return False
        tuner = self.tuners[index]
        n = min(cfg.batch_size, remaining)
        t0 = time.perf_counter()
        proposal = tuner.propose(n)
        if not proposal.inputs:  # Ansor retries an empty round once before giving up
            proposal = tuner.propose(n)
        search_secs = time.perf_counter() - t0
        self.stats.search_secs += search_secs
        if not proposal.inputs:
            self.scheduler.on_round_done(index, best_latency=tuner.state.best_cost, trials=0, new_candidates=False)
            return True
        self._batches += 1
        batch = MeasureBatch(
            id=f"{index}:{self._batches}",
            task=self.measure_tasks[index],
            inputs=proposal.inputs,
            timing=tuner.timing(cfg.timing),
            build_timeout=cfg.build_timeout,
            run_timeout=cfg.run_timeout,
        )
        self._rounds[batch.id] = _Round(index, {m.key for m in batch.inputs}, [], time.perf_counter(), search_secs)
        self.measurer.submit(batch)
        return True

    def _collect(self, wait: float | None) -> None:
        results = self.measurer.collect(timeout=wait)
        if not results and self.measurer.pending == 0:
            # Nothing more will come: what is still awaited is lost and may be proposed again.
            for rid, r in list(self._rounds.items()):
                self.tuners[r.task].forget(r.waiting)
                r.waiting.clear()
                self._finish_round(rid)
            return
        by_task: dict[str, list[MeasureRecord]] = {}
        for rec in results:
            by_task.setdefault(rec.task, []).append(rec)
        for rid, r in list(self._rounds.items()):
            tuner = self.tuners[r.task]
            mine = [rec for rec in by_task.get(tuner.key, ()) if rec.key in r.waiting]
            if not mine:
                continue
            r.waiting.difference_update(rec.key for rec in mine)
            records = tuner.ingest(mine)
            if records:
                r.records += records
                for cb in self.callbacks:
                    cb.on_records(self, tuner, records)
            if not r.waiting:
                self._finish_round(rid)

    def _finish_round(self, rid: str) -> None:
        r = self._rounds.pop(rid)
        tuner = self.tuners[r.task]
        measure_secs = time.perf_counter() - r.submitted
        tuner.note_round_time(len(r.records), measure_secs)
        self.stats.measure_secs += measure_secs
        summary = RoundSummary(
            index=len(self.stats.rounds),
            task=r.task,
            task_key=tuner.key,
            measured=len(r.records),
            best_cost=tuner.state.best_cost,
            trials=self.trials,
            search_secs=r.search_secs,
            measure_secs=measure_secs,
            elapsed=self.elapsed,
            records=tuple(r.records),
        )
        self.stats.rounds.append(summary)
        self.scheduler.on_round_done(
            r.task, best_latency=tuner.state.best_cost, trials=len(r.records), new_candidates=True
        )
        t_train = time.perf_counter()
        self._retrain.on_round(self, tuner, summary)
        train_secs = time.perf_counter() - t_train
        self.stats.train_secs += train_secs
        self.stats.search_secs += train_secs
        tuner.pace.note_training(train_secs)
        for cb in self.callbacks:
            cb.on_round(self, tuner, summary)


@dataclass
class _Round:
    """A round in flight: its task, the programs still awaited, the records so far."""

    task: int
    waiting: set[str]
    records: list[MeasureRecord]
    submitted: float
    search_secs: float
