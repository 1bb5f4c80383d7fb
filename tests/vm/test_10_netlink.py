"""The generic netlink family "gpuos": GET_INFO, policies, MIGRATE, through the Python
client (gpuos.kernel.netlink) and raw messages where the exact errno matters."""

from __future__ import annotations

import errno
import subprocess
import sys
import time
from pathlib import Path

import pytest

import vmlib
from vmlib import dbg_write, migrate_payload, range_nest, u32, u64
from gpuos.errors import (InvalidRequest, LimitReached, NoDriverRegistered, NoSuchPolicy,
                          NotSupported)
from gpuos.kernel.model import Client, Policy, Range
from gpuos.kernel.uapi import (DEST_CPU, DEST_GPU, MAX_NL_RANGES, MAX_POLICIES,
                               RANGE_EVICT_FIRST, RANGE_EVICT_LAST, Attr, Cmd, Counter,
                               DriverCaps, EventType, FaultPolicy, Op)

pytestmark = pytest.mark.vm

HDR = vmlib.header_defines()
MODULE_VERSION = vmlib.header_defines(vmlib.VERSION_H)["GPUOS_MODULE_VERSION"].strip('"')
COUNTERS = {c.name.lower() for c in Counter if c not in (Counter.UNSPEC, Counter.PAD)}


def events(sub, n, timeout=10):
    """The next n events of a subscription; no gaps, consecutive numbers."""
    out = []
    for _ in range(n):
        ev = sub.next(timeout=timeout)
        assert ev is not None, f"only {len(out)} of {n} events: {out}"
        assert ev.gap is None, ev.gap
        out.append(ev)
    assert [e.seq for e in out] == list(range(out[0].seq, out[0].seq + n))
    return out


def test_get_info_without_driver(no_driver, nl, raw):
    info = nl.get_info()
    assert info.genl_version == int(HDR["GPUOS_GENL_VERSION"]) == 1
    assert info.abi_version == int(HDR["GPUOS_ABI_VERSION"]) == 1
    assert info.module_version == MODULE_VERSION
    assert info.module_version == Path("/sys/module/gpuos/version").read_text().strip()
    assert info.driver_name is None and info.driver_caps == 0
    assert set(info.counters) == COUNTERS
    c = info.counters
    assert c["policies"] == c["objects"] == 0
    assert c["events"] == info.event_seq  # every event took one number, none in flight
    r = raw.info()
    assert r["version"] == int(HDR["GPUOS_GENL_VERSION"])  # the reply's genlmsghdr
    assert "driver_name" not in r and r["driver_caps"] == 0  # CAPS 0, no NAME at all
    assert r["counters"].keys() == COUNTERS


def test_counters_follow_policies_events_and_listeners(gpuos, nl, raw):
    before = nl.get_info()
    assert raw.set_policy("cgroup", 4242, FaultPolicy.ISOLATE) == 0  # nobody listens
    mid = nl.get_info()
    assert mid.event_seq == before.event_seq + 1
    d = {k: mid.counters[k] - before.counters[k] for k in COUNTERS}
    assert d["policies"] == d["objects"] == d["events"] == d["events_unsent"] == 1
    with nl.subscribe() as sub:
        assert raw.del_policy("cgroup", 4242) == 0
        ev = sub.next(timeout=10)
        assert ev.type == EventType.POLICY_DELETED and ev.seq == mid.event_seq + 1
    after = nl.get_info()
    d = {k: after.counters[k] - mid.counters[k] for k in COUNTERS}
    assert d["policies"] == d["objects"] == -1
    assert d["events"] == 1 and d["events_unsent"] == 0  # this one had a listener


