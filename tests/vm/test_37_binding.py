"""nvidia-uvm's binding to gpuos.ko (patches/nvidia-uvm/uvm_gpuos_bind.c) against the real
gpuos.ko: gpuos_bindtest.ko compiles the file unchanged and does what nvidia-uvm does with
it (attach at load, uvm_gpuos_attach, the fault path's three calls from hard interrupt
context, batches on an ordered queue, detach at unload).  Without gpuos.ko every call is
the default; attached, decisions and prefetch ranges reach it and gpuos.ko is held; detach
waits for accepted batches; calls race attach, detach and unload with a clean kernel log
(on the debug kernel: KASAN, lockdep, DEBUG_ATOMIC_SLEEP)."""

from __future__ import annotations

import errno
import time
from pathlib import Path

import pytest

from gpuos.kernel.model import Client, Range
from gpuos.kernel.uapi import DEST_GPU, EventType, FaultPolicy, Op
import vmlib

pytestmark = pytest.mark.vm

DBG = Path("/sys/kernel/debug/gpuos_bindtest")
ATTACH = Path("/sys/module/gpuos_bindtest/parameters/uvm_gpuos_attach")


def storm(count: int = 0, interval_us: int = 0, pid: int = 0, as_id: int = 0) -> dict[str, int]:
    """Start a storm (count > 0), or read where it is."""
    if count:
        (DBG / "storm").write_text(f"{count} {interval_us} {pid} {as_id}\n")
    words = (DBG / "storm").read_text().split()
    return {k: int(v) for k, v in zip(words[::2], words[1::2])}


def wait_storm(timeout: float = 60) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while (s := storm())["left"] > 0:
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    return s


def attached() -> bool:
    return ATTACH.read_text().strip() == "1"


def set_attach(on: bool) -> None:
    ATTACH.write_text("1\n" if on else "0\n")


@pytest.fixture
def bindtest(no_driver):
    """gpuos.ko with no driver; gpuos_bindtest loaded (and attached), unloaded after."""
    no_driver.insmod("gpuos_bindtest")
    yield no_driver
    if vmlib.module_loaded("gpuos_bindtest"):
        no_driver.rmmod("gpuos_bindtest")


def test_without_gpuos_every_call_is_the_default(kmod):
    kmod.unload_all()
    kmod.insmod("gpuos_bindtest")
    try:
        assert not attached()
        with pytest.raises(OSError) as exc:
            set_attach(True)
        assert exc.value.errno == errno.ENOENT
        s = (storm(300, 50, 1, 7), wait_storm())[1]
        assert (s["fired"], s["default"], s["isolate"], s["kill"], s["ranges"]) == (300, 300, 0, 0, 0)
    finally:
        kmod.rmmod("gpuos_bindtest")
        kmod.ensure_gpuos()


def test_attached_decisions_and_ranges_reach_it_and_gpuos_is_held(bindtest, nl, sleepers):
    assert attached()
    assert nl.get_info().driver_name == "gpuos-bindtest"
    assert bindtest.rmmod("gpuos", check=False).returncode != 0  # held while attached
    iso = sleepers()
    nl.set_policy(Client(pid=iso.pid), FaultPolicy.ISOLATE)
    nl.set_prefetch(0x42, [(0x100000, 0x10000)])
    s = (storm(400, 50, iso.pid, 0x42), wait_storm())[1]
    assert (s["fired"], s["isolate"], s["default"]) == (400, 400, 0)
    assert s["ranges"] > 0  # the lookups near the stored range found it
    (DBG / "gone").write_text("0x42\n")  # the address space went: its ranges with it
    s = (storm(50, 50, iso.pid, 0x42), wait_storm())[1]
    assert s["ranges"] == 0

    set_attach(False)
    assert not attached() and nl.get_info().driver_name is None
    s = (storm(100, 50, iso.pid, 0x42), wait_storm())[1]
    assert (s["fired"], s["default"], s["isolate"]) == (100, 100, 0)
    set_attach(True)
    assert attached() and nl.get_info().driver_name == "gpuos-bindtest"


def test_detach_finishes_the_batches_it_accepted(bindtest, nl):
    (DBG / "batch_delay_ms").write_text("400\n")
    with nl.subscribe() as sub:
        batch = nl.migrate(0x55, Op.MIGRATE, [Range(0x1000, 0x2000, DEST_GPU(0))])
        t0 = time.monotonic()
        set_attach(False)  # drains: returns after the batch is done
        assert time.monotonic() - t0 > 0.2
        done = None
        while done is None:
            ev = sub.next(timeout=10)
            assert ev is not None, "no MIGRATION_DONE"
            if ev.type == EventType.MIGRATION_DONE:
                done = ev
    assert (done.batch_id, done.statuses) == (batch, [0])  # its own result, not -ENODEV
    assert (DBG / "batches").read_text().split() == ["accepted", "1", "done", "1", "refused", "0"]


def test_calls_from_interrupt_context_race_attach_detach_and_unload(bindtest, nl, sleepers, kmsg):
    kmsg.new()
    victim = sleepers()
    nl.set_policy(Client(pid=victim.pid), FaultPolicy.ISOLATE)
    storm(20000, 20, victim.pid, 0x43)
    flips = 0
    deadline = time.monotonic() + 90
    while storm()["left"] > 0:
        assert time.monotonic() < deadline, storm()
        set_attach(False)
        set_attach(True)
        flips += 1
    s = storm()
    assert s["fired"] == 20000 and s["isolate"] + s["default"] == 20000 and flips > 0, (s, flips)
    assert s["isolate"] > 0 and s["default"] > 0  # both states were seen mid-storm

    storm(1000000, 50, victim.pid, 0x43)
    time.sleep(0.3)
    assert storm()["fired"] > 100
    bindtest.rmmod("gpuos_bindtest")  # mid-storm: its exit cancels the timer, then detaches
    assert nl.get_info().driver_name is None
    assert victim.alive()
    assert kmsg.bad(kmsg.new()) == []
