"""/dev/gpuos: the ioctl path for batches of ranges.

    with Chardev() as dev:              # checks GPUOS_IOC_ABI_VERSION
        res = dev.submit(as_id, Op.MIGRATE, [Range(base, length, DEST_GPU(0))])
        res.batch_id, res.statuses

Errnos become GpuosErrors (errnos.py): EPERM -> NotPermitted (submitting needs
CAP_SYS_ADMIN), ENODEV -> NoDriverRegistered, EOPNOTSUPP -> NotSupported,
EINVAL/E2BIG/EFAULT -> InvalidRequest (for bad ranges with ``statuses``: each
range's 0 or -EINVAL, as the module set them), EAGAIN -> LimitReached.  ``submit`` does not validate the ranges itself
(the module does), and its keyword arguments can set the batch's size, flags and
nr_ranges to anything, so that tests can check what the module refuses.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from typing import Sequence

from ..errors import (GpuosError, InvalidRequest, KmodNotLoaded, KmodVersionMismatch,
                      NotPermitted)
from .errnos import kernel_error
from .model import Range, SubmitResult
from .uapi import ABI_VERSION, IOC_ABI_VERSION, IOC_SUBMIT, GpuosBatch, GpuosRange, Op

DEV_PATH = "/dev/gpuos"


def build_batch(as_id: int, op: Op | int, ranges: Sequence[Range], *, flags: int = 0,
                size: int | None = None, nr_ranges: int | None = None
                ) -> tuple[GpuosBatch, ctypes.Array]:
    """struct gpuos_batch and the struct gpuos_range array it points to (keep both alive)."""
    array = (GpuosRange * max(len(ranges), 1))()
    for i, r in enumerate(ranges):
        array[i] = GpuosRange(base=r.base, len=r.len, dest=r.dest, prio=r.prio, flags=r.flags,
                              status=0)
    batch = GpuosBatch(size=ctypes.sizeof(GpuosBatch) if size is None else size, op=int(op),
                       as_id=as_id, nr_ranges=len(ranges) if nr_ranges is None else nr_ranges,
                       flags=flags, ranges=ctypes.addressof(array) if ranges else 0,
                       batch_id=0)
    return batch, array


class Chardev:
    """/dev/gpuos, opened read-write; a context manager.

    KmodNotLoaded if the device does not exist; KmodVersionMismatch (with
    ``check_abi``) if the module's ioctl ABI is not GPUOS_ABI_VERSION.
    """

    def __init__(self, path: str = DEV_PATH, check_abi: bool = True) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise KmodNotLoaded(f"{path} does not exist: gpuos.ko is not loaded") from None
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM):
                raise NotPermitted(f"cannot open {path}: {exc.strerror}") from None
            if exc.errno in (errno.ENXIO, errno.ENODEV):
                raise KmodNotLoaded(f"{path}: no such device (gpuos.ko is not loaded)") from None
            raise GpuosError(f"cannot open {path}: {exc.strerror}") from None
        try:
            if check_abi:
                version = self.abi_version()
                if version != ABI_VERSION:
                    raise KmodVersionMismatch(
                        f"gpuos.ko's ioctl ABI is version {version}, this gpuos speaks "
                        f"{ABI_VERSION}: install a matching gpuos")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Chardev:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def abi_version(self) -> int:
        """GPUOS_IOC_ABI_VERSION."""
        buf = ctypes.c_uint32(0)
        self._ioctl(IOC_ABI_VERSION, buf, "reading gpuos.ko's ABI version")
        return buf.value

    def submit(self, as_id: int, op: Op | int, ranges: Sequence[Range], *, flags: int = 0,
               size: int | None = None, nr_ranges: int | None = None) -> SubmitResult:
        """GPUOS_IOC_SUBMIT: the batch's id and each range's status (0 when accepted)."""
        batch, array = build_batch(as_id, op, ranges, flags=flags, size=size,
                                   nr_ranges=nr_ranges)
        what = f"submitting a batch of {len(ranges)} range(s)"
        try:
            self._ioctl(IOC_SUBMIT, batch, what, needs="CAP_SYS_ADMIN")
        except InvalidRequest as exc:
            # on a bad range the module sets each range's status (0 or -EINVAL) and copies
            # them back into our array
            exc.statuses = [array[i].status for i in range(len(ranges))]  # type: ignore[attr-defined]
            bad = [i for i, st in enumerate(exc.statuses) if st]
            if bad:
                exc.message = f"{what}: gpuos.ko rejected range{'s' if len(bad) > 1 else ''} " \
                              f"{', '.join(map(str, bad[:8]))}{' ...' if len(bad) > 8 else ''} " \
                              f"(page-aligned base and len > 0, dest, prio, flags)"
                exc.args = (exc.message,)
            raise
        return SubmitResult(batch_id=batch.batch_id,
                            statuses=[array[i].status for i in range(len(ranges))])

    def _ioctl(self, request: int, arg: ctypes.Structure | ctypes.c_uint32, what: str,
               needs: str = "CAP_SYS_ADMIN") -> None:
        if self.fd < 0:
            raise GpuosError(f"{what}: {self.path} is closed")
        try:
            fcntl.ioctl(self.fd, request, arg, True)
        except OSError as exc:
            raise kernel_error(exc.errno or errno.EIO, what, needs=needs) from None
