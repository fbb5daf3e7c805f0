"""Request and response bodies of the HTTP API (pydantic): `XCreate` in, `XPublic` out.

Units: seconds for every latency and duration (`*_secs`), bytes for sizes. Times are
ISO 8601 with a time zone.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SEED_MAX = 2**31 - 1
"""TVM's schedule seeds are in [1, 2^31 - 1]."""


class ErrorDetail(BaseModel):
    code: str = Field(description="a stable word: unauthorized, not_found, invalid_model, ...")
    message: str = Field(description="what is wrong, in one sentence")
    details: list[dict[str, Any]] | None = Field(default=None, description="per-field problems (validation)")


class ErrorBody(BaseModel):
    """The body of every 4xx and 5xx answer."""

    error: ErrorDetail


# -- models -----------------------------------------------------------------------------------


class TensorPublic(BaseModel):
    name: str
    shape: list[int]
    dtype: str


class ModelTaskPublic(BaseModel):
    position: int = Field(description="order in which the model first calls it")
    name: str = Field(description="fused subgraph and its input shapes")
    key: str = Field(description="the workload key (name#structural hash)")
    shapes: str
    weight: int = Field(description="calls per inference")
    flops: float = Field(description="FLOPs of one call")
    share: float = Field(description="share of the model's FLOPs (weight x flops / total)")


class ModelPublic(BaseModel):
    id: int
    name: str
    input_shapes: dict[str, list[int]] = Field(description="the shapes given at upload")
    inputs: list[TensorPublic]
    outputs: list[TensorPublic]
    onnx_sha256: str
    onnx_size: int
    tasks: list[ModelTaskPublic]
    warnings: list[str] = Field(description="the importer's notes (simplification skipped, ...)")
    created_at: datetime


class ModelSummary(BaseModel):
    id: int
    name: str
    tasks: int
    onnx_size: int
    created_at: datetime


class ModelPage(BaseModel):
    items: list[ModelSummary]
    next_cursor: int | None = Field(description="pass as `cursor` for the next page; null on the last")


# -- jobs -------------------------------------------------------------------------------------

JobStateName = Literal["queued", "running", "finishing", "succeeded", "failed", "cancelled"]


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_id: int = Field(gt=0, description="a model of your team (POST /v1/models)")
    device_class: str = Field(min_length=1, max_length=200, description="name of a device class (GET /v1/device-classes)")
    trial_budget: int = Field(gt=0, description="measurements in total over all the model's tasks")
    latency_target_secs: float | None = Field(
        default=None, gt=0, description="stop spending trials once the estimated latency is at most this"
    )
    strategy: Literal["gradient", "round-robin"] = Field(default="gradient", description="the task scheduler")
    seed: int = Field(default=1, ge=1, le=SEED_MAX)
    winograd: bool = Field(
        default=True,
        description="also tune each 3x3 stride-1 convolution by Winograd F(m x m, 3 x 3) and take it where it "
        "measures faster (CPU classes; false: the convolutions as they are)",
    )
    precision: Literal["fp32", "fp16"] = Field(
        default="fp32",
        description="what the model computes in: 'fp32' (as uploaded) or 'fp16' (CUDA classes with tensor cores, "
        "sm_70+: float16 operands with float32 accumulation, matrix multiplies on tensor cores; the tuned model "
        "is checked against the float32 reference with a float16 tolerance)",
    )


class JobTaskAlternativePublic(BaseModel):
    """One program of a task that has alternatives: the task's own, or another algorithm's."""

    algorithm: str = Field(description="'direct' (the task's own program), or the algorithm, e.g. 'winograd4'")
    position: int
    name: str
    key: str = Field(description="the records' task key: workload key @ target hash")
    trials: int = Field(description="measurements of this program so far")
    best_secs: float | None = Field(description="its fastest valid kernel so far (disputed times excluded)")
    best_emulated: bool = False
    best_confirmed: bool = False
    confirmed_best_secs: float | None = None
    dead_reason: str | None = Field(description="why the search stopped giving it trials")


