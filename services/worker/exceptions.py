"""Errors of the build worker (raised into RQ, which records the job as failed)."""

from __future__ import annotations


class WorkerError(Exception):
    """Root of the build worker's errors."""


class BatchNotFound(WorkerError):
    """The job names a batch the database does not have."""
