"""Processes sharing one pool of GPU memory (`gpuos run --share NAME`, libgpuos/src/share.c)
on the host: several t_resident processes under `gpuos run`, each on its own fake driver,
in one group whose pool is smaller than what any one of them reserves.

Every t_resident keeps a host copy of its device memory and compares every byte it reads
back: memory evicted at another member's request and not brought back intact, or a
launch that runs before its memory is back, fails the test."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from gpuos.movable.share import group_path, read_group
from helpers import ResidentApp, mem_stats as stats

GPUOS = [sys.executable, "-m", "gpuos.cli"]
MIB = 1 << 20
RESERVED = (2 + 4 + 2 + 8 + 2 + 4) * MIB  # t_resident's movable allocations, rounded to 2 MiB


@pytest.fixture
def group(tmp_path):
    name = f"t{os.getpid()}-{tmp_path.name}"[:64]
    yield name
    group_path(name).unlink(missing_ok=True)


def Member(build: Path, env: dict, tmp: Path, gpuos_args: list[str], rounds: int, seed: int, *mode: str):
    return ResidentApp(build, env, tmp, gpuos_args, rounds, seed, *mode)


@contextlib.contextmanager
def watched(group: str):
    """The group's file read every 2 ms while the block runs: the readings, in order."""
    seen: list = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                seen.append(read_group(group))
            except Exception:  # noqa: BLE001 - not made yet, or between members
                pass
            time.sleep(0.002)

    t = threading.Thread(target=sample)
    t.start()
    try:
        yield seen
    finally:
        done.set()
        t.join()


def run_watched(build: Path, env: dict, tmp: Path, group: str, limit: str, slice_ms: int, rounds: int,
                seed: int, modes: list[tuple[str, ...]]) -> tuple[list[dict], dict, dict]:
    """Members at once (one per mode), beginning their rounds together once all have
    started, the group's file read every 2 ms meanwhile (watched):
    each one's stats, the group's at the end, and what the readings saw (how many; the
    most resident bytes; the most members in a turn's set at once)."""
    tmp.mkdir(parents=True, exist_ok=True)
    members: list[ResidentApp] = []
    gate = Path(tempfile.mkdtemp(dir=tmp, prefix="gate-"))  # T_RESIDENT_GATE: all begin their rounds together
    try:
        with watched(group) as readings:
            for i, mode in enumerate(modes):
                members.append(Member(build, {**env, "T_RESIDENT_GATE": str(gate)}, tmp / f"m{i}",
                                      ["--share", group, "--gpu-memory", limit, "--slice", str(slice_ms)], rounds,
                                      seed + i, *mode))
            deadline = time.monotonic() + 120
            while (len(list(gate.glob("ready-*"))) < len(members) and time.monotonic() < deadline
                   and all(m.proc.poll() is None for m in members)):
                time.sleep(0.01)
            (gate / "go").touch()
            for m in members:
                m.wait_ok()
            g = stats(env, group)
            own = [stats(env, m.pid) for m in members]
    finally:
        results = [m.finish() for m in members]
    assert all(rc == 0 for rc, _ in results), results
    assert g["ask_timeouts"] == 0, g  # a member asked to evict did within the ask's time
    seen = {"samples": len(readings), "max": max((r.resident for r in readings), default=0),
            "set": max((sum(m.holder or m.beside for m in r.members) for r in readings), default=0)}
    return own, g, seen


HELD = ["--gpu-memory", "38M", "--slice", "120000"]  # two readers do not fit together; turns end by leaving


