"""The VM harness itself: the guest is what the kernel-facing tests expect.

Runs in the guest only (docs/vm-testing.md): the host stands in a proxy for each test.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.vm


def test_debian_kernel():
    assert os.uname().release == os.environ["GPUOS_VM_KVER"]


def test_tracefs_and_debugfs_mounted():
    mounts = {(m.split()[1], m.split()[2]) for m in Path("/proc/mounts").read_text().splitlines()}
    assert ("/sys/kernel/tracing", "tracefs") in mounts
    assert ("/sys/kernel/debug", "debugfs") in mounts


def test_kernel_python_libraries():
    import bcc  # noqa: F401
    import pyroute2  # noqa: F401


def test_setpriv_drops_root():
    out = subprocess.run(["setpriv", "--reuid=65534", "id", "-u"], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "65534"


def test_gpuos_module_loads():
    ko = Path(os.environ["GPUOS_KMOD_DIR"]) / "gpuos.ko"
    if not ko.exists():
        pytest.skip("no gpuos.ko was built (vmtest.py modules)")
    for mod in ("gpuos_testdrv", "gpuos"):  # the other vm tests' fixture may hold them
        if Path("/sys/module", mod, "initstate").exists():
            subprocess.run(["rmmod", mod], check=True)
    subprocess.run(["insmod", str(ko)], check=True)
    try:
        assert Path("/sys/module/gpuos").is_dir()
    finally:
        subprocess.run(["rmmod", "gpuos"], check=True)
