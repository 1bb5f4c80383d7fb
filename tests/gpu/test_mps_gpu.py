"""Supervised MPS on a real GPU: a fault of each kind, and the recovery actually observed.

`gpuos mps start` (private GPUOS_HOME), two clients through `gpuos mps run --policy
restart` (`python -m gpuos.workloads.mps_client`, an inference and a training loop that
write a heartbeat after every iteration), then `gpuos faults inject --kind K` as a third
MPS client.  Asserted from the supervisor's events (events.jsonl): the fault (Xid,
class and the faulter's pid, for the kinds with a known Xid), the incident, a server
that accepts clients again, both clients restarted, the incident closed; and from the
heartbeats: both clients make progress again, as new processes, within a bound.  Then
`gpuos mps stop`; whatever the test started is killed at the end, in any case.

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
from gpuos.workloads.run import kill_tree

MARKER = "GPUOS_MPS_TEST"
# kind -> (Xid, class) the kernel log must show for it, or None where it is not known
EXPECTED = {
    "oob-write": (31, "memory"),
    "oob-read": (31, "memory"),
    "ro-write": (31, "memory"),
    "illegal-instruction": (13, "sm"),
    "trap": (13, "sm"),
    "assert": None,
}
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
    for line in reversed(text.strip().splitlines()):
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    return {}


def _heartbeat(path: Path) -> tuple[float, int, int] | None:
    try:
        t, it, pid = path.read_text().split()[:3]
        return float(t), int(it), int(pid)
    except (OSError, ValueError):
        return None


def _marked(marker: str) -> list[int]:
    needle = f"{MARKER}={marker}".encode()
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (d / "environ").read_bytes().split(b"\0") and int(d.name) != os.getpid():
                out.append(int(d.name))
        except OSError:
            continue
    return out


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

    def start(self) -> None:
        code, text = self.cli("mps", "start", "--gpu", "0", "--json", "--timeout", "60")
        info = _last_json(text)
        if code == 36:  # mps-foreign: not ours to touch
            pytest.skip(f"an MPS control daemon gpuos did not start serves the GPU: {text[-300:]}")
        assert code == 0 and info.get("ok"), text
        self.mps_env = dict(self.env, **info["env"])
        self.events_file = Path(info["pipe_dir"]).parent / "events.jsonl"

    def events(self) -> list[dict]:
        out = []
        try:
            for line in self.events_file.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        except OSError:
            pass
        return out

    def stop(self) -> None:
        self.cli("mps", "stop", "--json", "--timeout", "45", timeout=60)
        for pid in _marked(self.marker):
            kill_tree(pid)


@pytest.fixture
def mps():
    root = Path(tempfile.mkdtemp(prefix="gmt-", dir="/tmp"))  # short: MPS socket paths
    m = Mps(root)
    try:
        m.start()
        yield m
    finally:
        try:
            m.stop()
        finally:
            for pid in _marked(m.marker):
                kill_tree(pid)
            print(f"logs in {root}")


def _fault_and_recover(mps: Mps, kind: str) -> None:
    clients = []
    for i, mode in enumerate(("infer", "train")):
        hb = mps.root / f"hb{i}"
        code, text = mps.cli("mps", "run", "--policy", "restart", "--json",
                             "--output", str(mps.root / f"client{i}.log"), "--",
                             sys.executable, "-m", "gpuos.workloads.mps_client", "--mode", mode,
                             "--heartbeat", str(hb), "--max-seconds", "600", timeout=30)
        reply = _last_json(text)
        assert code == 0 and reply.get("client"), text
        clients.append({"client": reply["client"], "heartbeat": hb})
    deadline = time.monotonic() + READY_S
    while not all(_heartbeat(c["heartbeat"]) for c in clients):
        assert time.monotonic() < deadline, "the clients made no progress under MPS"
        time.sleep(0.2)
    for c in clients:
        c["before"] = _heartbeat(c["heartbeat"])

    t0 = time.time()
    code, text = mps.cli("faults", "inject", "--kind", kind, "--json", timeout=60, env=mps.mps_env)
    lines = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
    faulter = next((x["pid"] for x in lines if x.get("pid")), None)
    assert lines and lines[-1].get("stage") == "faulted", f"the injector did not fault: {text}"
    assert faulter is not None

    deadline = time.monotonic() + RECOVER_S
    closed = None
    while closed is None and time.monotonic() < deadline:
        closed = next((e for e in mps.events() if e.get("event") == "incident-closed"
                       and e["time"] >= t0 - 1), None)
        time.sleep(0.25)
    evs = [e for e in mps.events() if e.get("time", 0) >= t0 - 1]
    print("\n".join(json.dumps(e, sort_keys=True) for e in evs))
    names = [e["event"] for e in evs]
    assert "incident-opened" in names, f"no incident: {names}"
    assert closed is not None, f"the incident was not closed in {RECOVER_S} s: {names}"
    assert closed.get("outcome") in ("recovered", "partial"), closed

    expected = EXPECTED[kind]
    if expected is not None:
        xid, cls = expected
        faults = [e["fault"] for e in evs if e["event"] == "fault" and isinstance(e.get("fault"), dict)]
        assert any(f.get("xid") == xid and f.get("fault_class") == cls and f.get("pid") == faulter
                   for f in faults), f"no Xid {xid} ({cls}) naming pid {faulter}: {faults}"
    assert "server-ready" in names, f"no server-ready after the incident: {names}"
    restarted = {e.get("client") for e in evs if e["event"] == "victim-restarted"}
    assert {c["client"] for c in clients} <= restarted, f"restarted: {restarted}"

    deadline = time.monotonic() + PROGRESS_S
    while True:
        beats = [_heartbeat(c["heartbeat"]) for c in clients]
        if all(b and b[2] != c["before"][2] and b[0] > t0 for b, c in zip(beats, clients)):
            break
        assert time.monotonic() < deadline, (
            f"the restarted clients made no progress in {PROGRESS_S} s: {beats} (before: "
            f"{[c['before'] for c in clients]})")
        time.sleep(0.2)
    print(f"{kind}: fault to both clients computing again: {max(b[0] for b in beats) - t0:.2f} s")


def test_mps_fault_oob_write_recovered(mps: Mps) -> None:
    _fault_and_recover(mps, "oob-write")


@pytest.mark.slow
@pytest.mark.parametrize("kind", [k for k in EXPECTED if k != "oob-write"])
def test_mps_fault_recovered(mps: Mps, kind: str) -> None:
    _fault_and_recover(mps, kind)
