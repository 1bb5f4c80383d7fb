"""libgpuos on real GPU workloads through `gpuos run`: it changes nothing and sees everything.

Small versions of the workload suite (gpuos.workloads.suite) run plain and under
`gpuos run`; results must be bit-identical, the workload's process tracked, and
`gpuos run --validate` must find no byte written outside the predicted buffers.
Skipped cleanly without torch and a CUDA GPU (the CuPy case also without CuPy).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
from gpu_needs import NO_TORCH_GPU, probe, torch_gpu_marks

from gpuos.workloads.run import Finished, private_caches, run, suite_cmd, under_gpuos
from gpuos.workloads.suite import VOLATILE_KEYS


STEPS = ["--steps", "2", "--warmup", "1"]
SMALL_GPT = ["--layers", "4", "--seq", "256"]
SMALL = {
    "resnet50-train": ["--batch", "8"],
    "gpt-train": SMALL_GPT,
    "gpt-compile": SMALL_GPT,
    "gpt-graphs": SMALL_GPT,
    "cupy": ["--size", "512"],
}
# The documented fallback for a blind spot validation found (README): CuPy's batched float32
# matmul runs a cuBLAS batched GEMM that reads the output's address from a pointer array in
# device memory; which kernel depends on the size (H100: an xmma FFMA GEMM at --size 512, the
# CUTLASS SIMT SGEMM at 1024).
FALLBACK = {"cupy": ["--touch-all", "cutlass_80_simt_sgemm", "--touch-all", "xmma_gemm_f32f32_f32f32"]}
# Counters that must be non-zero for the workload's process, beyond launches.
MORE_COUNTERS = {"gpt-graphs": ["graph_launches"]}
RUN_TIMEOUT = 240  # one run; the GPU host's pytest stops a test at 300 s


pytestmark = torch_gpu_marks()
_NO_CUPY = None if NO_TORCH_GPU else probe("import cupy; cupy.cuda.runtime.getDeviceCount()")


def _case(workload: str):
    if workload != "cupy":
        return pytest.param(workload, id=workload)
    return pytest.param(workload, id=workload,
                        marks=pytest.mark.skipif(bool(_NO_CUPY), reason=f"needs CuPy: {_NO_CUPY}"))


CASES = [_case(w) for w in SMALL]


def _run(cmd: list[str], tmp: Path) -> Finished:
    """Run with kernel caches of its own: torch.compile compiles (its workers included)
    in every run, the interposed ones too."""
    return run(cmd, RUN_TIMEOUT, dict(os.environ, **private_caches(tmp / "cache")))


def _ok(fin: Finished) -> dict:
    assert fin.returncode == 0, fin.describe()
    return fin.result()


def _cmd(workload: str, *extra: str) -> list[str]:
    return suite_cmd(workload, [*SMALL[workload], *STEPS, *extra])


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """workload -> its plain run's result, each computed once."""
    done: dict[str, dict] = {}

    def get(workload: str) -> dict:
        if workload not in done:
            done[workload] = _ok(_run(_cmd(workload), tmp_path_factory.mktemp(workload)))
        return done[workload]
    return get


def _same_result(workload: str, got: dict, want: dict, tmp: Path) -> None:
    """Checksums must match; if not, say whether plain runs even agree with each other."""
    if got["checksum"] == want["checksum"]:
        return
    again = _ok(_run(_cmd(workload), tmp / "plain-again"))
    verdict = ("plain runs agree with each other, so libgpuos changed the result"
               if again["checksum"] == want["checksum"] else
               "plain runs differ too: the workload itself is not deterministic")
    pytest.fail(f"{workload}: checksum {got['checksum']} != plain {want['checksum']}; {verdict}")


def _gpu_process(report: dict, pid: int) -> dict:
    procs = {p["pid"]: p for p in report["processes"]}
    assert pid in procs, f"the workload (pid {pid}) is not in the report: {report['processes']}"
    return procs[pid]


def _check_tracked(workload: str, proc: dict) -> None:
    assert proc["state"] == "on", f"tracking is {proc['state']}: {proc['reason']}"
    for counter in ["launches", *MORE_COUNTERS.get(workload, [])]:
        assert proc["counters"][counter] > 0, f"no {counter} seen: {proc['counters']}"
    if proc["counters"]["unmatched_procs"]:
        # Entry points cuGetProcAddress returned that libgpuos does not know: reported, not
        # failed (the validation test shows whether anything was missed through them).
        warnings.warn(f"{workload}: {proc['counters']['unmatched_procs']} unmatched "
                      f"cuGetProcAddress results; counters {proc['counters']}")


@pytest.mark.parametrize("workload", CASES)
def test_interposed_run_is_identical_and_tracked(workload, plain, tmp_path):
    report = tmp_path / "report.json"
    got = _ok(_run(under_gpuos(_cmd(workload), "--report", str(report)), tmp_path))
    _same_result(workload, got, plain(workload), tmp_path)
    rep = json.loads(report.read_text())
    assert rep["returncode"] == 0
    _check_tracked(workload, _gpu_process(rep, got["pid"]))


@pytest.mark.parametrize("workload", CASES)
def test_validation_finds_no_misses(workload, plain, tmp_path):
    report = tmp_path / "report.json"
    got = _ok(_run(under_gpuos(_cmd(workload), "--validate", *FALLBACK.get(workload, []),
                               "--report", str(report)), tmp_path))
    rep = json.loads(report.read_text())
    proc = _gpu_process(rep, got["pid"])
    v = rep["validation"]
    assert v is not None, f"no validation in the report: {rep['processes']}"
    assert proc["counters"]["validated"] > 0, f"nothing validated: {proc['counters']}"
    missed = [f"{k['name']}: {k['with_misses']} of {k['validated']} launches, "
              f"{k['missed_bytes']} bytes" for k in v["kernels"] if k["with_misses"]]
    assert v["with_misses"] == 0, (
        f"{v['with_misses']} of {v['operations']} operations wrote outside the prediction "
        f"({v['missed_bytes']} bytes):\n  " + "\n  ".join(missed))
    _same_result(workload, got, plain(workload), tmp_path)  # validating changes nothing either


def _stable(stdout: str) -> list:
    """stdout's lines, with what differs between any two runs (times, pid) left out."""
    out = []
    for line in stdout.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            out.append(line)
            continue
        out.append({k: v for k, v in obj.items() if k not in VOLATILE_KEYS})
    return out


@pytest.mark.parametrize("workload", [_case("cupy"), _case("gpt-train")])
def test_output_and_exit_status_are_passed_through(workload, tmp_path):
    cmd = _cmd(workload, "--exit-code", "3")
    report = tmp_path / "report.json"
    plain_run = _run(cmd, tmp_path / "plain")
    # -q: gpuos run's own summary would go to the same stderr.
    interposed = _run(under_gpuos(cmd, "-q", "--report", str(report)), tmp_path / "gpuos")
    assert (plain_run.returncode, interposed.returncode) == (3, 3), interposed.describe()
    assert _stable(interposed.stdout) == _stable(plain_run.stdout)
    assert interposed.stderr == plain_run.stderr
    assert json.loads(report.read_text())["returncode"] == 3
