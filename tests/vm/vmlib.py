"""Helpers of the kernel-facing tests (tests/vm): raw generic netlink, the test driver's
debugfs files, loading and unloading the modules, the kernel log, subprocesses.

Importable on the host too (conftest.py imports it there): the standard library and
gpuos.kernel.uapi only (no pyroute2, no bcc). fuzzlib.py builds on it, and runs as an
unprivileged child process, so nothing here may need root at import.
"""

from __future__ import annotations

import errno
import os
import re
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

from gpuos.kernel.uapi import GENL_NAME, Attr, Cmd, Counter

REPO = Path(__file__).resolve().parents[2]
HEADER = REPO / "kmod" / "uapi" / "gpuos.h"
VERSION_H = REPO / "kmod" / "version.h"
VM_DIR = Path(__file__).resolve().parent
DBG = Path("/sys/kernel/debug/gpuos_testdrv")
TRACEFS = Path("/sys/kernel/tracing/events/gpuos")
CGROUP2 = Path("/sys/fs/cgroup")

# an unprivileged user, as a user would be: no groups, no capabilities at all
UNPRIV = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]


def header_defines(path: Path = HEADER) -> dict[str, str]:
    """#define NAME VALUE of a C header (comments dropped)."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"#define\s+(\w+)\s+(.+?)\s*(/\*.*)?$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


# -- netlink, by hand -------------------------------------------------------------------

NETLINK_GENERIC = 16
SOL_NETLINK = 270
NETLINK_ADD_MEMBERSHIP, NETLINK_CAP_ACK, NETLINK_EXT_ACK = 1, 10, 11
NLMSG_NOOP, NLMSG_ERROR, NLMSG_DONE, NLMSG_OVERRUN = 1, 2, 3, 4
F_REQUEST, F_MULTI, F_ACK, F_ECHO, F_DUMP = 0x1, 0x2, 0x4, 0x8, 0x300
GENL_ID_CTRL, CTRL_CMD_GETFAMILY = 0x10, 3
CTRL_ATTR_FAMILY_ID, CTRL_ATTR_FAMILY_NAME, CTRL_ATTR_MCAST_GROUPS = 1, 2, 7
NLA_F_NESTED, NLA_F_NET_BYTEORDER, NLA_TYPE_MASK = 0x8000, 0x4000, 0x3FFF
NLMSG_HDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid


def nla(atype: int, payload: bytes, pad: bool = True) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, atype) + payload + (b"\0" * (-n % 4) if pad else b"")


def u32(atype: int, v: int) -> bytes:
    return nla(atype, struct.pack("=I", v))


def s32(atype: int, v: int) -> bytes:
    return nla(atype, struct.pack("=i", v))


def u64(atype: int, v: int) -> bytes:
    return nla(atype, struct.pack("=Q", v))


def nest(atype: int, *children: bytes) -> bytes:
    return nla(atype | NLA_F_NESTED, b"".join(children))


def attrs(buf: bytes) -> list[tuple[int, bytes]]:
    """(type with its flags, payload) of each attribute in buf."""
    out, off = [], 0
    while off + 4 <= len(buf):
        n, t = struct.unpack_from("=HH", buf, off)
        if n < 4 or off + n > len(buf):
            raise ValueError(f"bad attribute at {off}: length {n}")
        out.append((t, buf[off + 4:off + n]))
        off += (n + 3) & ~3
    return out


def amap(buf: bytes) -> dict[int, bytes]:
    """type (flags masked) -> payload; the last of duplicates."""
    return {t & NLA_TYPE_MASK: v for t, v in attrs(buf)}


def get_u32(v: bytes) -> int:
    return struct.unpack("=I", v)[0]


def get_s32(v: bytes) -> int:
    return struct.unpack("=i", v)[0]


def get_u64(v: bytes) -> int:
    return struct.unpack("=Q", v)[0]


class NoReply(Exception):
    """The kernel sent nothing for a request within the time allowed."""


class Genl:
    """A raw NETLINK_GENERIC socket talking to the family "gpuos".

    ``request(cmd, payload)`` sends one message and returns (errno, [genl bodies]):
    errno 0 for an ack (or the end of a dump), else the positive errno of the kernel's
    NLMSG_ERROR. Bodies are genlmsghdr + attributes, without the nlmsghdr.
    """

    def __init__(self, family: str = GENL_NAME, cap_ack: bool = True, rcvbuf: int | None = None):
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_GENERIC)
        try:
            self.sock.bind((0, 0))
            if cap_ack:  # errors carry the request's header only, not its payload
                self.sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)
            if rcvbuf:
                self.sock.setsockopt(socket.SOL_SOCKET, 33, rcvbuf)  # SO_RCVBUFFORCE
            self.buf = bytearray(1 << 18)
            self.seq = int(time.monotonic() * 1000) & 0xFFFFFFF
            self.backlog: deque[tuple[int, int, int, bytes]] = deque()
            err, msgs = self.transact(GENL_ID_CTRL, CTRL_CMD_GETFAMILY,
                                      nla(CTRL_ATTR_FAMILY_NAME, family.encode() + b"\0"))
            if err:
                raise OSError(err, f"resolving the genl family {family}: {os.strerror(err)}")
            a = amap(msgs[0][4:])
            self.family = struct.unpack("=H", a[CTRL_ATTR_FAMILY_ID][:2])[0]
            self.groups = {}
            for _, g in attrs(a.get(CTRL_ATTR_MCAST_GROUPS, b"")):
                ga = amap(g)
                self.groups[ga[1].rstrip(b"\0").decode()] = get_u32(ga[2])
        except BaseException:
            self.sock.close()
            raise

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Genl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def next_seq(self) -> int:
        self.seq = (self.seq + 1) & 0xFFFFFFFF
        return self.seq

    def build(self, mtype: int, cmd: int, payload: bytes = b"", flags: int = F_REQUEST | F_ACK,
              version: int = 1, reserved: int = 0, seq: int | None = None) -> tuple[bytes, int]:
        seq = self.next_seq() if seq is None else seq
        body = struct.pack("=BBH", cmd, version, reserved) + payload
        return NLMSG_HDR.pack(16 + len(body), mtype, flags, seq, 0) + body, seq

    def _recv(self, timeout: float) -> bytes:
        """One datagram. The kernel answers a request before send() returns, so the
        reply is usually there: one recv, no poll; into a buffer made once (a fresh
        1 MiB bytes object per recv costs more than the request itself under TCG)."""
        try:
            n = self.sock.recv_into(self.buf, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            if not select.select([self.sock], [], [], timeout)[0]:
                raise NoReply(f"no reply within {timeout} s") from None
            n = self.sock.recv_into(self.buf, 0, socket.MSG_DONTWAIT)
        return bytes(self.buf[:n])

    def _fill(self, timeout: float) -> None:
        data = self._recv(timeout)
        off = 0
        while off + 16 <= len(data):
            n, mtype, flags, seq, _ = NLMSG_HDR.unpack_from(data, off)
            if n < 16:
                break
            self.backlog.append((mtype, flags, seq, data[off + 16:off + n]))
            off += (n + 3) & ~3

    def recv_for(self, seq: int, timeout: float = 10.0) -> tuple[int, list[bytes]]:
        """The replies to request ``seq`` up to its ack, error or NLMSG_DONE. A message
        for another request is an error (every request is answered before the next)."""
        out = []
        while True:
            if not self.backlog:
                self._fill(timeout)
            mtype, flags, mseq, body = self.backlog.popleft()
            if mseq != seq:
                raise AssertionError(f"reply for request {mseq} while waiting for {seq} "
                                     f"(type {mtype})")
            if mtype == NLMSG_ERROR:
                return -get_s32(body[:4]), out
            if mtype == NLMSG_DONE:
                return -get_s32(body[:4]) if len(body) >= 4 else 0, out
            if mtype in (NLMSG_NOOP, NLMSG_OVERRUN):
                raise AssertionError(f"unexpected netlink message type {mtype}")
            out.append(body)

    def transact(self, mtype: int, cmd: int, payload: bytes = b"", **kw) -> tuple[int, list[bytes]]:
        data, seq = self.build(mtype, cmd, payload, **kw)
        self.sock.send(data)
        return self.recv_for(seq)

    def request(self, cmd: int, payload: bytes = b"", dump: bool = False,
                **kw) -> tuple[int, list[bytes]]:
        flags = F_REQUEST | (F_DUMP if dump else F_ACK)
        return self.transact(self.family, cmd, payload, flags=flags, **kw)

    def dump_datagrams(self, cmd: int) -> tuple[int, list[list[bytes]]]:
        """A dump, keeping the datagrams apart: (errno, [[body, ...] per datagram])."""
        data, seq = self.build(self.family, cmd, flags=F_REQUEST | F_DUMP)
        self.sock.send(data)
        grams: list[list[bytes]] = []
        while True:
            raw = self._recv(10)
            gram, off = [], 0
            while off + 16 <= len(raw):
                n, mtype, _, mseq, _ = NLMSG_HDR.unpack_from(raw, off)
                assert mseq == seq, (mseq, seq)
                body = raw[off + 16:off + n]
                if mtype in (NLMSG_DONE, NLMSG_ERROR):
                    grams.append(gram)
                    return -get_s32(body[:4]), grams
                gram.append(body)
                off += (n + 3) & ~3
            grams.append(gram)

    # -- a few commands -------------------------------------------------------------

    def info(self) -> dict:
        """GET_INFO as a dict: the attributes by name, counters by name."""
        err, msgs = self.request(Cmd.GET_INFO)
        if err:
            raise OSError(err, os.strerror(err))
        a = amap(msgs[0][4:])
        out: dict = {"version": msgs[0][1]}
        for attr in (Attr.GENL_VERSION, Attr.ABI_VERSION, Attr.DRIVER_CAPS):
            if attr in a:
                out[attr.name.lower()] = get_u32(a[attr])
        for attr in (Attr.MODULE_VERSION, Attr.DRIVER_NAME):
            if attr in a:
                out[attr.name.lower()] = a[attr].rstrip(b"\0").decode()
        out["event_seq"] = get_u64(a[Attr.EVENT_SEQ])
        out["counters"] = {Counter(t & NLA_TYPE_MASK).name.lower(): get_u64(v)
                           for t, v in attrs(a[Attr.COUNTERS])
                           if (t & NLA_TYPE_MASK) not in (Counter.UNSPEC, Counter.PAD)}
        return out

    def counters(self) -> dict[str, int]:
        return self.info()["counters"]

    def policies(self) -> list[tuple[str, int, int]]:
        """LIST_POLICIES: [("pid"|"cgroup", id, policy)]."""
        err, msgs = self.request(Cmd.LIST_POLICIES, dump=True)
        if err:
            raise OSError(err, os.strerror(err))
        return [parse_policy(amap(amap(m[4:])[Attr.POLICY])) for m in msgs]

    def set_policy(self, kind: str, cid: int, policy: int) -> int:
        return self.request(Cmd.SET_POLICY, client(kind, cid) + u32(Attr.FAULT_POLICY, policy))[0]

    def del_policy(self, kind: str, cid: int) -> int:
        return self.request(Cmd.DEL_POLICY, client(kind, cid))[0]

    def del_all_policies(self) -> int:
        n = 0
        for kind, cid, _ in self.policies():
            err = self.del_policy(kind, cid)
            if err and err != errno.ENOENT:
                raise OSError(err, f"deleting the policy of {kind} {cid}")
            n += 1
        return n


def client(kind: str, cid: int) -> bytes:
    return u32(Attr.CLIENT_PID, cid) if kind == "pid" else u64(Attr.CLIENT_CGROUP, cid)


def parse_policy(p: dict[int, bytes]) -> tuple[str, int, int]:
    if Attr.CLIENT_PID in p:
        return "pid", get_u32(p[Attr.CLIENT_PID]), get_u32(p[Attr.FAULT_POLICY])
    return "cgroup", get_u64(p[Attr.CLIENT_CGROUP]), get_u32(p[Attr.FAULT_POLICY])


def range_nest(base: int, length: int, dest: int = 0, prio: int = 0,
               flags: int | None = None) -> bytes:
    c = [u64(Attr.RANGE_BASE, base), u64(Attr.RANGE_LEN, length), u32(Attr.RANGE_DEST, dest),
         u32(Attr.RANGE_PRIO, prio)]
    if flags is not None:
        c.append(u32(Attr.RANGE_FLAGS, flags))
    return nest(Attr.RANGE, *c)


def migrate_payload(as_id: int, op: int, ranges: list[bytes]) -> bytes:
    return u64(Attr.AS_ID, as_id) + u32(Attr.OP, op) + nest(Attr.RANGES, *ranges)


def netlink_sockets(pid: int) -> list[tuple[int, int]]:
    """(protocol, groups bitmask of the first 32 groups) of each netlink socket of pid."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    out = []
    for line in Path("/proc/net/netlink").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[9]) in inodes:
            out.append((int(f[1]), int(f[3], 16)))
    return out


