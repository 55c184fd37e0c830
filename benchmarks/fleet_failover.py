"""fleet.py's failover scenario: worker A runs a workflow that never stops, idle worker B waits, A is
SIGKILLed at a random point of its heartbeat cycle, and the time until B carries on is measured from the
kill: B's claim (a 10 ms poll of the row's attempt), B's first new step record (now() of its insert) and
B's first new chunk (the time.time() it carries)."""

from __future__ import annotations

import random
import time
from typing import Any

from benchmarks.fleet_app import DEFAULT_POLL, STEP_SLEEP, STREAM_KEY
from benchmarks.fleet_bench import Bench, Run
from benchmarks.fleet_workers import Worker
from benchmarks.harness import RunFailed
from pgflow._core import codec


def failover(bench: Bench, lease: float, repeat: int) -> dict[str, Any]:
    with bench.run("failover", f"fo{int(lease)}r{repeat}", lease=lease, repeat=repeat,
                   poll_interval=DEFAULT_POLL, step_s=STEP_SLEEP) as run:
        run.app.migrate()
        wid = f"ticker-{run.name}"
        with bench.probe() as conn:
            worker_a, worker_b = start_pair(run, conn, wid, lease)
            kill = kill_holder(run, conn, wid, worker_a, worker_b)
            seen = takeover(run, conn, wid, worker_b, lease, kill["chunks_before_kill"])
        t_kill, expires = kill.pop("t_kill"), kill.pop("expires")
        run.record.update(
            ok=seen["step_pid"] == worker_b.pid and seen["chunk_pid"] == worker_b.pid, **kill,
            lease_left_at_kill_s=expires - t_kill,
            kill_to_claim_s=seen["claim"] - t_kill,  # seen by a 10 ms poll
            kill_to_first_step_s=seen["step"] - t_kill, kill_to_first_chunk_s=seen["chunk"] - t_kill,
            expiry_to_claim_s=seen["claim"] - expires,  # B's wait for its poll: 0 .. poll_interval
            bound_s=lease + DEFAULT_POLL)
        if not run.record["ok"]:
            run.record["error"] = (f"new records by pid {seen['step_pid']}/{seen['chunk_pid']}, expected B"
                                   f" {worker_b.pid}")
    return run.record


def steps_by(conn: Any, schema: str, wid: str, attempt: int) -> int:
    return int(conn.execute(f'SELECT count(*) FROM "{schema}".steps WHERE workflow_id = %s AND attempt = %s',
                            (wid, attempt)).fetchone()[0])


def start_pair(run: Run, conn: Any, wid: str, lease: float) -> tuple[Worker, Worker]:
    """Worker A, running the workflow (ten steps in), and worker B, registered and idle."""
    args = ["--concurrency", "4", "--lease", str(lease), "--grace", "0"]
    worker_a = run.worker("A", args)
    run.wait_registered(conn, worker_a)
    run.app.workflows["fleet.ticker"].with_options(id=wid).start(10_000_000)
    run.app.close()  # not a listener of the chunks' pings: only the workers are
    while steps_by(conn, run.schema, wid, 1) < 10:  # A claimed it (attempt 1) and is stepping
        worker_a.check("worker A to run the workflow")
        run.check_deadline("worker A to run the workflow")
        time.sleep(0.05)
    # B's poll phase random against A's heartbeats: else the two start at the same offset in every run,
    # and expiry -> claim takes the same few values instead of spreading over the poll.
    time.sleep(random.uniform(0, DEFAULT_POLL))
    worker_b = run.worker("B", args)
    run.wait_registered(conn, worker_b)
    # Kill at a random point of A's heartbeat cycle (renewals every lease/3) and of B's poll.
    time.sleep(0.5 + random.uniform(0, max(lease / 3, DEFAULT_POLL)))
    return worker_a, worker_b


def kill_holder(run: Run, conn: Any, wid: str, worker_a: Worker, worker_b: Worker) -> dict[str, Any]:
    """SIGKILL worker A, which must hold the workflow; return when, and its lease's expiry then."""
    schema = run.schema
    owner, attempt = conn.execute(f'SELECT lease_owner, attempt FROM "{schema}".workflows WHERE id = %s',
                                  (wid,)).fetchone()
    if attempt != 1 or not owner or f":{worker_a.pid}:" not in owner:
        raise RunFailed(f"workflow not held by worker A before the kill ({owner}, attempt {attempt})")
    worker_b.check("the kill")
    steps_before = steps_by(conn, schema, wid, 1)
    t_kill = worker_a.kill()
    time.sleep(0.2)  # A renewal in flight at the kill has committed (or not) by now
    expires = conn.execute(f'SELECT extract(epoch FROM lease_expires_at) FROM "{schema}".workflows WHERE id = %s',
                           (wid,)).fetchone()[0]
    chunks = conn.execute(f'SELECT count(*) FROM "{schema}".streams WHERE workflow_id = %s AND key = %s',
                          (wid, STREAM_KEY)).fetchone()[0]
    return {"t_kill": t_kill, "expires": float(expires), "steps_before_kill": steps_before,
            "chunks_before_kill": int(chunks)}


def takeover(run: Run, conn: Any, wid: str, worker_b: Worker, lease: float, chunks_before: int) -> dict[str, Any]:
    """Poll every 10 ms for B's claim, then its first step record and its first chunk."""
    schema, limit = run.schema, time.monotonic() + lease + 15
    seen: dict[str, Any] = {"claim": None, "step": None, "chunk": None}
    while seen["step"] is None or seen["chunk"] is None:
        now = time.time()
        if seen["claim"] is None:
            attempt, owner = conn.execute(f'SELECT attempt, lease_owner FROM "{schema}".workflows WHERE id = %s',
                                          (wid,)).fetchone()
            if attempt > 1:
                seen["claim"] = now
                if f":{worker_b.pid}:" not in (owner or ""):
                    raise RunFailed(f"claimed by {owner}, not worker B")
        if seen["claim"] is not None and seen["step"] is None:
            row = conn.execute(f'SELECT extract(epoch FROM finished_at), output FROM "{schema}".steps'
                               " WHERE workflow_id = %s AND attempt > 1 ORDER BY position LIMIT 1", (wid,)).fetchone()
            if row is not None:
                seen["step"], seen["step_pid"] = float(row[0]), codec.decode(row[1])[0]
        if seen["claim"] is not None and seen["chunk"] is None:
            row = conn.execute(f'SELECT value FROM "{schema}".streams WHERE workflow_id = %s AND key = %s'
                               " AND position >= %s ORDER BY position LIMIT 1", (wid, STREAM_KEY, chunks_before)
                               ).fetchone()
            if row is not None:
                seen["chunk_pid"], seen["chunk"] = codec.decode(row[0])[:2]
        worker_b.check("worker B to take over")
        if time.monotonic() > limit:
            raise RunFailed(f"no takeover within {lease + 15:.0f}s of the kill"
                            f" (claim seen: {seen['claim'] is not None})")
        time.sleep(0.01)
    return seen