def test_driver_name_and_caps_only_while_registered(gpuos, nl):
    gpuos.load_testdrv(autoregister=False)  # loaded, not registered
    info = nl.get_info()
    assert info.driver_name is None and info.driver_caps == 0
    with nl.subscribe() as sub:
        assert dbg_write("register", "1\n") == 0
        info = nl.get_info()
        assert info.driver_name == "gpuos-testdrv"
        assert info.driver_caps == int(DriverCaps.FAULT_REPORTS | DriverCaps.MIGRATE |
                                       DriverCaps.HINT | DriverCaps.STOP_CLIENT)
        assert dbg_write("register", "0\n") == 0
        info = nl.get_info()
        assert info.driver_name is None and info.driver_caps == 0
        reg, unreg = events(sub, 2)
    assert (reg.type, reg.driver_name) == (EventType.DRIVER_REGISTERED, "gpuos-testdrv")
    assert (unreg.type, unreg.driver_name) == (EventType.DRIVER_UNREGISTERED, "gpuos-testdrv")
    gpuos.load_testdrv(caps=int(DriverCaps.FAULT_REPORTS | DriverCaps.HINT))
    info = nl.get_info()
    assert info.driver_name == "gpuos-testdrv" and info.driver_caps == 0b0101
    assert info.caps == ["fault-reports", "hint"]
    gpuos.unload_testdrv()
    assert nl.get_info().driver_name is None


def test_policies_set_get_del_list(gpuos, nl, raw, sleepers):
    p = sleepers()
    pid, cg = Client(pid=p.pid), Client(cgroup=123456789)
    with nl.subscribe() as sub:
        nl.set_policy(pid, FaultPolicy.ISOLATE)
        assert nl.get_policy(pid) == Policy(pid, FaultPolicy.ISOLATE)
        nl.set_policy(pid, FaultPolicy.KILL_CLIENT)  # replaces
        assert nl.get_policy(pid) == Policy(pid, FaultPolicy.KILL_CLIENT)
        nl.set_policy(cg, FaultPolicy.DEFAULT)
        assert nl.get_policy(cg) == Policy(cg, FaultPolicy.DEFAULT)
        assert sorted(nl.list_policies(), key=str) == sorted(
            [Policy(pid, FaultPolicy.KILL_CLIENT), Policy(cg, FaultPolicy.DEFAULT)], key=str)
        assert nl.get_info().counters["policies"] == 2
        nl.del_policy(pid)
        with pytest.raises(NoSuchPolicy):
            nl.get_policy(pid)
        with pytest.raises(NoSuchPolicy):
            nl.del_policy(pid)
        assert nl.list_policies() == [Policy(cg, FaultPolicy.DEFAULT)]
        nl.del_policy(cg)
        assert nl.list_policies() == []
        evs = events(sub, 5)
    assert [(e.type, e.policy) for e in evs] == [
        (EventType.POLICY_SET, Policy(pid, FaultPolicy.ISOLATE)),
        (EventType.POLICY_SET, Policy(pid, FaultPolicy.KILL_CLIENT)),
        (EventType.POLICY_SET, Policy(cg, FaultPolicy.DEFAULT)),
        (EventType.POLICY_DELETED, Policy(pid, FaultPolicy.KILL_CLIENT)),
        (EventType.POLICY_DELETED, Policy(cg, FaultPolicy.DEFAULT))]
    # the client's errors, and the errnos behind them
    for bad in (Client(pid=1, cgroup=2), Client(), Client(pid=0)):
        with pytest.raises(InvalidRequest):
            nl.set_policy(bad, FaultPolicy.ISOLATE)
    assert raw.request(Cmd.GET_POLICY, u32(Attr.CLIENT_PID, p.pid))[0] == errno.ENOENT
    assert raw.request(Cmd.DEL_POLICY, u64(Attr.CLIENT_CGROUP, 99))[0] == errno.ENOENT
    assert raw.request(Cmd.SET_POLICY, u32(Attr.CLIENT_PID, 5) + u64(Attr.CLIENT_CGROUP, 5) +
                       u32(Attr.FAULT_POLICY, 1))[0] == errno.EINVAL
    assert raw.request(Cmd.SET_POLICY, u32(Attr.FAULT_POLICY, 1))[0] == errno.EINVAL
    assert raw.request(Cmd.SET_POLICY, u32(Attr.CLIENT_PID, 5))[0] == errno.EINVAL
    assert raw.request(Cmd.SET_POLICY, u32(Attr.CLIENT_PID, 0) +
                       u32(Attr.FAULT_POLICY, 1))[0] == errno.ERANGE
    assert raw.request(Cmd.SET_POLICY, u64(Attr.CLIENT_CGROUP, 0) +
                       u32(Attr.FAULT_POLICY, 1))[0] == errno.ERANGE
    assert raw.request(Cmd.SET_POLICY, u32(Attr.CLIENT_PID, 5) +
                       u32(Attr.FAULT_POLICY, 3))[0] == errno.ERANGE
    assert nl.list_policies() == []


