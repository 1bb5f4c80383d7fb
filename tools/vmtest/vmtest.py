#!/usr/bin/env python3
"""vmtest.py - run this repo's kernel-facing tests inside a real Debian kernel under QEMU.

The host cannot load modules and has no usable KVM, so kernel code is tested in a VM
under QEMU's software emulation (TCG). The guest runs the Debian kernel that the
host's linux-headers-amd64 points at (never the host's own kernel), a Debian root
filesystem shared read-only over 9p under a tmpfs overlay, this repository read-only
at its host path, and a writable 9p share /out for results. See docs/vm-testing.md.

  prepare   build (once; cached, keyed by kernel ABI) the kernel, root filesystem, initramfs
  modules   build the repo's out-of-tree modules (Kbuild, kmod/) for the guest kernel
  run       boot the VM, run one command as root in the guest, exit with its status
  test      modules, then run the vm tests (pytest -m vm tests/vm) in the guest

`--kernel-tree DIR` (run, test, modules) boots a kernel of your own instead, built in DIR
(bzImage and modules_prepare, with virtio-pci, 9p and overlayfs built in): a debug kernel
with KASAN and lockdep, say (tools/vmtest/debug-kernel.sh builds one). The same root
filesystem; the modules are built against DIR.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("GPUOS_VM_CACHE", "/var/cache/gpuos-vm"))
PACKAGES = ["mount", "python3", "python3-pyroute2", "python3-pytest", "python3-click",
            "python3-bpfcc", "bpftrace", "kmod", "util-linux", "procps",
            "xz-utils"]  # bcc unpacks a debug kernel's built-in headers (CONFIG_IKHEADERS)
EXCLUDES = ["/usr/share/man/*", "/usr/share/doc/*", "/usr/share/locale/*", "/usr/share/info/*"]
NINEP = "trans=virtio,version=9p2000.L,msize=262144"
# Statuses of our own, outside what a test command normally returns.
TIMEOUT, NO_RESULT = 124, 125

# Stage 1, pid 1 of the initramfs: the Debian root is the read-only 9p share "root"
# under a tmpfs overlay (the guest may write anywhere; the cache stays clean), the
# results share is /out, and the run's own /out/guest.sh (written by `run`) takes
# over as pid 1. Nothing run-specific lives here, so one initramfs serves every run.
# Any failure ends init: the kernel panics and QEMU exits (-no-reboot), no waiting.
INIT = """#!/bin/busybox sh
set -e
export PATH=/bin
mount -t devtmpfs dev /dev
exec </dev/console >/dev/console 2>&1
{insmods}
mount -t 9p -o {ninep},ro,cache=loose root /lower
mount -t tmpfs rw /rw && mkdir /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work root /root
mkdir -p /root/out && mount -t 9p -o {ninep} out /root/out
mount --move /dev /root/dev
exec switch_root /root /bin/sh /out/guest.sh
"""

# Stage 2, written into /out for each run: mounts, environment, the command. The
# status file is the only result the host trusts; isa-debug-exit then stops QEMU at
# once (writing 0 to port 0xf4 makes QEMU exit with 1), sysrq poweroff if it did not.
GUEST = """#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t tracefs tracefs /sys/kernel/tracing
mount -t debugfs debugfs /sys/kernel/debug
mount -t bpf bpf /sys/fs/bpf
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mkdir -p /dev/pts /dev/shm && mount -t devpts devpts /dev/pts && mount -t tmpfs shm /dev/shm
mount -t tmpfs tmp /tmp && mount -t tmpfs run /run
mkdir -p {repo} && mount -t 9p -o {ninep},ro,cache=loose repo {repo}
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
export GPUOS_IN_VM=1 GPUOS_VM_KVER={kver} GPUOS_KMOD_DIR=/out/kmod
[ -f /out/kconfig ] && export GPUOS_VM_KCONFIG=/out/kconfig
export PYTHONPATH={repo}/userspace PYTHONDONTWRITEBYTECODE=1
echo "gpuos-vm: the command starts $(cut -d' ' -f1 /proc/uptime) s after boot"
cd {repo} && {cmd} >/out/output 2>&1 </dev/null
echo $? >/out/status
sync
printf '\\000' | dd of=/dev/port bs=1 seek=244 count=1 status=none
echo o >/proc/sysrq-trigger
"""


def die(msg: str, status: int = 1):
    print(f"vmtest: error: {msg}", file=sys.stderr)
    sys.exit(status)


def sh(*cmd, **kw) -> str:
    """Run a command, return its stdout; on failure show its output and stop."""
    p = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, **kw)
    if p.returncode:
        die(f"{shlex.join(map(str, cmd))} exited {p.returncode}:\n{p.stdout[-4000:]}")
    return p.stdout


def kernel() -> tuple[str, str]:
    """(KVER, version) of the ABI linux-headers-amd64 points at; never the host's kernel."""
    p = subprocess.run(["dpkg-query", "-W", "-f=${Depends}", "linux-headers-amd64"],
                       capture_output=True, text=True)
    m = re.search(r"linux-headers-(\S+) \(= (\S+)\)", p.stdout)
    if not m:
        die("linux-headers-amd64 is not installed (tools/install.sh --dev installs it)")
    return m.group(1), m.group(2)


