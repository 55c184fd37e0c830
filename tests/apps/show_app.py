"""Workflows for ``pgflow workflows show`` (tests/test_cli_show.py): a step that fails before it
succeeds, one that always fails, a sync step that fails, and a long result."""

from __future__ import annotations

from types import SimpleNamespace

import pgflow

app = pgflow.App()

# A retry waits between half of this and all of it (the first one): long enough that the wait, not how
# late the note of a step's first attempt commits on a loaded machine, decides how long a step took.
BACKOFF = 0.1


class Refused(Exception):
    """Defined in the app: the traceback names it, and a reader without this module sees its path."""


def build(app: pgflow.App) -> SimpleNamespace:
    @app.step(name="show.flaky", max_attempts=3, backoff=BACKOFF)
    async def flaky(n: int) -> int:
        if pgflow.step_attempt() < 3:
            raise ConnectionError(f"try {pgflow.step_attempt()} of {n} refused")
        return n * 2

    @app.step(name="show.doomed", max_attempts=2, backoff=BACKOFF)
    async def doomed(n: int) -> int:
        raise Refused(f"no for {n} (step attempt {pgflow.step_attempt()})")

    @app.step(name="show.sync_doomed")
    def sync_doomed(n: int) -> int:
        raise Refused(f"sync no for {n}")

    @app.workflow(name="show.recovers")
    async def recovers(n: int, label: str = "x") -> dict[str, object]:
        doubled = await flaky(n)
        return {"doubled": doubled, "label": label, "long": "y" * 1000}

    @app.workflow(name="show.fails")
    async def fails(n: int) -> int:
        await flaky(n)
        return await doomed(n)

    @app.workflow(name="show.fails_sync")
    def fails_sync(n: int) -> int:
        return sync_doomed(n)

    return SimpleNamespace(recovers=recovers, fails=fails, fails_sync=fails_sync)


flows = build(app)
