"""The driver path for managed memory (gpuos.managed): working sets from launch records,
the learned period, the window's changes, and what the feeder asks of gpuos.ko, against a
fake kernel client.  The same feeder against the real gpuos.ko and its test driver runs in
the VM (tests/vm/test_38_managed_ahead.py)."""

from __future__ import annotations

import pytest

from gpuos.errors import LimitReached, NotPermitted
from gpuos.kernel.model import Event, Fault, FaultBatch, KmodInfo, Range
from gpuos.kernel.uapi import DEST_GPU, MAX_NL_RANGES, MAX_PRIO, RANGE_EVICT_FIRST, DriverCaps, EventType, Op
from gpuos.managed import AheadFeeder, LaunchSequence, Planner, merge, working_set

MIB = 1 << 20


def buf(base, size, *flags, ptr=None, length=0):
    return {"base": base, "size": size, "ptr": base if ptr is None else ptr, "len": length, "param": 0,
            "offset": 0, "flags": list(flags)}


def launch(*bufs):
    return {"type": "launch", "bufs": list(bufs)}


A, B, C, D = (frozenset({(k << 30, 4 * MIB)}) for k in range(1, 5))


def test_a_working_set_is_the_managed_buffers_page_aligned():
    rec = launch(buf(1 << 30, 3 * MIB + 5, "managed"), buf(2 << 30, MIB),  # device memory: not ours
                 buf(3 << 30, MIB, "host"),
                 buf(4 << 30, 64 * MIB, "managed", "exact", ptr=(4 << 30) + 5000, length=100))
    assert working_set(rec) == {(1 << 30, 3 * MIB + 4096), ((4 << 30) + 4096, 4096)}
    assert working_set(launch(buf(2 << 30, MIB))) == frozenset()


def test_spans_merge_into_disjoint_ones():
    assert merge([(8192, 4096), (0, 4096), (4096, 4096), (20480, 4096), (20480, 8192)]) == \
        [(0, 12288), (20480, 8192)]


def test_the_period_is_learnt_followed_and_lost():
    seq = LaunchSequence()
    for ws in [D, A, B, C, A, B]:
        seq.add(ws)
        assert seq.period == 0
    seq.add(C)
    assert seq.period == 3 and seq.ahead(4) == [A, B, C, A]  # next: A (after C)
    seq.add(A)
    assert seq.period == 3 and seq.ahead(2) == [B, C]
    seq.add(D)  # broken
    assert seq.period == 0 and seq.ahead(5) == [D]  # no period: the last launch's set
    for ws in [A, B, C, A, B, C]:
        seq.add(ws)
    assert seq.period == 3 and seq.ahead(1) == [A]


def test_a_sequence_that_never_repeats_has_no_period():
    seq = LaunchSequence()
    for k in range(500):
        seq.add(frozenset({(k << 21, 4096)}))
    assert seq.period == 0 and seq.ahead(3) == [frozenset({(499 << 21, 4096)})]


def test_the_planner_asks_only_for_what_enters_and_leaves_the_window():
    seq, plan = LaunchSequence(), Planner(gpu=1, window=2)
    for ws in [A, B, C, D] * 2:
        seq.add(ws)
    assert seq.period == 4 and seq.ahead(2) == [A, B]
    st = plan.step(seq)  # priorities by the window's eighths: the second of two launches, 4
    assert st.migrate == [Range(1 << 30, 4 * MIB, DEST_GPU(1), 0), Range(2 << 30, 4 * MIB, DEST_GPU(1), 4)]
    assert st.evict_first == [] and st.prefetch == [(1 << 30, 4 * MIB), (2 << 30, 4 * MIB)]
    assert plan.step(seq) is None  # nothing changed
    seq.add(A)  # the window moves on: B, C
    st = plan.step(seq)
    assert st.migrate == [Range(3 << 30, 4 * MIB, DEST_GPU(1), 4)]
    assert st.evict_first == [Range(1 << 30, 4 * MIB, DEST_GPU(1), MAX_PRIO, RANGE_EVICT_FIRST)]
    assert st.prefetch == [(2 << 30, 4 * MIB), (3 << 30, 4 * MIB)]


class Kernel:
    def __init__(self, name="nvidia-uvm", caps=DriverCaps.MIGRATE | DriverCaps.HINT | DriverCaps.FAULT_REPORTS,
                 fail=None):
        self.name, self.caps, self.fail = name, caps, fail
        self.batches: list[tuple[int, int, list[Range]]] = []
        self.prefetch: list[tuple[int, list]] = []

    def get_info(self):
        if self.fail == "info":
            raise NotPermitted("getting gpuos.ko's info: not permitted")
        return KmodInfo(1, 1, "0.1", self.name, int(self.caps), 0, {})

    def migrate(self, as_id, op, ranges):
        if self.fail == "busy":
            self.fail = None
            raise LimitReached("submitting: 64 batches already await the GPU driver")
        if self.fail == "perm":
            raise NotPermitted("submitting a batch: not permitted (needs CAP_SYS_ADMIN)")
        self.batches.append((as_id, op, list(ranges)))
        return len(self.batches)

    def set_prefetch(self, as_id, ranges=()):
        self.prefetch.append((as_id, list(ranges)))


