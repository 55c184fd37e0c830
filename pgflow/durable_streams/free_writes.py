"""The write path of free-standing streams: PUT (create, or fork), POST (append, close), DELETE.

An append is group-committed with the others that arrive meanwhile (``FreeStreamsAccess.appends``:
one transaction for the batch); once it commits, it is handed to this process's live readers of its
stream and its stream's key is pinged so that waiting readers look again (``FreeStreamsAccess.publish``).
The headers of a fork (``Stream-Forked-From``...) and of an idempotent producer (``Producer-Id``...)
are read here.
"""

from __future__ import annotations

from urllib.parse import quote

from .._core.engine.free_appends import Append, Appended, Producer
from .._core.engine.free_streams import Created, Fork, FreeStream
from . import protocol as p
from .free_access import FreeStreamsAccess, ping_key
from .http import Receive, Request, Send, answer, read_body
from .protocol import Refused


class FreeWrites(FreeStreamsAccess):
    """The handlers of PUT, POST and DELETE."""

    async def delete(self, request: Request, send: Send) -> None:
        outcome = await self.db(lambda s: s.delete(request.path))
        if outcome == "missing":
            raise Refused(404, "no stream at this path")
        if outcome == "gone":
            raise Refused(410, "this stream was deleted (forks of it still read its data)")
        self.ping(request.path)
        await answer(send, 204, {})

    # -- PUT ------------------------------------------------------------------------------------------

    async def create(self, request: Request, receive: Receive, send: Send) -> None:
        headers = request.headers
        media = p.content_type(headers.get("content-type"))
        ttl, expires_at = p.expiry(headers)
        fork = _fork(headers)
        close = p.closing(headers)
        body = await read_body(receive, headers, self.max_body)
        if fork is not None and media is None:
            source = await self.db(lambda s: s.get(fork.source))
            media = source.content_type if source is not None else "application/octet-stream"
        media = media or "application/octet-stream"
        json_mode = p.is_json(media)
        units = (p.json_messages(body, allow_empty=True) if json_mode else [body]) if body else []
        created: Created = await self.db(lambda s: s.create(request.path, media, ttl, expires_at, close, json_mode,
                                                            units, fork))
        stream = created.stream
        if created.outcome == "no_source":
            raise Refused(404, "Stream-Forked-From names no stream")
        if created.outcome in ("source_gone", "gone"):
            raise Refused(409, "that stream was deleted (forks of it still read its data): its path stays taken"
                          if created.outcome == "gone" else "the source stream was deleted: it cannot be forked")
        if created.outcome == "bad_offset":
            raise Refused(400, created.reason)
        if created.outcome == "conflict":
            raise Refused(409, created.reason or "a stream exists at this path with another configuration"
                          " (content type, TTL, expiry, closure or fork)")
        assert stream is not None
        if created.outcome == "created" and units:
            self.ping(request.path)
        out = {"content-type": stream.content_type, p.NEXT_OFFSET: p.offset_text(stream.tail)}
        if stream.closed:
            out[p.CLOSED] = "true"
        if created.outcome == "created":
            out["location"] = _location(request)
        await answer(send, 201 if created.outcome == "created" else 200, out)

    # -- POST -----------------------------------------------------------------------------------------

    async def append(self, request: Request, receive: Receive, send: Send) -> None:
        headers = request.headers
        producer = _producer(headers)
        seq = p.text_header(headers, p.SEQ)
        close = p.closing(headers)
        media = p.content_type(headers.get("content-type"))
        body = await read_body(receive, headers, self.max_body)
        if not body and not close:
            raise Refused(400, "an append needs a body (or Stream-Closed: true to close the stream)")
        if body and media is None:
            raise Refused(400, "an append with a body needs its Content-Type")

        def units_of(stream: FreeStream) -> list[bytes]:
            if not body:
                return []
            if p.is_json(stream.content_type) and media is not None and p.is_json(media):
                return p.json_messages(body, allow_empty=False)
            return [body]

        append = Append(request.path, media, bool(body), units_of, close, seq, producer)
        if producer is None:
            done = await self.appends.submit(append)
        else:  # (it may have overtaken an earlier append of its producer on the way here)
            waiters = self.app._internals().runtime().signals.waiters
            done = await self.overtaking.judged(append, waiters, ping_key(request.path))
        await self._appended(done, producer, send, not body)

    async def _appended(self, done: Appended, producer: Producer | None, send: Send,
                        appended_nothing: bool) -> None:
        stream = done.stream
        outcome = done.outcome
        if outcome == "missing":
            raise Refused(404, "no stream at this path: PUT creates one")
        if outcome == "gone":
            raise Refused(410, "this stream was deleted (forks of it still read its data)")
        assert stream is not None
        tail = {p.NEXT_OFFSET: p.offset_text(stream.tail)}
        if stream.closed:
            tail[p.CLOSED] = "true"
        if outcome == "closed":
            raise Refused(409, "the stream is closed: it takes no more appends", tail)
        if outcome == "type":
            raise Refused(409, f"the stream's content type is {stream.content_type}")
        if outcome == "seq":
            raise Refused(409, "Stream-Seq must be greater than the last one (compared as text)")
        if outcome == "stale_epoch":
            raise Refused(403, "a newer epoch of this producer has written: this one is fenced",
                          {p.PRODUCER_EPOCH: str(done.epoch)})
        if outcome == "epoch_seq":
            raise Refused(400, "a new Producer-Epoch starts at Producer-Seq 0")
        if outcome == "gap":
            raise Refused(409, f"Producer-Seq {producer.seq if producer else 0} skips ahead: expected {done.expected}",
                          {p.EXPECTED_SEQ: str(done.expected),
                           p.RECEIVED_SEQ: str(producer.seq if producer else 0)})
        if producer is not None:
            tail[p.PRODUCER_EPOCH] = str(done.epoch)
            tail[p.PRODUCER_SEQ] = str(done.seq)
        if outcome == "ok":  # (published, and its stream pinged, as it committed: FreeStreamsAccess.publish)
            await answer(send, 200 if producer is not None and not appended_nothing else 204, tail)
            return
        await answer(send, 204, tail)  # a duplicate: already there

