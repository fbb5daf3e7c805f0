from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HealthStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HEALTH_STATUS_UNSPECIFIED: _ClassVar[HealthStatus]
    HEALTH_STATUS_OK: _ClassVar[HealthStatus]
    HEALTH_STATUS_DEGRADED: _ClassVar[HealthStatus]
    HEALTH_STATUS_FAILING: _ClassVar[HealthStatus]

class ArtifactKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ARTIFACT_KIND_UNSPECIFIED: _ClassVar[ArtifactKind]
    ARTIFACT_KIND_KERNEL: _ClassVar[ArtifactKind]
    ARTIFACT_KIND_TASK_DATA: _ClassVar[ArtifactKind]
    ARTIFACT_KIND_MODEL_LIBRARY: _ClassVar[ArtifactKind]
    ARTIFACT_KIND_MODEL_INPUTS: _ClassVar[ArtifactKind]
    ARTIFACT_KIND_MODEL_ONNX: _ClassVar[ArtifactKind]

class ErrorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_KIND_NONE: _ClassVar[ErrorKind]
    ERROR_KIND_BUILD_ERROR: _ClassVar[ErrorKind]
    ERROR_KIND_BUILD_TIMEOUT: _ClassVar[ErrorKind]
    ERROR_KIND_RUN_CRASH: _ClassVar[ErrorKind]
    ERROR_KIND_RUN_ERROR: _ClassVar[ErrorKind]
    ERROR_KIND_RUN_TIMEOUT: _ClassVar[ErrorKind]
    ERROR_KIND_WRONG_RESULT: _ClassVar[ErrorKind]
HEALTH_STATUS_UNSPECIFIED: HealthStatus
HEALTH_STATUS_OK: HealthStatus
HEALTH_STATUS_DEGRADED: HealthStatus
HEALTH_STATUS_FAILING: HealthStatus
ARTIFACT_KIND_UNSPECIFIED: ArtifactKind
ARTIFACT_KIND_KERNEL: ArtifactKind
ARTIFACT_KIND_TASK_DATA: ArtifactKind
ARTIFACT_KIND_MODEL_LIBRARY: ArtifactKind
ARTIFACT_KIND_MODEL_INPUTS: ArtifactKind
ARTIFACT_KIND_MODEL_ONNX: ArtifactKind
ERROR_KIND_NONE: ErrorKind
ERROR_KIND_BUILD_ERROR: ErrorKind
ERROR_KIND_BUILD_TIMEOUT: ErrorKind
ERROR_KIND_RUN_CRASH: ErrorKind
ERROR_KIND_RUN_ERROR: ErrorKind
ERROR_KIND_RUN_TIMEOUT: ErrorKind
ERROR_KIND_WRONG_RESULT: ErrorKind

