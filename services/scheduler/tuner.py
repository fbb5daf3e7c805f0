"""Tune one task: rounds of search -> realize -> build -> run -> record -> retrain.

Map of a round (`TaskTuner._round`):
  1. `EvolutionarySearch.next_batch` proposes programs (pure Python, the loop-nest model);
  2. each is realized in TVM (`realize.py`); a TVM refusal is an invalid sample, counted
     and skipped, never measured;
  3. the builder compiles the batch in parallel worker processes;
  4. the runner then times the kernels one at a time (nothing else runs on the cores
     while a kernel is timed) and checks every output against the reference;
  5. every measurement is appended to the record store at once, the cost model is
     retrained, and the side effects after a measurement (progress line, curve) are
     small callbacks.
Search time, build time and measure time are accounted separately: the search's own
time is part of tuning time and is reported.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from services.measurer.runner import Runner
from services.measurer.task_data import add_expected_from, write_task_data
from services.scheduler.config import TuneConfig
from services.scheduler.cost_model import CostModel
from services.scheduler.evolution import EvolutionarySearch
from services.scheduler.program_space import Built
from services.scheduler.realize import RealizeError, realize, trace_json
from services.scheduler.task import SearchTask
from services.worker.builder import Builder
from tunefarm.records import BuildInput, ErrorKind, MeasureRecord, RunInput, RunResult, TimingConfig
from tunefarm.store import RecordStore


@dataclass(frozen=True)
class TrialEvent:
    """Sent after every measured candidate (drives the live progress line)."""

    task: str
    trial: int  # measurements of the task so far, resumed ones included
    total: int  # the trial budget
    record: MeasureRecord
    best_cost: float
    errors: int
    elapsed: float  # seconds since this run started
    eta: float | None  # seconds, from this run's pace


@dataclass
class TuneResult:
    task: SearchTask
    records: list[MeasureRecord]  # every record of the task, resumed ones first
    resumed: int
    invalid: int  # programs the search produced that TVM refused (never measured)
    search_secs: float = 0.0
    build_secs: float = 0.0
    measure_secs: float = 0.0
    wall_secs: float = 0.0
    stop_reason: str = "budget"
    verify_available: bool = True
    rounds: list[dict] = field(default_factory=list)

    @property
    def best(self) -> MeasureRecord | None:
        valid = [r for r in self.records if r.is_valid]
        return min(valid, key=lambda r: r.cost) if valid else None

    @property
    def errors(self) -> Counter:
        return Counter(str(r.error_kind) for r in self.records if r.error_kind.is_error)

    @property
    def curve(self) -> list[tuple[int, float]]:
        """(trial, best seconds so far) after every trial that improved the best."""
        out: list[tuple[int, float]] = []
        best = math.inf
        for i, r in enumerate(self.records, 1):
            if r.is_valid and r.cost < best:
                best = r.cost
                out.append((i, best))
        return out


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class TaskTuner:
    def __init__(
        self,
        task: SearchTask,
        config: TuneConfig,
        *,
        model: CostModel,
        builder: Builder,
        runner: Runner,
        store: RecordStore,
        work_dir: Path,
        on_trial: Callable[[TrialEvent], None] | None = None,
        log: Callable[[str], None] = _stderr,
    ):
        self.task = task
        self.config = config
        self.model = model
        self.builder = builder
        self.runner = runner
        self.store = store
        self.work_dir = Path(work_dir)
        self.on_trial = on_trial
        self.log = log
        self.rng = random.Random(config.seed)
        self.search = EvolutionarySearch(task.space, config.search, self.rng)
        self._workload_json = task.workload.to_json()
        self._last_measure_secs: float | None = None
        self._secs_per_scored: float | None = None

    # ------------------------------------------------------------------ entry point
    def tune(self) -> TuneResult:
        t_start = time.perf_counter()
        task, cfg = self.task, self.config
        records = self.store.load(task.key)
        result = TuneResult(task, list(records), resumed=len(records), invalid=0)
        self._resume(records)
        t0 = time.perf_counter()
        task_data, verify = self._prepare_task_data()
        result.measure_secs += time.perf_counter() - t0
        result.verify_available = verify
        self._task_data = task_data
        self._verify = verify
        self._t_start = t_start
        self._trials_at_start = len(records)
        empty_rounds = 0
        while len(result.records) < cfg.trials:
            n = min(cfg.batch_size, cfg.trials - len(result.records))
            measured_now = self._round(result, n)
            if measured_now == 0:
                empty_rounds += 1
                if empty_rounds >= 2:
                    result.stop_reason = "search space exhausted"
                    break
                continue
            empty_rounds = 0
            if cfg.early_stopping is not None and self._since_best(result.records) >= cfg.early_stopping:
                result.stop_reason = "early stopping"
                break
        result.wall_secs = time.perf_counter() - t_start
        return result

    # ---------------------------------------------------------------------- resume
    def _resume(self, records: list[MeasureRecord]) -> None:
        task = self.task
        self.measured: set[str] = set()
        usable = []
        for r in records:
            if 0 <= r.sketch < len(task.sketches) and task.sketch_signature(r.sketch) == r.sketch_sig:
                self.measured.add(r.candidate.key)
                usable.append(r)
        self.best_measured = sorted((r for r in usable if r.is_valid), key=lambda r: r.cost)
        if usable:
            feats = task.space.features_of([r.candidate for r in usable])
            self.model.update(feats, [r.cost for r in usable], [task.key] * len(usable))
        skipped = getattr(self.store, "skipped_lines", 0)
        if skipped:
            self.log(f"warning: {skipped} unreadable lines in the records file were skipped (left in place)")
        if records:
            self.log(
                f"resuming {task.workload.name}: {len(records)} records "
                f"({len(usable)} from the current sketches) in the store"
            )

    # ------------------------------------------------------------------- one round
    def _population(self) -> int:
        """The evolution's population for the next round: as large as configured, unless
        that would make the search exceed its target share of the round's time (judged
        by the last round's build and measure time and the search's own pace)."""
        cfg = self.config.search
        if self._secs_per_scored is None or self._last_measure_secs is None:
            return cfg.population
        share = cfg.target_search_share
        allowed = share / (1.0 - share) * self._last_measure_secs
        per_program = self._secs_per_scored * (cfg.generations + 1)
        return int(max(cfg.min_population, min(cfg.population, allowed / per_program)))

    def _model_ready(self) -> bool:
        return getattr(self.model, "trained_on", 0) > 0

    def _round(self, result: TuneResult, n: int) -> int:
        t0 = time.perf_counter()
        population = self._population()
        picks, stats = self.search.next_batch(
            self.model,
            n,
            self.measured,
            [r.candidate for r in self.best_measured],
            self._model_ready(),
            population=population,
        )
        batch: list[tuple[Built, list]] = []
        for b in picks:
            if len(batch) == n:
                break
            if b.candidate.key in self.measured:
                continue
            try:
                sch = realize(self.task.workload.mod, b.program.instructions)
            except RealizeError as exc:
                result.invalid += 1
                if result.invalid <= 3:
                    self.log(f"note: TVM refused a sampled program ({exc}); it is skipped, not measured")
                continue
            batch.append((b, trace_json(sch)))
        result.invalid += stats.invalid
        search_secs = time.perf_counter() - t0
        result.search_secs += search_secs
        if not batch:
            return 0
        t_measure = time.perf_counter()
        new_records = self._measure(batch, result)
        self._last_measure_secs = time.perf_counter() - t_measure
        if stats.scored:
            self._secs_per_scored = stats.seconds / stats.scored
        t1 = time.perf_counter()
        feats = self.task.space.features([b for b, _ in batch])
        self.model.update(feats, [r.cost for r in new_records], [self.task.key] * len(new_records))
        self.task.space.forget_features({r.candidate.key for r in self.best_measured[:64]})
        train_secs = time.perf_counter() - t1
        result.search_secs += train_secs
        result.rounds.append(
            {
                "measured": len(new_records),
                "population": population,
                "sampled": stats.sampled,
                "scored": stats.scored,
                "invalid": stats.invalid,
                "search_secs": round(search_secs + train_secs, 3),
            }
        )
        return len(new_records)

    # ----------------------------------------------------------------- measurement
    def _measure(self, batch: list[tuple[Built, list]], result: TuneResult) -> list[MeasureRecord]:
        task, cfg = self.task, self.config
        inputs = [
            BuildInput(
                candidate_key=b.candidate.key,
                workload_json=self._workload_json,
                trace_json=json.dumps(trace),
                target=task.target,
                timeout_secs=cfg.build_timeout,
            )
            for b, trace in batch
        ]
        t0 = time.perf_counter()
        builds = self.builder.build(inputs)
        result.build_secs += time.perf_counter() - t0
        out: list[MeasureRecord] = []
        for (b, trace), br in zip(batch, builds):
            if br.error_kind.is_error:
                run = RunResult(b.candidate.key, (), 0.0, br.error_kind, br.error_msg)
            else:
                t1 = time.perf_counter()
                run = self.runner.run([self._run_input(b, br.artifact)])[0]
                result.measure_secs += time.perf_counter() - t1
                Path(br.artifact).unlink(missing_ok=True)
            rec = MeasureRecord(
                task=task.key,
                workload=task.workload.name,
                target=task.target,
                sketch=b.candidate.sketch,
                sketch_sig=task.sketch_signature(b.candidate.sketch),
                decisions=b.candidate.decisions,
                trace=trace,
                costs=run.costs,
                error_kind=run.error_kind,
                error_msg=run.error_msg,
                build_secs=br.build_secs,
                run_secs=run.run_secs,
                verified=run.verified,
                timestamp=time.time(),
            )
            self.store.append([rec])
            out.append(rec)
            result.records.append(rec)
            self.measured.add(b.candidate.key)
            if rec.is_valid:
                self._note_best(rec)
            self._emit(result, rec)
        return out

    def _run_input(self, b: Built, artifact: str) -> RunInput:
        timing = self.config.timing
        if self.best_measured:
            # A kernel whose warm-up run takes 10x the best so far is timed once only.
            cutoff = max(0.01, 10.0 * self.best_measured[0].cost)
            timing = replace(timing, slow_cutoff_secs=min(timing.slow_cutoff_secs, cutoff))
        wl = self.task.workload
        return RunInput(
            candidate_key=b.candidate.key,
            artifact=artifact,
            task_data=self._task_data,
            n_inputs=len(wl.inputs),
            n_outputs=len(wl.outputs),
            verify=self._verify,
            timing=timing,
            timeout_secs=self.config.run_timeout,
        )

    def _note_best(self, rec: MeasureRecord) -> None:
        self.best_measured.append(rec)
        self.best_measured.sort(key=lambda r: r.cost)
        del self.best_measured[256:]

    def _emit(self, result: TuneResult, rec: MeasureRecord) -> None:
        if self.on_trial is None:
            return
        done = len(result.records)
        elapsed = time.perf_counter() - self._t_start
        new = done - self._trials_at_start
        eta = elapsed / new * (self.config.trials - done) if new else None
        best = result.best
        self.on_trial(
            TrialEvent(
                task=self.task.workload.name,
                trial=done,
                total=self.config.trials,
                record=rec,
                best_cost=best.cost if best else math.inf,
                errors=sum(1 for r in result.records if r.error_kind.is_error),
                elapsed=elapsed,
                eta=eta,
            )
        )

    @staticmethod
    def _since_best(records: list[MeasureRecord]) -> int:
        best, at = math.inf, 0
        for i, r in enumerate(records):
            if r.is_valid and r.cost < best:
                best, at = r.cost, i
        return len(records) - 1 - at

    # ----------------------------------------------------------------- reference
    def _prepare_task_data(self) -> tuple[str, bool]:
        """Inputs and reference outputs for the task. Workloads without a numpy
        reference get theirs from the unscheduled program, built and run once."""
        wl = self.task.workload
        self.work_dir.mkdir(parents=True, exist_ok=True)
        safe = "".join(ch if ch.isalnum() else "_" for ch in self.task.key)[-80:]
        path = str(self.work_dir / f"task_{safe}.npz")
        if wl.reference is not None:
            return write_task_data(path, wl, seed=0, with_expected=True), True
        write_task_data(path, wl, seed=0, with_expected=False)
        self.log(f"{wl.name}: computing reference outputs with the unscheduled program")
        build = self.builder.build(
            [BuildInput("reference", self._workload_json, "", self.task.target, self.config.reference_timeout)]
        )[0]
        if build.error_kind.is_error:
            self.log(f"warning: the unscheduled program does not build ({build.error_msg}); outputs are not checked")
            return path, False
        outputs = str(self.work_dir / f"reference_{safe}.npz")
        run = self.runner.run(
            [
                RunInput(
                    candidate_key="reference",
                    artifact=build.artifact,
                    task_data=path,
                    n_inputs=len(wl.inputs),
                    n_outputs=len(wl.outputs),
                    verify=False,
                    timing=TimingConfig(repeat=1, min_repeat_ms=0, slow_cutoff_secs=0.0),
                    timeout_secs=self.config.reference_timeout,
                    save_outputs=outputs,
                )
            ]
        )[0]
        Path(build.artifact).unlink(missing_ok=True)
        if run.error_kind is not ErrorKind.NONE:
            self.log(f"warning: the unscheduled program failed ({run.error_kind}: {run.error_msg}); outputs are not checked")
            return path, False
        add_expected_from(path, outputs)
        return path, True
