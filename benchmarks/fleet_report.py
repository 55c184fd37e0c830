"""What fleet.py reports: medians per scenario (leaving out the runs others' CPU use made noisy, when clean
ones exist), the targets, and the printed tables."""

from __future__ import annotations

import argparse
import functools
from typing import Any

from benchmarks.fleet_app import DEFAULT_POLL, STEP_SLEEP
from benchmarks.harness import fmt, median, print_head, target

THROUGHPUT_MEDIANS = ("workflows_per_s", "wall_per_s", "claim_to_finish_s", "startup_s", "enqueue_per_s",
                      "running_median", "worker_cpu_share", "postgres_cpu_share", "other_cpu_share",
                      "worker_cpu_ms_per_workflow", "postgres_cpu_ms_per_workflow")
FAILOVER_MEDIANS = ("kill_to_claim_s", "kill_to_first_step_s", "kill_to_first_chunk_s", "lease_left_at_kill_s",
                    "expiry_to_claim_s")


class Runs:
    """The runs of one scenario and setting (processes=4, lease=2...), and which of them were noisy."""

    def __init__(self, runs: list[dict[str, Any]], max_other: float, scenario: str, **match: Any) -> None:
        self.max_other = max_other
        self.mine = [r for r in runs if r["scenario"] == scenario and all(r.get(k) == v for k, v in match.items())]

    def noisy(self, r: dict[str, Any]) -> bool:
        return bool((r.get("other_cpu_share") or 0) > self.max_other)

    def ok(self) -> list[dict[str, Any]]:
        """The successful runs, leaving out noisy ones (kept after --tries) when there are clean ones."""
        found = [r for r in self.mine if r.get("ok")]
        return [r for r in found if not self.noisy(r)] or found

    def medians(self, keys: tuple[str, ...]) -> dict[str, float | None]:
        return {k: median([r[k] for r in self.ok()]) for k in keys}

    def values(self, key: str, digits: int) -> list[str]:
        """Every successful run's value, in repeat order; a noisy run's is marked with '*'."""
        return [f"{r[key]:.{digits}f}" + ("*" if self.noisy(r) else "") for r in self.mine if r.get("ok")]

    def count(self) -> str:
        n = sum(1 for r in self.mine if self.noisy(r))
        return f"{sum(1 for r in self.mine if r.get('ok'))}/{len(self.mine)}" + (f" ({n} noisy)" if n else "")


def summarize(runs: list[dict[str, Any]], a: argparse.Namespace) -> dict[str, Any]:
    ran = {r["scenario"] for r in runs}
    summary: dict[str, Any] = {"throughput": throughput_summary(runs, a) if "throughput" in ran else {},
                               "failover": {}, "latency": None}
    for lease in a.leases if "failover" in ran else []:
        rs = Runs(runs, a.max_other, "failover", lease=lease)
        summary["failover"][f"{lease:g}"] = {
            "runs_ok": rs.count(), "bound_s": lease + DEFAULT_POLL, **rs.medians(FAILOVER_MEDIANS),
            "max_kill_to_first_step_s": max((r["kill_to_first_step_s"] for r in rs.ok()), default=None),
            "all_values": rs.values("kill_to_first_step_s", 2),
        }
    if "latency" in ran:
        rs = Runs(runs, a.max_other, "latency")
        ok = rs.ok()
        summary["latency"] = {
            "runs_ok": rs.count(), "runs_each": a.latency_runs, **rs.medians(("p50_ms", "p90_ms", "p99_ms")),
            "max_ms": max((r["max_ms"] for r in ok), default=None), "all_p99_ms": rs.values("p99_ms", 1),
            "other_cpu_share": median([r["other_cpu_share"] for r in ok]),
            "stages_ms": {k: median([r["stages_ms"][k] for r in ok if r.get("stages_ms")])
                          for k in (ok[0].get("stages_ms") or {} if ok else {}) if k != "per_run"},
        }
    return summary


