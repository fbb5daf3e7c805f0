"""`tunefarm bench transfer`: tune on one device class, transfer the cost model to another.

Three embedded tuning sessions over all the workloads (and seed), each workload getting
the same trials in each (round-robin), with the same batch size and seed:

1. *source*: tune for the source target (e.g. `haswell`, AVX2) with a fresh cost model,
   which is saved (one model for all the workloads, as the farm keeps one per class);
2. *cold*: tune for the destination target (e.g. `x86-64-v2`, SSE4.2) with a fresh model;
3. *warm*: tune for the destination starting from what the source run left, as a farm class with no model of
   its own starts from its nearest class: the source's cost model transferred
   (`XGBCostModel.transferred`: its trees rank the first batch, its measurements are
   prior data whose weight fades as the destination's own arrive), and the source's
   records in the warm run's records file, so that each workload's search starts from
   the programs that won on the source (`SimilarPrograms`: the same workload on another
   target comes first).

Both targets must run on this machine (`tunefarm.isa`): a kernel built for an older ISA
runs here, so two classes are measured side by side. The figure of merit: the trials
the cold run needs to reach its own final best latency (within `--tolerance`), and the
trials the warm run needs to reach that same latency; the goal is warm <= 50% of cold.
A warm run that never reaches it counts as more than the budget. Trials are counted per
workload (its own measurements, in order). The runs go one after the other, so each
times its kernels with the machine to itself.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tunefarm.errors import UsageError
from tunefarm_app.bench.cold_warm import geomean, measured_costs, ms, parse_seeds, reach, trials_ratio

WORKLOADS: dict[str, tuple[str, dict[str, int], tuple[str, ...]]] = {
    "gemm256": ("matmul", {"M": 256, "N": 256, "K": 256}, ("B",)),
    "conv2d": ("conv2d", {"C": 32, "H": 28, "W": 28, "F": 32}, ("weight",)),
    "conv1x1": ("conv2d_1x1", {"C": 128, "H": 14, "W": 14, "F": 256}, ("weight",)),
    "bmm": ("batch_matmul", {"B": 12, "M": 128, "N": 128, "K": 64}, ()),
    "depthwise": ("depthwise_conv2d", {"C": 32, "H": 56, "W": 56}, ("weight",)),
}
"""The bench's workloads: id -> (registry op, shape, constant inputs). Small shapes, so that
three runs of each fit a shared 2-core machine."""

GOAL = 0.5
"""Warm trials over cold trials to reach the cold run's final latency: at most this."""


@dataclass(frozen=True)
class TransferRow:
    workload: str
    seed: int
    cold_best: float  # seconds: the cold run's final best latency (the bar)
    warm_best: float  # seconds: the warm run's final best latency
    source_best: float  # seconds: the source run's best, on the source target
    cold_trials: int  # trials the cold run needed to reach the bar
    warm_trials: int | None  # ... the warm run (None: not within the budget)
    budget: int

    @property
    def ratio(self) -> float:
        """warm / cold trials (a warm run that never reached the bar counts as budget + 1)."""
        return trials_ratio(self.warm_trials, self.cold_trials, self.budget)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio}


def compare(
    workload: str, seed: int, budget: int, source: list[float], cold: list[float], warm: list[float], tolerance: float
) -> TransferRow:
    """The row of one workload and seed from the three runs' costs."""
    r = reach(workload, cold, warm, tolerance=tolerance, budget=budget)
    return TransferRow(workload, seed, r.cold_best, r.warm_best, min(source), r.cold_trials, r.warm_trials, budget)


def add_command(bsub) -> None:
    """`tunefarm bench transfer`."""
    p = bsub.add_parser("transfer", help="tune on one class, then another cold and warm (the first's cost model)")
    p.add_argument("--source", default='{"kind": "llvm", "mcpu": "haswell"}',
                   help="the target tuned first, as a TVM JSON target dict (default: haswell)")
    p.add_argument("--dest", default='{"kind": "llvm", "mcpu": "x86-64-v2"}',
                   help="the target tuned cold and warm (default: x86-64-v2, SSE4.2 without AVX)")
    p.add_argument("--workloads", help=f"comma-separated subset of: {', '.join(WORKLOADS)} (default: all)")
    p.add_argument("--trials", type=int, default=64, help="trials of each run (default 64)")
    p.add_argument("--batch-size", type=int, default=16, help="candidates measured per round (default 16)")
    p.add_argument("--seeds", default="1", help="comma-separated seeds; each runs all three (default 1)")
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="a run reaches the cold run's best when within this fraction of it (default 0.02)")
    p.add_argument("--json", type=Path, help="write the rows as JSON here too")
    p.add_argument("--work-dir", type=Path, help="keep the records and cost models here (default: a temporary dir)")


def run(args: argparse.Namespace) -> int:
    from tunefarm.isa import check_runs_on_host
    from tunefarm.target import num_cores, parse_target

    source, dest = parse_target(args.source), parse_target(args.dest)
    for name, target in (("--source", source), ("--dest", dest)):
        target.setdefault("num-cores", num_cores(target))
        check_runs_on_host(target, name)
    workloads = _select(args.workloads)
    seeds = parse_seeds(args.seeds)
    if args.trials < 2 or args.batch_size < 1:
        raise UsageError("--trials must be at least 2 and --batch-size at least 1")
    rows: list[TransferRow] = []
    with tempfile.TemporaryDirectory(prefix="tunefarm-transfer-") as tmp:
        root = Path(args.work_dir) if args.work_dir else Path(tmp)
        for seed in seeds:
            for row in run_seed(workloads, source, dest, trials=args.trials, batch_size=args.batch_size, seed=seed,
                                tolerance=args.tolerance, root=root / f"seed{seed}"):  # fmt: skip
                rows.append(row)
                print(_line(row), file=sys.stderr, flush=True)
    print(render(rows, source, dest, args))
    if args.json:
        args.json.write_text(json.dumps({"source": source, "dest": dest, "rows": [r.as_dict() for r in rows]}, indent=2))
    return 0


