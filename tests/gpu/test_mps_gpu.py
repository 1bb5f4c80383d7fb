"""Supervised MPS on a real GPU: a fault of each kind, and the recovery actually observed.

`gpuos mps start` (private GPUOS_HOME), two clients through `gpuos mps run --policy
restart` (`python -m gpuos.workloads.mps_client`, an inference and a training loop that
write a heartbeat after every iteration), then `gpuos faults inject --kind K` as a third
MPS client.  Asserted from the supervisor's events (events.jsonl): the faults (Xid,
class and whose pid the line names, as measured for each kind: EXPECTED), the incident, a server
that accepts clients again, both clients restarted, the incident closed; and from the
heartbeats: both clients make progress again, as new processes, within a bound.  Then
`gpuos mps stop`; whatever the test started is killed at the end, in any case.  With
`--policy standby` the new processes must be the clients' standbys, which waited at
their first cuInit through the fault; with `--spare-server` too, warm standbys that
waited at their first kernel launch as clients of the spare server, released at the
swap, and the faulted server restarted as the spare.

Skipped cleanly without torch with CUDA, the MPS binaries, gpuos-inject, or when an MPS
daemon gpuos did not start is running.  oob-write is the quick test; the other kinds are
marked `slow` (each also at most about 90 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpuos.faults import inject as inj
from gpuos.mps.store import EventLog
from gpuos.workloads.mps_client import read_heartbeat
from gpuos.workloads.run import kill_tree, last_json_object, processes_with_env

MARKER = "GPUOS_MPS_TEST"
# kind -> the fault events the supervisor must report: (Xid, class, whose pid the line names:
# "mps" = the injector, a client or the server of this MPS; "server"; None = no pid).  As
# measured under MPS on H100, driver 580.159.04: an MMU fault's Xid 31 names *a* process of
# the MPS server (seen: a co-running victim, not the injector); an illegal instruction gives
# Xid 13 lines without a pid, then Xid 43 naming the MPS server; a trap gives Xid 43 alone.
# None: the fault stays in the faulting client (a device-side assert, as measured: no Xid
# line, no co-runner harmed), so there must be no incident at all.
EXPECTED: dict[str, list[tuple[int, str, str | None]] | None] = {
    "oob-write": [(31, "memory", "mps")],
    "oob-read": [(31, "memory", "mps")],
    "ro-write": [(31, "memory", "mps")],
    "illegal-instruction": [(13, "sm", None), (43, "channel", "server")],
    "trap": [(43, "channel", "server")],
    "assert": None,
}
# MMU faults of the SMs reach UVM: its fault tracker on the injector's address space names
# it (faults/uvm_tools.py; root), and no other process's tracker takes the fault.
TRACKED = {"oob-write", "oob-read", "ro-write"}
ARM_S = 4  # the injector waits this long after arming: the supervisor sees it as a client of
           # the server (get_client_list every 2 s) and puts a tracker on it before the fault
FAULTS_S = 8        # incident closed -> every expected fault event (a kernel-log event that
                    # NVML does not report waits out the 2 s join window)
CONTAINED_S = 10    # a contained fault: how long the clients must go on after it
READY_S = 60        # both clients' first heartbeat
RECOVER_S = 75      # fault -> incident closed
PROGRESS_S = 30     # incident closed -> both clients' new heartbeats


def _why_skip() -> str | None:
    try:
        inj.inject_binary()
    except inj.InjectorMissing as exc:
        return f"no gpuos-inject: {exc}"
    try:
        from gpuos.mps.control import find_mps_binaries
        find_mps_binaries()
    except Exception as exc:  # noqa: BLE001 - any reason means: skip
        return f"no MPS binaries: {exc}"
    try:
        res = subprocess.run([sys.executable, "-c",
                              "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
                             capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "torch check timed out"
    if res.returncode != 0:
        return f"no torch with CUDA: {res.stderr.strip().splitlines()[-1:] or 'no GPU'}"
    return None


_WHY = _why_skip()
pytestmark = [pytest.mark.gpu] + ([pytest.mark.skip(reason=_WHY)] if _WHY else [])


def _gpuos(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpuos.cli", *args]


def _last_json(text: str) -> dict:
    return last_json_object(text) or {}


class Mps:
    """gpuos mps in a private home; every process it leads to carries a marker."""

    def __init__(self, root: Path):
        self.root = root
        self.marker = f"{os.getpid()}-{time.monotonic_ns()}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        self.env.update({MARKER: self.marker, "GPUOS_HOME": str(root / "h")})

    def cli(self, *args: str, timeout: float = 90, env: dict | None = None) -> tuple[int, str]:
        out = self.root / f"cli-{time.monotonic_ns()}.out"
        with open(out, "w+") as f:  # a file: a detached supervisor may keep its stdout
            proc = subprocess.Popen(_gpuos(*args), env=env or self.env, stdout=f,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                proc.wait()
                code = -999
            f.seek(0)
            text = f.read()
        print(f"$ gpuos {' '.join(args)}: exit {code}\n{text[-3000:]}")
        return code, text

    def start(self, *extra: str) -> None:
        code, text = self.cli("mps", "start", "--gpu", "0", "--json", "--timeout", "60", *extra)
        info = _last_json(text)
        if code == 36:  # mps-foreign: not ours to touch
            pytest.skip(f"an MPS control daemon gpuos did not start serves the GPU: {text[-300:]}")
        assert code == 0 and info.get("ok"), text
        self.mps_env = dict(self.env, **info["env"])
        self.events_file = Path(info["pipe_dir"]).parent / "events.jsonl"
        self.log_dir = Path(info["log_dir"])

    def print_mps_logs(self) -> None:
        """The MPS daemon's and servers' own logs (what they say of a fault and its client)."""
        for f in sorted(self.log_dir.glob("*.log")):
            lines = f.read_text(errors="replace").splitlines()
            print(f"--- {f.name} (last 40 of {len(lines)} lines)\n" + "\n".join(lines[-40:]))

    def events(self) -> list[dict]:
        return EventLog(self.events_file).read()

    def stop(self) -> None:
        self.cli("mps", "stop", "--json", "--timeout", "45", timeout=60)
        for pid in processes_with_env(MARKER, self.marker):
            kill_tree(pid)


@pytest.fixture
def mps(request):
    root = Path(tempfile.mkdtemp(prefix="gmt-", dir="/tmp"))  # short: MPS socket paths
    m = Mps(root)
    try:
        m.start(*getattr(request, "param", ()))
        yield m
    finally:
        try:
            m.stop()
        finally:
            for pid in processes_with_env(MARKER, m.marker):
                kill_tree(pid)
            print(f"logs in {root}")


def _standbys(mps: Mps, clients: list[dict], warm: bool) -> dict[str, int]:
    """Each client's standby pid (warm ones: on the spare server), once every one has started."""
    deadline = time.monotonic() + READY_S
    while True:
        code, text = mps.cli("mps", "clients", "--json")
        rows = {r["id"]: r for r in (_last_json(text).get("clients") or [])}
        got = {c["client"]: rows.get(c["client"], {}).get("standby_pid")
               if rows.get(c["client"], {}).get("standby_warm") == warm else None for c in clients}
        if all(got.values()):
            return got
        assert time.monotonic() < deadline, f"no standbys: {got}"
        time.sleep(1.0)


