"""A job's task rows as the API shows them: one row per task of the model.

A task the scheduler also tunes by other algorithms (a 3x3 convolution by Winograd on a
CPU class: job task rows with `alternative_of`, `services.db.models.JobTask`) is still one
row, counted once: its trials are its programs' together, its best the fastest of them
(`algorithm` says whose: "direct" for the task's own), and `alternatives` lists each
program with its own numbers, the task's own first. So trials add up to the job's, and a
client that sums the rows' weighted bests, or counts the tasks without one, counts each
task once, as the search's estimate does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.api.schemas import JobTaskAlternativePublic, JobTaskPublic
from tunefarm.models.alternatives import DIRECT, algorithm_of


def job_task_rows(rows: Sequence[Sequence[Any]]) -> list[JobTaskPublic]:
    """The rows of `jobs.JobOverview.tasks` (position, name, key, weight, trials, best,
    dead reason, best emulated, best confirmed, confirmed best, the position of the task
    a row is an alternative of) as the job's task rows, by position."""
    alternatives: dict[int, list[Sequence[Any]]] = {}
    for r in rows:
        if r[10] is not None:
            alternatives.setdefault(r[10], []).append(r)
    return [_task_row(r, alternatives.get(r[0], [])) for r in rows if r[10] is None]


def _task_row(task: Sequence[Any], others: Sequence[Sequence[Any]]) -> JobTaskPublic:
    position, name, key, weight = task[0], task[1], task[2], task[3]
    if not others:
        return JobTaskPublic(
            position=position, name=name, key=key, weight=weight, trials=task[4], best_secs=task[5],
            dead_reason=task[6], best_emulated=task[7], best_confirmed=task[8], confirmed_best_secs=task[9],
        )  # fmt: skip
    members = [_member(name, r) for r in (task, *others)]
    measured = [m for m in members if m.best_secs is not None]
    lead = min(measured, key=lambda m: m.best_secs) if measured else members[0]  # the task's own on a tie
    confirmed = [m.confirmed_best_secs for m in members if m.confirmed_best_secs is not None]
    return JobTaskPublic(
        position=position,
        name=name,
        key=key,
        weight=weight,
        trials=sum(m.trials for m in members),
        best_secs=lead.best_secs,
        best_emulated=lead.best_emulated,
        best_confirmed=lead.best_confirmed,
        confirmed_best_secs=min(confirmed) if confirmed else None,
        dead_reason=task[6] if all(m.dead_reason for m in members) else None,  # stopped once all are
        algorithm=lead.algorithm if measured else DIRECT,
        alternatives=members,
    )


def _member(task_name: str, r: Sequence[Any]) -> JobTaskAlternativePublic:
    return JobTaskAlternativePublic(
        algorithm=algorithm_of(task_name, r[1]), position=r[0], name=r[1], key=r[2], trials=r[4], best_secs=r[5],
        dead_reason=r[6], best_emulated=r[7], best_confirmed=r[8], confirmed_best_secs=r[9],
    )  # fmt: skip
