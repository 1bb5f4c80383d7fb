#!/usr/bin/env python3
"""GPU memory oversubscription: a workload's throughput under `gpuos run --gpu-memory`
against the same workload with all its memory on the GPU, in the same run.

For each workload of the suite (gpuos.workloads.suite: deterministic, with a checksum of
its final state), in one run:

  ideal       `gpuos run --gpu-memory` with the GPU's whole memory as the limit (fits in
              memory: nothing is checked or moved): its timed seconds, checksum and the
              most movable memory it held at once (peak, from `gpuos mem stats`)
  per pressure P (100, 150, 200, 300 %): the limit is peak * 100 / P, and the workload
              runs under it twice:
                reactive   --evict lru: made resident at each call, least recently used
                           evicted (the baseline)
                proactive  --evict future: evicted by the call sequence learned as it
                           repeats (Belady's choice)
              each: throughput relative to the ideal, checksum equal or not, bytes moved
              in and out, their rates against the pinned-copy rate measured at the start
              of the run, the mean and p99 stall of a call that waited (p99: the top of
              its power-of-two histogram bucket), the evictions the learned sequence chose

Overhead at 100% (--overhead-turns K): separate runs of one workload on these machines
differ by far more than the 2% the issue allows (up to 1.7x within a lease), so each
workload also runs several systems alive at once, taking the GPU in turns of about
--overhead-turn-ms (the suite's --turns: every turn ending in a device synchronization,
the others waiting meanwhile).  --overhead-systems picks them (SYSTEMS; the first three
by default):
  plain       the workload alone, no gpuos
  ideal       as above (gpuos, the whole GPU as the limit)
  limited     --gpu-memory at 100% of the peak of a run of the turns' own steps (not
              the ideal's: an inference loop keeps its outputs), --evict future
  passive     ideal with its operations not recorded (--paused)
  driver      gpuos with the driver's own memory (--memory driver), recording
K rounds (rounded up to a whole set of balanced_orders), one turn of each system a
round, the rounds' orders such that each system runs in each place, and right after
each other one, equally often.  (A fixed ring of the three put a steady bias of up to
8% between ideal and limited, which run the same code at 100%: nothing is checked or
moved while all the memory fits, resident.c.)  Each system's turn is compared with
plain's in the same round, and limited's with ideal's (bench/paired.py
rounds_overhead): the overhead and its 95% interval, taken over blocks of neighbouring
rounds (about the square root of their number: a process's own speed drifts over
seconds, so neighbouring rounds share their error; over single rounds the same code
differed from itself by up to three intervals).  Limited over ideal is the method's own
check: it should be 0 within its interval; passive and driver split what gpuos itself
costs between recording and movable memory.  The checksums must all be equal (the same
steps, the same seed).  On the H200 one run's interval is ±2-7%: --overhead-from
recomputes stored runs with the current method and pools each workload over them.

Groups (--groups): several processes in one pool (`gpuos run --share NAME`), started at
once, each timing its steps from the moment all have warmed up (the suite's
--start-gate: their start-ups take different times, and a member timed while the others
still start runs alone; the JSON's started_together says whether all reached the gate):

  llm-replicas  three replicas of a GPT prefill loop of about 9 GB each
  dnn-mix       GPT and ResNet-50, each training and inference: four processes

  ideal       the same processes at once, each with the GPU's whole memory as its limit
              (nothing checked or moved): each one's items per second, and the sum of
              their peaks
  one at a time  each process alone, the whole GPU its own, one after another: the
              ideal's time over the sum of theirs is what a scheduler that runs one
              process at a time could reach at best (the members of a group share the
              GPU's compute in the ideal; a pool that holds only some of them at once
              gives that up)
  per pressure P (and per slice of --slice, a list to compare slices in one run): one
              pool of sum-of-peaks * 100 / P, time slices of that many ms, each
              process evicting by LRU (reactive) or by its learned sequence (proactive);
              in both the process whose turn it is makes the others evict first.  The
              figure is the group's throughput against the ideal's: the items of every
              member's timed steps over the time from the first timed step's start to
              the last one's end (each member's step log, on one clock), with the
              group's switches, the time from each switch until the new holder's first
              call had its memory in (mean and p99), and the bytes moved.  (Summing
              the members' own items per second would count a member that ran its
              timed steps alone, within its turns, at its speed alone.)  Each cell and
              the ideal run --repeat times (3), the median kept and every run in the
              JSON: single runs disagreed by up to 2x on an H100.  A group's full run
              takes about 20 minutes: give one group and a few pressures per call.

CUDA managed memory beyond the GPU is not measured (on these shared machines it can hang
the GPU; MSched measured demand paging at about 0.12 GB/s against 41.7 GB/s for a batched
transfer).

    python3 bench/oversub.py [--workloads gpt-train,resnet50-train,gpt-infer] [--groups llm-replicas,dnn-mix]
                             [--pressures 100,150,200,300] [--slice 1000[,3000]] [--repeat 3] [--steps-times 1]
                             [--overhead-turns K] [--overhead-turn-ms 500]
                             [--overhead-systems plain,ideal,limited[,passive,driver]]
    python3 bench/oversub.py --overhead-from RESULT.json [RESULT.json...]

Writes bench/results/oversub-<gpu>-<date>.json after every workload, prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from cr_baseline import PCIE_PROBE
from paired import pooled, rounds_overhead

import threading
import time

from gpuos import __version__
from gpuos.errors import GpuosError
from gpuos.movable.share import group_path, read_group
from gpuos.workloads.run import last_json_object, run, run_polling_mem_stats, suite_cmd, under_gpuos

WORKLOADS = {
    "gpt-train": ["--layers", "8", "--seq", "512", "--steps", "30", "--warmup", "3"],
    "resnet50-train": ["--batch", "32", "--steps", "30", "--warmup", "3"],
    "gpt-infer": ["--layers", "24", "--seq", "1024", "--steps", "30", "--warmup", "3"],
}
GPT_9GB = ["--d-model", "2560", "--heads", "20", "--layers", "28", "--seq", "1024", "--steps", "20", "--warmup", "2"]
GROUPS = {
    "llm-replicas": [("gpt-infer", GPT_9GB)] * 3,
    "dnn-mix": [("gpt-train", WORKLOADS["gpt-train"]), ("resnet50-train", WORKLOADS["resnet50-train"]),
                ("gpt-infer", WORKLOADS["gpt-infer"]),
                ("resnet50-infer", ["--batch", "64", "--steps", "60", "--warmup", "3"])],
}
TIMEOUT = 900.0
TURNS_POLL_S = 0.05  # the group's holder looked at this often (bench only: the file is read under a shared flock)


def header() -> dict:
    nvsmi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, check=True).stdout.splitlines()[0].split(", ")
    pcie = json.loads(subprocess.run([sys.executable, "-c", PCIE_PROBE], capture_output=True, text=True,
                                     check=True).stdout)
    return {"benchmark": "oversub", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": nvsmi[0], "driver": nvsmi[1], "gpu_memory_total": int(nvsmi[2]) << 20, "gpuos": __version__,
            "host": {"hostname": socket.gethostname(), "kernel": platform.release()},
            "pcie_pinned": pcie, "rows": [],
            # libgpuos's switches set in the benchmark's environment (GPUOS_GPU_MEMORY_EVICT ...)
            "gpuos_env": {k: v for k, v in os.environ.items() if k.startswith("GPUOS_")}}


def why_failed(fin) -> dict:
    """A failed run's error, and what libgpuos said (a call refused for lack of room is
    said there, once)."""
    return {"error": fin.describe()[-1500:],
            "gpuos_said": [ln for ln in fin.stderr.splitlines() if ln.startswith("gpuos:")][:5]}


def limited(workload: str, limit: int, evict: str, ideal: dict) -> dict:
    fin, stats = run_polling_mem_stats(
        under_gpuos(suite_cmd(workload, WORKLOADS[workload]), "-q", "--gpu-memory", str(limit), "--evict", evict),
        timeout=TIMEOUT)
    out = {"evict": evict, "limit": limit, "returncode": fin.returncode}
    res = last_json_object(fin.stdout) if fin.returncode == 0 else None
    if res is None:
        out.update(why_failed(fin))
        return out
    st = asdict(stats) if stats else {}
    out.update(seconds=res["seconds"], relative=ideal["seconds"] / res["seconds"],
               checksum_equal=res["checksum"] == ideal["checksum"], stats=st)
    if st:
        out["in_GBps"] = own_copy_rate([st])
        out["batch_GBps"] = batch_rate([st])
        out["in_map_share"] = own_map_share([st])
        out["map_split"] = map_split([st])
        out["out_GBps"] = st["bytes_out"] / st["out_ns"] if st["out_ns"] else None
        out["stall_per_wait_ms"] = st["stall_ns"] / st["calls_swapped"] / 1e6 if st["calls_swapped"] else 0.0
        p99 = stats.stall_percentile_us(99)
        if p99:
            out["stall_p99_ms"] = p99 / 1000
    return out


# The systems --overhead-turns can compare: gpuos run's options, from the GPU's memory and
# limited's limit (None: the workload alone).
SYSTEMS: dict[str, Callable[[int, int], list[str] | None]] = {
    "plain": lambda gpu, limit: None,
    "ideal": lambda gpu, limit: ["--gpu-memory", str(gpu)],
    "limited": lambda gpu, limit: ["--gpu-memory", str(limit), "--evict", "future"],
    "passive": lambda gpu, limit: ["--gpu-memory", str(gpu), "--paused"],  # ideal, operations not recorded
    "driver": lambda gpu, limit: ["--memory", "driver"],  # interception and recording, the driver's memory
}
DEFAULT_SYSTEMS = ("plain", "ideal", "limited")


def ideal_run(workload: str, args: list[str], gpu_bytes: int) -> tuple[dict | None, Any]:
    """The workload with these arguments under gpuos, the GPU's whole memory its limit:
    its JSON and its last memory stats (their reserved_peak is its peak)."""
    fin, stats = run_polling_mem_stats(
        under_gpuos(suite_cmd(workload, args), "-q", "--gpu-memory", str(gpu_bytes)), timeout=TIMEOUT)
    if fin.returncode != 0 or stats is None:
        raise RuntimeError(f"{workload}, the ideal run: {fin.describe()[-800:]}")
    assert stats.launches == 0 and stats.evictions == 0, "the ideal run was checked: it did not fit"
    return last_json_object(fin.stdout), stats


def run_workload(workload: str, pressures: list[int], gpu_bytes: int, overhead: int = 0,
                 turn_s: float = 0.5, systems: Sequence[str] = DEFAULT_SYSTEMS) -> dict:
    ideal, stats = ideal_run(workload, WORKLOADS[workload], gpu_bytes)
    peak = stats.reserved_peak
    row = {"workload": workload, "args": WORKLOADS[workload], "ideal": ideal, "peak_reserved": peak, "pressures": []}
    print(f"{workload}: ideal {ideal['seconds']:.2f} s, peak {peak / 2**30:.2f} GiB of movable memory", flush=True)
    for p in pressures:
        limit = peak * 100 // p
        cell = {"pressure": p, "limit": limit}
        for evict, name in (("lru", "reactive"), ("future", "proactive")):
            cell[name] = limited(workload, limit, evict, ideal)
            r = cell[name]
            print(f"{workload} {p}% {name}: " + (f"{r['relative']:.3f} of ideal, checksum "
                                                 f"{'equal' if r['checksum_equal'] else 'DIFFERS'}, "
                                                 f"in {r['stats'].get('bytes_in', 0) / 1e9:.1f} GB"
                                                 if "relative" in r else r["error"][:300]), flush=True)
        row["pressures"].append(cell)
    if overhead:
        row["overhead"] = overhead_turns(workload, overhead, gpu_bytes, ideal["seconds"] / ideal["steps"],
                                         turn_s, systems)
    return row


def balanced_orders(n: int) -> list[tuple[int, ...]]:
    """The rounds' orders of n systems (Williams' design): each system takes each place of
    a round, and comes right after each other one, equally often over them (n orders for
    an even n, 2n for an odd one)."""
    first, lo, hi = [0], 1, n - 1
    for j in range(1, n):
        first.append(lo if j % 2 else hi)
        lo, hi = (lo + 1, hi) if j % 2 else (lo, hi - 1)
    rows = [tuple((x + i) % n for x in first) for i in range(n)]
    return rows if n % 2 == 0 else rows + [r[::-1] for r in rows]


def comparisons(systems: Sequence[str]) -> list[tuple[str, str]]:
    """(other, base): each system against plain, and limited against ideal (the same code
    at 100%: the method's own check)."""
    return [(s, "plain") for s in systems if s != "plain"] + (
        [("limited", "ideal")] if {"limited", "ideal"} <= set(systems) else [])


def overhead_turns(workload: str, rounds: int, gpu_bytes: int, step_s: float, turn_s: float,
                   systems: Sequence[str] = DEFAULT_SYSTEMS) -> dict:
    """The systems (SYSTEMS' names, plain among them) alive at once, `rounds` rounds of one
    turn each (rounded up to whole sets of balanced_orders), a turn about turn_s seconds
    (whole steps of the ideal's step_s; module doc)."""
    k = max(1, round(turn_s / step_s))
    orders = balanced_orders(len(systems))
    rounds = -(-rounds // len(orders)) * len(orders)
    order = [i for r in range(rounds) for i in orders[r % len(orders)]]
    args = with_steps(WORKLOADS[workload], lambda _: rounds * k)
    limit = 0
    if "limited" in systems:
        # The limit: the peak of a run of the turns' steps, not the ideal's (an inference
        # loop keeps its outputs: over 600 steps gpt-infer outgrew the peak of 30).
        limit = ideal_run(workload, args, gpu_bytes)[1].reserved_peak
    ring = Path(tempfile.mkdtemp(prefix="oversub-turns-"))
    (ring / "order").write_text(" ".join(map(str, order)) + "\n")
    got: dict = {}

    def one(i: int, name: str) -> None:
        cmd = suite_cmd(workload, [*args, "--turns", str(ring), str(i), str(len(systems)), str(k)])
        options = SYSTEMS[name](gpu_bytes, limit)
        got[name] = run(cmd if options is None else under_gpuos(cmd, "-q", *options), timeout=TIMEOUT)
        if got[name].returncode != 0:
            (ring / "abort").touch()  # the others would wait for its turns

    threads = [threading.Thread(target=one, args=(i, n), daemon=True) for i, n in enumerate(systems)]
    for th in threads:
        th.start()
    while len(list(ring.glob("ready-*"))) < len(systems) and not got:
        time.sleep(0.01)
    (ring / ".turn").write_text("0")
    os.replace(ring / ".turn", ring / "turn")
    for th in threads:
        th.join()
    shutil.rmtree(ring, ignore_errors=True)
    res = {}
    for name in systems:
        fin = got[name]
        res[name] = last_json_object(fin.stdout) if fin.returncode == 0 else None
        if res[name] is None or not res[name].get("windows"):
            raise RuntimeError(f"{workload} overhead turns, {name}: {fin.describe()[-800:]}")
    per_step = {n: [(b - a) / k for a, b in res[n]["windows"]] for n in systems}
    out: dict = {"method": "balanced-turns", "turn_steps": k, "rounds": rounds, "limit": limit,
                 "systems": list(systems), "order": order, "per_step_s": per_step,
                 "checksums_equal": len({res[n]["checksum"] for n in systems}) == 1}
    estimate_overheads(out)
    print(f"{workload} overhead, {rounds} rounds of turns of {k} steps: "
          + ", ".join(f"{o} over {b} {pct(out[f'{o}_over_{b}'])}" for o, b in comparisons(systems)), flush=True)
    return out


def overhead_blocks(rounds: int) -> int:
    """Blocks of neighbouring rounds the interval is taken over (rounds_overhead's batch
    means): about the square root of the rounds, the usual choice, so that at 100 rounds
    and more a block outlasts a process's slow or fast stretch (about ten rounds, H200)."""
    return max(2, round(math.sqrt(rounds)))


def estimate_overheads(o: dict) -> dict:
    """A balanced-turns entry's comparisons, (re)computed from its per_step_s: each system
    over plain and limited over ideal, intervals over overhead_blocks."""
    for other, base in comparisons(o["systems"]):
        o[f"{other}_over_{base}"] = rounds_overhead(o["per_step_s"][base], o["per_step_s"][other],
                                                    overhead_blocks(o["rounds"]))
    return o


def pct(est: dict) -> str:
    return f"{est['overhead_pct']:+.1f} ± {est['ci95_pct']:.1f}%" if "overhead_pct" in est else "-"


OVERHEAD_COLUMNS = {"limited_over_plain": "limited (100%) over plain", "limited_over_ideal": "limited over ideal",
                    "ideal_over_plain": "ideal over plain", "passive_over_plain": "passive (not recording) over plain",
                    "driver_over_plain": "driver's memory over plain"}


def overhead_columns(overheads: list[dict]) -> list[str]:
    """The comparisons (OVERHEAD_COLUMNS' keys, in its order) that any of these entries has."""
    return [c for c in OVERHEAD_COLUMNS if any(c in o for o in overheads)]


def overhead_markdown(result: dict) -> str:
    rows = [r for r in result["rows"] if r.get("overhead", {}).get("method") == "balanced-turns"]
    if not rows:
        return ""
    cols = overhead_columns([r["overhead"] for r in rows])
    lines = ["| workload | rounds x steps a turn | " + " | ".join(OVERHEAD_COLUMNS[c] for c in cols)
             + " | checksums equal |", "| --- | --- | " + "---: | " * len(cols) + "--- |"]
    for row in rows:
        o = row["overhead"]
        cells = [pct(o[c]) if c in o else "-" for c in cols]
        cells[0] = f"**{cells[0]}**"
        lines.append(f"| {row['workload']} | {o['rounds']} x {o['turn_steps']} | " + " | ".join(cells)
                     + f" | {o['checksums_equal']} |")
    return "\n".join(lines)


def overhead_from(paths: list[str]) -> str:
    """--overhead-from: the balanced-turns rows of these JSONs, each run's estimates
    recomputed by the current method (estimate_overheads), one table a run, then one of
    every workload's estimates pooled over the runs (paired.pooled)."""
    parts, by_workload = [], {}
    for p in paths:
        try:
            result = json.loads(Path(p).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"oversub: --overhead-from {p}: {e}")
        rows = [r for r in result.get("rows", []) if r.get("overhead", {}).get("method") == "balanced-turns"]
        if not rows:
            raise SystemExit(f"oversub: --overhead-from {p}: no overhead turns (balanced-turns) in it")
        for r in rows:
            estimate_overheads(r["overhead"])
            by_workload.setdefault(r["workload"], []).append(r["overhead"])
        parts.append(f"{p} ({result.get('device', '?')}, {result.get('date', '?')[:10]}):\n\n"
                     + overhead_markdown({"rows": rows}))
    cols = overhead_columns([o for runs in by_workload.values() for o in runs])
    lines = ["Pooled over the runs (each run's estimates weighted by the inverse of their variance):", "",
             "| workload | runs | rounds | " + " | ".join(OVERHEAD_COLUMNS[c] for c in cols) + " | checksums equal |",
             "| --- | ---: | ---: | " + "---: | " * len(cols) + "--- |"]
    for w, runs in by_workload.items():
        cells = []
        for c in cols:
            est = pooled([o[c] for o in runs if c in o])
            cells.append(f"{pct(est)} ({est['runs']})" if est["runs"] != len(runs) and "overhead_pct" in est
                         else pct(est))
        cells[0] = f"**{cells[0]}**"
        lines.append(f"| {w} | {len(runs)} | {sum(o['rounds'] for o in runs)} | " + " | ".join(cells)
                     + f" | {all(o['checksums_equal'] for o in runs)} |")
    return "\n\n".join(parts + ["\n".join(lines)])


def failure(cell: dict) -> str:
    """A failed run's error, in a line: what libgpuos said, else the last line that names
    an error."""
    if cell.get("gpuos_said"):
        return cell["gpuos_said"][0][:70].replace("|", "/")
    lines = [ln.strip() for ln in cell.get("error", "").splitlines() if ln.strip()]
    return next((ln for ln in reversed(lines) if "Error:" in ln), lines[-1] if lines else "-")[:70].replace("|", "/")


def learned(cell: dict) -> str:
    st = cell.get("stats", {})
    return f"{st['evictions_future']} of {st['evictions']}" if st.get("evictions") else "-"


def markdown(result: dict) -> str:
    pin = result["pcie_pinned"]
    lines = [f"Pinned copies in this run: {pin['h2d_GBps']:.1f} GB/s to the GPU, {pin['d2h_GBps']:.1f} GB/s back.", "",
             "| workload | pressure | reactive (LRU) of ideal | proactive (learned) of ideal | checksums equal "
             "| moved in, reactive / proactive | copy-in rate, waited / batches | stall per waiting call, mean / p99 below "
             "| evictions by the learned sequence |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        for cell in row["pressures"]:
            r, f = cell["reactive"], cell["proactive"]
            if "relative" not in r or "relative" not in f:
                lines.append(f"| {row['workload']} | {cell['pressure']}% | {failure(r)} | {failure(f)} "
                             "| - | - | - | - | - |")
                continue
            moved = lambda x: x.get("stats", {}).get("bytes_in", 0) / 1e9  # noqa: E731
            lines.append(f"| {row['workload']} | {cell['pressure']}% | {r['relative']:.1%} | {f['relative']:.1%} "
                         f"| {r['checksum_equal'] and f['checksum_equal']} | {moved(r):.1f} / {moved(f):.1f} GB | "
                         + rates(f)
                         + f" | {f.get('stall_per_wait_ms', 0):.2f} / "
                         + (f"{f['stall_p99_ms']:.1f} ms" if f.get("stall_p99_ms") else "-") + f" | {learned(f)} |")
    return "\n".join(lines)


def own_copy_rate(stats: list[dict]) -> float | None:
    """GB/s of the copies calls waited for: in_ns times those to their end, but copies
    ahead (and a turn's batch) only to their issue (ahead_ns), so their bytes and that time
    are left out.  (Results before ahead_ns existed counted that issue time, and in groups,
    where a turn's batch is most of the bytes, the rate came out low.)"""
    own = sum(x.get("bytes_in", 0) - x.get("ahead_bytes", 0) for x in stats)
    ns = sum(x.get("in_ns", 0) - x.get("ahead_ns", 0) for x in stats)
    return own / ns if ns and own > 0 else None


def batch_rate(stats: list[dict]) -> float | None:
    """GB/s of the copies ahead and turns' batches as the GPU ran them (batch_bytes in
    batch_ns: each batch from its first copy's start to its last one's end, gaps while
    libgpuos mapped the next allocation included); None for results from before these
    figures, or with no batch timed."""
    ns = sum(x.get("batch_ns", 0) for x in stats)
    return sum(x.get("batch_bytes", 0) for x in stats) / ns if ns else None


def rates(cell: dict) -> str:
    """The copy-in rate column: the copies calls waited for / batches ahead, GB/s."""
    own, batch = cell.get("in_GBps"), cell.get("batch_GBps")
    if not own and not batch:
        return "-"
    fmt = lambda x: f"{x:.1f}" if x else "-"  # noqa: E731
    return f"{fmt(own)} / {fmt(batch)} GB/s"


def ahead_issue_split(stats: list[dict]) -> dict | None:
    """Where issuing copies ahead and turns' batches went (seconds, all members): making
    and mapping their memory, a turn's batch waiting for the room the others' evictions
    free, and the rest (queueing copies), beside the batches' GPU time; None for results
    from before these figures (2026-11-28, session 25)."""
    if not any("room_ns" in x for x in stats):
        return None
    total = lambda k: sum(x.get(k, 0) for x in stats) / 1e9  # noqa: E731
    return {"issue_s": total("ahead_ns"), "map_s": total("ahead_map_ns"), "room_s": total("room_ns"),
            "batch_gpu_s": total("batch_ns")}


def map_split(stats: list[dict]) -> dict | None:
    """Making and mapping memory for copies in (all members, waited for or ahead): how many
    mappings, their seconds and of those cuMemCreate's and cuMemSetAccess's (the rest is
    cuMemMap), the mean per mapping in ms, and the evictions' unmapping and releasing;
    None for results from before these figures (session 27)."""
    if not any("maps" in x for x in stats):
        return None
    total = lambda k: sum(x.get(k, 0) for x in stats)  # noqa: E731
    maps, ns = total("maps"), total("map_ns") + total("ahead_map_ns")
    return {"maps": maps, "map_s": ns / 1e9, "create_s": total("create_ns") / 1e9,
            "access_s": total("access_ns") / 1e9, "per_map_ms": ns / maps / 1e6 if maps else None,
            "release_s": total("release_ns") / 1e9}


def own_map_share(stats: list[dict]) -> float | None:
    """Of the time calls waited for copies in (in_ns less ahead_ns), the share spent making
    and mapping the physical memory they went to (map_ns); None for results from before
    map_ns, or with no such time."""
    if not any("map_ns" in x for x in stats):
        return None
    ns = sum(x.get("in_ns", 0) - x.get("ahead_ns", 0) for x in stats)
    return sum(x.get("map_ns", 0) for x in stats) / ns if ns > 0 else None


def run_members(members: list[tuple[str, list[str]]], options: list[str], group: str | None) -> dict:
    """The members at once, each under `gpuos run OPTIONS`, with their memory figures
    polled, and the group's (read from its file) while it has members."""
    got: list = [None] * len(members)
    last_group = {}
    seen_members: dict[int, dict] = {}
    done = threading.Event()
    logs = Path(tempfile.mkdtemp(prefix="oversub-steps-"))

    gate = logs / "gate"
    gate.mkdir()
    opened: dict = {}

    def member(i: int) -> None:
        w, args = members[i]
        cmd = suite_cmd(w, [*args, "--step-log", str(logs / f"{i}.jsonl"), "--start-gate", str(gate)])
        got[i] = run_polling_mem_stats(under_gpuos(cmd, "-q", *options), timeout=TIMEOUT)

    def open_gate() -> None:
        """Every member times its steps from one moment: the gate opens once all have
        warmed up (or one has ended: the others must not wait for it)."""
        while True:
            ready = len(list(gate.glob("ready-*")))
            if ready == len(members) or any(x is not None for x in got):
                break
            time.sleep(0.01)
        (gate / "go").touch()
        opened["all_ready"] = ready == len(members)

    turns: list = []  # [t, holder pid, [pids beside], [pids waiting]] at each change seen

    def poll_group() -> None:
        while group and not done.is_set():
            try:
                last_group["stats"] = read_group(group)
            except GpuosError:
                pass
            else:  # each member's last figures: the group's file drops a member that left
                for gm in last_group["stats"].members:
                    seen_members[gm.pid] = asdict(gm)
                ms = last_group["stats"].members
                now = [next((x.pid for x in ms if x.holder), 0), sorted(x.pid for x in ms if x.beside),
                       sorted(x.pid for x in ms if x.waiting)]
                if not turns or turns[-1][1:] != now:
                    turns.append([round(time.monotonic(), 3), *now])
            time.sleep(TURNS_POLL_S)

    poller = threading.Thread(target=poll_group)
    poller.start()
    threads = [threading.Thread(target=member, args=(i,)) for i in range(len(members))]
    threads.append(threading.Thread(target=open_gate))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    poller.join()
    out = {"members": [], "started_together": opened.get("all_ready", False)}
    for i, ((w, _), (fin, stats)) in enumerate(zip(members, got)):
        res = last_json_object(fin.stdout) if fin.returncode == 0 else None
        m = {"workload": w, "returncode": fin.returncode}
        if res is None:
            m.update(why_failed(fin))
        else:
            marks = json.loads((logs / f"{i}.jsonl").read_text().splitlines()[-1])["marks"]
            m.update(items_per_s=res["items_per_s"], seconds=res["seconds"], checksum=res["checksum"],
                     items=res["items_per_s"] * res["seconds"], timed_from=marks[0][0], timed_to=marks[-1][0],
                     step_ends=[round(x[0], 3) for x in marks[1:]])
        if stats is not None:
            m["stats"] = asdict(stats)
        out["members"].append(m)
    attach_group_members(out["members"], list(seen_members.values()))
    shutil.rmtree(logs, ignore_errors=True)
    if all("items" in m for m in out["members"]):
        span = max(m["timed_to"] for m in out["members"]) - min(m["timed_from"] for m in out["members"])
        out["items_per_s"] = sum(m["items"] for m in out["members"]) / span
    if "stats" in last_group:
        g = last_group["stats"]
        out["group"] = asdict(g)
        out["turns"] = turns
        pids = {m["group_member"]["pid"]: m["workload"] for m in out["members"] if "group_member" in m}
        out["idle"] = idle_spans(out["members"], turns, pids)
        waits = sum(g.switch_hist)
        out["switch_mean_ms"] = g.switch_ns / waits / 1e6 if waits else None
        p99 = g.switch_percentile_us(99)
        out["switch_p99_ms"] = p99 / 1000 if p99 else None
    return out


def idle_spans(members: list[dict], turns: list, names: dict[int, str], res_s: float = 0.005) -> dict | None:
    """Where a group's run lost time: each member's gaps between steps (longer than 5x its
    median step, at least 50 ms), and the time in which no member still running made a
    step (every one of them in a gap), by whose turn it was then (the group's holder as
    polled: `turns`; "-" for none, "?" before the first poll). None without step times."""
    runs = [(m["workload"], [m["timed_from"], *m["step_ends"]]) for m in members if m.get("step_ends")]
    if not runs:
        return None
    gaps: dict[str, list[tuple[float, float]]] = {}
    for w, ends in runs:
        steps = sorted(b - a for a, b in zip(ends, ends[1:]))
        floor = max(5 * steps[len(steps) // 2], 0.05) if steps else 0.05
        gaps[w] = [(a, b) for a, b in zip(ends, ends[1:]) if b - a > floor]
    t0, t1 = min(e[0] for _, e in runs), max(e[-1] for _, e in runs)
    none_s, holders = 0.0, {}
    t = t0
    while t < t1:
        running = [w for w, ends in runs if ends[-1] > t]
        if running and all(any(a <= t < b for a, b in gaps[w]) for w in running):
            none_s += res_s
            turn = next((x for x in reversed(turns) if x[0] <= t), None)
            who = "?" if turn is None else names.get(turn[1], str(turn[1])) if turn[1] else "-"
            holders[who] = holders.get(who, 0.0) + res_s
        t += res_s
    return {"gaps": {w: {"count": len(g), "seconds": round(sum(b - a for a, b in g), 3)} for w, g in gaps.items()},
            "none_progress_s": round(none_s, 3), "none_progress_by_holder": {k: round(v, 3) for k, v in holders.items()}}


def attach_group_members(members: list[dict], seen: list[dict]) -> None:
    """Each member's last record in the group's file (turns held and waited for, working
    set, turns beside a holder) as its `group_member`: the record whose reserved bytes are
    nearest the member's peak (the file names members by pid only; both figures are kept,
    to check the match)."""
    left = list(seen)
    for m in sorted(members, key=lambda m: -m.get("stats", {}).get("reserved_peak", 0)):
        peak = m.get("stats", {}).get("reserved_peak")
        if peak is None or not left:
            continue
        best = min(left, key=lambda g: abs(g["reserved"] - peak))
        left.remove(best)
        m["group_member"] = best


def exclusive_ceiling(names: list[str], alone_s: list[float | None], working_sets: list[int | None],
                      limit: int, ideal_s: float) -> dict | None:
    """The largest set of members no two of whose working sets fit the limit together:
    the scheduler admits a waiting member into a turn's set by its working set, so no two
    of them run in one set, and none runs faster than alone with the whole GPU: their
    alone times add up to at least the run's span, and ideal_s over that sum is the most
    of the ideal the run can reach (`ceiling`). Not a strict bound: a member that does not
    wait may run beside a holder on memory it has resident. None when fewer than two
    members have a working set (known only from a turn) and an alone time."""
    known = [i for i, (a, w) in enumerate(zip(alone_s, working_sets)) if a and w]
    best: list[int] = []
    for mask in range(1, 1 << len(known)):
        pick = [known[b] for b in range(len(known)) if mask >> b & 1]
        if len(pick) < 2 or sum(alone_s[i] for i in pick) <= sum(alone_s[i] for i in best):
            continue
        if all(working_sets[i] + working_sets[j] > limit for x, i in enumerate(pick) for j in pick[x + 1:]):
            best = pick
    if not best:
        return None
    total = sum(alone_s[i] for i in best)
    return {"members": [names[i] for i in best], "alone_s": total, "ceiling": ideal_s / total}


def median_run(runs: list[dict]) -> dict:
    """The run whose throughput is the median of those that finished (a failed one if none
    did), with every run's throughput in `items_per_s_runs`."""
    done = sorted((r for r in runs if "items_per_s" in r), key=lambda r: r["items_per_s"])
    pick = dict(done[(len(done) - 1) // 2] if done else runs[0])
    pick["items_per_s_runs"] = [r.get("items_per_s") for r in runs]
    return pick


def with_steps(args: list[str], steps: Callable[[int], int]) -> list[str]:
    """A workload's arguments with its timed steps (--steps N) made steps(N)."""
    at = args.index("--steps") + 1
    return [*args[:at], str(steps(int(args[at]))), *args[at + 1:]]


def longer(args: list[str], times: int) -> list[str]:
    """A member's arguments with its timed steps multiplied."""
    return with_steps(args, lambda n: n * times)


def run_group(name: str, pressures: list[int], slices: list[int], gpu_bytes: int, repeat: int,
              steps_times: int = 1) -> dict:
    """Every cell (and the ideal) run `repeat` times, the median kept: single runs of a
    group disagreed by up to 2x on an H100, more than the effects measured."""
    members = [(w, longer(args, steps_times)) for w, args in GROUPS[name]]
    # each alone with the whole GPU as its limit: nothing checked or moved, its peak counted
    ideal = median_run([run_members(members, ["--gpu-memory", str(gpu_bytes)], None) for _ in range(repeat)])
    if any("items_per_s" not in m for m in ideal["members"]):
        raise RuntimeError(f"{name}: the ideal run failed: {ideal}")
    peak = sum(m["stats"]["reserved_peak"] for m in ideal["members"])
    total = ideal["items_per_s"]
    alone = [run_members([m], ["--gpu-memory", str(gpu_bytes)], None)["members"][0] for m in members]
    ideal_s = sum(m["items"] for m in ideal["members"]) / total
    one_at_a_time = (ideal_s / sum(m["seconds"] for m in alone)
                     if all("seconds" in m for m in alone) else None)
    row = {"group": name, "members": [w for w, _ in members], "ideal": ideal, "peak_reserved": peak,
           "ideal_items_per_s": total, "alone": alone, "one_at_a_time": one_at_a_time,
           "slices_ms": slices, "repeat": repeat, "steps_times": steps_times, "pressures": []}
    print(f"{name}: ideal {total:.1f} items/s in all (runs {ideal['items_per_s_runs']}), "
          f"peaks {peak / 2**30:.2f} GiB; one at a time: "
          + (f"{one_at_a_time:.1%} of the ideal" if one_at_a_time else "a member failed alone"), flush=True)
    for p, slice_ms in ((p, s) for p in pressures for s in slices):
        limit = peak * 100 // p
        cell = {"pressure": p, "slice_ms": slice_ms, "limit": limit}
        for evict, system in (("lru", "reactive"), ("future", "proactive")):
            runs = []
            for k in range(repeat):
                share = f"oversub-{os.getpid()}-{name}-{p}-{evict}-{k}"
                try:
                    runs.append(run_members(members, ["--share", share, "--gpu-memory", str(limit),
                                                      "--slice", str(slice_ms), "--evict", evict], share))
                finally:
                    group_path(share).unlink(missing_ok=True)
            r = median_run(runs)
            ok = "items_per_s" in r
            if ok:
                r["relative"] = r["items_per_s"] / total
                r["relative_runs"] = [x / total if x else None for x in r["items_per_s_runs"]]
                r["checksums_equal"] = all(m["checksum"] == i["checksum"] for run in runs if "items_per_s" in run
                                           for m, i in zip(run["members"], ideal["members"]))
                st = [m.get("stats", {}) for m in r["members"]]
                r["bytes_in"] = sum(x.get("bytes_in", 0) for x in st)
                r["bytes_out"] = sum(x.get("bytes_out", 0) for x in st)
                r["in_GBps"] = own_copy_rate(st)
                r["batch_GBps"] = batch_rate(st)
                r["in_map_share"] = own_map_share(st)
                r["ahead_split"] = ahead_issue_split(st)
                r["map_split"] = map_split(st)
                r["exclusive"] = exclusive_ceiling(
                    [w for w, _ in members], [m.get("seconds") for m in alone],
                    [m.get("group_member", {}).get("working_set") for m in r["members"]], limit, ideal_s)
            cell[system] = r
            print(f"{name} {p}% {slice_ms} ms {system}: " + (f"{r['relative']:.3f} of ideal (runs "
                                               f"{', '.join(f'{x:.3f}' for x in r['relative_runs'] if x)}), "
                                               f"checksums {'equal' if r['checksums_equal'] else 'DIFFER'}, "
                                               f"{r.get('group', {}).get('switches', 0)} switches"
                                               + (f"; cannot share the pool: {', '.join(r['exclusive']['members'])}"
                                                  f" (at most {r['exclusive']['ceiling']:.1%} of ideal)"
                                                  if r.get("exclusive") else "")
                                               if ok else "failed: " + "; ".join(
                                                   m.get("error", "")[:200] for m in r["members"])), flush=True)
        row["pressures"].append(cell)
    return row


def group_markdown(result: dict) -> str:
    lines = ["| group | pressure | reactive (LRU) of ideal | proactive (learned) of ideal "
             "| one process at a time, of ideal | checksums equal "
             "| moved in, reactive / proactive | copy-in rate, waited / batches | switches | admitted beside a holder "
             "| from a switch to the first call's memory in, mean / p99 below |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in result.get("groups", []):
        alone = f"{row['one_at_a_time']:.1%}" if row.get("one_at_a_time") else "-"
        several = len(row.get("slices_ms", [])) > 1
        for cell in row["pressures"]:
            r, f = cell["reactive"], cell["proactive"]
            pressure = f"{cell['pressure']}%" + (f", {cell['slice_ms']} ms slices" if several else "")
            if "relative" not in r or "relative" not in f:
                why = lambda c: next((failure(m) for m in c["members"] if "error" in m), "-")  # noqa: E731
                lines.append(f"| {row['group']} | {pressure} | {why(r)} | {why(f)} | {alone} "
                             "| - | - | - | - | - | - |")
                continue
            lines.append(f"| {row['group']} | {pressure} | {r['relative']:.1%} | {f['relative']:.1%} "
                         f"| {alone} "
                         f"| {r['checksums_equal'] and f['checksums_equal']} "
                         f"| {r['bytes_in'] / 1e9:.1f} / {f['bytes_in'] / 1e9:.1f} GB | "
                         + rates(f)
                         + f" | {f.get('group', {}).get('switches', '-')} "
                         + f"| {f.get('group', {}).get('beside_turns', '-')} | "
                         + (f"{f['switch_mean_ms']:.1f} / {f['switch_p99_ms']:.1f} ms"
                            if f.get("switch_mean_ms") is not None else "-") + " |")
    return "\n".join(lines)


def slice_list(text: str) -> list[int]:
    try:
        slices = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: milliseconds, comma-separated") from None
    if not slices or min(slices) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: each slice must be positive")
    return slices


def system_list(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    unknown = [x for x in names if x not in SYSTEMS]
    if unknown or "plain" not in names or len(set(names)) != len(names) or len(names) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: two or more of {', '.join(SYSTEMS)}, plain among them, "
                                         "each once")
    return names


def positive_ms(text: str) -> int:
    n = int(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{n} ms: must be positive")
    return n


def non_negative(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is negative")
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="gpt-train,resnet50-train,gpt-infer")
    ap.add_argument("--groups", default="llm-replicas,dnn-mix", help="groups of processes sharing a pool; '' for none")
    ap.add_argument("--slice", type=slice_list, default=[1000],
                    help="the groups' time slice, ms; several (1000,3000): each pressure with each")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each group cell and of its ideal; the median is kept (all are in the JSON)")
    ap.add_argument("--pressures", default="100,150,200,300",
                    help="percent of the limit; '' for none (with --overhead-turns: the overhead alone)")
    ap.add_argument("--steps-times", type=int, default=1,
                    help="the groups' timed steps multiplied: longer runs amortize the turns' start")
    ap.add_argument("--overhead-turns", type=non_negative, default=0, metavar="K",
                    help="per workload, the --overhead-systems alive at once taking K rounds of turns, "
                         "rounded up to whole sets of balanced orders (6 for three systems, 10 for "
                         "five; 0: none)")
    ap.add_argument("--overhead-turn-ms", type=positive_ms, default=500, metavar="MS",
                    help="a turn's length, about (whole steps of the ideal's step time); shorter turns "
                         "bracket a drifting GPU closer")
    ap.add_argument("--overhead-systems", type=system_list, default=",".join(DEFAULT_SYSTEMS), metavar="LIST",
                    help=f"the systems taking turns, plain among them: {', '.join(SYSTEMS)} (passive: ideal "
                         "with its operations not recorded; driver: gpuos with the driver's own memory) "
                         "[default: %(default)s]")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--overhead-from", nargs="+", metavar="JSON",
                    help="run nothing: recompute the overhead turns of these results with the current "
                         "method, and pool each workload's over them")
    args = ap.parse_args()
    if args.overhead_from:
        print(overhead_from(args.overhead_from))
        return
    result = header()
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    tag = result["device"].replace("NVIDIA ", "").replace(" ", "_")
    path = outdir / f"oversub-{tag}-{result['date'][:10]}.json"
    pressures = [int(p) for p in args.pressures.split(",") if p]
    for w in filter(None, args.workloads.split(",")):
        result["rows"].append(run_workload(w, pressures, result["gpu_memory_total"], args.overhead_turns,
                                         args.overhead_turn_ms / 1000, args.overhead_systems))
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"{w} done; wrote {path}", flush=True)
    result["groups"] = []
    for g in filter(None, args.groups.split(",")):
        result["groups"].append(run_group(g, pressures, args.slice, result["gpu_memory_total"], args.repeat,
                                           args.steps_times))
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"{g} done; wrote {path}", flush=True)
    print(markdown(result))
    print()
    print(overhead_markdown(result))
    print()
    print(group_markdown(result))


if __name__ == "__main__":
    main()
