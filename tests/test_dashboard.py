"""The dashboard in a real browser: `tunefarm api` (uvicorn on loopback, real PostgreSQL)
serving a farm in a known state (farm_state.py), driven by headless Chromium.

Logs in with a team token, checks the numbers each page shows (jobs with their progress,
the job's curve as an SVG with its points, the per-task table and each task's curve, the
agents with heartbeats and errors, an agent's page and a class's), that another team's
job is not there, that no token or a bad one leads to the login page, that logging out
ends the session (its old cookie is worthless), that another site's form can neither log
the browser in nor cancel a job, that the tuned model downloads with the session (bytes
and sha256), that a job is cancelled from its page, that two jobs compare (curves and
legend), that the measured speed-up is told apart from the search's progress, that a
360 px window needs no sideways scrolling, and that every th has a scope and muted text
its contrast; and writes a screenshot of every page (tunefarm-test-artifacts/screenshots/).
"""

from __future__ import annotations

import hashlib
import shutil

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("jinja2")

import httpx  # noqa: E402
from browser import SCREENSHOTS, chrome, screenshot  # noqa: E402
from farm_state import CURVE, FINISHED_CURVE, MEASURED, TASKS, seed_farm, seed_finished_job  # noqa: E402

from tunefarm_app.bench.farm_progress import start_api  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def artifact_root(tmp_path_factory):
    return tmp_path_factory.mktemp("artifacts")


@pytest.fixture(scope="module")
def served(database_url, db_sessions, artifact_root):
    state = seed_farm(db_sessions)
    proc, base = start_api(database_url, artifact_root=artifact_root)
    try:
        yield state, base
    finally:
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def finished(served, db_sessions, artifact_root):
    """Team A's job that succeeded on a second class, with its archive (farm_state.py)."""
    state, _ = served
    return seed_finished_job(db_sessions, state, artifact_root)


@pytest.fixture(scope="module")
def browser():
    shutil.rmtree(SCREENSHOTS, ignore_errors=True)
    driver = chrome()
    try:
        yield driver
    finally:
        driver.quit()


