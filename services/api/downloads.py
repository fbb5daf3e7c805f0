"""A finished job's tuned model archive as a download: one response for the JSON API
(`GET /v1/jobs/{id}/artifact`, bearer token) and the dashboard (`/ui/jobs/{id}/artifact`,
the session cookie), so both stream the same file with the same headers.

`X-Content-SHA256` carries the archive's sha256 as the scheduler recorded it: a client
checks the bytes it got against it.
"""

from __future__ import annotations

from fastapi.responses import FileResponse

from services.api import crud
from services.api.settings import ApiSettings
from services.common import artifacts
from services.db.session import SessionFactory, transaction

SHA256_HEADER = "X-Content-SHA256"


def artifact_download(sessions: SessionFactory, settings: ApiSettings, *, team_id: int, job_id: int) -> FileResponse:
    """The team's job's tuned model archive, streamed from the artifact root
    (`NotFound`: not the team's job; `Conflict`: it has not succeeded)."""
    with transaction(sessions) as db:
        job = crud.job_artifact(db, team_id=team_id, job_id=job_id)
    assert job.artifact_path is not None
    return FileResponse(
        artifacts.resolve(settings.artifact_root, job.artifact_path),
        media_type="application/gzip",
        filename=f"job-{job_id}-tuned.tar.gz",
        headers={SHA256_HEADER: job.artifact_sha256 or ""},
    )
