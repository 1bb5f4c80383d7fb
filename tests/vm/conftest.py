"""Fixtures of the kernel-facing tests: the modules' lifecycle, clients, the kernel log.

This file is imported on the host too (tests/vmproxy.py reads the tests there without
importing them): only the standard library and vmlib at the top; what only the guest
has (pyroute2) is imported inside the fixtures.

One guest runs every test, in file order (test_10_* ... test_70_*, the destructive
unload tests last); a fixture brings the modules into the state a test needs and
leaves no policy or pending batch behind.
"""

from __future__ import annotations

import os

import pytest

import vmlib


@pytest.fixture(scope="session")
def kmsg():
    """The kernel log from the start of the session."""
    if not os.environ.get("GPUOS_IN_VM"):
        pytest.skip("kernel tests run in the VM guest (tests/vmproxy.py)")
    log = vmlib.Kmsg()
    yield log
    log.close()


@pytest.fixture(scope="session")
def kmod(kmsg):
    """The module lifecycle: gpuos.ko from $GPUOS_KMOD_DIR, loaded for the session (and
    reloaded by ``gpuos`` if a test unloaded it); the test driver loaded by the fixtures
    below, or with parameters through ``kmod.load_testdrv(caps=..., autoregister=...)``.
    Both are unloaded at the end."""
    ctl = vmlib.Kmod(os.environ["GPUOS_KMOD_DIR"])
    ctl.ensure_gpuos()
    yield ctl
    ctl.unload_all()


@pytest.fixture
def gpuos(kmod):
    """gpuos.ko loaded (the test driver as it is), no policies; cleaned up after."""
    kmod.ensure_gpuos()
    kmod.clean()
    yield kmod
    kmod.clean()


@pytest.fixture
def no_driver(gpuos):
    """gpuos.ko without any GPU driver: the test driver is unloaded."""
    gpuos.unload_testdrv()
    return gpuos


@pytest.fixture
def testdrv(gpuos):
    """The test driver with every capability, registered, async, nothing pending."""
    gpuos.load_testdrv()
    return gpuos


@pytest.fixture
def nl(gpuos):
    """The Python client (gpuos.kernel.netlink.GpuosNetlink)."""
    from gpuos.kernel.netlink import GpuosNetlink
    with GpuosNetlink() as client:
        yield client


@pytest.fixture
def raw(gpuos):
    """A raw generic netlink socket (vmlib.Genl)."""
    with vmlib.Genl() as sock:
        yield sock


@pytest.fixture
def sleepers():
    """Live sleeping processes, made on demand: ``sleepers()``; killed after."""
    made: list[vmlib.Sleeper] = []

    def make() -> vmlib.Sleeper:
        made.append(vmlib.Sleeper())
        return made[-1]
    yield make
    for s in made:
        s.kill()


@pytest.fixture
def cgroups():
    """Fresh cgroup v2 directories, made on demand: ``cgroups(name)``; removed after."""
    made: list[vmlib.Cgroup] = []

    def make(name: str = "gpuos-vmtest") -> vmlib.Cgroup:
        made.append(vmlib.Cgroup(name))
        return made[-1]
    yield make
    for cg in made:
        cg.remove()
