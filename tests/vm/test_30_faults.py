"""The whole fault path: policies set with the CLI, faults injected through the test
driver, the decisions, the events (a subscriber and `gpuos events` as a user runs it),
the counters (`gpuos kmod info`), and KILL_CLIENT with and without STOP_CLIENT; fault
batch reports (gpuos_report_fault_batch) to FAULT_BATCH events, and malformed ones."""

from __future__ import annotations

import json
import os
import time

import pytest

import vmlib
from vmlib import gpuos_cli, inject, inject_batch, wait_subscribed
from gpuos.kernel.model import Client, FaultBatch, Policy
from gpuos.kernel.uapi import (FAULT_BATCH_ADDRS, FAULT_BATCH_MAX_FAULTS, Decision, DriverCaps,
                               EventType, FaultAccess, FaultPolicy, FaultType)

pytestmark = pytest.mark.vm


def own_cgroup(pid: int) -> int:
    """The id of a process's cgroup v2 (its directory's inode)."""
    path = open(f"/proc/{pid}/cgroup").read().strip().split("::", 1)[1]
    return os.stat(vmlib.CGROUP2 / path.lstrip("/")).st_ino


def collect(sub, n, timeout=20):
    out = []
    for _ in range(n):
        ev = sub.next(timeout=timeout)
        assert ev is not None, f"{len(out)} of {n} events: {[e.to_json() for e in out]}"
        assert ev.gap is None, ev.gap
        out.append(ev)
    return out


def test_fault_path_with_pid_and_cgroup_policies(testdrv, nl, sleepers, cgroups):
    p, q, r = sleepers(), sleepers(), sleepers()  # p: pid policy; q: its cgroup's; r: none
    cg = cgroups()
    cg.add(q.pid)
    faults = [  # (process, veid, as_id, addr, access, type, gpu), expected decision
        ((p, 0, 0xA1, 0x7F0000001000, FaultAccess.READ, FaultType.INVALID_PDE, 0), 1),
        ((q, 3, 0xB2, 0x2000, FaultAccess.ATOMIC, FaultType.INVALID_PTE, 5), 1),
        ((r, 1, 0xC3, 0x3000, FaultAccess.WRITE, FaultType.WRITE, 31), 0),
        ((p, 2, 0xA1, 0x4000, FaultAccess.PREFETCH, FaultType.OTHER, 1), 1),
        ((q, 0, 0xB2, 0x5000, FaultAccess.WRITE, FaultType.ATOMIC, 2), 1),
    ]
    n_events = 2 + sum(2 if d else 1 for _, d in faults)  # POLICY_SETs, FAULT (+ ISOLATED)
    before = nl.get_info()
    # `gpuos events` as a user runs it, listening before anything happens
    listener = gpuos_cli("events", "--json", "--count", str(n_events), "--timeout", "90",
                         popen=True)
    try:
        with nl.subscribe() as sub:
            wait_subscribed(listener, nl.mcast_groups["events"])
            # the pid's policy as a user sets it; the cgroup's with the client (a second
            # CLI would only cost time)
            setter = gpuos_cli("policy", "set", "--pid", str(p.pid), "isolate")
            assert setter.returncode == 0, setter
            assert setter.stdout.strip() == f"pid {p.pid}: isolate"
            nl.set_policy(Client(cgroup=cg.id), FaultPolicy.ISOLATE)
            assert nl.get_policy(Client(pid=p.pid)).policy == FaultPolicy.ISOLATE
            assert nl.get_policy(Client(cgroup=cg.id)).policy == FaultPolicy.ISOLATE
            for (proc, *rest), want in faults:
                assert inject(proc.pid, *rest) == want  # last_decision
                assert int(vmlib.dbg_read("last_decision")) == want
            info_cli = gpuos_cli("kmod", "info", "--json", popen=True)
            evs = collect(sub, n_events)
        out, err = listener.communicate(timeout=90)
    finally:
        if listener.poll() is None:
            listener.kill()
    assert listener.returncode == 0, (listener.returncode, out, err)
    assert err == ""  # no "missed N events"
    # the subscriber: consecutive numbers from the last one before, in order
    assert [e.seq for e in evs] == list(range(before.event_seq + 1, before.event_seq + 1 + n_events))
    sets, rest = evs[:2], evs[2:]
    assert [(e.type, e.policy) for e in sets] == [
        (EventType.POLICY_SET, Policy(Client(pid=p.pid), FaultPolicy.ISOLATE)),
        (EventType.POLICY_SET, Policy(Client(cgroup=cg.id), FaultPolicy.ISOLATE))]
    i = 0
    for (proc, veid, as_id, addr, access, ftype, gpu), want in faults:
        types = [EventType.FAULT] + ([EventType.CLIENT_ISOLATED] if want else [])
        for t in types:
            ev = rest[i]
            i += 1
            f = ev.fault
            assert ev.type == t, ev
            assert (f.pid, f.veid, f.as_id, f.addr, f.access, f.type, f.gpu) == \
                (proc.pid, veid, as_id, addr, access, ftype, gpu), f
            assert f.cgroup == own_cgroup(proc.pid)
            assert f.decision == Decision(want)
    assert i == len(rest)
    assert rest[2].fault.cgroup == cg.id  # q's own cgroup: the fresh one
    # the CLI printed the same events, as JSON lines
    lines = [json.loads(line) for line in out.splitlines()]
    assert lines == [e.to_json() for e in evs]
    # the counters moved, as `gpuos kmod info --json` shows them
    out, err = info_cli.communicate(timeout=60)
    assert info_cli.returncode == 0, err
    info = json.loads(out)
    assert info["ok"] and info["driver"]["name"] == "gpuos-testdrv"
    d = {k: v - before.counters[k] for k, v in info["counters"].items()}
    assert d["faults"] == 5 and d["decisions_isolate"] == 4 and d["decisions_default"] == 1
    assert d["decisions_kill"] == 0 and d["rejected"] == 0
    assert d["policies"] == 2 and d["objects"] == 2
    assert d["events"] == n_events and d["events_unsent"] == 0
    assert info["event_seq"] == before.event_seq + n_events


