"""`gpuos run` and `gpuos trace launches` with a client written in Python.

The client speaks the control-socket handshake (gpuos_ctl.h) and writes its ring with
tests/ringwriter.py, so these tests cover the Python side alone; test_libgpuos.py runs
the real library against the fake driver.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuos.intercept.log import read_log
from gpuos.intercept.runner import CTL_MAGIC

TESTS = Path(__file__).resolve().parents[1]
GPUOS = [sys.executable, "-m", "gpuos.cli"]

CLIENT = r"""
import os, socket, struct, sys, time
sys.path.insert(0, {tests!r})
from ringwriter import Writer, launch_body
from gpuos.intercept import ring as R
from gpuos.intercept.runner import CTL_MAGIC, CTL_VERSION, HELLO, REPLY

mode = sys.argv[1]
w = Writer(nslots=64)
fid = w.function(0xF00, "vecadd", 3)
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["GPUOS_CTL"])
pid = os.getpid() if mode != "liar" else os.getpid() + 1
hello = HELLO.pack(CTL_MAGIC, CTL_VERSION, pid, os.getppid(), 0, 0, R.TRACK_ON, b"/bin/client")
socket.send_fds(s, [hello], [w.fd])
reply = s.recv(REPLY.size)
print("reply", REPLY.unpack(reply) if len(reply) == REPLY.size else None, flush=True)
w.record(R.LAUNCH, launch_body(1, fid, [(0x1000, 4096, 0x1000)]))
w.record(R.VALIDATE, R.VALIDATE_BODY.pack(1, 8192, 4096, 0, 4096, 1 << 20, fid, 1, 0, R.LAUNCH)
         + R.MISS.pack(0x2000, 8192, 0x2000, 4096))
w.record(R.COPY, R.COPY_BODY.pack(2, 0, 0x1000, 0x7000, 64, 64, 0, 1, 0))
w.record(R.VALIDATE, R.VALIDATE_BODY.pack(2, 4096, 64, 0, 0, 1 << 20, 0xFFFFFFFF, 0, 0, R.COPY))
struct.pack_into("<QQ", w.m, 368, 1, 1)   # n_launches, n_copies
if mode == "off":
    struct.pack_into("<I", w.m, 48, R.TRACK_OFF)
    w.m[56:56 + 14] = b"no memory\0\0\0\0\0"
if mode == "wait":
    print("ready", flush=True)
    time.sleep(30)
