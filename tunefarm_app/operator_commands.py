"""The command line of a farm's operator, on the farm's machines:

  tunefarm farm up --state-dir D [--workers 2] [--agents 1] [--database-url URL]
                   [--redis-url redis://:PASSWORD@HOST:PORT/0 [--redis-without-password]]
                   [--tls-cert F --tls-key F [--tls-ca F] [--tls-client-ca F --agent-tls-cert F --agent-tls-key F]]
                   (a detached supervisor starts again what dies: its pid in D/farm.json, its log D/logs/farm.log)
  tunefarm farm status --state-dir D      the farm's processes: running, started again, given up
  tunefarm farm down --state-dir D        the supervisor first, then the processes
  tunefarm farm team NAME [--value-file F]    a team and a new team token (or store F's, - for stdin)
  tunefarm farm agent-token [--value-file F]  a new agent token (or store F's)
  tunefarm farm token list [--team T] [--kind team|agent]
  tunefarm farm token revoke ID|PREFIX|TOKEN   refused by the API and the lease service at once
  tunefarm farm device-class NAME [--target JSON]
  tunefarm farm agent quarantine|unquarantine|unflag NAME   no leases, its unconfirmed timings ignored / back / pardoned
  tunefarm farm signing-key --private-key F --public-key F   the farm's code-signing key pair
  tunefarm db upgrade                     run the database migrations
  tunefarm api | scheduler | worker | agent | lease-service [ARGS...]   one process each

A team's commands, against a farm's API: `farm_commands`. Errors are one line on stderr
and exit status 2 (`tunefarm_app.cli`). The processes run with umask 077: what they write
(artifacts, uploads, logs) is their user's alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from pathlib import Path

from tunefarm.errors import UsageError
from tunefarm.secret_flags import read_secret_file, refuse_on_command_line

PROCESS_UMASK = 0o077
"""Files the farm's processes create are readable by their user only."""

VALUE_FILE_HELP = "store the token in this file (a deployment's secret; - reads stdin) instead of making one"

DATABASE_URL_HELP = "SQLAlchemy URL of the farm database (default: TUNEFARM_DATABASE_URL, else the local PostgreSQL)"
FARM_DATABASE_HELP = ("SQLAlchemy URL of the farm database (default: the --state-dir farm's, else "
                      "TUNEFARM_DATABASE_URL; with neither, the command is refused)")

SERVICE_COMMANDS = {
    "api": ("services.api.app", "the farm's HTTP API (uvicorn)"),
    "scheduler": ("services.scheduler.service", "the scheduler service: every job's search"),
    "worker": ("services.worker.cli", "an RQ build worker for the farm's device classes"),
    "agent": ("services.agent.cli", "a device agent: measure kernels for a farm"),
    "lease-service": ("services.lease.cli", "the gRPC service agents dial into"),
}
"""`tunefarm <name> ARGS...` runs `main(ARGS)` of the module (each parses its own flags)."""


def add_commands(sub) -> None:
    """The service processes, `db` and `farm`, after the team's commands."""
    # Each process parses its own flags: these subcommands hand every argument over.
    parser_class, sub._parser_class = sub._parser_class, _PassThrough
    try:
        for name, (_, help_text) in SERVICE_COMMANDS.items():
            sub.add_parser(name, help=help_text, add_help=False)
    finally:
        sub._parser_class = parser_class

    db = sub.add_parser("db", help="the farm database")
    dbsub = db.add_subparsers(dest="db_command", required=True)
    up = dbsub.add_parser("upgrade", help="run the migrations to the newest schema")
    up.add_argument("--database-url", help=DATABASE_URL_HELP)
    up.add_argument("--create", action="store_true", help="create the database first if it does not exist")

    farm = sub.add_parser("farm", help="run a whole farm on this machine; operator actions")
    fsub = farm.add_subparsers(dest="farm_command", required=True)
    _add_farm_up(fsub)
    fd = fsub.add_parser("down", help="stop a farm started with farm up")
    fd.add_argument("--state-dir", type=Path, help="the --state-dir given to farm up (default: TUNEFARM_STATE_DIR)")
    fs = fsub.add_parser("status", help="the processes of a farm started with farm up: running, started again, given up")
    fs.add_argument("--state-dir", type=Path, help="the --state-dir given to farm up (default: TUNEFARM_STATE_DIR)")
    _add_token_commands(fsub)
    _add_agent_commands(fsub)
    fc = fsub.add_parser("device-class", help="create a device class")
    fc.add_argument("name", help="the class's name (jobs and agents name it)")
    fc.add_argument("--target", help="TVM target as a JSON dict (default: this machine)")
    fc.add_argument("--description", default="", help="a line shown with the class")
    _farm_database_args(fc)
    fk = fsub.add_parser("signing-key", help="make the farm's code-signing key pair (kept if it exists)")
    fk.add_argument("--private-key", type=Path, required=True,
                    help="the private key (PEM, made mode 0600): TUNEFARM_SIGNING_KEY_FILE of workers and the scheduler")
    fk.add_argument("--public-key", type=Path, required=True,
                    help="the public key (PEM, written from the private one): every agent's --signing-public-key")


