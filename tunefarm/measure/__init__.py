"""The contract between the search and whatever measures its programs.

The search proposes a batch (`MeasureBatch`), a `Measurer` takes it (`submit`) and hands
back the `MeasureRecord` of each program as they arrive (`collect`): the measurement as it
is recorded (and, in the farm, as it was stored), in any order, possibly across several
batches in flight, and possibly never for some (a remote agent died and its lease
expired). Everything here is plain, frozen data; the workload, the task data
and the built artifacts travel by reference (a path, or an id a farm resolves), never
by value, so a queue and remote agents can stand in for the local implementation
without the search noticing.

Implementations: `tunefarm.measure.local.LocalMeasurer` (embedded mode: build in
parallel worker processes, then run one kernel at a time on this machine) and the farm's
queue-backed measurer (`services.scheduler.farm_measurer`).

The package is the measuring library, shared by embedded mode, the farm's build workers
and the device agents (none of it imports the search):

    builder.py     `Builder`, `LocalBuilder`: programs built in isolated processes
    runner.py      `Runner`, `LocalRunner`, `run_kernel`: kernels run, checked and timed
                   in an isolated (on an agent, sandboxed) process
    task_data.py   a workload's inputs and expected outputs, as one .npz file
    local.py       `LocalMeasurer`: this contract over a builder and a runner
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tunefarm.records import MeasureInput, MeasureRecord, TimingConfig
from tunefarm.workloads import Workload


@dataclass(frozen=True)
class MeasureTask:
    """What a builder and a runner need to know about a task, by reference."""

    key: str  # the task key
    workload: str  # reference to the workload's IRModule JSON (a file in embedded mode)
    workload_name: str  # the name its records carry
    target: dict[str, Any]
    task_data: str  # reference to the inputs and, when `verify`, the expected outputs
    n_inputs: int
    n_outputs: int
    verify: bool  # the task data holds expected outputs to check every kernel against


@dataclass(frozen=True)
class MeasureBatch:
    """One round of one task: the programs to measure and how."""

    id: str  # unique within a tuning run
    task: MeasureTask
    inputs: tuple[MeasureInput, ...]
    timing: TimingConfig = field(default_factory=TimingConfig)
    build_timeout: float = 60.0  # seconds a build may take before it is a BUILD_TIMEOUT
    run_timeout: float = 30.0  # seconds a run step may take before it is a RUN_TIMEOUT


class Measurer(ABC):
    """Measures batches of programs; results come back as they are ready."""

    @abstractmethod
    def prepare(self, workload: Workload, task_key: str, target: dict[str, Any]) -> MeasureTask:
        """Called once per task before its first batch: makes the workload, the task data
        and the reference outputs available to builders and runners, and says whether
        kernels can be checked against a reference (`MeasureTask.verify`)."""

    def prepare_all(self, tasks: Sequence[tuple[Workload, str, dict[str, Any]]]) -> list[MeasureTask]:
        """`prepare` for each (workload, task key, target), in order; a measurer whose
        preparations can overlap does them at once."""
        return [self.prepare(*t) for t in tasks]

    @abstractmethod
    def submit(self, batch: MeasureBatch) -> None:
        """Called when the search has proposed a batch. Returns at once; the batch is
        measured in the background (or remotely)."""

    @abstractmethod
    def collect(self, timeout: float | None = None) -> list[MeasureRecord]:
        """Called to take the records of the measurements that have arrived since the
        last call, in arrival order. Waits up to `timeout` seconds (None: no limit) for at
        least one when none is waiting; returns [] when the wait ends empty-handed or
        nothing is pending. Never raises for a bad program: failures are records with
        an error kind."""

    @property
    @abstractmethod
    def pending(self) -> int:
        """Programs submitted whose results have not been collected yet."""

    @abstractmethod
    def close(self) -> None:
        """Called once when tuning is over or interrupted; stops the work in progress.
        The measurer is unusable after."""

    def __enter__(self) -> Measurer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
