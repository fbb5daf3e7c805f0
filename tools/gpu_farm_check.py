"""A farm job on this machine's NVIDIA GPU, start to end (a step of `tools/gpu_check.sh`).

`farm up` on a PostgreSQL given by URL (the check starts one) and a Redis of the farm's
own, for a CUDA class whose target is this GPU's (what an agent started with `--gpu`
registers), with the farm's agent started with `--gpu` (TUNEFARM_AGENT_GPU=1). A team
uploads an example model and asks for N trials on that class; the job must finish with:
- every candidate measured exactly once, every best confirmed once, every batch done
  (`services.db.measurement_audit`);
- the tuned model checked on the agent's GPU against onnxruntime, timed there (p50, p90,
  p99), `measured_on` naming the GPU;
- the artifact loading and running on the GPU with the three lines its manifest.json gives.

    python tools/gpu_farm_check.py --database-url URL --state-dir DIR [--model small_cnn]
        [--trials 18] [--timeout 240] [--json result.json]

Prints what it found; exit 0 when all holds, 1 when something does not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TERMINAL = ("succeeded", "failed", "cancelled")


def gpu_class_target() -> dict[str, Any]:
    """The CUDA target an agent started with `--gpu` registers on this machine."""
    from services.agent import capabilities

    return json.loads(capabilities.with_gpu_target(capabilities.detect())["target_json"])


def run_manifest_lines(directory: Path, inputs: list[dict[str, Any]]) -> str:
    """Run the three lines of manifest.json in a fresh Python in `directory` on random
    inputs of the model's shapes; what it printed (the output's shape), or raises."""
    from tunefarm.models.build import input_identifier

    manifest = json.loads((directory / "manifest.json").read_text())
    # the lines name the inputs as identifiers made of the model's input names
    setup = ["import numpy as np"] + [
        f"{input_identifier(s['name'], i)} = np.random.default_rng({i}).standard_normal({tuple(s['shape'])}).astype('{s['dtype']}')"
        for i, s in enumerate(inputs)
    ]
    lines = [line.split("  #")[0] for line in manifest["usage"]]
    code = "\n".join([*setup, *lines, "print('output', getattr(out, 'shape', type(out).__name__))"])
    done = subprocess.run([sys.executable, "-c", code], cwd=directory, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the manifest's lines failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--database-url", required=True)
    p.add_argument("--state-dir", type=Path, required=True)
    p.add_argument("--model", default="small_cnn", help="an example model (tunefarm.models.examples)")
    p.add_argument("--trials", type=int, default=18)
    p.add_argument("--workers", type=int, default=4, help="build workers (nvcc)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds the job may take")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    from services.db.measurement_audit import measurement_audit
    from services.db.session import make_session_factory, transaction
    from tunefarm.models.examples import export_example
    from tunefarm.models.finish import extract_archive
    from tunefarm_app.farm_client import ClientSettings, FarmClient
    from tunefarm_app.farm_local import FarmConfig, down, up

    target = gpu_class_target()
    klass = f"cuda-{target['arch']}-check"
    print(f"class {klass}: {json.dumps(target, sort_keys=True)}", flush=True)
    config = FarmConfig(
        state_dir=args.state_dir, database_url=args.database_url, workers=args.workers, device_class=klass,
        target=target, agent_env={"TUNEFARM_AGENT_GPU": "1"}, extra_env={"TUNEFARM_POLL_INTERVAL_SECS": "0.2"},
    )  # fmt: skip
    t0 = time.monotonic()
    farm = up(config, log=lambda msg: print(msg, flush=True))
    found: dict[str, Any] = {"class": klass, "target": target}
    problems: list[str] = []
    try:
        settings = ClientSettings.load(server=farm.info["api_url"], token=farm.info["team_token"])
        with FarmClient(settings) as client, tempfile.TemporaryDirectory() as tmp:
            agents = [d for d in client.devices() if d["device_class"] == klass]
            found["agents"] = [{"name": a["name"], "gpu": a["capabilities"].get("gpu_name")} for a in agents]
            print(f"farm up in {time.monotonic() - t0:.0f} s; agents of {klass}: {found['agents']}", flush=True)
            onnx = export_example(args.model, Path(tmp) / f"{args.model}.onnx")
            model = client.upload_model(onnx, {})
            job = client.create_job(model_id=model["id"], device_class=klass, trial_budget=args.trials)
            print(f"job {job['id']}: {len(job['tasks'])} tasks, {args.trials} trials", flush=True)
            t1 = time.monotonic()
            last = ""
            while job["state"] not in TERMINAL and time.monotonic() - t1 < args.timeout:
                time.sleep(2.0)
                job = client.job(job["id"])
                line = f"  {time.monotonic() - t1:5.0f} s {job['state']} trials {job['trials_used']}/{args.trials}"
                if line.split(" s ")[1] != last:
                    print(line, flush=True)
                    last = line.split(" s ")[1]
            found["job_secs"] = round(time.monotonic() - t1, 1)
            found["state"] = job["state"]
            result = job.get("result") or {}
            found["result"] = {k: result.get(k) for k in ("check", "latency", "measured_on", "tuned_tasks", "tasks", "stop_reason")}
            print(json.dumps(found["result"], indent=1, default=str), flush=True)
            if job["state"] != "succeeded":
                problems.append(f"job {job['state']} after {found['job_secs']} s: {job.get('error')}")
            else:
                check = result.get("check") or {}
                if check.get("ok") is not True:
                    problems.append(f"the model check did not pass: {check}")
                if not result.get("latency"):
                    problems.append("the model was not timed on the agent")
                if not (result.get("measured_on") or {}).get("gpu"):
                    problems.append(f"measured_on names no GPU: {result.get('measured_on')}")
                sessions = make_session_factory(farm.config.database_url)
                try:
                    with transaction(sessions) as s:
                        audit = measurement_audit(s, job["id"])
                finally:
                    sessions.kw["bind"].dispose()
                found["audit"] = audit.__dict__
                print(f"audit: {audit}", flush=True)
                problems += audit.problems(job["trials_used"])  # the budget may end early (a space exhausted)
                out = Path(tmp) / "tuned"
                extract_archive(client.artifact(job["id"]), out)
                manifest = json.loads((out / "manifest.json").read_text())
                found["artifact"] = sorted(p.name for p in out.iterdir())
                try:
                    found["manifest_run"] = run_manifest_lines(out, manifest["inputs"])
                    print(f"manifest.json's lines on the GPU: {found['manifest_run']}", flush=True)
                except Exception as exc:  # noqa: BLE001 - reported as a problem
                    problems.append(str(exc))
    finally:
        down(args.state_dir, grace=5.0)
    found["problems"] = problems
    if args.json:
        args.json.write_text(json.dumps(found, indent=1, default=str))
    print("OK" if not problems else "PROBLEMS:\n  " + "\n  ".join(problems))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