def by_css(driver, selector: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def wait_until(driver, condition) -> None:
    """Until `condition(driver)` holds (a hang guard of 30 s). An element found just as the
    page is replaced (a form's answer, the 5 s reload of a page that changes) goes stale
    before it is read: that is asked again, not a failure."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.wait import WebDriverWait

    WebDriverWait(driver, 30, ignored_exceptions=(StaleElementReferenceException,)).until(condition)


def click(driver, selector: str) -> None:
    """Click the element, again if the page was replaced under it (stale)."""

    def clicked(d) -> bool:
        found = by_css(d, selector)
        if found:
            found[0].click()
        return bool(found)

    wait_until(driver, clicked)


def log_in(driver, base: str, token: str) -> None:
    """Submit the login form; return once the next page (or the login error) is shown."""
    driver.delete_all_cookies()
    driver.get(f"{base}/ui/login")
    field = by_css(driver, "input#token")[0]
    field.send_keys(token)
    field.submit()
    wait_until(driver, lambda d: not d.current_url.endswith("/ui/login") or by_css(d, "#login-error"))


def test_without_a_token_every_page_is_the_login_page(served, browser):
    state, base = served
    for page in ("/ui/jobs", f"/ui/jobs/{state.job_a}", "/ui/devices"):
        r = httpx.get(base + page, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/ui/login", (page, r.status_code)
        r = httpx.get(base + page, headers={"Authorization": "Bearer tft_not_a_token"}, follow_redirects=False)
        assert r.status_code == 303, page
    browser.delete_all_cookies()
    browser.get(f"{base}/ui/jobs")
    assert browser.current_url.endswith("/ui/login")
    assert by_css(browser, "form input#token")
    screenshot(browser, "login")


@pytest.mark.parametrize("which", ["unknown", "agent"])
def test_a_bad_token_is_refused_with_a_message(served, browser, which):
    state, base = served
    log_in(browser, base, "tft_unknown_token" if which == "unknown" else state.agent_token)
    assert browser.current_url.endswith("/ui/login")
    message = by_css(browser, "#login-error")[0].text
    assert ("unknown" in message) if which == "unknown" else ("agent token" in message), message
    assert not browser.get_cookies()


def test_jobs_page_shows_the_teams_jobs_with_progress(served, browser):
    state, base = served
    log_in(browser, base, state.team_a_token)
    assert browser.current_url.endswith("/ui/jobs")
    cookie = browser.get_cookie("tunefarm_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui"
    assert state.team_a_token not in cookie["value"]  # a session id: the token is not in the browser
    rows = by_css(browser, "tr.job")
    ids = {int(r.get_attribute("data-job-id")) for r in rows}
    assert state.job_a in ids and state.job_b not in ids  # team B's job is not shown
    row = by_css(browser, f"tr#job-{state.job_a}")[0]
    assert "running" in row.text and state.model_name in row.text
    measured = 7
    assert by_css(row, ".trials")[0].text == f"{measured} / {state.trial_budget}"
    bar = by_css(row, ".bar-inner")[0].get_attribute("style")
    assert f"{100 * measured / state.trial_budget:.1f}%" in bar
    assert by_css(row, ".est-start")[0].text == "90.0 us"  # the first complete estimate
    assert by_css(row, ".est-now")[0].text == "42.0 us"
    screenshot(browser, "jobs")


def test_job_page_plots_the_curve_and_lists_the_tasks(served, browser):
    state, base = served
    log_in(browser, base, state.team_a_token)
    browser.get(f"{base}/ui/jobs/{state.job_a}")
    svg = by_css(browser, "#job-curve svg.curve")[0]
    assert svg.get_attribute("data-points") == str(len(CURVE))
    assert len(by_css(browser, "#job-curve svg.curve circle.point")) == len(CURVE)
    assert by_css(browser, "#est-now")[0].text == "42.0 us"
    rows = by_css(browser, "tr.task")
    assert [r.find_element("css selector", ".task-name").text for r in rows] == [t[0] for t in TASKS]
    for row, (name, _, flops), best, errors in zip(rows, TASKS, state.best_by_task, state.errors_by_task):
        cells = {c: row.find_element("css selector", c).text for c in (".task-trials", ".task-best", ".task-gflops",
                                                                        ".task-errors")}
        assert cells[".task-errors"] == str(sum(errors.values())), name
        if best is None:
            assert cells[".task-best"] == "--" and "not yet" in row.text and cells[".task-trials"] == "0"
        else:
            assert cells[".task-gflops"] == f"{flops / best / 1e9:.1f}", name
            assert "tuned" in row.text
    assert "run_error 1, run_timeout 1" in rows[0].text
    screenshot(browser, "job")


def test_another_teams_job_is_not_found(served, browser):
    state, base = served
    log_in(browser, base, state.team_a_token)
    browser.get(f"{base}/ui/jobs/{state.job_b}")
    assert "not found" in by_css(browser, "#error")[0].text
    r = httpx.get(f"{base}/ui/jobs/{state.job_b}", headers={"Authorization": f"Bearer {state.team_a_token}"})
    assert r.status_code == 404
    r = httpx.get(f"{base}/ui/jobs/{state.job_b}", headers={"Authorization": f"Bearer {state.team_b_token}"})
    assert r.status_code == 200 and f"Job {state.job_b}" in r.text  # its own team sees it


def test_devices_page_shows_heartbeats_and_errors(served, browser):
    state, base = served
    log_in(browser, base, state.team_a_token)
    browser.get(f"{base}/ui/devices")
    assert any(state.device_class in r.text for r in by_css(browser, "tr.device-class"))
    agents = {r.get_attribute("data-agent"): r for r in by_css(browser, "tr.agent")}
    alive, silent = agents[state.alive_agent], agents[state.silent_agent]
    assert by_css(alive, ".measurements")[0].text == "7"
    assert by_css(alive, ".errors")[0].text == "run_error 2, run_timeout 1"
    assert by_css(alive, ".heartbeat")[0].text.endswith("s ago")
    assert by_css(silent, ".heartbeat")[0].text.startswith("1h")  # silent for an hour
    assert by_css(silent, ".errors")[0].text == "none"
    screenshot(browser, "devices")


def test_logging_out_ends_the_session(served, browser):
    state, base = served
    log_in(browser, base, state.team_a_token)
    session_id = browser.get_cookie("tunefarm_session")["value"]
    by_css(browser, "header form button")[0].click()
    wait_until(browser, lambda d: d.current_url.endswith("/ui/login"))
    browser.get(f"{base}/ui/jobs")
    assert browser.current_url.endswith("/ui/login")
    # The old cookie, kept (copied from the browser): its session is gone on the server.
    browser.add_cookie({"name": "tunefarm_session", "value": session_id, "path": "/ui"})
    browser.get(f"{base}/ui/jobs")
    assert browser.current_url.endswith("/ui/login")


@pytest.fixture(scope="module")
def other_site_pages():
    """Another site (localhost, not 127.0.0.1): its base URL, and its pages by path (a
    test adds the page it needs)."""
    import http.server
    import threading

    pages: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            page = pages.get(self.path, b"not here")
            self.send_response(200 if self.path in pages else 404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://localhost:{server.server_address[1]}", pages
    finally:
        server.shutdown()


def post_form(action: str, **fields: str) -> bytes:
    """Another site's page with a form that posts `fields` to `action` (button #go)."""
    inputs = "".join(f'<input type="hidden" name="{k}" value="{v}">' for k, v in fields.items())
    return (f'<!doctype html><form method="post" action="{action}">{inputs}'
            '<button id="go" type="submit">win a prize</button></form>').encode()


@pytest.fixture(scope="module")
def other_site(served, other_site_pages):
    """A page of another site with a form that posts team B's token to the dashboard's
    login: a login CSRF."""
    state, base = served
    site, pages = other_site_pages
    pages["/"] = post_form(f"{base}/ui/login", token=state.team_b_token)
    return f"{site}/"


def test_another_sites_form_cannot_log_the_browser_in_to_its_team(served, browser, other_site):
    state, base = served
    log_in(browser, base, state.team_a_token)
    browser.get(other_site)
    by_css(browser, "#go")[0].click()
    wait_until(browser, lambda d: d.current_url.startswith(base))
    assert "refused" in by_css(browser, "#error")[0].text
    screenshot(browser, "cross-site-refused")
    browser.get(f"{base}/ui/jobs")  # still team A's session: team B's job is not shown
    ids = {int(r.get_attribute("data-job-id")) for r in by_css(browser, "tr.job")}
    assert state.job_a in ids and state.job_b not in ids


def test_pages_carry_the_security_headers(served):
    state, base = served
    for page in ("/ui/login", "/ui/jobs", "/v1/jobs"):
        r = httpx.get(base + page, headers={"Authorization": f"Bearer {state.team_a_token}"}, follow_redirects=False)
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"], page
        assert r.headers["x-frame-options"] == "DENY" and r.headers["x-content-type-options"] == "nosniff"


def session_cookie(driver) -> dict[str, str]:
    """The browser's session cookie, for a plain HTTP client acting as that browser."""
    return {"tunefarm_session": driver.get_cookie("tunefarm_session")["value"]}


def test_the_job_page_downloads_the_tuned_model_with_the_session(served, finished, browser, tmp_path):
    state, base = served
    log_in(browser, base, state.team_a_token)
    browser.get(f"{base}/ui/jobs/{state.job_a}")
    assert not by_css(browser, "#download-artifact")  # running: nothing to download yet
    browser.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(tmp_path)})
    browser.get(f"{base}/ui/jobs/{finished.job_id}")
    assert by_css(browser, "#artifact-sha256")[0].text == finished.sha256
    screenshot(browser, "job-succeeded")
    by_css(browser, "#download-artifact")[0].click()
    saved = tmp_path / f"job-{finished.job_id}-tuned.tar.gz"
    wait_until(browser, lambda d: saved.exists() and not list(tmp_path.glob("*.crdownload")))
    data = saved.read_bytes()
    assert data == finished.archive and hashlib.sha256(data).hexdigest() == finished.sha256
    # The same download as the JSON API's (streamed, the sha256 in its header), for the cookie.
    r = httpx.get(f"{base}/ui/jobs/{finished.job_id}/artifact", cookies=session_cookie(browser))
    assert r.status_code == 200 and r.content == finished.archive
    api = httpx.get(f"{base}/v1/jobs/{finished.job_id}/artifact",
                    headers={"Authorization": f"Bearer {state.team_a_token}"})
    for header in ("x-content-sha256", "content-type", "content-disposition", "content-length"):
        assert r.headers[header] == api.headers[header], header
    assert r.headers["x-content-sha256"] == finished.sha256
    # Another team's session: not found; a job without a tuned model yet: not possible now.
    other = httpx.get(f"{base}/ui/jobs/{finished.job_id}/artifact",
                      headers={"Authorization": f"Bearer {state.team_b_token}"})
    assert other.status_code == 404 and finished.archive not in other.content
    running = httpx.get(f"{base}/ui/jobs/{state.job_a}/artifact", cookies=session_cookie(browser))
    assert running.status_code == 409 and "no tuned model yet" in running.text
    assert httpx.get(f"{base}/ui/jobs/{finished.job_id}/artifact", follow_redirects=False).status_code == 303


