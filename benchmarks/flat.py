"""Cost that stays flat as the tables grow: ``python -m benchmarks flat``.

pgflow alone, three states of its tables, each in a schema of its own (database ``bench_flat``):

  empty     nothing but the measured work;
  filled    1,000,000 finished workflows and their chunks (2 each, the last one the close marker)
            already in the tables, written with INSERT ... SELECT generate_series, copies of a real
            finished workflow and its real chunks (the template, run through the API first);
  backlog   100,000 queued no-op workflows (the same copies, queued).

In each state, after ANALYZE (a table that large has statistics in production):

  claim     the claim statement's generic plan (as pgflow's connections run it), EXPLAIN ANALYZE in a
            transaction rolled back: its time, and whether it scans the whole workflows table.
  drain     N queued no-op workflows (5,000; --quick 2,000; generate_series copies of one started
            through the API) and one worker process at concurrency 16: workflows/s from the first start
            to the N-th finish, from started_at/finished_at. In the backlog state the N are the first N
            of the 100,000 (the worker is stopped after them; the rest stay queued throughout).
  streams   then streams.py's pgflow design (256 streams, 500 chunks each, or
            $BENCH_FLAT_STREAMS and $BENCH_FLAT_CHUNKS, written by one process and
            read by another) in the same schema: chunks/s, write-to-read p50/p99. Before it, the
            backlog left queued is moved to a queue no worker serves, so the streams' worker does not
            have to skip it (a worker serving only some of a queue's workflow names is another case).

Repeats interleave the states. Ratios against the empty state of the same repeat are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import harness, streams, streams_orchestrator
from benchmarks.harness import Proc, RunFailed, log

STATES = ["empty", "filled", "backlog"]
FILLED = int(os.environ.get("BENCH_FLAT_FILLED", "1000000"))
BACKLOG = int(os.environ.get("BENCH_FLAT_BACKLOG", "100000"))
# The streams part's size (streams.py's own defaults unless set; the harness's test sets them small).
STREAMS = int(os.environ.get("BENCH_FLAT_STREAMS", "256"))
CHUNKS = int(os.environ.get("BENCH_FLAT_CHUNKS", str(streams_orchestrator.DEFAULT_CHUNKS["pgflow"])))
DATABASE = os.environ.get("BENCH_DB_PREFIX", "bench_") + "flat"  # tests use a prefix of their own


def copies(conn: Any, schema: str, template: str, n: int, prefix: str, status: str, queue: str | None = None) -> None:
    """n copies of the template workflow row, ids ``prefix-<g>``, in ``status`` (finished ones an hour
    old, queued ones due in id order)."""
    cols = [r[0] for r in conn.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_schema = %s AND table_name = 'workflows'"
        " ORDER BY ordinal_position", (schema,)).fetchall()]
    finished = status == "succeeded"
    special = {
        "id": f"'{prefix}-' || g",
        "status": f"'{status}'",
        "attempt": "1" if finished else "0",
        "lease_owner": "NULL", "lease_expires_at": "NULL",
        "created_at": "now() - interval '2 hours' + g * interval '1 microsecond'",
        "due_at": "now() - interval '2 hours' + g * interval '1 microsecond'",
        "started_at": "now() - interval '1 hour'" if finished else "NULL",
        "finished_at": "now() - interval '1 hour' + g * interval '1 microsecond'" if finished else "NULL",
    }
    if queue is not None:
        special["queue"] = f"'{queue}'"
    select = ", ".join(special.get(c, f't."{c}"') for c in cols)
    conn.execute(f'INSERT INTO "{schema}".workflows ({", ".join(chr(34) + c + chr(34) for c in cols)})'
                 f' SELECT {select} FROM "{schema}".workflows t, generate_series(1, %s) g WHERE t.id = %s',
                 (n, template))


def chunk_copies(conn: Any, schema: str, template: str, prefix: str, n: int) -> None:
    conn.execute(f'INSERT INTO "{schema}".stream_ids (workflow_id, key)'
                 f" SELECT '{prefix}-' || g, i.key FROM \"{schema}\".stream_ids i, generate_series(1, %s) g"
                 " WHERE i.workflow_id = %s", (n, template))
    conn.execute(f'INSERT INTO "{schema}".chunks (stream_id, position, value)'
                 f' SELECT n.id, c.position, c.value FROM "{schema}".stream_ids t'
                 f' JOIN "{schema}".chunks c ON c.stream_id = t.id'
                 f' JOIN "{schema}".stream_ids n ON n.key = t.key AND n.workflow_id LIKE %s'
                 " WHERE t.workflow_id = %s", (f"{prefix}-%", template))


class FlatStreams(streams_orchestrator.Orchestrator):
    """streams.py's orchestrator, made to run in a schema prepared beforehand and to leave it there."""

    fixed_schema = ""

    async def spawn(self, role: str, design: str, schema: str, run: str, chunks: int,
                    profile_name: str | None = None) -> streams_orchestrator.Child:
        return await super().spawn(role, design, self.fixed_schema, run, chunks, profile_name)

    async def setup(self, design: str, schema: str) -> None:
        return None

    async def teardown(self, design: str, schema: str) -> None:
        return None


