"""The logic of on-demand host memory without CRIU: pagemap images read, rewritten so the
driver's pages are eager, and the check for userfaultfd."""

from __future__ import annotations

import pytest

from gpuos.criu import Criu
from gpuos.errors import ImageCorrupt
from gpuos.hostmem import lazy
from gpuos.hostmem import pagemap as pm

P = pm.PAGE
LAZY = pm.PE_PRESENT | pm.PE_LAZY


def sample() -> pm.Pagemap:
    return pm.Pagemap(pages_id=3, entries=[
        pm.Entry(0x10000, 4, pm.PE_PRESENT, 0),          # eager already
        pm.Entry(0x20000, 16, LAZY, 4 * P),
        pm.Entry(0x40000, 2, pm.PE_PARENT, -1),          # not in this image's pages
        pm.Entry(0x50000, 8, LAZY, 20 * P)])


def test_a_pagemap_survives_encoding():
    m = sample()
    assert pm.parse(pm.encode(m)) == m
    assert m.pages_file == "pages-3.img"
    assert [e.lazy for e in m.entries] == [False, True, False, True]


def test_make_eager_splits_entries_at_the_ranges_and_keeps_the_pages_layout():
    m = pm.make_eager(sample(), [(0x20000 + 4 * P + 100, 0x20000 + 6 * P), (0x50000 + 7 * P, 0x60000)])
    got = [(e.vaddr, e.nr_pages, e.lazy, e.offset) for e in m.entries]
    assert got == [
        (0x10000, 4, False, 0),
        (0x20000, 4, True, 4 * P), (0x20000 + 4 * P, 2, False, 8 * P), (0x20000 + 6 * P, 10, True, 10 * P),
        (0x40000, 2, False, -1),
        (0x50000, 7, True, 20 * P), (0x50000 + 7 * P, 1, False, 27 * P)]
    # what CRIU reads itself, in the pages image: the eager entries
    assert m.eager_except() == [(0, 4 * P), (8 * P, 2 * P), (27 * P, P)]
    assert pm.parse(pm.encode(m)) == m  # offsets follow from the order alone


def test_nothing_in_the_ranges_changes_nothing():
    assert pm.make_eager(sample(), [(0x90000, 0xA0000)]) == sample()


@pytest.mark.parametrize("data", [b"", b"\x19\x43\x56\x54\x25\x40\x08\x56", b"junkjunkjunk",
                                  pm.encode(sample())[:-3]])
def test_a_broken_pagemap_is_a_corrupt_image(data):
    with pytest.raises(ImageCorrupt, match="not a CRIU pagemap image"):
        pm.parse(data, "pagemap-1.img")


def test_plan_makes_a_gpu_process_eager_and_says_what_criu_reads(tmp_path):
    (tmp_path / "pagemap-7.img").write_bytes(pm.encode(sample()))
    other = pm.Pagemap(pages_id=4, entries=[pm.Entry(0x1000, 2, LAZY, 0)])
    (tmp_path / "pagemap-8.img").write_bytes(pm.encode(other))
    parts = lazy.plan(tmp_path, {7: None})  # 7: driver ranges unknown, all of it eager
    assert parts == {"criu/pages-3.img": [(0, 4 * P), (4 * P, 16 * P), (20 * P, 8 * P)], "criu/pages-4.img": []}
    assert not any(e.lazy for e in pm.parse((tmp_path / "pagemap-7.img").read_bytes()).entries)
    assert pm.parse((tmp_path / "pagemap-8.img").read_bytes()) == other


def test_a_kernel_without_userfaultfd_is_said(tmp_path):
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'Error (criu/uffd.c:300): uffd: UFFDIO_API failed' >&2\nexit 1\n")
    fake.chmod(0o755)
    why = lazy.unsupported(Criu(fake, tmp_path / "plugins"))
    assert why and "refuses userfaultfd" in why and "UFFDIO_API failed" in why
