"""The trial's month, tested in about a second: the ``pgflow_env`` fixture (pgflow's pytest plugin,
installed with pgflow) gives each test a fresh schema, a worker in this process and a clock the test
moves. pyproject.toml here names the App (``pgflow_app = "onboarding:app"``)."""

from __future__ import annotations

import time

import pytest

from onboarding import mail_failures, outbox, trial


@pytest.fixture(autouse=True)
def empty_outbox():
    outbox.clear()
    mail_failures.clear()


def test_a_trial_nobody_upgrades_expires_after_three_weeks(pgflow_env):
    began = time.monotonic()
    mail_failures.extend(["timed out", "503"])  # the welcome mail fails twice before it goes out
    handle = trial.start("ann@example.com")

    pgflow_env.clock.advance(days=20)
    assert handle.status() == "queued"  # waiting for an upgrade, holding no worker
    assert pgflow_env.events(handle) == {"stage": "deciding"}
    assert outbox == [("ann@example.com", "welcome")]

    pgflow_env.clock.advance(days=2)
    assert handle.result(timeout=10) == "expired"
    assert outbox[-1] == ("ann@example.com", "your trial has ended")
    welcome = pgflow_env.steps(handle)[0]
    assert (welcome.name, welcome.attempts) == ("onboarding.send_mail", 3)
    assert time.monotonic() - began < 2.0  # three weeks, two retries and a timeout


def test_an_upgrade_in_the_window_is_thanked_for(pgflow_env):
    handle = trial.start("bo@example.com")
    pgflow_env.clock.advance(days=15)
    handle.send("upgrade", {"plan": "team"})
    pgflow_env.run_until_idle()
    assert handle.result(timeout=10) == "upgraded to team"
    [message] = pgflow_env.messages(handle)
    assert message.value == {"plan": "team"} and message.consumed_at is not None
    assert outbox == [("bo@example.com", "welcome"), ("bo@example.com", "welcome to the team plan")]


def test_nothing_happens_before_its_time(pgflow_env):
    handle = trial.start("cy@example.com")
    pgflow_env.clock.advance(days=13, hours=23)
    assert pgflow_env.events(handle) == {"stage": "trial"}
    handle.send("upgrade", {"plan": "solo"})  # early: kept until the trial asks for it
    pgflow_env.clock.advance(hours=1)
    assert handle.result(timeout=10) == "upgraded to solo"
