"""pgflow in one minute: a worker process streams a durable workflow's output, dies, and another
worker carries on.

    make demo                       # or: .venv/bin/python examples/demo.py

1. starts a real worker process: ``python -m pgflow worker examples.summarize:app --lease 2``
2. starts the ``summarize`` workflow on a file in examples/data/ and prints its streamed summary,
   word by word, as the worker commits it (``handle.stream("summary")``)
3. halfway through, kills that worker with SIGKILL and starts another; the reader, still attached,
   sees the stream carry on where it stopped once the dead worker's 2-second lease runs out
4. prints the step journal (no finished step ran twice) and the result, then stops the worker
   with SIGTERM

The database is $PGFLOW_DSN (schema $PGFLOW_SCHEMA, default "pgflow") when set, otherwise the embedded
PostgreSQL under ./.pgflow, which this process and the workers share: the first to need it starts
it, the last to exit stops it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.chdir(ROOT)  # so that ./.pgflow and the file path below mean the same thing here and in the worker
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

import pgflow  # noqa: E402
from examples.summarize import app, summarize  # noqa: E402
from pgflow.terminal import styled  # noqa: E402

DOCUMENT = "examples/data/crash-recovery.md"
KILL_AFTER = 30  # streamed words before the first worker is killed
LEASE = 2.0  # seconds before a dead worker's workflow is taken over


def where() -> str:
    dsn = os.environ.get("PGFLOW_DSN")
    if not dsn:
        return "embedded PostgreSQL in ./.pgflow"
    info = psycopg.conninfo.conninfo_to_dict(dsn)  # shown without the password
    return f"PostgreSQL at {info.get('host', 'localhost')}:{info.get('port', 5432)}/{info.get('dbname', '')}"


def start_worker() -> subprocess.Popen[bytes]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.Popen(
        [sys.executable, "-m", "pgflow", "--log-level", "WARNING", "worker", "examples.summarize:app",
         "--concurrency", "4", "--lease", str(LEASE), "--grace", "10"],
        cwd=ROOT, env=env,
    )


def stop_worker(worker: subprocess.Popen[bytes]) -> int:
    """SIGTERM: the worker stops claiming and gives running workflows up to its --grace to finish."""
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    return worker.returncode


def say(text: str) -> None:
    """The demo's own lines, dimmed on a terminal (plain in a file or a pipe, or under NO_COLOR)."""
    print(f"\n{styled(f'[demo] {text}', '2')}", flush=True)


def main() -> int:
    print(f"pgflow demo: {where()}, schema {app.schema!r}")
    workers: list[subprocess.Popen[bytes]] = []
    try:
        version = app.migrate()  # starts the embedded server first, so the workers join it
        workers.append(start_worker())
        say(f"schema at version {version}; worker process {workers[0].pid} started")
        began = time.monotonic()
        handle = summarize.start(DOCUMENT, sentences_per_section=1)
        say(f"started workflow {handle.id}; its stream, as committed:")

        words = 0
        killed_at: float | None = None
        resumed_after: float | None = None
        for token in handle.stream("summary"):
            if killed_at is not None and resumed_after is None:
                resumed_after = time.monotonic() - killed_at
                say(f"stream resumed {resumed_after:.1f}s after the kill, on worker {workers[1].pid}")
            print(token, end="", flush=True)
            words += 1
            if words == KILL_AFTER:
                workers[0].send_signal(signal.SIGKILL)
                workers[0].wait()
                killed_at = time.monotonic()
                workers.append(start_worker())
                say(f"killed worker {workers[0].pid} with SIGKILL mid-stream; started worker "
                    f"{workers[1].pid}, which takes over once the {LEASE:.0f}s lease runs out")

        try:
            result = handle.result(timeout=30)
        except (pgflow.WorkflowFailed, pgflow.WorkflowCancelled) as exc:
            say(str(exc))
            return 1
        say(f"succeeded in {time.monotonic() - began:.1f}s; the journal (each finished step ran once):")
        for step in handle.steps():
            tries = "attempt" if step.attempts == 1 else "attempts"
            print(f"  step {step.position}  {step.name:<18} {step.attempts} {tries}")
        print(f"\n\"{result.title}\": {result.words} words, {len(result.sections)} sections; "
              f"keywords: {', '.join(result.keywords)}")
        first = result.sections[0]
        print(textwrap.fill(first.sentences[0], width=96, initial_indent="  > ", subsequent_indent="    "))
        return 0
    finally:
        for worker in workers:
            stop_worker(worker)
        if workers:
            say(f"workers stopped (exit codes {', '.join(str(w.returncode) for w in workers)})")
        app.close()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
