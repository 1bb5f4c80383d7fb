"""The FakeDriver keeps to the driver's state machine, so the logic tests can trust it."""

from __future__ import annotations

import pytest

from gpuos.cudadrv import CHECKPOINTED, LOCKED, RUNNING, GpuDriver
from gpuos.errors import GpuosError, LockTimeout

from fakes import FakeDriver, device, gpu_uuid


def test_full_cycle():
    d = FakeDriver()
    d.add(10, used=5)
    assert [p.pid for p in d.processes()] == [10]
    d.lock(10, 1000)
    assert d.state(10) == LOCKED
    d.checkpoint(10)
    assert d.state(10) == CHECKPOINTED
    assert d.processes() == []  # no GPU memory while checkpointed
    d.restore(10, {"GPU-a": "GPU-b"})
    assert d.state(10) == LOCKED and d.restore_pairs[10] == {"GPU-a": "GPU-b"}
    d.unlock(10)
    assert d.state(10) == RUNNING
    assert d.calls_for(10) == ["lock", "state", "checkpoint", "state", "restore", "state", "unlock",
                               "state"]


@pytest.mark.parametrize("state,method", [
    (RUNNING, "checkpoint"), (RUNNING, "restore"), (RUNNING, "unlock"),
    (LOCKED, "lock"), (LOCKED, "restore"),
    (CHECKPOINTED, "lock"), (CHECKPOINTED, "checkpoint"), (CHECKPOINTED, "unlock"),
])
def test_wrong_transitions_fail(state, method):
    d = FakeDriver()
    d.add(10, state=state)
    args = {"lock": (10, 100), "restore": (10, {})}.get(method, (10,))
    with pytest.raises(GpuosError, match="ILLEGAL_STATE"):
        getattr(d, method)(*args)
    assert d.states[10] == state


def test_unknown_pid_fails():
    with pytest.raises(GpuosError, match="NOT_FOUND"):
        FakeDriver().state(99)


def test_injected_failure_happens_once_and_keeps_state():
    d = FakeDriver()
    d.add(10)
    d.fail("lock", 10, LockTimeout("timed out"))
    with pytest.raises(LockTimeout):
        d.lock(10, 100)
    assert d.states[10] == RUNNING
    d.lock(10, 100)
    assert d.states[10] == LOCKED


def test_satisfies_the_protocol():
    d: GpuDriver = FakeDriver(devices=[device(0), device(1)])
    for name in ("driver_info", "devices", "processes", "state", "lock", "checkpoint", "restore",
                 "unlock"):
        assert callable(getattr(d, name))
    assert [x.index for x in d.devices()] == [0, 1]


def test_restore_needs_the_gpu_or_a_mapping():
    d = FakeDriver(devices=[device(3)])
    d.add(10, uuid=gpu_uuid(7), state=CHECKPOINTED)
    with pytest.raises(GpuosError, match="INVALID_DEVICE"):
        d.restore(10, {})
    assert d.states[10] == CHECKPOINTED
    d.restore(10, {gpu_uuid(7): gpu_uuid(3)})
    assert d.states[10] == LOCKED and [p.uuid for p in d.processes()] == [gpu_uuid(3)]
