"""Measurement trust's pure parts: the timing floor's formula, a confirmation's verdict,
an agent's standing, and how `tunefarm devices` says it (no database, no TVM)."""

from __future__ import annotations

import pytest

from services.db import timing_floor, trust
from services.db.states import ConfirmationState
from tunefarm.records import Candidate, ErrorKind, MeasureRecord
from tunefarm_app.farm_commands import _standing


def _record(costs: tuple[float, ...], kind: ErrorKind = ErrorKind.NONE) -> MeasureRecord:
    return MeasureRecord(
        task="t", workload="w", target={}, sketch=0, sketch_sig="s", decisions=Candidate.make(0, {}).decisions,
        trace=[], costs=costs, error_kind=kind, error_msg="", build_secs=0.0, run_secs=0.0,
        verified=kind is ErrorKind.NONE, timestamp=0.0,
    )  # fmt: skip


GEMM128 = 2 * 128**3  # FLOPs of a 128x128x128 matrix multiply
GEMM128_BYTES = 3 * 128 * 128 * 4


def test_the_floor_is_the_work_at_the_classs_peak_over_the_safety_factor():
    two_cores = {"kind": "llvm", "num-cores": 2}
    ops, _ = timing_floor.peak(two_cores)
    assert ops == 2 * timing_floor.CPU_OPS_PER_CYCLE * timing_floor.CLOCK_HZ_BOUND
    floor = timing_floor.floor_secs(two_cores, flops=GEMM128, io_bytes=GEMM128_BYTES)
    assert floor == pytest.approx(GEMM128 / ops / timing_floor.SAFETY_FACTOR)
    assert 1e-9 < floor < 2e-8  # a reported nanosecond is refused; 13 ns is the bound
    # Memory-bound work: the bytes term decides (a copy of 64 MiB does almost no FLOPs).
    copy = timing_floor.floor_secs(two_cores, flops=0, io_bytes=2 * 64 << 20)
    assert copy == pytest.approx((2 * 64 << 20) / (2 * timing_floor.CPU_BYTES_PER_CYCLE * 8e9) / 10)
    # More cores, a lower floor; a class that names none is bounded by the largest sockets.
    assert timing_floor.floor_secs({"kind": "llvm", "num-cores": 64}, flops=GEMM128, io_bytes=0) < floor
    assert timing_floor.floor_secs({"kind": "llvm"}, flops=GEMM128, io_bytes=0) == pytest.approx(
        timing_floor.floor_secs({"kind": "llvm", "num-cores": timing_floor.UNKNOWN_CORES}, flops=GEMM128, io_bytes=0)
    )
    assert timing_floor.floor_secs({"kind": "cuda", "arch": "sm_90"}, flops=GEMM128, io_bytes=0) > 0
    assert timing_floor.floor_secs({"kind": "opencl"}, flops=GEMM128, io_bytes=0) == 0  # no bound known


def test_a_real_fast_kernel_is_far_above_the_floor():
    """The bound is generous: a core doing 64 fp32 FLOPs a cycle (AVX-512, two FMA units)
    at 6 GHz, a faster CPU than any shipping, still takes 30x the floor for a GEMM."""
    target = {"kind": "llvm", "num-cores": 2}
    fastest_real = GEMM128 / (2 * 64 * 6e9)
    assert fastest_real > 30 * timing_floor.floor_secs(target, flops=GEMM128, io_bytes=GEMM128_BYTES)


def test_a_time_below_the_floor_becomes_a_below_floor_error():
    floor = 1e-8
    lie = _record((5e-9, 2e-8, 2e-8))  # one impossible repeat is enough
    stored = timing_floor.checked(lie, floor)
    assert stored.error_kind is ErrorKind.BELOW_FLOOR and not stored.is_valid and stored.costs == ()
    assert "5e-09" in stored.error_msg and "1e-08" in stored.error_msg and not stored.verified
    honest = _record((2e-8, 3e-8))
    assert timing_floor.checked(honest, floor) is honest
    crash = _record((), ErrorKind.RUN_CRASH)
    assert timing_floor.checked(crash, floor) is crash
    assert timing_floor.checked(lie, 0.0) is lie  # no floor: nothing refused


@pytest.mark.parametrize(
    ("confirmation", "same_party", "verdict"),
    [
        (_record((2.5e-4, 3e-4)), False, ConfirmationState.CONFIRMED),  # within the tolerance (fastest repeat)
        (_record((1e-4,)), False, ConfirmationState.CONFIRMED),  # faster than claimed: at least as fast
        (_record((4.1e-4, 5e-4)), False, ConfirmationState.DISPUTED),  # more than 2x slower: a false time
        (_record((4.1e-4,)), True, ConfirmationState.CONFIRMED),  # its own agent disagreeing with itself: noise
        (_record((), ErrorKind.WRONG_RESULT), False, ConfirmationState.DISPUTED),  # its output is wrong elsewhere
        (_record((), ErrorKind.RUN_CRASH), False, ConfirmationState.FAILED),  # no comparable time
        (_record((), ErrorKind.BELOW_FLOOR), False, ConfirmationState.FAILED),  # the confirmer lied
    ],
)
def test_a_confirmations_verdict(confirmation, same_party, verdict):
    assert trust.verdict(2e-4, confirmation, same_party=same_party) is verdict


def test_agents_of_one_token_are_one_party():
    assert trust.same_party((1, 7), (1, 7)) and trust.same_party((1, None), (1, None))  # the same agent
    assert trust.same_party((1, 7), (2, 7))  # two names, one token
    assert not trust.same_party((1, 7), (2, 8))
    assert not trust.same_party((1, None), (2, None))  # no token: a party of its own