def throughput_summary(runs: list[dict[str, Any]], a: argparse.Namespace) -> dict[str, Any]:
    """Medians per process count, and each count's workflows/s over the first's: the median of the ratios
    of runs made side by side in the same repeat, leaving out repeats with a noisy run when others remain."""
    out: dict[str, Any] = {}
    for p in a.process_counts:
        rs = Runs(runs, a.max_other, "throughput", processes=p)
        out[str(p)] = {"runs_ok": rs.count(), **rs.medians(THROUGHPUT_MEDIANS),
                       "all_values": rs.values("workflows_per_s", 0)}
    if len(a.process_counts) > 1:
        base = a.process_counts[0]
        every = Runs(runs, a.max_other, "throughput")
        by = {(r["processes"], r["repeat"]): r for r in every.mine if r.get("ok")}
        quiet = {k for k in range(a.repeats) if all((p, k) in by and not every.noisy(by[(p, k)])
                                                    for p in a.process_counts)}
        for p in a.process_counts[1:]:
            out[f"ratio_{p}_to_{base}"] = median(
                [by[(p, k)]["workflows_per_s"] / by[(base, k)]["workflows_per_s"]
                 for k in (quiet or range(a.repeats)) if (p, k) in by and (base, k) in by])
    return out


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    if summary["latency"] is not None:
        out.append(target("no-op start-to-result p99 < 20 ms", summary["latency"]["p99_ms"], lambda v: v < 20, " ms"))
    for lease, f in summary["failover"].items():
        # A margin of one step and 100 ms for the replay and the record's commit.
        limit: float = f["bound_s"] + STEP_SLEEP + 0.1
        out.append(target(f"takeover (lease {lease}) <= lease + poll ({f['bound_s']:g} s), worst run",
                          f["max_kill_to_first_step_s"], functools.partial(float.__ge__, limit), " s"))
    return out


