"""The pytest plugin: the ``pgflow_app`` ini option and fixture, and the ``pgflow_env`` fixture.

Loaded by pytest through the ``pytest11`` entry point of pgflow's distribution; it does nothing
until a test asks for ``pgflow_env``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator

import pytest

from ..app import App
from ..embedded import embedded_dsn
from .env import PgflowEnv

APP_OPTION = "pgflow_app"
DSN_VARIABLE = "PGFLOW_TEST_DSN"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(APP_OPTION, "the App the pgflow_env fixture runs, as module:attribute (e.g. myproject.tasks:app)")


def load_app(spec: str) -> App:
    """``module:attribute`` to the App it names, with an error that says what was wrong."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise pytest.UsageError(f"{APP_OPTION} is module:attribute (e.g. myproject.tasks:app), got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise pytest.UsageError(f"{APP_OPTION} = {spec!r}: cannot import {module_name!r}: {exc}") from exc
    app = getattr(module, attribute, None)
    if not isinstance(app, App):
        raise pytest.UsageError(f"{APP_OPTION} = {spec!r}: {module_name}.{attribute} is {app!r}, not a pgflow.App")
    return app


@pytest.fixture
def pgflow_app(request: pytest.FixtureRequest) -> App:
    """The App under test: from the ``pgflow_app`` ini option; override this fixture to give it
    otherwise."""
    spec = request.config.getini(APP_OPTION)
    if not spec:
        raise pytest.UsageError(
            f"the pgflow_env fixture needs your App: set {APP_OPTION} = \"myproject.tasks:app\" under [pytest] (or"
            " [tool.pytest.ini_options]), or define a fixture named pgflow_app that returns it")
    return load_app(str(spec))


@pytest.fixture(scope="session")
def pgflow_dsn() -> str:
    """The server the tests' schemas live on: ``$PGFLOW_TEST_DSN``, else the project's embedded
    PostgreSQL (started if no process of the project runs it)."""
    dsn = os.environ.get(DSN_VARIABLE)
    if dsn:
        return dsn
    from .._core.datadir import default_data_dir

    return embedded_dsn(default_data_dir())


@pytest.fixture
def pgflow_env(pgflow_app: App, pgflow_dsn: str) -> Iterator[PgflowEnv]:
    """The App on a fresh schema with a worker running it in this process and a virtual clock;
    everything is stopped and the schema dropped after the test."""
    env = PgflowEnv(pgflow_app, pgflow_dsn)
    try:
        yield env.start()
    finally:
        env.stop()  # also after a start that failed half-way: the App is pointed back all the same
