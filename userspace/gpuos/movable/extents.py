"""Working sets finer than an allocation (issue 19, item 1a): the bytes of its buffers that a
kernel launch will touch, predicted from the launch's arguments before it is submitted.

PyTorch's caching allocator puts many tensors into one cudaMalloc segment, so a launch's
whole allocations are 5-13x what it touches.  As in MSched, each pointer argument's
extent, the bytes [lo, hi) around the pointer that the kernel touches, is inferred from
the launch's arguments: fixed for most kernels, linear in an integer argument or the grid
for many, recorded per argument values for the rest.  This module is the offline half:
`learn` fits the rules from launch logs recorded with `gpuos run --record-touched --log
FILE` (their `touched` records are the ground truth), `write_model` and `read_model` keep
them in a JSON file ("gpuos-extents", docs/design.md), `predict` applies them to one
launch, and `check` measures a model against another log.  A C implementation in
libgpuos would apply models with exactly `predict`'s semantics (none is built: over a step
the extents save the scheduler at most 16% of the bytes it moves, docs/design.md):

Pointers (found by the caller): every little-endian u64 word of the parameter buffer at an
offset that is a multiple of 8 (counted from the buffer's start; a pointer parameter or
struct member is 8-aligned there, so libgpuos's scan, stepping 8 bytes through each
parameter, finds the same ones) whose value lies in a live device allocation [S, E).  The
word's slot is (parameter index, byte offset of the word inside that parameter).

predict(model, kernel, params, grid, block, arg_hash, pointers) -> sorted ranges [start, end):
  1. If the kernel has no name, the model has no kernel of that name, or the parameter
     buffer's size (the end of its last parameter) is not the kernel's params_bytes:
     every pointer's whole allocation [S, E).
  2. Otherwise each pointer at address A in [S, E) gets, by the rule of its slot:
       no rule for the slot: [S, E)
       fixed:    [A + lo, A + hi)
       linear:   [A + lo, A + a * f + b), f the value of the rule's feature; a feature
                 that cannot be read (its parameter or bytes are not in the buffer): [S, E)
       recorded: the memo's [lo, hi] for memo_key(arg_hash, grid, block) as
                 [A + lo, A + hi); a key not in the memo: [S, E)
       whole:    [S, E)
     clipped to [S, E); an empty range (hi <= lo, or nothing left by the clip) adds nothing.
  3. The result is the union of the pointers' ranges, sorted, with overlapping and
     adjacent ranges merged (so one range may span two adjacent allocations).
  The memo key is "%016x/%u,%u,%u/%u,%u,%u" of arg_hash, grid x y z and block x y z;
  arg_hash is libgpuos's hash of the launch's parameter words that are not pointers
  (struct gpuos_rec_launch.arg_hash in gpuos_ring.h), as its launch records carry it.
  Features are exact integers (C: compute in 128 bits, or saturate; the range is clipped):
       scalar {param, offset, size 4 or 8, signed}: the little-endian integer of `size`
              bytes at byte `offset` of parameter `param`, two's complement if signed;
       grid: grid x; grid_xy: x*y; grid_xyz: x*y*z; block: block x*y*z;
       threads: grid x*y*z * block x*y*z; product {of: [f, g]}: f * g.

Attribution (learning and checking): a launch's touched runs are split at allocation
boundaries, and within an allocation at its pointers: each piece goes to the pointer with
the greatest address at or below its start (pieces below every pointer to the lowest).  A
pointer's extent in that launch is [first byte - A, end of last byte - A) of its pieces;
runs in no allocation a pointer names are unattributed (pointers the parameters do not
hold, e.g. pointer arrays in device memory).
"""

from __future__ import annotations

import json
import os
import struct
import time
from bisect import bisect_right, insort
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from gpuos.errors import GpuosError
from gpuos.intercept.log import read_log

FORMAT = "gpuos-extents"
VERSION = 1
# Measured touches can fall short of the truth by up to a 2 MiB block (within one, a page UVM
# brought in with a faulted neighbour does not fault), so rules fit within one block.
DEFAULT_TOLERANCE = 2 << 20
PAGE = 4096  # the granularity of touched runs
GRAINS = (4 << 10, 64 << 10, 2 << 20)  # 2 MiB: exact in the ground truth, and what gpuos moves
# Kinds of allocation records that map device memory a pointer can point into (host memory
# and VMM reservations or handles are no such mappings).
DEVICE_KINDS = frozenset({"device", "pitch", "async", "managed", "vmm-map", "graph"})
RULES = ("fixed", "linear", "recorded", "whole")  # most to least specific
GRID_KINDS = ("grid", "grid_xy", "grid_xyz", "block", "threads")
MEMO_MAX = 4096  # keys of one pointer's memo; beyond, the memo would hardly repeat: "whole"
PRODUCT_FEATURES_MAX = 16  # varying features whose pairwise products are tried
MISSES_LISTED = 5
NO_MEASURED_LAUNCH = "no launch of {log} was measured: record it with `gpuos run --record-touched --log FILE`"


# -- a launch's arguments ----------------------------------------------------------------


