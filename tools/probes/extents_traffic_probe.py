#!/usr/bin/env python3
"""Probe (issue 19, item 1a): would working sets finer than an allocation make the memory
scheduler move fewer bytes?  Simulated from `gpuos run --record-touched` recordings.

A launch's working set is taken three ways, in 2 MiB blocks (what gpuos moves):
  - whole: the allocations its pointer arguments name (what resident.c makes resident);
  - model: an extents model's prediction (gpuos mem extents learn), plus any block it
    missed (a scheduler would have to bring those in too);
  - touched: the blocks it faulted on (an oracle: the best any prediction could do).
Each is replayed, as one step's launch sequence repeated three times, through Belady's
choice (evict the resident item used farthest in the future, the true future known) with
a pool of the step's whole-allocation footprint over the pressure; the bytes brought in
during the third repetition are one step's traffic in steady state.  Items are whole
allocations for "whole" and single blocks for the others, so the finer sets also get
finer eviction.  The step is the last third of the measured launches (the recordings ran
one warm-up step and two timed ones).

    python3 tools/probes/extents_traffic_probe.py MODEL LOG.jsonl.gz... [--pressures 150,200,300]
                                                  [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpuos.movable import extents

BLOCK = 2 << 20
REPEATS = 3


def blocks(ranges) -> set[int]:
    out: set[int] = set()
    for start, end in ranges:
        out.update(range(start // BLOCK, -(-end // BLOCK)))
    return out


def belady_moved_in(seq: list[frozenset], size: dict, pool: int) -> tuple[int, int]:
    """Blocks brought in during the last of REPEATS repetitions of seq, and the launches whose
    own working set is larger than the pool (they cannot run under it)."""
    calls = seq * REPEATS
    next_use: list[dict] = [{} for _ in calls]
    later: dict = {}
    for t in range(len(calls) - 1, -1, -1):
        for item in calls[t]:
            next_use[t][item] = later.get(item, len(calls))
            later[item] = t
    resident: dict = {}
    used = moved = too_big = 0
    for t, need in enumerate(calls):
        last = t >= len(seq) * (REPEATS - 1)
        if sum(size[i] for i in need) > pool:
            too_big += last
        for item in need:
            if item not in resident:
                used += size[item]
                moved += size[item] if last else 0
            resident[item] = next_use[t][item]
        if used > pool:
            for _, item in sorted(((u, i) for i, u in resident.items() if i not in need), reverse=True):
                if used <= pool:
                    break
                used -= size[item]
                del resident[item]
    return moved, too_big


def probe(model: extents.ExtentModel, log: Path, pressures: list[int]) -> dict:
    counts = extents.LogCounts()
    launches = sorted(extents.read_measured(log, counts), key=lambda launch: launch.seq)
    step = launches[2 * len(launches) // 3:]
    size: dict = {}
    whole, model_sets, touched = [], [], []
    missed_launches = 0
    for launch in step:
        allocs = {(p.alloc_start, p.alloc_end) for p in launch.pointers}
        for a in allocs:
            size[("alloc", a)] = len(blocks([a]))
        whole.append(frozenset(("alloc", a) for a in allocs))
        t = blocks(r for runs in launch.touched.values() for r in runs)
        predicted = blocks(extents.predict(model, launch.kernel, launch.params, launch.grid, launch.block,
                                           launch.arg_hash, launch.pointers))
        missed_launches += bool(t - predicted)
        model_sets.append(frozenset(("block", b) for b in predicted | t))
        touched.append(frozenset(("block", b) for b in t))
    for s in model_sets + touched:
        size.update(dict.fromkeys(s, 1))
    footprint = {name: sum(size[i] for i in frozenset().union(*sets)) * BLOCK
                 for name, sets in (("whole", whole), ("model", model_sets), ("touched", touched))}
    out = {"log": log.name, "launches_in_step": len(step), "model_missed_launches": missed_launches,
           "footprint_bytes": footprint, "pressures": []}
    for pressure in pressures:
        pool = footprint["whole"] // BLOCK * 100 // pressure
        cell = {"pressure": pressure, "pool_bytes": pool * BLOCK}
        for name, sets in (("whole", whole), ("model", model_sets), ("touched", touched)):
            moved, too_big = belady_moved_in(sets, size, pool)
            cell[name] = {"moved_in_bytes": moved * BLOCK, "launches_over_pool": too_big}
        out["pressures"].append(cell)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("logs", type=Path, nargs="+")
    ap.add_argument("--pressures", default="150,200,300")
    ap.add_argument("--json", type=Path, metavar="FILE")
    a = ap.parse_args()
    model = extents.read_model(a.model)
    pressures = [int(p) for p in a.pressures.split(",")]
    results = []
    gib = 1 << 30
    print("| recording | pressure | pool | moved in per step: whole | model | touched (oracle) | model of whole | touched of whole |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for log in a.logs:
        r = probe(model, log, pressures)
        results.append(r)
        for c in r["pressures"]:
            w, m, t = (c[k]["moved_in_bytes"] for k in ("whole", "model", "touched"))
            over = "".join(f" ({c[k]['launches_over_pool']} launches over the pool)" if c[k]["launches_over_pool"] else ""
                           for k in ("whole",))
            print(f"| {r['log']} | {c['pressure']}% | {c['pool_bytes'] / gib:.2f} GiB | {w / gib:.2f} GiB{over} "
                  f"| {m / gib:.2f} GiB | {t / gib:.2f} GiB | {m / w:.0%} | {t / w:.0%} |" if w else
                  f"| {r['log']} | {c['pressure']}% | {c['pool_bytes'] / gib:.2f} GiB | 0 | {m / gib:.2f} GiB "
                  f"| {t / gib:.2f} GiB | - | - |")
    if a.json:
        a.json.write_text(json.dumps({"model": str(a.model), "repeats": REPEATS, "block": BLOCK,
                                      "recordings": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