def hold_a_turn(build: Path, env: dict, tmp: Path, group: str, members: list[ResidentApp]):
    """Two readers of 22 MiB in a 38 MiB pool (HELD), in turns of 120 s, appended to
    `members`, started one after the other: the second's start-up copies take the GPU,
    and once both have begun their rounds it holds the turn while the first, which does
    not fit beside it, waits.  The group then, and its holder (the second reader)."""
    gate = tmp / "gate"
    gate.mkdir()
    deadline = time.monotonic() + 120
    for i in range(2):
        members.append(Member(build, {**env, "T_RESIDENT_GATE": str(gate)}, tmp / f"r{i}", ["--share", group, *HELD],
                              200, 101 + i, "read"))
        while len(list(gate.glob("ready-*"))) <= i and time.monotonic() < deadline:
            time.sleep(0.01)
    (gate / "go").touch()
    while time.monotonic() < deadline:
        g = read_group(group)
        holder = next((m for m in g.members if m.holder), None)
        if holder and len(g.members) == 2 and all(m.waiting and not m.beside for m in g.members if not m.holder):
            return g, holder
        time.sleep(0.01)
    pytest.fail(f"no reader held the GPU while the other waited: {read_group(group)}")


def member_of(g, pid: int):
    return next((m for m in g.members if m.pid == pid), None)


def settled_newcomer(group: str, g0, holder, known: set[int], until, what: str):
    """The member not in `known` once `until(member)` holds (within 60 s) and a few of its
    looks at the turn later (every 20 ms): the group then, and that member.  The turn
    must be hold_a_turn's still (`g0`, `holder`): the same holder and switches."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = [m for m in read_group(group).members if m.pid not in known]
        if new and until(new[0]):
            break
        time.sleep(0.01)
    else:
        pytest.fail(f"the new member never {what}: {read_group(group)}")
    time.sleep(0.2)
    g = read_group(group)
    assert member_of(g, holder.pid).holder and (g.switches, member_of(g, holder.pid).slices) == \
        (g0.switches, holder.slices), (g0, g)  # the same turn throughout
    return g, member_of(g, new[0].pid)


def test_members_share_one_pool_and_lose_nothing(libgpuos_build, libgpuos_env, tmp_path, group):
    """Three processes of 22 MiB each in a 16 MiB pool, at once: each one's work is exact,
    the group never has more than 16 MiB resident, the GPU changed hands, and members
    evicted memory for each other."""
    own, g, seen = run_watched(libgpuos_build, libgpuos_env, tmp_path, group, "16M", 5, 300, 11,
                               [()] * 3)
    assert seen["samples"] > 10 and 0 < seen["max"] <= 16 * MIB
    assert g["limit"] == 16 * MIB and g["slice_ns"] == 5_000_000 and g["resident"] <= 16 * MIB
    assert sorted(m["pid"] for m in g["members"]) == sorted(st["pid"] for st in own)
    assert all(m["reserved"] == RESERVED and m["slices"] >= 1 for m in g["members"])
    assert sum(m["resident"] for m in g["members"]) == g["resident"]
    assert g["switches"] >= 2 and sum(g["switch_hist"]) >= 1 and g["switch_p99_us"] >= 1
    assert sum(m["released_bytes"] for m in g["members"]) > 0  # evicted for another member
    for st in own:
        assert st["limit"] == 16 * MIB and st["over_limit"] == 0 and st["evictions"] > 0


def two_readers(build: Path, env: dict, tmp: Path, group: str, limit: str, slice_ms: int, rounds: int,
                seed: int) -> tuple[list[dict], dict]:
    """Two members that read their six allocations round after round, exact: each one's
    stats and the group's at the end."""
    own, g, _ = run_watched(build, env, tmp, group, limit, slice_ms, rounds, seed, [("read",)] * 2)
    return own, g


def test_members_whose_memory_fits_together_run_side_by_side(libgpuos_build, libgpuos_env, tmp_path, group):
    """Two members of 22 MiB each in a 48 MiB pool, in turns of 5 ms: their memory fits
    together, so neither waits for the other's turn (no switch, no eviction), and both
    are exact."""
    own, g = two_readers(libgpuos_build, libgpuos_env, tmp_path, group, "48M", 5, 3000, 41)
    assert g["switches"] == 0 and g["resident"] == 2 * RESERVED, g
    assert all(m["wait_ns"] == 0 for m in g["members"]), g
    assert all(st["evictions"] == 0 and st["launches"] >= 3000 for st in own), own


