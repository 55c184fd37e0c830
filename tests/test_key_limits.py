"""Per-key limits (``app.queue(..., key_concurrency=, key_rate_limit=)``, ``with_options(key=...)``, a
workflow's key function): at most so many of one key's workflows at once and so many started per period,
across worker processes and through a worker's SIGKILL; turns between keys, so a key's backlog holds
no other key back; bad input refused before anything is written; the sync and async starts alike.

Every wait is for an event (a result, a row another process wrote), bounded. Time figures are read
from the rows (when each run began and ended, when each claim took its workflow), and only as lower
bounds or orders, never as "it happened fast".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

import pgflow
from pgflow._core import pruning
from pgflow._core.engine import claims, quote_identifier

from .apps import keyed
from .helpers import TIMEOUT, query, query_sync
from .processes import Processes, result_of, wait_until
from .test_claims import assert_found_by_the_key, subtree

pytestmark = pytest.mark.anyio

KEYED_APP = "tests.apps.keyed:app"


def peak(intervals: Iterable[tuple[datetime, datetime]]) -> int:
    """The most intervals open at once (an end before a start at a tie)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    open_, most = 0, 0
    for _, delta in events:
        open_ += delta
        most = max(most, open_)
    return most


def probe_rows(dsn: str, schema: str) -> list[tuple[str, int, datetime, datetime | None]]:
    """(tenant, pid, started, ended) of every run the probe recorded."""
    return [(str(t), int(p), s, e) for t, p, s, e in query_sync(
        dsn, f'SELECT tenant, pid, started, ended FROM "{schema}".probe ORDER BY n')]


def started_order(dsn: str, schema: str, queue: str) -> list[tuple[str, datetime]]:
    """(key, started_at) of the queue's workflows that were claimed, in claim order."""
    return [(str(k), at) for k, at in query_sync(
        dsn, f'SELECT key, started_at FROM "{schema}".workflows WHERE queue = %s AND started_at IS NOT NULL'
             " ORDER BY started_at, id", (queue,))]


async def keys_of(dsn: str, schema: str) -> dict[str, str]:
    return {str(id): str(key) for id, key in await query(dsn, f'SELECT id, key FROM "{schema}".workflows')}


# -- concurrency, across processes ------------------------------------------------------------------------


def test_key_concurrency_holds_across_two_worker_processes(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes,
) -> None:
    """Two processes of four slots each, three tenants of six workflows: without the limit a tenant's
    workflows could run eight at once; with it, two, across both processes together. The tenants
    run beside each other (the limit is per key, not the queue's)."""
    flows = keyed.build(app)
    app.migrate()
    query_sync(dsn, keyed.PROBE.format(table=flows.probe))
    workers = [procs.worker(f"worker-{i}", KEYED_APP, worker_env, queues=keyed.TENANTS, concurrency=4)
               for i in range(2)]
    handles = [flows.tenant_work.start(tenant, "", 0.4) for tenant in ("a", "b", "c") for _ in range(6)]
    pids = [result_of(h, procs) for h in handles]
    rows = probe_rows(dsn, schema)
    assert len(rows) == 18, rows
    for tenant in ("a", "b", "c"):
        runs = [(s, e) for t, _, s, e in rows if t == tenant and e is not None]
        assert peak(runs) <= keyed.KEY_CONCURRENCY, (tenant, rows)
    # More than one process ran the tenants' work, so the limit held across processes, not within one.
    assert set(pids) == {w.pid for w in workers}, f"{set(pids)}\n{procs.logs()}"
    assert peak([(s, e) for _, _, s, e in rows if e is not None]) > keyed.KEY_CONCURRENCY, rows
    assert all(w.alive() for w in workers), procs.logs()


# -- a worker killed --------------------------------------------------------------------------------------