@pytest.mark.parametrize(
    ("counts", "standing"),
    [
        (trust.AgentCounts(0, 0, 0, False), trust.Standing.UNCONFIRMED),
        (trust.AgentCounts(0, 1, 0, False), trust.Standing.TRUSTED),
        (trust.AgentCounts(0, 5, 1, False), trust.Standing.TRUSTED),  # one dispute among many confirmations: noise
        (trust.AgentCounts(0, 1, 1, False), trust.Standing.FLAGGED),
        (trust.AgentCounts(0, 0, 1, False), trust.Standing.FLAGGED),
        (trust.AgentCounts(1, 9, 0, False), trust.Standing.FLAGGED),  # a time below the floor is never noise
        (trust.AgentCounts(0, 3, 0, True), trust.Standing.QUARANTINED),
    ],
)
def test_an_agents_standing(counts, standing):
    assert trust.standing(counts) is standing
    assert bool(trust.flag_reasons(counts)) == trust.is_flagged(counts)


def test_tunefarm_devices_says_a_flagged_agent_is_flagged_and_why():
    counts = trust.AgentCounts(2, 1, 3, False)
    line = _standing({"standing": trust.standing(counts).value, "flag_reasons": trust.flag_reasons(counts),
                      "below_floor": 2, "confirmations_agreed": 1, "confirmations_disputed": 3})  # fmt: skip
    assert line.startswith("FLAGGED: 2 result(s) below the timing floor; 3 timing(s) disputed by other agents")
    assert "(1 confirmed, 3 disputed, 2 below the floor)" in line
    trusted = _standing({"standing": "trusted", "flag_reasons": [], "below_floor": 0, "confirmations_agreed": 4,
                         "confirmations_disputed": 0})  # fmt: skip
    assert trusted == "trusted (4 confirmed, 0 disputed, 0 below the floor)"


# -- what the API and the dashboard show (a real PostgreSQL) ----------------------------------


@pytest.fixture(scope="module")
def api(database_url, db_sessions, tmp_path_factory):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from services.api.app import create_app
    from services.api.settings import ApiSettings
    from tunefarm_app.bench.farm_progress import seed_job

    job = seed_job(db_sessions, measurements=40, tasks=2)
    settings = ApiSettings(database_url=database_url, api_allowed_hosts=["testserver"], artifact_root=tmp_path_factory.mktemp("artifacts"),
                           token_cache_secs=0)  # fmt: skip
    with TestClient(create_app(settings)) as client:
        yield client, job


def test_devices_show_each_agents_standing_and_why_it_is_flagged(api, db_sessions):
    from sqlalchemy import func

    from services.db import device_classes
    from services.db.models import Agent
    from services.db.session import transaction
    from services.db.states import AgentState

    client, job = api
    with transaction(db_sessions) as s:
        dc = device_classes.ensure_device_class(s, name="trust-class", target={"kind": "llvm", "num-cores": 2})
        s.add_all([
            Agent(device_class_id=dc.id, name="liar", below_floor=3, confirmations_disputed=2,
                  errors_by_kind={"below_floor": 3}, last_heartbeat_at=func.now()),
            Agent(device_class_id=dc.id, name="honest", confirmations_agreed=4, last_heartbeat_at=func.now()),
            Agent(device_class_id=dc.id, name="benched", state=AgentState.DISABLED, quarantined_at=func.now()),
        ])  # fmt: skip
    headers = {"Authorization": f"Bearer {job.team_token}"}
    devices = {d["name"]: d for d in client.get("/v1/devices", headers=headers).json()}
    liar = devices["liar"]
    assert liar["standing"] == "flagged" and liar["below_floor"] == 3 and liar["confirmations_disputed"] == 2
    assert liar["flag_reasons"] == ["3 result(s) below the timing floor",
                                    "2 timing(s) disputed by other agents, 0 confirmed"]  # fmt: skip
    assert devices["honest"]["standing"] == "trusted" and devices["honest"]["flag_reasons"] == []
    assert devices["benched"]["standing"] == "quarantined" and devices["benched"]["quarantined_at"]
    page = client.get("/ui/devices", headers=headers)
    assert page.status_code == 200
    row = page.text.split('data-agent="liar"')[1].split("</tr>")[0]
    assert 'class="state state-flagged">flagged' in row and "below the timing floor" in row
    assert 'class="state state-trusted">trusted' in page.text.split('data-agent="honest"')[1].split("</tr>")[0]


def test_a_jobs_tasks_say_whether_their_best_is_confirmed(api, db_sessions):
    from sqlalchemy import select, update

    from services.db.models import JobTask
    from services.db.session import transaction

    client, job = api
    with transaction(db_sessions) as s:
        first, second = s.scalars(select(JobTask.id).where(JobTask.job_id == job.job_id).order_by(JobTask.position))
        s.execute(update(JobTask).where(JobTask.id == first).values(best_cost=2e-3, best_confirmed=True, confirmed_cost=2e-3))
        s.execute(update(JobTask).where(JobTask.id == second).values(best_cost=1e-3, best_confirmed=False,
                                                                     confirmed_cost=None))  # fmt: skip
    headers = {"Authorization": f"Bearer {job.team_token}"}
    tasks = client.get(f"/v1/jobs/{job.job_id}", headers=headers).json()["tasks"]
    assert tasks[0]["best_confirmed"] and tasks[0]["confirmed_best_secs"] == tasks[0]["best_secs"]
    assert not tasks[1]["best_confirmed"] and tasks[1]["confirmed_best_secs"] is None and tasks[1]["best_secs"]
    page = client.get(f"/ui/jobs/{job.job_id}", headers=headers).text
    assert page.count('class="muted unconfirmed"') == 1
