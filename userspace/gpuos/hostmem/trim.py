"""Zero pages dropped from a dump: CRIU saves every page a process has touched, and half of
an inference server's host memory is pages of zeros (measured: GPT-2-large on an H200,
bench/results/replica-pages-gpt2-large-H200-2026-11-26.json). A page of private anonymous
memory that is not in the image is restored as a fresh zero page (CRIU maps such memory
anew, drops a child's inherited pages it has no copy of, and its lazy-pages daemon
answers a fault outside the image with a zero page), so the zero ones need not be saved,
read out, nor copied by CRIU at the restore.

Each task's pagemap is rewritten without them and its pages image compacted. The new
pages image gets a new id, written before the pagemap that names it replaces the old one:
a dump cut short by a crash is the old pair or the new one, never a mix. (Nothing is
fsynced here: CRIU does not sync its images either; the chunks made of them are.)
"""

from __future__ import annotations

import mmap
import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..errors import ImageCorrupt
from . import pagemap as pm
from .criuimg import entries, fields, varints

MM_MAGIC = 0x57492820
VMA_ANON_PRIVATE = 1 << 9
# private anonymous, but restored by CRIU its own way
VMA_SPECIAL = (1 << 2) | (1 << 3) | (1 << 10) | (1 << 12) | (1 << 13) | (1 << 14)


def anonymous_private(mm_image: bytes, name: str = "mm") -> list[tuple[int, int]]:
    """[start, end) of the task's private anonymous mappings, from its mm image."""
    try:
        (mm,) = entries(mm_image, MM_MAGIC)
        out = []
        for number, value in fields(mm):
            if number == 14 and isinstance(value, bytes):  # vma_entry
                v = varints(value)
                if v[7] & VMA_ANON_PRIVATE and not v[7] & VMA_SPECIAL:
                    out.append((v[1], v[2]))
    except (ValueError, KeyError) as exc:
        raise ImageCorrupt(f"{name} is not a CRIU mm image: {exc}") from None
    return sorted(out)


def _inside(addrs, ranges: list[tuple[int, int]]):
    """Which of the addresses (a numpy array) lie in the ranges."""
    if not ranges:
        return np.zeros(len(addrs), dtype=bool)
    starts = np.array([a for a, _ in ranges], dtype=np.uint64)
    ends = np.array([b for _, b in ranges], dtype=np.uint64)
    k = np.searchsorted(starts, addrs, side="right") - 1
    return (k >= 0) & (addrs < ends[np.maximum(k, 0)])


def _runs(keep) -> list[tuple[int, int, bool]]:
    """(first, count, value) of each run of equal values of a numpy bool array."""
    edges = np.flatnonzero(np.diff(keep.astype(np.int8))) + 1
    bounds = [0, *edges.tolist(), len(keep)]
    return [(a, b - a, bool(keep[a])) for a, b in zip(bounds, bounds[1:])]


def drop_zero_pages(criu_dir: Path) -> tuple[int, int]:
    """Rewrite every task's pagemap and pages images in criu_dir without the zero pages of
    its private anonymous memory. Returns the pages images' bytes before and after."""
    before = after = 0
    taken = {int(p.stem.removeprefix("pages-")) for p in criu_dir.glob("pages-*.img")
             if p.stem.removeprefix("pages-").isdigit()}
    for map_path in sorted(criu_dir.glob("pagemap-*.img")):
        pid = map_path.stem.removeprefix("pagemap-")
        mm_path = criu_dir / f"mm-{pid}.img"
        if not pid.isdigit() or not mm_path.exists():
            continue
        anon = anonymous_private(mm_path.read_bytes(), str(mm_path))
        old = pm.parse(map_path.read_bytes(), str(map_path))
        pages_path = criu_dir / old.pages_file
        size = pages_path.stat().st_size
        before += size
        if size == 0 or size % pm.PAGE:
            after += size
            continue
        new_id = max(taken) + 1
        taken.add(new_id)
        new_pages = criu_dir / f"pages-{new_id}.img"
        kept: list[pm.Entry] = []
        with open(pages_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as src, \
                open(new_pages, "wb") as out:
            nonzero = np.frombuffer(src, dtype=np.uint64).reshape(-1, pm.PAGE // 8).any(axis=1)
            off = 0
            for e in old.entries:
                if e.offset < 0:
                    kept.append(e)
                    continue
                first = e.offset // pm.PAGE
                if first + e.nr_pages > len(nonzero):
                    raise ImageCorrupt(f"{map_path} names pages past the end of {pages_path}")
                addrs = np.uint64(e.vaddr) + np.arange(e.nr_pages, dtype=np.uint64) * np.uint64(pm.PAGE)
                keep = nonzero[first:first + e.nr_pages] | ~_inside(addrs, anon)
                for a, n, value in _runs(keep):
                    if not value:
                        continue
                    out.write(src[(first + a) * pm.PAGE:(first + a + n) * pm.PAGE])
                    kept.append(replace(e, vaddr=e.vaddr + a * pm.PAGE, nr_pages=n, offset=off))
                    off += n * pm.PAGE
        after += off
        tmp = map_path.with_name(map_path.name + ".tmp")
        tmp.write_bytes(pm.encode(pm.Pagemap(pages_id=new_id, entries=kept)))
        os.replace(tmp, map_path)
        pages_path.unlink()
    return before, after
