"""The dashboard's pages of a team's jobs (`routers/dashboard.py` has the session and
the helpers every page shares).

- `/ui/jobs`: the team's jobs: state, trials used of the budget as a bar, the estimated
  latency at the start and now.
- `/ui/jobs/{id}`: one job: the estimated latency over trials (its curve, as the inline
  SVG of `tunefarm.display.latency_curve_svg`, the same plot as `tunefarm report --html`)
  and the per-task table (weight, trials, best latency, GFLOPS, tuned or not, errors),
  each task's best latency over its trials (small multiples, `jobs.task_best_curves`);
  a link to its tuned model once it succeeded.
- `/ui/jobs/{id}/cancel` (POST, from the job page's form): cancels the job as
  `POST /v1/jobs/{id}/cancel` does (`crud.request_cancel`: a queued job at once, a
  running one when the scheduler next looks); refused from another site
  (`dashboard.cross_site`).
- `/ui/jobs/{id}/artifact`: the tuned model archive, for the session's team: the same
  download as `GET /v1/jobs/{id}/artifact` (`services.api.downloads`: streamed, its
  sha256 in `X-Content-SHA256`), which answers only a bearer token.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from services.api import crud
from services.api.deps import SessionsDep, SettingsDep
from services.api.downloads import artifact_download
from services.api.exceptions import Conflict, NotFound
from services.api.routers.dashboard import (
    ACTIVE_STATES,
    JOBS_PER_PAGE,
    PREFIX,
    REFRESH_SECS,
    cross_site,
    error_page,
    page,
    page_team,
    refuse_cross_site,
    to_login,
)
from services.api.schemas import JobPublic, JobTaskPublic
from services.db.jobs import TaskDetail
from services.db.session import transaction
from tunefarm.display import CurveSeries, latency_curve_svg

router = APIRouter(prefix=PREFIX, include_in_schema=False)

JobId = Annotated[int, Path(ge=1)]

TASK_PLOT_WIDTH, TASK_PLOT_HEIGHT = 360, 200
"""The viewBox of one task's curve on the job page (they scale to their grid cell)."""


@router.get("/jobs", response_class=HTMLResponse)
async def jobs_page(request: Request, sessions: SessionsDep, cursor: int | None = None) -> Response:
    team = await page_team(request, sessions)
    if team is None:
        return to_login(request)
    with transaction(sessions) as db:
        items, next_cursor = crud.list_jobs(db, team_id=team.id, limit=JOBS_PER_PAGE, cursor=cursor)
    active = any(j.state in ACTIVE_STATES for j in items)
    return page(request, "jobs.html", here="jobs", jobs=items, next_cursor=next_cursor,
                refresh=REFRESH_SECS if active else None)


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
async def job_page(request: Request, sessions: SessionsDep, settings: SettingsDep, job_id: JobId) -> Response:
    team = await page_team(request, sessions)
    if team is None:
        return to_login(request)
    try:
        with transaction(sessions) as db:
            job = crud.job_public(db, team_id=team.id, job_id=job_id, fresh_secs=settings.agent_fresh_secs)
            details = crud.job_task_details(db, team_id=team.id, job_id=job_id)
            curves = crud.job_task_curves(db, team_id=team.id, job_id=job_id)
    except NotFound as exc:
        return error_page(request, exc)
    curve = CurveSeries(f"job {job.id}", [(p.trials, p.est_latency_secs) for p in job.curve])
    plot = latency_curve_svg([curve], target_secs=job.latency_target_secs, title="estimated latency over trials")
    active = job.state in ACTIVE_STATES
    return page(request, "job.html", here="jobs", job=job, rows=_task_rows(job, details), plot=plot,
                task_plots=_task_plots(job, curves), can_cancel=active and not job.cancel_requested,
                refresh=REFRESH_SECS if active else None)


def _task_rows(job: JobPublic, details: dict[int, TaskDetail]) -> list[dict[str, Any]]:
    """The task table's rows: the task, its GFLOPS at its best, its errors (count and text)."""
    rows = []
    for t in job.tasks:
        d = details.get(t.position)
        errors = d.errors_by_kind if d else {}
        rows.append({
            "task": t,
            "gflops": d.flops / t.best_secs / 1e9 if d and t.best_secs else None,
            "errors": sum(errors.values()),
            "errors_text": ", ".join(f"{k} {n}" for k, n in sorted(errors.items())),
        })
    return rows


def _task_plots(job: JobPublic, curves: dict[int, list[tuple[int, float]]]) -> list[tuple[JobTaskPublic, str]]:
    """Each task and the SVG of its best latency over its trials (small multiples)."""
    return [
        (t, latency_curve_svg([CurveSeries(t.name, curves.get(t.position, []))], width=TASK_PLOT_WIDTH,
                              height=TASK_PLOT_HEIGHT, title="best latency over its trials",
                              empty="no valid measurement yet"))
        for t in job.tasks
    ]


@router.get("/jobs/{job_id}/artifact", response_class=Response)
async def artifact(request: Request, sessions: SessionsDep, settings: SettingsDep, job_id: JobId) -> Response:
    team = await page_team(request, sessions)
    if team is None:
        return to_login(request)
    try:
        return artifact_download(sessions, settings, team_id=team.id, job_id=job_id)
    except (NotFound, Conflict) as exc:
        return error_page(request, exc)


@router.post("/jobs/{job_id}/cancel", response_class=RedirectResponse)
async def cancel(request: Request, sessions: SessionsDep, settings: SettingsDep, job_id: JobId) -> Response:
    why = cross_site(request, settings)
    if why is not None:
        return refuse_cross_site(request, why)
    team = await page_team(request, sessions)
    if team is None:
        return to_login(request)
    try:
        with transaction(sessions) as db:
            crud.request_cancel(db, team_id=team.id, job_id=job_id)
    except (NotFound, Conflict) as exc:
        return error_page(request, exc)
    return RedirectResponse(f"{PREFIX}/jobs/{job_id}", status_code=303)
