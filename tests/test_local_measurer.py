"""Embedded mode's measurer keeps builds and runs apart on a CPU, and builds ahead on a GPU.

The builder and runner here are recording stand-ins (the real ones are exercised by
test_measure.py and test_tuner.py): a build or run takes a moment and logs when it
starts and ends, so the order of events shows what overlapped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from tunefarm.measure import MeasureBatch, MeasureTask
from tunefarm.measure.builder import Builder
from tunefarm.measure.local import MAX_ROUNDS_IN_FLIGHT, LocalMeasurer, rounds_in_flight
from tunefarm.measure.runner import Runner
from tunefarm.records import BuildInput, BuildResult, Candidate, MeasureInput, RunInput, RunResult

STEP_SECS = 0.05


class Events:
    def __init__(self, batches: list[MeasureBatch]):
        self.lock = threading.Lock()
        self.log: list[tuple[str, str]] = []  # (event, batch id)
        self.batch_of = {m.key: b.id for b in batches for m in b.inputs}  # candidate key -> batch id
        self.first_batch = batches[0].id
        self.a_run_started = threading.Event()

    def add(self, event: str, batch: str) -> None:
        with self.lock:
            self.log.append((event, batch))
        if event == "run-start":
            self.a_run_started.set()


class RecordingBuilder(Builder):
    parallelism = 4

    def __init__(self, events: Events, hold_later_builds: bool = False):
        self.events = events
        # Later batches' builds end only once a kernel has started running (or after a
        # generous wait), so whether builds overlap runs depends on the measurer, not on
        # how the threads happen to be scheduled.
        self.hold_later_builds = hold_later_builds

    def build(self, inputs: Sequence[BuildInput]) -> list[BuildResult]:
        batch = self.events.batch_of[inputs[0].candidate_key]
        self.events.add("build-start", batch)
        time.sleep(STEP_SECS)
        if self.hold_later_builds and batch != self.events.first_batch:
            self.events.a_run_started.wait(timeout=10)
        self.events.add("build-end", batch)
        return [BuildResult(i.candidate_key, f"/nonexistent/{i.candidate_key}", STEP_SECS) for i in inputs]

    def close(self) -> None:
        pass


class RecordingRunner(Runner):
    def __init__(self, events: Events):
        self.events = events

    def run(self, inputs: Sequence[RunInput]) -> list[RunResult]:
        (inp,) = inputs
        batch = self.events.batch_of[inp.candidate_key]
        self.events.add("run-start", batch)
        time.sleep(STEP_SECS)
        self.events.add("run-end", batch)
        return [RunResult(inp.candidate_key, (1e-3,), STEP_SECS)]

    def close(self) -> None:
        pass


def batch(name: str, n: int = 2) -> MeasureBatch:
    task = MeasureTask("task", "wl.json", "wl", {"kind": "cuda", "arch": "sm_90"}, "data.npz", 2, 1, True)
    inputs = tuple(
        MeasureInput("task", Candidate.make(0, {"batch": ord(name), "i": i}), "sig", []) for i in range(n)
    )
    return MeasureBatch(id=name, task=task, inputs=inputs)


def measure(
    batches: list[MeasureBatch], builds_ahead: int, tmp_path, hold_later_builds: bool = False
) -> tuple[list[tuple[str, str]], list]:
    events = Events(batches)
    builder = RecordingBuilder(events, hold_later_builds)
    measurer = LocalMeasurer(builder, RecordingRunner(events), tmp_path, builds_ahead=builds_ahead)
    records = []
    try:
        for b in batches:
            measurer.submit(b)
        deadline = time.monotonic() + 30
        while measurer.pending and time.monotonic() < deadline:
            records += measurer.collect(timeout=1.0)
    finally:
        measurer.close()
    return events.log, records


def overlapped(log: list[tuple[str, str]]) -> bool:
    """Whether a batch was built while a kernel of another batch ran."""
    building: set[str] = set()
    running: set[str] = set()
    for event, b in log:
        kind, edge = event.split("-")
        mine, other = (building, running) if kind == "build" else (running, building)
        if edge == "start":
            if other - {b}:
                return True
            mine.add(b)
        else:
            mine.discard(b)
    return False


def test_on_a_cpu_a_batch_is_built_only_after_the_one_before_it_has_run(tmp_path):
    log, records = measure([batch("a"), batch("b"), batch("c")], builds_ahead=0, tmp_path=tmp_path)
    assert len(records) == 6 and all(r.is_valid for r in records)
    assert not overlapped(log)
    assert [e for e in log if e[0] == "build-start"] == [("build-start", x) for x in "abc"]
    # b's build starts after a's last run ended
    assert log.index(("build-start", "b")) > max(i for i, e in enumerate(log) if e == ("run-end", "a"))


def test_on_a_gpu_later_batches_are_built_while_one_runs_and_results_keep_their_order(tmp_path):
    batches = [batch("a"), batch("b"), batch("c")]
    log, records = measure(batches, builds_ahead=2, tmp_path=tmp_path, hold_later_builds=True)
    assert len(records) == 6 and all(r.is_valid for r in records)
    assert overlapped(log)
    # runs stay one kernel at a time and in submission order
    runs = [b for e, b in log if e == "run-start"]
    assert runs == ["a", "a", "b", "b", "c", "c"]
    depth = 0
    for e, _ in log:
        depth += {"run-start": 1, "run-end": -1}.get(e, 0)
        assert depth <= 1


def test_builds_ahead_are_bounded(tmp_path):
    log, _ = measure([batch(x) for x in "abcdef"], builds_ahead=1, tmp_path=tmp_path)
    # at most 2 batches hold a slot (one running, one built ahead): never 3 builds started before a run ended
    started = finished = 0
    for e, _ in log:
        started += e == "build-start"
        finished += e == "run-end"
        assert started <= 2 + finished // 2


def test_rounds_in_flight():
    cpu = {"kind": "llvm", "mcpu": "skylake-avx512"}
    gpu = {"kind": "cuda", "arch": "sm_90"}
    assert rounds_in_flight(cpu, 16, 2) == 1
    assert rounds_in_flight(gpu, 16, 2) == MAX_ROUNDS_IN_FLIGHT
    assert rounds_in_flight(gpu, 16, 4) == 4
    assert rounds_in_flight(gpu, 2, 32) == 2  # one builds while one runs
