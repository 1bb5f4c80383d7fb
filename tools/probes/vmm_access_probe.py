#!/usr/bin/env python3
"""Do kernels run slower on movable memory than on the driver's?  (issue 19; GPU host.)

    python3 tools/probes/vmm_access_probe.py [--sizes-mib 256,4096,16384] [--rounds 10]
                                             [--out FILE.json]

WHY
  At 100% of its memory a process under gpuos runs 2-4% slower than without it on
  launch-bound workloads (bench/oversub.py's turns, H200, pooled over runs), none of it
  the scheduler's.  gpuos's layer is interposition and recording (a CPU cost per call)
  and movable memory: each allocation an address range with one physical allocation
  mapped into it (memory.c), where cuMemAlloc lets the driver place it.  If the GPU's
  page sizes or TLB reach differ between the two, every kernel pays on the GPU side,
  and no CPU-side saving would bring the overhead down.  The turns cannot tell them
  apart: their intervals are wider than the difference.  This probe can, in one process.

WHAT IT DOES
  For each size, one buffer from cuMemAlloc and one made as libgpuos makes movable memory
  (reserve, cuMemCreate of a POSIX-fd-exportable pinned allocation at the minimum
  granularity, map, set access).  ROUNDS rounds, the two buffers' order alternating, each
  timing (CUDA events, median of 5 launches) two kernels on each buffer: a stream
  (read all of it, write a scaled copy of its first 64 MiB over and over: bandwidth) and
  a random gather (64 M reads at hashed indices over the whole buffer: TLB reach).  Per
  size and kernel: the medians, and movable over driver with the spread of the
  per-round ratios.  Both buffers hold the same random data; the outputs are compared.

RESULTS (H200, 580.159.04, 2026-11-28: bench/results/vmm-access-probe-H200-2026-11-28.txt)
  No difference: movable over driver +0.07% to +1.2% streaming (the 256 MiB buffer's
  0.19 ms kernel the noisiest; 1.4-1.6 TB/s either way), -1.9% to +0.3% gathering at
  random over 256 MiB to 16 GiB, every per-round ratio within -6% and +15% around them
  and equal outputs; again after this file's last change (4 rounds, 256 MiB and 4 GiB:
  -0.3% to +1.4%, -recheck.txt).  Movable memory costs the GPU nothing: what gpuos adds at 100% is
  on the CPU (about 200 ns per launch on that H200, bench/intercept_overhead.py's
  noop-launch).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vmm_ops_probe import device_memory  # noqa: E402  (movable memory's properties, as memory.c's)

KERNELS = r"""
extern "C" __global__ void stream(const float *src, float *dst, unsigned long long n,
                                  unsigned long long out_n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (; i < n; i += step)
        dst[i & (out_n - 1)] = src[i] * 1.5f;
}
extern "C" __global__ void gather(const float *src, float *dst, unsigned long long mask,
                                  unsigned long long out_n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (; i < out_n; i += step) {
        unsigned long long h = (i + 1) * 0x9E3779B97F4A7C15ull;
        dst[i] = src[(h ^ (h >> 29)) & mask];
    }
}
"""
OUT_BYTES = 64 << 20  # both kernels' output


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", default="256,4096,16384")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out")
    a = ap.parse_args()
    sizes = [int(x) << 20 for x in a.sizes_mib.split(",")]
    if any(s & (s - 1) or s < OUT_BYTES for s in sizes):
        print("vmm_access_probe: sizes must be powers of two of at least 64 MiB", file=sys.stderr)
        return 2

    import cupy as cp  # type: ignore[import-not-found]
    import numpy as np
    from cuda.bindings import driver as cu  # type: ignore[import-not-found]

    def ck(result):
        err, *rest = result
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{err}")
        return rest[0] if len(rest) == 1 else rest

    cp.cuda.Device(0).use()
    cp.zeros(1)  # the runtime's primary context, current: cuda-python's calls use it
    mod = cp.RawModule(code=KERNELS)
    stream_k, gather_k = mod.get_function("stream"), mod.get_function("gather")

    prop, desc = device_memory(cu, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    gran = ck(cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))

    out = cp.empty(OUT_BYTES // 4, dtype=cp.float32)
    out_n = np.uint64(OUT_BYTES // 4)
    start, end = cp.cuda.Event(), cp.cuda.Event()

    def time_ms(fn) -> float:
        ts = []
        for _ in range(5):
            start.record()
            fn()
            end.record()
            end.synchronize()
            ts.append(cp.cuda.get_elapsed_time(start, end))
        return statistics.median(ts)

    rows = []
    for size in sizes:
        n = size // 4
        driver_ptr = int(ck(cu.cuMemAlloc(size)))
        va = int(ck(cu.cuMemAddressReserve(size, 0, 0, 0)))
        handle = ck(cu.cuMemCreate(size, prop, 0))
        ck(cu.cuMemMap(va, size, 0, handle, 0))
        ck(cu.cuMemSetAccess(va, size, [desc], 1))
        bufs = {"driver": driver_ptr, "movable": va}
        data = cp.random.default_rng(size).random(n, dtype=cp.float32)
        for p in bufs.values():
            ck(cu.cuMemcpyDtoD(p, data.data.ptr, size))
        del data
        results: dict[str, dict[str, list]] = {k: {"driver": [], "movable": []} for k in ("stream", "gather")}
        sums = {}
        for r in range(a.rounds):
            order = ("driver", "movable") if r % 2 == 0 else ("movable", "driver")
            for kind in order:
                p = np.uint64(bufs[kind])
                results["stream"][kind].append(time_ms(
                    lambda: stream_k((1056,), (256,), (p, out, np.uint64(n), out_n))))
                results["gather"][kind].append(time_ms(
                    lambda: gather_k((1056,), (256,), (p, out, np.uint64(n - 1), out_n))))
                if r == 0:
                    sums[kind] = float(out.sum())
        row = {"size_mib": size >> 20, "granularity": gran, "outputs_equal": sums["driver"] == sums["movable"]}
        for k, v in results.items():
            ratios = [m / d for d, m in zip(v["driver"], v["movable"])]
            row[k] = {"driver_ms": statistics.median(v["driver"]), "movable_ms": statistics.median(v["movable"]),
                      "movable_over_driver_pct": (statistics.median(ratios) - 1) * 100,
                      "ratio_min_pct": (min(ratios) - 1) * 100, "ratio_max_pct": (max(ratios) - 1) * 100,
                      "rounds": v}
            gbps = size / (row[k]["driver_ms"] / 1e3) / 1e9 if k == "stream" else None
            print(f"{size >> 20:6d} MiB {k:6s}: driver {row[k]['driver_ms']:8.3f} ms, movable "
                  f"{row[k]['movable_ms']:8.3f} ms, movable over driver "
                  f"{row[k]['movable_over_driver_pct']:+.2f}% (rounds {row[k]['ratio_min_pct']:+.2f}% to "
                  f"{row[k]['ratio_max_pct']:+.2f}%)" + (f", {gbps:.0f} GB/s read" if gbps else ""))
        print(f"{size >> 20:6d} MiB outputs equal: {row['outputs_equal']}")
        rows.append(row)
        ck(cu.cuMemUnmap(va, size))
        ck(cu.cuMemRelease(handle))
        ck(cu.cuMemAddressFree(va, size))
        ck(cu.cuMemFree(driver_ptr))

    name = ck(cu.cuDeviceGetName(64, 0)).split(b"\0")[0].decode()
    version = ck(cu.cuDriverGetVersion())
    doc = {"probe": "vmm_access", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "device": name, "cuda_driver_version": version, "rounds": a.rounds, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all(r["outputs_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
