"""`GET /metrics`: the farm's state in Prometheus' text format, read at each scrape.

| metric | type | labels | what |
|---|---|---|---|
| `tunefarm_build_queue_depth` | gauge | device_class | RQ build jobs waiting in the class's queue (Redis) |
| `tunefarm_redis_up` | gauge | | 1 when Redis answered this scrape (else no queue depths) |
| `tunefarm_batches` | gauge | device_class, state | batches not finished: proposed, building, ready, leased |
| `tunefarm_leases_active` | gauge | device_class | active leases (batches an agent is measuring) |
| `tunefarm_batches_stalled` | gauge | device_class, waiting_for | open batches that waited `TUNEFARM_BATCH_STALL_SECS` for their build (`build`) or, built, for an agent (`agent`) |
| `tunefarm_agents` | gauge | device_class, state | agents by state (idle, busy, offline, disabled) |
| `tunefarm_agents_alive` | gauge | device_class | agents whose last heartbeat is within `lease_secs` |
| `tunefarm_measurements_total` | counter | device_class | candidates measured by agents |
| `tunefarm_measurement_errors_total` | counter | device_class, kind | measurements that are errors, by kind (agents' and failed builds') |
| `tunefarm_jobs` | gauge | state | jobs by state |

Measurements per second is the counter's rate, taken by Prometheus:
`rate(tunefarm_measurements_total[1m])` (errors alike). The database's counts are
`services.db.database_metrics`: a scrape costs the same however many measurements the
farm holds.

Auth: none by default — meant for an internal port or network, like most exporters; it
shows counts per device class and no team's data. With `TUNEFARM_METRICS_TOKEN` set, a
scrape must send `Authorization: Bearer <that token>` (Prometheus' `authorization`
setting), else 401 with a JSON body (whatever bytes the header holds; compared in
constant time).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from services.api.deps import SessionsDep, SettingsDep
from services.api.exceptions import Unauthorized
from services.api.routers.responses import errors
from services.api.schemas import ErrorBody
from services.common.queues import build_queue_name
from services.db.database_metrics import OPEN_BATCH_STATES, FarmCounts, farm_counts
from services.db.device_classes import device_class_names
from services.db.session import transaction
from services.db.states import AgentState, JobState

log = logging.getLogger("tunefarm.api.metrics")

REDIS_TIMEOUT_SECS = 1.0
"""A scrape does not wait longer than this for Redis (the database's metrics still come)."""

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    summary="The farm's metrics (Prometheus text format)",
    response_class=Response,
    responses={
        200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
              "description": "queue depths, leases, agents, measurements and errors, jobs"},
        **errors(401),
        503: {"model": ErrorBody, "description": "the database cannot be reached"},
    },
)
def metrics(request: Request, settings: SettingsDep, sessions: SessionsDep) -> Response:
    """Open unless the farm sets TUNEFARM_METRICS_TOKEN; then that token as a bearer."""
    if settings.metrics_token and not bearer_matches(request.headers.get("authorization", ""), settings.metrics_token):
        raise Unauthorized("metrics need 'Authorization: Bearer <the farm's metrics token>'")
    with transaction(sessions) as db:
        counts = farm_counts(db, alive_secs=settings.lease_secs, stall_secs=settings.batch_stall_secs)
        class_names = device_class_names(db)
    families = database_metrics(counts, alive_secs=settings.lease_secs)
    families += queue_metrics(request, settings.redis_url, settings.queue_prefix, class_names)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def bearer_matches(header: str, token: str) -> bool:
    """Whether an Authorization header is `Bearer <token>`, compared in constant time as
    bytes: the header's raw bytes (HTTP headers arrive latin-1 decoded) against the
    token's UTF-8, so any byte a client sends is a refusal, never an error."""
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode("latin-1", errors="replace"), token.encode())


