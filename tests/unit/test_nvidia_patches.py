"""The patch series against NVIDIA's open kernel modules (patches/): its files, the
source tools/nvidia-src.sh takes and verifies, and a build of nvidia-uvm.ko.

The source is the kernel-open/ tree of github.com/NVIDIA/open-gpu-kernel-modules at the
tag pinned in patches/series.lock, verified by a content hash of the tree (tree-sha256).
Offline it comes from the vendor copy ../shared/vendor/<vendor> next to the checkout
($GPUOS_NVIDIA_VENDOR overrides the directory) or from $GPUOS_NVIDIA_TARBALL.

- The file checks run everywhere.
- The source checks (nvidia-src.sh: archives, verification, caching; a second or so
  each, no build) run wherever such a copy of the source exists, in private caches.
- The build tests (marker `nvidia`) run tools/nvidia-build.sh: verify and patch the
  source, build nvidia-uvm.ko against Debian's packaged headers (about two minutes on
  two cores from nothing), check what it links. They run whenever the source is
  available offline (the vendor copy, $GPUOS_NVIDIA_TARBALL, or an existing cache in
  $GPUOS_NVIDIA_CACHE, default /var/cache/gpuos-nvidia) or GPUOS_NVIDIA_BUILD=1 (then a
  connected machine downloads the tag); they skip, saying why, otherwise or when the
  build tools or the kernel headers are missing.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PATCHES = ROOT / "patches"
SRC = ROOT / "tools" / "nvidia-src.sh"
BUILD = ROOT / "tools" / "nvidia-build.sh"
CACHE = Path(os.environ.get("GPUOS_NVIDIA_CACHE", "/var/cache/gpuos-nvidia"))
VENDOR_DIR = Path(os.environ.get("GPUOS_NVIDIA_VENDOR", ROOT.parent / "shared" / "vendor"))


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
        if words:
            assert len(words) == 2, f"series.lock: not 'key value': {line!r}"
            assert words[0] not in out, f"series.lock: {words[0]} twice"
            out[words[0]] = words[1]
    return out


PIN = lock()


def tree_hash(root: Path) -> str:
    """tree-sha256 as series.lock defines it, computed here independently of the script."""
    lines = []
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix().encode()
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            lines.append((rel, b"symlink " + os.fsencode(os.readlink(path))))
        elif stat.S_ISREG(mode):
            lines.append((rel, hashlib.sha256(path.read_bytes()).hexdigest().encode()))
        else:
            assert stat.S_ISDIR(mode), path
    return hashlib.sha256(b"".join(r + b"\0" + v + b"\n" for r, v in sorted(lines))).hexdigest()


# --- the files ----------------------------------------------------------------------


def test_series_lists_every_patch():
    names = series()
    assert names, "patches/series is empty"
    assert sorted(names) == sorted(p.name for p in PATCHES.glob("*.patch"))
    assert names == sorted(names), "patches are numbered in the order they apply"


def test_lock_pins_a_github_tag_by_tree_hash():
    assert set(PIN) == {"source", "repository", "tag", "commit", "tree-sha256", "vendor"}
    assert PIN["source"] == "github"
    assert PIN["repository"] == "NVIDIA/open-gpu-kernel-modules"
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?", PIN["tag"])
    assert re.fullmatch(r"[0-9a-f]{40}", PIN["commit"])
    assert re.fullmatch(r"[0-9a-f]{64}", PIN["tree-sha256"])
    assert PIN["vendor"] == f"open-gpu-kernel-modules-{PIN['tag']}-kernel-open.tar.xz"


@pytest.mark.parametrize("name", series())
def test_patch_has_description_and_p1_paths(name):
    text = (PATCHES / name).read_text()
    head, sep, _ = text.partition("\ndiff --git ")
    assert sep, f"{name}: no diff"
    assert len(head.split("\n---\n")[0].strip().splitlines()) >= 3, f"{name}: describe the patch"
    targets = re.findall(r"^\+\+\+ (\S+)", text, re.M)
    assert targets and all(t.startswith("b/") for t in targets), f"{name}: -p1 paths (b/...)"
    # Relative to kernel-open/ (b/nvidia-uvm/...), not to the repository's top.
    assert not any(t.startswith("b/kernel-open/") for t in targets), f"{name}: paths inside kernel-open/"
    # Nothing but the kernel-open tree: no gpuos header is patched in (nvidia-src.sh copies them).
    assert not any(t.startswith("b/nvidia-uvm/gpuos/") for t in targets)


# --- the source: nvidia-src.sh --------------------------------------------------------


def offline_source() -> Path | None:
    """A copy of the pinned tag available without a network: $GPUOS_NVIDIA_TARBALL or the vendor copy."""
    env = os.environ.get("GPUOS_NVIDIA_TARBALL")
    if env:
        return Path(env)
    vendor = VENDOR_DIR / PIN["vendor"]
    return vendor if vendor.is_file() else None


@pytest.fixture(scope="module")
def source_tarball() -> Path:
    src = offline_source()
    if src is None:
        pytest.skip(f"no copy of NVIDIA's source: neither {VENDOR_DIR / PIN['vendor']} "
                    "nor $GPUOS_NVIDIA_TARBALL")
    for tool in ("tar", "xz", "patch", "flock", "python3"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} missing")
    return src


@pytest.fixture(scope="module")
def kernel_open(source_tarball: Path, tmp_path_factory) -> Path:
    """The pinned tree, unpacked here (by tar, not by the script): to repack and modify."""
    out = tmp_path_factory.mktemp("src")
    subprocess.run(["tar", "-xf", str(source_tarball), "-C", str(out)], check=True)
    found = sorted(out.glob("kernel-open")) + sorted(out.glob("*/kernel-open"))
    assert len(found) == 1, found
    return found[0]


def pack(tree: Path, out: Path, top: str, compression: str = "gz") -> Path:
    """Repack TREE as OUT with kernel-open/ under TOP ("" or "./" or "dir/"), with other
    times and modes than the original (they are not part of the tree hash)."""
    def meta(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.mtime = 1_000_000_000
        ti.mode = 0o700 if ti.isdir() else 0o600
        ti.uname = ti.gname = "someone"
        ti.uid = ti.gid = 4242
        return ti
    with tarfile.open(out, f"w:{compression}") as tf:
        tf.add(tree, arcname=f"{top}kernel-open", filter=meta)
    return out


def run_src(*args: str, cache: Path, tmp_path: Path, env: dict[str, str] | None = None,
            check: bool | None = None) -> subprocess.CompletedProcess:
    """nvidia-src.sh with a private cache, an empty vendor directory and no network
    (a GitHub URL that cannot answer), unless ENV says otherwise."""
    empty = tmp_path / "no-vendor"
    empty.mkdir(exist_ok=True)
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPUOS_NVIDIA_")}
    full.update(GPUOS_NVIDIA_VENDOR=str(empty), GPUOS_NVIDIA_GITHUB=f"file://{tmp_path}/no-github")
    full.update(env or {})
    proc = subprocess.run([str(SRC), "--cache", str(cache), *args], capture_output=True,
                          text=True, env=full, timeout=300)
    if check is True:
        assert proc.returncode == 0, proc.stderr
    if check is False:
        assert proc.returncode != 0, proc.stderr
        assert proc.stderr.splitlines()[-1].startswith("nvidia-src: error: "), proc.stderr
    return proc


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def test_src_help():
    proc = subprocess.run([str(SRC), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert "Usage: tools/nvidia-src.sh" in proc.stdout and "--tarball FILE" in proc.stdout
    proc = subprocess.run([str(SRC), "--bogus"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown argument --bogus" in proc.stderr


def test_vendor_copy_matches_the_pin(source_tarball: Path, kernel_open: Path):
    """The pin is the hash of the vendor copy's tree (computed here, not by the script)."""
    assert tree_hash(kernel_open) == PIN["tree-sha256"]
    assert (kernel_open / "Kbuild").read_text().count(f'-DNV_VERSION_STRING=\\"{PIN["tag"]}\\"') == 1


