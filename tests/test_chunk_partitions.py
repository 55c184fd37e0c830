"""Stream chunks partitioned by the period their stream began in (migrations 0022-0024): a stream's
reads and writes reach one partition, the partitions service makes periods ahead and drops those whose
streams have all been pruned, a drop never queues the writers behind it, and an upgrade keeps the
chunks written before, while writers of the version before go on writing."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from datetime import timedelta
from io import BytesIO
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pytest

import pgflow
from pgflow._core.engine import Engine, migrations
from pgflow._core.pruning import tend_chunk_partitions

from .helpers import move_schema_clock, query, run_to_end, running, wait_for
from .processes import Processes

pytestmark = pytest.mark.anyio

DAY = timedelta(days=1).total_seconds()
BEFORE_PARTITIONS = "chunks_before_partitions"
# The last commit of main before the chunks were partitioned: the version whose writers the upgrade
# test runs beside the migration.
PREVIOUS_VERSION = "d2fabdbb14d85421d22c4c905d52297ab674aa77"


async def store_of(app: pgflow.App) -> Engine:
    return await app._client.runtime().store()


async def partitions(app: pgflow.App) -> list[str]:
    """The partitions there are, oldest first."""
    return [str(name) for (name,) in await query(
        app.dsn, f'SELECT name FROM "{app.schema}".chunk_partitions ORDER BY first_id')]


async def partition_of_now(app: pgflow.App) -> str:
    [(name,)] = await query(app.dsn, f'SELECT name FROM "{app.schema}".chunk_partitions'
                                     f' WHERE starts_at <= "{app.schema}".clock_now()'
                                     f' AND "{app.schema}".clock_now() < ends_at AND first_id >= 4294967296')
    return str(name)


async def partitions_holding(app: pgflow.App, workflow_id: str, key: str | None = None) -> set[str]:
    """The partitions the chunks of a workflow's streams (of its stream ``key``) lie in."""
    s = f'"{app.schema}"'
    rows = await query(app.dsn, f"SELECT DISTINCT c.tableoid::regclass::text FROM {s}.chunks c"
                                f" JOIN {s}.stream_ids i ON i.id = c.stream_id WHERE i.workflow_id = %s"
                                " AND (%s::text IS NULL OR i.key = %s)", workflow_id, key, key)
    return {str(name).rsplit(".", 1)[-1].strip('"') for (name,) in rows}


async def finished(app: pgflow.App, workflow: pgflow.Workflow[[int], int], n: int) -> pgflow.WorkflowHandle[int]:
    handle = await workflow.start_async(n)
    assert await run_to_end(app, handle) == n
    return handle


def build(app: pgflow.App) -> pgflow.Workflow[[int], int]:
    @app.workflow
    async def tokens(n: int) -> int:
        for i in range(n):
            await pgflow.write_stream_async("tokens", i)
        await pgflow.close_stream_async("tokens")
        return n

    return tokens


