"""GPU fault detection without a GPU: Xid lines, /dev/kmsg records, NVML (a fake), the join,
the journal, and `gpuos faults watch|log` end to end (fed a file through --file).

The Xid lines are the shapes the driver prints (kernel_rc.c: "NVRM: Xid (PCI:%04x:%02x:%02x):
%d, pid=%s, name=%s, %s"), taken from real logs: the Xid 31 line is the one the H200 printed
(/work/shared/notes/gpu-machine.md).
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import queue
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from gpuos.cli import faults as faults_cli
from gpuos.cli.main import cli
from gpuos.config import Paths
from gpuos.faults import kmsg as K
from gpuos.faults.join import Joiner
from gpuos.faults.journal import FaultJournal
from gpuos.faults.model import FaultClass, FaultEvent, MmuFault
from gpuos.faults.nvml import (DOUBLE_BIT_ECC, FAULT_EVENT_TYPES, GPU_RECOVERY_ACTION, NvmlSource,
                               NvmlUnavailable, XID_CRITICAL_ERROR)
from gpuos.faults.watch import FaultStream
from gpuos.faults.xid import (ACT_COPY, ACT_MEMORY, ACT_MEMORY_NONREPLAYABLE, ACT_UNKNOWN, XID_TABLE,
                              lookup, markdown_table)

from helpers import gpuos, gpuos_env

DOCS = Path(__file__).resolve().parents[2] / "docs" / "faults.md"

# -- real lines -----------------------------------------------------------------------

XID31 = ("NVRM: Xid (PCI:0000:00:06): 31, pid=574, name=python3, channel 0x0000000f, intr 00000000. "
         "MMU Fault: ENGINE GRAPHICS GPC1 GPCCLIENT_T1_11 faulted @ 0x834e_8be00000. "
         "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE")
XID13_WARP = ("NVRM: Xid (PCI:0000:2a:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp "
              "Exception on (GPC 0, TPC 1, SM 0): Illegal Instruction Encoding")
XID13_WARP2 = ("NVRM: Xid (PCI:0000:2a:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp "
               "Exception on (GPC 0, TPC 1, SM 1): Illegal Instruction Encoding")
XID13_GLOBAL = ("NVRM: Xid (PCI:0000:2a:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Global "
                "Exception on (GPC 0, TPC 1, SM 0): Multiple Warp Errors")
XID13_ESR = ("NVRM: Xid (PCI:0000:2a:00): 13, pid='<unknown>', name=<unknown>, Graphics Exception: "
             "ESR 0x504648=0x1000e 0x504650=0x20 0x504644=0xd3eff2 0x50464c=0x17f")
XID43 = "NVRM: Xid (PCI:0000:2a:00): 43, pid=1238258, name=ray::_RayTrainW, channel 0x00000002"
XID45 = "NVRM: Xid (PCI:0000:01:00): 45, pid=2171, name=xdg-desktop-por, channel 0x0000000a"
XID43_OLD = "NVRM: Xid (PCI:0000:01:00): 43, Ch 00000010"
XID48 = ("NVRM: Xid (PCI:0000:04:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double "
         "bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.")
XID63 = ("NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, "
         "reset gpu to activate.")
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID79_NOPID = "NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus."
XID119 = ("NVRM: Xid (PCI:0000:17:00): 119, pid=1582259, name=nvc:[driver], Timeout after 6s of "
          "waiting for RPC response from GPU1 GSP! Expected function 76 (GSP_RM_CONTROL) "
          "(0x20802a02 0x8).")
XID154 = ("NVRM: Xid (PCI:0000:01:00): 154, pid='<unknown>', name=<unknown>, GPU recovery action "
          "changed from 0x0 (None) to 0x1 (GPU Reset Required)")
XID31_HUB = ("NVRM: Xid (PCI:0000:08:00): 31, Ch 0000003b, intr 10000000. MMU Fault: ENGINE GRAPHICS "
             "HUBCLIENT_SCC faulted @ 0x0_04687000. Fault is of type FAULT_PDE ACCESS_TYPE_READ")
XID31_CE = ("NVRM: Xid (PCI:0000:81:00): 31, pid='<unknown>', name=<unknown>, Ch 00000016, intr "
            "10000000. MMU Fault: ENGINE CE0 HUBCLIENT_HSCE0 faulted @ 0x0_00000000. Fault is of "
            "type FAULT_PDE ACCESS_TYPE_READ")
XID69 = ("NVRM: Xid (PCI:0000:08:00): 69, Class Error: ChId 003b, Class 0000c197, Offset 00002040, "
         "Data 00004b30, ErrorCode 0000000c")
XID62 = "NVRM: Xid (PCI:0000:01:00): 62, 322bff9a 0000b3b8 00000000 206a4b08 206a3cc8 206a3e36"
XID_MIG = ("NVRM: Xid (PCI:0000:00:06 GPU-I:02 GPU-CI:01): 31, pid=574, name=python3, channel "
           "0x00000010, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC0 GPCCLIENT_T1_0 faulted @ "
           "0x7f5a_e7504000. Fault is of type FAULT_PTE ACCESS_TYPE_VIRT_READ")
XID_UNKNOWN = "NVRM: Xid (PCI:0000:00:06): 999, pid='<unknown>', name=<unknown>, Something new"


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def kmsg(seq: int, message: str, usec: int | None = None, prio: int = 3) -> str:
    return f"{prio},{seq},{usec if usec is not None else seq * 1000},-;{message}"


def assembled(lines: list[str], clock: FakeClock | None = None, **kw) -> list[FaultEvent]:
    """Feed /dev/kmsg records (seq 1, 2, ...) and drain."""
    asm = K.XidAssembler(boot_time=1_700_000_000.0, clock=clock or FakeClock(), **kw)
    out: list[FaultEvent] = []
    for i, line in enumerate(lines, 1):
        out += asm.feed(K.parse_line(kmsg(i, line)))
    return out + asm.drain()


def one(line: str) -> FaultEvent:
    (ev,) = assembled([line])
    return ev


# -- parsing --------------------------------------------------------------------------


def test_the_h200_line():
    ev = one(XID31)
    assert (ev.xid, ev.pci, ev.pid, ev.process, ev.channel) == (31, "0000:00:06", 574, "python3", 0xF)
    assert ev.mmu == MmuFault(engine="GRAPHICS GPC1 GPCCLIENT_T1_11", address=0x834E8BE00000,
                              fault_type="FAULT_PDE", access_type="ACCESS_TYPE_VIRT_WRITE")
    assert ev.fault_class is FaultClass.MEMORY and ev.action == ACT_MEMORY
    assert ev.name == "GPU memory page fault" and ev.source == "kmsg" and ev.seq == 1
    assert ev.extra == {"lines": 1, "intr": "00000000", "channels": [0xF]}
    assert ev.text == XID31
    assert ev.time == pytest.approx(1_700_000_000.0 + 1000 / 1e6)


@pytest.mark.parametrize("line, xid, cls, pid, process", [
    (XID13_WARP, 13, FaultClass.SM, None, None),
    (XID43, 43, FaultClass.CHANNEL, 1238258, "ray::_RayTrainW"),
    (XID43_OLD, 43, FaultClass.CHANNEL, None, None),
    (XID45, 45, FaultClass.INFO, 2171, "xdg-desktop-por"),
    (XID48, 48, FaultClass.DEVICE, None, None),
    (XID63, 63, FaultClass.INFO, 1896, None),
    (XID79, 79, FaultClass.DEVICE, None, None),
    (XID79_NOPID, 79, FaultClass.DEVICE, None, None),
    (XID119, 119, FaultClass.DEVICE, 1582259, "nvc:[driver]"),
    (XID69, 69, FaultClass.SM, None, None),
    (XID62, 62, FaultClass.DEVICE, None, None),
    (XID154, 154, FaultClass.DEVICE, None, None),
])
def test_classes_of_real_lines(line, xid, cls, pid, process):
    ev = one(line)
    assert (ev.xid, ev.fault_class, ev.pid, ev.process) == (xid, cls, pid, process)
    assert ev.action == lookup(xid).action or xid == 154
    assert ev.name == XID_TABLE[xid].name


def test_details_of_lines():
    assert one(XID43).channel == 2 and one(XID43_OLD).channel == 0x10 and one(XID69).channel == 0x3B
    assert one(XID63).text.endswith("reset gpu to activate.")
    ev = one(XID154)
    assert ev.extra["recovery_action"] == "GPU Reset Required"
    assert ev.extra["recovery_action_from"] == "None"
    back = one(XID154.replace("0x0 (None) to 0x1 (GPU Reset Required)",
                              "0x1 (GPU Reset Required) to 0x0 (None)"))
    assert back.fault_class is FaultClass.INFO
    mig = one(XID_MIG)
    assert (mig.extra["gpu_instance"], mig.extra["compute_instance"], mig.pci) == (2, 1, "0000:00:06")
    assert mig.mmu.address == 0x7F5AE7504000 and mig.mmu.fault_type == "FAULT_PTE"


def test_copy_engine_and_non_replayable_mmu_faults():
    ce = one(XID31_CE)
    assert ce.fault_class is FaultClass.COPY and ce.action == ACT_COPY
    assert ce.mmu.engine == "CE0 HUBCLIENT_HSCE0" and ce.mmu.address == 0
    hub = one(XID31_HUB)
    assert hub.fault_class is FaultClass.MEMORY and hub.action == ACT_MEMORY_NONREPLAYABLE
    assert hub.channel == 0x3B and hub.mmu.address == 0x04687000 and hub.pid is None


def test_unknown_xids_are_kept():
    ev = one(XID_UNKNOWN)
    assert (ev.xid, ev.fault_class, ev.action) == (999, FaultClass.UNKNOWN, ACT_UNKNOWN)
    assert ev.text.endswith("Something new")
    old = one("NVRM: Xid (0000:03:00): 14, Channel 00000001")  # an older driver's shape
    assert (old.xid, old.pci, old.channel, old.fault_class) == (14, "0000:03:00", 1, FaultClass.UNKNOWN)


def test_kmsg_record_format():
    raw = (b"3,4711,123456789,-;" + XID31.encode() +
           b"\n SUBSYSTEM=pci\n DEVICE=+pci:0000:00:06.0\n")
    rec = K.parse_kmsg_record(raw)
    assert (rec.seq, rec.usec, rec.level) == (4711, 123456789, 3)
    assert rec.message == XID31
    assert rec.fields == {"SUBSYSTEM": "pci", "DEVICE": "+pci:0000:00:06.0"}
    # facility in the prio, extra header fields, escaped bytes
    rec = K.parse_kmsg_record("30,5,6,c,more;tab\\x09and\\x5cbackslash")
    assert (rec.level, rec.seq, rec.message) == (6, 5, "tab\tand\\backslash")
    assert K.parse_kmsg_record("not a record") is None


@pytest.mark.parametrize("text, usec, level", [
    ("[  123.456789] " + XID79, 123456789, None),             # dmesg
    ("<4>[   12.5] " + XID79, 12500000, 4),                    # dmesg -r
    ("Nov 21 10:00:00 h200 kernel: " + XID79, None, None),     # journalctl -k
    (XID79, None, None),
])
def test_text_lines(text, usec, level):
    rec = K.parse_line(text)
    assert (rec.usec, rec.level, rec.seq) == (usec, level, None)
    assert K.parse_xid(rec.message).xid == 79


def test_normalize_pci():
    assert K.normalize_pci("00000000:3B:00.0") == "0000:3b:00"
    assert K.normalize_pci("0000:3b:00") == "0000:3b:00"


# -- continuation lines ---------------------------------------------------------------


def test_continuation_lines_enrich_one_event():
    evs = assembled([XID13_WARP, XID13_WARP2, XID13_GLOBAL, XID13_ESR, XID43])
    assert [e.xid for e in evs] == [13, 43]
    ev = evs[0]
    assert ev.extra["lines"] == 4 and ev.text.count("\n") == 3 and ev.seq == 1
    assert [(e["kind"], e["sm"], e["error"]) for e in ev.extra["sm_errors"]] == [
        ("warp", 0, "Illegal Instruction Encoding"), ("warp", 1, "Illegal Instruction Encoding"),
        ("global", 0, "Multiple Warp Errors")]
    assert ev.extra["esr"].startswith("0x504648=0x1000e")
    assert evs[1].pid == 1238258  # another Xid: an event of its own


def test_continuation_of_channels_and_pid():
    lines = [XID45.replace("0000000a", c) for c in ("00000006", "00000007", "00000008")]
    (ev,) = assembled(lines)
    assert ev.extra["channels"] == [6, 7, 8] and ev.channel == 6 and ev.extra["lines"] == 3
    # a pid that only a later line names is filled in
    (ev,) = assembled([XID13_WARP, XID13_ESR.replace("pid='<unknown>', name=<unknown>",
                                                     "pid=42, name=python3")])
    assert (ev.pid, ev.process) == (42, "python3")


def test_what_is_not_a_continuation():
    # two processes' faults; two MMU faults of one process; another GPU; far apart in seq
    assert len(assembled([XID31, XID31.replace("pid=574", "pid=575")])) == 2
    assert len(assembled([XID31, XID31])) == 2
    assert len(assembled([XID13_WARP, XID13_WARP.replace("0000:2a:00", "0000:2b:00")])) == 2
    asm = K.XidAssembler(boot_time=0.0, clock=FakeClock())
    out = asm.feed(K.parse_line(kmsg(1, XID13_WARP)))
    out += asm.feed(K.parse_line(kmsg(100, XID13_ESR)))
    assert len(out + asm.drain()) == 2
    # same seq neighbourhood, but seconds apart in the kernel's time
    asm = K.XidAssembler(boot_time=0.0, clock=FakeClock())
    out = asm.feed(K.parse_line(kmsg(1, XID13_WARP, usec=1_000_000)))
    out += asm.feed(K.parse_line(kmsg(2, XID13_ESR, usec=5_000_000)))
    assert len(out + asm.drain()) == 2


def test_events_settle_on_the_clock():
    clock = FakeClock()
    asm = K.XidAssembler(boot_time=0.0, clock=clock, settle=0.25, max_open=2.0)
    assert asm.feed(K.parse_line(kmsg(1, XID13_WARP))) == []
    clock.advance(0.1)
    assert asm.feed(K.parse_line(kmsg(2, XID13_ESR))) == []
    clock.advance(0.2)
    assert asm.flush() == []          # 0.2 s since the last line
    clock.advance(0.1)
    (ev,) = asm.flush()
    assert ev.extra["lines"] == 2 and asm.pending == 0
    # a flood keeps an event open at most max_open seconds
    out = []
    for i in range(30):
        out += asm.feed(K.parse_line(kmsg(10 + i, XID13_WARP)))
        out += asm.flush()
        clock.advance(0.1)
    out += asm.drain()
    assert sum(e.extra["lines"] for e in out) == 30 and len(out) >= 2
    assert all(e.extra["lines"] <= 21 for e in out)


def test_text_lines_without_seq_are_assembled_by_time():
    clock = FakeClock()
    asm = K.XidAssembler(boot_time=100.0, clock=clock)
    for line in ("[   50.000001] " + XID13_WARP, "[   50.000002] " + XID13_ESR,
                 "[   50.000003] some other driver line", "[   51.5] " + XID79):
        assert asm.feed(K.parse_line(line)) == []
    evs = asm.drain()
    assert [(e.xid, e.extra["lines"], e.seq) for e in evs] == [(13, 2, None), (79, 1, None)]
    assert evs[0].time == pytest.approx(150.000001)


# -- readers --------------------------------------------------------------------------


def test_kmsg_reader_on_a_file(tmp_path):
    f = tmp_path / "kmsg"
    f.write_text(kmsg(1, "usb 1-1: new device", prio=6) + "\n" + kmsg(2, XID31) +
                 "\n SUBSYSTEM=pci\n DEVICE=+pci:0000:00:06.0\n" + "[ 3.0] " + XID79 + "\n" +
                 " indented text\n" + kmsg(3, XID43))  # no newline at the end
    r = K.KmsgReader(str(f), from_start=True)
    recs = r.read()
    assert r.exhausted and r.fileno() >= 0
    assert [rec.seq for rec in recs] == [1, 2, None, None, 3]
    assert recs[1].fields["SUBSYSTEM"] == "pci" and recs[1].message == XID31
    assert recs[3].message == " indented text"
    r.close()
    r = K.KmsgReader(str(f))  # from now on: nothing of what is there
    assert r.read() == [] and r.exhausted
    r.close()


def test_kmsg_reader_reports_gaps(tmp_path):
    """/dev/kmsg answers EPIPE when the kernel overwrote records the reader had not read."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    r = K.KmsgReader(str(fifo), from_start=True)
    assert not r.is_file
    script = [kmsg(10, "a").encode(), kmsg(11, XID31).encode(), BrokenPipeError(),
              kmsg(15, XID79).encode(), BlockingIOError(), kmsg(16, "b").encode(),
              kmsg(20, "c").encode(), BlockingIOError()]

    def fake_read(fd, n):
        item = script.pop(0)
        if isinstance(item, Exception):
            raise item
        return item
    r._read = fake_read
    first = r.read()
    assert [getattr(x, "seq", None) for x in first] == [10, 11, None, 15]
    gap = first[2]
    assert isinstance(gap, K.KmsgGap) and (gap.first, gap.last, gap.count) == (12, 14, 3)
    assert "missed 3 records (seq 12..14" in gap.describe()
    second = r.read()  # a jump without EPIPE is a gap too
    assert [type(x).__name__ for x in second] == ["LogRecord", "KmsgGap", "LogRecord"]
    assert (second[1].first, second[1].last) == (17, 19)
    r.close()
    # overflow before anything was read: the extent is unknown
    r2 = K.KmsgReader(str(fifo), from_start=True)
    script[:] = [BrokenPipeError(), kmsg(50, "x").encode(), BlockingIOError()]
    r2._read = fake_read
    gap, rec = r2.read()
    assert (gap.first, gap.last, gap.count, rec.seq) == (None, 49, None, 50)
    assert "records were lost" in gap.describe()
    r2.close()


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="/dev/kmsg not readable here")
def test_kmsg_reader_on_this_kernel():
    r = K.KmsgReader(from_start=True)
    try:
        recs = [x for x in r.read() if isinstance(x, K.LogRecord)]
    finally:
        r.close()
    assert not r.exhausted
    assert recs and all(rec.seq is not None and rec.usec is not None for rec in recs)
    assert [rec.seq for rec in recs] == sorted(rec.seq for rec in recs)