def _add_farm_up(fsub) -> None:
    fu = fsub.add_parser("up", help="start api, lease service, scheduler, workers and a CPU agent here")
    fu.add_argument("--state-dir", type=Path, required=True, help="farm.json, logs and artifacts go here")
    fu.add_argument("--workers", type=int, default=2, help="build workers (default 2)")
    fu.add_argument("--agents", type=int, default=1, help="CPU agents on this machine (default 1)")
    fu.add_argument("--api-bind", default="127.0.0.1:0", help="HOST:PORT of the API (port 0: a free one)")
    fu.add_argument("--lease-bind", default="127.0.0.1:0", help="HOST:PORT of the lease service")
    fu.add_argument("--database-url", help=DATABASE_URL_HELP)
    fu.add_argument("--redis-url", help="a Redis with a password, redis://:PASSWORD@HOST:PORT/0 (rediss:// for TLS; "
                    "default: TUNEFARM_REDIS_URL, else the farm starts its own redis-server with a generated password)")
    fu.add_argument("--redis-without-password", action="store_true",
                    help="accept a --redis-url without a password (anyone who reaches it can write the build queues)")
    fu.add_argument("--queue-prefix", default="tunefarm", help="prefix of the farm's Redis queues")
    fu.add_argument("--team", default="local", help="the team whose token farm.json holds")
    fu.add_argument("--device-class", help="name of this CPU's class (default: arch-cpu-cores)")
    fu.add_argument("--tls-cert", type=Path, help="serve the agents' gRPC over TLS with this PEM certificate chain")
    fu.add_argument("--tls-key", type=Path, help="the certificate's PEM private key")
    fu.add_argument("--tls-ca", type=Path,
                    help="the CA (PEM) the local agent checks the certificate against (default: the system's roots)")
    fu.add_argument("--tls-client-ca", type=Path, help="mutual TLS: agents must present a certificate this PEM CA signed")
    fu.add_argument("--agent-tls-cert", type=Path, help="the local agent's client certificate (PEM), for mutual TLS")
    fu.add_argument("--agent-tls-key", type=Path, help="the local agent's client key (PEM)")
    fu.add_argument("--tls-server-name",
                    help="the name in the certificate the local agent checks (default: the lease service's host)")
    fu.add_argument(
        "--extra-class",
        action="append",
        default=[],
        metavar="NAME=TARGET",
        help="another class served here by its own worker and agent, TARGET a TVM JSON target whose code this "
        'CPU runs, e.g. v2=\'{"kind": "llvm", "mcpu": "x86-64-v2"}\' (repeatable)',
    )


def _add_token_commands(fsub) -> None:
    """`farm team`, `farm agent-token`, `farm token list|revoke`."""
    ft = fsub.add_parser("team", help="create a team (if needed) and print a new token for it")
    ft.add_argument("name", help="the team's name")
    fa = fsub.add_parser("agent-token", help="print a new agent token")
    for p in (ft, fa):
        p.add_argument("--value-file", metavar="PATH", help=VALUE_FILE_HELP)
        refuse_on_command_line(p, "--value", instead="--value-file PATH (- reads stdin)")
        _farm_database_args(p)
    tok = fsub.add_parser("token", help="list or revoke team and agent tokens")
    toksub = tok.add_subparsers(dest="token_command", required=True)
    tl = toksub.add_parser("list", help="every token: id, kind, team, prefix, label, created, revoked")
    tl.add_argument("--team", help="only this team's tokens")
    tl.add_argument("--kind", choices=["team", "agent"], help="only tokens of this kind")
    _farm_database_args(tl)
    tr = toksub.add_parser("revoke", help="revoke a token: refused at once; an agent token's agents get no more work")
    tr.add_argument("token", help="the token's id or prefix (as `farm token list` shows them), or the token itself")
    _farm_database_args(tr)


def _farm_database_args(p) -> None:
    """An operator command's database: a farm started here (`--state-dir`), or a URL."""
    p.add_argument("--state-dir", type=Path,
                   help="the --state-dir of a farm started with farm up: its database (default: TUNEFARM_STATE_DIR)")
    p.add_argument("--database-url", help=FARM_DATABASE_HELP)


