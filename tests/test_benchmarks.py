"""The benchmark harness (``python -m benchmarks``): its JSON, its ratios, its deadlines and its cleanup.

The end-to-end tests run the tasks benchmark for pgflow alone, tiny, against the embedded test server, in
databases named with a prefix of their own (dropped afterwards); the peers are left to the benchmark
itself (they need the [bench] extra and take minutes).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

from benchmarks import tasks

from .servers import EmbeddedServer

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def dsn(embedded_server: EmbeddedServer) -> str:
    """The harness is tested once, on the embedded PostgreSQL 18 (the benchmarks' own default server
    besides PostgreSQL 15): what differs between server versions is pgflow's, tested on both."""
    return embedded_server.dsn


def run(dsn: str, prefix: str, tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BENCH_DB_PREFIX": prefix,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "benchmarks", "tasks", "--dsn", dsn, "--systems", "pgflow",
                           "--output", str(tmp_path / "report.json"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def processes_with(marker: str) -> list[int]:
    """Our processes whose environment mentions ``marker`` (the run's database prefix)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def databases(dsn: str, prefix: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT datname FROM pg_database WHERE datname LIKE %s",
                                           (prefix + "%",)).fetchall()]


@pytest.mark.slow
def test_json_is_one_object_of_the_medians(dsn: str, tmp_path: Path) -> None:
    prefix = f"bt{uuid.uuid4().hex[:8]}_"
    done = run(dsn, prefix, tmp_path, "--json", "--tasks", "60", "--runs", "5", "--repeats", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    out = json.loads(lines[0])
    assert out["benchmark"] == "tasks"
    figures = out["systems"]["pgflow"]
    for key in ("tasks_per_s", "tasks64_per_s", "enqueue_per_s", "enqueue16_per_s", "p50_ms", "p99_ms"):
        assert figures[key] > 0, key
    assert figures["p99_ms"] >= figures["p50_ms"]
    report = json.loads((tmp_path / "report.json").read_text())
    if importlib.util.find_spec("matplotlib") is not None:  # the plot needs the [bench] extra
        assert (tmp_path / "report.png").stat().st_size > 0
    runs = report["runs"]
    # Two repeats of the c16 run and of the c64 run, in that order, each with its load average.
    assert [(r["repeat"], r["concurrency"]) for r in runs] == [(0, 16), (0, 64), (1, 16), (1, 64)]
    assert all(r["ok"] and "loadavg_before" in r and r["latency_runs"] == 5 for r in runs if r["concurrency"] == 16)
    assert figures["tasks_per_s"] == statistics.median(r["tasks_per_s"] for r in runs if r["concurrency"] == 16)
    assert figures["tasks64_per_s"] == statistics.median(r["tasks_per_s"] for r in runs if r["concurrency"] == 64)
    assert databases(dsn, prefix) == []
    assert processes_with(prefix) == []


@pytest.mark.slow
def test_a_run_past_its_deadline_fails_and_leaves_no_process(dsn: str, tmp_path: Path) -> None:
    prefix = f"bt{uuid.uuid4().hex[:8]}_"
    # 20,000 tasks cannot be enqueued in 3 s: the client is killed at the deadline. One repeat: its c16
    # and c64 runs both meet the deadline (three repeats would only meet it six times, 18 s of waiting).
    done = run(dsn, prefix, tmp_path, "--json", "--tasks", "20000", "--timeout", "3", "--repeats", "1")
    assert done.returncode == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["runs"] and not any(r["ok"] for r in report["runs"])
    assert all("deadline" in r["error"] for r in report["runs"]), report["runs"]
    assert json.loads(done.stdout)["systems"]["pgflow"] == {}
    assert databases(dsn, prefix) == []
    assert processes_with(prefix) == []


def test_side_by_side_compares_runs_of_the_same_repeat() -> None:
    def rec(system: str, repeat: int, rate: float, p50: float) -> dict[str, object]:
        return {"system": system, "repeat": repeat, "concurrency": 16, "ok": True, "tasks_per_s": rate,
                "p50_ms": p50}

    runs = [rec("pgflow", 0, 300, 4.0), rec("celery", 0, 100, 8.0), rec("pgqueuer", 0, 200, 100.0),
            rec("pgflow", 1, 100, 10.0), rec("celery", 1, 50, 5.0), rec("pgqueuer", 1, 400, 90.0)]
    ratios = tasks.side_by_side(runs, ["pgflow", "celery", "pgqueuer"])
    # Rates: pgflow / the best peer of that repeat; latencies: the best peer / pgflow (above 1: pgflow ahead).
    assert ratios["tasks_per_s"]["per_repeat"] == [{"best_peer": "pgqueuer", "ratio": 1.5},
                                                   {"best_peer": "pgqueuer", "ratio": 0.25}]
    assert ratios["p50_ms"]["per_repeat"] == [{"best_peer": "celery", "ratio": 2.0},
                                              {"best_peer": "celery", "ratio": 0.5}]
    assert ratios["tasks_per_s"]["median"] == pytest.approx(0.875)
    summary = tasks.summarize(runs, ["pgflow", "celery"])
    assert summary["pgflow"]["tasks_per_s"] == 200 and summary["celery"]["p50_ms"] == 6.5


@pytest.mark.slow
def test_flat_compares_filled_and_backlogged_tables_with_empty_ones(dsn: str, tmp_path: Path) -> None:
    prefix = f"bt{uuid.uuid4().hex[:8]}_"
    # Small on purpose (the harness's shape is tested, not its speed): one repeat of each state, and
    # 16 streams of 20 chunks instead of streams.py's 256 of 500.
    env = {**os.environ, "BENCH_DB_PREFIX": prefix, "BENCH_FLAT_FILLED": "3000", "BENCH_FLAT_BACKLOG": "2000",
           "BENCH_FLAT_STREAMS": "16", "BENCH_FLAT_CHUNKS": "20",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "benchmarks", "flat", "--dsn", dsn, "--json", "--tasks", "200",
                           "--repeats", "1", "--output", str(tmp_path / "flat.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert set(out["systems"]) == {"empty", "filled", "backlog"}
    report = json.loads((tmp_path / "flat.json").read_text())
    runs = {r["state"]: r for r in report["runs"]}
    # The fill really is in the tables: 3,000 finished copies and their 2 chunks each, or the backlog.
    assert runs["filled"]["rows"] == {"workflows": 3000 + 200 + 1, "streams": 2 * 3000 + 2}
    assert runs["backlog"]["rows"]["workflows"] == 2000 + 1
    for r in runs.values():
        assert r["tasks_per_s"] > 0 and r["chunks_per_s"] > 0
        assert any("Update on workflows" in line for line in r["claim_plan"])
    assert report["settings"]["streams"] == 16 and report["settings"]["chunks"] == 20
    assert set(report["ratios_to_empty"]) >= {"filled/tasks_per_s", "backlog/chunks_per_s"}
    assert databases(dsn, prefix) == []
    assert processes_with(prefix) == []