def test_dmesg_poller():
    clock = FakeClock()
    outputs = ["<6>[    1.000000] boot\n<4>[    2.000000] " + XID13_WARP + "\n",
               "<6>[    1.000000] boot\n<4>[    2.000000] " + XID13_WARP + "\n<4>[    2.000000] "
               + XID13_ESR + "\n<4>[    3.000000] " + XID79 + "\n"]
    calls = []

    def run():
        calls.append(1)
        return outputs[min(len(calls) - 1, 1)]
    p = K.DmesgPoller(interval=1.0, run=run, clock=clock)
    assert p.fileno() is None and p.read() == []   # from now on; the interval has not passed
    clock.advance(1.0)
    new = p.read()
    assert [r.message for r in new] == [XID13_ESR, XID79]   # same stamp as a seen line, and later
    clock.advance(1.0)
    assert p.read() == []
    p2 = K.DmesgPoller(from_start=True, run=lambda: outputs[0], clock=clock)
    assert [r.usec for r in p2.read()] == [1_000_000, 2_000_000]


def test_open_kernel_log_falls_back_and_explains(tmp_path):
    def denied(path, from_start=False):
        raise PermissionError(1, "Operation not permitted")

    def dmesg_denied():
        raise PermissionError("dmesg: read kernel buffer failed: Operation not permitted")
    with pytest.raises(K.KernelLogUnavailable) as exc:
        K.open_kernel_log(opener=denied, dmesg=dmesg_denied)
    assert exc.value.permission and "CAP_SYSLOG" in exc.value.message
    assert "/dev/kmsg: Operation not permitted" in exc.value.message

    def missing(path, from_start=False):
        raise FileNotFoundError(2, "No such file or directory")
    src = K.open_kernel_log(opener=missing, dmesg=lambda: "<6>[ 1.0] x\n")
    assert isinstance(src, K.DmesgPoller)
    with pytest.raises(K.KernelLogUnavailable) as exc:
        K.open_kernel_log(path=str(tmp_path / "none"))
    assert not exc.value.permission


