#!/usr/bin/env python3
"""What does making movable memory resident cost, call by call?  (issue 19; GPU host.)

    python3 tools/probes/vmm_ops_probe.py [--sizes-mib 2,8,32,128,512,2048] [--repeat 5]
                                          [--out FILE.json]

WHY
  In a group's turn switch, libgpuos makes each allocation it brings in resident with
  cuMemCreate, cuMemMap and cuMemSetAccess, then queues its copy in; an eviction unmaps
  and releases.  On an H200 (session 26, DNN mix at 150%: the oversub JSON's ahead_split)
  making and mapping took 0.44 s of a run's 0.56 s spent issuing batches, beside 0.78 s of
  the batches' GPU time, and the batches ran at 35 GB/s against 52 pinned.  Which call is
  it, is it a fixed cost per allocation or a cost per byte, and what would keeping the
  physical memory (mapping an existing handle again) or not asking for an exportable
  handle save?

WHAT IT DOES
  In one process, for each size and each handle type (a POSIX fd, as libgpuos asks for;
  none): REPEAT rounds of reserve, create, map, set access, a pinned copy in of the whole
  size, unmap, map again and set access again (the same handle), unmap, release; each call
  timed (synchronised where it queues).  Medians per size, type and call, in ms, and each
  call's cost per GiB beside the copy's.  Then, for COUNT allocations of 16 MiB (a turn's
  batch of ResNet-50's allocations), making them resident (create, map, set access) three
  ways, each timed as a whole: one after another; from 4 threads at once (does the fixed
  cost per allocation overlap?); and from one handle of their total size, mapped at each
  allocation's own reserved range at its offset (one create instead of COUNT).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone


def device_memory(cu, handle_type):
    """The properties of device 0's memory as libgpuos makes it (memory.c movable_prop,
    with `handle_type`) and read-write access to it from device 0."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    prop.requestedHandleTypes = handle_type
    desc = cu.CUmemAccessDesc()
    desc.location = prop.location
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return prop, desc


def batch_ways(cu, ck, count: int, size: int) -> dict[str, float]:
    """ms to make `count` allocations of `size` resident: serially, from 4 threads, and
    from one handle of their total size (each way's memory released before the next)."""
    import threading

    prop, desc = device_memory(cu, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    ctx = ck(cu.cuCtxGetCurrent())
    vas = [int(ck(cu.cuMemAddressReserve(size, 0, 0, 0))) for _ in range(count)]
    handles: list = [None] * count

    def make(i: int) -> None:
        handles[i] = ck(cu.cuMemCreate(size, prop, 0))
        ck(cu.cuMemMap(vas[i], size, 0, handles[i], 0))
        ck(cu.cuMemSetAccess(vas[i], size, [desc], 1))

    def drop() -> None:
        for i in range(count):
            ck(cu.cuMemUnmap(vas[i], size))
            if handles[i] is not None:
                ck(cu.cuMemRelease(handles[i]))
                handles[i] = None

    out = {}
    t0 = time.perf_counter()
    for i in range(count):
        make(i)
    out["serial"] = (time.perf_counter() - t0) * 1e3
    drop()

    def worker(k: int) -> None:
        ck(cu.cuCtxSetCurrent(ctx))
        for i in range(k, count, 4):
            make(i)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["four_threads"] = (time.perf_counter() - t0) * 1e3
    drop()

    t0 = time.perf_counter()
    big = ck(cu.cuMemCreate(size * count, prop, 0))
    for i in range(count):
        ck(cu.cuMemMap(vas[i], size, i * size, big, 0))
        ck(cu.cuMemSetAccess(vas[i], size, [desc], 1))
    out["one_handle"] = (time.perf_counter() - t0) * 1e3
    drop()
    ck(cu.cuMemRelease(big))
    for va in vas:
        ck(cu.cuMemAddressFree(va, size))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", default="2,8,32,128,512,2048")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from cuda.bindings import driver as cu  # type: ignore[import-not-found]

    def ck(result):
        err = result[0] if isinstance(result, tuple) else result
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA error: {getattr(err, 'name', err)}")
        if isinstance(result, tuple):
            return result[1] if len(result) == 2 else result[1:]
        return None

    ck(cu.cuInit(0))
    dev = ck(cu.cuDeviceGet(0))
    ctx = ck(cu.cuDevicePrimaryCtxRetain(dev))
    ck(cu.cuCtxSetCurrent(ctx))
    name = ck(cu.cuDeviceGetName(64, dev)).split(b"\0")[0].decode()
    driver = ck(cu.cuDriverGetVersion())
    sizes = [int(s) << 20 for s in args.sizes_mib.split(",")]
    host = ck(cu.cuMemAllocHost(max(sizes)))
    stream = ck(cu.cuStreamCreate(1))  # non-blocking, as libgpuos's swap stream
    results = []
    for htype_name, htype in (("posix-fd", cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                              ("none", cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE)):
        prop, desc = device_memory(cu, htype)
        gran = ck(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        for size in sizes:
            size = (size + gran - 1) // gran * gran
            times: dict[str, list[float]] = {}

            def timed(what, fn, *a):
                t0 = time.perf_counter()
                r = ck(fn(*a))
                times.setdefault(what, []).append((time.perf_counter() - t0) * 1e3)
                return r

            for _ in range(args.repeat):
                va = int(ck(cu.cuMemAddressReserve(size, 0, 0, 0)))
                h = timed("create", cu.cuMemCreate, size, prop, 0)
                timed("map", cu.cuMemMap, va, size, 0, h, 0)
                timed("set_access", cu.cuMemSetAccess, va, size, [desc], 1)
                t0 = time.perf_counter()
                ck(cu.cuMemcpyHtoDAsync(va, host, size, stream))
                ck(cu.cuStreamSynchronize(stream))
                times.setdefault("copy_in", []).append((time.perf_counter() - t0) * 1e3)
                timed("unmap", cu.cuMemUnmap, va, size)
                timed("map_again", cu.cuMemMap, va, size, 0, h, 0)
                timed("set_access_again", cu.cuMemSetAccess, va, size, [desc], 1)
                ck(cu.cuMemUnmap(va, size))
                timed("release", cu.cuMemRelease, h)
                ck(cu.cuMemAddressFree(va, size))
            med = {k: statistics.median(v) for k, v in times.items()}
            gib = size / (1 << 30)
            row = {"handle": htype_name, "bytes": size, "median_ms": med, "all_ms": times,
                   "per_gib_ms": {k: v / gib for k, v in med.items()}}
            results.append(row)
            print(f"{htype_name:8} {size >> 20:6} MiB  " + "  ".join(f"{k} {v:.3f}" for k, v in med.items()),
                  flush=True)
    batch = batch_ways(cu, ck, args.count, 16 << 20)
    print("batch of", args.count, "x 16 MiB:", "  ".join(f"{k} {v:.1f} ms" for k, v in batch.items()), flush=True)
    out = {"probe": "vmm_ops", "device": name, "driver": driver,
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rows": results, "batch_16mib": batch}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
