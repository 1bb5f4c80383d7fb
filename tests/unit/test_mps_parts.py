"""The parts of gpuos mps that need no process: control answers, GPU matching, fault feeds,
the state file."""

from __future__ import annotations

import json
import os

import pytest

from gpuos.errors import GpuosError, MpsUnavailable, NoGpu
from gpuos.mps.checkpoint import absolute, newest
from gpuos.mps.control import DaemonInfo, _ints, find_mps_binaries, serves_gpu, server_ready
from gpuos.mps.faultsrc import FeedFiles, gpu_match, parse_feed_line
from gpuos.mps.gpu import GpuRef, MpsDirs, resolve_gpu
from gpuos.mps.state import Machine
from gpuos.mps.store import (EventLog, SavedState, StateStore, SupervisorLock, describe_event,
                             supervisor_pid)

GPU0 = GpuRef(index=0, uuid="GPU-aaaaaaaa-1111-2222-3333-444444444444", pci="00000000:3B:00.0")
GPU1 = GpuRef(index=1, uuid="GPU-bbbbbbbb-1111-2222-3333-444444444444", pci="00000000:5E:00.0")


def test_server_answers():
    assert _ints("123\n456\n\n") == [123, 456]
    assert _ints("Server 12 not found") == [12]
    assert server_ready("ACTIVE\n") and server_ready("active")
    for s in ("FAULT", "", "INITIALIZING", "Server 5 not found", "Invalid PID"):
        assert not server_ready(s), s


@pytest.mark.parametrize("visible,serves", [
    (None, True),                      # unset: every GPU
    ("0", True), ("1", False), ("1,0", True), ("", False),
    ("GPU-aaaaaaaa", True),            # CUDA accepts UUID prefixes
    ("GPU-bbbbbbbb-1111-2222-3333-444444444444", False),
    ("MIG-xyz", False),
    ("weird", True),                   # a form we do not parse: assume the worst
])
def test_which_daemons_conflict(visible, serves):
    d = DaemonInfo(pid=1, pipe_dir="/tmp/nvidia-mps", visible=visible, readable=True)
    assert serves_gpu(d, GPU0) is serves


def test_unreadable_or_unknown_means_conflict():
    assert serves_gpu(DaemonInfo(1, None, None, readable=False), GPU0)
    assert serves_gpu(DaemonInfo(1, "/p", "3", True), GpuRef(index=None, uuid="GPU-x"))
    assert "not readable" in DaemonInfo(1, None, None, False).describe()


def test_finding_the_binaries(tmp_path):
    control, server = tmp_path / "nvidia-cuda-mps-control", tmp_path / "nvidia-cuda-mps-server"
    with pytest.raises(MpsUnavailable, match="GPUOS_MPS_CONTROL"):
        find_mps_binaries({"GPUOS_MPS_CONTROL": str(control), "PATH": str(tmp_path)})
    control.write_text("#!/bin/sh\n")
    control.chmod(0o755)
    with pytest.raises(MpsUnavailable, match="nvidia-cuda-mps-server not found"):
        find_mps_binaries({"PATH": str(tmp_path)})
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    b = find_mps_binaries({"PATH": str(tmp_path)})
    assert (b.control, b.server) == (control, server)


def test_resolving_gpus():
    devs = [GPU0, GPU1]
    assert resolve_gpu("1", devs) == GPU1
    assert resolve_gpu(GPU1.uuid.upper().replace("GPU-", "GPU-"), devs) == GPU1
    assert resolve_gpu(None, devs) == GPU0
    with pytest.raises(NoGpu):
        resolve_gpu("7", devs)
    with pytest.raises(NoGpu):
        resolve_gpu("GPU-cccccccc", devs)
    with pytest.raises(GpuosError, match="GPU index"):
        resolve_gpu("first", devs)
    # without NVML the value is taken as given
    assert resolve_gpu("3", None) == GpuRef(index=3, uuid=None)
    assert resolve_gpu(GPU0.uuid, None).key == GPU0.uuid
    assert GpuRef(index=3, uuid=None).key == "3" and GPU0.visible == GPU0.uuid