# -- the table ------------------------------------------------------------------------


def test_table_covers_the_common_xids():
    for xid in (13, 31, 32, 38, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109, 119,
                120, 121, 140, 143, 154):
        assert xid in XID_TABLE, xid
    expect = {13: "sm", 31: "memory", 43: "channel", 45: "info", 48: "device", 62: "device",
              69: "sm", 79: "device", 92: "info", 94: "device", 95: "device", 119: "device",
              120: "device"}
    assert {x: XID_TABLE[x].fault_class.value for x in expect} == expect
    assert lookup(12345).fault_class is FaultClass.UNKNOWN
    for xid, info in XID_TABLE.items():
        assert info.name and info.meaning and info.action and info.mnemonic, xid
        assert "|" not in info.meaning + info.action + info.name


def test_docs_table_is_the_code_table():
    text = DOCS.read_text()
    start, end = text.index("<!-- xid-table -->\n"), text.index("<!-- /xid-table -->")
    assert text[start + len("<!-- xid-table -->\n"):end].strip() == markdown_table(), \
        "docs/faults.md's table differs from xid.py: regenerate it with markdown_table()"


def test_event_json_round_trip():
    ev = one(XID31)
    data = json.loads(json.dumps(ev.to_json()))
    assert data["fault_class"] == "memory" and data["mmu"]["address"] == 0x834E8BE00000
    assert FaultEvent.from_json({"type": "fault", **data}) == ev
    assert FaultEvent.from_json({**data, "fault_class": "new-class"}).fault_class is FaultClass.UNKNOWN


