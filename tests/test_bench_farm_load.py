"""`tunefarm bench farm-load` on a small farm (real PostgreSQL, Redis, lease service, API
and build workers; simulated agents): every candidate of every search batch measured
exactly once and returned to its job once; the confirmations the lease service adds for
the jobs' bests are not counted as candidates left unmeasured."""

from __future__ import annotations

import json

import pytest

from tunefarm_app.cli import main


@pytest.mark.slow
def test_a_small_farm_load_loses_nothing(tmp_path, capsys):
    out = tmp_path / "load.json"
    code = main([
        "bench", "farm-load", "--agents", "6", "--jobs", "2", "--batches-per-job", "3", "--batch-size", "4",
        "--pollers", "2", "--timeout", "300", "--json", str(out),
    ])  # fmt: skip
    result = json.loads(out.read_text())
    lost = result["lost"]
    assert code == 0 and lost["ok"], lost
    assert lost["candidates"] == lost["measured_once"] == lost["results_returned"] == 2 * 3 * 4
    assert "nothing lost: yes" in capsys.readouterr().out
