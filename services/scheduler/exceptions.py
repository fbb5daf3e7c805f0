"""Errors of the scheduler service: one root, small named subclasses.

A job that cannot be tuned ends `failed` with the error's message (`JobFailed`); a
database that cannot be reached is not the job's fault: the job stays as it is and is
resumed when the database answers again.
"""

from __future__ import annotations


class SchedulerError(Exception):
    """Root of the scheduler service's errors."""


class JobFailed(SchedulerError):
    """The job cannot go on (its model does not load, a task cannot be tuned, the tuned
    model does not build or does not match onnxruntime). The message is the job's error."""


class JobVanished(SchedulerError):
    """The job's row is gone or no longer this process's to run."""


class FinishInterrupted(SchedulerError):
    """The scheduler stopped while a job was finishing (waiting for a device to run its
    tuned model): the job stays finishing and the next scheduler finishes it."""