def test_fault_events_are_matched_to_the_gpu():
    assert gpu_match({"gpu_uuid": GPU0.uuid}, GPU0) is True
    assert gpu_match({"gpu_uuid": GPU1.uuid}, GPU0) is False
    assert gpu_match({"pci": "0000:3b:00"}, GPU0) is True       # the driver's form vs NVML's
    assert gpu_match({"pci": "0000:5e:00"}, GPU0) is False
    assert gpu_match({"pci": "0000:3b:00"}, GpuRef(index=0, uuid=None)) is None
    assert gpu_match({}, GPU0) is None


def test_feed_lines_are_never_dropped():
    ev = parse_feed_line(json.dumps({"type": "fault", "xid": 31, "pci": "0000:3b:00", "time": 1.0,
                                     "source": "kmsg", "pid": 5}), "feed")
    assert ev["xid"] == 31 and ev["pid"] == 5
    assert ev["fault_class"] == "memory"  # classified from the Xid table
    unknown = parse_feed_line(json.dumps({"xid": 4242, "pci": "", "time": 1.0}), "feed")
    assert unknown["fault_class"] == "unknown" and unknown["xid"] == 4242
    junk = parse_feed_line("NVRM: something odd", "feed")
    assert junk["fault_class"] == "unknown" and junk["text"] == "NVRM: something odd"
    assert parse_feed_line("[1, 2]", "feed")["fault_class"] == "unknown"
    gap = parse_feed_line(json.dumps({"type": "kmsg-gap", "first": 1, "last": 9}), "feed")
    assert gap["fault_class"] == "unknown" and "lost" in gap["text"]
    assert parse_feed_line(json.dumps({"type": "mps-fault", "event": "fault"}), "feed") is None
    assert parse_feed_line("   ", "feed") is None
    odd = parse_feed_line(json.dumps({"fault_class": "sm", "color": "blue"}), "feed")
    assert odd["fault_class"] == "sm"


def test_feed_files_resume_from_their_offsets(tmp_path):
    f = tmp_path / "feed"
    f.write_text('{"xid": 1}\n')
    feeds = FeedFiles([str(f)])
    assert feeds.poll() == ([], [])  # history is not news
    with open(f, "a") as out:
        out.write('{"xid": 31, "pci": "", "time": 2}\n{"xid": 4')
    evs, _ = feeds.poll()
    assert [e["xid"] for e in evs] == [31]  # the half-written line waits
    again = FeedFiles([str(f)], feeds.offsets)
    with open(f, "a") as out:
        out.write('3, "pci": "", "time": 3}\n')
    assert [e["xid"] for e in again.poll()[0]] == [43]
    f.write_text("")
    evs, notes = again.poll()
    assert evs == [] and "shrank" in notes[0]


def test_state_file_round_trip_and_versions(tmp_path):
    dirs = MpsDirs(tmp_path / "mps" / "0")
    dirs.create()
    store = StateStore(dirs)
    assert store.load() is None
    m = Machine("0")
    store.save(SavedState(gpu=GPU0.to_dict(), machine=m.snapshot(), boot_id="b"))
    back = store.load()
    assert back.gpu == GPU0.to_dict() and Machine.from_snapshot(back.machine).snapshot() == m.snapshot()
    assert not any(p.name.endswith(".tmp") for p in dirs.root.iterdir())
    raw = json.loads(dirs.state.read_text())
    raw["format_version"] = 99
    dirs.state.write_text(json.dumps(raw))
    with pytest.raises(GpuosError, match="format_version 99"):
        store.load()
    dirs.state.write_text("{not json")
    with pytest.raises(GpuosError, match="not a gpuos MPS state file"):
        store.load()
    # unreadable and written before this boot (nothing is fsynced: a crash of the machine
    # can cut it short): set aside, as a previous boot's state is, and there is none
    os.utime(dirs.state, (1, 1))
    assert store.load() is None and not dirs.state.exists()
    (aside,) = dirs.root.glob("state-*-unreadable-previous-boot.json")
    assert aside.read_text() == "{not json"
    assert oct(os.stat(dirs.clients).st_mode & 0o777) == "0o700"


