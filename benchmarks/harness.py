"""What every benchmark of ``python -m benchmarks`` shares: the server it runs on, processes that are always
stopped, per-system databases, medians and percentiles, and the results file with its plot."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"


def log(*parts: Any) -> None:
    """Progress goes to stderr: stdout is kept for --json."""
    print(*parts, file=sys.stderr, flush=True)


def answers(dsn: str, timeout: float = 3.0) -> bool:
    import psycopg

    try:
        with psycopg.connect(dsn, connect_timeout=int(timeout), autocommit=True) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


def resolve_dsn(given: str | None) -> str:
    """--dsn, else the PostgreSQL 15 of these machines when it answers, else $PGFLOW_DSN."""
    if given:
        return given
    if answers(DEFAULT_DSN):
        return DEFAULT_DSN
    env = os.environ.get("PGFLOW_DSN")
    if env:
        return env
    raise SystemExit(f"no server: {DEFAULT_DSN} does not answer and PGFLOW_DSN is not set; pass --dsn")


def with_database(dsn: str, name: str) -> str:
    import psycopg.conninfo

    return psycopg.conninfo.make_conninfo(dsn, dbname=name) if "://" not in dsn else _url_with(dsn, name)


def _url_with(dsn: str, name: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + name))


def recreate_database(admin_dsn: str, name: str) -> str:
    """Drop (forcing out any session left) and create database ``name``; return its DSN."""
    import psycopg

    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return with_database(admin_dsn, name)


@contextlib.contextmanager
def serving(given: str | None) -> Iterator[tuple[str, str]]:
    """The server of a benchmark run as its own script: --dsn, else $PGFLOW_DSN, else pgflow's embedded
    PostgreSQL 18, kept up (its App open) until the benchmark ends. Yields the DSN and which it was."""
    dsn = given or os.environ.get("PGFLOW_DSN")
    if dsn:
        yield dsn, "given dsn"
        return
    import pgflow

    with pgflow.App() as embedded:
        yield embedded.dsn, "embedded"


def drop_schema(dsn: str, schema: str) -> None:
    """Drop a run's schema; a failure to (the server gone) is not the run's result, so it is ignored."""
    import psycopg

    with contextlib.suppress(psycopg.Error), psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def drop_database(admin_dsn: str, name: str) -> None:
    import psycopg

    with contextlib.suppress(psycopg.Error), psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def server_info(dsn: str) -> dict[str, Any]:
    """The settings that decide a benchmark's figures, and the postmaster's pid when the server runs on
    this machine (for its CPU time)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        info: dict[str, Any] = {"postmaster_pid": None}
        with contextlib.suppress(OSError, ValueError, IndexError):  # a server on another machine
            stat = Path(f"/proc/{conn.info.backend_pid}/stat").read_text()
            if stat[stat.index("(") + 1: stat.rindex(")")].startswith("postgres"):
                info["postmaster_pid"] = int(stat[stat.rindex(")") + 2:].split()[1])
        for setting in ("server_version", "fsync", "synchronous_commit", "shared_buffers", "max_connections",
                        "commit_delay"):
            row = conn.execute(f"SHOW {setting}").fetchone()
            info[setting] = row[0] if row else None
        return info


def pg_major(info: dict[str, Any]) -> str:
    major = str(info.get("server_version") or "").split(".")[0].split()[0]
    return f"pg{major}" if major.isdigit() else "pg"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def median(values: list[Any]) -> float | None:
    """The median of the values present (None and NaN left out: a run that did not measure it)."""
    present = [v for v in values if v is not None and v == v]
    return statistics.median(present) if present else None


