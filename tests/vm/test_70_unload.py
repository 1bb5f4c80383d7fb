"""Unloading: gpuos.ko stays while a GPU driver module uses it; the driver's pending
batches complete with -ENODEV when it goes; then gpuos.ko unloads under a subscribed
listener, which is told (an error, not a hang); and it loads again. Destructive, so last."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import subprocess
import sys

import pytest

import vmlib
from vmlib import Genl, migrate_payload, range_nest
from gpuos.kernel.uapi import Attr, Cmd

pytestmark = pytest.mark.vm

SYS_delete_module = 176  # x86_64

LISTENER = r"""
import json
from gpuos.errors import GpuosError
from gpuos.kernel.netlink import GpuosNetlink

with GpuosNetlink() as nl:
    sub = nl.subscribe()
print(json.dumps({"subscribed": True}), flush=True)
try:
    while True:
        ev = sub.next()  # blocks until an event comes
        print(json.dumps(dict(ev.to_json(), gap=ev.gap is not None)), flush=True)
except GpuosError as exc:
    print(json.dumps({"error": exc.kind, "message": exc.message}), flush=True)
except OSError as exc:
    print(json.dumps({"error": "OSError", "message": str(exc)}), flush=True)
"""


def test_gpuos_is_busy_while_the_driver_module_is_loaded(testdrv):
    p = testdrv.rmmod("gpuos", check=False)
    assert p.returncode != 0 and "in use" in p.stderr, p
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(SYS_delete_module, b"gpuos", os.O_NONBLOCK) == -1
    # a module others depend on: delete_module(2) fails with EWOULDBLOCK (== EAGAIN), which
    # rmmod(8) reports as "in use" (docs/uapi.md says so)
    assert ctypes.get_errno() == errno.EAGAIN
    assert vmlib.module_loaded("gpuos")
    with Genl() as nl:
        assert nl.info()["driver_name"] == "gpuos-testdrv"


def test_unload_with_listener_and_pending_batches(testdrv, kmsg):
    with Genl() as nl:
        group = nl.groups["events"]
    listener = subprocess.Popen([sys.executable, "-c", LISTENER], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        assert json.loads(listener.stdout.readline()) == {"subscribed": True}
        vmlib.wait_subscribed(listener, group)
        ids = []
        with Genl() as nl:
            for n in (1, 2, 3):
                err, replies = nl.request(Cmd.MIGRATE, migrate_payload(
                    0x70 + n, 0, [range_nest(0x1000 * i, 0x1000, 1) for i in range(1, n + 1)]))
                assert err == 0
                ids.append(vmlib.get_u64(vmlib.amap(replies[0][4:])[Attr.BATCH_ID]))
        assert [(b, n) for b, _, _, n in vmlib.pending()] == list(zip(ids, (1, 2, 3)))
        testdrv.rmmod("gpuos_testdrv")  # its pending batches complete with -ENODEV
        with Genl() as nl:
            info = nl.info()
        assert "driver_name" not in info and info["counters"]["objects"] == 0
        assert listener.poll() is None  # still subscribed
        testdrv.rmmod("gpuos")
        assert not vmlib.module_loaded("gpuos")
        out, err = listener.communicate(timeout=30)  # it must learn of it: no hang
    finally:
        if listener.poll() is None:
            listener.kill()
    lines = [json.loads(line) for line in out.splitlines()]
    assert listener.returncode == 0, (out, err)
    done = [ln for ln in lines if ln.get("type") == "migration-done"]
    # all at once, in no particular order (the header promises none)
    assert sorted((d["batch_id"], d["as_id"], d["statuses"]) for d in done) == [
        (b, 0x70 + n, [-errno.ENODEV] * n) for b, n in zip(ids, (1, 2, 3))]
    unreg = lines[len(done)]
    assert (unreg["type"], unreg["driver_name"]) == ("driver-unregistered", "gpuos-testdrv")
    seqs = [ln["seq"] for ln in lines if "seq" in ln]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and not any(
        ln.get("gap") for ln in lines)
    assert lines[-1] == {"error": "kmod-not-loaded",
                         "message": "gpuos.ko was unloaded: no more events"}, lines
    assert len(lines) == len(done) + 2
    # the kernel log of the whole session
    bad = kmsg.bad(kmsg.all())
    assert not bad, "\n".join(bad)
    # and it loads again, and works
    testdrv.insmod("gpuos")
    testdrv.insmod("gpuos_testdrv")
    with Genl() as nl:
        info = nl.info()
        assert info["driver_name"] == "gpuos-testdrv" and info["event_seq"] == 1
        assert info["counters"]["objects"] == 0
        err, _ = nl.request(Cmd.MIGRATE, migrate_payload(1, 0, [range_nest(0x1000, 0x1000)]))
        assert err == 0 and len(vmlib.pending()) == 1
    testdrv.unload_all()  # leave the guest as it was found
