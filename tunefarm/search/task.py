"""A search task: one workload on one target, with its DAG, sketches and program space."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from tunefarm.errors import WorkloadError
from tunefarm.records import MeasureRecord
from tunefarm.search.space.dag import ComputeDag, analyse
from tunefarm.search.space.program_space import ProgramSpace
from tunefarm.search.space.rule_set import RuleSet, rule_set_for
from tunefarm.search.space.sketch import Sketch
from tunefarm.workloads import Workload


def target_key(target: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(target, sort_keys=True).encode()).hexdigest()[:8]


def workload_of(task_key: str) -> str:
    """The workload part of a task key (`SearchTask.key`): the same for one workload on
    any target."""
    return task_key.rpartition("@")[0]


@dataclass(eq=False)
class SearchTask:
    workload: Workload
    target: dict[str, Any]
    dag: ComputeDag
    sketches: list[Sketch]
    rules: RuleSet

    @property
    def key(self) -> str:
        """Records match a task by this key: the workload's identity plus the target's."""
        return f"{self.workload.key}@{target_key(self.target)}"

    @cached_property
    def space(self) -> ProgramSpace:
        return ProgramSpace(self.dag, self.sketches, self.rules)

    def sketch_signature(self, index: int) -> str:
        return self.sketches[index].signature

    def record_features(self, records: Sequence[MeasureRecord]) -> list[np.ndarray]:
        """Feature matrices of measured programs of this task, in order (an empty matrix
        for a record of a sketch set that no longer exists), as the tuner computes them."""
        usable = [
            r for r in records if 0 <= r.sketch < len(self.sketches) and self.sketch_signature(r.sketch) == r.sketch_sig
        ]
        feats = dict(zip((r.candidate.key for r in usable), self.space.features_of([r.candidate for r in usable])))
        empty = np.zeros((0, 0), dtype=np.float32)
        return [feats.get(r.candidate.key, empty) for r in records]


def make_task(workload: Workload, target: dict[str, Any]) -> SearchTask:
    from tunefarm.search.space.dag import UnsupportedProgram

    try:
        dag = analyse(workload.mod["main"], workload.constants)
    except UnsupportedProgram as exc:
        raise WorkloadError(f"{workload.name}: {exc}") from None
    rules = rule_set_for(target)
    if dag.outside and rules.gpu_limits is not None:
        raise WorkloadError(
            f"{workload.name}: block {', '.join(dag.outside)} transforms a constant input once outside the kernel, "
            "which only CPU builds do so far"
        )
    sketches = rules.sketches(dag)
    if not sketches:
        raise WorkloadError(f"{workload.name}: no sketch could be derived")
    return SearchTask(workload, target, dag, sketches, rules)


def structure_kind(dag: ComputeDag) -> str:
    """The task's operator structure for the task scheduler's similarity groups (Ansor
    groups tasks by operator tag; we derive it from the DAG, never from a name): the
    iterator kinds of every block that needs multi-level tiling, or of the last block."""
    from tunefarm.search.space.dag import needs_multi_level_tiling

    tiled = [b for b in dag.blocks if needs_multi_level_tiling(b)] or [dag.blocks[-1]]
    return "+".join("".join(it.kind for it in b.iters) for b in tiled)
