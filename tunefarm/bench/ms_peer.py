"""The MetaSchedule peer: tune one workload with TVM MetaSchedule, export its best kernel.

Runs inside a child process (`python -m tunefarm.bench.peers metaschedule ...`), whose
stdout and stderr the bench sends to a log file; MetaSchedule's own logs go to
`<work_dir>/logs`. What it does, with MetaSchedule's defaults unless said otherwise:

1. `import tvm.s_tir.tensor_intrin` (MetaSchedule's schedule rules need it). On this
   machine that import alone takes 20-40 s (TVMScript's parser calls `inspect.stack()` for
   each of ~500 intrinsics); it is a one-off start-up cost, timed as `setup_secs` and
   left out of the tuning wall time.
2. `ms.tune_tir(mod, target, work_dir, max_trials_global=N, num_trials_per_iter=64)` with
   the "evolutionary" strategy, "xgb" cost model and local runner, timed as `tune_secs`.
   One change to the defaults: the builder's build function is `build_without_intrin`, the
   default build (same passes, same `tvm.compile`) minus that import. MetaSchedule restarts
   its build pool for every batch, so with the default build function every batch paid the
   import again in each worker and the first build of each worker hit the 30 s build
   timeout; that is a quirk of this machine, not of MetaSchedule's search.
3. Count the trials: every measured candidate is a database record, a failed one with
   run_secs 1e10. MetaSchedule stops early when its search finds no new candidate; the
   result reports how many trials it really made.
4. `ms.tir_integration.compile_tir(database, mod, target)` gives the best schedule;
   `tvm.compile` + `export_library` write it to the requested .so (function "main"), which
   the bench then times with tunefarm's own runner.

The child inherits TVM_NUM_THREADS from the bench (the cores of the target), so
MetaSchedule's runner times candidates with as many threads as tunefarm's does.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MS_TRIALS_PER_ITER = 64
"""Candidates MetaSchedule measures per search iteration (`num_trials_per_iter`)."""

MS_FAILED_COST = 1e9
"""MetaSchedule records a failed measurement with run_secs 1e10; anything above this is one."""


@dataclass(frozen=True)
class MetaScheduleOutcome:
    """What the child reports (as JSON) about one MetaSchedule tuning."""

    trials: int  # records in the database: measured candidates, failed ones included
    valid_trials: int  # measurements that built and ran
    requested_trials: int
    tune_secs: float  # wall time of tune_tir
    setup_secs: float  # the one-off `import tvm.s_tir.tensor_intrin` (not in tune_secs)
    best_recorded_secs: float | None  # MetaSchedule's own timing of its best candidate
    library: str | None  # the exported best kernel, None when there is none
    layout_rewrite: bool  # the best schedule rewrites an input's layout inside the kernel
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_without_intrin(mod: Any, target: Any, _params: Any) -> Any:
    """MetaSchedule's `default_build` without its `import tvm.s_tir.tensor_intrin`
    (see the module docstring); the compilation itself is the same."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


def tune_metaschedule(
    workload_mod: Any,
    target_dict: dict[str, Any],
    *,
    trials: int,
    work_dir: Path,
    library: Path,
    seed: int,
) -> MetaScheduleOutcome:
    """Steps 1-4 of the module docstring."""
    t0 = time.perf_counter()
    import tvm
    import tvm.s_tir.tensor_intrin  # noqa: F401  (registers the intrinsics the rules look up)
    from tvm.s_tir import meta_schedule as ms

    setup_secs = time.perf_counter() - t0
    target = tvm.target.Target(target_dict)
    if (work_dir / "database_tuning_record.json").exists():
        raise FileExistsError(f"{work_dir} already holds a MetaSchedule database; use a fresh --work-dir")
    work_dir.mkdir(parents=True, exist_ok=True)
    cores = int(target_dict.get("num-cores") or 1)
    t0 = time.perf_counter()
    builder = ms.builder.LocalBuilder(max_workers=cores, f_build=build_without_intrin)
    database = ms.tune_tir(
        workload_mod,
        target,
        str(work_dir),
        max_trials_global=trials,
        num_trials_per_iter=MS_TRIALS_PER_ITER,
        builder=builder,
        num_tuning_cores=cores,
        seed=seed,
    )
    tune_secs = time.perf_counter() - t0
    costs = [_record_cost(r) for r in database.get_all_tuning_records()]
    valid = [c for c in costs if c < MS_FAILED_COST]
    sch = ms.tir_integration.compile_tir(database, workload_mod, target)
    outcome = MetaScheduleOutcome(
        trials=len(costs),
        valid_trials=len(valid),
        requested_trials=trials,
        tune_secs=tune_secs,
        setup_secs=setup_secs,
        best_recorded_secs=min(valid) if valid else None,
        library=None,
        layout_rewrite=False,
        note="" if len(costs) >= trials else f"MetaSchedule stopped after {len(costs)} of {trials} trials",
    )
    if sch is None:
        return _with_note(outcome, "MetaSchedule's database has no valid schedule")
    library.parent.mkdir(parents=True, exist_ok=True)
    tvm.compile(sch.mod, target=target).export_library(str(library))
    rewrites = "layout_rewrite_preproc" in sch.mod.script()
    return MetaScheduleOutcome(**{**outcome.as_dict(), "library": str(library), "layout_rewrite": rewrites})


def _record_cost(record: Any) -> float:
    secs = [float(s) for s in record.run_secs] if record.run_secs is not None else []
    return sum(secs) / len(secs) if secs else math.inf


def _with_note(outcome: MetaScheduleOutcome, note: str) -> MetaScheduleOutcome:
    joined = "; ".join(n for n in (outcome.note, note) if n)
    return MetaScheduleOutcome(**{**outcome.as_dict(), "note": joined})
