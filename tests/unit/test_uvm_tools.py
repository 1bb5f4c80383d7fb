"""UVM fault trackers (gpuos.faults.uvm_tools) and the MPS supervisor's source over them,
without a GPU: the layouts against gcc's sizes (the probe's self-test), decoding, and the
source's shape and order with a stand-in for the trackers. On a GPU host under MPS:
tests/gpu/test_mps_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from gpuos.faults.uvm_tools import (EVENT_FATAL_FAULT, FatalFault, FatalFaultInfoV2, FaultTrackers,
                                    decode_fatal, fault_event, recorded_at)
from gpuos.mps.faultsrc import PEER_YOUNG_S, MpsPeers, TrackerSource, client_of
from gpuos.mps.state import TRACKER_SOURCE

PROBE = Path(__file__).resolve().parents[2] / "tools" / "probes" / "uvm_tools_probe.py"


def test_the_probe_self_test_passes_on_the_shared_layouts():
    res = subprocess.run([sys.executable, str(PROBE), "--self-test"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "gpuos.faults.uvm_tools decodes a v2 fatal fault" in res.stdout


def test_only_fatal_faults_decode():
    f = FatalFaultInfoV2(eventType=EVENT_FATAL_FAULT, faultType=2, accessType=1, reason=2, address=0x1000,
                         timeStamp=5)
    raw = bytes(f) + bytes(72 - len(bytes(f)))
    assert decode_fatal(raw, 42) == FatalFault(42, 0x1000, "read", "invalid_pte", "invalid_permissions", 5)
    assert decode_fatal(bytes([3]) + raw[1:], 42) is None  # a gpu_fault: not what names a faulter
    assert decode_fatal(b"", 42) is None


def test_a_process_without_a_uvm_file_gets_no_tracker_and_no_note():
    t = FaultTrackers()
    try:
        assert t.track([os.getpid()]) == [] and t.procs == {} and t.poll() == []
    finally:
        t.close()


def test_a_process_whose_uvm_file_refuses_a_tracker_is_not_followed_until_one_is_made(monkeypatch):
    """A uvm file opened but not initialised yet refuses a tracker (NV_STATUS 0x16 on an
    H200): the process must not count as tracked (the supervisor then looks sooner), and
    its file is tried again."""
    from types import SimpleNamespace

    import gpuos.faults.uvm_tools as ut

    monkeypatch.setattr(ut, "uvm_fds", lambda pid, major: [5])
    t = FaultTrackers()
    refuse = [True]

    def tracker(pidfd, fd):
        if refuse[0]:
            raise ut.TrackerError(22, "UVM_TOOLS_INIT_EVENT_TRACKER_V2: NV_STATUS 0x16")
        return SimpleNamespace(tools_fd=-1, close=lambda: None, queue=SimpleNamespace(pending=lambda: 0))
    monkeypatch.setattr(t, "_tracker", tracker)
    me = os.getpid()
    try:
        assert t.track([me]) == [f"no fault tracker on pid {me}: [Errno 22] UVM_TOOLS_INIT_EVENT_TRACKER_V2: "
                                 "NV_STATUS 0x16"]
        assert me not in t.procs
        assert t.track([me]) == [] and me not in t.procs  # tried again, said once
        refuse[0] = False
        assert t.track([me]) == [] and len(t.procs[me].trackers) == 1
    finally:
        t.close()


class StandIn:
    """FaultTrackers' face: what poll() returns, and the pids track() was given."""

    def __init__(self):
        self.pending: list[FatalFault] = []
        self.tracked: list[list[int]] = []
        self.procs: dict[int, object] = {}  # those with a tracker
        self.closed = False

    def poll(self):
        out, self.pending = self.pending, []
        return out

    def track(self, pids):
        self.tracked.append(sorted(pids))
        return ["no fault tracker on pid 9: EPERM"] if 9 in pids else []

    def close(self):
        self.closed = True