def apt_sources(codename: str, etc: Path = Path("/etc/apt")) -> list[str]:
    """The system's apt sources for CODENAME, -updates and -security, as one-line entries."""
    suites, out = {codename, f"{codename}-updates", f"{codename}-security"}, []
    for f in [etc / "sources.list", *sorted(etc.glob("sources.list.d/*.list"))]:
        for line in f.read_text().splitlines() if f.exists() else []:
            m = re.match(r"deb\s+(\[[^]]*\]\s+)?(\S+)\s+(\S+)\s+(.+)", line.strip())
            if m and m.group(3) in suites:
                out.append(line.strip())
    for f in sorted(etc.glob("sources.list.d/*.sources")):
        text = "\n".join(ln for ln in f.read_text().splitlines() if not ln.startswith("#"))
        for stanza in re.split(r"\n\s*\n", text):
            fields = dict(re.findall(r"^(\S+):[ \t]*((?:.*)(?:\n[ \t]+.*)*)", stanza, re.M))
            fields = {k.lower(): " ".join(v.split()) for k, v in fields.items()}
            if "deb" not in fields.get("types", "").split() or fields.get("enabled") == "no":
                continue
            keyring = fields.get("signed-by", "")
            opt = f"[signed-by={keyring}] " if keyring.startswith("/") else ""
            for uri in fields.get("uris", "").split():
                for suite in suites & set(fields.get("suites", "").split()):
                    out.append(f"deb {opt}{uri} {suite} {fields.get('components', 'main')}")
    if not any(f" {codename} " in s for s in out):
        die(f"no '{codename}' source in /etc/apt/sources.list*")
    return out


class Cache:
    """$GPUOS_VM_CACHE/KVER: rootfs/ (with the kernel in it), initramfs.cpio, stamp.json."""

    def __init__(self):
        self.kver, self.version = kernel()
        self.dir = CACHE / self.kver
        self.rootfs, self.initramfs = self.dir / "rootfs", self.dir / "initramfs.cpio"
        self.stamp_file, self.kmod = self.dir / "stamp.json", self.dir / "kmod"

    def stamp(self) -> dict:
        try:
            return json.loads(self.stamp_file.read_text())
        except (OSError, ValueError):
            return {}

    def record(self, **kw):
        st = {**self.stamp(), **kw, "kver": self.kver, "version": self.version}
        tmp = self.stamp_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(st, indent=1) + "\n")
        tmp.replace(self.stamp_file)

    def keys(self) -> tuple[str, str]:
        """What each product is built from: a change in any of it rebuilds that product."""
        rootfs = digest([self.kver, self.version, PACKAGES, EXCLUDES])
        return rootfs, digest([rootfs, INIT, NINEP])

    def ready(self) -> bool:
        st = self.stamp()
        return (st.get("rootfs"), st.get("initramfs")) == self.keys() and self.initramfs.exists()


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]


