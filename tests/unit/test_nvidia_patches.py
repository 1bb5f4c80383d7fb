"""The patch series against NVIDIA's open kernel module (patches/): its files, and a build.

The build tests (marker `nvidia`) run tools/nvidia-build.sh: fetch the pinned package,
apply the series, build nvidia.ko and nvidia-uvm.ko against Debian's packaged headers,
and check what nvidia-uvm.ko links. They need the package cache
($GPUOS_NVIDIA_CACHE, default /var/cache/gpuos-nvidia, created by tools/nvidia-src.sh)
or GPUOS_NVIDIA_BUILD=1 (then a cold run fetches 36 MB and builds for about two
minutes on two cores); otherwise they skip. The file checks run everywhere.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PATCHES = ROOT / "patches"
CACHE = Path(os.environ.get("GPUOS_NVIDIA_CACHE", "/var/cache/gpuos-nvidia"))


def series() -> list[str]:
    names = []
    for line in (PATCHES / "series").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line.split()[0])
    return names


def lock() -> dict[str, str]:
    out = {}
    for line in (PATCHES / "series.lock").read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if len(words) == 2:
            out[words[0]] = words[1]
    return out


def test_series_lists_every_patch():
    names = series()
    assert names, "patches/series is empty"
    assert sorted(names) == sorted(p.name for p in PATCHES.glob("*.patch"))
    assert names == sorted(names), "patches are numbered in the order they apply"


def test_lock_pins_version_and_sha256():
    pin = lock()
    assert pin["package"] == "nvidia-open-kernel-source"
    assert re.fullmatch(r"\d+\.\d+\.\d+-\d+", pin["version"])
    assert re.fullmatch(r"[0-9a-f]{64}", pin["sha256"])
    for key in ("suite", "component", "tarball", "tree"):
        assert pin[key]


@pytest.mark.parametrize("name", series())
def test_patch_has_description_and_p1_paths(name):
    text = (PATCHES / name).read_text()
    head, sep, _ = text.partition("\ndiff --git ")
    assert sep, f"{name}: no diff"
    assert len(head.split("\n---\n")[0].strip().splitlines()) >= 3, f"{name}: describe the patch"
    targets = re.findall(r"^\+\+\+ (\S+)", text, re.M)
    assert targets and all(t.startswith("b/") for t in targets), f"{name}: -p1 paths (b/...)"
    # Nothing but the kernel-open tree: no gpuos header is patched in (nvidia-src.sh copies them).
    assert not any(t.startswith("b/nvidia-uvm/gpuos/") for t in targets)


def _build_wanted() -> str | None:
    if os.environ.get("GPUOS_NVIDIA_BUILD") == "1":
        return None
    if not any(CACHE.glob("pristine-*/.gpuos-pristine")):
        return f"no NVIDIA source cache in {CACHE} (run tools/nvidia-src.sh, or set GPUOS_NVIDIA_BUILD=1)"
    return None


def _build_possible() -> str | None:
    if os.geteuid() != 0 and not os.access(CACHE.parent if not CACHE.exists() else CACHE, os.W_OK):
        return f"{CACHE} is not writable"
    for tool in ("dpkg-query", "make", "gcc", "patch", "nm", "modinfo", "objcopy", "strings"):
        if not shutil.which(tool):
            return f"{tool} missing"
    probe = subprocess.run(["dpkg-query", "-W", "-f=${Depends}", "linux-headers-amd64"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return "linux-headers-amd64 is not installed"
    return None


@pytest.fixture(scope="module")
def built() -> Path:
    reason = _build_wanted() or _build_possible()
    if reason:
        pytest.skip(reason)
    t0 = time.monotonic()
    proc = subprocess.run([str(ROOT / "tools" / "nvidia-build.sh"), "--cache", str(CACHE)],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    build = Path(proc.stdout.strip().splitlines()[-1])
    print(f"tools/nvidia-build.sh: {time.monotonic() - t0:.1f} s")
    return build


@pytest.mark.nvidia
def test_modules_built(built: Path):
    assert (built / "nvidia.ko").is_file()
    assert (built / "nvidia-uvm.ko").is_file()


@pytest.mark.nvidia
def test_uvm_does_not_depend_on_gpuos(built: Path):
    uvm = built / "nvidia-uvm.ko"
    depends = subprocess.run(["modinfo", "-F", "depends", str(uvm)],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert "gpuos" not in depends.split(","), depends
    undefined = subprocess.run(["nm", "-u", str(uvm)], capture_output=True, text=True,
                               check=True).stdout.split()
    assert not [s for s in undefined if s.startswith("gpuos_")]
    assert "__symbol_get" in undefined and "__symbol_put" in undefined


@pytest.mark.nvidia
def test_uvm_has_the_hooks(built: Path):
    uvm = built / "nvidia-uvm.ko"
    defined = subprocess.run(["nm", "--defined-only", str(uvm)], capture_output=True,
                             text=True, check=True).stdout
    for sym in ("uvm_gpuos_fatal_faults", "uvm_gpuos_fault_batch_serviced",
                "uvm_api_gpuos_migrate_ranges", "uvm_pmm_gpu_mark_root_chunk_evict_first",
                "uvm_gpuos_prefetch_pages"):
        assert re.search(rf"\s{sym}$", defined, re.M), sym
    params = subprocess.run(["modinfo", "-F", "parm", str(uvm)], capture_output=True,
                            text=True, check=True).stdout
    for param in ("uvm_gpuos_attach", "uvm_gpuos_isolate", "uvm_gpuos_batch_notify_us",
                  "uvm_gpuos_prefetch"):
        assert re.search(rf"^{param}:", params, re.M), param


@pytest.mark.nvidia
def test_source_is_cached(built: Path):
    """A second fetch does nothing: same tree, no download, well under a second or two."""
    t0 = time.monotonic()
    first = subprocess.run([str(ROOT / "tools" / "nvidia-src.sh"), "--cache", str(CACHE)],
                           capture_output=True, text=True, check=True)
    second = subprocess.run([str(ROOT / "tools" / "nvidia-src.sh"), "--cache", str(CACHE)],
                            capture_output=True, text=True, check=True)
    assert first.stdout.splitlines()[-1] == second.stdout.splitlines()[-1]
    assert "fetching" not in second.stderr and "applying" not in second.stderr
    assert time.monotonic() - t0 < 30
