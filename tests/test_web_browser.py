"""The web example (examples/web/) in a real headless Chromium, driven by Playwright.

The browser is Debian's ``chromium`` package (``apt-get install -y chromium``; .ci/run installs it),
launched through Playwright's ``executable_path``: Playwright's own browser downloads are never used.
Without the package or without the ``playwright`` module the test is skipped, saying which is missing.

Set PGFLOW_SCREENSHOT=examples/web/screenshot.png (``make screenshot``) to keep the final screenshot.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

import pgflow

from .helpers import ONE_SERVER
from .processes import Processes
from .web import CHROMIUM, CHROMIUM_ARGS, start_web

pytestmark = pytest.mark.slow

CUT_AFTER = 7  # the server ends each SSE response after this many events: the page must resume
WAIT_MS = 90_000  # the bound of every wait in the page


@ONE_SERVER  # what a browser shows and does: the same on any server
def test_page_streams_resumes_after_cuts_and_approval_finishes_the_workflow(
        procs: Processes, worker_env: dict[str, str], app: pgflow.App, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'")
    if not CHROMIUM.exists():
        pytest.skip(f"no browser: {CHROMIUM} is missing (on Debian: apt-get install -y chromium)")
    args = ("--cut-after", str(CUT_AFTER))
    base, web = start_web(procs, worker_env, *args, delay=0.1)
    port = int(base.rsplit(":", 1)[1])

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 900, "height": 640})
            page.set_default_timeout(WAIT_MS)
            page.goto(base)
            page.fill("input[name=prompt]", "Why keep a journal?")
            page.click("button[type=submit]")
            page.wait_for_url("**/runs/*")
            handle = app.handle(page.url.rsplit("/", 1)[1])

            # Words show up while the workflow is still writing them.
            page.wait_for_function("document.querySelectorAll('#tokens span').length >= 3")
            early = page.locator("#tokens span").count()
            assert page.get_attribute("#tokens", "data-done") is None

            # Restart the server mid-stream: the page reconnects to the new process, whose worker picks
            # up the workflow that the old one gave back when it stopped.
            page.wait_for_function(f"document.querySelectorAll('#tokens span').length >= {3 * CUT_AFTER + 3}")
            web.signal(signal.SIGTERM)
            web.wait_exit()
            _, restarted = start_web(procs, worker_env, *args, port=port, name="web-restarted", delay=0.1)

            page.wait_for_selector("#tokens[data-done=true]", state="attached")
            expected = list(handle.stream("tokens"))  # what the workflow committed, from the database
            assert len(expected) > 4 * CUT_AFTER and early < len(expected)
            shown = page.eval_on_selector_all(
                "#tokens span", "spans => spans.map(s => [Number(s.dataset.pos), s.textContent])")
            # Every word once, in order, though the connection was cut every CUT_AFTER events and the
            # server restarted.
            assert [word for _, word in shown] == expected
            assert [position for position, _ in shown] == list(range(len(expected)))
            connections = int(page.get_attribute("#tokens", "data-connections") or 0)
            assert connections > len(expected) // CUT_AFTER
            assert f"from position {CUT_AFTER} (Last-Event-ID '{CUT_AFTER - 1}')" in web.output()
            assert "(Last-Event-ID '" in restarted.output()  # the new server resumed the page's stream

            # Progress and stage are events the workflow set; it now waits for a human, holding no slot.
            page.wait_for_function("document.getElementById('progress').value === 1")
            page.wait_for_function("document.getElementById('status').textContent === 'queued, awaiting approval'")
            assert handle.status() == "queued"
            page.click("#approve")
            page.wait_for_selector("#status[data-final=true]", state="attached")
            assert page.inner_text("#status") == "succeeded: approved"
            assert handle.result(timeout=30) == {"decision": "approved", "words": len(expected)}
            page.screenshot(path=str(tmp_path / "screenshot.png"), full_page=True)
        finally:
            browser.close()
    keep = os.environ.get("PGFLOW_SCREENSHOT")
    if keep:
        shutil.copyfile(tmp_path / "screenshot.png", keep)