@dataclass(frozen=True)
class ParamsImage:
    """A launch's parameter buffer: each parameter's bytes at its offset, gaps zero."""

    data: bytes
    layout: tuple[tuple[int, int], ...]  # (offset, size) of each parameter in data

    @classmethod
    def from_record(cls, rec: dict) -> ParamsImage:
        """From a launch log's `params` record."""
        layout = tuple((p["offset"], p["size"]) for p in rec["params"])
        data = bytearray(max((off + size for off, size in layout), default=0))
        for p in rec["params"]:
            raw = bytes.fromhex(p["hex"])[:p["size"]]
            data[p["offset"]:p["offset"] + len(raw)] = raw
        return cls(bytes(data), layout)

    def read(self, param: int, offset: int, size: int, signed: bool) -> int | None:
        """The integer at byte `offset` of parameter `param`; None if it is not all there."""
        if not 0 <= param < len(self.layout):
            return None
        start, psize = self.layout[param]
        if offset < 0 or offset + size > psize:
            return None
        return int.from_bytes(self.data[start + offset:start + offset + size], "little", signed=signed)

    def words(self) -> Iterator[tuple[int, int, int]]:
        """(parameter, offset inside it, value) of every u64 word at an 8-aligned buffer offset."""
        for i, (start, size) in enumerate(self.layout):
            for off in range((-start) % 8, size - 7, 8):
                yield i, off, struct.unpack_from("<Q", self.data, start + off)[0]


@dataclass(frozen=True)
class Pointer:
    """A pointer argument: its slot (param, offset), value, and the allocation it points into."""

    param: int
    offset: int  # byte offset of the word inside the parameter
    address: int
    alloc_start: int
    alloc_end: int


def _grid_value(kind: str, grid: Sequence[int], block: Sequence[int]) -> int:
    blocks = grid[0] * grid[1] * grid[2]
    threads = block[0] * block[1] * block[2]
    return {"grid": grid[0], "grid_xy": grid[0] * grid[1], "grid_xyz": blocks, "block": threads,
            "threads": blocks * threads}[kind]


@dataclass(frozen=True)
class Feature:
    """An integer of a launch that an extent may be linear in."""

    kind: str  # "scalar", one of GRID_KINDS, or "product"
    param: int | None = None  # scalar: the parameter's index,
    offset: int | None = None  # the integer's byte offset inside it,
    size: int | None = None  # its bytes (4 or 8),
    signed: bool | None = None  # and whether it is two's complement
    of: tuple[Feature, Feature] | None = None  # product: the two features multiplied

    def value(self, params: ParamsImage, grid: Sequence[int], block: Sequence[int]) -> int | None:
        """Its value in a launch; None if the launch's parameters do not hold it."""
        if self.kind == "scalar":
            return params.read(self.param, self.offset, self.size, self.signed)
        if self.kind == "product":
            x, y = (f.value(params, grid, block) for f in self.of)
            return None if x is None or y is None else x * y
        return _grid_value(self.kind, grid, block)

    def to_dict(self) -> dict:
        if self.kind == "scalar":
            return {"kind": "scalar", "param": self.param, "offset": self.offset, "size": self.size,
                    "signed": self.signed}
        if self.kind == "product":
            return {"kind": "product", "of": [f.to_dict() for f in self.of]}
        return {"kind": self.kind}

    @classmethod
    def from_dict(cls, d: dict) -> Feature:
        kind = d["kind"]
        if kind == "scalar":
            if d["size"] not in (4, 8):
                raise ValueError(f"a scalar feature of {d['size']} bytes")
            return cls("scalar", int(d["param"]), int(d["offset"]), d["size"], bool(d["signed"]))
        if kind == "product":
            x, y = d["of"]
            return cls("product", of=(cls.from_dict(x), cls.from_dict(y)))
        if kind not in GRID_KINDS:
            raise ValueError(f"unknown feature kind {kind!r}")
        return cls(kind)


def memo_key(arg_hash: int, grid: Sequence[int], block: Sequence[int]) -> str:
    """The key of a launch in a "recorded" rule's memo."""
    return f"{arg_hash:016x}/{grid[0]},{grid[1]},{grid[2]}/{block[0]},{block[1]},{block[2]}"


# -- the model ---------------------------------------------------------------------------


@dataclass
class PointerRule:
    """The extent rule of one pointer slot of a kernel.  lo and hi are the observed envelope
    (the least lo, the greatest hi; 0, 0 if it never touched anything); "fixed" predicts
    them, "linear" predicts [lo, a * f + b)."""

    param: int
    offset: int
    rule: str  # one of RULES
    lo: int
    hi: int
    samples: int  # measured launches in which the slot held a pointer
    feature: Feature | None = None  # linear
    a: int | None = None  # linear: bytes per unit of the feature (>= 1)
    b: int | None = None  # linear: covers every sample learnt from (the fit's intercept plus its largest residual)
    memo: dict[str, tuple[int, int]] | None = None  # recorded: memo_key -> (lo, hi)

    def extent(self, params: ParamsImage, grid: Sequence[int], block: Sequence[int],
               arg_hash: int) -> tuple[int, int] | None:
        """[lo, hi) around the pointer in this launch; None: the whole allocation."""
        if self.rule == "fixed":
            return self.lo, self.hi
        if self.rule == "linear":
            f = self.feature.value(params, grid, block)
            return None if f is None else (self.lo, self.a * f + self.b)
        if self.rule == "recorded":
            return self.memo.get(memo_key(arg_hash, grid, block))
        return None

    def to_dict(self) -> dict:
        d = {"param": self.param, "offset": self.offset, "rule": self.rule, "lo": self.lo, "hi": self.hi,
             "samples": self.samples}
        if self.rule == "linear":
            d.update(feature=self.feature.to_dict(), a=self.a, b=self.b)
        if self.rule == "recorded":
            d["memo"] = {k: list(v) for k, v in self.memo.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PointerRule:
        rule = d["rule"]
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}")
        r = cls(int(d["param"]), int(d["offset"]), rule, int(d["lo"]), int(d["hi"]), int(d["samples"]))
        if rule == "linear":
            r.feature, r.a, r.b = Feature.from_dict(d["feature"]), int(d["a"]), int(d["b"])
        if rule == "recorded":
            r.memo = {str(k): (int(lo), int(hi)) for k, (lo, hi) in d["memo"].items()}
        return r