def latency_summary(latencies: list[float]) -> dict[str, float]:
    """Seconds in, milliseconds out: count, p50, p90, p99, max and mean."""
    nan = float("nan")
    return {
        "count": len(latencies),
        "p50_ms": percentile(latencies, 0.50) * 1000 if latencies else nan,
        "p90_ms": percentile(latencies, 0.90) * 1000 if latencies else nan,
        "p99_ms": percentile(latencies, 0.99) * 1000 if latencies else nan,
        "max_ms": max(latencies) * 1000 if latencies else nan,
        "mean_ms": statistics.fmean(latencies) * 1000 if latencies else nan,
    }


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def commit() -> str | None:
    """The checkout's commit, with "+local changes" when pgflow/ differs from it."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "pgflow"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("+local changes" if dirty else "") if out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def child_env(**extra: str) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""), **extra}


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (so field 1 is the parent's pid, 11 and 12
    user and system ticks); None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system, every thread) a process has used; 0 when it is gone."""
    fields = proc_stat(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu() -> float:
    """CPU seconds this process has used (user + system)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def machine_cpu() -> tuple[float, float, float]:
    """Machine-wide CPU seconds so far, summed over cores: (busy, idle, stolen by the hypervisor)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    ticks = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / ticks, (idle + iowait) / ticks, steal / ticks


def postgres_cpu(postmaster: int | None) -> float | None:
    """CPU seconds used so far by the benchmarked server: its postmaster, every live child process
    (backends, walwriter, ...) and the children it has already reaped. None when it is not local."""
    return None if postmaster is None else family_cpu(postmaster)


def family_cpu(pid: int) -> float:
    """CPU seconds used so far by a process, its live children and the children it has reaped (a
    server's backends; a supervised worker's processes)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = proc_stat(int(entry.name))
        if fields is None:
            continue
        if int(entry.name) == pid:
            total += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
        elif int(fields[1]) == pid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def versions(packages: tuple[str, ...] = ("pgflow-durable", "psycopg", "psycopg-pool", "anyio")) -> dict[str, Any]:
    """What was measured: the packages' versions and the pgflow commit (marked when the tree had local
    changes)."""
    from importlib import metadata

    found: dict[str, Any] = {}
    for package in packages:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    found["pgflow_commit"] = commit()
    return found


class Proc:
    """A subprocess in its own process group, logging to a file, stopped (SIGTERM, then SIGKILL of its
    whole group) by ``stop``; use it as a context manager so that happens in a ``finally``."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name, self.log_path = name, log_path
        with log_path.open("ab") as out:
            self.popen = subprocess.Popen(argv, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def check(self, what: str) -> None:
        if not self.alive():
            raise RunFailed(f"{self.name} exited ({self.popen.returncode}) while waiting for {what}:\n{self.tail()}")

    def stop(self, wait: float = 10.0) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(wait)
        with contextlib.suppress(ProcessLookupError):  # whatever of the group is left (children, threads)
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def __enter__(self) -> Proc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RunFailed(Exception):
    """One run failed (a process died, a deadline passed): reported, and the other runs go on."""


def error_text(exc: BaseException) -> str:
    """A failed run's error: a RunFailed says what happened in its own words; anything else is a bug, so
    its type is kept."""
    return str(exc) if isinstance(exc, RunFailed) else f"{type(exc).__name__}: {exc}"


def run_json(argv: list[str], env: dict[str, str], timeout: float, log_path: Path) -> dict[str, Any]:
    """Run a client process to its end (killed at the deadline) and return the JSON of its last line."""
    with log_path.open("ab") as err:
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=err, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise RunFailed(f"{' '.join(argv[2:5])} overran its {timeout:.0f} s deadline") from exc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = out.decode(errors="replace").strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        raise RunFailed(f"{' '.join(argv[2:5])} exited {proc.returncode}:\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def profiler(pid: int, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    """py-spy recording ``pid`` into ``out``: raw collapsed stacks (what profile.py reads), 200 Hz, without
    pausing the process. The py-spy beside this Python is preferred: the [bench] extra installs it there."""
    beside = Path(sys.executable).parent / "py-spy"
    pyspy = str(beside) if beside.exists() else (shutil.which("py-spy") or "py-spy")
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([pyspy, "record", "--pid", str(pid), *extra, "--format", "raw", "--rate", "200",
                             "--nonblocking", "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_profiler(proc: subprocess.Popen[bytes] | None) -> None:
    """Wait for py-spy to write its file, which it does when the profiled process exits; kill it after 30 s."""
    if proc is None:
        return
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def target(name: str, value: float | None, ok: Callable[[float], bool], unit: str) -> dict[str, Any]:
    """One line of a benchmark's targets: PASS or MISS, N/A when the figure was not measured."""
    return {"target": name, "value": value, "unit": unit,
            "status": "N/A" if value is None else ("PASS" if ok(value) else "MISS")}


def write_report(report: dict[str, Any], output: str | None, name: str) -> Path:
    """Write the report as JSON at ``output``, else as benchmarks/results/``name``; return where."""
    RESULTS.mkdir(exist_ok=True)
    out = Path(output) if output else RESULTS / name
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return out


def print_head(title: str, head: str) -> None:
    """A table's title, then its column heads, underlined."""
    print(title)
    print(head)
    print("-" * len(head))


def save(benchmark: str, info: dict[str, Any], report: dict[str, Any], figures: dict[str, dict[str, Any]],
         output: str | None = None) -> Path:
    """Write the report as JSON under benchmarks/results/ (or ``output``) and its plot beside it."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H%M")
    out = write_report(report, output, f"{benchmark}-{stamp}-{pg_major(info)}.json")
    with contextlib.suppress(ImportError):
        plot(benchmark, figures, out.with_suffix(".png"), f"{benchmark} on PostgreSQL {info.get('server_version')}"
             f", {report.get('date', '')}")
    return out


def plot(benchmark: str, figures: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """One grouped bar chart: a group per figure, a bar per system, each figure on its own axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(figures)
    names = [n for n in dict.fromkeys(k for f in figures.values() for k, v in f.items()
                                       if isinstance(v, (int, float)) and not isinstance(v, bool))]
    if not systems or not names:
        return
    fig, axes = plt.subplots(1, len(names), figsize=(3.0 * len(names) + 1, 4.2), squeeze=False)
    colours = plt.get_cmap("tab10")
    for ax, name in zip(axes[0], names, strict=True):
        values = [figures[s].get(name) for s in systems]
        for i, (system, value) in enumerate(zip(systems, values, strict=True)):
            if value is not None:
                ax.bar(i, value, color=colours(i % 10), label=system)
                label = f"{value:,.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"
                ax.annotate(label, (i, value), ha="center",
                            va="bottom", fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_xticks(range(len(systems)), systems, rotation=45, ha="right", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(title + "  (medians; _per_s: higher is better, _ms/_s: lower is better)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
