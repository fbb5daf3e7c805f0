"""Plain records that cross process (and later network) boundaries.

Data flow of one measurement::

    Candidate --(realize)--> MeasureInput --> BuildInput --(builder)--> BuildResult
              --> RunInput --(runner)--> RunResult --> MeasureResult
              --(task tuner)--> MeasureRecord --(store)--> JSON line

Every record here is a frozen dataclass of plain values (str, int, float, tuples), so it
pickles into a worker process, serialises to JSON and can go into a queue unchanged.
Measurement errors are data: an `ErrorKind` plus a message, and an infinite cost.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from json.encoder import encode_basestring_ascii
from typing import Any

RECORD_VERSION = 1
"""Version of the JSON-lines record format (`MeasureRecord.to_json`)."""


class ErrorKind(StrEnum):
    """Why a measured candidate has no valid cost."""

    NONE = "none"
    BUILD_ERROR = "build_error"  # lowering / codegen / link failed
    BUILD_TIMEOUT = "build_timeout"  # the build worker took longer than its limit
    RUN_CRASH = "run_crash"  # the runner process died (segfault, abort, OOM kill)
    RUN_ERROR = "run_error"  # the kernel raised (bad launch, load failure...)
    RUN_TIMEOUT = "run_timeout"  # the kernel did not finish within its limit
    WRONG_RESULT = "wrong_result"  # output differs from the reference
    BELOW_FLOOR = "below_floor"  # reported faster than the device can run it (the farm's timing floor)

    @property
    def is_error(self) -> bool:
        return self is not ErrorKind.NONE


DecisionValue = int | tuple[int, ...]


@dataclass(frozen=True)
class Candidate:
    """A complete program of the search space: a sketch plus a value for each of its slots.

    `decisions` is sorted by slot name so that equal programs have equal keys.
    """

    sketch: int
    decisions: tuple[tuple[str, DecisionValue], ...]

    @staticmethod
    def make(sketch: int, decisions: dict[str, DecisionValue]) -> Candidate:
        return Candidate(sketch, tuple(sorted((k, _freeze(v)) for k, v in decisions.items())))

    @cached_property
    def key(self) -> str:
        """`<sketch>:<decisions as compact JSON>`; computed once per candidate (the search
        asks for it many times per program)."""
        return f"{self.sketch}:[" + ",".join(_decision_json(s, v) for s, v in self.decisions) + "]"

    def as_dict(self) -> dict[str, DecisionValue]:
        return dict(self.decisions)


def _decision_json(slot: str, value: DecisionValue) -> str:
    """`json.dumps((slot, value), separators=(",", ":"))`, without the encoder's set-up
    cost: the value is an int or a tuple of ints (`_freeze`)."""
    if isinstance(value, tuple):
        return f"[{encode_basestring_ascii(slot)},[{','.join(map(str, value))}]]"
    return f"[{encode_basestring_ascii(slot)},{value}]"


def _freeze(value: Any) -> DecisionValue:
    if type(value) is int:  # the search's own values: as they are
        return value
    if type(value) is tuple and all(type(v) is int for v in value):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return int(value)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        import numpy as np

        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


TraceJSON = list
"""A TVM schedule trace as plain JSON data: `Trace.as_json()` with IntImm/FloatImm
unwrapped to numbers. It stays this one value from the search to the builder, the
records file and `apply-best`; TVM replays it with `Trace.apply_json_to_schedule`."""


@dataclass(frozen=True)
class MeasureInput:
    """One program the search wants measured: its candidate and its TVM trace."""

    task: str  # the task key (records match a task by it)
    candidate: Candidate
    sketch_sig: str  # identity of the candidate's sketch (see Sketch.signature)
    trace: TraceJSON

    @property
    def key(self) -> str:
        return self.candidate.key


@dataclass(frozen=True)
class BuildInput:
    """What a builder needs: the workload (by reference), the schedule and the target."""

    candidate_key: str
    workload: str  # reference to the workload: a file holding tvm.ir.save_json of its IRModule
    trace: TraceJSON | None  # None: the unscheduled program
    target: dict[str, Any]
    timeout_secs: float = 60.0


@dataclass(frozen=True)
class BuildResult:
    candidate_key: str
    artifact: str | None  # reference to the built library (a file path), None on error
    build_secs: float
    error_kind: ErrorKind = ErrorKind.NONE
    error_msg: str = ""


@dataclass(frozen=True)
class TimingConfig:
    """How a runner times one kernel (TVM's time_evaluator underneath).

    One untimed warm-up run (which is also the run whose output is checked), then
    `repeat` timed repeats, each at least `min_repeat_ms` long. The cost of a repeat is
    its mean per-call time; the record keeps all of them and reports their median.

    `flush_cache` (CPU kernels): every argument but the first (the weights and the
    outputs; the first is the input, which a model's previous kernel has just written)
    is flushed from the CPU caches before each repeat. With `flush_every_call` it is
    flushed before every call instead, as it is in a model, where a kernel's weights
    were last touched one inference ago: a repeat is then the mean of as many flushed
    calls as fill `min_repeat_ms` of kernel time (at most `max_flushed_calls`), each
    timed alone.
    """

    repeat: int = 5
    min_repeat_ms: float = 40.0
    flush_cache: bool = True
    flush_every_call: bool = False
    max_flushed_calls: int = 64
    # A kernel whose warm-up run already takes this long is timed once only: it cannot
    # be the best, and timing it properly would cost more than it tells.
    slow_cutoff_secs: float = 1.0

    def flushes_every_call(self, *, on_gpu: bool) -> bool:
        """Whether a kernel is timed with the caches flushed before every call (CPU only)."""
        return self.flush_every_call and self.flush_cache and not on_gpu


@dataclass(frozen=True)
class RunInput:
    candidate_key: str
    artifact: str  # reference to the built library
    task_data: str  # reference to the .npz with the inputs (and expected outputs when `verify`)
    n_inputs: int
    n_outputs: int
    verify: bool
    timing: TimingConfig = field(default_factory=TimingConfig)
    timeout_secs: float = 30.0
    # When set, the runner writes the kernel's outputs to this .npz (keys "output_0", ...)
    # after the warm-up run. Used to compute reference outputs with the naive program.
    save_outputs: str = ""


OutputDigest = tuple[float, ...]
"""A small fingerprint of a kernel's outputs (`tunefarm.digest`): enough to tell
whether two kernels computed the same thing without shipping their outputs."""


@dataclass(frozen=True)
class RunResult:
    candidate_key: str
    costs: tuple[float, ...]  # seconds per call, one per timed repeat; () on error
    run_secs: float  # wall time of the whole run step
    error_kind: ErrorKind = ErrorKind.NONE
    error_msg: str = ""
    verified: bool = False  # output was compared to the reference and matched
    digest: OutputDigest = ()  # fingerprint of the outputs of the warm-up run
    emulated: bool = False  # ran under an emulator: `costs` are the emulator's, not the device's
    flushed_calls: bool = False  # timed with the caches flushed before every call (`TimingConfig.flush_every_call`)

    @property
    def median(self) -> float:
        return median_cost(self.costs) if not self.error_kind.is_error else math.inf


@dataclass(frozen=True)
class MeasureResult:
    """How the measurement of one `MeasureInput` went: its build, and its run when the
    build succeeded (a failed build has no run)."""

    input: MeasureInput
    build: BuildResult
    run: RunResult | None

    @property
    def key(self) -> str:
        return self.input.key

    @property
    def error_kind(self) -> ErrorKind:
        if self.build.error_kind.is_error or self.run is None:
            return self.build.error_kind if self.build.error_kind.is_error else ErrorKind.RUN_ERROR
        return self.run.error_kind

    @property
    def error_msg(self) -> str:
        if self.build.error_kind.is_error:
            return self.build.error_msg
        return self.run.error_msg if self.run is not None else "the kernel was not run"

    @property
    def costs(self) -> tuple[float, ...]:
        return self.run.costs if self.run is not None and not self.error_kind.is_error else ()


class Stage(StrEnum):
    BUILD = "build"
    RUN = "run"


def failure_kind(stage: Stage, status: str) -> ErrorKind:
    """The error kind of an isolated call that did not return normally, by stage and by
    how it ended (`tunefarm.isolation.CallStatus`: "raised", "crashed", "timed_out")."""
    return _FAILURES[(stage, status)]


_FAILURES = {
    (Stage.BUILD, "raised"): ErrorKind.BUILD_ERROR,
    (Stage.BUILD, "crashed"): ErrorKind.BUILD_ERROR,
    (Stage.BUILD, "timed_out"): ErrorKind.BUILD_TIMEOUT,
    (Stage.RUN, "raised"): ErrorKind.RUN_ERROR,
    (Stage.RUN, "crashed"): ErrorKind.RUN_CRASH,
    (Stage.RUN, "timed_out"): ErrorKind.RUN_TIMEOUT,
}


def median_cost(costs: tuple[float, ...] | list[float]) -> float:
    if not costs:
        return math.inf
    s = sorted(costs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


@dataclass(frozen=True)
class MeasureRecord:
    """One measured candidate: one line of the records file.

    JSON line (version 1)::

        {"v": 1, "task": <task key>, "workload": <name>, "target": <target dict>,
         "sketch": <int>, "sketch_sig": <str>, "decisions": {<slot>: int | [int...]},
         "trace": <TVM Trace.as_json()>, "costs": [seconds...], "error": <ErrorKind>,
         "error_msg": <str>, "build_secs": <float>, "run_secs": <float>,
         "verified": <bool>, "time": <unix seconds>, "digest": [float...], "emulated": true,
         "flushed_calls": true}

    `digest` (optional) fingerprints the kernel's outputs, so kernels can be checked
    against each other when a task has no reference. `emulated` (present only when true)
    says the kernel ran under an emulator (an agent under qemu-user): its output check
    holds, its costs are the emulator's, not the device's. `flushed_calls` (present only
    when true) says its costs were timed with the caches flushed before every call
    (`TimingConfig.flush_every_call`): such costs are higher than warm ones for the same
    program, so a search compares only records timed the same way.
    """

    task: str
    workload: str
    target: dict[str, Any]
    sketch: int
    sketch_sig: str
    decisions: tuple[tuple[str, DecisionValue], ...]
    trace: TraceJSON  # replayable without our search code
    costs: tuple[float, ...]
    error_kind: ErrorKind
    error_msg: str
    build_secs: float
    run_secs: float
    verified: bool
    timestamp: float
    digest: OutputDigest = ()
    emulated: bool = False
    flushed_calls: bool = False

    @staticmethod
    def of(result: MeasureResult, *, workload: str, target: dict[str, Any], timestamp: float) -> MeasureRecord:
        """The record of a measurement; `error_kind` may be overridden by the caller's
        checks through `dataclasses.replace`."""
        run = result.run
        return MeasureRecord(
            task=result.input.task,
            workload=workload,
            target=target,
            sketch=result.input.candidate.sketch,
            sketch_sig=result.input.sketch_sig,
            decisions=result.input.candidate.decisions,
            trace=result.input.trace,
            costs=result.costs,
            error_kind=result.error_kind,
            error_msg=result.error_msg,
            build_secs=result.build.build_secs,
            run_secs=run.run_secs if run is not None else 0.0,
            verified=bool(run is not None and run.verified and not result.error_kind.is_error),
            timestamp=timestamp,
            digest=run.digest if run is not None else (),
            emulated=bool(run is not None and run.emulated),
            flushed_calls=bool(run is not None and run.flushed_calls),
        )

    @property
    def candidate(self) -> Candidate:
        return Candidate(self.sketch, self.decisions)

    @property
    def key(self) -> str:
        """The candidate's key (as `MeasureInput.key`): which program of its task this is."""
        return self.candidate.key

    @property
    def cost(self) -> float:
        return math.inf if self.error_kind.is_error else median_cost(self.costs)

    @property
    def is_valid(self) -> bool:
        return not self.error_kind.is_error and bool(self.costs)

    def to_json(self) -> str:
        return json.dumps(
            {
                "v": RECORD_VERSION,
                "task": self.task,
                "workload": self.workload,
                "target": self.target,
                "sketch": self.sketch,
                "sketch_sig": self.sketch_sig,
                "decisions": {k: list(v) if isinstance(v, tuple) else v for k, v in self.decisions},
                "trace": self.trace,
                "costs": list(self.costs),
                "error": str(self.error_kind),
                "error_msg": self.error_msg,
                "build_secs": round(self.build_secs, 6),
                "run_secs": round(self.run_secs, 6),
                "verified": self.verified,
                "time": round(self.timestamp, 3),
                **({"digest": list(self.digest)} if self.digest else {}),
                **({"emulated": True} if self.emulated else {}),
                **({"flushed_calls": True} if self.flushed_calls else {}),
            },
            separators=(",", ":"),
        )

    @staticmethod
    def from_json(line: str) -> MeasureRecord:
        d = json.loads(line)
        if d.get("v") != RECORD_VERSION:
            raise ValueError(f"record version {d.get('v')!r} is not {RECORD_VERSION}")
        return MeasureRecord(
            task=str(d["task"]),
            workload=str(d["workload"]),
            target=dict(d["target"]),
            sketch=int(d["sketch"]),
            sketch_sig=str(d["sketch_sig"]),
            decisions=Candidate.make(int(d["sketch"]), d["decisions"]).decisions,
            trace=d["trace"],
            costs=tuple(float(c) for c in d["costs"]),
            error_kind=ErrorKind(d["error"]),
            error_msg=str(d.get("error_msg", "")),
            build_secs=float(d.get("build_secs", 0.0)),
            run_secs=float(d.get("run_secs", 0.0)),
            verified=bool(d.get("verified", False)),
            timestamp=float(d.get("time", 0.0)),
            digest=tuple(float(x) for x in d.get("digest", ())),
            emulated=bool(d.get("emulated", False)),
            flushed_calls=bool(d.get("flushed_calls", False)),
        )