def test_a_pid_policy_needs_a_live_process(gpuos, nl, raw, sleepers):
    """A policy for a pid no process has would apply to whichever process comes to have
    that number (a KILL_CLIENT killing an unrelated program): refused (ESRCH), nothing
    stored.  One set for a live process stays bound to it after it exits."""
    from gpuos.errors import NoSuchProcess

    p = sleepers()
    gone = p.pid
    p.kill()
    assert not Path(f"/proc/{gone}").exists()
    with pytest.raises(NoSuchProcess, match="no such process"):
        nl.set_policy(Client(pid=gone), FaultPolicy.KILL_CLIENT)
    assert raw.set_policy("pid", 3_999_999, 2) == errno.ESRCH
    assert nl.list_policies() == []
    assert nl.get_info().counters["policies"] == 0


def test_list_dump_of_many_and_enospc_at_the_limit(gpuos, nl, raw):
    def policy(i):  # cgroups need not exist (a pid policy needs a live process)
        return ("cgroup", 5_000_000 + i, i % 3)
    t0 = time.monotonic()
    want = {policy(i) for i in range(1500)}
    for kind, cid, pol in want:
        assert raw.set_policy(kind, cid, pol) == 0
    t1 = time.monotonic()
    err, grams = raw.dump_datagrams(Cmd.LIST_POLICIES)
    assert err == 0 and len(grams) >= 2, "the dump should take more than one message's worth"
    got = [vmlib.parse_policy(vmlib.amap(vmlib.amap(b[4:])[Attr.POLICY])) for g in grams for b in g]
    assert len(got) == len(set(got)) == len(want) and set(got) == want
    t2 = time.monotonic()
    listed = nl.list_policies()  # the client reads every part of the dump
    assert {("pid", p.client.pid, p.policy) if p.client.pid else
            ("cgroup", p.client.cgroup, p.policy) for p in listed} == want
    assert len(listed) == len(want)
    t3 = time.monotonic()
    for i in range(len(want), MAX_POLICIES):
        assert raw.set_policy(*policy(i)) == 0, i
    c = nl.get_info().counters
    assert c["policies"] == c["objects"] == MAX_POLICIES
    err, grams = raw.dump_datagrams(Cmd.LIST_POLICIES)
    assert err == 0 and sum(map(len, grams)) == MAX_POLICIES
    assert raw.set_policy("cgroup", 999, 1) == errno.ENOSPC
    with pytest.raises(LimitReached):
        nl.set_policy(Client(pid=1), FaultPolicy.ISOLATE)
    assert raw.set_policy("cgroup", 5_000_000, 2) == 0  # replacing is fine at the limit
    assert raw.del_all_policies() == MAX_POLICIES
    c = nl.get_info().counters
    assert c["policies"] == c["objects"] == 0
    print(f"set {t1-t0:.2f} dump {t2-t1:.2f} ({len(grams)} datagrams) client list {t3-t2:.2f} "
          f"rest {time.monotonic()-t3:.2f}")


