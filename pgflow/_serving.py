"""uvicorn for the commands that serve HTTP (``pgflow dashboard``, ``pgflow streams serve``), stopped by
SIGTERM or Ctrl-C as a worker is: the answers in flight finished, then a normal exit.

uvicorn shuts down gracefully on either signal and then raises it once more under the handler that was
in place before it started, so that the process ends as the signal alone would have ended it. For SIGTERM
that handler is the default action: the process is gone at once, before its ``atexit`` hooks, and an
embedded PostgreSQL it started (``pgflow.embedded``, which the last process using it stops at exit) runs
on with nobody left to stop it. So while uvicorn runs, SIGTERM has a handler of ours, which only tells
uvicorn to stop (a SIGTERM before uvicorn took the signal over is not lost either)."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import uvicorn


def serve_until_stopped(asgi: Any, host: str, port: int) -> bool:
    """Serve ``asgi`` on ``host``:``port`` until SIGTERM or SIGINT; False when the server did not start
    (uvicorn has logged why: it exits the process there, with a code of its own, which this turns into
    an answer for the command to give its own exit code)."""
    server = uvicorn.Server(uvicorn.Config(asgi, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=2, proxy_headers=True))

    def stop(signum: int, frame: FrameType | None) -> None:
        server.should_exit = True

    main = threading.current_thread() is threading.main_thread()  # (uvicorn takes no signals elsewhere)
    previous = signal.signal(signal.SIGTERM, stop) if main else None
    try:
        server.run()
    except KeyboardInterrupt:  # (uvicorn's own raise of a Ctrl-C, once it has stopped)
        pass
    except SystemExit:  # (uvicorn's way of saying it could not start: bind or lifespan failed)
        return False
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return bool(server.started)
