"""Embedded mode, the default: one process tunes with local builder and runner
processes, a JSON-lines record store and a cost model in memory (no Redis, no
Postgres)."""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.measurer.runner import LocalRunner
from services.scheduler.config import TuneConfig
from services.scheduler.cost_model import CostModel, XGBConfig, XGBCostModel
from services.scheduler.task import SearchTask, make_task
from services.scheduler.tuner import TaskTuner, TrialEvent, TuneResult
from services.worker.builder import LocalBuilder
from tunefarm import target as targets
from tunefarm.errors import UsageError
from tunefarm.store import JsonlRecordStore
from tunefarm.workloads import Workload


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_records_path(workload: Workload) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in workload.name)
    return Path("tunefarm-records") / f"{safe}.jsonl"


def load_or_new_model(path: Path | None, seed: int, batch_size: int = 64) -> CostModel:
    if path is not None and path.exists():
        try:
            return XGBCostModel.load(path)
        except Exception as exc:
            raise UsageError(f"--cost-model {path}: not a tunefarm cost model ({exc})") from None
    # Retrain after every measured batch, not only when the data grew by 20% as
    # MetaSchedule's adaptive training does; start learning after the first batch.
    return XGBCostModel(XGBConfig(seed=seed, adaptive_training=False, num_warmup_samples=min(64, batch_size)))


def tune_workload(
    workload: Workload,
    target: dict[str, Any],
    config: TuneConfig,
    *,
    records: Path,
    work_dir: Path | None = None,
    cost_model_path: Path | None = None,
    on_trial: Callable[[TrialEvent], None] | None = None,
    log: Callable[[str], None] = _stderr,
) -> TuneResult:
    if config.trials < 1:
        raise UsageError("--trials must be at least 1")
    task: SearchTask = make_task(workload, target)
    store = JsonlRecordStore(records)
    store.put_workload(task.key, workload.name, workload.to_json())
    log(
        f"tuning {workload.name} on {targets.describe(target)}: {len(task.sketches)} sketches, "
        f"{config.trials} trials, seed {config.seed}"
    )
    log("config " + json.dumps(config.as_dict(), separators=(",", ":")))
    model = load_or_new_model(cost_model_path, config.seed, config.batch_size)
    cores = targets.num_cores(target)
    with tempfile.TemporaryDirectory(prefix="tunefarm-") as tmp:
        wd = Path(work_dir) if work_dir is not None else Path(tmp)
        builder = LocalBuilder(wd / "build", n_workers=cores)
        runner = LocalRunner(num_threads=cores)
        try:
            tuner = TaskTuner(
                task,
                config,
                model=model,
                builder=builder,
                runner=runner,
                store=store,
                work_dir=wd,
                on_trial=on_trial,
                log=log,
            )
            result = tuner.tune()
        finally:
            builder.close()
            runner.close()
    if cost_model_path is not None:
        model.save(cost_model_path)
    return result
