"""The worker of the supervisor tests (tests/test_supervisor.py). Its import dies at once (``os._exit(1)``,
a crash) while the file named by $PGFLOW_TEST_CRASH exists, so a test can make a child crash again and
again, and lets it live once the file is gone; $PGFLOW_TEST_IMPORT_DELAY holds its import that many
seconds, so a test can signal the supervisor while a child is still starting. (Both in the supervisor's
children only.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pgflow

# Only in the supervisor's children, which lead sessions of their own: the supervisor imports the app
# too (to check it before starting any), and must neither die nor wait here.
if os.getsid(0) == os.getpid():
    _crash = os.environ.get("PGFLOW_TEST_CRASH")
    if _crash and Path(_crash).exists():
        os._exit(1)
    time.sleep(float(os.environ.get("PGFLOW_TEST_IMPORT_DELAY", "0")))

app = pgflow.App()


@app.workflow(name="supervised.pid")
async def pid() -> int:
    """The pid of the worker process that ran it."""
    return os.getpid()
