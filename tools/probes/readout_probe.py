#!/usr/bin/env python3
"""Probe (issue 18): what a restore's read-out of CRIU's files costs with host-memory
chunks stored compressed (zstd) and raw, on one real image, in the same run.

Starts `gpuos.workloads.serve --model M` under `gpuos run`, checkpoints it into a private
store, times ImageContent.materialize of the image's CRIU files into /dev/shm three times
(page cache warm), then rewrites every compressed chunk raw and times it again; also
the zstd decompression and BLAKE3 rates of those chunks on one thread.

    python3 tools/probes/readout_probe.py [--model gpt2-large] [--home /var/tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-large")
    ap.add_argument("--home", default="/var/tmp")
    args = ap.parse_args()
    import blake3
    import zstandard

    from gpuos.store import ImageStore
    from gpuos.store.content import ImageContent, workers
    from gpuos.workloads.run import served, start_served

    home = Path(tempfile.mkdtemp(prefix="readout-", dir=args.home))
    env = dict(os.environ, GPUOS_HOME=str(home), GPUOS_HOT=str(home / "hot"))
    d = home / "req"
    run = start_served(args.model, d, env)
    out: dict = {"model": args.model, "workers": workers()}
    try:
        pid = served(run, d)
        res = subprocess.run([sys.executable, "-m", "gpuos.cli", "checkpoint", str(pid), "--image", "x", "--json"],
                             env=env, capture_output=True, text=True)
        out["checkpoint"] = json.loads(res.stdout).get("timings")
        run.wait()
        img = home / "images" / "x"
        m = ImageStore.load(img)
        chunk_dir = img / m.chunk_dir
        criu_bytes = sum(f.size for f in m.files if f.path.startswith("criu/"))
        out["criu_bytes"] = criu_bytes
        zst = list(chunk_dir.rglob("*.zst"))
        out["compressed_chunks"] = len(zst)
        out["compressed_bytes"] = sum(p.stat().st_size for p in zst)

        def timed(tag: str) -> None:
            ts = []
            for _ in range(3):
                shutil.rmtree("/dev/shm/readout-probe", ignore_errors=True)
                t = time.perf_counter()
                ImageContent(img, m).materialize(("criu",), Path("/dev/shm/readout-probe"))
                ts.append(time.perf_counter() - t)
            shutil.rmtree("/dev/shm/readout-probe", ignore_errors=True)
            out[tag] = ts
            print(tag, [round(x, 3) for x in ts], flush=True)

        timed("materialize_compressed_s")
        raw_total, t_dec, t_hash = 0, 0.0, 0.0
        for z in zst:
            packed = z.read_bytes()
            t = time.perf_counter()
            raw = zstandard.ZstdDecompressor().decompress(packed, max_output_size=64 << 20)
            t_dec += time.perf_counter() - t
            t = time.perf_counter()
            blake3.blake3(raw).digest()
            t_hash += time.perf_counter() - t
            raw_total += len(raw)
            dest = z.with_name(z.name.removesuffix(".zst"))
            dest.write_bytes(raw)
            z.unlink()
        out["raw_bytes_of_compressed"] = raw_total
        out["zstd_decompress_GBps_one_thread"] = raw_total / t_dec / 1e9 if t_dec else None
        out["blake3_GBps_one_thread"] = raw_total / t_hash / 1e9 if t_hash else None
        timed("materialize_raw_s")
    finally:
        if run.poll() is None:
            os.killpg(run.pid, 9)
        shutil.rmtree(home, ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