@pytest.mark.parametrize("top,compression", [("", "gz"), ("./", "bz2"), ("elsewhere-1.0/", "xz")])
def test_src_same_tree_same_hash_in_any_archive(source_tarball, kernel_open, tmp_path, top, compression):
    """The vendor .tar.xz and the same tree repacked (other compression, other top
    directory or none, other modes, owners and times) verify against the same pin."""
    pin = PIN["tree-sha256"]
    first = run_src("--pristine", "--tarball", str(source_tarball), cache=tmp_path / "a",
                    tmp_path=tmp_path, check=True)
    repacked = pack(kernel_open, tmp_path / f"repacked.tar.{compression}", top, compression)
    second = run_src("--pristine", "--tarball", str(repacked), cache=tmp_path / "b",
                     tmp_path=tmp_path, check=True)
    for proc in (first, second):
        assert f"tree-sha256 {pin}" in proc.stderr
    a, b = Path(last_line(first.stdout)), Path(last_line(second.stdout))
    assert a.name == b.name == "kernel-open"
    assert a.parent.name == b.parent.name == f"pristine-{PIN['tag']}-{pin[:16]}"
    assert tree_hash(a) == tree_hash(b) == pin


@pytest.mark.parametrize("change", ["modify", "add", "remove", "symlink"])
def test_src_refuses_a_modified_tree(kernel_open, tmp_path, change):
    tree = tmp_path / "tree" / "kernel-open"
    shutil.copytree(kernel_open, tree, symlinks=True)
    if change == "modify":
        with open(tree / "nvidia-uvm" / "uvm.c", "a") as f:
            f.write("\n")
    elif change == "add":
        (tree / "nvidia-uvm" / "extra.c").write_text("int x;\n")
    elif change == "remove":
        (tree / "nvidia" / "nv-p2p.c").unlink()
    else:
        os.symlink("uvm_va_space.c", tree / "nvidia-uvm" / "alias.c")
    found = tree_hash(tree)
    assert found != PIN["tree-sha256"]
    bad = pack(tree, tmp_path / "bad.tar.gz", "open-gpu-kernel-modules-x/")
    cache = tmp_path / "cache"
    proc = run_src("--tarball", str(bad), cache=cache, tmp_path=tmp_path, check=False)
    error = last_line(proc.stderr)
    assert "tree hash mismatch" in error, proc.stderr
    assert f"expected {PIN['tree-sha256']}" in error and f"found {found}" in error, error
    assert proc.stdout == ""
    # Nothing kept: no pristine tree, no temporary directory.
    assert sorted(p.name for p in cache.iterdir()) == [".lock"]


