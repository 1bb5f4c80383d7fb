"""The movable-memory agent end to end on the host: libgpuos in a real process under
`gpuos run`, the fake driver (whose VMM physical memory is a memfd, exported and imported
as fds like the real driver's), and gpuos.movable.Agent.

t_agent checks every byte of its device memory at every iteration and exits 1 at the
first that differs, so any move that loses or mixes up memory fails the test."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuos.movable import Agent, AgentError, agent_available
from gpuos.movable import agent as A
from helpers import kill_run

REPO = Path(__file__).resolve().parents[2]
GPUOS = [sys.executable, "-m", "gpuos.cli"]
SIZES = (2 << 20, (5 << 20) + 3, 8 << 20)  # t_agent's movable allocations
GRAN = 2 << 20


def reserved(n: int) -> int:
    return (n + GRAN - 1) // GRAN * GRAN


@pytest.fixture(scope="module")
def build(libgpuos_build) -> Path:
    return libgpuos_build


class App:
    """t_agent under `gpuos run`."""

    def __init__(self, build: Path, tmp: Path, *gpuos_args: str, app_args: tuple[str, ...] = ()):
        self.stop = tmp / "stop"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUOS_")}
        env.update(GPUOS_LIBGPUOS=str(build / "libgpuos.so"), LD_LIBRARY_PATH=str(build / "fakecuda"))
        self.proc = subprocess.Popen([*GPUOS, "run", "-q", *gpuos_args, "--", str(build / "tests" / "t_agent"),
                                      str(self.stop), "5", *app_args], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        assert line and line[0] == "ready", self.proc.stderr.read()
        self.pid, self.bases = int(line[1]), [int(x) for x in line[2:]]

    def finish(self) -> tuple[int, str, str]:
        self.stop.touch()
        out, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        kill_run(self.pid, self.proc)


@pytest.fixture
def app(build, tmp_path):
    a = App(build, tmp_path)
    yield a
    a.kill()


def memfd(size: int) -> int:
    fd = os.memfd_create("test-capture")
    os.ftruncate(fd, size)
    return fd


def iteration_of(data: bytes, i: int) -> int:
    """t_agent's iteration k from allocation i's first byte (byte j is j*31 + i*7 + k)."""
    return (data[0] - i * 7) % 256


def expected(n: int, i: int, k: int) -> bytes:
    return bytes((j * 31 + i * 7 + k) & 0xFF for j in range(n))


def test_the_header_and_the_mirror_agree(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "l.c"
    src.write_text('#include <stdio.h>\n#include "gpuos_agent.h"\nint main(void){printf("%zu %zu %zu %zu %u %d %s '
                   '%d %llu %u %d %d %zu %u\\n", sizeof(struct gpuos_agent_req), sizeof(struct gpuos_agent_reply), '
                   'sizeof(struct gpuos_agent_alloc), sizeof(struct gpuos_agent_part), GPUOS_AGENT_MAGIC, '
                   'GPUOS_AGENT_FDS_PER_MSG, GPUOS_AGENT_NAME, GPUOS_AGENT_FILL_PARTS, GPUOS_AGENT_FILL_LATER, '
                   'GPUOS_AGENT_RESUME_FILLING, GPUOS_AGENT_PARTS_MAX, GPUOS_AGENT_MEM_STATS, '
                   'sizeof(struct gpuos_res_stats), GPUOS_AGENT_PART_SHADOW); return 0;}\n')
    subprocess.run([cc, "-Wall", "-Werror", f"-I{REPO / 'libgpuos' / 'include'}", "-o", str(tmp_path / "l"), str(src)],
                   check=True)
    out = subprocess.run([str(tmp_path / "l")], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(A.REQ.size), str(A.REPLY.size), str(A.ALLOC.size), str(A.PART.size), str(A.MAGIC),
                   str(A.FDS_PER_MSG), A.NAME, str(A.FILL_PARTS), str(A.FILL_LATER), str(A.RESUME_FILLING),
                   str(A.PARTS_MAX), str(A.MEM_STATS), str(A.MEM_STATS_STRUCT.size), str(A.PART_SHADOW)]


def test_capture_hand_out_and_map_back_while_the_application_runs(app):
    """HOLD stops t_agent at its CUDA calls; LIST gives its three large allocations; CAPTURE
    copies exactly their contents at one iteration; EXPORT + RELEASE leave the process
    without its memory and MAP puts the same memory back: t_agent goes on, checking every
    byte, and ends well."""
    assert agent_available(app.pid)
    with Agent(app.pid) as ag:
        count, nbytes = ag.hold()
        assert count == 3 and nbytes == sum(reserved(n) for n in SIZES)
        allocs = ag.list()
        assert [a.base for a in allocs] == sorted(app.bases[:3])
        assert sorted(a.size for a in allocs) == sorted(SIZES)
        fd = memfd(nbytes)
        assert ag.prepare(fd, nbytes).arg == 1  # registered (the driver wants a current context)
        r = ag.capture()
        assert r.bytes == nbytes
        with mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ) as m:
            off = 0
            for a in allocs:
                i = app.bases.index(a.base)
                data = m[off:off + a.size]
                assert data == expected(a.size, i, iteration_of(data, i)), f"allocation {i}"
                off += a.reserved
        ag.unprepare()
        os.close(fd)
        fds = ag.export()
        assert len(fds) == 3
        ag.release()
        with pytest.raises(AgentError, match="MAP or FILL first"):
            ag.resume()
        ag.map(fds)
        for f in fds:
            os.close(f)
        ag.resume()
    rc, out, err = app.finish()
    assert rc == 0 and out.split()[0] == "ok", err


def test_fill_puts_captured_contents_into_new_memory(app):
    """CAPTURE, RELEASE (the memory is gone: nobody holds it), FILL from the capture: new
    physical memory at the same addresses with the same bytes; t_agent goes on."""
    with Agent(app.pid) as ag:
        fd = memfd(sum(reserved(n) for n in SIZES))
        ag.prepare(fd, sum(reserved(n) for n in SIZES))  # before the hold, as gpuos does
        _, nbytes = ag.hold()
        ag.capture()
        ag.release()
        r = ag.fill()
        assert r.bytes == nbytes
        os.close(fd)
        ag.resume()
    rc, out, err = app.finish()
    assert rc == 0, err


def test_a_wrong_fill_is_seen_by_the_application(app):
    """The test can fail: memory filled with other bytes makes t_agent exit 1."""
    with Agent(app.pid) as ag:
        _, nbytes = ag.hold()
        fd = memfd(nbytes)
        ag.prepare(fd, nbytes)
        ag.capture()
        os.pwrite(fd, b"\x55", 12345)
        ag.release()
        ag.fill()
        os.close(fd)
        ag.resume()
    rc, out, err = app.finish()
    assert rc == 1 and "byte 12345" in err


def test_a_client_gone_while_holding_lets_the_application_go_on(app):
    ag = Agent(app.pid)
    ag.hold()
    ag.close()
    time.sleep(0.2)
    rc, out, err = app.finish()
    assert rc == 0, err


def test_commands_out_of_order_are_refused_and_harmless(app):
    with Agent(app.pid) as ag:
        for call, what in ((ag.list, "not held"), (ag.release, "not held"), (ag.resume, "not held")):
            with pytest.raises(AgentError, match=what):
                call()
        ag.hold()
        with pytest.raises(AgentError, match="the memory is mapped"):
            ag.map([])
        with pytest.raises(AgentError, match="prepared memfd has 0 bytes"):
            ag.capture()
        fd = memfd(4096)
        ag.prepare(fd, 4096)
        with pytest.raises(AgentError, match="prepared memfd has 4096 bytes"):
            ag.capture()
        os.close(fd)
        ag.resume()
    rc, out, err = app.finish()
    assert rc == 0, err


def test_no_agent_without_movable_memory(build, tmp_path):
    a = App(build, tmp_path, "--memory", "driver")
    try:
        assert not agent_available(a.pid)
        with pytest.raises(AgentError, match="serves no movable-memory agent"):
            Agent(a.pid)
        rc, out, err = a.finish()
        assert rc == 0, err
    finally:
        a.kill()


def sockets(pid: int) -> int:
    fd_dir = Path(f"/proc/{pid}/fd")
    return sum(1 for f in fd_dir.iterdir() if os.readlink(f).startswith("socket:"))


def test_hold_detach_closes_the_control_connection_until_resume(app):
    """Before a CRIU dump the process must hold no socket connected outside it: HOLD with
    detach closes its connection to `gpuos run`, RESUME makes it again."""
    with Agent(app.pid) as ag:
        ag.hold()
        ag.resume()  # the agent has accepted this connection by now
        before = sockets(app.pid)  # the agent's listener, this connection, gpuos run's
        ag.hold(detach=True)
        assert sockets(app.pid) == before - 1
        ag.resume()
        assert sockets(app.pid) == before
    rc, out, err = app.finish()
    assert rc == 0, err


def test_a_snapshot_is_one_instant_captured_while_the_application_runs(app):
    """SNAPSHOT while held copies every allocation on the device; handed out and mapped
    back with the application's memory (as around a driver checkpoint), it is captured
    after RESUME while t_agent keeps rewriting its memory: the capture is the memory as
    it was at the hold (t_agent's allocations in one iteration k, or the first few
    already in k + 1 if it was held mid-iteration), not as it is now (a held capture
    afterwards finds t_agent further on), and the application is unharmed."""
    total = sum(reserved(n) for n in SIZES)
    fd = memfd(total)
    with Agent(app.pid) as ag:
        ag.prepare(fd, total)
        ag.hold()
        ag.snapshot()
        allocs = ag.list()
        mine, shadows = ag.export(), ag.export(shadows=True)
        ag.release()
        ag.map(mine)
        ag.map(shadows, shadows=True)
        for f in mine + shadows:
            os.close(f)
        ag.resume()
        time.sleep(0.2)  # t_agent moves on meanwhile
        r = ag.capture()
        assert r.arg == 1 and r.bytes == total  # from the snapshot
        with pytest.raises(AgentError, match="not held"):
            ag.capture()  # the snapshot is gone with its capture

        def iterations() -> list[int]:  # by t_agent's allocation index
            got = {}
            with mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ) as m:
                off = 0
                for a in allocs:
                    i = app.bases.index(a.base)
                    data = m[off:off + a.size]
                    got[i] = iteration_of(data, i)
                    assert data == expected(a.size, i, got[i]), f"allocation {i} is not one iteration"
                    off += a.reserved
            return [got[i] for i in sorted(got)]

        snap = iterations()
        k = snap[-1]
        assert all(x in (k, (k + 1) % 256) for x in snap) and snap == sorted(snap, key=lambda x: x != (k + 1) % 256)
        ag.hold()
        ag.capture()  # held, no snapshot: the memory now
        ag.resume()
        assert iterations()[-1] != k  # t_agent went on after the snapshot
        ag.unprepare()
    os.close(fd)
    rc, out, err = app.finish()
    assert rc == 0, err


# -- filling while the application runs (restore on demand) -----------------------------------

def _parts_of(allocs, index: int) -> list[tuple[int, int, int, int]]:
    """Allocation `index`, the whole of it, from where CAPTURE put it in the staging area."""
    return [(index, 0, allocs[index].reserved, sum(a.reserved for a in allocs[:index]))]


def _held_and_captured(ag: Agent) -> tuple[list, int, int]:
    """HOLD, CAPTURE into a staging memfd (left prepared): (allocations, the memfd, bytes)."""
    _, nbytes = ag.hold()
    allocs = ag.list()
    fd = memfd(nbytes)
    ag.prepare(fd, nbytes)
    ag.capture()
    return allocs, fd, nbytes


def _captured_then_emptied(ag: Agent) -> tuple[list, int, int]:
    """_held_and_captured, then RELEASE, FILL_LATER: new memory whose contents are to
    come.  (allocations, the memfd, bytes)."""
    allocs, fd, nbytes = _held_and_captured(ag)
    ag.release()
    assert ag.fill_later().bytes == nbytes
    return allocs, fd, nbytes


def _held_and_released(app):
    """t_agent held, its memory captured (the image's file) and released, as after CRIU
    and the driver brought it back: (MovableMemory, its bytes)."""
    from gpuos.manifest import MovableMemory, MovableRange

    with Agent(app.pid) as ag:
        allocs, fd, nbytes = _held_and_captured(ag)
        ag.unprepare()
        ag.release()
    data = os.pread(fd, nbytes, 0)
    os.close(fd)
    mem = MovableMemory(app.pid, "gpu-memory.bin", nbytes,
                        [MovableRange(a.base, a.size, a.reserved, a.device, a.last_use) for a in allocs])
    return mem, data


def _wanted(ag: Agent, timeout: float = 10.0) -> int:
    """The allocation the application waits for (an empty FILL_PARTS asks)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ag.send_parts([])
        r = ag.recv_parts()
        if r.arg != A.NONE_WANTED:
            return r.arg
        time.sleep(0.01)
    raise AssertionError("the application never waited for an allocation")


def test_filling_lets_the_application_go_on_waiting_only_for_what_it_touches(app):
    """FILL_LATER gives new, empty memory; RESUME(filling) lets t_agent go on: its first copy
    waits for the allocation it reads (reported as wanted), and once that one is filled it
    goes on to wait for the next one it touches, not for all of them.  Filled one by one,
    every byte checked by t_agent: nothing stale is ever read."""
    with Agent(app.pid) as ag:
        allocs, fd, _ = _captured_then_emptied(ag)
        with pytest.raises(AgentError, match="not prepared|out of bounds"):
            ag.send_parts([(0, 0, allocs[0].reserved + GRAN, 0)])  # more than the allocation has
            ag.recv_parts()
        ag.resume(filling=True)
        with pytest.raises(AgentError, match="still being filled"):
            ag.hold()
        order = [sorted(app.bases[:3]).index(b) for b in app.bases[:3]]  # t_agent's order, in LIST indices
        first = _wanted(ag)  # the one it was about to touch when held
        ag.send_parts(_parts_of(allocs, first))
        ag.recv_parts()
        after = order[(order.index(first) + 1) % len(order)]
        assert _wanted(ag) == after  # it went on, and waits for the next one it touches
        for i in set(order) - {first}:
            ag.send_parts(_parts_of(allocs, i))
            ag.recv_parts()
        ag.hold()  # all filled: the gate is open, a HOLD works again
        ag.resume()
        os.close(fd)
    rc, out, err = app.finish()
    assert rc == 0 and out.split()[0] == "ok", err


def test_filled_in_small_parts_from_a_small_staging_area(app):
    """Parts of 1 MiB through a staging area of 2 MiB (reused), any order: the contents
    come out whole."""
    mem, captured = _held_and_released(app)
    starts = mem.offsets()
    with Agent(app.pid) as ag:
        stage = memfd(2 << 20)
        ag.prepare(stage, 2 << 20)
        ag.fill_later()
        ag.resume(filling=True)
        pieces = [(i, off) for i, r in enumerate(mem.ranges) for off in range(0, r.reserved, 1 << 20)]
        for k, (i, off) in enumerate(reversed(pieces)):
            at = (k % 2) << 20
            os.pwrite(stage, captured[starts[i] + off:starts[i] + off + (1 << 20)], at)
            ag.send_parts([(i, off, 1 << 20, at)])
            r = ag.recv_parts()
            assert r.bytes == 1 << 20
        with pytest.raises(AgentError, match="nothing is being filled"):
            ag.send_parts([(0, 0, 1, 0)])
            ag.recv_parts()
        os.close(stage)
    rc, out, err = app.finish()
    assert rc == 0 and out.split()[0] == "ok", err


def test_a_call_that_may_touch_anything_waits_for_everything(build, tmp_path):
    """A free (cuMemFree) while the memory is being filled waits until all of it is filled,
    and FILL_PARTS reports it: a count and the call's name."""
    a = App(build, tmp_path, app_args=("free-early",))
    try:
        with Agent(a.pid) as ag:
            allocs, fd, _ = _captured_then_emptied(ag)
            a.stop.touch()  # it frees after the next allocation it touches
            ag.resume(filling=True)
            filled: set[int] = set()
            deadline, seen = time.monotonic() + 10, None
            while seen is None and time.monotonic() < deadline:
                ag.send_parts([])
                r = ag.recv_parts()
                if r.count:
                    seen = r
                elif r.arg != A.NONE_WANTED and r.arg not in filled:  # what it touches first
                    ag.send_parts(_parts_of(allocs, r.arg))
                    ag.recv_parts()
                    filled.add(r.arg)
                time.sleep(0.01)
            assert seen is not None and seen.msg.startswith("cuMemFree"), "the free did not wait"
            assert len(filled) < len(allocs) and a.proc.poll() is None  # it waits for the rest
            for i in set(range(len(allocs))) - filled:
                ag.send_parts(_parts_of(allocs, i))
                ag.recv_parts()
            os.close(fd)
        out, err = a.proc.communicate(timeout=60)
        assert a.proc.returncode == 0 and out.split()[-1] == "freed", err
    finally:
        a.kill()


def test_list_says_when_each_allocation_was_last_used(app):
    """Every recorded operation notes the movable allocations it touches: LIST's last_use
    orders them as t_agent uses them, each iteration (a rotation of its order, if held
    mid-iteration), which is the order a restore streams them back in."""
    from gpuos.manifest import MovableMemory, MovableRange
    from gpuos.movable.filler import order

    time.sleep(0.2)  # iterations recorded
    with Agent(app.pid) as ag:
        ag.hold()
        allocs = ag.list()
        ag.resume()
    assert all(a.last_use > 0 for a in allocs) and len({a.last_use for a in allocs}) == len(allocs)
    by_use = [app.bases.index(a.base) for a in sorted(allocs, key=lambda a: a.last_use)]
    assert by_use in ([0, 1, 2], [1, 2, 0], [2, 0, 1]), by_use
    mem = MovableMemory(app.pid, "gpu-memory.bin", sum(a.reserved for a in allocs),
                        [MovableRange(a.base, a.size, a.reserved, a.device, a.last_use) for a in allocs])
    assert [app.bases.index(allocs[i].base) for i in order(mem)] == by_use


def test_the_fill_order_puts_allocations_never_used_last():
    from gpuos.manifest import MovableMemory, MovableRange
    from gpuos.movable.filler import order

    ranges = [MovableRange(base=i << 30, size=1, reserved=GRAN, device=0, last_use=u)
              for i, u in enumerate([7, 0, 3, 0, 9])]
    assert order(MovableMemory(1, "f", 5 * GRAN, ranges)) == [2, 0, 4, 1, 3]


# -- a restore's prefill: memory filled elsewhere, taken by device copies ---------------------

class _Content:
    """An image's movable-memory file as ImageContent serves it to the filler: its bytes in
    pieces of 1 MiB (formats 1-4 style, split at the allocations' starts)."""

    def __init__(self, data: bytes):
        from gpuos.manifest import FileEntry

        self.data, self.file = data, FileEntry(path="gpu-memory.bin", size=len(data))
        self.read: list[int] = []  # offsets the filler read

    def entry(self, rel: str):
        return self.file

    def pieces(self, entry):
        from gpuos.store.content import Piece

        return [Piece(off, min(1 << 20, len(self.data) - off), None) for off in range(0, len(self.data), 1 << 20)]

    def read_piece(self, entry, piece, buf) -> None:
        self.read.append(piece.offset)
        buf[:] = self.data[piece.offset:piece.offset + piece.size]


class _Prefilled:
    """A prefill whose first `n` parts are done: one memfd per allocation (the fake
    driver's exported memory) with those parts' bytes, and 0xEE everywhere else, which
    t_agent would see if the filler took anything else from there."""

    def __init__(self, content: _Content, mem, n: int, error: Exception | None = None):
        from gpuos.movable.filler import parts

        self.why_not, self.error = None, error
        self.done = parts(content, mem)[:n]
        starts = mem.offsets()
        self.fds = []
        for i, r in enumerate(mem.ranges):
            buf = bytearray(b"\xee" * r.reserved)
            for p in self.done:
                if p.index == i:
                    buf[p.offset:p.offset + p.piece.size] = content.data[starts[i] + p.offset:
                                                                         starts[i] + p.offset + p.piece.size]
            fd = memfd(r.reserved)
            os.pwrite(fd, bytes(buf), 0)
            self.fds.append(fd)

    def take(self):
        from gpuos.movable.prefill import Taken

        if self.error:
            raise self.error
        return Taken(self.done, self.fds, 0.5)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


@pytest.mark.parametrize("on_demand", [True, False])
@pytest.mark.parametrize("done", [0, 5, "all"])
def test_a_fill_takes_what_the_prefill_put_on_the_gpu_and_streams_the_rest(app, on_demand, done):
    """The prefill's done parts come from its memory (MAPped as shadows without a snapshot,
    FILL_PARTS from the shadows), only the others are read from the image, and t_agent,
    checking every byte, finds its memory whole; the shadows are dropped after."""
    from concurrent.futures import ThreadPoolExecutor

    from gpuos.movable import filler

    mem, data = _held_and_released(app)
    content = _Content(data)
    every = filler.parts(content, mem)
    n = len(every) if done == "all" else done
    pf = _Prefilled(content, mem, n)
    try:
        with ThreadPoolExecutor(4) as pool:
            stats = filler.fill(app.pid, mem, content, pool, on_demand=on_demand, prefill=pf)
    finally:
        pf.close()
    assert stats.bytes == len(data) and stats.prefilled == sum(p.piece.size for p in every[:n])
    assert stats.prefill_why_not is None and stats.prefill_seconds == 0.5
    assert sorted(content.read) == sorted(p.piece.offset for p in every[n:])  # mem.offsets() + offset
    with Agent(app.pid) as ag:
        ag.hold()
        with pytest.raises(AgentError, match="no snapshot"):
            ag.export(shadows=True)  # dropped
        ag.resume()
    rc, out, err = app.finish()
    assert rc == 0 and out.split()[0] == "ok", err


def test_a_bad_chunk_met_by_the_prefill_fails_the_fill_before_anything_moves(app):
    """The prefill's error (a corrupt chunk) is the fill's: raised before the agent is
    asked for anything, so t_agent stays held, its memory released (the restore kills it)."""
    from concurrent.futures import ThreadPoolExecutor

    from gpuos.errors import ImageCorrupt
    from gpuos.movable import filler

    mem, data = _held_and_released(app)
    content = _Content(data)
    pf = _Prefilled(content, mem, 2, error=ImageCorrupt("chunk abc is corrupt"))
    try:
        with ThreadPoolExecutor(2) as pool, pytest.raises(ImageCorrupt, match="abc"):
            filler.fill(app.pid, mem, content, pool, prefill=pf)
    finally:
        pf.close()
    assert content.read == []
    with Agent(app.pid) as ag:
        with pytest.raises(AgentError, match="released"):
            ag.resume()


def test_shadows_mapped_without_a_snapshot_are_checked_and_let_go(app):
    """MAP with shadows and no snapshot makes one (held): fds in order only; FILL_PARTS
    from the shadows refuses a part past an allocation's end; a MAP cut short is undone by
    DROP (nothing stays mapped), and a second MAP of all of them then works."""
    mem, data = _held_and_released(app)
    sizes = [r.reserved for r in mem.ranges]
    fds = [memfd(n) for n in sizes]
    try:
        with Agent(app.pid) as ag:
            with pytest.raises(AgentError, match="no snapshot"):  # not from its start
                ag._request(A.MAP, 1 | A.SHADOWS, fds[1:2])
            ag._request(A.MAP, 0 | A.SHADOWS, fds[:1])  # one of three
            ag.drop()
            ag.map(fds, shadows=True)
            ag.fill_later()
            with pytest.raises(AgentError, match="out of bounds"):
                ag.send_parts([(0, 0, sizes[0] + GRAN, 0)], from_shadows=True)
                ag.recv_parts()
            ag.send_parts([(i, 0, n, 0) for i, n in enumerate(sizes)], from_shadows=True)
            assert ag.recv_parts().bytes == sum(sizes)
            ag.drop()
            ag.hold()  # all filled (zeros): the gate is open
            ag.resume()
            ag.resume()
    finally:
        for fd in fds:
            os.close(fd)
    app.kill()  # its memory is zeros now: t_agent would say so


def test_a_prefill_that_takes_the_room_is_let_go_and_the_fill_streams_it_all(app):
    """The prefill's memory, mapped as the shadows, leaves no room for the process's own
    (here one shadow is made to fill the fake driver's 16 GiB but 3 MiB): FILL_LATER
    fails for lack of memory, the shadows are dropped, and the fill streams everything
    from the image instead; t_agent finds its memory whole."""
    from concurrent.futures import ThreadPoolExecutor

    from gpuos.movable import filler

    mem, data = _held_and_released(app)
    content = _Content(data)
    pf = _Prefilled(content, mem, 3)
    others = sum(r.reserved for r in mem.ranges[1:])  # the other shadows' imports count too
    os.ftruncate(pf.fds[0], (16 << 30) - others - (3 << 20))  # sparse: no host memory behind it
    try:
        with ThreadPoolExecutor(2) as pool:
            stats = filler.fill(app.pid, mem, content, pool, prefill=pf)
    finally:
        pf.close()
    assert stats.prefilled == 0 and "no room for pid" in stats.prefill_why_not and "OUT_OF_MEMORY" in stats.prefill_why_not
    assert stats.bytes == len(data) and len(content.read) == len(filler.parts(content, mem))
    rc, out, err = app.finish()
    assert rc == 0 and out.split()[0] == "ok", err
