"""Groups of processes sharing one pool of GPU memory (`gpuos run --share NAME`): the group
file libgpuos keeps in /dev/shm (libgpuos/include/gpuos_share.h), read without its mutex,
under a shared flock(2) (libgpuos makes a group file and joins it under an exclusive one)."""

from __future__ import annotations

import fcntl
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from gpuos.errors import GpuosError, NoSuchGroup

from .agent import STALL_BUCKETS, log2_hist_percentile

NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")
MAGIC = 0x45524853  # GPUOS_SHARE_MAGIC
VERSION = 3
MEMBERS = 64
HEADER = struct.Struct("<IIIi10Q" + "Q" * STALL_BUCKETS)
MEMBER = struct.Struct("<IHH11QII")
SHM_DIR = Path("/dev/shm")


def check_name(name: str) -> str:
    """`name` if it can name a group, else ValueError saying what can."""
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"{name!r} is not a group name: 1 to 64 of A-Z a-z 0-9 _ . - (not starting with .)")
    return name


def group_path(name: str, uid: int | None = None) -> Path:
    return SHM_DIR / f"gpuos-share-{os.getuid() if uid is None else uid}-{check_name(name)}"


@dataclass(frozen=True)
class Member:
    pid: int
    waiting: int  # its calls waiting for the GPU now
    busy: int  # its calls past the wait, making their memory resident
    resident: int
    reserved: int
    release: int  # bytes the holder asked it to evict, not done yet
    slices: int  # times it took the GPU
    held_ns: int  # time it held the GPU (ended slices)
    released_bytes: int  # evicted at others' requests
    wait_ns: int  # time its calls waited for the GPU
    working_set: int  # bytes its calls needed over its last two turns, as it took its next (0: none yet)
    beside_slices: int  # times it was admitted to a turn beside the holder
    steps_aside: int  # times it left such a turn, lacking room
    holder: bool
    beside: bool  # admitted to the current turn beside the holder


@dataclass(frozen=True)
class GroupStats:
    name: str
    limit: int
    slice_ns: int
    resident: int
    switches: int  # the GPU went from one member to another
    switch_ns: int  # from each switch until the new holder's first call had its memory resident, in all
    reaped: int  # members found dead
    beside_turns: int  # members admitted to a turn beside its holder, in all
    ask_timeouts: int  # asks to evict not all done within libgpuos's 10 s (a stuck member)
    switch_hist: tuple[int, ...]  # those first calls by stall: [2^i, 2^(i+1)) microseconds
    members: tuple[Member, ...]

    def switch_percentile_us(self, q: float) -> int | None:
        """An upper bound of the q-th percentile of the switch stalls, in microseconds."""
        return log2_hist_percentile(self.switch_hist, q)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def read_group(name: str) -> GroupStats:
    """The group's figures and its live members (a member that died without leaving is
    left out; libgpuos reaps it at the next look)."""
    path = group_path(name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise NoSuchGroup(f"no group {name!r} (no {path})") from None
    except OSError as exc:
        raise GpuosError(f"cannot read {path}: {exc.strerror}") from None
    try:
        # Never half made: a member that starts at the same moment as this reader creates
        # the file (empty), then sizes and fills it, under an exclusive flock.
        fcntl.flock(fd, fcntl.LOCK_SH)
        raw = os.pread(fd, os.fstat(fd).st_size, 0)
    except OSError as exc:
        raise GpuosError(f"cannot read {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if not raw or not any(raw[:4]):  # created, not made yet (its maker failed, or is about to)
        raise NoSuchGroup(f"group {name!r} has no members now")
    if len(raw) < HEADER.size + MEMBERS * MEMBER.size:
        raise GpuosError(f"{path} is not a gpuos group file")
    head = HEADER.unpack_from(raw)
    magic, version, size, holder, limit, slice_ns, resident, _held_since, switches, switch_ns, reaped, beside_turns, \
        _claim, ask_timeouts = head[:14]
    if magic != MAGIC or version != VERSION or size != len(raw):
        raise GpuosError(f"{path} was made by another version of gpuos (or is not a group file)")
    members = []
    for i in range(MEMBERS):
        (pid, waiting, busy, _start, res, reserved, release, _since, slices, held_ns, released, wait_ns, working_set,
         beside_slices, beside, steps_aside) = MEMBER.unpack_from(raw, HEADER.size + i * MEMBER.size)
        if pid and _alive(pid):
            members.append(Member(pid=pid, waiting=waiting, busy=busy, resident=res, reserved=reserved, release=release,
                                  slices=slices, held_ns=held_ns, released_bytes=released, wait_ns=wait_ns,
                                  working_set=working_set, beside_slices=beside_slices, steps_aside=steps_aside,
                                  holder=holder == i, beside=bool(beside)))
    if not members:
        raise NoSuchGroup(f"group {name!r} has no members now")
    return GroupStats(name=name, limit=limit, slice_ns=slice_ns, resident=resident, switches=switches,
                      switch_ns=switch_ns, reaped=reaped, beside_turns=beside_turns, ask_timeouts=ask_timeouts,
                      switch_hist=tuple(head[14:]),
                      members=tuple(members))


def group_limit(name: str) -> int | None:
    """The limit of group `name` if it has live members, else None (a new group)."""
    try:
        return read_group(name).limit
    except NoSuchGroup:
        return None


def group_names() -> list[str]:
    """The names of this user's group files (with or without members now)."""
    prefix = f"gpuos-share-{os.getuid()}-"
    try:
        names = [p.name[len(prefix):] for p in SHM_DIR.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return []
    return sorted(n for n in names if NAME_RE.fullmatch(n))
