"""The scheduler service's pure parts: fair shares, the shared model's view, workloads
rebuilt from their rows, the tuned model archive."""

from __future__ import annotations

import numpy as np
import pytest

from services.scheduler.service import fair_share
from tunefarm.models.finish import archive_directory, extract_archive


@pytest.mark.parametrize(
    ("agents", "jobs", "share"),
    [(0, 1, 1), (1, 1, 2), (4, 1, 8), (4, 2, 4), (3, 2, 3), (1, 3, 1), (2, 16, 1)],
)
def test_a_class_shares_its_agents_between_its_jobs(agents, jobs, share):
    assert fair_share(2, agents, jobs) == share
    assert fair_share(2, agents, jobs) * jobs >= min(2 * agents, jobs)  # every agent has work when there is any


def test_the_operator_sets_how_agents_time_kernels_and_a_bad_value_is_refused(monkeypatch):
    from pydantic import ValidationError

    from services.scheduler.settings import SchedulerSettings
    from tunefarm.records import TimingConfig

    assert SchedulerSettings().timing() == TimingConfig()  # the farm times as `tunefarm tune` does
    monkeypatch.setenv("TUNEFARM_TIMING_REPEAT", "9")
    monkeypatch.setenv("TUNEFARM_TIMING_MIN_REPEAT_MS", "100")
    assert SchedulerSettings().timing() == TimingConfig(repeat=9, min_repeat_ms=100.0)
    monkeypatch.setenv("TUNEFARM_TIMING_REPEAT", "0")
    with pytest.raises(ValidationError, match="timing_repeat"):
        SchedulerSettings()


def test_the_shared_models_view_predicts_but_never_learns():
    from services.scheduler.shared_model import ClassModel, SharedModelView
    from tunefarm.search.cost_model import XGBConfig, XGBCostModel

    model = XGBCostModel(XGBConfig(num_warmup_samples=4, adaptive_training=False))
    rng = np.random.default_rng(0)
    feats = [rng.random((2, 5)).astype(np.float32) for _ in range(8)]
    model.update(feats, [float(i + 1) for i in range(8)], ["t"] * 8)
    view = SharedModelView(ClassModel(1, {}, model, None, None, 0, 0))
    assert view.trained_on == model.trained_on > 0 and view.num_samples == 8
    view.update(feats, [1.0] * 8, ["t"] * 8)  # sessions' retraining goes nowhere: the class model learns from Postgres
    assert model.num_samples == 8
    assert np.array_equal(view.predict(feats), model.predict(feats))


def test_a_workload_row_rebuilds_with_its_key():
    pytest.importorskip("tvm")
    from tvm import te

    from tunefarm.workloads import workload_from_te
    from tunefarm.workloads.base import workload_from_stored

    a = te.placeholder((8, 8), name="A")
    w = te.placeholder((8, 8), name="W")
    k = te.reduce_axis((0, 8), name="k")
    c = te.compute((8, 8), lambda i, j: te.sum(a[i, k] * w[k, j], axis=k), name="C")
    workload = workload_from_te("mm", [a, w, c]).with_constants([1])
    again = workload_from_stored(key=workload.key, name=workload.name, module_json=workload.to_json(), n_outputs=1)
    assert again.key == workload.key and again.constants == (1,)


def test_the_archive_round_trips_and_refuses_strange_entries(tmp_path):
    import io
    import tarfile

    from tunefarm.errors import ModelError

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "model.so").write_bytes(b"\x7fELF")
    (src / "sub" / "x.json").write_text("{}")
    archive = archive_directory(src, tmp_path / "a" / "tuned.tar.gz")
    files = extract_archive(archive.read_bytes(), tmp_path / "out")
    assert sorted(f.relative_to(tmp_path / "out").as_posix() for f in files) == ["model.so", "sub/x.json"]
    assert (tmp_path / "out" / "model.so").read_bytes() == b"\x7fELF"
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w:gz") as tar:
        info = tarfile.TarInfo("tuned/../../escape.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ModelError, match="unexpected entry"):
        extract_archive(evil.getvalue(), tmp_path / "evil")
    assert not (tmp_path / "escape.txt").exists()




def test_unconfirmed_bests_name_only_kernels_that_would_have_changed_the_model():
    """A task's unconfirmed fastest kernel is listed (the model uses a slower confirmed one);
    an alternative's unconfirmed best is listed only when it beats what its task took."""
    from services.scheduler.farm_job import unconfirmed_bests
    from tunefarm.models.alternatives import Member, choices
    from tunefarm.records import Candidate, ErrorKind, MeasureRecord

    def record(name: str, cost: float, n: int) -> MeasureRecord:
        return MeasureRecord(
            task=f"{name}@t", workload=name, target={}, sketch=0, sketch_sig="s",
            decisions=Candidate.make(0, {"x": n}).decisions, trace=[], costs=(cost,), error_kind=ErrorKind.NONE,
            error_msg="", build_secs=0.0, run_secs=0.0, verified=True, timestamp=0.0,
        )  # fmt: skip

    conv, w2, w4, add = "conv", "conv+winograd2", "conv+winograd4", "add"
    searched = {
        conv: (conv, record(conv, 5.0, 1)),  # confirmed
        w2: (w2, record(w2, 7.0, 2)),  # unconfirmed, slower than the direct program the model took
        w4: (w4, record(w4, 3.0, 3)),  # unconfirmed, faster: it would have been taken
        add: (add, record(add, 1.0, 4)),  # unconfirmed; the model uses its slower confirmed kernel
    }
    confirmed = {conv: searched[conv][1], w2: None, w4: record(w4, 6.0, 5), add: record(add, 2.0, 6)}
    groups = {conv: [conv, w2, w4], add: [add]}
    chosen = choices(groups, {k: Member(k, k, confirmed[k], 4) for k in searched})
    assert chosen[conv].chosen.key == conv
    assert unconfirmed_bests(searched, confirmed, groups, chosen) == [w4, add]
    # a task nothing of which was confirmed: its unconfirmed best is listed
    assert unconfirmed_bests({add: searched[add]}, {add: None}, {add: [add]}, choices({add: [add]}, {add: Member(add, add, None, 4)})) == [add]