def wait_subscribed(proc: subprocess.Popen, group: int, timeout: float = 30.0) -> None:
    """Until process proc has a generic netlink socket in multicast group ``group``."""
    assert 0 < group <= 32, f"group {group} is past what /proc/net/netlink shows"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process {proc.args} exited {proc.returncode} before "
                                 f"subscribing: {proc.communicate()}")
        try:
            if any(p == NETLINK_GENERIC and g & (1 << (group - 1))
                   for p, g in netlink_sockets(proc.pid)):
                return
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"process {proc.args} did not join group {group} in {timeout} s")


def wait_fds(proc: subprocess.Popen, link: str, count: int, timeout: float = 60.0) -> None:
    """Until proc has ``count`` open files whose /proc/PID/fd link is ``link``
    (e.g. anon_inode:[perf_event] once bcc has attached its tracepoints)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited {proc.returncode}: {proc.communicate()}")
        n = 0
        for fd in Path(f"/proc/{proc.pid}/fd").iterdir():
            try:
                n += os.readlink(fd) == link
            except OSError:
                pass
        if n >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{proc.args} has no {count} {link} after {timeout} s")


# -- the test driver --------------------------------------------------------------------


def dbg_write(name: str, text: str) -> int:
    """One write(2) to a debugfs file of the test driver: 0 or the errno."""
    try:
        fd = os.open(DBG / name, os.O_WRONLY)
    except OSError as exc:
        return exc.errno
    try:
        os.write(fd, text.encode())
        return 0
    except OSError as exc:
        return exc.errno
    finally:
        os.close(fd)


def dbg_read(name: str) -> str:
    return (DBG / name).read_text()


def inject(pid: int, veid: int = 0, as_id: int = 0x77, addr: int = 0xDEAD000, access: int = 1,
           ftype: int = 0, gpu: int = 0) -> int:
    """A fault report through the test driver; returns gpuos's decision."""
    err = dbg_write("inject_fault", f"{pid} {veid} {as_id:#x} {addr:#x} {access} {ftype} {gpu}\n")
    assert err == 0, os.strerror(err)
    return int(dbg_read("last_decision"))


