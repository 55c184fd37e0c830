"""The orchestrator side of streams.py: it starts each run's writer and reader processes, says "go", reads
their results and always stops them, with a deadline (--timeout) on every run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from benchmarks import harness, streams_sql
from benchmarks.harness import RunFailed, postgres_cpu
from benchmarks.streams_frameworks import DBOS_DATABASE

# Chunks per stream, chosen so one run of each design lasts roughly 5-15 s on a 2-core machine.
DEFAULT_CHUNKS = {"raw": 500, "naive": 100, "pgflow": 500, "pgflow-off": 500, "dbos": 20}


class Child:
    """A role subprocess: its stdout carries ``@@`` event lines, its stderr goes to a log file."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.name, self.proc, self.log = name, proc, log
        self.profiler: Any = None

    async def expect(self, event: str, deadline: float) -> dict[str, Any]:
        """The next ``event`` line's message; RunFailed if the process exits or the deadline passes first."""
        assert self.proc.stdout is not None
        while True:
            try:
                line = await asyncio.wait_for(self.proc.stdout.readline(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise RunFailed(f"timed out waiting for {self.name} to report {event!r}") from None
            if not line:
                await self.proc.wait()
                raise RunFailed(f"{self.name} exited with code {self.proc.returncode} before reporting "
                                f"{event!r}:\n{self.tail()}")
            text = line.decode(errors="replace").rstrip()
            if text.startswith("@@ "):
                message: dict[str, Any] = json.loads(text[3:])
                if message["event"] == event:
                    return message

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def stop(self) -> None:
        """Terminate (then kill) the process if it is still running."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        await asyncio.to_thread(harness.stop_profiler, self.profiler)


class Orchestrator:
    """One run at a time, each in a schema of its own (DBOS: a database of its own), dropped afterwards."""

    def __init__(self, a: argparse.Namespace, dsn: str, logdir: Path, postmaster: int | None) -> None:
        self.a, self.dsn, self.logdir, self.postmaster = a, dsn, logdir, postmaster

    async def spawn(self, role: str, design: str, schema: str, run: str, chunks: int,
                    profile_name: str | None = None) -> Child:
        a = self.a
        log = self.logdir / f"{run}-{role}.log"
        args = [sys.executable, "-m", "benchmarks.streams", "--role", role, "--design", design,
                "--dsn", self.dsn, "--schema", schema, "--run", run, "--streams", str(a.streams),
                "--chunks", str(chunks), "--timeout", str(a.timeout), "--noop-runs", str(a.noop_runs),
                "--noop-warmup", str(a.noop_warmup)]
        with open(log, "wb") as err:
            proc = await asyncio.create_subprocess_exec(
                *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err,
                cwd=str(harness.ROOT), env=harness.child_env(), limit=1 << 20)
        child = Child(f"{design} {role}", proc, log)
        if a.profile and profile_name:
            child.profiler = harness.profiler(proc.pid, Path(a.profile) / f"{profile_name}-{role}.txt")
        return child

    @contextlib.asynccontextmanager
    async def running(self, design: str, schema: str, record: dict[str, Any]) -> AsyncIterator[list[Child]]:
        """The run's children, whatever becomes of it stopped (the last started first) and its schema
        dropped; a failure is the record's error, so that the other runs go on."""
        children: list[Child] = []
        try:
            yield children
        except Exception as exc:  # noqa: BLE001 - one failed run is reported, the others still run
            record.update(ok=False, error=harness.error_text(exc))
        finally:
            for child in reversed(children):
                await child.stop()
            with contextlib.suppress(Exception):
                await self.teardown(design, schema)

    # -- the streams scenario ---------------------------------------------------------------------------

    async def stream_run(self, design: str, repeat: int) -> dict[str, Any]:
        chunks = self.a.chunks or DEFAULT_CHUNKS[design]
        run = f"{design.replace('-', '')}{repeat}x{uuid.uuid4().hex[:6]}"
        schema = f"bench_{run}"
        record: dict[str, Any] = {"design": design, "repeat": repeat, "streams": self.a.streams,
                                  "chunks_per_stream": chunks, "loadavg_before": os.getloadavg()[0]}
        deadline = time.monotonic() + self.a.timeout
        async with self.running(design, schema, record) as children:
            if design == "dbos":
                try:
                    import dbos  # noqa: F401
                except ImportError as exc:
                    raise RunFailed("DBOS Transact is not installed (pip install 'pgflow-durable[bench]'):"
                                    f" {exc}") from None
            await self.setup(design, schema)
            for role in ("writer", "reader"):
                children.append(await self.spawn(role, design, schema, run, chunks, f"{design}-{repeat}"))
                await children[-1].expect("ready", deadline)
            writer, reader = children
            record.update(await self.measure(writer, reader, chunks, deadline))
        record["loadavg_after"] = os.getloadavg()[0]
        return record

    async def measure(self, writer: Child, reader: Child, chunks: int, deadline: float) -> dict[str, Any]:
        """Say "go" to the writer and gather both results, with the server's CPU in between."""
        pg0 = postgres_cpu(self.postmaster)
        writer.send("go")
        w = await writer.expect("result", deadline)
        r = await reader.expect("result", deadline)
        pg1 = postgres_cpu(self.postmaster)
        total = r["last_end"] - w["first_write"]
        out = {"ok": not r["errors"] and r["chunks_read"] == self.a.streams * chunks,
               "chunks_per_s": w["chunks_per_s"], "write_seconds": w["write_seconds"],
               "p50_ms": r["latency"]["p50_ms"], "p99_ms": r["latency"]["p99_ms"],
               "completion_s": total, "writer": w, "reader": r,
               "postgres_cpu_share": None if pg0 is None or pg1 is None else (pg1 - pg0) / total}
        if r["errors"]:
            out["error"] = "; ".join(r["errors"][:5])
        return out

    async def setup(self, design: str, schema: str) -> None:
        if design in ("naive", "raw"):
            await streams_sql.setup(self.dsn, schema)
        elif design == "dbos":
            await asyncio.to_thread(harness.drop_database, self.dsn, DBOS_DATABASE)

    async def teardown(self, design: str, schema: str) -> None:
        if design == "dbos":
            await asyncio.to_thread(harness.drop_database, self.dsn, DBOS_DATABASE)
        else:
            await asyncio.to_thread(harness.drop_schema, self.dsn, schema)

    # -- the no-op latency scenario ---------------------------------------------------------------------

    async def noop_run(self) -> dict[str, Any]:
        run = f"noop{uuid.uuid4().hex[:6]}"
        schema = f"bench_{run}"
        deadline = time.monotonic() + self.a.timeout
        record: dict[str, Any] = {"runs": self.a.noop_runs, "warmup": self.a.noop_warmup}
        async with self.running("pgflow", schema, record) as children:
            worker = await self.spawn("noop-worker", "pgflow", schema, run, 0, "noop")
            children.append(worker)
            await worker.expect("ready", deadline)
            await asyncio.sleep(0.5)
            caller = await self.spawn("noop-caller", "pgflow", schema, run, 0, "noop")
            children.append(caller)
            result = await caller.expect("result", deadline)
            record.update(ok=True, **result["latency"])
            worker.send("stop")
        return record
