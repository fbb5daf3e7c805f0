"""Names of the farm's RQ queues, shared by whoever enqueues (the scheduler's
`FarmMeasurer`) and whoever works (`tunefarm worker`)."""

from __future__ import annotations

BUILD_JOB = "services.worker.jobs.build_batch"
"""Import path of the build job (enqueued by name: the enqueuer need not import it)."""


def build_queue_name(device_class: str, prefix: str = "tunefarm") -> str:
    """The queue of build jobs for one device class: `<prefix>:build:<class>`."""
    return f"{prefix}:build:{device_class}"


def build_job_id(batch_id: int, prefix: str = "tunefarm") -> str:
    """The RQ job id of a batch's build (one job per batch: enqueuing it again while it
    waits is a no-op, and its status can be looked up from the batch id)."""
    return f"{prefix}-build-{batch_id}"
