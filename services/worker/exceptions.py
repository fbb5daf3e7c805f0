"""Errors of the build worker (raised into RQ, which records the job as failed)."""

from __future__ import annotations

from rq.exceptions import DeserializationError


class WorkerError(Exception):
    """Root of the build worker's errors."""


class BatchNotFound(WorkerError):
    """The job names a batch the database does not have."""


class RefusedJob(WorkerError, DeserializationError):
    """A job in a build queue that is not a build job (`services.worker.build_job`): it is
    failed without anything being imported or run. A `DeserializationError` to RQ, which
    then logs it without reading the job's function."""