def _job_of_team_a(db_sessions, state, *, start: bool) -> int:
    """A new job of team A on the farm's class: queued, or running (`start`: claimed as the scheduler does)."""
    from services.api import crud
    from services.api.schemas import JobCreate
    from services.db import job_store
    from services.db.models import Job
    from services.db.session import transaction

    with transaction(db_sessions) as s:
        job = s.get(Job, state.job_a)
        body = JobCreate(model_id=job.model_id, device_class=state.device_class, trial_budget=8)
        job_id = crud.create_job(s, team_id=job.team_id, body=body, max_trial_budget=10_000).id
    if start:
        with transaction(db_sessions) as s:
            job_store.claim_job(s, job_id=job_id)
    return job_id


def _job_row(db_sessions, job_id: int):
    from services.db.models import Job
    from services.db.session import transaction

    with transaction(db_sessions) as s:
        job = s.get(Job, job_id)
        return job.state.value, job.cancel_requested


def test_a_running_job_is_cancelled_from_its_page(served, browser, db_sessions):
    from services.db import job_store
    from services.db.session import transaction
    from services.db.states import JobState

    state, base = served
    running, queued = _job_of_team_a(db_sessions, state, start=True), _job_of_team_a(db_sessions, state, start=False)
    log_in(browser, base, state.team_a_token)
    browser.get(f"{base}/ui/jobs/{running}")
    wait_until(browser, lambda d: by_css(d, "#job-state")[0].text == "running")
    screenshot(browser, "job-cancel")
    click(browser, "#cancel-job")
    wait_until(browser, lambda d: by_css(d, "#cancel-requested"))
    assert browser.current_url == f"{base}/ui/jobs/{running}" and not by_css(browser, "#cancel-job")
    assert _job_row(db_sessions, running) == ("running", True)  # the scheduler stops it when it next looks
    with transaction(db_sessions) as s:  # ... as the scheduler does (services/scheduler/service.py)
        assert running in job_store.cancel_requests(s, job_ids=[running])
        job_store.fail_open_batches(s, job_id=running, reason="the job was cancelled")
        job_store.set_job_state(s, job_id=running, state=JobState.CANCELLED)
    browser.get(f"{base}/ui/jobs/{running}")
    assert by_css(browser, "#job-state")[0].text == "cancelled" and not by_css(browser, "#cancel-job")
    # A queued job is cancelled at once, as by POST /v1/jobs/{id}/cancel.
    browser.get(f"{base}/ui/jobs/{queued}")
    click(browser, "#cancel-job")
    # one look at the page per try: the cancel form's answer may replace it between two
    wait_until(browser, lambda d: [e.text for e in by_css(d, "#job-state")] == ["cancelled"])
    assert _job_row(db_sessions, queued) == ("cancelled", True)
    # Cancelling a job that has ended: the API's 409, as a page.
    r = httpx.post(f"{base}/ui/jobs/{queued}/cancel", cookies=session_cookie(browser), headers={"Origin": base})
    assert r.status_code == 409 and "already cancelled" in r.text


