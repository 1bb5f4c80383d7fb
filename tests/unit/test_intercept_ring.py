"""The Python ring reader against the C header: layouts, and the reader protocol.

The layouts are checked by compiling gpuos_ring.h; the protocol by a small writer
written here from the header's description (the real writer, libgpuos, is tested end to
end in test_libgpuos.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpuos.intercept import ring as R
from gpuos.intercept.runner import HELLO, REPLY

from ringwriter import Writer, launch_body

REPO = Path(__file__).resolve().parents[2]
INCLUDE = REPO / "libgpuos" / "include"

LAYOUTS = {  # C struct -> the Python struct that mirrors it (header included for records)
    "gpuos_ring_hdr": R.HDR.size,
    "gpuos_func_ent": R.FUNC_ENT.size,
    "gpuos_rec_hdr": R.REC_HDR.size,
    "gpuos_rec_alloc": R.REC_HDR.size + R.ALLOC_BODY.size,
    "gpuos_rec_object": R.REC_HDR.size + R.OBJECT_BODY.size,
    "gpuos_rec_launch": R.REC_HDR.size + R.LAUNCH_BODY.size,
    "gpuos_rec_buf": R.BUF.size,
    "gpuos_rec_copy": R.REC_HDR.size + R.COPY_BODY.size,
    "gpuos_rec_graph": R.REC_HDR.size + R.GRAPH_BODY.size,
    "gpuos_rec_validate": R.REC_HDR.size + R.VALIDATE_BODY.size,
    "gpuos_rec_miss": R.MISS.size,
    "gpuos_rec_status": R.REC_HDR.size + R.STATUS_BODY.size,
    "gpuos_rec_params": R.REC_HDR.size + R.PARAMS_BODY.size,
    "gpuos_rec_param": R.PARAM.size,
    "gpuos_ctl_hello": HELLO.size,
    "gpuos_ctl_reply": REPLY.size,
}
OFFSETS = {  # fields whose offsets the reader relies on directly
    ("gpuos_ring_hdr", "head"): 32,
    ("gpuos_ring_hdr", "reason"): 56,
    ("gpuos_ring_hdr", "strtab_off"): 328,
    ("gpuos_ring_hdr", "n_launches"): 368,
    ("gpuos_ring_hdr", "n_misses"): 440,
    ("gpuos_ring_hdr", "ops_paused"): 448,
    ("gpuos_ring_hdr", "memory_mode"): 456,
    ("gpuos_ring_hdr", "movable_bytes"): 464,
    ("gpuos_ring_hdr", "n_movable_fallbacks"): 472,
    ("gpuos_rec_launch", "nbuf"): 96,
}


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory) -> dict:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("layout")
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "gpuos_ring.h"',
             '#include "gpuos_ctl.h"', "int main(void) {"]
    for name in LAYOUTS:
        lines.append(f'printf("{name} %zu\\n", sizeof(struct {name}));')
    for (name, fld) in OFFSETS:
        lines.append(f'printf("{name}.{fld} %zu\\n", offsetof(struct {name}, {fld}));')
    lines += ['printf("magic %llu\\n", (unsigned long long)GPUOS_RING_MAGIC);',
              'printf("chunk %d\\n", GPUOS_VALIDATE_CHUNK);', "return 0; }"]
    (d / "l.c").write_text("\n".join(lines))
    subprocess.run([cc, "-Wall", "-Werror", f"-I{INCLUDE}", "-o", str(d / "l"), str(d / "l.c")],
                   check=True)
    out = subprocess.run([str(d / "l")], check=True, capture_output=True, text=True).stdout
    return dict((k, int(v)) for k, v in (line.split() for line in out.splitlines()))


def test_struct_sizes_match_the_header(c_layout):
    for name, size in LAYOUTS.items():
        assert c_layout[name] == size, name


def test_field_offsets_and_constants_match_the_header(c_layout):
    for (name, fld), off in OFFSETS.items():
        assert c_layout[f"{name}.{fld}"] == off, f"{name}.{fld}"
    assert c_layout["magic"] == R.MAGIC
    assert c_layout["chunk"] == R.CHUNK


@pytest.fixture(autouse=True)
def close_writers(monkeypatch):
    made = []
    real_init = Writer.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append(self)
    monkeypatch.setattr(Writer, "__init__", init)
    yield
    for w in made:
        w.close()


def records(reader: R.RingReader) -> list[dict]:
    return [R.decode(*r) for r in reader.poll()]


def test_reader_decodes_records_and_functions():
    w = Writer()
    fid = w.function(0xF00, "saxpy_kernel", 4)
    w.record(R.LAUNCH, launch_body(1, fid, [(0x1000, 4096, 0x1010), (0x9000, 256, 0x9000)]))
    w.record(R.ALLOC, R.ALLOC_BODY.pack(0x1000, 4096, 0x20, 0, 0, 1, 0))
    ring = R.Ring(w.fd)
    recs = records(R.RingReader(ring))
    assert [r["type"] for r in recs] == ["launch", "alloc"]
    launch = recs[0]
    assert launch["grid"] == [4, 1, 1] and launch["block"] == [128, 1, 1]
    assert [(b["base"], b["ptr"], b["param"]) for b in launch["bufs"]] == [
        (0x1000, 0x1010, 0), (0x9000, 0x9000, 1)]
    assert ring.function(fid).name == "saxpy_kernel"
    assert ring.function(fid + 1) is None  # not published
    assert recs[1]["kind"] == "device"
    assert ring.header().counters["launches"] == 0 and ring.header().tracking


def test_reader_skips_pads_at_the_wrap_and_reads_multislot_records():
    w = Writer(nslots=16)
    reader = R.RingReader(R.Ring(w.fd))
    seen = []
    for seq in range(40):  # 3 slots each: pads where 3 do not fit before the end
        w.record(R.LAUNCH, launch_body(seq, 0, [(0x1000, 64, 0x1000)]))
        seen += records(reader)
    assert [r["seq"] for r in seen] == list(range(40))
    assert reader.stats.skipped_slots == 0 and reader.stats.torn == 0


def test_reader_lapped_by_the_writer_resumes_at_a_record_start():
    w = Writer(nslots=16)
    reader = R.RingReader(R.Ring(w.fd))
    for seq in range(30):
        w.record(R.LAUNCH, launch_body(seq, 0, [(0x1000, 64, 0x1000)]))
    seqs = [r["seq"] for r in records(reader)]
    assert seqs and seqs == list(range(seqs[0], 30))  # the newest, in order, no garbage
    assert seqs[0] > 0 and reader.stats.skipped_slots > 0


def test_reader_waits_for_an_uncommitted_record():
    w = Writer()
    reader = R.RingReader(R.Ring(w.fd))
    n = w.record(R.LAUNCH, launch_body(1, 0, []), commit=False)
    w.record(R.LAUNCH, launch_body(2, 0, []))
    assert records(reader) == []  # the first is claimed but not committed: wait
    w.commit_later(n)
    assert [r["seq"] for r in records(reader)] == [1, 2]


def test_reader_skips_a_writer_that_died_mid_record(monkeypatch):
    w = Writer()
    reader = R.RingReader(R.Ring(w.fd))
    monkeypatch.setattr(R.RingReader, "STALL_S", 0.0)
    w.record(R.LAUNCH, launch_body(1, 0, []), commit=False)
    w.record(R.LAUNCH, launch_body(2, 0, []))
    assert records(reader) == []       # first look: it may still be written
    assert [r["seq"] for r in records(reader)] == [2]


def test_ring_refuses_other_files():
    fd = os.memfd_create("x")
    os.ftruncate(fd, 8192)
    with pytest.raises(R.RingError):
        R.Ring(fd)
    os.close(fd)


def test_validate_and_status_records_decode():
    w = Writer()
    body = R.VALIDATE_BODY.pack(5, 8192, 4096, 0, 4096, 1 << 20, 3, 1, 0, R.LAUNCH)
    body += R.MISS.pack(0x2000, 8192, 0x3000, 4096)
    w.record(R.VALIDATE, body)
    w.record(R.STATUS, R.STATUS_BODY.pack(R.TRACK_OFF, 12, b"out of memory for the map"))
    v, s = records(R.RingReader(R.Ring(w.fd)))
    assert v["op"] == "launch" and v["func"] == 3 and not v["skipped"]
    assert v["misses"] == [{"base": 0x2000, "size": 8192, "first": 0x3000, "len": 4096}]
    assert s == {"type": "status", "ts_ns": 123, "tid": 7, "state": "off", "err": 12,
                 "reason": "out of memory for the map"}


def test_open_proc_ring_fd_finds_the_memfd():
    w = Writer()
    fd = R.open_proc_ring_fd(os.getpid())
    try:
        assert os.fstat(fd).st_ino == os.fstat(w.fd).st_ino
    finally:
        os.close(fd)
    with pytest.raises(LookupError):
        R.open_proc_ring_fd(os.getppid() if os.getppid() > 1 else 1)
