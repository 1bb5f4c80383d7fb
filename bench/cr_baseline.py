#!/usr/bin/env python3
"""Stop-the-world checkpoint/restore baseline: driver checkpoint API + CRIU.

For a PyTorch process holding N GiB of random data on the GPU (N = 1, 4, 16
by default), checkpoint it (CRIU kills it), restore it, and time every phase:
lock, GPU checkpoint, CRIU dump, checksum, publish, verify, CRIU restore, GPU
restore, unlock, and the process's first CUDA call after the restore.  Also:
the app-visible downtime (last step before the checkpoint to first step after
the restore), the image size, and effective bandwidths next to the host's
pinned PCIe bandwidth measured in the same run.  The restored process's
held data must be bit-identical (exact checksum) or the run fails.

    sudo python3 bench/cr_baseline.py [--sizes 1,4,16] [--out bench/results]

Writes bench/results/cr_baseline-<gpu>-<date>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from gpuos import __version__
from gpuos.checkpoint import CheckpointRequest, checkpoint
from gpuos.config import Paths
from gpuos.restore import restore
from gpuos.runtime import Runtime
from gpuos.workloads import TORCHJOB, step_times, steps_done

GiB = 1 << 30

PCIE_PROBE = r"""
import json, time, torch
n = 1 << 30
h = torch.empty(n, dtype=torch.uint8).pin_memory(); h.random_()
d = torch.empty(n, dtype=torch.uint8, device="cuda")
def t(f):
    f(); torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(5): f()
    torch.cuda.synchronize(); return 5 * n / (time.perf_counter() - t0) / 1e9
print(json.dumps({"h2d_GBps": t(lambda: d.copy_(h, non_blocking=True)),
                  "d2h_GBps": t(lambda: h.copy_(d, non_blocking=True))}))
