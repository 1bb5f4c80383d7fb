"""`gpuos trace faults`: its BPF program, its histogram and report, without bcc or a kernel."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpuos.kernel import trace
from gpuos.kernel.trace import Log2Bucket, build_report, format_log2_hist, log2_buckets

KMOD = Path(__file__).resolve().parents[2] / "kmod"
TRACE_H = KMOD / "trace.h"
POLICY_H = KMOD / "policy.h"
FAULT_FIELDS = {"pid", "cgroup", "as_id", "veid", "addr", "access", "type", "gpu"}
DECISION_FIELDS = {"pid", "cgroup", "source", "decision", "latency_ns"}


def test_bpf_program_is_package_data_and_uses_tracepoints_only():
    text = trace.bpf_text()
    assert text.startswith("// SPDX-License-Identifier")
    assert "TRACEPOINT_PROBE(gpuos, fault)" in text and "TRACEPOINT_PROBE(gpuos, decision)" in text
    assert not re.search(r"kprobe|kretprobe|fentry|fexit|KFUNC_PROBE", text.split("*/")[-1])


def test_bpf_program_reads_only_fields_the_tracepoints_have():
    used = set(re.findall(r"args->(\w+)", trace.bpf_text()))
    assert used <= FAULT_FIELDS | DECISION_FIELDS
    assert {"pid", "decision", "latency_ns"} <= used


def trace_event_fields(text: str, event: str) -> list[str]:
    m = re.search(r"TRACE_EVENT\(\s*" + event + r"\s*,(.*?)TP_fast_assign", text, re.S)
    assert m, f"no TRACE_EVENT({event}, ...) in kmod/trace.h"
    return re.findall(r"__field\(\s*[^,]+,\s*(\w+)\s*\)", m.group(1))


def test_field_names_match_kmod_trace_h():
    if not TRACE_H.is_file():
        pytest.skip("kmod/trace.h not written yet")
    text = TRACE_H.read_text()
    assert set(trace_event_fields(text, "fault")) >= FAULT_FIELDS
    assert set(trace_event_fields(text, "decision")) >= DECISION_FIELDS
    assert re.search(r"TRACE_SYSTEM\s+gpuos\b", text)


def test_decision_sources_match_kmod_policy_h():
    if not POLICY_H.is_file():
        pytest.skip("kmod/policy.h not written yet")
    found = {int(v): name.lower() for name, v in
             re.findall(r"GPUOS_SRC_(\w+)\s*=\s*(\d+)", POLICY_H.read_text())}
    assert found == trace.DECISION_SOURCES


def test_log2_buckets_are_bccs():
    assert log2_buckets({}) == []
    assert log2_buckets({1: 2, 3: 5}) == [Log2Bucket(1, 1, 2), Log2Bucket(2, 3, 0),
                                          Log2Bucket(4, 7, 5)]
    assert log2_buckets({0: 1, 11: 1})[0] == Log2Bucket(0, 0, 1)
    assert log2_buckets({0: 1, 11: 1})[-1] == Log2Bucket(1024, 2047, 1)


def test_histogram_text():
    text = format_log2_hist([Log2Bucket(512, 1023, 2), Log2Bucket(1024, 2047, 8)], "ns")
    lines = text.splitlines()
    assert "count" in lines[0] and "distribution" in lines[0]
    assert lines[1].split()[:5] == ["512", "->", "1023", ":", "2"]
    assert lines[2].count("*") == 40 and lines[1].count("*") == 10
    assert "(none)" in format_log2_hist([], "ns")


def test_report_groups_per_client():
    rep = build_report(1000.0, 2.0, faults={999999991: 3, 1: 1},
                       decisions={(999999991, 1): 3, (1, 0): 1}, slots={10: 4},
                       sources={1: 3, 0: 1, 2: 0})
    assert rep.sources == {"default": 1, "pid": 3}
    assert rep.faults == 4 and rep.decisions == 4
    first = rep.clients[0]
    assert first.pid == 999999991 and first.comm is None  # no such process: comm unknown
    assert first.faults == 3 and first.decisions == {"isolate": 3}
    assert rep.clients[1].comm is not None  # pid 1 exists
    js = rep.to_json()
    assert js["latency_ns"] == [{"low": 512, "high": 1023, "count": 4}]
    assert js["clients"][0] == {"pid": 999999991, "comm": None, "faults": 3,
                                "decisions": {"isolate": 3}}