def inject_batch(pid: int, as_id: int = 0x77, gpu: int = 0, batch_id: int = 1,
                 faults: int | None = None, instances: int | None = None, fatal: int = 0,
                 throttled: int = 0, skipped: int = 0,
                 by_access: tuple[int, int, int, int] | None = None,
                 addr_min: int | None = None, addr_max: int | None = None,
                 addrs: list[int] = (0x1000, 0x2000, 0x3000),
                 nr_addrs: int | None = None) -> int:
    """A fault batch report through the test driver (inject_fault_batch): 0, or the
    write's errno. Left out, the counts make a well-formed report: one fault per address,
    all reads, the span of the addresses. gpuos's verdict shows in its counters."""
    faults = len(addrs) if faults is None else faults
    instances = faults if instances is None else instances
    by_access = (faults, 0, 0, 0) if by_access is None else by_access
    addr_min = min(addrs, default=0) if addr_min is None else addr_min
    addr_max = max(addrs, default=0) if addr_max is None else addr_max
    nr_addrs = len(addrs) if nr_addrs is None else nr_addrs
    fields = [pid, as_id, gpu, batch_id, faults, instances, fatal, throttled, skipped,
              *by_access, addr_min, addr_max, nr_addrs, *addrs]
    return dbg_write("inject_fault_batch", " ".join(f"{v:#x}" for v in fields) + "\n")