@dataclass
class KernelModel:
    params_bytes: int  # the size of the parameter buffer it was learnt with
    launches: int  # measured launches learnt from
    pointers: list[PointerRule]
    by_slot: dict[tuple[int, int], PointerRule] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.by_slot = {(p.param, p.offset): p for p in self.pointers}

    @property
    def rule_class(self) -> str:
        """Its least specific pointer rule ("fixed" without pointers: it predicts nothing)."""
        return max((p.rule for p in self.pointers), key=RULES.index, default="fixed")

    def to_dict(self) -> dict:
        return {"params_bytes": self.params_bytes, "launches": self.launches,
                "pointers": [p.to_dict() for p in self.pointers]}

    @classmethod
    def from_dict(cls, d: dict) -> KernelModel:
        return cls(int(d["params_bytes"]), int(d["launches"]), [PointerRule.from_dict(p) for p in d["pointers"]])


@dataclass
class ExtentModel:
    created: str  # ISO 8601
    source: list[str]  # the logs learnt from
    tolerance: int  # bytes
    kernels: dict[str, KernelModel]

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "created": self.created, "source": self.source,
                "tolerance": self.tolerance, "kernels": {k: m.to_dict() for k, m in self.kernels.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> ExtentModel:
        return cls(str(d["created"]), [str(s) for s in d["source"]], int(d["tolerance"]),
                   {str(k): KernelModel.from_dict(m) for k, m in d["kernels"].items()})


def write_model(model: ExtentModel, path: Path) -> None:
    """Write the model to path atomically: readers see the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(model.to_dict(), f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise GpuosError(f"cannot write the model {path}: {exc.strerror or exc}") from None


def read_model(path: Path) -> ExtentModel:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GpuosError(f"no model {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise GpuosError(f"cannot read the model {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise GpuosError(f"{path} is not a gpuos extent model (not JSON: {exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise GpuosError(f"{path} is not a gpuos extent model (`gpuos mem extents learn` writes them)")
    if data.get("version") != VERSION:
        raise GpuosError(f"{path}: extent model version {data.get('version')!r} (this gpuos reads {VERSION})")
    try:
        return ExtentModel.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise GpuosError(f"{path} is not a valid gpuos extent model ({type(exc).__name__}: {exc})") from None


# -- prediction --------------------------------------------------------------------------


def _pointer_ranges(model: ExtentModel, kernel: str | None, params: ParamsImage, grid: Sequence[int],
                    block: Sequence[int], arg_hash: int,
                    pointers: Sequence[Pointer]) -> Iterator[tuple[Pointer, tuple[int, int] | None, str]]:
    """Each pointer's predicted range (None: nothing) and the rule that gave it ("whole" for
    every fallback to the allocation)."""
    km = model.kernels.get(kernel) if kernel is not None else None
    if km is not None and len(params.data) != km.params_bytes:
        km = None  # another kernel under the same name: its slots mean something else
    for p in pointers:
        rule = km.by_slot.get((p.param, p.offset)) if km is not None else None
        ext = rule.extent(params, grid, block, arg_hash) if rule is not None else None
        if ext is None:
            yield p, (p.alloc_start, p.alloc_end), "whole"
            continue
        lo, hi = ext
        start, end = max(p.alloc_start, p.address + lo), min(p.alloc_end, p.address + hi)
        yield p, ((start, end) if hi > lo and start < end else None), rule.rule


def predict(model: ExtentModel, kernel: str | None, params: ParamsImage, grid: Sequence[int],
            block: Sequence[int], arg_hash: int, pointers: Sequence[Pointer]) -> list[tuple[int, int]]:
    """The byte ranges a launch will touch, by the module docstring's semantics."""
    return _merge([r for _, r, _ in _pointer_ranges(model, kernel, params, grid, block, arg_hash, pointers)
                   if r is not None])


# -- byte ranges -------------------------------------------------------------------------


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping and adjacent ranges joined."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(ranges):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _round_clip(ranges: list[tuple[int, int]], grain: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """Every unit of `grain` bytes (address-aligned) that a range touches, within [lo, hi)."""
    return _merge([(max(lo, s // grain * grain), min(hi, -(-e // grain) * grain)) for s, e in ranges])


def _minus(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """a less b (both merged)."""
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while s < e and k < len(b) and b[k][0] < e:
            if b[k][0] > s:
                out.append((s, b[k][0]))
            s = max(s, b[k][1])
            k += 1
        if s < e:
            out.append((s, e))
    return out


def _clip(ranges: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    return [(max(s, lo), min(e, hi)) for s, e in ranges if s < hi and e > lo]


def _length(ranges: list[tuple[int, int]]) -> int:
    return sum(e - s for s, e in ranges)


def _units(ranges: list[tuple[int, int]], grain: int) -> int:
    """The grain-sized units that merged ranges overlap."""
    return sum(-(-e // grain) - s // grain for s, e in ranges)


# -- reading launch logs -----------------------------------------------------------------


@dataclass
class LogCounts:
    """What the logs held, and why launches were left out."""

    launches: int = 0  # launch records
    measured: int = 0  # with a complete touched record: learnt from or checked
    captured: int = 0  # recorded into a stream capture, not run
    layout_unknown: int = 0  # parameters not found
    graph: int = 0  # kernel nodes of graph launches: one touched record would cover the whole graph
    no_params: int = 0  # no params record, or a truncated one
    unmeasured: int = 0  # no touched record
    incomplete: int = 0  # a touched record that says touches may be missing (dropped, remote, ...)
    touched_records: int = 0
    touched_unused: int = 0  # touched records of no launch above
    coarse: int = 0  # measured launches whose runs join pages across gaps (the record's gap): over-reported
    pointers_unmeasured: int = 0  # pointers into allocations whose touches are not measured: no sample
    unattributed_runs: int = 0  # pieces of touched runs in no allocation a pointer argument names
    unattributed_bytes: int = 0
    unattributed_launches: int = 0


@dataclass
class MeasuredLaunch:
    pid: int
    seq: int
    kernel: str | None
    params: ParamsImage
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    arg_hash: int
    pointers: tuple[Pointer, ...]
    unmeasured: frozenset[int]  # starts of pointed-to allocations whose touches were not measured
    not_scalar: frozenset[int]  # buffer offsets of words that are (or look like) pointers: no features
    touched: dict[tuple[int, int], list[tuple[int, int]]]  # measured allocation [start, end) -> its touched ranges
    stray_runs: int  # pieces of runs in no measured allocation
    stray_bytes: int


class _Allocations:
    """One process's live device allocations (they do not overlap)."""

    def __init__(self) -> None:
        self.bases: list[int] = []
        self.ends: dict[int, int] = {}
        self.end_set: set[int] = set()
        self.measured: set[int] = set()

    def add(self, rec: dict) -> None:
        base, size = rec["base"], rec["size"]
        if rec["kind"] not in DEVICE_KINDS or size <= 0:
            return
        if base in self.ends:
            self.end_set.discard(self.ends[base])
        else:
            insort(self.bases, base)
        self.ends[base] = base + size
        self.end_set.add(base + size)
        if rec.get("measured"):
            self.measured.add(base)
        else:
            self.measured.discard(base)

    def remove(self, rec: dict) -> None:
        base = rec["base"]
        if rec["kind"] not in DEVICE_KINDS or base not in self.ends:
            return
        self.bases.pop(bisect_right(self.bases, base) - 1)
        self.end_set.discard(self.ends.pop(base))
        self.measured.discard(base)

    def find(self, addr: int) -> int | None:
        """The base of the allocation holding addr."""
        i = bisect_right(self.bases, addr) - 1
        if i >= 0 and addr < self.ends[self.bases[i]]:
            return self.bases[i]
        return None

    def next_base(self, addr: int) -> int | None:
        i = bisect_right(self.bases, addr)
        return self.bases[i] if i < len(self.bases) else None