async def test_a_stream_lies_in_the_partition_of_its_day_and_a_read_of_it_reaches_only_that_one(
    app: pgflow.App,
) -> None:
    tokens = build(app)
    await app.migrate_async()
    today = await partition_of_now(app)
    handle = await finished(app, tokens, 5)
    assert await partitions_holding(app, handle.id) == {today}
    assert [v async for v in handle.stream_async("tokens")] == [0, 1, 2, 3, 4]

    # A plan made for any stream id (as a prepared statement's generic plan is) prunes the other
    # partitions when it runs.
    s = f'"{app.schema}"'
    [(stream_id,)] = await query(app.dsn, f"SELECT id FROM {s}.stream_ids WHERE workflow_id = %s", handle.id)
    async with await psycopg.AsyncConnection.connect(app.dsn, autocommit=True) as conn:
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        await conn.execute(f"PREPARE read_chunks(bigint) AS SELECT position, value FROM {s}.chunks"
                           " WHERE stream_id = $1 AND position >= 0 ORDER BY position")
        plan = (await (await conn.execute(
            f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE read_chunks({int(stream_id)})")).fetchone())[0]  # type: ignore[index]
    assert relations(plan[0]["Plan"]) == {today}
    assert len(await partitions(app)) == 4  # the chunks from before partitioning, today and two days ahead


def relations(node: dict[str, Any]) -> set[str]:
    found = {node["Relation Name"]} if "Relation Name" in node else set()
    for child in node.get("Plans", []):
        found |= relations(child)
    return found


async def test_the_partitions_service_makes_the_days_ahead_and_drops_those_whose_streams_are_pruned(
    app: pgflow.App,
) -> None:
    tokens = build(app)
    await app.migrate_async()
    first_day = await partition_of_now(app)
    old = await finished(app, tokens, 3)
    recent = await finished(app, tokens, 4)
    await query(app.dsn, f'UPDATE "{app.schema}".workflows SET finished_at = finished_at - %s WHERE id = %s',
                timedelta(days=30), old.id)
    store = await store_of(app)

    # To noon (UTC) three days on, whatever the hour the test runs at: every day that passed then ended
    # long enough ago to be dropped (a partition is kept for an hour after its day ends).
    s = f'"{app.schema}"'
    [(into_day,)] = await query(app.dsn, f"SELECT extract(epoch FROM {s}.clock_now() AT TIME ZONE 'UTC'"
                                         f" - date_trunc('day', {s}.clock_now() AT TIME ZONE 'UTC'))::float8")
    await move_schema_clock(app, 3 * DAY + DAY / 2 - into_day)
    await tend_chunk_partitions(store)
    third_day = await partition_of_now(app)
    # Three days on: the days ahead of the clock are made; the days that passed with no stream begun
    # in them and the (empty) table from before partitioning are gone; the first day keeps its streams.
    names = await partitions(app)
    assert names[0] == first_day and third_day in names and len(names) == 4, names

    # Pruning deletes the old workflow's stream name; the first day still holds the recent one's.
    assert await app.prune_async(older_than=timedelta(days=7)) == 1
    assert first_day in await partitions(app)
    assert [v async for v in app.handle(recent.id).stream_async("tokens")] == [0, 1, 2, 3]
    with pytest.raises(pgflow.UnknownWorkflow):
        await app.handle(old.id).status_async()

    # Once the recent one is pruned too, the day goes whole, and a new stream lands in the clock's day.
    await query(app.dsn, f'UPDATE "{app.schema}".workflows SET finished_at = finished_at - %s', timedelta(days=30))
    assert await app.prune_async(older_than=timedelta(days=7)) == 1
    assert first_day not in await partitions(app)
    assert await query(app.dsn, f'SELECT count(*) FROM "{app.schema}".chunks') == [(0,)]
    later = await finished(app, tokens, 2)
    assert await partitions_holding(app, later.id) == {third_day}


async def test_a_worker_runs_the_partitions_service_as_soon_as_it_leads_it(app: pgflow.App) -> None:
    build(app)
    await app.migrate_async()
    await move_schema_clock(app, 10 * DAY)
    async with running(app):
        async def made() -> bool:
            s = f'"{app.schema}"'
            return await query(app.dsn, f"SELECT count(*) FROM {s}.chunk_partitions"
                                        f" WHERE ends_at > {s}.clock_now() + interval '2 days'") == [(1,)]

        await wait_for(made)
        assert "partitions" in {lock.service for lock in (await app.health_async()).maintenance}


async def test_a_drop_that_cannot_have_the_lock_soon_is_left_for_the_next_pass(
    app: pgflow.App,
) -> None:
    tokens = build(app)
    handle = await finished(app, tokens, 3)
    await query(app.dsn, f'UPDATE "{app.schema}".workflows SET finished_at = finished_at - %s', timedelta(days=30))
    await move_schema_clock(app, 2 * DAY)
    store = await store_of(app)
    doomed = await partitions(app)
    async with await psycopg.AsyncConnection.connect(app.dsn) as reader:
        # A long statement's lock on chunks, as a slow read of them holds it.
        await reader.execute(f'SELECT count(*) FROM "{app.schema}".chunks')
        with anyio.fail_after(10):
            assert await app.prune_async(older_than=timedelta(days=7)) == 1  # it returns: no wait
        assert await partitions(app) == doomed
        with anyio.fail_after(10):  # nothing waits for the lock any more: chunks are written
            await finished(app, tokens, 2)
        await reader.rollback()
    dropped = await store.partitions.drop_chunk_partitions()
    assert dropped and set(dropped) < set(doomed)
    assert handle.id not in {w for (w,) in await query(app.dsn, f'SELECT workflow_id FROM "{app.schema}".stream_ids')}


async def test_a_shorter_period_applies_to_the_partitions_made_after_it(app: pgflow.App) -> None:
    await app.migrate_async()
    before = await partitions(app)
    await query(app.dsn, f'UPDATE "{app.schema}".chunk_partitioning SET period_hours = 1')
    await move_schema_clock(app, 3 * DAY)
    store = await store_of(app)
    assert await store.partitions.add_chunk_partitions() == 3  # this hour and two ahead, after the last day made
    rows = await query(app.dsn, f'SELECT name, ends_at - starts_at FROM "{app.schema}".chunk_partitions'
                                f" WHERE name <> ALL(%s) ORDER BY first_id", before)
    assert [span for _, span in rows] == [timedelta(hours=1)] * 3
    with pytest.raises(psycopg.errors.CheckViolation):
        await query(app.dsn, f'UPDATE "{app.schema}".chunk_partitioning SET period_hours = 0')


@pytest.mark.new_schema  # migrated by the version before, then upgraded
async def test_an_upgraded_schema_keeps_its_chunks_in_the_first_partition_until_their_streams_are_pruned(
    dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The chunks as they were before 0022, written by this version's code, which needs what its claims
    # read (apart from the chunks) to run a worker at all: its fences (0026), the crash attribution's
    # columns (0028), the paused queues (0031) and a start's key (0032).
    before = [m for m in migrations.available() if m.version < 22 or m.version in (26, 28, 31, 32)]
    with monkeypatch.context() as patch:
        patch.setattr(migrations, "available", lambda: before)
        old = pgflow.App(dsn, schema=schema, poll_interval=0.5)
        try:
            handle = await finished(old, build(old), 6)
        finally:
            await old.close_async()
    s = f'"{schema}"'
    app = pgflow.App(dsn, schema=schema, poll_interval=0.5)
    try:
        tokens = build(app)
        assert await app.migrate_async() == migrations.available()[-1].version  # the latest
        assert await query(dsn, f"SELECT relkind::text FROM pg_class WHERE oid = '{s}.chunks'::regclass") == [("p",)]
        assert await partitions_holding(app, handle.id) == {BEFORE_PARTITIONS}
        assert [v async for v in app.handle(handle.id).stream_async("tokens")] == list(range(6))
        later = await finished(app, tokens, 2)
        assert await partitions_holding(app, later.id) == {await partition_of_now(app)}
        await move_schema_clock(app, 2 * DAY)
        await tend_chunk_partitions(await store_of(app))
        assert BEFORE_PARTITIONS in await partitions(app)  # its stream is not pruned
        await query(dsn, f"UPDATE {s}.workflows SET finished_at = finished_at - %s WHERE id = %s",
                    timedelta(days=30), handle.id)
        assert await app.prune_async(older_than=timedelta(days=7)) == 1
        assert BEFORE_PARTITIONS not in await partitions(app)
        assert [v async for v in app.handle(later.id).stream_async("tokens")] == [0, 1]
    finally:
        await app.close_async()


def previous_version(tmp_path: Path) -> Path:
    """The package as it was at PREVIOUS_VERSION, unpacked from the repository's history."""
    root = Path(__file__).resolve().parent.parent
    git = shutil.which("git")
    if git is None or not (root / ".git").exists():
        pytest.skip("needs git and this checkout's history, for the code of the version before")
    archive = subprocess.run([git, "-C", str(root), "archive", PREVIOUS_VERSION, "pgflow"], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"commit {PREVIOUS_VERSION[:8]} is not in this checkout's history (a shallow clone?):"
                    f" {archive.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(tmp_path / "previous", filter="data")
    return tmp_path / "previous"


@pytest.mark.new_schema  # migrated by the version before, then upgraded
async def test_writers_of_the_version_before_go_on_streaming_through_the_upgrade(
    app: pgflow.App, dsn: str, schema: str, worker_env: dict[str, str], procs: Processes, tmp_path: Path,
) -> None:
    gate, count = tmp_path / "migrated", 4
    env = {**worker_env, "PGFLOW_TEST_GATE": str(gate),
           "PYTHONPATH": f"{previous_version(tmp_path)}:{worker_env['PYTHONPATH']}"}
    which = procs.start("which", ["-c", "import pgflow; print(pgflow.__file__)"], env)
    assert which.wait_exit() == 0 and which.output().startswith(str(tmp_path / "previous")), which.describe()
    starter = procs.start("starter", ["-m", "tests.apps.upgrading", str(count)], env)
    assert starter.wait_exit() == 0, starter.describe()
    ids = starter.output().split()
    assert len(ids) == count and await query(dsn, f'SELECT max(version) FROM "{schema}".migrations') == [(21,)]
    old_worker = procs.worker("previous", "tests.apps.upgrading:app", env, concurrency=8)
    s = f'"{schema}"'

    async def chunks() -> int:
        return int((await query(dsn, f"SELECT count(*) FROM {s}.streams"))[0][0])

    async def all_writing() -> bool:
        rows = await query(dsn, f"SELECT count(DISTINCT workflow_id) FROM {s}.streams WHERE key = 'before'")
        return rows == [(count,)] and await chunks() >= 40 * count

    await wait_for(all_writing)
    # The migration, while the writers of the version before write without pause.
    assert await app.migrate_async() == migrations.available()[-1].version  # the latest
    assert await query(dsn, f"SELECT relkind::text FROM pg_class WHERE oid = '{s}.chunks'::regclass") == [("p",)]
    after_migration = await chunks()

    async def went_on() -> bool:
        return await chunks() > after_migration + 100 * count

    await wait_for(went_on)
    assert old_worker.alive(), old_worker.describe()
    gate.touch()
    for id in ids:
        handle = app.handle(id)
        with anyio.fail_after(60):
            written = await handle.result_async()
        assert [v async for v in handle.stream_async("before")] == list(range(written))
        assert [v async for v in handle.stream_async("after")] == list(range(50))
        # Begun before the upgrade, kept where it was; begun after it by the old code, in today's partition.
        assert await partitions_holding(app, id, "before") == {BEFORE_PARTITIONS}
        assert await partitions_holding(app, id, "after") == {await partition_of_now(app)}
    old_worker.stop()
    assert "Traceback" not in old_worker.output(), old_worker.describe()

