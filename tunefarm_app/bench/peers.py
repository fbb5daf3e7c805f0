"""The bench's peers, each run in a child process of its own: TVM MetaSchedule and the
vendor libraries (numpy/OpenBLAS, PyTorch CPU when installed).

Parent side: `run_metaschedule` and `run_vendor` start `python -m tunefarm_app.bench.peers
{metaschedule|vendor} ...`, wait for it with a time limit and read the JSON result file
it writes. Whatever the child does (raises, crashes, hangs), they return a `PeerRun` whose
`result` is None and whose `note` says why; they never raise for a failing peer. A child
that runs out of time is killed with its whole process group (MetaSchedule's build and run
pools included). The child's stdout and stderr go to a log file beside the result.

Child side: `main` parses the arguments, does the work (`ms_peer.tune_metaschedule`, or
a `vendors` thunk checked against the task data's expected outputs and then timed), and
writes the result as JSON, or {"error": "..."} when it fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunefarm_app.bench.suite import BenchOp

VENDOR_TIMEOUT_SECS = 300.0
"""Time limit of a vendor child (start-up, the output check and the timing)."""

MS_TIMEOUT_BASE_SECS = 900.0
"""Time limit of a MetaSchedule child: this much for start-up and the final compile..."""

MS_TIMEOUT_SECS_PER_TRIAL = 15.0
"""...plus this much per requested trial."""

THREAD_ENV_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "TVM_NUM_THREADS")
"""Thread-count variables set to the target's cores in every child."""


@dataclass(frozen=True)
class PeerRun:
    """How one child went: its JSON result (None when it failed), why not, and its wall time."""

    result: dict[str, Any] | None
    note: str
    secs: float
    log: Path


# -- parent side ---------------------------------------------------------------------------


def ms_timeout(trials: int) -> float:
    return MS_TIMEOUT_BASE_SECS + MS_TIMEOUT_SECS_PER_TRIAL * trials


def run_metaschedule(
    op: BenchOp,
    *,
    target: dict[str, Any],
    trials: int,
    out_dir: Path,
    seed: int,
    threads: int,
    timeout: float | None = None,
) -> PeerRun:
    """Tune `op` with MetaSchedule in a child (`threads` CPU threads); the best kernel goes
    to `<out_dir>/<op>.so` (`<op>.cuda.tar` for a CUDA target)."""
    from tunefarm.export import artifact_suffix

    argv = [
        "metaschedule",
        *_workload_args(op),
        "--target", json.dumps(target),
        "--trials", str(trials),
        "--work-dir", str(out_dir / op.id),
        "--library", str(out_dir / f"{op.id}{artifact_suffix(target)}"),
        "--seed", str(seed),
    ]  # fmt: skip
    return run_child(
        argv,
        result_path=out_dir / f"{op.id}.json",
        log_path=out_dir / f"{op.id}.log",
        timeout=timeout if timeout is not None else ms_timeout(trials),
        threads=threads,
    )


def run_vendor(
    lib: str, op: BenchOp, *, task_data: Path, threads: int, out_dir: Path, device: str = "cpu"
) -> PeerRun:
    """Check and time `op` with vendor library `lib` ("numpy" or "torch") in a child, on
    `device` ("cpu", or "cuda" for torch: this machine's GPU)."""
    log = out_dir / f"{op.id}.log"
    if lib == "torch" and importlib.util.find_spec("torch") is None:
        return PeerRun(None, "torch is not installed", 0.0, log)
    argv = [
        "vendor",
        "--lib", lib,
        *_workload_args(op),
        "--task-data", str(task_data),
        "--threads", str(threads),
        "--device", device,
    ]  # fmt: skip
    return run_child(
        argv,
        result_path=out_dir / f"{op.id}.json",
        log_path=log,
        timeout=VENDOR_TIMEOUT_SECS,
        threads=threads,
    )


def run_child(argv: list[str], *, result_path: Path, log_path: Path, timeout: float, threads: int) -> PeerRun:
    """Run `python -m tunefarm_app.bench.peers <argv> --result <result_path>` and read its result."""
    result_path.parent.mkdir(parents=True, exist_ok=True)
    result_path.unlink(missing_ok=True)
    env = {**os.environ, **{var: str(threads) for var in THREAD_ENV_VARS}}
    cmd = [sys.executable, "-m", "tunefarm_app.bench.peers", *argv, "--result", str(result_path)]
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return PeerRun(
                None, f"timed out after {timeout:.0f} s (log: {log_path})", time.perf_counter() - t0, log_path
            )
        except BaseException:  # Ctrl-C: do not leave the child tuning in the background
            _kill_group(proc)
            raise
    secs = time.perf_counter() - t0
    _kill_group(proc)  # pool workers the child may have left behind
    result = _read_result(result_path)
    if result is None:
        return PeerRun(
            None, f"exited with code {code} and no result ({_last_line(log_path)})", secs, log_path
        )
    if "error" in result:
        return PeerRun(None, str(result["error"]), secs, log_path)
    return PeerRun(result, "", secs, log_path)


