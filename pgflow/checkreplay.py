"""``pgflow check-replay``: before a deploy, would the code now importable replay the journals of the
workflows still unfinished? Run in CI against the production database (read-only), it exits 1 naming
every workflow whose journal the new code would meet with ``NonDeterministicWorkflow``, and 2 when it
could not check at all (bad arguments, an app that cannot be imported, a database that cannot be
reached or read): a CI step tells "this deploy would break running workflows" from "the check is broken".

``check_replay(app)`` / ``check_replay_async(app)`` give the same answer to code.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

import psycopg

from ._core.replaycheck import Mismatch, ReplayReport
from ._core.replaycheck import check_replay as _check
from ._core.status import UNFINISHED as _UNFINISHED
from .app import App
from .canvas import CANVAS
from .canvas import workflow as canvas_workflow
from .errors import ConfigurationError, EmbeddedUnavailable

__all__ = ["Mismatch", "ReplayReport", "check_replay", "check_replay_async"]

UNFINISHED = tuple(status.value for status in _UNFINISHED)  # ("queued", "running")
MAX_LIMIT = 1_000_000


def _checked(statuses: Sequence[str], limit: int, within: float) -> tuple[list[str], int, float]:
    if isinstance(statuses, str):
        raise TypeError("statuses is a list of statuses, e.g. ['running', 'queued']")
    wanted = [str(s) for s in statuses]
    unknown = [s for s in wanted if s not in UNFINISHED]
    if not wanted or unknown:
        raise ValueError(f"check-replay looks at unfinished workflows: statuses among {', '.join(UNFINISHED)},"
                         f" got {', '.join(unknown) or 'none'}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ValueError(f"limit is a whole number from 1 to {MAX_LIMIT}, got {limit!r}")
    if isinstance(within, bool) or not isinstance(within, int | float) or not 0 < within <= 3600:
        raise ValueError(f"within is a number of seconds per workflow, above 0 and at most 3600, got {within!r}")
    return wanted, limit, float(within)


async def check_replay_async(app: App, statuses: Sequence[str] = UNFINISHED, limit: int = 10_000,
                             within: float = 30.0) -> ReplayReport:
    """Replay the journals of up to ``limit`` workflows in ``statuses`` (oldest first) against the
    workflows ``app`` registers, running no step and writing nothing; ``within`` bounds each body."""
    wanted, limit, within = _checked(statuses, limit, within)
    internals = app._internals()
    config = await internals.config()
    registry = internals.registry
    if CANVAS not in registry.workflows:
        # pgflow's own workflow, which the new code runs too: canvases are checked whether or not the
        # App has built one in this process (the usual caller of check-replay never has), and without
        # registering it in the App, whose workers would then serve it.
        registry = replace(registry, workflows={**registry.workflows, CANVAS: canvas_workflow(internals.client)})
    return await _check(registry, internals.runtime(), config.dsn, config.schema, config.query_timeout,
                        wanted, limit, within)


def check_replay(app: App, statuses: Sequence[str] = UNFINISHED, limit: int = 10_000,
                 within: float = 30.0) -> ReplayReport:
    _checked(statuses, limit, within)
    return app._internals().call(lambda: check_replay_async(app, statuses, limit, within))


EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2
EXIT_CODES = (f"exit status: {EXIT_OK} when every checked workflow replays, {EXIT_MISMATCH} naming each that would"
              f" not, {EXIT_ERROR} when the check could not be made (bad arguments, an app that cannot be imported,"
              " a database that cannot be reached or read)")


def add_command(commands: Any, with_app: Callable[[argparse.ArgumentParser], None]) -> None:
    sub = commands.add_parser(
        "check-replay", help="replay unfinished workflows' journals against the code now importable (for CI, "
                             f"before a deploy): exits {EXIT_MISMATCH} naming each that would not replay,"
                             f" {EXIT_ERROR} when it cannot check",
        description="Replay the journals of unfinished workflows against the code now importable, running no"
                    " step and writing nothing (for CI, before a deploy).", epilog=EXIT_CODES)
    sub.add_argument("--status", default="running,queued",
                     help="comma-separated statuses to check, among running and queued (default: %(default)s)")
    sub.add_argument("--limit", type=int, default=10_000, help="at most this many workflows, oldest first")
    sub.add_argument("--within", type=float, default=30.0,
                     help="seconds a body may take to reach the end of its journal")
    with_app(sub)
    sub.set_defaults(handler=run)


def run(args: argparse.Namespace, load_app: Callable[[str], App]) -> int:
    """The command; ``load_app`` is the CLI's importer of ``module:app``."""
    if not args.app_target:
        raise ConfigurationError("check-replay needs the code to check: --app module:app")
    statuses = [s.strip() for s in args.status.split(",") if s.strip()]
    try:
        _checked(statuses, args.limit, args.within)
    except ValueError as exc:  # a bad command line, not a journal that fails: exit 2, not 1
        raise ConfigurationError(str(exc).replace("limit is", "--limit is").replace("within is", "--within is")
                                 ) from None
    with _imported(load_app, args.app_target) as app:
        report = _checked_report(app, statuses, args.limit, args.within)
    if args.json:
        json.dump({"ok": report.ok, "passed": report.passed, "mismatches": [asdict(m) for m in report.mismatches],
                   "skipped": [{"id": id, "reason": why} for id, why in report.skipped]}, sys.stdout)
        print()
    else:
        _print(report)
    return EXIT_OK if report.ok else EXIT_MISMATCH


