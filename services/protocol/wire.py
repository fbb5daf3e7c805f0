"""The agent service's messages <-> tunefarm's plain records (both sides use this).

`proto/tunefarm/v1/measurer.proto` mirrors `tunefarm.records`: `Result` is a `RunResult`
plus the batch candidate it belongs to, `Timing` a `TimingConfig`, and its `ErrorKind`
enum the `ErrorKind` StrEnum.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from services.protocol.generated import measurer_pb2 as pb
from tunefarm.records import ErrorKind, RunResult, TimingConfig

AUTH_HEADER = "authorization"
"""gRPC metadata key of the bearer token (`authorization: Bearer <token>`)."""

AGENT_SECRET_HEADER = "x-tunefarm-agent-secret"
"""gRPC metadata key of the secret `Register` answered with; every later call naming the
agent carries it."""

AGENT_SECRET_PREFIX = "tfs_"
"""Start of an agent secret (tells it apart from a token at a glance)."""

AGENT_NAME_RULE = "1 to 128 characters, each a letter (a-z, A-Z), a digit, '.', '_' or '-'"
"""What an agent's name may be (`valid_agent_name`), in words for the refusal."""

_AGENT_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


def valid_agent_name(name: str) -> bool:
    """Whether `name` may name an agent: it is shown in `tunefarm devices`, the dashboard
    and the services' logs, so it holds nothing a terminal or a log reader would act on
    (an ANSI escape, a newline forging a log line) and no look-alike letters; a host name
    (the default) passes. `AGENT_NAME_RULE` says it in words."""
    return _AGENT_NAME.fullmatch(name) is not None


_KIND_TO_PB = {
    ErrorKind.NONE: pb.ERROR_KIND_NONE,
    ErrorKind.BUILD_ERROR: pb.ERROR_KIND_BUILD_ERROR,
    ErrorKind.BUILD_TIMEOUT: pb.ERROR_KIND_BUILD_TIMEOUT,
    ErrorKind.RUN_CRASH: pb.ERROR_KIND_RUN_CRASH,
    ErrorKind.RUN_ERROR: pb.ERROR_KIND_RUN_ERROR,
    ErrorKind.RUN_TIMEOUT: pb.ERROR_KIND_RUN_TIMEOUT,
    ErrorKind.WRONG_RESULT: pb.ERROR_KIND_WRONG_RESULT,
}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_HEADER, f"Bearer {token}"),)


def agent_metadata(token: str, secret: str) -> tuple[tuple[str, str], ...]:
    """The metadata of a registered agent's calls: its token and its registration's secret."""
    return (*auth_metadata(token), (AGENT_SECRET_HEADER, secret))


def agent_secret(metadata: Sequence[tuple[str, str | bytes]]) -> str | None:
    """The value of the `x-tunefarm-agent-secret` entry, or None."""
    for key, value in metadata:
        if key.lower() == AGENT_SECRET_HEADER:
            text = (value.decode() if isinstance(value, bytes) else value).strip()
            return text or None
    return None


def bearer_token(metadata: Sequence[tuple[str, str | bytes]]) -> str | None:
    """The token of an `authorization: Bearer <token>` entry, or None."""
    for key, value in metadata:
        if key.lower() == AUTH_HEADER:
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


def error_kind_to_pb(kind: ErrorKind) -> int:
    return _KIND_TO_PB[kind]


def error_kind_from_pb(value: int) -> ErrorKind:
    try:
        return _KIND_FROM_PB[value]
    except KeyError:
        raise ValueError(f"unknown error kind {value}") from None


def result_to_pb(batch_candidate_id: int, run: RunResult) -> pb.Result:
    return pb.Result(
        batch_candidate_id=batch_candidate_id,
        candidate_key=run.candidate_key,
        costs=list(run.costs),
        run_secs=run.run_secs,
        error_kind=error_kind_to_pb(run.error_kind),
        error_msg=run.error_msg,
        verified=run.verified,
        digest=list(run.digest),
    )


def run_result_from_pb(msg: pb.Result) -> RunResult:
    kind = error_kind_from_pb(msg.error_kind)
    return RunResult(
        candidate_key=msg.candidate_key,
        costs=() if kind.is_error else tuple(msg.costs),
        run_secs=msg.run_secs,
        error_kind=kind,
        error_msg=msg.error_msg,
        verified=msg.verified and not kind.is_error,
        digest=tuple(msg.digest),
    )


def timing_to_pb(timing: TimingConfig) -> pb.Timing:
    return pb.Timing(
        repeat=timing.repeat,
        min_repeat_ms=timing.min_repeat_ms,
        flush_cache=timing.flush_cache,
        slow_cutoff_secs=timing.slow_cutoff_secs,
        flush_every_call=timing.flush_every_call,
        max_flushed_calls=timing.max_flushed_calls,
    )


def timing_from_pb(msg: pb.Timing) -> TimingConfig:
    return TimingConfig(
        repeat=msg.repeat,
        min_repeat_ms=msg.min_repeat_ms,
        flush_cache=msg.flush_cache,
        slow_cutoff_secs=msg.slow_cutoff_secs,
        flush_every_call=msg.flush_every_call,
        max_flushed_calls=msg.max_flushed_calls,
    )
