"""The command line of a farm's users (a team), against a farm's API (`--server` or
TUNEFARM_SERVER; the team token from TUNEFARM_TOKEN or `--token-file PATH`, never the
command line, where `ps` shows it):

  tunefarm submit MODEL.onnx [--input-shape x=1,3,224,224] --device-class C --trials N
                  [--latency-target MS] [--strategy gradient|round-robin] [--seed S] [--no-winograd]
                  [--precision fp32|fp16] [--follow [--retry-secs S]]
  tunefarm status ID [--follow [--retry-secs S]] [--json]
  tunefarm fetch ID --out DIR [--records]
  tunefarm cancel ID
  tunefarm jobs [--limit N]
  tunefarm devices

An operator's commands, on the farm's machines (`farm up`, `db upgrade`, the service
processes): `operator_commands`. Errors are one line on stderr and exit status 2
(`tunefarm_app.cli`).
"""

from __future__ import annotations

import argparse
import json
import math
from datetime import UTC, datetime
from pathlib import Path

from tunefarm.display import printable
from tunefarm.errors import UsageError
from tunefarm.secret_flags import read_secret_file, refuse_on_command_line
from tunefarm_app.json_output import add_json_flag, emit_json, only_json


def add_commands(sub) -> None:
    s = sub.add_parser("submit", help="upload a model to a farm and start tuning it on a device class")
    s.add_argument("model", type=Path, help="an ONNX file")
    s.add_argument("--input-shape", action="append", default=[], metavar="NAME=d0,d1,...",
                   help="the shape of an input with dynamic dimensions (once per such input)")
    s.add_argument("--device-class", required=True, help="where to tune (tunefarm devices lists the classes)")
    s.add_argument("--trials", type=int, required=True, help="measurements in total over all the model's tasks")
    s.add_argument("--latency-target", metavar="[MODEL=]MS",
                   help="stop once the estimated latency is at most MS milliseconds (as tune takes it)")
    s.add_argument("--strategy", choices=["gradient", "round-robin"], default="gradient", help="task scheduler")
    s.add_argument("--seed", type=int, default=1, help="seed of the job's search (default 1)")
    s.add_argument("--no-winograd", action="store_true",
                   help="tune 3x3 stride-1 convolutions only as they are, not also by Winograd (as tune takes it)")
    s.add_argument("--precision", choices=["fp32", "fp16"], default="fp32",
                   help="fp16: float16 operands with float32 accumulation, on a CUDA class with tensor cores "
                   "(as tune takes it; default fp32)")
    s.add_argument("--name", help="the model's name (default: the file name)")
    s.add_argument("--follow", action="store_true",
                   help="show the live progress table until the job ends (retries a lost connection)")
    _follow_args(s)
    _client_args(s)

    st = sub.add_parser("status", help="a job's state, trials, per-task best and estimated latency")
    st.add_argument("job", type=int, help="the job's id")
    st.add_argument("--follow", action="store_true",
                    help="show the live progress table until the job ends (retries a lost connection)")
    add_json_flag(st, "the API's job")
    _follow_args(st)
    _client_args(st)

    f = sub.add_parser("fetch", help="download a finished job's tuned model (model.so or, for a CUDA class, "
                                     "model.cuda.tar; manifest, records, report)")
    f.add_argument("job", type=int, help="the job's id")
    f.add_argument("--out", type=Path, required=True, help="directory to unpack into")
    _client_args(f)

    c = sub.add_parser("cancel", help="cancel a job")
    c.add_argument("job", type=int, help="the job's id")
    _client_args(c)

    j = sub.add_parser("jobs", help="your team's jobs, newest first")
    j.add_argument("--limit", type=int, default=20, help="jobs to list (default 20)")
    add_json_flag(j, "the API's page of jobs")
    _client_args(j)

    d = sub.add_parser("devices", help="the farm's agents and device classes")
    add_json_flag(d, "the API's classes and agents (every CPU flag included)")
    _client_args(d)


def _follow_args(p) -> None:
    p.add_argument("--retry-secs", type=float, metavar="SECS",
                   help="while following, keep retrying a farm that does not answer this long "
                        "(default: TUNEFARM_FOLLOW_RETRY_SECS or 300)")


def _client_args(p) -> None:
    p.add_argument("--server", help="the farm's API, http://HOST:PORT or HOST:PORT (default: TUNEFARM_SERVER)")
    p.add_argument("--state-dir", type=Path,
                   help="a farm started here with `tunefarm farm up --state-dir D`: its API and team token "
                        "(default: TUNEFARM_STATE_DIR; --server, --token-file and their variables win)")
    p.add_argument("--token-file", metavar="PATH",
                   help="a file holding your team token (- reads stdin; default: TUNEFARM_TOKEN)")
    refuse_on_command_line(p, "--token", instead="TUNEFARM_TOKEN or --token-file PATH")


