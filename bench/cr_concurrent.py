#!/usr/bin/env python3
"""Checkpoint while the application runs: stop-the-world against movable memory.

For a PyTorch process holding N GiB of random data on the GPU (N = 1, 4, 16 by default;
40 fits an H200) and stepping every few milliseconds, `gpuos checkpoint --leave-running`
twice per size, in the same run:

  stop-the-world  the process started plainly: the driver's checkpoint copies its memory
                  (the baseline)
  movable         the process under `gpuos run`: its memory is movable; the checkpoint
                  snapshots it on the device while the process is held and copies it to
                  the host after the process runs again

Reported per run, from the process's own step times: the app-visible stall (the longest
gap between two steps while the checkpoint ran), steps/s during the checkpoint against
before it, the time until the image was published, gpuos's own stall figure, the GPU
capture rate (GB/s) next to the pinned-copy rate measured in the same run, the image
size; and the held data's checksum, which must not change.

    python3 bench/cr_concurrent.py [--sizes 1,4,16] [--home /var/tmp] [--out bench/results]

Writes bench/results/cr-concurrent-<gpu>-<date>.json after every run, prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from cr_baseline import held_checksums, open_bench, wait_alive_steps

from gpuos.checkpoint import CheckpointRequest, checkpoint
from gpuos.runtime import Runtime
from gpuos.workloads import TORCHJOB, step_times, steps_done

GiB = 1 << 30
STEP_SLEEP = 0.005
BEFORE_S = 3.0  # the window before the checkpoint that gives the normal step rate
MODES = ("stop-the-world", "movable")


def start(mode: str, gib: float, log: Path, out: Path) -> tuple[subprocess.Popen, int]:
    job = [sys.executable, str(TORCHJOB), "--mode", "infer", "--steps", "1000000", "--log", str(log),
           "--step-sleep", str(STEP_SLEEP), "--hold-gib", str(gib), "--check-every", "50"]
    wrap = [sys.executable, "-m", "gpuos.cli", "run", "-q", "--"] if mode == "movable" else []
    with open(out, "w") as f:
        proc = subprocess.Popen(wrap + job, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    wait_alive_steps(log, proc, 40)
    if mode != "movable":
        return proc, proc.pid
    kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return proc, int(kids[0])


def run_one(rt: Runtime, mode: str, gib: float, workdir: Path) -> dict:
    log, out = workdir / f"{mode}-{gib}.log", workdir / f"{mode}-{gib}.out"
    proc, pid = start(mode, gib, log, out)
    try:
        time.sleep(BEFORE_S)
        t0 = time.time()
        cp = checkpoint(CheckpointRequest(pid=pid, image=f"bench-{mode}-{gib}", leave_running=True),
                        rt.paths.run, rt.store, rt.driver, rt.criu())
        t1 = time.time()
        done = steps_done(log)
        wait_alive_steps(log, proc, done + 60)  # it runs on, and checks its held data again
        times = sorted(step_times(log).values())
        before = [t for t in times if t0 - BEFORE_S <= t < t0]
        during = [t for t in times if t0 <= t < t1]
        around = [t for t in times if t0 - 1 <= t <= t1 + 1]
        gaps = [b - a for a, b in zip(around, around[1:])]
        worst = max(range(len(gaps)), key=gaps.__getitem__) if gaps else None
        sums = held_checksums(log)
        if len(set(sums)) != 1:
            raise RuntimeError(f"{mode} {gib} GiB: the held data changed: {sums}")
        tm = cp.timings
        movable_bytes = sum(m.bytes for m in cp.manifest.movable)
        if mode == "movable":
            capture_s = tm.get("movable-hold", 0) + tm.get("movable-capture", 0)
            captured = movable_bytes
        else:
            capture_s, captured = tm.get("gpu-checkpoint", 0), gib * GiB
        row = {
            "mode": mode, "gib": gib, "pid": pid,
            "app_stall_s": max(gaps) if gaps else None,
            # the longest gap before the checkpoint: the workload's own (its held-data checks)
            "gap_before_s": max((b - a for a, b in zip(before, before[1:])), default=None),
            # when the longest gap began and ended, seconds after the checkpoint started
            "app_stall_at_s": [around[worst] - t0, around[worst + 1] - t0] if worst is not None else None,
            "gpuos_stall_s": cp.stall,
            "steps_per_s_before": len(before) / BEFORE_S,
            "steps_per_s_during": len(during) / (t1 - t0),
            "published_s": t1 - t0,
            "capture_GBps": captured / 1e9 / capture_s if capture_s else None,
            "snapshot_s": tm.get("movable-hold") if mode == "movable" else None,
            "image_bytes": cp.manifest.total_size, "movable_bytes": movable_bytes,
            "timings": tm, "held_checksums": len(sums),
        }
        rt.store.remove(rt.store.resolve(f"bench-{mode}-{gib}"))
        return row
    finally:
        for p in {pid, proc.pid}:
            try:
                os.kill(p, 9)
            except ProcessLookupError:
                pass
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,4,16")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--home", default="/var/tmp",
                    help="Where the images go: a disk with room for the largest (not a tmpfs)")
    args = ap.parse_args()
    rt, home, result = open_bench("cr_concurrent", args.home)
    result["step_sleep_s"] = STEP_SLEEP
    rows: list[dict] = result["rows"]
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    tag = result["device"].replace("NVIDIA ", "").split()[0]
    path = outdir / f"cr-concurrent-{tag}-{result['date'][:10]}.json"
    for size in args.sizes.split(","):
        for mode in args.modes.split(","):
            try:
                rows.append(run_one(rt, mode, float(size), home))
            except Exception as exc:  # noqa: BLE001 - a benchmark: record and go on
                rows.append({"mode": mode, "gib": float(size), "error": f"{type(exc).__name__}: {exc}"})
            path.write_text(json.dumps(result, indent=2) + "\n")  # what is measured survives a failure
            print(f"{size} GiB {mode} done; wrote {path}", file=sys.stderr, flush=True)
    shutil.rmtree(home, ignore_errors=True)
    print(markdown(result))


def markdown(r: dict) -> str:
    head = ("| GiB on GPU | checkpoint | app stall (longest gap before) | gpuos stopped it | steps/s during vs before "
            "| published after | GPU capture | image |")
    lines = [f"{r['device']}, driver {r['driver']}, CRIU {r['criu']}, {r['date'][:10]}; "
             f"`gpuos checkpoint --leave-running` of a PyTorch process stepping every "
             f"{r['step_sleep_s'] * 1000:g} ms; app stall: the longest gap between two of its steps; "
             f"pinned D2H in the same run {r['pcie_pinned']['d2h_GBps']:.1f} GB/s.", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for row in r["rows"]:
        if "error" in row:
            lines.append(f"| {row['gib']:g} | {row['mode']} | failed: {row['error'][:80]} | | | | | |")
            continue
        ratio = row["steps_per_s_during"] / row["steps_per_s_before"] * 100 if row["steps_per_s_before"] else 0
        lines.append(
            f"| {row['gib']:g} | {row['mode']} | {row['app_stall_s']:.2f} s ({row['gap_before_s'] or 0:.2f} s) "
            f"| {row['gpuos_stall_s'] or 0:.2f} s | {ratio:.0f}% "
            f"| {row['published_s']:.1f} s | {row['capture_GBps'] or 0:.1f} GB/s "
            f"| {row['image_bytes'] / GiB:.1f} GiB |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
