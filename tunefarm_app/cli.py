"""The `tunefarm` command line.

  tunefarm tasks MODEL.onnx [--input-shape x=1,3,224,224]
  tunefarm tune MODEL.onnx [MORE.onnx] [--input-shape ...] --trials N --out DIR
  tunefarm run DIR [--input x=x.npy] [--out out.npz]
  tunefarm tune-op WORKLOAD [--shape M=..,N=..] [--trials N] [--records F] [--json F]
  tunefarm apply-best RECORDS --out LIB [--workload NAME]
  tunefarm sketches WORKLOAD [--shape ...]
  tunefarm export-ms RECORDS --out DIR
  tunefarm dataset [RECORDS...] [--database-url URL] --out FILE.parquet [--device-class NAME] [--include-errors]
  tunefarm build-dataset --out DIR [--classes host,haswell] [--trials N] [--models small_cnn]
  tunefarm pretrain DATASET.parquet... --out FILE.npz [--objective squared|rank] [--hold-out-fraction F] [--compare]
  tunefarm report DIR [--html [--out FILE]]
  tunefarm bench ops [--trials N]
  tunefarm bench models [--trials N] [--models resnet18,bert_layer] [--json F]
  tunefarm bench gpu-models [--trials N] [--models yolov8n_like] [--no-compile]   # on an NVIDIA GPU
  tunefarm bench transfer [--source T] [--dest T] [--trials N] [--workloads gemm256,...]
  tunefarm bench pretrained (--model F.npz | --datasets D.parquet...) --workload OP:SHAPE [--target T] [--trials N]

Every error is one line on stderr, and nothing already stored is lost. The exit status
says whose it is: 2 a bad command (a flag, a file, a shape), 1 a failure of the work
itself, 3 a farm that cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tunefarm.errors import TunefarmError, UsageError
from tunefarm_app import dataset_build, farm_commands, model_commands, operator_commands, pretrain_command
from tunefarm_app.bench import farm as bench_farm
from tunefarm_app.bench import farm_load as bench_farm_load
from tunefarm_app.bench import fastmath as bench_math
from tunefarm_app.bench import gpu_models as bench_gpu_models
from tunefarm_app.bench import models as bench_models
from tunefarm_app.bench import pretrained as bench_pretrained
from tunefarm_app.bench import transfer as bench_transfer
from tunefarm_app.json_output import add_json_flag, emit_json, only_json

TARGET_HELP = (
    'TVM target as a JSON dict (default: this host); an NVIDIA GPU: {"kind": "cuda", "arch": "sm_80"} '
    "(tune-op then measures on this machine's GPU)"
)
CONST_HELP = (
    "an input that is a constant (a weight): the kernel may take it in a layout of its own, "
    "transformed once outside the timed call; repeat or comma-separate"
)


def _with_constants(workload, const: list[str] | None):
    names = [n.strip() for c in const or () for n in c.split(",") if n.strip()]
    return workload.with_constants(names) if names else workload


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage + error)
        command = self.prog.removeprefix("tunefarm").strip()  # "tune", "farm up"; "" at the top
        raise UsageError(f"{command}: {message}" if command else message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tunefarm", description="Ansor-style auto-scheduler for tensor programs.")
    p.add_argument("--version", action="version", version=version_text(), help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    model_commands.add_commands(sub)
    farm_commands.add_commands(sub)
    operator_commands.add_commands(sub)
    _add_kernel_commands(sub)
    _add_records_commands(sub)
    _add_bench_commands(sub)
    return p


def _add_kernel_commands(sub) -> None:
    """One operator's kernel on this machine, no model: `tune-op`, `apply-best`, `sketches`."""
    t = sub.add_parser("tune-op", help="tune one operator on this machine (its CPU, or with a CUDA target its GPU)")
    t.add_argument("workload", help="registry name (matmul, conv2d, ...), file.py:function or a TVMScript file.py")
    t.add_argument("--shape", help="shape parameters, e.g. M=1024,N=1024,K=1024")
    t.add_argument("--const", action="append", metavar="NAME", help=CONST_HELP)
    t.add_argument("--trials", type=int, default=256, help="measurements in total (default 256)")
    t.add_argument("--records", type=Path, help="JSON-lines records file (resumed if it exists)")
    add_json_flag(t, "the report")
    t.add_argument("--target", help=TARGET_HELP)
    t.add_argument("--seed", type=int, default=1, help="search seed (default 1)")
    t.add_argument("--batch-size", type=int, default=32, help="measurements per round (default 32)")
    t.add_argument("--early-stopping", type=int, help="stop after this many trials without improvement")
    t.add_argument("--work-dir", type=Path, help="keep build artifacts and task data here")
    t.add_argument("--no-progress", action="store_true", help="no live progress line")
    model_commands.add_timing_args(t)
    model_commands.add_cost_model_args(t)

    a = sub.add_parser("apply-best", help="rebuild the best kernel of a records file, no search")
    a.add_argument("records", type=Path, help="a records file (JSON lines)")
    a.add_argument("--out", type=Path, required=True, help="shared library to write (function 'main')")
    a.add_argument("--workload", help="which workload, when the file holds several")

    s = sub.add_parser("sketches", help="print the sketches a workload gets")
    s.add_argument("workload", help="registry name (matmul, conv2d, ...), file.py:function or a TVMScript file.py")
    s.add_argument("--shape", help="shape parameters, e.g. M=1024,N=1024,K=1024")
    s.add_argument("--const", action="append", metavar="NAME", help=CONST_HELP)
    s.add_argument("--target", help=TARGET_HELP)


