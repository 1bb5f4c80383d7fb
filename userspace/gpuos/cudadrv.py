"""The GPU side: the CUDA driver's process checkpoint API and NVML.

``GpuDriver`` is the interface the checkpoint and restore logic uses;
``CudaDriver`` implements it with cuda-python (``cuda.bindings.driver``) and
NVML (``pynvml`` from nvidia-ml-py).  Unit tests substitute a fake.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Protocol

from .errors import DriverUnsupported, GpuosError, LockTimeout, NoGpu, NotPermitted
from .manifest import DriverInfo

# cuCheckpointProcess* appeared in the CUDA 12.8 driver API (r570 drivers).
MIN_CUDA_API = 12080

RUNNING, LOCKED, CHECKPOINTED, FAILED = "running", "locked", "checkpointed", "failed"
# The driver's answer for a process that loaded libcuda but never initialized CUDA (torch.compile's
# workers, a DataLoader's): a CPU process, for CRIU alone.
UNINITIALIZED = "uninitialized"


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str  # NVML form, "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
    name: str
    memory_total: int
    memory_free: int


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    uuid: str
    used_memory: int  # bytes; 0 where NVML does not say


class GpuDriver(Protocol):
    def driver_info(self) -> DriverInfo: ...
    def devices(self) -> list[GpuDevice]: ...
    def processes(self) -> list[GpuProcess]: ...
    def state(self, pid: int) -> str: ...
    def restore_thread(self, pid: int) -> int: ...
    def lock(self, pid: int, timeout_ms: int) -> None: ...
    def checkpoint(self, pid: int) -> None: ...
    def restore(self, pid: int, gpu_pairs: dict[str, str]) -> None: ...
    def unlock(self, pid: int) -> None: ...


def uuid_bytes(nvml_uuid: str) -> bytes:
    """'GPU-0a1b...' (NVML) to the 16 raw bytes of a CUuuid."""
    hexpart = nvml_uuid.removeprefix("GPU-").removeprefix("MIG-").replace("-", "")
    raw = bytes.fromhex(hexpart)
    if len(raw) != 16:
        raise ValueError(f"not a GPU UUID: {nvml_uuid!r}")
    return raw


NEEDS_NO_INIT = ("cuInit", "cuDriverGetVersion")


class CudaDriver:
    """GpuDriver on the real CUDA driver. cuInit(0) (0.19-0.22 s on an H100 host) runs in a
    thread of its own from the start. wait_for_init: the constructor waits for it (and
    raises what it raised); else only the calls that need it wait, and raise that: a
    restore's checks (NVML) and CRIU go on meanwhile."""

    def __init__(self, wait_for_init: bool = True) -> None:
        try:
            from cuda.bindings import driver as cu  # type: ignore[import-not-found]
            import pynvml  # type: ignore[import-not-found]
        except ImportError as exc:
            raise DriverUnsupported(
                f"cuda-python and nvidia-ml-py are needed for GPU processes ({exc})") from None
        self.cu = cu
        self.nvml = pynvml
        try:
            api = self._call("cuDriverGetVersion")  # loads libcuda; needs no cuInit
        except RuntimeError as exc:  # libcuda.so.1 missing
            raise NoGpu(f"no NVIDIA driver on this host ({exc})") from None
        self._initialized = threading.Event()
        self._init_error: GpuosError | None = None
        threading.Thread(target=self._init, name="gpuos-cuinit", daemon=True).start()
        if wait_for_init:
            self._initialized.wait()
            if self._init_error is not None:
                raise self._init_error
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NoGpu(f"NVML unavailable: {exc}") from None
        if api < MIN_CUDA_API or not hasattr(cu, "cuCheckpointProcessLock"):
            raise DriverUnsupported(
                f"the driver's checkpoint API needs CUDA {MIN_CUDA_API // 1000}.{MIN_CUDA_API % 1000 // 10}"
                f" (driver r570 or newer); this driver offers CUDA API {api // 1000}.{api % 1000 // 10}")
        self._api = api

    # -- plumbing ----------------------------------------------------------
    def _init(self) -> None:
        try:
            self._call("cuInit", 0)
        except RuntimeError as exc:
            self._init_error = NoGpu(f"no NVIDIA driver on this host ({exc})")
        except GpuosError as exc:
            self._init_error = exc
        finally:
            self._initialized.set()

    def _call(self, fn: str, *args, pid: int | None = None):
        if fn not in NEEDS_NO_INIT:
            self._initialized.wait()
            if self._init_error is not None:
                raise self._init_error
        cu = self.cu
        result = getattr(cu, fn)(*args)
        err, rest = result[0], result[1:]
        if err == cu.CUresult.CUDA_SUCCESS:
            return rest[0] if len(rest) == 1 else (rest or None)
        name = getattr(err, "name", str(err))
        who = f" (pid {pid})" if pid is not None else ""
        if err == cu.CUresult.CUDA_ERROR_NO_DEVICE:
            raise NoGpu("no CUDA-capable GPU on this host")
        # Seen on r580: a lock that times out on a busy GPU returns NOT_READY, not TIMEOUT.
        if err == cu.CUresult.CUDA_ERROR_TIMEOUT or (
                fn == "cuCheckpointProcessLock" and err == cu.CUresult.CUDA_ERROR_NOT_READY):
            raise LockTimeout(f"{fn}{who}: timed out waiting for the process's GPU work")
        if err == cu.CUresult.CUDA_ERROR_NOT_PERMITTED:
            raise NotPermitted(f"{fn}{who}: not permitted by the driver")
        if err == cu.CUresult.CUDA_ERROR_NOT_SUPPORTED:
            raise DriverUnsupported(
                f"{fn}{who}: not supported by the driver for this process "
                "(MPS clients, MIG, managed memory, CUDA IPC are not checkpointable)")
        if err == cu.CUresult.CUDA_ERROR_NOT_FOUND and fn.startswith("cuCheckpoint"):
            raise DriverUnsupported(f"{fn}: this driver has no process checkpoint API")
        raise GpuosError(f"{fn}{who} failed: {name}")

    # -- GpuDriver ----------------------------------------------------------
    def driver_info(self) -> DriverInfo:
        version = self.nvml.nvmlSystemGetDriverVersion()
        if isinstance(version, bytes):
            version = version.decode()
        return DriverInfo(version=version, cuda_api=self._api)

    def devices(self) -> list[GpuDevice]:
        nv = self.nvml
        out = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            uuid, name = nv.nvmlDeviceGetUUID(h), nv.nvmlDeviceGetName(h)
            out.append(GpuDevice(
                index=i,
                uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                name=name.decode() if isinstance(name, bytes) else name,
                memory_total=int(mem.total), memory_free=int(mem.free)))
        return out

    def processes(self) -> list[GpuProcess]:
        nv = self.nvml
        out = []
        for dev in self.devices():
            h = nv.nvmlDeviceGetHandleByIndex(dev.index)
            for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                used = p.usedGpuMemory if isinstance(p.usedGpuMemory, int) else 0
                out.append(GpuProcess(pid=int(p.pid), uuid=dev.uuid, used_memory=used))
        return out

    def state(self, pid: int) -> str:
        err, st = self.cu.cuCheckpointProcessGetState(pid)
        if err == self.cu.CUresult.CUDA_ERROR_NOT_INITIALIZED:
            return UNINITIALIZED
        if err != self.cu.CUresult.CUDA_SUCCESS:
            self._call("cuCheckpointProcessGetState", pid, pid=pid)  # raises the specific error
        ps = self.cu.CUprocessState
        known = {
            ps.CU_PROCESS_STATE_RUNNING: RUNNING,
            ps.CU_PROCESS_STATE_LOCKED: LOCKED,
            ps.CU_PROCESS_STATE_CHECKPOINTED: CHECKPOINTED,
            ps.CU_PROCESS_STATE_FAILED: FAILED,
        }
        if st not in known:
            raise GpuosError(f"the driver reports checkpoint state {int(st)} for pid {pid}, "
                             "which gpuos does not know (a newer driver?); nothing was changed")
        return known[st]

    def restore_thread(self, pid: int) -> int:
        return int(self._call("cuCheckpointProcessGetRestoreThreadId", pid, pid=pid))

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = self.cu.CUcheckpointLockArgs()
        args.timeoutMs = timeout_ms
        self._call("cuCheckpointProcessLock", pid, args, pid=pid)

    def checkpoint(self, pid: int) -> None:
        self._call("cuCheckpointProcessCheckpoint", pid, self.cu.CUcheckpointCheckpointArgs(), pid=pid)

    def restore(self, pid: int, gpu_pairs: dict[str, str]) -> None:
        cu = self.cu
        args = cu.CUcheckpointRestoreArgs()
        if gpu_pairs:
            pairs = []
            for old, new in gpu_pairs.items():
                pair = cu.CUcheckpointGpuPair()
                # cuda-python's CUuuid.bytes is read-only: write the raw struct.
                for field_, uuid in ((pair.oldUuid, old), (pair.newUuid, new)):
                    ctypes.memmove(field_.getPtr(), uuid_bytes(uuid), 16)
                    if bytes(field_.bytes) != uuid_bytes(uuid):
                        raise GpuosError(f"could not set GPU UUID {uuid} in the restore arguments")
                pairs.append(pair)
            args.gpuPairs = pairs
            args.gpuPairsCount = len(pairs)
        self._call("cuCheckpointProcessRestore", pid, args, pid=pid)

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid, self.cu.CUcheckpointUnlockArgs(), pid=pid)
