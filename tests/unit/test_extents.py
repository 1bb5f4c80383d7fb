"""Extents finer than an allocation (userspace/gpuos/movable/extents.py, `gpuos mem extents`):
rules learnt from synthetic launch logs with touched records, predictions, and the checker."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuos.cli.main import cli
from gpuos.errors import GpuosError
from gpuos.intercept.log import LaunchLogWriter
from gpuos.movable import extents as ext
from gpuos.movable.extents import Feature, ParamsImage, Pointer

from helpers import gpuos, gpuos_env

PID = 4242
KiB, MiB = 1 << 10, 1 << 20
SEG = 0x7F0000000000  # a 2 MiB-aligned caching-allocator segment
SEG2 = SEG + (1 << 30)


class Ptr(int):
    """A pointer parameter (8 bytes); every other parameter is given as its bytes."""


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def i64(v: int) -> bytes:
    return struct.pack("<q", v)


def hash_of(scalars: bytes) -> int:
    """The made-up arg_hash of a launch whose parameters that are not pointers are `scalars`."""
    return int.from_bytes(hashlib.blake2b(scalars, digest_size=8).digest(), "little")


def key_of(*scalars: bytes, grid=(1, 1, 1), block=(256, 1, 1)) -> str:
    """The memo key of a SynthLog launch."""
    return ext.memo_key(hash_of(b"".join(scalars)), grid, block)


class SynthLog:
    """A launch log as `gpuos run --record-touched --log` writes it, made up."""

    def __init__(self, path: Path):
        self.path = path
        self.w = LaunchLogWriter(path, ["synthetic"], False)
        self.seq = 0
        self.funcs: dict[str | None, int] = {}

    def alloc(self, base: int, size: int, measured: bool = True, kind: str = "device") -> None:
        rec = {"type": "alloc", "pid": PID, "base": base, "size": size, "ctx": 1, "stream": 0, "aux": 0,
               "kind": kind, "device": 0}
        self.w.write({**rec, "measured": True} if measured else rec)

    def free(self, base: int, size: int) -> None:
        self.w.write({"type": "free", "pid": PID, "base": base, "size": size, "ctx": 1, "stream": 0, "aux": 0,
                      "kind": "device", "device": 0, "measured": True})

    def launch(self, kernel: str | None, params: list, runs: list[tuple[int, int]] = (), grid=(1, 1, 1),
               block=(256, 1, 1), flags: tuple = (), touched_flags: tuple = (), touched: bool = True,
               touched_first: bool = False, params_flags: tuple = ()) -> int:
        if kernel not in self.funcs:
            self.funcs[kernel] = len(self.funcs)
            self.w.write({"type": "function", "pid": PID, "id": self.funcs[kernel], "handle": 0x1000 + len(self.funcs),
                          "name": kernel, "nparams": len(params), "params_bytes": 0})
        self.seq += 1
        layout, off, scalars = [], 0, b""
        for p in params:
            raw = struct.pack("<Q", p) if isinstance(p, Ptr) else p
            off += -off % min(8, len(raw))
            layout.append({"offset": off, "size": len(raw), "hex": raw.hex()})
            off += len(raw)
            scalars += b"" if isinstance(p, Ptr) else raw
        func = self.funcs[kernel]
        arg_hash = hash_of(scalars)
        self.w.write({"type": "params", "pid": PID, "seq": self.seq, "func": func, "flags": list(params_flags),
                      "params": layout})
        tr = {"type": "touched", "pid": PID, "seq": self.seq, "func": func, "faults": len(runs), "gap": 0,
              "flags": list(touched_flags),
              "runs": [{"start": s, "len": n, "access": ["read"]} for s, n in runs]}
        if touched and touched_first:
            self.w.write(tr)
        self.w.write({"type": "launch", "pid": PID, "seq": self.seq, "func": func, "grid": list(grid),
                      "block": list(block), "shmem": 0, "stream": 0, "ctx": 1, "graph_exec": 0, "arg_hash": arg_hash,
                      "flags": list(flags), "bufs": []})
        if touched and not touched_first:
            self.w.write(tr)
        return self.seq

    def close(self) -> Path:
        self.w.close()
        return self.path


def pages(n: int) -> int:
    return -(-n // 4096) * 4096


def rule_of(model: ext.ExtentModel, kernel: str, param: int, offset: int = 0) -> ext.PointerRule:
    return model.kernels[kernel].by_slot[(param, offset)]


def scale_log(path: Path, sizes: list[int], seg_size: int = 256 * MiB) -> Path:
    """Kernel "scale"(float *x, unsigned n) touching x[0, n) (4-byte elements), its tensor at
    a different place of one segment each launch."""
    log = SynthLog(path)
    log.alloc(SEG, seg_size)
    for i, n in enumerate(sizes):
        x = SEG + (i % 4) * 32 * MiB
        log.launch("scale", [Ptr(x), u32(n)], [(x, pages(4 * n))], grid=(-(-n // 256), 1, 1))
    return log.close()


# -- rules ---------------------------------------------------------------------------------


def test_fixed_extents_of_two_tensors_in_one_segment(tmp_path):
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 * MiB)
    for i in range(3):
        a, b = SEG + i * 8 * MiB, SEG + i * 8 * MiB + 4 * MiB  # different tensors each launch
        # the scalar (say alpha) differs each launch: the extent does not depend on the arguments
        log.launch("add", [Ptr(a), Ptr(b), u32(1 << 18), u32(i)], [(a, 1 * MiB), (b, 1 * MiB)])
    model, summary = ext.learn([log.close()])
    for param in (0, 1):
        r = rule_of(model, "add", param)
        assert (r.rule, r.lo, r.hi, r.samples) == ("fixed", 0, 1 * MiB, 3)
    assert summary.kernels_by_rule["fixed"] == 1 and summary.slots_by_rule["fixed"] == 2
    assert summary.launches_used == 3 and summary.counts.measured == 3


@pytest.mark.parametrize("size,make", [(4, u32), (8, i64)])
def test_linear_in_an_integer_argument(tmp_path, size, make):
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 256 * MiB)
    for n in (1 << 18, 1 << 19, 3 << 18, 1 << 20):
        log.launch("scale", [Ptr(SEG), make(n)], [(SEG, 4 * n)], grid=(n // 256, 1, 1))
    model, _ = ext.learn([log.close()])
    r = rule_of(model, "scale", 0)
    assert r.rule == "linear" and (r.a, r.b, r.lo) == (4, 0, 0)
    # the argument itself, not the grid that also grows with it; read unsigned, since a
    # negative value read unsigned predicts the whole allocation rather than nothing
    assert r.feature == Feature("scalar", param=1, offset=0, size=size, signed=False)


def test_linear_in_a_64_bit_argument_past_4_gib(tmp_path):
    """Byte counts that differ only in their high 32 bits."""
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 << 30)
    for n in (4 << 30, 8 << 30, 12 << 30):
        log.launch("memset_bytes", [Ptr(SEG), i64(n)], [(SEG, n)])
    model, _ = ext.learn([log.close()])
    r = rule_of(model, "memset_bytes", 0)
    assert (r.rule, r.feature, r.a, r.b) == ("linear", Feature("scalar", 1, 0, 8, False), 1, 0)


def test_an_end_pointer_is_no_size_argument(tmp_path):
    """fill(begin, end): cudaMalloc gave the same address for buffers of several sizes, so
    end grows with the extent, but only at that address: it must not become the feature."""
    def fill_log(path: Path, base: int, sizes: list[int]) -> Path:
        log = SynthLog(path)
        for n in sizes:
            log.alloc(base, n)
            log.launch("fill", [Ptr(base), i64(base + n)], [(base, n)])  # end is hashed: no allocation holds it
            log.free(base, n)
        return log.close()

    model, _ = ext.learn([fill_log(tmp_path / "train.jsonl", SEG, [2 * MiB, 4 * MiB, 8 * MiB])])
    assert rule_of(model, "fill", 0).rule == "recorded"
    blocks = ext.check(model, fill_log(tmp_path / "test.jsonl", SEG2, [6 * MiB])).grains[-1]
    assert blocks.model_miss_launches == 0


@pytest.mark.parametrize("counts,tolerance", [((16, 160, 100, 40), ext.DEFAULT_TOLERANCE),
                                              ((10, 40, 25), 64 * KiB)])  # 640 KiB to 2.5 MiB: small extents
def test_linear_in_the_grid(tmp_path, counts, tolerance):
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 256 * MiB)
    for blocks in counts:
        log.launch("rows", [Ptr(SEG)], [(SEG, blocks * 64 * KiB)], grid=(blocks, 1, 1))
    model, _ = ext.learn([log.close()], tolerance=tolerance)
    r = rule_of(model, "rows", 0)
    assert r.rule == "linear" and r.feature == Feature("grid") and (r.a, r.b) == (64 * KiB, 0)


def test_linear_in_a_product_of_two_arguments(tmp_path):
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 1 << 30)
    # 1 to 16 MiB; neither m nor k alone is within 2 MiB of a line
    for m, k in ((1024, 1024), (2048, 1024), (1024, 2048), (2048, 2048), (512, 512)):
        log.launch("gemm_a", [Ptr(SEG), u32(m), u32(k)], [(SEG, pages(4 * m * k))])
    model, _ = ext.learn([log.close()])
    r = rule_of(model, "gemm_a", 0)
    assert r.rule == "linear" and r.feature.kind == "product" and r.a == 4
    assert {f.param for f in r.feature.of} == {1, 2}


def test_a_linear_rule_covers_every_launch_it_was_learnt_from(tmp_path):
    """Touches that stray from the line (within the tolerance) raise its intercept to the
    largest: no launch learnt from is missed, at any unit."""
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 256 * MiB)
    for n, stray in ((1 << 19, 0), (1 << 21, 1 * MiB), (3 << 20, 512 * KiB), (1 << 22, 0)):  # 2 to 16 MiB
        log.launch("scale", [Ptr(SEG), u32(n)], [(SEG, 4 * n + stray)])
    path = log.close()
    model, _ = ext.learn([path])
    r = rule_of(model, "scale", 0)
    assert (r.rule, r.a, r.b) == ("linear", 4, 1 * MiB)
    assert all(g.model_miss_launches == 0 for g in ext.check(model, path).grains)


@pytest.mark.parametrize("same_arguments", [False, True])
def test_a_pointer_whose_lo_moves_is_not_fixed(tmp_path, same_arguments):
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 * MiB)
    for i, below in enumerate((1 * MiB, 5 * MiB)):  # lo moves by 4 MiB, more than the tolerance
        p = SEG + 8 * MiB + i * 16 * MiB
        log.launch("window", [Ptr(p), u32(0 if same_arguments else i)], [(p - below, below + 1 * MiB)])
    model, _ = ext.learn([log.close()])
    r = rule_of(model, "window", 0)
    assert (r.rule, r.lo, r.hi) == ("recorded", -5 * MiB, 1 * MiB)
    # the pointers are block-aligned: each key's memo is widened out to its 2 MiB blocks
    memo = sorted(r.memo.values())
    assert memo == ([(-5 * MiB, 2 * MiB)] if same_arguments else [(-6 * MiB, 2 * MiB), (-2 * MiB, 2 * MiB)])


def test_a_product_with_two_values_is_no_fit(tmp_path):
    """Three launches but m * k takes two values (as do m, k, m * m and k * k), and two
    points fit any line."""
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 * MiB)
    for m, k, hi in ((1, 4, 1 * MiB), (2, 2, 1 * MiB), (2, 4, 9 * MiB)):
        log.launch("gemm_a", [Ptr(SEG), u32(m), u32(k)], [(SEG, hi)])
    model, _ = ext.learn([log.close()])
    assert rule_of(model, "gemm_a", 0).rule == "recorded"


def test_recorded_per_argument_values_and_whole_when_the_memo_would_not_repeat(tmp_path, monkeypatch):
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 * MiB)
    extent = {1: 1 * MiB, 2: 9 * MiB, 3: 3 * MiB}  # no line within 2 MiB through these
    for _ in range(2):
        for mode, hi in extent.items():
            log.launch("gather", [Ptr(SEG), u32(mode)], [(SEG, hi)])
    path = log.close()
    model, summary = ext.learn([path])
    r = rule_of(model, "gather", 0)
    # memo entries widened out to the end of their 2 MiB block (the pointer is block-aligned)
    assert r.rule == "recorded" and r.memo == {key_of(u32(1)): (0, 2 * MiB), key_of(u32(2)): (0, 10 * MiB),
                                               key_of(u32(3)): (0, 4 * MiB)}
    assert (r.lo, r.hi) == (0, 9 * MiB)  # the envelope is what was measured
    assert summary.kernels_by_rule["recorded"] == 1

    ptr = [Pointer(0, 0, SEG, SEG, SEG + 64 * MiB)]
    params = ParamsImage(struct.pack("<QI", SEG, 2), ((0, 8), (8, 4)))
    arg_hash = hash_of(u32(2))
    assert ext.predict(model, "gather", params, (1, 1, 1), (256, 1, 1), arg_hash, ptr) == [(SEG, SEG + 10 * MiB)]
    # arguments never seen: the whole allocation
    assert ext.predict(model, "gather", params, (1, 1, 1), (256, 1, 1), 12345, ptr) == [(SEG, SEG + 64 * MiB)]

    monkeypatch.setattr(ext, "MEMO_MAX", 2)
    model, summary = ext.learn([path])
    assert rule_of(model, "gather", 0).rule == "whole" and summary.slots_by_rule["whole"] == 1


def test_one_sample_is_recorded_not_fixed(tmp_path):
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 * MiB)
    log.launch("once", [Ptr(SEG)], [(SEG, 1 * MiB)])
    model, _ = ext.learn([log.close()])
    assert rule_of(model, "once", 0).rule == "recorded"


@pytest.mark.parametrize("his,tolerance,rule", [
    ((1 * MiB, 3 * MiB), None, "fixed"),  # 2 MiB apart: within the default tolerance
    ((1 * MiB, 3 * MiB + 4 * KiB), None, "recorded"),  # a page more
    ((1 * MiB, 3 * MiB), 64 * KiB, "recorded"),
    ((1 * MiB, 1 * MiB + 64 * KiB), 64 * KiB, "fixed"),
])
def test_fixed_within_the_tolerance(tmp_path, his, tolerance, rule):
    """Measured touches can fall short within a 2 MiB block: by default, extents that differ
    by up to 2 MiB are one fixed extent (their largest)."""
    assert ext.DEFAULT_TOLERANCE == 2 * MiB
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 * MiB)
    for i, hi in enumerate(his):
        log.launch("k", [Ptr(SEG + i * 16 * MiB), u32(i)], [(SEG + i * 16 * MiB, hi)])
    model, _ = ext.learn([log.close()], **({} if tolerance is None else {"tolerance": tolerance}))
    assert model.tolerance == (tolerance or 2 * MiB)
    r = rule_of(model, "k", 0)
    assert (r.rule, r.lo, r.hi) == (rule, 0, max(his))


@pytest.mark.parametrize("vary", ["nothing", "a scalar", "the grid"])
def test_fixed_needs_arguments_that_varied(tmp_path, vary):
    """Launches that all had the same arguments say nothing of other arguments: they are
    recorded (their memo), and other arguments get the whole allocation; two argument sets
    (scalars or grid) with one extent make it fixed."""
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 * MiB)
    for i in range(4):
        p = SEG + i * 8 * MiB
        log.launch("k", [Ptr(p), u32(i % 2 if vary == "a scalar" else 0)], [(p, 1 * MiB)],
                   grid=(1 + (i % 2 if vary == "the grid" else 0), 1, 1))
    model, _ = ext.learn([log.close()])
    r = rule_of(model, "k", 0)
    x = Pointer(0, 0, SEG + 40 * MiB, SEG, SEG + 64 * MiB)

    def predict(n: int) -> list[tuple[int, int]]:
        params = ParamsImage(struct.pack("<QI", x.address, n), ((0, 8), (8, 4)))
        return ext.predict(model, "k", params, (1, 1, 1), (256, 1, 1), hash_of(u32(n)), [x])

    if vary == "nothing":
        assert (r.rule, r.lo, r.hi, r.samples) == ("recorded", 0, 1 * MiB, 4)
        assert r.memo == {key_of(u32(0)): (0, 2 * MiB)}
        assert predict(0) == [(x.address, x.address + 2 * MiB)]
        assert predict(9) == [(SEG, SEG + 64 * MiB)]  # arguments never seen: the whole allocation
    else:
        assert (r.rule, r.lo, r.hi, r.samples) == ("fixed", 0, 1 * MiB, 4)
        assert predict(0) == predict(9) == [(x.address, x.address + 1 * MiB)]


def test_fixed_counts_only_argument_sets_that_touched_something(tmp_path):
    """Two argument sets, but one touched nothing: one set of evidence, recorded."""
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 * MiB)
    for _ in range(2):
        log.launch("k", [Ptr(SEG), u32(0)], [(SEG, 1 * MiB)])
        log.launch("k", [Ptr(SEG), u32(1)], [])
    model, _ = ext.learn([log.close()])
    r = rule_of(model, "k", 0)
    assert (r.rule, r.samples) == ("recorded", 4)
    assert r.memo == {key_of(u32(0)): (0, 2 * MiB), key_of(u32(1)): (0, 0)}
    ptr = [Pointer(0, 0, SEG, SEG, SEG + 64 * MiB)]
    params = ParamsImage(struct.pack("<QI", SEG, 1), ((0, 8), (8, 4)))
    assert ext.predict(model, "k", params, (1, 1, 1), (256, 1, 1), hash_of(u32(1)), ptr) == []


def test_a_line_needs_three_distinct_values(tmp_path):
    """Two sizes (and grids), however often launched, fit any line: recorded.  A third size on
    the line makes it linear."""
    sizes = [1 << 18, 1 << 21] * 3  # 1 and 8 MiB: not one fixed extent
    model, _ = ext.learn([scale_log(tmp_path / "two.jsonl", sizes)])
    r = rule_of(model, "scale", 0)
    assert (r.rule, r.lo, r.hi, r.samples) == ("recorded", 0, 8 * MiB, 6)
    assert r.memo == {key_of(u32(1 << 18), grid=(1 << 10, 1, 1)): (0, 2 * MiB),
                      key_of(u32(1 << 21), grid=(1 << 13, 1, 1)): (0, 8 * MiB)}
    model, _ = ext.learn([scale_log(tmp_path / "three.jsonl", sizes + [1 << 20])])
    r = rule_of(model, "scale", 0)
    assert (r.rule, r.feature, r.a, r.b) == ("linear", Feature("scalar", 1, 0, 4, False), 4, 0)


def test_memo_entries_are_widened_to_2_mib_blocks(tmp_path):
    """A recorded extent is widened out to the 2 MiB blocks it touched, as far as the blocks
    at every address it was seen at allow: a measured lo or hi can be short within its block."""
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 * MiB)
    p1, p2 = SEG + 3 * MiB + 256 * KiB, SEG + 21 * MiB + 512 * KiB  # not block-aligned
    lo, hi = -100 * KiB, 1 * MiB + 4 * KiB
    for p in (p1, p2):  # one argument set at two addresses
        log.launch("stencil", [Ptr(p), u32(7)], [(p + lo, hi - lo)])
    # p1: blocks [2, 6) MiB, so [-1.25, 2.75) MiB around it; p2: [20, 24), so [-1.5, 2.5)
    log.launch("stencil", [Ptr(SEG + 32 * MiB), u32(8)], [(SEG + 32 * MiB, 8 * MiB)])  # aligned: as is
    path = log.close()
    model, _ = ext.learn([path])
    r = rule_of(model, "stencil", 0)
    assert (r.rule, r.lo, r.hi) == ("recorded", lo, 8 * MiB)
    assert r.memo == {key_of(u32(7)): (-1280 * KiB, 2560 * KiB), key_of(u32(8)): (0, 8 * MiB)}

    x = Pointer(0, 0, SEG + 40 * MiB, SEG, SEG + 64 * MiB)
    params = ParamsImage(struct.pack("<QI", x.address, 7), ((0, 8), (8, 4)))
    assert ext.predict(model, "stencil", params, (1, 1, 1), (256, 1, 1), hash_of(u32(7)), [x]) == \
        [(x.address - 1280 * KiB, x.address + 2560 * KiB)]
    report = ext.check(model, path)
    for g in report.grains:
        assert g.model_miss_launches == 0, g
    pages4k, blocks = report.grains[0], report.grains[-1]
    assert pages4k.model_bytes == (1280 + 2560) * KiB * 2 + 8 * MiB > pages4k.touched_bytes
    assert blocks.model_bytes == blocks.touched_bytes == (4 + 4 + 8) * MiB  # no more blocks than touched


def test_attribution_splits_a_run_at_the_pointers_of_one_allocation(tmp_path):
    """One merged run over two tensors of a segment: each pointer gets its own part."""
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 * MiB)
    for i in range(2):
        a = SEG + i * 16 * MiB
        log.launch("copy", [Ptr(a + 1 * MiB), Ptr(a)], [(a, 3 * MiB)])  # dst after src, one run
    path = log.close()
    launch = next(ext.read_measured(path, ext.LogCounts()))
    att = ext.attribute(launch)
    assert att.extents == {SEG: (0, 1 * MiB), SEG + 1 * MiB: (0, 2 * MiB)}
    assert att.unattributed_runs == 0
    model, _ = ext.learn([path])
    assert (rule_of(model, "copy", 0).hi, rule_of(model, "copy", 1).hi) == (2 * MiB, 1 * MiB)


def test_touches_below_the_lowest_pointer_make_lo_negative(tmp_path):
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 * MiB)
    for i in range(2):
        p = SEG + 4 * MiB + i * 8 * MiB
        log.launch("halo", [Ptr(p), u32(i)], [(p - 64 * KiB, 64 * KiB + 1 * MiB)])
    model, _ = ext.learn([log.close()])
    r = rule_of(model, "halo", 0)
    assert (r.rule, r.lo, r.hi) == ("fixed", -64 * KiB, 1 * MiB)
    ptr = Pointer(0, 0, SEG + 40 * MiB, SEG, SEG + 64 * MiB)
    params = ParamsImage(struct.pack("<QI", ptr.address, 7), ((0, 8), (8, 4)))
    assert ext.predict(model, "halo", params, (1, 1, 1), (1, 1, 1), 0, [ptr]) == \
        [(ptr.address - 64 * KiB, ptr.address + 1 * MiB)]


def test_incomplete_unmeasured_and_unrun_launches_are_left_out(tmp_path):
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 * MiB)
    for i in range(2):
        log.launch("k", [Ptr(SEG), u32(i)], [(SEG, 1 * MiB)])
    # each of these would break "fixed" if it were learnt from
    log.launch("k", [Ptr(SEG), u32(2)], [(SEG, 9 * MiB)], touched_flags=("dropped",))
    log.launch("k", [Ptr(SEG), u32(2)], [(SEG, 9 * MiB)], touched_flags=("remote",))
    log.launch("k", [Ptr(SEG), u32(2)], [(SEG, 9 * MiB)], touched=False)
    log.launch("k", [Ptr(SEG), u32(2)], [(SEG, 9 * MiB)], flags=("captured",))
    log.launch("k", [Ptr(SEG), u32(2)], [(SEG, 9 * MiB)], flags=("layout-unknown",))
    log.launch("k", [Ptr(SEG), u32(2)], [(SEG, 9 * MiB)], flags=("graph",))
    log.launch("k", [Ptr(SEG), u32(2)], [(SEG, 9 * MiB)], params_flags=("truncated",))
    log.launch(None, [Ptr(SEG), u32(2)], [(SEG, 9 * MiB)])
    model, summary = ext.learn([log.close()])
    assert (rule_of(model, "k", 0).rule, rule_of(model, "k", 0).hi) == ("fixed", 1 * MiB)
    c = summary.counts
    assert (c.launches, c.measured, c.incomplete, c.unmeasured, c.captured, c.layout_unknown, c.graph,
            c.no_params) == (10, 3, 2, 1, 1, 1, 1, 1)
    assert summary.unnamed == 1 and summary.launches_used == 2


def test_touched_record_before_its_launch_and_unmeasured_allocations(tmp_path):
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 * MiB)
    log.alloc(SEG2, 64 * MiB, measured=False)  # plain device memory: its touches are not seen
    for _ in range(2):
        log.launch("k", [Ptr(SEG), Ptr(SEG2)], [(SEG, 1 * MiB)], touched_first=True)
    model, summary = ext.learn([log.close()])
    assert summary.counts.measured == 2 and summary.counts.pointers_unmeasured == 2
    assert list(model.kernels["k"].by_slot) == [(0, 0)]  # no sample for the unmeasured one


def test_unattributed_touches_are_counted_and_missed_by_both_predictions(tmp_path):
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 * MiB)
    log.alloc(SEG2, 64 * MiB)  # named only by a pointer array in device memory
    for _ in range(2):
        log.launch("batched", [Ptr(SEG)], [(SEG, 1 * MiB), (SEG2, 2 * MiB)])
    path = log.close()
    model, summary = ext.learn([path])
    assert (summary.counts.unattributed_runs, summary.counts.unattributed_launches) == (2, 2)
    blocks = ext.check(model, path).grains[-1]
    assert (blocks.model_miss_launches, blocks.whole_miss_launches) == (2, 2)
    assert blocks.model_missed_bytes == blocks.whole_missed_bytes == 2 * 2 * MiB
    assert not blocks.model_misses[0].pointed


# -- predict -----------------------------------------------------------------------------


def test_predict_falls_back_to_whole_allocations(tmp_path):
    model, _ = ext.learn([scale_log(tmp_path / "a.jsonl", [1 << 18, 1 << 20, 1 << 21])])  # 1, 4 and 8 MiB
    assert rule_of(model, "scale", 0).rule == "linear"
    seg = (SEG, SEG + 256 * MiB)
    x = Pointer(0, 0, SEG + 8 * MiB, *seg)
    params = ParamsImage(struct.pack("<QI", x.address, 1 << 18), ((0, 8), (8, 4)))
    assert ext.predict(model, "scale", params, (1024, 1, 1), (256, 1, 1), 0, [x]) == [(x.address, x.address + 1 * MiB)]
    # unknown kernel, kernel without a name, unknown slot, other layout: the whole allocation
    assert ext.predict(model, "other", params, (1, 1, 1), (1, 1, 1), 0, [x]) == [seg]
    assert ext.predict(model, None, params, (1, 1, 1), (1, 1, 1), 0, [x]) == [seg]
    odd = Pointer(1, 0, SEG + 8 * MiB, *seg)
    assert ext.predict(model, "scale", params, (1, 1, 1), (1, 1, 1), 0, [odd]) == [seg]
    longer = ParamsImage(params.data + bytes(8), ((0, 8), (8, 4), (16, 8)))
    assert ext.predict(model, "scale", longer, (1, 1, 1), (1, 1, 1), 0, [x]) == [seg]
    # clipped to the allocation; a negative size predicts nothing
    big = ParamsImage(struct.pack("<QI", x.address, 1 << 30), params.layout)
    assert ext.predict(model, "scale", big, (1, 1, 1), (1, 1, 1), 0, [x]) == [(x.address, seg[1])]
    r = rule_of(model, "scale", 0)
    r.b = -(4 << 20)
    assert ext.predict(model, "scale", params, (1, 1, 1), (1, 1, 1), 0, [x]) == []


def test_predict_merges_the_ranges_of_pointers_in_one_allocation(tmp_path):
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 * MiB)
    for i in range(2):
        log.launch("two", [Ptr(SEG), Ptr(SEG + 2 * MiB), Ptr(SEG + 8 * MiB), u32(i)],
                   [(SEG, 1 * MiB), (SEG + 2 * MiB, 1 * MiB), (SEG + 8 * MiB, 1 * MiB)])
    model, _ = ext.learn([log.close()])
    assert {p.rule for p in model.kernels["two"].pointers} == {"fixed"}
    ptrs = [Pointer(i, 0, a, SEG, SEG + 64 * MiB) for i, a in enumerate((SEG + 10 * MiB, SEG, SEG + 1 * MiB))]
    params = ParamsImage(struct.pack("<QQQI", *(p.address for p in ptrs), 5), ((0, 8), (8, 8), (16, 8), (24, 4)))
    assert ext.predict(model, "two", params, (1, 1, 1), (256, 1, 1), 0, ptrs) == \
        [(SEG, SEG + 2 * MiB), (SEG + 10 * MiB, SEG + 11 * MiB)]


# -- check -------------------------------------------------------------------------------


def test_a_linear_rule_generalises_to_a_size_not_learnt_from(tmp_path):
    model, _ = ext.learn([scale_log(tmp_path / "train.jsonl", [1 << 18, 1 << 20, 3 << 19])])  # 1, 4 and 6 MiB
    held_out = scale_log(tmp_path / "test.jsonl", [5 << 18, 7 << 18, 1 << 21])
    report = ext.check(model, held_out)
    assert report.checked == 3 and report.launches_by_rule["linear"] == 3
    for g in report.grains:
        assert (g.model_miss_launches, g.model_missed_bytes, g.whole_miss_launches) == (0, 0, 0), g
    blocks = report.grains[-1]
    touched = (6 + 8 + 8) * MiB  # 5, 7 and 8 MiB in 2 MiB blocks
    assert (blocks.touched_bytes, blocks.touched_units) == (touched, 11)
    assert blocks.model_over == 1.0
    assert blocks.whole_bytes == 3 * 256 * MiB and blocks.whole_over == pytest.approx(3 * 256 * MiB / touched)


def test_a_wrong_model_produces_misses(tmp_path):
    # 1 and 2 MiB: within the tolerance, and two sizes fit no line: fixed 2 MiB
    model, _ = ext.learn([scale_log(tmp_path / "train.jsonl", [1 << 18, 1 << 19])])
    assert (rule_of(model, "scale", 0).rule, rule_of(model, "scale", 0).hi) == ("fixed", 2 * MiB)
    report = ext.check(model, scale_log(tmp_path / "test.jsonl", [1 << 20, 1 << 18]))  # 4 MiB, then 1 MiB
    blocks = report.grains[-1]
    assert (blocks.model_miss_launches, blocks.model_missed_units, blocks.model_missed_bytes) == (1, 1, 2 * MiB)
    assert blocks.whole_miss_launches == 0
    m = blocks.model_misses[0]
    assert (m.kernel, m.seq, m.alloc_start, m.alloc_size, m.first_missed, m.pointed) == \
        ("scale", 1, SEG, 256 * MiB, 2 * MiB, True)
    pages4k = report.grains[0]
    assert pages4k.model_missed_bytes == 2 * MiB and pages4k.model_missed_units == 2 * 256
    assert report.kernels["scale"].miss_launches == 1


def test_touches_below_a_wrong_lo_are_misses(tmp_path):
    log = SynthLog(tmp_path / "train.jsonl")
    log.alloc(SEG, 64 * MiB)
    for i in range(2):
        log.launch("halo", [Ptr(SEG + 8 * MiB), u32(i)], [(SEG + 8 * MiB, 1 * MiB)])
    model, _ = ext.learn([log.close()])
    assert rule_of(model, "halo", 0).rule == "fixed"
    log = SynthLog(tmp_path / "test.jsonl")
    log.alloc(SEG, 64 * MiB)
    log.launch("halo", [Ptr(SEG + 8 * MiB), u32(2)], [(SEG + 4 * MiB, 5 * MiB)])
    blocks = ext.check(model, log.close()).grains[-1]
    assert (blocks.model_missed_units, blocks.model_missed_bytes) == (2, 4 * MiB)
    assert blocks.model_misses[0].first_missed == 4 * MiB


def test_over_prediction_of_whole_allocations_against_the_model(tmp_path):
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 * MiB)
    for i in range(4):
        log.launch("small", [Ptr(SEG + i * 4 * MiB), u32(i)], [(SEG + i * 4 * MiB, 100 * KiB)])
    path = log.close()
    model, _ = ext.learn([path])
    report = ext.check(model, path)
    by_grain = {g.grain: g for g in report.grains}
    assert by_grain[4 * KiB].model_over == 1.0 and by_grain[4 * KiB].whole_over == pytest.approx(64 * MiB / (100 * KiB))
    assert by_grain[64 * KiB].touched_bytes == 4 * 128 * KiB and by_grain[64 * KiB].touched_units == 4 * 2
    assert by_grain[2 * MiB].model_over == 1.0 and by_grain[2 * MiB].whole_over == 32.0
    d = report.to_dict()
    json.dumps(d)
    assert d["grains"][-1]["whole_over"] == 32.0 and d["launches_by_rule_fraction"]["fixed"] == 1.0


def test_check_needs_touched_records(tmp_path):
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 64 * MiB)
    log.launch("k", [Ptr(SEG)], touched=False)
    path = log.close()
    model, _ = ext.learn([scale_log(tmp_path / "train.jsonl", [1 << 18, 1 << 18])])
    with pytest.raises(GpuosError, match="no launch of .* was measured: record it with `gpuos run --record-touched"):
        ext.check(model, path)
    with pytest.raises(GpuosError, match="was measured"):
        ext.learn([path])


# -- learning from several logs ------------------------------------------------------------


def kernels_log(path: Path, launches: list[tuple[str, int, int]]) -> Path:
    """Kernels k(float *x, unsigned n) each launch touching [x, x + extent), x at a different
    place of one segment each launch: launches are (kernel, n, extent)."""
    log = SynthLog(path)
    log.alloc(SEG, 1 << 30)
    for i, (kernel, n, extent) in enumerate(launches):
        x = SEG + (i % 16) * 64 * MiB
        log.launch(kernel, [Ptr(x), u32(n)], [(x, extent)])
    return log.close()


def test_rules_that_miss_on_a_held_out_log_fall_back_to_whole_allocations(tmp_path):
    """Three logs of other sizes: "odd" is linear in two of them but touches 8 MiB more in the
    third; fitted on the first two, its rule misses the third: whole.  "scale" is linear in
    all, and "once", only in the first log, is fixed: both keep their rules."""
    sizes = [[1 << 18, 1 << 20], [1 << 19, 3 << 19], [1 << 21, 5 << 19]]  # 1, 4 | 2, 6 | 8, 10 MiB
    logs = []
    for i, ns in enumerate(sizes):
        launches = [(k, n, 4 * n + (8 * MiB if k == "odd" and i == 2 else 0)) for n in ns for k in ("scale", "odd")]
        if i == 0:
            launches += [("once", n, 1 * MiB) for n in (1, 2)]
        logs.append(kernels_log(tmp_path / f"{i}.jsonl", launches))

    model, summary = ext.learn(logs)
    assert summary.held_out_misses == ["odd"]
    r = rule_of(model, "odd", 0)
    assert (r.rule, r.feature, r.a, r.b, r.memo) == ("whole", None, None, None, None)
    assert (r.lo, r.hi, r.samples) == (0, 18 * MiB, 6)  # the envelope stays what was measured
    r = rule_of(model, "scale", 0)
    assert (r.rule, r.feature, r.a, r.b) == ("linear", Feature("scalar", 1, 0, 4, False), 4, 0)
    assert rule_of(model, "once", 0).rule == "fixed"
    # the summary counts the rules as written
    assert summary.kernels_by_rule == {"fixed": 1, "linear": 1, "recorded": 0, "whole": 1}
    assert summary.slots_by_rule == {"fixed": 1, "linear": 1, "recorded": 0, "whole": 1}
    assert summary.launches_by_rule == {"fixed": 2, "linear": 6, "recorded": 0, "whole": 6}
    assert summary.launches_used == 14 and summary.logs == [str(p) for p in logs]
    x = Pointer(0, 0, SEG + 8 * MiB, SEG, SEG + (1 << 30))
    params = ParamsImage(struct.pack("<QI", x.address, 1 << 18), ((0, 8), (8, 4)))
    assert ext.predict(model, "odd", params, (1, 1, 1), (256, 1, 1), hash_of(u32(1 << 18)), [x]) == \
        [(SEG, SEG + (1 << 30))]
    assert ext.predict(model, "scale", params, (1, 1, 1), (256, 1, 1), hash_of(u32(1 << 18)), [x]) == \
        [(x.address, x.address + 1 * MiB)]

    # learnt from the first two alone, "odd" is linear (and each is checked with the other's rules)
    model, summary = ext.learn(logs[:2])
    assert summary.held_out_misses == [] and rule_of(model, "odd", 0).rule == "linear"


def test_two_logs_check_each_other(tmp_path):
    """Fixed at 1 MiB in one log, at 8 MiB in the other: the other log's rule covers the
    first, but not the reverse, and one miss is enough.  The same launches in one log are
    not cross-validated: recorded."""
    small = [("k", n, 1 * MiB) for n in (1, 2)] + [("scale", n, 4 * n) for n in (1 << 18, 1 << 20, 3 << 19)]
    large = [("k", n, 8 * MiB) for n in (3, 4)] + [("scale", n, 4 * n) for n in (1 << 19, 1 << 21, 3 << 20)]
    a, b = kernels_log(tmp_path / "a.jsonl", small), kernels_log(tmp_path / "b.jsonl", large)
    assert rule_of(ext.learn([a])[0], "k", 0).rule == rule_of(ext.learn([b])[0], "k", 0).rule == "fixed"
    assert ext.check(ext.learn([b])[0], a).kernels["k"].miss_launches == 0
    assert ext.check(ext.learn([a])[0], b).kernels["k"].miss_launches == 2

    model, summary = ext.learn([a, b])
    assert summary.held_out_misses == ["k"]
    assert rule_of(model, "k", 0).rule == "whole" and rule_of(model, "scale", 0).rule == "linear"
    assert summary.kernels_by_rule == {"fixed": 0, "linear": 1, "recorded": 0, "whole": 1}
    assert ext.check(model, b).grains[-1].model_miss_launches == 0

    model, summary = ext.learn([kernels_log(tmp_path / "both.jsonl", small + large)])
    assert summary.held_out_misses == [] and rule_of(model, "k", 0).rule == "recorded"


# -- the model file ----------------------------------------------------------------------


def test_model_round_trip_and_atomic_write(tmp_path, monkeypatch):
    log = SynthLog(tmp_path / "a.jsonl")
    log.alloc(SEG, 1 << 30)
    for m, k in ((256, 512), (512, 512), (512, 1024), (128, 64)):
        log.launch("gemm_a", [Ptr(SEG), u32(m), u32(k)], [(SEG, pages(4 * m * k))])
        log.launch("mode", [Ptr(SEG), u32(m % 3)], [(SEG, (m % 3 + 1) * 3 * MiB if m != 512 else MiB)])
    model, _ = ext.learn([log.close()], tolerance=4096)
    path = tmp_path / "model.json"
    ext.write_model(model, path)
    raw = json.loads(path.read_text())
    assert (raw["format"], raw["version"], raw["tolerance"], raw["source"]) == \
        ("gpuos-extents", 1, 4096, [str(tmp_path / "a.jsonl")])
    assert {p["rule"] for k in raw["kernels"].values() for p in k["pointers"]} == {"linear", "recorded"}
    assert ext.read_model(path) == model

    before = path.read_bytes()

    def fail_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail_replace)
    model.tolerance = 1
    with pytest.raises(GpuosError, match="cannot write the model .*No space left"):
        ext.write_model(model, path)
    assert path.read_bytes() == before  # the old model, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "model.json"]  # no temporary left


@pytest.mark.parametrize("content,message", [
    (None, "no model"),
    ("{not json", "not a gpuos extent model (not JSON"),
    ('{"format": "gpuos-image"}', "not a gpuos extent model"),
    ('{"format": "gpuos-extents", "version": 9}', "extent model version 9"),
    ('{"format": "gpuos-extents", "version": 1, "created": "", "source": [], "tolerance": 1, '
     '"kernels": {"k": {"params_bytes": 8, "launches": 1, "pointers": [{"rule": "psychic"}]}}}', "not a valid"),
])
def test_bad_models_are_refused(tmp_path, content, message):
    path = tmp_path / "model.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(GpuosError, match=re.escape(message)):
        ext.read_model(path)


# -- the commands ------------------------------------------------------------------------


def runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        return CliRunner()


def invoke(*args: str):
    return runner().invoke(cli, ["mem", "extents", *map(str, args)])


def test_learn_and_check_commands(tmp_path):
    train = scale_log(tmp_path / "train.jsonl", [1 << 18, 1 << 20, 3 << 19])  # 1, 4 and 6 MiB
    small = scale_log(tmp_path / "small.jsonl", [1 << 18, 1 << 19, 3 << 18])  # 1, 2 and 3 MiB
    wrong = scale_log(tmp_path / "one.jsonl", [1 << 18, 1 << 19])  # fixed 2 MiB
    test = scale_log(tmp_path / "test.jsonl.gz", [5 << 18, 1 << 21])
    model = tmp_path / "model.json"

    res = invoke("learn", train, "-o", model)
    assert res.exit_code == 0, res.output
    assert "learnt the extents of 1 kernels from 3 of 3 launches" in res.stdout
    assert "1 (100%) linear" in res.stdout
    assert json.loads(model.read_text())["tolerance"] == 2 * MiB  # the default
    res = invoke("learn", small, "-o", model)  # 1, 2 and 3 MiB: within the default 2 MiB
    assert res.exit_code == 0 and "1 (100%) fixed" in res.stdout, res.output
    res = invoke("learn", small, "-o", model, "--tolerance", "64K")
    assert res.exit_code == 0 and "1 (100%) linear" in res.stdout, res.output
    assert json.loads(model.read_text())["tolerance"] == 64 * KiB

    res = invoke("learn", train, "-o", model, "--json")
    d = json.loads(res.stdout)
    assert d["ok"] and d["model"] == str(model) and d["slots_by_rule"]["linear"] == 1
    assert d["counts"]["measured"] == 3 and d["launches_used"] == 3 and d["held_out_misses"] == []

    res = invoke("check", model, test)
    assert res.exit_code == 0, res.output
    assert "2 of 2 launches checked" in res.stdout and "2.0 MiB" in res.stdout and "MODEL MISSES" in res.stdout

    res = invoke("check", model, test, "--json")
    d = json.loads(res.stdout)
    assert d["ok"] and d["checked"] == 2 and d["grains"][-1]["model_miss_launches"] == 0
    assert d["kernels"][0]["name"] == "scale" and d["kernels"][0]["rule"] == "linear"

    invoke("learn", wrong, "-o", model)
    res = invoke("check", model, test)  # misses are a measurement, not a failure
    assert res.exit_code == 0 and "first misses at 2.0 MiB" in res.stdout and "pid 4242 seq 1 scale" in res.stdout

    # two logs: each is checked with the rules of the other
    res = invoke("learn", train, test, "-o", model, "--json")
    d = json.loads(res.stdout)
    assert d["slots_by_rule"]["linear"] == 1 and d["held_out_misses"] == [] and d["launches_used"] == 5
    res = invoke("learn", wrong, test, "-o", model, "--json")  # fixed 2 MiB misses 5 and 8 MiB
    d = json.loads(res.stdout)
    assert d["slots_by_rule"]["whole"] == 1 and d["held_out_misses"] == ["scale"]


def test_command_errors_are_one_line(tmp_path):
    train = scale_log(tmp_path / "train.jsonl", [1 << 18, 1 << 19])
    model = tmp_path / "model.json"
    unmeasured = SynthLog(tmp_path / "plain.jsonl")
    unmeasured.launch("k", [u32(1)], touched=False)
    unmeasured.close()
    (tmp_path / "junk.jsonl").write_text("hello\n")
    cases = [
        (["learn", tmp_path / "missing.jsonl", "-o", model], f"gpuos: no launch log {tmp_path / 'missing.jsonl'}"),
        (["learn", tmp_path / "junk.jsonl", "-o", model], "not a valid gpuos launch log"),
        (["learn", tmp_path / "plain.jsonl", "-o", model],
         f"gpuos: no launch of {tmp_path / 'plain.jsonl'} was measured: record it with "
         "`gpuos run --record-touched --log FILE`"),
        (["learn", train, "-o", tmp_path / "no" / "such" / "dir.json"], "cannot write the model"),
        (["check", tmp_path / "missing.json", train], "gpuos: no model"),
        (["check", train, train], "is not a gpuos extent model"),
    ]
    for args, message in cases:
        res = invoke(*args)
        assert res.exit_code == 1, (args, res.output)
        assert res.stdout == "" and len(res.stderr.splitlines()) == 1 and message in res.stderr, (args, res.stderr)
    res = invoke("learn", tmp_path / "plain.jsonl", "-o", model, "--json")
    assert res.exit_code == 1
    assert json.loads(res.stdout) == {"ok": False, "error": "error", "exit_code": 1, "message": res_message(res)}
    res = invoke("learn", train, "-o", model, "--tolerance", "lots")
    assert res.exit_code == 2 and "is not a size in bytes" in res.stderr
    invoke("learn", train, "-o", model)
    res = invoke("check", model, tmp_path / "plain.jsonl")
    assert res.exit_code == 1 and "was measured" in res.stderr


def res_message(res) -> str:
    return json.loads(res.stdout)["message"]


def test_the_installed_command(tmp_path, home):
    """The real entry point, once: help and an error's exit status."""
    env = gpuos_env(home.home)
    res = gpuos(env, "mem", "extents", "--help")
    assert res.returncode == 0 and "learn" in res.stdout and "check" in res.stdout
    res = gpuos(env, "mem", "extents", "check", str(tmp_path / "m.json"), str(tmp_path / "l.jsonl"))
    assert res.returncode == 1 and res.stderr.startswith("gpuos: no model")


