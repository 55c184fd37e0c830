"""What pgflow sends, and expects of the server sessions, when its dsn is a transaction-mode pooler:
no pgbouncer needed here (tests/test_pgbouncer.py runs a real one)."""

from __future__ import annotations

import pytest

import pgflow
from pgflow._core.connecting import link_settings, missing_settings, server_settings
from pgflow._core.registry import Config

pytestmark = pytest.mark.anyio


def test_a_pooled_connection_is_sent_no_server_settings_and_a_session_one_all_of_them() -> None:
    dsn = "postgresql://u@pooler:6432/db"
    pooled = link_settings(dsn, 10.0, session=False)
    assert "options" not in pooled
    assert pooled["keepalives"] == 1 and pooled["connect_timeout"] == 10  # the client's end of the link stays
    direct = link_settings(dsn, 10.0)
    assert "search_path=pg_catalog,pg_temp" in direct["options"]
    assert "idle_in_transaction_session_timeout=10000" in direct["options"]


def test_config_is_pooled_only_when_listen_dsn_names_another_server() -> None:
    assert not Config(dsn="postgresql://a/db").pooled
    assert not Config(dsn="postgresql://a/db", listen_dsn="postgresql://a/db").pooled
    pooled = Config(dsn="postgresql://pooler/db", listen_dsn="postgresql://server/db")
    assert pooled.pooled and pooled.session_dsn == "postgresql://server/db"
    assert Config(dsn="postgresql://a/db").session_dsn == "postgresql://a/db"


SETS = {"search_path": "SET search_path = 'pg_catalog, pg_temp'", "jit": "SET jit = off",
        "idle_in_transaction_session_timeout": "SET idle_in_transaction_session_timeout = 10000"}
ALL = list(SETS)


@pytest.mark.parametrize(("found", "missing"), [
    ({"search_path": "pg_catalog, pg_temp", "jit": "off", "idle_in_transaction_session_timeout": "10s"}, []),
    ({"search_path": "pg_catalog,pg_temp", "jit": "off", "idle_in_transaction_session_timeout": "5000ms"}, []),
    ({"search_path": '"$user", public', "jit": "on", "idle_in_transaction_session_timeout": "0"}, ALL),
    ({"idle_in_transaction_session_timeout": "1min"}, ALL),
    # Whatever a server (or something posing as one) answers is only compared, never trusted further.
    ({"search_path": "pg_catalog, pg_temp; DROP TABLE x", "jit": "off'--",
      "idle_in_transaction_session_timeout": "10s; SET x"}, ALL),
    ({}, ALL),
])
def test_the_settings_a_pooler_lacks_are_named_with_the_set_that_supplies_them(
        found: dict[str, str], missing: list[str]) -> None:
    # The lines to paste are pgflow's own values, never the server's answer.
    assert missing_settings(found, 10.0) == [SETS[name] for name in missing]
    assert set(server_settings(10.0)) == set(SETS)


def test_listen_dsn_comes_from_the_environment_and_a_malformed_one_is_refused_before_anything_is_written(
        dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGFLOW_LISTEN_DSN", "postgresql://nobody@127.0.0.1:1/none?connect_timeout=x:y")
    with pgflow.App(dsn, schema=schema) as app:
        @app.workflow(name="pgbs.never")
        def never() -> None:
            pass

        with pytest.raises(pgflow.ConfigurationError, match="PostgreSQL"):
            never.start()
    monkeypatch.delenv("PGFLOW_LISTEN_DSN")
    with pgflow.App(dsn, schema=schema) as app:
        assert not app.list_workflows()  # nothing was started, and the schema may not even exist yet