def test_a_turn_begins_with_the_memory_of_the_last_one(libgpuos_build, libgpuos_env, tmp_path, group):
    """Two members that read their six allocations round after round, each 22 MiB in a 24
    MiB pool, in turns of 20 ms: a turn brings back what the member used in its last one
    as one batch (the other evicting for all of it at once), and the calls find it there.
    Exact.  Over many turns: a batch evicted unused comes at the run's edges (0 to 4 of
    them a run, on this host, however long it is), so a run of a few turns could see more
    of those than of hits."""
    own, g = two_readers(libgpuos_build, libgpuos_env, tmp_path, group, "24M", 20, 40000, 21)
    assert g["switches"] >= 10, g
    for st in own:
        assert st["ahead_bytes"] > 0 and st["ahead_hits"] > st["ahead_unused"], json.dumps([own, g])
        assert 0 < st["ahead_ns"] <= st["in_ns"], st  # a turn's batch: issued, not waited for
        # its parts' making and mapping, and its waits for the other's evictions: of that time
        assert 0 < st["ahead_map_ns"] and st["ahead_map_ns"] + st["room_ns"] <= st["ahead_ns"], st


def test_members_whose_working_sets_fit_together_take_their_turns_together(libgpuos_build, libgpuos_env, tmp_path,
                                                                          group):
    """Four readers of 22 MiB each in a 48 MiB pool, in turns of 5 ms: two fit together,
    so a turn's holder admits beside itself the longest-waiting members whose working
    sets (published as their turns begin) fit with its own.  All exact, never more than
    48 MiB resident, no call refused."""
    own, g, seen = run_watched(libgpuos_build, libgpuos_env, tmp_path, group, "48M", 5, 10000, 51, [("read",)] * 4)
    assert seen["samples"] > 10 and 0 < seen["max"] <= 48 * MIB and seen["set"] >= 1, (seen, g)
    assert g["switches"] >= 2 and g["beside_turns"] >= 1, g
    assert sum(m["beside_slices"] for m in g["members"]) == g["beside_turns"], g
    assert all(m["working_set"] <= RESERVED for m in g["members"]), g
    assert any(m["working_set"] > 0 for m in g["members"]), g
    assert all(st["over_limit"] == 0 for st in own), own


def test_a_member_whose_working_set_grows_beside_the_holder_steps_aside(libgpuos_build, libgpuos_env, tmp_path,
                                                                       group):
    """One reader holds a turn of 120 s, the other waits (hold_a_turn).  A third reader
    started then joins the turn at its first call (what it has reserved so far fits
    beside the holder) and grows as its start-up copies go on, to 22 MiB, which cannot
    fit beside the holder's 22: lacking room, it leaves the turn (steps_aside) and waits
    for one of its own, instead of failing or swapping call by call in what is left it,
    and is not let into that turn again.  Once the two others are gone (killed: the
    waiter would hold the next 120 s turn), it does all its work, exact, no call
    refused."""
    members: list[ResidentApp] = []
    try:
        g0, holder = hold_a_turn(libgpuos_build, libgpuos_env, tmp_path, group, members)
        members.append(Member(libgpuos_build, libgpuos_env, tmp_path / "grows", ["--share", group, *HELD], 200, 109,
                              "read"))
        g, m = settled_newcomer(group, g0, holder, {m.pid for m in g0.members}, lambda m: m.steps_aside,
                                "stepped aside")
        assert (m.beside_slices, m.steps_aside, m.slices) == (1, 1, 0) and m.waiting and not m.beside, g
        assert members[1].wait_ok().pid == holder.pid
        for x in members[:2]:
            x.kill()
        grows = members[2].wait_ok()
        st = stats(libgpuos_env, grows.pid)
        assert st["over_limit"] == 0 and st["limit"] == 38 * MIB, st
        assert member_of(read_group(group), grows.pid).slices >= 1  # its own turn
    finally:
        results = [x.finish() for x in members]
    assert results[-1][0] == 0, results


