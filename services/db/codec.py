"""The JSON forms of the records stored in JSONB columns, and back.

- `BatchCandidate.input`: a `MeasureInput` (`input_to_json`);
- `BatchCandidate.build`: a `BuildResult` (`build_to_json`);
- `Batch.timing`: a `TimingConfig` (`timing_to_json`);
- `Measurement.record`: a `MeasureRecord`, its JSON line parsed (`record_to_json`), so
  `GET /v1/jobs/{id}/records` writes the records file format unchanged.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from tunefarm.records import BuildResult, Candidate, ErrorKind, MeasureInput, MeasureRecord, TimingConfig


def input_to_json(inp: MeasureInput) -> dict[str, Any]:
    return {
        "task": inp.task,
        "sketch": inp.candidate.sketch,
        "decisions": {k: list(v) if isinstance(v, tuple) else v for k, v in inp.candidate.decisions},
        "sketch_sig": inp.sketch_sig,
        "trace": inp.trace,
    }


def input_from_json(data: dict[str, Any]) -> MeasureInput:
    return MeasureInput(
        task=str(data["task"]),
        candidate=Candidate.make(int(data["sketch"]), data["decisions"]),
        sketch_sig=str(data["sketch_sig"]),
        trace=data["trace"],
    )


def build_to_json(result: BuildResult) -> dict[str, Any]:
    return {
        "candidate_key": result.candidate_key,
        "artifact": result.artifact,
        "build_secs": result.build_secs,
        "error": str(result.error_kind),
        "error_msg": result.error_msg,
    }


def build_from_json(data: dict[str, Any]) -> BuildResult:
    return BuildResult(
        candidate_key=str(data["candidate_key"]),
        artifact=data.get("artifact"),
        build_secs=float(data["build_secs"]),
        error_kind=ErrorKind(data.get("error", ErrorKind.NONE)),
        error_msg=str(data.get("error_msg", "")),
    )


def timing_to_json(timing: TimingConfig) -> dict[str, Any]:
    return asdict(timing)


def timing_from_json(data: dict[str, Any]) -> TimingConfig:
    return TimingConfig(**data)


def record_to_json(record: MeasureRecord) -> dict[str, Any]:
    return json.loads(record.to_json())


def record_from_json(data: dict[str, Any]) -> MeasureRecord:
    return MeasureRecord.from_json(json.dumps(data))
