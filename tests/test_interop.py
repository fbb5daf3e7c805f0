"""Our records applied by TVM MetaSchedule's own database tools."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm.s_tir import meta_schedule as ms

from tunefarm.records import ErrorKind, MeasureRecord
from tunefarm.search.space.realize import realize, trace_json
from tunefarm.search.task import make_task
from tunefarm.store import JsonlRecordStore
from tunefarm.workloads import registry
from tunefarm_app.interop import export_metaschedule


def test_export_is_applied_by_metaschedule(tmp_path, host_target):
    import random

    wl = registry.make("matmul", {"M": 32, "N": 32, "K": 16})
    task = make_task(wl, host_target)
    store = JsonlRecordStore(tmp_path / "r.jsonl")
    store.put_workload(task.key, wl.name, wl.to_json())
    rng = random.Random(0)
    recs = []
    for i, built in enumerate(task.space.sample_many(3, rng)):
        sch = realize(wl.mod, built.program.instructions)
        recs.append(
            MeasureRecord(task.key, wl.name, host_target, built.candidate.sketch, task.sketch_signature(built.candidate.sketch),
                          built.candidate.decisions, trace_json(sch), (1e-3 * (i + 1),), ErrorKind.NONE, "", 0.1, 0.1, True, 0.0)
        )
    store.append(recs)
    n, out = export_metaschedule(store.path, tmp_path / "db")
    assert n == 3
    db = ms.database.JSONDatabase(work_dir=str(out))
    assert len(db) == 3
    target = tvm.target.Target(host_target)
    scheduled = db.query_ir_module(wl.mod, target, "main")
    assert scheduled is not None
    best = db.get_top_k(db.commit_workload(wl.mod), 1)[0]
    assert float(best.run_secs[0]) == pytest.approx(1e-3)
    ex = tvm.compile(scheduled, target=target)
    a = np.random.rand(32, 16).astype("float32")
    b = np.random.rand(16, 32).astype("float32")
    c = tvm.runtime.empty((32, 32), "float32", tvm.cpu())
    ex["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b), c)
    np.testing.assert_allclose(c.numpy(), a @ b, rtol=1e-4, atol=1e-4)