def _add_records_commands(sub) -> None:
    """What was tuned, in other forms: `dataset`, `export-ms`, `report`."""
    d = sub.add_parser("dataset", help="write records as a columnar dataset (Parquet) for training cost models")
    d.add_argument("records", type=Path, nargs="*", help="records files (JSON lines, with their .workloads sidecar)")
    d.add_argument("--database-url", metavar="URL",
                   help="the farm's PostgreSQL (as TUNEFARM_DATABASE_URL): its vouched-for measurements too")  # fmt: skip
    d.add_argument("--out", type=Path, required=True, help="the Parquet file to write (and FILE.json: how it was made)")
    d.add_argument("--device-class", help="the device class the records were measured on (default: from each target); "
                   "with --database-url, only that farm class's measurements")  # fmt: skip
    d.add_argument("--include-errors", action="store_true", help="also failed measurements (cost inf)")
    dataset_build.add_command(sub)
    pretrain_command.add_command(sub)
    e = sub.add_parser("export-ms", help="write the records as a TVM MetaSchedule JSON database")
    e.add_argument("records", type=Path, help="a records file (JSON lines)")
    e.add_argument("--out", type=Path, required=True, help="database directory")

    r = sub.add_parser("report", help="show a tuned model directory's report (latency, check, tasks, rounds)")
    r.add_argument("directory", type=Path, help="a directory written by `tunefarm tune` or `tunefarm fetch`")
    r.add_argument("--html", action="store_true", help="also write it as one self-contained HTML file")
    r.add_argument("--out", type=Path, help="where --html writes (default: DIRECTORY/report.html)")


