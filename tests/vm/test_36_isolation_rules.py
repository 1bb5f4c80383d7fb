"""nvidia-uvm's fault-isolation rules (patches/nvidia-uvm/uvm_gpuos_isolate.c) in the
kernel: gpuos_isotest.ko compiles the file unchanged and runs kmod/isotest/isolate_cases.h
when it loads, in process context and then under a spinlock with interrupts off, as
nvidia-uvm's fault path calls it.  On the debug kernel (KASAN, lockdep,
DEBUG_ATOMIC_SLEEP) the log check of every test (vmlib.KMSG_BAD) would catch anything
those report; the same cases run in user space under ASan and UBSan
(tests/unit/test_isolation_rules.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import vmlib

pytestmark = pytest.mark.vm

PARAMS = Path("/sys/module/gpuos_isotest/parameters")


@pytest.mark.parametrize("seed", [1, 0x5eed])
def test_isolation_rules_hold_in_the_kernel(kmod, kmsg, seed):
    kmsg.new()
    kmod.insmod("gpuos_isotest", seed=seed, rounds=1000)
    try:
        failed = int((PARAMS / "failed").read_text())
    finally:
        kmod.rmmod("gpuos_isotest")
    log = kmsg.settled()
    assert not kmsg.bad(log), "\n".join(log[-40:])
    summary = [line for line in log if "gpuos_isotest: seed" in line]
    assert summary and f"seed {seed}, 1000 random runs twice" in summary[-1], "\n".join(log[-20:])
    assert failed == 0, "\n".join(line for line in log if "gpuos_isotest: FAIL" in line)