def _preloaded(mps: Mps, client: str, pid: int) -> dict | None:
    """A warm standby's report of what it loaded ahead (launch.kernel_list's directory)."""
    for p in mps.root.glob(f"h/mps/*/kernels/{client}/launched.txt.standby.{pid}"):
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):
            return None
    return None


def _waiting(pid: int) -> bool:
    """Blocked in openat(2) (x86-64: 257) on two looks 0.3 s apart: a standby at its FIFO."""
    looks = []
    for _ in range(2):
        try:
            looks.append(Path(f"/proc/{pid}/syscall").read_text().split()[:1] == ["257"])
        except OSError:
            return False
        time.sleep(0.3)
    return all(looks)


def _fault_and_recover(mps: Mps, kind: str, policy: str = "restart", spare: bool = False,
                       hold: bool = False, share: bool = False) -> None:
    clients = []
    for i, mode in enumerate(("infer", "train")):
        hb = mps.root / f"hb{i}"
        code, text = mps.cli("mps", "run", "--policy", policy, "--json",
                             "--output", str(mps.root / f"client{i}.log"), "--",
                             sys.executable, "-m", "gpuos.workloads.mps_client", "--mode", mode,
                             "--heartbeat", str(hb), "--max-seconds", "600",
                             *(["--seed", str(7 + i)] if share else []), timeout=30)
        reply = _last_json(text)
        assert code == 0 and reply.get("client"), text
        clients.append({"client": reply["client"], "heartbeat": hb})
    deadline = time.monotonic() + READY_S
    while not all(read_heartbeat(c["heartbeat"]) for c in clients):
        assert time.monotonic() < deadline, "the clients made no progress under MPS"
        time.sleep(0.2)
    for c in clients:
        c["before"] = read_heartbeat(c["heartbeat"])
    # `gpuos mps clients`: both clients, by pid, connected to the server, with GPU memory
    code, text = mps.cli("mps", "clients", "--json")
    listed = {r["id"]: r for r in (_last_json(text).get("clients") or [])}
    for c in clients:
        row = listed.get(c["client"])
        assert row and row["pid"] == c["before"][2] and row["alive"] and row["connected"], (c, listed)
        assert row["command"] and row["gpu_memory"], row
    standbys = _standbys(mps, clients, spare) if policy == "standby" else {}
    if spare:  # each standby through its torch start-up, on to its first launch: in openat(2)
        deadline = time.monotonic() + READY_S
        while not all(_waiting(p) for p in standbys.values()):
            assert time.monotonic() < deadline, f"the standbys {standbys} did not reach their wait"
            time.sleep(0.5)
        # while it waits, each loads the kernels its client launched (libgpuos/src/preload.c)
        deadline = time.monotonic() + 20
        while not all((_preloaded(mps, c, pid) or {}).get("loaded") for c, pid in standbys.items()):
            assert time.monotonic() < deadline, \
                f"the standbys loaded nothing ahead: {[_preloaded(mps, c, p) for c, p in standbys.items()]}"
            time.sleep(0.5)
        # and starts cuBLAS (the torch clients have loaded it; libgpuos/src/blaswarm.c)
        deadline = time.monotonic() + 20
        while not all((_preloaded(mps, c, pid) or {}).get("cublas_warm_up") for c, pid in standbys.items()):
            assert time.monotonic() < deadline, \
                f"no standby started cuBLAS: {[_preloaded(mps, c, p) for c, p in standbys.items()]}"
            time.sleep(0.5)
        warm = [_preloaded(mps, c, p)["cublas_warm_up"] for c, p in standbys.items()]
        assert all(w["calls"] > 0 and w["failed"] == 0 for w in warm), warm
        # and has the printf buffer made: its kernel that can print was JIT-compiled and ran
        # on this driver (preload.c ready_printf_buffer; null would be not yet, false failed)
        made = {c: _preloaded(mps, c, p)["printf_buffer_made"] for c, p in standbys.items()}
        assert all(m is True for m in made.values()), made
    if share:  # each maps its client's weights (same seed: same bytes) instead of a copy
        deadline = time.monotonic() + 30
        while not all(((_preloaded(mps, c, p) or {}).get("memory_shared") or {}).get("asked")
                      for c, p in standbys.items()):
            assert time.monotonic() < deadline, \
                f"no standby asked its client: {[_preloaded(mps, c, p) for c, p in standbys.items()]}"
            time.sleep(0.5)
        shared = {c: _preloaded(mps, c, p)["memory_shared"] for c, p in standbys.items()}
        print("shared:", shared)
        # the inference loop's standby shares its weights; the trainer's have moved by the
        # time its standby asks, so it shares nothing or gives it back once it sees them move
        assert shared[clients[0]["client"]]["bytes"] > 0, shared

    t0 = time.time()
    code, text = mps.cli("faults", "inject", "--kind", kind, "--delay", str(ARM_S), "--json", timeout=60,
                         env=mps.mps_env)
    lines = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
    faulter = next((x["pid"] for x in lines if x.get("pid")), None)
    assert lines and lines[-1].get("stage") == "faulted", f"the injector did not fault: {text}"
    assert faulter is not None
    if EXPECTED[kind] is None:
        _contained(mps, clients, t0)
        return

    deadline = time.monotonic() + RECOVER_S
    closed = None
    while closed is None and time.monotonic() < deadline:
        closed = next((e for e in mps.events() if e.get("event") == "incident-closed"
                       and e["time"] >= t0 - 1), None)
        time.sleep(0.25)
    evs = [e for e in mps.events() if e.get("time", 0) >= t0 - 1]
    print("\n".join(json.dumps(e, sort_keys=True) for e in evs))
    names = [e["event"] for e in evs]
    mps.print_mps_logs()
    assert "incident-opened" in names, f"no incident: {names}"
    assert closed is not None, f"the incident was not closed in {RECOVER_S} s: {names}"
    assert closed.get("outcome") in ("recovered", "partial"), closed

    expected = EXPECTED[kind]
    server = next((e.get("server_pid") for e in evs if e["event"] == "incident-opened"), None)
    ours = {faulter, server} | {e.get("pid") for e in evs if e["event"] in ("victim-exited",
                                                                            "victim-restarting")}
    ours |= {v.get("pid") for e in evs if e["event"] == "incident-opened" for v in e.get("victims", [])}

    def seen(xid: int, cls: str, who: str | None) -> bool:
        for e in mps.events():
            f = e.get("fault") if e.get("event") == "fault" and e.get("time", 0) >= t0 - 1 else None
            if not isinstance(f, dict) or f.get("xid") != xid or f.get("fault_class") != cls:
                continue
            pid = f.get("pid")
            if (who is None and pid is None) or (who == "server" and pid == server) or \
                    (who == "mps" and pid in ours):
                return True
        return False

    deadline = time.monotonic() + FAULTS_S
    while not all(seen(*x) for x in expected) and time.monotonic() < deadline:
        time.sleep(0.25)
    faults = [e["fault"] for e in mps.events() if e.get("event") == "fault"
              and e.get("time", 0) >= t0 - 1 and isinstance(e.get("fault"), dict)]
    print("faults:", [(f.get("xid"), f.get("fault_class"), f.get("pid"), f.get("process")) for f in faults],
          f"injector {faulter}, server {server}")
    for xid, cls, who in expected:
        assert seen(xid, cls, who), (f"no Xid {xid} ({cls}) naming {who or 'no pid'} "
                                     f"(injector {faulter}, server {server}, ours {ours}): {faults}")
    assert faults, "the supervisor reported no fault"
    named = {f.get("pid") for f in faults if f.get("source") == "uvm-tracker"}
    if kind in TRACKED:
        assert named == {faulter}, f"the fault tracker named {named}, not the injector {faulter}: {faults}"
    else:
        assert not named, f"a fault tracker named {named} for {kind}: {faults}"
    if spare:  # released at the swap; the faulted server restarted as the spare
        assert "servers-swapped" in names and "spare-ready" in names, names
        assert names.index("servers-swapped") < names.index("standby-releasing") < names.index("spare-ready")
    if hold:  # stopped at the swap, standbys released in the same turn, then killed
        held = next(e for e in evs if e["event"] == "victims-held")
        victims = {v.get("pid") for e in evs if e["event"] == "incident-opened" for v in e.get("victims", [])}
        assert held["pids"] and set(held["pids"]) <= victims, (held, victims)
        assert names.index("victims-held") < names.index("standby-releasing") < names.index("held-victims-killed")
        exits = {e.get("pid"): e.get("status") for e in evs if e["event"] == "victim-exited"}
        # killed, or gone by itself first: one already exiting when stopped is not held
        assert all(p in exits for p in held["pids"]), exits
    if not spare:
        assert "server-ready" in names, f"no server-ready after the incident: {names}"
    if policy == "standby":
        took = {e.get("client"): e.get("pid") for e in evs if e["event"] == "victim-took-over"}
        assert took == standbys, f"taken over: {took}, standbys: {standbys}"
        if spare:  # the runtime then took the libraries loaded ahead instead of loading its own
            deadline = time.monotonic() + 10
            while not all((_preloaded(mps, c, p) or {}).get("taken") for c, p in standbys.items()):
                assert time.monotonic() < deadline, \
                    f"no library loaded ahead was taken: {[_preloaded(mps, c, p) for c, p in standbys.items()]}"
                time.sleep(0.5)
    else:
        restarted = {e.get("client") for e in evs if e["event"] == "victim-restarted"}
        assert {c["client"] for c in clients} <= restarted, f"restarted: {restarted}"

    deadline = time.monotonic() + PROGRESS_S
    while True:
        beats = [read_heartbeat(c["heartbeat"]) for c in clients]
        if all(b and b[2] != c["before"][2] and b[0] > t0 for b, c in zip(beats, clients)):
            break
        assert time.monotonic() < deadline, (
            f"the restarted clients made no progress in {PROGRESS_S} s: {beats} (before: "
            f"{[c['before'] for c in clients]})")
        time.sleep(0.2)
    if policy == "standby":
        assert [b[2] for b in beats] == [standbys[c["client"]] for c in clients], (beats, standbys)
    if share:  # nothing the trainer writes is left shared (its standby put its own back while
        # it waited, or at its release); the inference loop's standby still shares its weights
        time.sleep(3)  # the standbys' reports after the release
        after = {c["client"]: _preloaded(mps, c["client"], standbys[c["client"]])["memory_shared"] for c in clients}
        print("after the release:", after)
        trainer, server = after[clients[1]["client"]], after[clients[0]["client"]]
        assert trainer["bytes"] == trainer["given_back_bytes"] + trainer["restored_bytes"], after
        assert server["bytes"] - server["given_back_bytes"] - server["restored_bytes"] > 0, after
    print(f"{kind} ({policy}): fault to both clients computing again: "
          f"{max(b[0] for b in beats) - t0:.2f} s")


