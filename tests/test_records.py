"""The JSON-lines record store: round trip, torn lines, the workloads sidecar."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from tunefarm.errors import RecordError
from tunefarm.records import Candidate, ErrorKind, MeasureRecord, TimingConfig, median_cost
from tunefarm.search.run import timed_like
from tunefarm.store import JsonlRecordStore


def rec(i: int, costs=(1e-3, 2e-3, 1.5e-3), error=ErrorKind.NONE, task="t#1") -> MeasureRecord:
    return MeasureRecord(
        task=task,
        workload="w",
        target={"kind": "llvm"},
        sketch=i % 2,
        sketch_sig="abc",
        decisions=Candidate.make(i % 2, {"C.tile.v_i": [i + 1, 2], "C.unroll": i}).decisions,
        trace=[[["GetSBlock", [], ["C", "main"], ["b0"]]], []],
        costs=costs if error is ErrorKind.NONE else (),
        error_kind=error,
        error_msg="" if error is ErrorKind.NONE else "boom",
        build_secs=0.1,
        run_secs=0.2,
        verified=error is ErrorKind.NONE,
        timestamp=1700000000.0 + i,
    )


def test_round_trip_keeps_every_field(tmp_path):
    store = JsonlRecordStore(tmp_path / "r.jsonl")
    records = [rec(0), rec(1, error=ErrorKind.RUN_TIMEOUT), rec(2, task="other#2")]
    store.append(records)
    assert store.load() == records
    assert store.load("other#2") == [records[2]]
    assert records[0].cost == pytest.approx(1.5e-3) and records[0].is_valid
    assert math.isinf(records[1].cost) and not records[1].is_valid
    assert records[0].candidate == Candidate(0, records[0].decisions)


def test_a_record_timed_flushed_before_every_call_says_so_and_others_do_not(tmp_path):
    flushed = replace(rec(0), flushed_calls=True)
    assert json.loads(flushed.to_json())["flushed_calls"] is True
    assert "flushed_calls" not in json.loads(rec(1).to_json())
    store = JsonlRecordStore(tmp_path / "r.jsonl")
    store.append([flushed, rec(1)])
    assert [r.flushed_calls for r in store.load()] == [True, False]


def test_a_search_resumes_only_records_timed_as_it_times():
    warm, flushed = rec(0), replace(rec(1), flushed_calls=True)
    gpu = replace(rec(2), target={"kind": "cuda", "arch": "sm_90"})  # a GPU kernel is never flushed
    assert timed_like([warm, flushed, gpu], TimingConfig()) == ([warm, gpu], 1)
    assert timed_like([warm, flushed, gpu], TimingConfig(flush_every_call=True)) == ([flushed, gpu], 1)
    assert timed_like([warm], TimingConfig(flush_every_call=True, flush_cache=False)) == ([warm], 0)


def test_a_torn_line_is_skipped_and_later_appends_survive(tmp_path):
    path = tmp_path / "r.jsonl"
    store = JsonlRecordStore(path)
    store.append([rec(0), rec(1)])
    with open(path, "a") as f:
        f.write(rec(2).to_json()[:40])  # the tuner was killed mid-write
    assert len(store.load()) == 2 and store.skipped_lines == 1
    store.append([rec(3)])
    loaded = store.load()
    assert [r.timestamp for r in loaded] == [rec(0).timestamp, rec(1).timestamp, rec(3).timestamp]
    assert store.skipped_lines == 1


def test_workloads_sidecar(tmp_path):
    store = JsonlRecordStore(tmp_path / "r.jsonl")
    assert store.get_workload("t#1") is None
    store.put_workload("t#1", "w", '{"mod": 1}')
    store.put_workload("t#1", "w", '{"mod": 2}')  # the first one is kept
    assert store.get_workload("t#1") == ("w", '{"mod": 1}')
    assert store.workloads_path.name == "r.jsonl.workloads"


def test_directory_is_not_a_records_file(tmp_path):
    with pytest.raises(RecordError):
        JsonlRecordStore(tmp_path).load()


def test_candidate_keys_ignore_decision_order():
    a = Candidate.make(1, {"x": 1, "y": [2, 3]})
    b = Candidate.make(1, {"y": (2, 3), "x": 1})
    assert a == b and a.key == b.key
    assert Candidate.make(0, {"x": 1}).key != a.key


@pytest.mark.parametrize(
    "decisions",
    [{}, {"conv.tile.ff": (1, 4, 16), "conv.unroll": 2}, {'odd"name\\é.x': 0, "empty": ()}],
)
def test_candidate_key_is_the_sketch_and_its_decisions_as_compact_json(decisions):
    """Keys are stored in records: the fast encoder must give what `json.dumps` gives."""
    c = Candidate.make(3, decisions)
    assert c.key == "3:" + json.dumps(c.decisions, separators=(",", ":"))


def test_median():
    assert median_cost([3.0, 1.0, 2.0]) == 2.0
    assert median_cost([1.0, 2.0]) == 1.5
    assert math.isinf(median_cost([]))
