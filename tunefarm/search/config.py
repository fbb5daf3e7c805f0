"""Search and tuning hyperparameters: typed, keyword-only, one comment per field.

Defaults follow Ansor's SketchPolicy (TVM v0.13 `auto_scheduler/search_policy.py`) except where a field says why.
`as_dict()` is logged at the start of every run together with the seed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from tunefarm.records import TimingConfig
from tunefarm.search.task_scheduler import TaskSchedulerConfig


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    # Programs per generation, at most. Ansor uses 2048, MetaSchedule 512. Scoring one
    # program with our loop-nest model costs ~0.5-1.5 ms, so the tuner shrinks the
    # population (down to `min_population`) when the search would exceed
    # `target_search_share` of the time a round of the session spends building and
    # measuring. Small rounds (a model's tasks often get 4-16 programs per round) need
    # the low floor: with 128 the search took a third of a small CNN's tuning time.
    population: int = 512
    min_population: int = 48
    # Share of tuning wall time the search may take.
    target_search_share: float = 0.15
    # Share of the measuring time that retraining the cost model may take. Ansor retrains
    # after every round of 64; a model's rounds hold 4-16 programs, and retraining from
    # scratch after each of them grows with the history: a 105-task detector at 1500
    # trials spent 263 s of 1959 s in it. The model retrains after a round once the
    # programs measured since its last training took its last training time / this share
    # to measure (every round while retraining is that cheap; `session.retrain_due`).
    retrain_share: float = 0.04
    # Generations of mutation/crossover after the initial population (Ansor: 4).
    generations: int = 4
    # Chance that an offspring is a mutation of its parent (Ansor: 0.85).
    mutation_prob: float = 0.85
    # Chance that an offspring is a crossover of two parents of the same sketch
    # (Ansor §5.1 describes node-based crossover; ours swaps whole blocks' decisions).
    crossover_prob: float = 0.05
    # Share of each measured batch picked at random from the initial population (Ansor: 0.05).
    eps_greedy: float = 0.05
    # Fewest random programs in a batch of two or more. 5% of the small batches a model's
    # tasks get (4-16 programs) rounds to none, so without a floor a task measures only
    # what a model trained on few labels likes, and that model never sees the rest.
    min_random_per_batch: int = 1
    # Share of the initial population seeded with the best measured programs (Ansor: 0.2).
    use_measured_ratio: float = 0.2
    # While a task has fewer measured programs than that share, fill it with the best
    # programs of its similar tasks (same sketch signature), refit to its extents
    # (`similar_programs.py`): a task's first rounds start from what worked on its siblings.
    transfer_from_similar: bool = True
    # Mutation kinds and their weights (Ansor CPU: tile 0.90, unroll 0.04,
    # compute location 0.05, parallel 0.01).
    mutation_weights: dict[str, float] = field(
        default_factory=lambda: {"tile": 0.90, "unroll": 0.04, "location": 0.05, "parallel": 0.01}
    )
    # The same on a GPU (Ansor GPU: tile 0.90, unroll 0.10; MetaSchedule CUDA: tile 0.9,
    # unroll 0.08, thread binding 0.02): "threads" re-draws an untiled kernel's or a
    # cross-thread reduction's threads per block; "pipeline" changes a tiled block's
    # software-pipeline depth (sm_80+ only: weights are relative, so a target without
    # the slot mutates as before).
    gpu_mutation_weights: dict[str, float] = field(
        default_factory=lambda: {"tile": 0.90, "unroll": 0.08, "threads": 0.02, "pipeline": 0.05}
    )
    # Give up sampling when this many consecutive draws are invalid.
    max_invalid_draws: int = 200

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FinalConfig:
    """The final rounds of a run (`tunefarm.search.finalists`): each task's fastest
    checked kernels, at most `kernels` of them and each within `within` x its best
    record's time, measured again together in `rounds` alternating rounds, each time
    `repeat` repeats of at least `min_repeat_ms` (at most the run's own); the models take
    the one with the lowest median. `rounds=0`: none (each task's best record wins)."""

    rounds: int = 3
    kernels: int = 3
    within: float = 1.25
    repeat: int = 3
    min_repeat_ms: float = 20.0

    def timing(self, base: TimingConfig) -> TimingConfig:
        """How each finalist is timed in a round: `base` (the run's timing), shorter."""
        return replace(base, repeat=min(base.repeat, self.repeat), min_repeat_ms=min(base.min_repeat_ms, self.min_repeat_ms))


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    # Measurements in total over all tasks of the run (records resumed from the file count).
    trials: int
    # Candidates measured per round (Ansor and MetaSchedule: 64). 32 gives the cost
    # model twice the feedback rounds at the same trial budget; on conv2d at 256 trials
    # it found kernels 1.0-1.3x faster than 64 did (two seeds each).
    batch_size: int = 32
    # Seed of every random choice of the run (sampling, evolution, the random model).
    seed: int = 1
    # How each kernel is timed.
    timing: TimingConfig = field(default_factory=TimingConfig)
    # Seconds a build may take before it is a BUILD_TIMEOUT.
    build_timeout: float = 60.0
    # Seconds a whole run step (warm-up, check, timing) may take before RUN_TIMEOUT.
    run_timeout: float = 30.0
    # Seconds the unscheduled program may take to build, and then to run, to produce
    # reference outputs (workloads without a numpy reference). Past it, kernels are
    # checked against each other instead: a naive program must not hold tuning up.
    reference_timeout: float = 60.0
    # A task stops after this many trials without improving its best (None: never).
    early_stopping: int | None = None
    # Which task gets the next round: "gradient" (Ansor §6) or "round-robin".
    strategy: str = "gradient"
    # The task scheduler's parameters (alpha, beta, window, epsilon); its seed is `seed`.
    scheduler: TaskSchedulerConfig | None = None
    search: SearchConfig = field(default_factory=SearchConfig)
    # The final rounds, once the budget is spent: none by default (each task's best
    # record wins); `tunefarm tune --final-rounds N` asks for them.
    final: FinalConfig = field(default_factory=lambda: FinalConfig(rounds=0))

    def scheduler_config(self) -> TaskSchedulerConfig:
        base = self.scheduler or TaskSchedulerConfig()
        return replace(base, seed=self.seed, per_task_early_stopping=self.early_stopping)

    def as_dict(self) -> dict:
        return asdict(self)


def batch_size_for(trials: int, n_tasks: int, largest: int = 32) -> int:
    """Measurements per round: small budgets per task are the normal case in a model, so
    rounds shrink until every task can get about three (at most `largest`, at least 4
    unless the budget could not then give every task its warm-up round)."""
    n_tasks = max(1, n_tasks)
    floor = max(1, min(4, trials // n_tasks))
    return int(max(floor, min(largest, trials // (3 * n_tasks))))
