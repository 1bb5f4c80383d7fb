"""CudaDriver's handling of the CUDA driver's answers, against a stand-in for
cuda.bindings.driver and pynvml (the real driver is exercised by tests/gpu)."""

from __future__ import annotations

import ctypes
import enum
import sys
import types

import pytest

from gpuos.cudadrv import CHECKPOINTED, CudaDriver, uuid_bytes
from gpuos.errors import DriverUnsupported, GpuosError, LockTimeout, NoGpu, NotPermitted


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_NOT_PERMITTED = 800
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_TIMEOUT = 909


class CUprocessState(enum.IntEnum):
    CU_PROCESS_STATE_RUNNING = 0
    CU_PROCESS_STATE_LOCKED = 1
    CU_PROCESS_STATE_CHECKPOINTED = 2
    CU_PROCESS_STATE_FAILED = 3


class CUuuid:
    """Like cuda-python's: read-only .bytes over 16 bytes of C memory."""

    def __init__(self):
        self._buf = ctypes.create_string_buffer(16)

    def getPtr(self):  # noqa: N802 - cuda-python's name
        return ctypes.addressof(self._buf)

    @property
    def bytes(self):
        return self._buf.raw


class Args:
    pass


class GpuPair:
    def __init__(self):
        self.oldUuid, self.newUuid = CUuuid(), CUuuid()


def fake_cuda(monkeypatch, version=13000, answers=None, has_checkpoint_api=True, init=None):
    """Install stand-ins; answers maps a function name to the CUresult it returns."""
    answers = answers or {}
    calls = []
    cu = types.ModuleType("cuda.bindings.driver")
    cu.CUresult, cu.CUprocessState = CUresult, CUprocessState
    cu.CUcheckpointLockArgs = cu.CUcheckpointCheckpointArgs = Args
    cu.CUcheckpointRestoreArgs = cu.CUcheckpointUnlockArgs = Args
    cu.CUcheckpointGpuPair = GpuPair

    def fn(name, result=None):
        def call(*args):
            calls.append((name, args))
            if name == "cuInit" and init is not None:
                return init()
            return (answers.get(name, CUresult.CUDA_SUCCESS), *([result] if result is not None else []))
        return call

    cu.cuInit = fn("cuInit")
    cu.cuDriverGetVersion = fn("cuDriverGetVersion", version)
    cu.cuCheckpointProcessGetState = fn("cuCheckpointProcessGetState",
                                        CUprocessState.CU_PROCESS_STATE_CHECKPOINTED)
    if has_checkpoint_api:
        for name in ("Lock", "Checkpoint", "Restore", "Unlock"):
            setattr(cu, f"cuCheckpointProcess{name}", fn(f"cuCheckpointProcess{name}"))
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = cu
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = type("NVMLError", (Exception,), {})
    nvml.nvmlInit = lambda: None
    nvml.nvmlSystemGetDriverVersion = lambda: "580.159.04"
    for name, mod in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.driver", cu),
                      ("pynvml", nvml)):
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


def test_driver_without_the_checkpoint_api_is_refused(monkeypatch):
    fake_cuda(monkeypatch, version=12040)
    with pytest.raises(DriverUnsupported) as exc:
        CudaDriver()
    assert "12.8" in exc.value.message and "12.4" in exc.value.message and exc.value.exit_code == 6


def test_bindings_without_the_checkpoint_api_are_refused(monkeypatch):
    fake_cuda(monkeypatch, has_checkpoint_api=False)
    with pytest.raises(DriverUnsupported):
        CudaDriver()


def test_no_libcuda_or_no_device_is_no_gpu(monkeypatch):
    def missing():
        raise RuntimeError("libcuda.so.1 not found")
    fake_cuda(monkeypatch, init=missing)
    with pytest.raises(NoGpu):
        CudaDriver()
    fake_cuda(monkeypatch, answers={"cuInit": CUresult.CUDA_ERROR_NO_DEVICE})
    with pytest.raises(NoGpu) as exc:
        CudaDriver()
    assert exc.value.exit_code == 16


def test_without_waiting_for_cuinit_only_the_calls_that_need_it_say_no_gpu(monkeypatch):
    """A restore's driver: its checks (NVML) go on while cuInit runs; a call that needs
    the driver initialised raises what cuInit raised."""
    fake_cuda(monkeypatch, answers={"cuInit": CUresult.CUDA_ERROR_NO_DEVICE})
    d = CudaDriver(wait_for_init=False)
    assert d.driver_info().version == "580.159.04"
    with pytest.raises(NoGpu) as exc:
        d.restore_thread(123)
    assert exc.value.exit_code == 16


def test_without_cuda_python_the_driver_is_unsupported(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # import fails
    with pytest.raises(DriverUnsupported):
        CudaDriver()


@pytest.mark.parametrize("result, error", [
    (CUresult.CUDA_ERROR_TIMEOUT, LockTimeout),
    (CUresult.CUDA_ERROR_NOT_READY, LockTimeout),  # what r580 answers on a busy GPU
    (CUresult.CUDA_ERROR_NOT_SUPPORTED, DriverUnsupported),  # e.g. an MPS client
    (CUresult.CUDA_ERROR_NOT_PERMITTED, NotPermitted),
    (CUresult.CUDA_ERROR_NOT_INITIALIZED, GpuosError),
])
def test_lock_errors_map_to_their_exit_codes(monkeypatch, result, error):
    calls = fake_cuda(monkeypatch, answers={"cuCheckpointProcessLock": result})
    drv = CudaDriver()
    with pytest.raises(error) as exc:
        drv.lock(4242, 1500)
    assert type(exc.value) is error and "4242" in exc.value.message
    name, (pid, args) = calls[-1]
    assert name == "cuCheckpointProcessLock" and pid == 4242 and args.timeoutMs == 1500


def test_not_ready_is_a_timeout_only_for_the_lock(monkeypatch):
    fake_cuda(monkeypatch, answers={"cuCheckpointProcessCheckpoint": CUresult.CUDA_ERROR_NOT_READY})
    with pytest.raises(GpuosError) as exc:
        CudaDriver().checkpoint(7)
    assert type(exc.value) is GpuosError and "CUDA_ERROR_NOT_READY" in exc.value.message


def test_state_names(monkeypatch):
    fake_cuda(monkeypatch)
    assert CudaDriver().state(1) == CHECKPOINTED


def test_restore_onto_other_gpus_passes_raw_uuid_pairs(monkeypatch):
    calls = fake_cuda(monkeypatch)
    old, new = "GPU-00112233-4455-6677-8899-aabbccddeeff", "GPU-ffeeddcc-bbaa-9988-7766-554433221100"
    CudaDriver().restore(9, {old: new})
    name, (pid, args) = calls[-1]
    assert name == "cuCheckpointProcessRestore" and pid == 9 and args.gpuPairsCount == 1
    pair = args.gpuPairs[0]
    assert pair.oldUuid.bytes == bytes.fromhex("00112233445566778899aabbccddeeff")
    assert pair.newUuid.bytes == bytes.fromhex("ffeeddccbbaa99887766554433221100")
    CudaDriver().restore(9, {})
    assert not hasattr(calls[-1][1][1], "gpuPairs")


@pytest.mark.parametrize("bad", ["GPU-1234", "GPU-zz112233-4455-6677-8899-aabbccddeeff", ""])
def test_uuid_bytes_rejects_malformed(bad):
    with pytest.raises(ValueError):
        uuid_bytes(bad)
