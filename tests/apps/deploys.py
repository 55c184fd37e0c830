"""One workflow in four versions of its code, for the tests of safe deploys (``patched``,
``deprecate_patch``, ``check-replay``). ``PGFLOW_TEST_CODE`` picks the version a process imports:

- ``v1``: a, sleep, b
- ``v2``: a, then c behind ``patched("c-first")``, sleep, b
- ``v2bad``: a, c, sleep, b (the same change without the patch: old journals do not replay)
- ``v3``: a, ``deprecate_patch("c-first")``, c, sleep, b (the old path gone)

Each comes as an ``async def`` workflow and as a ``def`` one. Steps note their calls in the file
``notes`` names (one line each, with the pid), so a test counts what ran where.
"""

from __future__ import annotations

import os

import pgflow

app = pgflow.App(suspend_after=0.5, poll_interval=0.2)  # env-configured; connects lazily
CODE = os.environ.get("PGFLOW_TEST_CODE", "v1")


def note(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{line}:{os.getpid()}\n")


@app.step(name="deploys.a")
def a(notes: str, x: int) -> int:
    note(notes, f"a:{x}")
    return x + 1


@app.step(name="deploys.b")
def b(notes: str, x: int) -> int:
    note(notes, f"b:{x}")
    return x * 10


@app.step(name="deploys.c")
def c(notes: str, x: int) -> int:
    note(notes, f"c:{x}")
    return x + 100


@app.workflow(name="deploys.flow")
async def flow(notes: str, x: int, nap: float) -> int:
    y = await a(notes, x)
    if CODE == "v2" and pgflow.patched("c-first"):
        y = await c(notes, y)
    elif CODE == "v2bad":
        y = await c(notes, y)
    elif CODE == "v3":
        pgflow.deprecate_patch("c-first")
        y = await c(notes, y)
    await pgflow.sleep_async(nap)
    return await b(notes, y)


@app.workflow(name="deploys.flow_sync")
def flow_sync(notes: str, x: int, nap: float) -> int:
    y = a(notes, x)
    if CODE == "v2" and pgflow.patched("c-first"):
        y = c(notes, y)
    elif CODE == "v2bad":
        y = c(notes, y)
    elif CODE == "v3":
        pgflow.deprecate_patch("c-first")
        y = c(notes, y)
    pgflow.sleep(nap)
    return b(notes, y)
