"""The tuned model's latency lines (`tunefarm_app.tuned_report.latency_lines`), as `tune`,
`run` and `report` print them."""

from __future__ import annotations

from tunefarm_app.tuned_report import latency_lines, rounds_disagree


def _latency(p50: float, rounds: list[float]) -> dict:
    return {"mean": p50, "median": p50, "p90": p50, "p99": p50, "runs": 100, "threads": 2, "round_medians": rounds}


def test_a_comparison_whose_rounds_disagree_says_the_machine_was_busy():
    ours = _latency(1.0e-3, [1.0e-3] * 5)
    steady = {"latency": ours, "openvino_latency": _latency(1.1e-3, [1.10e-3, 1.08e-3, 1.12e-3, 1.1e-3, 1.09e-3])}
    busy = {"latency": ours, "openvino_latency": _latency(1.1e-3, [0.68e-3, 1.12e-3, 1.19e-3, 1.1e-3, 1.15e-3])}
    assert not any("rounds disagree" in line for line in latency_lines(steady))
    lines = latency_lines(busy)
    assert any("vs OpenVINO" in line and "0.68-1.19x" in line for line in lines)
    assert any("the rounds disagree (0.68-1.19x)" in line and "tunefarm run" in line for line in lines)
    assert rounds_disagree([1.0, 1.25]) and not rounds_disagree([1.0, 1.2]) and not rounds_disagree([0.7])
