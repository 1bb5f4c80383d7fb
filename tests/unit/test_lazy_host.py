"""Host memory on demand (`gpuos restore --host-memory lazy`): CRIU's lazy pages with the
real criu and userfaultfd, the pages served from the image's chunks by gpuos's page
server.  The counter holds 48 MiB of touched memory that it keeps checking: after the
restore it counts on, consecutively, with the same sums.  Skipped without root, a working
criu or userfaultfd."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from gpuos import procs
from gpuos.config import find_criu
from gpuos.hostmem import pagemap as pm
from gpuos.manifest import CRIU_DIR
from gpuos.store import ImageStore
from gpuos.store.content import ImageContent

from helpers import (assert_consecutive, counted, gpuos, gpuos_env, gpuos_json, hidden_entries, journals,
                     wait_for)

pytestmark = pytest.mark.criu
MB = 48


@pytest.fixture
def env(criu_bin, home):
    if subprocess.run([str(find_criu()), "check", "--feature", "uffd-noncoop"], capture_output=True).returncode:
        pytest.skip("no userfaultfd for CRIU here")
    return gpuos_env(home.home, criu=criu_bin)


def checkpointed(env, processes, tmp_path):
    log = tmp_path / "count.log"
    proc = processes.counter(log, mb=MB)
    code, out = gpuos_json(env, "checkpoint", str(proc.pid), "--image", "job")
    assert code == 0, out
    proc.wait(timeout=10)
    return proc.pid, log, counted(log)


def test_lazy_restore_serves_the_pages_from_the_chunks(env, home, store, processes, tmp_path):
    pid, log, at_dump = checkpointed(env, processes, tmp_path)
    code, res = gpuos_json(env, "restore", "job", "--host-memory", "lazy")
    assert code == 0, res
    processes.adopt(pid, "counter.py")
    host = res["host_memory"]
    assert host["on_demand"] is True and host["why_not"] is None
    assert host["served"]["pages"] * 4096 >= MB << 20  # the ballast came through the page server
    assert "host-fill" in res["timings"]
    wait_for(lambda: len(counted(log)) >= len(at_dump) + 20, what="the restored counter to count on")
    assert_consecutive(counted(log))
    assert journals(home.run) == [] and hidden_entries(store.root) == []
    assert not list(home.run.glob("restore-*")) and not list(home.hot.glob("restore-*"))


def test_replicas_say_why_their_host_memory_is_not_lazy(env, home, store, processes, tmp_path):
    pid, log, at_dump = checkpointed(env, processes, tmp_path)
    code, res = gpuos_json(env, "restore", "job", "--host-memory", "lazy", "--replicas", "1")
    assert code == 0, res
    try:
        assert res["host_memory"]["on_demand"] is False
        assert "replicas" in res["host_memory"]["why_not"]
    finally:
        os.kill(res["replicas"][0]["init"], signal.SIGKILL)


def lazy_chunk(store_root, name: str, tmp_path):
    """A chunk of the image's host memory that only the page server reads (lazy)."""
    m = ImageStore.load(store_root / name)
    content = ImageContent(store_root / name, m)
    out = content.materialize((CRIU_DIR,), tmp_path / "peek")
    for f in (out / CRIU_DIR).glob("pagemap-*.img"):
        if not f.stem.removeprefix("pagemap-").isdigit():
            continue
        pmap = pm.parse(f.read_bytes())
        entry = content.entry(f"{CRIU_DIR}/{pmap.pages_file}")
        lazy = [(e.offset, e.offset + e.nr_pages * 4096) for e in pmap.entries if e.lazy]
        off = 0
        for c in entry.chunks:
            if any(a <= off and off + c.size <= b for a, b in lazy) and c.size >= 64 << 10:
                return c, entry
            off += c.size
    raise AssertionError("no chunk of lazy pages")


def test_a_corrupt_chunk_of_lazy_pages_ends_the_restore_never_a_zero_page(env, home, store, processes, tmp_path):
    pid, log, at_dump = checkpointed(env, processes, tmp_path)
    chunk, entry = lazy_chunk(store.root, "job", tmp_path)
    path = store.chunks().stored(chunk.id)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.chmod(0o644)
    path.write_bytes(bytes(data))

    res = gpuos(env, "restore", "job", "--host-memory", "lazy")
    assert res.returncode == 10, (res.returncode, res.stderr)
    line = res.stderr.splitlines()[-1]
    assert "host memory:" in line and "corrupt" in line and "the restored processes were killed" in line, line
    wait_for(lambda: not procs.exists(pid), what="the restored process to be killed and reaped")
    n = len(counted(log))
    assert counted(log)[:len(at_dump)] == at_dump
    assert_consecutive(counted(log))  # whatever it wrote before it reached the page was right
    assert journals(home.run) == [] and not list(home.hot.glob("restore-*"))
    (logs,) = home.run.glob("restore-*")  # CRIU's and the daemon's logs, which the message names
    assert f"(log: {logs})" in line and (logs / "lazy-pages.log").exists()
    assert len(counted(log)) == n

    path.write_bytes(bytes(data[:len(data) // 2]) + bytes([data[len(data) // 2] ^ 0x40]) + bytes(data[len(data) // 2 + 1:]))
    code, res = gpuos_json(env, "restore", "job", "--host-memory", "lazy")  # mended: it restores
    assert code == 0, res
    processes.adopt(pid, "counter.py")
    wait_for(lambda: len(counted(log)) >= n + 20, what="the mended image's counter to count on")