# -- NVML (a fake pynvml) -------------------------------------------------------------


class FakeNvml:
    NVML_ERROR_TIMEOUT = 10

    class NVMLError(Exception):
        def __init__(self, value):
            super().__init__(f"NVML error {value}")
            self.value = value

    def __init__(self, gpus=(("GPU-aaaa", "00000000:00:06.0", FAULT_EVENT_TYPES | 0x4),),
                 init_error: str | None = None):
        self.gpus = [(u, p, ctypes.c_void_p(0x1000 + i), m) for i, (u, p, m) in enumerate(gpus)]
        self.init_error = init_error
        self.events: queue.Queue = queue.Queue()
        self.registered: list[tuple[str, int]] = []
        self.freed = self.shut = False

    def nvmlInit(self):
        if self.init_error:
            raise self.NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i][2]

    def _gpu(self, h):
        return next(g for g in self.gpus if g[2].value == h.value)

    def nvmlDeviceGetUUID(self, h):
        return self._gpu(h)[0]

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self._gpu(h)[1].encode())

    def nvmlDeviceGetSupportedEventTypes(self, h):
        return self._gpu(h)[3]

    def nvmlEventSetCreate(self):
        return "set"

    def nvmlDeviceRegisterEvents(self, h, mask, s):
        assert s == "set"
        self.registered.append((self._gpu(h)[0], mask))

    def nvmlEventSetWait_v2(self, s, ms):
        try:
            return self.events.get(timeout=ms / 1000)
        except queue.Empty:
            raise self.NVMLError(self.NVML_ERROR_TIMEOUT) from None

    def nvmlEventSetFree(self, s):
        self.freed = True

    def post(self, gpu: int, etype: int, data: int, gi: int = 0xFFFFFFFF):
        self.events.put(SimpleNamespace(device=ctypes.c_void_p(0x1000 + gpu), eventType=etype,
                                        eventData=data, gpuInstanceId=gi,
                                        computeInstanceId=0xFFFFFFFF))


