"""Fan-out / fan-in with child workflows: index a document one section per child, then merge.

    python examples/fanout.py [examples/data/crash-recovery.md]

The ``fanout.document`` workflow splits the file into its ``## `` sections (a step), starts one
``fanout.section`` child workflow per section, and gathers their results with ``asyncio.gather`` over
``result_async``. Each child runs an ``index`` step that fails on its first attempt (a simulated busy
service; ``FANOUT_FAILURES`` sets how many attempts fail, 1 by default) and is retried with backoff.
The process runs its own worker; the database is $PGFLOW_DSN, or the embedded PostgreSQL in ./.pgflow.

What holds:

- A child started from a workflow body gets an id derived from its parent's id and the call's
  position, so a parent replayed after a crash finds the children it started instead of starting
  them again. (Start children one by one like this, not with ``start_many``, whose ids are random
  unless you pass ``ids=``.)
- Children are ordinary workflows: any worker runs them, in parallel. A parent waiting in
  ``result_async`` holds its worker slot, so give the worker more slots than parents.
- A child that fails makes its ``result_async`` raise ``pgflow.WorkflowFailed``; uncaught, the parent
  fails with it (catch it to carry on without that child). Cancelling the parent cancels the
  children that have not ended.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pgflow

app = pgflow.App()  # $PGFLOW_DSN (and $PGFLOW_SCHEMA), or the embedded PostgreSQL under ./.pgflow

FAILURES = int(os.environ.get("FANOUT_FAILURES", "1"))  # failing first attempts of each index step
DOCUMENT = Path(__file__).resolve().parent / "data" / "crash-recovery.md"


@app.step(name="fanout.split")
def split(path: str) -> list[tuple[str, str]]:
    """(title, text) of each ``## `` section of a Markdown file."""
    sections: list[tuple[str, str]] = []
    for chunk in re.split(r"^## ", Path(path).read_text(encoding="utf-8"), flags=re.MULTILINE)[1:]:
        title, _, text = chunk.partition("\n")
        sections.append((title.strip(), " ".join(text.split())))
    return sections


@app.step(name="fanout.index", max_attempts=FAILURES + 2, backoff=0.2, retry_on=(ConnectionError,))
async def index(text: str) -> dict[str, int]:
    """How often each word of four letters or more occurs. Raises ConnectionError on the first
    ``FAILURES`` attempts: retried after 0.2 s, then 0.4 s, ..., as ``retry_on`` allows."""
    if pgflow.step_attempt() <= FAILURES:
        raise ConnectionError(f"index service busy (simulated), attempt {pgflow.step_attempt()}")
    return dict(Counter(re.findall(r"[a-z][a-z'-]{3,}", text.lower())))


@app.workflow(name="fanout.section")
async def index_section(title: str, text: str) -> dict[str, int]:
    return await index(text)


@app.workflow(name="fanout.document")
async def index_document(path: str) -> dict[str, Any]:
    sections = await split(path)
    # Fan out: one child per section, started from the body (idempotent across replays, see above).
    children = [await index_section.start_async(title, text) for title, text in sections]
    # Fan in: the children run in parallel on any worker; wait for them all.
    counts = await asyncio.gather(*(child.result_async() for child in children))
    total: Counter[str] = Counter()
    for count in counts:
        total.update(count)
    return {"sections": len(sections), "words": sum(total.values()),
            "top": [word for word, _ in sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))[:8]],
            "children": [child.id for child in children]}


async def main(path: str) -> int:
    try:
        async with app.worker(concurrency=8):
            handle = await index_document.start_async(path)
            print(f"started {handle.id} on {path}", flush=True)
            report = await handle.result_async(timeout=300)
            for child in report["children"]:
                steps = (await app.handle(child).info_async()).steps
                print(f"  child {child}: " + ", ".join(f"{s.name} {s.attempts} attempts" for s in steps))
        print(f"{report['sections']} sections, {report['words']} words; most frequent: {', '.join(report['top'])}")
        return 0
    except pgflow.WorkflowFailed as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        await app.close_async()


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else str(DOCUMENT))))
