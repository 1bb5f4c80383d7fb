#!/usr/bin/env python3
"""Probe (issue 18): where a restore's CRIU time goes for an inference image, and how
fast CRIU's files can be put in memory for CRIU to read them from files.

Starts `gpuos.workloads.serve --model M` under `gpuos run`, checkpoints it into a private
store, then, page cache warm, in the same run:
- restores it R times each way, interleaved: streamed to CRIU (`gpuos restore`) and read
  out first (`--replicas 1`: its own namespaces; CRIU reads the pages from tmpfs files);
  each restore's phases and CRIU's marks, and the first answer's time;
- reads the CRIU files' chunks (checked) as the chunk store does (new buffers), and with
  nothing allocated per chunk (buffers and a decompressor per thread), with 1-16 threads:
  whether decoding is bound by the memory it allocates;
- reads the CRIU files out of the store into memory three ways: ImageContent.materialize
  (pwrite into a /dev/shm file), and decompressed straight into a shared mapping of a
  memfd by the pool's threads, verified there (no copy, no inode lock), and into private
  buffers only (the chunks' decode rate).

    python3 tools/probes/criu_pages_probe.py [--model gpt2-large] [--home /var/tmp] [--repeat 3 (0: no restores)]
        [--compare-site PYTHONPATH (restores by another gpuos instead of read-out ones) [--replicas N]]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

GPUOS = [sys.executable, "-m", "gpuos.cli"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-large")
    ap.add_argument("--home", default="/var/tmp")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=0,
                    help="With --compare-site: both restore `--replicas N` (read out, not streamed)")
    ap.add_argument("--compare-site", default=None,
                    help="Another gpuos (a PYTHONPATH): its restores interleaved with this one's, "
                         "instead of the read-out ones")
    args = ap.parse_args()

    from gpuos.store import ImageStore
    from gpuos.store.content import ImageContent, workers
    from gpuos.workloads.run import served, start_served, wait_file

    home = Path(tempfile.mkdtemp(prefix="criu-pages-", dir=args.home))
    env = dict(os.environ, GPUOS_HOME=str(home), GPUOS_HOT="/dev/shm/criu-pages-probe-hot")
    d = home / "req"
    run = start_served(args.model, d, env)
    out: dict = {"model": args.model, "workers": workers(), "restores": []}
    try:
        pid = served(run, d)
        res = subprocess.run([*GPUOS, "checkpoint", str(pid), "--image", "x", "--json"], env=env,
                             capture_output=True, text=True)
        out["checkpoint"] = json.loads(res.stdout).get("timings")
        run.wait()
        img = home / "images" / "x"
        m = ImageStore.load(img)
        entries = [f for f in m.files if f.path.startswith("criu/")]
        out["criu_bytes"] = sum(f.size for f in entries)
        out["pages_bytes"] = sum(f.size for f in entries if "/pages-" in f.path)
        for i in range(args.repeat):
            n = ["--replicas", str(args.replicas)] if args.replicas else []
            ways = ((("stream", [], env), ("read-out", ["--replicas", "1"], env)) if not args.compare_site else
                    (("this gpuos", n, env), ("other gpuos", n, dict(env, PYTHONPATH=args.compare_site))))
            for way, extra, way_env in ways:
                (d / "req-1").write_text("")
                t0 = time.time()
                r = subprocess.run([*GPUOS, "restore", "x", "--json", *extra], env=way_env, capture_output=True,
                                   text=True)
                got = json.loads(r.stdout or "{}")
                one = {"way": way, "ok": got.get("ok"), "restore_cmd_s": time.time() - t0,
                       "timings": got.get("timings"), "criu_marks": got.get("criu_marks"),
                       "criu_gaps": (got.get("criu_gaps") or [])[:3], "fills": got.get("fills"),
                       "error": got.get("message")}
                try:
                    wait_file(d / "resp-1", 60)
                    one["first_answer_s"] = json.loads((d / "resp-1").read_text())["answered"] - t0
                except Exception as exc:  # noqa: BLE001 - a probe: say it
                    one["answer_error"] = str(exc)
                for p in [x["init"] for x in got.get("replicas", [])] or [got.get("pid")]:
                    if p:
                        try:
                            os.kill(p, 9)
                        except ProcessLookupError:
                            pass
                time.sleep(1.5)
                for f in ("req-1", "resp-1"):
                    (d / f).unlink(missing_ok=True)
                print(json.dumps(one), flush=True)
                out["restores"].append(one)

        content = ImageContent(img, m)
        pool = ThreadPoolExecutor(max_workers=workers())

        def pwrite_way() -> float:
            shutil.rmtree("/dev/shm/criu-pages-probe", ignore_errors=True)
            t = time.perf_counter()
            content.materialize(("criu",), Path("/dev/shm/criu-pages-probe"))
            dt = time.perf_counter() - t
            shutil.rmtree("/dev/shm/criu-pages-probe", ignore_errors=True)
            return dt

        def read_mapped(e, p, mm) -> None:
            with memoryview(mm) as whole, whole[p.offset:p.offset + p.size] as view:
                content.read_piece(e, p, view)

        def memfd_way() -> float:
            t = time.perf_counter()
            maps = []
            futs = []
            for e in entries:
                fd = os.memfd_create(e.path.replace("/", "_"))
                os.ftruncate(fd, e.size)
                if e.size:
                    mm = mmap.mmap(fd, e.size, mmap.MAP_SHARED)
                    maps.append((fd, mm))
                    for p in content.pieces(e):
                        futs.append(pool.submit(read_mapped, e, p, mm))
                else:
                    maps.append((fd, None))
            for f in futs:
                f.result()
            dt = time.perf_counter() - t
            for fd, mm in maps:
                if mm is not None:
                    mm.close()
                os.close(fd)
            return dt

        def decode_way() -> float:
            t = time.perf_counter()
            futs = [pool.submit(lambda e=e, p=p: content.read_piece(e, p, memoryview(bytearray(p.size))))
                    for e in entries for p in content.pieces(e)]
            for f in futs:
                f.result()
            return time.perf_counter() - t

        # chunks read (checked) into new buffers, or into one buffer per thread used again:
        # whether the decoding is bound by first touches of memory
        import threading

        chunk_list = [c for e in entries for c in e.chunks]
        local = threading.local()

        def fresh_way(c) -> None:
            content.chunks.read_into(c, memoryview(bytearray(c.size)), True)

        import zstandard

        from gpuos.store.chunks import digest

        def reused_way(c) -> None:  # nothing allocated per chunk: buffers and decompressor per thread
            if getattr(local, "out", None) is None:
                local.out, local.inp = bytearray(8 << 20), bytearray(8 << 20)
                local.dctx = zstandard.ZstdDecompressor()
            path = content.chunks.stored(c.id)
            fd = os.open(path, os.O_RDONLY)
            try:
                n = os.readv(fd, [local.inp])
            finally:
                os.close(fd)
            out_view = memoryview(local.out)[:c.size]
            if path.name.endswith(".zst"):
                with local.dctx.stream_reader(memoryview(local.inp)[:n], read_size=n) as r:
                    got = 0
                    while got < c.size and (k := r.readinto(out_view[got:])):
                        got += k
            else:
                out_view[:] = memoryview(local.inp)[:n]
            if digest(out_view) != c.id:
                raise RuntimeError(f"chunk {c.id} does not match")

        matrix = {}
        for threads in (1, 4, 8, 16):
            for what, fn in (("new buffers", fresh_way), ("nothing allocated", reused_way)):
                local = threading.local()
                with ThreadPoolExecutor(max_workers=threads) as tp:
                    t = time.perf_counter()
                    list(tp.map(fn, chunk_list))
                    matrix[f"{what} x{threads}"] = out["criu_bytes"] / (time.perf_counter() - t) / 1e9
        out["decode_GBps"] = matrix
        print("decode GB/s", {k: round(v, 2) for k, v in matrix.items()}, flush=True)

        for name, fn in (("materialize_pwrite_s", pwrite_way), ("memfd_mapped_s", memfd_way),
                         ("decode_only_s", decode_way)):
            out[name] = [fn() for _ in range(3)]
            print(name, [round(x, 3) for x in out[name]], flush=True)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, 9)
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree("/dev/shm/criu-pages-probe-hot", ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