def test_nvml_source_registers_and_converts():
    nv = FakeNvml(gpus=(("GPU-aaaa", "00000000:00:06.0", FAULT_EVENT_TYPES | 0x4 | 0x10),
                        ("GPU-bbbb", "00000000:3B:00.0", XID_CRITICAL_ERROR)))
    src = NvmlSource(nvml=nv, wait_ms=10, wall=lambda: 5.0)
    assert nv.registered == [("GPU-aaaa", FAULT_EVENT_TYPES), ("GPU-bbbb", XID_CRITICAL_ERROR)]
    assert src.pci_to_uuid == {"0000:00:06": "GPU-aaaa", "0000:3b:00": "GPU-bbbb"}
    assert src.wait_one() is None
    nv.post(1, XID_CRITICAL_ERROR, 79)
    ev = src.wait_one()
    assert (ev.xid, ev.pci, ev.gpu_uuid, ev.source, ev.fault_class, ev.pid, ev.time) == \
        (79, "0000:3b:00", "GPU-bbbb", "nvml", FaultClass.DEVICE, None, 5.0)
    nv.post(0, XID_CRITICAL_ERROR, 4242, gi=3)
    ev = src.wait_one()
    assert ev.fault_class is FaultClass.UNKNOWN and ev.extra["gpu_instance"] == 3
    nv.post(0, DOUBLE_BIT_ECC, 0)
    ev = src.wait_one()
    assert ev.xid is None and ev.name == "double-bit ECC error" and ev.fault_class is FaultClass.DEVICE
    nv.post(0, GPU_RECOVERY_ACTION, 0)
    ev = src.wait_one()
    assert ev.extra["recovery_action"] == "None" and ev.fault_class is FaultClass.INFO
    src.stop()
    assert nv.freed and nv.shut


def test_nvml_unavailable():
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        NvmlSource(nvml=FakeNvml(init_error="Driver Not Loaded"))
    with pytest.raises(NvmlUnavailable, match="no GPU offers"):
        NvmlSource(nvml=FakeNvml(gpus=(("GPU-a", "0000:00:06.0", 0x4),)))
    with pytest.raises(NvmlUnavailable, match="no GPU"):
        NvmlSource(nvml=FakeNvml(gpus=()))


def test_nvml_thread_stops_on_error_and_says_so():
    nv = FakeNvml()
    src = NvmlSource(nvml=nv, wait_ms=10)
    nv.events.put(SimpleNamespace(device=None, eventType=None, eventData=None))  # breaks to_event
    got = []
    src.start(got.append)
    deadline = time.monotonic() + 5
    while src.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not src.running and "NVML event wait failed" in src.error and got == []
    src.stop()


# -- the join -------------------------------------------------------------------------


def nvml_event(xid: int | None, pci: str = "0000:00:06", uuid: str = "GPU-aaaa") -> FaultEvent:
    return FaultEvent(xid=xid, pci=pci, time=1.0, source="nvml", fault_class=FaultClass.UNKNOWN,
                      action="", gpu_uuid=uuid, text="NVML")


def test_join_same_gpu_same_xid_within_the_window():
    clock = FakeClock()
    j = Joiner(window=2.0, clock=clock, pci_to_uuid={"00000000:00:06.0": "GPU-aaaa"})
    assert j.add(nvml_event(31)) == [] and j.pending == 1
    clock.advance(0.3)
    (ev,) = j.add(one(XID31))          # the kernel line comes after NVML's event
    assert ev.source == "kmsg+nvml" and ev.gpu_uuid == "GPU-aaaa" and ev.pid == 574
    assert ev.extra["nvml_events"] == 1 and j.pending == 0
    # the other order: the kernel line goes out at once, NVML's later report is absorbed
    kev = one(XID31)
    assert j.add(kev) == [kev] and kev.source == "kmsg" and kev.gpu_uuid == "GPU-aaaa"
    clock.advance(1.9)
    assert j.add(nvml_event(31)) == [] and j.pending == 0
    clock.advance(5)
    assert j.flush() == [] and j.drain() == []


def test_join_leaves_unmatched_events_alone_after_the_window():
    clock = FakeClock()
    j = Joiner(window=2.0, clock=clock, pci_to_uuid={"0000:00:06": "GPU-aaaa"})
    kev = one(XID31)
    assert j.add(kev) == [kev] and kev.gpu_uuid == "GPU-aaaa"  # the UUID from NVML's device list
    assert j.add(nvml_event(13)) == []                                 # another Xid
    assert j.add(nvml_event(31, pci="0000:3b:00", uuid="GPU-bbbb")) == []  # another GPU
    clock.advance(2.0)
    assert j.flush() == []
    clock.advance(0.01)
    out = j.flush()
    assert [(e.source, e.xid, e.pci) for e in out] == [("nvml", 13, "0000:00:06"), ("nvml", 31, "0000:3b:00")]
    # too late to be absorbed: NVML's report is an event of its own
    j.add(one(XID31))
    clock.advance(2.5)
    assert j.add(nvml_event(31)) == []
    assert [e.source for e in j.drain()] == ["nvml"]


def test_join_takes_one_nvml_event_per_line():
    clock = FakeClock()
    j = Joiner(window=2.0, clock=clock)
    (k,) = assembled([XID13_WARP, XID13_GLOBAL, XID13_ESR])
    assert k.extra["lines"] == 3
    for _ in range(2):
        assert j.add(nvml_event(13, pci="0000:2a:00")) == []
    assert j.add(k) == [k] and k.extra["nvml_events"] == 2   # out at once, with the two
    assert j.add(nvml_event(13, pci="0000:2a:00")) == []     # the third: absorbed
    assert j.add(nvml_event(13, pci="0000:2a:00")) == []     # a fourth is an event of its own
    assert [e.source for e in j.drain()] == ["nvml"]


