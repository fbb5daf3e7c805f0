"""Whole-model commands of the command line: `tasks`, `tune`, `run`.

  tunefarm tasks MODEL.onnx [--input-shape x=1,3,224,224]...
  tunefarm tune MODEL.onnx [MODEL2.onnx ...] [--input-shape ...] --trials N --out DIR
  tunefarm run DIR [--input x=x.npy]... [--out out.npz] [--threads N] [--repeat N]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from tunefarm.errors import ModelError, UsageError
from tunefarm.records import TimingConfig
from tunefarm_app.json_output import add_json_flag, emit_json, only_json


def add_commands(sub) -> None:
    t = sub.add_parser("tasks", help="the task table of a model: subgraphs, shapes, weights, FLOPs")
    t.add_argument("models", nargs="+", type=Path, help="ONNX files")
    _input_shape_arg(t)
    _conv_layout_arg(t)
    t.add_argument("--precision", choices=["fp32", "fp16"], default="fp32",
                   help="the tasks of the model in this precision (fp16: as tune --precision fp16 tunes it)")
    add_json_flag(t, "the task tables")

    u = sub.add_parser("tune", help="tune whole models and write the tuned, compiled models")
    u.add_argument("models", nargs="+", type=Path, help="ONNX files; several share their identical tasks")
    _input_shape_arg(u)
    _conv_layout_arg(u)
    u.add_argument("--trials", type=int, default=2000, help="measurements in total over all tasks (default 2000)")
    u.add_argument("--out", type=Path, required=True, help="directory for model.so, manifest, records and report")
    u.add_argument("--target", help="TVM target as a JSON dict (default: this host)")
    u.add_argument("--seed", type=int, default=1, help="search seed (default 1)")
    u.add_argument("--strategy", choices=["gradient", "round-robin"], default="gradient", help="task scheduler")
    u.add_argument(
        "--latency-target",
        action="append",
        default=[],
        metavar="[MODEL=]MS",
        help="stop giving a model's tasks time once its estimated latency is at most MS milliseconds",
    )
    u.add_argument("--compare-default", action="store_true", help="also time TVM's untuned default build")
    u.add_argument(
        "--no-peers", dest="no_peers", action="store_true",
        help="do not time onnxruntime and OpenVINO beside the tuned model (its output is still checked)",
    )
    u.add_argument(
        "--no-winograd", action="store_true",
        help="tune 3x3 stride-1 convolutions only as they are, not also by Winograd F(m x m, 3 x 3)",
    )
    u.add_argument(
        "--precision", choices=["fp32", "fp16"], default="fp32",
        help="what the models compute in: fp32 (default, as imported) or fp16 (CUDA targets, sm_70+: float16 "
        "operands with float32 accumulation, matrix multiplies on tensor cores; checked with a float16 tolerance)",
    )
    u.add_argument(
        "--final-rounds", type=int, default=0, metavar="N",
        help="once the trials are spent, time each task's fastest kernels (up to 3, within 1.25x of its best) again "
        "together in N alternating rounds (3 is a good start) and build with the lowest median (default 0: each task's best "
        "record)",
    )
    u.add_argument("--work-dir", type=Path, help="keep build artifacts and task data here")
    u.add_argument("--no-progress", action="store_true", help="plain log lines instead of the live view")
    add_timing_args(u)
    add_cost_model_args(u)

    r = sub.add_parser("run", help="run a tuned model and print its latency")
    r.add_argument("directory", type=Path, help="a directory written by `tunefarm tune`")
    r.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", help="an input (default: random)")
    add_json_flag(r, "the latencies (the tuned model's and its peers') and the outputs' shapes")
    r.add_argument("--out", "--output", dest="out", type=Path,
                   help="write the outputs to this .npz (--out names what a command writes, as on tune and report)")
    r.add_argument(
        "--repeat", type=int, help="timed inferences (default: as many as fit in about a second, at least 20), "
        "in 5 blocks alternating with onnxruntime's"
    )
    r.add_argument("--threads", type=int, help="threads of TVM and of the peers (default: the target's cores)")
    r.add_argument(
        "--no-peers", "--no-onnxruntime", dest="no_peers", action="store_true",
        help="do not time onnxruntime and OpenVINO on the model's reference.onnx",
    )


def add_timing_args(p) -> None:
    p.add_argument(
        "--flush-every-call", action="store_true",
        help="time each CPU kernel with its weights and outputs flushed from the caches before every call, as "
        "they come in a model, each call timed alone (default: flushed before each repeat of many warm calls). "
        "Estimates then match the model's latency more closely; earlier records timed the other way are not "
        "resumed",
    )


def timing_config(args) -> TimingConfig:
    """The kernels' timing that the command line asks for."""
    return TimingConfig(flush_every_call=args.flush_every_call)