def run_seed(
    wids: list[str], source: dict, dest: dict, *, trials: int, batch_size: int, seed: int, tolerance: float, root: Path
) -> list[TransferRow]:
    """The three runs (module doc) of every workload for one seed. Each run is one session
    over all the workloads, each getting `trials` (round-robin), so the source's model is a
    class's model trained on all of them, as the farm keeps one per class. The runs go one
    after the other, each with the machine's cores to itself (two runs at once would time
    each other's kernels). A run whose records are all in `root` already is resumed, not measured again."""
    from tunefarm.search.cost_model import cache as cost_model_cache

    root.mkdir(parents=True, exist_ok=True)
    run = dict(wids=wids, trials=trials, batch_size=batch_size, seed=seed)
    source_model = root / "source-model.npz"
    source_costs = tune_run(name="source", target=source, records=root / "source.jsonl", model=source_model, **run)
    warm_model, warm_records = root / "warm-model.npz", root / "warm.jsonl"
    if not warm_model.exists():
        cost_model_cache.transferred_model(source_model, dest).save(warm_model)
    if not warm_records.exists():
        shutil.copyfile(root / "source.jsonl", warm_records)
    cold_costs = tune_run(name="cold", target=dest, records=root / "cold.jsonl", model=None, **run)
    warm_costs = tune_run(name="warm", target=dest, records=warm_records, model=warm_model, **run)
    return [
        compare(wid, seed, trials, s, c, w, tolerance)
        for wid, s, c, w in zip(wids, source_costs, cold_costs, warm_costs)
    ]


def tune_run(
    *, name: str, wids: list[str], target: dict, trials: int, batch_size: int, seed: int, records: Path,
    model: Path | None,
) -> list[list[float]]:  # fmt: skip
    """One embedded session over the workloads (`trials` each, round-robin); each
    workload's costs in measurement order. `model`: the cost model file to start from (a
    fresh model when it does not exist), saved back at the end."""
    from tunefarm.search.config import TuneConfig
    from tunefarm.tune import TaskSpec, tune_tasks
    from tunefarm.workloads.registry import make

    specs = []
    for wid in wids:
        op, shape, constants = WORKLOADS[wid]
        specs.append(TaskSpec(make(op, shape).with_constants(constants), {"bench": 1}))
    config = TuneConfig(trials=trials * len(specs), batch_size=batch_size, seed=seed, strategy="round-robin")
    result = tune_tasks(specs, target, config, records=records, cost_model_path=model, log=_quiet)
    return [measured_costs(state) for state in result.states]


def render(rows: list[TransferRow], source: dict, dest: dict, args: argparse.Namespace) -> str:
    from tunefarm.target import describe

    lines = [
        f"transfer: tuned on {describe(source)}, then {describe(dest)} cold (fresh model) and warm "
        f"(the first's model); {args.trials} trials per run, batches of {args.batch_size}, "
        f"tolerance {args.tolerance:.0%}",
        "",
        f"{'workload':<11} {'seed':>4} {'source best':>12} {'cold best':>10} {'warm best':>10} "
        f"{'cold trials':>11} {'warm trials':>11} {'warm/cold':>9}",
    ]
    for r in rows:
        warm = str(r.warm_trials) if r.warm_trials is not None else f">{r.budget}"
        lines.append(
            f"{r.workload:<11} {r.seed:>4} {ms(r.source_best):>12} {ms(r.cold_best):>10} {ms(r.warm_best):>10} "
            f"{r.cold_trials:>11} {warm:>11} {r.ratio:>9.2f}"
        )
    ratios = [r.ratio for r in rows]
    ratio_mean = geomean(ratios)
    met = sum(1 for x in ratios if x <= GOAL)
    lines += [
        "",
        f"warm/cold trials to reach the cold run's final latency: geometric mean {ratio_mean:.2f} "
        f"(goal <= {GOAL:.2f}); {met} of {len(rows)} rows meet it; "
        f"warm's final best / cold's: geometric mean {geomean([r.warm_best / r.cold_best for r in rows]):.3f}",
    ]
    return "\n".join(lines)


def _quiet(msg: str) -> None:
    """The runs' own log lines are not shown (a line per workload is)."""


def _line(r: TransferRow) -> str:
    warm = r.warm_trials if r.warm_trials is not None else f">{r.budget}"
    return f"{r.workload} seed {r.seed}: cold reached {ms(r.cold_best)} in {r.cold_trials} trials, warm in {warm}"


def _select(spec: str | None) -> list[str]:
    if not spec:
        return list(WORKLOADS)
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in WORKLOADS]
    if unknown or not wanted:
        raise UsageError(f"--workloads: unknown workload {unknown[0] if unknown else ''!r}; known: {', '.join(WORKLOADS)}")
    return wanted