def test_src_tarball_without_kernel_open(kernel_open, tmp_path):
    # kernel-open/ two levels down does not count.
    deep = pack(kernel_open, tmp_path / "deep.tar.gz", "a/b/")
    proc = run_src("--tarball", str(deep), cache=tmp_path / "c", tmp_path=tmp_path, check=False)
    assert "no kernel-open/ directory in" in last_line(proc.stderr) and str(deep) in proc.stderr
    # Not an archive.
    junk = tmp_path / "junk.tar.xz"
    junk.write_text("not a tar archive\n")
    proc = run_src("--tarball", str(junk), cache=tmp_path / "c", tmp_path=tmp_path, check=False)
    assert "cannot read" in last_line(proc.stderr) and "as a tar archive" in last_line(proc.stderr)
    # No such file (from the environment).
    proc = run_src(cache=tmp_path / "c", tmp_path=tmp_path, check=False,
                   env={"GPUOS_NVIDIA_TARBALL": str(tmp_path / "missing.tar.xz")})
    assert "GPUOS_NVIDIA_TARBALL: no such file" in last_line(proc.stderr)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [".lock"]


def test_src_patches_and_caches(source_tarball, tmp_path):
    """A fresh cache: unpack, verify, patch, copy the gpuos headers; the second run
    prints the same tree and does nothing; the pristine tree is never modified."""
    cache = tmp_path / "cache"
    env = {"GPUOS_NVIDIA_TARBALL": str(source_tarball)}
    first = run_src(cache=cache, tmp_path=tmp_path, env=env, check=True)
    for name in series():
        assert f"applying {name}" in first.stderr
    tree = Path(last_line(first.stdout))
    assert tree.name == "kernel-open" and tree.parent.name.startswith("tree-")
    assert (cache / "tree").resolve() == tree.parent.resolve()
    for src, dst in (("kmod/include/gpuos_hooks.h", "nvidia-uvm/gpuos/include/gpuos_hooks.h"),
                     ("kmod/uapi/gpuos.h", "nvidia-uvm/gpuos/uapi/gpuos.h")):
        assert (tree / dst).read_bytes() == (ROOT / src).read_bytes()
    for name in series():   # every file a patch creates or changes is there
        for target in re.findall(r"^\+\+\+ b/(\S+)", (PATCHES / name).read_text(), re.M):
            assert (tree / target).is_file(), target
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.name != ".lock"}

    t0 = time.monotonic()
    second = run_src(cache=cache, tmp_path=tmp_path, env=env, check=True)
    assert time.monotonic() - t0 < 10
    assert last_line(second.stdout) == str(tree)
    assert second.stderr == "", second.stderr      # nothing unpacked, verified or applied
    after = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.name != ".lock"}
    assert after == before

    pristine = run_src("--pristine", cache=cache, tmp_path=tmp_path, env=env, check=True)
    assert tree_hash(Path(last_line(pristine.stdout))) == PIN["tree-sha256"]

    refreshed = run_src("--refresh", cache=cache, tmp_path=tmp_path, env=env, check=True)
    assert "unpacking" in refreshed.stderr and f"tree-sha256 {PIN['tree-sha256']}" in refreshed.stderr
    assert last_line(refreshed.stdout) == str(tree)