# Exit code 1 is the verdict alone: every failure to check is a ConfigurationError, which the CLI reports
# in one line with exit code 2 (an exception left to Python would exit 1 too, as if journals failed).

def _imported(load_app: Callable[[str], App], target: str) -> App:
    """The App ``target`` names; any failure of its import (a syntax error, an exception at import, a
    missing dependency) is an error of the check, with its traceback shown for the one who fixes it."""
    try:
        return load_app(target)
    except (ConfigurationError, EmbeddedUnavailable):
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises at import: exit 2, not 1
        traceback.print_exc(file=sys.stderr)
        raise ConfigurationError(f"cannot import the app {target!r}: {type(exc).__name__}: {_first_line(exc)}"
                                 ) from None


def _checked_report(app: App, statuses: list[str], limit: int, within: float) -> ReplayReport:
    """``check_replay``'s report, or a ConfigurationError saying why there is none."""
    try:
        return check_replay(app, statuses, limit, within)
    except (ConfigurationError, EmbeddedUnavailable):
        raise
    except psycopg.errors.UndefinedTable as exc:
        raise ConfigurationError(f"check-replay cannot read schema {app.schema!r}: {_first_line(exc)}; is it"
                                 " migrated (pgflow migrate), and is PGFLOW_SCHEMA the right one?") from None
    except (psycopg.Error, OSError) as exc:
        raise ConfigurationError(f"check-replay cannot read schema {app.schema!r}: {type(exc).__name__}:"
                                 f" {_first_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - an unforeseen failure is no verdict either: exit 2, not 1
        traceback.print_exc(file=sys.stderr)
        raise ConfigurationError(f"check-replay failed: {type(exc).__name__}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")


def _print(report: ReplayReport) -> None:
    # Ids and names are data from the table, printed as Python literals: no control character of
    # theirs reaches the terminal.
    for m in report.mismatches:
        if m.called is not None:
            print(f"workflow {m.workflow_id!r} ({m.name!r}): at position {m.position} the code calls {m.called!r},"
                  f" the journal recorded {m.recorded!r}")
        else:
            print(f"workflow {m.workflow_id!r} ({m.name!r}): {ascii(m.message)[1:-1]}")
    for id, why in report.skipped:
        print(f"skipped {id!r}: {why}")
    verdict = "ok" if report.ok else "FAILED"
    print(f"check-replay {verdict}: {len(report.passed)} replay, {len(report.mismatches)} would not,"
          f" {len(report.skipped)} not checked")