MIGRATE_CLI = """
from gpuos.cli.main import cli
from gpuos.kernel import connect
from gpuos.kernel.model import Range

# gpuos has no `migrate` command: this one goes through the CLI's group all the same,
# with its error handling and exit codes
@cli.command("migrate-test")
def migrate_test():
    with connect() as nl:
        print(nl.migrate(7, 0, [Range(0x1000, 0x1000, 1)]))

cli(prog_name="gpuos")
"""


def test_migrate_without_driver_is_enodev(no_driver, nl, raw):
    with pytest.raises(NoDriverRegistered):
        nl.migrate(7, Op.MIGRATE, [Range(0x1000, 0x1000, DEST_GPU(0))])
    ok = [range_nest(0x1000, 0x1000, DEST_GPU(0), 0)]
    assert raw.request(Cmd.MIGRATE, migrate_payload(7, Op.MIGRATE, ok))[0] == errno.ENODEV
    # a malformed batch is refused first, with or without a driver
    assert raw.request(Cmd.MIGRATE, migrate_payload(7, Op.MIGRATE, [range_nest(0x1001, 0x1000)])
                       )[0] == errno.EINVAL
    p = subprocess.run([sys.executable, "-c", MIGRATE_CLI, "migrate-test"],
                       capture_output=True, text=True)
    assert p.returncode == 22, (p.returncode, p.stdout, p.stderr)  # NoDriverRegistered
    assert p.stderr.strip() == ("gpuos: submitting a batch of 1 range(s): no GPU driver "
                                "registered with gpuos"), p.stderr


def test_migrate_with_driver_pending_complete(testdrv, nl):
    before = nl.get_info().counters
    with nl.subscribe() as sub:
        b1 = nl.migrate(0x55, Op.MIGRATE, [Range(0x1000, 0x1000, DEST_GPU(0)),
                                           Range(0x10000, 0x4000, DEST_CPU, prio=7)])
        b2 = nl.migrate(0x56, Op.HINT, [Range(0, 0x1000, flags=RANGE_EVICT_FIRST),
                                        Range(0x2000, 0x1000, flags=RANGE_EVICT_LAST),
                                        Range(0x8000, 0x1000, DEST_GPU(31), flags=1)])
        assert b1 > 0 and b2 == b1 + 1
        assert vmlib.pending() == [(b1, 0x55, Op.MIGRATE, 2), (b2, 0x56, Op.HINT, 3)]
        mid = nl.get_info().counters
        assert mid["batches"] - before["batches"] == 2
        assert mid["ranges"] - before["ranges"] == 5
        assert mid["objects"] - before["objects"] == 2  # the two batches
        vmlib.complete(b1, 0, -5)  # a status per range
        vmlib.complete(b2, -12)  # one for all
        d1, d2 = events(sub, 2)
    assert (d1.type, d1.batch_id, d1.as_id, d1.statuses) == (EventType.MIGRATION_DONE, b1, 0x55,
                                                             [0, -5])
    assert (d2.type, d2.batch_id, d2.as_id, d2.statuses) == (EventType.MIGRATION_DONE, b2, 0x56,
                                                             [-12, -12, -12])
    assert vmlib.pending() == []
    after = nl.get_info().counters
    assert after["batches_done"] - before["batches_done"] == 2
    assert after["objects"] == before["objects"]