def test_tracker_source_reports_each_fatal_fault_as_the_faulters_xid_31():
    stand_in, pids = StandIn(), [[5, 6]]
    stand_in.procs = {5: object()}
    src = TrackerSource(lambda: pids[0], stand_in)
    assert src.poll() == ([], []) and stand_in.tracked == [[5, 6]]
    assert src.untracked == [6]  # followed, no tracker yet: the supervisor looks again soon
    stand_in.pending = [FatalFault(6, 0x83bf1a800000, "write", "invalid_pde", "invalid_address", 7)]
    pids[0] = [5, 9]  # 6 left: its fault was read before it was let go
    faults, notes = src.poll()
    assert notes == ["no fault tracker on pid 9: EPERM"] and stand_in.tracked[-1] == [5, 9]
    (f,) = faults
    assert (f["xid"], f["fault_class"], f["pid"], f["source"]) == (31, "memory", 6, TRACKER_SOURCE)
    assert "pid 6" in f["text"] and "0x83bf1a800000" in f["text"] and f["mmu"]["access_type"] == "write"
    src.close()
    assert stand_in.closed


def test_the_watch_source_reports_from_its_thread_and_says_why_it_stopped():
    """`gpuos faults watch`'s source: each fatal fault becomes a FaultEvent from its thread
    (Xid 31, source uvm-tracker, the pid); a thread that breaks sets `error` (the stream
    says it once) and stop() closes the trackers."""
    import threading
    import time

    from gpuos.faults.uvm_tools import SOURCE, TrackerFaultSource

    stand_in = StandIn()
    stand_in.pending = [FatalFault(6, 0x1000, "write", "invalid_pde", "invalid_address", 7)]
    src = object.__new__(TrackerFaultSource)  # as root on a GPU host, less the checks
    src.trackers, src.every, src.error, src._stop, src._thread = stand_in, 0.01, None, threading.Event(), None
    src.pids = lambda: [6, 7]
    got = []
    src.start(got.append)
    deadline = time.monotonic() + 10
    while not (got and stand_in.tracked) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [(e.xid, e.source, e.pid, e.fault_class.value) for e in got] == [(31, SOURCE, 6, "memory")]
    assert stand_in.tracked[0] == [6, 7]

    def broken():
        raise ValueError("queue unreadable")
    stand_in.poll = broken
    while src.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert src.error == "UVM fault trackers: queue unreadable"
    src.stop()
    assert stand_in.closed


def test_peers_are_the_processes_whose_environment_names_a_pipe_of_ours(tmp_path):
    """A client gpuos did not start is followed from its environment, before any MPS client
    list shows it; a fresh fork is read again until it is PEER_YOUNG_S old (it may exec)."""
    proc = tmp_path / "proc"

    def process(pid: int, *env: str) -> None:
        (proc / str(pid)).mkdir(parents=True, exist_ok=True)
        (proc / str(pid) / "environ").write_bytes(b"\0".join(e.encode() for e in env) + b"\0")

    now = [100.0]
    peers = MpsPeers(["/g/pipe", "/g/slot1/pipe"], proc=proc, clock=lambda: now[0])
    process(10, "PATH=/bin", "CUDA_MPS_PIPE_DIRECTORY=/g/pipe")
    process(11, "CUDA_MPS_PIPE_DIRECTORY=/g/slot1/pipe")
    process(12, "CUDA_MPS_PIPE_DIRECTORY=/other/pipe")  # another MPS: not ours
    process(13, "X=CUDA_MPS_PIPE_DIRECTORY=/g/pipe")     # not the variable itself
    process(14, "HOME=/root")                            # a fork that will exec
    (proc / "self").mkdir()
    assert sorted(peers.scan()) == [10, 11]
    process(14, "CUDA_MPS_PIPE_DIRECTORY=/g/pipe")       # it exec'd a client: still young
    now[0] += PEER_YOUNG_S / 2
    assert sorted(peers.scan()) == [10, 11, 14]
    # Old processes' answers are kept: their environments are not read again.
    now[0] += PEER_YOUNG_S
    (proc / "10" / "environ").unlink()
    assert sorted(peers.scan()) == [10, 11, 14]
    # Gone processes are forgotten; a pid used again is read afresh.
    import shutil
    shutil.rmtree(proc / "11")
    assert sorted(peers.scan()) == [10, 14] and 11 not in peers.seen
    process(11, "HOME=/root")
    assert sorted(peers.scan()) == [10, 14]


