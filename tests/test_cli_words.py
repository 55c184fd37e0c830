"""The words agree: what the worker's log calls an attempt is what ``pgflow.attempt()``, the records and
``pgflow workflows show`` call one (claims after a durable sleep are no new attempt; a run a stop cut
short is), and ``pgflow psql --json`` does what it says."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import anyio
import msgspec
import psycopg
import pytest

import pgflow

ROOT = Path(__file__).resolve().parent.parent
WAIT = 60.0


@pytest.mark.anyio
async def test_the_log_counts_attempts_as_pgflow_attempt_does(dsn: str, schema: str,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    seen: list[tuple[str, int]] = []
    cut_short = anyio.Event()

    async with pgflow.App(dsn, schema=schema, poll_interval=0.5, suspend_after=0.2) as app:
        @app.step(name="words.flaky", max_attempts=2, backoff=0.01)
        async def flaky() -> int:
            if pgflow.step_attempt() == 1:
                raise ConnectionError("first try")
            return 1

        @app.workflow(name="words.sleeper")
        async def sleeper() -> int:
            seen.append(("sleeper", pgflow.attempt()))
            await pgflow.sleep_async(0.5)  # past suspend_after: the slot is given back, the row claimed again
            seen.append(("sleeper", pgflow.attempt()))
            await pgflow.sleep_async(0.5)
            return await flaky()

        @app.workflow(name="words.interrupted")
        async def interrupted() -> int:
            seen.append(("interrupted", pgflow.attempt()))
            if pgflow.attempt() == 1:
                cut_short.set()
                await anyio.sleep_forever()  # until its worker stops under it
            return pgflow.attempt()

        with caplog.at_level(logging.INFO, logger="pgflow"):
            async with app.worker(concurrency=2):
                sleeping = await sleeper.start_async()
                stopped = await interrupted.start_async()
                with anyio.fail_after(WAIT):
                    assert await sleeping.result_async() == 1
                    await cut_short.wait()
            async with app.worker(concurrency=2):
                with anyio.fail_after(WAIT):
                    assert await stopped.result_async() == 2

        with psycopg.connect(dsn) as conn:
            claims = conn.execute(f'SELECT attempt FROM "{schema}".workflows WHERE id = %s',
                                  (sleeping.id,)).fetchone()
        assert claims is not None and claims[0] >= 3  # claimed three times: first, and after each sleep
        # Its body ran once per claim (replaying the sleeps), always as attempt 1.
        ran = [a for name, a in seen if name == "sleeper"]
        assert len(ran) >= 4 and set(ran) == {1}, ran
        assert [a for name, a in seen if name == "interrupted"] == [1, 2]
        for handle, attempt in ((sleeping, 1), (stopped, 2)):
            assert (await handle.info_async()).record.attempt == attempt
            assert (await app.workflow_details_async(handle.id)).attempt == attempt

    lines = [r.getMessage() for r in caplog.records if r.name.startswith("pgflow")]
    [end] = [m for m in lines if m.startswith(f"workflow words.sleeper {sleeping.id} succeeded in ")]
    assert end.endswith("(attempt 1)"), end
    [end] = [m for m in lines if m.startswith(f"workflow words.interrupted {stopped.id} succeeded in ")]
    assert end.endswith("(attempt 2)"), end
    [retry] = [m for m in lines if m.startswith("step words.flaky of ")]
    assert "step attempt 1 of workflow attempt 1; retrying in" in retry, retry
    assert not any(f"attempt {n}" in m for m in lines if sleeping.id in m for n in (2, 3, 4)), lines


def test_psql_json_prints_where_to_connect_and_opens_no_psql(tmp_path: Path) -> None:
    password, dsn = "s3cret-Pa55", "postgresql://alice:s3cret-Pa55@db.invalid:6543/orders"
    bin_dir, record = tmp_path / "bin", tmp_path / "ran"
    bin_dir.mkdir()
    (bin_dir / "psql").write_text(f"#!/bin/sh\ntouch {record}\n")
    (bin_dir / "psql").chmod(0o755)
    env = {**os.environ, "PGFLOW_DSN": dsn, "PGFLOW_SCHEMA": "orders_flow",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

    def psql(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pgflow", "psql", *args], env=env, capture_output=True,
                              text=True, timeout=WAIT)

    shown = psql("--json")
    assert shown.returncode == 0, shown.stderr
    assert msgspec.json.decode(shown.stdout) == {"dsn": "postgresql://alice:***@db.invalid:6543/orders",
                                                 "schema": "orders_flow", "search_path": "orders_flow,public"}
    assert password not in shown.stdout + shown.stderr and not record.exists()
    assert msgspec.json.decode(psql("--json", "--show-password").stdout)["dsn"] == dsn
    assert not record.exists()
