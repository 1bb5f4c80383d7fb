"""Restore: a process's movable memory streamed from the image into new memory at the
same addresses, on demand.

CRIU and the driver have brought the process back held at its CUDA calls, its movable
memory released (handout.py).  The filler

  1. makes a small staging area (SLOTS x SLOT bytes of shared memory), which the agent
     registers (pinned: a few milliseconds, not the seconds that pinning a whole
     image's memory takes);
  2. asks for new memory for every allocation, its contents to come (FILL_LATER);
  3. on demand (the default): lets the process go on at once (RESUME filling): each of
     its launches waits only until the allocations libgpuos predicts it touches are
     filled, each copy or memset for those it addresses, anything else for all of them
     (gpuos_agent.h);
  4. streams the allocations in, in the order of their last use before the checkpoint
     (libgpuos notes each operation's allocations: the last iteration's order is the next
     one's): the image's pieces (chunks, checked against their names as they are read, in
     parallel) into one slot while the agent copies the other to the GPU (FILL_PARTS); an
     allocation the process waits for, as the agent's reply says, goes next;
  5. eager (stop the world): the same stream, and RESUME once all is in.

What gpuos put on the GPU while CRIU restored the process (prefill.py) is not read again:
its memory is mapped into the agent as the shadows before step 2 and its parts copied on
the device (FILL_PARTS from the shadows) before the stream of the rest.

A chunk that is missing or corrupt stops the fill before any byte of it reaches the GPU:
the restore fails and the process, which would wait for it for ever, is killed.
"""

from __future__ import annotations

import mmap
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..manifest import MovableMemory, MovableRange
from ..store.content import ImageContent, Piece
from .agent import NONE_WANTED, PARTS_MAX, Agent, AgentError, out_of_memory

if TYPE_CHECKING:
    from .prefill import Prefill

SLOT = 64 << 20
SLOTS = 2


@dataclass
class FillStats:
    """What a fill did, for the restore's report."""

    bytes: int = 0
    seconds: float = 0.0          # from the first command to the last byte on the GPU
    resumed_after: float = 0.0    # seconds until the process went on (on demand: at once)
    on_demand: bool = True
    asked: int = 0                # times the process was waiting for an allocation not yet in
    waited_for_all: int = 0       # calls that had to wait for everything
    why: list[str] = field(default_factory=list)  # their reasons, each once
    prefilled: int = 0            # bytes on the GPU already when the process was back (prefill.py)
    prefill_seconds: float = 0.0  # the prefill's time, from the restore's start until it stopped
    prefill_why_not: str | None = None  # why no prefill served (None: one did, or none was asked)


@dataclass(frozen=True)
class Part:
    """A piece of the image's file, and where its bytes go: allocation, offset in it."""

    piece: Piece
    index: int
    offset: int


def order(mem: MovableMemory) -> list[int]:
    """The allocations in the order to fill them: by their last use before the checkpoint
    (the order the next iteration uses them, profile-guided as gCROP), then those never
    used, by address."""
    return sorted(range(len(mem.ranges)), key=lambda i: (mem.ranges[i].last_use == 0, mem.ranges[i].last_use, i))


def parts(content: ImageContent, mem: MovableMemory) -> list[Part]:
    """The file's pieces by allocation, in the order to fill them (a piece across an
    allocation's start, which the store never makes, is refused)."""
    starts = mem.offsets()
    out, i = [], 0
    for p in content.pieces(content.entry(mem.file)):
        if p.chunk is None:  # a whole file's range (formats 1-4): split at allocation starts
            pieces = [Piece(a, min(p.offset + p.size, b) - a, None)
                      for a, b in zip([p.offset] + [s for s in starts if p.offset < s < p.offset + p.size],
                                      [s for s in starts if p.offset < s < p.offset + p.size] + [p.offset + p.size])]
        else:
            pieces = [p]
        for q in pieces:
            while i + 1 < len(starts) and q.offset >= starts[i + 1]:
                i += 1
            if q.offset + q.size > starts[i + 1] or q.size > SLOT:
                raise AgentError(f"{mem.file}: a piece at byte {q.offset} ({q.size} bytes) crosses the start of "
                                 f"allocation {i + 1} or is larger than a slot")
            out.append(Part(q, i, q.offset - starts[i]))
    rank = {i: k for k, i in enumerate(order(mem))}
    return sorted(out, key=lambda part: (rank[part.index], part.offset))


