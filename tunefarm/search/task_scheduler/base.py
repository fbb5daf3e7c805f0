"""Task scheduling across the tasks of one or more models (Ansor paper, OSDI 2020, §6 and appendix A).

A model is split into tasks (fused subgraphs), each tuned by its own search. Tuning proceeds in
rounds: a round is one batch of measurements of one task. A `TaskScheduler` decides which task
gets the next round so that time goes where the models' end-to-end latency gains most.

Plain data here: `TaskInfo` (what the caller knows about a task), `TaskSchedulerConfig`, `Objective`
(the models' estimated latency, with optional per-model targets), `TaskProgress` and `Decision`
(snapshots for reports), and the `TaskScheduler` interface. The interface keeps the per-task
bookkeeping (rounds, trials, best latency, dead tasks, rounds in flight); a strategy only says
which of the tasks that still want time gets the next round (`_choose`).

Time is counted in rounds, as in Ansor's code (the paper's t_i): a round's size may vary (the last
one of a budget, a space that runs dry), which the estimate ignores.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from types import MappingProxyType

SIMILARITY_LOG_BASE = 1.618
"""Base of the FLOP-count logarithm in a similarity tag (Ansor's `derive_similarity_tag`): tasks
of one operator structure whose FLOP counts lie within a factor of ~1.6 share a tag."""


def similarity_tag(kind: str, flops: float) -> str:
    """Ansor's similarity tag: the operator structure ``kind`` plus the FLOP count's order of
    magnitude in base 1.618. An empty ``kind`` gives ``""``, which makes a task similar to none."""
    if not kind:
        return ""
    return f"{kind}_{int(math.log(max(flops, 0.0) + 1, SIMILARITY_LOG_BASE))}"


@dataclass(frozen=True)
class TaskInfo:
    """What the scheduler knows about one task; tasks are numbered by their position."""

    key: str
    # Floating-point operations of one run of the task (C_i in the paper); 0 when unknown or
    # meaningless (pure data movement): the similar-task estimate is then skipped.
    flops: float
    # Model name -> occurrences of the task in that model (w_{m,i}); several models may share
    # a task. A copy of what was passed (a plain dict, so that `asdict` works for reports).
    weights: Mapping[str, int]
    # Tasks with equal non-empty tags are similar (N(i) in the paper); see `similarity_tag`.
    similarity_tag: str = ""
    # Tasks with equal non-empty groups are alternative ways to compute one thing (a
    # convolution direct or by Winograd): a model pays for the fastest of them only, so
    # they carry equal weights and the objective counts their minimum.
    group: str = ""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.flops) and self.flops >= 0):
            raise ValueError(f"task {self.key!r}: flops must be finite and >= 0, got {self.flops}")
        for model, count in self.weights.items():
            if count < 0:
                raise ValueError(f"task {self.key!r}: weight in {model!r} must be >= 0, got {count}")
        object.__setattr__(self, "weights", dict(self.weights))

    def __hash__(self) -> int:
        return hash((self.key, self.flops, tuple(sorted(self.weights.items())), self.similarity_tag, self.group))


@dataclass(frozen=True, kw_only=True)
class TaskSchedulerConfig:
    # Share of the backward (observed) slope in the gradient; the rest is the forward
    # (predicted) term (Ansor: 0.2).
    alpha: float = 0.2
    # A task is assumed able to reach 1/beta of the best speed (FLOP/s) of its similar tasks
    # (Ansor: 2).
    beta: float = 2.0
    # Rounds a task may be given beyond every similar task's while it stays below 1/beta of
    # their best speed; past that it no longer counts as similar to them, for the rest of the
    # run (Ansor's code: 5). Without it, a task that cannot run like its similar tasks (a
    # memory-bound head tagged with compute-bound convolutions) is promised their speed
    # forever and takes round after round.
    dissimilar_after: int = 5
    # Rounds the backward slope looks back over (Ansor: 3); 0 while the history is shorter.
    backward_window: int = 3
    # Chance that a round goes to a random task instead of the gradient's pick. Ansor's paper
    # has this; TVM's code never did. 0.05 costs at most 5% of the budget and makes sure that
    # a task whose early rounds looked flat, so that the gradient would starve it, still gets
    # an occasional round; it is also the measurement-level epsilon Ansor uses.
    eps_greedy: float = 0.05
    # Trials without improving a task's best before the task is dead (None: never).
    per_task_early_stopping: int | None = None
    # Rounds a task may finish without any valid measurement before it is dead. 1 as in TVM
    # since PR #16739: a task with no valid program after its warm-up round is dropped (before
    # that fix its latency sentinel made the gradient meaningless).
    rounds_without_valid: int = 1
    # Seed of the scheduler's random choices (epsilon picks, ties).
    seed: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if self.dissimilar_after < 0:
            raise ValueError(f"dissimilar_after must be >= 0, got {self.dissimilar_after}")
        if self.backward_window < 1:
            raise ValueError(f"backward_window must be >= 1, got {self.backward_window}")
        if not 0 <= self.eps_greedy <= 1:
            raise ValueError(f"eps_greedy must be in [0, 1], got {self.eps_greedy}")
        if self.per_task_early_stopping is not None and self.per_task_early_stopping < 1:
            raise ValueError(f"per_task_early_stopping must be >= 1, got {self.per_task_early_stopping}")
        if self.rounds_without_valid < 1:
            raise ValueError(f"rounds_without_valid must be >= 1, got {self.rounds_without_valid}")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LatencyEstimate:
    """The models' estimated latency from the best latency of each task so far.

    Tasks without a valid measurement (`unknown_tasks`) are left out of every sum until they
    have one, so a model with unknown tasks is underestimated and never counts as at target.
    """

    # Model -> Σ_i w_{m,i} · g_i over the model's tasks with a valid latency, in seconds.
    per_model: Mapping[str, float]
    # Σ of `per_model`.
    total: float
    # The objective f = Σ_m max(latency_m, target_m) (target 0 for a model without one);
    # equals `total` when there are no targets.
    objective: float
    # Tasks used by some model that have no valid latency yet (or never will: dead ones).
    unknown_tasks: tuple[int, ...]
    # Models with a target whose every task is measured and whose latency is at or below it.
    at_target: frozenset[str]


class Objective:
    """The paper's f: total weighted latency of all models, optionally with latency targets.

    Without targets f = Σ_m Σ_i w_{m,i} · g_i. With targets L_m it is the paper's
    f = Σ_m max(Σ_i w_{m,i} · g_i, L_m): a model at or below its target contributes nothing more
    to gain, so ∂f/∂g_i only sums the weights of the models still above theirs. A task shared with
    a model above its target keeps getting time.

    Tasks of one `TaskInfo.group` count once, as the fastest of them: g_i there is the group's
    minimum (`group_best`), and the group is unknown only while none of them has a latency.

    Tasks without a valid latency are left out of the sums (`LatencyEstimate.unknown_tasks`); a
    model with such a task is never at target, since its latency is not known (a task that died
    without a valid program keeps its model above target: its other tasks keep getting time).
    """

    def __init__(self, tasks: Sequence[TaskInfo], targets: Mapping[str, float] | None = None) -> None:
        self.tasks = tuple(tasks)
        # task -> the tasks of its group (itself alone when it has none)
        members: dict[str, list[int]] = {}
        for i, t in enumerate(self.tasks):
            if t.group:
                members.setdefault(t.group, []).append(i)
        self.groups = tuple(tuple(members[t.group]) if t.group else (i,) for i, t in enumerate(self.tasks))
        for group in members.values():
            if any(self.tasks[i].weights != self.tasks[group[0]].weights for i in group):
                raise ValueError(f"the tasks of group {self.tasks[group[0]].group!r} must have equal weights")
        self.models = tuple(sorted({m for t in self.tasks for m in t.weights}))
        self.targets = MappingProxyType(dict(targets or {}))
        for model, target in self.targets.items():
            if model not in self.models:
                raise ValueError(f"target for unknown model {model!r} (models: {list(self.models)})")
            if not (target >= 0 and math.isfinite(target)):
                raise ValueError(f"target of {model!r} must be finite and >= 0, got {target}")

    def group_best(self, best: Sequence[float], task: int) -> float:
        """The best latency of ``task``'s group: the minimum over its members (math.inf if none)."""
        return min(best[k] for k in self.groups[task])

    def estimate(self, best: Sequence[float]) -> LatencyEstimate:
        """Estimate from ``best[i]``, the best latency of task i in seconds (math.inf if none)."""
        per_model = dict.fromkeys(self.models, 0.0)
        complete = dict.fromkeys(self.models, True)
        unknown = []
        for i, task in enumerate(self.tasks):
            used_by = [m for m, w in task.weights.items() if w > 0]
            if not used_by:
                continue
            latency = self.group_best(best, i)
            if not math.isfinite(latency):
                unknown.append(i)
                for m in used_by:
                    complete[m] = False
                continue
            if self.groups[i][0] != i:
                continue  # a group counts once, at its first member
            for m in used_by:
                per_model[m] += task.weights[m] * latency
        at_target = frozenset(
            m for m, target in self.targets.items() if complete[m] and per_model[m] <= target
        )
        objective = sum(max(latency, self.targets.get(m, 0.0)) for m, latency in per_model.items())
        return LatencyEstimate(
            per_model=per_model,
            total=sum(per_model.values()),
            objective=objective,
            unknown_tasks=tuple(unknown),
            at_target=at_target,
        )

    def chain_gradient(self, best: Sequence[float]) -> list[float]:
        """∂f/∂g_i for every task: Σ_m w_{m,i} over the models not yet at their target (for a
        task of a group, ∂f/∂ of the group's latency: what lowers it is the scheduler's question).

        0 for a task all of whose models are at target (or that no model uses): it gets no
        more time.
        """
        at_target = self.estimate(best).at_target
        return [float(sum(w for m, w in task.weights.items() if m not in at_target)) for task in self.tasks]


class DeadReason(StrEnum):
    """Why a task gets no more rounds (`TaskScheduler.mark_dead` also takes free text)."""

    NO_VALID_SCHEDULE = "no-valid-schedule"  # no valid measurement after its first round(s)
    EXHAUSTED = "exhausted"  # the search could not propose anything new
    EARLY_STOPPED = "early-stopped"  # no improvement for `per_task_early_stopping` trials


class DecisionReason(StrEnum):
    WARM_UP = "warm-up"  # the task had no round (or no valid latency) yet
    GRADIENT = "gradient"  # the largest |∂f/∂t_i|
    EPSILON = "epsilon"  # a random task (epsilon-greedy)
    ROUND_ROBIN = "round-robin"  # next in turn


@dataclass(frozen=True)
class Decision:
    """One `next_task` answer, kept for the report."""

    # Index of the round among all rounds handed out, from 0.
    round: int
    task: int
    reason: DecisionReason
    # ∂f/∂t of the chosen task (None where no gradient was computed).
    gradient: float | None = None
    # ∂f/∂t of every task that had one at that moment.
    gradients: Mapping[int, float] | None = None


@dataclass(frozen=True)
class TaskProgress:
    """A snapshot of one task's bookkeeping."""

    key: str
    # None while the task may get rounds; otherwise why not.
    dead_reason: str | None
    # Rounds ingested by `on_round_done`.
    rounds: int
    # Rounds handed out and not yet ingested.
    in_flight: int
    # Measurements ingested.
    trials: int
    # Best valid latency in seconds so far (math.inf: none yet).
    best: float
    # `best` after each ingested round.
    history: tuple[float, ...]
    # Trials ingested since `best` last improved.
    trials_since_improvement: int
    # Every model that uses the task is at its target: it gets no more time.
    at_target: bool

    @property
    def alive(self) -> bool:
        return self.dead_reason is None


@dataclass
class _Book:
    """Mutable per-task bookkeeping behind `TaskProgress`."""

    dead_reason: str | None = None
    rounds: int = 0
    in_flight: int = 0
    trials: int = 0
    best: float = math.inf
    history: list[float] = field(default_factory=list)
    trials_since_improvement: int = 0

    @property
    def issued(self) -> int:
        return self.rounds + self.in_flight


class TaskScheduler(ABC):
    """Hands out rounds to tasks and ingests their results.

    Rounds may be in flight concurrently (a farm measures asynchronously): `next_task` may be
    called again before earlier rounds, of any task, are done. Every estimate uses what has been
    ingested so far; a strategy may also look at the rounds still in flight (`TaskProgress.in_flight`).
    Not thread-safe: call it from the one loop that drives the tuning.

    ``tasks`` are numbered by position; ``targets`` maps a model to its latency target in seconds
    (see `Objective`). The caller logs ``config.as_dict()`` (seed included) at the start of a run.
    """

    def __init__(
        self,
        tasks: Sequence[TaskInfo],
        *,
        config: TaskSchedulerConfig | None = None,
        targets: Mapping[str, float] | None = None,
    ) -> None:
        if not tasks:
            raise ValueError("a task scheduler needs at least one task")
        self.config = config or TaskSchedulerConfig()
        self.objective = Objective(tasks, targets)
        self._books = [_Book() for _ in tasks]
        self._decisions: list[Decision] = []

    # --- the interface -------------------------------------------------------------------------

    def next_task(self) -> int | None:
        """The task that gets the next round; called whenever the tuner can start a round.

        The round counts as in flight until `on_round_done` ingests it. Returns None when every
        task is dead or at target; more rounds may come back later (e.g. a task in flight).
        """
        candidates = self._wanted()
        if not candidates:
            return None
        decision = self._choose(candidates, len(self._decisions))
        if decision.task not in candidates:
            raise RuntimeError(f"{type(self).__name__} chose task {decision.task}, not a candidate")
        self._decisions.append(decision)
        self._books[decision.task].in_flight += 1
        return decision.task

    def on_round_done(self, task: int, *, best_latency: float, trials: int, new_candidates: bool) -> None:
        """Ingest a round of ``task`` once its measurements are in (store, model, etc. updated).

        ``best_latency`` is the task's best valid latency so far in seconds (math.inf: none yet);
        ``trials`` the measurements of this round; ``new_candidates`` False when the search
        could not propose anything new (the space is exhausted). Rounds may be ingested in any
        order. A task may die here: no valid latency after `rounds_without_valid` rounds, an
        exhausted space, or `per_task_early_stopping` trials without improvement.
        """
        book = self._book(task)
        if book.in_flight == 0:
            raise ValueError(f"task {task} has no round in flight")
        if math.isnan(best_latency) or best_latency <= 0:
            raise ValueError(f"best_latency must be > 0 or math.inf, got {best_latency}")
        if trials < 0:
            raise ValueError(f"trials must be >= 0, got {trials}")
        book.in_flight -= 1
        _ingest(book, best_latency, trials)
        self._apply_death_rules(book, exhausted=not new_candidates)

    def restore(self, task: int, rounds: Sequence[tuple[float, int]]) -> None:
        """Take a task's rounds from an earlier run (resume), before any `next_task` for it:
        each is (best latency after the round, trials in it). They count as rounds already
        done (warm-up included); the dead-task rules are then applied once to the result."""
        book = self._book(task)
        if book.issued:
            raise ValueError(f"task {task} already has rounds; restore it first")
        for best_latency, trials in rounds:
            _ingest(book, best_latency, trials)
        if book.rounds:
            self._apply_death_rules(book)

    def restore_in_flight(self, task: int) -> None:
        """A round of ``task`` handed out before a restart and still in flight: it will be
        ingested by `on_round_done` like one `next_task` handed out (no decision recorded)."""
        self._book(task).in_flight += 1

    def mark_dead(self, task: int, reason: str) -> None:
        """Give ``task`` no more rounds, e.g. when the caller finds it cannot be built at all.

        Rounds already in flight may still be ingested. A dead task stays dead with its first reason.
        """
        if not reason:
            raise ValueError("a dead task needs a reason")
        self._kill(self._book(task), reason)

    @property
    def tasks(self) -> tuple[TaskInfo, ...]:
        return self.objective.tasks

    @property
    def states(self) -> tuple[TaskProgress, ...]:
        """A snapshot of every task's bookkeeping, in task order."""
        chain = self.objective.chain_gradient(self._best())
        return tuple(
            TaskProgress(
                key=info.key,
                dead_reason=book.dead_reason,
                rounds=book.rounds,
                in_flight=book.in_flight,
                trials=book.trials,
                best=book.best,
                history=tuple(book.history),
                trials_since_improvement=book.trials_since_improvement,
                at_target=chain[i] == 0,
            )
            for i, (info, book) in enumerate(zip(self.tasks, self._books))
        )

    @property
    def decisions(self) -> tuple[Decision, ...]:
        """Every `next_task` answer so far, in order."""
        return tuple(self._decisions)

    def estimate(self) -> LatencyEstimate:
        """The models' estimated latency from what has been ingested so far."""
        return self.objective.estimate(self._best())

    # --- for strategies ------------------------------------------------------------------------

    @abstractmethod
    def _choose(self, candidates: list[int], round_index: int) -> Decision:
        """Pick one of ``candidates`` (alive tasks not at target, ascending, never empty) for the
        round numbered ``round_index``; called by `next_task`, which records the decision."""

    def _wanted(self) -> list[int]:
        chain = self.objective.chain_gradient(self._best())
        return [i for i, book in enumerate(self._books) if book.dead_reason is None and chain[i] > 0]

    def _best(self) -> list[float]:
        return [book.best for book in self._books]

    def _book(self, task: int) -> _Book:
        if not 0 <= task < len(self._books):
            raise ValueError(f"no task {task} (have {len(self._books)})")
        return self._books[task]

    def _apply_death_rules(self, book: _Book, *, exhausted: bool = False) -> None:
        """No valid latency after `rounds_without_valid` rounds, an exhausted space, or no
        improvement for `per_task_early_stopping` trials: the task gets no more rounds."""
        limit = self.config.per_task_early_stopping
        if not math.isfinite(book.best) and book.rounds >= self.config.rounds_without_valid:
            self._kill(book, DeadReason.NO_VALID_SCHEDULE)
        elif exhausted:
            self._kill(book, DeadReason.EXHAUSTED)
        elif limit is not None and book.trials_since_improvement >= limit:
            self._kill(book, DeadReason.EARLY_STOPPED)

    @staticmethod
    def _kill(book: _Book, reason: str) -> None:
        if book.dead_reason is None:
            book.dead_reason = str(reason)


def _ingest(book: _Book, best_latency: float, trials: int) -> None:
    """Count one finished round of a task: its trials and the best latency after it."""
    book.rounds += 1
    book.trials += trials
    if best_latency < book.best:
        book.best = best_latency
        book.trials_since_improvement = 0
    else:
        book.trials_since_improvement += trials
    book.history.append(book.best)
