#!/usr/bin/env python3
"""Probe (issue 18): does a process whose memory is advised huge pages (MADV_HUGEPAGE)
come back faster through CRIU, and with huge pages?

A restore's CRIU time, for an inference process, is its reading of 0.75 GB of host
memory into memory it touches for the first time; on the GPU hosts a first touch runs at
1.6-2.0 GB/s in 4 KiB pages and 4.3-5.4 GB/s in huge pages (THP `madvise` there). CRIU
saves each mapping's madvise flags and gives them back, but when: before it reads the
pages into the mapping (the read then faults huge pages) or after?

R times, interleaved, each way (advised huge pages or not): starts a plain process holding
SIZE MiB of written anonymous memory, checkpoints it with gpuos into a private store and
restores it (streamed, as a restore does); reports CRIU's restore time and marks, and
the process's AnonHugePages before and after.

    python3 tools/probes/criu_thp_probe.py [--mib 768] [--repeat 3] [--home /var/tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GPUOS = [sys.executable, "-m", "gpuos.cli"]
HOG = r"""
import mmap, sys, time
n = int(sys.argv[1]) << 20
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if sys.argv[2] == "huge":
    m.madvise(mmap.MADV_HUGEPAGE)
page = (b"weights " * 512)[:4088]
for off in range(0, n, 4096):
    m[off:off + 4096] = page + off.to_bytes(8, "little")  # no page of zeros: all saved
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def anon_huge(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) << 10
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=768)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--home", default="/var/tmp")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="criu-thp-", dir=args.home))
    env = dict(os.environ, GPUOS_HOME=str(home))
    env.pop("GPUOS_STORE", None)
    out: dict = {"mib": args.mib, "thp": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip(),
                 "restores": []}
    try:
        for i in range(args.repeat):  # a new process and image each time: a killed restored
            for way in ("4k", "huge"):  # process may stay a zombie, its pid taken
                hog = subprocess.Popen([sys.executable, "-c", HOG, str(args.mib), way], stdout=subprocess.PIPE,
                                       text=True, start_new_session=True)
                assert hog.stdout.readline().strip() == "ready"
                before = anon_huge(hog.pid)
                image = f"{way}-{i}"
                res = subprocess.run([*GPUOS, "checkpoint", str(hog.pid), "--image", image, "--json"], env=env,
                                     capture_output=True, text=True)
                got = json.loads(res.stdout or "{}")
                if not got.get("ok"):
                    sys.exit(f"checkpoint {way}: {got.get('message') or res.stderr[-300:]}")
                hog.wait()
                t0 = time.monotonic()
                res = subprocess.run([*GPUOS, "restore", image, "--json"], env=env, capture_output=True, text=True)
                wall = time.monotonic() - t0
                got = json.loads(res.stdout or "{}")
                one = {"way": way, "ok": got.get("ok"), "wall_s": wall, "error": got.get("message"),
                       "anon_huge_before": before,
                       "criu_restore_s": (got.get("timings") or {}).get("criu-restore"),
                       "criu_marks": got.get("criu_marks"), "decoders": got.get("decoders")}
                if got.get("ok"):
                    one["anon_huge"] = anon_huge(got["pid"])
                    os.kill(got["pid"], signal.SIGKILL)
                out["restores"].append(one)
                print(json.dumps(one), flush=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print(json.dumps({k: v for k, v in out.items() if k != "restores"}, indent=1))


if __name__ == "__main__":
    main()
