"""Managed memory moved ahead of the launches that need it, by the patched driver (issue
19's driver path).

A program that uses CUDA managed memory gets its pages by demand paging: each first touch
on the GPU faults, and fault-driven migration runs at a small fraction of PCIe speed.
libgpuos records, for every launch, the buffers it may touch (gpuos_ring.h: LAUNCH
records, managed buffers flagged); launches repeat (training iterations, decode steps).
So gpuos learns the repeating sequence of the launches' managed working sets and, for the
next launches (at least `window`, and twice as many as it launched since the last step:
the program runs on while a step is made and served), asks the driver through gpuos.ko
(kmod/uapi/gpuos.h), one step at a time with only what changed:

  - MIGRATE to the GPU: ranges entering the window, the soonest needed most urgent
    (the window's eighths: GPUOS_MAX_PRIO + 1 priorities), one batch;
  - HINT EVICT_FIRST: ranges leaving the window: their next use is the farthest known
    (Belady), so the driver evicts them first under pressure;
  - SET_PREFETCH: the window's ranges, which a patched nvidia-uvm services with any
    fault inside them (patches/0004), so a launch the prediction missed still moves in
    2 MiB blocks, not pages.

Until the sequence repeats, the window is the last launch's working set (as LRU would
keep it), and `Stats.period` is 0.  The driver names the address space (as_id); gpuos
learns a process's from the first fault event that names its pid.  Nothing here touches
the application: without gpuos.ko, a registered driver with the migrate and hint caps, or
CAP_SYS_ADMIN, `why_not` says why and no request is made.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

from ..errors import GpuosError, LimitReached
from ..kernel.model import Event, KmodInfo, Range
from ..kernel.uapi import DEST_GPU, MAX_NL_RANGES, MAX_PRIO, PAGE_SIZE, RANGE_EVICT_FIRST, DriverCaps, Op

WINDOW = 8  # launches ahead, at least: more when more launched between two steps
MAX_PERIOD = 1024  # launches in the longest repeating sequence looked for
HISTORY = 2 * MAX_PERIOD

Span = tuple[int, int]  # (base, length), page-aligned


def working_set(rec: dict) -> frozenset[Span]:
    """The managed memory a LAUNCH record (intercept.ring.decode) may touch, page-aligned:
    each managed buffer's allocation, or its exact range where libgpuos knows it."""
    out = set()
    for b in rec.get("bufs", ()):
        if "managed" not in b["flags"]:
            continue
        lo, hi = (b["ptr"], b["ptr"] + b["len"]) if "exact" in b["flags"] and b["len"] else \
            (b["base"], b["base"] + b["size"])
        lo -= lo % PAGE_SIZE
        hi += -hi % PAGE_SIZE
        if hi > lo:
            out.add((lo, hi - lo))
    return frozenset(out)


def merge(spans: Iterable[Span]) -> list[Span]:
    """Disjoint, sorted spans covering the same bytes (touching ones joined)."""
    out: list[list[int]] = []
    for base, length in sorted(spans):
        if out and base <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], base + length - out[-1][0])
        else:
            out.append([base, length])
    return [(b, n) for b, n in out]