class _Families:
    """A collector of metric families computed before the scrape is rendered."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def database_metrics(counts: FarmCounts, *, alive_secs: float) -> list[Metric]:
    """The database's metric families, for every class (absent means 0, not unknown)."""
    names = counts.class_names
    batches = GaugeMetricFamily("tunefarm_batches", "batches not finished, by state", labels=["device_class", "state"])
    leases = GaugeMetricFamily("tunefarm_leases_active", "active leases", labels=["device_class"])
    stalled = GaugeMetricFamily("tunefarm_batches_stalled", "open batches waiting longer than the stall window",
                                labels=["device_class", "waiting_for"])
    for class_id, name in names.items():  # every state of every class
        for state in OPEN_BATCH_STATES:
            batches.add_metric([name, state.value], counts.open_batches.get((class_id, state), 0))
        leases.add_metric([name], counts.active_leases.get(class_id, 0))
        for phase in ("build", "agent"):
            stalled.add_metric([name, phase], counts.stalled_batches.get((class_id, phase), 0))
    errors_family = CounterMetricFamily(
        "tunefarm_measurement_errors", "measurements that are errors, by kind", labels=["device_class", "kind"]
    )
    for (class_id, kind), n in sorted(counts.errors.items()):
        errors_family.add_metric([names[class_id], kind], n)
    jobs = GaugeMetricFamily("tunefarm_jobs", "jobs by state", labels=["state"])
    for state in JobState:
        jobs.add_metric([state.value], counts.jobs.get(state, 0))
    return [batches, stalled, leases, *agent_metrics(counts, alive_secs=alive_secs), errors_family, jobs]


def agent_metrics(counts: FarmCounts, *, alive_secs: float) -> list[Metric]:
    """Agents by class and state, those alive, and the candidates they measured."""
    agents = GaugeMetricFamily("tunefarm_agents", "agents by state", labels=["device_class", "state"])
    alive = GaugeMetricFamily(
        "tunefarm_agents_alive", f"agents that heartbeat within the lease window ({alive_secs:g} s)",
        labels=["device_class"],
    )
    measured = CounterMetricFamily("tunefarm_measurements", "candidates measured by agents", labels=["device_class"])
    per_class: dict[int, dict[str, Any]] = {c: {"alive": 0, "measured": 0, "states": {}} for c in counts.class_names}
    for row in counts.agents:
        entry = per_class[row.device_class_id]
        entry["states"][row.state] = row.agents
        entry["alive"] += row.alive
        entry["measured"] += row.measured
    for class_id, name in counts.class_names.items():
        entry = per_class[class_id]
        for state in AgentState:
            agents.add_metric([name, state.value], entry["states"].get(state, 0))
        alive.add_metric([name], entry["alive"])
        measured.add_metric([name], entry["measured"])
    return [agents, alive, measured]


def queue_metrics(request: Request, redis_url: str, prefix: str, class_names: list[str]) -> list[Metric]:
    """RQ build queue lengths per class, and whether Redis answered."""
    from redis import Redis
    from redis.exceptions import RedisError

    up = GaugeMetricFamily("tunefarm_redis_up", "1 when Redis answered this scrape")
    depth = GaugeMetricFamily("tunefarm_build_queue_depth", "build jobs waiting in the class's RQ queue",
                              labels=["device_class"])
    client = getattr(request.app.state, "metrics_redis", None)
    if client is None:
        client = Redis.from_url(redis_url, socket_timeout=REDIS_TIMEOUT_SECS, socket_connect_timeout=REDIS_TIMEOUT_SECS)
        request.app.state.metrics_redis = client
    try:
        pipe = client.pipeline(transaction=False)
        for name in class_names:
            pipe.llen(_rq_queue_key(build_queue_name(name, prefix)))
        lengths = pipe.execute()
    except RedisError as exc:
        log.warning("metrics: Redis at %s did not answer: %s", redis_url, exc)
        up.add_metric([], 0)
        return [up]
    up.add_metric([], 1)
    for name, n in zip(class_names, lengths):
        depth.add_metric([name], int(n))
    return [up, depth]


def _rq_queue_key(queue_name: str) -> str:
    """The Redis list RQ keeps a queue's job ids in (`rq.Queue(name).key`)."""
    from rq import Queue

    return Queue.redis_queue_namespace_prefix + queue_name

