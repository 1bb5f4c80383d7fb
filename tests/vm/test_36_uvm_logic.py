"""gpuos's own nvidia-uvm logic (patches/nvidia-uvm/: the fault-isolation rules, the fault
batch report builder, the prefetch clipping) in the kernel: gpuos_uvmtest.ko compiles the
files unchanged and runs kmod/uvmtest/uvm_cases.h when it loads, in process context and
then under a spinlock with interrupts off, as nvidia-uvm's fault path calls them.  On the
debug kernel (KASAN, lockdep, DEBUG_ATOMIC_SLEEP) the log check of every test
(vmlib.KMSG_BAD) would catch anything those report; the same cases run in user space
under ASan and UBSan (tests/unit/test_uvm_logic.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.vm

PARAMS = Path("/sys/module/gpuos_uvmtest/parameters")


@pytest.mark.parametrize("seed", [1, 0x5eed])
def test_uvm_logic_holds_in_the_kernel(kmod, kmsg, seed):
    kmsg.new()
    kmod.insmod("gpuos_uvmtest", seed=seed, rounds=1000)
    try:
        failed = int((PARAMS / "failed").read_text())
    finally:
        kmod.rmmod("gpuos_uvmtest")
    log = kmsg.settled()
    assert not kmsg.bad(log), "\n".join(log[-40:])
    summary = [line for line in log if "gpuos_uvmtest: seed" in line]
    assert summary and f"seed {seed}, 1000 random runs twice" in summary[-1], "\n".join(log[-20:])
    assert failed == 0, "\n".join(line for line in log if "gpuos_uvmtest: FAIL" in line)
