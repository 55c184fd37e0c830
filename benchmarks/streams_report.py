"""What streams.py reports: the medians per design, the targets pgflow is held to, and the printed table."""

from __future__ import annotations

from typing import Any

from benchmarks.harness import fmt, median, print_head, target


def summarize(runs: list[dict[str, Any]], designs: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for design in designs:
        ok = [r for r in runs if r["design"] == design and r.get("ok")]
        mine = [r for r in runs if r["design"] == design]
        summary[design] = {
            "runs_ok": len(ok), "runs": len(mine),
            "chunks_per_stream": mine[0]["chunks_per_stream"] if mine else None,
            **{k: median([r[k] for r in ok]) for k in ("chunks_per_s", "p50_ms", "p99_ms", "completion_s")},
            "writer_cpu_share": median([r["writer"]["cpu_share"] for r in ok]),
            "reader_cpu_share": median([r["reader"]["cpu_share"] for r in ok]),
            "postgres_cpu_share": median([r["postgres_cpu_share"] for r in ok]),
            "errors": [r["error"] for r in mine if r.get("error")],
        }
    return summary


def ratio(runs: list[dict[str, Any]], num: str, den: str) -> float | None:
    """Median over repeats of num's chunks/s divided by den's, measured in the same repeat."""
    by = {(r["design"], r["repeat"]): r for r in runs if r.get("ok")}
    repeats = sorted({r["repeat"] for r in runs})
    values = [by[(num, k)]["chunks_per_s"] / by[(den, k)]["chunks_per_s"]
              for k in repeats if (num, k) in by and (den, k) in by]
    return median(values)


def targets(runs: list[dict[str, Any]], summary: dict[str, Any], noop: dict[str, Any] | None) -> list[dict[str, Any]]:
    out = []
    if "pgflow" in summary and "raw" in summary:
        out.append(target("pgflow chunks/s >= 70% of raw", ratio(runs, "pgflow", "raw"), lambda v: v >= 0.7, "x"))
        raw_p99 = summary["raw"]["p99_ms"]
        out.append(target("pgflow p99 <= 1.5x raw's", None if not raw_p99 else summary["pgflow"]["p99_ms"] / raw_p99,
                          lambda v: v <= 1.5, "x"))
    if "pgflow" in summary and "naive" in summary:
        out.append(target("pgflow chunks/s >= 10x naive", ratio(runs, "pgflow", "naive"), lambda v: v >= 10, "x"))
    if "pgflow" in summary:
        out.append(target("pgflow p99 write-to-read <= 100 ms", summary["pgflow"]["p99_ms"], lambda v: v <= 100, "ms"))
    if "pgflow" in summary and "dbos" in summary:
        out.append(target("pgflow chunks/s >= 20x DBOS", ratio(runs, "pgflow", "dbos"), lambda v: v >= 20, "x"))
    if noop is not None:
        measured = noop if noop.get("ok") else {}
        out.append(target("no-op start-to-result p50 <= 4 ms", measured.get("p50_ms"), lambda v: v <= 4, "ms"))
        out.append(target("no-op start-to-result p99 <= 8 ms", measured.get("p99_ms"), lambda v: v <= 8, "ms"))
    return out


def print_report(report: dict[str, Any]) -> None:
    s = report["server"]
    print_head(f"\npgflow streams benchmark, {report['date']}: {report['streams']} streams, "
               f"{report['repeats']} repeat(s), medians; PostgreSQL {s.get('server_version')} "
               f"({report['server_kind']}), {report['machine']['cpus']} CPUs, "
               f"pgflow {report['versions'].get('pgflow_commit')}, dbos {report['versions'].get('dbos')}",
               f"{'design':<14}{'K':>6}{'chunks/s':>11}{'p50 ms':>9}{'p99 ms':>9}{'total s':>9}"
               f"{'writer':>8}{'reader':>8}{'pg cpu':>8}  ok")
    for design, d in report["summary"].items():
        print(f"{design:<14}{fmt(d['chunks_per_stream'], 'd'):>6}{fmt(d['chunks_per_s'], ',.0f'):>11}"
              f"{fmt(d['p50_ms'], '.1f'):>9}{fmt(d['p99_ms'], '.1f'):>9}{fmt(d['completion_s'], '.2f'):>9}"
              f"{fmt(d['writer_cpu_share'], '.0%'):>8}{fmt(d['reader_cpu_share'], '.0%'):>8}"
              f"{fmt(d['postgres_cpu_share'], '.0%'):>8}  {d['runs_ok']}/{d['runs']}")
        for error in d["errors"][:3]:
            print(f"    error: {error.splitlines()[0][:150]}")
    print("(writer/reader/pg cpu: CPU seconds per wall second of the run; 100% = one core of the machine's "
          f"{report['machine']['cpus']})")
    noop = report.get("noop")
    if noop:
        if noop.get("ok"):
            print(f"\nno-op workflow, start -> result from another process ({noop['runs']} runs): "
                  f"p50 {noop['p50_ms']:.1f} ms, p99 {noop['p99_ms']:.1f} ms, max {noop['max_ms']:.1f} ms")
        else:
            print(f"\nno-op workflow: failed: {noop.get('error')}")
    if report.get("warning"):
        print(f"\nWARNING: {report['warning']}")
    print("\ntargets:")
    for t in report["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.1f}{t['unit']}"
        print(f"  {t['status']:<5} {t['target']:<40} {value}")
