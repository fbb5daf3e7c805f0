"""`tunefarm build-dataset`: measure the project's operators and example models on device
classes, and write each class's measurements as a dataset (`tunefarm.dataset`) to train
the pretrained cost model on (`tunefarm pretrain`).

  tunefarm build-dataset --out data/ [--classes host,haswell,x86-64-v2] [--ops all|ID,...]
                         [--models small_cnn,resnet18] [--trials 64] [--model-trials 16] [--seed 1]

Per class (`host`: this machine's CPU; any other name: an LLVM `mcpu` of the host's
architecture that runs here, `tunefarm.isa`), one embedded tuning session over every
workload: the operator set of `tunefarm bench ops` and of `tunefarm bench transfer` (other
shapes of the same operators) with `--trials` each, and the tasks of the example models
with `--model-trials` each, in round-robin, from a fresh cost model (neither a cache nor
the pretrained model: the dataset must not learn from what it will train). The records go
to `<out>/records/<class>.jsonl`; a rerun resumes them, so an interrupted build loses
nothing. Then each class's records are written as `<out>/<class>.parquet`, with
`<class>.parquet.json` saying how it was made (this command line, the workloads, the
budgets, the versions), so it can be rebuilt.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from tunefarm.errors import UsageError

DEFAULT_CLASSES = ("host",)
DEFAULT_MODELS = ("small_cnn",)


def add_command(sub) -> None:
    p = sub.add_parser(
        "build-dataset", help="measure the operator set and example models on device classes, as datasets for pretraining"
    )
    p.add_argument("--out", type=Path, required=True, help="directory for the records and the per-class Parquet files")
    p.add_argument("--classes", default=",".join(DEFAULT_CLASSES),
                   help="comma-separated: host (this CPU) or an mcpu of this architecture that runs here, "
                   "e.g. haswell, x86-64-v2 (default: host)")  # fmt: skip
    p.add_argument("--ops", default="all", help="bench ops ids (`tunefarm bench ops`), comma-separated, or all (default)")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="example models whose tasks are measured too, comma-separated, or none (default: small_cnn)")
    p.add_argument("--trials", type=int, default=64, help="measurements per operator per class (default 64)")
    p.add_argument("--model-trials", type=int, default=16, help="measurements per model task per class (default 16)")
    p.add_argument("--seed", type=int, default=1, help="search seed (default 1)")


def class_target(name: str) -> dict[str, Any]:
    """The target of a class name: `host`, or an LLVM mcpu of this machine's architecture
    that runs here (UsageError otherwise)."""
    from tunefarm.isa import check_runs_on_host
    from tunefarm.target import host_target_dict, num_cores
    from tunefarm.tvm_target import llvm_cpus

    if name == "host":
        return host_target_dict()
    target: dict[str, Any] = {"kind": "llvm", "mcpu": name}
    known = llvm_cpus(target)
    if name not in known:
        raise UsageError(f"--classes: {name!r} is neither host nor a CPU LLVM knows (e.g. {', '.join(known[:6])})")
    target["num-cores"] = num_cores(target)
    check_runs_on_host(target, f"--classes {name}")
    return target


def operator_workloads(spec: str) -> list:
    """The workloads of `--ops`: the bench ops set (`all`, or ids) and, with `all`, bench
    transfer's smaller shapes of the same operators."""
    from tunefarm.workloads.registry import make
    from tunefarm_app.bench.suite import select_ops
    from tunefarm_app.bench.transfer import WORKLOADS

    if spec.strip() == "none":
        return []
    out = [op.workload() for op in select_ops(None if spec.strip() == "all" else spec)]
    if spec.strip() == "all":
        for registry, shape, constants in WORKLOADS.values():
            w = make(registry, dict(shape))
            out.append(w.with_constants(constants) if constants else w)
    seen: set[str] = set()
    return [w for w in out if not (w.key in seen or seen.add(w.key))]


def model_workloads(spec: str, work: Path) -> list:
    """The distinct tasks of the example models of `--models` (exported under `work`)."""
    from tunefarm.models.examples import export_example, get_example
    from tunefarm.models.finish import load_model
    from tunefarm.models.tasks import merge_tasks

    names = [n.strip() for n in spec.split(",") if n.strip() and n.strip() != "none"]
    for n in names:
        get_example(n)  # UsageError for an unknown one, before anything runs
    loaded = [load_model(export_example(n, work / f"{n}.onnx"), name=n) for n in names]
    return [t.workload for t in merge_tasks([m.tasks for m in loaded])] if loaded else []


def run(args: argparse.Namespace) -> int:
    from tunefarm.dataset import command_line, export_records, write_dataset

    if args.trials < 1 or args.model_trials < 0:
        raise UsageError("--trials must be at least 1 and --model-trials at least 0")
    classes = [c.strip() for c in args.classes.split(",") if c.strip()]
    if not classes:
        raise UsageError("--classes: no class given")
    targets = {c: class_target(c) for c in classes}
    ops = operator_workloads(args.ops)
    op_keys = {w.key for w in ops}
    models = [w for w in model_workloads(args.models, args.out / "models") if w.key not in op_keys] if args.model_trials else []
    if not ops and not models:
        raise UsageError("nothing to measure: no operator and no model task")
    sessions = [("ops", ops, args.trials), ("models", models, args.model_trials)]
    for name, target in targets.items():
        t0 = time.perf_counter()
        sources = []
        for kind, workloads, trials in sessions:
            if workloads:
                records = args.out / "records" / f"{name}-{kind}.jsonl"
                _measure(name, target, workloads, trials, records, args)
                sources.append(records)
        # "host" is this machine: its rows take their class from the target (its CPU), so
        # that datasets measured on different hosts stay different classes.
        rows, counts = export_records(sources, device_class=None if name == "host" else name)
        provenance = {
            "command": command_line(),
            "sources": [str(r.resolve()) for r in sources],
            "target": target,
            "workloads": {w.name: t for kind, ws, t in sessions for w in ws},
            "seed": args.seed,
            "tuning_secs": round(time.perf_counter() - t0, 1),
            **counts.as_report(),
        }
        out = write_dataset(rows, args.out / f"{name}.parquet", provenance=provenance)
        print(f"{name:12s} {out}: {counts.rows} measurements of {len(counts.tasks)} tasks")
    return 0


def _measure(name: str, target: dict[str, Any], workloads: list, trials: int, records: Path, args) -> None:
    """One session: every workload `trials` measurements (round-robin), from a fresh cost
    model, into `records` (resumed)."""
    from tunefarm.search.config import TuneConfig
    from tunefarm.tune import TaskSpec, tune_tasks

    records.parent.mkdir(parents=True, exist_ok=True)
    _stderr(f"[{name}] {len(workloads)} workloads x {trials} trials (records {records})")
    config = TuneConfig(trials=trials * len(workloads), batch_size=min(16, trials), seed=args.seed, strategy="round-robin")
    tune_tasks(
        [TaskSpec(w, {w.name: 1}) for w in workloads], target, config, records=records,
        work_dir=args.out / "work" / name, cost_model_path=None, pretrained=False,
        log=lambda m: _stderr(f"[{name}] {m}"),
    )  # fmt: skip


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
