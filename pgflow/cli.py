"""``pgflow``: run workers and manage the schema from the command line."""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from ._commands import add_app_argument, add_commands, app_target, explain, on_app
from ._core import log_lines, loops
from ._supervisor import Backoff, supervise
from .app import App
from .checkreplay import add_command as add_check_replay
from .dashboard.command import add_parser as add_dashboard
from .dashboard.command import run as run_dashboard
from .errors import ConfigurationError, EmbeddedUnavailable, PgflowError

log = logging.getLogger("pgflow.cli")

# Exit codes a supervisor can act on.
EXIT_OK = 0             # stopped by a signal with every running workflow finished
EXIT_FAILED = 1         # a management command that could not do what it was asked
EXIT_USAGE = 2          # bad command line or app: restarting will not help
EXIT_RELEASED = 3       # stopped by a signal after the grace period; unfinished workflows were given back
EXIT_FORCED = 130       # a second signal cut the drain short; unfinished workflows were given back
EXIT_PIPE = 141         # the reader of the output went away (| head): a shell's code for a SIGPIPE death


def load_app(target: str) -> App:
    """Import ``module:attribute`` and return the App it names, or explain what is wrong."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigurationError(f"expected module:app (for example myproject.tasks:app), got {target!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name or (exc.name and module_name.startswith(exc.name + ".")):
            raise ConfigurationError(
                f"cannot import module {module_name!r}: run from the directory that contains it or "
                "add that directory to PYTHONPATH"
            ) from exc
        raise
    if not hasattr(module, attribute):
        raise ConfigurationError(f"module {module_name!r} has no attribute {attribute!r}{_apps_in(module)}")
    app = getattr(module, attribute)
    if not isinstance(app, App):
        raise ConfigurationError(f"{module_name}.{attribute} (from {target!r}) is a {_kind(app)}, not a pgflow.App"
                                 f"{_apps_in(module)}")
    return app


def _apps_in(module: Any) -> str:
    """The Apps a module does hold, for the error that names the wrong attribute: the likely fix."""
    names = [f"{module.__name__}:{name}" for name, value in vars(module).items() if isinstance(value, App)]
    return f"; its pgflow.App: {', '.join(names)}" if names else "; it holds no pgflow.App"


def _kind(value: Any) -> str:
    """What was found instead of an App, in words: a class, a module, or an instance of a type."""
    if isinstance(value, type):
        return f"class ({value.__name__})"
    return f"{type(value).__name__}" if value is not None else "None"


async def _serve(app: App, concurrency: int, queues: list[str], lease: float, grace: float,
                 health_port: int | None = None, health_host: str = "0.0.0.0") -> int:
    """Run a worker until SIGTERM or SIGINT, then drain it: a second signal cuts the drain short.

    Signals are caught before the worker starts, so one that arrives while it starts up (it is
    already registered) drains it instead of killing the process."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with app.worker(concurrency=concurrency, queues=queues, lease=lease, health_port=health_port,
                              health_host=health_host) as worker:
            async for signum in signals:
                log.info("received %s: draining for up to %.1fs (send it again to stop now)",
                         signal.Signals(signum).name, grace)
                break
            forced = False
            async with anyio.create_task_group() as group:

                async def second_signal() -> None:
                    nonlocal forced
                    async for signum in signals:
                        log.warning("received %s again: stopping now", signal.Signals(signum).name)
                        forced = True
                        group.cancel_scope.cancel()

                group.start_soon(second_signal)
                await worker.stop(grace)
                group.cancel_scope.cancel()
            if forced:
                await worker.stop(0)
                return EXIT_FORCED
            return EXIT_OK if not worker.interrupted else EXIT_RELEASED
    return EXIT_OK


def _exit_despite_abandoned_threads(code: int) -> None:
    """A sync step or workflow interrupted at shutdown keeps its thread (threads cannot be stopped),
    and Python would wait for it before exiting. Its workflow is already back in the queue and
    fencing refuses its writes, so the process exits without it, after running the exit hooks (an
    embedded server's stop among them) that ``os._exit`` would skip.

    Only threads that are still there after ``LEAVING`` seconds count: the idle threads of the
    loop's pool were told to stop when the loop ended and leave a moment later. Counted at once,
    they made an idle worker warn of step threads still running, and leave by ``os._exit``."""
    stuck = _threads_still_running(LEAVING)
    if stuck:
        log.warning("exiting with %d step threads still running (%s); their workflows were handed back",
                    len(stuck), ", ".join(sorted({t.name for t in stuck})))
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


LEAVING = 2.0  # seconds the threads on their way out get to leave before a stopped worker exits