def pending() -> list[tuple[int, int, int, int]]:
    """The test driver's pending batches: (id, as_id, op, nr_ranges)."""
    return [tuple(int(x) for x in line.split()) for line in dbg_read("pending").splitlines()]


def stopped() -> list[tuple[int, int]]:
    return [tuple(int(x) for x in line.split()) for line in dbg_read("stopped").splitlines()]


def complete(batch_id: int, *statuses: int) -> None:
    err = dbg_write("complete", " ".join(map(str, (batch_id, *statuses))) + "\n")
    assert err == 0, os.strerror(err)


# -- modules ---------------------------------------------------------------------------


def module_loaded(name: str) -> bool:
    return Path("/sys/module", name, "initstate").exists()


def run(cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if check and p.returncode:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}: {p.stdout}{p.stderr}")
    return p


class Kmod:
    """Loads gpuos.ko and gpuos_testdrv.ko from GPUOS_KMOD_DIR, on demand, and unloads them."""

    def __init__(self, kmod_dir: str | os.PathLike):
        self.dir = Path(kmod_dir)

    def ko(self, name: str) -> Path:
        path = self.dir / f"{name}.ko"
        if not path.exists():
            raise FileNotFoundError(f"{path} was not built (tools/vmtest/vmtest.py modules)")
        return path

    def insmod(self, name: str, **params: object) -> None:
        args = [f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in params.items()
                if v is not None]
        run(["insmod", str(self.ko(name)), *args])

    def rmmod(self, name: str, check: bool = True) -> subprocess.CompletedProcess:
        return run(["rmmod", name], check=check)

    def ensure_gpuos(self) -> None:
        if not module_loaded("gpuos"):
            self.insmod("gpuos")

    def testdrv_params(self) -> tuple[int, bool] | None:
        if not module_loaded("gpuos_testdrv"):
            return None
        p = Path("/sys/module/gpuos_testdrv/parameters")
        return int((p / "caps").read_text()), (p / "autoregister").read_text().strip() == "Y"

    def load_testdrv(self, caps: int | None = None, autoregister: bool = True) -> None:
        """The test driver with these module parameters (caps None: its default, all),
        reloaded if it runs with others; registered, async and idle when autoregister."""
        self.ensure_gpuos()
        want = (15 if caps is None else caps, autoregister)
        if self.testdrv_params() != want:
            self.unload_testdrv()
            self.insmod("gpuos_testdrv", caps=caps, autoregister=None if autoregister else 0)
        assert dbg_write("register", "1\n" if autoregister else "0\n") == 0
        self.idle_testdrv()

    def idle_testdrv(self) -> None:
        """Mode async, no batch pending (each completed with status 0)."""
        assert dbg_write("mode", "async\n") == 0
        for bid, *_ in pending():
            complete(bid, 0)

    def unload_testdrv(self) -> None:
        if module_loaded("gpuos_testdrv"):
            self.rmmod("gpuos_testdrv")

    def unload_all(self) -> None:
        self.unload_testdrv()
        if module_loaded("gpuos"):
            self.rmmod("gpuos")

    def clean(self) -> None:
        """No policies; the test driver (if loaded) async and idle."""
        if module_loaded("gpuos"):
            with Genl() as nl:
                nl.del_all_policies()
        if module_loaded("gpuos_testdrv") and DBG.is_dir():
            self.idle_testdrv()


