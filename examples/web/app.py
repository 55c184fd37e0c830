"""A web page that starts a durable workflow, shows its output live and asks a human to approve it.

    pip install 'pgflow-durable[web]'      # or, in this repository: make venv
    python examples/web/app.py              # then open http://127.0.0.1:8000

One process serves the page (Starlette on uvicorn) and runs an in-process pgflow worker, against
$PGFLOW_DSN or else the embedded PostgreSQL under ./.pgflow. With ``--no-worker`` it only serves the
page, and workers run elsewhere: ``pgflow worker examples.web.app:app``.

What it shows:

- **Streams over Server-Sent Events.** A fake language model (the ``generate`` step) writes the words
  of its answer one by one with ``pgflow.write_stream_async``. ``GET /runs/{id}/tokens`` relays them
  as SSE, each event's ``id:`` being the chunk's stream position. When the connection drops, the
  browser's EventSource reconnects by itself and sends the last id it saw as ``Last-Event-ID``; the
  server carries on from the next position, so the page shows every word once, in order.
- **Events.** After each sentence the workflow publishes ``set_event_async("progress", fraction)``,
  and its "stage" before it waits; the page polls ``GET /runs/{id}/state``, which reads them with
  ``handle.get_event_async``.
- **Messages.** The workflow then waits with ``recv_async("approval")``; the page's Approve and Reject
  buttons POST to ``/runs/{id}/approval``, which calls ``handle.send_async``. The wait is durable: stop
  this process, start it again, and the workflow still waits for (and gets) its decision.

``--cut-after N`` ends every SSE response after N events, to watch the page resume (the browser test,
tests/test_web_browser.py, uses it). ``WEB_TOKEN_DELAY`` is the seconds between two words (0.08).

Any page on the web can make the browser send requests here, so the server refuses what its own page
does not send: POSTs from another origin or of another content type, bodies over 16 KiB, ids that
cannot be workflow ids, Last-Event-IDs that are not stream positions (tests/test_web_hardening.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import html
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import parse_qs

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

import pgflow

app = pgflow.App()  # $PGFLOW_DSN (and $PGFLOW_SCHEMA), or the embedded PostgreSQL under ./.pgflow
log = logging.getLogger("web")

DELAY = float(os.environ.get("WEB_TOKEN_DELAY", "0.08"))
MAX_BODY = 16 * 1024  # bytes: a decision is a few, a prompt a few hundred
LAST_POSITION = 2**31 - 2  # positions are int4, and a reader resumes at the one after Last-Event-ID
PAGE = Path(__file__).with_name("page.html").read_text(encoding="utf-8")
ANSWER = (
    "Durable workflows keep their progress in the database. Each finished step is journaled, so a crash "
    "costs only the step that was running. Streams are journaled too: every word you see here was "
    "committed before it was sent. Drop the connection and the page picks up where it stopped. Now it "
    "is your turn: approve or reject this answer."
)


def answer_for(prompt: str) -> list[str]:
    """The fake model's answer to ``prompt``, one sentence per item."""
    return [f"You asked: {prompt.strip() or 'nothing'}", *(s.strip() + "." for s in ANSWER.split(".") if s.strip())]


# -- the workflow -------------------------------------------------------------------------------------


@app.step(name="web.generate", max_attempts=3, backoff=0.2)
async def generate(sentence: str) -> int:
    """Stream one sentence word by word, as a model sends its tokens. A retried attempt skips the words
    an earlier attempt already committed (``stream_offset``), so readers never see one twice."""
    words = sentence.split()
    for word in words[pgflow.stream_offset("tokens"):]:
        await asyncio.sleep(DELAY)
        await pgflow.write_stream_async("tokens", word)
    return len(words)