def test_supervisor_lock(tmp_path):
    dirs = MpsDirs(tmp_path / "g")
    assert supervisor_pid(dirs) is None
    a, b = SupervisorLock(dirs), SupervisorLock(dirs)
    assert a.try_acquire() and not b.try_acquire(patience=0.1)
    assert supervisor_pid(dirs) == os.getpid()
    a.release()
    assert supervisor_pid(dirs) is None and b.try_acquire()
    b.release()


def test_supervisor_lock_waits_out_a_look(tmp_path):
    """supervisor_pid() holds the lock shared for an instant to look; a supervisor that
    starts in that instant must not take it for another supervisor (seen on an H200: a
    fresh `gpuos mps start` failed with "another gpuos MPS supervisor runs")."""
    import fcntl
    import threading
    dirs = MpsDirs(tmp_path / "g")
    dirs.root.mkdir(parents=True)
    look = os.open(dirs.lock, os.O_RDONLY | os.O_CREAT)
    fcntl.flock(look, fcntl.LOCK_SH)  # a look, caught in the act
    t = threading.Timer(0.05, lambda: os.close(look))
    t.start()
    lock = SupervisorLock(dirs)
    try:
        assert lock.try_acquire()
    finally:
        t.join()
        lock.release()


def test_event_log_and_descriptions(tmp_path):
    seen = []
    log = EventLog(tmp_path / "events.jsonl", mirror=seen.append)
    ev = {"time": 0, "gpu": "0", "event": "fault", "state": "running", "incident": None,
          "fault": {"xid": 4242, "fault_class": "unknown", "pid": 7}, "attributed": True,
          "unknown": True}
    log.append(ev)
    (tmp_path / "events.jsonl").open("a").write("torn")
    assert log.read()[0] == ev and log.read()[-1]["event"] == "unreadable-line"
    assert seen == [ev]
    assert "Xid 4242 unknown pid 7 UNKNOWN Xid" in describe_event(ev)
    broken = EventLog(tmp_path / "e2", mirror=lambda e: 1 / 0)
    broken.append(ev)  # a broken mirror never loses our own log
    assert broken.read() == [ev] and "division" in broken.mirror_error


def test_a_slow_loop_turn_of_an_incident_is_said_with_where_it_went():
    """The supervisor's loop sees nothing else while it works: a turn of an incident that
    took SLOW_TURN_S or more is an event naming its parts; outside an incident, none."""
    from gpuos.mps.state import Incident, Machine, Settings
    from gpuos.mps.supervisor import SLOW_PART_S, SLOW_TURN_S, Supervisor

    sup = object.__new__(Supervisor)  # only what _timed and _say_slow_turn use
    sup.machine, sup.events, sup.say, sup._turn = Machine("GPU-x", Settings()), [], None, {}
    with sup._timed("faults"):
        pass
    sup._turn.update({"source TrackerSource": 0.2, "reap": SLOW_PART_S / 2})
    sup._say_slow_turn(0.25)
    assert sup.events == []  # no incident: nothing waits on the loop
    sup.machine.incident = Incident(id=3, opened=0.0, cause="fault", server_pid=7)
    sup._say_slow_turn(SLOW_TURN_S / 2)
    assert sup.events == []
    sup._say_slow_turn(0.25)
    (ev,) = sup.events
    assert (ev["event"], ev["incident"], ev["seconds"]) == ("slow-turn", 3, 0.25)
    assert ev["parts"] == {"source TrackerSource": 0.2}  # the parts under SLOW_PART_S left out


