#!/usr/bin/env python3
"""How fast can a restore read GPU-memory chunks out of the store?  (issue 18: the fill ran
at 6-7 GB/s on an H200 host, against 55 GB/s for the copies to the GPU; CPU only.)

    python3 tools/probes/fill_read_probe.py [--gib 3] [--dir DIR] [--out FILE.json]

Ingests --gib of random bytes into a chunk store of its own (as a checkpoint stores GPU
memory: coarse chunks, uncompressed), drops nothing from the page cache (a warm restore),
then reads every chunk back the way movable/filler.py does, 64 MiB slot by 64 MiB slot,
the chunks of a slot in parallel on the restore's pool, into one buffer, checked against
their names; and again with each part alone: reading without the check, the check alone
on data in memory, and the pool's own cost (empty tasks); and read and check overlapped
(a slot read while the one before is checked).  GB/s of each in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpuos.store.chunks import ChunkStore, digest
from gpuos.store.content import Source, ingest, workers

SLOT = 64 << 20


def slots(chunks):
    batch, used = [], 0
    for c in chunks:
        if used + c.size > SLOT and batch:
            yield batch
            batch, used = [], 0
        batch.append((c, used))
        used += c.size
    if batch:
        yield batch


def timed(label, fn, nbytes, r):
    t = time.monotonic()
    fn()
    dt = time.monotonic() - t
    r[label] = {"seconds": round(dt, 4), "GBps": round(nbytes / dt / 1e9, 2)}
    print(f"{label}: {nbytes / dt / 1e9:.2f} GB/s ({dt:.3f} s)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=3.0)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default="fill-read-probe.json")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fillprobe-", dir=a.dir))
    r: dict = {"probe": "fill_read", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "cpus": os.cpu_count(), "workers": workers()}
    try:
        size = int(a.gib * (1 << 30))
        src = root / "gpu-memory.bin"
        with open(src, "wb") as f:
            for _ in range(size // (64 << 20)):
                f.write(os.urandom(64 << 20))
        size = src.stat().st_size
        store = ChunkStore(root / "chunks")
        t = time.monotonic()
        with store.shared():
            (entry,), stats = ingest([Source("gpu-memory.bin", src, size)], store)
        r["ingest_s"] = round(time.monotonic() - t, 3)
        chunks = entry.chunks
        r["bytes"], r["chunks"] = size, len(chunks)
        r["chunk_mean_mib"] = round(size / len(chunks) / 2**20, 2)
        ring = memoryview(bytearray(SLOT))
        pool = ThreadPoolExecutor(max_workers=workers())
        batches = list(slots(chunks))

        def read(verify: bool):
            def go():
                for b in batches:
                    list(pool.map(lambda cb: store.read_into(cb[0], ring[cb[1]:cb[1] + cb[0].size], verify), b))
            return go

        for k in range(2):  # the first pass warms the page cache (ingest wrote it; evictions aside)
            timed(f"read_and_check_pass{k}", read(True), size, r)
        timed("read_only", read(False), size, r)
        pair = [memoryview(bytearray(SLOT)) for _ in range(2)]

        def pipelined():
            """A slot's chunks read (unchecked) while the slot before is checked, on the
            same pool: the two overlapped, each byte still checked before it would go on."""
            prev = None
            for i, b in enumerate(batches + [None]):
                buf = pair[i % 2]
                futs = [pool.submit(store.read_into, c, buf[o:o + c.size], False) for c, o in b or []]
                if prev is not None:
                    pb, pbuf = prev
                    futs += [pool.submit(lambda c, v: digest(v) == c.id or sys.exit("corrupt"), c,
                                         pbuf[o:o + c.size]) for c, o in pb]
                for f in futs:
                    f.result()
                prev = (b, buf) if b else None
        timed("read_then_check_overlapped", pipelined, size, r)
        blob = memoryview(bytearray(SLOT))

        def check_only():
            for b in batches:
                list(pool.map(lambda cb: digest(blob[cb[1]:cb[1] + cb[0].size]), b))
        timed("check_only", check_only, size, r)

        def empty():
            for b in batches:
                list(pool.map(lambda cb: None, b))
        timed("pool_only", empty, size, r)
        r["tasks_per_slot"] = round(len(chunks) / len(batches), 1)
        pool.shutdown()
    except Exception as exc:  # noqa: BLE001 - a probe: say what broke
        r["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(root, ignore_errors=True)
        Path(a.out).write_text(json.dumps(r, indent=2) + "\n")
        print(json.dumps(r, indent=2))
    return 1 if "error" in r else 0


if __name__ == "__main__":
    sys.exit(main())
