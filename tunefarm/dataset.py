"""Measurement datasets: what the project measured, as columnar files a cost model can be
trained on across tasks and device classes (TenSet-style), and rebuilt from their sources.

One row per measured program (`DatasetRow`): the device class and target it was measured
for, the task and workload, the program (sketch, decisions) and its features (the
per-store matrix the cost model reads, `tunefarm.search.features`, with its version),
the measured time (median seconds and every repeat), its noise (the repeats' relative
spread), how it was timed (warm, or with the caches flushed before every call), whether
the output was checked, and the environment it was measured in (TVM
and tunefarm versions, CPU model, cores, host). Emulated timings (an agent under
qemu-user) are never rows: they are an emulator's, not a device's. Failed measurements
are left out unless asked for (their time is none).

`export_measured` makes the rows of measured tasks from any source (`MeasuredTask`: a
task's records, its stored workload, and where they were measured); `export_records`
reads records files (`tunefarm tune`'s and `tune-op`'s JSON lines with their `.workloads`
sidecar) through it, and the farm's Postgres store gives its vouched-for measurements the
same way (`services.db.datasets`). `write_dataset` writes Parquet (pyarrow) plus a
`<file>.json` beside it saying how it was made: the sources, the command, the versions
and the row counts, so that it can be rebuilt.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tunefarm.errors import RecordError, UsageError
from tunefarm.records import MeasureRecord
from tunefarm.store import JsonlRecordStore

DATASET_VERSION = 1


@dataclass(frozen=True)
class Environment:
    """Where a set of measurements was taken."""

    tvm_version: str
    tunefarm_version: str
    cpu_model: str
    cores: int
    host: str

    @staticmethod
    def here() -> Environment:
        import tvm

        from tunefarm import __version__
        from tunefarm.isa import host_cpu_model
        from tunefarm.target import physical_cores

        return Environment(str(tvm.__version__), __version__, host_cpu_model() or platform.machine(), physical_cores(),
                           platform.node())  # fmt: skip


@dataclass(frozen=True)
class DatasetRow:
    """One measured program (see the module docstring)."""

    device_class: str
    target: str  # the target dict as JSON (sorted keys)
    task: str
    workload: str
    flops: float
    sketch_sig: str
    candidate: str
    decisions: str  # JSON
    feature_version: int
    features: list[list[float]]  # one row per store
    cost: float  # median seconds (inf for a failed measurement)
    costs: list[float]
    noise: float  # the repeats' standard deviation over their median (0 for fewer than 2)
    flushed_calls: bool  # timed with the caches flushed before every call, not warm (`TimingConfig`)
    error: str
    verified: bool
    timestamp: float
    tvm_version: str
    tunefarm_version: str
    cpu_model: str
    cores: int
    host: str
    source: str


@dataclass
class ExportCounts:
    rows: int = 0
    skipped_emulated: int = 0
    skipped_errors: int = 0
    skipped_no_workload: int = 0
    skipped_no_features: int = 0
    tasks: set[str] = field(default_factory=set)

    def as_report(self) -> dict[str, Any]:
        return {**{k: v for k, v in asdict(self).items() if k != "tasks"}, "tasks": len(self.tasks)}


@dataclass(frozen=True)
class MeasuredTask:
    """One task's measurements from one source, with the workload they are rebuilt from."""

    key: str  # the records' task key
    workload_key: str  # the stored workload's key (a task key does too: it names the constants)
    name: str
    module_json: str  # tvm.ir.save_json of the workload's IRModule
    records: Sequence[MeasureRecord]
    environment: Environment
    source: str
    device_class: str | None = None  # None: a name made from each record's target
    n_outputs: int | None = None


def export_records(
    paths: Sequence[str | os.PathLike[str]],
    *,
    device_class: str | None = None,
    include_errors: bool = False,
    environment: Environment | None = None,
) -> tuple[list[DatasetRow], ExportCounts]:
    """The rows of every record of the records files `paths` (see the module docstring).
    `device_class` names the class the records were measured on (default: a name made from
    each record's target). Raises RecordError for a file that is not a records file."""
    env = environment or Environment.here()
    tasks: list[MeasuredTask] = []
    counts = ExportCounts()
    for path in paths:
        store = JsonlRecordStore(path)
        if not Path(path).is_file():
            raise RecordError(f"{path}: no such records file")
        by_task: dict[str, list[MeasureRecord]] = {}
        for r in store.load():
            by_task.setdefault(r.task, []).append(r)
        for key, task_records in by_task.items():
            stored = store.get_workload(key)
            if stored is None:
                counts.skipped_no_workload += len(task_records)
                continue
            tasks.append(MeasuredTask(key, key, stored[0], stored[1], task_records, env, str(path), device_class))
    return export_measured(tasks, include_errors=include_errors, counts=counts)