def test_malformed_fault_reports_get_default(testdrv, nl, sleepers):
    p = sleepers()
    nl.set_policy(Client(pid=p.pid), FaultPolicy.KILL_CLIENT)
    before = nl.get_info()
    for kw in ({"access": 4}, {"ftype": 5}, {"gpu": 32}, {"access": 0xFFFFFFFF}):
        assert inject(p.pid, **kw) == Decision.DEFAULT, kw
    after = nl.get_info()
    assert after.counters["rejected"] - before.counters["rejected"] == 4
    assert after.counters["faults"] == before.counters["faults"]
    assert after.event_seq == before.event_seq  # no events either
    assert p.alive()
    for text in ("1 2 3", "1 2 3 4 5 6 7 8", "x 0 0 0 0 0 0", ""):
        assert vmlib.dbg_write("inject_fault", text) != 0, text


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_kill_client_with_stop_client_cap_stops_it(testdrv, nl, sleepers):
    p = sleepers()
    nl.set_policy(Client(pid=p.pid), FaultPolicy.KILL_CLIENT)
    before = nl.get_info().counters
    with nl.subscribe() as sub:
        assert inject(p.pid, as_id=0x99) == Decision.KILL_CLIENT
        fault, isolated = collect(sub, 2)
    assert (fault.type, isolated.type) == (EventType.FAULT, EventType.CLIENT_ISOLATED)
    assert fault.fault.decision == isolated.fault.decision == Decision.KILL_CLIENT
    assert wait_for(lambda: (0x99, p.pid) in vmlib.stopped()), vmlib.dbg_read("stopped")
    time.sleep(0.5)
    assert p.alive()  # the driver stopped it: no signal
    after = nl.get_info().counters
    assert after["decisions_kill"] - before["decisions_kill"] == 1
    assert wait_for(lambda: nl.get_info().counters["objects"] == 1)  # the policy; the work item is freed


def test_kill_client_without_stop_client_cap_is_sigkill(gpuos, nl, sleepers, cgroups):
    gpuos.load_testdrv(caps=int(DriverCaps.FAULT_REPORTS | DriverCaps.MIGRATE |
                                DriverCaps.HINT))
    stopped_before = vmlib.stopped()
    p = sleepers()
    nl.set_policy(Client(pid=p.pid), FaultPolicy.KILL_CLIENT)
    assert inject(p.pid) == Decision.KILL_CLIENT
    assert p.proc.wait(timeout=10) == -9  # SIGKILL
    # a cgroup's KILL_CLIENT reaches its member the same way
    q = sleepers()
    cg = cgroups()
    cg.add(q.pid)
    nl.set_policy(Client(cgroup=cg.id), FaultPolicy.KILL_CLIENT)
    assert inject(q.pid, as_id=0x5) == Decision.KILL_CLIENT
    assert q.proc.wait(timeout=10) == -9
    assert vmlib.stopped() == stopped_before  # stop_client was never called
    assert wait_for(lambda: nl.get_info().counters["objects"] == 2)  # two policies