def _add_agent_commands(fsub) -> None:
    """`farm agent quarantine|unquarantine|unflag NAME`."""
    fag = fsub.add_parser("agent", help="quarantine an agent whose timings are not believed, or let it back")
    fagsub = fag.add_subparsers(dest="agent_command", required=True)
    for name, help_text in (
        ("quarantine", "no more leases; its unconfirmed measurements count for no best and train no model"),
        ("unquarantine", "lease to it again (once it heartbeats); its measurements count again"),
        ("unflag", "forget its results below the floor and its disputed timings: a flagged agent is leased "
                   "nothing until an operator does this"),
    ):
        q = fagsub.add_parser(name, help=help_text)
        q.add_argument("name", help="the agent's name (as `tunefarm devices` shows it)")
        _farm_database_args(q)


class _PassThrough(argparse.ArgumentParser):
    """A subcommand whose arguments, flags included, all go to the process's own `main`."""

    def parse_known_args(self, args=None, namespace=None):
        namespace = namespace if namespace is not None else argparse.Namespace()
        namespace.args = list(args or [])
        return namespace, []


def cmd_service(args: argparse.Namespace) -> int:
    import importlib

    from pydantic import ValidationError

    from services.common.settings import settings_problem
    from services.db.exceptions import DatabaseError

    module = importlib.import_module(SERVICE_COMMANDS[args.command][0])
    os.umask(PROCESS_UMASK)
    try:
        return int(module.main(list(args.args)) or 0)
    except DatabaseError as exc:  # e.g. the schema is not migrated: one line, not a traceback
        raise UsageError(f"{args.command}: {exc}") from None
    except ValidationError as exc:  # a bad TUNEFARM_ setting: the variable and what is wrong
        raise UsageError(f"{args.command}: {settings_problem(exc)}") from None