class Flat:
    def __init__(self, a: argparse.Namespace, db: str, logdir: Path) -> None:
        self.a, self.db, self.logdir = a, db, logdir
        self.tasks = a.tasks or (2000 if a.quick else 5000)

    def prepare(self, state: str, schema: str) -> dict[str, Any]:
        """Migrate the schema, run the templates through the API, fill, queue the drain's tasks."""
        import psycopg

        from benchmarks.peers import flat_app

        info: dict[str, Any] = {}
        app = flat_app.make_app(self.db, schema)

        async def templates() -> tuple[str, str]:
            await app.migrate_async()
            # The queued template waits in a queue of its own while the filler's worker runs.
            queued = await app.workflows["bench.noop"].with_options(queue="templates").start_async()
            filled = await app.workflows["bench.filler"].start_async(1)
            async with app.worker(concurrency=1):
                await app.handle(filled.id).result_async(timeout=60)
            return filled.id, queued.id

        try:
            filled_id, queued_id = asyncio.run(templates())
        finally:
            app.close()
        with psycopg.connect(self.db, autocommit=True) as conn:
            t0 = time.perf_counter()
            if state == "filled":
                copies(conn, schema, filled_id, FILLED, "fill", "succeeded")
                chunk_copies(conn, schema, filled_id, "fill", FILLED)
            n_queued = BACKLOG if state == "backlog" else self.tasks
            copies(conn, schema, queued_id, n_queued, "task", "queued", queue="default")
            conn.execute(f'DELETE FROM "{schema}".workflows WHERE id = %s', (queued_id,))
            conn.execute(f'ANALYZE "{schema}".workflows')
            conn.execute(f'ANALYZE "{schema}".stream_ids')
            conn.execute(f'ANALYZE "{schema}".chunks')
            info["fill_s"] = time.perf_counter() - t0
            info["rows"] = {t: conn.execute(f'SELECT count(*) FROM "{schema}".{t}').fetchone()[0]
                            for t in ("workflows", "streams")}
            info["size_mb"] = conn.execute(
                "SELECT sum(pg_total_relation_size(c.oid)) / 1e6 FROM pg_class c JOIN pg_namespace n"
                " ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relkind = 'r'", (schema,)).fetchone()[0]
        return info

    def explain_claim(self, schema: str) -> dict[str, Any]:
        """The claim statement's plan as pgflow's connections run it (generic plans: they set
        plan_cache_mode=force_generic_plan), executed in a transaction rolled back: its time, and
        whether it reads the whole workflows table."""
        import re

        import psycopg

        from pgflow._core.engine import claims

        # A full claim (no floor, expired leases looked for): the one whose cost grows with what the
        # table holds, if any does.
        params = {"queues": "'{default}'::text[]", "floors": "'{NULL}'::timestamptz[]",
                  "names": "'{bench.noop,bench.filler}'::text[]", "limit": "16",
                  "owner": "'probe'", "lease": "10.0", "token": "1", "commit": "'on'"}
        order = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", claims.FULL_CLAIM)))
        sql = re.sub(r"%\((\w+)\)s", lambda m: f"${order.index(m.group(1)) + 1}",
                     claims.FULL_CLAIM.replace("{s}", f'"{schema}"'))
        types = {"queues": "text[]", "floors": "timestamptz[]",
                 "names": "text[]", "limit": "int", "owner": "text", "lease": "float8",
                 "token": "int8", "commit": "text"}
        with psycopg.connect(self.db, autocommit=True) as conn:
            conn.execute("SET plan_cache_mode = force_generic_plan")
            conn.execute(f"PREPARE probe_claim({', '.join(types[k] for k in order)}) AS {sql}")
            conn.execute("BEGIN")
            plan = [r[0] for r in conn.execute(
                f"EXPLAIN (ANALYZE, BUFFERS) EXECUTE probe_claim({', '.join(params[k] for k in order)})").fetchall()]
            conn.execute("ROLLBACK")
        took = next((float(x.split(":")[1].split()[0]) for x in plan if x.startswith("Execution Time")), None)
        return {"claim_plan_ms": took, "claim_plan_seq_scan": any("Seq Scan on workflows" in x for x in plan),
                "claim_plan": plan}

    def drain(self, schema: str) -> dict[str, Any]:
        import psycopg

        n = self.tasks
        env = harness.child_env(BENCH_DSN=self.db, PGFLOW_DSN=self.db, PGFLOW_SCHEMA=schema)
        argv = [sys.executable, "-m", "pgflow", "--log-level", "WARNING", "worker", "benchmarks.peers.flat_app:app",
                "--concurrency", "16", "--grace", "0"]
        deadline = time.monotonic() + self.a.timeout
        # Progress is read through the finished_at index, so that polling costs the same however many
        # rows the table holds (a count over the table would scan the filled million every 50 ms).
        since = time.time() - 1
        finished = (f"FROM \"{schema}\".workflows WHERE finished_at >= to_timestamp(%s)"
                    " AND name = 'bench.noop' AND status = 'succeeded'")
        with psycopg.connect(self.db, autocommit=True) as conn, \
                Proc(f"flat worker {schema}", argv, env, self.logdir / f"{schema}-worker.log") as worker:
            while True:
                done = conn.execute(f"SELECT count(*) {finished}", (since,)).fetchone()[0]
                if done >= n:
                    break
                worker.check(f"{n} workflows to finish ({done} done)")
                if time.monotonic() > deadline:
                    raise RunFailed(f"deadline: {done}/{n} done")
                time.sleep(0.05)
            worker.stop()
            first, last = conn.execute(
                f"SELECT (SELECT extract(epoch FROM min(started_at)) FROM \"{schema}\".workflows"
                "          WHERE name = 'bench.noop' AND started_at >= to_timestamp(%s)),"
                f"       (SELECT extract(epoch FROM finished_at) {finished} ORDER BY finished_at OFFSET %s LIMIT 1)",
                (since, since, n - 1)).fetchone()
            # The backlog left queued goes to a queue no worker serves (see the module's docstring).
            conn.execute(f"UPDATE \"{schema}\".workflows SET queue = 'parked' WHERE status = 'queued'")
        return {"tasks_per_s": n / (float(last) - float(first)), "window_s": float(last) - float(first)}

    def streams_run(self, schema: str, repeat: int) -> dict[str, Any]:
        sa = streams.parse(["--dsn", self.db, "--designs", "pgflow", "--timeout", str(self.a.timeout),
                            "--streams", str(STREAMS), "--chunks", str(CHUNKS)])
        orch = FlatStreams(sa, self.db, self.logdir, None)
        orch.fixed_schema = schema
        record = asyncio.run(orch.stream_run("pgflow", repeat))
        if not record.get("ok"):
            raise RunFailed(f"streams: {record.get('error')}")
        return {k: record[k] for k in ("chunks_per_s", "p50_ms", "p99_ms")}

    def run(self, state: str, repeat: int) -> dict[str, Any]:
        import psycopg

        schema = f"flat_{state}_{repeat}"
        record: dict[str, Any] = {"state": state, "repeat": repeat, "tasks": self.tasks,
                                  "loadavg_before": os.getloadavg()[0]}
        try:
            with psycopg.connect(self.db, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            record.update(self.prepare(state, schema))
            record.update(self.explain_claim(schema))
            record.update(self.drain(schema))
            record.update(self.streams_run(schema, repeat))
            record["ok"] = True
        except Exception as exc:  # noqa: BLE001 - one failed run is reported, the others still run
            record.update(ok=False, error=str(exc) if isinstance(exc, RunFailed) else f"{type(exc).__name__}: {exc}")
        finally:
            with psycopg.connect(self.db, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            record["loadavg_after"] = os.getloadavg()[0]
        return record


def main(a: argparse.Namespace) -> dict[str, Any]:
    dsn = harness.resolve_dsn(a.dsn)
    info = harness.server_info(dsn)
    db = harness.recreate_database(dsn, DATABASE)
    logdir = Path(tempfile.mkdtemp(prefix="bench-flat-"))
    bench = Flat(a, db, logdir)
    log(f"flat: PostgreSQL {info['server_version']}; filled {FILLED:,}, backlog {BACKLOG:,}, drain {bench.tasks:,};"
        f" {a.repeats} repeat(s); logs in {logdir}")
    runs = []
    try:
        for repeat in range(a.repeats):
            for state in STATES:
                r = bench.run(state, repeat)
                runs.append(r)
                if r.get("ok"):
                    log(f"  [{repeat + 1}] {state:<8} drain {r['tasks_per_s']:7,.0f}/s"
                        f"  streams {r['chunks_per_s']:8,.0f} chunks/s  p50 {r['p50_ms']:6.1f} ms"
                        f"  p99 {r['p99_ms']:6.1f} ms  (fill {r['fill_s']:.0f} s,"
                        f" {r['size_mb']:.0f} MB; claim {r['claim_plan_ms']:.2f} ms"
                        f"{', seq scan' if r['claim_plan_seq_scan'] else ''};"
                        f" load {r['loadavg_before']:.1f} -> {r['loadavg_after']:.1f})")
                else:
                    log(f"  [{repeat + 1}] {state:<8} FAILED: {str(r.get('error'))[:400]}")
    finally:
        harness.drop_database(dsn, DATABASE)
    figures: dict[str, dict[str, Any]] = {}
    for state in STATES:
        ok = [r for r in runs if r["state"] == state and r.get("ok")]
        figures[state] = {k: v for k in ("tasks_per_s", "chunks_per_s", "p50_ms", "p99_ms")
                          if (v := harness.median([r[k] for r in ok])) is not None}
    ratios: dict[str, Any] = {}
    for state in STATES[1:]:
        for k in ("tasks_per_s", "chunks_per_s", "p99_ms"):
            per = [r[k] / e[k] for r in runs for e in runs if r["state"] == state and e["state"] == "empty"
                   and r["repeat"] == e["repeat"] and r.get("ok") and e.get("ok")]
            if per:
                ratios[f"{state}/{k}"] = {"per_repeat": per, "median": harness.median(per)}
    report = {"benchmark": "flat", "systems": figures, "ratios_to_empty": ratios,
              "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "server": info,
              "versions": {"pgflow_commit": harness.commit()}, "repeats": a.repeats,
              "settings": {"filled": FILLED, "backlog": BACKLOG, "tasks": bench.tasks, "concurrency": 16,
                           "streams": STREAMS, "chunks": CHUNKS},
              "runs": runs, "machine": {"cpus": os.cpu_count(), "loadavg_end": os.getloadavg()}}
    for name, r in ratios.items():
        log(f"  {name}: {r['median']:.2f}x of empty  (per repeat {', '.join(f'{v:.2f}' for v in r['per_repeat'])})")
    out = harness.save("flat", info, report, figures, a.output)
    log(f"wrote {out}")
    return report