def test_an_exited_processs_trackers_are_closed_off_the_callers_thread():
    """The close of a tracker may be the driver's teardown of an exited process's VA space
    (seconds after a fault): track() lets it go to the closer thread and returns; close()
    waits for it."""
    import threading

    from gpuos.faults.uvm_tools import _Process

    release, closed = threading.Event(), []

    class EmptyQueue:
        def pending(self):
            return 0

    class SlowTracker:
        queue = EmptyQueue()

        def close(self):
            release.wait(30)
            closed.append(True)

    t = FaultTrackers()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    t.procs[child.pid] = _Process(t.sys.pidfd_open(child.pid), [SlowTracker()], frozenset())
    child.wait()
    done = threading.Event()
    threading.Thread(target=lambda: (t.track([child.pid]), done.set()), daemon=True).start()
    assert done.wait(10), "track() waited for the tracker's close"
    assert t.procs == {} and not closed and not t.wait_closed(0)
    release.set()
    t.close()
    assert closed == [True] and t.wait_closed(0)


def test_a_clients_child_belongs_to_the_client_whose_session_it_runs_in():
    """gpuos starts each client in a session of its own: a process in that session (the
    client's CUDA child under a shell or a launcher) is that client's; others are not."""
    import subprocess
    leader = subprocess.Popen(["sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE,
                              start_new_session=True, text=True)
    other = subprocess.Popen(["sleep", "30"])  # in the test's own session
    try:
        child = int(leader.stdout.readline())
        assert client_of(child, {leader.pid}) == leader.pid
        assert client_of(leader.pid, {leader.pid}) is None  # a client is itself
        assert client_of(other.pid, {leader.pid}) is None
        assert client_of(None, {leader.pid}) is None
        assert client_of(2 ** 22 + 7, {leader.pid}) is None  # no such process
        # a grandchild that made a session of its own: found by its ancestors
        inner = subprocess.Popen(["sh", "-c", "setsid sleep 30 & echo $!; wait"], stdout=subprocess.PIPE,
                                 start_new_session=True, text=True)
        try:
            grandchild = int(inner.stdout.readline())
            deadline = time.time() + 5
            while client_of(grandchild, {inner.pid}) is None and time.time() < deadline:
                time.sleep(0.01)  # (setsid may fork once more before it execs sleep)
            assert client_of(grandchild, {inner.pid}) == inner.pid
            assert client_of(grandchild, {leader.pid}) is None
        finally:
            os.killpg(inner.pid, 9)
            subprocess.run(["pkill", "-9", "-P", str(inner.pid)], check=False)
            inner.wait()
    finally:
        for p in (leader, other):
            os.killpg(leader.pid, 9) if p is leader else p.kill()
            p.wait()


def test_a_fault_is_dated_when_uvm_recorded_it():
    """UVM's timestamp is CLOCK_MONOTONIC_RAW: the event's time is when the fault was
    recorded, not when the tracker was read; an implausible one falls back to the read."""
    assert recorded_at(9_750_000_000, now=1000.0, now_raw_ns=10_000_000_000) == 999.75
    assert recorded_at(0, now=1000.0, now_raw_ns=10_000_000_000) == 1000.0
    assert recorded_at(11_000_000_000, now=1000.0, now_raw_ns=10_000_000_000) == 1000.0  # future
    assert recorded_at(1, now=1000.0, now_raw_ns=4_000_000_000_000) == 1000.0  # over an hour
    # with the real clocks: a fault recorded now is dated now
    now_raw = time.clock_gettime_ns(time.CLOCK_MONOTONIC_RAW)
    ev = fault_event(FatalFault(6, 0x1000, "write", "invalid_pde", "invalid_address", now_raw - 50_000_000))
    assert abs(ev.time - (time.time() - 0.05)) < 0.02
