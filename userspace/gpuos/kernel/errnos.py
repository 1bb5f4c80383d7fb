"""errnos from gpuos.ko (netlink errors and ioctl failures) as GpuosErrors with one-line messages."""

from __future__ import annotations

import errno
import os

from ..errors import (GpuosError, InvalidRequest, KmodVersionMismatch, LimitReached,
                      NoDriverRegistered, NoSuchPolicy, NoSuchProcess, NotPermitted, NotSupported)
from .uapi import MAX_PENDING, MAX_POLICIES, MAX_RANGES


def kernel_error(code: int, what: str, *, needs: str = "CAP_SYS_ADMIN",
                 detail: str | None = None, max_ranges: int = MAX_RANGES) -> GpuosError:
    """The error for errno ``code`` from gpuos.ko while doing ``what`` (e.g. "setting a policy").

    ``needs`` names the privilege an EPERM lacked; ``detail`` is the kernel's extended
    ack message, if it sent one; ``max_ranges`` the batch limit of the path taken
    (GPUOS_MAX_RANGES for the ioctl, GPUOS_MAX_NL_RANGES for netlink).
    """
    code = abs(code)
    tail = f" ({detail})" if detail else ""
    if code in (errno.EPERM, errno.EACCES):
        said = "" if detail == f"needs {needs}" else tail  # gpuos.ko's own extended ack says as much
        return NotPermitted(f"{what}: not permitted (needs {needs}){said}")
    if code == errno.ENOENT:
        return NoSuchPolicy(f"{what}: no such policy{tail}")
    if code == errno.ESRCH:  # a pid policy is bound to a live process
        return NoSuchProcess(f"{what}: no such process{tail}")
    if code == errno.ENOSPC:
        return LimitReached(f"{what}: gpuos.ko's limit is reached (at most {MAX_POLICIES} "
                            f"policies){tail}")
    if code == errno.ENODEV:
        return NoDriverRegistered(f"{what}: no GPU driver registered with gpuos{tail}")
    if code in (errno.EOPNOTSUPP, errno.ENOTSUP):
        return NotSupported(f"{what}: the registered GPU driver does not support this "
                            f"operation{tail}")
    if code == errno.EINVAL:
        return InvalidRequest(f"{what}: gpuos.ko rejected the request as invalid{tail}")
    if code == errno.ERANGE:  # netlink's policy check refuses out-of-range values so
        return InvalidRequest(f"{what}: a value is out of range{tail}")
    if code == errno.E2BIG:
        return InvalidRequest(f"{what}: too many ranges (at most {max_ranges} a batch){tail}")
    if code == errno.EAGAIN:
        return LimitReached(f"{what}: {MAX_PENDING} batches already await the GPU driver; "
                            f"try again when some are done{tail}")
    if code == errno.ENOTTY:
        return KmodVersionMismatch(f"{what}: gpuos.ko does not know this ioctl (another "
                                   f"version of the module?){tail}")
    if code == errno.EFAULT:
        return InvalidRequest(f"{what}: gpuos.ko could not read the ranges (bad address){tail}")
    return GpuosError(f"{what}: {os.strerror(code)}{tail}")
