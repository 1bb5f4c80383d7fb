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
  batch of ResNet-50's allocations), making them resident (create, map, set access) as a
  whole, several ways (batch_ways): serially; from 4 threads (does the fixed cost per
  allocation overlap?); as libgpuos issues a batch, each copy queued after its mapping;
  and serially while another process releases memory or runs memsets.

RESULTS (H200, 580.159.04, session 27: bench/results/vmm-ops-probe-H200-2026-11-28.txt)
  Per call, alone on an idle GPU: create 0.02-0.07 ms, map 0.003-0.02, set access
  0.03-0.15, unmap 0.02-0.18, release 0.02 ms at 2 MiB to 1.8 ms at 2 GiB (the only call
  that grows with the size, about 0.9 ms per GiB); POSIX-fd handles cost the same as
  none.  So about 0.07 ms to make 16 MiB resident, against the 0.4 ms per allocation of
  the DNN mix's turns: the difference is not the calls themselves.  The batch part failed
  there on its one-handle way (offsets other than 0 are refused) and was rewritten.
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


def batch_ways(cu, ck, count: int, size: int, busy_cmd: list[str]) -> dict[str, float]:
    """ms to make `count` allocations of `size` resident (create, map, set access), each way
    on its own (its memory released before the next): serially on an idle GPU; from 4
    threads; as libgpuos issues a batch (each one's copy in queued right after its
    mapping: `as_issued` to the last issue, `as_issued_gpu` to the copies' end,
    `as_issued_making` the making alone); and serially while another process works the
    GPU (`busy_cmd` + MODE: releasing memory as evictions do, or running memsets), to see
    whether the 0.4 ms per allocation of a DNN mix's turns is contention.  (One handle of
    the batch's size mapped at each range's offset: the driver refuses offsets other than
    0, CUDA_ERROR_NOT_SUPPORTED on 580.159.04, H200.)"""
    import subprocess
    import threading

    prop, desc = device_memory(cu, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    ctx = ck(cu.cuCtxGetCurrent())
    vas = [int(ck(cu.cuMemAddressReserve(size, 0, 0, 0))) for _ in range(count)]
    handles: list = [None] * count
    host = ck(cu.cuMemAllocHost(size))
    stream = ck(cu.cuStreamCreate(1))

    def make(i: int) -> None:
        handles[i] = ck(cu.cuMemCreate(size, prop, 0))
        ck(cu.cuMemMap(vas[i], size, 0, handles[i], 0))
        ck(cu.cuMemSetAccess(vas[i], size, [desc], 1))

    def drop() -> None:
        for i in range(count):
            if handles[i] is not None:
                ck(cu.cuMemUnmap(vas[i], size))
                ck(cu.cuMemRelease(handles[i]))
                handles[i] = None

    def serial() -> float:
        t0 = time.perf_counter()
        for i in range(count):
            make(i)
        ms = (time.perf_counter() - t0) * 1e3
        drop()
        return ms

    out = {"serial": serial()}

    def worker(k: int) -> None:
        ck(cu.cuCtxSetCurrent(ctx))
        for i in range(k, count, 4):
            make(i)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    out["four_threads"] = (time.perf_counter() - t0) * 1e3
    drop()

    making = 0.0
    t0 = time.perf_counter()
    for i in range(count):
        m0 = time.perf_counter()
        make(i)
        making += time.perf_counter() - m0
        ck(cu.cuMemcpyHtoDAsync(vas[i], host, size, stream))
    out["as_issued"] = (time.perf_counter() - t0) * 1e3
    ck(cu.cuStreamSynchronize(stream))
    out["as_issued_gpu"] = (time.perf_counter() - t0) * 1e3
    out["as_issued_making"] = making * 1e3
    drop()

    for mode in ("release", "memset"):
        busy = subprocess.Popen([*busy_cmd, mode], stdout=subprocess.PIPE, text=True)
        try:
            if busy.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the busy process ({mode}) did not start: exit {busy.wait()}")
            time.sleep(0.2)
            out[f"serial_beside_{mode}"] = serial()
        finally:
            busy.terminate()
            busy.wait()
    ck(cu.cuStreamDestroy(stream))
    ck(cu.cuMemFreeHost(host))
    for va in vas:
        ck(cu.cuMemAddressFree(va, size))
    return out


def busy(cu, ck, mode: str) -> int:
    """--busy MODE: work the GPU until terminated: `release`, make and release 512 MiB at a
    time, as evicting members do; `memset`, 1 GiB memsets back to back."""
    prop, desc = device_memory(cu, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    size = 512 << 20
    va = int(ck(cu.cuMemAddressReserve(size, 0, 0, 0)))
    if mode == "memset":
        h = ck(cu.cuMemCreate(size, prop, 0))
        ck(cu.cuMemMap(va, size, 0, h, 0))
        ck(cu.cuMemSetAccess(va, size, [desc], 1))
        stream = ck(cu.cuStreamCreate(1))
    print("ready", flush=True)
    while True:
        if mode == "memset":
            for _ in range(8):
                ck(cu.cuMemsetD32Async(va, 7, size // 4, stream))
            ck(cu.cuStreamSynchronize(stream))
        else:
            h = ck(cu.cuMemCreate(size, prop, 0))
            ck(cu.cuMemMap(va, size, 0, h, 0))
            ck(cu.cuMemSetAccess(va, size, [desc], 1))
            ck(cu.cuMemUnmap(va, size))
            ck(cu.cuMemRelease(h))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", default="2,8,32,128,512,2048")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--out", default="")
    ap.add_argument("--busy", choices=("release", "memset"), help=argparse.SUPPRESS)  # batch_ways's other process
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
    if args.busy:
        return busy(cu, ck, args.busy)
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
    batch = batch_ways(cu, ck, args.count, 16 << 20, [sys.executable, __file__, "--busy"])
    print("batch of", args.count, "x 16 MiB:", "  ".join(f"{k} {v:.1f} ms" for k, v in batch.items()), flush=True)
    out = {"probe": "vmm_ops", "device": name, "driver": driver,
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rows": results, "batch_16mib": batch}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
