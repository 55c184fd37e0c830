"""The fault suite's quick cases (issue 11): each fault alone under the mixed load of
tests/apps/chaos.py, with every invariant checked at the end (see tests/chaos.py; ``make soak`` runs the
same harness for minutes). ``make test`` runs each fault alone; the mixed case (15 s of every fault in
turn, on both servers) is marked ``chaos`` and runs in ``make chaos``. Faults are real: SIGKILL and
SIGSTOP of worker processes, backends terminated and statements cancelled on the server, the server
restarted, a TCP proxy that freezes or resets links, every connection slot taken."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .chaos import FAULTS, Settings, run_chaos

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


def check(report: Any) -> None:
    print("\n" + report.summary())
    assert sum(report.injected[k] for k in FAULTS) > 0, "no fault was injected"
    assert report.statuses, "nothing was started"
    assert not report.violations, report.summary()


@pytest.mark.parametrize("fault", FAULTS)
async def test_the_load_survives_each_fault_alone(server: tuple[str, Any], tmp_path: Path, fault: str) -> None:
    dsn, embedded = server
    if fault == "restart" and embedded is None:
        pytest.skip("restarts only the embedded PostgreSQL 18")
    if embedded is None and fault not in ("kill", "freeze", "refuse"):
        pytest.skip("on PostgreSQL 15 only the faults that differ by server version; the rest run on 18")
    check(await run_chaos(dsn, tmp_path, Settings(seconds=4.5, every=1.5, faults=(fault,)), embedded))


@pytest.mark.chaos
async def test_the_load_survives_every_fault_mixed(server: tuple[str, Any], tmp_path: Path) -> None:
    dsn, embedded = server
    check(await run_chaos(dsn, tmp_path, Settings(seconds=15.0, every=1.5, seed=11), embedded))