def _location(request: Request) -> str:
    """The new stream's absolute URL (what a 201's Location is), from the Host the client used."""
    return f"{request.scheme}://{request.headers.get('host', 'localhost')}{quote(request.path)}"


def _fork(headers: dict[str, str]) -> Fork | None:
    source = p.text_header(headers, p.FORKED_FROM)
    offset, sub = headers.get(p.FORK_OFFSET), headers.get(p.FORK_SUB_OFFSET)
    if source is None:
        if offset is not None or sub is not None:
            raise Refused(400, "Stream-Fork-Offset and Stream-Fork-Sub-Offset need Stream-Forked-From")
        return None
    if not source.startswith("/"):
        raise Refused(400, "Stream-Forked-From is the path of a stream of this server, /...")
    anchor = p.parse_offset(offset.strip(), what="Stream-Fork-Offset") if offset is not None else None
    sub_value = p.decimal(sub, "Stream-Fork-Sub-Offset", p.MAX_POSITION) if sub is not None else 0
    if sub_value and anchor is None:
        raise Refused(400, "Stream-Fork-Sub-Offset needs Stream-Fork-Offset")
    return Fork(source, anchor, sub_value)


def _producer(headers: dict[str, str]) -> Producer | None:
    given = [headers.get(n) for n in (p.PRODUCER_ID, p.PRODUCER_EPOCH, p.PRODUCER_SEQ)]
    if all(v is None for v in given):
        return None
    if any(v is None for v in given):
        raise Refused(400, "Producer-Id, Producer-Epoch and Producer-Seq go together: give all three or none")
    producer_id = p.text_header(headers, p.PRODUCER_ID)
    if not producer_id or not producer_id.strip():
        raise Refused(400, "Producer-Id is empty")
    epoch = p.decimal(given[1] or "", "Producer-Epoch", p.MAX_SAFE)
    seq = p.decimal(given[2] or "", "Producer-Seq", p.MAX_SAFE)
    return Producer(producer_id, epoch, seq)
