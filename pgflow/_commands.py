"""``pgflow workflows ls|show|cancel|resume|fork``, ``tail``, ``queues``, ``workers`` and ``status``:
the management API on the command line. Plain-text tables for people, ``--json`` for scripts (one JSON
document on stdout)."""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ._core.checks import check_id
from ._core.connecting import redact, split_password
from ._core.status import Status
from .app import STATUSES, App
from .errors import ConfigurationError, PgflowError
from .records import MAX_WAIT, ChildInfo, Children, Health
from .showing import print_details
from .terminal import json_text, safe, table

# A prune by hand this recent takes workflows whose callers may still be about to read their results
# and streams: most likely a unit slip (--older-than 7 meaning days), so it asks for --yes.
PRUNE_CONFIRM_BELOW = 3600.0


Handler = Callable[[argparse.Namespace, Callable[[str], App]], int]
"""What a subcommand's parser carries as its ``handler`` default: the command, given the parsed
arguments and the CLI's importer of ``module:app``; returns the exit code."""

Command = Callable[[App, argparse.Namespace], int]


def add_app_argument(parser: argparse.ArgumentParser, *, positional: bool = False, fallback: bool = True) -> None:
    """``--app MODULE:APP``, which every command takes. ``positional``: the command takes it as its
    first argument too (``pgflow worker mod:app``, the older form, kept as an alias); ``fallback``:
    without either, ``App()`` from the environment stands in."""
    default = " (default: PGFLOW_DSN / PGFLOW_SCHEMA, else the embedded server)" if fallback else ""
    parser.add_argument("--app", dest="app_target", metavar="MODULE:APP",
                        help=f"the App, as module:attribute{default}")
    if positional:
        parser.add_argument("app", nargs="?", metavar="MODULE:APP", help="the same as --app")


def app_target(args: argparse.Namespace) -> str | None:
    """The ``module:app`` the command line names, by ``--app`` or by position; None: neither."""
    option, given = getattr(args, "app_target", None), getattr(args, "app", None)
    if option and given and option != given:
        raise ConfigurationError(f"two Apps named: --app {option} and {given}; give one")
    return option or given or None


def on_app(command: Command) -> Handler:
    """A command run on the App that ``--app`` names, or on ``App()`` from the environment, which is
    closed when the command is done."""

    def handler(args: argparse.Namespace, load_app: Callable[[str], App]) -> int:
        target = app_target(args)
        with load_app(target) if target else App() as app:
            return command(app, args)

    return handler