def test_fault_batch_reports_become_events(testdrv, nl, sleepers):
    p = sleepers()
    addrs = [0x7F0000000000 + i * 0x3000 for i in range(FAULT_BATCH_ADDRS)]
    full = dict(as_id=0xA1, gpu=31, batch_id=1 << 40, faults=10, instances=14, fatal=1,
                throttled=2, skipped=5, by_access=(4, 3, 2, 1), addr_min=addrs[0],
                addr_max=0x7F00000F0000, addrs=addrs)
    before = nl.get_info()
    # `gpuos events` as a user runs it: the text lines
    listener = gpuos_cli("events", "--count", "2", "--timeout", "90", popen=True)
    try:
        with nl.subscribe() as sub:
            wait_subscribed(listener, nl.mcast_groups["events"])
            assert inject_batch(p.pid, **full) == 0
            # pid 0 (no such process: no cgroup), one fault at the lowest page
            assert inject_batch(0, gpu=0, batch_id=0, addrs=[0]) == 0
            evs = collect(sub, 2)
        out, err = listener.communicate(timeout=90)
    finally:
        if listener.poll() is None:
            listener.kill()
    assert [e.type for e in evs] == [EventType.FAULT_BATCH] * 2
    assert [e.seq for e in evs] == [before.event_seq + 1, before.event_seq + 2]
    assert evs[0].fault is None
    assert evs[0].fault_batch == FaultBatch(
        pid=p.pid, cgroup=own_cgroup(p.pid), as_id=0xA1, gpu=31, batch_id=1 << 40, faults=10,
        instances=14, fatal=1, throttled=2, skipped=5,
        by_access={"read": 4, "write": 3, "atomic": 2, "prefetch": 1},
        addr_min=addrs[0], addr_max=0x7F00000F0000, addrs=addrs)
    assert evs[1].fault_batch == FaultBatch(
        pid=0, cgroup=None, as_id=0x77, gpu=0, batch_id=0, faults=1, instances=1, fatal=0,
        throttled=0, skipped=0, by_access={"read": 1, "write": 0, "atomic": 0, "prefetch": 0},
        addr_min=0, addr_max=0, addrs=[0])
    assert listener.returncode == 0, (out, err)
    lines = out.splitlines()
    assert len(lines) == 2 and err == ""
    assert lines[0].split(" ", 2)[2] == (
        f"fault-batch pid={p.pid} cgroup={own_cgroup(p.pid)} as_id=0xa1 gpu=31 "
        f"fault_batch={1 << 40} faults=10 instances=14 fatal=1 throttled=2 skipped=5 read=4 "
        f"write=3 atomic=2 prefetch=1 addr_min={addrs[0]:#x} addr_max=0x7f00000f0000 "
        f"addrs={','.join(f'{a:#x}' for a in addrs)}")
    after = nl.get_info()
    d = {k: v - before.counters[k] for k, v in after.counters.items()}
    assert d["fault_batches"] == 2 and d["events"] == 2 and d["events_unsent"] == 0
    assert d["rejected"] == 0 and d["faults"] == 0 and d["objects"] == 0
    # nobody listening: counted, numbered, unsent
    assert inject_batch(p.pid) == 0
    final = nl.get_info()
    assert final.counters["fault_batches"] - after.counters["fault_batches"] == 1
    assert final.counters["events_unsent"] - after.counters["events_unsent"] == 1
    assert final.event_seq == after.event_seq + 1


