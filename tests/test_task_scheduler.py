"""Task schedulers on synthetic models, without compiling anything.

A simulated task's best latency after t rounds is floor + (start − floor) · exp(−t/τ). First one
conformance suite run against every strategy, then the objective, then the gradient scheduler's
formula and behaviour, ending with the property that it reaches round-robin's final objective
in clearly fewer rounds.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tunefarm.search.task_scheduler import (
    STRATEGIES,
    DeadReason,
    DecisionReason,
    GradientScheduler,
    Objective,
    RoundRobinScheduler,
    TaskInfo,
    TaskScheduler,
    TaskSchedulerConfig,
    make_scheduler,
    similarity_tag,
    task_gradient,
)
from tunefarm.search.task_scheduler.gradient import backward_slope, forward_gain

TRIALS = 32  # measurements per simulated round
MS = 1e-3


@dataclass(frozen=True)
class SimTask:
    """A task whose best latency (seconds) falls towards ``floor`` as it gets rounds."""

    weight: int
    start: float
    floor: float
    tau: float  # rounds
    flops: float = 1e9

    def latency(self, rounds: int) -> float:
        return self.floor + (self.start - self.floor) * math.exp(-rounds / self.tau)


def infos(sims: list[SimTask], model: str = "net") -> list[TaskInfo]:
    return [TaskInfo(f"t{i}", s.flops, {model: s.weight}) for i, s in enumerate(sims)]


def finish(sched: TaskScheduler, task: int, sims: list[SimTask], **overrides) -> None:
    """Ingest one round of ``task`` with the simulated latency after its rounds so far."""
    rounds = sched.states[task].rounds + 1
    kwargs = {"best_latency": sims[task].latency(rounds), "trials": TRIALS, "new_candidates": True}
    kwargs.update(overrides)
    sched.on_round_done(task, **kwargs)


def step(sched: TaskScheduler, sims: list[SimTask]) -> int | None:
    task = sched.next_task()
    if task is not None:
        finish(sched, task, sims)
    return task


def run(sched: TaskScheduler, sims: list[SimTask], rounds: int) -> list[float]:
    """The objective after each of ``rounds`` sequential rounds; math.inf while some task has
    no latency yet (the estimate leaves unmeasured tasks out, so it is not comparable then)."""
    values = []
    for _ in range(rounds):
        assert step(sched, sims) is not None
        estimate = sched.estimate()
        values.append(math.inf if estimate.unknown_tasks else estimate.objective)
    return values


FOUR = [
    SimTask(weight=1, start=1 * MS, floor=0.2 * MS, tau=4),
    SimTask(weight=2, start=2 * MS, floor=0.5 * MS, tau=4),
    SimTask(weight=1, start=0.5 * MS, floor=0.4 * MS, tau=2),
    SimTask(weight=3, start=1 * MS, floor=0.3 * MS, tau=6),
]

# --- conformance: every strategy -------------------------------------------------------------

strategies = pytest.mark.parametrize("strategy", sorted(STRATEGIES))


@strategies
def test_first_pass_gives_every_task_a_round(strategy):
    sched = make_scheduler(strategy, infos(FOUR))
    first = [step(sched, FOUR) for _ in FOUR]
    assert sorted(first) == [0, 1, 2, 3]
    if strategy == "gradient":
        assert {d.reason for d in sched.decisions} == {DecisionReason.WARM_UP}
    assert [s.rounds for s in sched.states] == [1, 1, 1, 1]
    assert [s.trials for s in sched.states] == [TRIALS] * 4


@strategies
def test_bookkeeping_of_a_task(strategy):
    sched = make_scheduler(strategy, infos(FOUR[:1]))
    for latency in (3 * MS, 2 * MS, 2.5 * MS):  # a worse round keeps the best
        sched.on_round_done(sched.next_task(), best_latency=latency, trials=10, new_candidates=True)
    state = sched.states[0]
    assert state.alive and state.dead_reason is None
    assert (state.rounds, state.trials, state.in_flight) == (3, 30, 0)
    assert state.history == (3 * MS, 2 * MS, 2 * MS)
    assert state.best == 2 * MS and state.trials_since_improvement == 10
    assert [d.round for d in sched.decisions] == [0, 1, 2]


@strategies
def test_task_without_valid_schedule_after_warm_up_is_dead_and_skipped(strategy):
    sched = make_scheduler(strategy, infos(FOUR))
    for _ in FOUR:
        task = sched.next_task()
        finish(sched, task, FOUR, **({"best_latency": math.inf} if task == 1 else {}))
    assert sched.states[1].dead_reason == DeadReason.NO_VALID_SCHEDULE
    assert 1 not in [step(sched, FOUR) for _ in range(30)]
    assert sched.estimate().unknown_tasks == (1,)


@strategies
def test_exhausted_task_is_dead(strategy):
    sched = make_scheduler(strategy, infos(FOUR))
    for _ in FOUR:
        task = sched.next_task()
        finish(sched, task, FOUR, new_candidates=task != 2)
    assert sched.states[2].dead_reason == DeadReason.EXHAUSTED
    assert 2 not in [step(sched, FOUR) for _ in range(30)]


@strategies
def test_early_stopping_kills_a_stalled_task(strategy):
    config = TaskSchedulerConfig(per_task_early_stopping=3 * TRIALS, eps_greedy=0)
    sched = make_scheduler(strategy, infos(FOUR), config=config)
    for _ in range(40):
        task = sched.next_task()
        if task == 0:  # stalls after its first round
            sched.on_round_done(0, best_latency=FOUR[0].start, trials=TRIALS, new_candidates=True)
        else:
            finish(sched, task, FOUR)
    state = sched.states[0]
    assert state.dead_reason == DeadReason.EARLY_STOPPED
    assert state.rounds == 4 and state.trials_since_improvement == 3 * TRIALS
    assert all(s.alive for s in sched.states[1:])


@strategies
def test_all_dead_gives_none_and_late_rounds_are_still_ingested(strategy):
    sched = make_scheduler(strategy, infos(FOUR[:2]))
    in_flight = sched.next_task()
    sched.mark_dead(0, "cannot build")
    sched.mark_dead(0, "second reason is ignored")
    assert sched.next_task() == 1
    finish(sched, 1, FOUR, new_candidates=False)
    assert sched.next_task() is None
    finish(sched, in_flight, FOUR)  # the round handed out before mark_dead
    assert sched.states[0].dead_reason == "cannot build" and sched.states[0].rounds == 1
    assert sched.next_task() is None


@strategies
def test_rejects_rounds_never_handed_out_and_bad_latencies(strategy):
    sched = make_scheduler(strategy, infos(FOUR))
    with pytest.raises(ValueError, match="no round in flight"):
        sched.on_round_done(0, best_latency=MS, trials=1, new_candidates=True)
    task = sched.next_task()
    for bad in (math.nan, 0.0, -1.0):
        with pytest.raises(ValueError, match="best_latency"):
            sched.on_round_done(task, best_latency=bad, trials=1, new_candidates=True)
    with pytest.raises(ValueError, match="no task"):
        sched.mark_dead(9, "x")


@strategies
def test_several_rounds_in_flight(strategy):
    sched = make_scheduler(strategy, infos(FOUR))
    issued = [sched.next_task() for _ in range(10)]  # nothing comes back yet
    assert None not in issued and set(issued) == {0, 1, 2, 3}
    assert max(Counter(issued).values()) - min(Counter(issued).values()) <= 1  # spread, in turn
    assert sum(s.in_flight for s in sched.states) == 10
    for task in reversed(issued):  # results come back in any order
        finish(sched, task, FOUR)
    assert sum(s.in_flight for s in sched.states) == 0
    assert sum(s.rounds for s in sched.states) == 10
    more = [sched.next_task() for _ in range(8)]
    assert None not in more
    for task in more:
        finish(sched, task, FOUR)


@strategies
def test_latency_targets(strategy):
    # Model "small" uses tasks 0 and 1, model "big" tasks 1 and 2: task 1 is shared.
    tasks = [
        TaskInfo("a", 1e9, {"small": 1}),
        TaskInfo("shared", 1e9, {"small": 1, "big": 1}),
        TaskInfo("b", 1e9, {"big": 4}),
    ]
    sims = [SimTask(1, 1 * MS, 0.1 * MS, 3), SimTask(1, 1 * MS, 0.1 * MS, 3), SimTask(4, 5 * MS, 1 * MS, 3)]
    config = TaskSchedulerConfig(eps_greedy=0)
    sched = make_scheduler(strategy, tasks, config=config, targets={"small": 1.5 * MS, "big": 1e-9})
    for _ in range(3):
        step(sched, sims)
    for _ in range(60):
        step(sched, sims)
        if "small" in sched.estimate().at_target:
            break
    assert sched.estimate().at_target == {"small"}
    state = sched.states
    assert state[0].at_target and not state[1].at_target and not state[2].at_target
    later = [step(sched, sims) for _ in range(40)]
    assert 0 not in later  # the model at target gives its own task no more time
    assert 1 in later  # the shared task still serves the model above target
    assert sched.states[0].alive  # not dead, just not wanted


@strategies
def test_all_models_at_target_gives_none(strategy):
    sched = make_scheduler(strategy, infos(FOUR[:2]), targets={"net": 1.0})
    step(sched, FOUR)
    assert sched.estimate().at_target == frozenset()  # task 1 is unknown yet: not at target
    step(sched, FOUR)
    assert sched.estimate().at_target == {"net"}
    assert sched.next_task() is None


# --- round robin -----------------------------------------------------------------------------


def test_round_robin_cycles_over_alive_tasks():
    sched = RoundRobinScheduler(infos(FOUR))
    assert [step(sched, FOUR) for _ in range(6)] == [0, 1, 2, 3, 0, 1]
    sched.mark_dead(2, "gone")
    assert [step(sched, FOUR) for _ in range(5)] == [3, 0, 1, 3, 0]
    assert {d.reason for d in sched.decisions} == {DecisionReason.ROUND_ROBIN}


# --- objective -------------------------------------------------------------------------------


def test_objective_counts_measured_tasks_and_lists_unknown_ones():
    tasks = [
        TaskInfo("a", 1.0, {"m1": 2}),
        TaskInfo("b", 1.0, {"m1": 1, "m2": 3}),
        TaskInfo("c", 1.0, {"m2": 1}),
        TaskInfo("unused", 1.0, {}),
    ]
    objective = Objective(tasks, targets={"m1": 10.0})
    est = objective.estimate([1.0, 2.0, math.inf, math.inf])
    assert dict(est.per_model) == {"m1": 4.0, "m2": 6.0}
    assert est.total == 10.0 and est.objective == 10.0 + 6.0  # max(4, 10) + 6
    assert est.unknown_tasks == (2,) and est.at_target == {"m1"}
    assert objective.chain_gradient([1.0, 2.0, math.inf, math.inf]) == [0.0, 3.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="unknown model"):
        Objective(tasks, targets={"nope": 1.0})


def test_a_group_of_alternatives_counts_once_at_its_fastest():
    # "conv" computed directly (0) or by Winograd (1), and a task of its own (2)
    tasks = [
        TaskInfo("conv", 1.0, {"m": 2}, group="conv"),
        TaskInfo("conv+winograd", 1.0, {"m": 2}, group="conv"),
        TaskInfo("add", 1.0, {"m": 1}),
    ]
    objective = Objective(tasks)
    assert objective.estimate([3.0, 2.0, 1.0]).per_model == {"m": 2 * 2.0 + 1.0}
    assert objective.estimate([3.0, math.inf, 1.0]).per_model == {"m": 2 * 3.0 + 1.0}
    # one member measured: the group is known
    assert objective.estimate([math.inf, 2.0, 1.0]).unknown_tasks == ()
    assert objective.estimate([math.inf, math.inf, 1.0]).unknown_tasks == (0, 1)
    with pytest.raises(ValueError, match="equal weights"):
        Objective([TaskInfo("a", 1.0, {"m": 1}, group="g"), TaskInfo("b", 1.0, {"m": 2}, group="g")])


def test_an_alternative_is_worth_a_round_only_where_it_could_beat_its_group():
    config = TaskSchedulerConfig(alpha=0.2, backward_window=3)
    kwargs = {"chain": 1.0, "rounds": 2, "flops": 0.0, "best_similar_speed": None, "config": config}
    alone = task_gradient(history=[4.0, 4.0], **kwargs)  # forward −g/t = −2: Δg = 0.8·−2
    assert alone == pytest.approx(-1.6)
    # the fastest of its group: the group gains what the task gains
    assert task_gradient(history=[4.0, 4.0], best_of_alternatives=5.0, **kwargs) == pytest.approx(-1.6)
    # 4 −1.6 = 2.4 would beat an alternative at 3 by 0.6
    assert task_gradient(history=[4.0, 4.0], best_of_alternatives=3.0, **kwargs) == pytest.approx(-0.6)
    # an alternative at 1 is out of its reach: no gain
    assert task_gradient(history=[4.0, 4.0], best_of_alternatives=1.0, **kwargs) == 0.0


def test_the_slower_alternative_stops_getting_rounds():
    # Winograd (1) reaches a quarter of the direct convolution's (0) floor: once that shows, the
    # direct one is out of reach and its rounds stop, while a task of its own (2) keeps its share.
    sims = [
        SimTask(weight=1, start=4 * MS, floor=3 * MS, tau=2),
        SimTask(weight=1, start=2 * MS, floor=0.75 * MS, tau=6),
        SimTask(weight=1, start=2 * MS, floor=0.5 * MS, tau=6),
    ]
    tasks = [
        TaskInfo("conv", 1e9, {"net": 1}, group="conv"),
        TaskInfo("conv+winograd", 1e9, {"net": 1}, group="conv"),
        TaskInfo("other", 1e9, {"net": 1}),
    ]
    sched = GradientScheduler(tasks, config=TaskSchedulerConfig(eps_greedy=0))
    run(sched, sims, 30)
    rounds = [s.rounds for s in sched.states]
    assert rounds[0] <= 2 and rounds[1] > 5 and rounds[2] > 5, rounds
    est = sched.estimate()
    assert est.per_model["net"] == pytest.approx(sched.states[1].best + sched.states[2].best)


def test_the_models_own_tasks_warm_up_before_their_alternatives():
    tasks = [
        TaskInfo("conv", 1e9, {"net": 1}, group="conv"),
        TaskInfo("conv+winograd2", 1e9, {"net": 1}, group="conv"),
        TaskInfo("conv+winograd4", 1e9, {"net": 1}, group="conv"),
        TaskInfo("add", 1e9, {"net": 1}),
    ]
    sched = GradientScheduler(tasks, config=TaskSchedulerConfig(eps_greedy=0))
    order = []
    for _ in range(4):
        order.append(sched.next_task())
        sched.on_round_done(order[-1], best_latency=1 * MS, trials=TRIALS, new_candidates=True)
    assert order == [0, 3, 1, 2]
    assert {d.reason for d in sched.decisions} == {DecisionReason.WARM_UP}


def test_similarity_tag_and_factory():
    assert similarity_tag("conv2d", 1e9) == similarity_tag("conv2d", 1.3e9) != similarity_tag("conv2d", 3e9)
    assert similarity_tag("", 1e9) == ""
    assert isinstance(make_scheduler("gradient", infos(FOUR)), GradientScheduler)
    with pytest.raises(ValueError, match="unknown task-scheduler strategy"):
        make_scheduler("greedy", infos(FOUR))
    with pytest.raises(ValueError):
        TaskSchedulerConfig(eps_greedy=1.5)


# --- the gradient ----------------------------------------------------------------------------


def test_gradient_terms_by_hand():
    config = TaskSchedulerConfig(alpha=0.2, beta=2.0, backward_window=3)
    history = [8.0, 6.0, 5.0, 4.5, 4.0]
    assert backward_slope(history, 3) == pytest.approx((4.0 - 6.0) / 3)
    assert backward_slope(history[:3], 3) == 0.0  # too short
    assert backward_slope([math.inf, 6.0, 5.0, 4.0], 3) == 0.0  # first valid inside the window
    # optimistic term alone: −g/t
    assert forward_gain(4.0, 5, flops=100.0, best_similar_speed=None, beta=2.0) == pytest.approx(-0.8)
    # a similar task runs at 100 FLOP/s: at half that speed 100 FLOPs take 2 s, a gain of −2
    assert forward_gain(4.0, 5, flops=100.0, best_similar_speed=100.0, beta=2.0) == pytest.approx(-2.0)
    # zero FLOPs or no similar speed: the similarity term is skipped
    assert forward_gain(4.0, 5, flops=0.0, best_similar_speed=100.0, beta=2.0) == pytest.approx(-0.8)
    grad = task_gradient(
        chain=3.0, history=history, rounds=5, flops=100.0, best_similar_speed=100.0, config=config
    )
    assert grad == pytest.approx(3.0 * (0.2 * (-2.0 / 3) + 0.8 * -2.0))


def test_similar_fast_task_pulls_a_slow_one():
    # Same FLOPs; task 1 runs 4x faster, and neither improves any more. With one tag, task 0 is
    # expected to reach half of task 1's speed, so it keeps getting rounds; without, it does not.
    def counts(tag: str) -> tuple[Counter, GradientScheduler]:
        tasks = [TaskInfo(f"t{i}", 1e9, {"net": 1}, tag) for i in range(2)]
        # (dissimilar_after off: here the pull itself is under test)
        sched = GradientScheduler(tasks, config=TaskSchedulerConfig(eps_greedy=0, dissimilar_after=100))
        for _ in range(8):
            task = sched.next_task()
            sched.on_round_done(task, best_latency=(4 * MS, 1 * MS)[task], trials=TRIALS, new_candidates=True)
        return Counter(d.task for d in sched.decisions), sched

    similar, sched = counts(similarity_tag("dense", 1e9))
    alone, _ = counts("")
    assert similar[0] > alone[0]
    assert sched.states[0].rounds >= 2
    # forward = min(−g/t, β·C/V − g) with β·C/V = 2 · 1e9 / (1e9 / 1 ms) = 2 ms; backward 0
    assert sched.gradients([0])[0] == pytest.approx(0.8 * (2 * MS - 4 * MS))


def test_heavy_far_task_gets_more_rounds_than_light_converged_one():
    sims = [
        SimTask(weight=8, start=4 * MS, floor=0.5 * MS, tau=10),  # heavy, far from its floor
        SimTask(weight=1, start=0.3 * MS, floor=0.3 * MS, tau=1),  # light, converged
    ]
    sched = GradientScheduler(infos(sims))
    run(sched, sims, 40)
    rounds = [s.rounds for s in sched.states]
    assert rounds[0] > 3 * rounds[1], rounds
    picks = [d for d in sched.decisions if d.reason == DecisionReason.GRADIENT]
    assert picks and all(d.gradient == min(d.gradients.values()) for d in picks)
    assert all(d.gradient <= 0 for d in picks)


def test_epsilon_greedy_rate_and_record():
    config = TaskSchedulerConfig(eps_greedy=0.2, seed=7)
    sched = GradientScheduler(infos(FOUR), config=config)
    run(sched, FOUR, 1500)
    after_warm_up = sched.decisions[len(FOUR) :]
    eps = [d for d in after_warm_up if d.reason == DecisionReason.EPSILON]
    assert 0.16 < len(eps) / len(after_warm_up) < 0.24
    assert len({d.task for d in eps}) == len(FOUR)  # uniform over the tasks
    assert all(d.gradients is not None and d.gradient == d.gradients[d.task] for d in eps)
    # no epsilon at all when it is 0
    quiet = GradientScheduler(infos(FOUR), config=TaskSchedulerConfig(eps_greedy=0))
    run(quiet, FOUR, 100)
    assert DecisionReason.EPSILON not in {d.reason for d in quiet.decisions}


def test_ties_are_broken_by_the_seeded_rng():
    twins = [SimTask(weight=1, start=1 * MS, floor=0.5 * MS, tau=5)] * 3

    def picks(seed: int) -> list[int]:
        sched = GradientScheduler(infos(twins), config=TaskSchedulerConfig(eps_greedy=0, seed=seed))
        for _ in range(3):  # warm-up; nothing comes back, so the estimates stay equal
            sched.next_task()
        for task in range(3):
            finish(sched, task, twins)
        return [step(sched, twins) for _ in range(12)]

    assert picks(1) == picks(1)
    assert len({tuple(picks(seed)[:1]) for seed in range(20)}) > 1  # the first tie is random


def test_rounds_in_flight_count_as_time_spent():
    sims = [
        SimTask(weight=2, start=2 * MS, floor=1 * MS, tau=10),
        SimTask(weight=1, start=1.5 * MS, floor=0.5 * MS, tau=10),
    ]
    sched = GradientScheduler(infos(sims), config=TaskSchedulerConfig(eps_greedy=0))
    run(sched, sims, 2)
    issued = [sched.next_task() for _ in range(6)]  # a farm with six free slots
    # The heavier task gets most, not all: its −g/t shrinks with every round handed out.
    assert issued.count(0) > issued.count(1) > 0


def test_gradient_reaches_round_robin_objective_in_fewer_rounds(capsys):
    # Tasks differ in weight and in how much they can still gain.
    sims = [
        SimTask(weight=12, start=3.0 * MS, floor=0.4 * MS, tau=8),  # heavy, far from its floor
        SimTask(weight=6, start=2.0 * MS, floor=0.8 * MS, tau=5),
        SimTask(weight=1, start=0.3 * MS, floor=0.28 * MS, tau=2),  # light, nearly converged
        SimTask(weight=2, start=0.5 * MS, floor=0.45 * MS, tau=2),
        SimTask(weight=1, start=1.0 * MS, floor=0.3 * MS, tau=6),
        SimTask(weight=3, start=0.2 * MS, floor=0.19 * MS, tau=1),
        SimTask(weight=1, start=0.1 * MS, floor=0.05 * MS, tau=4),
        SimTask(weight=2, start=1.0 * MS, floor=0.6 * MS, tau=3),
    ]
    budget = 15 * len(sims)
    target = run(RoundRobinScheduler(infos(sims)), sims, budget)[-1]
    values = run(GradientScheduler(infos(sims)), sims, budget)
    needed = next(r + 1 for r, v in enumerate(values) if v <= target)
    ratio = needed / budget
    with capsys.disabled():
        print(f"\ngradient reached round-robin's objective after {needed}/{budget} rounds ({ratio:.2f})")
    assert ratio <= 0.8


# --- never NaN, never a dead task ------------------------------------------------------------

task_infos = st.lists(
    st.builds(
        TaskInfo,
        key=st.just("t"),
        flops=st.sampled_from([0.0, 1.0, 1e9]),
        weights=st.dictionaries(st.sampled_from(["m1", "m2"]), st.integers(0, 3), max_size=2),
        similarity_tag=st.sampled_from(["", "x_1"]),
    ),
    min_size=1,
    max_size=5,
)
events = st.lists(
    st.tuples(
        st.sampled_from(["next", "done", "dead"]),
        st.integers(0, 10),
        st.sampled_from([math.inf, 1e-9, 1e-3, 1.0]),
        st.integers(0, 3),
        st.booleans(),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tasks=task_infos,
    events=events,
    strategy=st.sampled_from(sorted(STRATEGIES)),
    eps=st.sampled_from([0, 0.5]),
    invalid_rounds=st.sampled_from([1, 2]),
)
def test_never_nan_never_a_dead_task(tasks, events, strategy, eps, invalid_rounds):
    config = TaskSchedulerConfig(eps_greedy=eps, per_task_early_stopping=4, rounds_without_valid=invalid_rounds)
    sched = make_scheduler(
        strategy,
        tasks,
        config=config,
        targets={"m1": 1e-3} if any("m1" in t.weights for t in tasks) else None,
    )
    for kind, pick, latency, trials, fresh in events:
        if kind == "next":
            task = sched.next_task()
            states = sched.states
            wanted = [i for i, s in enumerate(states) if s.alive and not s.at_target]
            if task is None:
                assert not wanted
                continue
            assert task in wanted
            decision = sched.decisions[-1]
            for g in (decision.gradients or {}).values():
                assert math.isfinite(g) and g <= 0
        elif kind == "done":
            flying = [i for i, s in enumerate(sched.states) if s.in_flight]
            if flying:
                sched.on_round_done(
                    flying[pick % len(flying)], best_latency=latency, trials=trials, new_candidates=fresh
                )
        else:
            sched.mark_dead(pick % len(tasks), "test")
        est = sched.estimate()
        assert not math.isnan(est.total) and not math.isnan(est.objective)


def test_a_task_that_never_runs_like_its_similar_tasks_leaves_their_group():
    """A one-channel head tagged like a fast convolution: the tag promises it half the
    convolution's speed, a gain per round that never shrinks. Once it has had more than
    `dissimilar_after` rounds beyond the convolution's and still runs below 1/beta of its
    speed, the promise is dropped, and the rounds go to the heavy task that still improves
    (the head took 237 of 1000 trials of a detector before)."""
    tag = similarity_tag("SSSSRRR", 2e6)
    tasks = [
        TaskInfo("head", 2e6, {"net": 1}, tag),
        TaskInfo("conv", 2e6, {"net": 1}, tag),
        TaskInfo("heavy", 1e9, {"net": 1}),
    ]

    def run_with(dissimilar_after: int) -> GradientScheduler:
        config = TaskSchedulerConfig(eps_greedy=0, dissimilar_after=dissimilar_after)
        sched = GradientScheduler(tasks, config=config)
        for _ in range(60):
            task = sched.next_task()
            rounds = sched.states[task].rounds + 1
            # the head is stuck at 1 ms (2 GFLOPS), the convolution at 50 us (40 GFLOPS); the
            # heavy task improves slowly from 10 ms
            best = (1 * MS, 0.05 * MS, 10 * MS * (1 - 0.005 * rounds))[task]
            sched.on_round_done(task, best_latency=best, trials=TRIALS, new_candidates=True)
        return sched

    sched = run_with(5)
    assert sched.dissimilar == {0}
    head, conv, heavy = (s.rounds for s in sched.states)
    assert head <= conv + 5 + 1  # the rule's margin and the round that tripped it
    assert heavy > 3 * head
    never = run_with(10**6)  # the rule off: the promise holds for the whole run
    assert never.dissimilar == set() and never.states[0].rounds > 2 * head
    # the evicted head's forward term is −g/t alone: no similar speed (backward 0: it is stuck)
    book = sched.states[0]
    assert sched.gradients([0])[0] == pytest.approx(0.8 * (-book.best / book.rounds))


def test_is_dissimilar_by_hand():
    from tunefarm.search.task_scheduler.gradient import is_dissimilar

    members = {0: (10.0, 12), 1: (100.0, 6)}
    assert is_dissimilar(0, members, beta=2.0, extra_rounds=5)  # 12 > 5 + 6, 10 < 100 / 2
    assert not is_dissimilar(0, {0: (10.0, 11), 1: (100.0, 6)}, beta=2.0, extra_rounds=5)  # not enough rounds yet
    assert not is_dissimilar(0, {0: (60.0, 12), 1: (100.0, 6)}, beta=2.0, extra_rounds=5)  # at 60%: similar enough
    assert not is_dissimilar(1, members, beta=2.0, extra_rounds=5)  # the fast one never leaves
    assert not is_dissimilar(0, {0: (10.0, 12)}, beta=2.0, extra_rounds=5)  # alone: nothing to compare
