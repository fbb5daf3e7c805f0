"""Fair share is by team first, then by job: against a real PostgreSQL, the lease queue
of a class hands its agents to the teams in turns however many jobs each runs, and the
scheduler's caps give each team an equal part of the class's batches in flight."""

from __future__ import annotations

import uuid
from collections import Counter

from farm_fixtures import placeholder_model

from services.db import batches, codec, leases
from services.db.job_store import RunningJob
from services.db.models import Agent, Batch, BatchCandidate, DeviceClass, Job, JobTask, Team, WorkloadRow
from services.db.session import transaction
from services.db.states import BatchState
from services.scheduler.service import fair_caps
from tunefarm.records import Candidate, MeasureInput, TimingConfig

LEASE_SECS = 60.0
CANDIDATE = MeasureInput("t#0@x", Candidate.make(0, {"C.tile": (4, 1)}), "sig", [["trace"]])


def seed_class(factory, *, jobs_per_team: dict[str, int], batches_per_job: int, agents: int):
    """A device class with `agents` agents and, per team, its jobs' ready batches, made
    ready team by team in the order given (the first team's batches are the oldest)."""
    uid = uuid.uuid4().hex[:10]
    job_team: dict[int, str] = {}
    batch_ids: list[int] = []
    with transaction(factory) as s:
        dc = DeviceClass(name=f"fair-{uid}", target={"kind": "llvm"})
        wl = WorkloadRow(key=f"w#{uid}", name="w", module_json="{}", flops=1e6, n_inputs=2, n_outputs=1)
        s.add_all([dc, wl])
        s.flush()
        for name, n_jobs in jobs_per_team.items():
            team = Team(name=f"{name}-{uid}")
            s.add(team)
            s.flush()
            model = placeholder_model(team.id, {"x": [1, 3]})
            s.add(model)
            s.flush()
            for _ in range(n_jobs):
                job = Job(team_id=team.id, model_id=model.id, device_class_id=dc.id, trial_budget=100)
                s.add(job)
                s.flush()
                task = JobTask(job_id=job.id, workload_id=wl.id, task_key=f"{wl.key}@x", position=0, weight=1)
                s.add(task)
                s.flush()
                job_team[job.id] = name
                for _ in range(batches_per_job):
                    batch = Batch(job_id=job.id, job_task_id=task.id, workload_id=wl.id, device_class_id=dc.id,
                                  timing=codec.timing_to_json(TimingConfig()), build_timeout_secs=60.0,
                                  run_timeout_secs=30.0)
                    s.add(batch)
                    s.flush()
                    s.add(BatchCandidate(batch_id=batch.id, position=0, candidate_key=CANDIDATE.key,
                                         input=codec.input_to_json(CANDIDATE)))
                    batch_ids.append(batch.id)
        agent_rows = [Agent(device_class_id=dc.id, name=f"agent-{uid}-{i}") for i in range(agents)]
        s.add_all(agent_rows)
        s.flush()
        agent_ids = [a.id for a in agent_rows]
    for b in batch_ids:  # one transaction each: ready in this order
        with transaction(factory) as s:
            batches.transition_batch(s, batch_id=b, to=BatchState.BUILDING)
            assert batches.mark_batch_ready(s, batch_id=b) is BatchState.READY
    return job_team, agent_ids


def lease_in_turn(factory, agent_ids: list[int]) -> list[int]:
    """Each agent leases one batch (and keeps it); the job of each lease, in order."""
    jobs = []
    for agent_id in agent_ids:
        with transaction(factory) as s:
            lease = leases.lease_next_batch(s, agent_id=agent_id, lease_secs=LEASE_SECS)
            assert lease is not None
            jobs.append(lease.batch.job_id)
    return jobs


def test_the_agents_go_to_the_teams_in_turns_then_to_each_teams_jobs(db_sessions):
    """Team A has three jobs whose batches are all older than team B's one job's: the
    agents still alternate between the teams, and A's turns go round its jobs."""
    job_team, agents = seed_class(db_sessions, jobs_per_team={"a": 3, "b": 1}, batches_per_job=4, agents=8)
    leased = lease_in_turn(db_sessions, agents)
    teams = [job_team[j] for j in leased]
    assert teams == ["a", "b"] * 4, teams
    a_jobs = [j for j in leased if job_team[j] == "a"]
    assert sorted(Counter(a_jobs).values()) == [1, 1, 2], a_jobs  # round its three jobs, oldest first
    assert a_jobs[:3] == sorted(a_jobs[:3])


def test_one_team_one_job_is_still_first_in_first_out(db_sessions):
    job_team, agents = seed_class(db_sessions, jobs_per_team={"solo": 1}, batches_per_job=4, agents=1)
    batches = []
    for _ in range(4):
        with transaction(db_sessions) as s:
            batches.append(leases.lease_next_batch(s, agent_id=agents[0], lease_secs=LEASE_SECS).batch_id)
    assert batches == sorted(batches)


def test_the_schedulers_caps_split_a_class_between_teams_first():
    """4 agents x 2 batches each: team A's 25 jobs share half of them, team B's one job
    has the other half; a team alone shares all of them between its jobs."""
    running = [RunningJob(i, 1, 100) for i in range(1, 26)] + [RunningJob(26, 1, 200)]
    caps = fair_caps(2, {1: 4}, running)
    assert caps[26] == 4
    assert all(caps[i] == 1 for i in range(1, 26))
    alone = fair_caps(2, {2: 4}, [RunningJob(1, 2, 100), RunningJob(2, 2, 100)])
    assert alone == {1: 4, 2: 4}
    no_agents = fair_caps(2, {}, [RunningJob(1, 3, 100)])
    assert no_agents == {1: 1}
