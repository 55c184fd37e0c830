"""A trial that runs for a month: welcome mail, two weeks of trial, a week to upgrade, then a
reminder or a thank-you. The kind of workflow nobody tests by waiting for it; see test_onboarding.py.

Run it for real with a worker: ``pgflow worker onboarding:app`` (from this directory).
"""

from __future__ import annotations

import pgflow

app = pgflow.App()

TRIAL_DAYS = 14
UPGRADE_WINDOW_DAYS = 7

# Where the mail goes in this sample: a real project calls its mail service in the step.
outbox: list[tuple[str, str]] = []
mail_failures: list[str] = []  # tests make the mail service fail: a ConnectionError per entry


@app.step(max_attempts=5, backoff=600, max_backoff=6 * 3600, retry_on=(ConnectionError,))
def send_mail(to: str, subject: str) -> str:
    """A mail service that goes down now and then: retried with backoff, ten minutes and up."""
    if mail_failures:
        raise ConnectionError(f"mail service: {mail_failures.pop(0)}")
    outbox.append((to, subject))
    return f"{subject} -> {to}"


@app.workflow(name="onboarding.trial")
async def trial(email: str) -> str:
    await send_mail(email, "welcome")
    await pgflow.set_event_async("stage", "trial")
    await pgflow.sleep_async(TRIAL_DAYS * 86400)
    await pgflow.set_event_async("stage", "deciding")
    choice = await pgflow.recv_async("upgrade", timeout=UPGRADE_WINDOW_DAYS * 86400)
    if choice is None:
        await send_mail(email, "your trial has ended")
        return "expired"
    await send_mail(email, f"welcome to the {choice['plan']} plan")
    return f"upgraded to {choice['plan']}"
