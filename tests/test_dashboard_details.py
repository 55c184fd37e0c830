"""The workflow page tells the truth in its details: a finished workflow waits for nothing, children are
listed in the order they were started, and a stream's lines are numbered by their positions, from 0."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import psycopg
import pytest

import pgflow

from .test_dashboard_http import AUTH, TOKEN, WAIT, page, serving


@pytest.fixture
def serve(dsn: str, schema: str, app: pgflow.App) -> Iterator[Any]:
    yield from serving(dsn, schema, app)


def _fact(body: str, name: str) -> str:
    found = re.search(rf"<dt>{name}</dt><dd>(.*?)</dd>", body)
    assert found is not None, f"no {name!r} on the page"
    return found.group(1)


def test_the_workflow_page_waits_numbers_and_orders_as_the_workflow_did(
    serve: Any, app: pgflow.App, dsn: str, schema: str,
) -> None:
    served = serve(token=TOKEN)
    parent = app.start_by_name("dash.parent", 12)
    assert parent.result(timeout=WAIT) == sum(i * i for i in range(12))
    family = page(served.base, f"/workflow?id={quote(parent.id)}", **AUTH).body
    listed = [int(n) for n in re.findall(re.escape(parent.id) + r"\.(\d+)\b", family)]
    firsts = list(dict.fromkeys(listed))
    assert firsts == list(range(12)), firsts  # started order, not the ids' text order (0, 1, 10, 11, 2, ...)

    done, queued = f"{parent.id}.3", app.start_by_name("dash.nobody_runs_this").id
    with psycopg.connect(dsn, autocommit=True) as conn:  # the topic a row keeps after its last receive
        conn.execute(f'UPDATE "{schema}".workflows SET waiting_for = %s WHERE id = ANY(%s)',
                     ("approval", [done, queued]))
    assert _fact(page(served.base, f"/workflow?id={quote(done)}", **AUTH).body, "waiting for") == "-"
    assert _fact(page(served.base, f"/workflow?id={quote(queued)}", **AUTH).body, "waiting for") == "approval"

    writer = app.start_by_name("dash.writer", 3, 0.0)
    writer.result(timeout=WAIT)
    streamed = page(served.base, f"/workflow?id={quote(writer.id)}", **AUTH).body
    assert re.search(r'<ol start="0"', streamed), "a stream's first line is position 0"
    assert 'data-pos="0"' in streamed
