"""Launches whose touched bytes are known exactly, for `gpuos run --record-touched`.

One 64 MiB cudaMalloc (its own allocation, no pool), and three CuPy kernels on parts of
it: a write of [4 MiB, 12 MiB), a read of 4 MiB from 20 MiB + 12 KiB, a write of all of
it. Prints one JSON line: the allocation, each launch's kernel, pointer and byte length,
and whether the results were right (the read's sum, the writes read back).
"""

from __future__ import annotations

import json

import cupy
import numpy as np

MiB = 1 << 20
SIZE = 64 * MiB
SRC = r"""
extern "C" __global__ void write_range(float *p, long long n, float v) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        p[i] = v + (float)(i % 1024);
}
extern "C" __global__ void read_sum(const float *p, long long n, unsigned long long *out) {
    unsigned long long s = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        s += (unsigned long long)p[i];
    atomicAdd(out, s);
}
"""


def main() -> None:
    mod = cupy.RawModule(code=SRC)
    write, read = mod.get_function("write_range"), mod.get_function("read_sum")
    base = cupy.cuda.runtime.malloc(SIZE)
    out = cupy.cuda.runtime.malloc(4096)
    cupy.cuda.runtime.memset(out, 0, 8)
    launches = []

    def launch(fn, name, off, nbytes, *extra):
        ptr = base + off
        fn((256,), (256,), (ptr, np.int64(nbytes // 4), *extra))
        launches.append({"kernel": name, "ptr": ptr, "len": nbytes})

    launch(write, "write_range", 4 * MiB, 8 * MiB, np.float32(1.0))  # [4, 12) MiB
    launch(read, "read_sum", 20 * MiB + 12 * 1024, 4 * MiB, out)     # never written: zeros
    launch(write, "write_range", 0, SIZE, np.float32(2.0))           # all of it
    cupy.cuda.runtime.deviceSynchronize()
    host = np.empty(SIZE // 4, dtype=np.float32)
    cupy.cuda.runtime.memcpy(host.ctypes.data, base, SIZE, cupy.cuda.runtime.memcpyDeviceToHost)
    total = np.empty(1, dtype=np.uint64)
    cupy.cuda.runtime.memcpy(total.ctypes.data, out, 8, cupy.cuda.runtime.memcpyDeviceToHost)
    want = 2.0 + (np.arange(SIZE // 4) % 1024).astype(np.float32)
    ok = bool(np.array_equal(host, want)) and int(total[0]) == 0
    print(json.dumps({"base": base, "size": SIZE, "launches": launches, "ok": ok}))


if __name__ == "__main__":
    main()
