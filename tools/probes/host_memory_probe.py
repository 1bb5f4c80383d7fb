#!/usr/bin/env python3
"""Probe (issue 18): what the host memory of an inference process is, that CRIU dumps.

Builds a gpuos.workloads.serve model (as the server does), answers one request, then
prints the process's resident anonymous memory by mapping kind (heap, anonymous, file-backed
private), and its non-zero pages (what a trimmed image keeps, hostmem/trim.py), before and
after glibc's malloc_trim(0) gives freed heap pages back: how much of a restore's CRIU time
is memory the process no longer uses.

    python3 tools/probes/host_memory_probe.py [--model gpt2-large]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re

import numpy as np
import torch

from gpuos.workloads.serve import build


def anon_by_kind() -> dict[str, int]:
    """Anonymous resident bytes per kind of mapping, from /proc/self/smaps."""
    kinds: dict[str, int] = {}
    name = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            head = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \S+\s*(.*)$", line)
            if head:
                path = head.group(1).strip()
                name = ("[heap]" if path == "[heap]" else "anonymous" if not path
                        else "[stack]" if path.startswith("[stack") else "/dev/*" if path.startswith("/dev/")
                        else "file" if path.startswith("/") else path)
            elif line.startswith("Anonymous:"):
                kinds[name] = kinds.get(name, 0) + int(line.split()[1]) * 1024
    return kinds


def nonzero_bytes() -> int:
    """Bytes of non-zero 4 KiB pages in the private writable anonymous mappings (heap,
    anonymous; none over 8 GiB), read through /proc/self/mem (a page never touched reads as
    zeros)."""
    total = 0
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", buffering=0) as mem:
        for line in maps.read().splitlines():
            f = line.split()
            if f[1][:2] != "rw" or f[1][3] != "p" or (len(f) > 5 and f[5] != "[heap]"):
                continue
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            if hi - lo > 8 << 30:  # a reservation, not memory (reading it would take minutes)
                continue
            for at in range(lo, hi, 1 << 26):
                try:
                    mem.seek(at)
                    data = mem.read(min(1 << 26, hi - at))
                except OSError:
                    break
                pages = np.frombuffer(data, dtype=np.uint64).reshape(-1, 512)
                total += int(pages.any(axis=1).sum()) * 4096
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-large")
    args = ap.parse_args()
    dev = torch.device("cuda")
    _, answer = build(args.model, 1234, dev)
    with torch.inference_mode():
        answer(0)
    torch.cuda.synchronize()
    before, nonzero_before = anon_by_kind(), nonzero_bytes()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    after, nonzero_after = anon_by_kind(), nonzero_bytes()
    print(json.dumps({"model": args.model, "anon_before": before, "anon_after_trim": after,
                      "total_before": sum(before.values()), "total_after": sum(after.values()),
                      "nonzero_before": nonzero_before, "nonzero_after": nonzero_after}))


if __name__ == "__main__":
    main()