def test_a_member_that_launches_without_pause_evicts_when_asked(libgpuos_build, libgpuos_env, tmp_path, group):
    """A member launching without pause on 6 MiB that stays resident (t_resident small)
    and a reader of 22 MiB in a 24 MiB pool: the reader's turns need some of the first
    one's memory.  Its launches hold libgpuos's lock nearly always, so its release thread
    alone could wait for it for seconds; its calls evict what was asked first.  Every ask
    is answered within its time (run_watched checks), both exact."""
    own, g, seen = run_watched(libgpuos_build, libgpuos_env, tmp_path, group, "24M", 5, 20000, 71,
                               [("small",), ("read",)])
    spinner = next(m for m in g["members"] if m["pid"] == own[0]["pid"])
    assert spinner["released_bytes"] > 0, g  # it was asked, and evicted
    assert seen["max"] <= 24 * MIB and all(st["over_limit"] == 0 for st in own), own


def test_a_member_not_waiting_whose_resident_memory_fits_is_admitted_beside_the_next_holder(
        libgpuos_build, libgpuos_env, tmp_path, group):
    """One reader holds a turn, the other waits (hold_a_turn); a member of 16 MiB
    (t_resident threads) joins the turn and does its work, then idles with its memory
    resident.  The holder goes; the waiting reader takes the GPU, and admits beside
    itself the idle member, which does not wait but whose resident memory fits with its
    own: in the set, it is asked to evict last (outside, it would be asked first, and its
    next calls would wait for its memory to come back; measured on an H200: in the DNN mix
    at 150% resnet50-infer, 0.66 GB that fits beside every other member, stalled 1.2-4.6 s
    of a 3-8 s run).  Here the new holder's 22 MiB fit beside it: the idle member is
    never asked, and keeps all its memory."""
    members: list[ResidentApp] = []
    try:
        _, holder = hold_a_turn(libgpuos_build, libgpuos_env, tmp_path, group, members)
        members.append(Member(libgpuos_build, libgpuos_env, tmp_path / "idle", ["--share", group, *HELD], 100, 107,
                              "threads"))
        idle = members[-1].wait_ok(timeout=60)
        assert members[1].wait_ok().pid == holder.pid
        members[1].kill()  # the holder goes (killed: on its way out it would free its memory
        # first, and the waiter could join its turn in the room that leaves)
        nxt = members[0].wait_ok()  # the waiter's turn: its work done
        g = read_group(group)
        assert member_of(g, nxt.pid).holder and len(g.members) == 2, g
        m = member_of(g, idle.pid)
        assert m.beside and not m.waiting and m.beside_slices == 2 and m.slices == 0, g  # joined, then admitted
        assert m.resident == 16 * MIB and m.released_bytes == 0, g
        assert all(stats(libgpuos_env, x.pid)["over_limit"] == 0 for x in (nxt, idle))
    finally:
        results = [x.finish() for x in members]
    assert [rc for rc, _ in results[::2]] == [0, 0], results


def test_a_member_that_dies_gives_its_memory_back(libgpuos_build, libgpuos_env, tmp_path, group):
    """A member killed while it holds memory (no chance to leave): the next one to look
    finds it dead, its bytes leave the group's count, and the survivor has the pool."""
    first = Member(libgpuos_build, libgpuos_env, tmp_path / "a", ["--share", group, "--gpu-memory", "12M"], 100, 1)
    first.wait_ok()
    assert read_group(group).resident > 0
    second = Member(libgpuos_build, libgpuos_env, tmp_path / "b", ["--share", group], 400, 2, "cycle")
    time.sleep(0.3)
    os.kill(first.pid, signal.SIGKILL)
    first.proc.communicate(timeout=60)
    try:
        second.wait_ok()
        g = stats(libgpuos_env, group)
    finally:
        rc, err = second.finish()
    assert rc == 0, err
    assert g["reaped"] == 1 and [m["pid"] for m in g["members"]] == [second.pid]
    assert g["resident"] == g["members"][0]["resident"] <= 12 * MIB


