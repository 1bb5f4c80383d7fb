"""`gpuos run --record-touched` on a GPU: the bytes each launch touched, measured from the
GPU faults of managed memory (libgpuos/src/touched.c), are the bytes it touched.

Kernels with known extents (tests/gpu/programs/touch_ranges.py, CuPy): every faulted page
lies inside the launch's range, the touched 2 MiB blocks are exactly the range's, reads
and writes are told apart, whole-allocation predictions miss nothing, and the program's
results are right. Then a PyTorch workload: measured, every launch's record complete or
flagged, its result bit-identical to a plain run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from gpu_needs import NO_TORCH_GPU, probe, torch_gpu_marks

from gpuos.intercept.log import read_log
from gpuos.workloads.run import private_caches, run, suite_cmd, under_gpuos

pytestmark = torch_gpu_marks()
_NO_CUPY = None if NO_TORCH_GPU else probe("import cupy; cupy.cuda.runtime.getDeviceCount()")
PROGRAM = Path(__file__).parent / "programs" / "touch_ranges.py"
BLOCK = 2 << 20
PAGE = 4096
TIMEOUT = 240


def blocks(start: int, end: int) -> set[int]:
    return set(range(start // BLOCK, (end + BLOCK - 1) // BLOCK))


def records(log: Path) -> list[dict]:
    return list(read_log(log))[1:]


@pytest.mark.skipif(bool(_NO_CUPY), reason=f"needs CuPy: {_NO_CUPY}")
def test_touched_pages_are_the_kernels_ranges(tmp_path):
    log = tmp_path / "touched.jsonl"
    fin = run(under_gpuos([sys.executable, str(PROGRAM)], "--record-touched", "--log", str(log)), TIMEOUT,
              dict(os.environ, **private_caches(tmp_path / "cache")))
    assert fin.returncode == 0, fin.describe()
    out = fin.result()
    assert out["ok"], "the program's results are wrong under --record-touched"
    recs = records(log)
    names = {(r["pid"], r["id"]): r["name"] for r in recs if r["type"] == "function"}
    alloc = [r for r in recs if r["type"] == "alloc" and r["base"] == out["base"]]
    assert alloc and alloc[0].get("measured"), f"the 64 MiB allocation is not measured: {alloc}"
    ours = [r for r in recs if r["type"] == "launch" and names.get((r["pid"], r["func"])) in
            ("write_range", "read_sum")]
    assert [names[(r["pid"], r["func"])] for r in ours] == [x["kernel"] for x in out["launches"]]
    touched = {r["seq"]: r for r in recs if r["type"] == "touched"}
    validated = {r["seq"]: r for r in recs if r["type"] == "validate"}
    lo, hi = out["base"], out["base"] + out["size"]
    for rec, want in zip(ours, out["launches"]):
        t = touched.get(rec["seq"])
        assert t is not None, f"no touched record for {want}"
        assert not t["flags"], f"{want['kernel']}: touches may be missing: {t['flags']}"
        runs = [(r["start"], r["start"] + r["len"], r["access"]) for r in t["runs"]
                if r["start"] < hi and r["start"] + r["len"] > lo]
        assert runs, f"{want['kernel']}: nothing touched in the allocation"
        first = want["ptr"] // PAGE * PAGE
        last = -(-(want["ptr"] + want["len"]) // PAGE) * PAGE
        outside = [(hex(s), e - s) for s, e, _ in runs if s < first or e > last]
        assert not outside, f"{want['kernel']}: pages outside [{first:#x}, {last:#x}) faulted: {outside}"
        got = set().union(*(blocks(s, e) for s, e, _ in runs))
        assert got == blocks(want["ptr"], want["ptr"] + want["len"]), \
            f"{want['kernel']}: touched blocks {sorted(got)} != the range's"
        access = set().union(*(set(a) for _, _, a in runs))
        assert ("write" in access) == (want["kernel"] == "write_range"), f"{want['kernel']}: {access}"
        v = validated[rec["seq"]]
        assert not v["skipped"] and v["missed_bytes"] == 0, v
        assert v["changed_bytes"] > 0


def test_a_pytorch_workload_is_measured_and_its_result_unchanged(tmp_path):
    cmd = suite_cmd("gpt-train", ["--layers", "2", "--seq", "256", "--steps", "1", "--warmup", "1"])
    env = dict(os.environ, **private_caches(tmp_path / "cache"))
    plain = run(cmd, TIMEOUT, env)
    assert plain.returncode == 0, plain.describe()
    log = tmp_path / "touched.jsonl.gz"
    fin = run(under_gpuos(cmd, "--record-touched", "--log", str(log)), TIMEOUT, env)
    assert fin.returncode == 0, fin.describe()
    assert fin.result()["checksum"] == plain.result()["checksum"]
    recs = records(log)
    launches = [r for r in recs if r["type"] == "launch" and "captured" not in r["flags"]]
    touched = [r for r in recs if r["type"] == "touched"]
    assert launches and len(touched) >= 0.9 * len(launches), (len(touched), len(launches))
    measured = [r for r in recs if r["type"] == "alloc" and r.get("measured")]
    assert measured, "no allocation was measured"
    incomplete = [t for t in touched if t["flags"]]
    assert len(incomplete) <= 0.01 * len(touched), f"{len(incomplete)} of {len(touched)} incomplete"
    assert sum(1 for t in touched if t["runs"]) >= 0.9 * len(touched)