def test_join_with_one_source_waits_for_nothing():
    j = Joiner(clock=FakeClock(), nvml=False)
    (ev,) = j.add(one(XID31))
    assert ev.source == "kmsg"
    j = Joiner(clock=FakeClock(), kmsg=False)
    assert len(j.add(nvml_event(31))) == 1
    j = Joiner(clock=FakeClock())
    assert len(j.add(nvml_event(None))) == 1   # not an Xid: nothing to join


class ListLog:
    """A kernel log source fed by the test."""
    exhausted = False
    name = "test"

    def __init__(self):
        self.items: list = []
        self.closed = False

    def fileno(self):
        return None

    def read(self):
        out, self.items = self.items, []
        return out

    def close(self):
        self.closed = True


def test_fault_stream_joins_kmsg_and_nvml():
    clock = FakeClock()
    nv = FakeNvml()
    log = ListLog()
    stream = FaultStream(log, NvmlSource(nvml=nv, wait_ms=10), window=2.0, settle=0.25,
                         clock=clock, boot_time=0.0)
    try:
        nv.post(0, XID_CRITICAL_ERROR, 31)
        got: list = []
        deadline = time.monotonic() + 5
        while stream.joiner.pending == 0 and time.monotonic() < deadline:  # NVML's event first
            got += stream.poll(0.05)
        log.items += [K.parse_line(kmsg(7, XID31)), K.KmsgGap(3, 6)]
        while not any(isinstance(x, FaultEvent) for x in got) and time.monotonic() < deadline:
            got += stream.poll(0.05)
            clock.advance(0.1)
        events = [x for x in got if isinstance(x, FaultEvent)]
        gaps = [x for x in got if isinstance(x, K.KmsgGap)]
        assert [(e.xid, e.source, e.gpu_uuid, e.pid) for e in events] == [(31, "kmsg+nvml", "GPU-aaaa", 574)]
        assert gaps == [K.KmsgGap(3, 6)]
        nv.post(0, XID_CRITICAL_ERROR, 79)  # NVML alone: drained at the end
        deadline = time.monotonic() + 5
        while stream.joiner.pending == 0 and time.monotonic() < deadline:
            got = stream.poll(0.05)
            assert got == []
        (ev,) = stream.drain()
        assert (ev.xid, ev.source, ev.pci) == (79, "nvml", "0000:00:06")
    finally:
        stream.close()
    assert log.closed and nv.freed


def test_fault_stream_does_not_hold_a_kernel_line_back_for_nvml():
    """With NVML running but silent, a kernel-log event comes out once its lines have
    settled, not after the join window (NVML was seen 4 s late on an H100 under MPS)."""
    clock = FakeClock()
    log = ListLog()
    stream = FaultStream(log, NvmlSource(nvml=FakeNvml(), wait_ms=10), window=2.0, settle=0.25,
                         clock=clock, boot_time=0.0)
    try:
        log.items += [K.parse_line(kmsg(7, XID31))]
        start, got = clock(), []
        while not got and clock() - start < 1.9:
            got += stream.poll(0.01)
            clock.advance(0.05)
        assert [(e.xid, e.source) for e in got] == [(31, "kmsg")] and clock() - start < 0.5
    finally:
        stream.close()


# -- the journal ----------------------------------------------------------------------


def test_journal_append_and_read(tmp_path):
    j = FaultJournal(tmp_path / "faults")
    rec = j.append({"type": "fault", **one(XID31).to_json()})
    assert isinstance(rec["time"], float)
    j.append({"type": "mps-incident", "time": 10.0, "gpu": "GPU-aaaa"})
    assert [r["type"] for r in j.read()] == ["fault", "mps-incident"]
    assert j.read(since=11.0) == [rec]
    assert [r["type"] for r in j.read(limit=1)] == ["mps-incident"]  # the last one in the file
    assert (tmp_path / "faults" / "faults.jsonl").stat().st_mode & 0o777 == 0o600
    lines = (tmp_path / "faults" / "faults.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(x) for x in lines)


def test_journal_is_bounded(tmp_path):
    j = FaultJournal(tmp_path, max_bytes=1024, files=2)
    for i in range(200):
        j.append({"type": "t", "i": i, "pad": "x" * 60})
    sizes = [p.stat().st_size for p in j.files()]
    assert len(sizes) == 2 and all(s <= 1024 for s in sizes) and sum(sizes) <= 2048
    got = [r["i"] for r in j.read()]
    assert got == list(range(200 - len(got), 200)) and len(got) >= 12
    j3 = FaultJournal(tmp_path / "three", max_bytes=512, files=3)
    for i in range(100):
        j3.append({"i": i})
    assert [p.name for p in j3.files()] == ["faults.jsonl.2", "faults.jsonl.1", "faults.jsonl"]
    with pytest.raises(ValueError):
        j.append({"pad": "x" * 2000})


def test_journal_tolerates_a_torn_line(tmp_path):
    j = FaultJournal(tmp_path)
    j.append({"type": "a", "time": 1.0})
    with open(j.current, "ab") as f:
        f.write(b'{"type": "fault", "xid": 3')     # a crash in the middle of a record
    assert [r["type"] for r in j.read()] == ["a"] and j.skipped == 1
    j.append({"type": "b", "time": 2.0})
    assert [r["type"] for r in j.read()] == ["a", "b"] and j.skipped == 1
    assert j.current.read_bytes().endswith(b'"xid": 3\n{"time":2.0,"type":"b","v":1}\n')
    with open(j.current, "ab") as f:  # a record of a format this gpuos does not know
        f.write(b'{"time":3.0,"type":"c","v":2}\n')
    assert [r["type"] for r in j.read()] == ["a", "b"] and (j.skipped, j.newer) == (1, 1)


def _append_many(path: str, tag: int) -> None:
    j = FaultJournal(path, max_bytes=4096, files=3)
    for i in range(50):
        j.append({"type": "t", "writer": tag, "i": i, "pad": "y" * 40})


def test_journal_writers_in_several_processes(tmp_path):
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(tmp_path), n)) for n in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    j = FaultJournal(tmp_path, max_bytes=4096, files=3)
    recs = j.read()
    assert j.skipped == 0 and recs
    assert sum(p.stat().st_size for p in j.files()) <= 3 * 4096
    for n in range(4):  # each writer's surviving records are its last ones, in order
        mine = [r["i"] for r in recs if r["writer"] == n]
        assert mine == list(range(50 - len(mine), 50))