def build_rootfs(c: Cache):
    codename = re.search(r"^VERSION_CODENAME=(\S+)", Path("/etc/os-release").read_text(), re.M)
    if not codename:
        die("no VERSION_CODENAME in /etc/os-release")
    new = c.dir / "rootfs.new"
    shutil.rmtree(new, ignore_errors=True)
    print(f"vmtest: building the guest root filesystem (Debian {codename.group(1)}) with mmdebstrap")
    sh("mmdebstrap", "--mode=root", "--variant=essential", "--include=" + ",".join(PACKAGES),
       *[f"--dpkgopt=path-exclude={p}" for p in EXCLUDES], codename.group(1), new,
       *apt_sources(codename.group(1)))
    # The kernel (image and modules) goes into the root too: the initramfs takes its
    # modules from there and the guest can modprobe. bcc needs the headers. tar keeps
    # the merged-/usr symlinks (/lib -> usr/lib) that dpkg-deb -x would replace.
    common = re.search(r"(linux-headers-\S+-common)", sh("dpkg-query", "-W", "-f=${Depends}",
                                                         f"linux-headers-{c.kver}"))
    debs = [f"linux-image-{c.kver}", f"linux-headers-{c.kver}", common.group(1)]
    print(f"vmtest: unpacking {', '.join(debs)} {c.version} into it")
    with tempfile.TemporaryDirectory(dir=c.dir) as tmp:
        sh("apt-get", "-q", "-o", "APT::Sandbox::User=root", "download",
           *[f"{d}={c.version}" for d in debs], cwd=tmp)
        for deb in Path(tmp).glob("*.deb"):
            sh("sh", "-c", 'dpkg-deb --fsys-tarfile "$1" | tar -x --keep-directory-symlink -C "$2"',
               "-", deb, new)
    sh("depmod", "-b", new, c.kver)
    shutil.rmtree(c.rootfs, ignore_errors=True)
    new.rename(c.rootfs)


def build_initramfs(c: Cache):
    """busybox-static and the modules that 9p over virtio and overlayfs need."""
    print("vmtest: building the initramfs")
    deps = sh("modprobe", "-d", c.rootfs, "-S", c.kver, "-a", "--show-depends",
              "virtio_pci", "9pnet_virtio", "9p", "overlay")
    write_initramfs(c.initramfs, list(dict.fromkeys(re.findall(r"^insmod (\S+)", deps, re.M))))


def write_initramfs(path: Path, mods: list[str]):
    """busybox-static, these modules (loaded first) and INIT, as a cpio archive at PATH."""
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp)
        for d in ("bin", "dev", "lower", "rw", "root", "mod"):
            (stage / d).mkdir()
        shutil.copy2("/bin/busybox", stage / "bin")
        for applet in sh("/bin/busybox", "--list").split():
            if applet != "busybox":
                (stage / "bin" / applet).symlink_to("busybox")
        for m in mods:
            shutil.copy2(m, stage / "mod")
        insmods = "\n".join(f"insmod /mod/{Path(m).name}" for m in mods)
        (stage / "init").write_text(INIT.format(insmods=insmods, ninep=NINEP))
        (stage / "init").chmod(0o755)
        tmpfile = path.with_suffix(".tmp")
        with open(tmpfile, "wb") as f:
            subprocess.run("find . | cpio -o -H newc -R 0:0 --quiet", shell=True, cwd=stage,
                           stdout=f, check=True)
        tmpfile.replace(path)