# -- the kernel log --------------------------------------------------------------------

# What must never appear: WARN()/BUG() and their traces, oopses, sanitizers, lockups.
KMSG_BAD = re.compile(r"\bBUG\b|\bWARN|Oops|general protection|KASAN|UBSAN|sleeping function "
                      r"called|refcount_t|Call Trace|list_(add|del) corruption|"
                      r"blocked for more than|soft lockup|RCU stall|rcu_sched self-detected")


class Kmsg:
    """/dev/kmsg from the moment it is made: ``new()`` returns the records logged since
    the last call, ``all()`` every record since the start."""

    def __init__(self):
        self.fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self.fd, 0, os.SEEK_END)
        self.seen: list[str] = []

    def new(self) -> list[str]:
        out = []
        while True:
            try:
                rec = os.read(self.fd, 8192).decode(errors="replace")
            except BlockingIOError:
                break
            except BrokenPipeError:  # records overwritten before we read them
                out.append("(kmsg: records were lost)")
                continue
            out.append(rec.partition(";")[2].rstrip("\n"))
        self.seen += out
        return out

    def all(self) -> list[str]:
        self.new()
        return list(self.seen)

    def settled(self, quiet: float = 0.5, timeout: float = 10.0) -> list[str]:
        """The records logged since the last call, once none has come for ``quiet`` s."""
        out, last, deadline = [], time.monotonic(), time.monotonic() + timeout
        while time.monotonic() - last < quiet and time.monotonic() < deadline:
            got = self.new()
            if got:
                out += got
                last = time.monotonic()
            time.sleep(0.05)
        return out

    def forget(self, records: list[str]) -> None:
        """Leave these records out of ``all()`` (a test's own planted reports)."""
        drop = set(records)
        self.seen = [r for r in self.seen if r not in drop]

    @staticmethod
    def bad(lines: list[str]) -> list[str]:
        return [ln for ln in lines if KMSG_BAD.search(ln)]

    def close(self) -> None:
        os.close(self.fd)


