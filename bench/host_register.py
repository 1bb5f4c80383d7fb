#!/usr/bin/env python3
"""How fast the driver pins host memory for DMA (cuMemHostRegister), by size and kind.

The movable-memory capture copies into a staging file that libgpuos's agent registers;
registration pins every page.  For each size: a tmpfs file with its pages allocated
(fallocate, as gpuos stages it), and the same without; seconds to register, whether the
driver accepted it, and the D2H rate into it afterwards.

    python3 bench/host_register.py [--gib 1,4,16,20] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", default="1,4,16,20")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    a = ap.parse_args()
    import numpy as np
    from cuda.bindings import driver as cu

    def ck(r):
        if int(r[0]) != 0:
            raise RuntimeError(getattr(r[0], "name", str(r[0])))
        return r[1] if len(r) == 2 else r[1:]

    ck(cu.cuInit(0))
    dev = ck(cu.cuDeviceGet(0))
    ctx = ck(cu.cuDevicePrimaryCtxRetain(dev))
    ck(cu.cuCtxSetCurrent(ctx))
    name = ck(cu.cuDeviceGetName(64, dev)).split(b"\0")[0].decode()
    rows = []
    for gib in [int(x) for x in a.gib.split(",")]:
        size = gib << 30
        dsrc = ck(cu.cuMemAlloc(min(size, 4 << 30)))
        for populated in (True, False):
            path = f"/dev/shm/gpuos-register-probe-{os.getpid()}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.unlink(path)
            t = time.perf_counter()
            if populated:
                os.posix_fallocate(fd, 0, size)
            else:
                os.ftruncate(fd, size)
            alloc_s = time.perf_counter() - t
            m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
            t = time.perf_counter()
            err = cu.cuMemHostRegister(addr, size, 1)[0]
            reg_s = time.perf_counter() - t
            row = {"gib": gib, "populated": populated, "allocate_s": round(alloc_s, 3),
                   "register_s": round(reg_s, 3), "registered": int(err) == 0,
                   "error": None if int(err) == 0 else getattr(err, "name", str(err))}
            n = min(size, 4 << 30)
            t = time.perf_counter()
            ck(cu.cuMemcpyDtoH(addr, dsrc, n))
            row["dtoh_gbps"] = round(n / (time.perf_counter() - t) / 1e9, 1)
            if int(err) == 0:
                ck(cu.cuMemHostUnregister(addr))
            del addr
            m.close()
            os.close(fd)
            rows.append(row)
            print(json.dumps(row), flush=True)
        ck(cu.cuMemFree(dsrc))
    out = {"benchmark": "host-register", "device": name, "date": datetime.now(timezone.utc).isoformat(),
           "rows": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"host-register-{name.replace('NVIDIA ', '').split()[0]}-{datetime.now():%Y-%m-%d}.json").write_text(
        json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