def print_report(report: dict[str, Any]) -> None:
    s, summary = report["server"], report["summary"]
    print(f"\npgflow fleet benchmark, {report['date']}: PostgreSQL {s.get('server_version')} "
          f"({report['server_kind']}), {report['repeats']} repeat(s), medians; "
          f"{report['machine']['cpus']} CPUs, pgflow {report['versions'].get('pgflow_commit')}")
    if any(k.isdigit() for k in summary["throughput"]):
        print_throughput(summary["throughput"], report["settings"])
    if summary["failover"]:
        print_failover(summary["failover"])
    if summary["latency"] is not None:
        print_latency(summary["latency"])
    print("\ntargets:")
    for t in report["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.2f}{t['unit']}"
        print(f"  {t['status']:<5} {t['target']:<58} {value}")
    for r in [r for r in report["runs"] if not r.get("ok")][:5]:
        print(f"  failed run {r['scenario']} repeat {r['repeat']}: {str(r.get('error')).splitlines()[0][:200]}")


def print_throughput(tp: dict[str, Any], settings: dict[str, Any]) -> None:
    print_head(f"\n1. claim throughput: {settings['workflows']} no-op workflows enqueued first, "
               f"--concurrency {settings['concurrency']}",
               f"{'processes':<10}{'wf/s':>9}{'wall wf/s':>11}{'run s':>8}{'startup s':>11}"
               f"{'running':>9}{'workers':>9}{'pg cpu':>8}{'other':>7}{'ms/wf w+pg':>12}  ok   per repeat")
    for p, d in tp.items():
        if not p.isdigit():
            continue
        print(f"{p:<10}{fmt(d['workflows_per_s'], ',.0f'):>9}{fmt(d['wall_per_s'], ',.0f'):>11}"
              f"{fmt(d['claim_to_finish_s'], '.2f'):>8}{fmt(d['startup_s'], '.2f'):>11}"
              f"{fmt(d['running_median'], '.0f'):>9}{fmt(d['worker_cpu_share'], '.0%'):>9}"
              f"{fmt(d['postgres_cpu_share'], '.0%'):>8}{fmt(d['other_cpu_share'], '.0%'):>7}"
              f"{fmt(d['worker_cpu_ms_per_workflow'], '.2f'):>6}+{fmt(d['postgres_cpu_ms_per_workflow'], '.2f'):<5}"
              f"  {d['runs_ok']}  {' '.join(d['all_values'])}")
    for k, v in tp.items():
        if k.startswith("ratio_"):
            _, num, _, den = k.split("_")
            print(f"  {num} processes / {den}: {fmt(v, '.2f')}x (median of per-repeat ratios)")
    print("  (wf/s: N / first claim -> last finish on the server clock; wall: from process spawn, "
          "50 ms poll; running: median in-flight rows;\n   cpu: CPU s per wall s from the first claim seen, "
          "100% = one core; other: busy CPU of everything else on the machine;\n   ms/wf: CPU ms per workflow "
          "of the worker processes + the server)")


def print_failover(failover: dict[str, Any]) -> None:
    print_head(f"\n2. SIGKILL -> resumption by an idle worker (poll_interval {DEFAULT_POLL:g} s, "
               f"{STEP_SLEEP * 1000:.0f} ms steps)",
               f"{'lease s':<9}{'claim s':>9}{'1st step s':>12}{'1st chunk s':>13}{'lease left':>12}"
               f"{'expiry->claim':>15}{'bound':>7}  ok   1st step per repeat")
    for lease, d in failover.items():
        print(f"{lease:<9}{fmt(d['kill_to_claim_s'], '.2f'):>9}{fmt(d['kill_to_first_step_s'], '.2f'):>12}"
              f"{fmt(d['kill_to_first_chunk_s'], '.2f'):>13}{fmt(d['lease_left_at_kill_s'], '.2f'):>12}"
              f"{fmt(d['expiry_to_claim_s'], '.2f'):>15}{d['bound_s']:>7g}  {d['runs_ok']}  "
              f"{' '.join(d['all_values'])}")
    print("  (from the kill; lease left: the dead worker's lease at the kill, between lease*2/3 and lease "
          "since it is renewed every lease/3;\n   expiry->claim: the idle worker's wait for its next poll, "
          "0 .. poll_interval. Bound: lease + poll_interval, plus one step;\n   on average 5/6 lease + "
          "poll_interval/2.)")


def print_latency(lat: dict[str, Any]) -> None:
    print(f"\n3. no-op start -> handle.result(), idle worker in another process ({lat['runs_each']} "
          f"sequential runs per repeat): p50 {fmt(lat['p50_ms'], '.1f')} ms, p90 {fmt(lat['p90_ms'], '.1f')} ms, "
          f"p99 {fmt(lat['p99_ms'], '.1f')} ms, max {fmt(lat['max_ms'], '.1f')} ms  "
          f"(p99 per repeat {' '.join(lat['all_p99_ms'])}; {lat['runs_ok']} ok; other CPU on the machine "
          f"{fmt(lat['other_cpu_share'], '.0%')})")
    st = lat.get("stages_ms") or {}
    if st:
        print("   where it goes (median / p99 ms): " + ", ".join(
            f"{k.replace('_', ' ')} {fmt(st.get(k), '.1f')} / {fmt(st.get(k + '_p99'), '.1f')}"
            for k in ("start_to_enqueue", "enqueue_to_claim", "claim_to_finish", "finish_to_result")))


def describe(r: dict[str, Any]) -> str:
    """One run's progress line."""
    if r["scenario"] == "throughput":
        return (f"throughput {r['processes']} process(es): {r.get('workflows_per_s', 0):8,.0f} wf/s "
                f"(run {r.get('claim_to_finish_s', 0):.2f} s, startup {r.get('startup_s', 0):.2f} s, "
                f"enqueue {r.get('enqueue_per_s', 0):,.0f}/s, pg cpu {r.get('postgres_cpu_share') or 0:.0%}, "
                f"workers cpu {r.get('worker_cpu_share', 0):.0%}, other {r.get('other_cpu_share', 0):.0%})")
    if r["scenario"] == "failover":
        return (f"failover lease {r['lease']:g}: claim {r.get('kill_to_claim_s', 0):.2f} s, "
                f"first step {r.get('kill_to_first_step_s', 0):.2f} s, first chunk "
                f"{r.get('kill_to_first_chunk_s', 0):.2f} s (lease left at kill "
                f"{r.get('lease_left_at_kill_s', 0):.2f} s)")
    return (f"latency: p50 {r.get('p50_ms', 0):.1f} ms, p99 {r.get('p99_ms', 0):.1f} ms, "
            f"max {r.get('max_ms', 0):.1f} ms, other cpu {r.get('other_cpu_share', 0):.0%}")