def add_commands(commands: Any, with_app: Callable[[argparse.ArgumentParser], None]) -> None:
    """The management subcommands; ``with_app`` adds the options that choose the App."""

    def add(parser: argparse.ArgumentParser, command: Command) -> argparse.ArgumentParser:
        with_app(parser)
        parser.set_defaults(handler=on_app(command))
        return parser

    _add_workflows(commands, add)
    queues = commands.add_parser("queues", help="each queue's depth, oldest wait, running workflows, limits and"
                                                " pause; or pause NAME / resume NAME")
    queues.add_argument("action", nargs="?", choices=("pause", "resume"),
                        help="pause: the fleet claims none of the queue's workflows until resumed (running ones"
                             " finish, starts still queue); resume: it claims them again")
    queues.add_argument("name", nargs="?", help="the queue to pause or resume")
    add(queues, _queues)
    add(commands.add_parser("workers", help="live workers, their heartbeat's age and what each runs"), _workers)
    status = commands.add_parser("status", help="the fleet's health: exits 1 when unhealthy, one line per problem"
                                                " (no live worker, work on a queue or under a name no live worker"
                                                " serves, a queue waiting over --max-wait, a dead worker while work"
                                                " waits on its queues, a stalled NOTIFY queue, stuck sessions, a"
                                                " maintenance lock held by a stranger)")
    status.add_argument("app", nargs="?", metavar="MODULE:APP", help="the same as --app")
    status.add_argument("--stuck-after", type=float, default=60.0,
                        help="seconds idle in a transaction that make a session count as stuck (default: %(default)s)")
    status.add_argument("--max-wait", type=duration, default=MAX_WAIT, metavar="DURATION",
                        help="unhealthy once a queue's oldest due workflow has waited this long: 5m, 30s or"
                             " seconds (default: %(default)s s)")
    add(status, _status)
    prune = commands.add_parser("prune", help="delete finished workflows, their steps and streams, now")
    prune.add_argument("--older-than", required=True, type=duration, metavar="DURATION",
                       help="finished longer ago than this: 7d, 12h, 30m, 45s or seconds")
    prune.add_argument("--yes", action="store_true",
                       help=f"needed for a duration under {_fmt_duration(PRUNE_CONFIRM_BELOW)}, which takes "
                            "workflows that have only just finished")
    add(prune, _prune)
    psql = commands.add_parser("psql", help="open psql on the App's database, pgflow's schema first in the "
                                            "search path (or print the DSN; --json: the DSN, schema and "
                                            "search path as JSON, psql not opened)")
    psql.add_argument("--print", action="store_true", dest="print_dsn",
                      help="only print the DSN (its password as ***)")
    psql.add_argument("--show-password", action="store_true", help="print the DSN's password as it is")
    add(psql, _psql)
    keys = commands.add_parser("keys", help="the keyring that seals pgflow's pings")
    keys_actions = keys.add_subparsers(dest="action", required=True)
    rotate = keys_actions.add_parser("rotate", help="add a new key, used from --overlap seconds on; the old"
                                                    " ones are accepted until --overlap seconds after that")
    rotate.add_argument("--overlap", type=float, default=120.0, help="seconds (default: %(default)s)")
    add(rotate, _rotate_keys)
    tail = commands.add_parser("tail", help="follow a workflow's stream live, as tail -f does")
    tail.add_argument("id", help="the workflow id")
    tail.add_argument("key", help="the stream key")
    tail.add_argument("--offset", type=int, default=0, help="the first position (default: %(default)s)")
    add(tail, _tail)
    from .durable_streams.command import add_parser as add_streams
    from .durable_streams.command import run as run_streams

    add_streams(commands, with_app).set_defaults(handler=on_app(run_streams))


def _add_workflows(commands: Any,
                   add: Callable[[argparse.ArgumentParser, Command], argparse.ArgumentParser]) -> None:
    workflows = commands.add_parser("workflows", help="list, inspect, cancel, resume and fork workflows")
    actions = workflows.add_subparsers(dest="action", required=True)
    ls = actions.add_parser("ls", help="list workflows, newest first")
    ls.add_argument("--status", choices=STATUSES, help="only workflows in this status")
    ls.add_argument("--name", help="only workflows of this name")
    ls.add_argument("--queue", help="only workflows of this queue")
    ls.add_argument("--limit", type=int, default=50, help="at most this many (default: %(default)s)")
    add(ls, _list)
    show = actions.add_parser("show", help="one workflow: its record, arguments, result, error with traceback,"
                                           " steps with their timings and every attempt's error, and streams")
    show.add_argument("id", help="the workflow id")
    show.add_argument("--full", action="store_true",
                      help="print values, messages and tracebacks whole (by default they are cut to a screenful)")
    show.add_argument("--steps", type=_positive, default=1000, metavar="N",
                      help="show the first N steps of the journal (default: %(default)s)")
    show.add_argument("--children", type=_positive, default=1000, metavar="N",
                      help="show the first N workflows its body started (default: %(default)s)")
    add(show, _show_workflow)
    for action, text, command in (("cancel", "cancel a workflow", _cancel),
                                  ("resume", "run a failed or cancelled workflow again", _resume),
                                  ("fork", "start a copy that replays the first N steps", _fork)):
        sub = actions.add_parser(action, help=text)
        sub.add_argument("id", help="the workflow id")
        if action == "fork":
            sub.add_argument("--from-step", type=int, required=True, help="steps copied (replayed, not run)")
        add(sub, command)


