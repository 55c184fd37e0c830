"""The examples, each run as its users run it (one command, a real process) against the test's
database and schema through PGFLOW_DSN / PGFLOW_SCHEMA, bounded by a flag or an environment knob.

The web example's page is tested in a browser by tests/test_web_browser.py; here its HTTP surface is
tested with a plain client, so it is covered on machines without a browser too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from xml.etree import ElementTree

import pytest

import pgflow

from .helpers import ONE_SERVER
from .processes import Processes, wait_until
from .web import post, read_events, start_web

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


# -- fan-out / fan-in ---------------------------------------------------------------------------------


@ONE_SERVER  # an example as its users run it; what it calls is tested on both servers by its own tests
def test_fanout_gathers_one_child_per_section_each_retried(procs: Processes, worker_env: dict[str, str],
                                                         app: pgflow.App) -> None:
    run = procs.start("fanout", [str(EXAMPLES / "fanout.py")], worker_env)
    assert run.wait_exit(timeout=180) == 0, procs.logs()

    [parent] = app.list_workflows(name="fanout.document")
    report = app.handle(parent.id).result(timeout=5)
    document = (EXAMPLES / "data" / "crash-recovery.md").read_text()
    assert report["sections"] == document.count("\n## ") and report["sections"] >= 3
    children = app.list_workflows(name="fanout.section")
    assert sorted(c.id for c in children) == sorted(report["children"])
    assert all(c.status == "succeeded" for c in children)
    assert all(c.id.startswith(f"{parent.id}.") for c in children)  # derived from the parent's id
    words = 0
    for child in children:
        [step] = app.handle(child.id).steps()
        assert (step.name, step.attempts, step.error_type) == ("fanout.index", 2, None)  # failed once, retried
        words += sum(app.handle(child.id).result(timeout=5).values())
    assert report["words"] == words
    assert "2 attempts" in run.output()


# -- testing_sample: pgflow's pytest plugin from a project of its own -------------------------------------


@ONE_SERVER  # an example as its users run it; what it calls is tested on both servers by its own tests
def test_the_testing_sample_runs_its_month_through_the_plugin(dsn: str, tmp_path: Path) -> None:
    """The sample's own tests, run by pytest in a process of their own from the sample's directory, as
    its users run them: the plugin comes from pgflow's entry point (nothing here loads it), the App from
    the sample's pytest configuration, the server from PGFLOW_TEST_DSN."""
    sample = EXAMPLES / "testing_sample"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PGFLOW_", "PYTEST_"))}
    env["PGFLOW_TEST_DSN"] = dsn
    report = tmp_path / "report.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
                          cwd=sample, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout, done.stdout
    suite = ElementTree.parse(report).getroot().find("testsuite")
    assert suite is not None
    # Each passed (the first asserts its three weeks took under 2 s of wall time) and none was skipped.
    cases = {case.get("name"): [child.tag for child in case] for case in suite.iter("testcase")}
    assert cases == {"test_a_trial_nobody_upgrades_expires_after_three_weeks": [],
                     "test_an_upgrade_in_the_window_is_thanked_for": [], "test_nothing_happens_before_its_time": []}


# -- periodic -----------------------------------------------------------------------------------------


@ONE_SERVER  # an example as its users run it; what it calls is tested on both servers by its own tests
def test_periodic_runs_on_its_schedule_with_a_durable_sleep(procs: Processes, worker_env: dict[str, str],
                                                            app: pgflow.App) -> None:
    # Every second; a sleep past the App's suspend_after (5 s), so each run gives its slot back meanwhile.
    env = {**worker_env, "PERIODIC_SCHEDULE": "* * * * * *", "PERIODIC_SLEEP": "6"}
    run = procs.start("periodic", [str(EXAMPLES / "periodic.py"), "--runs", "2"], env)
    assert run.wait_exit(timeout=120) == 0, procs.logs()

    done = app.list_workflows(name="periodic.report", status="succeeded")
    assert len(done) >= 2, procs.logs()
    for record in done:
        result = app.handle(record.id).result(timeout=5)
        assert record.id == f"periodic.report@{result['tick']}"  # one id per tick: one run per tick
        assert result["published_at"] - result["collected_at"] >= 6.0  # the sleep happened between the steps
    assert run.output().count("published") >= 2


# -- the web example over plain HTTP ------------------------------------------------------------------


@ONE_SERVER  # an example as its users run it; what it calls is tested on both servers by its own tests
def test_web_sse_resumes_from_last_event_id_and_the_first_decision_wins(
        procs: Processes, worker_env: dict[str, str], app: pgflow.App) -> None:
    base, web = start_web(procs, worker_env, "--cut-after", "5")
    with urllib.request.urlopen(post(f"{base}/start", form="prompt=why+journal"), timeout=30) as page:
        run = page.url.rsplit("/", 1)[1]  # redirected to /runs/<id>
        assert run in page.read().decode()
    handle = app.handle(run)

    received: list[tuple[int, str]] = []
    connections, ended = 0, False
    while not ended:
        messages, ended = read_events(f"{base}/runs/{run}/tokens", str(received[-1][0]) if received else None)
        assert len(messages) <= 5  # the --cut-after knob
        received += messages
        connections += 1
        assert connections < 100, received
    expected = list(handle.stream("tokens"))  # what the workflow committed
    assert expected[:4] == ["You", "asked:", "why", "journal"] and len(expected) > 40
    assert [word for _, word in received] == expected  # every word once, in order, across the reconnections
    assert [position for position, _ in received] == list(range(len(expected)))
    assert connections > len(expected) // 5
    assert "from position 5 (Last-Event-ID '4')" in web.output()
    # A reader that asks again for the middle of the stream gets the rest, from the next position.
    assert read_events(f"{base}/runs/{run}/tokens", "9")[0][:1] == [(10, expected[10])]

    assert handle.get_event("stage", timeout=60) == "awaiting approval"
    wait_until(lambda: handle.status() == "queued", "the workflow to give its slot back", procs, web)
    with urllib.request.urlopen(f"{base}/runs/{run}/state", timeout=30) as response:
        state = json.load(response)
    # The events the workflow set; its long wait for a message gave its worker slot back ("queued").
    assert state == {"status": "queued", "progress": 1.0, "stage": "awaiting approval"}
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{base}/runs/no-such-run/tokens", timeout=30)
    assert refused.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(post(f"{base}/runs/{run}/approval", {"approved": "yes"}), timeout=30)
    assert refused.value.code == 400  # and nothing was sent: the decision below is the first
    # The wait outlives the server: stop it, start another, and the decision still gets through.
    web.signal(signal.SIGTERM)
    web.wait_exit()
    start_web(procs, worker_env, port=int(base.rsplit(":", 1)[1]), name="web-restarted")
    for approved in (False, True):  # the second decision carries the same idempotency key: dropped
        with urllib.request.urlopen(post(f"{base}/runs/{run}/approval", {"approved": approved}), timeout=30):
            pass
    assert handle.result(timeout=60) == {"decision": "rejected", "words": len(expected)}
    with urllib.request.urlopen(f"{base}/runs/{run}/state", timeout=30) as response:
        assert json.load(response)["result"]["decision"] == "rejected"