def test_another_sites_form_cannot_cancel_a_job(served, browser, db_sessions, other_site_pages):
    state, base = served
    site, pages = other_site_pages
    job_id = _job_of_team_a(db_sessions, state, start=True)
    pages["/cancel"] = post_form(f"{base}/ui/jobs/{job_id}/cancel")
    log_in(browser, base, state.team_a_token)
    browser.get(f"{site}/cancel")
    by_css(browser, "#go")[0].click()
    wait_until(browser, lambda d: d.current_url.startswith(base))
    assert "refused" in by_css(browser, "#error")[0].text
    assert _job_row(db_sessions, job_id) == ("running", False)
    # Not even with the session's cookie and a bearer token: the Origin decides.
    for headers in ({"Origin": site}, {"Referer": f"{site}/cancel"}, {}):
        r = httpx.post(f"{base}/ui/jobs/{job_id}/cancel", cookies=session_cookie(browser),
                       headers={**headers, "Authorization": f"Bearer {state.team_a_token}"}, follow_redirects=False)
        assert r.status_code == 403 and "refused" in r.text, headers
    assert _job_row(db_sessions, job_id) == ("running", False)


def test_the_measured_speedup_is_told_apart_from_the_searchs_progress(served, finished, browser):
    state, base = served
    log_in(browser, base, state.team_a_token)
    headers = [th.text for th in by_css(browser, "table.jobs thead th")]
    assert "est. progress" in headers and "vs onnxruntime" in headers
    assert not any("speed" in h for h in headers)  # the estimate's ratio is never called a speed-up
    done = by_css(browser, f"tr#job-{finished.job_id}")[0]
    assert by_css(done, ".speedup")[0].text == f"{finished.speedup:.2f}x" == "2.50x"  # measured: 75 us / 30 us
    assert by_css(done, ".speedup-openvino")[0].text == "2.00x"  # OpenVINO's 60 us / 30 us
    assert by_css(done, ".est-progress")[0].text == "3.00x"  # estimated: 120 us at the start, 40 us now
    running = by_css(browser, f"tr#job-{state.job_a}")[0]
    assert by_css(running, ".speedup")[0].text == by_css(running, ".speedup-openvino")[0].text == "--"  # not yet
    assert by_css(running, ".est-progress")[0].text == f"{CURVE[0][1] / CURVE[-1][1]:.2f}x"
    browser.get(f"{base}/ui/jobs/{finished.job_id}")
    assert by_css(browser, "#measured-speedup")[0].text == "2.50x"
    assert by_css(browser, "#est-progress")[0].text == "3.00x"
    facts = {dt.text: dd.text for dt, dd in zip(by_css(browser, ".facts dt"), by_css(browser, ".facts dd"))}
    assert "est. progress 3.00x" in facts["estimated latency"] and "speed" not in facts["estimated latency"]
    assert facts["measured speed-up"].startswith("2.50x the speed of onnxruntime, 2.00x the speed of OpenVINO")
    assert facts["onnxruntime"].startswith("75.0 us median") and facts["OpenVINO"].startswith("60.0 us median")
    # The JSON API carries the same number (the CLI's status and jobs print it).
    auth = {"Authorization": f"Bearer {state.team_a_token}"}
    job = httpx.get(f"{base}/v1/jobs/{finished.job_id}", headers=auth).json()
    assert job["speedup_vs_onnxruntime"] == pytest.approx(2.5)
    listed = {j["id"]: j for j in httpx.get(f"{base}/v1/jobs", headers=auth).json()["items"]}
    assert listed[finished.job_id]["speedup_vs_onnxruntime"] == pytest.approx(2.5)
    assert job["speedup_vs_openvino"] == listed[finished.job_id]["speedup_vs_openvino"] == pytest.approx(2.0)
    assert listed[state.job_a]["speedup_vs_onnxruntime"] is None