@pytest.mark.parametrize("limit", ["key", "queue"])
def test_a_killed_workers_runs_hold_their_places_until_run_again(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
    limit: str,
) -> None:
    """Worker A runs two of tenant k's six workflows (its limit: per key, or the queue's own), held at
    a gate, and is SIGKILLed. Workers B and C take over: A's two runs are rescued and run again, the
    other four run, all six succeed, and at no time do more than two of k's workflows run in B and C
    together (A's runs held their places until they were rescued, then until they ran again, alone, as
    suspects: counting the live leases alone ran three at once)."""
    flows = keyed.build(app)
    app.migrate()
    query_sync(dsn, keyed.PROBE.format(table=flows.probe))
    gate = tmp_path / "gate"
    queue, work = (keyed.TENANTS, flows.tenant_work) if limit == "key" else (keyed.CAPPED, flows.capped_work)
    a = procs.worker("worker-A", KEYED_APP, worker_env, queues=queue, concurrency=4)
    handles = [work.start("k", str(gate), 0.3) for _ in range(6)]
    wait_until(lambda: sum(1 for _, pid, _, _ in probe_rows(dsn, schema) if pid == a.pid) == 2,
               "worker A to run two of k's workflows", procs, a)
    a.kill()
    assert sum(1 for _, pid, _, _ in probe_rows(dsn, schema) if pid == a.pid) == 2  # never more than its limit
    others = [procs.worker(name, KEYED_APP, worker_env, queues=queue, concurrency=2)
              for name in ("worker-B", "worker-C")]
    gate.touch()
    pids = [result_of(h, procs) for h in handles]
    assert set(pids) <= {w.pid for w in others}, pids
    rows = probe_rows(dsn, schema)
    survivors = [(s, e) for _, pid, s, e in rows if pid != a.pid]
    assert len(survivors) == 6 and all(e is not None for _, e in survivors), rows
    assert peak(survivors) <= keyed.KEY_CONCURRENCY, rows  # type: ignore[arg-type]
    attempts = query_sync(dsn, f'SELECT attempt FROM "{schema}".workflows ORDER BY attempt')
    assert [n for (n,) in attempts] == [1, 1, 1, 1, 2, 2], attempts  # A's two ran again


# -- turns between keys ----------------------------------------------------------------------------------


async def test_a_lone_keys_workflow_is_claimed_in_the_first_round_behind_a_hot_keys_backlog(
        app: pgflow.App, dsn: str, schema: str) -> None:
    """Ten thousand queued workflows of one key, then one of another, started last: the worker's first
    claim (two slots) takes the lone key's workflow beside the hot key's first. (Without turns, the
    claim's order of priority and due time would put it behind the ten thousand.)"""
    app.queue("fair", key_concurrency=2)

    @app.workflow(name="keys.noop", queue="fair")
    async def noop(n: int) -> int:
        return n

    await noop.with_options(key="a-hot").start_many_async([(n,) for n in range(10_000)])
    lone = await noop.with_options(key="b-lone").start_async(-1)
    async with app.worker(concurrency=2, queues=["fair"]):
        assert await lone.result_async(timeout=TIMEOUT) == -1
    claims = started_order(dsn, schema, "fair")
    first_round = [key for key, at in claims if at == claims[0][1]]
    assert sorted(first_round) == ["a-hot", "b-lone"], claims[:5]


async def test_keys_take_turns_round_after_round(app: pgflow.App, dsn: str, schema: str) -> None:
    """Three keys' backlogs, started one key after the other, through one slot: the claims go round the
    keys (a, b, c, a, b, c, ...), each round beginning after the key the last one ended at."""
    app.queue("turns", key_concurrency=100)  # (a limit that never binds: the turns alone order them)

    @app.workflow(name="keys.turn", queue="turns", key=lambda key, n: key)
    async def turn(key: str, n: int) -> int:
        return n

    handles = [await turn.start_async(key, n) for key in ("a", "b", "c") for n in range(3)]
    async with app.worker(concurrency=1, queues=["turns"]):
        for handle in handles:
            await handle.result_async(timeout=TIMEOUT)
    assert [key for key, _ in started_order(dsn, schema, "turns")] == ["a", "b", "c"] * 3


# -- the rate, across two workers --------------------------------------------------------------------------