def test_malformed_fault_batch_reports_are_rejected(testdrv, nl, sleepers):
    p = sleepers()
    nmax = FAULT_BATCH_MAX_FAULTS
    bad = [  # each against the well-formed default: 3 faults, reads, pages 0x1000..0x3000
        {"gpu": 32}, {"gpu": 0xFFFFFFFF},
        {"faults": 0, "by_access": (0, 0, 0, 0), "nr_addrs": 0, "addrs": []},
        {"faults": 0, "by_access": (0, 0, 0, 0)},
        {"faults": nmax + 1, "by_access": (nmax + 1, 0, 0, 0)},
        {"instances": 2}, {"instances": nmax + 1},
        {"fatal": 4}, {"throttled": 4},
        {"by_access": (1, 1, 0, 0)}, {"by_access": (0, 0, 0, 4)},
        {"by_access": (0xFFFFFFFF, 4, 0, 0)},  # adds up to 3 in 32 bits
        {"nr_addrs": 0}, {"nr_addrs": FAULT_BATCH_ADDRS + 1}, {"nr_addrs": 0xFFFFFFFF},
        {"faults": 2, "by_access": (2, 0, 0, 0)},  # 3 distinct pages of 2 faults
        {"addr_min": 0x3000, "addr_max": 0x1000},
        {"addr_min": 0x800}, {"addr_max": 0x3800},
        {"addrs": [0x1000, 0x3000, 0x2000]}, {"addrs": [0x1000, 0x1000, 0x3000]},
        {"addrs": [0x1000, 0x2000, 0x2800], "addr_max": 0x3000},
        {"addrs": [0x1000, 0x2000, 0x5000], "addr_max": 0x3000},
        {"addrs": [0x1000, 0x2000, 0x3000], "addr_min": 0x2000},
    ]
    before = nl.get_info()
    for kw in bad:
        assert inject_batch(p.pid, **kw) == 0, kw  # the driver passes it on as is
    after = nl.get_info()
    assert after.counters["rejected"] - before.counters["rejected"] == len(bad)
    assert after.counters["fault_batches"] == before.counters["fault_batches"]
    assert after.event_seq == before.event_seq  # no events
    # the well-formed default is accepted; entries past nr_addrs are ignored
    assert inject_batch(p.pid) == 0
    assert inject_batch(p.pid, nr_addrs=1, addrs=[0x1000, 0x1000, 0]) == 0
    final = nl.get_info()
    assert final.counters["fault_batches"] - after.counters["fault_batches"] == 2
    assert final.counters["rejected"] == after.counters["rejected"]
    # what the test driver cannot parse never reaches gpuos
    ok = "1 0x77 0 1 1 1 0 0 0 1 0 0 0 0x1000 0x1000 1 0x1000"
    too_many = ok + " 0x2000" * FAULT_BATCH_ADDRS
    for text in ("", "1 2 3", ok.rsplit(" ", 2)[0], ok + " x", too_many, ok + " -1",
                 ok.replace("0x77", "0x1" + "0" * 16)):
        assert vmlib.dbg_write("inject_fault_batch", text) != 0, text
    assert vmlib.dbg_write("inject_fault_batch", ok + "\n") == 0
    assert nl.get_info().counters["rejected"] == after.counters["rejected"]


# -- prefetch ranges (GPUOS_CMD_SET_PREFETCH, gpuos_prefetch_lookup) ---------------------

def lookup(as_id: int, addr: int, max_: int | None = None) -> list[tuple[int, int]]:
    """gpuos_prefetch_lookup through the test driver: [(base, len), ...]."""
    text = f"{as_id:#x} {addr:#x}" + ("" if max_ is None else f" {max_}")
    assert vmlib.dbg_write("prefetch_lookup", text + "\n") == 0
    return [tuple(int(x, 16) for x in line.split())
            for line in vmlib.dbg_read("prefetch_lookup").splitlines()]