def test_a_group_is_listed_until_it_has_emptied(libgpuos_build, libgpuos_env, tmp_path, group):
    m = Member(libgpuos_build, libgpuos_env, tmp_path, ["--share", group, "--gpu-memory", "12M"], 20, 3)
    m.wait_ok()
    assert stats(libgpuos_env, group)["members"][0]["pid"] == m.pid
    shown = subprocess.run([*GPUOS, "mem", "stats", group], env=libgpuos_env, capture_output=True, text=True,
                           check=True).stdout  # the table a person reads: one row per member
    assert "turns shared       0 admissions beside a holder" in shown, shown
    header, row = [line.split() for line in shown.splitlines()[-2:]]
    assert header[:6] == ["PID", "GPU", "RESIDENT", "RESERVED", "WORKING", "SET"] and row[0] == str(m.pid), shown
    listed = json.loads(subprocess.run([*GPUOS, "mem", "groups", "--json"], env=libgpuos_env, capture_output=True,
                                       text=True, check=True).stdout)["groups"]
    assert {"group": group, "limit": 12 * MIB, "members": [m.pid]}.items() <= \
        next(g for g in listed if g["group"] == group).items()
    assert m.finish()[0] == 0
    assert not group_path(group).exists()  # the last one out removed it
    res = subprocess.run([*GPUOS, "mem", "stats", group], env=libgpuos_env, capture_output=True, text=True)
    assert res.returncode == 40 and "no group" in res.stderr


@pytest.mark.parametrize("args, message", [
    (["--share", "new-{g}"], "the first one needs --gpu-memory"),
    (["--share", "{g}", "--gpu-memory", "14M"], "shares 12.0 MiB"),
    (["--share", "a/b", "--gpu-memory", "1G"], "is not a group name"),
    (["--share", ".x", "--gpu-memory", "1G"], "is not a group name"),
    (["--slice", "10", "--gpu-memory", "1G"], "only means something with --share"),
    (["--share", "{g}", "--slice", "0"], "0 is not in the range"),
])
def test_bad_groups_are_refused(libgpuos_build, libgpuos_env, tmp_path, group, args, message):
    """A running member (12 MiB) makes the group exist; bad requests exit 2 before
    anything starts."""
    m = Member(libgpuos_build, libgpuos_env, tmp_path, ["--share", group, "--gpu-memory", "12M"], 20, 4)
    m.wait_ok()
    try:
        res = subprocess.run([*GPUOS, "run", *[a.format(g=group) for a in args], "--", "true"], env=libgpuos_env,
                             capture_output=True, text=True, timeout=60)
    finally:
        assert m.finish()[0] == 0
    assert res.returncode == 2 and message in res.stderr, res.stderr


