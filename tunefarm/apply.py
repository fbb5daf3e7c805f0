"""`apply-best`: rebuild the best measured kernel of a records file, without search.

The record's TVM trace is replayed on the workload stored beside the records, compiled
for the record's target and exported with TVM's `export_library`: the library's function
`main` takes the workload's tensors in order, inputs first, then outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tunefarm.errors import RecordError
from tunefarm.isolation import IsolatedWorker
from tunefarm.records import MeasureRecord
from tunefarm.store import JsonlRecordStore


@dataclass(frozen=True)
class BestKernel:
    record: MeasureRecord
    workload_name: str
    workload_json: str


def find_best(records_path: str | Path, workload: str | None = None) -> BestKernel:
    path = Path(records_path)
    if not path.exists():
        raise RecordError(f"no such records file: {path}")
    store = JsonlRecordStore(path)
    records = store.load()
    if not records:
        extra = f" ({store.skipped_lines} unreadable lines)" if store.skipped_lines else ""
        raise RecordError(f"{path} holds no records{extra}")
    if workload is not None:
        records = [r for r in records if r.workload == workload or r.task == workload]
        if not records:
            raise RecordError(f"{path} has no records of workload {workload!r}")
    tasks = sorted({r.task for r in records})
    if len(tasks) > 1:
        names = ", ".join(sorted({r.workload for r in records}))
        raise RecordError(f"{path} holds several workloads ({names}); choose one with --workload")
    valid = [r for r in records if r.is_valid]
    if not valid:
        raise RecordError(f"{path}: none of the {len(records)} measurements of {records[0].workload} is valid")
    best = min(valid, key=lambda r: r.cost)
    stored = store.get_workload(best.task)
    if stored is None:
        raise RecordError(f"{store.workloads_path} is missing, or lacks the workload of task {best.task}")
    name, mod_json = stored
    return BestKernel(best, name, mod_json)


def build_best(best: BestKernel, out_path: str | Path, timeout: float = 600.0) -> Path:
    """Build in an isolated process (a crash in codegen cannot take the CLI down)."""
    import json

    out = Path(out_path).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with IsolatedWorker(preload=["tvm"], name="apply-best") as worker:
        outcome = worker.call(
            "services.worker.builder:build_module",
            best.workload_json,
            json.dumps(best.record.trace),
            best.record.target,
            str(out),
            timeout=timeout,
        )
    if not outcome.ok:
        raise RecordError(f"rebuilding the best kernel failed: {outcome.message}")
    return out
