"""Where a profiled process's CPU goes: ``python -m benchmarks.profile FILE [FILE...]``.

Reads py-spy's raw (collapsed) stacks, as ``python -m benchmarks tasks --profile DIR`` records them for
pgflow's worker (``py-spy record --format raw --nonblocking``, without ``--idle``: only samples where a
thread was running), and prints the share of samples under each part of pgflow's path (the first
category, in the order below, that any frame of the stack matches), then the hottest leaf functions.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

# (category, regular expression on one frame "function (file:line)"), first match wins, checked in
# this order over the whole stack: the claim and finish statements before psycopg in general, etc.
CATEGORIES = [
    ("start-up (imports, before the first claim)", r"importlib\._bootstrap"),
    ("claim statement (Claims.claim)", r"^Claims\.\w*claim"),
    ("finish statement (Engine.finish)", r"^Engine\.finish "),
    ("batched ends (finisher.py)", r"\(finisher\.py"),
    ("other store statements", r"\(store/"),
    ("pings / notify / listen", r"\((notify|listener)\.py"),
    ("heartbeat", r"_heartbeat_loop "),
    ("logging", r"\(logging/"),
    ("workflow execution (executor, execution, outcomes, codec)", r"\((executor|execution|outcomes|codec)\.py"),
    ("claim loop and worker bookkeeping", r"\(worker\.py"),
    ("psycopg / pool, outside the above", r"\((psycopg|psycopg_pool)/|\(pool\.py"),
    ("asyncio / anyio event loop", r"\((asyncio|anyio)/|selectors\.py"),
]


def load(paths: list[Path]) -> collections.Counter[tuple[str, ...]]:
    stacks: collections.Counter[tuple[str, ...]] = collections.Counter()
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if stack and count.isdigit():
                stacks[tuple(stack.split(";"))] += int(count)
    return stacks


def summarize(stacks: collections.Counter[tuple[str, ...]], top: int = 15) -> str:
    total = sum(stacks.values())
    if not total:
        return "no samples"
    compiled = [(name, re.compile(rx)) for name, rx in CATEGORIES]
    by_category: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    for stack, n in stacks.items():
        frames = [f for f in stack if not f.startswith(("process ", "thread "))]
        name = next((c for c, rx in compiled if any(rx.search(f) for f in frames)), "other")
        by_category[name] += n
        if frames:
            leaves[re.sub(r":\d+\)$", ")", frames[-1])] += n
    lines = [f"{total} samples (CPU only)", "", "| where | share |", "|---|---:|"]
    lines += [f"| {c} | {n / total:.1%} |" for c, n in by_category.most_common()]
    lines += ["", "hottest leaf functions:"]
    lines += [f"  {n / total:6.1%}  {leaf}" for leaf, n in leaves.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args(argv)
    print(summarize(load(a.files), a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
