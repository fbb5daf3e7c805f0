"""The models teams upload: `store_model` (a taken-in model, its task table and its
workloads), `get_model`, `list_models`, `model_tasks` (what a job on it tunes).

Every read takes the team: another team's model is not found, exactly like one that does
not exist (None). Every function works inside the caller's transaction and commits
nothing itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from services.db.model_runs import StoredFile
from services.db.models import Model, ModelTask, WorkloadRow

TASK_TABLE_COLUMNS = ("position", "name", "key", "shapes", "weight", "flops", "share")
"""What a model's task table (`Model.task_table`, for display) keeps of each task."""


def store_model(
    session: Session,
    *,
    team_id: int,
    name: str,
    input_shapes: dict[str, list[int]],
    onnx: StoredFile,
    fused: StoredFile,
    intake: dict[str, Any],
) -> Model:
    """Insert a taken-in model (`intake`: its tasks, inputs, outputs and warnings), its
    task table and its workloads (shared by key with every other model that has them)."""
    tasks = intake["tasks"]
    workload_ids = _store_workloads(session, tasks)
    model = Model(
        team_id=team_id,
        name=name,
        input_shapes=input_shapes,
        onnx_path=onnx.path,
        onnx_sha256=onnx.sha256,
        onnx_size=onnx.size,
        fused_path=fused.path,
        fused_sha256=fused.sha256,
        fused_size=fused.size,
        task_table=[{k: t[k] for k in TASK_TABLE_COLUMNS} for t in tasks],
        inputs=intake["inputs"],
        outputs=intake["outputs"],
        warnings=intake["warnings"],
    )
    session.add(model)
    session.flush()
    session.add_all(
        ModelTask(
            model_id=model.id,
            workload_id=workload_ids[t["key"]],
            position=t["position"],
            weight=t["weight"],
            const_inputs=t["const_inputs"],
            global_vars=t["global_vars"],
        )
        for t in tasks
    )
    session.flush()
    session.refresh(model)
    return model


def store_variant_tasks(session: Session, tasks: Sequence[dict[str, Any]]) -> list[StoredTask]:
    """The tasks of a model converted for a job (an intake's task entries: another
    precision's), their workloads inserted unless stored already, as a job takes them."""
    ids = _store_workloads(session, tasks)
    return [StoredTask(ids[t["key"]], t["key"], t["position"], t["weight"]) for t in tasks]


def _store_workloads(session: Session, tasks: Sequence[dict[str, Any]]) -> dict[str, int]:
    """The workloads of `tasks`, inserted unless stored already (by key); their ids by key."""
    for t in tasks:
        session.execute(
            pg_insert(WorkloadRow)
            .values(
                key=t["key"],
                name=t["name"],
                module_json=t["module_json"],
                flops=t["flops"],
                n_inputs=t["n_inputs"],
                n_outputs=t["n_outputs"],
            )
            .on_conflict_do_nothing(index_elements=[WorkloadRow.key])
        )
    keys = [t["key"] for t in tasks]
    return {key: wid for key, wid in session.execute(select(WorkloadRow.key, WorkloadRow.id).where(WorkloadRow.key.in_(keys)))}


def get_model(session: Session, *, team_id: int, model_id: int) -> Model | None:
    """The team's model (None: none of the team's)."""
    return session.scalars(select(Model).where(Model.id == model_id, Model.team_id == team_id)).one_or_none()


def list_models(session: Session, *, team_id: int, limit: int, cursor: int | None) -> tuple[list[Model], int | None]:
    """A page of the team's models, newest first (ids below `cursor`), and the cursor of
    the next page (None: the last)."""
    query = select(Model).where(Model.team_id == team_id)
    if cursor is not None:
        query = query.where(Model.id < cursor)
    rows = list(session.scalars(query.order_by(Model.id.desc()).limit(limit + 1)))
    return rows[:limit], (rows[limit - 1].id if len(rows) > limit else None)


@dataclass(frozen=True)
class StoredTask:
    """A task of a stored model: its workload (id and key), position and weight."""

    workload_id: int
    key: str
    position: int
    weight: int


def model_tasks(session: Session, *, model_id: int) -> list[StoredTask]:
    """The model's tasks, by position."""
    rows = session.execute(
        select(ModelTask.workload_id, WorkloadRow.key, ModelTask.position, ModelTask.weight)
        .join(WorkloadRow, WorkloadRow.id == ModelTask.workload_id)
        .where(ModelTask.model_id == model_id)
        .order_by(ModelTask.position)
    ).all()
    return [StoredTask(workload_id=r.workload_id, key=r.key, position=r.position, weight=r.weight) for r in rows]
