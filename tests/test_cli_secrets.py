"""A DSN's password stays out of every command line and every message: ``pgflow psql`` hands it to psql
through the environment (a command line is readable by every local user, in ``ps``), ``--print``
shows it as ``***`` unless asked, and a malformed DSN's error does not quote it back.

No server is needed: ``pgflow psql`` with an explicit DSN does not connect, and a malformed DSN fails
before any network. psql is replaced by a small script that records what the kernel shows of it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg.conninfo
import pytest

from pgflow._core.connecting import redact, where

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "s3cret-Pa55"
DSN = f"postgresql://alice:{PASSWORD}@db.invalid:6543/orders"

# Records its own command line and environment as every process's are visible: through /proc.
FAKE_PSQL = """#!/bin/sh
cat /proc/$$/cmdline > "$PSQL_RECORD/cmdline"
cat /proc/$$/environ > "$PSQL_RECORD/environ"
"""


def pgflow_cli(*args: str, dsn: str, path: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PGFLOW_DSN": dsn, "PATH": path, "PSQL_RECORD": str(cwd / "record"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("PGPASSWORD", None)
    return subprocess.run([sys.executable, "-m", "pgflow", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def fake_psql(tmp_path: Path) -> tuple[str, Path]:
    """(a PATH whose psql is the recording script, the directory it records into)."""
    if not Path("/proc/self/cmdline").exists():
        pytest.skip("needs /proc to read the fake psql's command line")
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir()
    record.mkdir()
    script = bin_dir / "psql"
    script.write_text(FAKE_PSQL)
    script.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", record


def test_pgflow_psql_gives_the_password_through_the_environment_and_the_rest_on_the_command_line(
    fake_psql: tuple[str, Path], tmp_path: Path,
) -> None:
    path, record = fake_psql
    ran = pgflow_cli("psql", dsn=DSN, path=path, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert PASSWORD not in ran.stdout + ran.stderr

    argv = (record / "cmdline").read_bytes().split(b"\0")[:-1]
    assert all(PASSWORD.encode() not in arg for arg in argv), argv
    assert psycopg.conninfo.conninfo_to_dict(argv[-1].decode()) == {
        "user": "alice", "host": "db.invalid", "port": "6543", "dbname": "orders"}
    environ = dict(item.decode().partition("=")[::2] for item in
                   (record / "environ").read_bytes().split(b"\0")[:-1])
    assert environ["PGPASSWORD"] == PASSWORD
    assert environ["PGOPTIONS"].endswith("-c search_path=pgflow,public")


def test_print_shows_the_password_as_stars_unless_asked_and_so_does_a_missing_psql(tmp_path: Path) -> None:
    nowhere = str(tmp_path / "no-psql-here")  # a PATH without psql; the interpreter is named by its path
    printed = pgflow_cli("psql", "--print", dsn=DSN, path=nowhere, cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.strip() == "postgresql://alice:***@db.invalid:6543/orders"
    assert PASSWORD not in printed.stderr

    shown = pgflow_cli("psql", "--print", "--show-password", dsn=DSN, path=nowhere, cwd=tmp_path)
    assert shown.stdout.strip() == DSN

    missing = pgflow_cli("psql", dsn=DSN, path=nowhere, cwd=tmp_path)
    assert missing.returncode == 0 and "psql is not installed" in missing.stderr
    assert missing.stdout.strip() == "postgresql://alice:***@db.invalid:6543/orders"


@pytest.mark.parametrize("dsn", [
    f"postgresql://alice:{PASSWORD}@[::1/orders",          # libpq quotes the whole URI back
    f"postgresql://alice:{PASSWORD}%zz@db.invalid/orders",  # libpq quotes the bad token: the password
    f"host=db.invalid password='{PASSWORD} user=alice",    # an unterminated quote
])
def test_a_malformed_dsns_error_does_not_contain_its_password(dsn: str, tmp_path: Path) -> None:
    failed = pgflow_cli("queues", dsn=dsn, path=os.environ.get("PATH", ""), cwd=tmp_path)
    assert failed.returncode == 2 and "the PostgreSQL DSN is malformed" in failed.stderr, failed.stderr
    assert PASSWORD not in failed.stdout + failed.stderr
    psql = pgflow_cli("psql", dsn=dsn, path=os.environ.get("PATH", ""), cwd=tmp_path)
    assert psql.returncode == 2 and "malformed" in psql.stderr, psql.stderr
    assert PASSWORD not in psql.stdout + psql.stderr


def test_a_password_libpq_cuts_short_is_not_put_on_psqls_command_line(
    fake_psql: tuple[str, Path], tmp_path: Path,
) -> None:
    # An unencoded @ ends the user info early for libpq: "cret" would become part of the host name.
    path, record = fake_psql
    refused = pgflow_cli("psql", dsn="postgresql://alice:s3@cret@db.invalid/orders", path=path, cwd=tmp_path)
    assert refused.returncode == 2 and "percent-encode" in refused.stderr, refused.stderr
    assert "cret" not in refused.stdout + refused.stderr
    assert not (record / "cmdline").exists()


@pytest.mark.parametrize(("dsn", "shown"), [
    (DSN, "postgresql://alice:***@db.invalid:6543/orders"),
    ("postgresql://alice@db.invalid/orders?password=p%40ss&sslmode=require",
     "postgresql://alice@db.invalid/orders?password=***&sslmode=require"),
    (f"host=db.invalid password={PASSWORD} user=alice", "host=db.invalid password=*** user=alice"),
    ("host=db.invalid password = 'a \\' b' sslpassword=k3y", "host=db.invalid password = *** sslpassword=***"),
    ("postgresql://postgres@/postgres?host=/tmp/x&port=5432", "postgresql://postgres@/postgres?host=/tmp/x&port=5432"),
    ("postgresql://db.invalid:5432/orders", "postgresql://db.invalid:5432/orders"),
])
def test_redact_replaces_every_password_and_nothing_else(dsn: str, shown: str) -> None:
    assert redact(dsn) == shown


def test_where_never_shows_a_piece_of_a_password() -> None:
    # libpq takes "u:pa/ss@h/db" as host "u", port "pa" and database "ss@h/db".
    assert "pa" not in where("postgresql://u:pa/ss@h/db").replace("***", "")
    assert where("postgresql://u:p@ss@db.invalid/orders") == "***@db.invalid:5432/orders"