class JobTaskPublic(BaseModel):
    position: int
    name: str
    key: str = Field(description="the records' task key: workload key @ target hash")
    weight: int
    trials: int = Field(description="measurements of this task so far (of all its alternatives)")
    best_secs: float | None = Field(
        description="its fastest valid kernel so far, of whichever of its alternatives (disputed times excluded)"
    )
    algorithm: str = Field(
        default="direct",
        description="the program that best is of: 'direct' (the task's own), or an alternative's algorithm "
        "(e.g. 'winograd4')",
    )
    alternatives: list[JobTaskAlternativePublic] = Field(
        default_factory=list,
        description="a task also tuned by other algorithms (a 3x3 convolution by Winograd, on a CPU class): each "
        "program, the task's own first; the model takes the fastest confirmed one. Empty for other tasks",
    )
    best_emulated: bool = Field(
        default=False, description="that time was measured under an emulator: it is the emulator's, not the device's"
    )
    best_confirmed: bool = Field(
        default=False,
        description="a second measurement of that kernel agreed with it; an unconfirmed best awaits its confirmation",
    )
    confirmed_best_secs: float | None = Field(
        default=None, description="its fastest confirmed kernel (of any of its alternatives): what the tuned model uses"
    )
    dead_reason: str | None = Field(description="why the search stopped giving it trials (all its alternatives)")


class ProgressPoint(BaseModel):
    trials: int
    elapsed_secs: float = Field(description="seconds since the job started")
    est_latency_secs: float | None


class TransferPublic(BaseModel):
    device_class: str = Field(description="the class whose cost model this class's model started from")
    version: int = Field(description="that class's version")


class PretrainedPublic(BaseModel):
    family: str | None = Field(description="the device family the pretrained model serves (x86, arm, cuda)")
    objective: str | None = Field(description="its training objective (squared or rank)")
    programs: int | None = Field(description="measured programs it was trained on")
    tasks: int | None = Field(description="tasks those programs are of")
    classes: int = Field(description="device classes they were measured on")
    written: str | None = Field(description="when the model file was written (UTC)")


class CostModelPublic(BaseModel):
    version_id: int | None = Field(description="the class's cost model version the job started from")
    version: int | None
    trained_on: int | None = Field(description="programs that version was trained on")
    trained_on_at_first_batch: int | None = Field(
        description="programs the shared model had learned from when the job's first batch was ranked "
        "(0: ranked at random, or by the pretrained model alone when there is one; null: no batch yet)"
    )
    device_class: str | None = Field(
        None, description="the class that version belongs to: the job's own, or the one it was transferred from"
    )
    transferred_from: TransferPublic | None = Field(
        None,
        description="the job's class had no cost model of its own: its model started from this nearest "
        "class's (null: trained on the class's own measurements only, or fresh)",
    )
    pretrained: PretrainedPublic | None = Field(
        None,
        description="the pretrained cost model of the class's device family under the job's model: its trees "
        "rank programs, and the class's own measurements train trees on top of it. With version null, the "
        "class had no model of its own nor a near class's, and the job started from it (null: none)",
    )


class ArtifactPublic(BaseModel):
    available: bool
    sha256: str | None
    size: int | None


SPEEDUP_DESCRIPTION = (
    "the finished job's tuned model measured against onnxruntime on the same input and threads, in alternating "
    "rounds: the median over the rounds of onnxruntime's p50 over the tuned model's (result.onnxruntime_latency."
    "round_medians / result.latency.round_medians; without rounds, result.onnxruntime_latency.median / "
    "result.latency.median); null until both were measured. Not est_latency_start_secs / est_latency_secs: that ratio is the search's progress on its "
    "own estimate"
)