async def test_key_rate_limit_paces_each_key_apart_across_two_workers(
        app: pgflow.App, second_app: pgflow.App, dsn: str, schema: str) -> None:
    """Two keys of six workflows, at most 3 started per 2 s per key, claimed by two workers of two Apps
    (two pools, as two processes): each key's bucket starts full, so its first three start together and
    the rest one per 2/3 s at the soonest; the keys are paced apart (each key's first three start
    before the other key's fourth)."""
    rate, per = 3, 2.0
    flows = []
    for each in (app, second_app):
        each.queue("metered", key_rate_limit=rate, per=per)
        flows.append(each.workflow(name="keys.metered", queue="metered", key=lambda key, n: key)(_metered))
    handles = [await flows[0].start_async(key, n) for key in ("x", "y") for n in range(6)]
    async with app.worker(concurrency=8, queues=["metered"]), second_app.worker(concurrency=8, queues=["metered"]):
        for handle in handles:
            await handle.result_async(timeout=TIMEOUT)
    claims = started_order(dsn, schema, "metered")
    by_key = {key: [at for k, at in claims if k == key] for key in ("x", "y")}
    for key, other in (("x", "y"), ("y", "x")):
        offsets = [(at - by_key[key][0]).total_seconds() for at in by_key[key]]
        for k, offset in enumerate(offsets):  # by t seconds, at most 3 + 1.5 t have started
            assert offset >= (k + 1 - rate) * per / rate - 0.05, (key, offsets)
        assert by_key[key][rate - 1] < by_key[other][rate], claims


async def _metered(key: str, n: int) -> int:
    return n


# -- refusals ------------------------------------------------------------------------------------------------


def refusals(app: pgflow.App, wf: pgflow.Workflow[Any, Any], bad_function: pgflow.Workflow[Any, Any],
             ) -> list[tuple[str, Callable[[], Any]]]:
    """Each bad key, as a call that must raise ValueError (nothing written)."""
    return [
        ("a key that is no string", lambda: wf.with_options(key=42)),  # type: ignore[arg-type]
        ("bytes", lambda: wf.with_options(key=b"tenant")),  # type: ignore[arg-type]
        ("an empty key", lambda: wf.with_options(key="")),
        ("a NUL", lambda: wf.with_options(key="a\x00b")),
        ("too long", lambda: wf.with_options(key="k" * 10_000)),
        ("a key function's int", lambda: bad_function.start(7)),
        ("a key function's int, in start_many", lambda: bad_function.start_many([(1,), (7,)])),
        ("a key function's int, by name", lambda: app.start_by_name("keys.bad_function", 7)),
    ]


def test_bad_keys_and_limits_are_refused_before_anything_is_written(app: pgflow.App, dsn: str, schema: str) -> None:
    @app.workflow(name="keys.refused")
    def refused(n: int) -> int:
        return n

    @app.workflow(name="keys.bad_function", key=lambda n: n if n == 7 else str(n))
    def bad_function(n: int) -> int:
        return n

    app.migrate()
    for what, call in refusals(app, refused, bad_function):
        with pytest.raises(ValueError, match="key") as raised:
            call()
        assert "key" in str(raised.value), what
    with pytest.raises(ValueError, match="the key function of workflow 'keys.bad_function' returned 7"):
        bad_function.start(7)
    # A key function that raises: its error, as it is.
    failing = app.workflow(name="keys.failing", key=lambda n: {}[n])(lambda n: n)
    with pytest.raises(KeyError):
        failing.start(1)
    for bad in ("tenant", 42):
        with pytest.raises(pgflow.ConfigurationError, match="a workflow's key is a function"):
            app.workflow(name=f"keys.bad_{bad}", key=bad)(lambda n: n)  # type: ignore[call-overload]
    for options in ({"key_concurrency": 0}, {"key_concurrency": "2"}, {"key_rate_limit": -1},
                    {"key_rate_limit": True}, {"key_rate_limit": 2.5}, {"key_rate_limit": 3, "per": 0}):
        with pytest.raises(pgflow.ConfigurationError):
            app.queue("keys.q", **options)  # type: ignore[arg-type]
    assert "keys.q" not in app.queues
    assert query_sync(dsn, f'SELECT count(*) FROM "{schema}".workflows') == [(0,)]


async def test_bad_keys_are_refused_by_the_async_twins(app: pgflow.App, dsn: str, schema: str) -> None:
    @app.workflow(name="keys.bad_async", key=lambda n: None)
    async def bad_async(n: int) -> int:
        return n

    await app.migrate_async()
    with pytest.raises(ValueError, match="returned None: key is a non-empty string"):
        await bad_async.start_async(1)
    with pytest.raises(ValueError, match="returned None"):
        await bad_async.start_many_async([(1,)])
    with pytest.raises(ValueError, match="key is a non-empty string"):
        await bad_async.with_options(key=3.5).start_async(1)  # type: ignore[arg-type]
    assert await query(dsn, f'SELECT count(*) FROM "{schema}".workflows') == [(0,)]