def best_steps(measured) -> list[tuple[int, float]]:
    """(trial, best so far) where the best improved, and at the last trial."""
    steps, best = [], None
    for trial, (cost, _) in enumerate(measured, start=1):
        improved = cost is not None and (best is None or cost < best)
        best = cost if improved else best
        if best is not None and (improved or trial == len(measured)):
            steps.append((trial, best))
    return steps


def test_the_job_page_draws_each_tasks_best_latency_over_its_trials(served, browser):
    from tunefarm.display import format_cost

    state, base = served
    log_in(browser, base, state.team_a_token)
    browser.get(f"{base}/ui/jobs/{state.job_a}")
    figures = by_css(browser, "figure.task-curve")
    assert [int(f.get_attribute("data-position")) for f in figures] == list(range(len(TASKS)))
    for figure, (name, _, _), measured in zip(figures, TASKS, MEASURED):
        assert name in by_css(figure, "figcaption")[0].text
        steps = best_steps(measured)
        svg = by_css(figure, "svg.curve")[0]
        assert svg.get_attribute("data-points") == str(len(steps)), name
        titles = [c.get_attribute("textContent") for c in by_css(figure, "circle.point title")]
        assert titles == [f"{t} trials: {format_cost(b)}" for t, b in steps], name
        if not steps:
            assert "no valid measurement yet" in svg.get_attribute("textContent")
    assert best_steps(MEASURED[0]) == [(1, 4e-5), (2, 3e-5), (4, 3e-5)]  # the rule, spelled out once
    screenshot(browser, "job-task-curves")