def test_prefetch_ranges(testdrv, nl, raw):
    import errno
    from gpuos.kernel.uapi import MAX_NL_RANGES, MAX_PREFETCH_AS, PREFETCH_WINDOW, Attr, Cmd
    from vmlib import nest, u32, u64

    W, M = PREFETCH_WINDOW, 1 << 20
    base_objects = nl.get_info().counters["objects"]
    assert lookup(0xA5, 0x40000000) == []  # nothing set
    # given out of order; the window is the 2 MiB block around the address
    nl.set_prefetch(0xA5, [(0x40000000 + W + M, 2 * W), (0x40000000 + 0x3000, 0x2000),
                           (0x40000000 - 0x1000, 0x2000), (0x40000000 + M, 0x1000)])
    assert nl.get_info().counters["objects"] == base_objects + 1
    assert lookup(0xA5, 0x40000000 + 0x5000) == [  # clipped to the window, ascending
        (0x40000000, 0x1000), (0x40000000 + 0x3000, 0x2000), (0x40000000 + M, 0x1000)]
    assert lookup(0xA5, 0x40000000 + 0x5000, 2) == [(0x40000000, 0x1000),
                                                     (0x40000000 + 0x3000, 0x2000)]
    assert lookup(0xA5, 0x40000000 + 0x5000, 0) == []
    assert lookup(0xA5, 0x40000000 + W) == [(0x40000000 + W + M, W - M)]
    assert lookup(0xA5, 0x40000000 + 2 * W + 0x1000) == [(0x40000000 + 2 * W, W)]
    assert lookup(0xA5, 0x40000000 - 1) == [(0x40000000 - 0x1000, 0x1000)]
    assert lookup(0xA5, 0x40000000 + 8 * W) == []
    assert lookup(0xA6, 0x40000000) == []  # another address space
    # the top of the address space: no overflow of the window
    top = (1 << 64) - 0x2000
    nl.set_prefetch(0xA6, [(top, 0x1000)])
    assert lookup(0xA6, top) == [(top, 0x1000)]
    # replacing
    nl.set_prefetch(0xA5, [(0x80000000, W)])
    assert lookup(0xA5, 0x40000000) == []
    assert lookup(0xA5, 0x80001000) == [(0x80000000, W)]
    assert nl.get_info().counters["objects"] == base_objects + 2
    # clearing: empty and absent ranges; clearing nothing is fine
    nl.set_prefetch(0xA5, [])
    assert raw.request(Cmd.SET_PREFETCH, u64(Attr.AS_ID, 0xA6) + nest(Attr.RANGES))[0] == 0
    assert raw.request(Cmd.SET_PREFETCH, u64(Attr.AS_ID, 0xA6))[0] == 0
    assert lookup(0xA5, 0x80001000) == [] and lookup(0xA6, top) == []
    assert nl.get_info().counters["objects"] == base_objects

    # malformed
    rejected = nl.get_info().counters["rejected"]

    def pf(as_id, *ranges, extra=b""):
        rs = [nest(Attr.RANGE, u64(Attr.RANGE_BASE, b), u64(Attr.RANGE_LEN, n)) + b""
              for b, n in ranges]
        return raw.request(Cmd.SET_PREFETCH, u64(Attr.AS_ID, as_id) + nest(Attr.RANGES, *rs) +
                           extra)[0]

    assert pf(1, (0x1001, 0x1000)) == errno.EINVAL  # misaligned base
    assert pf(1, (0x1000, 0x1800)) == errno.EINVAL  # misaligned length
    assert pf(1, (top, 0x2000)) == errno.EINVAL  # overflow
    assert pf(1, (0x1000, 0x2000), (0x2000, 0x1000)) == errno.EINVAL  # overlap
    assert pf(1, (0x1000, 0)) == errno.ERANGE  # the policy: len >= 1
    assert pf(1, *[(i * 0x2000, 0x1000) for i in range(MAX_NL_RANGES + 1)]) == errno.E2BIG
    assert raw.request(Cmd.SET_PREFETCH, nest(Attr.RANGES, nest(
        Attr.RANGE, u64(Attr.RANGE_BASE, 0), u64(Attr.RANGE_LEN, 0x1000))))[0] == errno.EINVAL
    assert raw.request(Cmd.SET_PREFETCH, u64(Attr.AS_ID, 1) + nest(Attr.RANGES, nest(
        Attr.RANGE, u64(Attr.RANGE_BASE, 0), u64(Attr.RANGE_LEN, 0x1000),
        u32(Attr.RANGE_DEST, 0))))[0] == errno.EINVAL  # no dest in a prefetch range
    assert raw.request(Cmd.SET_PREFETCH, u64(Attr.AS_ID, 1) + nest(Attr.RANGES, nest(
        Attr.RANGE, u64(Attr.RANGE_BASE, 0))))[0] == errno.EINVAL  # no length
    assert nl.get_info().counters["rejected"] > rejected
    assert lookup(1, 0x1000) == []  # nothing stored
    # the most ranges in one request
    assert pf(1, *[(i * 0x2000, 0x1000) for i in range(MAX_NL_RANGES)]) == 0
    assert len(lookup(1, 0, 16)) == 16
    assert pf(1) == 0  # an empty nest clears

    # at most MAX_PREFETCH_AS address spaces
    try:
        for i in range(MAX_PREFETCH_AS):
            assert pf(0x1000 + i, (0x1000, 0x1000)) == 0, i
        assert nl.get_info().counters["objects"] == base_objects + MAX_PREFETCH_AS
        assert pf(0x99999, (0x1000, 0x1000)) == errno.ENOSPC
        assert pf(0x1000, (0x3000, 0x1000)) == 0  # replacing is fine at the limit
        assert lookup(0x1000, 0x1000) == [(0x3000, 0x1000)]
        assert pf(0x99999) == 0  # clearing one that has none, too
    finally:
        for i in range(MAX_PREFETCH_AS):
            assert raw.request(Cmd.SET_PREFETCH, u64(Attr.AS_ID, 0x1000 + i))[0] == 0
    assert pf(0x99999, (0x1000, 0x1000)) == 0
    nl.set_prefetch(0x99999)
    assert nl.get_info().counters["objects"] == base_objects