def _add_bench_commands(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks against TVM MetaSchedule and vendor libraries")
    bsub = b.add_subparsers(dest="suite", required=True, parser_class=_Parser)
    bo = bsub.add_parser("ops", help="tune the operator set and compare with the peers")
    bo.add_argument("--trials", type=int, default=256, help="trials per operator (default 256)")
    bo.add_argument("--ops", help="comma-separated subset of the benchmark's op ids")
    bo.add_argument("--no-metaschedule", action="store_true", help="do not tune with TVM MetaSchedule as a peer")
    bo.add_argument("--json", type=Path, help="write the table as JSON here")
    bo.add_argument("--work-dir", type=Path, help="keep records and peer outputs here")
    bo.add_argument("--seed", type=int, default=1, help="search seed (default 1)")
    bo.add_argument(
        "--target",
        help='TVM target as a JSON dict (default: this host); a CUDA target, e.g. {"kind": "cuda", "arch": "sm_90"}, '
        "tunes and times every kernel and the PyTorch peer on this machine's GPU",
    )
    bench_models.add_command(bsub)
    bench_gpu_models.add_command(bsub)
    bench_farm.add_command(bsub)
    bench_farm_load.add_command(bsub)
    bench_math.add_command(bsub)
    bench_transfer.add_command(bsub)
    bench_pretrained.add_command(bsub)


def version_text() -> str:
    """`tunefarm --version`: ours, TVM's and Python's."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from tunefarm import __version__

    try:
        tvm = version("apache-tvm")
    except PackageNotFoundError:
        tvm = "not installed"
    return f"tunefarm {__version__} (TVM {tvm}, Python {platform.python_version()})"


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return _dispatch(args)
    except TunefarmError as exc:  # one line; the status says whose fault (`tunefarm.errors`)
        print(f"tunefarm: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(
            "\ntunefarm: interrupted; every measurement made so far is in the records file: "
            "the same command resumes",
            file=sys.stderr,
        )
        return 130
    except BrokenPipeError:  # output piped into `head` or a pager that quit: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


def _dispatch(args: argparse.Namespace) -> int:
    if args.command in model_commands.COMMANDS:
        return model_commands.COMMANDS[args.command](args)
    if args.command in farm_commands.COMMANDS:
        return farm_commands.COMMANDS[args.command](args)
    if args.command in operator_commands.COMMANDS:
        return operator_commands.COMMANDS[args.command](args)
    if args.command == "tune-op":
        return _tune_op(args)
    if args.command == "apply-best":
        return _apply_best(args)
    if args.command == "sketches":
        return _sketches(args)
    if args.command == "export-ms":
        return _export_ms(args)
    if args.command == "dataset":
        return _dataset(args)
    if args.command == "build-dataset":
        return dataset_build.run(args)
    if args.command == "pretrain":
        return pretrain_command.run(args)
    if args.command == "report":
        return _report(args)
    if args.command == "bench" and args.suite == "models":
        return bench_models.run_models_bench(args)
    if args.command == "bench" and args.suite == "gpu-models":
        return bench_gpu_models.run_gpu_models_bench(args)
    if args.command == "bench" and args.suite == "farm":
        return bench_farm.run_farm_bench(args)
    if args.command == "bench" and args.suite == "farm-load":
        return bench_farm_load.run_farm_load_bench(args)
    if args.command == "bench" and args.suite == "math":
        return bench_math.run(args)
    if args.command == "bench" and args.suite == "transfer":
        return bench_transfer.run(args)
    if args.command == "bench" and args.suite == "pretrained":
        return bench_pretrained.run(args)
    if args.command == "bench":
        from tunefarm_app.bench.ops import run_ops_bench

        return run_ops_bench(args)
    raise UsageError(f"unknown command {args.command}")


def _tune_op(args: argparse.Namespace) -> int:
    from tunefarm.search.config import TuneConfig
    from tunefarm.target import parse_target
    from tunefarm.tune import default_records_path, tune_workload
    from tunefarm.workloads import load_workload
    from tunefarm_app.progress import ProgressView
    from tunefarm_app.report import report_dict, summary_lines

    if args.trials < 1:
        raise UsageError("--trials must be at least 1")
    if args.batch_size < 1:
        raise UsageError("--batch-size must be at least 1")
    target = parse_target(args.target)
    workload = _with_constants(load_workload(args.workload, args.shape), args.const)
    records = args.records or default_records_path(workload)
    if records.exists() and records.is_dir():
        raise UsageError(f"--records {records} is a directory")
    config = TuneConfig(trials=args.trials, batch_size=args.batch_size, seed=args.seed, early_stopping=args.early_stopping,
                        timing=model_commands.timing_config(args))  # fmt: skip
    callbacks = [] if args.no_progress else [ProgressView()]
    result = tune_workload(
        workload,
        target,
        config,
        records=records,
        work_dir=args.work_dir,
        cost_model_path=model_commands.cost_model_file(args, target),
        callbacks=callbacks,
        pretrained=not args.no_pretrained,
    )
    if not only_json(args):
        for line in summary_lines(result):
            print(line)
        print(f"records    {records}")
    emit_json(args, report_dict(result))
    return 0 if result.outcomes[0].best is not None else 1


def _apply_best(args: argparse.Namespace) -> int:
    from tunefarm_app.apply import build_best, find_best, layout_notes

    best = find_best(args.records, args.workload)
    out = build_best(best, args.out)
    rec = best.record
    print(f"rebuilt the best kernel of {best.workload_name} ({rec.cost * 1e3:.4f} ms when measured) -> {out}")
    print("call it as main(inputs..., outputs...) after tvm.runtime.load_module")
    for line in layout_notes(out):
        print(line)
    return 0


def _sketches(args: argparse.Namespace) -> int:
    from tunefarm.search.space.dag import fusible_consumer, is_strictly_inlineable, needs_multi_level_tiling
    from tunefarm.search.task import make_task
    from tunefarm.target import describe, parse_target
    from tunefarm.workloads import load_workload

    workload = _with_constants(load_workload(args.workload, args.shape), args.const)
    target = parse_target(args.target)
    task = make_task(workload, target)
    print(f"{workload.name}: {len(task.dag.blocks)} blocks, {len(task.sketches)} sketches ({describe(target)} rules)")
    for b in task.dag.blocks:
        iters = " ".join(f"{it.name}:{it.extent}{it.kind}" for it in b.iters)
        fc = fusible_consumer(task.dag, b)
        flags = [
            "reduction" if b.is_reduction else "spatial",
            "data-reuse" if needs_multi_level_tiling(b) else "",
            "inlineable" if is_strictly_inlineable(task.dag, b) else "",
            f"fusible-consumer={fc.name}" if fc else "",
            f"tables={','.join(b.table_iters)}" if b.table_iters else "",
        ]
        print(f"  block {b.name}  [{iters}]  {' '.join(f for f in flags if f)}")
    for name in task.dag.outside:
        print(f"  block {name}  runs once outside the kernel (transforms a constant input)")
    for i, sk in enumerate(task.sketches):
        print(f"sketch {i} ({sk.signature})")
        for line in sk.describe():
            print(f"    {line}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from tunefarm_app.tuned_report import html_report, load_report, print_report

    if args.out and not args.html:
        raise UsageError("--out is where --html writes: give --html too")
    file, report = load_report(args.directory)
    print_report(report, file)
    if args.html:
        out = args.out or file.with_name("report.html")
        if out.is_dir():
            raise UsageError(f"--out {out} is a directory")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(html_report(report, file))
        print(f"html       {out}")
    return 0


def _dataset(args: argparse.Namespace) -> int:
    from tunefarm.dataset import command_line, export_measured, export_records, write_dataset

    if not args.records and not args.database_url:
        raise UsageError("dataset: give records files, --database-url, or both")
    rows, counts = ([], None)
    if args.records:
        rows, counts = export_records(args.records, device_class=args.device_class, include_errors=args.include_errors)
    sources = [str(p.resolve()) for p in args.records]
    if args.database_url:
        farm_rows, counts = export_measured(_farm_measurements(args.database_url, args.device_class),
                                            include_errors=args.include_errors, counts=counts)  # fmt: skip
        rows += farm_rows
        from services.db.datasets import redacted

        sources.append(f"farm database {redacted(args.database_url)}")
    if not rows:
        raise UsageError(f"no measurement to write ({json.dumps(counts.as_report())})")
    provenance = {"command": command_line(), "sources": sources, **counts.as_report()}
    out = write_dataset(rows, args.out, provenance=provenance)
    print(f"dataset    {out}: {counts.rows} measurements of {len(counts.tasks)} tasks")
    skipped = {k: v for k, v in counts.as_report().items() if k.startswith("skipped") and v}
    if skipped:
        print("skipped    " + ", ".join(f"{v} {k.removeprefix('skipped_').replace('_', ' ')}" for k, v in skipped.items()))
    print(f"how made   {out}.json")
    return 0


def _farm_measurements(url: str, device_class: str | None) -> list:
    """The farm's vouched-for measurements (`services.db.datasets`); UsageError when the
    database cannot be read."""
    from services.db.datasets import FarmUnreadable, read_measured_tasks

    try:
        return read_measured_tasks(url, device_class=device_class)
    except FarmUnreadable as exc:
        raise UsageError(f"--database-url: cannot read the farm's measurements ({exc})") from None


def _export_ms(args: argparse.Namespace) -> int:
    from tunefarm_app.interop import export_metaschedule

    n, out = export_metaschedule(args.records, args.out)
    print(f"wrote {n} tuning records to the MetaSchedule database in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
