"""`tunefarm bench pretrained`: does a pretrained cost model cut the trials to a good kernel?

  tunefarm bench pretrained (--model FILE.npz | --datasets A.parquet [B.parquet ...])
      --workload OP:SHAPE [--workload ...] [--model-tasks MODEL.onnx] [--target T ...]
      [--trials 128] [--batch-size 16] [--repeat 5] [--min-repeat-ms 40] [--seeds 1,2]
      [--tolerance 0.02] [--json [FILE]]

Per target, seed and held-out workload, two embedded tuning sessions with the same seed,
budget and batch size, one after the other (each times its kernels with the machine to
itself), each a session over all the workloads (`--trials` each, round-robin), as
`tunefarm bench transfer` runs them:

1. *cold*: a fresh cost model (`pretrained=False`, no cost model file or cache);
2. *pretrained*: the pretrained model (`tune_tasks(pretrained_file=)`: the start
   `tunefarm tune` takes from the shipped file, from this file instead).

The figure (`cold_warm`): the trials each needs to reach the cold run's final best
latency (within `--tolerance`), their ratio pretrained/cold per workload (a pretrained
run that never reaches it counts as budget + 1), and the geometric mean of the ratios
over workloads and seeds, per target. Each target is labelled by whether the model
learnt from its class (a training class whose target has the same device descriptor:
all the model can tell devices apart by) or not: the evaluation is for both a class it
was trained on and one it never saw (x86 ISA classes this host runs: `tunefarm.isa`).

The model: a file (`--model`, `tunefarm pretrain`'s), or one trained here on
`--datasets` with every held-out workload left out (`pretrain.held_out_mask`). Held out
must mean held out: a workload the model learnt from (its metadata records them by name
and key: `pretrain.trained_workloads`) is refused, as is a model that does not record them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tunefarm.errors import TunefarmError, UsageError
from tunefarm.records import TimingConfig
from tunefarm_app.bench.cold_warm import geomean, measured_costs, ms, parse_seeds, reach
from tunefarm_app.json_output import add_json_flag, emit_json, only_json

DEFAULT_TIMING = TimingConfig()
"""The measurer's timing when a caller gives none."""

DEFAULT_TARGETS = ("host", '{"kind": "llvm", "mcpu": "x86-64-v2"}')
"""This machine's class (the one a dataset measured here trained on) and SSE4.2 without AVX."""


class PretrainedBenchError(TunefarmError):
    """A pretrained run that did not start from the pretrained model (exit 1)."""


@dataclass(frozen=True)
class BenchWorkload:
    name: str  # as the table shows it
    workload: Any  # tunefarm.workloads.Workload


@dataclass(frozen=True)
class PretrainedRow:
    target: str  # `tunefarm.target.describe`
    trained_class: str | None  # the training class with this target's descriptor (None: a new class)
    workload: str
    seed: int
    cold_best: float
    pretrained_best: float
    cold_trials: int
    pretrained_trials: int | None  # None: not within the budget
    budget: int
    ratio: float  # pretrained / cold trials

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def add_command(bsub) -> None:
    p = bsub.add_parser("pretrained", help="held-out workloads tuned cold and from a pretrained cost model")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", type=Path, help="the pretrained model file (tunefarm pretrain's)")
    model.add_argument("--datasets", type=Path, nargs="+", metavar="DATASET",
                       help="train one on these tunefarm dataset files, the held-out workloads left out")  # fmt: skip
    p.add_argument("--workload", action="append", default=[], metavar="OP:SHAPE",
                   help="a held-out registry op and its shape, e.g. matmul:M=512,N=512,K=512; repeat")  # fmt: skip
    p.add_argument("--model-tasks", type=Path, metavar="MODEL.onnx",
                   help="the tasks of this model are held out too (e.g. an example model: python -m "
                   "tunefarm.models.examples small_cnn --out small_cnn.onnx)")  # fmt: skip
    p.add_argument("--target", action="append", metavar="T",
                   help="a target tuned, as a TVM JSON target dict or 'host'; repeat (default: the host and "
                   "x86-64-v2)")  # fmt: skip
    p.add_argument("--trials", type=int, default=128, help="trials per workload in each run (default 128)")
    p.add_argument("--batch-size", type=int, default=16, help="candidates measured per round (default 16)")
    p.add_argument("--repeat", type=int, default=TimingConfig.repeat,
                   help=f"timed repeats per kernel (default {TimingConfig.repeat}, as tuning)")
    p.add_argument("--min-repeat-ms", type=float, default=TimingConfig.min_repeat_ms,
                   help=f"minimum length of a repeat (default {TimingConfig.min_repeat_ms:g}, as tuning)")
    p.add_argument("--seeds", default="1", help="comma-separated seeds; each runs both (default 1)")
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="a run reaches the cold run's final best when within this fraction of it (default 0.02)")  # fmt: skip
    p.add_argument("--objective", choices=["squared", "rank"], default="rank", help="with --datasets (default rank)")
    p.add_argument("--rounds", type=int, default=200, help="with --datasets: most trees (default 200)")
    p.add_argument("--work-dir", type=Path, help="keep the records (and a trained model) here (default: a temporary dir)")
    add_json_flag(p, "the rows and geometric means")


