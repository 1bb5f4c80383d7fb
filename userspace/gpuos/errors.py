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
)