def _threads_still_running(within: float) -> list[threading.Thread]:
    """The threads that would keep the process alive (not daemons, not this one) and are still
    running ``within`` seconds from now; returns as soon as none is left."""
    deadline = time.monotonic() + within
    for thread in _non_daemon_threads():
        thread.join(max(0.0, deadline - time.monotonic()))
    return _non_daemon_threads()


def _non_daemon_threads() -> list[threading.Thread]:
    current = threading.current_thread()
    return [t for t in threading.enumerate() if t is not current and not t.daemon and t.is_alive()]


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in ``--help``, except where there is none to show: a required option, a flag that is
    off unless given, a filter that is off unless given (None), or help that says its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default is None or isinstance(action.default, bool) or \
                "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Subparsers are built from the parser's class, not from its formatter: this carries the
    defaults in help down to every subcommand."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _DefaultsHelp)
        super().__init__(*args, **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.log_level not in LOG_LEVELS:  # argparse checks choices on the command line, not on defaults
        parser.error(f"PGFLOW_LOG_LEVEL is one of {', '.join(LOG_LEVELS)}, got {args.log_level!r}")
    log_lines.configure(args.log_level)
    try:
        code = int(args.handler(args, load_app))
        sys.stdout.flush()  # here, where a closed pipe is caught, not in the interpreter's exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except (ConfigurationError, EmbeddedUnavailable) as exc:  # neither is helped by a traceback
        print(f"pgflow: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (PgflowError, ValueError) as exc:  # an unknown id, a workflow that cannot resume, ...
        print(explain(exc), file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_FORCED


def _reader_gone() -> int:
    """The reader of stdout went away (``pgflow workflows ls | head -1``): what it read was all it
    wanted, so the command ends quietly, as one killed by SIGPIPE would, and not with a traceback.
    stdout is pointed at /dev/null first, or the interpreter's flush at exit fails on the pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor behind stdout (an embedding's stream)
        pass
    return EXIT_PIPE


def _parser() -> argparse.ArgumentParser:
    """The command line: every subcommand's parser carries its ``handler`` (see ``commands.Handler``),
    which ``main`` calls, so a new command is one parser and one function, in its own module if it likes."""
    parser = _Parser(prog="pgflow", description=__doc__)
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
                        default=os.environ.get("PGFLOW_LOG_LEVEL", "INFO"),
                        help=f"{', '.join(LOG_LEVELS)}, in any case (default: %(default)s, from "
                             "$PGFLOW_LOG_LEVEL when set)")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_worker(commands)
    migrate = commands.add_parser("migrate", help="create or upgrade the schema")
    add_app_argument(migrate, positional=True)
    migrate.set_defaults(handler=_migrate)

    def with_app(sub: argparse.ArgumentParser) -> None:
        add_app_argument(sub)
        sub.add_argument("--json", action="store_true", help="print JSON for scripts")

    add_commands(commands, with_app)
    add_dashboard(commands).set_defaults(handler=on_app(run_dashboard))
    add_check_replay(commands, with_app)
    return parser


def _add_worker(commands: Any) -> None:
    worker = commands.add_parser("worker", help="run a worker process")
    add_app_argument(worker, positional=True, fallback=False)
    worker.add_argument("--concurrency", type=int, default=16, help="workflows run at once")
    worker.add_argument("--queues", default="default", help="comma-separated queue names")
    worker.add_argument("--lease", type=float, default=10.0,
                        help="seconds a crashed worker's workflows stay claimed before another takes them")
    worker.add_argument("--grace", type=float, default=25.0,
                        help="seconds SIGTERM waits for running workflows before giving them back")
    worker.add_argument("--processes", type=int, metavar="N",
                        help="run N worker processes (1 included) under a supervisor: it restarts one that exits"
                             " on its own after a wait that doubles with each exit in a row (--restart-delay,"
                             " up to --restart-delay-max) and starts over once the process has lived"
                             " --restart-reset seconds, while the others serve on; it passes SIGTERM and SIGINT"
                             " on and exits with the worst of its workers' drains (0: all drained), or 2 when"
                             " one reports a usage error. Without it the one worker (default: 1) is this"
                             " process, unsupervised: systemd or Kubernetes restarts it")
    worker.add_argument("--restart-delay", type=_seconds, metavar="SECONDS",
                        default=os.environ.get("PGFLOW_RESTART_DELAY", "1"),
                        help="with --processes: the wait before restarting a worker process that exited on its"
                             " own (default: %(default)s, from $PGFLOW_RESTART_DELAY when set)")
    worker.add_argument("--restart-delay-max", type=_seconds, metavar="SECONDS",
                        default=os.environ.get("PGFLOW_RESTART_DELAY_MAX", "10"),
                        help="with --processes: the longest that wait grows to (default: %(default)s, from"
                             " $PGFLOW_RESTART_DELAY_MAX when set)")
    worker.add_argument("--restart-reset", type=_seconds, metavar="SECONDS",
                        default=os.environ.get("PGFLOW_RESTART_RESET", "30"),
                        help="with --processes: a worker process that has lived this long starts its wait over"
                             " (default: %(default)s, from $PGFLOW_RESTART_RESET when set)")
    worker.add_argument("--health-port", type=int, metavar="PORT",
                        help="serve this worker's liveness probe, GET /healthz (200 while its loop, heartbeat and"
                             " listener are alive, 503 once one has failed for longer than --lease), on PORT;"
                             " off unless given")
    worker.add_argument("--health-host", default="0.0.0.0",
                        help="the address the probe binds (a kubelet probes the pod's IP)")
    worker.add_argument("--loop", choices=loops.CHOICES, default=os.environ.get("PGFLOW_LOOP", "auto"),
                        help="the event loop: uvloop (compiled: a quarter less CPU per workflow), asyncio's, or"
                             " auto, uvloop when it is installed (default: %(default)s, from $PGFLOW_LOOP when set)")
    worker.set_defaults(handler=_worker)


def _worker(args: argparse.Namespace, load_app: Callable[[str], App]) -> int:
    """``pgflow worker``: one worker in this process, or ``--processes`` of them under a supervisor."""
    if args.loop not in loops.CHOICES:  # (argparse checks choices on the command line, not on defaults)
        raise ConfigurationError(f"PGFLOW_LOOP is one of {', '.join(loops.CHOICES)}, got {args.loop!r}")
    options = loops.backend_options(args.loop)
    target = app_target(args)
    if target is None:
        raise ConfigurationError("pgflow worker serves the workflows of an App: name it, as --app module:app")
    app = load_app(target)
    queues = [q.strip() for q in args.queues.split(",") if q.strip()]
    if (args.processes is not None and args.processes < 1) or args.concurrency < 1:
        raise ConfigurationError("--processes and --concurrency must be at least 1")
    if args.health_port is not None and args.processes is not None and args.processes > 1:
        raise ConfigurationError("--health-port probes one worker process: with --processes N, the"
                                 " processes could not share the port; run one process per container"
                                 " (scale with replicas) or drop --health-port")
    if args.health_port is not None and not 0 <= args.health_port <= 65535:
        raise ConfigurationError(f"--health-port is a TCP port, 0 to 65535, got {args.health_port}")
    if args.processes is not None:
        return _supervise(args, target, queues)
    # What importing the app made lives as long as the process: frozen out of the collector's sight, a
    # full collection scans only what the worker makes afterwards (4 ms rather than 21 ms in the
    # streams benchmark, where every chunk written meanwhile waited behind it: benchmarks/README.md).
    gc.collect()
    gc.freeze()
    try:
        code: int = anyio.run(_serve, app, args.concurrency, queues, args.lease, args.grace,
                              args.health_port, args.health_host, backend_options=options)
    finally:
        app.close()
    _exit_despite_abandoned_threads(code)
    return code


def _supervise(args: argparse.Namespace, target: str, queues: list[str]) -> int:
    """``--processes N``: N children, each a plain ``pgflow worker`` with the same options (one child
    serves the probe: the option is refused for more)."""
    probe = [] if args.health_port is None else ["--health-port", str(args.health_port),
                                                 "--health-host", args.health_host]
    worker_args = [target, "--concurrency", str(args.concurrency), "--queues", ",".join(queues), "--lease",
                   str(args.lease), "--grace", str(args.grace), "--loop", args.loop, *probe]
    if args.restart_delay_max < args.restart_delay:
        raise ConfigurationError(f"--restart-delay-max ({args.restart_delay_max:g}) is less than --restart-delay"
                                 f" ({args.restart_delay:g})")
    backoff = Backoff(args.restart_delay, args.restart_delay_max, args.restart_reset)
    return supervise(worker_args, args.processes, backoff, args.log_level)


def _seconds(text: str) -> float:
    """A number of seconds, finite and > 0 (argparse applies it to the defaults from the environment
    too, so a bad $PGFLOW_RESTART_* is a usage error that names the option)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"seconds, a number > 0, got {text!r}")
    return value


def _migrate(args: argparse.Namespace, load_app: Callable[[str], App]) -> int:
    target = app_target(args)
    app = load_app(target) if target else App()
    with app:
        version = app.migrate()
    print(f"schema {app.schema!r} is at version {version}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
