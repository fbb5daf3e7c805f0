"""Typed errors raised at tunefarm's boundaries (CLI, file loading, record store).

Measurement failures are *not* exceptions: they are data (`records.ErrorKind`).

Each error carries the command line's exit status for it (`exit_code`): 2 when what was
asked is wrong (a flag, a file, a shape, a target: fix the command), 1 when the work
itself failed (a model that does not run, a broken installation), 3 when the farm cannot
be reached (`tunefarm_app.farm_client`: try again later).
"""

USAGE_EXIT = 2
FAILURE_EXIT = 1
UNREACHABLE_EXIT = 3


class TunefarmError(Exception):
    """Root of every error tunefarm raises on purpose."""

    exit_code = FAILURE_EXIT


class UsageError(TunefarmError):
    """The user asked for something malformed (bad shape string, unknown workload...)."""

    exit_code = USAGE_EXIT


class WorkloadError(TunefarmError):
    """A workload could not be defined or loaded (bad file, bad function, bad TVMScript)."""

    exit_code = USAGE_EXIT


class RecordError(TunefarmError):
    """A record file is unreadable, malformed, or holds nothing usable."""

    exit_code = USAGE_EXIT


class TargetError(TunefarmError):
    """A target description TVM does not accept."""

    exit_code = USAGE_EXIT


class EnvironmentCheckError(TunefarmError):
    """The installed packages are known to be broken (e.g. the wrong apache-tvm-ffi)."""


class ModelError(TunefarmError):
    """A model could not be imported or built (the file given is at fault)."""

    exit_code = USAGE_EXIT


class ModelRunError(ModelError):
    """A built model failed to run or be timed in its process (a crash, a timeout)."""

    exit_code = FAILURE_EXIT
