"""What every scenario of fleet.py does around its measurement: a fresh schema and App, the worker
processes it starts, a deadline, and whatever becomes of the run, its workers stopped and its schema
dropped, a failure kept as the run's error so that the other runs go on."""

from __future__ import annotations

import argparse
import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import pgflow
from benchmarks import harness
from benchmarks.fleet_app import make_app
from benchmarks.fleet_workers import Worker, wait_for_quiet


@dataclass
class Run:
    """One scenario run: its record (what the results file keeps), schema, App and workers."""

    bench: Bench
    name: str
    record: dict[str, Any]
    deadline: float
    app: pgflow.App
    workers: list[Worker] = field(default_factory=list)

    @property
    def schema(self) -> str:
        return f"fleet_{self.name}"

    def worker(self, name: str, args: list[str], profile: bool = False) -> Worker:
        """Start a worker process of this run (stopped at its end), its log in the benchmark's logdir."""
        b = self.bench
        out = Path(b.a.profile) / f"{self.name}-{name}.txt" if b.a.profile and profile else None
        env = harness.child_env(PGFLOW_DSN=b.dsn, PGFLOW_SCHEMA=self.schema,
                                PGFLOW_LOG_LEVEL=os.environ.get("PGFLOW_LOG_LEVEL", "INFO"),
                                FLEET_POOL_SIZE=str(b.a.pool_size))
        worker = Worker(f"{self.name} {name}", args, env, b.logdir / f"{self.name}-{name}.log", out)
        self.workers.append(worker)
        return worker

    def check_deadline(self, what: str) -> None:
        if time.monotonic() > self.deadline:
            raise harness.RunFailed(f"timed out waiting for {what}")

    def wait_registered(self, conn: Any, worker: Worker) -> None:
        """Wait until ``worker`` is in the workers table (its claim loop is up)."""
        while not conn.execute(f'SELECT 1 FROM "{self.schema}".workers WHERE pid = %s', (worker.pid,)).fetchone():
            worker.check("the worker to register")
            self.check_deadline(f"{worker.name} to register")
            time.sleep(0.05)


class Cpu(NamedTuple):
    """CPU seconds so far: the workers', the server's (None when it is not on this machine), this
    process's, and the machine's, busy and stolen by the hypervisor."""

    workers: float
    server: float | None
    me: float
    busy: float
    stolen: float

    def shares(self, before: Cpu, span: float) -> dict[str, float | None]:
        """CPU per wall second of ``span`` since ``before``; "other" is everything else on the machine
        (another benchmark, a test suite...; a server shared with them counts its work for them as its own)."""
        workers, me, busy = self.workers - before.workers, self.me - before.me, self.busy - before.busy
        pg = None if self.server is None or before.server is None else self.server - before.server
        return {"worker_cpu_share": workers / span, "postgres_cpu_share": None if pg is None else pg / span,
                "orchestrator_cpu_share": me / span, "machine_cpu_share": busy / span,
                "steal_share": (self.stolen - before.stolen) / span,
                "other_cpu_share": (busy - workers - me - (pg or 0.0)) / span}


class Bench:
    def __init__(self, a: argparse.Namespace, dsn: str, logdir: Path, postmaster: int | None) -> None:
        self.a, self.dsn, self.logdir, self.postmaster = a, dsn, logdir, postmaster

    def probe(self) -> Any:
        """A connection of this process's own, outside pgflow, to watch the rows."""
        import psycopg

        return psycopg.connect(self.dsn, autocommit=True)

    def cpu(self, *workers: Worker) -> Cpu:
        busy, _, stolen = harness.machine_cpu()
        return Cpu(sum(w.cpu() for w in workers), harness.postgres_cpu(self.postmaster), harness.self_cpu(),
                   busy, stolen)

    @contextlib.contextmanager
    def run(self, scenario: str, name: str, **fields: Any) -> Iterator[Run]:
        """A run of ``scenario``, started once the machine is quiet; afterwards, whatever became of it, its
        workers stopped (the last started first; their logs kept in the record when it failed), its App
        closed and its schema dropped."""
        record: dict[str, Any] = {"scenario": scenario, **fields, "loadavg_before": os.getloadavg()[0],
                                  "busy_before": wait_for_quiet(self.a.quiet_wait)}
        name = f"{name}x{uuid.uuid4().hex[:6]}"
        run = Run(self, name, record, time.monotonic() + self.a.timeout, make_app(self.dsn, f"fleet_{name}"))
        try:
            yield run
        except Exception as exc:  # noqa: BLE001 - one failed run is reported, the others still run
            record.update(ok=False, error=harness.error_text(exc))
        finally:
            for w in reversed(run.workers):
                w.stop()
                if not record.get("ok"):
                    record.setdefault("worker_logs", {})[w.name] = w.tail()
            run.app.close()
            harness.drop_schema(self.dsn, run.schema)
            record["loadavg_after"] = os.getloadavg()[0]
