"""/dev/gpuos: GPUOS_IOC_ABI_VERSION and GPUOS_IOC_SUBMIT, every error the header lists,
through the Python client (gpuos.kernel.chardev) and raw ioctls where the errno matters."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct

import pytest

import vmlib
from fuzzlib import LIBC, PAGE, PROT_NONE, Pages, sys_ioctl
from gpuos.errors import InvalidRequest, LimitReached, NoDriverRegistered
from gpuos.kernel.chardev import Chardev, build_batch
from gpuos.kernel.model import Range
from gpuos.kernel.uapi import (DEST_GPU, IOC_ABI_VERSION, IOC_SUBMIT, MAX_PENDING, MAX_RANGES,
                               RANGE_EVICT_FIRST, RANGE_EVICT_LAST, EventType, GpuosBatch, Op,
                               _IOC, _IOR, _IOWR)

pytestmark = pytest.mark.vm

HDR = vmlib.header_defines()
OK = Range(0x1000, 0x1000, DEST_GPU(0))


def submit(fd, op=Op.MIGRATE, ranges=(OK,), as_id=9, **kw):
    """A raw GPUOS_IOC_SUBMIT: (errno, batch_id, statuses). The statuses start at -99."""
    batch, array = build_batch(as_id, op, list(ranges), **kw)
    for i in range(len(ranges)):
        array[i].status = -99
    err = sys_ioctl(fd, IOC_SUBMIT, ctypes.addressof(batch))
    return err, batch.batch_id, [array[i].status for i in range(len(ranges))]


@pytest.fixture
def dev(gpuos):
    fd = os.open("/dev/gpuos", os.O_RDWR)
    yield fd
    os.close(fd)


def test_device_and_abi_version(gpuos):
    st = os.stat("/dev/gpuos")
    assert stat.S_ISCHR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o666
    with Chardev() as c:
        assert c.abi_version() == int(HDR["GPUOS_ABI_VERSION"]) == 1
    fd = os.open("/dev/gpuos", os.O_RDONLY)  # reading the version needs no write access
    try:
        v = ctypes.c_uint32(0xFFFFFFFF)
        assert sys_ioctl(fd, IOC_ABI_VERSION, ctypes.addressof(v)) == 0 and v.value == 1
        assert sys_ioctl(fd, IOC_ABI_VERSION, 0) == errno.EFAULT
        assert sys_ioctl(fd, IOC_ABI_VERSION, 0xFFFFFFFF81000000) == errno.EFAULT  # kernel
    finally:
        os.close(fd)


def test_submit_happy_path(testdrv, dev):
    ranges = [Range(0x1000, 0x1000, DEST_GPU(0)), Range(0x200000, 0x10000, DEST_GPU(31), 7),
              Range(0xFFFFFFFFFFFFE000, 0x1000)]  # up to the last page: no overflow
    err, b1, st = submit(dev, Op.MIGRATE, ranges, as_id=0x1234)
    assert err == 0 and b1 > 0 and st == [0, 0, 0]
    err, b2, st = submit(dev, Op.HINT, [Range(0, 0x1000, flags=RANGE_EVICT_FIRST),
                                        Range(0x1000, 0x1000, flags=RANGE_EVICT_LAST)])
    assert err == 0 and b2 == b1 + 1 and st == [0, 0]
    with Chardev() as c:  # the client
        res = c.submit(5, Op.MIGRATE, [OK] * MAX_RANGES)  # the most a batch takes
        assert res.batch_id == b2 + 1 and res.statuses == [0] * MAX_RANGES
    assert vmlib.pending() == [(b1, 0x1234, 0, 3), (b2, 9, 1, 2), (b2 + 1, 5, 0, MAX_RANGES)]
    from gpuos.kernel.netlink import GpuosNetlink
    with GpuosNetlink() as nl, nl.subscribe() as sub:
        vmlib.complete(b2 + 1, *([0] * (MAX_RANGES - 1) + [-22]))
        ev = sub.next(timeout=10)
    assert ev.type == EventType.MIGRATION_DONE and ev.batch_id == b2 + 1 and ev.gap is None
    assert ev.statuses == [0] * (MAX_RANGES - 1) + [-22]


def test_submit_validation_errors(testdrv, dev):
    def rejected():
        with vmlib.Genl() as nl:
            return nl.counters()["rejected"]
    before = rejected()
    for kw, want in [({"size": 0}, errno.EINVAL), ({"size": 39}, errno.EINVAL),
                     ({"size": 41}, errno.EINVAL), ({"size": 0xFFFFFFFF}, errno.EINVAL),
                     ({"op": 2}, errno.EINVAL), ({"op": 0xFFFFFFFF}, errno.EINVAL),
                     ({"flags": 1}, errno.EINVAL), ({"flags": 1 << 31}, errno.EINVAL),
                     ({"nr_ranges": 0}, errno.EINVAL),
                     ({"nr_ranges": MAX_RANGES + 1}, errno.E2BIG),
                     ({"nr_ranges": 0xFFFFFFFF}, errno.E2BIG)]:
        op = kw.pop("op", Op.MIGRATE)
        err, bid, st = submit(dev, op, [OK], **kw)
        assert (err, bid, st) == (want, 0, [-99]), (kw, op)  # nothing read or written back
    bad_ranges = [
        (Op.MIGRATE, Range(0x1001, 0x1000)),  # unaligned base
        (Op.MIGRATE, Range(0x1000, 0x1800)),  # unaligned len
        (Op.MIGRATE, Range(0x1000, 0)),  # empty
        (Op.MIGRATE, Range(0xFFFFFFFFFFFFF000, 0x2000)),  # base + len overflows
        (Op.MIGRATE, Range(0xFFFFFFFFFFFFF000, 0x1000)),  # ... to exactly 2^64
        (Op.MIGRATE, Range(0x1000, 0x1000, DEST_GPU(32))),  # past GPUOS_MAX_GPUS
        (Op.MIGRATE, Range(0x1000, 0x1000, 0xFFFFFFFF)),
        (Op.MIGRATE, Range(0x1000, 0x1000, 0, 8)),  # past GPUOS_MAX_PRIO
        (Op.MIGRATE, Range(0x1000, 0x1000, flags=RANGE_EVICT_FIRST)),  # flags on a migrate
        (Op.HINT, Range(0x1000, 0x1000)),  # a hint needs one end of the list
        (Op.HINT, Range(0x1000, 0x1000, flags=RANGE_EVICT_FIRST | RANGE_EVICT_LAST)),
        (Op.HINT, Range(0x1000, 0x1000, flags=4)),
    ]
    for op, bad in bad_ranges:
        good = Range(0x4000, 0x1000, flags=RANGE_EVICT_FIRST if op == Op.HINT else 0)
        err, bid, st = submit(dev, op, [good, bad, good, bad])
        assert (err, bid, st) == (errno.EINVAL, 0, [0, -errno.EINVAL, 0, -errno.EINVAL]), bad
    assert vmlib.pending() == []  # nothing reached the driver
    assert rejected() - before == 11 + len(bad_ranges)
    with Chardev() as c:  # the client: InvalidRequest, with the statuses
        with pytest.raises(InvalidRequest) as exc:
            c.submit(1, Op.MIGRATE, [OK, Range(0x1000, 0)])
        assert exc.value.statuses == [0, -errno.EINVAL] and "rejected range 1" in str(exc.value)
        with pytest.raises(InvalidRequest, match="too many ranges"):
            c.submit(1, Op.MIGRATE, [OK], nr_ranges=MAX_RANGES + 1)


def test_submit_bad_pointers(testdrv, dev):
    mem = Pages(2)  # two pages, then a PROT_NONE guard
    hole = LIBC.mmap(None, PAGE, 3, 0x22, -1, 0)
    LIBC.munmap(hole, PAGE)  # an address just unmapped
    try:
        def ranges_at(ptr, nr=1):
            batch = GpuosBatch(size=40, op=0, as_id=1, nr_ranges=nr, flags=0, ranges=ptr)
            return sys_ioctl(dev, IOC_SUBMIT, ctypes.addressof(batch))
        for ptr in (0, 8, hole, mem.guard, 0xFFFFFFFF81000000, 0xFFFF888000000000,
                    0x0000800000000000, 0xFFFFFFFFFFFFFFF0):
            assert ranges_at(ptr) == errno.EFAULT, hex(ptr)
        # one readable range, the second one in the guard page
        Pages.write(mem.guard - 32, struct.pack("=QQIIIi", 0x1000, 0x1000, 1, 0, 0, 0))
        assert ranges_at(mem.guard - 32, nr=2) == errno.EFAULT
        assert vmlib.pending() == []
        assert ranges_at(mem.guard - 32, nr=1) == 0  # the same range alone is fine
        for ptr in (0, 8, hole, mem.guard, mem.guard - 20, 0xFFFFFFFF81000000):
            assert sys_ioctl(dev, IOC_SUBMIT, ptr) == errno.EFAULT, hex(ptr)  # the batch itself
        assert sys_ioctl(dev, IOC_ABI_VERSION, mem.guard) == errno.EFAULT
        # a read-only batch is read, and submitted; then its id cannot be written back
        Pages.write(mem.addr, bytes(GpuosBatch(size=40, op=0, as_id=1, nr_ranges=1, flags=0,
                                               ranges=mem.guard - 32)))
        Pages.protect(mem.addr, PAGE, 1)
        assert sys_ioctl(dev, IOC_ABI_VERSION, mem.addr) == errno.EFAULT
        assert sys_ioctl(dev, IOC_SUBMIT, mem.addr) == errno.EFAULT
        assert len(vmlib.pending()) == 2  # "the batch still completes, with its event"
        Pages.protect(mem.addr, PAGE, PROT_NONE)
        assert sys_ioctl(dev, IOC_SUBMIT, mem.addr) == errno.EFAULT
        assert len(vmlib.pending()) == 2
    finally:
        mem.close()


def test_submit_without_driver_and_pending_limit(gpuos, dev):
    gpuos.unload_testdrv()
    assert submit(dev)[0] == errno.ENODEV
    assert submit(dev, ranges=[Range(0x1000, 0)])[0] == errno.EINVAL  # checked first
    with Chardev() as c, pytest.raises(NoDriverRegistered):
        c.submit(1, Op.MIGRATE, [OK])
    gpuos.load_testdrv()
    for i in range(MAX_PENDING):
        assert submit(dev)[0] == 0, i
    assert submit(dev)[0] == errno.EAGAIN
    with Chardev() as c, pytest.raises(LimitReached):
        c.submit(1, Op.MIGRATE, [OK])
    assert len(vmlib.pending()) == MAX_PENDING
    bid = vmlib.pending()[0][0]
    vmlib.complete(bid, 0)
    assert submit(dev)[0] == 0  # room again


def test_unknown_ioctls_are_enotty(gpuos, dev):
    buf = ctypes.create_string_buffer(64)
    for req in (_IOWR(ord("G"), 0x02, 40), _IOWR(ord("G"), 0x01, 48),  # SUBMIT, other size
                _IOR(ord("G"), 0x00, 8), _IOC(0, ord("G"), 0x01, 0), _IOWR(ord("H"), 0x01, 40),
                0, 0x1234, 0xFFFFFFFF):
        assert req not in (IOC_ABI_VERSION, IOC_SUBMIT)
        assert sys_ioctl(dev, req, ctypes.addressof(buf)) == errno.ENOTTY, hex(req)