def test_prefetch_ranges_go_with_their_address_space(testdrv, nl, raw):
    """The driver reports an address space destroyed (gpuos_address_space_gone, through
    the test driver): its prefetch ranges go, so address spaces of processes long gone
    never use up MAX_PREFETCH_AS (before this, the 257th process could not store any)."""
    from gpuos.kernel.uapi import MAX_PREFETCH_AS

    base_objects = nl.get_info().counters["objects"]
    for round_ in range(2):  # twice the limit's worth of address spaces, one after another
        for i in range(MAX_PREFETCH_AS):
            as_id = 0x5000 + round_ * MAX_PREFETCH_AS + i
            nl.set_prefetch(as_id, [(0x1000, 0x1000)])
            assert lookup(as_id, 0x1000) == [(0x1000, 0x1000)]
        for i in range(MAX_PREFETCH_AS):
            as_id = 0x5000 + round_ * MAX_PREFETCH_AS + i
            assert vmlib.dbg_write("as_gone", f"{as_id:#x}\n") == 0
            assert lookup(as_id, 0x1000) == []
        assert nl.get_info().counters["objects"] == base_objects
    assert vmlib.dbg_write("as_gone", "0x77777\n") == 0  # one that had none: nothing happens
    assert vmlib.dbg_write("as_gone", "x\n") != 0


def test_faults_watch_shows_what_the_driver_reports_through_gpuos_ko(testdrv, nl, sleepers):
    """`gpuos faults watch`, as a user runs it with gpuos.ko loaded: a fault the driver
    reports through gpuos.ko comes out with the pid the driver named, unaltered, and what
    gpuos adds to it: the process's name (read from /proc, not reported), the decision of
    the policy set for that pid, the address, VEID and types.  That the pid is the client
    that faulted (the one thing the kernel log's Xid cannot give under MPS) is the
    driver's part: the patched nvidia-uvm reports the process that created the faulting
    VA space (patches/README.md), which has never run on a GPU; the test driver reports
    what it is told, so this test cannot show it."""
    victim, faulter = sleepers(), sleepers()
    nl.set_policy(Client(pid=faulter.pid), FaultPolicy.ISOLATE)
    watch = gpuos_cli("faults", "watch", "--json", "--no-nvml", "--no-journal", "--duration", "60",
                      popen=True)
    try:
        wait_subscribed(watch, nl.mcast_groups["events"])
        assert inject(faulter.pid, veid=5, as_id=0xA7, addr=0x7F12345000, access=FaultAccess.WRITE,
                      ftype=FaultType.INVALID_PDE, gpu=1) == Decision.ISOLATE
        deadline = time.monotonic() + 30
        ev = None
        while ev is None and time.monotonic() < deadline:
            line = watch.stdout.readline()
            assert line, watch.stderr.read() if watch.poll() is not None else "no output"
            rec = json.loads(line)
            if rec.get("source") == "gpuos.ko":
                ev = rec
    finally:
        watch.terminate()
        watch.communicate(timeout=30)
        nl.del_policy(Client(pid=faulter.pid))
    assert ev is not None
    assert (ev["pid"], ev["process"], ev["fault_class"], ev["xid"]) == (faulter.pid, "sleep", "memory", None)
    assert ev["mmu"]["address"] == 0x7F12345000 and ev["mmu"]["access_type"] == "write"
    assert ev["mmu"]["fault_type"] == "invalid-pde"
    assert (ev["extra"]["veid"], ev["extra"]["as_id"], ev["extra"]["decision"]) == (5, 0xA7, "isolate")
    assert "isolated" in ev["action"] and victim.pid != ev["pid"]