def _queues(app: App, args: argparse.Namespace) -> int:
    if args.action is None:
        if args.name is not None:
            raise ConfigurationError(f"pgflow queues takes pause NAME or resume NAME, not {args.name!r} alone")
        _show(args, app.queues_info(), ["name", "queued", "due", "oldest_due_waited_s", "running", "concurrency",
                                        "rate_limit", "rate_period_s", "paused_since"])
        return 0
    if args.name is None:
        raise ConfigurationError(f"pgflow queues {args.action} needs the queue's name:"
                                 f" pgflow queues {args.action} NAME")
    if args.action == "pause":
        _done(args, {"queue": args.name, "paused_since": app.pause_queue(args.name).isoformat()})
    else:
        _done(args, {"queue": args.name, "resumed": app.resume_queue(args.name)})
    return 0


def _workers(app: App, args: argparse.Namespace) -> int:
    workers = app.workers_info()
    if args.json:
        _print_json(workers)
    else:
        table([{**asdict(w), "state": w.state} for w in workers],
              ["id", "state", "host", "pid", "queues", "version", "heartbeat_age_s", "lease_s", "running"])
        if any(w.dead for w in workers):
            print("(DEAD: its heartbeat is older than its lease; its workflows go to live workers)")
    return 0


def _status(app: App, args: argparse.Namespace) -> int:
    health = app.health(stuck_after=args.stuck_after, max_wait=args.max_wait)
    if args.json:
        _print_json({**asdict(health), "ok": health.ok, "problems": health.problems, "notes": health.notes})
    else:
        _print_health(health)
    return 0 if health.ok else 1


def _print_health(health: Health) -> None:
    """The verdict, then each problem on a line of its own (escaped: any role chooses the names and
    application names in them), and the NOTIFY queue's likely holders while it fills up."""
    print(f"{'healthy' if health.ok else 'UNHEALTHY'}: {health.live_workers} live workers, NOTIFY queue "
          f"{health.notification_queue_usage:.1%} full")
    for problem in health.problems:
        print(f"  {safe(problem)}")
    for note in health.notes:
        print(f"  (note) {safe(note)}")
    if health.notification_queue_usage > 0.5:
        print("  the oldest open transactions of the cluster (whichever of them ran LISTEN holds the NOTIFY"
              " queue back):")
        for session in health.queue_holders:
            print(f"    {safe(session.describe())}")


def _psql(app: App, args: argparse.Namespace) -> int:
    dsn = app.dsn  # for the embedded default, starts or joins the project's server
    if args.json:  # a script wants where to connect, not an interactive psql
        _print_json({"dsn": dsn if args.show_password else redact(dsn), "schema": app.schema,
                     "search_path": f"{app.schema},public"})
        return 0
    client = shutil.which("psql")
    if args.print_dsn or client is None:
        if client is None and not args.print_dsn:
            print("pgflow: psql is not installed; the DSN:", file=sys.stderr)
        print(dsn if args.show_password else redact(dsn))
        return 0
    # A command line is readable by every local user (ps, /proc); a process's environment only by its
    # owner and root. So the password goes to psql as PGPASSWORD, and the rest as a DSN without it.
    conninfo, password = split_password(dsn)
    env = dict(os.environ)
    if password is not None:
        env["PGPASSWORD"] = password
    env["PGOPTIONS"] = f"{env.get('PGOPTIONS', '')} -c search_path={app.schema},public".strip()
    os.execve(client, [client, conninfo], env)


def _prune(app: App, args: argparse.Namespace) -> int:
    if args.older_than < PRUNE_CONFIRM_BELOW and not args.yes:
        print(f"pgflow: error: this would delete every workflow that finished more than "
              f"{_fmt_duration(args.older_than)} ago (succeeded, failed or cancelled), with its steps, "
              "stream chunks, events and messages; pass --yes to do it", file=sys.stderr)
        return 2

    def progress(deleted: int) -> None:
        if not args.json:
            print(f"\rdeleted {deleted} workflows", end="", file=sys.stderr, flush=True)

    deleted = app.prune(args.older_than, progress=progress)
    if not args.json:
        print(file=sys.stderr)
    _done(args, {"deleted": deleted})
    return 0


