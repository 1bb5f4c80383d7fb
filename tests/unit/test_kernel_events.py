"""Gap detection: in the sequence numbers alone, and in an event stream fed through the
subscription's reading loop (a pipe and canned messages stand in for the netlink socket)."""

from __future__ import annotations

import errno
import os
from collections import deque

import pytest

from gpuos.errors import GpuosError, KmodNotLoaded
from gpuos.kernel.model import Event, Gap, GapDetector
from gpuos.kernel.uapi import EventType

from netlink_wire import FAMILY, event, info_reply


def test_no_gap_in_order():
    det = GapDetector(last=10)
    assert [det.feed(s) for s in (11, 12, 13)] == [None, None, None]
    assert det.missed == 0 and det.last == 13


def test_gap_is_reported_once_with_its_range():
    det = GapDetector(last=4)
    assert det.feed(5) is None
    gap = det.feed(9)
    assert gap == Gap(6, 8) and gap.count == 3
    assert gap.describe() == "missed 3 events (seq 6..8)"
    assert det.feed(10) is None
    assert det.missed == 3


def test_a_late_joiner_gap_counts_from_the_baseline():
    det = GapDetector(last=0)
    assert det.feed(3) == Gap(1, 2)


def test_without_baseline_the_first_event_starts_the_count():
    det = GapDetector()
    assert det.feed(1000) is None
    assert det.feed(1002) == Gap(1001, 1001)
    assert Gap(1001, 1001).describe() == "missed 1 event (seq 1001..1001)"


def test_an_event_that_raced_the_baseline_is_no_gap_and_does_not_rewind():
    det = GapDetector(last=7)  # GET_INFO said 7, but event 7 arrived after joining
    assert det.feed(7) is None
    assert det.feed(6) is None
    assert det.last == 7
    assert det.feed(8) is None


# -- the subscription's loop ---------------------------------------------------------



def nlk():
    return pytest.importorskip("gpuos.kernel.netlink")  # pyroute2


class FakeSocket:
    """Stands in for pyroute2's socket: a pipe to select on, batches of messages to get()."""

    def __init__(self, batches):
        self.prid = FAMILY
        self.batches = list(batches)
        self.r, self.w = os.pipe()
        for _ in self.batches:
            os.write(self.w, b"x")

    def fileno(self):
        return self.r

    def get(self):
        os.read(self.r, 1)
        batch = self.batches.pop(0)
        if isinstance(batch, BaseException):
            raise batch
        return batch

    def close(self):
        os.close(self.r)
        os.close(self.w)


def _event_msg(seq: int, etype: int = EventType.POLICY_SET):
    return nlk().decode(event(etype, seq))


def subscription(batches, last=None):
    sub = object.__new__(nlk().EventSubscription)
    sub._sock = FakeSocket(batches)
    sub.detector = GapDetector(last)
    sub.overflows = 0
    sub._pending = deque()
    return sub


def test_stream_reports_gaps_on_the_event_after_them():
    sub = subscription([[_event_msg(11), _event_msg(12)], [_event_msg(15)], [_event_msg(16)]],
                       last=10)
    try:
        got = [sub.next(timeout=1) for _ in range(4)]
        assert [e.seq for e in got] == [11, 12, 15, 16]
        assert [e.gap for e in got] == [None, None, Gap(13, 14), None]
        assert sub.missed == 2
        assert sub.next(timeout=0.05) is None  # nothing more: a timeout, not an error
    finally:
        sub._sock.close()


def test_stream_survives_a_socket_overflow():
    sub = subscription([[_event_msg(1)], OSError(errno.ENOBUFS, "No buffer space"),
                        [_event_msg(40)]], last=0)
    try:
        first, second = sub.next(timeout=1), sub.next(timeout=1)
        assert first.seq == 1 and first.gap is None
        assert second.seq == 40 and second.gap == Gap(2, 39)
        assert sub.overflows == 1
    finally:
        sub._sock.close()


def test_stream_skips_what_is_not_an_event_of_the_family():
    other = _event_msg(1)
    other["header"]["type"] = 2  # NLMSG_ERROR: an ack, say
    reply = nlk().decode(info_reply())
    sub = subscription([[other, reply, _event_msg(2)]], last=1)
    try:
        ev = sub.next(timeout=1)
        assert ev.seq == 2 and ev.gap is None
    finally:
        sub._sock.close()


def test_stream_read_errors_are_gpuos_errors():
    sub = subscription([OSError(errno.EBADF, "Bad file descriptor")])
    try:
        with pytest.raises(GpuosError, match="reading events"):
            sub.next(timeout=1)
    finally:
        sub._sock.close()


def _ctrl_msg(cmd: int, family_id: int, name: str):
    from pyroute2.netlink import GENL_ID_CTRL, ctrlmsg
    msg = ctrlmsg()
    msg["cmd"], msg["version"] = cmd, 2
    msg["attrs"] = [["CTRL_ATTR_FAMILY_NAME", name], ["CTRL_ATTR_FAMILY_ID", family_id]]
    msg["header"]["type"] = GENL_ID_CTRL
    msg.encode()
    out = ctrlmsg(msg.data)
    out.decode()
    return out


def test_stream_ends_when_the_family_is_unregistered():
    """rmmod gpuos drops the socket from the group silently: nlctrl's DELFAMILY ends the
    stream (KmodNotLoaded) instead of a recv that never returns."""
    from pyroute2.netlink import CTRL_CMD_DELFAMILY, CTRL_CMD_NEWFAMILY
    other = _ctrl_msg(CTRL_CMD_DELFAMILY, FAMILY + 1, "other")  # another family: ignored
    born = _ctrl_msg(CTRL_CMD_NEWFAMILY, FAMILY + 2, "newcomer")
    sub = subscription([[_event_msg(1), other, born], [_ctrl_msg(CTRL_CMD_DELFAMILY, FAMILY,
                                                                 "gpuos")]], last=0)
    try:
        assert sub.next(timeout=1).seq == 1
        with pytest.raises(KmodNotLoaded, match="unloaded"):
            sub.next(timeout=1)
    finally:
        sub._sock.close()


def test_iterating_yields_events():
    sub = subscription([[_event_msg(1), _event_msg(2)]])
    try:
        it = iter(sub)
        assert [next(it).seq, next(it).seq] == [1, 2]
    finally:
        sub._sock.close()


def test_event_json_has_no_gap_field():
    ev = Event(seq=3, time_ns=5, type=EventType.DRIVER_UNREGISTERED, driver_name="x",
               gap=Gap(1, 2))
    assert ev.to_json() == {"seq": 3, "time_ns": 5, "type": "driver-unregistered",
                            "driver_name": "x"}
