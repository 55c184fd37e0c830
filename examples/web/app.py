"""A web page that starts a durable workflow, shows its output live and asks a human to approve it.

    pip install 'pgflow[web,embedded]'      # or, in this repository: make venv
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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

import pgflow

app = pgflow.App()  # $PGFLOW_DSN (and $PGFLOW_SCHEMA), or the embedded PostgreSQL under ./.pgflow
log = logging.getLogger("web")

DELAY = float(os.environ.get("WEB_TOKEN_DELAY", "0.08"))
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


async def start(request: Request) -> Response:
    form = parse_qs((await request.body()).decode())  # a plain urlencoded form: no python-multipart needed
    handle = await answer.start_async(form.get("prompt", [""])[0][:200])
    return RedirectResponse(f"/runs/{handle.id}", status_code=303)


async def run(request: Request) -> pgflow.WorkflowHandle[Any] | None:
    """The handle of the run named in the URL, or None when there is no such workflow."""
    handle = app.handle(request.path_params["id"])
    try:
        await handle.status_async()
    except pgflow.UnknownWorkflow:
        return None
    return handle


def not_found() -> Response:
    return JSONResponse({"error": "no such run"}, status_code=404)


async def run_page(request: Request) -> Response:
    handle = await run(request)
    return HTMLResponse(PAGE.replace("{{run}}", handle.id)) if handle else HTMLResponse("no such run", 404)


async def tokens(request: Request) -> Response:
    """The stream as SSE. ``Last-Event-ID`` (sent by a reconnecting EventSource) is the last position
    the client has, so it resumes at the next one."""
    handle = await run(request)
    if handle is None:
        return not_found()  # an EventSource stops reconnecting on an error status
    last = request.headers.get("last-event-id", "")
    offset = int(last) + 1 if last.isdigit() else 0
    log.info("tokens of %s from position %d (Last-Event-ID %r)", handle.id, offset, last or None)
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
    if handle is None:
        return not_found()
    status = await handle.status_async()
    body: dict[str, Any] = {"status": status,  # events: None until the workflow sets them
                            "progress": await handle.get_event_async("progress", timeout=0),
                            "stage": await handle.get_event_async("stage", timeout=0)}
    if status == "succeeded":
        body["result"] = await handle.result_async()
    return JSONResponse(body)


async def approval(request: Request) -> Response:
    """Deliver the human's decision to the workflow. The idempotency key makes a second click (or a
    retried POST) deliver nothing more: the first decision is the one the workflow gets."""
    handle = await run(request)
    if handle is None:
        return not_found()
    try:
        body = await request.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("approved"), bool):
        return JSONResponse({"error": 'send {"approved": true} or {"approved": false}'}, status_code=400)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--no-worker", action="store_true", help="only serve the page; workers run elsewhere")
    parser.add_argument("--cut-after", type=int, metavar="N", help="end each SSE response after N events")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    log.setLevel(logging.INFO)
    app.migrate()  # before serving: starts the embedded server if that is the database
    print(f"pgflow web example on http://{args.host}:{args.port} (schema {app.schema!r})", flush=True)
    uvicorn.run(web_app(worker=not args.no_worker, cut_after=args.cut_after), host=args.host, port=args.port,
                log_level="warning", timeout_graceful_shutdown=2)
    app.close()  # the connections that migrate() opened
    return 0


if __name__ == "__main__":
    sys.exit(main())
