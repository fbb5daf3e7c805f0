"""One task's search, driven by steps: `propose` a batch, `ingest` its results.

A driver (the embedded session, or the farm's scheduler service) decides which task gets
the next round and sends the proposed programs to a `Measurer`; the results come back
whenever they are ready (in any order, some never) and are handed to `ingest`. So the
search never waits on a build or a kernel, and never knows where they ran.

Map of a round:
  1. `propose(n)`: `EvolutionarySearch.next_batch` picks programs with the cost model
     (pure Python, the loop-nest model); each is realized in TVM (`realize.py`) to get
     its trace; a TVM refusal is an invalid sample, counted and skipped, never measured.
     Programs already measured or still in flight are never proposed again.
  2. the driver measures them (`tunefarm.measure.Measurer`);
  3. `ingest(results)`: each result becomes a `MeasureRecord` (cross-checked against the
     other kernels' outputs when the task has no reference), the best list and the
     measured set are updated, and the records go back to the driver, whose callbacks
     store them, retrain the shared cost model and draw progress.
Search time is accounted here (sampling, evolution, realizing); the driver accounts for
retraining, building and measuring.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from tunefarm import digest
from tunefarm.records import ErrorKind, MeasureInput, MeasureRecord, TimingConfig
from tunefarm.search.config import SearchConfig, TuneConfig
from tunefarm.search.cost_model import CostModel
from tunefarm.search.evolution import EvolutionarySearch, RoundStats
from tunefarm.search.similar_programs import SimilarPrograms
from tunefarm.search.space.program_space import Built
from tunefarm.search.space.realize import RealizeError, realize, trace_json
from tunefarm.search.task import SearchTask

BEST_KEPT = 256
"""Best measured programs kept to seed the evolution's initial population."""

SLOW_FACTOR = 10.0
"""A kernel whose warm-up run takes this many times the task's best is timed once only."""


@dataclass
class SearchPace:
    """How fast measuring and scoring go, shared by every task of a session, so that a
    task's first guided round already sizes its evolution right (the search's own time
    is part of tuning time and must stay a small share of it)."""

    measure_secs_per_trial: float | None = None  # wall time of a round / its measurements
    secs_per_scored: float | None = None  # evolution time per program scored (all tasks)
    # The search's time per round that no population size changes: realizing the picked
    # programs in TVM, and retraining the cost model after the round (0 in most rounds).
    propose_fixed_secs: float | None = None
    training_secs: float | None = None

    def note_round(self, measured: int, secs: float) -> None:
        if measured > 0:
            self.measure_secs_per_trial = _ema(self.measure_secs_per_trial, secs / measured)

    def note_search(self, scored: int, secs: float, fixed_secs: float = 0.0) -> None:
        """A proposal: `secs` of evolution over `scored` programs, and `fixed_secs` of
        proposing beside it (realizing the picks)."""
        if scored > 0:
            self.secs_per_scored = _ema(self.secs_per_scored, secs / scored)
        self.propose_fixed_secs = _ema(self.propose_fixed_secs, max(fixed_secs, 0.0))

    def note_training(self, secs: float) -> None:
        """The cost model's retraining after a round (0 when it did not retrain)."""
        self.training_secs = _ema(self.training_secs, max(secs, 0.0))

    @property
    def fixed_secs_per_round(self) -> float:
        return (self.propose_fixed_secs or 0.0) + (self.training_secs or 0.0)


