"""Write tunefarm records as a TVM MetaSchedule JSON database.

`database_workload.json` gets each task's workload, `database_tuning_record.json` each
valid measurement (its TVM trace, costs, target and argument info), so TVM users can
apply our schedules with MetaSchedule's own tools (`ApplyDatabase`,
`Database.query_ir_module`, `tir_integration.compile_tir`).
"""

from __future__ import annotations

from pathlib import Path

from tunefarm import wmma
from tunefarm.errors import RecordError
from tunefarm.store import JsonlRecordStore


def export_metaschedule(records_path: str | Path, out_dir: str | Path) -> tuple[int, Path]:
    import tvm
    from tvm.s_tir import Schedule, Trace
    from tvm.s_tir import meta_schedule as ms

    path = Path(records_path)
    if not path.exists():
        raise RecordError(f"no such records file: {path}")
    store = JsonlRecordStore(path)
    records = [r for r in store.load() if r.is_valid]
    if not records:
        raise RecordError(f"{path} holds no valid measurement to export")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)  # JSONDatabase needs the directory to exist
    db = ms.database.JSONDatabase(work_dir=str(out))
    n = 0
    for task in sorted({r.task for r in records}):
        stored = store.get_workload(task)
        if stored is None:
            raise RecordError(f"{store.workloads_path} lacks the workload of task {task}")
        mod = tvm.ir.load_json(stored[1])
        workload = db.commit_workload(mod)
        args_info = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
        for r in (x for x in records if x.task == task):
            sch = Schedule(mod)
            if wmma.uses_wmma(r.trace):
                wmma.register()
            Trace.apply_json_to_schedule(r.trace, sch)
            db.commit_tuning_record(
                ms.database.TuningRecord(
                    sch.trace,
                    workload,
                    run_secs=[float(c) for c in r.costs],
                    target=tvm.target.Target(r.target),
                    args_info=args_info,
                )
            )
            n += 1
    return n, out