def cmd_db(args: argparse.Namespace) -> int:
    from services.db.exceptions import DatabaseError
    from services.db.migrate import create_database, current_revision, database_exists, upgrade
    from services.db.session import SQLAlchemyError

    url = _database_url(args.database_url)
    try:
        if args.create and not database_exists(url):
            create_database(url)
        upgrade(url)
        print(f"database   at revision {current_revision(url)}")
    except (DatabaseError, SQLAlchemyError) as exc:
        raise UsageError(f"db upgrade: {_first_line(exc)}") from None
    return 0


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    lines = [ln.strip() for ln in str(orig).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def cmd_farm(args: argparse.Namespace) -> int:
    return FARM_COMMANDS[args.farm_command](args)


def _farm_up(args: argparse.Namespace) -> int:
    from tunefarm_app.farm_local import FarmConfig
    from tunefarm_app.farm_redis import redact
    from tunefarm_app.farm_supervisor import RestartPolicy, up_supervised
    from tunefarm_app.farm_tls import FarmTls

    if args.workers < 1 or args.agents < 1:
        raise UsageError("--workers and --agents must be at least 1")
    policy = RestartPolicy.from_environment()  # its TUNEFARM_RESTART_* delays, checked before anything starts
    tls = None
    tls_flags = (args.tls_ca, args.tls_client_ca, args.agent_tls_cert, args.agent_tls_key, args.tls_server_name)
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise UsageError("--tls-cert and --tls-key go together")
        tls = FarmTls(args.tls_cert, args.tls_key, args.tls_ca, args.tls_client_ca, args.agent_tls_cert,
                      args.agent_tls_key, args.tls_server_name)
        tls.check()
    elif any(f is not None for f in tls_flags):
        raise UsageError("the TLS flags need --tls-cert and --tls-key (the lease service's certificate)")
    config = FarmConfig(
        state_dir=args.state_dir,
        database_url=_database_url(args.database_url),
        redis_url=_redis_url(args.redis_url),
        redis_without_password=args.redis_without_password,
        queue_prefix=args.queue_prefix,
        api_bind=args.api_bind,
        lease_bind=args.lease_bind,
        workers=args.workers,
        agents=args.agents,
        team=args.team,
        device_class=args.device_class,
        tls=tls,
        extra_classes=_extra_classes(args.extra_class),
    )
    info = up_supervised(config.state_dir, lambda log: _up(config, log), policy=policy)
    print(f"api        {info['api_url']}")
    print(f"dashboard  {info['api_url']}/ui (log in with the team token in farm.json); metrics at /metrics")
    print(f"grpc       {info['grpc_address']}" + (" (TLS)" if info.get("grpc_tls") else " (plaintext)"))
    print(f"redis      {redact(info['redis_url'])}" + (" (the farm's own)" if info["own_redis"] else ""))
    print(f"class      {info['device_class']}")
    for name in info["extra_classes"]:
        print(f"class      {name} (extra)")
    for name, p in info["processes"].items():
        print(f"process    {name}: pid {p['pid']}, log {p['log']}")
    supervisor = info["supervisor"]
    print(f"supervisor pid {supervisor['pid']}: starts again what exits (log {supervisor['log']}; tunefarm farm status)")
    print(f"state      {args.state_dir / 'farm.json'} (holds the team and agent tokens and the Redis password)")
    print("clients    the team's and the operator's commands find this farm with:")
    print(f"export TUNEFARM_STATE_DIR={shlex.quote(str(args.state_dir.resolve()))}")
    return 0


def _up(config, log):
    """`farm_local.up` (in farm up's supervisor), a database that fails it as a `UsageError`."""
    from services.db.exceptions import DatabaseError
    from services.db.session import SQLAlchemyError
    from tunefarm.isolation import WITHOUT_TORCH, block_imports
    from tunefarm_app.farm_local import up

    # The host's target asks TVM, whose FFI imports torch whenever it is installed: a
    # second or more of every `farm up`, and memory the supervisor would keep, for
    # nothing it uses (this runs in the supervisor, a child of the command).
    block_imports(WITHOUT_TORCH)
    try:
        return up(config, log=log)
    except (DatabaseError, SQLAlchemyError) as exc:
        raise UsageError(f"farm up: the database at {config.database_url}: {_first_line(exc)}") from None


def _extra_classes(values: list[str]) -> dict[str, dict]:
    """`--extra-class NAME=TARGET` values as name -> target (the host runs each: checked)."""
    from tunefarm.isa import check_runs_on_host
    from tunefarm.target import parse_target

    out: dict[str, dict] = {}
    for value in values:
        name, sep, text = value.partition("=")
        if not sep or not name.strip() or not text.strip():
            raise UsageError(f"--extra-class wants NAME=TARGET, got {value!r}")
        target = parse_target(text)
        check_runs_on_host(target, f"--extra-class {name.strip()}")
        out[name.strip()] = target
    return out


def _farm_down(args: argparse.Namespace) -> int:
    from tunefarm_app.farm_local import down

    stopped = down(_state_dir(args))
    print(f"stopped    {', '.join(stopped) if stopped else 'nothing (no process was running)'}")
    return 0


def _farm_status(args: argparse.Namespace) -> int:
    from tunefarm_app.farm_status import farm_status, status_lines

    for line in status_lines(farm_status(_state_dir(args))):
        print(line)
    return 0


def _farm_team(args: argparse.Namespace) -> int:
    from services.db import teams, tokens
    from services.db.states import TokenKind

    value = read_secret_file(args.value_file) if args.value_file else None

    def work(s):
        team = teams.ensure_team(s, name=args.name)
        if value:
            tokens.register_token(s, kind=TokenKind.TEAM, plain=value, team_id=team.id, label="tunefarm farm team")
            return f"team       {team.name}: token stored"
        return tokens.issue_team_token(s, team_id=team.id, label="tunefarm farm team")

    print(_with_db(args, work))
    return 0


def _farm_agent_token(args: argparse.Namespace) -> int:
    from services.db import tokens
    from services.db.states import TokenKind

    value = read_secret_file(args.value_file) if args.value_file else None

    def work(s):
        if value:
            tokens.register_token(s, kind=TokenKind.AGENT, plain=value, label="tunefarm farm agent-token")
            return "agent token stored"
        return tokens.issue_agent_token(s, label="tunefarm farm agent-token")

    print(_with_db(args, work))
    return 0


def _farm_token(args: argparse.Namespace) -> int:
    from services.db import tokens
    from services.db.states import TokenKind

    if args.token_command == "revoke":
        token = _with_db(args, lambda s: tokens.revoke_token_by_ref(s, ref=args.token))
        print(f"revoked    token {token.id} ({token.kind}, {token.prefix}...) at {token.revoked_at:%Y-%m-%d %H:%M:%S %Z}")
        return 0
    kind = TokenKind(args.kind) if args.kind else None
    listed = _with_db(args, lambda s: tokens.list_tokens(s, team=args.team, kind=kind))
    if not listed:
        print("no tokens")
    for t in listed:
        owner = f"team {t.team.name}" if t.team is not None else "agents"
        state = f"revoked {t.revoked_at:%Y-%m-%d %H:%M}" if t.revoked_at else "active"
        label = f"  {t.label}" if t.label else ""
        print(f"{t.id:>5}  {t.kind:<5}  {t.prefix}...  {owner:<20}  created {t.created_at:%Y-%m-%d %H:%M}  {state}{label}")
    return 0


def _farm_device_class(args: argparse.Namespace) -> int:
    from services.db import device_classes
    from tunefarm.target import parse_target

    target = parse_target(args.target)
    dc = _with_db(
        args,
        lambda s: device_classes.ensure_device_class(s, name=args.name, target=target, description=args.description),
    )
    print(f"class      {dc.name}: target {json.dumps(dc.target)}")
    return 0


def _farm_agent(args: argparse.Namespace) -> int:
    from services.db import agents, trust
    from services.db.exceptions import RowNotFound

    act = {"quarantine": agents.quarantine_agent, "unquarantine": agents.lift_quarantine,
           "unflag": agents.clear_flags}[args.agent_command]  # fmt: skip

    def work(s):
        try:
            agent = act(s, name=args.name)
        except RowNotFound:
            raise UsageError(f"no agent named {args.name!r} (tunefarm devices lists them)") from None
        return agent.name, agent.state.value, trust.standing(trust.AgentCounts.of(agent)).value

    name, state, standing = _with_db(args, work)
    print(f"agent      {name}: {state}, {standing}")
    return 0


def _farm_signing_key(args: argparse.Namespace) -> int:
    from services.protocol.signing import KeyFileError, ensure_key_pair

    try:
        made = ensure_key_pair(args.private_key, args.public_key)
    except KeyFileError as exc:
        raise UsageError(str(exc)) from None
    print(f"signing key {args.private_key} ({'made' if made else 'kept'}); public key {args.public_key}")
    return 0


def _with_db(args: argparse.Namespace, work):
    from services.db.exceptions import DatabaseError
    from services.db.session import make_session_factory, transaction

    sessions = make_session_factory(_farm_database_url(args))
    try:
        with transaction(sessions) as s:
            return work(s)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except DatabaseError as exc:
        raise UsageError(f"the database: {_first_line(exc)}") from None
    finally:
        sessions.kw["bind"].dispose()


def _database_url(given: str | None) -> str:
    from services.db.settings import DatabaseSettings

    return given or DatabaseSettings().database_url


def _state_dir(args: argparse.Namespace, *, required: bool = True) -> Path | None:
    """The farm a command acts on: --state-dir, else TUNEFARM_STATE_DIR (the line `farm
    up` prints); `UsageError` when neither names one and `required`."""
    if args.state_dir is not None:
        return args.state_dir
    if os.environ.get("TUNEFARM_STATE_DIR"):
        return Path(os.environ["TUNEFARM_STATE_DIR"])
    if required:
        raise UsageError("which farm? pass --state-dir D (the one given to farm up) or set TUNEFARM_STATE_DIR")
    return None


def _farm_database_url(args: argparse.Namespace) -> str:
    """The database an operator command acts on: --database-url, else the farm.json of
    --state-dir (or TUNEFARM_STATE_DIR), else TUNEFARM_DATABASE_URL. Never a guess: a
    token or class written to some default database would serve no farm, silently."""
    from services.db.settings import DatabaseSettings
    from tunefarm_app.farm_local import read_state

    if args.database_url:
        return args.database_url
    state_dir = _state_dir(args, required=False)
    if state_dir is not None:
        url = read_state(state_dir).get("database_url")
        if not url:
            raise UsageError(f"the farm.json in {state_dir} names no database")
        return url
    settings = DatabaseSettings()
    if "database_url" in settings.model_fields_set:
        return settings.database_url
    raise UsageError(
        "which farm? pass --state-dir D (a farm started with farm up; or set TUNEFARM_STATE_DIR), "
        "or --database-url URL (or TUNEFARM_DATABASE_URL)"
    )


def _redis_url(given: str | None) -> str | None:
    """The Redis `farm up` is given (--redis-url, else TUNEFARM_REDIS_URL when set); None
    for a Redis of the farm's own."""
    from services.worker.settings import WorkerSettings

    if given:
        return given
    settings = WorkerSettings()
    return settings.redis_url if "redis_url" in settings.model_fields_set else None


FARM_COMMANDS = {
    "up": _farm_up,
    "signing-key": _farm_signing_key,
    "down": _farm_down,
    "status": _farm_status,
    "team": _farm_team,
    "agent-token": _farm_agent_token,
    "token": _farm_token,
    "device-class": _farm_device_class,
    "agent": _farm_agent,
}


COMMANDS = {
    "db": cmd_db,
    "farm": cmd_farm,
    **{name: cmd_service for name in SERVICE_COMMANDS},
}
