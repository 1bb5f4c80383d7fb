"""gpuos-inject on a real GPU: every kind alone, and a plain co-running process unharmed.

Each kind runs alone (no MPS) and must end with its expected driver error (exit 0);
where the kernel log can be read, the Xid it leaves is checked too.  Then each faulting
kind runs while another CUDA process (gpuos-inject --kind none --after-iterations 0,
which fills and checks a buffer until SIGUSR1) computes on the same GPU: without MPS
every process has its own context, so the victim must go on working and exit 0.

Skipped cleanly without the gpuos-inject binary or a GPU it can use, and the co-runner
test while an MPS daemon runs.  The expected errors and Xids are gpuos-inject's table
(docs/inject.md); on a mismatch, the lines printed here say what the GPU did.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuos.faults import inject as inj

pytestmark = pytest.mark.gpu

CODES = {
    "oob-write": 700,
    "oob-read": 700,
    "ro-write": 700,
    "illegal-instruction": 715,
    "trap": 719,
    "assert": 710,
    "none": 0,
}
# kind -> the Xid lines the kernel log must show: (Xid, a text the line must carry or None,
# whether it names the injector's pid).  As measured on H100, driver 580.159.04: the SM
# exception's Xid 13 lines name no process (they come just before the Xid 43 that does);
# a trap or a device-side assert shows no Xid 13 at all, only Xid 43.
XIDS: dict[str, list[tuple[int, str | None, bool]]] = {
    "oob-write": [(31, "ACCESS_TYPE_VIRT_WRITE", True)],
    "oob-read": [(31, "ACCESS_TYPE_VIRT_READ", True)],
    "ro-write": [(31, "ACCESS_TYPE_VIRT_WRITE", True)],
    "illegal-instruction": [(13, "Illegal Instruction", False), (43, None, True)],
    "trap": [(43, None, True)],
    "assert": [(43, None, True)],
}
FAULTING = [k for k in inj.KINDS if k != "none"]
TIMEOUT = 120


def _probe() -> tuple[Path | None, str | None]:
    try:
        binary = inj.inject_binary()
    except inj.InjectorMissing as exc:
        return None, str(exc)
    try:
        res = subprocess.run([str(binary), "--kind", "none", "--json"], capture_output=True,
                             text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return None, "gpuos-inject --kind none timed out"
    if res.returncode != 0:
        return None, f"gpuos-inject --kind none: exit {res.returncode}: {res.stderr.strip()[-300:]}"
    return binary, None


BINARY, _WHY = _probe()
if _WHY:
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason=f"needs a GPU gpuos-inject can use: {_WHY}")]


def _lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


def _run(kind: str, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    res = subprocess.run([str(BINARY), "--kind", kind, "--json", *args], capture_output=True,
                         text=True, timeout=TIMEOUT)
    print(f"--- {kind}: exit {res.returncode}\n{res.stdout}{res.stderr}")
    return res, _lines(res.stdout)


class KernelLog:
    """/dev/kmsg records written after construction (None if it cannot be read)."""

    def __init__(self):
        try:
            self.fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            self.fd = None
            return
        os.lseek(self.fd, 0, os.SEEK_END)

    def read(self) -> list[str]:
        out = []
        while self.fd is not None:
            try:
                rec = os.read(self.fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            except OSError:  # EPIPE: overwritten records; go on
                continue
            out.append(rec.split(";", 1)[-1].split("\n", 1)[0])
        return out

    def close(self):
        if self.fd is not None:
            os.close(self.fd)


@pytest.mark.parametrize("kind", list(inj.KINDS))
def test_kind_alone(kind):
    res, lines = _run(kind)
    assert [ln["stage"] for ln in lines] == ["working", "armed",
                                            "completed" if kind == "none" else "faulted"]
    assert all(ln["kind"] == kind and ln["pid"] == lines[0]["pid"] for ln in lines)
    last = lines[-1]
    assert (last["error"], last["code"]) == (inj.KINDS[kind], CODES[kind]), last
    assert last["as_expected"] and last["exit"] == 0
    assert res.returncode == inj.EXIT_EXPECTED
    if kind == "assert":  # the device's message went to stderr, not into the JSON
        assert "Assertion" in res.stderr or "assert" in res.stderr.lower()


@pytest.mark.parametrize("kind", list(XIDS))
def test_kernel_log_shows_the_xid(kind):
    log = KernelLog()
    if log.fd is None:
        pytest.skip("cannot read /dev/kmsg")
    try:
        res, lines = _run(kind)
        assert res.returncode == 0
        pid = lines[0]["pid"]
        xids: list[str] = []  # every Xid line since the injector started (no one else faults)

        def found(xid: int, text: str | None, names_pid: bool) -> bool:
            return any(f"): {xid}, " in r and (text is None or text in r)
                       and ((f"pid={pid}," in r) if names_pid else "pid=" not in r) for r in xids)

        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            xids += [r for r in log.read() if re.search(r"NVRM: Xid \([^)]*\): \d+,", r)]
            if all(found(*x) for x in XIDS[kind]):
                break
            time.sleep(0.1)
        print("\n".join(xids) or "(no Xid line)")
        for xid, text, names_pid in XIDS[kind]:
            assert found(xid, text, names_pid), (xid, text, names_pid, xids)
    finally:
        log.close()


@pytest.mark.parametrize("kind", ["oob-write", "ro-write", "illegal-instruction"])
def test_faults_watch_names_the_faulter_by_its_address_space(kind, tmp_path):
    """As root, `gpuos faults watch` puts a UVM fault tracker on every CUDA process: an MMU
    fault is reported once more as Xid 31 [uvm-tracker] naming the injector; an SM
    exception never reaches UVM, so nothing is reported that way."""
    if os.geteuid() != 0:
        pytest.skip("fault trackers need root")
    env = dict(os.environ, GPUOS_HOME=str(tmp_path / "h"))
    watch = subprocess.Popen([sys.executable, "-m", "gpuos.cli", "faults", "watch", "--json", "--no-journal",
                              "--duration", "25"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        time.sleep(3)  # the watch is up
        res, lines = _run(kind, "--delay", "3")  # armed, then 3 s for the watch to find it
        assert res.returncode == 0 and lines[-1]["stage"] == "faulted"
        pid = lines[0]["pid"]
        time.sleep(2)
    finally:
        watch.send_signal(signal.SIGTERM)
        out, err = watch.communicate(timeout=30)
    print(out, err)
    events = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    tracked = [e for e in events if e.get("source") == "uvm-tracker"]
    if kind == "illegal-instruction":
        assert tracked == [], tracked
    else:
        assert [(e["xid"], e["pid"], e["fault_class"]) for e in tracked] == [(31, pid, "memory")], events
        assert tracked[0]["mmu"]["access_type"] == "write"


def _mps_running() -> bool:
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().startswith("nvidia-cuda-mps"):
                return True
        except OSError:
            continue
    return False


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "no output in time"
    return proc.stdout.readline()


@pytest.mark.parametrize("kind", FAULTING)
def test_plain_corunner_unaffected(kind):
    if _mps_running():
        pytest.skip("an MPS daemon is running: this test is about plain (non-MPS) processes")
    victim = subprocess.Popen([str(BINARY), "--kind", "none", "--after-iterations", "0", "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(_readline(victim, TIMEOUT))
        assert first["stage"] == "working"
        time.sleep(0.5)  # the victim is in its work loop
        res, lines = _run(kind)
        assert res.returncode == inj.EXIT_EXPECTED and lines[-1]["code"] == CODES[kind]
        time.sleep(0.5)  # and keeps working after the fault
        assert victim.poll() is None, f"victim died: {victim.stderr.read()}"
        victim.send_signal(signal.SIGUSR1)
        out, err = victim.communicate(timeout=TIMEOUT)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    rest = _lines(out)
    print(f"--- victim: exit {victim.returncode}\n{out}{err}")
    assert victim.returncode == 0, err
    assert [ln["stage"] for ln in rest] == ["armed", "completed"]
    assert rest[0]["iterations"] >= 1 and rest[-1]["code"] == 0