def test_jobs_ticked_in_the_list_are_compared(served, finished, browser):
    from urllib.parse import parse_qs, urlsplit

    from tunefarm.display import format_cost

    state, base = served
    log_in(browser, base, state.team_a_token)
    for _ in range(3):  # the list reloads itself while a job runs: tick again if it did meanwhile
        browser.get(f"{base}/ui/jobs")
        for job_id in (state.job_a, finished.job_id):
            by_css(browser, f"tr#job-{job_id} input.compare-pick")[0].click()
        by_css(browser, "#compare-jobs")[0].click()
        wait_until(browser, lambda d: "/ui/compare" in d.current_url)
        if by_css(browser, "#compare-curve"):
            break
    ids = [int(i) for i in parse_qs(urlsplit(browser.current_url).query)["jobs"]]
    assert sorted(ids) == sorted([state.job_a, finished.job_id])  # a plain GET form: jobs=..&jobs=..
    svg = by_css(browser, "#compare-curve svg.curve")[0]
    assert svg.get_attribute("data-series") == "2"
    labels = {state.job_a: f"job {state.job_a}: {state.model_name} on {state.device_class}",
              finished.job_id: f"job {finished.job_id}: {state.model_name} on {finished.device_class}"}
    points = {g.get_attribute("data-label"): int(g.get_attribute("data-points")) for g in by_css(svg, "g.series")}
    assert points == {labels[state.job_a]: len(CURVE), labels[finished.job_id]: len(FINISHED_CURVE)}
    assert [t.text for t in by_css(svg, ".legend text")] == [labels[i] for i in ids]  # the legend names both
    styles = {g.get_attribute("class") for g in by_css(svg, ".legend-item")}
    assert len(styles) == 2  # each its own line style
    bests = {state.job_a: state.best_by_task, finished.job_id: finished.best_by_task}
    rows = by_css(browser, "tr.compared-task")
    assert [by_css(r, ".task-name")[0].text for r in rows] == [t[0] for t in TASKS]  # one model: tasks line up
    for position, row in enumerate(rows):
        cells = by_css(row, ".task-best")
        assert [c.text for c in cells] == [format_cost(bests[i][position]) for i in ids], position
        faster = [i for i, c in zip(ids, cells) if "better" in c.get_attribute("class")]
        both = [bests[i][position] for i in ids]
        if None in both:
            assert faster == []
        else:
            assert faster == [min(ids, key=lambda i: bests[i][position])]
    screenshot(browser, "compare")
    cookies = session_cookie(browser)
    r = httpx.get(f"{base}/ui/compare?jobs={state.job_a},{finished.job_id}", cookies=cookies)
    assert r.status_code == 200 and all(label in r.text for label in labels.values())
    r = httpx.get(f"{base}/ui/compare?jobs={state.job_a}", cookies=cookies)
    assert r.status_code == 422 and "pick 2 to 8 jobs" in r.text
    r = httpx.get(f"{base}/ui/compare?jobs={state.job_a},{state.job_b}", cookies=cookies)
    assert r.status_code == 404 and f"job {state.job_b} not found" in r.text  # another team's job