@dataclass
class _Process:
    functions: dict[int, str | None] = field(default_factory=dict)
    allocs: _Allocations = field(default_factory=_Allocations)
    params: dict[int, dict] = field(default_factory=dict)  # seq -> params record, until its launch
    launches: dict[int, MeasuredLaunch] = field(default_factory=dict)  # seq -> launch awaiting its touched record
    touched: dict[int, dict] = field(default_factory=dict)  # seq -> touched record awaiting its launch


def _launch(pid: int, proc: _Process, rec: dict, params: ParamsImage) -> MeasuredLaunch:
    pointers, unmeasured, not_scalar = [], set(), set()
    allocs = proc.allocs
    for param, off, word in params.words():
        base = allocs.find(word)
        if base is not None:
            pointers.append(Pointer(param, off, word, base, allocs.ends[base]))
            if base not in allocs.measured:
                unmeasured.add(base)
        # A word one past an allocation's end is an end pointer, not a size.
        if base is not None or word in allocs.end_set:
            not_scalar.add(params.layout[param][0] + off)
    return MeasuredLaunch(pid=pid, seq=rec["seq"], kernel=proc.functions.get(rec["func"]), params=params,
                          grid=tuple(rec["grid"]), block=tuple(rec["block"]), arg_hash=rec.get("arg_hash", 0),
                          pointers=tuple(pointers), unmeasured=frozenset(unmeasured),
                          not_scalar=frozenset(not_scalar), touched={}, stray_runs=0, stray_bytes=0)


def _split_runs(launch: MeasuredLaunch, allocs: _Allocations, runs: list[dict]) -> None:
    """Fill in the launch's touched ranges, split at the boundaries of allocations."""
    for run in runs:
        s, e = run["start"], run["start"] + run["len"]
        while s < e:
            base = allocs.find(s)
            if base is None:
                nxt = allocs.next_base(s)
                end = e if nxt is None else min(e, nxt)
            else:
                end = min(e, allocs.ends[base])
            if base is not None and base in allocs.measured:
                launch.touched.setdefault((base, allocs.ends[base]), []).append((s, end))
            else:
                launch.stray_runs += 1
                launch.stray_bytes += end - s
            s = end


def read_measured(log: Path, counts: LogCounts) -> Iterator[MeasuredLaunch]:
    """The measured launches of a launch log, in the order their records complete; `counts`
    says what the log held and why the other launches were left out."""
    procs: dict[int, _Process] = {}

    def complete(launch: MeasuredLaunch, touched: dict, proc: _Process) -> MeasuredLaunch | None:
        if touched.get("flags"):  # every flag of a touched record means touches may be missing
            counts.incomplete += 1
            return None
        counts.measured += 1
        counts.coarse += bool(touched.get("gap"))
        counts.pointers_unmeasured += sum(p.alloc_start in launch.unmeasured for p in launch.pointers)
        _split_runs(launch, proc.allocs, touched.get("runs", []))
        return launch

    try:
        records = read_log(Path(log))
        next(records)  # the header
        for rec in records:
            rtype, proc = rec.get("type"), procs.setdefault(rec.get("pid", 0), _Process())
            if rtype == "alloc":
                proc.allocs.add(rec)
            elif rtype == "free":
                proc.allocs.remove(rec)
            elif rtype == "function":
                proc.functions[rec["id"]] = rec.get("name")
            elif rtype == "params":
                proc.params[rec["seq"]] = rec
            elif rtype == "launch":
                counts.launches += 1
                params, flags = proc.params.pop(rec["seq"], None), rec.get("flags", ())
                if "captured" in flags:
                    counts.captured += 1
                elif "layout-unknown" in flags:
                    counts.layout_unknown += 1
                elif "graph" in flags:
                    counts.graph += 1
                elif params is None or "truncated" in params.get("flags", ()):
                    counts.no_params += 1
                else:
                    launch = _launch(rec.get("pid", 0), proc, rec, ParamsImage.from_record(params))
                    touched = proc.touched.pop(rec["seq"], None)
                    if touched is None:
                        proc.launches[rec["seq"]] = launch
                    elif (done := complete(launch, touched, proc)) is not None:
                        yield done
            elif rtype == "touched":
                counts.touched_records += 1
                launch = proc.launches.pop(rec["seq"], None)
                if launch is None:
                    proc.touched[rec["seq"]] = rec  # its launch may come after it
                elif (done := complete(launch, rec, proc)) is not None:
                    yield done
    except FileNotFoundError:
        raise GpuosError(f"no launch log {log}") from None
    except (OSError, EOFError) as exc:
        raise GpuosError(f"cannot read the launch log {log}: {getattr(exc, 'strerror', None) or exc}") from None
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        # read_log's "not a gpuos launch log", bad JSON, or records lacking their fields
        what = str(exc) if isinstance(exc, ValueError) and str(exc).startswith(str(log)) else \
            f"{log}: not a valid gpuos launch log ({type(exc).__name__}: {exc})"
        raise GpuosError(what) from None
    counts.unmeasured += sum(len(p.launches) for p in procs.values())
    counts.touched_unused += sum(len(p.touched) for p in procs.values())


