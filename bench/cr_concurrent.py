#!/usr/bin/env python3
"""Checkpoint while the application runs: stop-the-world against movable memory.

For a PyTorch process holding N GiB of random data on the GPU (N = 1, 4, 16 by default;
40 fits an H200) and stepping every few milliseconds, and for a GPT-2-large-sized
inference process (`gpt2-large`: transformers, 774M parameters, about 3 GB on the GPU,
answering a request per step), `gpuos checkpoint --leave-running` twice each, in the
same run:

  stop-the-world  the process started plainly: the driver's checkpoint copies its memory
                  (the baseline)
  movable         the process under `gpuos run`: its memory is movable; the checkpoint
                  snapshots it on the device while the process is held and copies it
                  into the image after the process runs again

Reported per run, from the process's own step times: the app-visible stall (the longest
gap between two steps while the checkpoint ran); steps/s after the stop until the image
is published (while gpuos copies and writes) and over the whole checkpoint, against
before it; the time until the image was published, next to the time the store takes to
write an image of that size (its write rate measured in the same run, with fsync);
gpuos's own stall figure; the rate at which GPU memory was captured in the stop (the
driver's copy, or the device-side snapshot) and copied into the image after it, next
to the pinned-copy rate measured in the same run; the image size; and the held data's
checksum (or the model's answers), which must not change.

    python3 bench/cr_concurrent.py [--sizes 1,4,16,gpt2-large] [--home /var/tmp] [--out bench/results]

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


LLM = "gpt2-large"


def start(mode: str, size: str, log: Path, out: Path) -> tuple[subprocess.Popen, int]:
    job = [sys.executable, str(TORCHJOB), "--steps", "1000000", "--log", str(log), "--step-sleep", str(STEP_SLEEP)]
    job += ["--mode", "serve"] if size == LLM else ["--mode", "infer", "--hold-gib", size, "--check-every", "50"]
    wrap = [sys.executable, "-m", "gpuos.cli", "run", "-q", "--"] if mode == "movable" else []
    with open(out, "w") as f:
        proc = subprocess.Popen(wrap + job, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    wait_alive_steps(log, proc, 40)
    if mode != "movable":
        return proc, proc.pid
    kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return proc, int(kids[0])


def store_write_rate(home: Path, n: int = 4 * GiB) -> float:
    """Bytes/s at which the store's file system takes a new file, fsync included."""
    block = os.urandom(64 << 20)
    path = home / "write-rate.tmp"
    t0 = time.monotonic()
    with open(path, "wb") as f:
        for _ in range(n // len(block)):
            f.write(block)
        os.fsync(f.fileno())
    rate = n / (time.monotonic() - t0)
    path.unlink()
    return rate


def run_one(rt: Runtime, mode: str, size: str, workdir: Path, store_rate: float,
            answers: dict[tuple[str, str], dict[str, str]]) -> dict:
    """One checkpoint of one workload; its step outputs go into answers[(mode, size)]."""
    log, out = workdir / f"{mode}-{size}.log", workdir / f"{mode}-{size}.out"
    proc, pid = start(mode, size, log, out)
    try:
        time.sleep(BEFORE_S)
        t0 = time.time()
        cp = checkpoint(CheckpointRequest(pid=pid, image=f"bench-{mode}-{size}", leave_running=True),
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
        stop_end = around[worst + 1] if worst is not None else t0
        after = [t for t in times if stop_end < t <= t1]
        sums = held_checksums(log)
        if size != LLM and len(set(sums)) != 1:
            raise RuntimeError(f"{mode} {size}: the held data changed: {sums}")
        tm = cp.timings
        movable_bytes = sum(m.bytes for m in cp.manifest.movable)
        gpu_bytes = sum(p.gpu_memory or 0 for p in cp.manifest.processes) if mode != "movable" else movable_bytes
        in_stop_s = tm.get("movable-hold") if mode == "movable" else tm.get("gpu-checkpoint")
        row = {
            "mode": mode, "workload": LLM if size == LLM else f"hold {size} GiB",
            "gib": None if size == LLM else float(size), "pid": pid,
            "app_stall_s": max(gaps) if gaps else None,
            # the longest gap before the checkpoint: the workload's own (its held-data checks)
            "gap_before_s": max((b - a for a, b in zip(before, before[1:])), default=None),
            # when the longest gap began and ended, seconds after the checkpoint started
            "app_stall_at_s": [around[worst] - t0, around[worst + 1] - t0] if worst is not None else None,
            "gpuos_stall_s": cp.stall,
            "steps_per_s_before": len(before) / BEFORE_S,
            "steps_per_s_during": len(during) / (t1 - t0),
            # from the end of the stop to the image's publication: while gpuos copies and writes
            "steps_per_s_after_stop": len(after) / (t1 - stop_end) if t1 - stop_end > 0.5 else None,
            "published_s": t1 - t0,
            "store_write_s": cp.manifest.total_size / store_rate,
            # GPU memory captured in the stop: the driver's copy (stop-the-world) or the
            # device-side snapshot (movable); then (movable) copied into the image after it
            "gpu_bytes": gpu_bytes,
            "capture_in_stop_GBps": gpu_bytes / 1e9 / in_stop_s if in_stop_s else None,
            "copy_out_GBps": (movable_bytes / 1e9 / tm["movable-capture"]
                              if mode == "movable" and tm.get("movable-capture") else None),
            "image_bytes": cp.manifest.total_size, "movable_bytes": movable_bytes,
            "timings": tm, "held_checksums": len(sums),
        }
        answers[(mode, size)] = {ln.split()[0]: ln.split()[2] for ln in log.read_text().splitlines()
                                 if " output " in ln}
        rt.store.remove(rt.store.resolve(f"bench-{mode}-{size}"))
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
    ap.add_argument("--sizes", default=f"1,4,16,{LLM}",
                    help=f"GiB held on the GPU, comma-separated; {LLM} for the inference process")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--home", default="/var/tmp",
                    help="Where the images go: a disk with room for the largest (not a tmpfs)")
    args = ap.parse_args()
    rt, home, result = open_bench("cr_concurrent", args.home)
    result["step_sleep_s"] = STEP_SLEEP
    result["store_write_GBps"] = store_write_rate(home) / 1e9
    rows: list[dict] = result["rows"]
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    tag = result["device"].replace("NVIDIA ", "").split()[0]
    path = outdir / f"cr-concurrent-{tag}-{result['date'][:10]}.json"
    answers: dict[tuple[str, str], dict[str, str]] = {}
    for size in args.sizes.split(","):
        for mode in args.modes.split(","):
            try:
                rows.append(run_one(rt, mode, size, home, result["store_write_GBps"] * 1e9, answers))
            except Exception as exc:  # noqa: BLE001 - a benchmark: record and go on
                rows.append({"mode": mode, "workload": size, "error": f"{type(exc).__name__}: {exc}"})
            path.write_text(json.dumps(result, indent=2) + "\n")  # what is measured survives a failure
            print(f"{size} {mode} done; wrote {path}", file=sys.stderr, flush=True)
        # the same seeded requests give the same answers, checkpoint or not, in either mode
        runs = [answers[(m, size)] for m in args.modes.split(",") if (m, size) in answers]
        if len(runs) == 2:
            common = runs[0].keys() & runs[1].keys()
            same = all(runs[0][k] == runs[1][k] for k in common)
            for row in rows[-2:]:
                row["outputs_compared"], row["outputs_identical"] = len(common), same
            if not same:
                print(f"{size}: the two runs' outputs differ", file=sys.stderr, flush=True)
            path.write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(home, ignore_errors=True)
    print(markdown(result))


def markdown(r: dict) -> str:
    head = ("| workload | checkpoint | app stall | steps/s after the stop | published after (store write alone) "
            "| captured in the stop | into the image | image |")
    lines = [f"{r['device']}, driver {r['driver']}, CRIU {r['criu']}, {r['date'][:10]}; "
             f"`gpuos checkpoint --leave-running` of a PyTorch process stepping every "
             f"{r['step_sleep_s'] * 1000:g} ms; app stall: the longest gap between two of its steps; "
             f"steps/s from the end of the stop until the image is published, against before; "
             f"store write: the image's size at the rate the store's disk took a file in the same run "
             f"({r['store_write_GBps']:.1f} GB/s, fsync included); pinned D2H in the same run "
             f"{r['pcie_pinned']['d2h_GBps']:.1f} GB/s.", "",
             head, "|" + "---|" * (head.count("|") - 1)]

    def rate(x):
        return f"{x:.1f} GB/s" if x else "-"

    for row in r["rows"]:
        if "error" in row:
            lines.append(f"| {row['workload']} | {row['mode']} | failed: {row['error'][:80]} | | | | | |")
            continue
        before = row["steps_per_s_before"]
        after = (f"{row['steps_per_s_after_stop'] / before * 100:.0f}%"
                 if before and row["steps_per_s_after_stop"] is not None else "-")
        lines.append(
            f"| {row['workload']} | {row['mode']} | {row['app_stall_s']:.2f} s | {after} "
            f"| {row['published_s']:.1f} s ({row['store_write_s']:.1f} s) "
            f"| {rate(row['capture_in_stop_GBps'])} | {rate(row['copy_out_GBps'])} "
            f"| {row['image_bytes'] / GiB:.1f} GiB |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
