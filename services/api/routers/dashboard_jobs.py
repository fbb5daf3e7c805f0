"""The dashboard's pages of a team's jobs (`routers/dashboard.py` has the session and
the helpers every page shares).

- `/ui/jobs`: the team's jobs: state, trials used of the budget as a bar, the estimated
  latency at the start and now and their ratio, labelled the search's progress ("est.
  progress": the search's own estimate, never a speed-up), and the measured speed-up
  over onnxruntime of a finished job (`JobSummary.speedup_vs_onnxruntime`).
- `/ui/jobs/{id}`: one job: the estimated latency over trials (its curve, as the inline
  SVG of `tunefarm.display.latency_curve_svg`, the same plot as `tunefarm report --html`)
  and the per-task table (weight, trials, best latency, GFLOPS, tuned or not, errors; a
  task also tuned by Winograd says which program leads, a row per program below it),
  each task's best latency over its trials (small multiples, `jobs.task_best_curves`; a
  line per program);
  a link to its tuned model once it succeeded.
- `/ui/compare?jobs=1,2`: two or more of the team's jobs side by side: their estimated
  latency curves overlaid (one `latency_curve_svg`, a legend naming each job), their
  facts (state, trials, estimate, measured speed-up) and each task's best latency per job
  (tasks matched by workload, so one model tuned on two classes lines up). The jobs list
  reaches it with checkboxes and a button: a plain GET form (`jobs=1&jobs=2` works too).
- `/ui/jobs/{id}/cancel` (POST, from the job page's form): cancels the job as
  `POST /v1/jobs/{id}/cancel` does (`crud.request_cancel`: a queued job at once, a
  running one when the scheduler next looks); refused from another site
  (`dashboard.cross_site`).
- `/ui/jobs/{id}/artifact`: the tuned model archive, for the session's team: the same
  download as `GET /v1/jobs/{id}/artifact` (`services.api.downloads`: streamed, its
  sha256 in `X-Content-SHA256`), which answers only a bearer token.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from services.api import crud
from services.api.deps import SessionsDep, SettingsDep
from services.api.downloads import artifact_download
from services.api.exceptions import Conflict, InvalidRequest, NotFound
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
from services.api.schemas import JobPublic, JobTaskAlternativePublic, JobTaskPublic
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
            job = crud.job_public(db, team_id=team.id, job_id=job_id, fresh_secs=settings.agent_fresh_secs, stall_secs=settings.batch_stall_secs)
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
    """The task table's rows: the task, its GFLOPS at its best, its errors (count and
    text); a task with alternatives (Winograd programs of a convolution) is followed by a
    row per program (`alternative`), its errors are theirs together."""
    rows = []
    for t in job.tasks:
        members = t.alternatives or [t]
        rows.append(_task_row(t, [details.get(m.position) for m in members], alternative=False))
        rows += [_task_row(a, [details.get(a.position)], alternative=True) for a in t.alternatives]
    return rows


def _task_row(
    t: JobTaskPublic | JobTaskAlternativePublic, details: Sequence[TaskDetail | None], *, alternative: bool
) -> dict[str, Any]:
    errors: Counter[str] = Counter()
    for d in details:
        errors.update(d.errors_by_kind if d else {})
    flops = next((d.flops for d in details if d), None)  # the same work whatever the algorithm
    return {
        "task": t,
        "alternative": alternative,
        "gflops": flops / t.best_secs / 1e9 if flops and t.best_secs else None,
        "errors": sum(errors.values()),
        "errors_text": ", ".join(f"{k} {n}" for k, n in sorted(errors.items())),
    }


def _task_plots(job: JobPublic, curves: dict[int, list[tuple[int, float]]]) -> list[tuple[JobTaskPublic, str]]:
    """Each task and the SVG of its best latency over its trials (small multiples); a
    task with alternatives has a line per program."""
    return [
        (t, latency_curve_svg([CurveSeries(m.algorithm if t.alternatives else t.name, curves.get(m.position, []))
                               for m in (t.alternatives or [t])],
                              width=TASK_PLOT_WIDTH, height=TASK_PLOT_HEIGHT, title="best latency over its trials",
                              empty="no valid measurement yet"))  # fmt: skip
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


COMPARE_MAX = 8
"""Jobs one comparison shows at most (each its own line style)."""


@dataclass(frozen=True)
class TaskComparison:
    """One task (a workload) across the compared jobs: its best latency in each (None:
    not measured yet, or not a task of that job: `in_job`), and which job is fastest."""

    name: str
    bests: list[float | None]
    in_job: list[bool]
    fastest: int | None  # index into the jobs


@router.get("/compare", response_class=HTMLResponse)
async def compare_page(
    request: Request, sessions: SessionsDep, settings: SettingsDep, jobs: Annotated[list[str], Query()] = ()
) -> Response:
    team = await page_team(request, sessions)
    if team is None:
        return to_login(request)
    try:
        ids = compared_job_ids(jobs)
        with transaction(sessions) as db:
            found = [crud.job_public(db, team_id=team.id, job_id=i, fresh_secs=settings.agent_fresh_secs, stall_secs=settings.batch_stall_secs) for i in ids]
    except (InvalidRequest, NotFound) as exc:
        return error_page(request, exc)
    series = [CurveSeries(_job_label(j), [(p.trials, p.est_latency_secs) for p in j.curve]) for j in found]
    plot = latency_curve_svg(series, title="estimated latency over trials")
    active = any(j.state in ACTIVE_STATES for j in found)
    return page(request, "compare.html", here="jobs", jobs=found, plot=plot, tasks=compare_tasks(found),
                refresh=REFRESH_SECS if active else None)


def compared_job_ids(values: Sequence[str]) -> list[int]:
    """The job ids of `jobs` query values (each one id or several, comma-separated), in
    order, each once; `InvalidRequest` unless 2 to COMPARE_MAX of them."""
    ids: list[int] = []
    for value in values:
        for part in value.split(","):
            if not part.strip():
                continue
            if not part.strip().isdigit() or int(part) < 1:
                raise InvalidRequest(f"{part.strip()!r} is not a job id")
            if int(part) not in ids:
                ids.append(int(part))
    if not 2 <= len(ids) <= COMPARE_MAX:
        raise InvalidRequest(f"pick 2 to {COMPARE_MAX} jobs to compare (there were {len(ids)})")
    return ids


def _job_label(job: JobPublic) -> str:
    return f"job {job.id}: {job.model_name} on {job.device_class}"


def compare_tasks(jobs: Sequence[JobPublic]) -> list[TaskComparison]:
    """Every task of the jobs, matched by workload (a task's key without its target
    suffix), in the order the jobs list them."""
    names: dict[str, str] = {}
    bests: dict[str, dict[int, float | None]] = {}
    for i, job in enumerate(jobs):
        for t in job.tasks:
            workload = t.key.rsplit("@", 1)[0]
            names.setdefault(workload, t.name)
            bests.setdefault(workload, {})[i] = t.best_secs
    rows = []
    for workload, by_job in bests.items():
        measured = {i: b for i, b in by_job.items() if b is not None}
        rows.append(TaskComparison(
            name=names[workload],
            bests=[by_job.get(i) for i in range(len(jobs))],
            in_job=[i in by_job for i in range(len(jobs))],
            fastest=min(measured, key=measured.__getitem__) if len(measured) > 1 else None,
        ))
    return rows