OPENVINO_SPEEDUP_DESCRIPTION = (
    "the same against OpenVINO, timed on the same agent in alternating rounds with the tuned model and "
    "onnxruntime (per round as above, with result.openvino_latency); null where OpenVINO was not timed "
    "(result.peer_notes says why: e.g. not installed on the agent)"
)


class JobPublic(BaseModel):
    id: int
    state: JobStateName
    model_id: int
    model_name: str
    device_class: str
    trial_budget: int
    trials_used: int
    latency_target_secs: float | None
    est_latency_start_secs: float | None = Field(
        description="the estimated end-to-end latency once every task had a valid kernel (the first estimate)"
    )
    est_latency_secs: float | None = Field(description="the estimate with the best kernels found so far")
    cancel_requested: bool
    error: str | None
    waiting: str | None = Field(
        default=None,
        description="why a job not yet over makes no progress: no agent of its class is online "
        "(none heartbeated within TUNEFARM_AGENT_FRESH_SECS); null when one is, or the job is over",
    )
    config: dict[str, Any]
    tasks: list[JobTaskPublic]
    curve: list[ProgressPoint]
    cost_model: CostModelPublic
    artifact: ArtifactPublic
    result: dict[str, Any] | None = Field(description="the finished job's check and latency")
    speedup_vs_onnxruntime: float | None = Field(default=None, description=SPEEDUP_DESCRIPTION)
    speedup_vs_openvino: float | None = Field(default=None, description=OPENVINO_SPEEDUP_DESCRIPTION)
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class JobSummary(BaseModel):
    id: int
    state: JobStateName
    model_id: int
    model_name: str
    device_class: str
    trial_budget: int
    trials_used: int
    est_latency_start_secs: float | None = Field(description="the first complete estimate (see JobPublic)")
    est_latency_secs: float | None
    speedup_vs_onnxruntime: float | None = Field(default=None, description=SPEEDUP_DESCRIPTION)
    speedup_vs_openvino: float | None = Field(default=None, description=OPENVINO_SPEEDUP_DESCRIPTION)
    created_at: datetime
    finished_at: datetime | None


class JobPage(BaseModel):
    items: list[JobSummary]
    next_cursor: int | None = Field(description="pass as `cursor` for the next page; null on the last")


# -- devices ----------------------------------------------------------------------------------

AgentStateName = Literal["idle", "busy", "offline", "disabled"]
StandingName = Literal["trusted", "unconfirmed", "flagged", "quarantined"]


class DevicePublic(BaseModel):
    id: int
    name: str
    device_class: str
    state: AgentStateName = Field(
        description="idle or busy: live; offline: stopped, or silent for longer than TUNEFARM_AGENT_FRESH_SECS; "
        "disabled: quarantined by an operator"
    )
    capabilities: dict[str, Any] = Field(description="what the agent detected: CPU model, cores, ISA, GPU")
    registered_at: datetime
    last_heartbeat_at: datetime | None
    measurements_done: int
    errors_by_kind: dict[str, int]
    standing: StandingName = Field(
        description="whether its timings are believed: trusted (a timing confirmed), unconfirmed (none yet), flagged "
        "(times below the class's floor, or disputed by other agents), quarantined (by an operator: no leases)"
    )
    flag_reasons: list[str] = Field(description="why it is flagged (empty: it is not)")
    below_floor: int = Field(description="its results faster than the class's timing floor (refused)")
    confirmations_agreed: int = Field(description="its timings a second measurement confirmed")
    confirmations_disputed: int = Field(description="its timings another agent measured slower (or wrong)")
    quarantined_at: datetime | None


class DeviceClassPublic(BaseModel):
    name: str
    target: dict[str, Any] = Field(description="the TVM target (JSON dict) every agent of the class measures for")
    description: str
    agents_online: int = Field(
        description="live agents of the class: idle or busy, heartbeated within TUNEFARM_AGENT_FRESH_SECS"
    )


class Health(BaseModel):
    status: Literal["ok"]
    schema_revision: str
