"""The workflows of the per-key limit tests (tests/test_key_limits.py), served by worker processes.

One step records each run of a workflow in the test's ``probe`` table (the tenant, the worker's pid, when
it began and ended), so the test reads, from the rows alone, how many of one key ran at once and in which
processes. It holds still until the gate file the test passes exists (none: no wait), then for ``hold``
seconds: the work whose overlap the limits bound.

A worker process serves ``app`` (configured from PGFLOW_DSN and PGFLOW_SCHEMA); the test process calls
``build`` on its own App, so that both register the same names and declare the same queue limits.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import psycopg

import pgflow

TENANTS = "tenants"  # at most KEY_CONCURRENCY of a tenant's workflows at once
KEY_CONCURRENCY = 2
CAPPED = "capped"  # at most KEY_CONCURRENCY of its workflows at once, whatever their key (the queue's own limit)
GATE_POLL = 0.05  # seconds between looks at the gate file
GATE_LIMIT = 180.0  # seconds the step waits for its gate before giving up (a test that died)

PROBE = ("CREATE TABLE {table} (n serial PRIMARY KEY, workflow text NOT NULL, tenant text NOT NULL,"
         " pid int NOT NULL, started timestamptz NOT NULL, ended timestamptz)")


def build(app: pgflow.App) -> SimpleNamespace:
    app.queue(TENANTS, key_concurrency=KEY_CONCURRENCY)
    app.queue(CAPPED, concurrency=KEY_CONCURRENCY)
    probe = f'"{app.schema}".probe'

    @app.step
    def occupy(workflow: str, tenant: str, gate: str, hold: float) -> int:
        """One run of a tenant's work, recorded as it begins and as it ends; the pid that ran it."""
        with psycopg.connect(app.dsn, autocommit=True) as conn:
            row = conn.execute(f"INSERT INTO {probe} (workflow, tenant, pid, started)"
                               " VALUES (%s, %s, %s, clock_timestamp()) RETURNING n",
                               (workflow, tenant, os.getpid())).fetchone()
            deadline = time.monotonic() + GATE_LIMIT
            while gate and not Path(gate).exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no gate file {gate} after {GATE_LIMIT}s")
                time.sleep(GATE_POLL)
            time.sleep(hold)  # (the work itself, whose overlap the test measures)
            conn.execute(f"UPDATE {probe} SET ended = clock_timestamp() WHERE n = %s", (row[0] if row else 0,))
        return os.getpid()

    @app.workflow(queue=TENANTS, key=lambda tenant, gate, hold: tenant)
    async def tenant_work(tenant: str, gate: str, hold: float) -> int:
        return await occupy(pgflow.workflow_id(), tenant, gate, hold)

    @app.workflow(queue=CAPPED)
    async def capped_work(tenant: str, gate: str, hold: float) -> int:
        return await occupy(pgflow.workflow_id(), tenant, gate, hold)

    return SimpleNamespace(occupy=occupy, tenant_work=tenant_work, capped_work=capped_work, probe=probe)


app = pgflow.App()  # env-configured; connects lazily, so only a worker process serving it connects
flows = build(app)