def cmd_prepare(args) -> int:
    t0 = time.monotonic()
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two prepares at once would build over each other
        c = Cache()
        rootfs_key, initramfs_key = c.keys()
        if c.ready():
            print(f"vmtest: {c.dir} is prepared ({c.kver} {c.version})")
            return 0
        if os.geteuid() != 0:
            die("prepare builds the guest as root (mmdebstrap --mode=root); run it as root")
        c.dir.mkdir(exist_ok=True)
        if c.stamp().get("rootfs") != rootfs_key or not c.rootfs.is_dir():
            c.record(rootfs=None, initramfs=None)
            build_rootfs(c)
            c.record(rootfs=rootfs_key)
        build_initramfs(c)
        c.record(initramfs=initramfs_key, prepared=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 packages=PACKAGES)
        # The security suite keeps only the current ABI: older ones are never used again.
        for old in CACHE.iterdir():
            if old != c.dir and (old / "stamp.json").exists():
                shutil.rmtree(old)
    print(f"vmtest: prepared {c.dir} ({c.kver} {c.version}) in {time.monotonic() - t0:.0f} s")
    return 0


def build_modules(kver: str, dest: Path, tree: Path | None = None):
    """Build Kbuild + kmod/ for KVER (or for the kernel built in TREE) in a private copy;
    the .ko files go into DEST."""
    if not (REPO / "Kbuild").exists():
        print(f"vmtest: no kernel modules to build ({REPO}/Kbuild does not exist yet)")
        return
    # kbuild writes its objects next to the sources: build a fresh copy of the sources
    # only (git's view, so no stale objects from an in-tree build), where every file is
    # compiled and a warning from a file that did not change still fails the build.
    with tempfile.TemporaryDirectory(prefix="gpuos-kbuild-") as tmp:
        build = Path(tmp)
        sources = sh("git", "-C", REPO, "ls-files", "-zco", "--exclude-standard", "Kbuild", "kmod",
                     "patches/nvidia-uvm")
        for f in sources.split("\0"):
            if f and (REPO / f).is_file():
                (build / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / f, build / f)
        # GPUOS_TESTDRV=y: also the stand-in GPU driver that the vm tests load (see Kbuild).
        # A tree built without its modules has no Module.symvers; its vmlinux's exports
        # (vmlinux.symvers) are all there is to link against.
        extra = [] if tree is None else [f"KBUILD_EXTRA_SYMBOLS={tree / 'vmlinux.symvers'}"]
        p = subprocess.run(["make", "-C", str(tree or f"/usr/src/linux-headers-{kver}"), f"M={build}",
                            f"-j{os.cpu_count()}", "GPUOS_TESTDRV=y", *extra, "modules"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        print(p.stdout.replace(f"{build}/", f"{REPO}/"), end="")  # messages name the real sources
        if p.returncode:
            die(f"the module build failed (exit {p.returncode})")
        if re.search(r"warning:", p.stdout.replace("WARNING: Module.symvers is missing.", ""), re.I):
            die("the module build printed warnings; they count as errors")
        kos = sorted(build.rglob("*.ko"))
        for ko in kos:
            shutil.copy2(ko, dest)
    print(f"vmtest: built {', '.join(k.name for k in kos) or 'no modules'} for {kver}")


def cmd_modules(args) -> int:
    c = Cache()
    shutil.rmtree(c.kmod, ignore_errors=True)
    c.kmod.mkdir(parents=True)
    build_modules(c.kver, c.kmod, args.kernel_tree)
    return 0


def own_kernel(c: Cache, tree: Path) -> tuple[Path, Path, str]:
    """(bzImage, initramfs, release) of the kernel built in TREE; its initramfs loads no
    module (what the Debian kernel's loads must be built in)."""
    image = tree / "arch/x86/boot/bzImage"
    if not image.is_file():
        die(f"no {image}: build the kernel first (tools/vmtest/debug-kernel.sh)")
    release = (tree / "include/config/kernel.release").read_text().strip()
    initramfs = c.dir / "initramfs-builtin.cpio"
    key = digest([INIT, NINEP])
    stamp = initramfs.with_suffix(".key")
    if not initramfs.exists() or not stamp.exists() or stamp.read_text() != key:
        write_initramfs(initramfs, [])
        stamp.write_text(key)
    return image, initramfs, release


def cmd_run(args) -> int:
    if not args.cmd:
        die("run needs a command: vmtest.py run -- CMD...")
    if not shutil.which("qemu-system-x86_64"):
        die("qemu-system-x86_64 not found (tools/install.sh --dev installs it)", NO_RESULT)
    c = Cache()
    if not c.ready():
        die(f"the VM for {c.kver} is not prepared: run {__file__} prepare", NO_RESULT)
    out = Path(args.out or tempfile.mkdtemp(prefix="gpuos-vm-"))
    out.mkdir(parents=True, exist_ok=True)
    if (out / "status").exists():
        die(f"{out} holds an earlier run: give --out an empty directory")
    if not (out / "kmod").exists():  # `test` builds its own; else those of the last `modules`
        shutil.copytree(c.kmod, out / "kmod") if c.kmod.is_dir() else (out / "kmod").mkdir()
    image, initramfs, kver = f"{c.rootfs}/boot/vmlinuz-{c.kver}", c.initramfs, c.kver
    if args.kernel_tree:
        image, initramfs, kver = own_kernel(c, args.kernel_tree)
        shutil.copyfile(args.kernel_tree / ".config", out / "kconfig")  # what the tests may rely on
    (out / "guest.sh").write_text(GUEST.format(repo=shlex.quote(str(REPO)), ninep=NINEP,
                                               kver=kver, cmd=shlex.join(args.cmd)))
    append = "console=ttyS0 panic=-1 oops=panic" + ("" if args.verbose else " quiet")
    qemu = ["qemu-system-x86_64", "-accel", "tcg", "-cpu", "max", "-m", args.mem,
            "-smp", str(args.smp), "-nographic", "-no-reboot", "-nic", "none",
            "-kernel", str(image), "-initrd", str(initramfs),
            "-append", f"{append} {args.append}".strip(),
            "-device", "isa-debug-exit,iobase=0xf4,iosize=0x04"]
    for tag, path, ro in (("root", c.rootfs, True), ("out", out, False), ("repo", REPO, True)):
        qemu += ["-virtfs", f"local,path={path},mount_tag={tag},security_model=none,"
                 f"multidevs=remap{',readonly=on' if ro else ''}"]
    t0 = time.monotonic()
    with open(out / "console.log", "wb") as log:
        vm = subprocess.Popen(qemu, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
        timed_out = threading.Event()
        timer = threading.Timer(args.timeout, lambda: (timed_out.set(), vm.kill()))
        timer.start()
        for chunk in iter(lambda: vm.stdout.read1(65536), b""):
            log.write(chunk)
            if args.verbose:
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
        vm.wait()
        timer.cancel()
    took = time.monotonic() - t0
    if (out / "output").exists():
        sys.stdout.write((out / "output").read_text(errors="replace"))
        sys.stdout.flush()
    status = (out / "status").read_text().strip() if (out / "status").exists() else ""
    if status.isdigit():
        print(f"vmtest: guest command exited {status} ({took:.1f} s from boot to result; "
              f"console log {out}/console.log)", file=sys.stderr)
        return int(status)
    tail = (out / "console.log").read_text(errors="replace").splitlines()[-40:]
    print("\n".join(tail), file=sys.stderr)
    why = f"timed out after {args.timeout:.0f} s" if timed_out.is_set() else \
        f"QEMU exited {vm.returncode} without a result from the guest"
    print(f"vmtest: {why} (console log above and in {out}/console.log)", file=sys.stderr)
    return TIMEOUT if timed_out.is_set() else NO_RESULT


def cmd_test(args) -> int:
    args.out = args.out or tempfile.mkdtemp(prefix="gpuos-vm-")
    (Path(args.out) / "kmod").mkdir(parents=True)
    build_modules(Cache().kver, Path(args.out) / "kmod", args.kernel_tree)
    pytest_args = args.pytest_args
    if not any(a.startswith("tests/vm") for a in pytest_args):
        pytest_args = ["tests/vm", *pytest_args]
    args.cmd = ["python3", "-m", "pytest", "-m", "vm", "-p", "no:cacheprovider",
                "--junitxml=/out/junit.xml", *pytest_args]
    status = cmd_run(args)
    if args.junit and (Path(args.out) / "junit.xml").exists():
        shutil.copyfile(Path(args.out) / "junit.xml", args.junit)
    return status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("prepare", help="build the guest (cached; a no-op when up to date)",
                       description="Fetch the Debian kernel that linux-headers-amd64 points at, build "
                       f"the guest root filesystem (mmdebstrap) and the initramfs, under {CACHE}/KVER "
                       "($GPUOS_VM_CACHE). Idempotent: only what changed is rebuilt. Needs root.")
    p.set_defaults(func=cmd_prepare)
    p = sub.add_parser("modules", help="build Kbuild + kmod/ for the guest kernel",
                       description="Build the repo's out-of-tree modules (a copy of Kbuild and kmod/) "
                       "against /usr/src/linux-headers-KVER; any compiler or modpost warning fails. "
                       "The .ko files go where `run` gives them to the guest ($GPUOS_KMOD_DIR).")
    p.set_defaults(func=cmd_modules)
    modules = p
    run = sub.add_parser("run", help="boot the VM and run one command in it",
                         description="Boot the VM, run CMD as root in the guest (cwd: the repo, "
                         "read-only; PYTHONPATH=REPO/userspace, GPUOS_IN_VM=1, GPUOS_KMOD_DIR; /out is "
                         "the results share), print its output and exit with its status: "
                         f"{TIMEOUT} on timeout, {NO_RESULT} when the guest gave no result.")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    run.set_defaults(func=cmd_run)
    test = sub.add_parser("test", help="modules, then the vm tests in the guest",
                          description="Build the modules, then run `python3 -m pytest -m vm "
                          "-p no:cacheprovider --junitxml=/out/junit.xml tests/vm PYTEST_ARGS` in the "
                          "guest (tests/vm is left out when PYTEST_ARGS name tests under it).")
    test.add_argument("--junit", metavar="PATH", help="copy the guest's JUnit XML here")
    test.add_argument("pytest_args", nargs="*", metavar="PYTEST_ARGS", help="after --, e.g. -- -k smoke -x")
    test.set_defaults(func=cmd_test)
    for p in (modules, run, test):
        p.add_argument("--kernel-tree", type=Path, metavar="DIR",
                       default=Path(os.environ["GPUOS_VM_KERNEL_TREE"]) if os.environ.get("GPUOS_VM_KERNEL_TREE") else None,
                       help="boot the kernel built in DIR instead of Debian's, modules built against it "
                            "($GPUOS_VM_KERNEL_TREE)")
    for p in (run, test):
        p.add_argument("--timeout", type=float, default=600, help="seconds before the VM is killed (600)")
        p.add_argument("--mem", default="2G", help="guest memory (2G)")
        p.add_argument("--smp", type=int, default=2, help="guest CPUs (2)")
        p.add_argument("--append", default="", help="more kernel command line, e.g. panic_on_warn=1")
        p.add_argument("--out", metavar="DIR", help="results share (default: a new temporary directory)")
        p.add_argument("-v", "--verbose", action="store_true", help="show the boot log live (no `quiet`)")
    args = ap.parse_args(argv)
    if getattr(args, "cmd", None) and args.cmd[0] == "--":
        args.cmd = args.cmd[1:]
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