def fault_of(pid, as_id, batch=False):
    if batch:
        fb = FaultBatch(pid, None, as_id, 0, 1, 1, 1, 0, 0, 0, {}, 0, 0, [])
        return Event(1, 0, EventType.FAULT_BATCH, fault_batch=fb)
    return Event(1, 0, EventType.FAULT, fault=Fault(pid, None, as_id, 0, 0x1000, 1, 0, 0, 0))


def periodic(*sets, times=2):
    return [launch(*[buf(b, n, "managed") for b, n in ws]) for ws in list(sets) * times]


def test_the_feeder_waits_for_its_address_space_then_asks_for_the_window():
    k = Kernel()
    f = AheadFeeder(pid=42, gpu=0, kernel=k, window=2)
    f.records(periodic(A, B, C) + [launch(buf(9 << 30, MIB))])  # and a launch of device memory only
    assert f.stats.launches == 7 and f.stats.managed_launches == 6 and f.stats.period == 3
    assert f.step() is None and k.batches == []  # no address space yet
    f.event(fault_of(41, 0x66))  # another process's
    f.event(fault_of(42, 0x77, batch=True))
    f.event(fault_of(42, 0x88))  # the first one stays
    st = f.step()  # six launches since the last step: twice that, within one period of three
    assert f.as_id == 0x77 and [b[:2] for b in k.batches] == [(0x77, Op.MIGRATE)] and f.stats.window == 3
    assert k.batches[0][2] == st.migrate
    assert [(r.base, r.prio) for r in st.migrate] == [(1 << 30, 0), (2 << 30, 2), (3 << 30, 5)]
    assert k.prefetch == [(0x77, st.prefetch)]
    assert f.stats.steps == 1 and f.stats.bytes_migrated == 12 * MIB
    f.close()
    f.close()
    assert k.prefetch[1:] == [(0x77, [])]  # cleared once


@pytest.mark.parametrize("kernel,why", [(Kernel(name=None), "no GPU driver"),
                                        (Kernel(caps=DriverCaps.FAULT_REPORTS), "lacks migrate and hint"),
                                        (Kernel(fail="info"), "not permitted")])
def test_without_a_driver_that_can_it_asks_nothing_and_says_why(kernel, why):
    f = AheadFeeder(pid=42, gpu=0, kernel=kernel)
    f.records(periodic(A, B))
    f.event(fault_of(42, 0x77))
    assert why in f.why_not and f.step() is None and kernel.batches == [] and kernel.prefetch == []


def test_a_busy_module_drops_a_step_and_the_next_asks_again_in_full():
    k = Kernel(fail="busy")
    f = AheadFeeder(pid=42, gpu=0, kernel=k, window=2)
    f.event(fault_of(42, 0x77))
    f.records(periodic(A, B, C))
    assert f.step() is None and f.stats.dropped == 1
    st = f.step()
    assert len(st.migrate) == 3 and k.batches and f.stats.steps == 1


def test_an_error_is_said_once_and_many_ranges_go_in_batches_of_the_netlink_limit():
    k = Kernel(fail="perm")
    f = AheadFeeder(pid=42, gpu=0, kernel=k)
    f.event(fault_of(42, 0x77))
    f.records([launch(*[buf((k2 + 1) << 22, 4096, "managed") for k2 in range(10)])])
    assert f.step() is None and f.step() is None and f.stats.errors == [
        "submitting a batch: not permitted (needs CAP_SYS_ADMIN)"]
    k = Kernel()
    f = AheadFeeder(pid=42, gpu=0, kernel=k)
    f.event(fault_of(42, 0x77))
    f.records([launch(*[buf((i + 1) << 22, 4096, "managed") for i in range(MAX_NL_RANGES + 5)])])
    f.step()
    assert [len(b[2]) for b in k.batches] == [MAX_NL_RANGES, 5] and len(k.prefetch[0][1]) == MAX_NL_RANGES


def test_the_window_reaches_as_far_as_the_program_ran_between_steps():
    """Launches come faster than steps: the window covers twice the launches since the
    last step (at least the planner's), within one period; prefetch and migration follow."""
    k = Kernel()
    f = AheadFeeder(pid=42, gpu=0, kernel=k, window=2)
    f.event(fault_of(42, 0x77))
    sets = [frozenset({((i + 1) << 30, 4 * MIB)}) for i in range(20)]
    f.records(periodic(*sets, times=2))  # period 20, 40 launches
    f.step()
    assert f.stats.window == 20 and len(k.batches[0][2]) == 20  # the whole period
    f.records(periodic(*sets[:3], times=1))  # three more launches: a window of six, 3 to 8
    st = f.step()
    assert f.stats.window == 6 and st.migrate == [] and len(st.evict_first) == 14
    assert [b for b, _ in st.prefetch] == [(i + 1) << 30 for i in range(3, 9)]
    assert [op for _, op, _ in k.batches] == [Op.MIGRATE, Op.HINT]  # no empty batch
