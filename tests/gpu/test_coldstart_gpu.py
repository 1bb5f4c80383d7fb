"""Restore from the chunk store on a real GPU: on demand and eager, answers identical to an
uninterrupted run; a corrupt or missing chunk refused with exit 10 and nothing left
running; the image restores again once mended.

A ResNet-50 inference server (gpuos.workloads.serve) under `gpuos run` answers request 0
and is checkpointed with --leave-running; the running server then answers request 1:
the reference, from a process that never stopped.  Each restore brings back a server that
has answered request 0 only, and must answer request 1 exactly so.  Needs root, criu,
torch and torchvision, a GPU.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import criu_unusable

pytestmark = pytest.mark.gpu

PR_SET_CHILD_SUBREAPER = 36


def _ready() -> str | None:
    why = criu_unusable()
    if why:
        return why
    p = subprocess.run([sys.executable, "-c", "import torch, torchvision; assert torch.cuda.is_available()"],
                       capture_output=True, text=True, timeout=300)
    return None if p.returncode == 0 else f"needs torch, torchvision and a GPU: {p.stderr.strip()[-200:]}"


_WHY = _ready()
if _WHY:
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason=_WHY)]


def wait_file(path: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"timed out waiting for {path}"
        time.sleep(0.01)


def gpuos(env, *args, check: int | None = 0) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "gpuos.cli", *args], env=env, capture_output=True, text=True,
                       timeout=600)
    if check is not None:
        assert p.returncode == check, f"gpuos {' '.join(args)}: {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    return p


def end(pid: int) -> None:
    """Kill a restored server and reap it (this test is a subreaper: CRIU detaches it)."""
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def servers_alive(d: Path) -> list[int]:
    """Live processes serving the requests directory d."""
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if (f"--requests\0{d}\0".encode() in Path(f"/proc/{p}/cmdline").read_bytes()
                    and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"):
                found.append(int(p))
        except OSError:
            pass
    return found


def reap() -> None:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(env, requests dir, image name, reference answer to request 1)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    tmp = tmp_path_factory.mktemp("coldstart")
    env = dict(os.environ, GPUOS_HOME=str(tmp / "home"), GPUOS_HOT=str(tmp / "hot"), PYTHONUNBUFFERED="1")
    d = tmp / "requests"
    d.mkdir()
    (d / "req-0").write_text("")
    run = subprocess.Popen([sys.executable, "-m", "gpuos.cli", "run", "-q", "--", sys.executable, "-m",
                            "gpuos.workloads.serve", "--model", "resnet50", "--requests", str(d)],
                           env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_file(d / "resp-0")
        pid = int((d / "ready").read_text())
        gpuos(env, "checkpoint", str(pid), "--image", "srv", "--leave-running")
        (d / "req-1").write_text("")
        wait_file(d / "resp-1")
        reference = json.loads((d / "resp-1").read_text())["output"]
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    while Path(f"/proc/{pid}").exists():  # a zombie of this test's (a subreaper's) until reaped
        reap()
        time.sleep(0.01)
    (d / "resp-1").unlink()
    return env, d, "srv", reference


def restored_answer(env, d: Path, image: str, *flags: str) -> tuple[str, dict]:
    res = json.loads(gpuos(env, "restore", image, "--json", *flags).stdout)
    try:
        wait_file(d / "resp-1", 120)
        return json.loads((d / "resp-1").read_text())["output"], res
    finally:
        end(res["pid"])
        (d / "resp-1").unlink(missing_ok=True)


@pytest.mark.parametrize("flags", [(), ("--no-prefill",), ("--eager",), ("--host-memory", "lazy")],
                         ids=["on-demand", "no-prefill", "eager", "lazy-host-memory"])
def test_a_restored_server_answers_as_one_that_never_stopped(served, flags):
    """The answer is the reference's whichever way the GPU memory came back: some of it
    put on the GPU by gpuos while CRIU restored (the prefill) unless --no-prefill."""
    env, d, image, reference = served
    got, res = restored_answer(env, d, image, *flags)
    assert got == reference
    (fill,) = res["fills"].values()
    assert fill["on_demand"] == ("--eager" not in flags) and fill["bytes"] > 0
    if "--no-prefill" in flags:
        assert fill["prefilled"] == 0 and fill["prefill_why_not"] is None, fill
    else:
        assert 0 < fill["prefilled"] <= fill["bytes"] and fill["prefill_why_not"] is None, fill
    if "--eager" not in flags:
        assert fill["resumed_after"] < fill["seconds"]  # it went on before its memory was back
    host = res["host_memory"]
    assert host["on_demand"] == ("lazy" in flags), host
    if "lazy" in flags:  # its host memory came through gpuos's page server
        assert host["served"]["pages"] > 1000, host


def test_replicas_each_answer_as_one_that_never_stopped(served):
    """Three replicas of the server, each in namespaces of its own, restored at once: each
    answers request 1 exactly as the server that never stopped, and runs as the image's pid
    inside its own pid namespace."""
    env, d, image, reference = served
    t0 = time.time()
    res = json.loads(gpuos(env, "restore", image, "--replicas", "3", "--json").stdout)
    try:
        (orig,) = {int(k) for r in res["replicas"] for k in r["pids"]}
        for r in res["replicas"]:
            status = Path(f"/proc/{r['pid']}/status").read_text().splitlines()
            nspid = next(ln for ln in status if ln.startswith("NSpid:")).split()[1:]
            assert len(nspid) == 2 and nspid[-1] == str(orig)  # the image's pid, in a namespace of its own
        deadline = time.monotonic() + 120
        while True:
            got = [a for a in map(json.loads, (d / "answers").read_text().splitlines())
                   if a["request"] == 1 and a["answered"] >= t0]
            if len(got) >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert len(got) == 3 and len({a["token"] for a in got}) == 3, got
        assert all(a["output"] == reference for a in got)
        assert len(res["fills"]) == 3 and all(f["bytes"] > 0 for f in res["fills"].values())
        # one prefill for the three: each took it (the same bytes)
        assert len({f["prefilled"] for f in res["fills"].values()}) == 1, res["fills"]
        assert all(f["prefilled"] > 0 for f in res["fills"].values()), res["fills"]
    finally:
        for r in res["replicas"]:
            end(r["init"])  # the replica's pid 1: the whole replica ends with it
        (d / "resp-1").unlink(missing_ok=True)


def _chunks_of(env, image: str, prefix: str) -> list[Path]:
    from gpuos.store import ImageStore
    store = ImageStore(Path(env["GPUOS_HOME"]) / "images")
    m = store.load(store.resolve(image))
    return [store.chunks().stored(c.id) for f in m.files if f.path.startswith(prefix) for c in f.chunks]


@pytest.mark.parametrize("where,damage", [("gpu-memory-", "corrupt"), ("gpu-memory-", "missing"),
                                          ("criu/pages-", "corrupt")])
def test_a_bad_chunk_is_refused_and_nothing_is_left_running(served, where, damage):
    env, d, image, reference = served
    chunk = max(_chunks_of(env, image, where), key=lambda p: p.stat().st_size)
    good = chunk.read_bytes()
    aside = chunk.with_name(chunk.name + ".aside")
    try:
        if damage == "missing":
            chunk.rename(aside)
        else:
            chunk.chmod(0o644)
            chunk.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
        res = gpuos(env, "restore", image, check=10)
        line = res.stderr.strip().splitlines()[-1]
        assert f"chunk {chunk.parent.name}{chunk.name.removesuffix('.zst')}" in line and ("is corrupt" if damage == "corrupt" else "is missing") in line
        assert "the image is intact" in line or "nothing was restored" in line
        assert not (d / "resp-1").exists()
        assert servers_alive(d) == []
        assert gpuos(env, "images", "verify", image, check=10).returncode == 10
    finally:
        if aside.exists():
            aside.rename(chunk)
        else:
            chunk.write_bytes(good)
    reap()  # the process the failed restore killed, reparented to this test
    got, _ = restored_answer(env, d, image)  # mended: it restores again
    assert got == reference