def export_measured(
    tasks: Iterable[MeasuredTask], *, include_errors: bool = False, counts: ExportCounts | None = None
) -> tuple[list[DatasetRow], ExportCounts]:
    """The rows of the measured tasks' records (see the module docstring), counted into
    `counts` (a new one by default): never emulated timings, failed ones only with
    `include_errors`."""
    counts = counts if counts is not None else ExportCounts()
    rows: list[DatasetRow] = []
    for task in tasks:
        kept = []
        for r in task.records:
            if r.emulated:
                counts.skipped_emulated += 1
            elif r.error_kind.is_error and not include_errors:
                counts.skipped_errors += 1
            else:
                kept.append(r)
        if kept:
            rows += _task_rows(task, kept, counts)
    return rows, counts


def _task_rows(measured: MeasuredTask, records: list[MeasureRecord], counts: ExportCounts) -> list[DatasetRow]:
    from tunefarm.search.task import make_task
    from tunefarm.workloads.base import workload_from_stored

    key, device_class, env, source = measured.key, measured.device_class, measured.environment, measured.source
    try:
        workload = workload_from_stored(key=measured.workload_key, name=measured.name,
                                        module_json=measured.module_json, n_outputs=measured.n_outputs)  # fmt: skip
        task = make_task(workload, records[0].target)
    except Exception:  # a workload this version cannot analyse: no features for its records
        counts.skipped_no_features += len(records)
        return []
    feats = task.record_features(records)
    version = task.rules.feature_version
    out = []
    for r, f in zip(records, feats):
        if f.shape[0] == 0:
            counts.skipped_no_features += 1
            continue
        counts.rows += 1
        counts.tasks.add(key)
        out.append(
            DatasetRow(
                device_class=device_class or _class_name(r.target),
                target=json.dumps(r.target, sort_keys=True),
                task=key,
                workload=r.workload,
                flops=float(task.workload.flops),
                sketch_sig=r.sketch_sig,
                candidate=r.candidate.key,
                decisions=json.dumps(dict(r.decisions), sort_keys=True),
                feature_version=version,
                features=f.astype(float).tolist(),
                cost=r.cost,
                costs=[float(c) for c in r.costs],
                noise=_noise(r.costs),
                flushed_calls=r.flushed_calls,
                error=str(r.error_kind),
                verified=r.verified,
                timestamp=r.timestamp,
                tvm_version=env.tvm_version,
                tunefarm_version=env.tunefarm_version,
                cpu_model=env.cpu_model,
                cores=env.cores,
                host=env.host,
                source=source,
            )
        )
    return out


def write_dataset(
    rows: Sequence[DatasetRow], out: str | os.PathLike[str], *, provenance: Mapping[str, Any]
) -> Path:
    """Write `rows` as Parquet to `out` and `<out>.json` beside it (how it was made:
    `provenance`, the versions, the row counts per class and feature version)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError("writing a dataset needs pyarrow: pip install 'tunefarm[dataset]'") from None
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    columns = {f: [getattr(r, f) for r in rows] for f in DatasetRow.__dataclass_fields__}
    table = pa.table(columns, schema=_schema(pa))
    partial = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    pq.write_table(table, partial, compression="zstd")
    os.replace(partial, out)
    per_class: dict[str, int] = {}
    for r in rows:
        per_class[f"{r.device_class} (features v{r.feature_version})"] = per_class.get(
            f"{r.device_class} (features v{r.feature_version})", 0) + 1
    manifest = {
        "dataset_version": DATASET_VERSION,
        "file": out.name,
        "rows": len(rows),
        "rows_per_class": per_class,
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **dict(provenance),
    }
    Path(f"{out}.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return out


def read_dataset(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows of a dataset file as dicts (for training and tests)."""
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _schema(pa) -> Any:
    return pa.schema([
        ("device_class", pa.string()), ("target", pa.string()), ("task", pa.string()), ("workload", pa.string()),
        ("flops", pa.float64()), ("sketch_sig", pa.string()), ("candidate", pa.string()), ("decisions", pa.string()),
        ("feature_version", pa.int32()), ("features", pa.list_(pa.list_(pa.float32()))), ("cost", pa.float64()),
        ("costs", pa.list_(pa.float64())), ("noise", pa.float64()), ("flushed_calls", pa.bool_()), ("error", pa.string()), ("verified", pa.bool_()),
        ("timestamp", pa.float64()), ("tvm_version", pa.string()), ("tunefarm_version", pa.string()),
        ("cpu_model", pa.string()), ("cores", pa.int32()), ("host", pa.string()), ("source", pa.string()),
    ])  # fmt: skip


def _noise(costs: Iterable[float]) -> float:
    values = [float(c) for c in costs if math.isfinite(c)]
    if len(values) < 2:
        return 0.0
    median = statistics.median(values)
    return statistics.stdev(values) / median if median > 0 else 0.0


def _class_name(target: Mapping[str, Any]) -> str:
    """A readable class name for a target without one: its kind and cpu or arch."""
    detail = target.get("mcpu") or target.get("arch") or target.get("mtriple") or ""
    return f"{target.get('kind', '?')}-{detail}" if detail else str(target.get("kind", "?"))


def command_line() -> str:
    """How this process was started (for a dataset's provenance)."""
    return " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