def _client(args: argparse.Namespace):
    from tunefarm_app.farm_client import ClientSettings, FarmClient

    retry = getattr(args, "retry_secs", None)
    if retry is not None and not (math.isfinite(retry) and retry >= 0):
        raise UsageError("--retry-secs must be a number of seconds, 0 or more")
    token = read_secret_file(args.token_file, "team token") if args.token_file else None
    return FarmClient(
        ClientSettings.load(server=args.server, token=token, follow_retry_secs=retry, state_dir=args.state_dir)
    )


def _follow(client, job_id: int) -> dict:
    """Follow a job with the live progress table (`tune`'s), retrying a lost farm."""
    from tunefarm_app.progress import JobProgressView

    view = JobProgressView()
    try:
        return client.follow(job_id, view.update, on_retry=lambda msg: view.note(f"farm       {msg}"))
    finally:
        view.close()


# -- a team's commands ------------------------------------------------------------------------


def cmd_submit(args: argparse.Namespace) -> int:
    from tunefarm_app.model_commands import parse_input_shapes

    if args.trials < 1:
        raise UsageError("--trials must be at least 1")
    target = _latency_target(args.latency_target, args.name or args.model.stem)
    if not args.model.is_file():
        raise UsageError(f"no such model file: {args.model}")
    shapes = parse_input_shapes(args.input_shape)
    with _client(args) as client:
        _check_device_class(client, args.device_class)  # before the upload: nothing stored for a typo
        model = client.upload_model(args.model, shapes, args.name)
        print(f"model      {model['id']}: {model['name']}, {len(model['tasks'])} tasks")
        for t in model["tasks"]:
            print(f"  task     {t['position']}: {t['name']} x{t['weight']} ({t['flops'] / 1e6:.2f} MFLOP, {t['share']:.0%})")
        for w in model["warnings"]:
            print(f"warning    {w}")
        job = client.create_job(
            model_id=model["id"],
            device_class=args.device_class,
            trial_budget=args.trials,
            latency_target_secs=target,
            strategy=args.strategy,
            seed=args.seed,
            winograd=False if args.no_winograd else None,  # None: the farm's default (on)
            precision=None if args.precision == "fp32" else args.precision,  # a farm before precision takes fp32
        )
        print(f"job        {job['id']}: {job['state']} on {job['device_class']}, {job['trial_budget']} trials")
        if not args.follow:
            print(f"follow it  tunefarm status {job['id']} --follow")
            return 0
        final = _follow(client, job["id"])
    return _print_end(final)


def _latency_target(given: str | None, model: str) -> float | None:
    """`--latency-target [MODEL=]MS` in seconds, with `tune`'s grammar; MODEL, when
    named, must be the model submitted."""
    from tunefarm_app.model_commands import parse_latency_targets

    if given is None:
        return None
    (name, secs), = parse_latency_targets([given], [model]).items()
    if name != model:
        raise UsageError(f"--latency-target names no model: {name} (this model is {model})")
    return secs


