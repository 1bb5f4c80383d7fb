"""The driver path for managed memory (gpuos.managed.AheadFeeder) against the real gpuos.ko
and its test driver: the feeder learns a process's address space from a fault batch that
names its pid, then asks for the window of a repeating launch sequence as batches the
driver receives (MIGRATE to the GPU, the soonest most urgent; HINT evict-first for what
leaves the window) and as prefetch ranges the driver's fault path finds.  No CUDA in the
guest: the launch records are what intercept.ring.decode makes of libgpuos's."""

from __future__ import annotations

import pytest

import vmlib
from vmlib import inject_batch

pytestmark = pytest.mark.vm

MIB = 1 << 20
BASES = [0x7F0000000000 + k * (64 * MIB) for k in range(4)]  # four managed allocations of 4 MiB


def launch(*bases):
    return {"type": "launch", "bufs": [{"base": b, "size": 4 * MIB, "ptr": b, "len": 0, "param": 0, "offset": 0,
                                        "flags": ["managed"]} for b in bases]}


def lookup(as_id: int, addr: int) -> list[tuple[int, int]]:
    assert vmlib.dbg_write("prefetch_lookup", f"{as_id:#x} {addr:#x}\n") == 0
    return [tuple(int(x, 16) for x in line.split()) for line in vmlib.dbg_read("prefetch_lookup").splitlines()]


def test_a_repeating_launch_sequence_reaches_the_driver_ahead(testdrv, nl, sleepers):
    from gpuos.kernel.uapi import EventType, Op
    from gpuos.managed import AheadFeeder

    p = sleepers()
    objects = nl.get_info().counters["objects"]
    feeder = AheadFeeder(pid=p.pid, gpu=0, kernel=nl, window=2)
    try:
        assert feeder.why_not is None
        # launches: [0, 1], [2], [3], [0, 1], [2], [3]: period 3
        feeder.records([launch(BASES[0], BASES[1]), launch(BASES[2]), launch(BASES[3])] * 2)
        assert feeder.stats.period == 3
        assert feeder.step() is None and vmlib.pending() == []  # its address space is not known yet
        with nl.subscribe() as sub:
            assert inject_batch(p.pid + 100000, as_id=0x51) == 0  # not this process's
            assert inject_batch(p.pid, as_id=0x52) == 0
            for _ in range(2):
                ev = sub.next(timeout=10)
                assert ev is not None and ev.type == EventType.FAULT_BATCH
                feeder.event(ev)
        assert feeder.as_id == 0x52
        st = feeder.step()  # six launches since the last step: the window is the whole period
        assert [(r.base, r.prio) for r in st.migrate] == [(BASES[0], 0), (BASES[1], 0), (BASES[2], 2),
                                                          (BASES[3], 5)]
        assert [(as_id, op, n) for _, as_id, op, n in vmlib.pending()] == [(0x52, int(Op.MIGRATE), 4)]
        # what the fault path finds: the window's ranges, clipped to the 2 MiB block of the fault
        assert lookup(0x52, BASES[2] + 4096) == [(BASES[2], 2 * MIB)]
        assert lookup(0x52, BASES[2] + 3 * MIB) == [(BASES[2] + 2 * MIB, 2 * MIB)]
        assert lookup(0x52, BASES[0] + 8 * MIB) == []  # outside every range
        assert feeder.step() is None  # nothing changed
        feeder.records([launch(BASES[0], BASES[1])])  # one launch: a window of two, [2] and [3]
        st = feeder.step()
        assert st.migrate == [] and [r.base for r in st.evict_first] == BASES[:2]
        assert [(op, n) for _, as_id, op, n in vmlib.pending()] == [(int(Op.MIGRATE), 4), (int(Op.HINT), 2)]
        assert lookup(0x52, BASES[3]) == [(BASES[3], 2 * MIB)] and lookup(0x52, BASES[0]) == []
        assert feeder.stats.steps == 2 and feeder.stats.batches == 2 and feeder.stats.errors == []
        assert nl.get_info().counters["objects"] == objects + 2 + 1  # the batches pending, its prefetch ranges
        for batch_id, *_ in vmlib.pending():  # the driver completes them
            assert vmlib.dbg_write("complete", f"{batch_id} 0\n") == 0
        feeder.close()  # the process ended: its prefetch ranges leave gpuos.ko
        assert lookup(0x52, BASES[3]) == [] and nl.get_info().counters["objects"] == objects
    finally:  # nothing left behind for the next tests, passed or not
        for batch_id, *_ in vmlib.pending():
            vmlib.dbg_write("complete", f"{batch_id} 0\n")
        nl.set_prefetch(0x52, [])


def test_without_a_driver_the_feeder_asks_nothing(no_driver, nl, sleepers):
    from gpuos.managed import AheadFeeder

    feeder = AheadFeeder(pid=sleepers().pid, gpu=0, kernel=nl)
    assert "no GPU driver is registered" in feeder.why_not
    feeder.records([launch(BASES[0])] * 4)
    feeder.as_id = 0x52  # even so
    before = nl.get_info().counters["batches"]
    assert feeder.step() is None and nl.get_info().counters["batches"] == before