@app.workflow(name="web.answer")
async def answer(prompt: str) -> dict[str, Any]:
    sentences = answer_for(prompt)
    words = 0
    for done, sentence in enumerate(sentences, 1):
        words += await generate(sentence)
        await pgflow.set_event_async("progress", done / len(sentences))
    await pgflow.close_stream_async("tokens")
    await pgflow.set_event_async("stage", "awaiting approval")
    # Waits for a human: a message sent to this workflow, consumed once, the receipt journaled. A wait
    # this long gives the worker slot back: meanwhile the workflow is "queued", and no worker holds it.
    decision = await pgflow.recv_async("approval", timeout=24 * 3600)
    if decision is None:
        return {"decision": "expired", "words": words}
    return {"decision": "approved" if decision.get("approved") else "rejected", "words": words}


# -- the web server -----------------------------------------------------------------------------------


async def home(request: Request) -> Response:
    return HTMLResponse(PAGE.replace("{{run}}", ""))


async def posted(request: Request, content_type: str) -> bytes:
    """The body of a POST that this server's own page sent. Another site's page can make the browser
    POST here too, without asking first, but only with that site's Origin and a form or text/plain
    content type: so a foreign Origin is refused, and any content type but ``content_type``. The
    body is read as it arrives, so no client makes the server hold more than MAX_BODY bytes of it."""
    origin = request.headers.get("origin")  # sent by browsers on every POST, absent from curl's
    if origin is not None and origin != f"{request.url.scheme}://{request.url.netloc}":
        raise HTTPException(403, "a request from another site's page")
    if request.headers.get("content-type", "").partition(";")[0].strip().lower() != content_type:
        raise HTTPException(415, f"send {content_type}")
    too_large = HTTPException(413, f"a body is at most {MAX_BODY} bytes")
    # Refused before a byte of the body is read. (uvicorn lets only digits through; the length
    # test spares int() a number of thousands of them from a server that lets those through too.)
    declared = request.headers.get("content-length")
    if declared is not None and (len(declared) > 9 or int(declared) > MAX_BODY):
        raise too_large
    body = bytearray()
    async for chunk in request.stream():  # a chunked body has no length to check beforehand
        body += chunk
        if len(body) > MAX_BODY:
            raise too_large
    return bytes(body)


async def start(request: Request) -> Response:
    # A plain urlencoded form: no python-multipart needed.
    form = parse_qs((await posted(request, "application/x-www-form-urlencoded")).decode(errors="replace"))
    handle = await answer.start_async(form.get("prompt", [""])[0][:200])
    return RedirectResponse(f"/runs/{handle.id}", status_code=303)


async def run(request: Request) -> pgflow.WorkflowHandle[Any]:
    """The handle of the run named in the URL; 400 for what cannot be a workflow id (too long, a
    NUL), which ``app.handle`` refuses, and 404 for a workflow that does not exist."""
    try:
        handle = app.handle(request.path_params["id"])
    except ValueError:
        raise HTTPException(400, "not a workflow id") from None
    try:
        await handle.status_async()
    except pgflow.UnknownWorkflow:
        raise HTTPException(404, "no such run") from None
    return handle


async def run_page(request: Request) -> Response:
    handle = await run(request)
    # Ids are any text, so one made elsewhere may be markup: escaped, quotes too, in its attribute.
    return HTMLResponse(PAGE.replace("{{run}}", html.escape(handle.id, quote=True)))


def last_event_id(request: Request) -> int:
    """The last position a reconnecting EventSource has, -1 for a first connection. Only ASCII
    digits: ``str.isdigit()`` takes "²", which ``int()`` refuses, and ``int()`` takes "1_0"."""
    last = request.headers.get("last-event-id", "")
    if not last:
        return -1
    if not (last.isascii() and last.isdigit() and len(last) <= 10 and int(last) <= LAST_POSITION):
        raise HTTPException(400, "Last-Event-ID is a stream position")
    return int(last)