def test_migrate_limits_and_malformed_batches(testdrv, raw):
    ok = range_nest(0x1000, 0x1000, 1, 0)
    cases = [
        ([], errno.EINVAL),  # no ranges
        ([ok] * (MAX_NL_RANGES + 1), errno.E2BIG),
        ([range_nest(0x1000, 0x1001)], errno.EINVAL),  # unaligned len
        ([range_nest(0xFFFFFFFFFFFFF000, 0x1000)], errno.EINVAL),  # base + len overflows
        ([range_nest(0x1000, 0)], errno.ERANGE),  # len 0: the policy's minimum
        ([range_nest(0x1000, 0x1000, DEST_GPU(32))], errno.ERANGE),
        ([range_nest(0x1000, 0x1000, 0, 8)], errno.ERANGE),
        ([range_nest(0x1000, 0x1000, 0, 0, 1)], errno.EINVAL),  # flags on a migrate
        ([range_nest(0x1000, 0x1000, 0, 0, 4)], errno.EINVAL),  # unknown flag bit
        ([vmlib.nest(Attr.RANGE, u64(Attr.RANGE_BASE, 0))], errno.EINVAL),  # no len
    ]
    for ranges, want in cases:
        assert raw.request(Cmd.MIGRATE, migrate_payload(1, Op.MIGRATE, ranges))[0] == want, ranges
    assert raw.request(Cmd.MIGRATE, migrate_payload(1, Op.HINT, [range_nest(0, 4096, 0, 0, 3)])
                       )[0] == errno.EINVAL  # both eviction ends
    assert raw.request(Cmd.MIGRATE, migrate_payload(1, 2, [ok]))[0] == errno.ERANGE  # op
    no_nested_flag = u64(Attr.AS_ID, 1) + u32(Attr.OP, 0) + vmlib.nla(Attr.RANGES, ok)
    assert raw.request(Cmd.MIGRATE, no_nested_flag)[0] == errno.EINVAL
    err, replies = raw.request(Cmd.MIGRATE, migrate_payload(1, Op.MIGRATE, [ok] * MAX_NL_RANGES))
    assert err == 0 and len(replies) == 1  # the most a message takes
    assert vmlib.pending()[-1][3] == MAX_NL_RANGES
    assert vmlib.pending() and len(vmlib.pending()) == 1


def test_strict_validation_of_requests(gpuos, raw):
    assert raw.request(Cmd.GET_INFO, u32(Attr.OP, 0))[0] == errno.EINVAL  # takes no attributes
    assert raw.request(Cmd.GET_INFO, reserved=1)[0] == errno.EINVAL
    assert raw.request(Cmd.GET_INFO, u32(Attr.DECISION + 1, 0))[0] == errno.EINVAL  # > max
    assert raw.request(Cmd.EVENT)[0] == errno.EOPNOTSUPP  # multicast only
    assert raw.request(200)[0] == errno.EOPNOTSUPP
    assert raw.request(Cmd.LIST_POLICIES, u32(Attr.CLIENT_PID, 1), dump=True)[0] == errno.EINVAL
    assert raw.request(Cmd.SET_POLICY, u64(Attr.CLIENT_PID, 5) +  # a u32 sent as a u64
                       u32(Attr.FAULT_POLICY, 1))[0] == errno.EINVAL
    assert raw.request(Cmd.SET_POLICY, u32(Attr.CLIENT_PID, 5) + u32(Attr.FAULT_POLICY, 1) +
                       u64(Attr.AS_ID, 1))[0] == errno.EINVAL  # not this command's
    assert raw.request(Cmd.GET_INFO, version=7)[0] == 0  # requests' version is not checked


def test_unsupported_op_is_eopnotsupp(gpuos, nl, raw):
    gpuos.load_testdrv(caps=int(DriverCaps.FAULT_REPORTS | DriverCaps.MIGRATE |
                                DriverCaps.STOP_CLIENT))  # no HINT
    hint = [Range(0, 0x1000, flags=RANGE_EVICT_LAST)]
    with pytest.raises(NotSupported):
        nl.migrate(3, Op.HINT, hint)
    assert raw.request(Cmd.MIGRATE, migrate_payload(3, Op.HINT, [range_nest(0, 4096, 0, 0, 2)])
                       )[0] == errno.EOPNOTSUPP
    bid = nl.migrate(3, Op.MIGRATE, [Range(0, 0x1000)])  # what it has works
    assert [b[0] for b in vmlib.pending()] == [bid]
    gpuos.load_testdrv(caps=int(DriverCaps.FAULT_REPORTS | DriverCaps.HINT))  # no MIGRATE
    with pytest.raises(NotSupported):
        nl.migrate(3, Op.MIGRATE, [Range(0, 0x1000)])
    assert nl.migrate(3, Op.HINT, hint) > bid