# -- every way of starting ------------------------------------------------------------------------------------


async def test_sync_and_async_starts_carry_their_keys(app: pgflow.App, dsn: str, schema: str) -> None:
    """The key given (sync from a plain thread, as a sync web framework calls it; async), the key
    function's (start, start_many, start_by_name, a debounced start), the given one over the
    function's, and none: each row holds its start's key, and the work runs in the key-limited queue."""
    app.queue("tenants", key_concurrency=2)
    ran: list[str] = []

    @app.workflow(name="keys.doc", queue="tenants", key=lambda tenant, doc: f"tenant-{tenant}")
    def doc(tenant: str, doc: str) -> str:
        ran.append(doc)
        return doc

    @app.workflow(name="keys.plain", queue="tenants")
    async def plain(doc: str) -> str:
        return doc

    def sync_starts() -> list[pgflow.WorkflowHandle[Any]]:
        return [doc.start("1", "sync-function"), doc.with_options(key="given").start("1", "sync-given"),
                plain.with_options(key="tenant-9").start("sync-plain")]

    handles = await anyio.to_thread.run_sync(sync_starts)
    handles += [await doc.start_async("2", "async-function"),
                await doc.with_options(key="given").start_async("2", "async-given"),
                await plain.start_async("no-key"),
                *await doc.start_many_async([("3", "many-a"), ("4", "many-b")]),
                await app.start_by_name_async("keys.doc", "5", "by-name"),
                await doc.with_options(debounce=0.1, debounce_key="d").start_async("6", "debounced")]
    keys = await keys_of(dsn, schema)
    assert [keys[h.id] for h in handles] == [
        "tenant-1", "given", "tenant-9", "tenant-2", "given", "", "tenant-3", "tenant-4", "tenant-5", "tenant-6"]
    async with app.worker(concurrency=4, queues=["tenants"]):
        results = [await h.result_async(timeout=TIMEOUT) for h in handles]
    assert results == ["sync-function", "sync-given", "sync-plain", "async-function", "async-given", "no-key",
                       "many-a", "many-b", "by-name", "debounced"]
    assert sorted(ran) == sorted(r for r in results if r not in ("sync-plain", "no-key"))


# -- the buckets ---------------------------------------------------------------------------------------------


async def test_retention_forgets_the_buckets_that_are_full_again(app: pgflow.App, dsn: str, schema: str) -> None:
    """A key without a bucket has a full one: the retention pass deletes the buckets that refilled, and
    those of a queue with no per-key rate any more, and keeps the ones still short of tokens."""
    await app.migrate_async()
    s = f'"{schema}"'
    await query(dsn, f"INSERT INTO {s}.queues (name, key_rate_limit, rate_period) VALUES ('m', 2, 60)")
    await query(dsn, f"INSERT INTO {s}.queue_keys (queue, key, tokens, refilled_at) VALUES"
                     " ('m', 'dry', 0, now()), ('m', 'half', 1, now() - interval '29 s'),"
                     " ('m', 'refilled', 0, now() - interval '61 s'), ('m', 'topped', 1, now() - interval '31 s'),"
                     " ('unlimited', 'x', 0, now())")
    runtime = app._client.runtime()
    assert await runtime.db(lambda store: pruning.prune_key_buckets(store)) == 3
    assert await query(dsn, f"SELECT key FROM {s}.queue_keys ORDER BY key") == [("dry",), ("half",)]