@pytest.mark.parametrize("lib", ["plain", "tsan"])
def test_threads_of_two_members_lose_nothing(libgpuos_build, libgpuos_env, tmp_path, group, lib):
    """Two processes of four threads each (16 MiB per process) in a 12 MiB pool: each
    process's release thread evicts while its other threads launch; all exact, and with
    ThreadSanitizer (library and program) no race is reported."""
    env, prog = dict(libgpuos_env), "t_resident"
    if lib == "tsan":
        res = subprocess.run(["make", "-s", "-C", str(Path(__file__).resolve().parents[2] / "libgpuos"),
                              f"O={libgpuos_build}", "tsan"], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        env["GPUOS_LIBGPUOS"] = str(libgpuos_build / "tsan" / "libgpuos.so")
        prog = "t_resident_tsan"
    procs = []
    for i in range(2):
        (tmp_path / f"stop{i}").touch()  # each ends at once, having checked everything
        procs.append(subprocess.Popen([*GPUOS, "run", "-q", "--share", group, "--gpu-memory", "12M", "--slice", "3",
                                       "--", str(libgpuos_build / "tests" / prog), str(tmp_path / f"stop{i}"), "100",
                                       str(5 + i), "threads"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and "ThreadSanitizer" not in err, err[-3000:]
        assert out.split()[:2] == ["ok", "100"]


def test_a_group_file_being_made_reads_as_no_group_yet(group):
    """Two `gpuos run --share` started at once: the second one's look at the group (its
    limit) may find the first member's file just created (empty) or sized and not filled
    in; that is no group yet, not a file of another version (it was: once in a host suite).
    The look waits for a member making or joining the file (its exclusive flock)."""
    import fcntl

    from gpuos.errors import GpuosError, NoSuchGroup
    from gpuos.movable.share import HEADER, MEMBER, MEMBERS, group_limit

    path = group_path(group)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a member making it
        got: list = []
        t = threading.Thread(target=lambda: got.append(group_limit(group)))
        t.start()
        t.join(0.3)
        assert t.is_alive() and not got  # waits for the maker
        fcntl.flock(fd, fcntl.LOCK_UN)
        t.join(10)
        assert got == [None]  # empty: no group yet
        os.ftruncate(fd, HEADER.size + MEMBERS * MEMBER.size)
        assert group_limit(group) is None  # sized, not filled in
        os.pwrite(fd, (0x12345678).to_bytes(4, "little"), 0)
        with pytest.raises(GpuosError, match="another version") as exc:
            group_limit(group)
        assert not isinstance(exc.value, NoSuchGroup)
    finally:
        os.close(fd)


def test_a_member_that_begins_to_wait_during_a_turn_joins_it_if_it_fits(libgpuos_build, libgpuos_env, tmp_path,
                                                                       group):
    """One reader holds a turn of 120 s, the other waits (hold_a_turn).  A member started
    then (t_resident threads, 16 MiB) begins to wait during that turn; it fits beside the
    holder, so it joins the turn at once and does all its work in it, instead of waiting
    out the holder's slice (without the rule it would wait 120 s).  A second one started
    after it does not fit (the pool is full), and waits without being let in (let in, it
    would lack room and step aside: its counts say so).  Certain by construction:
    nothing but the long slice could end the turn while the late members run, and it is
    checked not to have.  The two still waiting are killed at the end rather than
    waiting it out."""
    args = ["--share", group, *HELD]
    members: list[ResidentApp] = []
    try:
        with watched(group) as seen:
            g0, holder = hold_a_turn(libgpuos_build, libgpuos_env, tmp_path, group, members)
            members.append(Member(libgpuos_build, libgpuos_env, tmp_path / "fits", args, 100, 107, "threads"))
            fits = members[-1].wait_ok(timeout=60)  # its work done and exact within the holder's turn
            members.append(Member(libgpuos_build, libgpuos_env, tmp_path / "full", args, 100, 108, "threads"))
            full = members[-1]
            g1, left_out = settled_newcomer(group, g0, holder, {m.pid for m in g0.members} | {fits.pid},
                                            lambda m: m.waiting or m.beside_slices, "waited")
            joined = member_of(g1, fits.pid)
            assert joined.slices == 0 and joined.beside_slices == 1 and joined.beside, g1
            assert left_out.waiting and left_out.beside_slices == left_out.steps_aside == 0, g1
            waiter = next(m.pid for m in g0.members if not m.holder)  # never let in either
            assert all(not m.beside for g in seen if any(m.holder and m.pid == holder.pid for m in g.members)
                       for m in g.members if m.pid == waiter)
            assert all(g.resident <= 38 * MIB for g in seen)
            assert stats(libgpuos_env, fits.pid)["over_limit"] == 0
            assert members[1].wait_ok().pid == holder.pid  # its work done in its turn
            for m in (members[0], full):  # they would wait out the slice
                m.kill()
    finally:
        results = [m.finish() for m in members]
    assert [rc for rc, _ in results[1:3]] == [0, 0], results  # (the two killed: either way)