def fill(pid: int, mem: MovableMemory, content: ImageContent, pool: ThreadPoolExecutor,
         on_demand: bool = True, prefill: "Prefill | None" = None) -> FillStats:
    """Stream the image's movable memory of `pid` back (see the module comment); what
    `prefill` has put on the GPU meanwhile is taken from there (prefill.py)."""
    t0 = time.monotonic()
    stats = FillStats(on_demand=on_demand)
    taken = prefill.take() if prefill is not None else None  # a bad chunk it met: raised here
    if prefill is not None:
        stats.prefill_why_not = None if taken else prefill.why_not or "nothing was on the GPU in time"
    fd = os.memfd_create(f"gpuos-fill-{pid}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, SLOT * SLOTS)
        # Not closed here: after a failed read, its traceback may still hold a view of it.
        ring = mmap.mmap(fd, SLOT * SLOTS)
        with Agent(pid) as ag:
            have = [MovableRange(a.base, a.size, a.reserved, a.device) for a in ag.list()]
            if len(have) != len(mem.ranges) or not all(a.same_place(b) for a, b in zip(have, mem.ranges)):
                raise AgentError(f"pid {pid}'s movable memory is not the image's: {len(have)} ranges, "
                                 f"the image has {len(mem.ranges)}")
            if taken:
                try:
                    ag.map(taken.fds, shadows=True)
                except AgentError as exc:  # the agent lets go of what it mapped: streamed instead
                    ag.drop()
                    stats.prefill_why_not, taken = f"pid {pid} could not map it: {exc}", None
            ag.prepare(fd, SLOT * SLOTS)
            try:
                ag.fill_later()
            except AgentError as exc:  # the prefill's memory took the room: let it go, stream it all
                if not taken or not out_of_memory(exc):
                    raise
                ag.drop()
                stats.prefill_why_not, taken = f"no room for pid {pid}'s memory beside it: {exc}", None
                ag.fill_later()  # goes on from the allocation that had no room
            if on_demand:
                ag.resume(filling=True)
                stats.resumed_after = time.monotonic() - t0
            if taken:
                _from_shadows(ag, taken.done, stats)
                stats.prefilled, stats.prefill_seconds = stats.bytes, taken.seconds
            skip = {(p.index, p.offset) for p in taken.done} if taken else set()
            _stream(ag, content, mem, memoryview(ring), pool, stats, skip)
            ag.unprepare()
            if taken:
                ag.drop()
            if not on_demand:
                ag.resume()
                stats.resumed_after = time.monotonic() - t0
    finally:
        os.close(fd)
    stats.seconds = time.monotonic() - t0
    return stats


def _from_shadows(ag: Agent, done: list[Part], stats: FillStats) -> None:
    """The prefilled parts, in the fill order, by device-to-device copies."""
    for k in range(0, len(done), PARTS_MAX):
        batch = done[k:k + PARTS_MAX]
        ag.send_parts([(p.index, p.offset, p.piece.size, 0) for p in batch], from_shadows=True)
        stats.bytes += sum(p.piece.size for p in batch)
        _reply(ag.recv_parts(), deque(), stats)


def _stream(ag: Agent, content: ImageContent, mem: MovableMemory, ring: memoryview,
            pool: ThreadPoolExecutor, stats: FillStats, skip: set[tuple[int, int]]) -> None:
    """Every part not in `skip` (allocation, offset) read into a slot (in parallel) while
    the agent copies the other slot."""
    entry = content.entry(mem.file)
    todo = deque(p for p in parts(content, mem) if (p.index, p.offset) not in skip)
    slot, in_flight = 0, False
    while todo or in_flight:
        batch, used = [], 0
        while todo and used + todo[0].piece.size <= SLOT:
            part = todo.popleft()
            batch.append((part, slot * SLOT + used))
            used += part.piece.size
        list(pool.map(lambda b: content.read_piece(entry, b[0].piece, ring[b[1]:b[1] + b[0].piece.size]), batch))
        if in_flight:
            _reply(ag.recv_parts(), todo, stats)
        in_flight = bool(batch)
        if batch:
            ag.send_parts([(p.index, p.offset, p.piece.size, at) for p, at in batch])
            stats.bytes += used
        slot = (slot + 1) % SLOTS


def _reply(r, todo: deque, stats: FillStats) -> None:
    """A FILL_PARTS reply: what waited for everything; the allocation the process waits
    for goes to the front of what is left."""
    stats.waited_for_all += r.count
    if r.count and r.msg not in stats.why:
        stats.why.append(r.msg)
    if r.arg != NONE_WANTED:
        wanted = [p for p in todo if p.index == r.arg]
        if wanted and todo[0].index != r.arg:
            stats.asked += 1
            rest = [p for p in todo if p.index != r.arg]
            todo.clear()
            todo.extend(wanted + rest)
