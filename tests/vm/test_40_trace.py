"""The tracepoints (gpuos:fault_batch firing, read from the ftrace buffer), and `gpuos trace
faults` (bcc on gpuos:fault and gpuos:decision) while faults are injected."""

from __future__ import annotations

import json

import pytest

import vmlib
from vmlib import gpuos_cli, inject, inject_batch
from gpuos.kernel.model import Client
from gpuos.kernel.uapi import FaultPolicy

pytestmark = pytest.mark.vm

FIELDS = {  # trace.h's TP_STRUCT__entry of each tracepoint
    "fault": ["pid", "cgroup", "as_id", "veid", "addr", "access", "type", "gpu"],
    "decision": ["pid", "cgroup", "source", "decision", "latency_ns"],
    "migrate": ["batch_id", "as_id", "op", "nr_ranges", "result"],
    "batch_done": ["batch_id", "nr", "first_error"],
    "policy": ["pid", "cgroup", "policy", "set"],
    "fault_batch": ["pid", "cgroup", "as_id", "gpu", "batch_id", "nr_faults", "nr_instances",
                    "nr_fatal", "nr_throttled", "nr_skipped", "nr_read", "nr_write", "nr_atomic",
                    "nr_prefetch", "addr_min", "addr_max", "nr_addrs"],
}


def test_tracepoints_in_tracefs(gpuos):
    names = {p.name for p in vmlib.TRACEFS.iterdir() if p.is_dir()}
    assert names == set(FIELDS)
    for tp, fields in FIELDS.items():
        fmt = (vmlib.TRACEFS / tp / "format").read_text()
        for f in fields:
            assert f" {f};" in fmt, (tp, f, fmt)


def test_fault_batch_tracepoint_fires(testdrv):
    tracing = vmlib.TRACEFS.parent.parent  # /sys/kernel/tracing
    enable = vmlib.TRACEFS / "fault_batch" / "enable"
    (tracing / "trace").write_text("")  # clear the buffer
    enable.write_text("1")
    try:
        assert inject_batch(4000000, as_id=0xAB, gpu=3, batch_id=77, skipped=9,
                            by_access=(1, 1, 1, 0)) == 0
        assert inject_batch(4000000, gpu=99) == 0  # malformed: no tracepoint
    finally:
        enable.write_text("0")
    lines = [ln for ln in (tracing / "trace").read_text().splitlines()
             if "fault_batch:" in ln]
    assert len(lines) == 1, lines
    assert lines[0].split("fault_batch: ", 1)[1] == (
        "pid=4000000 cgroup=0 as_id=0xab gpu=3 batch_id=77 faults=3 instances=3 fatal=0 "
        "throttled=0 skipped=9 read=1 write=1 atomic=1 prefetch=0 addr_min=0x1000 "
        "addr_max=0x3000 nr_addrs=3")


def test_trace_faults_counts_and_latency(testdrv, nl, sleepers):
    a, b = sleepers(), sleepers()
    nl.set_policy(Client(pid=b.pid), FaultPolicy.ISOLATE)
    tracer = gpuos_cli("trace", "faults", "--json", "--duration", "3", popen=True)
    try:
        # attached once bcc has opened a perf event per tracepoint
        vmlib.wait_fds(tracer, "anon_inode:[perf_event]", 2, timeout=120)
        for i in range(7):
            assert inject(a.pid, addr=0x1000 * i) == 0
        for i in range(4):
            assert inject(b.pid, access=i) == 1
        assert inject(b.pid, access=9) == 0  # malformed: no tracepoint fires for it
        out, err = tracer.communicate(timeout=60)
    finally:
        if tracer.poll() is None:
            tracer.kill()
    assert tracer.returncode == 0, (out, err)
    rep = json.loads(out.strip().splitlines()[-1])
    clients = {c["pid"]: c for c in rep["clients"]}
    assert set(clients) == {a.pid, b.pid}, rep
    assert (clients[a.pid]["faults"], clients[a.pid]["decisions"]) == (7, {"default": 7})
    assert (clients[b.pid]["faults"], clients[b.pid]["decisions"]) == (4, {"isolate": 4})
    assert clients[a.pid]["comm"] == clients[b.pid]["comm"] == "sleep"
    assert rep["faults"] == rep["decisions"] == 11
    assert rep["sources"] == {"default": 7, "pid": 4}
    hist = rep["latency_ns"]
    assert sum(bucket["count"] for bucket in hist) == 11  # one latency sample per decision
    assert all(bk["low"] <= bk["high"] for bk in hist)
    assert all(x["high"] + 1 == y["low"] for x, y in zip(hist, hist[1:]))  # log2, contiguous