async def tokens(request: Request) -> Response:
    """The stream as SSE. ``Last-Event-ID`` (sent by a reconnecting EventSource) is the last position
    the client has, so it resumes at the next one. (An EventSource stops reconnecting on an error
    status, such as the 404 of a run that does not exist.)"""
    handle = await run(request)
    last = request.headers.get("last-event-id")
    offset = last_event_id(request) + 1
    log.info("tokens of %s from position %d (Last-Event-ID %r)", handle.id, offset, last)
    cut_after: int | None = request.app.state.cut_after

    async def events() -> AsyncIterator[str]:
        yield "retry: 500\n\n"  # reconnect after 0.5 s instead of the browser's default of about 3 s
        sent = 0
        async for position, word in handle.stream_items_async("tokens", offset):
            yield f"id: {position}\ndata: {json.dumps(word)}\n\n"
            sent += 1
            if sent == cut_after:
                return  # the --cut-after knob: drop the connection; the browser reconnects
        yield "event: end\ndata: {}\n\n"  # closed, or the workflow ended: the page stops listening

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


async def state(request: Request) -> Response:
    """Status and progress, polled by the page."""
    handle = await run(request)
    status = await handle.status_async()
    body: dict[str, Any] = {"status": status,  # events: None until the workflow sets them
                            "progress": await handle.get_event_async("progress", timeout=0),
                            "stage": await handle.get_event_async("stage", timeout=0)}
    if status == "succeeded":
        body["result"] = await handle.result_async()
    return JSONResponse(body)


async def approval(request: Request) -> Response:
    """Deliver the human's decision to the workflow. The idempotency key makes a second click (or a
    retried POST) deliver nothing more: the first decision is the one the workflow gets, so only
    the page's own request may make it (``posted``)."""
    data = await posted(request, "application/json")
    handle = await run(request)
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("approved"), bool):
        raise HTTPException(400, 'send {"approved": true} or {"approved": false}')
    await handle.send_async("approval", {"approved": body["approved"]}, idempotency_key=f"{handle.id}:decision")
    return JSONResponse({"sent": True})


def web_app(*, worker: bool = True, cut_after: int | None = None) -> Starlette:
    """The Starlette app; with ``worker`` it also runs a pgflow worker on the server's event loop."""

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        try:
            if worker:
                async with app.worker(concurrency=16):
                    yield
            else:
                yield
        finally:
            await app.close_async()

    server = Starlette(lifespan=lifespan, routes=[
        Route("/", home),
        Route("/start", start, methods=["POST"]),
        Route("/runs/{id}", run_page),
        Route("/runs/{id}/tokens", tokens),
        Route("/runs/{id}/state", state),
        Route("/runs/{id}/approval", approval, methods=["POST"]),
    ])
    server.state.cut_after = cut_after
    return server


def exit_normally(signum: int, _: FrameType | None) -> None:
    """uvicorn shuts down on SIGTERM or Ctrl-C, then raises the signal again for the handler it
    found. Python's own handler of SIGTERM kills the process there, before the exit hook that stops
    the embedded PostgreSQL once its last user is gone, leaving the server running; this handler
    exits the usual way instead, through ``app.close()`` and the exit hooks (and without the
    traceback of a KeyboardInterrupt)."""
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--no-worker", action="store_true", help="only serve the page; workers run elsewhere")
    parser.add_argument("--cut-after", type=int, metavar="N", help="end each SSE response after N events")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    log.setLevel(logging.INFO)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, exit_normally)
    try:
        app.migrate()  # before serving: starts the embedded server if that is the database
        print(f"pgflow web example on http://{args.host}:{args.port} (schema {app.schema!r})", flush=True)
        uvicorn.run(web_app(worker=not args.no_worker, cut_after=args.cut_after), host=args.host,
                    port=args.port, log_level="warning", timeout_graceful_shutdown=2)
    finally:
        app.close()  # the connections that migrate() opened
    return 0


if __name__ == "__main__":
    sys.exit(main())