def _check_device_class(client, name: str) -> None:
    names = sorted(c["name"] for c in client.device_classes())
    if name not in names:
        known = ", ".join(names) if names else "none yet"
        raise UsageError(f"no device class {name!r} on this farm (classes: {known}; "
                         "an operator creates one with tunefarm farm device-class NAME)")


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.follow:
            final = _follow(client, args.job)
            return _print_end(final)
        job = client.job(args.job)
    emit_json(args, job)
    if not only_json(args):
        _print_job(job)
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    from tunefarm_app.artifact_fetch import FetchLimits, fetch_tuned_model

    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out} exists and is not a directory")
    with _client(args) as client:
        s = client.settings
        limits = FetchLimits(max_archive_bytes=s.fetch_max_bytes, max_entry_bytes=s.fetch_max_entry_bytes,
                             max_unpacked_bytes=s.fetch_max_unpacked_bytes)
        fetched = fetch_tuned_model(client, args.job, args.out, limits)
    print(f"fetched    job {args.job}: {len(fetched.files)} files in {args.out} ({fetched.archive_bytes} bytes)")
    for f in fetched.files:
        print(f"  {f.relative_to(args.out)}")
    print(f"run it     tunefarm run {args.out}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.cancel(args.job)
    pending = " (the scheduler stops it shortly)" if job["state"] not in ("cancelled",) else ""
    print(f"job        {job['id']}: {job['state']}{pending}")
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    from tunefarm_app.progress import format_cost

    with _client(args) as client:
        page = client.jobs(limit=args.limit)
    emit_json(args, page)
    if only_json(args):
        return 0
    if not page["items"]:
        print("no jobs yet")
        return 0
    print(f"{'job':>6}  {'state':<10} {'trials':>13}  {'device class':<24} {'model':<24} est. latency")
    for j in page["items"]:
        est = format_cost(j["est_latency_secs"]) if j["est_latency_secs"] else "-"
        trials = f"{j['trials_used']}/{j['trial_budget']}"
        measured = "".join(f"  {j[key]:.2f}x {peer}" for key, peer in (("speedup_vs_onnxruntime", "onnxruntime"),
                           ("speedup_vs_openvino", "OpenVINO")) if j.get(key))  # fmt: skip
        measured += " (measured)" if measured else ""
        print(printable(f"{j['id']:>6}  {j['state']:<10} {trials:>13}  {j['device_class']:<24} "
                        f"{j['model_name']:<24} {est}{measured}"))
    if page["next_cursor"]:
        print(f"(more: older than job {page['next_cursor']})")
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    with _client(args) as client:
        classes = client.device_classes()
        agents = client.devices()
    emit_json(args, {"device_classes": classes, "agents": agents})
    if only_json(args):
        return 0
    for c in classes:
        print(f"class      {c['name']}: {c['agents_online']} agent(s) online, target {json.dumps(c['target'])}")
    now = datetime.now(UTC)
    for a in agents:
        errors = ", ".join(f"{k} {v}" for k, v in sorted(a["errors_by_kind"].items())) or "no errors"
        # The name and capabilities are the agent's word: printed escaped (no terminal escapes).
        print(printable(f"agent      {a['name']} ({a['device_class']}; {_machine(a['capabilities'])}): {a['state']}, "
                        f"{a['measurements_done']} measured, {errors}; last heartbeat "
                        f"{_ago(a['last_heartbeat_at'], now)}", 2000))
        print(f"  timings  {_standing(a)}")
    if not classes and not agents:
        print("no device classes or agents yet")
    return 0


VECTOR_ISA_ORDER = ("amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx2", "avx", "sse4_2", "sve2", "sve",
                    "asimddp", "asimd", "neon")
"""The vector ISA features worth a word in a machine's line, widest first (an agent
reports dozens of CPU flags; `--json` has them all)."""


def _machine(caps: dict) -> str:
    """An agent's machine in a few words: arch, cores, its widest vector ISA, emulation."""
    machine = f"{caps.get('arch', '?')}, {caps.get('logical_cores', '?')} cores"
    features = set(caps.get("isa_features") or ())
    widest = [f for f in VECTOR_ISA_ORDER if f in features][:2]
    if widest:
        machine += f", {' '.join(widest)}"
    if caps.get("emulated"):
        machine += ", EMULATED (timings are the emulator's)"
    return machine


def _ago(stamp: str | None, now: datetime) -> str:
    """An API timestamp as the time since it ("12 s ago"); "never" for none."""
    if not stamp:
        return "never"
    try:
        then = datetime.fromisoformat(stamp)
    except ValueError:
        return stamp
    if then.tzinfo is None:
        then = then.replace(tzinfo=UTC)
    secs = max(0.0, (now - then).total_seconds())
    if secs < 120:
        return f"{secs:.0f} s ago"
    if secs < 7200:
        return f"{secs / 60:.0f} min ago"
    if secs < 172800:
        return f"{secs / 3600:.0f} h ago"
    return f"{then:%Y-%m-%d %H:%M} UTC"


def _standing(agent: dict) -> str:
    """An agent's standing (services.db.trust) in a line: FLAGGED and why, in capitals."""
    standing = agent.get("standing", "unconfirmed")
    counts = (f"{agent.get('confirmations_agreed', 0)} confirmed, {agent.get('confirmations_disputed', 0)} disputed, "
              f"{agent.get('below_floor', 0)} below the floor")
    if standing in ("flagged", "quarantined"):
        reasons = "; ".join(agent.get("flag_reasons") or [])
        return f"{standing.upper()}{': ' + reasons if reasons else ''} ({counts})"
    return f"{standing} ({counts})"


def _print_end(job: dict) -> int:
    _print_job(job)
    return 0 if job["state"] == "succeeded" else 1


def pretrained_text(pre: dict, *, started: bool) -> str:
    """A job's pretrained base (the API's `cost_model.pretrained`) in words: the job
    `started` from it (its class had no model of its own), or its class's model is on top of it."""
    learnt = (f"{pre.get('objective') or '?'} objective, {pre.get('programs') or '?'} programs of "
              f"{pre.get('tasks') or '?'} tasks on {pre.get('classes', 0)} device classes")  # fmt: skip
    family = pre.get("family") or "?"
    if started:
        return f"the pretrained {family} model ({learnt}): this class had no model of its own"
    return f"over the pretrained {family} model ({learnt})"


def _print_job(job: dict) -> None:
    from tunefarm_app.progress import format_cost
    from tunefarm_app.tuned_report import latency_text, peer_lines

    def cost(v):
        return format_cost(v) if v else "-"

    print(f"job        {job['id']}: {job['state']}" + (" (cancel requested)" if job["cancel_requested"] and job["state"] not in ("cancelled",) else ""))
    print(f"model      {job['model_id']}: {job['model_name']} on {job['device_class']}")
    print(f"trials     {job['trials_used']} of {job['trial_budget']}")
    if job.get("waiting"):
        print(f"waiting    {job['waiting'].removeprefix('waiting: ')}")
    print(f"latency    {cost(job['est_latency_secs'])} estimated now, {cost(job['est_latency_start_secs'])} at the start")
    for t in job["tasks"]:
        dead = f"  ({t['dead_reason']})" if t["dead_reason"] else ""
        emulated = " (emulated)" if t.get("best_emulated") else ""
        unconfirmed = ""
        if t["best_secs"] and not t.get("best_confirmed"):
            unconfirmed = f" (unconfirmed; confirmed {cost(t.get('confirmed_best_secs'))})"
        leads = f" by {t['algorithm']}" if t.get("alternatives") else ""
        print(f"  task     {t['position']}: {t['name']} x{t['weight']}: {t['trials']} trials, "
              f"best {cost(t['best_secs'])}{leads}{emulated}{unconfirmed}{dead}")
        for a in t.get("alternatives") or []:  # the programs of a task also tuned by Winograd
            stopped = f"  ({a['dead_reason']})" if a["dead_reason"] else ""
            print(f"             {a['algorithm']}: {a['trials']} trials, best {cost(a['best_secs'])}{stopped}")
    cm = job["cost_model"]
    src = cm.get("transferred_from")
    if src and cm.get("device_class") != job["device_class"]:
        print(f"cost model class {src['device_class']}'s version {src['version']}, transferred (this class had none)")
    elif src:
        print(f"cost model version {cm['version']} of this class, descending from class {src['device_class']}'s "
              f"version {src['version']} (transferred)")
    pre = cm.get("pretrained")
    if pre:
        print(f"cost model {pretrained_text(pre, started=cm.get('version') is None)}")
    if cm["trained_on_at_first_batch"] is not None:
        ranked = "at random" if not cm["trained_on_at_first_batch"] else f"by the class's model ({cm['trained_on_at_first_batch']} programs)"
        if pre and not cm["trained_on_at_first_batch"]:
            ranked = "by the pretrained model"
        print(f"first batch ranked {ranked}")
    if job["error"]:
        print(f"error      {job['error']}")
    if job["result"]:
        lat = job["result"].get("latency")
        on = job["result"].get("measured_on") or {}
        where = f" on {on['agent']}" if on.get("agent") else ""
        if where and on.get("gpu"):
            where += f" ({on['gpu']})"
        if lat:
            emulated = " (EMULATED: the emulator's time, not the device's)" if lat.get("emulated") else ""
            print(f"tuned      {latency_text(lat)}{where}{emulated}")
        for line in peer_lines(job["result"], where):  # onnxruntime's, OpenVINO's, or why not
            print(line)
        for key, short, peer in (("speedup_vs_onnxruntime", "ORT", "onnxruntime"), ("speedup_vs_openvino", "OpenVINO", "OpenVINO")):
            if job.get(key):
                basis = "rounds' p50s" if (job["result"].get("latency") or {}).get("round_medians") else "p50"
                print(f"{'vs ' + short:<10} {job[key]:.2f}x the speed of {peer} ({basis}, measured, same input and threads)")
        check = job["result"].get("check") or {}
        if check.get("ok"):
            print(f"check      matches {check['reference']}{where} (max abs error {check['max_abs_error']:.2g})")
        elif check.get("problem"):
            print(f"check      {check['problem']}")
    if job["artifact"]["available"]:
        print(f"fetch it   tunefarm fetch {job['id']} --out DIR")


COMMANDS = {
    "submit": cmd_submit,
    "status": cmd_status,
    "fetch": cmd_fetch,
    "cancel": cmd_cancel,
    "jobs": cmd_jobs,
    "devices": cmd_devices,
}