"""


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def wait_alive_steps(log: Path, proc: subprocess.Popen, n: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while steps_done(log) < n:
        if proc.poll() is not None:
            raise RuntimeError(f"job died: {log.with_suffix('.out').read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError("job too slow")
        time.sleep(0.01)


def held_checksums(log: Path) -> list[str]:
    return [ln.split()[2] for ln in log.read_text().splitlines() if " held " in ln]


def run_size(rt: Runtime, gib: float, workdir: Path) -> dict:
    log, out = workdir / f"job-{gib}.log", workdir / f"job-{gib}.out"
    steps = 100000
    with open(out, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, str(TORCHJOB), "--mode", "infer", "--steps", str(steps), "--log", str(log),
             "--step-sleep", "0.005", "--hold-gib", str(gib), "--check-every", "10"],
            stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_alive_steps(log, proc, 20)
        criu = rt.criu()
        cp = checkpoint(CheckpointRequest(pid=proc.pid, image=f"bench-{gib}"), rt.paths.run,
                        rt.store, rt.driver, criu)
        proc.wait()
        last_before = max(step_times(log).values())
        done_before = steps_done(log)
        cold = drop_caches()
        t_restore = time.time()
        rs = restore(f"bench-{gib}", rt.paths.run, rt.store, rt.driver, criu)
        t_restored = time.time()
        held_before = len(held_checksums(log))
        wait_alive_steps(log, proc_stub(rs.pid), done_before + 12)
        first_after = min(t for t in step_times(log).values() if t > last_before)
        os.kill(rs.pid, 9)
        while Path(f"/proc/{rs.pid}").exists():
            time.sleep(0.02)
        sums = held_checksums(log)
        if len(sums) <= held_before or len(set(sums)) != 1:
            raise RuntimeError(f"held data changed across checkpoint/restore: {sums}")
        size = cp.manifest.total_size
        t_cp, t_rs = cp.timings, rs.timings
        row = {
            "gib": gib,
            "image_bytes": size,
            "checkpoint": t_cp,
            "restore": t_rs,
            "restore_wall": t_restored - t_restore,
            "first_step_after_restore": first_after - t_restored,
            "downtime": first_after - last_before,
            "cold_page_cache_at_restore": cold,
            "gpu_checkpoint_GBps": gib * GiB / 1e9 / t_cp["gpu-checkpoint"],
            "criu_dump_GBps": size / 1e9 / t_cp["criu-dump"],
            "criu_restore_GBps": size / 1e9 / t_rs["criu-restore"],
            "gpu_restore_GBps": gib * GiB / 1e9 / t_rs["gpu-restore"],
            "held_checksums_identical": len(sums),
        }
        rt.store.remove(rt.store.resolve(f"bench-{gib}"))
        return row
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class proc_stub:  # noqa: N801 - a Popen look-alike for a restored (non-child) process
    def __init__(self, pid: int):
        self.pid = pid

    def poll(self):
        return None if Path(f"/proc/{self.pid}").exists() else 1


def open_bench(benchmark: str, home_dir: str) -> tuple[Runtime, Path, dict]:
    """A private gpuos home under home_dir (where the images go), and the result's header:
    device, driver, CRIU, gpuos, host, and the pinned PCIe bandwidth measured now; rows empty."""
    home = Path(tempfile.mkdtemp(prefix="gpuos-bench-", dir=home_dir))
    rt = Runtime(paths=Paths(home=home, store=home / "images"))
    drv = rt.driver()
    dev = drv.devices()[0]
    pcie = json.loads(subprocess.run([sys.executable, "-c", PCIE_PROBE], capture_output=True,
                                     text=True, check=True).stdout)
    return rt, home, {
        "benchmark": benchmark,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": dev.name, "gpu_memory_total": dev.memory_total,
        "driver": drv.driver_info().version, "cuda_api": drv.driver_info().cuda_api,
        "criu": rt.criu().check_version(), "gpuos": __version__,
        "host": {"hostname": socket.gethostname(), "kernel": platform.release(), "cpus": os.cpu_count()},
        "pcie_pinned": pcie,
        "rows": [],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,4,16")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--home", default="/var/tmp",
                    help="Where the images go: a disk with room for the largest (not a tmpfs)")
    args = ap.parse_args()
    rt, home, result = open_bench("cr_baseline", args.home)
    rows: list[dict] = result["rows"]
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    tag = result["device"].replace("NVIDIA ", "").replace(" ", "_")
    path = outdir / f"cr_baseline-{tag}-{result['date'][:10]}.json"
    for size in args.sizes.split(","):
        rows.append(run_size(rt, float(size), home))
        path.write_text(json.dumps(result, indent=2) + "\n")  # what is measured survives a failure
        print(f"{size} GiB done; wrote {path}", flush=True)
    shutil.rmtree(home, ignore_errors=True)
    print(markdown(result))


def markdown(r: dict) -> str:
    head = ("| GiB on GPU | lock | GPU ckpt | CRIU dump | checksum | publish | verify | CRIU restore "
            "| GPU restore | unlock | first step | downtime | image | GPU ckpt GB/s | GPU restore GB/s |")
    lines = [f"{r['device']}, driver {r['driver']}, CRIU {r['criu']}, {r['date'][:10]}; "
             f"pinned PCIe H2D {r['pcie_pinned']['h2d_GBps']:.1f} GB/s, "
             f"D2H {r['pcie_pinned']['d2h_GBps']:.1f} GB/s. Times in seconds.", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for row in r["rows"]:
        c, s = row["checkpoint"], row["restore"]
        lines.append(
            f"| {row['gib']:g} | {c.get('lock', 0):.3f} | {c['gpu-checkpoint']:.2f} | {c['criu-dump']:.2f} "
            f"| {c['checksum']:.2f} | {c.get('publish', 0):.3f} | {s['verify']:.2f} | {s['criu-restore']:.2f} "
            f"| {s['gpu-restore']:.2f} | {s['unlock']:.3f} | {row['first_step_after_restore']:.3f} "
            f"| {row['downtime']:.1f} | {row['image_bytes'] / GiB:.1f} GiB "
            f"| {row['gpu_checkpoint_GBps']:.1f} | {row['gpu_restore_GBps']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