# -- processes ------------------------------------------------------------------------


def gpuos_cli(*args: str, unpriv: bool = False, env: dict | None = None,
              popen: bool = False, **kw):
    """`python3 -m gpuos.cli ARGS` as a user runs it (as nobody with ``unpriv``)."""
    cmd = [sys.executable, "-m", "gpuos.cli", *args]
    if unpriv:
        cmd = UNPRIV + cmd
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, **kw)
    return subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)


def unpriv_env() -> dict[str, str]:
    """The environment for a Python child running as nobody: a PYTHONPATH it can read
    (the repository's, or a world-readable copy of what it needs when it cannot)."""
    env = dict(os.environ)
    paths = [REPO / "userspace", VM_DIR]
    probe = " && ".join(f"test -r {p}/{f}" for p, f in
                        ((paths[0], "gpuos/kernel/netlink.py"), (paths[1], "vmlib.py")))
    if subprocess.run(UNPRIV + ["sh", "-c", probe]).returncode != 0:
        tmp = Path(tempfile.mkdtemp(prefix="gpuos-unpriv-"))
        shutil.copytree(REPO / "userspace" / "gpuos", tmp / "gpuos",
                        ignore=shutil.ignore_patterns("__pycache__"))
        for f in ("vmlib.py", "fuzzlib.py"):
            shutil.copy2(VM_DIR / f, tmp / f)
        for p in [tmp, *tmp.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        paths = [tmp]
    env["PYTHONPATH"] = os.pathsep.join(map(str, paths))
    env["HOME"] = "/tmp"
    return env


class Sleeper:
    """A live, sleeping process (`sleep`), killed at exit."""

    def __init__(self):
        self.proc = subprocess.Popen(["sleep", "1000"])
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Cgroup:
    """A fresh cgroup v2 directory; ``add(pid)`` moves a process into it."""

    def __init__(self, name: str):
        self.path = CGROUP2 / f"{name}-{os.getpid()}-{time.monotonic_ns() % 100000}"
        self.path.mkdir()
        self.id = os.stat(self.path).st_ino

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(f"{pid}\n")

    def remove(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (CGROUP2 / "cgroup.procs").write_text(f"{pid}\n")
            except OSError:
                pass  # gone meanwhile
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:  # EBUSY while a killed member is being reaped
                if exc.errno != errno.EBUSY:
                    raise
                time.sleep(0.05)
        self.path.rmdir()
