"""Ansor's gradient-based task scheduler (Ansor paper, OSDI 2020, §6 and appendix A).

The next round goes to the task whose extra time is expected to lower the objective f (the
models' weighted latency, `Objective`) the fastest, i.e. the most negative ∂f/∂t_i, where t_i is
the time (rounds) spent on task i. The paper approximates it as

    ∂f/∂t_i ≈ ∂f/∂g_i · ( α·(g_i(t_i) − g_i(t_i − Δt))/Δt
                          + (1−α)·min( −g_i(t_i)/t_i, β·C_i / max_{k∈N(i)} V_k − g_i(t_i) ) )

with g_i the task's best latency, C_i its FLOPs, N(i) its similar tasks and V_k = C_k/g_k their
achieved speed. Around it, as in the paper: a round-robin warm-up so every task has a latency,
and epsilon-greedy picks of a random task (which TVM's code never had). As in TVM's code, a
task leaves its similarity group once it has had `TaskSchedulerConfig.dissimilar_after` rounds
more than every other member and still runs below 1/β of the group's best speed: the tag
(structure and FLOP count) said it was similar, its measurements say it is not.

Differences from TVM's implementation, on purpose:
- the objective's chain term comes from `Objective.chain_gradient` (exact for a weighted sum),
  not from a finite difference;
- tasks without a valid latency are never given a gradient: they are in warm-up, or dead after
  `TaskSchedulerConfig.rounds_without_valid` rounds (the bug TVM fixed in PR #16739);
- rounds in flight count as time already spent in the forward term (t_i), so that concurrent
  rounds spread over tasks instead of all going to the one whose estimate has not moved yet;
- alternatives of one computation (`TaskInfo.group`: a convolution direct or by Winograd) cost
  the model their minimum only, so a round is worth the predicted change of that minimum: a task
  counts only once its predicted latency could beat the best of its alternatives.

Map: `backward_slope` and `forward_gain` are the two halves of the bracket, `task_gradient`
puts the formula together, `is_dissimilar` is the eviction rule, `GradientScheduler._choose`
applies warm-up, epsilon and argmax.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from .base import Decision, DecisionReason, TaskInfo, TaskScheduler, TaskSchedulerConfig

TIE_TOLERANCE = 1e-12
"""Relative difference below which two gradients are a tie (broken by the seeded rng)."""


def backward_slope(history: Sequence[float], window: int) -> float:
    """(g_i(t_i) − g_i(t_i − Δt)) / Δt with Δt = ``window`` rounds: the observed gain per round.

    0 while the history has no point ``window`` rounds back, or when either point has no valid
    latency (the first valid measurement lies inside the window).
    """
    if len(history) <= window:
        return 0.0
    now, then = history[-1], history[-1 - window]
    if not (math.isfinite(now) and math.isfinite(then)):
        return 0.0
    return (now - then) / window


def forward_gain(
    best: float, rounds: int, *, flops: float, best_similar_speed: float | None, beta: float
) -> float:
    """min(−g_i/t_i, β·C_i / max_{k∈N(i)} V_k − g_i): the predicted gain of the next round.

    The first term assumes the gain so far continues at its average rate (optimistic: the task
    could reach 0 in as many rounds again); the second that the task can reach 1/β of the best
    speed among its similar tasks. ``best_similar_speed`` is None when no other similar task has
    a valid latency, and the second term is skipped then, as it is for a task of 0 FLOPs.
    """
    # optimistic guess: the average gain per round so far continues
    gain = -best / max(rounds, 1)
    if best_similar_speed is not None and best_similar_speed > 0 and flops > 0:
        # similarity: the latency at 1/β of the fastest similar task's FLOP/s
        gain = min(gain, beta * flops / best_similar_speed - best)
    return gain


def is_dissimilar(
    task: int, members: Mapping[int, tuple[float, int]], *, beta: float, extra_rounds: int
) -> bool:
    """Whether ``task`` has shown it is not like the rest of its similarity group: ``members``
    maps each member with a valid latency (``task`` included) to (speed in FLOP/s, rounds
    spent). True when the task runs below 1/β of the group's best speed although it has had
    more than ``extra_rounds`` rounds beyond every other member (Ansor's code: 5)."""
    others = [rounds for k, (_, rounds) in members.items() if k != task]
    if task not in members or not others:
        return False
    speed, rounds = members[task]
    best = max(s for s, _ in members.values())
    return speed < best / beta and rounds > extra_rounds + max(others)


def task_gradient(
    *,
    chain: float,
    history: Sequence[float],
    rounds: int,
    flops: float,
    best_similar_speed: float | None,
    config: TaskSchedulerConfig,
    best_of_alternatives: float = math.inf,
) -> float:
    """∂f/∂t_i of a task with a valid latency (``history[-1]`` finite); ≤ 0, never NaN.

    ``chain`` is ∂f/∂g_i from the objective, ``rounds`` the time t_i spent on the task (rounds
    ingested plus rounds in flight). ``best_of_alternatives``: the best latency of the other
    tasks of its group (`TaskInfo.group`); the model pays min(g_i, that), so a round of the task
    is worth what it is predicted to take off that minimum: nothing until g_i could fall below it.
    """
    backward = backward_slope(history, config.backward_window)
    forward = forward_gain(
        history[-1], rounds, flops=flops, best_similar_speed=best_similar_speed, beta=config.beta
    )
    # the predicted change of g_i in the next round: α·backward + (1−α)·forward
    change = config.alpha * backward + (1 - config.alpha) * forward
    now = history[-1]
    if math.isfinite(best_of_alternatives):
        change = min(now + change, best_of_alternatives) - min(now, best_of_alternatives)
    # chain rule: ∂f/∂g_i · Δg_i
    return chain * change


class GradientScheduler(TaskScheduler):
    """Ansor's scheduler: warm-up, then the largest |∂f/∂t_i|, with epsilon-greedy random picks."""

    def __init__(
        self,
        tasks: Sequence[TaskInfo],
        *,
        config: TaskSchedulerConfig | None = None,
        targets: Mapping[str, float] | None = None,
    ) -> None:
        super().__init__(tasks, config=config, targets=targets)
        self._rng = random.Random(self.config.seed)
        # Tasks that left their similarity group (`is_dissimilar`); for the rest of the run.
        self.dissimilar: set[int] = set()

    def _choose(self, candidates: list[int], round_index: int) -> Decision:
        books = self._books
        # Warm-up: a task without a valid latency gets rounds first, until it has one or its
        # `rounds_without_valid` rounds are handed out (with the default 1: one round-robin pass);
        # the models' own tasks (the first of each group) before any alternative of theirs.
        warm = [
            i for i in candidates
            if not math.isfinite(books[i].best) and books[i].issued < self.config.rounds_without_valid
        ]  # fmt: skip
        if warm:
            own = [i for i in warm if self.objective.groups[i][0] == i]
            return Decision(round=round_index, task=(own or warm)[0], reason=DecisionReason.WARM_UP)

        measured = [i for i in candidates if math.isfinite(books[i].best)]
        if not measured:
            # Every candidate's first rounds are still in flight: keep the farm busy, in turn.
            task = min(candidates, key=lambda i: (books[i].issued, i))
            return Decision(round=round_index, task=task, reason=DecisionReason.ROUND_ROBIN)

        gradients = self.gradients(measured)
        if self._rng.random() < self.config.eps_greedy:
            task = self._rng.choice(candidates)
            return Decision(
                round=round_index,
                task=task,
                reason=DecisionReason.EPSILON,
                gradient=gradients.get(task),
                gradients=gradients,
            )
        steepest = min(gradients.values())
        ties = [i for i, g in gradients.items() if g <= steepest + TIE_TOLERANCE * abs(steepest)]
        task = ties[0] if len(ties) == 1 else self._rng.choice(ties)
        return Decision(
            round=round_index,
            task=task,
            reason=DecisionReason.GRADIENT,
            gradient=gradients[task],
            gradients=gradients,
        )

    def gradients(self, tasks: Sequence[int]) -> dict[int, float]:
        """∂f/∂t_i of each of ``tasks``, which must all have a valid latency."""
        books, infos = self._books, self.tasks
        best = self._best()
        chain = self.objective.chain_gradient(best)
        speeds = self._similar_speeds()
        result = {}
        for i in tasks:
            similar = infos[i].similarity_tag and i not in self.dissimilar
            group = speeds.get(infos[i].similarity_tag, []) if similar else []
            has_other = any(k != i for k, _ in group)
            result[i] = task_gradient(
                chain=chain[i],
                history=books[i].history,
                rounds=books[i].issued,
                flops=infos[i].flops,
                best_similar_speed=max(v for _, v in group) if has_other else None,
                config=self.config,
                best_of_alternatives=min((best[k] for k in self.objective.groups[i] if k != i), default=math.inf),
            )
        return result

    def _similar_speeds(self) -> dict[str, list[tuple[int, float]]]:
        """V_k = C_k / g_k per similarity tag, over the tasks with a valid latency (dead or
        not), once the tasks that proved dissimilar have left their groups."""
        groups: dict[str, dict[int, tuple[float, int]]] = {}
        for k, (info, book) in enumerate(zip(self.tasks, self._books)):
            if info.similarity_tag and info.flops > 0 and math.isfinite(book.best) and k not in self.dissimilar:
                groups.setdefault(info.similarity_tag, {})[k] = (info.flops / book.best, book.issued)
        for members in groups.values():
            for k in sorted(members):
                if is_dissimilar(k, members, beta=self.config.beta, extra_rounds=self.config.dissimilar_after):
                    self.dissimilar.add(k)
        return {
            tag: [(k, speed) for k, (speed, _) in members.items() if k not in self.dissimilar]
            for tag, members in groups.items()
        }
