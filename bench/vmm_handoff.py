#!/usr/bin/env python3
"""What movable memory relies on, measured on the real driver (docs/design.md, "Movable memory").

An application process (a child, as libgpuos would make it) holds SIZE GiB of device
memory made with the VMM API (reserved range, cuMemCreate exportable as a POSIX fd,
mapped read-write), filled with random data.  Then:

  capture   the whole range copied to host memory that is a memfd mapped shared and
            registered (cuMemHostRegister), in 64 MiB pieces on 4 streams: GB/s; the same
            from a pinned buffer (cuMemAllocHost) reused, for comparison
  hand out  the physical memory exported as an fd and passed to this process (which
            has no CUDA context), then unmapped and released in the application:
            device memory free before and after (is the fd alone keeping it?)
  driver    cuCheckpointProcessLock/Checkpoint/Restore/Unlock of the application that now
            holds only the address range: seconds each
  map back  the fd passed back; imported and mapped at the same address: seconds, and
            the contents compared with the capture (bit-identical?)

    python3 bench/vmm_handoff.py [--gib 4] [--out DIR]

Prints and writes vmm-handoff-<gpu>-<date>.json.  Exit 1 if a step failed or the data differed.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

PIECE = 64 << 20
STREAMS = 4


def ck(result):
    err, rest = result[0], result[1:]
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {getattr(err, 'name', err)}")
    return rest[0] if len(rest) == 1 else rest


def send(sock: socket.socket, msg: dict, fds: list[int] | None = None) -> None:
    data = (json.dumps(msg) + "\n").encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def recv(sock: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, 65536, 4)
    if not data:
        raise EOFError("peer closed")
    return json.loads(data.decode()), list(fds)


# ---- the application (child) ------------------------------------------------------------

def application(sock: socket.socket, gib: int) -> None:
    import numpy as np
    from cuda.bindings import driver as cu

    ck(cu.cuInit(0))
    dev = ck(cu.cuDeviceGet(0))
    ctx = ck(cu.cuDevicePrimaryCtxRetain(dev))
    ck(cu.cuCtxSetCurrent(ctx))
    size = gib << 30
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    desc = cu.CUmemAccessDesc()
    desc.location = prop.location
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    va = int(ck(cu.cuMemAddressReserve(size, 0, 0, 0)))
    handle = ck(cu.cuMemCreate(size, prop, 0))
    ck(cu.cuMemMap(va, size, 0, handle, 0))
    ck(cu.cuMemSetAccess(va, size, [desc], 1))
    rng = np.random.default_rng(1)
    block = rng.integers(0, 2**32, PIECE // 4, dtype=np.uint32)
    for off in range(0, size, PIECE):  # a different random piece at every offset
        block ^= np.uint32(off // PIECE * 2654435761 & 0xFFFFFFFF)
        ck(cu.cuMemcpyHtoD(va + off, block.ctypes.data, PIECE))
    ck(cu.cuCtxSynchronize())
    streams = [ck(cu.cuStreamCreate(1)) for _ in range(STREAMS)]

    def capture(dst_addr: int, ring: bool) -> float:
        t = time.perf_counter()
        for i, off in enumerate(range(0, size, PIECE)):
            dst = dst_addr + (i % (2 * STREAMS)) * PIECE if ring else dst_addr + off
            if ring and i >= 2 * STREAMS:
                ck(cu.cuStreamSynchronize(streams[i % STREAMS]))
            ck(cu.cuMemcpyDtoHAsync(dst, va + off, PIECE, streams[i % STREAMS]))
        for s in streams:
            ck(cu.cuStreamSynchronize(s))
        return time.perf_counter() - t

    def memfd_view(name: str) -> tuple[int, mmap.mmap, int]:
        fd = os.memfd_create(name)
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
        return fd, m, addr

    out: dict = {"gib": gib}
    fd1, m1, a1 = memfd_view("capture")
    t = time.perf_counter()
    ck(cu.cuMemHostRegister(a1, size, 1))  # CU_MEMHOSTREGISTER_PORTABLE
    out["register_s"] = time.perf_counter() - t
    capture(a1, ring=False)  # first touch of the pages: not timed
    out["capture_memfd_gbps"] = size / capture(a1, ring=False) / 1e9
    pinned = ck(cu.cuMemAllocHost(2 * STREAMS * PIECE))
    out["capture_pinned_ring_gbps"] = size / capture(int(pinned), ring=True) / 1e9
    ck(cu.cuMemFreeHost(pinned))
    out["free_before_release"] = ck(cu.cuMemGetInfo())[0]
    fd = ck(cu.cuMemExportToShareableHandle(handle, prop.requestedHandleTypes, 0))
    send(sock, {"step": "exported", "va": va}, [int(fd)])
    os.close(int(fd))
    recv(sock)  # "release"
    t = time.perf_counter()
    ck(cu.cuMemUnmap(va, size))
    ck(cu.cuMemRelease(handle))
    out["release_s"] = time.perf_counter() - t
    out["free_after_release"] = ck(cu.cuMemGetInfo())[0]
    send(sock, {"step": "released", **out})
    msg, fds = recv(sock)  # "map back", after the driver's checkpoint and restore
    t = time.perf_counter()
    h2 = ck(cu.cuMemImportFromShareableHandle(fds[0], prop.requestedHandleTypes))
    ck(cu.cuMemMap(va, size, 0, h2, 0))
    ck(cu.cuMemSetAccess(va, size, [desc], 1))
    out["map_back_s"] = time.perf_counter() - t
    os.close(fds[0])
    fd2, m2, a2 = memfd_view("after")
    ck(cu.cuMemHostRegister(a2, size, 1))
    capture(a2, ring=False)
    out["identical"] = bool(np.array_equal(np.frombuffer(m1, dtype=np.uint64),
                                           np.frombuffer(m2, dtype=np.uint64)))
    send(sock, {"step": "done", **out})


# ---- the controller (parent) ----------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        application(socket.socket(fileno=a.child), a.gib)
        return 0

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "userspace"))
    from gpuos.cudadrv import CudaDriver

    drv = CudaDriver()
    dev = drv.devices()[0]
    mine, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, __file__, "--gib", str(a.gib), "--child", str(theirs.fileno())],
                             pass_fds=[theirs.fileno()])
    theirs.close()
    result: dict = {"benchmark": "vmm-handoff", "date": datetime.now(timezone.utc).isoformat(),
                    "device": dev.name, "driver": drv.driver_info().version}
    ok = False
    try:
        msg, fds = recv(mine)
        held = fds[0]  # this process has no CUDA context: only the fd keeps the memory
        send(mine, {"step": "release"})
        msg, _ = recv(mine)
        result.update(msg)
        times = {}
        for step, fn in (("lock", lambda: drv.lock(child.pid, 10000)),
                         ("checkpoint", lambda: drv.checkpoint(child.pid)),
                         ("restore", lambda: drv.restore(child.pid, {})),
                         ("unlock", lambda: drv.unlock(child.pid))):
            t = time.perf_counter()
            fn()
            times[step] = round(time.perf_counter() - t, 4)
        result["driver_s"] = times
        send(mine, {"step": "map back"}, [held])
        os.close(held)
        msg, _ = recv(mine)
        result.update(msg)
        ok = bool(msg.get("identical"))
    except Exception as exc:  # noqa: BLE001 - a measurement: say what failed
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        child.wait(timeout=120)
    result["ok"] = ok
    a.out.mkdir(parents=True, exist_ok=True)
    name = dev.name.replace("NVIDIA ", "").split()[0]
    path = a.out / f"vmm-handoff-{name}-{datetime.now():%Y-%m-%d}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
