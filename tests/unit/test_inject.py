"""gpuos-inject on the host (no GPU): it builds, its command line, clean failures.

The program (inject/) is built here with its own Makefile into a temporary directory,
as setup.py builds it.  Without a GPU it can only fail, and must fail cleanly: exit 3,
one line saying why, a JSON line with --json.  Two ways are covered: no driver at all
(no libcuda.so.1), and a driver with no GPU (a stub libcuda.so.1 whose cuInit says
CUDA_ERROR_NO_DEVICE, which the static CUDA runtime turns into cudaErrorNoDevice).  The
illegal-instruction kind's cubin patching runs without a GPU too
(--write-illegal-cubins), and nvdisasm, when at hand, confirms that the patched
instruction is one no SM decodes.  `gpuos faults inject` (gpuos.faults.inject) is
checked with the real binary and with stand-ins.  On a GPU: tests/gpu/test_inject_gpu.py.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuos.faults import inject as inj

REPO = Path(__file__).resolve().parents[2]
MARKER = 0x1BADC0DE
INVALID_LO = 0xFFF
ARCHS = (80, 90, 100)

STUB_LIBCUDA = r"""
/* A libcuda.so.1 with a driver but no GPU: enough for the static CUDA runtime to ask. */
#include <dlfcn.h>
#include <stddef.h>
int cuInit(unsigned flags) { (void)flags; return 100; /* CUDA_ERROR_NO_DEVICE */ }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *st) {
    (void)ver; (void)flags;
    void *self = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    void *p = self ? dlsym(self, sym) : NULL;
    *pfn = p;
    if (st) *st = p ? 0 : 1;
    return p ? 0 : 500; /* CUDA_ERROR_NOT_FOUND */
}
int cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags, int *st) {
    return cuGetProcAddress_v2(sym, pfn, ver, flags, st);
}
"""


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("inject")
    t0 = time.monotonic()
    res = subprocess.run(["make", "-s", "-C", str(REPO / "inject"), f"O={out}"],
                         capture_output=True, text=True)
    if res.returncode and "nvcc not found" in res.stderr:
        pytest.skip("no nvcc (the CUDA toolkit) to build gpuos-inject with")
    assert res.returncode == 0, res.stderr
    print(f"gpuos-inject built in {time.monotonic() - t0:.1f} s")
    return out


@pytest.fixture(scope="module")
def binary(build) -> Path:
    return build / "gpuos-inject"


@pytest.fixture(scope="module")
def stub_driver(tmp_path_factory) -> Path:
    """A directory holding a libcuda.so.1 that has no GPU."""
    d = tmp_path_factory.mktemp("stubcuda")
    (d / "stub.c").write_text(STUB_LIBCUDA)
    cc = os.environ.get("CC", "gcc")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libcuda.so.1"), str(d / "stub.c"),
                    "-Wl,-soname,libcuda.so.1", "-ldl"], check=True)
    return d


def run(binary: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60,
                          env=env)


def json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


def _host_has_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


# -- the build -------------------------------------------------------------------------


def test_builds_static_runtime_no_libcuda_link(binary):
    assert os.access(binary, os.X_OK)
    res = subprocess.run(["readelf", "-d", str(binary)], capture_output=True, text=True)
    if res.returncode:
        pytest.skip("no readelf")
    needed = [line for line in res.stdout.splitlines() if "(NEEDED)" in line]
    assert needed
    # the CUDA runtime is static and libcuda.so.1 is dlopened: neither is a dependency
    assert not [n for n in needed if "libcuda" in n or "libcudart" in n], needed


def test_build_without_nvcc_says_so(tmp_path):
    res = subprocess.run(["make", "-C", str(REPO / "inject"), f"O={tmp_path}",
                          "NVCC=/nonexistent/bin/nvcc"], capture_output=True, text=True)
    assert res.returncode != 0
    assert "nvcc not found" in res.stderr and "CUDA_HOME" in res.stderr
    assert not (tmp_path / "gpuos-inject").exists()


def test_packaged_binary_is_found(monkeypatch):
    """setup.py ships gpuos/_native/gpuos-inject (this tree installed with pip install -e .)."""
    monkeypatch.delenv(inj.ENV, raising=False)
    try:
        path = inj.inject_binary()
    except inj.InjectorMissing as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"gpuos not (re)installed from this tree: {exc}")
    assert path.name == "gpuos-inject" and path.parent.name == "_native"
    assert oct(path.stat().st_mode & 0o777) == oct(0o755)
    assert run(path, "--help").returncode == 0


# -- the command line --------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help(binary, flag):
    res = run(binary, flag)
    assert res.returncode == 0
    assert res.stdout.startswith("Usage: gpuos-inject --kind KIND")
    for kind, expect in inj.KINDS.items():
        assert kind in res.stdout
        assert expect in res.stdout or kind == "none"
    assert "Exit codes" in res.stdout


def test_list_matches_python_side(binary):
    res = run(binary, "--list", "--json")
    assert res.returncode == 0
    rows = json_lines(res.stdout)
    assert {r["kind"]: r["expect"] for r in rows} == inj.KINDS
    assert all(r["xid"] and r["what"] for r in rows)
    human = run(binary, "--list")
    assert human.returncode == 0 and len(human.stdout.splitlines()) == len(inj.KINDS)


@pytest.mark.parametrize("args", [
    [],
    ["--kind", "bogus"],
    ["--kind"],
    ["--kind", "none", "--delay", "-1"],
    ["--kind", "none", "--delay", "soon"],
    ["--kind", "none", "--device", "x"],
    ["--kind", "none", "--after-iterations", "-3"],
    ["--frob"],
    ["--kind", "none", "extra"],
], ids=lambda a: " ".join(a) or "nothing")
def test_usage_errors(binary, args):
    res = run(binary, *args)
    assert res.returncode == inj.EXIT_USAGE, res.stderr
    assert res.stdout == ""
    assert res.stderr.startswith("gpuos-inject: ") and "--help" in res.stderr


# -- without a GPU ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(inj.KINDS))
def test_no_driver_fails_cleanly(binary, tmp_path, kind):
    if _host_has_driver():
        pytest.skip("this host has a libcuda.so.1")
    env = dict(os.environ, LD_LIBRARY_PATH=str(tmp_path))  # nothing there
    res = run(binary, "--kind", kind, "--json", env=env)
    assert res.returncode == inj.EXIT_SETUP
    (line,) = json_lines(res.stdout)
    assert line["kind"] == kind and line["pid"] > 0
    assert line["stage"] == "setup-failed" and line["step"] == "driver"
    assert line["error"] == "no-driver" and line["exit"] == inj.EXIT_SETUP
    (err,) = res.stderr.splitlines()
    assert err.startswith(f"gpuos-inject: {kind}: setup-failed: driver: cannot load libcuda.so.1")
    human = run(binary, "--kind", kind, env=env)
    assert human.returncode == inj.EXIT_SETUP and human.stdout == ""
    assert "no NVIDIA driver" in human.stderr


@pytest.mark.parametrize("kind", ["oob-write", "illegal-instruction", "none"])
def test_driver_without_gpu_fails_cleanly(binary, stub_driver, kind):
    env = dict(os.environ, LD_LIBRARY_PATH=str(stub_driver))
    res = run(binary, "--kind", kind, "--json", env=env)
    assert res.returncode == inj.EXIT_SETUP, res.stderr
    (line,) = json_lines(res.stdout)
    assert line["stage"] == "setup-failed" and line["step"] == "cudaGetDeviceCount"
    assert (line["error"], line["code"]) == ("cudaErrorNoDevice", 100)
    (err,) = res.stderr.splitlines()
    assert "cudaErrorNoDevice" in err and "no CUDA-capable device" in err


# -- illegal-instruction: the patched cubins ---------------------------------------------


def _text_section(img: bytes, name: bytes) -> tuple[int, int]:
    shoff, = struct.unpack_from("<Q", img, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", img, 0x3A)
    secs = [struct.unpack_from("<IIQQQQ", img, shoff + i * shentsize) for i in range(shnum)]
    strtab = secs[shstrndx][4]
    for sh_name, _type, _flags, _addr, off, size in secs:
        if img[strtab + sh_name:].split(b"\0", 1)[0] == name:
            return off, size
    raise AssertionError(f"no section {name!r}")


def _nvdisasm() -> str | None:
    for cand in [os.environ.get("NVDISASM"), shutil.which("nvdisasm"),
                 *sorted(glob.glob("/usr/local/cuda*/bin/nvdisasm"))]:
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def test_illegal_cubins_are_patched_at_the_marker(binary, tmp_path):
    res = run(binary, "--write-illegal-cubins", str(tmp_path))
    assert res.returncode == 0, res.stderr
    built = sorted(int(p.name[len("illegal_sm"):-len(".cubin")])
                   for p in tmp_path.glob("illegal_sm*.cubin") if ".patched" not in p.name)
    assert 90 in built and set(built) <= set(ARCHS)  # sm_90: H100, H200
    for sm in built:
        orig = (tmp_path / f"illegal_sm{sm}.cubin").read_bytes()
        patched = (tmp_path / f"illegal_sm{sm}.patched.cubin").read_bytes()
        assert len(orig) == len(patched)
        diff = [i for i in range(len(orig)) if orig[i] != patched[i]]
        off, size = _text_section(orig, b".text.gpuos_illegal")
        start = diff[0] - (diff[0] - off) % 16  # the 16-byte instruction holding the change
        assert off <= start < off + size and diff[-1] < start + 8  # only its low 64 bits
        assert struct.unpack_from("<I", orig, start + 4)[0] == MARKER
        assert struct.unpack_from("<Q", patched, start)[0] == INVALID_LO
        assert patched[start + 8:start + 16] == orig[start + 8:start + 16]  # control bits kept


def test_patched_instruction_does_not_decode(binary, tmp_path):
    nvdisasm = _nvdisasm()
    if not nvdisasm:
        pytest.skip("no nvdisasm (NVDISASM=..., PATH, /usr/local/cuda*/bin)")
    assert run(binary, "--write-illegal-cubins", str(tmp_path)).returncode == 0
    for orig in sorted(tmp_path.glob("illegal_sm*[0-9].cubin")):
        ok = subprocess.run([nvdisasm, "-c", str(orig)], capture_output=True, text=True)
        assert ok.returncode == 0, ok.stderr
        bad = subprocess.run([nvdisasm, "-c", str(orig.with_suffix(".patched.cubin"))],
                             capture_output=True, text=True)
        assert bad.returncode != 0 and "Illegal instruction" in bad.stderr, (orig, bad.stderr)


# -- gpuos faults inject (gpuos.faults.inject) ------------------------------------------


def _collect(monkeypatch, binary: Path | str, **kw) -> tuple[int, list[str], list[str]]:
    monkeypatch.setenv(inj.ENV, str(binary))
    out: list[str] = []
    err: list[str] = []
    rc = inj.inject_cmd(out=out.append, err=err.append, **kw)
    return rc, out, err


def test_wrapper_runs_the_binary(monkeypatch, binary, stub_driver):
    monkeypatch.setenv("LD_LIBRARY_PATH", str(stub_driver))
    rc, out, err = _collect(monkeypatch, binary, kind="ro-write", json_out=True)
    assert rc == inj.EXIT_SETUP
    (line,) = [json.loads(o) for o in out]
    assert line["kind"] == "ro-write" and line["stage"] == "setup-failed"
    assert line["error"] == "cudaErrorNoDevice"
    assert len(err) == 1 and "cudaErrorNoDevice" in err[0]


def _stand_in(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "fake-inject"
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(0o755)
    return p


def test_wrapper_passes_options_streams_and_keeps_the_exit_code(monkeypatch, tmp_path):
    fake = _stand_in(tmp_path, 'echo "args: $*"\necho "first"\necho "to stderr" >&2\n'
                               'echo "second"\nexit 5\n')
    rc, out, err = _collect(monkeypatch, fake, kind="trap", delay=0.5, device=1,
                            after_iterations=3, json_out=True)
    assert rc == inj.EXIT_NO_FAULT
    assert out == ["args: --kind trap --delay 0.5 --device 1 --after-iterations 3 --json",
                   "first", "second"]
    assert err == ["to stderr"]


def test_wrapper_reports_death_by_signal(monkeypatch, tmp_path):
    fake = _stand_in(tmp_path, "kill -9 $$\n")
    rc, _, _ = _collect(monkeypatch, fake, kind="none")
    assert rc == 128 + 9


def test_wrapper_missing_binary(monkeypatch, tmp_path):
    rc, out, err = _collect(monkeypatch, tmp_path / "nope", kind="oob-read", json_out=True)
    assert rc == inj.EXIT_SETUP
    (line,) = [json.loads(o) for o in out]
    assert line["stage"] == "setup-failed" and line["error"] == "injector-missing"
    assert len(err) == 1 and "GPUOS_INJECT" in err[0]


def test_click_command(tmp_path, binary, stub_driver):
    """The click command, as `python -m gpuos.faults.inject` runs it (exit codes are real)."""
    env = dict(os.environ, GPUOS_INJECT=str(binary), LD_LIBRARY_PATH=str(stub_driver))
    cmd = [sys.executable, "-m", "gpuos.faults.inject"]
    res = subprocess.run([*cmd, "--kind", "assert", "--json"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert res.returncode == inj.EXIT_SETUP, res.stderr
    assert json_lines(res.stdout)[0]["stage"] == "setup-failed"
    bad = subprocess.run([*cmd, "--kind", "segfault"], capture_output=True, text=True, env=env)
    assert bad.returncode == inj.EXIT_USAGE and "segfault" in bad.stderr
    helped = subprocess.run([*cmd, "--help"], capture_output=True, text=True, env=env)
    assert helped.returncode == 0
    assert all(kind in helped.stdout for kind in inj.KINDS)
    assert all(f"{code} " in helped.stdout for code in inj.EXIT_CODES)
