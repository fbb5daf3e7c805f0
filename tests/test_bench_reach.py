"""`tunefarm bench models`: trials to reach another run's final latency, from the
report's time series (synthetic time series, nothing tuned)."""

from __future__ import annotations

import pytest

from tunefarm_app.bench.models import ModelRow, final_estimate, reach_figures, render, trials_to_reach


def _timeline(points):
    """(trials, estimate seconds or None while some task is unmeasured) per round."""
    return [
        {"trials": t, "estimated_seconds": {"m": est or 0.0}, "unknown_tasks": [] if est else [1]}
        for t, est in points
    ]


def test_trials_to_reach_counts_only_complete_estimates():
    fast = _timeline([(8, None), (16, 5.0), (32, 3.0), (64, 2.0)])
    slow = _timeline([(8, 6.0), (16, 5.5), (32, 4.0), (64, 3.0)])
    assert final_estimate(fast, "m") == 2.0 and final_estimate(_timeline([(8, None)]), "m") is None
    assert trials_to_reach(fast, 3.0, "m") == 32
    assert trials_to_reach(slow, 2.0, "m") is None
    assert trials_to_reach(fast, 10.0, "m") == 16  # not at 8: a task was unmeasured


def test_reach_figures_against_round_robin_metaschedule_and_the_ablation():
    ours = _timeline([(16, 5.0), (32, 3.0), (64, 2.0)])
    rr = _timeline([(16, 6.0), (32, 4.0), (64, 3.0)])
    off = _timeline([(16, 5.5), (32, 3.5), (64, 2.5)])
    row = ModelRow("m", 64, ours=1e-3, metaschedule=1.5e-3, round_robin=1.5e-3, ablation_off=1.2e-3)
    timelines = {"ours": ours, "round_robin": rr, "ablation_off": off}
    row.final_estimates = {k: final_estimate(t, "m") for k, t in timelines.items()}
    row.reach = reach_figures(row, timelines, "m")
    assert row.reach == {"ours->RR": 32, "RR->ours": None, "ours->MS": 32, "on->off": 64, "off->on": None}
    text = "\n".join(render([row], {}))
    assert "ours to RR final" in text and "32 (50%)" in text and "off to on final" in text


def test_a_model_row_ratio_is_the_median_of_the_rounds_not_pooled_p50s():
    # a phased machine: pooled p50s 1.0 ms (ours) and 0.6 ms (OpenVINO) would say 0.6x,
    # while every round had both engines within 5% of each other
    row = ModelRow("m", 64, ours=1.0e-3, openvino=0.6e-3, onnxruntime=2.0e-3)
    row.latencies = {
        "ours": {"median": 1.0e-3, "round_medians": [1.0e-3, 0.6e-3, 1.1e-3, 0.62e-3, 1.0e-3]},
        "openvino": {"median": 0.6e-3, "round_medians": [1.05e-3, 0.6e-3, 1.1e-3, 0.6e-3, 0.98e-3]},
    }
    assert row.ratio("openvino") == pytest.approx(1.0)
    assert row.ratio("onnxruntime") == pytest.approx(2.0)  # not timed in rounds here: p50 over p50
    assert row.ratio("metaschedule") is None
    text = "\n".join(render([row], {}))
    assert "1.00x" in text and "0.97-1.05" in text  # the rounds' range beside the median
    assert row.ratio_range("onnxruntime") is None
