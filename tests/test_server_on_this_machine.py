"""``App(server_on_this_machine=)`` / ``$PGFLOW_SERVER_ON_THIS_MACHINE``: whether the server shares this
machine's cores, which decides whether a worker's stream writer cuts writers in step into two cohorts
(``_core/streams/writer.py``). Given, it is what the worker goes by, whatever the guess from the
connection's address says; None (the default) keeps the guess (``connecting.on_this_machine``)."""

from __future__ import annotations

import pytest

import pgflow
from pgflow._core.engine.database import Database
from pgflow.errors import ConfigurationError

pytestmark = pytest.mark.anyio
VARIABLE = "PGFLOW_SERVER_ON_THIS_MACHINE"


async def test_the_setting_overrides_the_guess_both_ways(dsn: str, schema: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The test's servers are on this machine (a unix socket, 127.0.0.1), so the real guess says "here";
    a server elsewhere is stood for by a guess that says so. Each way, the setting wins and the guess is
    not even asked; unset, the guess decides."""
    monkeypatch.delenv(VARIABLE, raising=False)
    real_guess = Database.on_this_machine
    asked: list[bool] = []

    async def guess(self: Database, *, says: bool | None) -> bool:
        answer = await real_guess(self) if says is None else says
        asked.append(answer)
        return answer

    async def cohorts(setting: bool | None, guessed: bool | None) -> tuple[bool, list[bool]]:
        """Whether a worker of an App with ``setting`` cuts its writers into cohorts, when the guess
        says ``guessed`` (None: the real one), and what the guess answered."""
        asked.clear()

        async def patched(self: Database) -> bool:
            return await guess(self, says=guessed)

        monkeypatch.setattr(Database, "on_this_machine", patched)
        async with pgflow.App(dsn, schema=schema, server_on_this_machine=setting) as app:
            async with app.worker(concurrency=1, queues=["none"]) as worker:
                return worker._parts.writer.cohorts, list(asked)

    assert await cohorts(None, None) == (False, [True])  # the guess: here, so one batch a round
    assert await cohorts(False, None) == (True, [])  # said elsewhere: cohorts, though the guess says here
    assert await cohorts(None, False) == (True, [False])  # a guess of elsewhere
    assert await cohorts(True, False) == (False, [])  # said here: no cohorts, though the guess says elsewhere


async def test_the_variable_gives_the_setting_and_the_keyword_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """(Nothing connects: the resolved configuration is read.)"""
    async def setting(**given: bool | None) -> bool | None:
        async with pgflow.App("postgresql://nowhere.invalid/db", **given) as app:
            return (await app._internals().config()).server_on_this_machine

    monkeypatch.delenv(VARIABLE, raising=False)
    assert await setting() is None
    for said, meant in [("1", True), ("yes", True), (" TRUE ", True), ("off", False), ("0", False), ("auto", None),
                        ("", None)]:
        monkeypatch.setenv(VARIABLE, said)
        assert await setting() is meant, said
    monkeypatch.setenv(VARIABLE, "0")
    assert await setting(server_on_this_machine=True) is True
    monkeypatch.setenv(VARIABLE, "1")
    assert await setting(server_on_this_machine=False) is False
    monkeypatch.setenv(VARIABLE, "sometimes")
    with pytest.raises(ConfigurationError, match=f"{VARIABLE} is 1 or 0.*'sometimes'"):
        pgflow.App("postgresql://nowhere.invalid/db")
    with pytest.raises(ConfigurationError, match="server_on_this_machine is True, False or None"):
        pgflow.App("postgresql://nowhere.invalid/db", server_on_this_machine="yes")  # type: ignore[arg-type]
