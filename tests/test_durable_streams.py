"""The Durable Streams server (``pgflow.durable_streams``), in process: the protocol's rules on
free-standing streams, a workflow's stream in JSON mode, hostile requests (never a 5xx), the Host and
token rules, and the retention of expired streams. The public conformance suite and the official
TypeScript client are in test_durable_streams_client.py (they need node)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import anyio
import psycopg
import pytest

import pgflow
from pgflow._core.pruning import prune_expired_streams
from pgflow.durable_streams import asgi_app, read_free_stream_async
from pgflow.durable_streams import protocol as p

pytestmark = pytest.mark.anyio

Answer = tuple[int, dict[str, str], bytes]


async def call(asgi: Any, method: str, path: str, headers: Iterable[tuple[str, str]] = (), body: bytes = b"",
               query: str = "", host: str = "127.0.0.1:4437", chunks: list[bytes] | None = None) -> Answer:
    """One request to the ASGI app, its whole answer (live answers end when their stream does)."""
    sent: list[dict[str, Any]] = []
    parts = list(chunks) if chunks is not None else [body]

    async def receive() -> dict[str, Any]:
        if parts:
            part = parts.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(parts)}
        await anyio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "query_string": query.encode("latin-1"),
             "headers": [(b"host", host.encode())] + [(k.lower().encode(), v.encode()) for k, v in headers],
             "client": ("127.0.0.1", 5000), "scheme": "http"}
    await asgi(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    head = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], head, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


JSON = [("content-type", "application/json")]


async def test_protocol_pure_rules() -> None:
    assert p.parse_offset(p.offset_text(42)) == 42
    assert p.offset_text(9) < p.offset_text(10)  # offsets sort as text
    for bad in ["", "abc", "1,2", "0 1", "-2", "now1", "1_" + "9" * 30, "١_١"]:
        with pytest.raises(p.Refused) as refused:
            p.parse_offset(bad)
        assert refused.value.status == 400
    assert p.decimal("3600", "ttl", p.MAX_TTL) == 3600
    for bad in ["+1", "01", "1.0", "1e3", "-1", "", " ", "99999999999999999999"]:
        with pytest.raises(p.Refused):
            p.decimal(bad, "ttl", p.MAX_TTL)
    assert p.json_messages(b'[1, {"a": [2]}]', allow_empty=False) == [b"1", b'{"a": [2]}']
    assert p.json_messages(b"[[1,2],[3]]", allow_empty=False) == [b"[1,2]", b"[3]"]
    assert p.json_messages(b'{"x":1}', allow_empty=False) == [b'{"x":1}']
    assert p.json_messages(b"[]", allow_empty=True) == []
    for bad_json in [b"[]", b"[1,]", b"{", b"NaN", b"[1] 2"]:
        with pytest.raises(p.Refused):
            p.json_messages(bad_json, allow_empty=False)
    assert int(p.cursor(str(10**9))) > 10**9  # never at or below the one echoed


async def test_free_stream_round_trip(app: pgflow.App) -> None:
    asgi = asgi_app(app)
    status, head, _ = await call(asgi, "PUT", "/chat/1", JSON, b'[{"a":1},{"b":2}]')
    assert status == 201 and head[p.NEXT_OFFSET] == p.offset_text(2)
    assert (await call(asgi, "PUT", "/chat/1", JSON))[0] == 200  # the same again: idempotent
    assert (await call(asgi, "PUT", "/chat/1", [("content-type", "text/plain")]))[0] == 409
    status, head, _ = await call(asgi, "POST", "/chat/1", JSON, b'{"c":3}')
    assert status == 204 and head[p.NEXT_OFFSET] == p.offset_text(3)
    status, head, body = await call(asgi, "GET", "/chat/1")
    assert status == 200 and json.loads(body) == [{"a": 1}, {"b": 2}, {"c": 3}]
    assert head[p.UP_TO_DATE] == "true" and head["x-content-type-options"] == "nosniff"
    etag = head["etag"]
    assert (await call(asgi, "GET", "/chat/1", [("if-none-match", etag)]))[0] == 304
    status, head, body = await call(asgi, "GET", "/chat/1", query=f"offset={p.offset_text(1)}")
    assert json.loads(body) == [{"b": 2}, {"c": 3}]

    async def append_later() -> None:
        await anyio.sleep(0.3)
        await call(asgi, "POST", "/chat/1", JSON, b'[{"d":4}]')

    async with anyio.create_task_group() as group:  # a long-poll at the tail is woken by the append
        group.start_soon(append_later)
        with anyio.fail_after(5):
            status, head, body = await call(asgi, "GET", "/chat/1", query=f"offset={p.offset_text(3)}&live=long-poll")
    assert status == 200 and json.loads(body) == [{"d": 4}] and p.CURSOR in head

    # Idempotent producer: a retry is a 204 and writes nothing; a stale epoch is fenced.
    producer = [*JSON, ("producer-id", "w1"), ("producer-epoch", "0"), ("producer-seq", "0")]
    assert (await call(asgi, "POST", "/chat/1", producer, b'{"e":5}'))[0] == 200
    assert (await call(asgi, "POST", "/chat/1", producer, b'{"e":5}'))[0] == 204
    bumped = [*JSON, ("producer-id", "w1"), ("producer-epoch", "1"), ("producer-seq", "0")]
    assert (await call(asgi, "POST", "/chat/1", bumped, b'{"f":6}'))[0] == 200
    status, head, _ = await call(asgi, "POST", "/chat/1", producer[:-1] + [("producer-seq", "1")], b'{"g":7}')
    assert status == 403 and head[p.PRODUCER_EPOCH] == "1"
    gap = [*JSON, ("producer-id", "w1"), ("producer-epoch", "1"), ("producer-seq", "5")]
    status, head, _ = await call(asgi, "POST", "/chat/1", gap, b'{"h":8}')
    assert status == 409 and head[p.EXPECTED_SEQ] == "1"

    # Close: appends refused after; a reader at the end is told at once.
    status, head, _ = await call(asgi, "POST", "/chat/1", [("stream-closed", "true")])
    assert status == 204 and head[p.CLOSED] == "true"
    assert (await call(asgi, "POST", "/chat/1", JSON, b"1"))[0] == 409
    tail = head[p.NEXT_OFFSET]
    with anyio.fail_after(2):
        status, head, _ = await call(asgi, "GET", "/chat/1", query=f"offset={tail}&live=long-poll")
    assert status == 204 and head[p.CLOSED] == "true"
    with anyio.fail_after(2):
        status, head, body = await call(asgi, "GET", "/chat/1", query=f"offset={p.offset_text(4)}&live=sse")
    events = body.decode()
    assert '"streamClosed":true' in events and '{"e":5}' in events

    # A fork reads its source below the fork point, then its own appends; deleting the source keeps it.
    fork = [("stream-forked-from", "/chat/1"), ("stream-fork-offset", p.offset_text(2))]
    assert (await call(asgi, "PUT", "/chat/fork", fork))[0] == 201
    assert (await call(asgi, "POST", "/chat/fork", JSON, b'"own"'))[0] == 204
    assert (await call(asgi, "DELETE", "/chat/1"))[0] == 204
    assert (await call(asgi, "GET", "/chat/1"))[0] == 410
    status, _, body = await call(asgi, "GET", "/chat/fork")
    assert json.loads(body) == [{"a": 1}, {"b": 2}, "own"]
    assert (await call(asgi, "DELETE", "/chat/fork"))[0] == 204
    assert (await call(asgi, "GET", "/chat/1"))[0] == 404  # the source went with its last fork

    # Python reads a free-standing stream too (what a workflow's step does).
    await call(asgi, "PUT", "/py", JSON, b'[1,2,3]')
    got = [m async for _, m in read_free_stream_async(app, "/py", live=False)]
    assert got == [1, 2, 3]


async def test_byte_stream_paging_and_base64_sse(app: pgflow.App) -> None:
    asgi = asgi_app(app)
    octets = [("content-type", "application/octet-stream")]
    assert (await call(asgi, "PUT", "/bin", octets))[0] == 201
    big = bytes(range(256)) * 4096  # 1 MiB
    for _ in range(3):
        assert (await call(asgi, "POST", "/bin", octets, big))[0] == 204
    read, offset, pages = b"", "-1", 0
    while True:
        status, head, body = await call(asgi, "GET", "/bin", query=f"offset={offset}")
        assert status == 200
        read += body
        pages += 1
        offset = head[p.NEXT_OFFSET]
        if head.get(p.UP_TO_DATE) == "true":
            break
    assert read == big * 3 and pages > 1  # large reads come in pages
    assert (await call(asgi, "POST", "/bin", [("stream-closed", "true")]))[0] == 204
    status, head, body = await call(asgi, "GET", "/bin", query=f"offset={p.offset_text(len(big) * 3)}&live=sse")
    assert head[p.SSE_ENCODING] == "base64" and b"streamClosed" in body


async def test_workflow_stream_in_json_mode(app: pgflow.App) -> None:
    gate = anyio.Event()

    @app.workflow()
    async def talk(n: int) -> None:
        for i in range(n):
            await pgflow.write_stream_async("tokens", {"i": i, "text": f"t{i}"})
        await gate.wait()
        await pgflow.write_stream_async("tokens", "last")
        await pgflow.close_stream_async("tokens")

    asgi = asgi_app(app)
    async with app.worker(concurrency=2):
        handle = await talk.start_async(3)
        path = f"/workflows/{handle.id}/tokens"
        with anyio.fail_after(10):
            while True:
                status, head, body = await call(asgi, "GET", path)
                if status == 200 and len(json.loads(body)) == 3:
                    break
                await anyio.sleep(0.05)
        assert json.loads(body) == [{"i": i, "text": f"t{i}"} for i in range(3)]
        assert head[p.NEXT_OFFSET] == p.offset_text(3) and p.CLOSED not in head
        assert (await call(asgi, "POST", path, JSON, b"1"))[0] == 405  # read-only
        assert (await call(asgi, "PUT", path, JSON))[0] == 405
        status, head, _ = await call(asgi, "HEAD", path)
        assert status == 200 and head[p.NEXT_OFFSET] == p.offset_text(3)

        async def release() -> None:
            await anyio.sleep(0.3)
            gate.set()

        async with anyio.create_task_group() as group:  # a long-poll at the tail waits for the next chunk
            group.start_soon(release)
            with anyio.fail_after(10):
                status, head, body = await call(asgi, "GET", path, query=f"offset={p.offset_text(3)}&live=long-poll")
        assert status == 200 and json.loads(body) == ["last"]
        _ = await handle.result_async(timeout=10)
        with anyio.fail_after(5):
            status, head, body = await call(asgi, "GET", path, query="offset=-1&live=sse")
        assert b'"last"' in body and b'"streamClosed":true' in body
        status, head, body = await call(asgi, "GET", path, query=f"offset={p.offset_text(4)}")
        assert json.loads(body) == [] and head[p.CLOSED] == "true"
    assert (await call(asgi, "GET", "/workflows/nobody/tokens"))[0] == 404


HOSTILE: list[tuple[str, str, list[tuple[str, str]], bytes, str]] = [
    ("GET", "/s", [], b"", "offset=abc"),
    ("GET", "/s", [], b"", "offset=1,2"),
    ("GET", "/s", [], b"", "offset="),
    ("GET", "/s", [], b"", "offset=-1&offset=now"),
    ("GET", "/s", [], b"", "offset=0000000000000000_9999999999999999999"),
    ("GET", "/s", [], b"", "offset=99999999999999999999999_1"),
    ("GET", "/s", [], b"", "live=sse"),
    ("GET", "/s", [], b"", "offset=-1&live=forever"),
    ("GET", "/s", [], b"", "offset=%ff%fe"),
    ("GET", "/s", [], b"", "a=" + "x" * 5000),
    ("GET", "/s", [], b"", "&".join(f"k{i}=v" for i in range(100))),
    ("GET", "/s", [], b"", "cursor=-5&offset=-1&live=long-poll"),
    ("PUT", "/t", [("content-type", "nonsense")], b"", ""),
    ("PUT", "/t", [("content-type", "a/b/c;;")], b"", ""),
    ("PUT", "/t", [("stream-ttl", "-1")], b"", ""),
    ("PUT", "/t", [("stream-ttl", "1e9")], b"", ""),
    ("PUT", "/t", [("stream-ttl", "9" * 40)], b"", ""),
    ("PUT", "/t", [("stream-expires-at", "tomorrow")], b"", ""),
    ("PUT", "/t", [("stream-expires-at", "2030-01-01T00:00:00")], b"", ""),
    ("PUT", "/t", [("stream-ttl", "5"), ("stream-expires-at", "2030-01-01T00:00:00Z")], b"", ""),
    ("PUT", "/t", [("stream-forked-from", "/nowhere")], b"", ""),
    ("PUT", "/t", [("stream-forked-from", "relative")], b"", ""),
    ("PUT", "/t", [("stream-fork-offset", "x")], b"", ""),
    ("PUT", "/t", [("stream-forked-from", "/s"), ("stream-fork-offset", "zz")], b"", ""),
    ("PUT", "/t", [("stream-forked-from", "/s"), ("stream-fork-offset", p.offset_text(10**9))], b"", ""),
    ("PUT", "/t", [("stream-forked-from", "/s"), ("stream-fork-sub-offset", "-1")], b"", ""),
    ("PUT", "/j", JSON, b"{not json", ""),
    ("PUT", "/j", JSON, b"[1,2", ""),
    ("PUT", "/j", JSON, b"\xff\xfe", ""),
    ("POST", "/s", JSON, b"", ""),
    ("POST", "/s", [], b"data", ""),
    ("POST", "/s", JSON, b"[]", ""),
    ("POST", "/s", JSON, b"[1,]", ""),
    ("POST", "/s", JSON, b"NaN", ""),
    ("POST", "/s", [*JSON, ("producer-id", "p")], b"1", ""),
    ("POST", "/s", [*JSON, ("producer-id", ""), ("producer-epoch", "0"), ("producer-seq", "0")], b"1", ""),
    ("POST", "/s", [*JSON, ("producer-id", "p"), ("producer-epoch", "-1"), ("producer-seq", "0")], b"1", ""),
    ("POST", "/s", [*JSON, ("producer-id", "p"), ("producer-epoch", str(2**60)), ("producer-seq", "0")], b"1", ""),
    ("POST", "/s", [*JSON, ("producer-id", "p"), ("producer-epoch", "0"), ("producer-seq", "x")], b"1", ""),
    ("POST", "/s", [*JSON, ("producer-id", "p\x01"), ("producer-epoch", "0"), ("producer-seq", "0")], b"1", ""),
    ("POST", "/s", [*JSON, ("stream-seq", "x" * 5000)], b"1", ""),
    ("POST", "/s", [("content-type", "text/plain")], b"x", ""),
    ("POST", "/s", [*JSON, ("content-length", "abc")], b"1", ""),
    ("POST", "/s", [*JSON, ("content-length", str(10**12))], b"1", ""),
    ("POST", "/nowhere", JSON, b"1", ""),
    ("PATCH", "/s", [], b"", ""),
    ("DELETE", "/nowhere", [], b"", ""),
    ("GET", "/", [], b"", ""),
    ("PUT", "/", [], b"", ""),
    ("GET", "/" + "a" * 2000, [], b"", ""),
    ("GET", "/a\x00b", [], b"", ""),
    ("GET", "/\udcff", [], b"", ""),
    ("GET", "/workflows/", [], b"", ""),
    ("GET", "/workflows/x", [], b"", ""),
    ("GET", "/workflows/" + "i" * 500 + "/k", [], b"", ""),
    ("GET", "/workflows/id/" + "k" * 5000, [], b"", ""),
    ("GET", "/workflows/id/k", [], b"", "offset=bad"),
    ("POST", "/workflows/id/k", JSON, b"1", ""),
    ("DELETE", "/workflows/id/k", [], b"", ""),
]


async def test_hostile_requests_are_4xx(app: pgflow.App) -> None:
    asgi = asgi_app(app, max_body=1024)
    assert (await call(asgi, "PUT", "/s", JSON, b"[1]"))[0] == 201
    statuses = []
    for method, path, headers, body, query in HOSTILE:
        status, _, text = await call(asgi, method, path, headers, body, query)
        statuses.append(status)
        assert status < 500, (method, path, headers, body[:40], query, status, text[:200])
    assert sum(400 <= s < 500 for s in statuses) >= len(HOSTILE) - 1  # (a cursor of -5 is only ignored)
    # Too big, declared or not: 413, and nothing half-written.
    assert (await call(asgi, "POST", "/s", JSON, b"[" + b"1," * 2000 + b"1]"))[0] == 413
    assert (await call(asgi, "POST", "/s", JSON, chunks=[b"[1,", b"2," * 1000, b"3]"]))[0] == 413
    many = asgi_app(app)  # (the default bound on bytes) more messages in one request than one transaction takes
    assert (await call(many, "POST", "/s", JSON, b"[" + b"1," * p.MAX_MESSAGES + b"1]"))[0] == 413
    status, _, body = await call(asgi, "GET", "/s")
    assert status == 200 and json.loads(body) == [1]
    # The Host rule (DNS rebinding) and the token.
    assert (await call(asgi, "GET", "/s", host="evil.example"))[0] == 421
    guarded = asgi_app(app, token="t" * 24)
    assert (await call(guarded, "GET", "/s"))[0] == 401
    assert (await call(guarded, "GET", "/s", [("authorization", "Bearer wrong-token-here")]))[0] == 401
    assert (await call(guarded, "GET", "/s", [("authorization", "Bearer " + "t" * 24)]))[0] == 200
    # A browser page from another origin is refused unless named.
    assert (await call(asgi, "POST", "/s", [*JSON, ("origin", "https://evil.example")], b"2"))[0] == 403
    allowed = asgi_app(app, cors=["https://app.example"])
    status, head, _ = await call(allowed, "OPTIONS", "/s", [("origin", "https://app.example")])
    assert status == 204 and "if-none-match" in head["access-control-allow-headers"]
    assert head["access-control-allow-origin"] == "https://app.example"


async def test_streams_survive_a_postgres_restart(app: pgflow.App, restartable: Any) -> None:
    asgi = asgi_app(app)
    assert (await call(asgi, "PUT", "/kept", JSON, b"[1,2]"))[0] == 201
    producer = [*JSON, ("producer-id", "p"), ("producer-epoch", "0"), ("producer-seq", "0")]
    assert (await call(asgi, "POST", "/kept", producer, b"3"))[0] == 200
    await anyio.to_thread.run_sync(restartable.restart)
    with anyio.fail_after(30):  # the pool reconnects; requests during the restart may fail, none half-writes
        while True:
            status, _, body = await call(asgi, "GET", "/kept")
            if status == 200:
                break
            await anyio.sleep(0.2)
    assert json.loads(body) == [1, 2, 3]
    assert (await call(asgi, "POST", "/kept", producer, b"3"))[0] == 204  # the producer's state survived too
    status, _, body = await call(asgi, "GET", "/kept")
    assert json.loads(body) == [1, 2, 3]


async def test_expired_streams_answer_404_and_are_pruned(app: pgflow.App) -> None:
    asgi = asgi_app(app)
    assert (await call(asgi, "PUT", "/short", [("stream-ttl", "1")]))[0] == 201
    assert (await call(asgi, "PUT", "/gone", [("stream-expires-at", "2001-01-01T00:00:00Z")]))[0] == 201
    assert (await call(asgi, "PUT", "/keep", [("stream-ttl", "3600")]))[0] == 201
    assert (await call(asgi, "GET", "/gone"))[0] == 404  # expired: deleted by the request that found it
    await anyio.sleep(1.2)
    store = await app._internals().runtime().store()
    assert await prune_expired_streams(store) == 1  # /short, which nobody asked for since
    assert (await call(asgi, "PUT", "/brief", [("stream-expires-at", "2001-01-01T00:00:00Z")]))[0] == 201
    await app.prune_async(timedelta(days=1))  # a user's prune deletes the expired streams too
    async with await psycopg.AsyncConnection.connect(store.pool.conninfo, autocommit=True) as conn:
        cur = await conn.execute(f'SELECT path FROM "{app.schema}".free_streams ORDER BY path')
        assert [row[0] for row in await cur.fetchall()] == ["/keep"]
    statements = store.free_streams
    assert await statements.get("/short") is None
    assert await statements.get("/keep") is not None