@dataclass
class Attribution:
    extents: dict[int, tuple[int, int] | None]  # pointer address -> [lo, hi) touched around it; None: nothing
    unattributed_runs: int
    unattributed_bytes: int


def attribute(launch: MeasuredLaunch) -> Attribution:
    """Each measured pointer's touched extent in this launch (module docstring, Attribution)."""
    addrs: dict[int, list[int]] = {}  # measured allocation start -> its distinct pointers, ascending
    for p in launch.pointers:
        if p.alloc_start not in launch.unmeasured:
            addrs.setdefault(p.alloc_start, []).append(p.address)
    for a in addrs.values():
        a[:] = sorted(set(a))
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    runs, nbytes = launch.stray_runs, launch.stray_bytes
    for (alloc, _), ranges in launch.touched.items():
        ptrs = addrs.get(alloc)
        if not ptrs:
            runs += len(ranges)
            nbytes += _length(ranges)
            continue
        for s, e in ranges:
            i = bisect_right(ptrs, s) - 1
            while s < e:  # split at pointers: a run may cover the buffers of two
                owner = ptrs[max(i, 0)]
                end = min(e, ptrs[i + 1]) if i + 1 < len(ptrs) else e
                first[owner] = min(first.get(owner, s), s)
                last[owner] = max(last.get(owner, end), end)
                s, i = end, i + 1
    extents = {a: (first[a] - a, last[a] - a) if a in first else None for ptrs in addrs.values() for a in ptrs}
    return Attribution(extents, runs, nbytes)


def _count_unattributed(counts: LogCounts, att: Attribution) -> None:
    counts.unattributed_runs += att.unattributed_runs
    counts.unattributed_bytes += att.unattributed_bytes
    counts.unattributed_launches += att.unattributed_runs > 0


def _no_touched_records(counts: LogCounts, before: int, log: Path) -> None:
    if counts.touched_records == before:
        raise GpuosError(NO_MEASURED_LAUNCH.format(log=log))


# -- learning ----------------------------------------------------------------------------


BLOCK = GRAINS[-1]


