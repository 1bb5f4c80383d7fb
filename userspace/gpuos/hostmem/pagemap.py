"""CRIU's pagemap images, read and rewritten: where each page of a process's memory is in
its pages image, and which pages may come in lazily.

A pagemap image (``pagemap-<pid>.img``) is CRIU's common image framing (two u32 magics,
then entries, each a u32 length and a protobuf message): a ``pagemap_head`` naming the
pages image (``pages-<pages_id>.img``), then ``pagemap_entry``s in address order. An
entry whose flags have PE_PRESENT has its ``nr_pages`` pages next in the pages image;
PE_LAZY marks pages CRIU may restore on demand (anonymous private memory, set at every
dump).  gpuos clears PE_LAZY where it wants pages restored before the process runs (what
the driver reads back into the GPU at its restore), splitting entries there: the pages
image is unchanged, its layout being the entries' order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ImageCorrupt
from .criuimg import entries, field, frame, varints

PAGEMAP_MAGIC = 0x56084025
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4
PAGE = 4096


@dataclass(frozen=True)
class Entry:
    vaddr: int
    nr_pages: int
    flags: int
    offset: int  # of its pages in the pages image; -1 when it has none there

    @property
    def end(self) -> int:
        return self.vaddr + self.nr_pages * PAGE

    @property
    def lazy(self) -> bool:
        return bool(self.flags & PE_LAZY) and self.offset >= 0


@dataclass
class Pagemap:
    pages_id: int
    entries: list[Entry]

    @property
    def pages_file(self) -> str:
        return f"pages-{self.pages_id}.img"

    def eager_except(self, lazy_ok: bool = True) -> list[tuple[int, int]]:
        """(offset, length) in the pages image of every page CRIU restores before the
        process runs (all pages if not lazy_ok)."""
        return [(e.offset, e.nr_pages * PAGE) for e in self.entries
                if e.offset >= 0 and not (lazy_ok and e.lazy)]


def parse(data: bytes, name: str = "pagemap") -> Pagemap:
    try:
        msgs = [varints(m) for m in entries(data, PAGEMAP_MAGIC)]
        if not msgs:
            raise ValueError("no head")
        pages_id = msgs[0].get(1, 0)
        out, off = [], 0
        for m in msgs[1:]:
            nr = m.get(5, m.get(2, 0))
            flags = m[4] if 4 in m else (PE_PARENT if m.get(3) else PE_PRESENT)
            present = bool(flags & PE_PRESENT)
            out.append(Entry(vaddr=m[1], nr_pages=nr, flags=flags, offset=off if present else -1))
            if present:
                off += nr * PAGE
    except (ValueError, KeyError) as exc:
        raise ImageCorrupt(f"{name} is not a CRIU pagemap image: {exc}") from None
    return Pagemap(pages_id=pages_id, entries=out)


def encode(pm: Pagemap) -> bytes:
    return frame(PAGEMAP_MAGIC, [field(1, pm.pages_id)] + [
        field(1, e.vaddr) + field(2, e.nr_pages & 0xFFFFFFFF) + field(4, e.flags) + field(5, e.nr_pages)
        for e in pm.entries])


def make_eager(pm: Pagemap, ranges: list[tuple[int, int]]) -> Pagemap:
    """The pagemap with PE_LAZY cleared on every page in ``ranges`` ([start, end) virtual
    addresses), entries split at the ranges' edges."""
    cuts = sorted({a - a % PAGE for r in ranges for a in r})
    out: list[Entry] = []
    for e in pm.entries:
        start = e.vaddr
        for cut in [c for c in cuts if e.vaddr < c < e.end] + [e.end]:
            n = (cut - start) // PAGE
            part = replace(e, vaddr=start, nr_pages=n,
                           offset=e.offset + (start - e.vaddr) if e.offset >= 0 else -1)
            if part.flags & PE_LAZY and any(a < part.end and part.vaddr < b for a, b in ranges):
                part = replace(part, flags=part.flags & ~PE_LAZY)
            out.append(part)
            start = cut
    return Pagemap(pages_id=pm.pages_id, entries=out)
