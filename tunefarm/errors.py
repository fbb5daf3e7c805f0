"""Typed errors raised at tunefarm's boundaries (CLI, file loading, record store).

Measurement failures are *not* exceptions: they are data (`records.ErrorKind`).
"""


class TunefarmError(Exception):
    """Root of every error tunefarm raises on purpose."""


class UsageError(TunefarmError):
    """The user asked for something malformed (bad shape string, unknown workload...)."""


class WorkloadError(TunefarmError):
    """A workload could not be defined or loaded (bad file, bad function, bad TVMScript)."""


class RecordError(TunefarmError):
    """A record file is unreadable, malformed, or holds nothing usable."""


class TargetError(TunefarmError):
    """A target description TVM does not accept."""


class EnvironmentCheckError(TunefarmError):
    """The installed packages are known to be broken (e.g. the wrong apache-tvm-ffi)."""


class ModelError(TunefarmError):
    """A model could not be imported or built."""
