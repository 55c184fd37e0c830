"""The README's Install command in a fresh venv: the checkout installs, and the default ``App()`` (the
embedded PostgreSQL, no DSN) runs a workflow there. Slow (it builds a venv and installs the
dependencies from the package index or pip's cache): ``make install-check`` runs it; ``make test``
leaves it out (marker ``install``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.install

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent('''
    import importlib.metadata, sys
    import anyio
    import pgflow

    app = pgflow.App()   # no dsn, no PGFLOW_DSN: the embedded PostgreSQL under ./.pgflow

    @app.step(max_attempts=2, backoff=0.01)
    def shout(text: str) -> str:
        if pgflow.step_attempt() == 1:
            raise ConnectionError("once")
        return text.upper()

    @app.workflow
    async def greet(name: str) -> str:
        return await shout(f"hello {name}")

    async def main() -> None:
        async with app.worker(concurrency=2):
            handle = await greet.start_async("world")
            print("result:", await handle.result_async(timeout=60))
            print("attempts:", (await handle.steps_async())[0].attempts)
        await app.close_async()

    anyio.run(main)
    plugins = [e.value for e in importlib.metadata.entry_points(group="pytest11") if e.name == "pgflow"]
    print("plugin:", plugins)
    print("dist:", importlib.metadata.version("pgflow-durable"))
''')


def test_a_fresh_venv_installs_the_checkout_and_runs_the_default_app(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PGFLOW_", "VIRTUAL_ENV", "PYTHONPATH"))}
    # The README's command, from the checkout.
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "-e", str(ROOT)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text("[project]\nname = 'demo'\nversion = '0'\n")
    (project / "demo.py").write_text(SCRIPT)
    ran = subprocess.run([str(python), "demo.py"], cwd=project, env=env, capture_output=True, text=True,
                         timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "result: HELLO WORLD" in ran.stdout and "attempts: 2" in ran.stdout, ran.stdout
    assert "plugin: ['pgflow.testing.plugin']" in ran.stdout, ran.stdout
    assert (project / ".pgflow").is_dir()  # the embedded server's data, where the README says
    cli = subprocess.run([str(venv / "bin" / "pgflow"), "--help"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert cli.returncode == 0 and "worker" in cli.stdout, cli.stdout + cli.stderr
