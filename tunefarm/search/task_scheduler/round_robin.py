"""Round-robin task scheduling: the baseline Ansor's gradient scheduler is compared with (§6)."""

from __future__ import annotations

from .base import Decision, DecisionReason, TaskScheduler


class RoundRobinScheduler(TaskScheduler):
    """Cycles over the tasks that still want time (alive, not at target), in task order.

    Rounds in flight do not matter: the turn passes on as soon as a round is handed out.
    """

    _last: int = -1  # task of the previous decision

    def _choose(self, candidates: list[int], round_index: int) -> Decision:
        task = next((i for i in candidates if i > self._last), candidates[0])
        self._last = task
        return Decision(round=round_index, task=task, reason=DecisionReason.ROUND_ROBIN)