def _rotate_keys(app: App, args: argparse.Namespace) -> int:
    _done(args, {"key": app.rotate_signal_key(args.overlap), "sealed_with_in_s": args.overlap})
    return 0


def _tail(app: App, args: argparse.Namespace) -> int:
    shown = 0
    for position, value in app.handle(args.id).stream_items(args.key, args.offset):
        print(json_text({"position": position, "value": value}) if args.json
              else f"{position}\t{safe(str(value))}", flush=True)
        shown += 1
    if not shown:
        _check_stream(app, args.id, args.key)
    return 0


def _check_stream(app: App, workflow_id: str, key: str) -> None:
    """A stream with nothing to show, for a workflow that has ended (a stream ends with its
    workflow): when it has no stream of that name, a misspelt key, say so rather than end as quietly
    as an empty stream would."""
    details = app.workflow_details(workflow_id, steps_limit=1)
    keys = [stream.key for stream in details.streams]
    if key not in keys:
        streams = f"its streams: {', '.join(map(repr, keys))}" if keys else "it wrote no stream"
        raise PgflowError(f"workflow {workflow_id!r} ({details.status}) has no stream {key!r}; {streams}")


def _list(app: App, args: argparse.Namespace) -> int:
    records = app.list_workflows(status=args.status, name=args.name, queue=args.queue, limit=args.limit)
    _show(args, records, ["id", "name", "queue", "status", "attempt", "created_at", "finished_at", "error_type"])
    return 0


def _show_workflow(app: App, args: argparse.Namespace) -> int:
    details = app.workflow_details(check_id(args.id), steps_limit=args.steps)
    children = _children(app, details.id, args.children)
    if args.json:  # the details, and the children with the journal's length beside them
        _print_json({**{field: getattr(details, field) for field in details.__struct_fields__},
                     "children": children.children, "children_total": children.total,
                     "journal_positions": children.journal_positions})
    else:
        print_details(details, args.full, children)
    return 0


def _children(app: App, workflow_id: str, limit: int) -> Children:
    """The workflows the body of ``workflow_id`` started: its journal holds no step record for their
    starts, so without them its positions would seem to jump."""
    internals = app._internals()
    rows, total, positions = internals.call(
        lambda: internals.runtime().db(lambda store: store.management.children(workflow_id, limit)))
    return Children([ChildInfo.of(row) for row in rows], total, positions)


def _cancel(app: App, args: argparse.Namespace) -> int:
    app.handle(args.id).cancel()
    _done(args, {"id": args.id, "cancel": "requested"})
    return 0


def _resume(app: App, args: argparse.Namespace) -> int:
    app.handle(args.id).resume()
    _done(args, {"id": args.id, "status": Status.QUEUED.value})
    return 0


def _fork(app: App, args: argparse.Namespace) -> int:
    forked = app.handle(args.id).fork(from_step=args.from_step)
    _done(args, {"id": forked.id, "forked_from": args.id, "from_step": args.from_step})
    return 0


def duration(text: str) -> float:
    """'7d', '12h', '30m', '45s' or plain seconds."""
    units = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
    try:
        value = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use 7d, 12h, 30m, 45s or seconds)") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"a duration is finite and >= 0, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, got {value}")
    return value


def _fmt_duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def explain(exc: PgflowError | ValueError) -> str:
    return f"pgflow: error: {safe(str(exc))}"


def _done(args: argparse.Namespace, what: dict[str, Any]) -> None:
    if args.json:
        _print_json(what)
    else:
        print(safe(" ".join(f"{k}={v}" for k, v in what.items())))


def _show(args: argparse.Namespace, records: list[Any], columns: list[str]) -> None:
    if args.json:
        _print_json(records)
    else:
        table([asdict(r) for r in records], columns)


def _print_json(value: Any) -> None:
    sys.stdout.write(json_text(value) + "\n")
