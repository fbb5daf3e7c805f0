"""`tunefarm pretrain`: train the base cost model a device family's runs start from.

  tunefarm pretrain DATASET.parquet [MORE.parquet] --out FILE.npz [--objective squared|rank]
                    [--family x86] [--hold-out-workloads A,B | --hold-out-fraction 0.2] [--compare]

The datasets are `tunefarm dataset` files (`tunefarm.dataset`). Training is
`tunefarm.search.cost_model.pretrain`; the file is written by `save_pretrained` with the
datasets' provenance (their paths, digests and how each was made), so that a shipped file
(`tunefarm/search/cost_model/pretrained/<family>.npz`) says what it learnt from.

With held-out workloads (named, or a fraction chosen by a hash of the names), the model is
trained without them and scored on them, per device class and task: pairwise accuracy
beyond the measurement noise and recall@k. `--compare` trains and scores both objectives
of the trees and the statement MLP (`statement_mlp.py`, with PyTorch installed) on the same
split; the file is the `--objective` trees'. Held out means by workload, never random rows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path
from typing import Any

from tunefarm.errors import UsageError
from tunefarm_app.json_output import add_json_flag, emit_json, only_json

MAX_SHIPPED_BYTES = 20 * 1024 * 1024
"""The largest file the package ships: a larger one is written with a warning."""


def add_command(sub) -> None:
    p = sub.add_parser("pretrain", help="train a pretrained cost model across tasks and device classes from datasets")
    p.add_argument("datasets", type=Path, nargs="+", help="Parquet files written by `tunefarm dataset`")
    p.add_argument("--out", type=Path, required=True, help="the model file to write (e.g. x86.npz)")
    p.add_argument("--objective", choices=["squared", "rank"], default="rank",  # PretrainConfig's (xgboost is imported only to run)
                   help="squared: weighted squared error on normalised throughput (as tuning trains); "
                   "rank: pairwise ranking within each task (default rank)")  # fmt: skip
    p.add_argument("--family", help="the device family to train (x86, arm, cuda); default: the datasets' only one")
    p.add_argument("--hold-out-workloads", action="append", default=[], metavar="NAME[,NAME]",
                   help="workloads (or task keys) left out of training and scored")  # fmt: skip
    p.add_argument("--hold-out-fraction", type=float, default=0.0, metavar="F",
                   help="hold out about this fraction of the workloads, chosen by a hash of their names")  # fmt: skip
    p.add_argument("--compare", action="store_true",
                   help="train and score both objectives and the statement MLP on the held-out workloads")  # fmt: skip
    p.add_argument("--rounds", type=int, default=200, help="most trees (default 200)")
    p.add_argument("--max-depth", type=int, default=8, help="deepest tree (default 8)")
    p.add_argument("--threads", type=int, default=1, help="XGBoost threads (default 1)")
    p.add_argument("--seed", type=int, default=43, help="seed (default 43)")
    add_json_flag(p, "the training and held-out figures")


def run(args: argparse.Namespace) -> int:
    from tunefarm.dataset import command_line
    from tunefarm.search.cost_model.pretrain import (
        OBJECTIVES,
        PretrainConfig,
        base_scores,
        held_out_workloads,
        pretrain,
        ranking_report,
        split_by_workload,
        training_programs,
    )
    from tunefarm.search.cost_model.pretrained import save_pretrained

    _check_args(args)
    rows = [row for path in args.datasets for row in read_rows(path)]
    programs = training_programs(rows, family=args.family)
    named = [n.strip() for item in args.hold_out_workloads for n in item.split(",") if n.strip()]
    held = named or held_out_workloads(programs, args.hold_out_fraction)
    train, test = split_by_workload(programs, held) if held else (programs, None)
    quiet = only_json(args)
    say = (lambda line: None) if quiet else print
    summary = train.summary()
    say(f"dataset    {summary['programs']} distinct programs of {summary['tasks']} tasks "
        f"({summary['workloads']} workloads) on {len(summary['classes'])} device classes ({programs.family})")  # fmt: skip
    if test is not None:
        say(f"held out   {len(set(test.workloads))} workloads, {len(test)} programs: {', '.join(sorted(set(test.workloads)))}")
    objectives = list(OBJECTIVES) if args.compare else [args.objective]
    results: dict[str, Any] = {}
    chosen = None
    for objective in objectives:
        config = PretrainConfig(objective=objective, num_boost_round=args.rounds, max_depth=args.max_depth,
                                nthread=args.threads, seed=args.seed)  # fmt: skip
        result = pretrain(train, config)
        entry: dict[str, Any] = {"trees": result.num_trees, "train_loss": result.train_loss,
                                 "seconds": round(result.seconds, 3)}  # fmt: skip
        line = f"{objective:<10} {result.num_trees} trees in {result.seconds:.1f} s"
        if test is not None:
            report = ranking_report(base_scores(result.base, test), test)
            entry["held_out"] = report.as_report()
            line += (f"; held out: pairwise {_pct(report.pairwise)} over {report.pairs} pairs beyond the noise "
                     f"({report.dropped} within it), recall@{entry['held_out']['k']} {_pct(report.recall)}")  # fmt: skip
            say(line)
            for cls, (pairwise, recall) in report.per_class.items():
                say(f"           {cls}: pairwise {_pct(pairwise)}, recall {_pct(recall)}")
        else:
            say(line)
        results[objective] = entry
        if objective == args.objective:
            chosen = result
    assert chosen is not None
    if args.compare and test is not None:
        results["statement_mlp"] = _score_statement_mlp(train, test, args.seed, say)
    provenance = {
        "command": command_line(),
        "datasets": [dataset_provenance(p) for p in args.datasets],
        "held_out_workloads": sorted(set(test.workloads)) if test is not None else [],
        "held_out": results[args.objective].get("held_out"),
    }
    out = save_pretrained(chosen.base, args.out, provenance=provenance)
    size = out.stat().st_size
    say(f"written    {out} ({size / 1e6:.2f} MB, {args.objective} objective)")
    if size > MAX_SHIPPED_BYTES:
        say(f"warning    larger than the {MAX_SHIPPED_BYTES // 2**20} MiB a shipped model may be: fewer --rounds or a "
            "smaller --max-depth")  # fmt: skip
    emit_json(args, {"file": str(out), "bytes": size, "family": programs.family, "training": summary,
                     "held_out_workloads": provenance["held_out_workloads"], "objectives": results})  # fmt: skip
    return 0


def _score_statement_mlp(train, test, seed: int, say) -> dict[str, Any]:
    """The statement MLP trained on `train`, scored on `test` as the trees are."""
    from tunefarm.search.cost_model.pretrain import ranking_report
    from tunefarm.search.cost_model.statement_mlp import MLPConfig, train_statement_mlp

    try:
        model = train_statement_mlp(train, MLPConfig(seed=seed))
    except UsageError as exc:  # no PyTorch: the comparison says so and the trees are still written
        say(f"{'mlp':<10} not trained: {exc}")
        return {"error": str(exc)}
    report = ranking_report(model.scores(test), test)
    held = report.as_report()
    say(f"{'mlp':<10} {model.epochs} epochs in {model.seconds:.1f} s; held out: pairwise {_pct(report.pairwise)} over "
        f"{report.pairs} pairs beyond the noise ({report.dropped} within it), recall@{held['k']} {_pct(report.recall)}")
    for cls, (pairwise, recall) in report.per_class.items():
        say(f"           {cls}: pairwise {_pct(pairwise)}, recall {_pct(recall)}")
    return {"epochs": model.epochs, "train_loss": model.train_loss, "seconds": round(model.seconds, 3), "held_out": held}


def _check_args(args: argparse.Namespace) -> None:
    if args.out.is_dir():
        raise UsageError(f"--out {args.out} is a directory")
    if not 0 <= args.hold_out_fraction < 1:
        raise UsageError("--hold-out-fraction must be at least 0 and below 1")
    if args.hold_out_workloads and args.hold_out_fraction:
        raise UsageError("--hold-out-workloads and --hold-out-fraction: give one")
    if args.compare and not (args.hold_out_workloads or args.hold_out_fraction):
        raise UsageError("--compare scores the objectives on held-out workloads: give --hold-out-workloads or "
                         "--hold-out-fraction")  # fmt: skip
    if args.rounds < 1 or args.max_depth < 1 or args.threads < 1:
        raise UsageError("--rounds, --max-depth and --threads must be at least 1")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The columns training reads of a `tunefarm dataset` file's rows. Raises UsageError."""
    if not path.is_file():
        raise UsageError(f"{path}: no such dataset file")
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError("reading a dataset needs pyarrow: pip install 'tunefarm[dataset]'") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow's errors for a file that is not Parquet vary by version
        raise UsageError(f"{path}: not a Parquet dataset ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    needed = {"device_class", "target", "task", "workload", "feature_version", "features", "cost", "noise"}
    missing = sorted(needed - set(table.column_names))
    if missing:
        raise UsageError(f"{path}: not a tunefarm dataset (no column {', '.join(missing)})")
    return table.select(sorted(needed | ({"cores"} & set(table.column_names)))).to_pylist()


def dataset_provenance(path: Path) -> dict[str, Any]:
    """The dataset file's name, digest and how it was made (its `.json` sidecar)."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest_path = path.with_name(path.name + ".json")
    manifest = None
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError):
            manifest = None
    return {"file": str(path.resolve()), "sha256": digest, "manifest": manifest}


def _pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:.1%}"