# -- the commands ---------------------------------------------------------------------


def runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        return CliRunner()


@pytest.fixture
def env(home):
    return gpuos_env(home.home)


def records_file(tmp_path: Path, name: str = "kmsg") -> Path:
    f = tmp_path / name
    f.write_text("\n".join([
        kmsg(100, "usb 1-1: new high-speed USB device", prio=6),
        kmsg(101, XID31, usec=2_000_000) + "\n SUBSYSTEM=pci\n DEVICE=+pci:0000:00:06.0",
        kmsg(102, XID13_WARP, usec=2_000_100),
        kmsg(103, XID13_GLOBAL, usec=2_000_110),
        kmsg(104, XID13_ESR, usec=2_000_120),
        kmsg(105, XID43, usec=2_000_200),
        kmsg(109, XID79, usec=2_000_300),   # 106..108 were overwritten
        kmsg(110, XID_UNKNOWN, usec=2_000_400),
    ]) + "\n")
    return f


def test_watch_json_from_a_file_and_the_journal(env, home, tmp_path):
    res = gpuos(env, "faults", "watch", "--json", "--file", str(records_file(tmp_path)))
    assert res.returncode == 0, res.stderr
    events = [json.loads(line) for line in res.stdout.splitlines()]
    assert [(e["xid"], e["fault_class"]) for e in events] == [
        (31, "memory"), (13, "sm"), (43, "channel"), (79, "device"), (999, "unknown")]
    assert all(e["type"] == "fault" and e["source"] == "kmsg" for e in events)
    assert events[0]["pid"] == 574 and events[0]["mmu"]["address"] == 0x834E8BE00000
    assert events[1]["extra"]["lines"] == 3 and events[1]["seq"] == 102
    assert "missed 3 records (seq 106..108" in res.stderr
    assert "NVML" not in res.stderr  # --file does not use NVML
    journal = FaultJournal(home.faults).read()
    assert [r["type"] for r in journal] == ["fault"] * 3 + ["kmsg-gap"] + ["fault"] * 2  # in log order
    assert [r.get("xid") for r in journal if r["type"] == "fault"] == [31, 13, 43, 79, 999]
    assert journal[3]["first"] == 106 and journal[3]["count"] == 3
    # faults log: the same records
    res = gpuos(env, "faults", "log", "--json")
    assert res.returncode == 0 and [json.loads(x) for x in res.stdout.splitlines()] == journal
    res = gpuos(env, "faults", "log", "--limit", "2")
    lines = res.stdout.splitlines()
    assert res.returncode == 0 and len(lines) == 2
    assert "Xid 79  device" in lines[0]
    assert "Xid 999  unknown  pid ?  unknown Xid: Something new -> reported; no automatic action" in lines[1]
    res = gpuos(env, "faults", "log", "--since", "2999-01-01")
    assert res.returncode == 0 and res.stdout == "" and "no fault recorded since then" in res.stderr
    res = gpuos(env, "faults", "log", "--since", "yesterday")
    assert res.returncode == 2 and "--since" in res.stderr


def test_watch_prints_one_line_per_event(env, home, tmp_path):
    f = tmp_path / "dmesg.txt"
    f.write_text("[    2.000000] " + XID31 + "\n[    2.000100] " + XID13_WARP + "\n[    2.000101] "
                 + XID13_ESR + "\n[    9.000000] " + XID48 + "\n")
    res = gpuos(env, "faults", "watch", "--file", str(f), "--no-journal")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 3
    assert "  0000:00:06  Xid 31  memory  pid 574 (python3)  GPU memory page fault: channel 0xf; " \
           "MMU GRAPHICS GPC1 GPCCLIENT_T1_11 @ 0x834e8be00000 FAULT_PDE ACCESS_TYPE_VIRT_WRITE -> " \
           "containable: " in lines[0] and lines[0].endswith("[kmsg]")
    assert "Xid 13  sm  pid ?  Graphics Engine Exception: SM warp GPC 0 TPC 1 SM 0: Illegal " \
           "Instruction Encoding; ESR 0x504648=0x1000e" in lines[1]
    assert "Xid 48  device" in lines[2] and "An uncorrectable double bit error" in lines[2]
    assert not home.faults.exists()  # --no-journal


def test_watch_usage_and_source_errors(env, tmp_path):
    res = gpuos(env, "faults", "watch", "--no-kmsg", "--no-nvml")
    assert res.returncode == 2 and "nothing to watch" in res.stderr
    res = gpuos(env, "faults", "watch", "--file", str(tmp_path / "none"))
    assert res.returncode == 1 and "cannot read" in res.stderr and "No such file" in res.stderr


