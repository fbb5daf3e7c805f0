"""The farm schema against a real PostgreSQL: migrations, the schema check, and the
invariants the helpers of services.db keep (exactly-once measurements, leases,
SKIP LOCKED, tokens)."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

import pytest
from farm_fixtures import placeholder_model
from sqlalchemy import create_engine, func, select, text

from services.db import agents, batches, codec, cost_models, leases, measurements, model_runs, tokens
from services.db.batches import mark_batch_ready, transition_batch  # make_farm's arguments hide the module
from services.db.exceptions import (
    Conflict,
    ConstraintViolation,
    InvalidTransition,
    LeaseNotHeld,
    RowNotFound,
    SchemaOutOfDate,
)
from services.db.migrate import check_schema, current_revision, downgrade, head_revision, upgrade
from services.db.models import (
    Agent,
    Base,
    Batch,
    BatchCandidate,
    DeviceClass,
    Job,
    JobTask,
    Lease,
    Measurement,
    ModelRun,
    Team,
    Token,
    WorkloadRow,
)
from services.db.session import transaction
from services.db.settings import DatabaseSettings
from services.db.states import AgentState, BatchState, LeaseState, ModelRunState, TokenKind
from tunefarm.records import Candidate, ErrorKind, MeasureInput, MeasureRecord, TimingConfig

LEASE_SECS = 60.0
FINGERPRINT = {"tvm": "0.27.0", "device": {"cores": 4}}


# -- a small farm ---------------------------------------------------------------------------


@dataclass
class Farm:
    device_class_id: int
    job_id: int
    job_task_id: int
    agent_ids: list[int]
    batch_ids: list[int]
    candidate_ids: dict[int, list[int]]  # batch id -> its candidates' ids


def _uid() -> str:
    return uuid.uuid4().hex[:12]


def _input(i: int) -> MeasureInput:
    return MeasureInput("t#0@x", Candidate.make(0, {"C.tile": (4, i + 1), "C.unroll": i}), "sig", [["trace"]])


def _record(inp: MeasureInput, cost: float | None) -> MeasureRecord:
    return MeasureRecord(
        task=inp.task,
        workload="t",
        target={"kind": "llvm"},
        sketch=inp.candidate.sketch,
        sketch_sig=inp.sketch_sig,
        decisions=inp.candidate.decisions,
        trace=inp.trace,
        costs=(cost,) if cost is not None else (),
        error_kind=ErrorKind.NONE if cost is not None else ErrorKind.RUN_ERROR,
        error_msg="" if cost is not None else "boom",
        build_secs=0.1,
        run_secs=0.2,
        verified=cost is not None,
        timestamp=1.0,
    )


def make_farm(factory, *, batches: int = 1, candidates: int = 2, agents: int = 2, ready: bool = True) -> Farm:
    """A team, model, device class (its own queue), job and task, agents, and batches
    made ready in order."""
    uid = _uid()
    with transaction(factory) as s:
        team = Team(name=f"team-{uid}")
        dc = DeviceClass(name=f"class-{uid}", target={"kind": "llvm"})
        wl = WorkloadRow(key=f"w#{uid}", name="w", module_json="{}", flops=1e6, n_inputs=2, n_outputs=1)
        s.add_all([team, dc, wl])
        s.flush()
        model = placeholder_model(team.id, {"x": [1, 3]})
        s.add(model)
        s.flush()
        job = Job(team_id=team.id, model_id=model.id, device_class_id=dc.id, trial_budget=100)
        s.add(job)
        s.flush()
        jt = JobTask(job_id=job.id, workload_id=wl.id, task_key=f"{wl.key}@x", position=0, weight=1)
        s.add(jt)
        agent_rows = [Agent(device_class_id=dc.id, name=f"agent-{uid}-{i}") for i in range(agents)]
        s.add_all(agent_rows)
        s.flush()
        batch_ids, cands = [], {}
        for _ in range(batches):
            b = Batch(
                job_id=job.id,
                job_task_id=jt.id,
                workload_id=wl.id,
                device_class_id=dc.id,
                timing=codec.timing_to_json(TimingConfig()),
                build_timeout_secs=60.0,
                run_timeout_secs=30.0,
            )
            s.add(b)
            s.flush()
            rows = [
                BatchCandidate(
                    batch_id=b.id,
                    position=i,
                    candidate_key=_input(i).key,
                    input=codec.input_to_json(_input(i)),
                )
                for i in range(candidates)
            ]
            s.add_all(rows)
            s.flush()
            batch_ids.append(b.id)
            cands[b.id] = [r.id for r in rows]
        farm = Farm(dc.id, job.id, jt.id, [a.id for a in agent_rows], batch_ids, cands)
    for b in batch_ids:  # one transaction each: distinct ready_at, so FIFO order is defined
        with transaction(factory) as s:
            transition_batch(s, batch_id=b, to=BatchState.BUILDING)
            if ready:
                assert mark_batch_ready(s, batch_id=b) is BatchState.READY
    return farm


def db_now(factory) -> datetime:
    with transaction(factory) as s:
        return s.scalar(select(func.now()))


def lease(factory, agent_id: int, now: datetime | None = None) -> Lease | None:
    with transaction(factory) as s:
        return leases.lease_next_batch(s, agent_id=agent_id, lease_secs=LEASE_SECS, now=now)


def record(factory, farm: Farm, lease_row: Lease, agent_id: int, index: int = 0, cost: float | None = 0.001):
    with transaction(factory) as s:
        return measurements.record_measurement(
            s,
            batch_candidate_id=farm.candidate_ids[lease_row.batch_id][index],
            lease_id=lease_row.id,
            agent_id=agent_id,
            record=_record(_input(index), cost),
            fingerprint=FINGERPRINT,
        )


# -- migrations and settings ------------------------------------------------------------------


def test_the_migrations_build_what_the_models_declare(empty_database_url):
    """Alembic's comparison of the migrated schema with the ORM's metadata finds nothing:
    every table, column, index (partial ones included) and constraint the models declare
    is made by a migration, and nothing else is."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    upgrade(empty_database_url)
    engine = create_engine(empty_database_url)
    try:
        with engine.connect() as c:
            assert compare_metadata(MigrationContext.configure(c), Base.metadata) == []
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(empty_database_url):
    url = empty_database_url
    assert current_revision(url) is None
    upgrade(url)
    assert current_revision(url) == head_revision()
    engine = create_engine(url)
    try:
        with engine.connect() as c:
            tables = set(c.scalars(text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")))
            assert tables == set(Base.metadata.tables) | {"alembic_version"}
            partial = c.scalar(
                text("SELECT indexdef FROM pg_indexes WHERE indexname = 'uq_leases_active_batch'")
            )
            assert "UNIQUE" in partial and "WHERE (state = 'active'" in partial
            enums = set(c.scalars(text("SELECT typname FROM pg_type WHERE typtype = 'e'")))
            assert {
                "job_state",
                "batch_state",
                "lease_state",
                "error_kind",
                "token_kind",
                "agent_state",
            } <= enums
        downgrade(url, "base")
        assert current_revision(url) is None
        with engine.connect() as c:
            assert set(c.scalars(text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'"))) == {
                "alembic_version"
            }
            assert not list(c.scalars(text("SELECT typname FROM pg_type WHERE typtype = 'e'")))
    finally:
        engine.dispose()
    upgrade(url)
    assert current_revision(url) == head_revision()


def test_check_schema(empty_database_url):
    with pytest.raises(SchemaOutOfDate) as info:
        check_schema(empty_database_url)
    assert info.value.current is None and info.value.expected == head_revision()
    assert head_revision() in str(info.value)
    upgrade(empty_database_url)
    check_schema(empty_database_url)


def test_settings_read_the_environment(monkeypatch):
    monkeypatch.setenv("TUNEFARM_DATABASE_URL", "postgresql+psycopg2://u@db:5432/x")
    monkeypatch.setenv("TUNEFARM_DATABASE_POOL_SIZE", "3")
    settings = DatabaseSettings()
    assert settings.database_url == "postgresql+psycopg2://u@db:5432/x" and settings.database_pool_size == 3


# -- transactions and tokens ------------------------------------------------------------------


def test_transaction_translates_unique_violation_and_rolls_back(db_sessions):
    name = f"team-{_uid()}"
    with transaction(db_sessions) as s:
        s.add(Team(name=name))
    with pytest.raises(Conflict) as info:
        with transaction(db_sessions) as s:
            s.add(Team(name=f"{name}-other"))
            s.flush()
            s.add(Team(name=name))
    assert info.value.constraint == "uq_teams_name"
    with transaction(db_sessions) as s:
        assert s.scalar(select(func.count()).where(Team.name == f"{name}-other")) == 0


def test_token_hash_round_trip(db_sessions):
    with transaction(db_sessions) as s:
        team = Team(name=f"team-{_uid()}")
        s.add(team)
        s.flush()
        row, plain = tokens.issue_token(s, kind=TokenKind.TEAM, team_id=team.id, label="ci")
    assert plain.startswith("tft_") and row.prefix == plain[: len(row.prefix)]
    assert row.token_hash == tokens.hash_token(plain) and plain not in row.token_hash
    with transaction(db_sessions) as s:
        found = tokens.verify_token(s, plain=plain, kind=TokenKind.TEAM)
        assert found is not None and found.id == row.id and found.team_id == team.id
        assert tokens.verify_token(s, plain=plain + "x", kind=TokenKind.TEAM) is None
        s.get(Token, row.id).revoked_at = func.now()
    with transaction(db_sessions) as s:
        assert tokens.verify_token(s, plain=plain, kind=TokenKind.TEAM) is None


def test_a_heartbeat_after_its_token_was_revoked_changes_nothing(db_sessions):
    """A service's token cache may let a heartbeat through just after the revocation
    committed: the database refuses it, and the agent stays offline with no lease."""
    from services.db.exceptions import TokenRevoked

    farm = make_farm(db_sessions)
    a = farm.agent_ids[0]
    with transaction(db_sessions) as s:
        token, _ = tokens.issue_token(s, kind=TokenKind.AGENT)
        s.get(Agent, a).token_id = token.id
    held = lease(db_sessions, a)
    with transaction(db_sessions) as s:
        tokens.revoke_token(s, token_id=token.id)
    with pytest.raises(TokenRevoked), transaction(db_sessions) as s:
        leases.heartbeat(s, agent_id=a, lease_secs=LEASE_SECS, lease_ids=[held.id])
    with transaction(db_sessions) as s:
        assert s.get(Agent, a).state is AgentState.OFFLINE
        assert s.get(Lease, held.id).state is LeaseState.EXPIRED


def test_agent_token_is_not_a_team_token(db_sessions):
    with transaction(db_sessions) as s:
        team = Team(name=f"team-{_uid()}")
        s.add(team)
        s.flush()
        _, agent_plain = tokens.issue_token(s, kind=TokenKind.AGENT)
        _, team_plain = tokens.issue_token(s, kind=TokenKind.TEAM, team_id=team.id)
    with transaction(db_sessions) as s:
        assert tokens.verify_token(s, plain=agent_plain, kind=TokenKind.AGENT) is not None
        assert tokens.verify_token(s, plain=agent_plain, kind=TokenKind.TEAM) is None
        assert tokens.verify_token(s, plain=team_plain, kind=TokenKind.AGENT) is None
        # Even with its prefix forged, a stored agent token is no team token.
        forged = "tft_" + agent_plain.removeprefix("tfa_")
        assert tokens.verify_token(s, plain=forged, kind=TokenKind.TEAM) is None
    with pytest.raises(ConstraintViolation) as info:  # an agent token cannot belong to a team
        with transaction(db_sessions) as s:
            tok = tokens.new_token(TokenKind.AGENT)
            s.add(Token(kind=TokenKind.AGENT, team_id=team.id, token_hash=tok.token_hash, prefix=tok.prefix))
    assert info.value.constraint == "ck_tokens_team_iff_team_kind"


# -- measurements -----------------------------------------------------------------------------


def test_measurement_is_recorded_once_under_concurrent_writers(db_sessions):
    farm = make_farm(db_sessions)
    agent = farm.agent_ids[0]
    held = lease(db_sessions, agent)
    cand = farm.candidate_ids[held.batch_id][0]
    rec = _record(_input(0), 0.002)

    def write(session):
        return measurements.record_measurement(
            session,
            batch_candidate_id=cand,
            lease_id=held.id,
            agent_id=agent,
            record=rec,
            fingerprint=FINGERPRINT,
        )

    # Writer 1 inserts and keeps its transaction open; writer 2 must wait on the unique
    # index, then find the row and write nothing.
    with ThreadPoolExecutor(1) as pool:
        with transaction(db_sessions) as s1:
            first = write(s1)
            second_future = pool.submit(_in_transaction, db_sessions, write)
            with pytest.raises(TimeoutError):
                second_future.result(timeout=0.5)
        second = second_future.result(timeout=10)
    assert first.created and not second.created and first.measurement_id == second.measurement_id

    # And many writers at once (a retried stream): still one row, counted once.
    barrier = threading.Barrier(6)

    def racer(_):
        barrier.wait()
        return _in_transaction(db_sessions, write)

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(racer, range(6)))
    assert not any(r.created for r in results)
    with transaction(db_sessions) as s:
        assert s.scalar(select(func.count()).where(Measurement.batch_candidate_id == cand)) == 1
        job, task, ag = s.get(Job, farm.job_id), s.get(JobTask, farm.job_task_id), s.get(Agent, agent)
        assert job.trials_used == 1 and task.trials == 1
        assert task.best_cost == pytest.approx(0.002) and task.best_measurement_id == first.measurement_id
        assert ag.measurements_done == 1 and ag.errors_by_kind == {}


def _in_transaction(factory, fn):
    with transaction(factory) as s:
        return fn(s)


def test_progress_counters_track_best_and_errors(db_sessions):
    farm = make_farm(db_sessions, candidates=3)
    agent = farm.agent_ids[0]
    held = lease(db_sessions, agent)
    record(db_sessions, farm, held, agent, index=0, cost=0.003)
    best = record(db_sessions, farm, held, agent, index=1, cost=0.001)
    record(db_sessions, farm, held, agent, index=2, cost=None)  # a run error
    with transaction(db_sessions) as s:
        task, ag = s.get(JobTask, farm.job_task_id), s.get(Agent, agent)
        assert task.trials == 3 and task.best_measurement_id == best.measurement_id
        assert ag.measurements_done == 3 and ag.errors_by_kind == {"run_error": 1}
        m = s.scalars(
            select(Measurement).where(
                Measurement.error_kind == ErrorKind.RUN_ERROR, Measurement.job_id == farm.job_id
            )
        ).one()
        assert m.cost is None and m.fingerprint == FINGERPRINT
        assert codec.record_from_json(m.record) == _record(_input(2), None)


def test_a_tasks_best_says_whether_an_emulator_measured_it(db_sessions):
    farm = make_farm(db_sessions, candidates=3)
    agent = farm.agent_ids[0]
    held = lease(db_sessions, agent)
    ids = farm.candidate_ids[held.batch_id]
    emulated = replace(_record(_input(0), 0.002), emulated=True)
    with transaction(db_sessions) as s:  # the bulk path (a results stream)
        measurements.record_measurements(
            s, lease_id=held.id, agent_id=agent, items=[(ids[0], emulated)], fingerprint=FINGERPRINT
        )
        assert s.get(JobTask, farm.job_task_id).best_emulated is True
    record(db_sessions, farm, held, agent, index=1, cost=0.003)  # slower: the best stays emulated
    with transaction(db_sessions) as s:
        assert s.get(JobTask, farm.job_task_id).best_emulated is True
    record(db_sessions, farm, held, agent, index=2, cost=0.001)  # the one path
    with transaction(db_sessions) as s:
        task = s.get(JobTask, farm.job_task_id)
        assert task.best_emulated is False and task.best_cost == 0.001


def test_result_under_another_agents_lease_is_refused(db_sessions):
    farm = make_farm(db_sessions)
    a, b = farm.agent_ids
    held = lease(db_sessions, a)
    with pytest.raises(LeaseNotHeld):
        record(db_sessions, farm, held, b)
    with pytest.raises(LeaseNotHeld):
        with transaction(db_sessions) as s:
            leases.finish_lease(s, lease_id=held.id, agent_id=b)
    # A candidate of another batch under this lease is refused too.
    other = make_farm(db_sessions)
    with pytest.raises(LeaseNotHeld):
        with transaction(db_sessions) as s:
            measurements.record_measurement(
                s,
                batch_candidate_id=other.candidate_ids[other.batch_ids[0]][0],
                lease_id=held.id,
                agent_id=a,
                record=_record(_input(0), 0.001),
                fingerprint=FINGERPRINT,
            )
    assert record(db_sessions, farm, held, a).created


def test_expired_lease_is_leased_again_and_the_late_result_refused(db_sessions):
    farm = make_farm(db_sessions)
    a, b = farm.agent_ids
    first = lease(db_sessions, a)
    assert lease(db_sessions, b) is None  # the only batch is held
    later = db_now(db_sessions) + timedelta(seconds=LEASE_SECS + 1)
    second = lease(db_sessions, b, now=later)
    assert second is not None and second.batch_id == first.batch_id and second.batch.attempts == 2
    with transaction(db_sessions) as s:
        assert s.get(Lease, first.id).state is LeaseState.EXPIRED
    with pytest.raises(LeaseNotHeld):
        record(db_sessions, farm, first, a)
    with transaction(db_sessions) as s:
        assert leases.heartbeat(s, agent_id=a, lease_secs=LEASE_SECS, lease_ids=[first.id]) == []  # not a's now
    with pytest.raises(LeaseNotHeld):
        with transaction(db_sessions) as s:
            leases.finish_lease(s, lease_id=first.id, agent_id=a)
    for i in range(2):
        assert record(db_sessions, farm, second, b, index=i).created
    with transaction(db_sessions) as s:
        assert leases.finish_lease(s, lease_id=second.id, agent_id=b) is BatchState.DONE
        assert s.get(Batch, first.batch_id).state is BatchState.DONE


def test_heartbeat_keeps_a_lease_and_expire_leases_requeues(db_sessions):
    farm = make_farm(db_sessions)
    a, b = farm.agent_ids
    held = lease(db_sessions, a)
    t0 = db_now(db_sessions)
    with transaction(db_sessions) as s:
        assert leases.heartbeat(
            s, agent_id=a, lease_secs=LEASE_SECS, lease_ids=[held.id], now=t0 + timedelta(seconds=50)
        ) == [held.id]
        assert s.get(Agent, a).state is AgentState.BUSY
    assert lease(db_sessions, b, now=t0 + timedelta(seconds=LEASE_SECS + 1)) is None  # extended to t0+110
    with transaction(db_sessions) as s:
        # (The sweep is global: other tests' leases may expire too.)
        assert held.batch_id not in leases.expire_leases(s, now=t0 + timedelta(seconds=100))
        assert held.batch_id in leases.expire_leases(s, now=t0 + timedelta(seconds=120))
    with transaction(db_sessions) as s:
        assert s.get(Lease, held.id).state is LeaseState.EXPIRED
        assert s.get(Batch, held.batch_id).state is BatchState.READY
        leases.heartbeat(s, agent_id=b, lease_secs=LEASE_SECS, now=t0 + timedelta(seconds=115))
        offline = agents.mark_agents_offline(s, stale_secs=10, now=t0 + timedelta(seconds=120))
        assert a in offline and b not in offline
    again = lease(db_sessions, b)
    assert again is not None and again.batch_id == held.batch_id


def test_classes_with_work_are_those_an_agent_could_lease_from(db_sessions):
    farm = make_farm(db_sessions, batches=1)
    idle = make_farm(db_sessions, batches=1, ready=False)

    def with_work(now=None):
        with transaction(db_sessions) as s:
            return leases.classes_with_work(s, now=now) & {farm.device_class_id, idle.device_class_id}

    assert with_work() == {farm.device_class_id}  # a ready batch; the other class's is only building
    held = lease(db_sessions, farm.agent_ids[0])
    assert with_work() == set()  # leased, under a live lease
    t0 = db_now(db_sessions)
    assert with_work(now=t0 + timedelta(seconds=LEASE_SECS + 1)) == {farm.device_class_id}  # its lease expired
    assert lease(db_sessions, farm.agent_ids[1], now=t0 + timedelta(seconds=LEASE_SECS + 1)).batch_id == held.batch_id


def test_a_model_run_is_leased_kept_alive_taken_over_and_finished_once(db_sessions):
    farm = make_farm(db_sessions, batches=1)
    a, b = farm.agent_ids
    file = model_runs.StoredFile("model_runs/x/model.so", "0" * 64, 10)
    onnx = model_runs.StoredFile("model_runs/x/model.onnx", "1" * 64, 20)

    def create():
        with transaction(db_sessions) as s:
            return model_runs.create_model_run(
                s, job_id=farm.job_id, device_class_id=farm.device_class_id, library=file, inputs=file,
                repeat=3, warmup=1, timeout_secs=60.0, onnx=onnx, input_names=["x"],
            ).id  # fmt: skip

    def lease_run(agent_id, now=None):
        with transaction(db_sessions) as s:
            run = model_runs.lease_model_run(s, agent_id=agent_id, lease_secs=LEASE_SECS, max_attempts=2, now=now)
            return run.id if run is not None else None

    old, run_id = create(), create()
    with transaction(db_sessions) as s:  # a second run of the job supersedes the first
        assert s.get(ModelRun, old).state is ModelRunState.FAILED and "superseded" in s.get(ModelRun, old).error
    t0 = db_now(db_sessions)
    assert lease_run(a) == run_id
    assert lease_run(b) is None  # held by a
    with transaction(db_sessions) as s:
        leases.heartbeat(s, agent_id=a, lease_secs=LEASE_SECS, model_run_ids=[run_id], now=t0 + timedelta(seconds=50))
        assert s.get(Agent, a).state is AgentState.BUSY
    assert lease_run(b, now=t0 + timedelta(seconds=LEASE_SECS + 1)) is None  # extended to t0+110
    assert lease_run(b, now=t0 + timedelta(seconds=120)) == run_id  # a went silent: b takes it over
    with transaction(db_sessions) as s, pytest.raises(LeaseNotHeld):
        model_runs.finish_model_run(s, model_run_id=run_id, agent_id=a, outputs_path="o.npz", result={})
    with transaction(db_sessions) as s:
        peers = {"onnxruntime": {"latency_samples": [1e-4], "round_medians": [1e-4], "threads": 2},
                 "openvino": {"error": "cannot load the model"}}
        done = model_runs.finish_model_run(s, model_run_id=run_id, agent_id=b, outputs_path="o.npz", result={"agent": "b"},
                                           peer_latencies=peers)  # fmt: skip
        assert done.state is ModelRunState.DONE and done.attempts == 2 and done.finished_at is not None
        assert (done.onnx_path, done.onnx_size, done.input_names, done.peer_latencies) == (onnx.path, 20, ["x"], peers)
    with transaction(db_sessions) as s, pytest.raises(LeaseNotHeld):  # a resent result changes nothing
        model_runs.finish_model_run(s, model_run_id=run_id, agent_id=b, outputs_path=None, result={}, error="late")
    # A run whose agents keep dying fails after max_attempts leases instead of looping.
    third = create()
    assert lease_run(a) == third
    assert lease_run(b, now=t0 + timedelta(seconds=200)) == third
    assert lease_run(a, now=t0 + timedelta(seconds=400)) is None
    with transaction(db_sessions) as s:
        assert s.get(ModelRun, third).state is ModelRunState.FAILED and "leased 2 times" in s.get(ModelRun, third).error
    with transaction(db_sessions) as s:  # a run without peers has none: SQL NULL, not JSON null
        plain = model_runs.create_model_run(s, job_id=farm.job_id, device_class_id=farm.device_class_id, library=file,
                                            inputs=file, repeat=0, warmup=1, timeout_secs=60.0)  # fmt: skip
    assert lease_run(a) == plain.id
    with transaction(db_sessions) as s:
        model_runs.finish_model_run(s, model_run_id=plain.id, agent_id=a, outputs_path="o.npz", result={})
        unset = (ModelRun.input_names.is_(None), ModelRun.peer_latencies.is_(None))
        assert s.scalar(select(func.count()).select_from(ModelRun).where(ModelRun.id == plain.id, *unset)) == 1


def test_a_model_run_given_up_is_leased_by_nobody_and_a_leased_one_is_left_to_its_agent(db_sessions):
    farm = make_farm(db_sessions, batches=1)
    a, _ = farm.agent_ids
    file = model_runs.StoredFile("model_runs/x/model.cuda.tar", "0" * 64, 10)

    def create():
        with transaction(db_sessions) as s:
            return model_runs.create_model_run(
                s, job_id=farm.job_id, device_class_id=farm.device_class_id, library=file, inputs=file,
                repeat=3, warmup=1, timeout_secs=60.0,
            ).id  # fmt: skip

    def give_up(run_id):
        with transaction(db_sessions) as s:
            return model_runs.give_up_model_run(s, model_run_id=run_id, reason="not run: no agent of c is online")

    ready = create()
    assert give_up(ready) is True
    with transaction(db_sessions) as s:
        row = s.get(ModelRun, ready)
        assert row.state is ModelRunState.FAILED and "no agent" in row.error and row.finished_at is not None
        assert model_runs.lease_model_run(s, agent_id=a, lease_secs=LEASE_SECS, max_attempts=2) is None
    leased = create()
    with transaction(db_sessions) as s:
        assert model_runs.lease_model_run(s, agent_id=a, lease_secs=LEASE_SECS, max_attempts=2).id == leased
    assert give_up(leased) is False
    with transaction(db_sessions) as s:
        assert s.get(ModelRun, leased).state is ModelRunState.LEASED


def test_finish_with_candidates_missing_requeues_only_what_is_missing(db_sessions):
    farm = make_farm(db_sessions, candidates=3)
    a, b = farm.agent_ids
    held = lease(db_sessions, a)
    record(db_sessions, farm, held, a, index=1)
    with transaction(db_sessions) as s:
        assert leases.finish_lease(s, lease_id=held.id, agent_id=a) is BatchState.READY
        assert [c.position for c in batches.unmeasured_candidates(s, batch_id=held.batch_id)] == [0, 2]
    assert lease(db_sessions, b).batch_id == held.batch_id


def test_batch_whose_builds_all_failed_is_done_without_an_agent(db_sessions):
    farm = make_farm(db_sessions, ready=False)
    batch = farm.batch_ids[0]
    with transaction(db_sessions) as s:
        for i, cand in enumerate(farm.candidate_ids[batch]):
            failed = MeasureRecord(
                **{**_record(_input(i), None).__dict__, "error_kind": ErrorKind.BUILD_ERROR}
            )
            assert measurements.record_build_error(
                s, batch_candidate_id=cand, record=failed, fingerprint={}
            ).created
        assert batches.mark_batch_ready(s, batch_id=batch) is BatchState.DONE
    with pytest.raises(InvalidTransition):
        with transaction(db_sessions) as s:
            batches.transition_batch(s, batch_id=batch, to=BatchState.READY)
    with transaction(db_sessions) as s:
        assert s.get(Job, farm.job_id).trials_used == 2
        assert s.get(JobTask, farm.job_task_id).best_cost is None


# -- the queue --------------------------------------------------------------------------------


def test_leases_are_fifo_within_a_device_class(db_sessions):
    farm = make_farm(db_sessions, batches=3, agents=1)
    make_farm(db_sessions, batches=2, agents=1)  # another class's queue is not ours
    got = []
    while (held := lease(db_sessions, farm.agent_ids[0])) is not None:
        got.append(held.batch_id)
    assert got == farm.batch_ids


def test_skip_locked_a_locked_batch_is_passed_over_not_waited_for(db_sessions):
    farm = make_farm(db_sessions, batches=2)
    a, b = farm.agent_ids
    with ThreadPoolExecutor(1) as pool:
        with transaction(db_sessions) as s1:  # agent a's lease is not committed yet
            first = leases.lease_next_batch(s1, agent_id=a, lease_secs=LEASE_SECS)
            second = pool.submit(lease, db_sessions, b).result(timeout=5)  # no waiting on a's lock
    assert {first.batch_id, second.batch_id} == set(farm.batch_ids)


def test_concurrent_agents_never_get_the_same_batch(db_sessions):
    n_agents, n_batches = 8, 20
    farm = make_farm(db_sessions, batches=n_batches, agents=n_agents, candidates=1)
    barrier = threading.Barrier(n_agents)

    def agent_loop(agent_id):
        barrier.wait()
        got = []
        while (held := lease(db_sessions, agent_id)) is not None:
            got.append(held.batch_id)
        return got

    with ThreadPoolExecutor(n_agents) as pool:
        per_agent = list(pool.map(agent_loop, farm.agent_ids))
    leased = [b for got in per_agent for b in got]
    assert sorted(leased) == sorted(farm.batch_ids)  # each batch exactly once
    with transaction(db_sessions) as s:
        active = s.scalar(
            select(func.count()).where(Lease.batch_id.in_(farm.batch_ids), Lease.state == LeaseState.ACTIVE)
        )
        assert active == n_batches


# -- cost models and codecs -------------------------------------------------------------------


def test_cost_model_versions_count_up_per_class(db_sessions):
    farm = make_farm(db_sessions, agents=0)
    with transaction(db_sessions) as s:
        assert cost_models.latest_cost_model_version(s, device_class_id=farm.device_class_id) is None
        kw = dict(
            device_class_id=farm.device_class_id, feature_version=1, sha256="0" * 64, size=1, trained_on=5
        )
        v1 = cost_models.add_cost_model_version(s, path="cm/1", last_measurement_id=10, **kw)
        v2 = cost_models.add_cost_model_version(s, path="cm/2", last_measurement_id=20, **kw)
        assert (v1.version, v2.version) == (1, 2)
        assert cost_models.latest_cost_model_version(s, device_class_id=farm.device_class_id).id == v2.id


def test_codec_round_trips():
    inp = _input(3)
    assert codec.input_from_json(codec.input_to_json(inp)) == inp
    rec = _record(inp, 0.5)
    assert codec.record_from_json(codec.record_to_json(rec)) == rec
    timing = TimingConfig(repeat=3)
    assert codec.timing_from_json(codec.timing_to_json(timing)) == timing


# -- measurement trust: the timing floor, confirmations, vouching, quarantine -----------------


def _confirmation_batch(factory, measurement_id: int) -> Batch | None:
    with transaction(factory) as s:
        return s.scalars(select(Batch).where(Batch.confirms_measurement_id == measurement_id)).one_or_none()


def test_a_new_best_is_confirmed_by_another_agent_in_a_row_of_its_own(db_sessions):
    from services.db.models import Confirmation
    from services.db.states import ConfirmationState

    farm = make_farm(db_sessions, candidates=2)
    a, b = farm.agent_ids
    held = lease(db_sessions, a)
    best = record(db_sessions, farm, held, a, index=0, cost=0.002)
    record(db_sessions, farm, held, a, index=1, cost=0.003)  # slower: not a new best, no confirmation
    check = _confirmation_batch(db_sessions, best.measurement_id)
    assert check is not None and check.state is BatchState.READY and check.avoid_agent_id == a
    with transaction(db_sessions) as s:
        assert s.scalar(select(func.count()).select_from(Batch).where(Batch.confirms_measurement_id.is_not(None),
                                                                     Batch.job_id == farm.job_id)) == 1  # fmt: skip
        assert leases.finish_lease(s, lease_id=held.id, agent_id=a) is BatchState.DONE
        task = s.get(JobTask, farm.job_task_id)
        assert task.best_cost == 0.002 and not task.best_confirmed and task.confirmed_cost is None
    assert lease(db_sessions, a) is None  # its own time: b may confirm it, and is live
    confirming = lease(db_sessions, b)
    assert confirming.batch_id == check.id
    (cand,) = queries_candidates(db_sessions, check.id)
    for created in (True, False):  # written twice: one confirmation
        with transaction(db_sessions) as s:
            got = measurements.record_measurement(s, batch_candidate_id=cand, lease_id=confirming.id, agent_id=b,
                                             record=_record(_input(0), 0.0025), fingerprint=FINGERPRINT)  # fmt: skip
        assert got.created is created
    with transaction(db_sessions) as s:
        assert leases.finish_lease(s, lease_id=confirming.id, agent_id=b) is BatchState.DONE
        conf = s.scalars(select(Confirmation).where(Confirmation.batch_candidate_id == cand)).one()
        assert conf.outcome is ConfirmationState.CONFIRMED and conf.agent_id == b and conf.measurement_id == best.measurement_id
        assert s.scalar(select(func.count()).where(Measurement.job_id == farm.job_id)) == 2  # no third measurement
        assert s.get(Job, farm.job_id).trials_used == 2
        m = s.get(Measurement, best.measurement_id)
        assert m.confirmation is ConfirmationState.CONFIRMED and m.confirmed_by_agent_id == b
        task = s.get(JobTask, farm.job_task_id)
        assert task.best_confirmed and task.confirmed_cost == 0.002 and task.confirmed_measurement_id == m.id
        assert (s.get(Agent, a).confirmations_agreed, s.get(Agent, b).confirmations_agreed) == (1, 0)


def queries_candidates(factory, batch_id: int) -> list[int]:
    with transaction(factory) as s:
        return [c.id for c in batches.unmeasured_candidates(s, batch_id=batch_id)]


def test_an_agent_alone_confirms_its_own_best_on_a_later_lease_and_cannot_dispute_it(db_sessions):
    from services.db.states import ConfirmationState

    farm = make_farm(db_sessions, candidates=2, agents=1)
    (a,) = farm.agent_ids
    held = lease(db_sessions, a)
    first = record(db_sessions, farm, held, a, index=0, cost=0.002)
    record(db_sessions, farm, held, a, index=1, cost=None)
    with transaction(db_sessions) as s:
        assert leases.finish_lease(s, lease_id=held.id, agent_id=a) is BatchState.DONE
    again = lease(db_sessions, a)  # nobody else: its own confirmation, on a later lease
    assert again.batch_id == _confirmation_batch(db_sessions, first.measurement_id).id
    (cand,) = queries_candidates(db_sessions, again.batch_id)
    with transaction(db_sessions) as s:  # itself, much slower this time: noise, not evidence against it
        measurements.record_measurement(s, batch_candidate_id=cand, lease_id=again.id, agent_id=a,
                                   record=_record(_input(0), 0.01), fingerprint=FINGERPRINT)  # fmt: skip
    with transaction(db_sessions) as s:
        # Its kernel stays the task's best (its output checked; only the only agent could time it again).
        assert s.get(Measurement, first.measurement_id).confirmation is ConfirmationState.CONFIRMED
        row = s.get(Agent, a)
        assert row.confirmations_disputed == 0  # it cannot dispute itself
        task = s.get(JobTask, farm.job_task_id)
        assert task.best_cost == 0.002 and task.confirmed_cost == 0.002


def _give_tokens(factory, farm: Farm, *groups: tuple[int, ...]) -> None:
    """Register the agents of each group with one agent token of its own."""
    with transaction(factory) as s:
        for group in groups:
            token, _ = tokens.issue_token(s, kind=TokenKind.AGENT)
            for agent_id in group:
                s.get(Agent, agent_id).token_id = token.id


def test_a_second_agent_of_the_same_token_never_confirms_the_first(db_sessions):
    """One token, two names: a lying party registers `a` and `b`; `b` must not confirm
    `a`'s fake time while an agent of another token (`c`) is live to check it, and when
    only the party is live its word on `a` is a second word of `a`'s own (never a
    dispute, and no evidence: `trust.verdict(same_party=True)`)."""
    from services.db.models import Confirmation
    from services.db.states import ConfirmationState

    farm = make_farm(db_sessions, candidates=2, agents=3)
    a, b, c = farm.agent_ids
    _give_tokens(db_sessions, farm, (a, b), (c,))
    held = lease(db_sessions, a)
    fake = record(db_sessions, farm, held, a, index=0, cost=0.0001)
    record(db_sessions, farm, held, a, index=1, cost=None)
    with transaction(db_sessions) as s:
        leases.finish_lease(s, lease_id=held.id, agent_id=a)
    check = _confirmation_batch(db_sessions, fake.measurement_id)
    assert lease(db_sessions, b) is None  # its own token's time: c, of another token, is live
    assert lease(db_sessions, a) is None
    confirming = lease(db_sessions, c)
    assert confirming.batch_id == check.id
    (cand,) = queries_candidates(db_sessions, check.id)
    with transaction(db_sessions) as s:
        measurements.record_measurement(s, batch_candidate_id=cand, lease_id=confirming.id, agent_id=c,
                                   record=_record(_input(0), 0.002), fingerprint=FINGERPRINT)  # fmt: skip
    with transaction(db_sessions) as s:
        assert s.get(Measurement, fake.measurement_id).confirmation is ConfirmationState.DISPUTED
        assert s.get(Agent, a).confirmations_disputed == 1
    # c goes away: the party alone is its own confirmer, and b's word on a's next best
    # counts no more than a's own would (a slower time is no dispute, a faster no proof).
    farm2 = make_farm(db_sessions, candidates=1, agents=3)
    a2, b2, c2 = farm2.agent_ids
    _give_tokens(db_sessions, farm2, (a2, b2), (c2,))
    held = lease(db_sessions, a2)
    best = record(db_sessions, farm2, held, a2, index=0, cost=0.002)
    with transaction(db_sessions) as s:
        leases.finish_lease(s, lease_id=held.id, agent_id=a2)
        s.get(Agent, c2).state = AgentState.OFFLINE
    confirming = lease(db_sessions, b2)
    assert confirming.batch_id == _confirmation_batch(db_sessions, best.measurement_id).id
    (cand,) = queries_candidates(db_sessions, confirming.batch_id)
    with transaction(db_sessions) as s:
        measurements.record_measurement(s, batch_candidate_id=cand, lease_id=confirming.id, agent_id=b2,
                                   record=_record(_input(0), 0.01), fingerprint=FINGERPRINT)  # fmt: skip
    with transaction(db_sessions) as s:
        conf = s.scalars(select(Confirmation).where(Confirmation.batch_candidate_id == cand)).one()
        assert conf.outcome is ConfirmationState.CONFIRMED  # 5x slower, yet no dispute: one party
        assert s.get(Agent, a2).confirmations_disputed == 0


def test_times_below_the_floor_are_errors_that_count_against_the_agent(db_sessions):
    from services.db import timing_floor, trust

    farm = make_farm(db_sessions, candidates=2)
    a = farm.agent_ids[0]
    floor = timing_floor.floor_secs({"kind": "llvm"}, flops=1e6, io_bytes=None)
    held = lease(db_sessions, a)
    too_fast = record(db_sessions, farm, held, a, index=0, cost=floor / 2)
    record(db_sessions, farm, held, a, index=1, cost=floor * 2)  # fast, but possible
    with transaction(db_sessions) as s:
        m = s.get(Measurement, too_fast.measurement_id)
        assert m.error_kind is ErrorKind.BELOW_FLOOR and m.cost is None and "timing floor" in m.record["error_msg"]
        assert _confirmation_batch(db_sessions, too_fast.measurement_id) is None
        assert s.get(JobTask, farm.job_task_id).best_cost == floor * 2
        row = s.get(Agent, a)
        assert row.below_floor == 1 and row.errors_by_kind == {"below_floor": 1}
        assert trust.standing(trust.AgentCounts.of(row)) is trust.Standing.FLAGGED


def test_vouching_numbers_a_believed_agents_measurements_once(db_sessions):
    from services.db import confirmations

    farm = make_farm(db_sessions, candidates=2)
    a, b = farm.agent_ids
    held = lease(db_sessions, a)
    best = record(db_sessions, farm, held, a, index=0, cost=0.002)
    record(db_sessions, farm, held, a, index=1, cost=None)  # an error: learnt too (as a bad program), once believed
    with transaction(db_sessions) as s:
        leases.finish_lease(s, lease_id=held.id, agent_id=a)
        assert confirmations.vouch(s, device_class_id=farm.device_class_id) == 0  # a: nothing confirmed yet
    confirming = lease(db_sessions, b)
    (cand,) = queries_candidates(db_sessions, confirming.batch_id)
    with transaction(db_sessions) as s:
        measurements.record_measurement(s, batch_candidate_id=cand, lease_id=confirming.id, agent_id=b,
                                   record=_record(_input(0), 0.002), fingerprint=FINGERPRINT)  # fmt: skip
    with transaction(db_sessions) as s:
        assert confirmations.vouch(s, device_class_id=farm.device_class_id) == 2  # a is trusted now: both
    with transaction(db_sessions) as s:
        assert confirmations.vouch(s, device_class_id=farm.device_class_id) == 0  # once
        seqs = s.scalars(select(Measurement.vouched_seq).where(Measurement.job_id == farm.job_id)).all()
        assert len(set(seqs)) == 2 and None not in seqs
    assert best.created


def test_a_quarantined_agent_gets_no_lease_until_the_quarantine_is_lifted(db_sessions):
    farm = make_farm(db_sessions, batches=2)
    a, b = farm.agent_ids
    held = lease(db_sessions, a)
    record(db_sessions, farm, held, a, index=0, cost=0.002)
    with transaction(db_sessions) as s:
        name = s.get(Agent, a).name
        agent = agents.quarantine_agent(s, name=name)
        assert agent.state is AgentState.DISABLED and agent.quarantined_at is not None
        assert s.get(Lease, held.id).state is LeaseState.EXPIRED  # its lease ended at once
        assert s.get(JobTask, farm.job_task_id).best_cost is None  # its unconfirmed time counts for nothing
    assert lease(db_sessions, a) is None
    with transaction(db_sessions) as s:
        assert leases.heartbeat(s, agent_id=a, lease_secs=LEASE_SECS) == []
        assert s.get(Agent, a).state is AgentState.DISABLED  # a heartbeat does not end it
    assert lease(db_sessions, b).batch_id == held.batch_id  # its batch went to another agent
    with transaction(db_sessions) as s:
        assert agents.lift_quarantine(s, name=name).state is AgentState.OFFLINE
        assert s.get(JobTask, farm.job_task_id).best_cost == 0.002
        leases.heartbeat(s, agent_id=a, lease_secs=LEASE_SECS)
    assert lease(db_sessions, a) is not None
    with pytest.raises(RowNotFound), transaction(db_sessions) as s:
        agents.quarantine_agent(s, name="no such agent")


def test_a_flagged_agent_is_leased_nothing_while_an_honest_one_is(db_sessions):
    """A flagged agent's timings are not believed: every trial it ran would be spent for
    nothing, so it gets no batch and no model run, and `lease_withheld` says why."""
    farm = make_farm(db_sessions, batches=2)
    liar, honest = farm.agent_ids
    file = model_runs.StoredFile("model_runs/x/model.so", "0" * 64, 10)
    with transaction(db_sessions) as s:
        s.get(Agent, liar).below_floor = 1
        run = model_runs.create_model_run(s, job_id=farm.job_id, device_class_id=farm.device_class_id, library=file,
                                       inputs=file, repeat=3, warmup=1, timeout_secs=60.0).id  # fmt: skip
    assert lease(db_sessions, liar) is None
    with transaction(db_sessions) as s:
        assert model_runs.lease_model_run(s, agent_id=liar, lease_secs=LEASE_SECS, max_attempts=2) is None
        reason = leases.lease_withheld(s, agent_id=liar)
        assert reason.startswith("flagged") and "below the timing floor" in reason
        assert leases.lease_withheld(s, agent_id=honest) is None
        assert leases.heartbeat(s, agent_id=liar, lease_secs=LEASE_SECS) == []  # it still heartbeats
        leases.heartbeat(s, agent_id=honest, lease_secs=LEASE_SECS)
    with transaction(db_sessions) as s:  # the scheduler counts the honest one only (fair share, model runs)
        from services.db import job_store

        assert job_store.live_agents_by_class(s, fresh_secs=60).get(farm.device_class_id) == 1
    assert lease(db_sessions, honest).batch_id == farm.batch_ids[0]
    with transaction(db_sessions) as s:
        assert model_runs.lease_model_run(s, agent_id=honest, lease_secs=LEASE_SECS, max_attempts=2).id == run
        s.get(Agent, liar).below_floor = 0
        s.get(Agent, liar).confirmations_disputed = 2  # disputed as often as confirmed (never): flagged too
        assert "disputed by other agents" in leases.lease_withheld(s, agent_id=liar)
        name = s.get(Agent, liar).name
        pardoned = agents.clear_flags(s, name=name)  # an operator's word: it is leased again
        assert (pardoned.below_floor, pardoned.confirmations_disputed) == (0, 0)
        assert leases.lease_withheld(s, agent_id=liar) is None
        s.get(Agent, liar).below_floor = 1
        agents.quarantine_agent(s, name=name)
        assert leases.lease_withheld(s, agent_id=liar).startswith("quarantined")
    assert lease(db_sessions, liar) is None
    with transaction(db_sessions) as s:
        agents.lift_quarantine(s, name=name)
        leases.heartbeat(s, agent_id=liar, lease_secs=LEASE_SECS)
    assert lease(db_sessions, liar) is None  # let out of quarantine, still flagged


def test_a_finishing_job_waits_for_confirmations_and_builds_with_confirmed_bests_only(db_sessions, tmp_path):
    """The scheduler's side (`FarmJob.finish`): the tuned model gets each task's fastest
    kernel that a second measurement confirmed, never a disputed or unconfirmed one."""
    from types import SimpleNamespace

    from services.scheduler.exceptions import FinishInterrupted
    from services.scheduler.farm_job import FarmJob, RunnerContext

    farm = make_farm(db_sessions, candidates=2)
    a, b = farm.agent_ids
    held = lease(db_sessions, a)
    record(db_sessions, farm, held, a, index=0, cost=0.001)  # its best: a confirmation is open
    record(db_sessions, farm, held, a, index=1, cost=0.002)
    with transaction(db_sessions) as s:
        leases.finish_lease(s, lease_id=held.id, agent_id=a)
        task_key = s.get(JobTask, farm.job_task_id).task_key
    ctx = RunnerContext(sessions=db_sessions, artifact_root=tmp_path, measurer_factory=None, check_tuned_model=False,
                        log=lambda msg: None, confirm_wait_secs=60.0)  # fmt: skip
    runner = FarmJob(ctx, SimpleNamespace(job_id=farm.job_id, start_model_trained_on=None), shared=None)
    records = [_record(_input(0), 0.001), _record(_input(1), 0.002)]
    runner.tasks = [SimpleNamespace(key=task_key, workload=SimpleNamespace(key="w", name="w"))]
    runner.tuners = [SimpleNamespace(state=SimpleNamespace(records=records))]
    ctx.stop.set()  # the scheduler stops while the job waits: it finishes on the next pick
    with pytest.raises(FinishInterrupted):
        runner._await_confirmations()
    ctx.stop.clear()
    assert runner._confirmed_bests() == {"w": None}  # nothing confirmed yet: the default schedule

    def confirm(agent_id: int, index: int, cost: float) -> None:
        held = lease(db_sessions, agent_id)
        (cand,) = queries_candidates(db_sessions, held.batch_id)
        with transaction(db_sessions) as s:
            measurements.record_measurement(s, batch_candidate_id=cand, lease_id=held.id, agent_id=agent_id,
                                       record=_record(_input(index), cost), fingerprint=FINGERPRINT)  # fmt: skip
            leases.finish_lease(s, lease_id=held.id, agent_id=agent_id)

    confirm(b, 0, 0.01)  # b measures the fastest 10x slower: disputed; the next one is confirmed in turn
    confirm(b, 1, 0.0021)
    runner._await_confirmations()  # none open: returns at once
    assert runner._confirmed_bests() == {"w": records[1]}


def _wait_for_a_blocked_lock(factory, waiter: threading.Thread) -> None:
    """Until some transaction in this database waits on a row lock (the sweeper's, on the
    lease the heartbeat holds); fails if the waiter ends first or nothing waits in 60 s."""
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert waiter.is_alive(), "the sweep ended without waiting on the renewed lease's row"
        with factory() as s:
            if s.execute(
                text("select count(*) from pg_stat_activity where datname = current_database() "
                     "and wait_event_type = 'Lock'")
            ).scalar():
                return
        time.sleep(0.05)
    raise AssertionError("the sweep never waited on the renewed lease's row")


def test_a_lease_renewed_while_the_sweep_expires_it_keeps_its_batch_leased(db_sessions):
    """The sweep locks the batches whose leases look expired, then expires those leases; a
    heartbeat (which locks no batch) may renew one in between. That lease stays active,
    so its batch must stay leased: requeued, the next agent's lease of it would break the
    one-active-lease-per-batch rule (a Conflict the agent took for a name clash, and exited)."""
    farm = make_farm(db_sessions)
    a, b = farm.agent_ids
    held = lease(db_sessions, a)
    t0 = db_now(db_sessions)
    renewing = db_sessions()  # the heartbeat's transaction, left open: it holds the lease's row
    assert leases.heartbeat(
        renewing, agent_id=a, lease_secs=LEASE_SECS, lease_ids=[held.id], now=t0 + timedelta(seconds=1000)
    ) == [held.id]
    swept: dict[str, list[int]] = {}

    def sweep() -> None:  # scans the committed (expired) lease, then waits on its row
        with transaction(db_sessions) as s:
            swept["expired"] = leases.expire_leases(s, now=t0 + timedelta(seconds=LEASE_SECS + 1))

    sweeper = threading.Thread(target=sweep)
    sweeper.start()
    _wait_for_a_blocked_lock(db_sessions, sweeper)
    renewing.commit()
    renewing.close()
    sweeper.join(30)
    assert held.batch_id not in swept["expired"]  # other tests' batches in this database may be requeued
    with transaction(db_sessions) as s:
        assert s.get(Batch, held.batch_id).state is BatchState.LEASED
    assert lease(db_sessions, b) is None