def test_each_agent_has_a_page_and_pages_link_jobs_classes_and_agents(served, browser):
    state, base = served
    log_in(browser, base, state.team_a_token)
    browser.get(f"{base}/ui/devices")
    alive = {r.get_attribute("data-agent"): r for r in by_css(browser, "tr.agent")}[state.alive_agent]
    by_css(alive, "a.agent-link")[0].click()
    wait_until(browser, lambda d: "/ui/devices/" in d.current_url)
    assert state.alive_agent in by_css(browser, "h1")[0].text
    assert by_css(browser, "#agent-measurements")[0].text == str(state.measured_by_alive)
    errors = {r.get_attribute("data-kind"): int(by_css(r, "td")[0].text) for r in by_css(browser, "tr.error-kind")}
    assert errors == {"run_error": 2, "run_timeout": 1}
    hours = by_css(browser, "tr.history-hour")
    assert hours and sum(int(by_css(h, ".hour-measurements")[0].text) for h in hours) == state.measured_by_alive
    assert sum(int(by_css(h, ".hour-errors")[0].text) for h in hours) == sum(errors.values())
    listed = {a["name"]: a for a in httpx.get(f"{base}/v1/devices",
                                              headers={"Authorization": f"Bearer {state.team_a_token}"}).json()}
    standing = by_css(browser, "#agent-standing")[0].text
    assert standing.startswith(listed[state.alive_agent]["standing"])
    assert f"confirmed {listed[state.alive_agent]['confirmations_agreed']}, disputed" in standing
    screenshot(browser, "device")
    # Its class's page lists the class's agents, each linked.
    by_css(browser, "a.class-link")[0].click()
    wait_until(browser, lambda d: "/ui/classes/" in d.current_url)
    assert browser.current_url.endswith(f"/ui/classes/{state.device_class}")
    agents = {r.get_attribute("data-agent") for r in by_css(browser, "tr.agent")}
    assert agents == {state.alive_agent, state.silent_agent}
    assert by_css(browser, "#agents-online")[0].text.endswith("of 2")
    screenshot(browser, "device-class")
    # The silent agent's page: nothing measured, no errors.
    silent = [r for r in by_css(browser, "tr.agent") if r.get_attribute("data-agent") == state.silent_agent][0]
    by_css(silent, "a.agent-link")[0].click()
    wait_until(browser, lambda d: by_css(d, "#no-history"))
    assert by_css(browser, "#no-errors") and by_css(browser, "#agent-measurements")[0].text == "0"
    # A job's page and the jobs list link the job's class.
    browser.get(f"{base}/ui/jobs/{state.job_a}")
    by_css(browser, "#job-class")[0].click()
    wait_until(browser, lambda d: d.current_url.endswith(f"/ui/classes/{state.device_class}"))
    browser.get(f"{base}/ui/jobs")
    link = by_css(browser, f"tr#job-{state.job_a} a.class-link")[0]
    assert link.get_attribute("href") == f"{base}/ui/classes/{state.device_class}"
    cookies = session_cookie(browser)
    assert httpx.get(f"{base}/ui/devices/999999", cookies=cookies).status_code == 404
    assert httpx.get(f"{base}/ui/classes/no-such-class", cookies=cookies).status_code == 404
    assert httpx.get(f"{base}/ui/devices/1", follow_redirects=False).status_code == 303  # no session


