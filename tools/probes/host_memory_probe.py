#!/usr/bin/env python3
"""Probe (issue 18): what the host memory of an inference process is, that CRIU dumps.

Builds a gpuos.workloads.serve model (as the server does), answers one request, then
prints the process's resident anonymous memory by mapping kind (heap, anonymous, file-backed
private), before and after glibc's malloc_trim(0) gives freed heap pages back: how much of
a restore's CRIU time is memory the process no longer uses.

    python3 tools/probes/host_memory_probe.py [--model gpt2-large]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-large")
    args = ap.parse_args()
    dev = torch.device("cuda")
    _, answer = build(args.model, 1234, dev)
    with torch.inference_mode():
        answer(0)
    torch.cuda.synchronize()
    before = anon_by_kind()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    after = anon_by_kind()
    print(json.dumps({"model": args.model, "anon_before": before, "anon_after_trim": after,
                      "total_before": sum(before.values()), "total_after": sum(after.values())}))


if __name__ == "__main__":
    main()
