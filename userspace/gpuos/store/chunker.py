"""Where a file is cut into chunks: page-aligned, content-defined.

A chunk ends after a page whose fingerprint has its low bits zero (the profile's mask), at
least min_pages and at most max_pages pages after the previous cut, and at every cut the
caller forces (a movable allocation's start).  Two profiles: COARSE (about 2.25 MiB) for
GPU memory, whose replicas share whole allocations; FINE (about 320 KiB) for a process's
host memory (CRIU's pages), where two replicas differ in pages scattered everywhere
(pointers, the driver's saved state): measured on two GPT-2-large servers (H200), the
second adds 61% of its host memory to a store holding the first with COARSE chunks, 51%
with FINE, 46% with 20 KiB chunks, and 43% at best (pages that differ).  The cuts depend only on the pages' own
contents, so two images whose memory holds the same data at different offsets (two
replicas of one model, a process checkpointed again after its heap grew) still cut it
into the same chunks and share them; fixed-size chunks would share nothing after the
first page inserted.  Pages, not bytes, because everything large in an image (CRIU's
pages-*.img, a process's GPU memory) is made of whole pages.

A page's fingerprint mixes eight of its 64-bit words, one per 512 bytes, computed for a
whole window of pages at once with numpy: several GB/s, so cutting costs far less than
hashing (BLAKE3) the chunks.
"""

from __future__ import annotations

import numpy as np

from dataclasses import dataclass

PAGE = 4096


@dataclass(frozen=True)
class Profile:
    min_pages: int
    mask: int       # a cut after a page whose fingerprint & mask is 0: one in mask + 1
    max_pages: int


COARSE = Profile(min_pages=64, mask=0x1FF, max_pages=2048)  # 256 KiB, about 2.25 MiB, 8 MiB
FINE = Profile(min_pages=16, mask=0x3F, max_pages=512)      # 64 KiB, about 320 KiB, 2 MiB
_WORDS = PAGE // 8
_SAMPLE = 64        # every 64th word of a page: one per 512 bytes
_K = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63,
               0x27D4EB2F165667C5, 0xD6E8FEB86659FD93, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53],
              dtype=np.uint64)
# Added before mixing so that a page of zeros does not fingerprint to 0 (a cut after every
# min_pages of zeros); with it, runs of zeros are cut only at max_pages (checked by a test).
_SEED = np.uint64(0x2545F4914F6CDD1D)


def fingerprints(data: memoryview | bytes) -> np.ndarray:
    """One 64-bit fingerprint per whole page of data."""
    npages = len(data) // PAGE
    words = np.frombuffer(data, dtype=np.uint64, count=npages * _WORDS).reshape(npages, _WORDS)
    with np.errstate(over="ignore"):
        h = (words[:, ::_SAMPLE] * _K).sum(axis=1, dtype=np.uint64) + _SEED
        h ^= h >> np.uint64(29)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(32)
    return h


class Cutter:
    """Feeds a file's pages through in windows; gives the chunk ends (byte offsets in the
    file), the same however the file is split into windows."""

    def __init__(self, profile: Profile = COARSE) -> None:
        self.p = profile
        self.last = 0   # the previous cut, in pages from the start of the file
        self.pages = 0  # pages seen

    def feed(self, window: memoryview | bytes) -> list[int]:
        """The cuts inside these pages (window: whole pages, following the ones fed)."""
        fp = fingerprints(window)
        base = self.pages
        self.pages += len(fp)
        cuts: list[int] = []
        for p in (np.flatnonzero((fp & np.uint64(self.p.mask)) == 0) + base + 1).tolist():
            self._to(p, cuts)
            if p - self.last >= self.p.min_pages:
                cuts.append(p)
                self.last = p
        self._to(self.pages, cuts)
        return [c * PAGE for c in cuts]

    def force(self) -> int | None:
        """A cut here (where the pages fed so far end), unless there is one already."""
        if self.pages == self.last:
            return None
        self.last = self.pages
        return self.pages * PAGE

    def _to(self, page: int, cuts: list[int]) -> None:
        """Cuts of max_pages until `page` is within max_pages of the previous cut."""
        while page - self.last > self.p.max_pages:
            self.last += self.p.max_pages
            cuts.append(self.last)


def chunk_ends(data: memoryview | bytes, forced: list[int] = (), profile: Profile = COARSE) -> list[int]:
    """Every chunk's end in data (the last one is len(data)); `forced`: byte offsets, page
    multiples, where a chunk must end.  The whole-file form of what ingest does in windows."""
    cutter = Cutter(profile)
    ends: list[int] = []
    whole = len(data) // PAGE * PAGE
    start = 0
    for f in sorted(set(forced) | {whole}):
        if not 0 < f <= whole or f % PAGE:
            continue
        ends += cutter.feed(memoryview(data)[start:f])
        if (c := cutter.force()) is not None:
            ends.append(c)
        start = f
    if len(data) > (ends[-1] if ends else 0):
        ends.append(len(data))  # a last, partial page
    return ends