def test_src_source_order(source_tarball, kernel_open, tmp_path):
    """--tarball, then $GPUOS_NVIDIA_TARBALL, then the vendor copy, then GitHub."""
    vendor = tmp_path / "vendor"
    vendor.mkdir()
    shutil.copy(source_tarball, vendor / PIN["vendor"])
    bad_tree = tmp_path / "bad" / "kernel-open"
    shutil.copytree(kernel_open, bad_tree)
    (bad_tree / "Makefile").write_text("all:\n")
    bad = pack(bad_tree, tmp_path / "bad.tar.xz", "", "xz")

    # The vendor copy, when nothing else is given.
    proc = run_src("--pristine", cache=tmp_path / "1", tmp_path=tmp_path, check=True,
                   env={"GPUOS_NVIDIA_VENDOR": str(vendor)})
    assert f"from the vendor copy {vendor / PIN['vendor']}" in proc.stderr
    # $GPUOS_NVIDIA_TARBALL before the vendor copy (the bad one is read, and refused).
    proc = run_src("--pristine", cache=tmp_path / "2", tmp_path=tmp_path, check=False,
                   env={"GPUOS_NVIDIA_VENDOR": str(vendor), "GPUOS_NVIDIA_TARBALL": str(bad)})
    assert "tree hash mismatch" in proc.stderr and str(bad) in proc.stderr
    # --tarball before $GPUOS_NVIDIA_TARBALL.
    proc = run_src("--pristine", "--tarball", str(source_tarball), cache=tmp_path / "3",
                   tmp_path=tmp_path, check=True, env={"GPUOS_NVIDIA_TARBALL": str(bad)})
    assert f"from {source_tarball} (--tarball)" in proc.stderr
    # Nothing local: GitHub, which cannot be reached here.
    proc = run_src("--pristine", cache=tmp_path / "4", tmp_path=tmp_path, check=False)
    error = last_line(proc.stderr)
    assert "cannot download" in error and "--tarball" in error, error
    assert f"{PIN['repository']}/archive/refs/tags/{PIN['tag']}.tar.gz" in error