class LaunchSequence:
    """The managed working sets of the launches so far (those that touch any), and the
    period with which they repeat: the smallest p whose last 2p launches are one run of p
    twice over.  Cheap per launch: a period is looked for only among the distances to the
    last few launches with the same working set."""

    CANDIDATES = 8  # earlier launches of the same working set tried as a period's start

    def __init__(self) -> None:
        self.ids: deque[int] = deque(maxlen=HISTORY)  # each launch's working set, interned
        self.period = 0
        self.count = 0  # launches added
        self._id_of: dict[frozenset[Span], int] = {}
        self._sets: list[frozenset[Span]] = []
        self._seen: dict[int, deque[int]] = {}  # id -> the last launches (counts) with it

    def _intern(self, ws: frozenset[Span]) -> int:
        if ws not in self._id_of:
            if len(self._sets) >= 16 * HISTORY:  # a program that never repeats: start again
                self._id_of.clear(), self._sets.clear(), self._seen.clear(), self.ids.clear()
                self.period = 0
            self._id_of[ws] = len(self._sets)
            self._sets.append(ws)
        return self._id_of[ws]

    def add(self, ws: frozenset[Span]) -> None:
        i = self._intern(ws)
        s, n, p = self.ids, self.count, self.period
        s.append(i)
        self.count += 1
        seen = self._seen.setdefault(i, deque(maxlen=self.CANDIDATES))
        earlier = list(seen)
        seen.append(n)
        if p and len(s) > p and s[-1 - p] == i:
            return
        self.period = 0
        for q in sorted(n - e for e in earlier):
            if q <= MAX_PERIOD and 2 * q <= len(s) and all(s[-k] == s[-k - q] for k in range(1, q + 1)):
                self.period = q
                return

    def ahead(self, k: int) -> list[frozenset[Span]]:
        """The working sets of the next k launches: the period's, from where the program is
        in it; without one, the last launch's (one)."""
        s, p = self.ids, self.period
        if not s:
            return []
        if not p:
            return [self._sets[s[-1]]]
        return [self._sets[s[len(s) - p + i % p]] for i in range(k)]


@dataclass(frozen=True)
class Step:
    """What one step asks of the driver."""

    migrate: list[Range]      # to the GPU, entering the window
    evict_first: list[Range]  # leaving it
    prefetch: list[Span]      # the window's ranges (replaces the last step's)


