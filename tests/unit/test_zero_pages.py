"""Zero pages dropped from the dump (hostmem/trim.py) with the real criu: a process whose
memory is half pages of data, half touched pages of zeros, restored eagerly and lazily,
keeps checking every page; the image holds the data pages only.  Skipped without root or
a working criu."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpuos import procs
from gpuos.config import find_criu
from gpuos.hostmem import pagemap as pm
from gpuos.hostmem import trim
from gpuos.manifest import CRIU_DIR
from gpuos.store import ImageStore

from helpers import gpuos_env, gpuos_json, journals, wait_for

pytestmark = pytest.mark.criu
MB = 32

HOLDER = """\
import hashlib, sys, time
mb = int(sys.argv[2])
data = bytearray(mb << 20)   # pages of data
zeros = bytearray(mb << 20)  # pages touched, left zero: present in the process, saved by CRIU
for off in range(0, len(data), 4096):
    data[off:off + 8] = (off // 4096 + 1).to_bytes(8, "little")
    zeros[off] = 0
want = hashlib.sha256(data).hexdigest()
log = open(sys.argv[1], "a", buffering=1)
i = 0
while True:
    ok = hashlib.sha256(data).hexdigest() == want and not any(zeros)
    zeros[(i * 4096) % len(zeros)] = 0  # written to, after the restore too
    log.write(f"{i} {'ok' if ok else 'BAD'}\\n")
    i += 1
    time.sleep(0.01)
"""


def lines(log) -> list[str]:
    text = log.read_text() if log.exists() else ""
    return text[: text.rfind("\n") + 1].splitlines()


@pytest.fixture
def env(criu_bin, home):
    return gpuos_env(home.home, criu=criu_bin)


@pytest.mark.parametrize("host_memory", ["eager", "lazy"])
def test_zero_pages_are_not_saved_and_come_back_as_zeros(env, home, store, processes, tmp_path, host_memory):
    if host_memory == "lazy" and subprocess.run([str(find_criu()), "check", "--feature", "uffd-noncoop"],
                                                capture_output=True).returncode:
        pytest.skip("no userfaultfd for CRIU here")
    script, log = tmp_path / "holder.py", tmp_path / "holder.log"
    script.write_text(HOLDER)
    proc = processes.start([sys.executable, str(script), str(log), str(MB)], "holder")
    wait_for(lambda: len(lines(log)) >= 3, timeout=60, what="the holder to start")
    code, out = gpuos_json(env, "checkpoint", str(proc.pid), "--image", "z")
    assert code == 0, out
    assert "trim" in out["timings"]
    proc.wait(timeout=10)
    m = ImageStore.load(store.root / "z")
    pages = [f for f in m.files if f.path.startswith(f"{CRIU_DIR}/pages-")]
    assert sum(f.size for f in pages) < (MB << 20) * 3 // 2  # the data, not the zeros (2 x MB touched)
    n = len(lines(log))

    code, res = gpuos_json(env, "restore", "z", "--host-memory", host_memory)
    assert code == 0, res
    processes.adopt(proc.pid, str(script))
    wait_for(lambda: len(lines(log)) >= n + 10, what="the restored holder to check its memory")
    assert all(ln.endswith(" ok") for ln in lines(log)), [ln for ln in lines(log) if not ln.endswith(" ok")][:3]
    assert journals(home.run) == []


def test_only_zero_pages_of_private_anonymous_memory_are_dropped(tmp_path):
    """A synthetic dump: two entries, one in private anonymous memory, one outside (a
    file's private mapping, whose absent pages would read the file); zeros dropped only in
    the first, the pages image compacted under a new id."""
    from gpuos.hostmem.criuimg import field, frame

    P = pm.PAGE
    vma = lambda start, end, status: field(1, start) + field(2, end) + field(7, status)  # noqa: E731
    mm = field(1, 0) + b"".join(b"\x72" + bytes([len(v)]) + v for v in
                                 [vma(0x10000, 0x20000, trim.VMA_ANON_PRIVATE | 1),
                                  vma(0x30000, 0x40000, (1 << 6) | 1)])
    (tmp_path / "mm-5.img").write_bytes(frame(trim.MM_MAGIC, [mm]))
    lazy = pm.PE_PRESENT | pm.PE_LAZY
    (tmp_path / "pagemap-5.img").write_bytes(pm.encode(pm.Pagemap(
        pages_id=1, entries=[pm.Entry(0x10000, 4, lazy, 0), pm.Entry(0x30000, 2, pm.PE_PRESENT, 4 * P)])))
    pages = [b"\0" * P, b"A" * P, b"\0" * P, b"\0" * P, b"\0" * P, b"B" * P]
    (tmp_path / "pages-1.img").write_bytes(b"".join(pages))

    before, after = trim.drop_zero_pages(tmp_path)
    assert (before, after) == (6 * P, 3 * P)
    m = pm.parse((tmp_path / "pagemap-5.img").read_bytes())
    assert m.pages_id == 2 and not (tmp_path / "pages-1.img").exists()
    assert [(e.vaddr, e.nr_pages, e.flags, e.offset) for e in m.entries] == [
        (0x10000 + P, 1, lazy, 0), (0x30000, 2, pm.PE_PRESENT, P)]
    assert (tmp_path / "pages-2.img").read_bytes() == b"A" * P + b"\0" * P + b"B" * P


FORKING_HOLDER = """\
import hashlib, os, sys, time
mb = int(sys.argv[2])
data = bytearray(mb << 20)
zeros = bytearray(mb << 20)
for off in range(0, len(data), 4096):
    data[off:off + 8] = (off // 4096 + 1).to_bytes(8, "little")
    zeros[off] = 0
child = os.fork()  # shares both, copy on write
me = "child" if child == 0 else "parent"
if child == 0:  # the child makes some of the parent's data pages zero, and some zero pages data
    for off in range(0, len(data) // 2, 4096):
        data[off:off + 8] = bytes(8)
        zeros[off] = 7
want_data = hashlib.sha256(data).hexdigest()
want_zeros = hashlib.sha256(zeros).hexdigest()
log = open(sys.argv[1], "a", buffering=1)
i = 0
while True:
    ok = hashlib.sha256(data).hexdigest() == want_data and hashlib.sha256(zeros).hexdigest() == want_zeros
    log.write(f"{me} {i} {'ok' if ok else 'BAD'}\\n")
    i += 1
    time.sleep(0.01)
"""


def test_a_forked_child_gets_its_own_zero_pages_back_not_its_parents_data(env, home, store, processes, tmp_path):
    """CRIU restores a child's private memory from its parent's (copy on write) and drops
    the pages the child's image lacks: the zero pages trimmed from the child's image must
    come back as zeros, not as the parent's data."""
    script, log = tmp_path / "forker.py", tmp_path / "forker.log"
    script.write_text(FORKING_HOLDER)
    proc = processes.start([sys.executable, str(script), str(log), str(MB)], "forker")
    wait_for(lambda: sum(ln.startswith("child") for ln in lines(log)) >= 3, timeout=60, what="both to start")
    code, out = gpuos_json(env, "checkpoint", str(proc.pid), "--image", "fork")
    assert code == 0, out
    assert len(out["pids"]) == 2
    proc.wait(timeout=10)
    wait_for(lambda: not any(procs.exists(p) for p in out["pids"]), what="the child to be reaped")
    n = len(lines(log))
    code, res = gpuos_json(env, "restore", "fork")
    assert code == 0, res
    processes.adopt(proc.pid, str(script))
    for pid in out["pids"]:
        processes.adopt(pid, str(script))
    wait_for(lambda: sum(ln.startswith("child") for ln in lines(log)[n:]) >= 10
             and sum(ln.startswith("parent") for ln in lines(log)[n:]) >= 10, what="both to check their memory")
    assert all(ln.endswith(" ok") for ln in lines(log)), [ln for ln in lines(log) if not ln.endswith(" ok")][:3]
