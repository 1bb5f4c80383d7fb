"""gpuos's own CUDA context for moving memory between the store and a GPU.

Out (checkpoint): after a `--leave-running` stop the process runs again while its
snapshot (device memory the agent filled in the stop, handed to gpuos as descriptors)
still has to reach the image.  Copying it inside the process would pin host memory there,
which holds up the process's own CUDA calls (measured on H100: one 0.8 s gap at 16 GiB).
The copier does it from gpuos instead: a context on the process's GPU (made before the
stop), a few pinned bounce buffers, and a pipeline: each piece (PIECE) is copied from the
GPU into a buffer on its own stream while earlier pieces go, in order, to the store, which
cuts them into chunks as they come (store.content.StreamIn): the memory never becomes a
file.  Each snapshot allocation is let go as soon as its last piece is on the host, so the
GPU gets the memory back at the copy's pace.  The process only shares the copy engines.

In (restore, prefill.py): while CRIU restores the process, memory of the copier's own
(exportable, one allocation per movable allocation) is filled from the image's chunks,
each read and checked straight into a pinned buffer and copied to the GPU while the next
buffers are read.  The process, once back, takes it by device-to-device copies.

Used only where it can be: cuda-python, the process on one GPU that gpuos finds by UUID.
Otherwise the agent copies into a staging file (handout.capture_snapshot), and a restore
streams through the agent (filler.py).
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

from ..errors import GpuosError

PIECE = 64 << 20  # bytes per bounce buffer

BUFFERS = 4  # pieces in flight: one copying from the GPU while the others are written


class CopierError(GpuosError):
    pass


class Copier:
    """A context on the GPU with this UUID (NVML form), with pinned bounce buffers."""

    def __init__(self, gpu_uuid: str | None):
        self.ctx = None
        self.buffers: list[int] = []
        self.streams: list = []
        self.memory: list[tuple[int, int, object]] = []  # allocate(): (va, size, handle)
        try:
            self._open(gpu_uuid)
        except CopierError:
            self.close()
            raise
        except Exception as exc:  # noqa: BLE001 - cuda-python without a driver raises its own kinds
            self.close()
            raise CopierError(f"no CUDA context for gpuos ({type(exc).__name__}: {exc})") from None

    def _open(self, gpu_uuid: str | None) -> None:
        from cuda.bindings import driver as cu  # type: ignore[import-not-found]

        self.cu = cu
        self._ck(cu.cuInit(0))
        self.dev = self._device(gpu_uuid)
        self.ctx = self._ck(cu.cuDevicePrimaryCtxRetain(self.dev))
        self._ck(cu.cuCtxSetCurrent(self.ctx))
        for _ in range(BUFFERS):
            self.buffers.append(int(self._ck(cu.cuMemHostAlloc(PIECE, 0))))
            self.streams.append(self._ck(cu.cuStreamCreate(1)))  # NON_BLOCKING
        self.views = [memoryview((ctypes.c_char * PIECE).from_address(b)).cast("B") for b in self.buffers]

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

    def copy(self, fds: list[int], reserved: list[int], sink: Callable[[bytes], None]) -> int:
        """Each fd's memory (`reserved[i]` bytes), back to back, to sink, piece by piece in
        order; the bytes.  The copier owns the fds: each is closed (and its memory goes) as
        soon as it is copied, all on failure."""
        cu = self.cu
        self._ck(cu.cuCtxSetCurrent(self.ctx))
        fds = list(fds)
        mapped: list[tuple[int, int, object] | None] = [None] * len(fds)
        starts = [sum(reserved[:i]) for i in range(len(reserved))]
        total = sum(reserved)
        npieces = max(1, -(-total // PIECE))
        # the last piece that holds a byte of allocation i: once it is on the host, i goes
        last = [(s + n - 1) // PIECE if n else -1 for s, n in zip(starts, reserved)]
        pending: list[Future | None] = [None] * BUFFERS
        try:
            for i, (fd, size) in enumerate(zip(fds, reserved)):
                mapped[i] = self._map(fd, size)
            with ThreadPoolExecutor(BUFFERS) as pool:
                for k in range(npieces):
                    b = k % BUFFERS
                    if pending[b] is not None:
                        sink(pending[b].result())  # piece k - BUFFERS: every piece before it is out
                        self._let_go(k - BUFFERS, last, mapped, fds)
                    lo, hi = k * PIECE, min((k + 1) * PIECE, total)
                    for i, (s, n) in enumerate(zip(starts, reserved)):
                        a, z = max(lo, s), min(hi, s + n)
                        if a < z:
                            va = mapped[i][0]  # type: ignore[index]
                            self._ck(cu.cuMemcpyDtoHAsync(self.buffers[b] + a - lo, va + a - s, z - a,
                                                          self.streams[b]))
                    pending[b] = pool.submit(self._piece, b, hi - lo)
                for k in range(max(0, npieces - BUFFERS), npieces):  # the last ones, in order
                    sink(pending[k % BUFFERS].result())
        finally:
            for s in self.streams:
                cu.cuStreamSynchronize(s)
            self._let_go(npieces, last, mapped, fds)
        return total

    def _map(self, fd: int, size: int) -> tuple[int, int, object]:
        """fd's memory (a snapshot allocation), imported and mapped here."""
        cu = self.cu
        prop = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return self._map_handle(self._ck(cu.cuMemImportFromShareableHandle(fd, prop)), size)

    def _map_handle(self, h, size: int) -> tuple[int, int, object]:
        """Physical memory h mapped read-write at an address range of the copier's own:
        (va, size, h); on failure every step undone, h released."""
        cu = self.cu
        try:
            va = int(self._ck(cu.cuMemAddressReserve(size, 0, 0, 0)))
        except CopierError:
            cu.cuMemRelease(h)
            raise
        try:
            self._ck(cu.cuMemMap(va, size, 0, h, 0))
        except CopierError:
            cu.cuMemAddressFree(va, size)
            cu.cuMemRelease(h)
            raise
        try:
            self._ck(cu.cuMemSetAccess(va, size, [self._access()], 1))
        except CopierError:
            self._unmap((va, size, h))
            raise
        return va, size, h

    def _unmap(self, mapped: tuple[int, int, object]) -> None:
        """Undo _map_handle."""
        va, size, h = mapped
        self.cu.cuMemUnmap(va, size)
        self.cu.cuMemRelease(h)
        self.cu.cuMemAddressFree(va, size)

    def _let_go(self, done: int, last: list[int], mapped: list, fds: list[int]) -> None:
        """Unmap and close every allocation whose last piece is at most `done` (copied)."""
        cu = self.cu
        for i, lp in enumerate(last):
            if lp > done:
                continue
            if mapped[i] is not None:
                self._unmap(mapped[i])
                mapped[i] = None
            if fds[i] >= 0:
                os.close(fds[i])
                fds[i] = -1

    def _piece(self, b: int, n: int) -> bytes:
        """A piece, once its copies on stream b are done: out of the bounce buffer (which
        the next piece reuses)."""
        self._ck(self.cu.cuCtxSetCurrent(self.ctx))  # this thread's own current context
        self._ck(self.cu.cuStreamSynchronize(self.streams[b]))
        return bytes(self.views[b][:n])

    def allocate(self, sizes: Sequence[int]) -> None:
        """Device memory of the copier's own, exportable as POSIX fds, one allocation of
        each size (multiples of the GPU's granularity), mapped at addresses of its own.
        All or none: CopierError (out of memory among others), nothing kept."""
        cu = self.cu
        self._ck(cu.cuCtxSetCurrent(self.ctx))
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = int(self.dev)
        prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        try:
            for size in sizes:
                self.memory.append(self._map_handle(self._ck(cu.cuMemCreate(size, prop, 0)), size))
        except CopierError:
            self.free()
            raise

    def _access(self):
        cu = self.cu
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = int(self.dev)
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc

    def free_bytes(self) -> int:
        """The GPU's free memory now."""
        self._ck(self.cu.cuCtxSetCurrent(self.ctx))
        return int(self._ck(self.cu.cuMemGetInfo())[0])

    def load(self, parts: Sequence[tuple[int, int, int]], read: Callable[[int, memoryview], None],
             pool: ThreadPoolExecutor, stop: Callable[[], bool]) -> int:
        """parts[k] = (allocation, offset, length) of allocate()'s memory, filled in order:
        as many parts as fit in a bounce buffer read into it at once (read(k, view), on the
        pool), then copied to the GPU on the buffer's stream while the next buffers are
        read.  Before each buffer, stop() may end it.  Returns how many parts (a prefix)
        are on the GPU; a read's error is raised once the copies issued are done."""
        cu = self.cu
        self._ck(cu.cuCtxSetCurrent(self.ctx))
        issued, b, k = 0, 0, 0
        try:
            while k < len(parts) and not stop():
                self._ck(cu.cuStreamSynchronize(self.streams[b]))  # the buffer's last copies are done
                batch, used = [], 0
                while k < len(parts) and used + parts[k][2] <= PIECE:
                    batch.append((k, used))
                    used += parts[k][2]
                    k += 1
                if not batch:
                    raise CopierError(f"a part of {parts[k][2]} bytes is larger than a buffer")
                view = self.views[b]
                list(pool.map(lambda e: read(e[0], view[e[1]:e[1] + parts[e[0]][2]]), batch))
                for j, at in batch:
                    i, off, n = parts[j]
                    va = self.memory[i][0]
                    self._ck(cu.cuMemcpyHtoDAsync(va + off, self.buffers[b] + at, n, self.streams[b]))
                issued = k
                b = (b + 1) % BUFFERS
        finally:
            for s in self.streams:
                cu.cuStreamSynchronize(s)
        return issued

    def export(self) -> list[int]:
        """allocate()'s memory as POSIX fds, in its order (the caller closes them)."""
        cu = self.cu
        self._ck(cu.cuCtxSetCurrent(self.ctx))
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        fds: list[int] = []
        try:
            for _, _, h in self.memory:
                fds.append(int(self._ck(cu.cuMemExportToShareableHandle(h, kind, 0))))
        except CopierError:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def free(self) -> None:
        """allocate()'s memory let go (what was exported lives on while imported elsewhere)."""
        self.cu.cuCtxSetCurrent(self.ctx)
        for mapped in self.memory:
            self._unmap(mapped)
        self.memory = []

    def close(self) -> None:
        if self.ctx is None:
            return
        self.free()
        cu = self.cu
        self.views = []
        for s in self.streams:
            cu.cuStreamDestroy(s)
        for b in self.buffers:
            cu.cuMemFreeHost(b)
        self.streams, self.buffers = [], []
        cu.cuDevicePrimaryCtxRelease(self.dev)
        self.ctx = None