def _contained(mps: Mps, clients: list[dict], t0: float) -> None:
    """The fault stayed in the injector: no incident, and both clients go on computing as the
    same processes for CONTAINED_S after it."""
    time.sleep(CONTAINED_S)
    evs = [e for e in mps.events() if e.get("time", 0) >= t0 - 1]
    print("\n".join(json.dumps(e, sort_keys=True) for e in evs))
    names = [e["event"] for e in evs]
    assert "incident-opened" not in names and "client-failed" not in names, names
    for c in clients:
        b = read_heartbeat(c["heartbeat"])
        assert b and b[2] == c["before"][2] and b[1] > c["before"][1] and b[0] > t0 + CONTAINED_S - 2, (
            f"client {c['client']} did not go on: {b} (before: {c['before']})")


def test_mps_fault_oob_write_recovered(mps: Mps) -> None:
    _fault_and_recover(mps, "oob-write")


@pytest.mark.slow
@pytest.mark.parametrize("kind", [k for k in EXPECTED if k != "oob-write"])
def test_mps_fault_recovered(mps: Mps, kind: str) -> None:
    _fault_and_recover(mps, kind)


@pytest.mark.parametrize("kind", ["oob-write", "trap"])
def test_mps_fault_victims_taken_over_by_standbys(mps: Mps, kind: str) -> None:
    _fault_and_recover(mps, kind, policy="standby")


@pytest.mark.parametrize("mps", [("--spare-server",)], indirect=True)
@pytest.mark.parametrize("kind", ["oob-write", "trap", "illegal-instruction"])
def test_mps_fault_victims_taken_over_by_warm_standbys_on_the_spare(mps: Mps, kind: str) -> None:
    _fault_and_recover(mps, kind, policy="standby", spare=True)


@pytest.mark.parametrize("mps", [("--spare-server", "--hold-victims", "0.5")], indirect=True)
@pytest.mark.parametrize("kind", ["oob-write", "trap"])
def test_mps_fault_victims_held_while_warm_standbys_take_over(mps: Mps, kind: str) -> None:
    _fault_and_recover(mps, kind, policy="standby", spare=True, hold=True)


@pytest.mark.parametrize("mps", [("--spare-server", "--hold-victims", "0.5", "--share-standby-memory")],
                         indirect=True)
def test_mps_fault_taken_over_by_standbys_that_share_their_clients_weights(mps: Mps) -> None:
    _fault_and_recover(mps, "oob-write", policy="standby", spare=True, hold=True, share=True)
