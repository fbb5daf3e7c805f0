"""`apply-best`: rebuild the best measured kernel of a records file, without search.

The record's TVM trace is replayed on the workload stored beside the records, compiled
for the record's target and exported with TVM's `export_library`: the library's function
`main` takes the workload's tensors in order, inputs first, then outputs. When the schedule
stores a constant input in a layout of its own (`tune-op --const`), `main` takes that input
in the new layout, and the library also exports `main_weight_prepack` (the transform, to
run once) and `main_layouts` (the description; `layout_notes` prints it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tunefarm.errors import RecordError
from tunefarm.isolation import WITHOUT_TORCH, IsolatedWorker
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
    import tempfile

    out = Path(out_path).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tunefarm-apply-") as tmp:
        workload = Path(tmp) / "workload.json"
        workload.write_text(best.workload_json)
        with IsolatedWorker(preload=["tvm"], name="apply-best", blocked_imports=WITHOUT_TORCH) as worker:
            outcome = worker.call(
                "tunefarm.measure.builder:build_module",
                str(workload),
                best.record.trace,
                best.record.target,
                str(out),
                timeout=timeout,
            )
    if not outcome.ok:
        raise RecordError(f"rebuilding the best kernel failed: {outcome.message}")
    return out


def layout_notes(library: str | Path) -> list[str]:
    """What a user must know to call the library: the inputs `main` takes in a rewritten
    layout, and how to transform them (no lines when it takes every input as it is)."""
    import tvm

    from tunefarm import layout

    layouts = layout.read_layouts(tvm.runtime.load_module(str(library)))
    if layouts is None:
        return []
    lines = [f"main takes {len(layouts.rewritten)} constant input(s) in a rewritten layout:"]
    lines += [f"  {r.describe()}" for r in layouts.rewritten]
    originals = ", ".join(r.name for r in layouts.rewritten)
    lines.append(
        f"transform them once with {layout.TRANSFORM}({originals}, <rewritten copies>); "
        f"{layout.LAYOUTS}(uint8[{layout.LAYOUTS_BYTES}]) gives this description as JSON"
    )
    return lines
