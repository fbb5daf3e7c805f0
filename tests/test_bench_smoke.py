"""`tunefarm bench ops` machinery end to end on one small op with a tiny budget: tunefarm,
MetaSchedule (child process), numpy (child process), the shared kernel timing, the held-out
cost-model accuracy, the table and the JSON. No assertion on how fast anything is."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("tvm")

from tunefarm.target import host_target_dict  # noqa: E402
from tunefarm_app.bench.ops import BenchPlan, run_bench, write_json  # noqa: E402
from tunefarm_app.bench.results import summarize  # noqa: E402
from tunefarm_app.bench.suite import BenchOp  # noqa: E402
from tunefarm_app.bench.table import render  # noqa: E402


@pytest.mark.slow
def test_bench_small_gemm_end_to_end(tmp_path):
    op = BenchOp("gemm128", "matmul", constants=("B",)).with_params(M=128, N=128, K=128)
    plan = BenchPlan(
        ops=(op,), trials=8, seed=1, work_dir=tmp_path, target=host_target_dict(), ms_timeout=240
    )

    (row,) = run_bench(plan, log=lambda msg: None)

    assert row.throughput(row.ours_secs) > 0, row.notes
    assert row.throughput(row.numpy_secs) > 0, row.notes
    assert row.ms_secs is not None and math.isfinite(row.ms_secs), row.notes
    assert row.ours is not None and row.ours.trials == 8
    assert row.ms is not None and row.ms.trials == 8
    assert (tmp_path / "ours" / "gemm128.so").exists() and (tmp_path / "ms" / "gemm128.so").exists()
    # the FMA peak is measured in the same run, and no kernel is faster than it
    assert row.peak_gflops is not None and row.peak_gflops > 0
    assert 0 < row.peak_share(row.ours_secs) < 1.2

    summary = summarize([row])
    text = render([row], summary, trials=plan.trials, header=[])
    assert "gemm128" in text and "geomean ours/MS" in text and "%peak" in text
    write_json(tmp_path / "bench.json", plan, [row], summary)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["ops"][0]["op"] == "gemm128" and data["summary"]["geomean_vs_ms"] > 0