def _workload_args(op: BenchOp) -> list[str]:
    return ["--registry", op.registry, "--params", json.dumps(dict(op.params)), "--const", json.dumps(op.constants)]


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _read_result(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    return f"last log line: {lines[-1][:200]}" if lines else f"log: {path}"


# -- child side ----------------------------------------------------------------------------


def _child_metaschedule(args: argparse.Namespace) -> dict[str, Any]:
    from tunefarm.workloads.registry import make
    from tunefarm_app.bench.ms_peer import tune_metaschedule

    workload = make(args.registry, json.loads(args.params)).with_constants(json.loads(args.const))
    outcome = tune_metaschedule(
        workload.mod,
        json.loads(args.target),
        constants=workload.constants,
        trials=args.trials,
        work_dir=Path(args.work_dir),
        library=Path(args.library),
        seed=args.seed,
    )
    return outcome.as_dict()


def _child_metaschedule_model(args: argparse.Namespace) -> dict[str, Any]:
    from tunefarm_app.bench.ms_peer import tune_metaschedule_model

    outcome = tune_metaschedule_model(
        Path(args.onnx),
        json.loads(args.input_shapes),
        json.loads(args.target),
        trials=args.trials,
        work_dir=Path(args.work_dir),
        out_dir=Path(args.out_dir),
        seed=args.seed,
    )
    return outcome.as_dict()


def run_metaschedule_model(
    onnx: Path, input_shapes: dict[str, list[int]], *, target: dict[str, Any], trials: int, out_dir: Path,
    seed: int, timeout: float | None = None,
) -> PeerRun:
    """MetaSchedule's `tune_relax` on a whole model, in a child process."""
    out_dir.mkdir(parents=True, exist_ok=True)
    threads = int(target.get("num-cores") or 1)
    argv = [
        "metaschedule-model",
        "--onnx", str(onnx),
        "--input-shapes", json.dumps(input_shapes),
        "--target", json.dumps(target),
        "--trials", str(trials),
        "--work-dir", str(out_dir / "db"),
        "--out-dir", str(out_dir / "model"),
        "--seed", str(seed),
    ]  # fmt: skip
    return run_child(
        argv,
        result_path=out_dir / "result.json",
        log_path=out_dir / "metaschedule.log",
        timeout=timeout if timeout is not None else ms_timeout(trials),
        threads=threads,
    )


def _child_vendor(args: argparse.Namespace) -> dict[str, Any]:
    from tunefarm.measure.runner import kernel_output_mismatch
    from tunefarm.measure.task_data import read_task_data
    from tunefarm_app.bench import vendors

    data = read_task_data(args.task_data)
    p = vendors.resolve_params(args.registry, json.loads(args.params))
    if args.lib == "numpy":
        call = vendors.bind_numpy(args.registry, p, data.inputs)
    else:
        call = vendors.bind_torch(args.registry, p, data.inputs, args.threads, args.device)
    if call is None:
        return {"error": f"{args.lib} has no implementation of {args.registry}"}
    if data.expected is not None:
        problem = kernel_output_mismatch(call.outputs(), data.expected)
        if problem:
            return {"error": f"{args.lib}'s output is wrong: {problem}"}
    timing = vendors.time_call(call)
    return {"median_secs": timing.median_secs, "samples": timing.samples, "calls": timing.calls}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tunefarm_app.bench.peers")
    sub = p.add_subparsers(dest="peer", required=True)
    ms = sub.add_parser("metaschedule")
    v = sub.add_parser("vendor")
    mm = sub.add_parser("metaschedule-model")
    for s in (ms, v):
        s.add_argument("--registry", required=True)
        s.add_argument("--params", default="{}")
        s.add_argument("--const", default="[]")
    for s in (ms, v, mm):
        s.add_argument("--result", required=True)
    mm.add_argument("--onnx", required=True)
    mm.add_argument("--input-shapes", default="{}")
    mm.add_argument("--target", required=True)
    mm.add_argument("--trials", type=int, required=True)
    mm.add_argument("--work-dir", required=True)
    mm.add_argument("--out-dir", required=True)
    mm.add_argument("--seed", type=int, default=1)
    ms.add_argument("--target", required=True)
    ms.add_argument("--trials", type=int, required=True)
    ms.add_argument("--work-dir", required=True)
    ms.add_argument("--library", required=True)
    ms.add_argument("--seed", type=int, default=1)
    v.add_argument("--lib", choices=("numpy", "torch"), required=True)
    v.add_argument("--task-data", required=True)
    v.add_argument("--threads", type=int, default=1)
    v.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        child = {
            "metaschedule": _child_metaschedule,
            "metaschedule-model": _child_metaschedule_model,
            "vendor": _child_vendor,
        }[args.peer]
        result = child(args)
    except Exception as exc:
        traceback.print_exc()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        result = {"error": f"{type(exc).__name__}: {first}"[:500]}
    Path(args.result).write_text(json.dumps(result, indent=1))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    raise SystemExit(main())