def add_cost_model_args(p) -> None:
    p.add_argument(
        "--cost-model",
        type=Path,
        metavar="PATH",
        help="start from the cost model in this file (if it is there) and save the run's model to it "
        "(default: a per-target file under $XDG_CACHE_HOME/tunefarm/cost_models)",
    )
    p.add_argument(
        "--no-cost-model-cache",
        action="store_true",
        help="start without the cached cost model and keep nothing (without --cost-model); "
        "the shipped pretrained model still applies unless --no-pretrained",
    )
    p.add_argument(
        "--no-pretrained",
        action="store_true",
        help="without a cost model of its own (file or cache), start from a fresh one, not the "
        "shipped pretrained model of the target's device family",
    )


def cost_model_file(args: argparse.Namespace, target: dict) -> Path | None:
    """The cost model file of a `tune` or `tune-op` run (None: a fresh model, not kept)."""
    from tunefarm.search.cost_model.cache import model_path

    return model_path(args.cost_model, target, use_cache=not args.no_cost_model_cache)


def _input_shape_arg(p) -> None:
    p.add_argument(
        "--input-shape",
        action="append",
        default=[],
        metavar="NAME=d0,d1,...",
        help="the shape of an input with dynamic dimensions (once per such input)",
    )


def _conv_layout_arg(p) -> None:
    p.add_argument(
        "--conv-layout",
        choices=["nhwc", "model"],
        default="nhwc",
        help="the layout convolutions compute in: nhwc (default; vectorized over channels) or model "
        "(the model's own, e.g. NCHW; channel concats and splits stay views)",
    )


def parse_input_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, sep, dims = item.partition("=")
        if not sep or not name.strip() or not dims.strip():
            raise UsageError(f"--input-shape: expected NAME=d0,d1,..., got {item!r}")
        try:
            shape = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise UsageError(f"--input-shape {name}: dimensions must be integers, got {dims!r}") from None
        if any(d < 1 for d in shape):
            raise UsageError(f"--input-shape {name}: dimensions must be positive, got {dims!r}")
        out[name.strip()] = shape
    return out


