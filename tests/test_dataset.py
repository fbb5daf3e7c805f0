"""The measurement dataset: records files to Parquet rows with features, noise and the
environment, emulated and failed measurements left out, and a sidecar saying how it was made."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tunefarm.dataset import export_records, read_dataset, write_dataset
from tunefarm.records import ErrorKind
from tunefarm.search.features import feature_width
from tunefarm.store import JsonlRecordStore
from tunefarm_app.cli import main


def test_records_become_a_dataset_with_features_noise_and_provenance(tmp_path, capsys):
    records = tmp_path / "mm.jsonl"
    argv = ["tune-op", "matmul", "--shape", "M=32,N=32,K=32", "--trials", "6", "--batch-size", "3",
            "--records", str(records), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    store = JsonlRecordStore(records)
    measured = store.load()
    good = [r for r in measured if not r.error_kind.is_error]
    assert good
    # one emulated and one failed measurement more: never rows (the failed one on request);
    # one timed with the caches flushed before every call: a row that says so
    store.append([dataclasses.replace(good[0], emulated=True),
                  dataclasses.replace(good[0], costs=(), error_kind=ErrorKind.RUN_ERROR, error_msg="boom"),
                  dataclasses.replace(good[0], flushed_calls=True)])  # fmt: skip
    rows, counts = export_records([records], device_class="avx512-test")
    assert counts.rows == len(good) + 1 == len(rows) and counts.skipped_emulated == 1 and counts.skipped_errors >= 1
    assert [r.flushed_calls for r in rows].count(True) == 1
    row = rows[0]
    assert row.device_class == "avx512-test" and json.loads(row.target) == good[0].target
    assert row.feature_version == 1 and all(len(f) == feature_width(1) for f in row.features) and row.features
    assert row.cost == pytest.approx(good[0].cost) and row.costs == list(good[0].costs)
    assert row.noise >= 0 and row.tvm_version and row.cores >= 1
    out = write_dataset(rows, tmp_path / "ds" / "mm.parquet", provenance={"command": "test", **counts.as_report()})
    back = read_dataset(out)
    assert len(back) == len(rows) and back[0]["task"] == row.task and back[0]["features"][0] == pytest.approx(row.features[0])
    assert [r["flushed_calls"] for r in back] == [r.flushed_calls for r in rows]
    made = json.loads((tmp_path / "ds" / "mm.parquet.json").read_text())
    assert made["rows"] == len(rows) and made["command"] == "test" and made["skipped_emulated"] == 1
    with_errors, _ = export_records([records], include_errors=True)
    assert any(r.error == "run_error" for r in with_errors)
    capsys.readouterr()
    assert main(["dataset", str(records), "--out", str(tmp_path / "cli.parquet")]) == 0
    assert f"{len(good) + 1} measurements of 1 tasks" in capsys.readouterr().out


def test_a_missing_records_file_is_one_line(tmp_path, capsys):
    assert main(["dataset", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "x.parquet")]) == 2
    assert "no such records file" in capsys.readouterr().err


def test_build_dataset_measures_the_operators_on_each_class_and_writes_one_dataset_per_class(tmp_path, capsys):
    """`build-dataset`: one records file per class and session (resumed by a rerun, which
    measures nothing more), one Parquet file per class with the workloads and budgets in
    its sidecar; an unknown class is one line, exit 2, before anything runs."""
    out = tmp_path / "data"
    argv = ["build-dataset", "--out", str(out), "--classes", "host", "--ops", "bmm", "--trials", "3", "--models", "none"]
    assert main(argv) == 0
    rows = read_dataset(out / "host.parquet")
    host_cpu = json.loads(rows[0]["target"])["mcpu"]
    assert len(rows) >= 1 and {r["device_class"] for r in rows} == {f"llvm-{host_cpu}"}  # the host's CPU names it
    assert {r["workload"] for r in rows} == {"batch_matmul(B=12,M=128,N=128,K=64)"}
    made = json.loads((out / "host.parquet.json").read_text())
    assert made["workloads"] == {"batch_matmul(B=12,M=128,N=128,K=64)": 3}
    assert made["command"] and made["sources"] == [str((out / "records" / "host-ops.jsonl").resolve())]
    records = out / "records" / "host-ops.jsonl"
    before = records.read_text()
    assert len(before.splitlines()) == 3
    assert main(argv) == 0  # resumed: the budget is spent, nothing is measured again
    assert records.read_text() == before
    capsys.readouterr()
    assert main([*argv[:4], "not-a-cpu", *argv[5:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'not-a-cpu' is neither host nor a CPU LLVM knows" in err[0]