class Capabilities(_message.Message):
    __slots__ = ("hostname", "os", "arch", "cpu_model", "physical_cores", "logical_cores", "isa_features", "llvm_cpu", "gpu_name", "gpu_compute_capability", "tvm_version", "agent_version", "target_json", "memory_bytes", "emulated", "emulation")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    OS_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    CPU_MODEL_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_CORES_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_CORES_FIELD_NUMBER: _ClassVar[int]
    ISA_FEATURES_FIELD_NUMBER: _ClassVar[int]
    LLVM_CPU_FIELD_NUMBER: _ClassVar[int]
    GPU_NAME_FIELD_NUMBER: _ClassVar[int]
    GPU_COMPUTE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    TVM_VERSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TARGET_JSON_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EMULATED_FIELD_NUMBER: _ClassVar[int]
    EMULATION_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    os: str
    arch: str
    cpu_model: str
    physical_cores: int
    logical_cores: int
    isa_features: _containers.RepeatedScalarFieldContainer[str]
    llvm_cpu: str
    gpu_name: str
    gpu_compute_capability: str
    tvm_version: str
    agent_version: str
    target_json: str
    memory_bytes: int
    emulated: bool
    emulation: str
    def __init__(self, hostname: _Optional[str] = ..., os: _Optional[str] = ..., arch: _Optional[str] = ..., cpu_model: _Optional[str] = ..., physical_cores: _Optional[int] = ..., logical_cores: _Optional[int] = ..., isa_features: _Optional[_Iterable[str]] = ..., llvm_cpu: _Optional[str] = ..., gpu_name: _Optional[str] = ..., gpu_compute_capability: _Optional[str] = ..., tvm_version: _Optional[str] = ..., agent_version: _Optional[str] = ..., target_json: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., emulated: _Optional[bool] = ..., emulation: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("device_class", "name", "capabilities")
    DEVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    device_class: str
    name: str
    capabilities: Capabilities
    def __init__(self, device_class: _Optional[str] = ..., name: _Optional[str] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("agent_id", "target_json", "heartbeat_interval_secs", "lease_secs", "poll_interval_secs", "agent_secret")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_JSON_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECS_FIELD_NUMBER: _ClassVar[int]
    POLL_INTERVAL_SECS_FIELD_NUMBER: _ClassVar[int]
    AGENT_SECRET_FIELD_NUMBER: _ClassVar[int]
    agent_id: int
    target_json: str
    heartbeat_interval_secs: float
    lease_secs: float
    poll_interval_secs: float
    agent_secret: str
    def __init__(self, agent_id: _Optional[int] = ..., target_json: _Optional[str] = ..., heartbeat_interval_secs: _Optional[float] = ..., lease_secs: _Optional[float] = ..., poll_interval_secs: _Optional[float] = ..., agent_secret: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("agent_id", "held_lease_ids", "held_model_run_ids")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    HELD_MODEL_RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    agent_id: int
    held_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    held_model_run_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, agent_id: _Optional[int] = ..., held_lease_ids: _Optional[_Iterable[int]] = ..., held_model_run_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("active_lease_ids",)
    ACTIVE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    active_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, active_lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GoOfflineRequest(_message.Message):
    __slots__ = ("agent_id",)
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    agent_id: int
    def __init__(self, agent_id: _Optional[int] = ...) -> None: ...

class GoOfflineResponse(_message.Message):
    __slots__ = ("released_batch_ids",)
    RELEASED_BATCH_IDS_FIELD_NUMBER: _ClassVar[int]
    released_batch_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, released_batch_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class HealthReport(_message.Message):
    __slots__ = ("agent_id", "status", "message", "load_average_1m", "memory_available_bytes", "disk_free_bytes")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOAD_AVERAGE_1M_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    agent_id: int
    status: HealthStatus
    message: str
    load_average_1m: float
    memory_available_bytes: int
    disk_free_bytes: int
    def __init__(self, agent_id: _Optional[int] = ..., status: _Optional[_Union[HealthStatus, str]] = ..., message: _Optional[str] = ..., load_average_1m: _Optional[float] = ..., memory_available_bytes: _Optional[int] = ..., disk_free_bytes: _Optional[int] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaseBatchRequest(_message.Message):
    __slots__ = ("agent_id", "model_runs", "held_lease_ids", "held_model_run_ids")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_RUNS_FIELD_NUMBER: _ClassVar[int]
    HELD_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    HELD_MODEL_RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    agent_id: int
    model_runs: bool
    held_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    held_model_run_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, agent_id: _Optional[int] = ..., model_runs: _Optional[bool] = ..., held_lease_ids: _Optional[_Iterable[int]] = ..., held_model_run_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ArtifactRef(_message.Message):
    __slots__ = ("kind", "id", "file_name", "sha256", "size", "signature", "signed_as")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    SIGNED_AS_FIELD_NUMBER: _ClassVar[int]
    kind: ArtifactKind
    id: int
    file_name: str
    sha256: str
    size: int
    signature: bytes
    signed_as: int
    def __init__(self, kind: _Optional[_Union[ArtifactKind, str]] = ..., id: _Optional[int] = ..., file_name: _Optional[str] = ..., sha256: _Optional[str] = ..., size: _Optional[int] = ..., signature: _Optional[bytes] = ..., signed_as: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("repeat", "min_repeat_ms", "flush_cache", "slow_cutoff_secs", "flush_every_call", "max_flushed_calls")
    REPEAT_FIELD_NUMBER: _ClassVar[int]
    MIN_REPEAT_MS_FIELD_NUMBER: _ClassVar[int]
    FLUSH_CACHE_FIELD_NUMBER: _ClassVar[int]
    SLOW_CUTOFF_SECS_FIELD_NUMBER: _ClassVar[int]
    FLUSH_EVERY_CALL_FIELD_NUMBER: _ClassVar[int]
    MAX_FLUSHED_CALLS_FIELD_NUMBER: _ClassVar[int]
    repeat: int
    min_repeat_ms: float
    flush_cache: bool
    slow_cutoff_secs: float
    flush_every_call: bool
    max_flushed_calls: int
    def __init__(self, repeat: _Optional[int] = ..., min_repeat_ms: _Optional[float] = ..., flush_cache: _Optional[bool] = ..., slow_cutoff_secs: _Optional[float] = ..., flush_every_call: _Optional[bool] = ..., max_flushed_calls: _Optional[int] = ...) -> None: ...

class LeasedCandidate(_message.Message):
    __slots__ = ("batch_candidate_id", "candidate_key", "kernel")
    BATCH_CANDIDATE_ID_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_KEY_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    batch_candidate_id: int
    candidate_key: str
    kernel: ArtifactRef
    def __init__(self, batch_candidate_id: _Optional[int] = ..., candidate_key: _Optional[str] = ..., kernel: _Optional[_Union[ArtifactRef, _Mapping]] = ...) -> None: ...

class LeasedBatch(_message.Message):
    __slots__ = ("lease_id", "batch_id", "attempt", "candidates", "task_data", "n_inputs", "n_outputs", "verify", "timing", "run_timeout_secs", "workload_name")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    TASK_DATA_FIELD_NUMBER: _ClassVar[int]
    N_INPUTS_FIELD_NUMBER: _ClassVar[int]
    N_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    RUN_TIMEOUT_SECS_FIELD_NUMBER: _ClassVar[int]
    WORKLOAD_NAME_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    batch_id: int
    attempt: int
    candidates: _containers.RepeatedCompositeFieldContainer[LeasedCandidate]
    task_data: ArtifactRef
    n_inputs: int
    n_outputs: int
    verify: bool
    timing: Timing
    run_timeout_secs: float
    workload_name: str
    def __init__(self, lease_id: _Optional[int] = ..., batch_id: _Optional[int] = ..., attempt: _Optional[int] = ..., candidates: _Optional[_Iterable[_Union[LeasedCandidate, _Mapping]]] = ..., task_data: _Optional[_Union[ArtifactRef, _Mapping]] = ..., n_inputs: _Optional[int] = ..., n_outputs: _Optional[int] = ..., verify: _Optional[bool] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., run_timeout_secs: _Optional[float] = ..., workload_name: _Optional[str] = ...) -> None: ...

class LeasedModelRun(_message.Message):
    __slots__ = ("model_run_id", "library", "inputs", "repeat", "warmup", "timeout_secs", "onnx_model", "input_names")
    MODEL_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LIBRARY_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    REPEAT_FIELD_NUMBER: _ClassVar[int]
    WARMUP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECS_FIELD_NUMBER: _ClassVar[int]
    ONNX_MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUT_NAMES_FIELD_NUMBER: _ClassVar[int]
    model_run_id: int
    library: ArtifactRef
    inputs: ArtifactRef
    repeat: int
    warmup: int
    timeout_secs: float
    onnx_model: ArtifactRef
    input_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_run_id: _Optional[int] = ..., library: _Optional[_Union[ArtifactRef, _Mapping]] = ..., inputs: _Optional[_Union[ArtifactRef, _Mapping]] = ..., repeat: _Optional[int] = ..., warmup: _Optional[int] = ..., timeout_secs: _Optional[float] = ..., onnx_model: _Optional[_Union[ArtifactRef, _Mapping]] = ..., input_names: _Optional[_Iterable[str]] = ...) -> None: ...

class LeaseBatchResponse(_message.Message):
    __slots__ = ("batch", "model_run", "withheld")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_RUN_FIELD_NUMBER: _ClassVar[int]
    WITHHELD_FIELD_NUMBER: _ClassVar[int]
    batch: LeasedBatch
    model_run: LeasedModelRun
    withheld: str
    def __init__(self, batch: _Optional[_Union[LeasedBatch, _Mapping]] = ..., model_run: _Optional[_Union[LeasedModelRun, _Mapping]] = ..., withheld: _Optional[str] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("agent_id", "lease_id", "refs", "model_run_id")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REFS_FIELD_NUMBER: _ClassVar[int]
    MODEL_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    agent_id: int
    lease_id: int
    refs: _containers.RepeatedCompositeFieldContainer[ArtifactRef]
    model_run_id: int
    def __init__(self, agent_id: _Optional[int] = ..., lease_id: _Optional[int] = ..., refs: _Optional[_Iterable[_Union[ArtifactRef, _Mapping]]] = ..., model_run_id: _Optional[int] = ...) -> None: ...

class FilePart(_message.Message):
    __slots__ = ("index", "offset", "data", "last", "total_size", "sha256", "error")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    last: bool
    total_size: int
    sha256: str
    error: str
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., total_size: _Optional[int] = ..., sha256: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class FetchChunk(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[FilePart]
    def __init__(self, parts: _Optional[_Iterable[_Union[FilePart, _Mapping]]] = ...) -> None: ...

class Result(_message.Message):
    __slots__ = ("batch_candidate_id", "candidate_key", "costs", "run_secs", "error_kind", "error_msg", "verified", "digest")
    BATCH_CANDIDATE_ID_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_KEY_FIELD_NUMBER: _ClassVar[int]
    COSTS_FIELD_NUMBER: _ClassVar[int]
    RUN_SECS_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    ERROR_MSG_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    batch_candidate_id: int
    candidate_key: str
    costs: _containers.RepeatedScalarFieldContainer[float]
    run_secs: float
    error_kind: ErrorKind
    error_msg: str
    verified: bool
    digest: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, batch_candidate_id: _Optional[int] = ..., candidate_key: _Optional[str] = ..., costs: _Optional[_Iterable[float]] = ..., run_secs: _Optional[float] = ..., error_kind: _Optional[_Union[ErrorKind, str]] = ..., error_msg: _Optional[str] = ..., verified: _Optional[bool] = ..., digest: _Optional[_Iterable[float]] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResultMessage(_message.Message):
    __slots__ = ("agent_id", "lease_id", "result", "finish")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    agent_id: int
    lease_id: int
    result: Result
    finish: Finish
    def __init__(self, agent_id: _Optional[int] = ..., lease_id: _Optional[int] = ..., result: _Optional[_Union[Result, _Mapping]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ...) -> None: ...

class ResultAck(_message.Message):
    __slots__ = ("batch_candidate_ids", "finished", "batch_state")
    BATCH_CANDIDATE_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    BATCH_STATE_FIELD_NUMBER: _ClassVar[int]
    batch_candidate_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    batch_state: str
    def __init__(self, batch_candidate_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., batch_state: _Optional[str] = ...) -> None: ...

class ModelRunResult(_message.Message):
    __slots__ = ("agent_id", "model_run_id", "outputs_npz", "latency_samples", "run_secs", "error", "threads", "round_medians", "peers")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_NPZ_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RUN_SECS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    ROUND_MEDIANS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    agent_id: int
    model_run_id: int
    outputs_npz: bytes
    latency_samples: _containers.RepeatedScalarFieldContainer[float]
    run_secs: float
    error: str
    threads: int
    round_medians: _containers.RepeatedScalarFieldContainer[float]
    peers: _containers.RepeatedCompositeFieldContainer[PeerTiming]
    def __init__(self, agent_id: _Optional[int] = ..., model_run_id: _Optional[int] = ..., outputs_npz: _Optional[bytes] = ..., latency_samples: _Optional[_Iterable[float]] = ..., run_secs: _Optional[float] = ..., error: _Optional[str] = ..., threads: _Optional[int] = ..., round_medians: _Optional[_Iterable[float]] = ..., peers: _Optional[_Iterable[_Union[PeerTiming, _Mapping]]] = ...) -> None: ...

class PeerTiming(_message.Message):
    __slots__ = ("peer", "latency_samples", "round_medians", "threads", "error")
    PEER_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ROUND_MEDIANS_FIELD_NUMBER: _ClassVar[int]
    THREADS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    peer: str
    latency_samples: _containers.RepeatedScalarFieldContainer[float]
    round_medians: _containers.RepeatedScalarFieldContainer[float]
    threads: int
    error: str
    def __init__(self, peer: _Optional[str] = ..., latency_samples: _Optional[_Iterable[float]] = ..., round_medians: _Optional[_Iterable[float]] = ..., threads: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class ModelRunAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