@dataclass
class _Spread:
    """The extents of one pointer slot in the launches with one memo key.

    A measured hi can fall short of the true one, but not past its 2 MiB block: every block
    a launch touches faults at least once, so the last faulted page is in the true last
    block.  hi_cap is the least, over the samples, of the end of that block (relative to
    the pointer), lo_floor the greatest start of the first one.  A memo entry widens its
    key's extent out to them: the same arguments at other addresses may end in the next
    block.  (Bounding fixed and linear rules by them too missed more on GPU recordings,
    2026-11-27: within one key, measured extents are not always the same.)"""

    samples: int = 0
    touched: int = 0  # samples in which it touched something
    lo_min: int = 0
    lo_max: int = 0
    hi_min: int = 0
    hi_max: int = 0
    hi_cap: int = 0
    lo_floor: int = 0

    def add(self, extent: tuple[int, int] | None, address: int) -> None:
        self.samples += 1
        if extent is None:
            return
        lo, hi = extent
        cap = -(-(address + hi) // BLOCK) * BLOCK - address
        floor = (address + lo) // BLOCK * BLOCK - address
        if not self.touched:
            self.lo_min = self.lo_max = lo
            self.hi_min = self.hi_max = hi
            self.hi_cap, self.lo_floor = cap, floor
        self.touched += 1
        self.lo_min, self.lo_max = min(self.lo_min, lo), max(self.lo_max, lo)
        self.hi_min, self.hi_max = min(self.hi_min, hi), max(self.hi_max, hi)
        self.hi_cap, self.lo_floor = min(self.hi_cap, cap), max(self.lo_floor, floor)


@dataclass
class _Shape:
    """What a launch's features are read from (one per memo key: launches with one key have
    the same scalars, grid and block)."""

    data: bytes
    not_scalar: frozenset[int]
    grid: tuple[int, int, int]
    block: tuple[int, int, int]


@dataclass
class _KernelSamples:
    layout: tuple[tuple[int, int], ...]
    params_bytes: int
    launches: int = 0
    shapes: dict[str, _Shape] = field(default_factory=dict)
    slots: dict[tuple[int, int], dict[str, _Spread]] = field(default_factory=dict)


def _scalar_features(layout: tuple[tuple[int, int], ...]) -> list[tuple[Feature, int]]:
    """Every integer a layout holds, with its buffer offset: u32 and i32 at 4-aligned offsets,
    u64 and i64 at 8-aligned ones, each within one parameter.  Listed in the order ties are
    broken: wider first (an argument read whole: its low half would wrap), unsigned first (a
    negative value read unsigned predicts the whole allocation, not nothing)."""
    out = []
    for size in (8, 4):
        for signed in (False, True):
            for i, (start, psize) in enumerate(layout):
                for off in range((-start) % size, psize - size + 1, size):
                    out.append((Feature("scalar", i, off, size, signed), start + off))
    return out


class _FeatureTable:
    """The features' values in a kernel's launch shapes, read on demand."""

    def __init__(self, ks: _KernelSamples):
        self.shapes = ks.shapes
        self.positions = _scalar_features(ks.layout)
        self.words: dict[str, tuple[int, ...]] = {}
        self.found: dict[tuple[str, ...], list[tuple[Feature, list[int]]]] = {}  # a kernel's slots mostly share keys

    def _words(self, key: str) -> tuple[int, ...]:
        w = self.words.get(key)
        if w is None:
            data = self.shapes[key].data
            data += bytes(-len(data) % 4)
            w = self.words[key] = struct.unpack(f"<{len(data) // 4}I", data)
        return w

    def varying(self, keys: list[str]) -> list[tuple[Feature, list[int]]]:
        """The features present in every one of the keys' shapes and not the same in all, with
        their values (in the order of keys)."""
        found = self.found.get(tuple(keys))
        if found is None:
            found = self.found[tuple(keys)] = self._varying(keys)
        return found

    def _varying(self, keys: list[str]) -> list[tuple[Feature, list[int]]]:
        first = self._words(keys[0])
        differ: set[int] = set()  # indices of the u32 words that are not the same in all shapes
        for k in keys[1:]:
            w = self._words(k)
            if w != first:
                differ.update(i for i, (x, y) in enumerate(zip(first, w)) if x != y)
        out = []
        for feat, at in self.positions:
            if at >> 2 not in differ and (feat.size == 4 or (at >> 2) + 1 not in differ):
                continue
            word = at & ~7
            if any(word in self.shapes[k].not_scalar for k in keys):
                continue
            vals = []
            for k in keys:
                w = self._words(k)
                v = w[at >> 2] if feat.size == 4 else w[at >> 2] | w[(at >> 2) + 1] << 32
                if feat.signed and v >> (feat.size * 8 - 1):
                    v -= 1 << (feat.size * 8)
                vals.append(v)
            if len(set(vals)) > 1:
                out.append((feat, vals))
        for kind in GRID_KINDS:
            vals = [_grid_value(kind, self.shapes[k].grid, self.shapes[k].block) for k in keys]
            if len(set(vals)) > 1:
                out.append((Feature(kind), vals))
        return out


def _fit_line(xs: list[int], spreads: list[_Spread], tolerance: int) -> tuple[int, int, int] | None:
    """(a, b, spread): integer a >= 1 with every observed hi - a * x within `spread` <= tolerance
    of each other, and b the largest of them (so that a * x + b covers every sample)."""
    top: dict[int, int] = {}  # x -> the largest hi at x
    for x, s in zip(xs, spreads):
        top[x] = max(top.get(x, s.hi_max), s.hi_max)
    if len(top) < 3:  # two points fit any line: a rule needs a third to be evidence
        return None
    n, sx, sy = len(top), sum(top), sum(top.values())
    sxx, sxy = sum(x * x for x in top), sum(x * y for x, y in top.items())
    num, den = n * sxy - sx * sy, n * sxx - sx * sx  # least squares, exact in integers
    a = (2 * num + den) // (2 * den)
    if a < 1:
        return None
    intercepts = [h - a * x for x, s in zip(xs, spreads) for h in (s.hi_min, s.hi_max)]
    spread = max(intercepts) - min(intercepts)
    return (a, max(intercepts), spread) if spread <= tolerance else None


def _fit_linear(table: _FeatureTable, keys: list[str], spreads: list[_Spread],
                tolerance: int) -> tuple[Feature, int, int] | None:
    """The feature whose line fits best: the smallest spread (in whole pages, the resolution
    of the measurement), then the smallest intercept (extents are mostly proportional to
    their size argument; a spurious feature seldom is), then the order of _scalar_features
    and GRID_KINDS.  Products of two features are tried only when no single one fits."""
    varying = table.varying(keys)
    best = None
    for rank, (feat, xs) in enumerate(varying):
        fit = _fit_line(xs, spreads, tolerance)
        if fit is not None and (best is None or (fit[2] // PAGE, abs(fit[1]), rank) < best[0]):
            best = ((fit[2] // PAGE, abs(fit[1]), rank), feat, fit[0], fit[1])
    if best is None and len(keys) >= 3:
        pool = varying[:PRODUCT_FEATURES_MAX]
        rank = 0
        for i, (f, fx) in enumerate(pool):
            for g, gx in pool[i + 1:]:
                if (f.kind, f.param, f.offset) == (g.kind, g.param, g.offset):
                    continue  # one integer read signed and unsigned: its square is no product of two
                xs = [x * y for x, y in zip(fx, gx)]
                rank += 1
                if len(set(xs)) < 3:  # two points fit any line: a product needs a third
                    continue
                fit = _fit_line(xs, spreads, tolerance)
                if fit is not None and (best is None or (fit[2] // PAGE, abs(fit[1]), rank) < best[0]):
                    best = ((fit[2] // PAGE, abs(fit[1]), rank), Feature("product", of=(f, g)), fit[0], fit[1])
    return None if best is None else best[1:]


def _fit_slot(slot: tuple[int, int], by_key: dict[str, _Spread], table: _FeatureTable,
              tolerance: int) -> PointerRule:
    samples = sum(s.samples for s in by_key.values())
    hit = {k: s for k, s in by_key.items() if s.touched}
    lo = min((s.lo_min for s in hit.values()), default=0)
    hi = max((s.hi_max for s in hit.values()), default=0)
    lo_steady = max((s.lo_max for s in hit.values()), default=0) - lo <= tolerance
    rule = PointerRule(slot[0], slot[1], "whole", lo, hi, samples)
    # Fixed only where the arguments varied and the extent did not: launches that all had the
    # same arguments say nothing of other arguments (their memo does).
    if len(hit) >= 2 and lo_steady and hi - min((s.hi_min for s in hit.values()), default=0) <= tolerance:
        rule.rule = "fixed"
        return rule
    if lo_steady and len(hit) >= 2:
        fit = _fit_linear(table, list(hit), list(hit.values()), tolerance)
        if fit is not None:
            rule.rule, (rule.feature, rule.a, rule.b) = "linear", fit
            return rule
    if len(by_key) <= MEMO_MAX:
        rule.rule = "recorded"
        rule.memo = {k: (min(s.lo_floor, s.lo_min), max(s.hi_cap, s.hi_max)) if s.touched else (0, 0)
                     for k, s in by_key.items()}
    return rule


@dataclass
class LearnSummary:
    logs: list[str]
    counts: LogCounts
    launches_used: int
    unnamed: int  # measured launches of kernels without a name: nothing to learn them under
    layout_changed: int  # measured launches whose parameter layout differs from their kernel's first launch's
    kernels_by_rule: dict[str, int]  # kernels by their class (KernelModel.rule_class)
    slots_by_rule: dict[str, int]  # pointer slots by rule
    launches_by_rule: dict[str, int]  # launches learnt from, by their kernel's class
    held_out_misses: list[str] = field(default_factory=list)  # kernels whose rules missed on a held-out log: whole

    def to_dict(self) -> dict:
        return asdict(self)


def learn(logs: Sequence[Path], tolerance: int = DEFAULT_TOLERANCE) -> tuple[ExtentModel, LearnSummary]:
    """Fit the extent rules of every named kernel measured in the logs.

    With several logs (recordings of other sizes: sequence lengths, batches), every rule is
    also tried on shapes it was not fitted on: for each log, the rules fitted on the others
    are checked against it, and a kernel whose prediction misses a touched 2 MiB block there
    falls back to whole allocations (held_out_misses names it).  A rule that only holds for
    the shapes it has seen would miss on the next one; under --gpu-memory a miss is memory
    that is not there."""
    model, summary = _fit_logs(logs, tolerance)
    if len(logs) >= 2:
        for i, held_out in enumerate(logs):
            fold, _ = _fit_logs([p for j, p in enumerate(logs) if j != i], tolerance)
            report = check(fold, held_out)
            for kc in report.kernels.values():
                if kc.miss_launches and kc.name in model.kernels and kc.name not in summary.held_out_misses:
                    summary.held_out_misses.append(kc.name)
        for name in summary.held_out_misses:
            for p in model.kernels[name].pointers:
                p.rule, p.feature, p.a, p.b, p.memo = "whole", None, None, None, None
        _count_rules(model, summary)
    return model, summary


def _fit_logs(logs: Sequence[Path], tolerance: int) -> tuple[ExtentModel, LearnSummary]:
    counts = LogCounts()
    kernels: dict[str, _KernelSamples] = {}
    unnamed = layout_changed = 0
    for log in logs:
        before = counts.touched_records
        for launch in read_measured(log, counts):
            att = attribute(launch)
            _count_unattributed(counts, att)
            if launch.kernel is None:
                unnamed += 1
                continue
            ks = kernels.get(launch.kernel)
            if ks is None:
                ks = kernels[launch.kernel] = _KernelSamples(launch.params.layout, len(launch.params.data))
            if launch.params.layout != ks.layout:
                layout_changed += 1
                continue
            ks.launches += 1
            key = memo_key(launch.arg_hash, launch.grid, launch.block)
            if key not in ks.shapes:
                ks.shapes[key] = _Shape(launch.params.data, launch.not_scalar, launch.grid, launch.block)
            for p in launch.pointers:
                if p.alloc_start not in launch.unmeasured:
                    ks.slots.setdefault((p.param, p.offset), {}).setdefault(key, _Spread()).add(att.extents[p.address], p.address)
        _no_touched_records(counts, before, log)
    model = ExtentModel(created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), source=[str(p) for p in logs],
                        tolerance=tolerance, kernels={})
    for name, ks in sorted(kernels.items()):
        table = _FeatureTable(ks)
        model.kernels[name] = KernelModel(ks.params_bytes, ks.launches,
                                          [_fit_slot(slot, by_key, table, tolerance)
                                           for slot, by_key in sorted(ks.slots.items())])
    by_rule = lambda: dict.fromkeys(RULES, 0)  # noqa: E731
    summary = LearnSummary(logs=[str(p) for p in logs], counts=counts,
                           launches_used=sum(k.launches for k in model.kernels.values()), unnamed=unnamed,
                           layout_changed=layout_changed, kernels_by_rule=by_rule(), slots_by_rule=by_rule(),
                           launches_by_rule=by_rule())
    _count_rules(model, summary)
    return model, summary


def _count_rules(model: ExtentModel, summary: LearnSummary) -> None:
    for counted in (summary.kernels_by_rule, summary.launches_by_rule, summary.slots_by_rule):
        counted.update(dict.fromkeys(RULES, 0))
    for km in model.kernels.values():
        summary.kernels_by_rule[km.rule_class] += 1
        summary.launches_by_rule[km.rule_class] += km.launches
        for p in km.pointers:
            summary.slots_by_rule[p.rule] += 1


# -- checking ----------------------------------------------------------------------------


@dataclass
class Miss:
    """Bytes a launch touched in one allocation that a prediction did not name."""

    pid: int
    seq: int
    kernel: str | None
    alloc_start: int
    alloc_size: int
    first_missed: int  # offset in the allocation
    missed_bytes: int
    pointed: bool  # a pointer argument names the allocation (if not, no prediction from arguments can)


@dataclass
class GrainResult:
    """Predictions against touches, both rounded out to units of `grain` bytes
    (address-aligned) and clipped to their allocation."""

    grain: int
    touched_units: int = 0
    touched_bytes: int = 0
    model_units: int = 0
    model_bytes: int = 0
    whole_units: int = 0  # today's prediction: the whole allocations the pointer arguments name
    whole_bytes: int = 0
    model_missed_units: int = 0
    model_missed_bytes: int = 0
    model_miss_launches: int = 0
    whole_missed_units: int = 0
    whole_missed_bytes: int = 0
    whole_miss_launches: int = 0
    model_misses: list[Miss] = field(default_factory=list)  # the first MISSES_LISTED

    @property
    def model_over(self) -> float | None:
        """Bytes predicted by the model per byte touched."""
        return self.model_bytes / self.touched_bytes if self.touched_bytes else None

    @property
    def whole_over(self) -> float | None:
        return self.whole_bytes / self.touched_bytes if self.touched_bytes else None


@dataclass
class KernelCheck:
    """One kernel's launches at the 2 MiB grain."""

    name: str
    rule: str  # its class in the model; "whole" if the model does not know it
    launches: int = 0
    miss_launches: int = 0
    touched_bytes: int = 0
    model_bytes: int = 0
    whole_bytes: int = 0


@dataclass
class CheckReport:
    log: str
    counts: LogCounts
    checked: int = 0  # measured launches compared
    kernels_by_rule: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    # launches by the least specific rule applied to their pointers ("whole" for every fallback:
    # a kernel or slot the model lacks, a memo key it has not seen, an unreadable feature)
    launches_by_rule: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RULES, 0))
    grains: list[GrainResult] = field(default_factory=lambda: [GrainResult(g) for g in GRAINS])
    kernels: dict[str, KernelCheck] = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        for g, gd in zip(self.grains, d["grains"]):
            gd.update(model_over=g.model_over, whole_over=g.whole_over)
        d["kernels"] = sorted(d["kernels"].values(), key=lambda k: (-k["miss_launches"], -k["whole_bytes"], k["name"]))
        d["kernels_by_rule_fraction"] = _fractions(self.kernels_by_rule)
        d["launches_by_rule_fraction"] = _fractions(self.launches_by_rule)
        return d


def _fractions(by_rule: dict[str, int]) -> dict[str, float]:
    total = sum(by_rule.values())
    return {r: n / total if total else 0.0 for r, n in by_rule.items()}


def check(model: ExtentModel, log: Path) -> CheckReport:
    """Apply the model to every measured launch of log and compare with what it touched."""
    report = CheckReport(log=str(log), counts=LogCounts())
    for launch in read_measured(log, report.counts):
        _count_unattributed(report.counts, attribute(launch))
        report.checked += 1
        predicted, worst = [], "fixed"
        for p, rng, rule in _pointer_ranges(model, launch.kernel, launch.params, launch.grid, launch.block,
                                            launch.arg_hash, launch.pointers):
            if rng is not None:
                predicted.append(rng)
            worst = max(worst, rule, key=RULES.index)
        report.launches_by_rule[worst] += 1
        predicted = _merge(predicted)
        name = launch.kernel or "(unnamed)"
        kc = report.kernels.get(name)
        if kc is None:
            km = model.kernels.get(launch.kernel) if launch.kernel is not None else None
            kc = report.kernels[name] = KernelCheck(name, km.rule_class if km is not None else "whole")
            report.kernels_by_rule[kc.rule] += 1
        kc.launches += 1
        _compare(report, kc, launch, predicted)
    _no_touched_records(report.counts, 0, log)
    return report


def _compare(report: CheckReport, kc: KernelCheck, launch: MeasuredLaunch,
             predicted: list[tuple[int, int]]) -> None:
    pointed = {(p.alloc_start, p.alloc_end) for p in launch.pointers if p.alloc_start not in launch.unmeasured}
    for g in report.grains:
        model_missed = whole_missed = False
        for alloc in sorted(pointed | set(launch.touched)):
            start, end = alloc
            touched = _round_clip(launch.touched.get(alloc, []), g.grain, start, end)
            mine = _round_clip(_clip(predicted, start, end), g.grain, start, end)
            whole = [alloc] if alloc in pointed else []
            g.touched_units += _units(touched, g.grain)
            g.touched_bytes += _length(touched)
            g.model_units += _units(mine, g.grain)
            g.model_bytes += _length(mine)
            g.whole_units += _units(whole, g.grain)
            g.whole_bytes += _length(whole)
            lost = _minus(touched, mine)
            if lost:
                model_missed = True
                g.model_missed_units += _units(lost, g.grain)
                g.model_missed_bytes += _length(lost)
                if len(g.model_misses) < MISSES_LISTED:
                    g.model_misses.append(Miss(launch.pid, launch.seq, launch.kernel, start, end - start,
                                               lost[0][0] - start, _length(lost), alloc in pointed))
            lost = _minus(touched, whole)
            if lost:
                whole_missed = True
                g.whole_missed_units += _units(lost, g.grain)
                g.whole_missed_bytes += _length(lost)
            if g.grain == GRAINS[-1]:
                kc.touched_bytes += _length(touched)
                kc.model_bytes += _length(mine)
                kc.whole_bytes += _length(whole)
        g.model_miss_launches += model_missed
        g.whole_miss_launches += whole_missed
        if g.grain == GRAINS[-1]:
            kc.miss_launches += model_missed