def run(args: argparse.Namespace) -> int:
    if args.trials < 2 or args.batch_size < 1:
        raise UsageError("--trials must be at least 2 and --batch-size at least 1")
    if args.repeat < 1 or args.min_repeat_ms < 0:
        raise UsageError("--repeat must be at least 1 and --min-repeat-ms at least 0")
    timing = TimingConfig(repeat=args.repeat, min_repeat_ms=args.min_repeat_ms)
    if not 0 <= args.tolerance < 1:
        raise UsageError("--tolerance must be at least 0 and below 1")
    targets = [host_runnable_target(t) for t in (args.target or DEFAULT_TARGETS)]
    workloads = held_out_workloads(args.workload, args.model_tasks)
    seeds = parse_seeds(args.seeds)
    say = (lambda line: None) if only_json(args) else (lambda line: print(line, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory(prefix="tunefarm-pretrained-") as tmp:
        root = Path(args.work_dir) if args.work_dir else Path(tmp)
        path = args.model or train_held_out(args.datasets, workloads, targets[0], root, args, say)
        info = checked_model(path, workloads, targets)
        rows: list[PretrainedRow] = []
        for target in targets:
            trained = trained_class(info, target)
            for seed in seeds:
                for row in run_seed(workloads, target, trained, path, trials=args.trials, batch_size=args.batch_size,
                                    seed=seed, tolerance=args.tolerance, root=root / _target_dir(target) / f"seed{seed}",
                                    timing=timing):  # fmt: skip
                    rows.append(row)
                    say(_line(row))
    means = target_means(rows)
    if not only_json(args):
        print(render(rows, means, path, args))
    emit_json(args, {"model": str(path), "tolerance": args.tolerance, "trials": args.trials,
                     "batch_size": args.batch_size, "timing": asdict(timing), "rows": [r.as_dict() for r in rows],
                     "geomeans": means})  # fmt: skip
    return 0


# --- what is tuned -----------------------------------------------------------------------------


def host_runnable_target(text: str) -> dict[str, Any]:
    """A target ("host" or a JSON dict) with its cores, which this machine must run."""
    from tunefarm.isa import check_runs_on_host
    from tunefarm.target import num_cores, parse_target

    target = parse_target(None if text == "host" else text)
    target.setdefault("num-cores", num_cores(target))
    check_runs_on_host(target, f"--target {text}")
    return target


def parse_op(spec: str):
    """`op:NAME=INT,...` -> the registry op's workload at that shape."""
    from tunefarm.workloads import registry
    from tunefarm.workloads.loader import parse_shape

    name, _, shape = spec.partition(":")
    if name.strip() not in registry.OPS:
        raise UsageError(f"--workload {spec!r}: not a registry op ({', '.join(sorted(registry.OPS))}) with a shape")
    return registry.make(name.strip(), parse_shape(shape))


def held_out_workloads(specs: list[str], model: Path | None) -> list[BenchWorkload]:
    """The registry ops named, then the tasks of the model (each workload once)."""
    found: dict[str, BenchWorkload] = {}
    for spec in specs:
        w = parse_op(spec)
        found.setdefault(w.key, BenchWorkload(w.name, w))
    if model is not None:
        from tunefarm.models.importer import import_model
        from tunefarm.models.tasks import extract_tasks

        if not model.is_file():
            raise UsageError(f"--model-tasks {model}: no such model file")
        tasks = extract_tasks(import_model(model), name=model.stem)
        for t in tasks.tasks:
            found.setdefault(t.workload.key, BenchWorkload(f"{model.stem}:{t.workload.name}", t.workload))
    if not found:
        raise UsageError("give the held-out workloads: --workload OP:SHAPE (repeat) and/or --model-tasks MODEL.onnx")
    return list(found.values())


# --- the model ---------------------------------------------------------------------------------


def checked_model(path: Path, workloads: list[BenchWorkload], targets: list[dict[str, Any]]) -> dict[str, Any]:
    """The model's metadata, once it fits every target and learnt none of the workloads.
    Raises UsageError (one line) otherwise."""
    from tunefarm.search.cost_model.pretrain import trained_workloads, workload_identity
    from tunefarm.search.cost_model.pretrained import incompatibility, read_pretrained

    if not path.is_file():
        raise UsageError(f"--model {path}: no such file")
    try:
        base = read_pretrained(path)
    except Exception as exc:  # any file that is not one: a usage error, in one line
        raise UsageError(f"--model {path}: not a pretrained cost model ({type(exc).__name__}: {exc})") from None
    for target in targets:
        problem = incompatibility(base, target)
        if problem:
            raise UsageError(f"--model {path} cannot score {_describe(target)}: it was {problem}")
    trained = trained_workloads(base.info)
    if trained is None:
        raise UsageError(f"--model {path} does not record the workloads it was trained on: train it again with "
                         "tunefarm pretrain to tell held-out workloads from trained ones")  # fmt: skip
    learnt = [w.name for w in workloads if w.workload.name in trained or workload_identity(w.workload.key) in trained]
    if learnt:
        raise UsageError(f"{', '.join(learnt)}: in the training set of {path}, so not held out "
                         "(leave it out with tunefarm pretrain --hold-out-workloads, or bench it with --datasets)")  # fmt: skip
    return dict(base.info)


def train_held_out(
    datasets: list[Path], workloads: list[BenchWorkload], target: dict[str, Any], root: Path, args: argparse.Namespace,
    say,
) -> Path:  # fmt: skip
    """A model trained on `datasets` (the target's device family) without the held-out
    workloads, written under `root`."""
    from tunefarm.dataset import command_line
    from tunefarm.search.cost_model.descriptor import device_family
    from tunefarm.search.cost_model.pretrain import PretrainConfig, held_out_mask, pretrain, training_programs
    from tunefarm.search.cost_model.pretrained import save_pretrained
    from tunefarm_app.pretrain_command import dataset_provenance, read_rows

    if args.rounds < 1:
        raise UsageError("--rounds must be at least 1")
    programs = training_programs([r for p in datasets for r in read_rows(p)], family=device_family(target))
    names = [n for w in workloads for n in (w.workload.name, w.workload.key)]
    out = held_out_mask(programs, names)
    train = programs.subset(~out)
    if not len(train):
        raise UsageError("every program of the datasets is of a held-out workload: nothing left to train on")
    result = pretrain(train, PretrainConfig(objective=args.objective, num_boost_round=args.rounds))
    say(f"trained {result.num_trees} trees on {len(train)} programs ({int(out.sum())} of held-out workloads left out) "
        f"in {result.seconds:.1f} s")  # fmt: skip
    provenance = {"command": command_line(), "datasets": [dataset_provenance(p) for p in datasets],
                  "held_out_workloads": sorted(set(names))}  # fmt: skip
    return save_pretrained(result.base, root / f"pretrained-{programs.family}.npz", provenance=provenance)


def trained_class(info: dict[str, Any], target: dict[str, Any]) -> str | None:
    """The training class whose target has `target`'s device descriptor (None: none has)."""
    import numpy as np

    from tunefarm.search.cost_model.descriptor import device_descriptor

    mine = device_descriptor(target)
    for name, other in sorted((info.get("class_targets") or {}).items()):
        try:
            if np.array_equal(device_descriptor(dict(other)), mine):
                return str(name)
        except Exception:  # a class target this installation cannot describe is no match
            continue
    return None


# --- the runs ----------------------------------------------------------------------------------


def run_seed(
    workloads: list[BenchWorkload], target: dict[str, Any], trained: str | None, model: Path, *, trials: int,
    batch_size: int, seed: int, tolerance: float, root: Path, timing: TimingConfig = DEFAULT_TIMING,
) -> list[PretrainedRow]:  # fmt: skip
    """The cold and the pretrained run of every workload for one target and seed."""
    root.mkdir(parents=True, exist_ok=True)
    run = dict(workloads=workloads, target=target, trials=trials, batch_size=batch_size, seed=seed, timing=timing)
    cold = tune_run(records=root / "cold.jsonl", pretrained_file=None, **run)
    warm = tune_run(records=root / "pretrained.jsonl", pretrained_file=model, **run)
    rows = []
    for w, c, p in zip(workloads, cold, warm):
        r = reach(w.name, c, p, tolerance=tolerance, budget=trials)
        rows.append(PretrainedRow(_describe(target), trained, w.name, seed, r.cold_best, r.warm_best, r.cold_trials,
                                  r.warm_trials, trials, r.ratio))  # fmt: skip
    return rows


def tune_run(
    *, workloads: list[BenchWorkload], target: dict[str, Any], trials: int, batch_size: int, seed: int, records: Path,
    pretrained_file: Path | None, timing: TimingConfig = DEFAULT_TIMING,
) -> list[list[float]]:  # fmt: skip
    """One embedded session over the workloads (`trials` each, round-robin), with a fresh
    model (no `pretrained_file`) or starting from `pretrained_file`; no cost model file or
    cache is read or written. Each workload's costs in measurement order."""
    from tunefarm.search.config import TuneConfig
    from tunefarm.tune import TaskSpec, tune_tasks

    specs = [TaskSpec(w.workload, {"bench": 1}) for w in workloads]
    config = TuneConfig(trials=trials * len(specs), batch_size=batch_size, seed=seed, strategy="round-robin",
                        timing=timing)
    result = tune_tasks(specs, target, config, records=records, cost_model_path=None,
                        pretrained=pretrained_file is not None, pretrained_file=pretrained_file, log=_quiet)  # fmt: skip
    wanted = "pretrained" if pretrained_file is not None else "fresh"
    started = result.cost_model.source if result.cost_model else None
    if started != wanted:
        note = result.cost_model.note if result.cost_model else "none"
        raise PretrainedBenchError(f"the {wanted} run started from a {started} cost model ({note})")
    return [measured_costs(state) for state in result.states]


# --- the table ---------------------------------------------------------------------------------


def target_means(rows: list[PretrainedRow]) -> list[dict[str, Any]]:
    """Per target (in the rows' order): its class label and the geometric means over its
    workloads and seeds of the trials ratio and of pretrained best / cold best."""
    out = []
    for target in dict.fromkeys(r.target for r in rows):
        mine = [r for r in rows if r.target == target]
        out.append({
            "target": target, "trained_class": mine[0].trained_class, "rows": len(mine),
            "ratio_geomean": geomean(r.ratio for r in mine),
            "best_geomean": geomean(r.pretrained_best / r.cold_best for r in mine),
            "reached": sum(1 for r in mine if r.pretrained_trials is not None),
        })  # fmt: skip
    return out


def render(rows: list[PretrainedRow], means: list[dict[str, Any]], model: Path, args: argparse.Namespace) -> str:
    tw = max([len("target"), *(len(r.target) for r in rows)])
    cw = max([len("class"), *(len(_class_label(r.trained_class)) for r in rows)])
    ww = max([len("workload"), *(len(r.workload) for r in rows)])
    lines = [
        f"pretrained: held-out workloads tuned cold (fresh model) and from {model}; {args.trials} trials per "
        f"workload per run, batches of {args.batch_size}; a run reaches the cold run's final best within "
        f"{args.tolerance:.0%}",
        "",
        f"{'target':<{tw}} {'class':<{cw}} {'workload':<{ww}} {'seed':>4} {'cold best':>12} {'pre best':>12} "
        f"{'cold trials':>11} {'pre trials':>10} {'pre/cold':>8}",
    ]
    for r in rows:
        pre = str(r.pretrained_trials) if r.pretrained_trials is not None else f">{r.budget}"
        lines.append(
            f"{r.target:<{tw}} {_class_label(r.trained_class):<{cw}} {r.workload:<{ww}} {r.seed:>4} "
            f"{ms(r.cold_best):>12} {ms(r.pretrained_best):>12} {r.cold_trials:>11} {pre:>10} {r.ratio:>8.2f}"
        )
    lines.append("")
    for m in means:
        lines.append(
            f"{m['target']} ({_class_label(m['trained_class'])}): pretrained/cold trials geometric mean "
            f"{m['ratio_geomean']:.2f} over {m['rows']} workload-seeds ({m['reached']} reached the bar); "
            f"pretrained best / cold best {m['best_geomean']:.3f}"
        )
    return "\n".join(lines)


def _class_label(trained: str | None) -> str:
    return f"trained: {trained}" if trained else "new class"


def _line(r: PretrainedRow) -> str:
    pre = r.pretrained_trials if r.pretrained_trials is not None else f">{r.budget}"
    return (f"{r.target} {r.workload} seed {r.seed}: cold reached {ms(r.cold_best)} in {r.cold_trials} trials, "
            f"pretrained in {pre}")  # fmt: skip


def _describe(target: dict[str, Any]) -> str:
    from tunefarm.target import describe

    return describe(target)


def _target_dir(target: dict[str, Any]) -> str:
    from tunefarm.search.task import target_key

    return f"target-{target_key(target)}"


def _quiet(msg: str) -> None:
    """The runs' own log lines are not shown (a line per workload is)."""
