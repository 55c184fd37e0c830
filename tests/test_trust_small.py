"""Small matters of trust from a security review, each with the hostile or careless party it is about:
the user's application name kept on pgflow's connections, a test environment that drops only the schema
it made, recorded exception names that must stay data, and check-replay's exit codes."""

from __future__ import annotations

import os
import uuid

import anyio
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import pgflow

from .helpers import query

WAIT = 30.0


# -- the user's application_name --------------------------------------------------------------------------


def _named(dsn: str, form: str, name: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``dsn`` naming the application ``name`` in ``form``: in the URL, as key=value, or through PGAPPNAME."""
    if form == "url":
        return f"{dsn}{'&' if '?' in dsn else '?'}application_name={name}"
    if form == "keywords":
        return make_conninfo("", **{**conninfo_to_dict(dsn), "application_name": name})
    if form == "PGAPPNAME":
        monkeypatch.setenv("PGAPPNAME", name)
    return dsn


async def _names_of_this_process(dsn: str, name: str) -> list[str]:
    """The application names of this process's sessions: pgflow's own (by the pid in them) and the user's."""
    rows = await query(dsn, "SELECT application_name FROM pg_stat_activity WHERE pid <> pg_backend_pid()")
    pid = str(os.getpid())
    ours = [str(row[0]) for row in rows if row[0]]
    return sorted(n for n in ours if n == name or n.split(" ")[0].rsplit("-", 1)[-1] == pid and n.startswith("pgflow-"))


@pytest.mark.anyio
@pytest.mark.parametrize("form", ["url", "keywords", "PGAPPNAME", "none"])
async def test_the_users_application_name_is_kept_on_every_connection(
        dsn: str, schema: str, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGAPPNAME", raising=False)
    name = f"myapp-{uuid.uuid4().hex[:8]}"
    app = pgflow.App(_named(dsn, form, name, monkeypatch), schema=schema, poll_interval=0.5)
    app.workflow(name="trust.noop")(_noop)
    pid = os.getpid()
    maintenance = f"pgflow-maintenance-{pid}" + ("" if form == "none" else f" ({name})")
    try:
        async with app.worker():
            with anyio.fail_after(WAIT):  # the pool, the listener and the maintenance lock connection
                while True:
                    names = await _names_of_this_process(dsn, name)
                    wanted = {maintenance, f"pgflow-{pid}", f"pgflow-listener-{pid}"} if form == "none" else \
                        {maintenance, name}
                    if wanted <= set(names) and (form == "none" or names.count(name) >= 2):
                        break
                    await anyio.sleep(0.1)
            if form != "none":  # nothing of pgflow's own names replaced the user's
                assert set(names) == {name, maintenance}, names
            health = await app.health_async()  # and `pgflow status` still knows the worker's lock connection
            assert any(holder.worker for holder in health.maintenance), health.maintenance
    finally:
        await app.close_async()


async def _noop() -> None:
    return None
