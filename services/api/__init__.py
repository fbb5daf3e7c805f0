"""The farm's HTTP API (FastAPI): teams upload models, start tuning jobs on a device class,
follow them and fetch the tuned models.

| module | what it holds |
|---|---|
| `settings.py` | `ApiSettings` (bind address, artifact root, upload and budget limits) |
| `app.py` | `create_app(settings)`, the error handlers, `main` (`tunefarm api`, uvicorn) |
| `routers/` | one router per resource: `models`, `jobs`, `devices`, `health`; `metrics` (Prometheus); `dashboard` (the HTML pages' session and helpers), `dashboard_jobs`, `dashboard_devices` (the pages) |
| `templates/` | the dashboard's Jinja2 pages |
| `authentication.py` | the team of a request, from its headers, before its body is read |
| `deps.py` | the `Annotated` dependencies: settings, database session, team, page |
| `schemas.py` | request and response bodies (`JobCreate`, `JobPublic`, ...) |
| `crud.py` | the operations on a team's resources: `services.db` reads and writes, the API's errors, the response schemas |
| `intake.py` | taking in an upload: import and fuse the model in a child process |
| `intake_pool.py` | the importer processes shared by all teams, a few per team at most |
| `downloads.py` | a finished job's tuned model archive as a download (the API's and the dashboard's) |
| `storage.py` | files under the artifact root (uploads, fused modules) |
| `security_headers.py` | CSP, frame, nosniff and referrer headers on every response |
| `limits.py` | the request body limit (413 while streaming) |
| `exceptions.py` | `ApiError` and its subclasses, each with its HTTP status |
"""
