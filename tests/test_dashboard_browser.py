"""``pgflow dashboard`` in a real headless Chromium, driven by Playwright, against a ``pgflow worker``
process: what an operator sees and does, from signing in to cancelling and resuming.

The browser is Debian's ``chromium`` package (``apt-get install -y chromium``; .ci/run installs it),
launched through Playwright's ``executable_path``, as tests/test_web_browser.py does: Playwright's
own browser downloads are never used. Without the package or the ``playwright`` module the test is
skipped, saying which is missing.

Set PGFLOW_DASHBOARD_SCREENSHOTS=docs/dashboard (``make dashboard-screenshots``) to keep the
screenshots of each page there.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

import pgflow

from .helpers import ONE_SERVER
from .processes import Processes, wait_until
from .web import CHROMIUM, CHROMIUM_ARGS, free_port, listening

pytestmark = pytest.mark.slow

TOKEN = "a-dashboard-token-for-the-browser-test"
WAIT_MS = 90_000
CHUNKS = 60


def until(page: Any, script: str, timeout: float = WAIT_MS / 1000) -> None:
    """Wait until ``script`` is true in the page. (Playwright's wait_for_function evaluates a string
    in the page, which the dashboard's Content-Security-Policy forbids; an evaluation over the
    DevTools protocol is not the page's own script.)"""
    from playwright.sync_api import Error

    deadline = time.monotonic() + timeout
    while True:
        try:
            if page.evaluate(script):
                return
        except Error as exc:  # the page reloads itself when a new stream shows up
            if "context was destroyed" not in str(exc):
                raise
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {script}")
        time.sleep(0.1)


@ONE_SERVER  # what a browser shows and does: the same on any server
def test_an_operator_signs_in_watches_a_stream_reads_a_failure_cancels_and_resumes(
        procs: Processes, worker_env: dict[str, str], app: pgflow.App, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'")
    if not CHROMIUM.exists():
        pytest.skip(f"no browser: {CHROMIUM} is missing (on Debian: apt-get install -y chromium)")
    app.migrate()
    worker = procs.worker("worker", "tests.apps.dashboard:app", worker_env, concurrency=8)
    port = free_port()
    dashboard = procs.start("dashboard", ["-m", "pgflow", "dashboard", "--port", str(port), "--allow-actions"],
                            {**worker_env, "PGFLOW_DASHBOARD_TOKEN": TOKEN})
    wait_until(lambda: listening(port), "the dashboard to listen", procs, dashboard)
    wait_until(lambda: app.workers_info(), "the worker to register", procs, worker)
    base = f"http://127.0.0.1:{port}"
    shots = tmp_path / "shots"
    shots.mkdir()

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            # Without the token the page is refused: a 401 with the sign-in form, nothing else.
            stranger = browser.new_context()
            refused = stranger.new_page().goto(base)
            assert refused is not None and refused.status == 401
            assert "Queues" not in refused.text() and 'name="token"' in refused.text()
            stranger.close()

            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(WAIT_MS)
            refusals: list[str] = []  # what the Content-Security-Policy refused: nothing, or the page broke
            page.on("console", lambda m: refusals.append(m.text) if "Content Security Policy" in m.text else None)
            page.goto(base)
            page.fill("input[name=token]", TOKEN)
            page.click("form.login button[type=submit]")
            page.wait_for_selector("#workers")

            # The overview lists the running worker, live.
            until(page, f"document.querySelector('#workers').textContent.includes('pid {worker.pid}')")
            assert "live" in page.inner_text("#workers")

            # A workflow's page: its steps, and its stream growing while the worker writes it.
            writer = app.start_by_name("dash.writer", CHUNKS, 0.15)
            page.goto(f"{base}/workflow?id={writer.id}")
            until(page, "document.querySelectorAll('.stream li').length >= 3")
            seen = page.locator(".stream li").count()
            assert writer.status() == "running"
            until(page, f"document.querySelectorAll('.stream li').length >= {seen + 5}")
            assert "pgflow.set_event:stage" in page.inner_text("#steps")
            page.wait_for_selector(".stream[data-done=true]", state="attached")
            shown = page.eval_on_selector_all(".stream li", "items => items.map(i => i.textContent)")
            assert shown == list(writer.stream("out")) == [f"line {i}" for i in range(CHUNKS)]
            assert writer.result(timeout=60) == CHUNKS
            until(page, "document.getElementById('state')?.dataset.status === 'succeeded'")
            assert "dash.write" in page.inner_text("#steps")
            page.screenshot(path=str(shots / "workflow.png"), full_page=True)

            # A failed workflow's page: its message and traceback.
            failed = app.start_by_name("dash.fails", "the disk is full <b>really</b>")
            with pytest.raises(pgflow.WorkflowFailed):
                failed.result(timeout=60)
            page.goto(f"{base}/workflow?id={failed.id}")
            error = page.inner_text("#error")
            assert "ValueError: the disk is full <b>really</b>" in error
            assert "Traceback (most recent call last)" in error and "raise ValueError(message)" in error
            page.screenshot(path=str(shots / "failed.png"), full_page=True)

            # Cancel stops a running workflow, after a confirmation.
            running = app.start_by_name("dash.runs_long", 300.0)
            wait_until(lambda: running.status() == "running", "the long one to run", procs, worker)
            page.goto(f"{base}/workflow?id={running.id}")
            page.click("#action-cancel")
            page.wait_for_selector("#confirm")
            page.screenshot(path=str(shots / "confirm.png"))
            page.click("#confirm")
            until(page, "document.getElementById('state')?.dataset.status === 'cancelled'")
            with pytest.raises(pgflow.WorkflowCancelled):
                running.result(timeout=60)

            # Resume re-runs a failed one.
            marker = tmp_path / "ready"
            waiting = app.start_by_name("dash.until_file", str(marker))
            with pytest.raises(pgflow.WorkflowFailed):
                waiting.result(timeout=60)
            marker.write_text("now")
            page.goto(f"{base}/workflow?id={waiting.id}")
            assert "FileNotFoundError" in page.inner_text("#error")
            page.click("#action-resume")
            page.click("#confirm")
            until(page, "document.getElementById('state')?.dataset.status === 'succeeded'")
            assert waiting.result(timeout=60) == "found"

            parent = app.start_by_name("dash.parent", 4)
            assert parent.result(timeout=60) == 14
            page.goto(f"{base}/workflows")
            page.wait_for_selector("#workflows")
            page.screenshot(path=str(shots / "workflows.png"), full_page=True)
            busy = app.start_by_name("dash.runs_long", 300.0)
            wait_until(lambda: busy.status() == "running", "a workflow to run for the overview", procs, worker)
            page.goto(base)
            until(page, "document.querySelector('table#queues') !== null"
                        " && document.querySelector('#workers').textContent.includes('dash.runs_long')")
            page.screenshot(path=str(shots / "overview.png"), full_page=True)
            assert refusals == []
        finally:
            browser.close()
    keep = os.environ.get("PGFLOW_DASHBOARD_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for shot in shots.iterdir():
            shutil.copyfile(shot, Path(keep) / shot.name)