def _ema(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass(frozen=True)
class EvolutionSize:
    """How large a round's evolution is: programs per generation, and generations after
    the initial population."""

    population: int
    generations: int


def evolution_size(cfg: SearchConfig, pace: SearchPace, n: int) -> EvolutionSize:
    """The evolution's size for a round of `n` programs: as configured, unless that would
    make the search exceed its target share of the round's time (judged by the measuring
    pace per trial and the scoring pace, both shared). The share covers the whole search
    of a round: what realizing the picks and retraining the cost model take per round
    (`SearchPace.fixed_secs_per_round`) comes off the evolution's allowance. The
    population shrinks first, down to the smallest one; then the generations, down to
    one (rounds of a few programs of small kernels: a smallest population over every
    generation would take a fifth of the tuning time)."""
    full = EvolutionSize(cfg.population, cfg.generations)
    if pace.secs_per_scored is None or pace.measure_secs_per_trial is None:
        return full
    share = cfg.target_search_share
    allowed = share / (1.0 - share) * pace.measure_secs_per_trial * n - pace.fixed_secs_per_round
    population = int(min(cfg.population, allowed / (pace.secs_per_scored * (cfg.generations + 1))))
    if population >= cfg.min_population:
        return EvolutionSize(population, cfg.generations)
    scored_rounds = int(allowed / (pace.secs_per_scored * cfg.min_population))  # initial population + generations
    return EvolutionSize(cfg.min_population, max(1, min(cfg.generations, scored_rounds - 1)))


@dataclass(frozen=True)
class Proposal:
    """What `propose` gives the driver: the programs to measure, best first."""

    inputs: tuple[MeasureInput, ...]
    stats: RoundStats
    population: int  # the evolution's population this round
    refused: int  # programs TVM refused while realizing (never measured)
    search_secs: float


@dataclass
class TaskState:
    """A task's tuning state as plain data: records in measurement order, and counters."""

    records: list[MeasureRecord] = field(default_factory=list)
    resumed: int = 0
    invalid: int = 0  # programs the search produced that TVM refused (never measured)
    search_secs: float = 0.0
    rounds: list[dict] = field(default_factory=list)
    cross_checked: bool = False  # kernels checked against each other (no reference)

    @property
    def trials(self) -> int:
        return len(self.records)

    @property
    def best(self) -> MeasureRecord | None:
        """The fastest kernel whose output was checked: against the reference, or, without
        one, against the output the other kernels agree on. A kernel measured before
        kernels agreed (or that no other kernel confirmed) never goes into a model."""
        valid = [r for r in self.records if r.is_valid and r.verified]
        return min(valid, key=lambda r: r.cost) if valid else None

    @property
    def best_cost(self) -> float:
        best = self.best
        return best.cost if best is not None else math.inf

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

    def trials_since_best(self) -> int:
        best, at = math.inf, -1
        for i, r in enumerate(self.records):
            if r.is_valid and r.cost < best:
                best, at = r.cost, i
        return len(self.records) - 1 - at


class TaskTuner:
    def __init__(
        self,
        task: SearchTask,
        config: TuneConfig,
        model: CostModel,
        *,
        verify: bool = True,
        pace: SearchPace | None = None,
        similar: SimilarPrograms | None = None,
        log: Callable[[str], None] = lambda msg: None,
    ):
        self.task = task
        self.similar = similar  # the best programs of every task of the run, to seed from
        self.config = config
        self.model = model
        self.verify = verify  # False: no reference, kernels are checked against each other
        self.log = log
        self.rng = random.Random(f"{config.seed}:{task.key}")
        self.search = EvolutionarySearch(task.space, config.search, self.rng)
        self.state = TaskState(cross_checked=not verify)
        self.measured: set[str] = set()
        self.in_flight: set[str] = set()
        self.best_measured: list[MeasureRecord] = []
        self._consensus: tuple[float, ...] | None = None  # agreed output digest (no reference)
        self._unconfirmed: list[tuple[float, ...]] = []
        self.pace = pace or SearchPace()

    @property
    def key(self) -> str:
        return self.task.key

    # -- resume -----------------------------------------------------------------------------

    def resume(self, records: Sequence[MeasureRecord]) -> list[MeasureRecord]:
        """Take the task's records from a previous run; returns those whose sketch still
        exists (the ones the cost model can learn from)."""
        task = self.task
        usable = []
        for r in records:
            self.state.records.append(r)
            self.measured.add(r.candidate.key)
            if 0 <= r.sketch < len(task.sketches) and task.sketch_signature(r.sketch) == r.sketch_sig:
                usable.append(r)
            if r.is_valid:
                self._note_digest(r.digest)
        self.state.resumed = len(records)
        self.best_measured = sorted((r for r in usable if r.is_valid), key=lambda r: r.cost)[:BEST_KEPT]
        return usable

    # -- propose ----------------------------------------------------------------------------

    def evolution_size(self, n: int) -> EvolutionSize:
        """The evolution's size for a round of `n` programs (`evolution_size`)."""
        return evolution_size(self.config.search, self.pace, n)

    def model_ready(self) -> bool:
        """Whether the cost model's scores rank programs (`CostModel.ranks`): trained on
        measurements, or scoring with a pretrained base from the first round."""
        return self.model.ranks

    def propose(self, n: int) -> Proposal:
        """Up to `n` new programs to measure, realized in TVM, best first."""
        t0 = time.perf_counter()
        size = self.evolution_size(n)
        population = size.population
        taken = self.measured | self.in_flight
        picks, stats = self.search.next_batch(
            self.model,
            n,
            taken,
            [r.candidate for r in self.best_measured],
            self.model_ready(),
            population=population,
            generations=size.generations,
            transferred=self.transferred(population),
        )
        inputs: list[MeasureInput] = []
        refused = 0
        for b in picks:
            if len(inputs) == n:
                break
            if b.candidate.key in taken:
                continue
            try:
                sch = realize(self.task.workload.mod, b.program.instructions)
            except RealizeError as exc:
                refused += 1
                if self.state.invalid + refused <= 3:
                    self.log(f"note: TVM refused a sampled program ({exc}); it is skipped, not measured")
                continue
            taken.add(b.candidate.key)
            inputs.append(
                MeasureInput(self.key, b.candidate, self.task.sketch_signature(b.candidate.sketch), trace_json(sch))
            )
        self.in_flight.update(m.key for m in inputs)
        secs = time.perf_counter() - t0
        self.state.invalid += refused + stats.invalid
        self.state.search_secs += secs
        self.pace.note_search(stats.scored, stats.seconds, fixed_secs=secs - stats.seconds)
        self.state.rounds.append(
            {
                "proposed": len(inputs),
                "population": population,
                "generations": stats.generations,
                "sampled": stats.sampled,
                "scored": stats.scored,
                "invalid": stats.invalid + refused,
                "transferred": stats.transferred,
                "search_secs": round(secs, 3),
            }
        )
        return Proposal(tuple(inputs), stats, population, refused, secs)

    def transferred(self, population: int) -> list[Built]:
        """Programs made from similar tasks' best (`similar_programs.py`), filling the population's
        seed share that the task's own best programs do not fill yet."""
        cfg = self.config.search
        room = int(cfg.use_measured_ratio * population) - len(self.best_measured)
        if self.similar is None or not cfg.transfer_from_similar or room <= 0:
            return []
        signatures = {s.signature for s in self.task.sketches}
        out = []
        for donor in self.similar.donors(self.key, signatures, room):
            built = self.task.space.transfer(donor.sketch_sig, donor.candidate.as_dict(), self.rng)
            if built is not None:
                out.append(built)
        return out

    def timing(self, base: TimingConfig) -> TimingConfig:
        """`base` with a slow cutoff at SLOW_FACTOR x the best so far."""
        if not self.best_measured:
            return base
        cutoff = max(0.01, SLOW_FACTOR * self.best_measured[0].cost)
        return replace(base, slow_cutoff_secs=min(base.slow_cutoff_secs, cutoff))

    # -- ingest -----------------------------------------------------------------------------

    def ingest(self, records: Iterable[MeasureRecord]) -> list[MeasureRecord]:
        """Take arrived measurements (in arrival order) into the search's state: returns
        them as the search keeps them (checked against each other when the task has no
        reference). Records of programs this tuner did not propose, or already ingested,
        are ignored (a measurement delivered twice is one)."""
        out = []
        for measured in records:
            key = measured.key
            if key in self.measured or key not in self.in_flight:
                continue
            self.in_flight.discard(key)
            self.measured.add(key)
            rec = self._cross_check(measured)
            self.state.records.append(rec)
            if rec.is_valid:
                self.best_measured.append(rec)
                self.best_measured.sort(key=lambda r: r.cost)
                del self.best_measured[BEST_KEPT:]
            out.append(rec)
        return out

    def forget(self, keys: Iterable[str]) -> None:
        """Programs proposed whose results will never come (a lost batch): they may be
        proposed again."""
        self.in_flight.difference_update(keys)

    def note_round_time(self, measured: int, measure_secs: float) -> None:
        """Called when a round's results are all in, with the wall time they took."""
        self.pace.note_round(measured, measure_secs)

    def features(self, records: Sequence[MeasureRecord]) -> list[np.ndarray]:
        """Feature matrices of measured programs, for the cost model (empty for records
        of a sketch set that no longer exists)."""
        usable = [
            r
            for r in records
            if 0 <= r.sketch < len(self.task.sketches) and self.task.sketch_signature(r.sketch) == r.sketch_sig
        ]
        feats = dict(zip((r.candidate.key for r in usable), self.task.space.features_of([r.candidate for r in usable])))
        empty = np.zeros((0, 0), dtype=np.float32)
        return [feats.get(r.candidate.key, empty) for r in records]

    def trim_caches(self) -> None:
        """Bound the feature cache between rounds (keep the best programs' features)."""
        self.task.space.forget_features({r.candidate.key for r in self.best_measured[:64]})

    # -- checking kernels against each other ------------------------------------------------

    def _cross_check(self, rec: MeasureRecord) -> MeasureRecord:
        """Without a reference, a kernel is checked against the others: once two kernels
        agree, their output digest is the consensus, and a kernel that disagrees with it
        is a wrong result. Kernels measured before a consensus stay unverified."""
        if self.verify or not rec.is_valid or not rec.digest:
            return rec
        if self._consensus is None:
            self._note_digest(rec.digest)
            return replace(rec, verified=self._consensus is not None)
        if digest.agree(rec.digest, self._consensus):
            return replace(rec, verified=True)
        return replace(
            rec,
            costs=(),
            error_kind=ErrorKind.WRONG_RESULT,
            error_msg="outputs differ from those the other kernels agree on (no reference; checked against each other)",
            verified=False,
        )

    def _note_digest(self, d: tuple[float, ...]) -> None:
        if self.verify or not d or self._consensus is not None:
            return
        for other in self._unconfirmed:
            if digest.agree(d, other):
                self._consensus = other
                self._unconfirmed.clear()
                self._confirm_earlier()
                return
        self._unconfirmed.append(d)

    def _confirm_earlier(self) -> None:
        """Once kernels agree, the kernels measured before that agree with them are
        checked too (those that disagree stay unverified: never a task's best)."""
        consensus = self._consensus
        assert consensus is not None
        records = self.state.records
        for i, r in enumerate(records):
            if r.is_valid and not r.verified and r.digest and digest.agree(r.digest, consensus):
                records[i] = replace(r, verified=True)
