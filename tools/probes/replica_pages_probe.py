#!/usr/bin/env python3
"""Probe (issue 18): how alike the host memory of two replicas of one model is, page by
page, and how much of it chunks of a given size would share.

Starts two `gpuos.workloads.serve` servers of MODEL under `gpuos run`, checkpoints each into
a private store, reads their CRIU page images out of the store, and prints: pages in each,
the share of B's pages that A has too (the most any chunking could share), zero pages, and
for several chunk sizes the bytes B would add to a store holding A.

    python3 tools/probes/replica_pages_probe.py [--model gpt2-large] [--home /var/tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import blake3
import zstandard

from gpuos.store import ImageStore
from gpuos.store import chunker
from gpuos.store.chunks import ZST_LEVEL, ZST_WORTH
from gpuos.workloads.run import served, start_served

PAGE = 4096


def pages_of(image: Path, out: Path) -> bytes:
    store = ImageStore(image.parent)
    m = store.load(image)
    base = store.content(image, m).materialize(("criu",), out)
    return b"".join(p.read_bytes() for p in sorted((base / "criu").glob("pages-*.img")))


def chunk_set(data: bytes, min_pages: int, mask: int, max_pages: int) -> dict[str, tuple[int, int]]:
    """name -> (bytes, bytes as stored: compressed where zstd saves a tenth)."""
    ends = chunker.chunk_ends(data, profile=chunker.Profile(min_pages, mask, max_pages))
    z = zstandard.ZstdCompressor(level=ZST_LEVEL)
    out = {}
    for a, b in zip([0] + ends[:-1], ends):
        packed = len(z.compress(data[a:b]))
        out[blake3.blake3(data[a:b]).hexdigest()] = (b - a, packed if packed < (b - a) * ZST_WORTH else b - a)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-large")
    ap.add_argument("--home", default="/var/tmp")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="gpuos-probe-", dir=args.home))
    env = dict(os.environ, GPUOS_HOME=str(home), GPUOS_HOT=str(home / "hot"))
    try:
        procs = [start_served(args.model, home / f"r{k}", env) for k in range(2)]
        for k, p in enumerate(procs):
            pid = served(p, home / f"r{k}")
            subprocess.run([sys.executable, "-m", "gpuos.cli", "checkpoint", str(pid), "--image", f"r{k}"],
                           env=env, check=True, capture_output=True)
            p.wait()
        a = pages_of(home / "images" / "r0", home / "out0")
        b = pages_of(home / "images" / "r1", home / "out1")
        pa = {blake3.blake3(a[i:i + PAGE]).digest() for i in range(0, len(a), PAGE)}
        pb = [blake3.blake3(b[i:i + PAGE]).digest() for i in range(0, len(b), PAGE)]
        zero = blake3.blake3(bytes(PAGE)).digest()
        result = {"model": args.model, "pages_a": len(a) // PAGE, "pages_b": len(pb),
                  "b_pages_in_a": sum(h in pa for h in pb) / len(pb),
                  "b_zero_pages": sum(h == zero for h in pb) / len(pb), "chunkings": []}
        for min_pages, mask, max_pages in ((64, 0x1FF, 2048), (16, 0x3F, 512), (4, 0xF, 128), (1, 0x3, 32)):
            ca, cb = chunk_set(a, min_pages, mask, max_pages), chunk_set(b, min_pages, mask, max_pages)
            added = sum(n for c, (n, _) in cb.items() if c not in ca)
            stored = sum(z for c, (_, z) in cb.items() if c not in ca)
            result["chunkings"].append({"min_pages": min_pages, "avg_kib": (mask + 1 + min_pages) * 4,
                                        "max_pages": max_pages, "chunks_b": len(cb), "b_adds_bytes": added,
                                        "b_adds_share": added / len(b), "b_adds_stored_bytes": stored,
                                        "a_stored_bytes": sum(z for _, z in ca.values())})
        print(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
