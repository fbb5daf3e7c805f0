"""Kept one release for old imports: the queue names live in services/common/queues.py."""

from services.common.queues import BUILD_JOB, build_job_id, build_queue_name  # noqa: F401
