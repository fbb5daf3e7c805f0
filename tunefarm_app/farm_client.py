"""The farm's HTTP API from the command line's side: `ClientSettings` (where the farm is,
which token) and `FarmClient` (one method per endpoint, errors as one line).

Every failure is a `FarmError` (a `UsageError`: the CLI prints one line and exits 2):
the API's own JSON error message with its status, or why the farm could not be reached.
A `TransientFarmError` (no connection, a reset or timed-out request, a 5xx answer) may
pass: `follow` retries those with a growing pause (`RETRY_PAUSES_SECS`), saying so, and
gives up once the farm has not answered for `follow_retry_secs`.

A farm is not trusted to send sane downloads: a tuned model archive is read at most
`fetch_max_bytes` (refused on its declared length, or cut off as it streams) and checked
against the farm's `X-Content-SHA256`; `artifact_fetch` unpacks it within its limits.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from tunefarm.errors import UNREACHABLE_EXIT, USAGE_EXIT, TunefarmError, UsageError

DEFAULT_SERVER = "http://127.0.0.1:8000"

TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})

RETRY_PAUSES_SECS = (1.0, 2.0, 4.0, 8.0, 15.0)
"""Pauses before the 1st, 2nd, ... retry of a poll that failed; the last one repeats."""


class FarmError(TunefarmError):
    """The farm answered with an error, or what it sent is unusable (exit 1)."""


class FarmRefused(FarmError):
    """The farm refused the request (HTTP 4xx: no such job, a bad token, a bad model):
    the command is at fault (exit 2)."""

    exit_code = USAGE_EXIT


class TransientFarmError(FarmError):
    """The request broke off or timed out, or the farm answered 5xx: worth asking again."""


class FarmUnreachable(TransientFarmError):
    """No answer from the farm at all (refused connection, unknown host, timeout): exit 3."""

    exit_code = UNREACHABLE_EXIT


class ClientSettings(BaseSettings):
    """Where the farm's API is and the team token to use: flags win, then TUNEFARM_SERVER
    and TUNEFARM_TOKEN, then the farm.json of a farm started here (`--state-dir`,
    TUNEFARM_STATE_DIR). The only reader of those variables."""

    model_config = SettingsConfigDict(env_prefix="TUNEFARM_", extra="ignore")

    # Base URL of the API (http://host:port); a bare host:port gets http://.
    server: str = DEFAULT_SERVER
    # A team token (tft_...); a secret: no default.
    token: str = ""
    # The state dir of a farm started with `tunefarm farm up --state-dir D`: its farm.json
    # gives the API's URL and the team token that neither a flag nor a variable gives.
    state_dir: Path | None = None
    # Seconds one HTTP request may take (uploads of large models take longer to import).
    http_timeout_secs: float = 600.0
    # Seconds between two polls of a followed job (`--follow`).
    follow_interval_secs: float = 2.0
    # How long `--follow` keeps retrying while the farm does not answer (the --retry-secs flag).
    follow_retry_secs: float = 300.0
    # `tunefarm fetch`'s limits: the downloaded archive, one unpacked file, and all of
    # them together (a farm is not trusted to send a sane archive).
    fetch_max_bytes: int = 2 * 1024**3
    fetch_max_entry_bytes: int = 2 * 1024**3
    fetch_max_unpacked_bytes: int = 4 * 1024**3

    @classmethod
    def load(
        cls, *, server: str | None = None, token: str | None = None, follow_retry_secs: float | None = None,
        state_dir: Path | None = None,
    ) -> ClientSettings:
        given: dict[str, Any] = {k: v for k, v in {"server": server, "token": token, "state_dir": state_dir}.items() if v}
        if follow_retry_secs is not None:
            given["follow_retry_secs"] = follow_retry_secs
        try:
            settings = cls(**given)
        except ValidationError as exc:
            raise UsageError(f"client settings: {_first_problem(exc)}") from None
        if settings.state_dir is not None:
            settings = settings.with_local_farm()
        if not settings.token.strip():
            raise UsageError(
                "no team token: set TUNEFARM_TOKEN, pass --token-file PATH, or name a farm started here "
                "with --state-dir D (or TUNEFARM_STATE_DIR)"
            )
        if "://" not in settings.server:
            settings.server = f"http://{settings.server}"
        return settings

    def with_local_farm(self) -> ClientSettings:
        """The API's URL and the team token from the farm.json in `state_dir`, where
        neither was given (a flag or TUNEFARM_SERVER / TUNEFARM_TOKEN wins)."""
        from tunefarm_app.farm_local import read_state

        assert self.state_dir is not None
        info = read_state(self.state_dir)
        update: dict[str, Any] = {}
        if "server" not in self.model_fields_set and info.get("api_url"):
            update["server"] = info["api_url"]
        if not self.token.strip() and info.get("team_token"):
            update["token"] = info["team_token"]
        return self.model_copy(update=update)


class FarmClient:
    def __init__(self, settings: ClientSettings, *, transport: Any = None):
        import httpx

        self.settings = settings
        self.base = settings.server.rstrip("/")
        self.http = httpx.Client(
            base_url=self.base,
            headers={"Authorization": f"Bearer {settings.token}"},
            timeout=settings.http_timeout_secs,
            transport=transport,
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> FarmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- endpoints ------------------------------------------------------------------------------

    def upload_model(self, path: Path, input_shapes: Mapping[str, Sequence[int]], name: str | None = None) -> dict:
        if not path.is_file():
            raise UsageError(f"no such model file: {path}")
        data = {"input_shapes": json.dumps({k: list(v) for k, v in input_shapes.items()})}
        if name:
            data["name"] = name
        with contextlib.ExitStack() as files:
            parts = [("file", (path.name, files.enter_context(open(path, "rb")), "application/octet-stream"))]
            for location, data_file in model_external_files(path):
                parts.append(("external_data", (location, files.enter_context(open(data_file, "rb")), "application/octet-stream")))
            return self._call("POST", "/v1/models", files=parts, data=data)

    def create_job(self, **body: Any) -> dict:
        return self._call("POST", "/v1/jobs", json={k: v for k, v in body.items() if v is not None})

    def job(self, job_id: int) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def jobs(self, *, limit: int | None = None, cursor: int | None = None) -> dict:
        params = {k: v for k, v in {"limit": limit, "cursor": cursor}.items() if v is not None}
        return self._call("GET", "/v1/jobs", params=params)

    def cancel(self, job_id: int) -> dict:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def devices(self) -> list[dict]:
        return self._call("GET", "/v1/devices")

    def device_classes(self) -> list[dict]:
        return self._call("GET", "/v1/device-classes")

    def artifact(self, job_id: int) -> bytes:
        """The job's tuned model archive, in memory (at most `fetch_max_bytes`)."""
        sink = io.BytesIO()
        self._download(f"/v1/jobs/{job_id}/artifact", sink, max_bytes=self.settings.fetch_max_bytes)
        return sink.getvalue()

    def download_artifact(self, job_id: int, dest: Path, *, max_bytes: int) -> int:
        """Stream the job's tuned model archive into the file `dest`; its size. A declared
        length over `max_bytes` is refused before reading, a longer stream as it passes
        it; a body that does not match the farm's `X-Content-SHA256` is refused too.
        Raises `FarmError` (`dest` then removed)."""
        try:
            with open(dest, "wb") as f:
                return self._download(f"/v1/jobs/{job_id}/artifact", f, max_bytes=max_bytes)
        except BaseException:
            dest.unlink(missing_ok=True)
            raise

    def records(self, job_id: int) -> Iterator[str]:
        """The job's records file, line by line."""
        import httpx

        try:
            with self.http.stream("GET", f"/v1/jobs/{job_id}/records") as response:
                if response.status_code >= 400:
                    response.read()
                    raise self._error(response)
                yield from response.iter_lines()
        except httpx.TransportError as exc:
            raise FarmUnreachable(f"cannot reach the farm at {self.base}: {_describe(exc)}") from None
        except httpx.HTTPError as exc:
            raise FarmError(f"cannot reach the farm at {self.base}: {exc}") from None

    def follow(
        self,
        job_id: int,
        on_change: Callable[[dict], None],
        *,
        on_retry: Callable[[str], None] = lambda message: None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> dict:
        """Poll the job until it ends; `on_change` sees every new state of it. A poll that
        fails transiently is retried (`on_retry` is told why and when) until the farm has
        not answered for `follow_retry_secs`; then a `FarmError` says so."""
        last = None
        failing_since: float | None = None
        attempt = 0
        while True:
            try:
                job = self.job(job_id)
            except TransientFarmError as exc:
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                down = now - failing_since
                pause = RETRY_PAUSES_SECS[min(attempt, len(RETRY_PAUSES_SECS) - 1)]
                if down + pause > self.settings.follow_retry_secs:
                    raise FarmUnreachable(
                        f"gave up following job {job_id}: no answer from the farm for {down:.0f} s "
                        f"(last: {exc}); `tunefarm status {job_id} --follow` picks it up again"
                    ) from None
                attempt += 1
                on_retry(f"retrying in {pause:g} s (attempt {attempt}): {exc}")
                sleep(pause)
                continue
            if failing_since is not None:
                on_retry(f"the farm answers again after {time.monotonic() - failing_since:.0f} s")
                failing_since, attempt = None, 0
            view = (job["state"], job["trials_used"], job["est_latency_secs"], job["est_latency_start_secs"],
                    job.get("waiting"))
            if view != last:
                on_change(job)
                last = view
            if job["state"] in TERMINAL_STATES:
                return job
            sleep(self.settings.follow_interval_secs)

    # -- plumbing -----------------------------------------------------------------------------

    def _download(self, path: str, sink: BinaryIO, *, max_bytes: int) -> int:
        import httpx

        digest, size = hashlib.sha256(), 0
        try:
            with self.http.stream("GET", path) as response:
                if response.status_code >= 400:
                    response.read()
                    raise self._error(response)
                declared = response.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                    raise FarmError(_too_large(int(declared), max_bytes))
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    if size > max_bytes:
                        raise FarmError(_too_large(size, max_bytes, at_least=True))
                    digest.update(chunk)
                    sink.write(chunk)
                expected = response.headers.get("x-content-sha256")
        except httpx.TransportError as exc:
            raise FarmUnreachable(f"cannot reach the farm at {self.base}: {_describe(exc)}") from None
        except httpx.HTTPError as exc:
            raise FarmError(f"cannot reach the farm at {self.base}: {exc}") from None
        if expected and expected != digest.hexdigest():
            raise FarmError(f"the download is damaged: its sha256 is {digest.hexdigest()}, the farm said {expected}")
        return size

    def _call(self, method: str, path: str, *, raw: bool = False, **kwargs: Any) -> Any:
        import httpx

        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise FarmUnreachable(f"cannot reach the farm at {self.base}: {_describe(exc)}") from None
        except httpx.HTTPError as exc:
            raise FarmError(f"cannot reach the farm at {self.base}: {exc}") from None
        if response.status_code >= 400:
            raise self._error(response)
        return response.content if raw else response.json()

    @staticmethod
    def _error(response) -> FarmError:
        try:
            message = response.json()["error"]["message"]
        except Exception:
            message = response.text.strip()[:300] or response.reason_phrase
        kind = TransientFarmError if response.status_code >= 500 else FarmRefused
        return kind(f"{message} (HTTP {response.status_code})")


def _too_large(size: int, limit: int, *, at_least: bool = False) -> str:
    what = f"at least {size}" if at_least else str(size)
    return f"the archive is {what} bytes, more than tunefarm fetch downloads ({limit}; TUNEFARM_FETCH_MAX_BYTES)"


def _describe(exc: Exception) -> str:
    """An httpx transport error in a few words (its message can be empty: a reset)."""
    return str(exc).strip() or type(exc).__name__


def model_external_files(path: Path) -> list[tuple[str, Path]]:
    """(location, file) of each external data file the ONNX model at `path` names, which
    an upload carries along; each must be in the model's directory (a `ModelError`
    naming the tensor and the location otherwise). Without the onnx package the model
    goes alone (the farm names any file it misses)."""
    try:
        import onnx
    except ImportError:
        return []
    from tunefarm.models.external_data import external_files

    model = onnx.ModelProto()
    try:
        model.ParseFromString(path.read_bytes())
    except Exception:  # not ONNX: the farm says what is wrong with it
        return []
    return external_files(model, path.parent)


def _first_problem(exc: ValidationError) -> str:
    """A settings validation error as one line: the variable and what is wrong with it."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error.get("loc", ())) or "value"
    return f"TUNEFARM_{where.upper()}: {error.get('msg', 'invalid')}"
