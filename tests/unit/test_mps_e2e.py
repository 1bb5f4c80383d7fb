"""`gpuos mps` end to end, with the fake MPS of tests/fake_mps (no GPU, no driver).

The real command runs in subprocesses against a fake nvidia-cuda-mps-control (and
-server, and nvidia-smi) and fake CUDA clients that connect to the fake server; a
client faults on cue, which takes every client of the server down, and writes a
fault event to the feed the supervisor follows.  Each test has its own GPUOS_HOME
and its own made-up GPU UUID, and kills whatever it started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from gpuos.procs import alive

from helpers import gpuos, gpuos_env, gpuos_json, wait_for

FAKES = Path(__file__).resolve().parents[1] / "fake_mps"


@pytest.fixture(scope="session")
def fake_bin(tmp_path_factory) -> Path:
    """The fakes, with this interpreter in their #! line (no env, no pyenv shims: fast)."""
    d = tmp_path_factory.mktemp("fakebin")
    for f in FAKES.iterdir():
        if f.is_dir():
            continue
        text = f.read_text()
        if text.startswith("#!"):
            text = f"#!{sys.executable}\n" + text.split("\n", 1)[1]
        (d / f.name).write_text(text)
        (d / f.name).chmod(0o755)
    return d


def _kill_ours(marker: str) -> None:
    """SIGKILL every process whose environment mentions marker (this test's directory)."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in env:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


class Mps:
    """One test's gpuos home, fake GPU and fake MPS, and shortcuts to drive them."""

    def __init__(self, home: Path, tmp: Path, bin_: Path):
        self.tmp, self.bin = tmp, bin_
        self.uuid = f"GPU-{uuid.uuid4()}"
        self.feed = tmp / "faults.jsonl"
        self.feed.touch()
        self.smi = tmp / "smi"
        self.env = gpuos_env(home, GPUOS_MPS_CONTROL=str(bin_ / "nvidia-cuda-mps-control"),
                             GPUOS_NVIDIA_SMI=str(bin_ / "nvidia-smi"),
                             FAKE_NVIDIA_SMI_STATE=str(self.smi),
                             FAKE_MPS_FAULT_FEED=str(self.feed))
        for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_VISIBLE_DEVICES"):
            self.env.pop(k, None)
        self.dir = home / "mps" / self.uuid
        self.n = 0

    def __call__(self, *args: str, env: dict | None = None, timeout: float = 60):
        return gpuos(env or self.env, *args, timeout=timeout)

    def json(self, *args: str) -> tuple[int, dict]:
        if "--" not in args:
            return gpuos_json(self.env, *args)
        cut = args.index("--")  # --json before the command
        res = self(*args[:cut], "--json", *args[cut:])
        try:
            return res.returncode, json.loads(res.stdout)
        except ValueError:
            raise AssertionError(f"no JSON: {res.stdout!r} {res.stderr!r}") from None

    def start(self, *extra: str, env: dict | None = None, feed: bool = True) -> dict:
        args = ["mps", "start", "--gpu", self.uuid, "--no-kmsg", "--no-nvml", "--poll", "0.05",
                "--drain-grace", "1.5", "--kill-grace", "0.5", *extra, "--json"]
        if feed:
            args[4:4] = ["--fault-feed", str(self.feed)]
        res = self(*args, env=env)
        assert res.returncode == 0, (res.stdout, res.stderr)
        return json.loads(res.stdout)

    def client(self, *extra: str, opts: tuple[str, ...] = (), name: str | None = None
               ) -> tuple[str, Path]:
        """`gpuos mps run [opts] -- fake_client.py --log LOG [extra]`; its id and log."""
        self.n += 1
        log = self.tmp / f"{name or 'client'}-{self.n}.log"
        code, data = self.json("mps", "run", *opts, "--", str(self.bin / "fake_client.py"),
                               "--log", str(log), *extra)
        assert code == 0, data
        return data["client"], log

    def state(self) -> dict:
        return json.loads((self.dir / "state.json").read_text())

    def machine(self) -> dict:
        return self.state()["machine"]

    def events(self) -> list[dict]:
        p = self.dir / "events.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []

    def names(self) -> list[str]:
        return [e["event"] for e in self.events()]

    def wait_incident_closed(self, n: int = 1, timeout: float = 15) -> dict:
        def closed():
            h = self.machine()["history"]
            return h[n - 1] if len(h) >= n else None
        return wait_for(closed, timeout, f"incident {n} closed")

    def supervisor_pid(self) -> int | None:
        try:
            return int((self.dir / "supervisor.lock").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None


@pytest.fixture
def mps(home, tmp_path, fake_bin):
    m = Mps(home.home, tmp_path, fake_bin)
    yield m
    m("mps", "stop", "--force", "--grace", "0.2", "--gpu", m.uuid, timeout=30)
    _kill_ours(str(tmp_path))


def lines(log: Path, word: str) -> list[str]:
    return [ln for ln in log.read_text().splitlines() if ln.startswith(word)] if log.exists() else []


def connected(log: Path, n: int = 1) -> bool:
    return len(lines(log, "connected")) >= n




# -- the whole loop -------------------------------------------------------------------------------

def test_fault_recovery_end_to_end(mps, home):
    info = mps.start()
    assert info["state"] == "running" and info["env"]["CUDA_VISIBLE_DEVICES"] == mps.uuid
    assert info["compute_mode"] is None and info["compute_mode_now"] == "Default"
    assert Path(info["pipe_dir"]) == mps.dir / "pipe"
    trigger = mps.tmp / "fault-now"
    a, alog = mps.client(name="victim")
    b, blog = mps.client("--fault-when", str(trigger), name="faulter")
    wait_for(lambda: connected(alog) and connected(blog), 10, "both clients connected")
    code, cl = mps.json("mps", "clients")
    assert code == 0
    rows = {r["id"]: r for r in cl["clients"]}
    assert rows[a]["state"] == rows[b]["state"] == "running"
    assert rows[a]["connected"] and rows[b]["connected"] and rows[a]["policy"] == "restart"
    old = {a: rows[a]["pid"], b: rows[b]["pid"]}

    trigger.touch()
    inc = mps.wait_incident_closed()
    assert inc["outcome"] == "recovered"
    assert [f["xid"] for f in inc["faults"]] == [31] and inc["faults"][0]["fault_class"] == "memory"
    victims = {v["client"]: v for v in inc["victims"]}
    assert set(victims) == {a, b}
    assert victims[b]["role"] == "named" and victims[a]["role"] == "victim"
    assert all(v["recovery"] == "restarted" for v in victims.values())
    # Both run again, connected to the server, each started exactly twice.
    wait_for(lambda: connected(alog, 2) and connected(blog, 2), 10, "victims reconnected")
    assert len(lines(alog, "start")) == 2 and len(lines(blog, "start")) == 2
    assert lines(alog, "error") == ["error CUDA error: an illegal memory access was encountered"]
    m = mps.machine()
    for cid in (a, b):
        c = m["clients"][cid]
        assert c["state"] == "running" and c["restarts"] == 1 and c["pid"] != old[cid]
        assert alive(c["pid"]) and not alive(old[cid])
    # Every step is in the event log, in order, and in the fault journal.
    names = mps.names()
    order = ["fault", "incident-opened", "drained", "server-ready", "victim-restarted",
             "incident-closed"]
    assert [names.index(n) for n in order] == sorted(names.index(n) for n in order)
    journal = [json.loads(x) for x in (home.home / "faults" / "faults.jsonl").read_text().splitlines()]
    assert {r["type"] for r in journal} >= {f"mps-{n}" for n in order}
    assert all(r["gpu"] == mps.uuid for r in journal if r["type"].startswith("mps-"))
    # status shows it, for people and for scripts
    code, st = mps.json("mps", "status", "--events", "50")
    g = st["gpus"][0]
    assert g["state"] == "running" and g["supervisor_running"] and not g["unfinished"]
    assert g["clients"] == {"running": 2} and g["incidents"][0]["outcome"] == "recovered"
    human = mps("mps", "status").stdout
    assert "incident 1: fault (Xid 31) -> recovered" in human and f"{b} (named by the fault): restarted" in human

    res = mps("mps", "stop", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["state"] == "stopped" and sorted(out["clients_stopped"]) == sorted([a, b])
    m = mps.machine()
    assert not any(alive(c["pid"]) for c in m["clients"].values())
    assert not (mps.dir / "pipe" / "nvidia-cuda-mps-control.pid").exists()
    assert mps.supervisor_pid() is None or not alive(mps.supervisor_pid())
    again = mps("mps", "stop")
    assert again.returncode == 0 and "not running" in again.stdout


def test_the_incident_says_the_work_lost_since_the_clients_checkpoint(mps):
    """`gpuos mps run --checkpoint`: the supervisor looks at the checkpoint's newest file, and
    the incident says each victim lost the work since it (a client without one: its run)."""
    mps.start()
    ckpt = mps.tmp / "ckpt"
    ckpt.mkdir()
    trigger = mps.tmp / "fault-now"
    a, alog = mps.client(opts=("--checkpoint", str(ckpt)), name="victim")
    b, blog = mps.client("--fault-when", str(trigger), name="faulter")
    wait_for(lambda: connected(alog) and connected(blog), 10, "both clients connected")
    (ckpt / "step-1.pt").write_bytes(b"x")
    written = (ckpt / "step-1.pt").stat().st_mtime
    def seen() -> float | None:
        code, cl = mps.json("mps", "clients")
        return next(r["checkpoint_at"] for r in cl["clients"] if r["id"] == a)
    assert wait_for(seen, 10, "the checkpoint seen") == pytest.approx(written)
    assert mps.machine()["clients"][a]["checkpoint"] == str(ckpt)
    time.sleep(0.5)
    trigger.touch()
    inc = mps.wait_incident_closed()
    victims = {v["client"]: v for v in inc["victims"]}
    opened = inc["opened"]
    assert victims[a]["resumes_from"] == "checkpoint"
    # from the checkpoint to the end of the victim's run: its exit, which the fake server's
    # fault brings a moment before the fault event opens the incident
    assert opened - written - 0.5 < victims[a]["lost_s"] <= opened - written + 0.01
    assert victims[a]["lost_s"] < victims[a]["ran_s"]
    assert victims[b]["resumes_from"] == "start" and victims[b]["lost_s"] == victims[b]["ran_s"]
    human = mps("mps", "status").stdout
    assert f"{a}: restarted, {victims[a]['lost_s']:.1f} s of work lost (since its checkpoint)" in human


def test_end_faulted_server_kills_it_at_the_incident(mps):
    """--end-faulted-server: the faulted server is SIGKILLed as the incident opens (not left
    FAULT until its clients have gone); its clients' connections break, they exit, and are
    restarted on a new server."""
    mps.start("--end-faulted-server")
    trigger = mps.tmp / "fault-now"
    a, alog = mps.client(name="victim")
    b, blog = mps.client("--fault-when", str(trigger), name="faulter")
    wait_for(lambda: connected(alog) and connected(blog), 10, "both clients connected")
    faulted = wait_for(lambda: mps.machine()["server_pid"], 10, "the server seen")
    assert mps.machine()["settings"]["end_faulted_server"] is True
    trigger.touch()
    inc = mps.wait_incident_closed()
    assert inc["outcome"] == "recovered"
    assert {v["recovery"] for v in inc["victims"]} == {"restarted"}
    ended = [e for e in mps.events() if e["event"] == "server-ended"]
    assert [e["server_pid"] for e in ended] == [faulted]
    names = mps.names()
    assert names.index("incident-opened") < names.index("server-ended") < names.index("server-ready")
    wait_for(lambda: not alive(faulted), 5, "the faulted server gone")
    assert mps.machine()["server_pid"] not in (None, faulted)
    wait_for(lambda: connected(alog, 2) and connected(blog, 2), 10, "victims reconnected")
    assert mps("mps", "stop").returncode == 0


def test_standby_waits_at_cuinit_then_takes_the_victims_place(mps, libgpuos_build):
    """Policy standby with the real libgpuos on its fake driver: each client's standby runs
    up to its first cuInit and waits there, outside the server; after the fault it is
    released, connects to the new server and is the client from then on; new standbys
    are started; stop takes them all."""
    lib = dict(GPUOS_LIBGPUOS=str(libgpuos_build / "libgpuos.so"),
               LD_LIBRARY_PATH=str(libgpuos_build / "fakecuda"))
    mps.env.update(lib)
    mps.start("--policy", "standby")
    trigger = mps.tmp / "fault-now"
    a, alog = mps.client("--cuinit", name="victim")
    b, blog = mps.client("--cuinit", "--fault-when", str(trigger), name="faulter")

    def standbys() -> dict | None:
        cs = mps.machine()["clients"]
        got = {cid: cs[cid]["standby_pid"] for cid in (a, b)}
        return got if all(got.values()) else None
    sb = wait_for(standbys, 15, "both standbys started")
    logs = {a: alog, b: blog}
    # Each standby started, and waits at cuInit: it never reached the driver or the server.
    for cid, pid in sb.items():
        wait_for(lambda: f"start {pid}" in lines(logs[cid], "start"), 10, "standby started")
    time.sleep(1.0)
    for cid, pid in sb.items():
        assert alive(pid) and f"cuinit {pid}" not in lines(logs[cid], "cuinit")
        assert len(lines(logs[cid], "connected")) == 1  # the client's own
    old = {cid: mps.machine()["clients"][cid]["pid"] for cid in (a, b)}
    code, cl = mps.json("mps", "clients")
    assert code == 0 and {r["id"]: r["standby_pid"] for r in cl["clients"]} == sb
    assert "STANDBY" in mps("mps", "clients").stdout

    trigger.touch()
    inc = mps.wait_incident_closed()
    assert inc["outcome"] == "recovered"
    assert {v["client"]: v["recovery"] for v in inc["victims"]} == {a: "took-over", b: "took-over"}
    m = mps.machine()
    for cid in (a, b):
        c = m["clients"][cid]
        assert c["pid"] == sb[cid] and c["state"] == "running" and c["restarts"] == 1
        assert not alive(old[cid])
        wait_for(lambda: f"cuinit {sb[cid]}" in lines(logs[cid], "cuinit") and connected(logs[cid], 2),
                 10, "the standby went on to the new server")
        assert len(lines(logs[cid], "start")) == 2  # no third copy of the command was run
    assert "victim-took-over" in mps.names()
    new = wait_for(standbys, 15, "new standbys")
    assert all(new[cid] not in (sb[cid], old[cid]) for cid in (a, b))
    fifos = sorted(p.name for p in (mps.dir / "standby").iterdir())
    # the released ones are gone; the new ones' with their state files
    assert fifos == sorted(f"{cid}.2{x}" for cid in (a, b) for x in ("", ".state"))

    res = mps("mps", "stop", "--json")
    assert res.returncode == 0, res.stderr
    wait_for(lambda: not any(alive(p) for p in new.values()), 10, "standbys stopped")
    assert not list((mps.dir / "standby").iterdir())


def test_a_standby_is_started_again_from_a_newer_checkpoint(mps, libgpuos_build):
    """--checkpoint with policy standby: a standby resumes from the checkpoint there was at its
    start, so once a newer one has settled (and the standby is --standby-refresh old) it is
    replaced by one that starts from it; the incident then says the take-over lost only
    the work since that checkpoint."""
    mps.env.update(GPUOS_LIBGPUOS=str(libgpuos_build / "libgpuos.so"),
                   LD_LIBRARY_PATH=str(libgpuos_build / "fakecuda"))
    mps.start("--policy", "standby", "--standby-refresh", "1")
    ckpt = mps.tmp / "ckpt.pt"
    trigger = mps.tmp / "fault-now"
    a, alog = mps.client("--cuinit", opts=("--checkpoint", str(ckpt)), name="victim")
    b, blog = mps.client("--cuinit", "--fault-when", str(trigger), name="faulter")

    def standby(cid: str, other_than: int | None = None) -> int | None:
        pid = mps.machine()["clients"][cid]["standby_pid"]
        return pid if pid and pid != other_than else None
    first = wait_for(lambda: standby(a), 15, "the victim's standby started")
    wait_for(lambda: standby(b), 15, "the faulter's standby started")
    time.sleep(1.5)
    assert standby(a) == first  # no checkpoint yet: kept
    ckpt.write_bytes(b"x")
    written = ckpt.stat().st_mtime
    second = wait_for(lambda: standby(a, other_than=first), 20, "a standby from the checkpoint")
    # make before break: it took the old one's place once it waited (libgpuos said so in
    # its FIFO's state file), and only then was the old one stopped
    wait_for(lambda: not alive(first), 10, "the old standby stopped")
    assert f"start {second}" in lines(alog, "start")
    names = [(e["event"], e.get("pid")) for e in mps.events()]
    assert names.index(("standby-refreshed", second)) < names.index(("standby-stopped", first))
    stopped = [e for e in mps.events() if e["event"] == "standby-stopped" and e.get("pid") == first]
    assert stopped and stopped[0]["why"] == "a newer checkpoint: its replacement, started from it, waits"
    assert mps.machine()["clients"][a]["standby_state_at"] == pytest.approx(written)
    wait_for(lambda: f"start {second}" in lines(alog, "start"), 10, "the new standby waits")
    trigger.touch()
    inc = mps.wait_incident_closed()
    v = {x["client"]: x for x in inc["victims"]}
    assert v[a]["recovery"] == "took-over" and mps.machine()["clients"][a]["pid"] == second
    assert v[a]["resumes_from"] == "checkpoint"
    assert inc["opened"] - written - 0.5 < v[a]["lost_s"] <= inc["opened"] - written + 0.01  # to its exit
    assert v[b]["resumes_from"] == "start"


def test_spare_server_warm_standbys_take_over_at_once(mps, libgpuos_build):
    """--spare-server: a second fake control daemon; each client's standby is its client,
    past cuInit and connected, waiting at its first launch.  A fault on the active server
    releases them at once: they are the clients, on the other server, and launch; the
    faulted server is restarted as the spare and hosts the next standbys; stop takes
    both daemons."""
    lib = dict(GPUOS_LIBGPUOS=str(libgpuos_build / "libgpuos.so"),
               LD_LIBRARY_PATH=str(libgpuos_build / "fakecuda"))
    mps.env.update(lib)
    out = mps.start("--policy", "standby", "--spare-server")
    trigger = mps.tmp / "fault-now"
    a, alog = mps.client("--cuinit", "--launch", name="victim")
    b, blog = mps.client("--cuinit", "--launch", "--fault-when", str(trigger), name="faulter")
    logs = {a: alog, b: blog}

    def warm() -> dict | None:
        cs = mps.machine()["clients"]
        got = {cid: cs[cid]["standby_pid"] for cid in (a, b) if cs[cid]["standby_warm"]}
        return got if len(got) == 2 and all(got.values()) else None
    sb = wait_for(warm, 20, "two warm standbys")
    for cid, pid in sb.items():
        wait_for(lambda: connected(logs[cid], 2), 10, "the standby connected to the spare")
    time.sleep(1.0)
    m = mps.machine()
    assert m["slot"] == 0 and m["spare"] == "ready"
    for cid, pid in sb.items():
        server_of = {int(x.split()[2]): int(x.split()[1]) for x in lines(logs[cid], "connected")}
        client_pid = m["clients"][cid]["pid"]
        assert server_of[client_pid] == m["server_pid"] != server_of[pid]  # the standby: the spare's
        assert alive(pid) and lines(logs[cid], "launched") == [f"launched {client_pid}"]
    assert (mps.dir / "pipe").resolve() == (mps.dir / "slot0" / "pipe").resolve()
    # Each client, under libgpuos, wrote down the kernel it launched; its standby, waiting
    # at the same launch, loaded it ahead (libgpuos/src/preload.c).
    for cid, pid in sb.items():
        listed = mps.dir / "kernels" / cid / "launched.txt"
        wait_for(lambda: listed.exists() and listed.read_text().split() == ["fake_noop"], 10,
                 "the client's kernel list")
        report = listed.with_name(f"launched.txt.standby.{pid}")
        wait_for(lambda: report.exists() and json.loads(report.read_text())["loaded"] == 1, 10,
                 "the standby's kernel loaded ahead")
    code, cl = mps.json("mps", "clients")
    assert code == 0 and {r["id"]: (r["standby_preload"] or {}).get("loaded") for r in cl["clients"]} == \
        {a: 1, b: 1}
    assert f"{sb[a]} (warm, 1/1 kernels ahead)" in mps("mps", "clients").stdout
    old = {cid: m["clients"][cid]["pid"] for cid in (a, b)}

    trigger.touch()
    inc = mps.wait_incident_closed()
    assert inc["outcome"] == "recovered"
    assert {v["client"]: v["recovery"] for v in inc["victims"]} == {a: "took-over", b: "took-over"}
    names = mps.names()
    # released at the swap, not once the faulted server was back
    assert names.index("servers-swapped") < names.index("standby-releasing") < names.index("spare-ready")
    assert "server-ready" not in names
    m = mps.machine()
    assert m["slot"] == 1 and m["spare"] == "ready"
    for cid in (a, b):
        c = m["clients"][cid]
        assert c["pid"] == sb[cid] and c["state"] == "running" and not alive(old[cid])
        wait_for(lambda: f"launched {sb[cid]}" in lines(logs[cid], "launched"), 10, "released")
    assert (mps.dir / "pipe").resolve() == (mps.dir / "slot1" / "pipe").resolve()
    new = wait_for(lambda: (w := warm()) and all(w[c] != sb[c] for c in w) and w, 20,
                   "new warm standbys, on the restarted server")
    code, st = mps.json("mps", "status")
    spare = st["gpus"][0]["spare"]
    assert code == 0 and spare["state"] == "ready" and spare["slot"] == 0

    res = mps("mps", "stop", "--json")
    assert res.returncode == 0, res.stderr
    wait_for(lambda: not any(alive(p) for p in [*new.values(), *sb.values()]), 10, "all stopped")
    for slot in (0, 1):
        assert not (mps.dir / f"slot{slot}" / "pipe" / "nvidia-cuda-mps-control.pid").exists()


def test_warm_standbys_share_their_clients_start_up_memory(mps, libgpuos_build):
    """--share-standby-memory: clients and their warm standbys run with libgpuos's
    sharing on, and each standby maps its client's weights instead of its own copy; its
    report, in `gpuos mps clients --json`, says so."""
    mps.env.update(GPUOS_LIBGPUOS=str(libgpuos_build / "libgpuos.so"),
                   LD_LIBRARY_PATH=str(libgpuos_build / "fakecuda"))
    bad = mps("mps", "start", "--gpu", mps.uuid, "--share-standby-memory")
    assert bad.returncode == 2 and "--share-standby-memory needs --spare-server" in bad.stderr
    mps.start("--policy", "standby", "--spare-server", "--share-standby-memory")
    trigger = mps.tmp / "fault-now"
    a, alog = mps.client("--cuinit", "--launch", "--weights", name="server")
    b, blog = mps.client("--cuinit", "--launch", "--fault-when", str(trigger), name="faulter")

    def shared(other_than: int | None = None) -> dict | None:
        code, cl = mps.json("mps", "clients")
        row = next(r for r in cl["clients"] if r["id"] == a)
        got = ((row["standby_preload"] or {}).get("memory_shared") or {})
        return got if got.get("asked") and row["standby_pid"] != other_than else None
    got = wait_for(shared, 30, "the standby asked its client for its memory")
    assert (got["allocations"], got["bytes"], got["restored"]) == (1, 4 << 20, 0), got
    assert "4.0 MiB of its client's memory shared" in mps("mps", "clients").stdout
    code, st = mps.json("mps", "status")
    assert st["gpus"][0]["spare"]["share_standby_memory"] is True
    # A standby that took over serves its memory in turn: the next standby maps it.
    first = mps.machine()["clients"][a]["standby_pid"]
    trigger.touch()
    inc = mps.wait_incident_closed()
    assert {v["client"]: v["recovery"] for v in inc["victims"]}[a] == "took-over"
    assert mps.machine()["clients"][a]["pid"] == first
    got = wait_for(lambda: shared(other_than=first), 30, "the next standby shares with the one that took over")
    assert (got["allocations"], got["bytes"]) == (1, 4 << 20), got


def test_hold_victims_stops_them_until_the_standbys_took_over(mps, libgpuos_build):
    """--hold-victims: the victims are stopped as the incident opens, their warm standbys
    released in the same turn, and the victims SIGKILLed the hold's length later (a victim
    that stays, --stubborn, is gone in half a second, not at the drain's SIGTERM 10 s on)."""
    mps.env.update(GPUOS_LIBGPUOS=str(libgpuos_build / "libgpuos.so"),
                   LD_LIBRARY_PATH=str(libgpuos_build / "fakecuda"))
    res = mps("mps", "start", "--hold-victims", "0.5")  # nothing to hold for without a spare
    assert res.returncode == 2 and "--hold-victims needs --spare-server" in res.stderr, res.stderr
    assert mps.supervisor_pid() is None
    mps.start("--policy", "standby", "--spare-server", "--hold-victims", "0.5")
    assert mps.machine()["settings"]["hold_victims"] == 0.5
    code, st = mps.json("mps", "status")
    assert code == 0 and st["gpus"][0]["spare"]["hold_victims"] == 0.5
    assert "on a fault: victims held 0.5 s" in mps("mps", "status").stdout
    trigger = mps.tmp / "fault-now"
    a, alog = mps.client("--cuinit", "--launch", "--stubborn", name="victim")
    b, blog = mps.client("--cuinit", "--launch", "--fault-when", str(trigger), name="faulter")

    def warm() -> dict | None:
        cs = mps.machine()["clients"]
        got = {cid: cs[cid]["standby_pid"] for cid in (a, b) if cs[cid]["standby_warm"]}
        return got if len(got) == 2 and all(got.values()) else None
    sb = wait_for(warm, 20, "two warm standbys")
    wait_for(lambda: connected(alog, 2) and connected(blog, 2), 10, "the standbys connected")
    old = {cid: mps.machine()["clients"][cid]["pid"] for cid in (a, b)}
    t0 = time.time()
    trigger.touch()
    inc = mps.wait_incident_closed()
    assert {v["client"]: v["recovery"] for v in inc["victims"]} == {a: "took-over", b: "took-over"}
    ev = {e["event"]: e for e in mps.events()}
    held = ev["victims-held"]
    assert old[a] in held["pids"] and set(held["pids"]) <= set(old.values())
    assert time.time() - t0 < 5  # not the drain's SIGTERM
    names = mps.names()
    assert names.index("victims-held") < names.index("standby-releasing") < names.index("held-victims-killed")
    assert ev["held-victims-killed"]["time"] - held["time"] >= 0.5
    signalled = {v["pid"]: v["signalled"] for v in inc["victims"] if v["pid"] in held["pids"]}
    # the stubborn victim was killed; the faulter, held as it was already exiting by
    # itself (a stop does not hold an exit), may have gone before the kill
    assert signalled[old[a]] == "SIGKILL" and set(signalled.values()) <= {"SIGSTOP", "SIGKILL"}, signalled
    assert not any(alive(p) for p in old.values())
    m = mps.machine()
    assert all(m["clients"][cid]["pid"] == sb[cid] for cid in (a, b))
    assert mps("mps", "stop").returncode == 0


def test_spare_server_supervisor_killed_then_resumed_and_stopped(mps, libgpuos_build):
    """A spare-server supervisor SIGKILLed: `gpuos mps start` resumes it, adopting both
    daemons and the warm standbys (none started twice); with it killed again, `gpuos mps
    stop` stops clients, standbys and both daemons by itself."""
    mps.env.update(GPUOS_LIBGPUOS=str(libgpuos_build / "libgpuos.so"),
                   LD_LIBRARY_PATH=str(libgpuos_build / "fakecuda"))
    mps.start("--policy", "standby", "--spare-server")
    a, alog = mps.client("--cuinit", "--launch", name="a")

    def warm() -> int | None:
        c = mps.machine()["clients"][a]
        return c["standby_pid"] if c["standby_warm"] and c["standby_pid"] else None
    sb = wait_for(warm, 20, "a warm standby")
    daemons = {s: int((mps.dir / f"slot{s}" / "pipe" / "nvidia-cuda-mps-control.pid").read_text())
               for s in (0, 1)}
    sup = mps.supervisor_pid()
    os.kill(sup, signal.SIGKILL)
    wait_for(lambda: not alive(sup), 10, "supervisor gone")
    mps.start("--policy", "standby", "--spare-server")
    wait_for(lambda: mps.supervisor_pid() not in (None, sup), 10, "a new supervisor")
    wait_for(lambda: "spare-adopted" in mps.names(), 10, "the spare adopted")
    m = mps.machine()
    assert m["daemon_pid"] == daemons[0] and m["spare_daemon_pid"] == daemons[1]
    assert m["clients"][a]["standby_pid"] == sb and alive(sb)
    assert len(lines(alog, "start")) == 2  # the client and its one standby: nothing started again
    os.kill(mps.supervisor_pid(), signal.SIGKILL)
    res = mps("mps", "stop", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["state"] == "stopped"
    wait_for(lambda: not any(alive(p) for p in [sb, m["clients"][a]["pid"], *daemons.values()]), 10,
             "client, standby and both daemons stopped")


def test_server_crash_without_fault_report_is_recovered(mps):
    env = {**mps.env, "FAKE_MPS_FAULT_MODE": "crash"}
    mps.start(env=env, feed=False)  # no fault source: the server's death is the evidence
    trigger = mps.tmp / "go"
    a, alog = mps.client(name="a")
    b, blog = mps.client("--fault-when", str(trigger), name="b")
    wait_for(lambda: connected(alog) and connected(blog), 10, "connected")
    first_server = int(lines(alog, "connected")[0].split()[1])
    trigger.touch()
    inc = mps.wait_incident_closed()
    assert inc["cause"] == "server-exit" and inc["outcome"] == "recovered"
    wait_for(lambda: connected(alog, 2) and connected(blog, 2), 10, "reconnected")
    second_server = int(lines(alog, "connected")[1].split()[1])
    assert second_server != first_server and not alive(first_server)
    assert mps.machine()["server_pid"] == second_server
    assert "server-exited" in mps.names()


def test_stubborn_victim_killed_hook_and_none_policies(mps):
    mps.start()
    trigger = mps.tmp / "go"
    hook_out = mps.tmp / "hook.env"
    hook = f"env | grep ^GPUOS_MPS_ | sort > {hook_out}; echo hooked"
    s, slog = mps.client("--stubborn", "--ignore-term", name="stubborn")
    h, hlog = mps.client(opts=("--policy", "hook", "--hook", hook), name="hooked")
    n, nlog = mps.client("--fault-when", str(trigger), opts=("--policy", "none"), name="none")
    wait_for(lambda: all(connected(x) for x in (slog, hlog, nlog)), 10, "connected")
    stubborn_pid = mps.machine()["clients"][s]["pid"]
    trigger.touch()
    inc = mps.wait_incident_closed()
    v = {x["client"]: x for x in inc["victims"]}
    assert v[s]["signalled"] == "SIGKILL" and v[s]["recovery"] == "restarted"
    assert not alive(stubborn_pid)
    assert v[h]["recovery"] == "hook-ok" and v[n]["recovery"] == "not-recovered"
    assert v[n]["role"] == "named" and inc["outcome"] == "recovered"
    env = dict(x.split("=", 1) for x in hook_out.read_text().splitlines())
    assert env["GPUOS_MPS_CLIENT"] == h and env["GPUOS_MPS_INCIDENT"] == "1"
    assert env["GPUOS_MPS_FAULT_XIDS"] == "31" and env["GPUOS_MPS_VICTIM_EXIT"] == "1"
    assert "fake_client.py" in env["GPUOS_MPS_VICTIM_CMD"] and env["GPUOS_MPS_GPU"] == mps.uuid
    assert "hooked" in (mps.dir / "output" / f"{h}.log").read_text()
    names = mps.names()
    assert names.count("drain-timeout") == 2  # SIGTERM, then SIGKILL
    m = mps.machine()
    assert m["clients"][h]["state"] == "hooked" and m["clients"][n]["state"] == "not-recovered"


@pytest.mark.parametrize("hold,resume", [("mps-recovering", "recover"), ("mps-spawned", "recover"),
                                         ("mps-spawned", "start")])
def test_supervisor_killed_mid_recovery_resumes(mps, hold, resume):
    hold_file = mps.tmp / "held"
    env = {**mps.env, "GPUOS_TEST_HOLD_AT": hold, "GPUOS_TEST_HOLD_FILE": str(hold_file)}
    mps.start(env=env)
    trigger = mps.tmp / "go"
    a, alog = mps.client(name="a")
    b, blog = mps.client("--fault-when", str(trigger), name="b")
    wait_for(lambda: connected(alog) and connected(blog), 10, "connected")
    trigger.touch()
    wait_for(hold_file.exists, 15, "the supervisor at the hold point")
    sup = int(hold_file.read_text().split()[0])
    os.kill(sup, signal.SIGKILL)
    wait_for(lambda: not alive(sup), 5, "supervisor dead")
    m = mps.machine()
    assert m["state"] == "recovering"
    code, st = mps.json("mps", "status")
    g = st["gpus"][0]
    assert not g["supervisor_running"] and g["unfinished"] and g["incident"]["id"] == 1
    assert "recover" in mps("mps", "status").stdout
    res = mps("mps", "run", "--", "true")
    assert res.returncode == 37 and "recover" in res.stderr  # reported, not silently lost

    if resume == "recover":
        code, rec = mps.json("mps", "recover")
        assert code == 0, rec
        assert rec["resumed"] and rec["was"] == "recovering" and rec["state"] == "running"
        inc = rec["incident"]
    else:
        info = mps.start()
        assert info["resumed"] == "recovering"
        inc = mps.wait_incident_closed()
    assert all(v["recovery"] == "restarted" for v in inc["victims"]) and inc["outcome"] == "recovered"
    wait_for(lambda: connected(alog, 2) and connected(blog, 2), 10, "victims back")
    # Exactly once: each victim started twice in all, one process each now.
    time.sleep(0.3)
    assert len(lines(alog, "start")) == 2 and len(lines(blog, "start")) == 2
    resumed = [e for e in mps.events() if e["event"] == "supervisor-resumed"]
    assert len(resumed) == 1 and resumed[0]["was"] == "recovering"
    adopted = [e for e in mps.events() if e["event"] == "victim-restarted" and e["adopted"]]
    assert len(adopted) == (1 if hold == "mps-spawned" else 0)
    assert mps.supervisor_pid() != sup and alive(mps.supervisor_pid())


def test_dead_control_daemon_is_restarted_and_clients_left_alone(mps):
    mps.start()
    a, alog = mps.client(name="a")
    wait_for(lambda: connected(alog), 10, "connected")
    m = mps.machine()
    pid, daemon = m["clients"][a]["pid"], m["daemon_pid"]
    os.kill(daemon, signal.SIGKILL)
    inc = mps.wait_incident_closed()
    assert inc["cause"] == "daemon-exit" and inc["outcome"] == "recovered" and inc["victims"] == []
    m = mps.machine()
    assert m["daemon_pid"] != daemon and alive(m["daemon_pid"])
    assert m["clients"][a]["pid"] == pid and alive(pid)  # untouched
    assert len(lines(alog, "start")) == 1


def test_unknown_xid_is_reported_and_recovered(mps):
    mps.start()
    trigger = mps.tmp / "go"
    a, alog = mps.client(name="a")
    b, blog = mps.client("--fault-when", str(trigger), "--xid", "4242", name="b")
    wait_for(lambda: connected(alog) and connected(blog), 10, "connected")
    trigger.touch()
    inc = mps.wait_incident_closed()
    faults = [e for e in mps.events() if e["event"] == "fault"]
    assert faults and faults[0]["fault"]["xid"] == 4242 and faults[0]["unknown"]
    assert faults[0]["fault"]["fault_class"] == "unknown"
    assert 4242 in [f["xid"] for f in inc["faults"]]  # linked to the incident, never dropped
    assert inc["outcome"] == "recovered"
    assert "UNKNOWN Xid" in mps("mps", "status", "--events", "100").stdout


def test_a_fault_event_wakes_the_supervisor(mps):
    """Fault sources wake the supervisor's loop (here the feed's directory, watched with
    inotify) instead of waiting for its next poll: with a 3 s poll, each event is taken
    within half a second, three times in a row (by chance: about 1 in 200)."""
    mps.start("--poll", "3")
    time.sleep(1.0)
    for k in range(3):
        t = time.time()
        with open(mps.feed, "a") as f:
            f.write(json.dumps({"type": "fault", "xid": 4242, "pci": "0000:00:06", "time": t,
                                "source": "kmsg", "text": f"wake probe {k}"}) + "\n")

        def seen():
            return next((e for e in mps.events() if e["event"] == "fault"
                         and e["fault"].get("text") == f"wake probe {k}"), None)
        ev = wait_for(seen, 10, f"fault event {k}")
        assert ev["time"] - t < 0.5, f"taken {ev['time'] - t:.2f} s after it was written"
        time.sleep(0.3)


# -- refusals ------------------------------------------------------------------------------------------

def test_foreign_daemon_is_refused(mps, fake_bin):
    pipe = mps.tmp / "theirs"
    env = {**mps.env, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(pipe),
           "CUDA_VISIBLE_DEVICES": mps.uuid}
    subprocess.run([str(fake_bin / "nvidia-cuda-mps-control"), "-d"], env=env, check=True)
    theirs = int((pipe / "nvidia-cuda-mps-control.pid").read_text())
    try:
        res = mps("mps", "start", "--gpu", mps.uuid, "--no-kmsg", "--no-nvml")
        assert res.returncode == 36, (res.stdout, res.stderr)
        assert f"pid {theirs}" in res.stderr and "nothing was changed" in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
        assert not (mps.dir / "pipe" / "nvidia-cuda-mps-control.pid").exists()
        code, data = mps.json("mps", "start", "--gpu", mps.uuid, "--no-kmsg", "--no-nvml")
        assert code == 36 and data["error"] == "mps-foreign"
    finally:
        subprocess.run([str(fake_bin / "nvidia-cuda-mps-control")], input="quit\n", text=True,
                       env=env)
    wait_for(lambda: not alive(theirs), 5, "their daemon gone")


def test_daemon_for_another_gpu_is_no_conflict(mps, fake_bin):
    pipe = mps.tmp / "other"
    env = {**mps.env, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(pipe),
           "CUDA_VISIBLE_DEVICES": f"GPU-{uuid.uuid4()}"}
    subprocess.run([str(fake_bin / "nvidia-cuda-mps-control"), "-d"], env=env, check=True)
    try:
        assert mps.start()["state"] == "running"
    finally:
        subprocess.run([str(fake_bin / "nvidia-cuda-mps-control")], input="quit\n", text=True,
                       env=env)


def test_missing_binaries(mps, tmp_path):
    env = {**mps.env, "GPUOS_MPS_CONTROL": str(tmp_path / "nope")}
    res = mps("mps", "start", "--gpu", mps.uuid, env=env)
    assert res.returncode == 35 and res.stderr.startswith("gpuos: nvidia-cuda-mps-control not found")
    env = {k: v for k, v in mps.env.items() if k != "GPUOS_MPS_CONTROL"}
    env["PATH"] = str(tmp_path)
    if not any((Path(d) / "nvidia-cuda-mps-control").exists() for d in ("/usr/local/nvidia/bin", "/usr/bin")):
        res = mps("mps", "start", "--gpu", mps.uuid, env=env)
        assert res.returncode == 35 and "GPUOS_MPS_CONTROL" in res.stderr
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "nvidia-cuda-mps-control").write_text("#!/bin/sh\n")
    (lonely / "nvidia-cuda-mps-control").chmod(0o755)
    env = {**mps.env, "GPUOS_MPS_CONTROL": str(lonely / "nvidia-cuda-mps-control"), "PATH": str(lonely)}
    res = mps("mps", "start", "--gpu", mps.uuid, env=env)
    assert res.returncode == 35 and "nvidia-cuda-mps-server not found" in res.stderr
    assert not mps.dir.exists()


def test_nothing_to_talk_to(mps):
    for args in (["mps", "status", "--gpu", mps.uuid], ["mps", "clients"], ["mps", "recover"],
                 ["mps", "run", "--", "true"], ["mps", "policy", "get"]):
        res = mps(*args)
        assert res.returncode == 37, (args, res.stderr)
    res = mps("mps", "status")
    assert res.returncode == 0 and "no gpuos MPS supervisor" in res.stdout
    res = mps("mps", "start", "--gpu", "banana")
    assert res.returncode == 1 and "GPU index" in res.stderr


def test_prohibited_gpu_is_refused_and_left_alone(mps):
    mps.smi.write_text("Prohibited")
    res = mps("mps", "start", "--gpu", mps.uuid, "--no-kmsg", "--no-nvml")
    assert res.returncode == 38 and "Prohibited" in res.stderr
    assert mps.smi.read_text() == "Prohibited"
    assert " -c " not in (Path(str(mps.smi) + ".log").read_text())


def test_exclusive_is_set_only_when_asked_and_restored(mps):
    mps.start()
    assert mps("mps", "stop").returncode == 0
    assert " -c " not in Path(str(mps.smi) + ".log").read_text()  # never touched
    info = mps.start("--exclusive")
    assert info["compute_mode"]["previous"] == "Default"
    assert info["compute_mode"]["set"] == "Exclusive_Process"
    assert mps.smi.read_text() == "Exclusive_Process"
    assert any("compute mode changed: Default -> Exclusive_Process" in n for n in info["notes"])
    assert "Exclusive_Process (set by gpuos; was Default)" in mps("mps", "status").stdout
    res = mps("mps", "stop")
    assert res.returncode == 0 and "compute mode restored: Exclusive_Process -> Default" in res.stdout
    assert mps.smi.read_text() == "Default"
    assert "compute-mode-restored" in mps.names()


def test_server_that_will_not_come_back_fails_then_recovers(mps):
    mps.start("--restart-attempts", "2")
    a, alog = mps.client(name="a")
    b, blog = mps.client(name="b")
    wait_for(lambda: connected(alog) and connected(blog), 10, "connected")
    refuse = mps.dir / "pipe" / "fake-refuse-starts"
    refuse.write_text("always")  # the GPU accepts no new server (no context) for now
    os.kill(mps.machine()["server_pid"], signal.SIGKILL)
    wait_for(lambda: mps.machine()["state"] == "failed", 15, "the supervisor failed")
    m = mps.machine()
    assert "2 attempts" in m["failure"] and m["incident"]["closed"] is None
    assert m["incident"]["cause"] in ("server-exit", "server-fault")
    wait_for(lambda: mps.supervisor_pid() is None or not alive(mps.supervisor_pid()), 5, "exited")
    res = mps("mps", "run", "--", "true")
    assert res.returncode == 37 and "recover" in res.stderr
    st = mps("mps", "status").stdout
    assert "failed" in st and "no MPS server accepted clients" in st
    refuse.unlink()
    code, rec = mps.json("mps", "recover")
    assert code == 0 and rec["state"] == "running" and rec["incident"]["outcome"] == "recovered"
    wait_for(lambda: connected(alog, 2) and connected(blog, 2), 10, "victims back")


def test_stop_refuses_while_others_use_the_server(mps, fake_bin):
    mps.start()
    log = mps.tmp / "outsider.log"
    env = {**mps.env, "CUDA_MPS_PIPE_DIRECTORY": str(mps.dir / "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": str(mps.dir / "log")}
    outsider = subprocess.Popen([str(fake_bin / "fake_client.py"), "--log", str(log)], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: connected(log), 10, "outsider connected")
        wait_for(lambda: outsider.pid in mps.machine()["unmanaged"], 10, "outsider noticed")
        code, cl = mps.json("mps", "clients")
        assert [r["state"] for r in cl["clients"] if r["pid"] == outsider.pid] == ["other"]
        res = mps("mps", "stop")
        assert res.returncode == 18 and str(outsider.pid) in res.stderr
        assert mps.machine()["state"] == "running"
        res = mps("mps", "stop", "--force")
        assert res.returncode == 0, res.stderr
        outsider.wait(timeout=10)  # its server is gone
        assert outsider.returncode == 1
    finally:
        outsider.kill()
        outsider.wait()


def test_start_twice_run_wait_and_policies(mps):
    mps.start()
    again = mps.start()
    assert again["already_running"] is True
    res = mps("mps", "run", "--wait", "--", str(mps.bin / "fake_client.py"), "--log",
              str(mps.tmp / "w.log"), "--exit-after", "0.3")
    assert res.returncode == 0, res.stderr
    res = mps("mps", "run", "--wait", "--", "sh", "-c", "echo to-stdout; exit 7")
    assert res.returncode == 7 and "to-stdout" in res.stdout and "failed" in res.stderr
    res = mps("mps", "run", "--policy", "hook", "--", "true")
    assert res.returncode == 2 and "--hook" in res.stderr
    c, _ = mps.client(name="p")
    assert mps.json("mps", "policy", "get")[1]["policy"] == "restart"
    assert mps("mps", "policy", "set", "none").returncode == 0
    assert mps("mps", "policy", "set", "--client", c, "hook", "--hook", "echo hi").returncode == 0
    code, got = mps.json("mps", "policy", "get", "--client", c)
    assert (got["policy"], got["hook"], got["own"]) == ("hook", "echo hi", True)
    assert mps.json("mps", "policy", "get")[1]["policy"] == "none"
    res = mps("mps", "policy", "set", "--client", "c99", "none")
    assert res.returncode == 1 and "no client c99" in res.stderr
    # with the supervisor stopped, the state file is changed
    assert mps("mps", "stop").returncode == 0
    assert mps("mps", "policy", "set", "restart").returncode == 0
    assert mps.machine()["settings"]["default_policy"] == "restart"


def test_foreground_supervisor_stops_on_sigterm(mps):
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from gpuos.cli.main import main; sys.argv[0] = 'gpuos'; main()",
         "mps", "start", "--foreground", "--gpu", mps.uuid, "--no-kmsg", "--no-nvml", "--poll", "0.05"],
        env=mps.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        wait_for(lambda: (mps.dir / "state.json").exists() and mps.machine()["state"] == "running",
                 10, "running in the foreground")
        assert mps.supervisor_pid() == proc.pid
        a, alog = mps.client(name="fg")
        wait_for(lambda: connected(alog), 10, "connected")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "daemon-started" in err and "client-stopped" in err  # every event, as it happens
    assert mps.machine()["state"] == "stopped"


def test_state_of_a_previous_boot_is_set_aside(mps):
    mps.start()
    mps.client("--exit-after", "30", name="old")
    assert mps("mps", "stop").returncode == 0
    st = mps.state()
    st["boot_id"] = "another-boot"
    st["machine"]["state"] = "running"  # as if the host had gone down under it
    (mps.dir / "state.json").write_text(json.dumps(st))
    assert mps("mps", "recover").returncode == 1  # not resumed: its processes are gone
    info = mps.start()
    assert not info["resumed"] and any("before the last boot" in n for n in info["notes"])
    assert list(mps.dir.glob("state-*-previous-boot.json"))
    assert mps.machine()["clients"] == {} and "previous-boot" in mps.names()
