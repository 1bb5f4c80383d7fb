#!/usr/bin/env python3
"""Probe (issue 19): how much a launch log's call sequence repeats, and what an eviction
policy would move for it under a limit, simulated at gpuos's granularity (whole movable
allocations, 2 MiB-rounded).

From a `gpuos run --log` of a workload (no limit), the calls that touch movable memory in
order, each as the set of allocations it needs (resident.c's ticks).  Reported:
  - the step length (the most common gap between the occurrences of calls that come
    once per step) and the share of calls that differ one step apart (resident.c learns a
    period only where they agree);
  - the bytes brought in under a limit (default 2/3 of all movable memory) by least
    recently used, by Belady's choice with the true future (an oracle: the least any
    policy at this granularity could move), and by resident.c's estimate (a use one
    period back, plus the period) with the step length as the period.

    python3 tools/probes/oversub_trace_probe.py LOG.jsonl.gz [--limit-fraction 0.667]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json

GRAN = 2 << 20


def calls_of(path: str) -> tuple[dict[int, int], list[tuple[int, ...]]]:
    recs = [json.loads(line) for line in gzip.open(path, "rt")]
    sizes = {r["base"]: -(-r["size"] // GRAN) * GRAN for r in recs if r.get("type") == "alloc" and r.get("movable")}
    bases = sorted(sizes)

    def holder(p: int) -> int | None:
        i = bisect.bisect_right(bases, p) - 1
        return bases[i] if i >= 0 and p < bases[i] + sizes[bases[i]] else None

    calls = []
    for r in sorted((r for r in recs if r.get("type") in ("launch", "copy")), key=lambda r: r["seq"]):
        ptrs = [b["base"] for b in r["bufs"]] if r["type"] == "launch" else [r["dst"], r["src"]]
        need = tuple(dict.fromkeys(a for a in map(holder, ptrs) if a))
        if need:
            calls.append(need)
    return sizes, calls


def step_length(calls: list[tuple[int, ...]]) -> int:
    at = collections.defaultdict(list)
    for t, c in enumerate(calls):
        at[c].append(t)
    gaps = collections.Counter(b - a for v in at.values() if 3 <= len(v) <= 64 for a, b in zip(v, v[1:]))
    return gaps.most_common(1)[0][0]


def moved(sizes: dict[int, int], calls: list[tuple[int, ...]], limit: int, policy: str, period: int = 0) -> int:
    uses = collections.defaultdict(list)
    for t, c in enumerate(calls):
        for a in c:
            uses[a].append(t)
    nxt = {a: 0 for a in uses}
    resident: set[int] = set()
    used = total = 0
    last: dict[int, int] = {}
    for t, c in enumerate(calls):
        for a in c:
            while nxt[a] < len(uses[a]) and uses[a][nxt[a]] <= t:
                nxt[a] += 1
        want = [a for a in c if a not in resident]
        need = sum(sizes[a] for a in want)
        while used + need > limit:
            cands = [a for a in resident if a not in c]
            if policy == "lru":
                v = min(cands, key=lambda a: last.get(a, -1))
            elif policy == "oracle":
                v = max(cands, key=lambda a: uses[a][nxt[a]] if nxt[a] < len(uses[a]) else 1 << 62)
            else:
                def estimate(a: int) -> int:
                    back = [u for u in uses[a][:nxt[a]] if u > t - period]
                    return back[0] + period - t if back else 1 << 62
                v = max(cands, key=estimate)
            resident.discard(v)
            used -= sizes[v]
        for a in want:
            resident.add(a)
            used += sizes[a]
            total += sizes[a]
        for a in c:
            last[a] = t
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--limit-fraction", type=float, default=2 / 3)
    args = ap.parse_args()
    sizes, calls = calls_of(args.log)
    step = step_length(calls)
    tail = calls[-4 * step:]
    differ = sum(1 for t in range(step, len(tail)) if tail[t] != tail[t - step]) / max(1, len(tail) - step)
    limit = int(sum(sizes.values()) * args.limit_fraction)
    out = {"log": args.log, "calls": len(calls), "allocations": len(sizes), "movable_bytes": sum(sizes.values()),
           "step_calls": step, "differ_one_step_apart": round(differ, 3), "limit": limit,
           "moved_lru": moved(sizes, calls, limit, "lru"), "moved_oracle": moved(sizes, calls, limit, "oracle"),
           "moved_period_estimate": moved(sizes, calls, limit, "period", step)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
