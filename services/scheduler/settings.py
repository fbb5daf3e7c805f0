"""The scheduler service's settings: the only place it reads the environment.

Environment variables (prefix TUNEFARM_), besides the shared ones (`ServiceSettings`: the
database, TUNEFARM_ARTIFACT_ROOT, TUNEFARM_REDIS_URL the build jobs go through,
TUNEFARM_QUEUE_PREFIX, TUNEFARM_AGENT_FRESH_SECS: what counts as a live agent, for the
fair shares, and how long a tuned model's run waits, after as long, for a class with no
live agent):

| variable | default | meaning |
|---|---|---|
| TUNEFARM_MAX_JOBS | 16 | jobs this process tunes at the same time |
| TUNEFARM_BATCHES_PER_AGENT | 2 | batches in flight per live agent of a class, shared by its jobs |
| TUNEFARM_POLL_INTERVAL_SECS | 0.25 | sleep between passes when nothing happened |
| TUNEFARM_STEP_WAIT_SECS | 0.02 | how long one job's step waits for results |
| TUNEFARM_COST_MODEL_WARMUP | 32 | programs a class's cost model sees before it ranks (random before) |
| TUNEFARM_COST_MODEL_SAVE_EVERY | 256 | new measurements between two saved versions of a class's model |
| TUNEFARM_COST_MODEL_CATCH_UP_SECS | 10 | how often a class's model reads measurements made elsewhere |
| TUNEFARM_COST_MODEL_TRANSFER | true | a class with no cost model of its own starts from its nearest class's |
| TUNEFARM_COST_MODEL_PRETRAINED | true | ... else from the pretrained model of its device family (false: fresh) |
| TUNEFARM_PRETRAINED_DIR | unset | the directory of the pretrained models (`<family>.npz`) instead of the package's |
| TUNEFARM_CHECK_TUNED_MODEL | true | have an agent of the class run and time the tuned model (beside onnxruntime and OpenVINO) and check it against onnxruntime before keeping it |
| TUNEFARM_MODEL_RUN_WAIT_SECS | 1800 | how long an agent of the class may take to run and time a tuned model |
| TUNEFARM_TIMING_REPEAT | 5 | timed repeats of each kernel an agent measures (their median is its time) |
| TUNEFARM_TIMING_MIN_REPEAT_MS | 40 | the least length of one repeat: a fast kernel is called until it is reached |
| TUNEFARM_BUILD_CHECK_SECS | 5 | how often batches in flight are checked for builds nobody is doing (a killed worker, Redis's data lost) |
| TUNEFARM_SCHEDULER_HEARTBEAT_FILE | unset | touched after every pass (a container's health check reads its age) |
| TUNEFARM_SIGNING_KEY_FILE | unset | the farm's Ed25519 private key (PEM): tuned models run by agents (and the ONNX graphs their peers are timed on) are signed with it |
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from services.common.settings import ServiceSettings
from tunefarm.records import TimingConfig


class SchedulerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TUNEFARM_", extra="ignore")

    # Jobs tuned at the same time by this process (more wait, queued, in id order).
    max_jobs: int = 16
    # Fair share: a class with A live agents and J running jobs lets each job keep
    # ceil(batches_per_agent * A / J) batches in flight (at least 1): one being measured
    # and one built and waiting per agent keeps every agent busy, and equal caps over a
    # FIFO queue give every job the same share of the agents.
    batches_per_agent: int = 2
    # The loop: a pass steps every job once (waiting at most step_wait_secs each for
    # results), and sleeps poll_interval_secs when no job made progress.
    poll_interval_secs: float = 0.25
    step_wait_secs: float = 0.02
    # The shared cost model of each class: programs before it ranks (random scores
    # before; embedded mode starts after its first batch), measurements between saved
    # versions, and how often measurements of jobs tuned elsewhere are read.
    cost_model_warmup: int = 32
    cost_model_save_every: int = 256
    cost_model_catch_up_secs: float = 10.0
    # A class with no cost model of its own starts from its nearest class's latest one
    # (tunefarm.search.cost_model.transfer); False: it starts fresh.
    cost_model_transfer: bool = True
    # A class with no cost model of its own nor a near class's starts from the pretrained
    # model of its device family (tunefarm.search.cost_model.pretrained: the package's
    # file, or pretrained_dir's <family>.npz); False: it starts fresh.
    cost_model_pretrained: bool = True
    pretrained_dir: Path | None = None
    # Run the tuned model on an agent of the class (a model run: its outputs, and its
    # latency beside onnxruntime's and OpenVINO's on that agent) and compare its outputs
    # with onnxruntime's here before keeping it; the agent has model_run_wait_secs to
    # pick it up and run it (then it is kept unchecked and untimed, and the report says
    # so). False: neither checked nor timed.
    check_tuned_model: bool = True
    model_run_wait_secs: float = 1800.0
    # A finishing job waits this long for its bests' confirmations (a second measurement
    # of each best kernel, services.db.confirmations) before it builds the tuned model
    # with the confirmed ones it has.
    confirm_wait_secs: float = 600.0
    # How an agent times each kernel of the farm's jobs (`TimingConfig`): `timing_repeat`
    # repeats, each at least `timing_min_repeat_ms` long, the CPU caches flushed before
    # each; the median repeat is the kernel's time. More repeats for a noisy board.
    timing_repeat: int = Field(default=TimingConfig.repeat, ge=1, le=100)
    timing_min_repeat_ms: float = Field(default=TimingConfig.min_repeat_ms, ge=0.0, le=10_000.0)
    # How often each job's batches in flight are checked: a batch no worker is building
    # and whose build job is not waiting in Redis (its worker was killed, Redis lost its
    # data) is enqueued again.
    build_check_secs: float = 5.0
    # A file touched after every pass of the loop: its age tells a health check that the
    # loop is alive (None: no file).
    scheduler_heartbeat_file: Path | None = None
    # The farm's signing key (services/protocol/signing.py): a tuned model handed to an
    # agent is signed with it; agents load nothing unsigned (None: unsigned).
    signing_key_file: Path | None = None

    def timing(self) -> TimingConfig:
        """How agents time the kernels of this scheduler's jobs."""
        return TimingConfig(repeat=self.timing_repeat, min_repeat_ms=self.timing_min_repeat_ms)
