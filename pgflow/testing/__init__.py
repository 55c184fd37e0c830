"""Testing pgflow workflows: a pytest plugin with a per-test schema, an in-process worker and a
clock the test moves.

Installed with pgflow (the ``pytest11`` entry point ``pgflow`` loads ``pgflow.testing.plugin``), it
adds the ``pgflow_env`` fixture. Tell it your App with ``pgflow_app = "myproject.tasks:app"`` in
pytest's configuration, or by defining a ``pgflow_app`` fixture that returns it::

    def test_reminder(pgflow_env):
        handle = signup.start("ann@example.com")
        pgflow_env.clock.advance(days=30)         # every sleep, backoff and timeout on the way runs
        assert handle.result(timeout=10) == "reminded"

The database is ``$PGFLOW_TEST_DSN``, else the project's embedded PostgreSQL (the one ``App()``
uses), in a fresh schema per test, dropped after it. Time, for the workflows: durable sleeps,
message timeouts, ``delay=``, retry backoff, cron ticks and workflow timeouts follow the test's
clock, through the same code as in production (the schema's ``clock_now()`` and the App's clock in
this process; see migration 0019 and ``pgflow/_core/clock.py``).
"""

from .clock import VirtualClock
from .env import Message, PgflowEnv

__all__ = ["Message", "PgflowEnv", "VirtualClock"]