class Planner:
    """The window's ranges from one step to the next: only the changes are asked for."""

    def __init__(self, gpu: int, window: int = WINDOW):
        self.dest, self.window = DEST_GPU(gpu), window
        self.in_window: dict[Span, int] = {}

    def step(self, seq: LaunchSequence, window: int | None = None) -> Step | None:
        """None when the window (`window` launches, else the planner's) holds what it held.
        Priorities spread over the window: its first eighth most urgent."""
        n = max(window or self.window, 1)
        want: dict[Span, int] = {}
        for i, ws in enumerate(seq.ahead(n)):
            for span in ws:
                want.setdefault(span, min(i * (MAX_PRIO + 1) // n, MAX_PRIO))
        if want.keys() == self.in_window.keys():
            return None
        entering = sorted((p, span) for span, p in want.items() if span not in self.in_window)
        leaving = sorted(span for span in self.in_window if span not in want)
        self.in_window = want
        return Step(migrate=[Range(b, n, self.dest, p) for p, (b, n) in entering],
                    evict_first=[Range(b, n, self.dest, MAX_PRIO, RANGE_EVICT_FIRST) for b, n in leaving],
                    prefetch=merge(want))


class Kernel(Protocol):
    """What the feeder needs of gpuos.kernel.netlink.GpuosNetlink."""

    def get_info(self) -> KmodInfo: ...
    def migrate(self, as_id: int, op: Op | int, ranges: Sequence[Range]) -> int: ...
    def set_prefetch(self, as_id: int, ranges: Sequence[Span] = ()) -> None: ...


@dataclass
class Stats:
    launches: int = 0          # LAUNCH records seen
    window: int = 0            # launches ahead at the last step
    managed_launches: int = 0  # of them, touching managed memory
    period: int = 0            # the learned period; 0: none (the window is the last launch's set)
    steps: int = 0             # steps that asked the driver for something (each sets the prefetch ranges)
    batches: int = 0           # MIGRATE and HINT batches accepted by gpuos.ko
    ranges_migrated: int = 0
    bytes_migrated: int = 0
    ranges_hinted: int = 0
    dropped: int = 0           # steps refused while gpuos.ko had too many batches pending
    errors: list[str] = field(default_factory=list)  # each once


def driver_not_ready(info: KmodInfo) -> str | None:
    """Why a registered driver cannot take the feeder's requests; None if it can."""
    if not info.driver_name:
        return "no GPU driver is registered with gpuos.ko (the patched nvidia-uvm is not loaded)"
    caps = DriverCaps(info.driver_caps)
    lacks = [c.name.lower() for c in (DriverCaps.MIGRATE, DriverCaps.HINT) if c not in caps]
    return f"the driver {info.driver_name} lacks {' and '.join(lacks)}" if lacks else None


class AheadFeeder:
    """Feeds one process's launches (`pid`, on GPU `gpu`, the driver's index) to the
    driver through `kernel`.  Without one (`why_not` says why), it still learns the
    sequence, so that the report shows what would have been asked."""

    def __init__(self, pid: int, gpu: int, kernel: Kernel | None, window: int = WINDOW,
                 why_not: str | None = None):
        self.pid, self.kernel = pid, kernel
        self.as_id: int | None = None
        self.seq = LaunchSequence()
        self.planner = Planner(gpu, window)
        self.stats = Stats()
        self.prefetch_set = False  # ranges stored in gpuos.ko, cleared by close()
        self._since_step = 0  # managed launches since the last step: the window covers twice as many
        self.why_not = why_not or (None if kernel else "no connection to gpuos.ko")
        if kernel is not None and not self.why_not:
            try:
                self.why_not = driver_not_ready(kernel.get_info())
            except GpuosError as exc:
                self.why_not = exc.message

    def event(self, ev: Event) -> None:
        """A gpuos.ko event: a fault of this process names its address space."""
        f = ev.fault or ev.fault_batch
        if self.as_id is None and f is not None and f.pid == self.pid and f.as_id is not None:
            self.as_id = f.as_id

    def records(self, recs: Iterable[dict]) -> None:
        """Decoded ring records (intercept.ring.decode), oldest first."""
        for rec in recs:
            if rec.get("type") != "launch":
                continue
            self.stats.launches += 1
            ws = working_set(rec)
            if ws:
                self.stats.managed_launches += 1
                self._since_step += 1
                self.seq.add(ws)
        self.stats.period = self.seq.period

    def step(self) -> Step | None:
        """Ask the driver for what changed in the window; the step, or None if nothing was
        asked (nothing changed, no address space known yet, or the driver path is off)."""
        if self.why_not or self.as_id is None or self.kernel is None:
            return None
        if not self._since_step and self.planner.in_window:
            return None  # the program has not moved
        # the program runs on while a step is made and served: the window reaches as far
        # ahead as twice what it launched since the last one (within one period)
        window = max(self.planner.window, 2 * self._since_step)
        if self.seq.period:
            window = min(window, max(self.seq.period, self.planner.window))
        self.stats.window = window
        st = self.planner.step(self.seq, window)
        if st is None:
            self._since_step = 0
            return None
        try:
            for op, ranges in ((Op.MIGRATE, st.migrate), (Op.HINT, st.evict_first)):
                for k in range(0, len(ranges), MAX_NL_RANGES):
                    self.kernel.migrate(self.as_id, op, ranges[k:k + MAX_NL_RANGES])
                    self.stats.batches += 1
            self.kernel.set_prefetch(self.as_id, st.prefetch[:MAX_NL_RANGES])
        except LimitReached:
            self.stats.dropped += 1
            self.planner.in_window = {}  # asked again in full at the next step
            return None
        except GpuosError as exc:
            if exc.message not in self.stats.errors:
                self.stats.errors.append(exc.message)
            self.planner.in_window = {}
            return None
        self._since_step = 0  # (a step refused keeps it: the next one reaches as far)
        self.stats.steps += 1
        self.prefetch_set = True
        self.stats.ranges_migrated += len(st.migrate)
        self.stats.bytes_migrated += sum(r.len for r in st.migrate)
        self.stats.ranges_hinted += len(st.evict_first)
        return st

    def close(self) -> None:
        """The process ended: its prefetch ranges leave gpuos.ko (which also drops them when
        the driver reports its address space gone, but a driver may be slow to)."""
        if self.prefetch_set and self.kernel is not None and self.as_id is not None:
            try:
                self.kernel.set_prefetch(self.as_id, [])
            except GpuosError:
                pass  # gpuos.ko went away: nothing is left there
            self.prefetch_set = False
