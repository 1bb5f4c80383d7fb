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

Single-process workloads only: `--share` groups (several processes in one pool) are not
built yet.  CUDA managed memory beyond the GPU is not measured (on these shared machines
it can hang the GPU; MSched measured demand paging at about 0.12 GB/s against 41.7 GB/s
for a batched transfer).

    python3 bench/oversub.py [--workloads gpt-train,resnet50-train,gpt-infer] [--pressures 100,150,200,300]

Writes bench/results/oversub-<gpu>-<date>.json after every workload, prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import subprocess
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from cr_baseline import PCIE_PROBE

from gpuos import __version__
from gpuos.workloads.run import last_json_object, run_polling_mem_stats, suite_cmd, under_gpuos

WORKLOADS = {
    "gpt-train": ["--layers", "8", "--seq", "512", "--steps", "30", "--warmup", "3"],
    "resnet50-train": ["--batch", "32", "--steps", "30", "--warmup", "3"],
    "gpt-infer": ["--layers", "24", "--seq", "1024", "--steps", "30", "--warmup", "3"],
}
TIMEOUT = 900.0


def header() -> dict:
    nvsmi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, check=True).stdout.splitlines()[0].split(", ")
    pcie = json.loads(subprocess.run([sys.executable, "-c", PCIE_PROBE], capture_output=True, text=True,
                                     check=True).stdout)
    return {"benchmark": "oversub", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "device": nvsmi[0], "driver": nvsmi[1], "gpu_memory_total": int(nvsmi[2]) << 20, "gpuos": __version__,
            "host": {"hostname": socket.gethostname(), "kernel": platform.release()},
            "pcie_pinned": pcie, "rows": []}


def limited(workload: str, limit: int, evict: str, ideal: dict) -> dict:
    fin, stats = run_polling_mem_stats(
        under_gpuos(suite_cmd(workload, WORKLOADS[workload]), "-q", "--gpu-memory", str(limit), "--evict", evict),
        timeout=TIMEOUT)
    out = {"evict": evict, "limit": limit, "returncode": fin.returncode}
    res = last_json_object(fin.stdout) if fin.returncode == 0 else None
    if res is None:
        out["error"] = fin.describe()[-1500:]
        # what libgpuos said (a call refused for lack of room is said there, once)
        out["gpuos_said"] = [ln for ln in fin.stderr.splitlines() if ln.startswith("gpuos:")][:5]
        return out
    st = asdict(stats) if stats else {}
    out.update(seconds=res["seconds"], relative=ideal["seconds"] / res["seconds"],
               checksum_equal=res["checksum"] == ideal["checksum"], stats=st)
    if st:
        out["in_GBps"] = st["bytes_in"] / st["in_ns"] if st["in_ns"] else None
        out["out_GBps"] = st["bytes_out"] / st["out_ns"] if st["out_ns"] else None
        out["stall_per_wait_ms"] = st["stall_ns"] / st["calls_swapped"] / 1e6 if st["calls_swapped"] else 0.0
        p99 = stats.stall_percentile_us(99)
        if p99:
            out["stall_p99_ms"] = p99 / 1000
    return out


def run_workload(workload: str, pressures: list[int], gpu_bytes: int) -> dict:
    fin, stats = run_polling_mem_stats(
        under_gpuos(suite_cmd(workload, WORKLOADS[workload]), "-q", "--gpu-memory", str(gpu_bytes)), timeout=TIMEOUT)
    if fin.returncode != 0 or stats is None:
        raise RuntimeError(fin.describe())
    ideal = last_json_object(fin.stdout)
    assert stats.launches == 0 and stats.evictions == 0, "the ideal run was checked: it did not fit"
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
    return row


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
             "| moved in, reactive / proactive | copy-in rate | stall per waiting call, mean / p99 below "
             "| evictions by the learned sequence |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["rows"]:
        for cell in row["pressures"]:
            r, f = cell["reactive"], cell["proactive"]
            if "relative" not in r or "relative" not in f:
                lines.append(f"| {row['workload']} | {cell['pressure']}% | {failure(r)} | {failure(f)} "
                             "| - | - | - | - | - |")
                continue
            rate = f.get("in_GBps")
            moved = lambda x: x.get("stats", {}).get("bytes_in", 0) / 1e9  # noqa: E731
            lines.append(f"| {row['workload']} | {cell['pressure']}% | {r['relative']:.1%} | {f['relative']:.1%} "
                         f"| {r['checksum_equal'] and f['checksum_equal']} | {moved(r):.1f} / {moved(f):.1f} GB | "
                         + (f"{rate:.1f} GB/s" if rate else "-")
                         + f" | {f.get('stall_per_wait_ms', 0):.2f} / "
                         + (f"{f['stall_p99_ms']:.1f} ms" if f.get("stall_p99_ms") else "-") + f" | {learned(f)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="gpt-train,resnet50-train,gpt-infer")
    ap.add_argument("--pressures", default="100,150,200,300")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    result = header()
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    tag = result["device"].replace("NVIDIA ", "").replace(" ", "_")
    path = outdir / f"oversub-{tag}-{result['date'][:10]}.json"
    for w in args.workloads.split(","):
        result["rows"].append(run_workload(w, [int(p) for p in args.pressures.split(",")],
                                           result["gpu_memory_total"]))
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"{w} done; wrote {path}", flush=True)
    print(markdown(result))


if __name__ == "__main__":
    main()
