"""``pgflow check-replay``: before a deploy, would the code now importable replay the journals of the
workflows still unfinished? Run in CI against the production database (read-only), it exits 1 naming
every workflow whose journal the new code would meet with ``NonDeterministicWorkflow``.

``check_replay(app)`` / ``check_replay_async(app)`` give the same answer to code.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from ._core.replaycheck import Mismatch, ReplayReport
from ._core.replaycheck import check_replay as _check
from ._core.status import UNFINISHED as _UNFINISHED
from .app import App
from .errors import ConfigurationError

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
    config = await app._runtimes.config_async()
    return await _check(app.registry, app._client.runtime(), config.dsn, config.schema, config.query_timeout,
                        wanted, limit, within)


def check_replay(app: App, statuses: Sequence[str] = UNFINISHED, limit: int = 10_000,
                 within: float = 30.0) -> ReplayReport:
    _checked(statuses, limit, within)
    return app._client.call(lambda: check_replay_async(app, statuses, limit, within))


def add_command(commands: Any, with_app: Callable[[argparse.ArgumentParser], None]) -> None:
    sub = commands.add_parser(
        "check-replay", help="replay unfinished workflows' journals against the code now importable (for CI, "
                             "before a deploy): exits 1 naming each that would not replay")
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
    with load_app(args.app_target) as app:
        report = check_replay(app, statuses, args.limit, args.within)
    if args.json:
        json.dump({"ok": report.ok, "passed": report.passed, "mismatches": [asdict(m) for m in report.mismatches],
                   "skipped": [{"id": id, "reason": why} for id, why in report.skipped]}, sys.stdout)
        print()
    else:
        _print(report)
    return 0 if report.ok else 1


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