def parse_latency_targets(items: list[str], models: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.rpartition("=")
        if not sep:
            if len(models) != 1:
                raise UsageError("--latency-target: name the model (MODEL=MS) when tuning several")
            name = models[0]
        try:
            ms = float(value)
        except ValueError:
            raise UsageError(f"--latency-target: {value!r} is not a number of milliseconds") from None
        if not math.isfinite(ms) or ms <= 0:
            raise UsageError(f"--latency-target: must be a positive number of milliseconds, got {value!r}")
        out[name] = ms / 1e3
    return out


def _check_files(paths: list[Path]) -> None:
    for p in paths:
        if not p.is_file():
            raise ModelError(f"no such model file: {p}")


def cmd_tasks(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tunefarm.models.finish import load_model, model_name
    from tunefarm.models.tasks import CONV_LAYOUT_CHOICES

    _check_files(args.models)
    shapes = parse_input_shapes(args.input_shape)
    taken: set[str] = set()
    console = Console(highlight=False)
    listed: list[dict] = []
    for path in args.models:
        m = load_model(path, shapes, name=model_name(path, taken), conv_layouts=CONV_LAYOUT_CHOICES[args.conv_layout],
                       precision=args.precision)
        rows = m.tasks.table()
        listed.append({
            "model": m.name, "gflop_per_run": m.tasks.total_flops / 1e9, "elided": list(m.tasks.elided),
            "warnings": list(m.imported.warnings),
            "tasks": [{"index": i, "name": r.name, "shapes": r.shapes, "weight": r.weight, "flops": r.flops,
                       "share": r.share} for i, r in enumerate(rows)],
        })  # fmt: skip
        if only_json(args):
            continue
        table = Table(title=f"{m.name}: {len(rows)} tasks, {m.tasks.total_flops / 1e9:.3f} GFLOP per run")
        for col in ("#", "task", "shapes", "weight", "MFLOP", "share"):
            table.add_column(col, justify="left" if col in ("task", "shapes") else "right")
        for i, r in enumerate(rows):
            table.add_row(str(i), r.name.split("(")[0], r.shapes, str(r.weight), f"{r.flops / 1e6:.2f}", f"{r.share:.1%}")
        console.print(table)
        if m.tasks.elided:
            console.print(f"not tasks (the build makes them views): {', '.join(m.tasks.elided)}", markup=False)
        for w in m.imported.warnings:
            console.print(f"warning: {w}", markup=False)
    emit_json(args, listed)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from tunefarm.models.alternatives import ALGORITHMS
    from tunefarm.models.build import library_name
    from tunefarm.models.finish import model_name
    from tunefarm.target import parse_target
    from tunefarm.tune import tune_models
    from tunefarm_app.progress import ProgressView
    from tunefarm_app.tuned_report import check_lines, cost_model_line, latency_lines

    if args.trials < 1:
        raise UsageError("--trials must be at least 1")
    if args.final_rounds < 0:
        raise UsageError("--final-rounds must be at least 0")
    _check_files(args.models)
    shapes = parse_input_shapes(args.input_shape)
    taken: set[str] = set()
    names = [model_name(p, taken) for p in args.models]
    targets = parse_latency_targets(args.latency_target, names)
    callbacks = [] if args.no_progress else [ProgressView()]
    target = parse_target(args.target)
    result = tune_models(
        args.models,
        input_shapes=shapes,
        trials=args.trials,
        out=args.out,
        target=target,
        seed=args.seed,
        strategy=args.strategy,
        latency_targets=targets,
        compare_default=args.compare_default,
        peers=() if args.no_peers else None,
        callbacks=callbacks,
        work_dir=args.work_dir,
        cost_model=cost_model_file(args, target),
        pretrained=not args.no_pretrained,
        conv_layout=args.conv_layout,
        algorithms=() if args.no_winograd else ALGORITHMS,
        precision=args.precision,
        final_rounds=args.final_rounds,
        timing=timing_config(args),
    )
    report = result.report
    failed = False
    for m in report["models"]:
        tuned = sum(1 for t in m["tasks"] if t["schedule"] == "tuned")
        print(f"model      {m['name']}: {tuned} of {len(m['tasks'])} tasks tuned")
        if m["error"]:
            failed = True
            print(f"error      {m['error']}")
            if m["check"].get("outputs"):
                print("\n".join(check_lines(m["check"])))
            continue
        for line in latency_lines(m) + check_lines(m["check"]):
            print(line)
        print(f"written    {m['directory']}/{library_name(report['target'])} and manifest.json")
    share = report["search_share"] or 0.0
    print(
        f"trials     {report['trials']} ({report['trials'] - report['resumed_trials']} this run, "
        f"{report['resumed_trials']} resumed); {report['tuning_seconds']:.0f} s tuning, search {share:.0%}"
    )
    if report.get("cost_model"):
        print(cost_model_line(report["cost_model"]))
    print(f"report     {args.out / 'report.json'}")
    return 1 if failed else 0


def cmd_run(args: argparse.Namespace) -> int:
    from tunefarm.gpu import is_gpu
    from tunefarm.models.finish import REFERENCE_NAME
    from tunefarm.models.peers import available_peers, latency_key
    from tunefarm.models.runtime import load_manifest, model_threads, run_model, time_side_by_side
    from tunefarm_app.tuned_report import latency_lines

    if args.repeat is not None and args.repeat < 1:
        raise UsageError("--repeat must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be at least 1")
    manifest = load_manifest(args.directory)
    specs = manifest["inputs"]
    given, missing = _run_inputs(args.input, specs)
    threads = args.threads or model_threads(args.directory)
    run = run_model(args.directory, given, repeat=0, threads=threads)
    reference = args.directory / REFERENCE_NAME
    # the peers (onnxruntime, OpenVINO) run on the CPU: beside a GPU's model they say nothing
    on_gpu = is_gpu(manifest.get("target") or {})
    peers = () if args.no_peers or on_gpu or not reference.is_file() else available_peers()
    latencies = time_side_by_side(
        {"tuned": args.directory}, given, threads=threads, onnx_model=reference if peers else None, peers=peers,
        runs=args.repeat,
    )
    timed: dict = {"latency": latencies["tuned"].as_report()}
    timed.update({latency_key(p): latencies[p].as_report() for p in peers})
    quiet = only_json(args)
    if not quiet:
        for line in latency_lines(timed):
            print(line)
        for s, out in zip(manifest["outputs"], run.outputs):
            print(f"output     {s['name']}: {out.dtype}{list(out.shape)}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        np.savez(args.out, **{s["name"]: o for s, o in zip(manifest["outputs"], run.outputs)})
        if not quiet:
            print(f"written    {args.out}")
    if missing and not quiet:
        print("inputs     " + ", ".join(s["name"] for s in missing) + " random (standard normal, seed 0)")
    emit_json(args, {
        **timed,
        "outputs": [{"name": s["name"], "dtype": str(o.dtype), "shape": list(o.shape)}
                    for s, o in zip(manifest["outputs"], run.outputs)],
        "random_inputs": [s["name"] for s in missing],
    })  # fmt: skip
    return 0


def _run_inputs(items: list[str], specs: list[dict]) -> tuple[dict[str, np.ndarray], list[dict]]:
    """`run`'s inputs: each `--input NAME=FILE.npy` checked against the manifest's inputs,
    the rest drawn at random (standard normal, seed 0); and the specs of those drawn."""
    from tunefarm.models.check import random_inputs

    given: dict[str, np.ndarray] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            raise UsageError(f"--input: expected NAME=FILE.npy, got {item!r}")
        spec = next((s for s in specs if s["name"] == name), None)
        if spec is None:
            raise UsageError(f"--input {name}: the model has no such input ({', '.join(s['name'] for s in specs)})")
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--input {name}: cannot read {path} as a .npy file ({exc})") from None
        if tuple(arr.shape) != tuple(spec["shape"]):
            raise UsageError(f"--input {name}: shape {list(arr.shape)}, the model takes {spec['shape']}")
        given[name] = arr.astype(spec["dtype"], copy=False)
    missing = [s for s in specs if s["name"] not in given]
    if missing:
        given.update(
            random_inputs({s["name"]: s["shape"] for s in missing}, {s["name"]: s["dtype"] for s in missing})
        )
    return given, missing


COMMANDS = {"tasks": cmd_tasks, "tune": cmd_tune, "run": cmd_run}
