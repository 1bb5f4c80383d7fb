"""gpuos's own copy of a snapshot to the host, in a CUDA context of gpuos's.

After a `--leave-running` stop the process runs again while its snapshot (device memory
the agent filled in the stop, handed to gpuos as descriptors) still has to reach the
host.  Copying it inside the process would pin the staging file there, which holds up
the process's own CUDA calls (measured on H100: one 0.8 s gap at 16 GiB).  The copier
does it from gpuos instead: it registers the staging file in gpuos before the stop,
imports the snapshot's descriptors after it, maps them at addresses of its own, copies
at PCIe speed, and lets them go; the process only shares the copy engines.

Used only where it can be: cuda-python, the process on one GPU that gpuos finds by UUID.
Otherwise the agent copies (handout.capture_snapshot).
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from ..errors import GpuosError

WINDOW = 256 << 20  # registered in windows, no copy crossing one (as the agent does)
PIECE = 64 << 20


class CopierError(GpuosError):
    pass


class Copier:
    """A context on the GPU with this UUID (NVML form), and a staging file registered in it."""

    def __init__(self, gpu_uuid: str | None, staging: Path, size: int):
        self.registered, self.fd, self.map = 0, -1, None
        try:
            self._open(gpu_uuid, staging, size)
        except CopierError:
            self.close()
            raise
        except Exception as exc:  # noqa: BLE001 - cuda-python without a driver raises its own kinds
            self.close()
            raise CopierError(f"no CUDA context for gpuos ({type(exc).__name__}: {exc})") from None

    def _open(self, gpu_uuid: str | None, staging: Path, size: int) -> None:
        from cuda.bindings import driver as cu  # type: ignore[import-not-found]

        self.cu = cu
        self._ck(cu.cuInit(0))
        self.dev = self._device(gpu_uuid)
        self.ctx = self._ck(cu.cuDevicePrimaryCtxRetain(self.dev))
        self._ck(cu.cuCtxSetCurrent(self.ctx))
        self.fd = os.open(staging, os.O_RDWR)
        self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        import ctypes
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.size = size
        self.registered = 0
        for off in range(0, size, WINDOW):
            n = min(WINDOW, size - off)
            self._ck(cu.cuMemHostRegister(self.addr + off, n, 1))  # PORTABLE
            self.registered = off + n

    def _ck(self, result):
        err, rest = result[0], result[1:]
        if int(err) != 0:
            raise CopierError(f"CUDA error {getattr(err, 'name', err)}")
        return rest[0] if len(rest) == 1 else rest

    def _device(self, uuid: str | None):
        cu = self.cu
        count = self._ck(cu.cuDeviceGetCount())
        if uuid is None:
            if count != 1:
                raise CopierError("which GPU is not known")
            return self._ck(cu.cuDeviceGet(0))
        want = bytes.fromhex(uuid.removeprefix("GPU-").replace("-", ""))
        for i in range(count):
            d = self._ck(cu.cuDeviceGet(i))
            if bytes(self._ck(cu.cuDeviceGetUuid(d)).bytes) == want:
                return d
        raise CopierError(f"GPU {uuid} is not visible to gpuos")

    def copy(self, fds: list[int], reserved: list[int]) -> int:
        """Each fd's memory (`reserved[i]` bytes) into the staging file, back to back."""
        cu = self.cu
        self._ck(cu.cuCtxSetCurrent(self.ctx))
        prop = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = int(self.dev)
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        streams = [self._ck(cu.cuStreamCreate(1)) for _ in range(4)]
        mapped = []
        off = k = 0
        try:
            for fd, size in zip(fds, reserved):
                if off + size > self.registered:
                    raise CopierError("the staging file is smaller than the snapshot")
                h = self._ck(cu.cuMemImportFromShareableHandle(fd, prop))
                va = int(self._ck(cu.cuMemAddressReserve(size, 0, 0, 0)))
                mapped.append((va, size, h))
                self._ck(cu.cuMemMap(va, size, 0, h, 0))
                self._ck(cu.cuMemSetAccess(va, size, [desc], 1))
                o = 0
                while o < size:
                    n = min(PIECE, size - o, WINDOW - (off + o) % WINDOW)
                    self._ck(cu.cuMemcpyDtoHAsync(self.addr + off + o, va + o, n, streams[k % 4]))
                    o += n
                    k += 1
                off += size
            for s in streams:
                self._ck(cu.cuStreamSynchronize(s))
        finally:
            for s in streams:
                cu.cuStreamSynchronize(s)
                cu.cuStreamDestroy(s)
            for va, size, h in mapped:
                cu.cuMemUnmap(va, size)
                cu.cuMemRelease(h)
                cu.cuMemAddressFree(va, size)
        return off

    def close(self) -> None:
        if self.registered:
            self.cu.cuCtxSetCurrent(self.ctx)
            for off in range(0, self.registered, WINDOW):
                self.cu.cuMemHostUnregister(self.addr + off)
        self.registered = 0
        if self.map is not None:
            self.map.close()
            self.map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if getattr(self, "ctx", None) is not None:
            self.cu.cuDevicePrimaryCtxRelease(self.dev)
            self.ctx = None