sys.exit(3)
"""


@pytest.fixture
def client(tmp_path) -> list[str]:
    path = tmp_path / "client.py"
    path.write_text(CLIENT.format(tests=str(TESTS)))
    return [sys.executable, str(path)]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*GPUOS, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def fake_lib(tmp_path, monkeypatch) -> Path:
    """LD_PRELOAD needs a loadable library: any will do for a Python client."""
    lib = tmp_path / "libgpuos.so"
    src = tmp_path / "empty.c"
    src.write_text("int gpuos_test_empty;\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    monkeypatch.setenv("GPUOS_LIBGPUOS", str(lib))
    return lib


def test_run_reports_log_and_validation(tmp_path, client, fake_lib):
    log, report = tmp_path / "l.jsonl.gz", tmp_path / "r.json"
    res = run("run", "--log", str(log), "--validate", "--report", str(report), "--",
              *client, "ok")
    assert res.returncode == 3, res.stderr           # the command's own exit status
    assert "reply (%d, 0)" % CTL_MAGIC in res.stdout
    doc = json.loads(report.read_text())
    (proc,) = doc["processes"]
    assert proc["state"] == "on" and proc["counters"]["launches"] == 1
    assert proc["exe"] == "/bin/client"
    v = doc["validation"]
    assert (v["operations"], v["with_misses"], v["missed_bytes"]) == (2, 1, 4096)
    (vecadd, copy) = v["kernels"]
    assert vecadd["name"] == "vecadd" and vecadd["launches"] == 1 and vecadd["with_misses"] == 1
    assert copy["name"] == "(copy)" and copy["with_misses"] == 0
    assert "1 with misses" in res.stderr and "vecadd" in res.stderr

    lines = list(read_log(log))
    assert lines[0]["format"] == "gpuos-launch-log" and lines[0]["validate"] is True
    types = [line["type"] for line in lines[1:]]
    assert types == ["proc", "function", "launch", "validate", "copy", "validate", "proc"]
    fn = lines[2]
    assert fn["name"] == "vecadd" and fn["nparams"] == 3 and fn["id"] == lines[3]["func"]
    assert lines[3]["bufs"][0]["base"] == 0x1000
    assert lines[-1]["event"] == "end" and lines[-1]["counters"]["launches"] == 1


def test_run_reports_tracking_off(tmp_path, client, fake_lib):
    res = run("run", "--json", "--", *client, "off")
    assert res.returncode == 3
    doc = json.loads(res.stdout[res.stdout.index("{"):])
    assert doc["processes"][0]["state"] == "off"
    assert doc["processes"][0]["reason"] == "no memory"
    assert "tracking OFF (no memory)" in res.stderr


def test_run_refuses_a_client_lying_about_its_pid(client, fake_lib):
    res = run("run", "--json", "--", *client, "liar")
    assert res.returncode == 3
    assert "reply None" in res.stdout or "reply (%d, 71)" % CTL_MAGIC in res.stdout
    assert json.loads(res.stdout[res.stdout.index("{"):])["processes"] == []


def test_run_without_cuda_calls_and_bad_commands(fake_lib):
    res = run("run", "--", "true")
    assert res.returncode == 0 and "nothing was tracked" in res.stderr
    res = run("run", "--", "sh", "-c", "kill -TERM $$")
    assert res.returncode == 128 + 15
    res = run("run", "--", "no-such-command-gpuos")
    assert res.returncode == 1 and "command not found" in res.stderr
    res = run("run")
    assert res.returncode == 2
    res = run("run", "--ring-slots", "3000", "--", "true")
    assert res.returncode == 2 and "power of two" in res.stderr
    for bad in ("x", "3-1", "1,,2", "100000"):
        res = run("run", "--record-cpus", bad, "--", "true")
        assert res.returncode == 2 and "--record-cpus" in res.stderr, bad
    res = run("run", "--log", "/nonexistent-dir/x.jsonl", "--", "true")
    assert res.returncode == 1 and "cannot write the log" in res.stderr and "Traceback" not in res.stderr


def test_run_without_the_library(monkeypatch, tmp_path):
    monkeypatch.setenv("GPUOS_LIBGPUOS", str(tmp_path / "missing.so"))
    res = run("run", "--", "true")
    assert res.returncode == 30 and "libgpuos.so not found" in res.stderr


def test_trace_launches_follows_a_live_process(client, fake_lib):
    proc = subprocess.Popen([*GPUOS, "run", "-q", "--", *client, "wait"], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().startswith("reply")
        assert proc.stdout.readline() == "ready\n"
        pid = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _is_client(int(p), proc.pid))
        res = run("trace", "launches", str(pid), "--from-start", "--duration", "0.3", "--json")
        assert res.returncode == 0, res.stderr
        (launch,) = [json.loads(line) for line in res.stdout.splitlines()]
        assert launch["name"] == "vecadd" and launch["pid"] == pid
        res = run("trace", "launches", str(pid), "--from-start", "--duration", "0.3", "--all")
        assert "launch #1 vecadd grid=4x1x1" in res.stdout and "htod #2" in res.stdout
    finally:
        proc.terminate()
        proc.wait(30)


def _is_client(pid: int, parent: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return int(stat.rsplit(")", 1)[1].split()[1]) == parent


def test_trace_launches_errors():
    res = run("trace", "launches", "999999999")
    assert res.returncode == 3
    plain = subprocess.Popen(["sleep", "30"])
    try:
        res = run("trace", "launches", str(plain.pid))
    finally:
        plain.kill()
        plain.wait()
    assert res.returncode == 29 and "no libgpuos ring" in res.stderr
