"""Fuzz: random and malformed netlink messages and ioctls, as root and (at the same time)
as nobody, each checked against the protocol (fuzzlib.py); then a clean kernel log, no
leaked objects, and an unloadable module.

The seed is printed; GPUOS_FUZZ_SEED=N in the guest repeats a run (the guest does not
see the host's environment):

    tools/vmtest/vmtest.py run -- env GPUOS_FUZZ_SEED=N python3 -m pytest -m vm -s \
        tests/vm/test_60_fuzz.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import fuzzlib
import vmlib
from vmlib import UNPRIV, Genl
from gpuos.kernel.uapi import PREFETCH_WINDOW, Attr, Cmd

pytestmark = pytest.mark.vm

MESSAGES, IOCTLS = 10_000, 5_000  # as root
CHILD_MESSAGES, CHILD_IOCTLS = 2_500, 1_000  # as nobody, meanwhile
SCHEDULE = [  # (fraction of the run, the test driver's state from then on)
    (0.0, {"mode": "sync"}),
    (0.35, {"mode": "async"}),  # batches pile up (EAGAIN at GPUOS_MAX_PENDING)
    (0.60, {"registered": False}),  # ENODEV; the pending ones completed with -ENODEV
    (0.68, {"registered": True, "mode": "fail"}),  # EIO from the driver's submit
    (0.76, {"mode": "sync"}),
    (0.90, {"mode": "async"}),  # left pending for the unload
]


def test_fuzz_netlink_and_ioctls(testdrv, kmsg):
    seed = int(os.environ.get("GPUOS_FUZZ_SEED") or time.time_ns() % 1_000_000_007)
    print(f"fuzz seed {seed} (the unprivileged child's: {seed + 1})", flush=True)
    kmsg.new()
    child = subprocess.Popen(
        UNPRIV + [sys.executable, str(vmlib.VM_DIR / "fuzzlib.py"), "--unpriv", "--seed",
                  str(seed + 1), "--messages", str(CHILD_MESSAGES), "--ioctls", str(CHILD_IOCTLS)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=vmlib.unpriv_env())
    t0 = time.monotonic()
    fz = fuzzlib.Fuzzer(seed, priv=True)
    try:
        root = fz.run(MESSAGES, IOCTLS, SCHEDULE)
        model_policies = dict(fz.model.policies)
        model_prefetch = dict(fz.model.prefetch)
    finally:
        fz.close()
        if child.poll() is None:
            try:
                child.wait(timeout=120)
            except subprocess.TimeoutExpired:
                child.kill()
    out, err = child.communicate()
    elapsed = time.monotonic() - t0
    print(json.dumps({k: v for k, v in root.items() if k != "policies"}, indent=1))
    print(f"unprivileged child: {out.strip()[:2000]} {err[-2000:]}")
    print(f"fuzz: {elapsed:.1f} s in the guest for {root['netlink']} + {CHILD_MESSAGES} "
          f"netlink messages and {root['ioctls']} + {CHILD_IOCTLS} ioctls")
    assert not root["failures"], f"seed {seed}:\n" + "\n".join(root["failures"])
    assert child.returncode == 0, err
    nobody = json.loads(out)
    assert not nobody["failures"], f"seed {seed + 1}, as nobody:\n" + "\n".join(
        nobody["failures"])
    assert root["netlink"] >= 10_000 and nobody["netlink"] == CHILD_MESSAGES
    # the fuzzer got deep: every command accepted some time, every door refused often
    for what in ("GET_INFO", "SET_POLICY", "GET_POLICY", "DEL_POLICY", "LIST_POLICIES",
                 "MIGRATE", "SET_PREFETCH", "SUBMIT", "ABI_VERSION", "not processed"):
        assert root["accepted"].get(what), (what, root["accepted"])
    for door, errs in (("netlink", ("EINVAL", "ERANGE", "ENOENT", "EOPNOTSUPP", "ENODEV", "EIO")),
                       ("ioctl", ("EINVAL", "EFAULT", "E2BIG", "ENOTTY", "ENODEV", "EIO"))):
        outcomes = root["outcomes"][door]
        for e in errs:
            alias = "ENOTSUP" if e == "EOPNOTSUPP" else e
            assert outcomes.get(e) or outcomes.get(alias), (door, e, outcomes)
    assert nobody["outcomes"]["netlink"].get("EPERM") and nobody["outcomes"]["ioctl"].get("EPERM")
    # the kernel said nothing bad
    log = kmsg.new()
    assert not kmsg.bad(log), "\n".join(kmsg.bad(log))
    # no leaks: policies deleted and the driver gone, nothing of gpuos's is left alive
    with Genl() as nl:
        assert {(k, c): p for k, c, p in nl.policies()} == model_policies
        nl.del_all_policies()
        # the prefetch ranges are the model's (the driver's lookup at each address space's
        # first range finds it), then cleared
        assert model_prefetch, "no prefetch ranges were ever stored"
        for as_id, ranges in model_prefetch.items():
            (base, length), start = ranges[0], ranges[0][0] // PREFETCH_WINDOW * PREFETCH_WINDOW
            want = (base, min(base + length, start + PREFETCH_WINDOW) - base)  # clipped to the window
            assert vmlib.dbg_write("prefetch_lookup", f"{as_id:#x} {base:#x}\n") == 0
            found = [tuple(int(x, 16) for x in line.split())
                     for line in vmlib.dbg_read("prefetch_lookup").splitlines()]
            assert want in found, (hex(as_id), ranges[:3], found)
            assert nl.request(Cmd.SET_PREFETCH, vmlib.u64(Attr.AS_ID, as_id))[0] == 0
    testdrv.unload_testdrv()  # completes what was pending, with -ENODEV
    with Genl() as nl:
        c = nl.counters()
    assert c["objects"] == 0 and c["policies"] == 0, c
    testdrv.rmmod("gpuos")
    assert not vmlib.module_loaded("gpuos")
    assert not kmsg.bad(kmsg.new())
    assert elapsed < 90, f"the fuzz run took {elapsed:.0f} s"