def test_src_default_vendor_path(source_tarball, tmp_path):
    """Without $GPUOS_NVIDIA_VENDOR: ../shared/vendor next to the checkout."""
    default = ROOT.parent / "shared" / "vendor" / PIN["vendor"]
    if not default.is_file():
        pytest.skip(f"no {default}")
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPUOS_NVIDIA_")}
    full["GPUOS_NVIDIA_GITHUB"] = f"file://{tmp_path}/no-github"
    proc = subprocess.run([str(SRC), "--pristine", "--cache", str(tmp_path / "c")],
                          capture_output=True, text=True, env=full, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "from the vendor copy" in proc.stderr and f"shared/vendor/{PIN['vendor']}" in proc.stderr


def test_src_downloads_the_tag_archive(kernel_open, tmp_path):
    """GitHub's archive layout (<name>-<tag>/ with src/ etc. next to kernel-open/),
    served from a file:// URL: only kernel-open/ is taken, and verified."""
    top = f"open-gpu-kernel-modules-{PIN['tag']}"
    stage = tmp_path / "stage" / top
    shutil.copytree(kernel_open, stage / "kernel-open")
    (stage / "src" / "kernel-open").mkdir(parents=True)
    (stage / "src" / "kernel-open" / "decoy.c").write_text("decoy\n")
    (stage / "README.md").write_text("readme\n")
    archive = tmp_path / "gh" / PIN["repository"] / "archive" / "refs" / "tags" / f"{PIN['tag']}.tar.gz"
    archive.parent.mkdir(parents=True)
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(stage, arcname=top)
    proc = run_src("--pristine", cache=tmp_path / "c", tmp_path=tmp_path, check=True,
                   env={"GPUOS_NVIDIA_GITHUB": f"file://{tmp_path}/gh"})
    assert "downloading" in proc.stderr and f"tree-sha256 {PIN['tree-sha256']}" in proc.stderr
    pristine = Path(last_line(proc.stdout))
    assert tree_hash(pristine) == PIN["tree-sha256"]
    assert sorted(p.name for p in pristine.parent.iterdir()) == [".gpuos-pristine", "kernel-open"]


def test_src_unpinned_tag(kernel_open, source_tarball, tmp_path):
    tag = "999.1"
    other = tmp_path / "other" / "kernel-open"
    shutil.copytree(kernel_open, other)
    kbuild = other / "Kbuild"
    kbuild.write_text(kbuild.read_text().replace(f'NV_VERSION_STRING=\\"{PIN["tag"]}\\"',
                                                 f'NV_VERSION_STRING=\\"{tag}\\"'))
    archive = pack(other, tmp_path / "other.tar.gz", f"open-gpu-kernel-modules-{tag}/")
    # Unverified, said so; the patches are applied.
    proc = run_src("--tag", tag, "--tarball", str(archive), cache=tmp_path / "c",
                   tmp_path=tmp_path, check=True)
    assert "NOT verified" in proc.stderr and f"maintained for {PIN['tag']} only" in proc.stderr
    assert f"tree-sha256 {tree_hash(other)}" in proc.stderr
    for name in series():
        assert f"applying {name}" in proc.stderr
    # An archive of another version than the tag asked for.
    proc = run_src("--tag", tag, "--tarball", str(source_tarball), cache=tmp_path / "d",
                   tmp_path=tmp_path, check=False)
    assert f"version '{PIN['tag']}'" in last_line(proc.stderr) and f"not {tag}" in last_line(proc.stderr)
    # A tag the patches do not apply to exactly: the first context line of the first
    # patch's first hunk changed (patch --fuzz=1 would still apply it).
    text = (PATCHES / series()[0]).read_text()
    m = re.search(r"^--- a/\S+\n\+\+\+ b/(\S+)\n@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@.*\n ", text, re.M)
    assert m, "the first patch changes no file with a hunk that starts with context"
    target, line = other / m.group(1), int(m.group(2))
    lines = target.read_text().splitlines(keepends=True)
    lines[line - 1] = lines[line - 1].rstrip("\n") + " /* changed */\n"
    target.write_text("".join(lines))
    archive = pack(other, tmp_path / "other2.tar.gz", "")
    proc = run_src("--tag", tag, "--tarball", str(archive), cache=tmp_path / "e",
                   tmp_path=tmp_path, check=False)
    error = last_line(proc.stderr)
    assert f"{series()[0]} does not apply to the unpinned tag {tag}" in error, proc.stderr


# --- the build: nvidia-build.sh (marker nvidia) ---------------------------------------


def _build_wanted() -> str | None:
    if os.environ.get("GPUOS_NVIDIA_BUILD") == "1" or offline_source() is not None:
        return None
    if any(CACHE.glob("pristine-*/.gpuos-pristine")):
        return None
    return (f"NVIDIA's source is not available offline: no {VENDOR_DIR / PIN['vendor']}, "
            f"no $GPUOS_NVIDIA_TARBALL, no cache in {CACHE} (GPUOS_NVIDIA_BUILD=1 downloads it)")


def _build_possible() -> str | None:
    probe = CACHE
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        return f"{probe} is not writable (the cache {CACHE}; set GPUOS_NVIDIA_CACHE)"
    for tool in ("dpkg-query", "make", "gcc", "patch", "tar", "xz", "flock", "nm", "modinfo",
                 "objcopy", "strings"):
        if not shutil.which(tool):
            return f"{tool} missing"
    if kernel_abi() is None:
        return "linux-headers-amd64 is not installed"
    return None


def kernel_abi() -> str | None:
    probe = subprocess.run(["dpkg-query", "-W", "-f=${Depends}", "linux-headers-amd64"],
                           capture_output=True, text=True)
    m = re.search(r"linux-headers-(\d\S*)-amd64", probe.stdout)
    return m.group(1) if probe.returncode == 0 and m else None


def expected(name: str) -> list[str]:
    """One of the lists at the top of nvidia-build.sh (EXPECT_FUNCTIONS, ...)."""
    m = re.search(rf"^{name}=\((.*?)^\)", BUILD.read_text(), re.M | re.S)
    assert m, name
    return re.sub(r"#[^\n]*", "", m.group(1)).split()


def run_build() -> subprocess.CompletedProcess:
    return subprocess.run([str(BUILD), "--cache", str(CACHE)], capture_output=True, text=True,
                          timeout=3000)


@pytest.fixture(scope="module")
def built() -> Path:
    reason = _build_wanted() or _build_possible()
    if reason:
        pytest.skip(reason)
    t0 = time.monotonic()
    proc = run_build()
    assert proc.returncode == 0, proc.stderr[-4000:]
    build = Path(proc.stdout.strip().splitlines()[-1])
    print(f"tools/nvidia-build.sh: {time.monotonic() - t0:.1f} s")
    return build


@pytest.mark.nvidia
def test_uvm_built_for_the_headers(built: Path):
    uvm = built / "nvidia-uvm.ko"
    assert uvm.is_file()
    vermagic = subprocess.run(["modinfo", "-F", "vermagic", str(uvm)], capture_output=True,
                              text=True, check=True).stdout
    assert vermagic.startswith(f"{kernel_abi()}-amd64 "), vermagic
    version = subprocess.run(["modinfo", "-F", "version", str(uvm)], capture_output=True,
                             text=True, check=True).stdout.strip()
    assert version == PIN["tag"]


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
def test_uvm_imports_are_exported(built: Path):
    """What modpost could not check (nvidia.ko is not built): every import is exported by
    the kernel or by nvidia.ko's sources (here: any .c/.h of nvidia/ and common/)."""
    uvm = built / "nvidia-uvm.ko"
    undefined = {line.split()[-1] for line in subprocess.run(
        ["nm", "-u", str(uvm)], capture_output=True, text=True, check=True).stdout.splitlines()}
    symvers = Path(f"/usr/src/linux-headers-{kernel_abi()}-amd64/Module.symvers")
    kernel = {line.split("\t")[1] for line in symvers.read_text().splitlines() if line}
    nvidia = set()
    for path in [*(built / "nvidia").rglob("*.[ch]"), *(built / "common").rglob("*.[ch]")]:
        nvidia |= set(re.findall(r"^\s*(?:NV_)?EXPORT_SYMBOL(?:_GPL)?\s*\(\s*(\w+)\s*\)",
                                 path.read_text(errors="replace"), re.M))
    assert undefined - kernel, "nvidia-uvm.ko imports nothing from nvidia.ko?"
    assert not undefined - kernel - nvidia, sorted(undefined - kernel - nvidia)
    assert {s for s in undefined - kernel if s.startswith("nvUvmInterface")}


@pytest.mark.nvidia
def test_uvm_has_the_hooks(built: Path, tmp_path: Path):
    uvm = built / "nvidia-uvm.ko"
    functions, names, params = (expected("EXPECT_FUNCTIONS"), expected("EXPECT_SYMBOL_GET"),
                                expected("EXPECT_PARAMS"))
    # What the first patch adds, at least (the lists grow with the series).
    assert {"uvm_gpuos_init", "uvm_gpuos_exit"} <= set(functions)
    assert {"gpuos_register_driver", "gpuos_unregister_driver"} <= set(names)
    assert "uvm_gpuos_attach" in params
    defined = subprocess.run(["nm", "--defined-only", str(uvm)], capture_output=True,
                             text=True, check=True).stdout
    for sym in functions:
        assert re.search(rf"\s[tT] {sym}$", defined, re.M), sym
    # The names symbol_get looks up are strings in the module's data, not only in its debug info.
    stripped = tmp_path / "nvidia-uvm.ko"
    subprocess.run(["objcopy", "--strip-debug", str(uvm), str(stripped)], check=True)
    strings = subprocess.run(["strings", "-a", str(stripped)], capture_output=True, text=True,
                             check=True).stdout.splitlines()
    for name in names:
        assert name in strings, name
    parm = subprocess.run(["modinfo", "-F", "parm", str(uvm)], capture_output=True,
                          text=True, check=True).stdout
    for param in params:
        assert re.search(rf"^{param}:", parm, re.M), param


@pytest.mark.nvidia
def test_build_is_incremental(built: Path):
    """Nothing changed: nothing is compiled again (the sync keeps the build directory's
    times, the conftest registration is not rewritten)."""
    t0 = time.monotonic()
    proc = run_build()
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert Path(proc.stdout.strip().splitlines()[-1]) == built
    log = (built / "gpuos-build.log").read_text()
    assert not re.search(r"^\s*CC \[M\]", log, re.M), log[-2000:]
    assert time.monotonic() - t0 < 120


@pytest.mark.nvidia
def test_source_is_cached(built: Path):
    """A second fetch does nothing: same tree, nothing unpacked or applied."""
    first = subprocess.run([str(SRC), "--cache", str(CACHE)], capture_output=True, text=True,
                           check=True)
    second = subprocess.run([str(SRC), "--cache", str(CACHE)], capture_output=True, text=True,
                            check=True)
    assert first.stdout.splitlines()[-1] == second.stdout.splitlines()[-1]
    assert built.name == f"build-{kernel_abi()}-uvm"
    for word in ("unpacking", "downloading", "applying"):
        assert word not in second.stderr
