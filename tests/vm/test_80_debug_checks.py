"""The debug kernel's checks fire: the test driver commits a known bug (`plant`), and the
kernel log shows KASAN's, DEBUG_ATOMIC_SLEEP's and lockdep's report of it, which the
log check every test relies on (vmlib.KMSG_BAD) catches.  Only on a kernel built with
them (tools/vmtest/debug-kernel.sh, then `vmtest.py test --kernel-tree DIR`); skipped
on Debian's, which has none of them.  They run last: lockdep turns itself off after
its first report, and after a KASAN report too (so lockdep's plant comes first), and
test_70's check of the whole session's log must not see these reports (they are
forgotten once seen)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import vmlib

pytestmark = pytest.mark.vm

CHECKS = {  # the plant, what the kernel says, the config that makes it say so; in this order
    "lock_inversion": ("possible circular locking dependency detected", "CONFIG_PROVE_LOCKING"),
    "sleep_in_atomic": ("BUG: sleeping function called from invalid context", "CONFIG_DEBUG_ATOMIC_SLEEP"),
    "uaf": ("BUG: KASAN: use-after-free", "CONFIG_KASAN"),
}


def kernel_has(option: str) -> bool:
    """Whether the running kernel was built with OPTION: its .config, which vmtest gives
    the guest ($GPUOS_VM_KCONFIG; Debian's kernel has it in /boot)."""
    path = Path(os.environ.get("GPUOS_VM_KCONFIG") or f"/boot/config-{os.uname().release}")
    try:
        return f"{option}=y" in path.read_text().splitlines()
    except OSError:
        return False


@pytest.mark.parametrize("plant", list(CHECKS))
def test_the_debug_kernel_reports_a_planted_bug(testdrv, kmsg, plant):
    says, option = CHECKS[plant]
    if not kernel_has(option):
        pytest.skip(f"this kernel was built without {option} (tools/vmtest/debug-kernel.sh builds one with it)")
    kmsg.new()
    assert vmlib.dbg_write("plant", plant + "\n") == 0
    log = kmsg.settled()
    kmsg.forget(log)  # planted: not a finding of the session
    assert any(says in line for line in log), "\n".join(log[-40:])
    assert kmsg.bad(log), "the suite's log check would have missed it"