# -- the plan --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("full", [True, False], ids=["full", "bounded"])
async def test_a_keyed_claim_walks_the_keys_through_their_index_and_scans_no_table(
        app: pgflow.App, dsn: str, schema: str, full: bool) -> None:
    """Planned once for any values (a generic plan, as pgflow's prepared claims run), on a backlog of
    30,000 over 1,000 keys beside finished work: the walk from key to key and each key's turn are
    probes of the keyed index, in its order (no sort of a key's rows), and the claimed rows are found
    by the primary key."""
    await app.migrate_async()
    s = f'"{schema}"'
    await query(dsn, f"INSERT INTO {s}.workflows (id, name, queue, inputs, priority, due_at, status, key)"
                     " SELECT 'w' || i, 'n.a', 'q', '\\x80'::bytea, i %% 3, now() - make_interval(secs => i %% 7),"
                     "  CASE WHEN i %% 5 = 0 THEN 'succeeded' ELSE 'queued' END, 'k' || (i %% 1000)"
                     " FROM generate_series(1, 30000) AS i")
    await query(dsn, f"ANALYZE {s}.workflows")
    statement = claims.FULL_KEYED_CLAIMING if full else claims.KEYED_CLAIMING
    template = statement.for_schema(quote_identifier(schema))[0].decode()
    given = {"queue": "'q'", "limit": "16", "names": "'{n.a}'::text[]", "queues": "'{q}'::text[]", "commit": "'on'",
             "token": "1", "owner": "'probe'", "lease": "10.0"}
    types = {"queue": "text", "limit": "int4", "names": "text[]", "queues": "text[]", "commit": "text",
             "token": "int8", "owner": "text", "lease": "float8"}
    names = statement._names  # noqa: SLF001 - the order of its $n
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("SET jit = off")
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        await conn.execute(f"PREPARE keyed({', '.join(types[n] for n in names)}) AS {template}")
        cur = await conn.execute(f"EXPLAIN EXECUTE keyed({', '.join(given[n] for n in names)})")
        text = "\n".join(row[0] for row in await cur.fetchall())
    assert "Seq Scan on workflows" not in text, text
    ring, first = subtree(text, "CTE ring"), subtree(text, "CTE first")
    assert "Index Only Scan using workflows_queued_by_key" in ring and "Sort" not in ring, text
    assert "Index Scan using workflows_queued_by_key" in first and "Sort" not in first, text
    assert_found_by_the_key(text)
    assert ("CTE expired" in text) == full, text


# -- a limited queue that is not the workflow's own --------------------------------------------------------


@pytest.mark.parametrize("limits", [{"concurrency": 1}, {"key_concurrency": 1}], ids=["queue", "key"])
async def test_a_slot_freed_in_a_limited_queue_wakes_its_claims_whatever_the_workflows_own_queue(
        dsn: str, schema: str, limits: dict[str, int]) -> None:
    """Workflows of the default queue started on a limited one (``with_options(queue=...)``), one slot:
    each end wakes the worker's claim of the next at once. (Woken by the ends of the workflows' own
    queue, which has no limits, it looked again only at its poll, here a minute: a drain of three took
    two minutes.)"""
    async with pgflow.App(dsn, schema=schema, poll_interval=60.0) as app:
        app.queue("one-at-a-time", **limits)  # type: ignore[arg-type]

        @app.workflow(name="keys.elsewhere")
        async def elsewhere(n: int) -> int:
            return n

        handles = [await elsewhere.with_options(queue="one-at-a-time", key="k").start_async(n) for n in range(3)]
        async with app.worker(concurrency=4, queues=["one-at-a-time"]):
            assert [await h.result_async(timeout=TIMEOUT) for h in handles] == [0, 1, 2]


async def test_a_paused_key_limited_queue_is_not_claimed(app: pgflow.App) -> None:
    """Pausing holds for a queue with per-key limits too (its claim is a statement of its own)."""
    app.queue("keyed-paused", key_concurrency=2)

    @app.workflow(name="keys.paused")
    async def quick(n: int) -> int:
        return n

    await app.migrate_async()
    await app.pause_queue_async("keyed-paused")
    waiting = await quick.with_options(queue="keyed-paused", key="k").start_async(1)
    async with app.worker(concurrency=2, queues=["keyed-paused", "default"]):
        # Claimed by the same worker's rounds, after the paused queue's claim looked (and took nothing).
        assert await (await quick.start_async(2)).result_async(timeout=TIMEOUT) == 2
        assert await (await quick.start_async(3)).result_async(timeout=TIMEOUT) == 3
        assert await waiting.status_async() == "queued"
        await app.resume_queue_async("keyed-paused")
        assert await waiting.result_async(timeout=TIMEOUT) == 1