def storm() -> tuple[int, int]:
    """The test driver's hrtimer fault storm: (reports left, reports made)."""
    left, fired = vmlib.dbg_read("fault_storm").split()[1::2]
    return int(left), int(fired)


def test_faults_from_interrupt_context_race_unregister_and_unload(testdrv, nl, sleepers, kmsg):
    """The real driver reports faults from its bottom half, in atomic context. An hrtimer
    (hard interrupt context) reports them by the thousand: while the driver unregisters
    and registers again and again; with a KILL_CLIENT decision whose kill races an
    unregister; and while the test driver's module is removed mid-storm.  Every report is
    counted, the client to kill is killed (or stopped by the driver), the isolated one
    lives, and the kernel log stays clean."""
    kmsg.new()
    iso, victim = sleepers(), sleepers()
    nl.set_policy(Client(pid=iso.pid), FaultPolicy.ISOLATE)
    nl.set_policy(Client(pid=victim.pid), FaultPolicy.KILL_CLIENT)
    faults0 = nl.get_info().counters["faults"]

    assert vmlib.dbg_write("fault_storm", f"20000 20 {iso.pid} 1 0x10 0x100000 0 0 0\n") == 0
    flips = 0
    deadline = time.monotonic() + 60
    while storm()[0] > 0:
        assert time.monotonic() < deadline, storm()
        assert vmlib.dbg_write("register", "0\n") == 0
        assert vmlib.dbg_write("register", "1\n") == 0
        flips += 1
    assert storm() == (0, 20000) and flips > 0

    stopped_before = vmlib.stopped()
    assert vmlib.dbg_write("fault_storm", f"50 10 {victim.pid} 1 0x11 0x200000 0 0 0\n") == 0
    assert vmlib.dbg_write("register", "0\n") == 0  # the kill's work item may find no driver
    assert wait_for(lambda: storm() == (0, 50)), storm()
    assert wait_for(lambda: not victim.alive() or (0x11, victim.pid) in vmlib.stopped()[len(stopped_before):])
    assert vmlib.dbg_write("register", "1\n") == 0

    assert vmlib.dbg_write("fault_storm", f"1000000 50 {iso.pid} 1 0x12 0x300000 0 0 0\n") == 0
    assert wait_for(lambda: storm()[1] > 100)
    testdrv.unload_testdrv()  # its exit cancels the timer mid-storm
    counted = nl.get_info().counters["faults"] - faults0
    time.sleep(0.2)
    assert nl.get_info().counters["faults"] - faults0 == counted  # nothing reports any more
    assert counted > 20000 + 50 + 100
    assert iso.alive()
    assert kmsg.bad(kmsg.new()) == []
    testdrv.load_testdrv()


def test_kills_that_cannot_be_scheduled_get_the_drivers_default(testdrv, nl, sleepers):
    """More KILL_CLIENT decisions than gpuos keeps waiting (256; here the driver's
    stop_client takes 20 ms each, and 400 faults come from interrupt context within a few
    ms): those past the limit get the driver's default, never an isolation without end
    (on the real driver, a client parked for good).  The waiting kills all run."""
    p = sleepers()
    nl.set_policy(Client(pid=p.pid), FaultPolicy.KILL_CLIENT)
    before = nl.get_info().counters
    stopped_before = len(vmlib.stopped())
    assert vmlib.dbg_write("stop_delay_ms", "20\n") == 0
    try:
        assert vmlib.dbg_write("fault_storm", f"400 10 {p.pid} 1 0x13 0x400000 0 0 0\n") == 0
        assert wait_for(lambda: storm() == (0, 400)), storm()
        c = nl.get_info().counters
        kills, defaults, isolates = (c[k] - before[k] for k in
                                     ("decisions_kill", "decisions_default", "decisions_isolate"))
        assert (kills + defaults, isolates) == (400, 0), (kills, defaults, isolates)
        assert kills >= 256 and defaults > 0, (kills, defaults)
        assert wait_for(lambda: len(vmlib.stopped()) - stopped_before == kills, timeout=60)
    finally:
        assert vmlib.dbg_write("stop_delay_ms", "0\n") == 0
    assert wait_for(lambda: nl.get_info().counters["objects"] == 1)  # the policy; no work item left
    assert p.alive()  # stopped by the driver, not signalled