def every_page(state, finished) -> dict[str, str]:
    """A name and the path of each kind of page (screenshots are named after them)."""
    return {
        "login": "/ui/login", "jobs": "/ui/jobs", "job": f"/ui/jobs/{state.job_a}",
        "job-succeeded": f"/ui/jobs/{finished.job_id}", "compare": f"/ui/compare?jobs={finished.job_id},{state.job_a}",
        "devices": "/ui/devices", "device": f"/ui/devices/{finished.agent_id}",
        "device-class": f"/ui/classes/{finished.device_class}", "not-found": "/ui/jobs/999999",
    }


def test_a_phone_wide_window_needs_no_sideways_scrolling(served, finished, browser):
    """At 360 px every page fits the window: the curves scale (viewBox, width 100%; a
    page's main plot no narrower than 480 px, scrolling inside its card) and wide tables
    scroll inside their own box, not the page."""
    state, base = served
    log_in(browser, base, state.team_a_token)
    browser.set_window_size(360, 800)
    try:
        for name, path in every_page(state, finished).items():
            browser.get(base + path)
            page_width, window_width = browser.execute_script(
                "return [document.scrollingElement.scrollWidth, window.innerWidth]")
            assert window_width <= 360 and page_width <= window_width, (name, page_width, window_width)
            for box in by_css(browser, ".card.plot, .table-scroll, figure.task-curve"):  # the boxes fit
                assert box.size["width"] <= window_width, name
            for svg in by_css(browser, "figure.task-curve svg.curve"):  # small multiples scale to their box
                assert svg.size["width"] <= window_width, name
            screenshot(browser, f"{name}-360")
    finally:
        browser.set_window_size(1280, 1000)


THEAD_SCOPES = """
return [...document.querySelectorAll('th')].map(th => th.getAttribute('scope'));
"""

TEXT_COLOURS = """
const pick = '.muted, .facts dt, svg.curve .tick, svg.curve .axis, svg.curve .empty, table.data thead th';
function background(el) {
  for (; el; el = el.parentElement) {
    const c = getComputedStyle(el).backgroundColor;
    if (c && c !== 'transparent' && !c.endsWith(', 0)')) return c;
  }
  return 'rgb(255, 255, 255)';
}
return [...document.querySelectorAll(pick)].filter(el => el.textContent.trim()).map(el => {
  const style = getComputedStyle(el);
  const fg = el instanceof SVGElement ? style.fill : style.color;
  return [el.className.baseVal ?? el.className, el.textContent.trim().slice(0, 40), fg, background(el)];
});
"""


def contrast(foreground: str, background: str) -> float:
    """WCAG 2 contrast ratio of two CSS rgb() colours."""
    def luminance(css: str) -> float:
        r, g, b = (int(float(v)) / 255 for v in css[css.index("(") + 1:css.index(")")].split(",")[:3])
        lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (r, g, b)]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted((luminance(foreground), luminance(background)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_every_table_header_has_a_scope_and_muted_text_is_readable(served, finished, browser):
    """Every th says whether it heads a column or a row, and muted text (and the plots'
    ticks, the facts' labels, table headers) has at least WCAG AA's 4.5:1 contrast
    against what it is drawn on: computed from the rendered page."""
    state, base = served
    log_in(browser, base, state.team_a_token)
    checked = 0
    for name, path in every_page(state, finished).items():
        browser.get(base + path)
        scopes = browser.execute_script(THEAD_SCOPES)
        assert all(s in ("col", "row") for s in scopes), (name, scopes)
        for cls, text, fg, bg in browser.execute_script(TEXT_COLOURS):
            ratio = contrast(fg, bg)
            assert ratio >= 4.5, (name, cls, text, fg, bg, round(ratio, 2))
            checked += 1
    assert checked > 50  # the pages have muted text, facts and ticks to check
    assert contrast("rgb(95, 107, 122)", "rgb(240, 242, 245)") == pytest.approx(4.84, abs=0.01)  # .muted, worst case
    assert contrast("rgb(123, 135, 148)", "rgb(255, 255, 255)") < 4.5  # the old muted grey (3.66:1) would fail
