"""A sync caller that blocks in ``result()`` or in iterating ``stream()`` on a workflow no worker runs
(``python -m tests.apps.blocked_caller result|stream``): the runtime tests send it SIGINT."""

from __future__ import annotations

import signal
import sys

from .runtime_app import tokens

# As in an interactive Python, whatever started this process: a shell without job control starts
# background commands (CI, nohup ... &) with SIGINT ignored, and Python then never raises
# KeyboardInterrupt.
signal.signal(signal.SIGINT, signal.default_int_handler)

handle = tokens.start(5)
print("blocking", flush=True)
if sys.argv[1] == "result":
    handle.result()
else:
    for _ in handle.stream("tokens"):
        pass