# -- tools/probes/extents_traffic_probe.py: the replay its figures come from -----------------

def _traffic_probe():
    import importlib.util
    path = Path(__file__).resolve().parents[2] / "tools" / "probes" / "extents_traffic_probe.py"
    spec = importlib.util.spec_from_file_location("extents_traffic_probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_traffic_replay_counts_the_last_repetition_and_evicts_by_the_future():
    probe = _traffic_probe()
    seq = [frozenset({"a"}), frozenset({"b"}), frozenset({"c"})]
    size = {"a": 1, "b": 1, "c": 1}
    assert probe.belady_moved_in(seq, size, 3) == (0, 0)  # all fit: nothing moves once in
    # Three items in a loop, room for two: Belady keeps the one used soonest; in the third
    # pass (ticks 6-8) a and c miss, b was kept.
    assert probe.belady_moved_in(seq, size, 2) == (2, 0)
    assert probe.belady_moved_in([frozenset({"big"})], {"big": 5}, 4) == (0, 1)


def test_traffic_replay_finer_items_move_only_what_is_used():
    probe = _traffic_probe()
    # Two 4-block allocations used alternately, one block of each: whole allocations do not
    # fit together in 6 blocks and swap every call; their used blocks do.
    whole = [frozenset({"A"}), frozenset({"B"})] * 2
    blocks = [frozenset({("A", 0)}), frozenset({("B", 0)})] * 2
    size = {"A": 4, "B": 4, ("A", 0): 1, ("B", 0): 1}
    assert probe.belady_moved_in(whole, size, 6) == (16, 0)
    assert probe.belady_moved_in(blocks, size, 6) == (0, 0)