def test_the_loop_looks_again_soon_while_a_young_followed_process_has_no_tracker():
    """A client may fault within 0.1 s of making its context: while a process the trackers
    follow is young and has none yet, the loop polls every TRACK_SOON_S, else every poll;
    every LEAVING_POLL_S while a swapped incident waits for victims to begin exiting; and
    wakes when held victims are to be killed."""
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    from gpuos.mps.supervisor import LEAVING_POLL_S, TRACK_SOON_S, Options, Supervisor

    sup = object.__new__(Supervisor)
    sup.options = Options()
    leaving: list = []
    kill_at: list = []
    sup.machine = SimpleNamespace(leaving_victims=lambda: leaving,
                                  held_victims_deadline=lambda: kill_at[0] if kill_at else None)
    young = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        sup.sources = [SimpleNamespace(), SimpleNamespace(untracked=[1])]  # init: old
        assert sup._poll_timeout() == sup.options.poll
        sup.sources[1].untracked = [1, young.pid]
        assert sup._poll_timeout() == TRACK_SOON_S
        leaving.append(("c1", young.pid))
        assert sup._poll_timeout() == LEAVING_POLL_S < TRACK_SOON_S
        leaving.clear()
        sup.sources[1].untracked = [1, 2 ** 22 + 7]  # gone: no reason to hurry
        assert sup._poll_timeout() == sup.options.poll
        kill_at.append(time.time() + 0.1)
        assert 0.05 < sup._poll_timeout() <= 0.1
        kill_at[0] = time.time() - 1  # past: at once
        assert sup._poll_timeout() == 0.001
    finally:
        young.kill()
        young.wait()


def test_signal_tree_reaches_a_gpu_process_that_left_the_clients_group(monkeypatch):
    """A client's process group, and its descendants that made a session of their own and
    use CUDA (one here, by a stand-in predicate); a descendant that does not is left."""
    import signal
    import subprocess
    import time

    from gpuos import procs
    from gpuos.mps.launch import signal_tree

    leader = subprocess.Popen(["sh", "-c", "setsid sleep 30 & echo $!; setsid sleep 31 & echo $!; wait"],
                              stdout=subprocess.PIPE, start_new_session=True, text=True)
    gpu_kid, other_kid = int(leader.stdout.readline()), int(leader.stdout.readline())
    try:
        deadline = time.time() + 5
        while time.time() < deadline and not all(
                procs.exists(k) and os.getpgid(k) == k for k in (gpu_kid, other_kid)):
            time.sleep(0.01)  # each setsid has made its own group
        monkeypatch.setattr(procs, "uses_cuda", lambda pid: pid == gpu_kid)
        assert signal_tree(leader.pid, signal.SIGKILL)
        leader.wait(timeout=5)
        deadline = time.time() + 5
        while procs.alive(gpu_kid) and time.time() < deadline:
            time.sleep(0.01)
        assert not procs.alive(gpu_kid) and procs.alive(other_kid)
    finally:
        for k in (gpu_kid, other_kid):
            try:
                os.kill(k, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if leader.poll() is None:
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait()


# -- a client's own checkpoint (mps/checkpoint.py) ---------------------------------------------

def test_the_newest_checkpoint_of_a_file_a_directory_or_a_glob(tmp_path):
    uid = os.getuid()
    d = tmp_path / "ckpt"
    d.mkdir()
    assert newest(str(d), uid) is None  # nothing written yet
    assert newest(str(tmp_path / "missing.pt"), uid) is None
    old, new = d / "step-1.pt", d / "step-2"
    old.write_bytes(b"1")
    new.mkdir()  # a checkpoint directory counts by its own time
    os.utime(old, (1000, 1000))
    os.utime(new, (2000, 2000))
    assert newest(str(d), uid) == 2000
    assert newest(str(old), uid) == 1000
    assert newest(str(d / "*.pt"), uid) == 1000
    assert newest(str(d / "nothing-*"), uid) is None
    # only the client's user's own files count: the supervisor may run as root
    assert newest(str(d), uid + 1) is None
    assert absolute("ckpt/*.pt", "/work") == "/work/ckpt/*.pt"
    assert absolute("/abs/x", "/work") == "/abs/x"
