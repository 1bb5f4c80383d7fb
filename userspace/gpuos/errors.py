"""Errors gpuos reports, each with a distinct, documented exit code.

The CLI prints ``gpuos: <message>`` on one line and exits with the error's
code; ``--json`` output carries the same code and message.  The table is
documented in docs/cli.md: keep the two in step (a unit test checks it).
"""

from __future__ import annotations


class GpuosError(Exception):
    """Base class: an expected failure with a one-line message."""

    exit_code = 1
    kind = "error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class NoSuchProcess(GpuosError):
    exit_code = 3
    kind = "no-such-process"


class NotPermitted(GpuosError):
    exit_code = 4
    kind = "not-permitted"


class CriuUnavailable(GpuosError):
    """criu is missing, too old, or does not work on this kernel."""

    exit_code = 5
    kind = "criu-unavailable"


class DriverUnsupported(GpuosError):
    """No usable CUDA driver checkpoint API (driver too old, no cuda-python)."""

    exit_code = 6
    kind = "driver-unsupported"


class LockTimeout(GpuosError):
    exit_code = 7
    kind = "lock-timeout"


class CheckpointFailed(GpuosError):
    """The checkpoint failed; the process was put back and left running."""

    exit_code = 8
    kind = "checkpoint-failed"


class ImageNotFound(GpuosError):
    exit_code = 9
    kind = "image-not-found"


class ImageCorrupt(GpuosError):
    """An image is incomplete or a file's size or checksum does not match."""

    exit_code = 10
    kind = "image-corrupt"


class ImageFormatUnsupported(GpuosError):
    exit_code = 11
    kind = "image-format-unsupported"


class GpuMismatch(GpuosError):
    """No GPU of the image's model (or a different driver) on this host."""

    exit_code = 12
    kind = "gpu-mismatch"


class InsufficientGpuMemory(GpuosError):
    exit_code = 13
    kind = "insufficient-gpu-memory"


class PidTaken(GpuosError):
    exit_code = 14
    kind = "pid-taken"


class RestoreFailed(GpuosError):
    """The restore failed; whatever was restored was removed again."""

    exit_code = 15
    kind = "restore-failed"


class NoGpu(GpuosError):
    exit_code = 16
    kind = "no-gpu"


class DemoMismatch(GpuosError):
    """The restored run's results differ from the uninterrupted run."""

    exit_code = 17
    kind = "demo-mismatch"


class Busy(GpuosError):
    """Another gpuos operation holds the same process or image."""

    exit_code = 18
    kind = "busy"


class ProcessLeftStopped(GpuosError):
    """Putting a process back failed: it is left locked or checkpointed on the GPU.

    The operation's journal is kept, so ``gpuos recover`` (or the next
    gpuos command) retries.
    """

    exit_code = 19
    kind = "process-left-stopped"


# -- gpuos.ko (userspace/gpuos/kernel) -------------------------------------------


class KmodNotLoaded(GpuosError):
    """gpuos.ko is not loaded: no netlink family "gpuos", no /dev/gpuos, no tracepoints."""

    exit_code = 20
    kind = "kmod-not-loaded"


class KmodVersionMismatch(GpuosError):
    """gpuos.ko speaks another version of its protocol (netlink family or ioctl ABI)."""

    exit_code = 21
    kind = "kmod-version-mismatch"


class NoDriverRegistered(GpuosError):
    """No GPU driver is registered with gpuos.ko (ENODEV)."""

    exit_code = 22
    kind = "no-driver-registered"


class NotSupported(GpuosError):
    """The registered GPU driver lacks the operation (EOPNOTSUPP)."""

    exit_code = 23
    kind = "not-supported"


class InvalidRequest(GpuosError):
    """gpuos.ko refused a malformed request (EINVAL, E2BIG, EFAULT)."""

    exit_code = 24
    kind = "invalid-request"


class NoSuchPolicy(GpuosError):
    """The client has no fault policy of its own (ENOENT)."""

    exit_code = 25
    kind = "no-such-policy"


class LimitReached(GpuosError):
    """A limit of gpuos.ko was reached: GPUOS_MAX_POLICIES (ENOSPC), GPUOS_MAX_PENDING (EAGAIN)."""

    exit_code = 26
    kind = "limit-reached"


class BccUnavailable(GpuosError):
    """bcc (python3-bpfcc) is not installed, so nothing can be traced."""

    exit_code = 27
    kind = "bcc-unavailable"


class Timeout(GpuosError):
    """Waiting ended before what was asked for arrived (e.g. `events --count N --timeout S`)."""

    exit_code = 28
    kind = "timeout"


# -- libgpuos (userspace/gpuos/intercept) ----------------------------------------


class NotTracked(GpuosError):
    """The process has no libgpuos ring (not started by `gpuos run`, or no CUDA call yet)."""

    exit_code = 29
    kind = "not-tracked"


class LibgpuosMissing(GpuosError):
    """libgpuos.so is not built or not where gpuos looks for it."""

    exit_code = 30
    kind = "libgpuos-missing"


# -- supervised MPS (userspace/gpuos/mps) ------------------------------------------


class MpsUnavailable(GpuosError):
    """nvidia-cuda-mps-control (or nvidia-cuda-mps-server) is not installed or not found."""

    exit_code = 35
    kind = "mps-unavailable"


class MpsForeign(GpuosError):
    """An MPS control daemon that gpuos did not start serves this GPU (or may)."""

    exit_code = 36
    kind = "mps-foreign"


class MpsNotRunning(GpuosError):
    """No gpuos MPS supervisor runs for that GPU."""

    exit_code = 37
    kind = "mps-not-running"


class MpsNotReady(GpuosError):
    """The GPU or its MPS server refuses new clients (compute mode, a fault, a reset needed)."""

    exit_code = 38
    kind = "mps-not-ready"


class MpsFailed(GpuosError):
    """The MPS supervisor failed: the daemon did not start, or no server came back after a fault.

    Its state is kept; ``gpuos mps recover`` tries again.
    """

    exit_code = 39
    kind = "mps-failed"


class NoSuchGroup(GpuosError):
    """`gpuos mem stats NAME`: no group of that name with members (`gpuos run --share`)."""

    exit_code = 40
    kind = "no-such-group"


ALL_ERRORS: tuple[type[GpuosError], ...] = (
    GpuosError,
    NoSuchProcess,
    NotPermitted,
    CriuUnavailable,
    DriverUnsupported,
    LockTimeout,
    CheckpointFailed,
    ImageNotFound,
    ImageCorrupt,
    ImageFormatUnsupported,
    GpuMismatch,
    InsufficientGpuMemory,
    PidTaken,
    RestoreFailed,
    NoGpu,
    DemoMismatch,
    Busy,
    ProcessLeftStopped,
    KmodNotLoaded,
    KmodVersionMismatch,
    NoDriverRegistered,
    NotSupported,
    InvalidRequest,
    NoSuchPolicy,
    LimitReached,
    BccUnavailable,
    Timeout,
    NotTracked,
    LibgpuosMissing,
    MpsUnavailable,
    MpsForeign,
    MpsNotRunning,
    MpsNotReady,
    MpsFailed,
    NoSuchGroup,
)
