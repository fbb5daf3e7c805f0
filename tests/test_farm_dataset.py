"""The farm's measurements as a dataset (`services.db.datasets`, `tunefarm dataset
--database-url`): only vouched-for measurements, never emulated ones, named by their device
class, each with the environment its agent reported, and features computed from the
workload row. Real records (a small embedded tune) stored as farm measurements in a
throw-away PostgreSQL database."""

from __future__ import annotations

import dataclasses
import json
import uuid

import pytest
from farm_fixtures import placeholder_model

from services.db import codec
from services.db.datasets import measured_tasks
from services.db.models import (
    Batch,
    BatchCandidate,
    DeviceClass,
    Job,
    JobTask,
    Measurement,
    Team,
    WorkloadRow,
)
from services.db.session import transaction
from tunefarm.dataset import export_measured, read_dataset
from tunefarm.records import TimingConfig
from tunefarm.search.features import feature_width
from tunefarm.store import JsonlRecordStore
from tunefarm_app.cli import main

AGENT = {"agent": "board-1", "hostname": "board-1.lab", "cpu_model": "Test CPU 9000", "physical_cores": 4,
         "tvm_version": "0.27.0", "agent_version": "0.9.0"}  # fmt: skip


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Records of a small matmul tuned here, and its stored workload."""
    records = tmp_path_factory.mktemp("farm_dataset") / "mm.jsonl"
    argv = ["tune-op", "matmul", "--shape", "M=32,N=32,K=32", "--trials", "6", "--batch-size", "3",
            "--records", str(records), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    store = JsonlRecordStore(records)
    good = [r for r in store.load() if not r.error_kind.is_error]
    assert len(good) >= 3
    return good, store.get_workload(good[0].task)


def _store(factory, records, workload, fingerprints, vouched) -> str:
    """The records as measurements of a new class's job, with these fingerprints and
    vouched-for flags; the class's name."""
    uid = uuid.uuid4().hex[:8]
    name, module_json = workload
    with transaction(factory) as s:
        team = Team(name=f"team-{uid}")
        dc = DeviceClass(name=f"x86-{uid}", target=records[0].target)
        wl = WorkloadRow(key=f"{records[0].task.split('@')[0]}-{uid}", name=name, module_json=module_json,
                         flops=2 * 32**3, n_inputs=2, n_outputs=1)  # fmt: skip
        s.add_all([team, dc, wl])
        s.flush()
        model = placeholder_model(team.id)
        s.add(model)
        s.flush()
        job = Job(team_id=team.id, model_id=model.id, device_class_id=dc.id, trial_budget=100)
        s.add(job)
        s.flush()
        jt = JobTask(job_id=job.id, workload_id=wl.id, task_key=records[0].task, position=0, weight=1)
        s.add(jt)
        s.flush()
        batch = Batch(job_id=job.id, job_task_id=jt.id, workload_id=wl.id, device_class_id=dc.id,
                      timing=codec.timing_to_json(TimingConfig()), build_timeout_secs=60.0, run_timeout_secs=30.0)  # fmt: skip
        s.add(batch)
        s.flush()
        for i, (r, fp, ok) in enumerate(zip(records, fingerprints, vouched, strict=True)):
            cand = BatchCandidate(batch_id=batch.id, position=i, candidate_key=f"{r.candidate.key}/{i}", input={"i": i})
            s.add(cand)
            s.flush()
            s.add(Measurement(batch_candidate_id=cand.id, job_id=job.id, job_task_id=jt.id, workload_id=wl.id,
                              device_class_id=dc.id, candidate_key=r.candidate.key, cost=r.cost,
                              error_kind=r.error_kind, record=codec.record_to_json(r), fingerprint=fp,
                              vouched_seq=1000 + i if ok else None))  # fmt: skip
        return dc.name


def test_only_vouched_device_measurements_of_the_farm_become_rows_with_their_agents_environment(db_sessions, measured):
    good, workload = measured
    records = [*good, good[0], good[1]]
    fingerprints = [AGENT] * len(good) + [{**AGENT, "emulated": True}, AGENT]
    vouched = [True] * len(good) + [True, False]  # an emulated timing; one its agent was never believed for
    cls = _store(db_sessions, records, workload, fingerprints, vouched)
    other = _store(db_sessions, good[:1], workload, [AGENT], [True])  # another class's
    with transaction(db_sessions) as s:
        tasks = measured_tasks(s, device_class=cls)
        assert {t.device_class for t in measured_tasks(s)} >= {cls, other}
    rows, counts = export_measured(tasks)
    assert len(rows) == counts.rows == len(good) and counts.skipped_emulated == 1
    assert {r.device_class for r in rows} == {cls}
    assert sorted(r.cost for r in rows) == sorted(r.cost for r in good)
    row = rows[0]
    assert (row.cpu_model, row.cores, row.host, row.tvm_version, row.tunefarm_version) == (
        "Test CPU 9000", 4, "board-1.lab", "0.27.0", "0.9.0")  # fmt: skip
    assert row.features and all(len(f) == feature_width(row.feature_version) for f in row.features)
    assert json.loads(row.target) == good[0].target and row.source == f"farm measurements of class {cls}"


def test_the_dataset_command_reads_the_farm_database_beside_records_files(tmp_path, database_url, db_sessions, measured,
                                                                          capsys):  # fmt: skip
    good, workload = measured
    cls = _store(db_sessions, good, workload, [AGENT] * len(good), [True] * len(good))
    out = tmp_path / "farm.parquet"
    assert main(["dataset", "--database-url", database_url, "--device-class", cls, "--out", str(out)]) == 0
    assert f"{len(good)} measurements of 1 tasks" in capsys.readouterr().out
    assert {r["device_class"] for r in read_dataset(out)} == {cls}
    made = json.loads((tmp_path / "farm.parquet.json").read_text())
    assert any(src.startswith("farm database postgresql") for src in made["sources"])
    # a bad URL or nothing to read: one line, exit 2
    assert main(["dataset", "--database-url", "postgresql://127.0.0.1:1/none", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--database-url: cannot read the farm's measurements" in err[0]
    assert main(["dataset", "--out", str(out)]) == 2
    assert "give records files, --database-url, or both" in capsys.readouterr().err


def test_an_emulated_fingerprint_marks_its_records_even_when_the_record_does_not_say_so(db_sessions, measured):
    good, workload = measured
    unmarked = dataclasses.replace(good[0], emulated=False)
    cls = _store(db_sessions, [unmarked], workload, [{**AGENT, "emulated": True}], [True])
    with transaction(db_sessions) as s:
        (task,) = measured_tasks(s, device_class=cls)
    assert [r.emulated for r in task.records] == [True]
