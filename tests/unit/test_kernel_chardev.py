"""/dev/gpuos: the batch as the ioctl sees it, and errnos as one-line GpuosErrors."""

from __future__ import annotations

import ctypes
import errno

import pytest

from gpuos.errors import (GpuosError, InvalidRequest, KmodNotLoaded, KmodVersionMismatch,
                          LimitReached, NoDriverRegistered, NoSuchPolicy, NoSuchProcess, NotPermitted,
                          NotSupported)
from gpuos.kernel import chardev, uapi
from gpuos.kernel.chardev import Chardev, build_batch
from gpuos.kernel.errnos import kernel_error
from gpuos.kernel.model import Range, SubmitResult
from gpuos.kernel.uapi import DEST_GPU, GpuosBatch, GpuosRange, Op


def test_batch_points_at_the_ranges():
    ranges = [Range(0x10000, 0x2000, DEST_GPU(0), 1), Range(0x40000, 0x1000, 0, 7, 0)]
    batch, array = build_batch(99, Op.MIGRATE, ranges)
    assert (batch.size, batch.op, batch.as_id, batch.nr_ranges, batch.flags, batch.batch_id) == \
        (ctypes.sizeof(GpuosBatch), 0, 99, 2, 0, 0)
    seen = [GpuosRange.from_address(batch.ranges + i * ctypes.sizeof(GpuosRange))
            for i in range(batch.nr_ranges)]
    assert [(r.base, r.len, r.dest, r.prio, r.flags, r.status) for r in seen] == \
        [(0x10000, 0x2000, 1, 1, 0, 0), (0x40000, 0x1000, 0, 7, 0, 0)]
    assert ctypes.addressof(array) == batch.ranges


def test_batch_fields_can_be_made_wrong_for_tests():
    batch, _ = build_batch(1, 7, [], flags=1, size=8, nr_ranges=5000)
    assert (batch.op, batch.flags, batch.size, batch.nr_ranges, batch.ranges) == (7, 1, 8, 5000, 0)


def test_missing_device_means_module_not_loaded(tmp_path):
    with pytest.raises(KmodNotLoaded, match="gpuos.ko is not loaded"):
        Chardev(str(tmp_path / "gpuos"))


def test_a_device_without_the_ioctl_is_another_version():
    with pytest.raises(KmodVersionMismatch, match="does not know this ioctl"):
        Chardev("/dev/null")
    with Chardev("/dev/null", check_abi=False) as dev:  # opening alone works
        assert dev.fd >= 0
    assert dev.fd == -1


@pytest.mark.parametrize("code, cls, words", [
    (errno.EPERM, NotPermitted, "needs CAP_SYS_ADMIN"),
    (errno.ENOENT, NoSuchPolicy, "no such policy"),
    (errno.ESRCH, NoSuchProcess, "no such process"),
    (errno.ENOSPC, LimitReached, "at most 4096 policies"),
    (errno.ENODEV, NoDriverRegistered, "no GPU driver registered with gpuos"),
    (errno.EOPNOTSUPP, NotSupported, "does not support"),
    (errno.EINVAL, InvalidRequest, "rejected the request as invalid"),
    (errno.E2BIG, InvalidRequest, "at most 4096 a batch"),
    (errno.EAGAIN, LimitReached, "1024 batches already await the GPU driver"),
    (errno.EFAULT, InvalidRequest, "bad address"),
    (errno.ENOTTY, KmodVersionMismatch, "does not know this ioctl"),
    (errno.EIO, GpuosError, "Input/output error"),
])
def test_errnos_become_one_line_errors(code, cls, words):
    err = kernel_error(-code, "submitting a batch", needs="CAP_SYS_ADMIN")
    assert type(err) is cls
    assert err.message.startswith("submitting a batch: ") and words in err.message
    assert "\n" not in err.message


def test_the_kernels_extended_ack_is_kept():
    err = kernel_error(errno.EINVAL, "setting a policy", detail="Unknown attribute type")
    assert err.message.endswith("(Unknown attribute type)")


def test_an_extended_ack_that_only_repeats_the_privilege_is_not_said_twice():
    err = kernel_error(errno.EPERM, "setting a policy", detail="needs CAP_SYS_ADMIN")
    assert err.message == "setting a policy: not permitted (needs CAP_SYS_ADMIN)"


def test_netlink_batches_have_their_own_limit():
    err = kernel_error(errno.E2BIG, "submitting a batch of 2000 range(s)", max_ranges=1024)
    assert "at most 1024 a batch" in err.message


# -- submit, against a stand-in for the ioctl --------------------------------------------


class FakeIoctl:
    """Does what gpuos.ko does with the ioctl's argument (and the memory it points to)."""

    def __init__(self, abi=1, fail=None, bad_ranges=()):
        self.abi, self.fail, self.bad_ranges, self.calls = abi, fail, set(bad_ranges), []

    def __call__(self, fd, request, arg, mutate):
        assert mutate is True
        self.calls.append(request)
        if request == uapi.IOC_ABI_VERSION:
            arg.value = self.abi
            return 0
        assert request == uapi.IOC_SUBMIT and arg.size == ctypes.sizeof(GpuosBatch)
        ranges = [GpuosRange.from_address(arg.ranges + i * ctypes.sizeof(GpuosRange))
                  for i in range(arg.nr_ranges)]
        if self.bad_ranges:
            for i, r in enumerate(ranges):
                r.status = -errno.EINVAL if i in self.bad_ranges else 0
            raise OSError(errno.EINVAL, "Invalid argument")
        if self.fail:
            raise OSError(self.fail, "failed")
        arg.batch_id = 1000 + arg.nr_ranges
        for r in ranges:
            r.status = 0
        return 0


@pytest.fixture
def fake_ioctl(monkeypatch):
    def install(**kw):
        fake = FakeIoctl(**kw)
        monkeypatch.setattr(chardev.fcntl, "ioctl", fake)
        return fake
    return install


def test_open_checks_the_abi(fake_ioctl):
    fake_ioctl(abi=1)
    with Chardev("/dev/null") as dev:
        assert dev.abi_version() == 1
    fake_ioctl(abi=2)
    with pytest.raises(KmodVersionMismatch, match="ioctl ABI is version 2"):
        Chardev("/dev/null")


def test_submit_returns_the_batch_id_and_statuses(fake_ioctl):
    fake_ioctl()
    with Chardev("/dev/null") as dev:
        res = dev.submit(5, Op.MIGRATE, [Range(0, 4096), Range(8192, 4096, DEST_GPU(1))])
    assert res == SubmitResult(batch_id=1002, statuses=[0, 0])


def test_submit_names_the_ranges_the_module_rejected(fake_ioctl):
    fake_ioctl(bad_ranges={1, 2})
    with Chardev("/dev/null") as dev, pytest.raises(InvalidRequest) as exc:
        dev.submit(5, Op.MIGRATE, [Range(0, 4096), Range(1, 4096), Range(0, 0)])
    assert exc.value.statuses == [0, -errno.EINVAL, -errno.EINVAL]
    assert exc.value.message.startswith("submitting a batch of 3 range(s): gpuos.ko rejected "
                                        "ranges 1, 2 ")


def test_submit_without_a_driver(fake_ioctl):
    fake_ioctl(fail=errno.ENODEV)
    with Chardev("/dev/null") as dev, pytest.raises(NoDriverRegistered) as exc:
        dev.submit(5, Op.HINT, [Range(0, 4096)])
    assert exc.value.message == "submitting a batch of 1 range(s): no GPU driver registered " \
                                "with gpuos"