def test_watch_without_nvml_says_so_once(env, tmp_path, monkeypatch):
    """NVML unavailable: kernel log only, said once; neither source: exit 4 (not permitted)."""
    monkeypatch.setattr(faults_cli, "NvmlSource", lambda: (_ for _ in ()).throw(
        NvmlUnavailable("NVML unavailable: Driver Not Loaded")))
    monkeypatch.setattr(faults_cli, "open_kernel_log",
                        lambda from_start=False, path=None: K.KmsgReader(str(records_file(tmp_path)),
                                                                          from_start=True))
    res = runner().invoke(cli, ["faults", "watch", "--no-journal"])
    assert res.exit_code == 0, res.output
    assert res.stderr.count("NVML unavailable: Driver Not Loaded: watching the kernel log only") == 1
    assert len(res.stdout.splitlines()) == 5

    def denied(from_start=False, path=None):
        raise K.KernelLogUnavailable("cannot read the kernel log: /dev/kmsg: Operation not permitted; "
                                     "dmesg -r: ...; reading it needs root or CAP_SYSLOG when "
                                     "kernel.dmesg_restrict is 1", True)
    monkeypatch.setattr(faults_cli, "open_kernel_log", denied)
    res = runner().invoke(cli, ["faults", "watch"])
    assert res.exit_code == 4
    assert "CAP_SYSLOG" in res.stderr and "Driver Not Loaded" in res.stderr
    res = runner().invoke(cli, ["faults", "watch", "--json"])
    assert res.exit_code == 4 and json.loads(res.stdout)["error"] == "not-permitted"
    res = runner().invoke(cli, ["faults", "watch", "--no-kmsg"])
    assert res.exit_code == 16 and "nothing to watch" in res.stderr


def test_watch_stops_after_duration(env, tmp_path, monkeypatch):
    """A live source that never ends: --duration ends the watch, events pending are flushed."""
    log = ListLog()
    log.items = [K.parse_line(kmsg(1, XID31))]
    monkeypatch.setattr(faults_cli, "open_kernel_log", lambda from_start=False, path=None: log)
    t0 = time.monotonic()
    res = runner().invoke(cli, ["faults", "watch", "--no-nvml", "--json",
                                                   "--duration", "0.3"])
    assert res.exit_code == 0, res.output
    assert 0.25 < time.monotonic() - t0 < 5 and log.closed
    assert [json.loads(x)["xid"] for x in res.stdout.splitlines()] == [31]


def test_log_prints_other_writers_records(home):
    j = FaultJournal(home.faults)
    j.append({"type": "mps-incident", "time": 1_700_000_000.0, "gpu": "GPU-aaaa", "clients": [1, 2]})
    j.append({"type": "kmsg-gap", "time": 1_700_000_001.0, "first": None, "last": None, "count": None})
    res = runner().invoke(cli, ["faults", "log"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].endswith("  mps-incident  clients=[1, 2] gpu=GPU-aaaa")
    assert "records were lost" in lines[1]
    assert Paths.from_env().faults == home.home / "faults"


def test_help_names_the_commands():
    res = CliRunner().invoke(cli, ["--help"])
    assert "faults" in res.output
    res = CliRunner().invoke(cli, ["faults", "watch", "--help"])
    assert res.exit_code == 0 and "--from-start" in res.output and "CAP_SYSLOG" in res.output


# -- gpuos.ko's fault reports (faults/kmod.py); the real module is tested in the VM --------------

def kmod_event(seq=7, pid=4242, decision=1, time_ns=10_000_000_000):
    from gpuos.kernel.model import Event, Fault
    from gpuos.kernel.uapi import EventType
    return Event(seq=seq, time_ns=time_ns, type=EventType.FAULT,
                 fault=Fault(pid=pid, cgroup=None, as_id=0xA7, veid=5, addr=0x7F12345000, access=1,
                             type=0, gpu=1, decision=decision))


def test_a_gpuos_ko_fault_names_the_faulting_process():
    from gpuos.faults.kmod import ACTIONS, fault_event
    from gpuos.kernel.uapi import Decision
    ev = fault_event(kmod_event(pid=os.getpid()), now_wall=1000.0, now_mono_ns=12_000_000_000)
    assert (ev.xid, ev.source, ev.fault_class, ev.pid) == (None, "gpuos.ko", FaultClass.MEMORY, os.getpid())
    assert ev.process and ev.time == pytest.approx(998.0)  # logged 2 s before it was read
    assert (ev.mmu.address, ev.mmu.access_type, ev.mmu.fault_type, ev.mmu.engine) == \
        (0x7F12345000, "write", "invalid-pde", "VEID 5")
    assert ev.extra == {"veid": 5, "as_id": 0xA7, "uvm_gpu": 1, "cgroup": None, "decision": "isolate",
                        "kmod_seq": 7}
    assert ev.action == ACTIONS[Decision.ISOLATE]
    assert "gpuos.ko" in faults_cli.event_line(ev) and f"pid {os.getpid()}" in faults_cli.event_line(ev)
    # an unknown decision falls back to what the stock driver does; other events are not faults
    assert fault_event(kmod_event(decision=9), 0.0, 0).action == ACTIONS[Decision.DEFAULT]
    from gpuos.kernel.model import Event
    from gpuos.kernel.uapi import EventType
    assert fault_event(Event(seq=1, time_ns=0, type=EventType.DRIVER_REGISTERED), 0.0, 0) is None


class FakeKmod:
    """KmodFaultSource's interface, fed by the test."""

    def __init__(self):
        self.error, self.callback, self.stopped = None, None, False

    def start(self, callback):
        self.callback = callback

    def stop(self):
        self.stopped = True


def test_the_stream_passes_gpuos_ko_faults_through_at_once():
    from gpuos.faults.kmod import fault_event
    kmod, log = FakeKmod(), ListLog()
    stream = FaultStream(log, None, window=2.0, clock=FakeClock(), boot_time=0.0, threaded=[kmod])
    try:
        kmod.callback(fault_event(kmod_event(pid=77), 1000.0, 10_000_000_000))
        got = stream.poll(0.01)
        assert [(e.source, e.pid) for e in got if isinstance(e, FaultEvent)] == [("gpuos.ko", 77)]
        kmod.error = "gpuos.ko: gpuos.ko was unloaded: no more events"
        notices = [x.text for x in stream.poll(0.01) if not isinstance(x, FaultEvent)]
        assert notices == ["gpuos.ko: gpuos.ko was unloaded: no more events; its fault reports stopped"]
    finally:
        stream.close()
    assert kmod.stopped
