"""Fuzzing gpuos.ko through its two doors, raw: generic netlink messages (socket,
struct) and /dev/gpuos ioctls (ctypes), each one checked against a model of the protocol.

The model is kmod/uapi/gpuos.h's top comment plus the netlink core's strict validation
(lib/nlattr.c, net/netlink/genetlink.c of Linux 6.1), and the state the fuzzer itself
creates: the policies it set, the batches it submitted, the test driver's mode. For each
message it predicts the outcome: no answer at all (a header the kernel cannot parse), an
ack without processing (not a request, a control type), the errno of a refusal, or
acceptance, whose reply is then checked too. A message the kernel accepts that the spec
says it must refuse, or the opposite, is a failure; so is an unexpected errno.

In the test it runs as root; ``python3 fuzzlib.py --unpriv ...`` runs it as a child
process (under setpriv, as nobody) at the same time, printing a JSON summary. Standard
library and vmlib only: nothing here needs pyroute2 or root at import.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import random
import struct
import sys
import time
from pathlib import Path

import vmlib
from vmlib import (F_ACK, F_DUMP, F_ECHO, F_REQUEST, NLA_F_NESTED, NLA_F_NET_BYTEORDER, NLA_TYPE_MASK,
                   NLMSG_HDR, Genl)
from gpuos.kernel.uapi import (ATTR_MAX, IOC_ABI_VERSION, IOC_SUBMIT, MAX_NL_RANGES, MAX_PENDING,
                               MAX_POLICIES, MAX_PREFETCH_AS, MAX_RANGES, Attr, Cmd)

A = Attr
MAX32, MAX64 = 2**32 - 1, 2**64 - 1
PAGE = 4096
BOGUS_FAMILY = 0xFFF0  # no such generic netlink family (checked at start)

# -- the protocol: per-command policies, as kmod/netlink.c declares them -------------------
# An attribute's rule: ("u32"|"u64", min, max), ("mask", bits) or ("nest", rules).

CLIENT = {A.CLIENT_PID: ("u32", 1, MAX32), A.CLIENT_CGROUP: ("u64", 1, MAX64)}
SET = {**CLIENT, A.FAULT_POLICY: ("u32", 0, 2)}
RANGE = {A.RANGE_BASE: ("u64", 0, MAX64), A.RANGE_LEN: ("u64", 1, MAX64),
         A.RANGE_DEST: ("u32", 0, 32), A.RANGE_PRIO: ("u32", 0, 7), A.RANGE_FLAGS: ("mask", 3)}
RANGES = {A.RANGE: ("nest", RANGE)}
MIGRATE = {A.AS_ID: ("u64", 0, MAX64), A.OP: ("u32", 0, 1), A.RANGES: ("nest", RANGES)}
PF_RANGE = {A.RANGE_BASE: ("u64", 0, MAX64), A.RANGE_LEN: ("u64", 1, MAX64)}
PF_RANGES = {A.RANGE: ("nest", PF_RANGE)}
PREFETCH = {A.AS_ID: ("u64", 0, MAX64), A.RANGES: ("nest", PF_RANGES)}
# cmd -> (rules, admin, "do"|"dump")
OPS = {Cmd.GET_INFO: ({}, False, "do"), Cmd.SET_POLICY: (SET, True, "do"),
       Cmd.GET_POLICY: (CLIENT, False, "do"), Cmd.DEL_POLICY: (CLIENT, True, "do"),
       Cmd.LIST_POLICIES: ({}, False, "dump"), Cmd.MIGRATE: (MIGRATE, True, "do"),
       Cmd.SET_PREFETCH: (PREFETCH, True, "do")}
WIDTH = {"u32": 4, "mask": 4, "u64": 8}


def nl_parse(buf: bytes, rules: dict, depth: int = 0):
    """__nla_validate_parse with NL_VALIDATE_STRICT: (errno, {type: payload} last wins,
    [(type, payload)] in order)."""
    tb, seq, off, rem = {}, [], 0, len(buf)
    while rem >= 4:
        n, t = struct.unpack_from("=HH", buf, off)
        if n < 4 or n > rem:
            break
        typ, data = t & NLA_TYPE_MASK, buf[off + 4:off + n]
        if typ == 0 or typ > ATTR_MAX:
            return errno.EINVAL, None, None  # unknown attribute type
        err = nl_attr(rules.get(typ), t, data, depth)
        if err:
            return err, None, None
        tb[typ] = data
        seq.append((typ, data))
        step = (n + 3) & ~3
        off, rem = off + step, rem - step
    if rem > 0:
        return errno.EINVAL, None, None  # bytes left over
    return 0, tb, seq


def nl_attr(rule, t: int, data: bytes, depth: int) -> int:
    """validate_nla: 0 or the errno."""
    if rule is None:  # NLA_UNSPEC: not taken here
        return errno.EINVAL
    kind = rule[0]
    if kind in WIDTH and len(data) != WIDTH[kind]:
        return errno.EINVAL  # strict: exact length
    if (kind == "nest") != bool(t & NLA_F_NESTED):
        return errno.EINVAL  # NLA_F_NESTED missing, or not expected
    if kind == "nest":
        if not data:
            return 0  # an empty nest is allowed
        if len(data) < 4:
            return errno.ERANGE
        return nl_parse(data, rule[1], depth + 1)[0]
    v = int.from_bytes(data, sys.byteorder)
    if kind == "mask":
        return errno.EINVAL if v & ~rule[1] else 0
    return errno.ERANGE if not rule[1] <= v <= rule[2] else 0


def range_check(op: int, base: int, length: int, dest: int, prio: int, flags: int) -> int:
    """gpuos_range_check (the header's struct gpuos_range rules): 0 or -EINVAL."""
    bad = (not length or base % PAGE or length % PAGE or base + length > MAX64 or dest > 32
           or prio > 7 or (flags != 0 if op == 0 else flags not in (1, 2)) or op > 1)
    return -errno.EINVAL if bad else 0


class Expect:
    """What the kernel must do with one message: ``ok`` is the set of allowed outcomes
    (0: accepted, else an errno); ``effect`` runs on acceptance; ``verify(bodies)``
    checks the replies of an accepted message; ``silent``: no answer at all."""

    __slots__ = ("ok", "effect", "verify", "silent", "what")

    def __init__(self, ok=(0,), effect=None, verify=None, silent=False, what=""):
        self.ok, self.effect, self.verify, self.silent, self.what = set(ok), effect, verify, \
            silent, what


def refuse(err: int, what: str = "") -> Expect:
    return Expect((err,), what=what)


class Model:
    """The state the fuzzer created, and the prediction for each message and ioctl."""

    def __init__(self, family: int, priv: bool):
        self.family, self.priv = family, priv
        self.policies: dict[tuple[str, int], int] = {}
        self.registered = True
        self.mode = "sync"
        self.pending = 0  # batches gpuos holds for the driver
        self.next_id: int | None = None  # the next batch id, once known
        self.prefetch: dict[int, list[tuple[int, int]]] = {}  # as_id -> its ranges, sorted

    # -- netlink ----------------------------------------------------------------

    def netlink(self, data: bytes) -> Expect:
        if not data:  # netlink_sendmsg refuses to send nothing
            return Expect((errno.ENODATA,), silent=True, what="empty datagram")
        if len(data) < 16:
            return Expect(silent=True, what="shorter than nlmsghdr")
        n, mtype, flags, _, _ = NLMSG_HDR.unpack_from(data)
        if n < 16 or n > len(data):
            return Expect(silent=True, what="nlmsg_len out of bounds")
        if not flags & F_REQUEST or mtype < 0x10:
            # netlink_rcv_skb: not for the kernel; acked (error 0) only if asked to
            return Expect((0,), silent=not flags & F_ACK, what="not processed")
        if mtype != self.family:
            return refuse(errno.ENOENT, "no such family")
        if n < 20:
            return refuse(errno.EINVAL, "truncated genlmsghdr")
        cmd, _version, reserved = struct.unpack_from("=BBH", data, 16)
        if reserved:
            return refuse(errno.EINVAL, "reserved != 0")
        # genl_header_check (resv_start_op 0: every command): nlmsg_flags are REQUEST,
        # ACK, ECHO and, for a dump, both DUMP bits; any other bit is EINVAL
        if flags & ~(F_DUMP if flags & F_DUMP == F_DUMP else 0) & ~(F_REQUEST | F_ACK | F_ECHO):
            return refuse(errno.EINVAL, "nlmsg_flags")
        if cmd not in OPS:
            return refuse(errno.EOPNOTSUPP, f"unknown command {cmd}")
        rules, admin, kind = OPS[cmd]
        dump = flags & F_DUMP == F_DUMP
        if dump != (kind == "dump"):
            return refuse(errno.EOPNOTSUPP, "do/dump mismatch")
        err, tb, _ = nl_parse(data[20:n], rules)
        if err:
            return refuse(err, "policy")
        if admin and not self.priv:  # CAP_SYS_ADMIN, first thing in the command
            return refuse(errno.EPERM, "admin command")
        return self.command(Cmd(cmd), tb)

    def command(self, cmd: Cmd, tb: dict) -> Expect:
        if cmd == Cmd.GET_INFO:
            return Expect(verify=self.verify_info, what="GET_INFO")
        if cmd == Cmd.LIST_POLICIES:
            return Expect(verify=self.verify_list, what="LIST_POLICIES")
        if cmd == Cmd.MIGRATE:
            return self.migrate(tb)
        if cmd == Cmd.SET_PREFETCH:
            return self.set_prefetch(tb)
        pid, cg = tb.get(A.CLIENT_PID), tb.get(A.CLIENT_CGROUP)
        if (pid is None) == (cg is None):
            return refuse(errno.EINVAL, "not exactly one client")
        key = ("pid", vmlib.get_u32(pid)) if pid is not None else ("cgroup", vmlib.get_u64(cg))
        if cmd == Cmd.SET_POLICY:
            if A.FAULT_POLICY not in tb:
                return refuse(errno.EINVAL, "no policy")
            pol = vmlib.get_u32(tb[A.FAULT_POLICY])
            if key[0] == "pid" and not process_exists(key[1]):  # a pid policy needs a live process
                return refuse(errno.ESRCH, "no such process")
            if key not in self.policies and len(self.policies) >= MAX_POLICIES:
                return refuse(errno.ENOSPC, "too many policies")
            return Expect(effect=lambda: self.policies.__setitem__(key, pol), what="SET_POLICY")
        if cmd == Cmd.GET_POLICY:
            def verify(bodies):
                assert len(bodies) == 1, bodies
                self.check_version(bodies[0], Cmd.GET_POLICY)
                got = vmlib.parse_policy(vmlib.amap(vmlib.amap(bodies[0][4:])[A.POLICY]))
                assert got[:2] == key, (got, key)
                if self.priv:
                    assert got[2] == self.policies[key], (got, self.policies[key])
            if not self.priv:  # root's fuzzer changes policies meanwhile
                return Expect((0, errno.ENOENT), verify=verify, what="GET_POLICY")
            return Expect(verify=verify, what="GET_POLICY") if key in self.policies else \
                refuse(errno.ENOENT, "no such policy")
        if key not in self.policies:  # DEL_POLICY
            return refuse(errno.ENOENT, "no such policy")
        return Expect(effect=lambda: self.policies.pop(key), what="DEL_POLICY")

    def migrate(self, tb: dict) -> Expect:
        for attr in (A.AS_ID, A.OP, A.RANGES):
            if attr not in tb:
                return refuse(errno.EINVAL, f"no {attr.name}")
        op = vmlib.get_u32(tb[A.OP])
        _, _, entries = nl_parse(tb[A.RANGES], RANGES, 1)
        if not entries:
            return refuse(errno.EINVAL, "no ranges")
        if len(entries) > MAX_NL_RANGES:
            return refuse(errno.E2BIG, "too many ranges")
        ranges = []
        for _, data in entries:
            _, r, _ = nl_parse(data, RANGE, 2)
            if any(a not in r for a in (A.RANGE_BASE, A.RANGE_LEN, A.RANGE_DEST, A.RANGE_PRIO)):
                return refuse(errno.EINVAL, "range field missing")
            ranges.append((vmlib.get_u64(r[A.RANGE_BASE]), vmlib.get_u64(r[A.RANGE_LEN]),
                           vmlib.get_u32(r[A.RANGE_DEST]), vmlib.get_u32(r[A.RANGE_PRIO]),
                           vmlib.get_u32(r[A.RANGE_FLAGS]) if A.RANGE_FLAGS in r else 0))
        if any(range_check(op, *r) for r in ranges):
            return refuse(errno.EINVAL, "bad range")
        return self.submit("MIGRATE")

    def set_prefetch(self, tb: dict) -> Expect:
        """SET_PREFETCH in the kernel's order: AS_ID, E2BIG, each range's fields, the ranges
        (aligned, not overflowing, disjoint), then ENOSPC for one address space too many."""
        if A.AS_ID not in tb:
            return refuse(errno.EINVAL, "no AS_ID")
        as_id = vmlib.get_u64(tb[A.AS_ID])
        entries = nl_parse(tb[A.RANGES], PF_RANGES, 1)[2] if A.RANGES in tb else []
        if len(entries) > MAX_NL_RANGES:
            return refuse(errno.E2BIG, "too many prefetch ranges")
        ranges = []
        for _, data in entries:
            _, r, _ = nl_parse(data, PF_RANGE, 2)
            if A.RANGE_BASE not in r or A.RANGE_LEN not in r:
                return refuse(errno.EINVAL, "prefetch range field missing")
            ranges.append((vmlib.get_u64(r[A.RANGE_BASE]), vmlib.get_u64(r[A.RANGE_LEN])))
        if any(n == 0 or b % PAGE or n % PAGE or b + n > MAX64 for b, n in ranges):
            return refuse(errno.EINVAL, "bad prefetch range")
        ranges.sort()
        if any(a[0] + a[1] > b[0] for a, b in zip(ranges, ranges[1:])):
            return refuse(errno.EINVAL, "overlapping prefetch ranges")
        if ranges and as_id not in self.prefetch and len(self.prefetch) >= MAX_PREFETCH_AS:
            return refuse(errno.ENOSPC, "too many address spaces with prefetch ranges")

        def effect():
            if ranges:
                self.prefetch[as_id] = ranges
            else:
                self.prefetch.pop(as_id, None)
        return Expect(effect=effect, what="SET_PREFETCH")

    def submit(self, what: str) -> Expect:
        """A valid batch meets the driver: ENODEV, EAGAIN, EIO (an id spent) or a new id."""
        if not self.registered:
            return refuse(errno.ENODEV, "no driver")
        if self.pending >= MAX_PENDING:
            return refuse(errno.EAGAIN, "pending limit")
        if self.mode == "fail":
            return Expect((errno.EIO,), effect=self.spend_id, what="driver fails")
        expect = Expect(effect=self.spend_id, what=what)
        expect.verify = self.verify_batch_id
        return expect

    def spend_id(self) -> None:
        if self.next_id is not None:
            self.next_id += 1
        if self.mode == "async":
            self.pending += 1

    def verify_batch_id(self, bodies) -> None:
        assert len(bodies) == 1, bodies
        self.check_version(bodies[0], Cmd.MIGRATE)
        self.check_id(vmlib.get_u64(vmlib.amap(bodies[0][4:])[A.BATCH_ID]))

    def check_id(self, got: int) -> None:
        """Ids count up by one per batch offered to the driver (the fuzzer is the only
        submitter); the first one tells where they stand."""
        if self.next_id is None:
            self.next_id = got
        assert got == self.next_id, f"batch id {got}, expected {self.next_id}"

    @staticmethod
    def check_version(body: bytes, cmd: int) -> None:
        assert body[0] == cmd and body[1] == 1 and body[2:4] == b"\0\0", body[:4]

    def verify_info(self, bodies) -> None:
        assert len(bodies) == 1, bodies
        self.check_version(bodies[0], Cmd.GET_INFO)
        a = vmlib.amap(bodies[0][4:])
        assert vmlib.get_u32(a[A.GENL_VERSION]) == 1 and vmlib.get_u32(a[A.ABI_VERSION]) == 1
        assert a[A.MODULE_VERSION].endswith(b"\0") and A.EVENT_SEQ in a and A.COUNTERS in a
        if self.priv:  # root's fuzzer (un)registers the driver meanwhile
            assert (A.DRIVER_NAME in a) == self.registered, (a.keys(), self.registered)
            assert vmlib.get_u32(a[A.DRIVER_CAPS]) == (15 if self.registered else 0)

    def verify_list(self, bodies) -> None:
        got = set()
        for b in bodies:
            self.check_version(b, Cmd.LIST_POLICIES)
            kind, cid, pol = vmlib.parse_policy(vmlib.amap(vmlib.amap(b[4:])[A.POLICY]))
            got.add((kind, cid, pol))
        assert len(got) == len(bodies), "a policy listed twice"
        if self.priv:
            want = {(k, c, p) for (k, c), p in self.policies.items()}
            assert got == want, (sorted(got ^ want)[:5], len(got), len(want))

    # -- ioctls -------------------------------------------------------------------

    def submit_ioctl(self, batch_ok: bool, fields: tuple, ranges_readable: bool,
                     ranges: list[tuple]) -> tuple[Expect, list[int] | None]:
        """GPUOS_IOC_SUBMIT, in the header's order: EPERM; the struct (EFAULT, EINVAL,
        E2BIG); the ranges (EFAULT, EINVAL with per-range statuses); then the driver.
        Returns the expectation and the statuses an EINVAL writes back."""
        if not self.priv:
            return refuse(errno.EPERM, "SUBMIT unprivileged"), None
        if not batch_ok:
            return refuse(errno.EFAULT, "batch unreadable"), None
        size, op, _as_id, nr, flags = fields
        if size != 40 or op > 1 or flags or nr == 0:
            return refuse(errno.EINVAL, "batch fields"), None
        if nr > MAX_RANGES:
            return refuse(errno.E2BIG, "nr_ranges"), None
        if not ranges_readable:
            return refuse(errno.EFAULT, "ranges unreadable"), None
        statuses = [range_check(op, *r) for r in ranges]
        if any(statuses):
            return refuse(errno.EINVAL, "bad range"), statuses
        exp = self.submit("SUBMIT")
        exp.verify = None  # the caller reads the id and statuses back from memory
        return exp, None


# -- generating messages ----------------------------------------------------------------


def process_exists(pid: int) -> bool:
    """A live process (thread group) with this pid: PIDS are none, 1 is init."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (OSError, ValueError):
        return False
    return f"\nTgid:\t{pid}\n" in status


def enc(t: int, payload: bytes, pad: bool = True) -> bytes:
    return vmlib.nla(t, payload[:0xFFFF - 4], pad)  # nla_len is 16 bits


class Gen:
    """Random and malformed messages, most built from valid ones and then broken."""

    PIDS = [3_900_000 + i for i in range(12)]  # never a live process (pid_max is lower)
    CGROUPS = [7_000_000 + i for i in range(12)]
    AS_IDS = [0xA5000 + i for i in range(MAX_PREFETCH_AS + 40)]  # more than may have ranges

    def __init__(self, rng: random.Random, family: int):
        self.r, self.family = rng, family

    def u(self, bits: int) -> int:
        return self.r.getrandbits(bits)

    # values

    def scalar(self, width: int, value: int) -> bytes:
        if self.r.random() < 0.04:  # wrong length
            return self.r.randbytes(self.r.choice([0, 1, 2, 3, 5, 6, 7, 9, 12, 16]))
        return value.to_bytes(width, sys.byteorder)

    def client_attrs(self) -> list[tuple[int, bytes]]:
        r = self.r.random()
        pid = (self.r.choice(self.PIDS) if self.r.random() < 0.85 else
               self.r.choice([0, 1, MAX32, self.u(32)]))
        cg = (self.r.choice(self.CGROUPS) if self.r.random() < 0.85 else
              self.r.choice([0, 1, MAX64, self.u(64)]))
        if r < 0.45:
            return [(A.CLIENT_PID, self.scalar(4, pid))]
        if r < 0.9:
            return [(A.CLIENT_CGROUP, self.scalar(8, cg))]
        if r < 0.95:
            return [(A.CLIENT_PID, self.scalar(4, pid)), (A.CLIENT_CGROUP, self.scalar(8, cg))]
        return []

    def range_attrs(self, op: int) -> list[tuple[int, bytes]]:
        r = self.r
        base = r.choice([PAGE * r.randrange(1 << 20), PAGE * r.randrange(1 << 20),
                         PAGE * r.randrange(1 << 40), self.u(64), MAX64 - PAGE + 1,
                         2**64 - 2 * PAGE, PAGE * r.randrange(16) + r.randrange(1, PAGE)])
        length = r.choice([PAGE, PAGE * r.randrange(1, 1 << 12), PAGE * r.randrange(1, 1 << 12),
                           0, r.randrange(1, PAGE), PAGE + 1, MAX64 - PAGE + 1, self.u(64)])
        dest = r.choice([0, 1, r.randrange(33), r.randrange(33), 32, 33, self.u(32)])
        prio = r.choice([0, r.randrange(8), r.randrange(8), 7, 8, self.u(32)])
        out = [(A.RANGE_BASE, self.scalar(8, base)), (A.RANGE_LEN, self.scalar(8, length)),
               (A.RANGE_DEST, self.scalar(4, dest)), (A.RANGE_PRIO, self.scalar(4, prio))]
        f = r.random()
        if op == 1 or f < 0.1:
            flags = r.choice([1, 2, 1, 2, 0, 3, 4, self.u(32)])
            out.append((A.RANGE_FLAGS, self.scalar(4, flags)))
        elif f < 0.4:
            out.append((A.RANGE_FLAGS, self.scalar(4, 0)))
        return self.mutate_list(out, 0.15)

    def ranges_nest(self, op: int) -> bytes:
        r = self.r.random()
        if r < 0.06:  # garbage inside the nest: anything, deep nests too
            return b"".join(self.garbage_attr(1) for _ in range(self.r.randrange(1, 4)))
        count = (0 if r < 0.09 else
                 self.r.choice([1023, 1024, 1025, 1200]) if r < 0.095 else
                 self.r.randrange(1, 5))
        if count > 100:  # huge nests: one range, repeated (64 KiB is a nest's limit)
            one = self.nest(A.RANGE, self.encode_list(self.valid_range(op)))
            return one * count
        out = []
        for _ in range(count):
            body = self.encode_list(self.range_attrs(op))
            if self.r.random() < 0.03:
                body += self.garbage_attr(2)
            out.append(self.nest(A.RANGE, body))
        return b"".join(out)

    def prefetch_nest(self) -> bytes:
        """Prefetch ranges: mostly valid and disjoint, sometimes unaligned, overlapping,
        overflowing, empty, or too many."""
        r = self.r
        if r.random() < 0.04:
            return b"".join(self.garbage_attr(1) for _ in range(r.randrange(1, 4)))
        count = r.choice([1023, 1024, 1025]) if r.random() < 0.01 else r.randrange(0, 6)
        start = PAGE * r.randrange(1 << 30)
        out = []
        for i in range(count):
            base, length = start + i * 64 * PAGE, PAGE * r.randrange(1, 64)
            m = r.random()
            if m < 0.05:
                base += r.randrange(1, PAGE)  # unaligned
            elif m < 0.08:
                length = MAX64 - PAGE + 1  # overflows
            elif m < 0.11:
                base = start  # overlaps the first
            items = [(A.RANGE_BASE, self.scalar(8, base)), (A.RANGE_LEN, self.scalar(8, length))]
            out.append(self.nest(A.RANGE, self.encode_list(self.mutate_list(items, 0.1))))
        return b"".join(out)

    def valid_range(self, op: int) -> list[tuple[int, bytes]]:
        return [(A.RANGE_BASE, (PAGE * self.r.randrange(1 << 30)).to_bytes(8, sys.byteorder)),
                (A.RANGE_LEN, (PAGE * self.r.randrange(1, 64)).to_bytes(8, sys.byteorder)),
                (A.RANGE_DEST, self.r.randrange(33).to_bytes(4, sys.byteorder)),
                (A.RANGE_PRIO, self.r.randrange(8).to_bytes(4, sys.byteorder)),
                (A.RANGE_FLAGS, (self.r.choice([1, 2]) if op else 0).to_bytes(4, sys.byteorder))]

    def nest(self, t: int, body: bytes) -> bytes:
        flag = NLA_F_NESTED if self.r.random() > 0.03 else 0  # sometimes without NLA_F_NESTED
        return enc(t | flag, body)

    def encode_list(self, items: list[tuple[int, bytes]]) -> bytes:
        out = b"".join(enc(t, v) for t, v in items)
        if items and self.r.random() < 0.05:  # the last attribute unpadded
            t, v = items[-1]
            out = b"".join(enc(t, v) for t, v in items[:-1]) + enc(t, v, pad=False)
        if self.r.random() < 0.03:  # trailing garbage
            out += self.r.randbytes(self.r.randrange(1, 8))
        return out

    def garbage_attr(self, depth: int = 0) -> bytes:
        r = self.r
        t = r.choice([0, r.randrange(ATTR_MAX + 1), r.randrange(ATTR_MAX + 1),
                      r.randrange(ATTR_MAX + 1, 64), self.u(14), ATTR_MAX + 1])
        if r.random() < 0.25 and depth < 12:  # nested garbage, deep sometimes
            body = b"".join(self.garbage_attr(depth + 1) for _ in range(r.randrange(4)))
            return enc(t | (NLA_F_NESTED if r.random() < 0.8 else 0), body)
        if r.random() < 0.1:
            t |= r.choice([NLA_F_NESTED, NLA_F_NET_BYTEORDER])
        return enc(t, self.r.randbytes(r.choice([0, 1, 2, 4, 4, 8, 8, 12, 16, 40])))

    def mutate_list(self, items: list[tuple[int, bytes]], p: float):
        """Drop, duplicate, add unknown, or re-flag attributes (items: (type, payload))."""
        r = self.r
        if r.random() >= p:
            return items
        items = list(items)
        for _ in range(r.randrange(1, 3)):
            m = r.random()
            if m < 0.25 and items:
                del items[r.randrange(len(items))]
            elif m < 0.5 and items:  # duplicate, same or another value
                t, v = r.choice(items)
                v2 = v if r.random() < 0.5 else self.r.randbytes(len(v))
                items.insert(r.randrange(len(items) + 1), (t, v2))
            elif m < 0.7:  # an attribute this command does not take, or an unknown one
                t = r.choice([0, r.randrange(1, ATTR_MAX + 1), ATTR_MAX + 1, self.u(14)])
                items.insert(r.randrange(len(items) + 1),
                             (t, self.r.randbytes(r.choice([0, 4, 8]))))
            elif m < 0.85 and items:  # flags on a scalar
                i = r.randrange(len(items))
                t, v = items[i]
                items[i] = (t | r.choice([NLA_F_NESTED, NLA_F_NET_BYTEORDER]), v)
            elif items:  # resize a payload
                i = r.randrange(len(items))
                t, v = items[i]
                items[i] = (t, v[:r.randrange(len(v) + 1)] + self.r.randbytes(r.randrange(5)))
        return items

    # messages

    def header(self, cmd: int, payload: bytes, flags: int | None = None, version: int = 1,
               reserved: int = 0, seq: int = 0, mtype: int | None = None) -> bytes:
        flags = F_REQUEST | F_ACK if flags is None else flags
        body = struct.pack("=BBH", cmd, version, reserved) + payload
        return NLMSG_HDR.pack(16 + len(body), self.family if mtype is None else mtype, flags,
                              seq, 0) + body

    def structured(self, seq: int) -> bytes:
        r = self.r
        cmd = r.choices([Cmd.GET_INFO, Cmd.SET_POLICY, Cmd.GET_POLICY, Cmd.DEL_POLICY,
                         Cmd.LIST_POLICIES, Cmd.MIGRATE, Cmd.SET_PREFETCH],
                        [6, 24, 13, 13, 5, 30, 9])[0]
        items: list[tuple[int, bytes]] = []
        if cmd in (Cmd.SET_POLICY, Cmd.GET_POLICY, Cmd.DEL_POLICY):
            items = self.client_attrs()
            if cmd == Cmd.SET_POLICY and r.random() < 0.97:
                items.append((A.FAULT_POLICY, self.scalar(4, r.choice([0, 1, 2, 1, 2, 3,
                                                                       self.u(32)]))))
        elif cmd == Cmd.SET_PREFETCH:
            as_id = r.choice(self.AS_IDS) if r.random() < 0.9 else self.u(64)
            items = [(A.AS_ID, self.scalar(8, as_id))]
            if r.random() < 0.85:  # else none: clears
                items.append((A.RANGES, self.prefetch_nest()))
        elif cmd == Cmd.MIGRATE:
            op = r.choice([0, 1, 0, 1, 2]) if r.random() > 0.02 else self.u(32)
            items = [(A.AS_ID, self.scalar(8, self.u(64))), (A.OP, self.scalar(4, op))]
            if r.random() < 0.4:  # well-formed ranges, so that batches go through
                body = b"".join(self.nest(A.RANGE, self.encode_list(self.valid_range(op)))
                                for _ in range(r.randrange(1, 4)))
            else:
                body = self.ranges_nest(op)
            items.append((A.RANGES, body))
        elif r.random() < 0.05:  # GET_INFO / LIST with an attribute
            items = [(r.randrange(ATTR_MAX + 1), self.r.randbytes(4))]
        items = self.mutate_list(items, 0.12)
        payload = b"".join(self.nest(t, v) if t == A.RANGES else enc(t, v) for t, v in items)
        if items and r.random() < 0.03:
            payload += self.r.randbytes(r.randrange(1, 4))
        flags = F_REQUEST | F_ACK
        if cmd == Cmd.LIST_POLICIES:
            flags = F_REQUEST | F_DUMP
        m = r.random()
        if m < 0.03:
            flags ^= F_DUMP  # dump on a doit command, or a LIST that is no dump
        elif m < 0.06:
            flags |= r.choice([0x8, 0x10, 0x20, 0x100, 0x200, 0x400, 0x800])
        version = 1 if r.random() > 0.05 else r.randrange(256)  # requests' version is free
        reserved = 0 if r.random() > 0.02 else r.randrange(1, 1 << 16)
        if r.random() < 0.02:
            cmd = r.choice([0, Cmd.EVENT, Cmd.SET_PREFETCH + 1, Cmd.SET_PREFETCH + 2, 100, 255])
        return self.header(cmd, payload, flags, version, reserved, seq)

    def random(self, seq: int) -> bytes:
        r = self.r
        cmd = r.randrange(12) if r.random() < 0.8 else r.randrange(256)
        if cmd == Cmd.SET_PREFETCH:  # not modelled here (it stores lists): test_30 covers it
            cmd = Cmd.GET_INFO
        if r.random() < 0.3:
            payload = self.r.randbytes(r.randrange(64))
        else:
            payload = b"".join(self.garbage_attr() for _ in range(r.randrange(6)))
        flags = F_REQUEST | F_ACK | (F_DUMP if r.random() < 0.2 else 0)
        return self.header(cmd, payload, flags, r.randrange(256),
                           0 if r.random() > 0.1 else self.u(16), seq)

    def oddity(self, seq: int) -> bytes:
        """Headers the kernel answers without looking inside, or not at all."""
        r = self.r
        k = r.randrange(7)
        msg = self.structured(seq)
        if k == 0:  # shorter than a netlink header
            return msg[:r.randrange(16)]
        if k == 1:  # nlmsg_len past the datagram
            return struct.pack("=I", len(msg) + r.randrange(1, 100)) + msg[4:]
        if k == 2:  # nlmsg_len below the header
            return struct.pack("=I", r.randrange(16)) + msg[4:]
        if k == 3:  # a genlmsghdr cut short
            n = r.randrange(16, 20)
            return struct.pack("=I", n) + msg[4:n]
        if k == 4:  # not a request (acked: NLM_F_ACK asks for it)
            return msg[:6] + struct.pack("=H", F_ACK | r.choice([0, 0x100, 0x8])) + msg[8:]
        if k == 5:  # a netlink control type
            return msg[:4] + struct.pack("=H", r.randrange(1, 0x10)) + msg[6:]
        return msg[:4] + struct.pack("=H", BOGUS_FAMILY) + msg[6:]  # a family that isn't

    def truncated(self, seq: int) -> bytes:
        """A message cut anywhere, its nlmsg_len telling the truth."""
        msg = self.structured(seq)
        n = self.r.randrange(16, len(msg) + 1)
        return struct.pack("=I", n) + msg[4:n]

    def netlink(self, seq: int) -> bytes:
        r = self.r.random()
        if r < 0.05:
            return self.oddity(seq)
        if r < 0.10:
            return self.truncated(seq)
        if r < 0.28:
            return self.random(seq)
        return self.structured(seq)


# -- ioctls -----------------------------------------------------------------------------

PROT_NONE, PROT_READ, PROT_RW = 0, 1, 3
MAP_PRIVATE_ANON = 0x02 | 0x20
BAD_POINTERS = [0, 0x10, 0x1000, 0xFFFFFFFF81000000, 0xFFFF888000000000, 0x0000800000000000,
                0xDEAD000000000000, MAX64 - 7]
# ioctl types the VFS handles itself before the driver (FIOCLEX, FIONBIO, FIFREEZE, ...)
VFS_TYPES = {0x00, 0x02, 0x12, 0x54, 0x58, 0x66, 0x94}
RANGE_FMT = struct.Struct("=QQIIIi")
BATCH_FMT = struct.Struct("=IIQIIQQ")


def libc():
    lib = ctypes.CDLL(None, use_errno=True)
    lib.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
    lib.ioctl.restype = ctypes.c_int
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                         ctypes.c_int, ctypes.c_long]
    lib.mmap.restype = ctypes.c_void_p
    lib.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return lib


LIBC = libc()


def sys_ioctl(fd: int, request: int, arg: int) -> int:
    """ioctl(2) with any pointer: 0 or the errno."""
    ctypes.set_errno(0)
    if LIBC.ioctl(fd, request, arg) < 0:
        return ctypes.get_errno()
    return 0


class Pages:
    """Anonymous memory: ``n`` read-write pages, then a PROT_NONE guard page at ``guard``."""

    def __init__(self, n: int):
        self.size = (n + 1) * PAGE
        self.addr = LIBC.mmap(None, self.size, PROT_RW, MAP_PRIVATE_ANON, -1, 0)
        if self.addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        self.guard = self.addr + n * PAGE
        self.protect(self.guard, PAGE, PROT_NONE)

    @staticmethod
    def protect(addr: int, size: int, prot: int) -> None:
        if LIBC.mprotect(addr, size, prot):
            raise OSError(ctypes.get_errno(), "mprotect")

    @staticmethod
    def write(addr: int, data: bytes) -> None:
        ctypes.memmove(addr, data, len(data))

    @staticmethod
    def read(addr: int, n: int) -> bytes:
        return ctypes.string_at(addr, n)

    def close(self) -> None:
        LIBC.munmap(self.addr, self.size)


class Fuzzer:
    """Sends, checks, counts. ``failures`` lists what the kernel did against the model."""

    def __init__(self, seed: int, priv: bool):
        self.seed, self.priv = seed, priv
        self.rng = random.Random(seed)
        self.nl = Genl()
        self.model = Model(self.nl.family, priv)
        self.gen = Gen(self.rng, self.nl.family)
        self.fd = os.open("/dev/gpuos", os.O_RDWR)
        self.mem = Pages(34)  # batch structs on page 0, ranges up to the guard
        self.ro = Pages(1)  # made read-only when used
        self.stats: dict[str, dict] = {"netlink": {}, "ioctl": {}}
        self.accepted: dict[str, int] = {}
        self.failures: list[str] = []
        self.n_netlink = self.n_ioctl = 0
        err, _ = self.nl.transact(BOGUS_FAMILY, 1)
        assert err == errno.ENOENT, f"family id {BOGUS_FAMILY:#x} exists here ({err})"

    def close(self) -> None:
        os.close(self.fd)
        self.mem.close()
        self.ro.close()
        self.nl.close()

    def fail(self, text: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(text)

    def count(self, door: str, outcome: str) -> None:
        self.stats[door][outcome] = self.stats[door].get(outcome, 0) + 1

    # netlink

    def one_netlink(self) -> None:
        seq = self.nl.next_seq()
        data = self.gen.netlink(seq)
        exp = self.model.netlink(data)
        self.n_netlink += 1
        try:
            self.nl.sock.send(data)
        except OSError as exc:
            if exc.errno not in exp.ok or not exp.silent:
                self.fail(f"netlink {exp.what}: send failed with {exc}; {data[:64].hex()}")
            self.count("netlink", f"send refused ({exp.what})")
            return
        if exp.silent and exp.ok != {0}:
            self.fail(f"netlink {exp.what}: sent, though it cannot be")
            return
        if exp.silent:
            self.count("netlink", f"no answer ({exp.what})")
            return
        try:
            err, bodies = self.nl.recv_for(seq, timeout=5)
        except (AssertionError, vmlib.NoReply) as exc:
            self.fail(f"netlink {exp.what}: {exc}; message {data[:64].hex()}")
            self.resync()
            return
        self.check("netlink", exp, err, bodies, data)

    def resync(self) -> None:
        """After a surprise, drop what is queued and start afresh on a new socket."""
        self.nl.close()
        self.nl = Genl()

    def check(self, door: str, exp: Expect, err: int, bodies, what) -> None:
        if err not in exp.ok:
            self.fail(f"{door} {exp.what}: got {errno.errorcode.get(err, err) if err else 'accepted'}, "
                      f"expected {sorted(errno.errorcode.get(e, 'accepted') for e in exp.ok)}; "
                      f"{what[:96].hex() if isinstance(what, bytes) else what}")
            return
        if err:
            self.count(door, errno.errorcode.get(err, str(err)))
            if exp.effect and err == errno.EIO:
                exp.effect()
            return
        self.count(door, "accepted")
        self.accepted[exp.what] = self.accepted.get(exp.what, 0) + 1
        try:
            if exp.verify:
                exp.verify(bodies)
            elif door == "netlink" and bodies:
                raise AssertionError(f"unexpected replies {bodies!r}")
        except AssertionError as exc:
            self.fail(f"{door} {exp.what} accepted, but the reply is wrong: {exc}")
        if exp.effect:
            exp.effect()

    # ioctls

    def one_ioctl(self) -> None:
        r = self.rng.random()
        self.n_ioctl += 1
        if r < 0.12:
            self.random_ioctl()
        elif r < 0.22:
            self.abi_ioctl()
        else:
            self.submit_ioctl()

    def random_ioctl(self) -> None:
        r = self.rng
        while True:
            if r.random() < 0.6:  # 'G', any number, direction and size
                req = (r.randrange(4) << 30) | (r.randrange(1 << 14) << 16) | (ord("G") << 8) | \
                    r.randrange(256)
            else:
                req = r.getrandbits(32)
            if req not in (IOC_ABI_VERSION, IOC_SUBMIT) and (req >> 8) & 0xFF not in VFS_TYPES:
                break
        arg = r.choice([self.mem.addr, 0, self.mem.guard, r.getrandbits(64)])
        err = sys_ioctl(self.fd, req, arg)
        self.check("ioctl", refuse(errno.ENOTTY, "unknown ioctl"), err, None, f"ioctl {req:#x}")

    def abi_ioctl(self) -> None:
        r = self.rng.random()
        if r < 0.5:
            addr = self.mem.addr + self.rng.randrange(0, PAGE - 4)
            self.mem.write(addr, b"\xff" * 4)
            err = sys_ioctl(self.fd, IOC_ABI_VERSION, addr)
            self.check("ioctl", Expect(what="ABI_VERSION"), err, None, "ABI_VERSION")
            if not err and self.mem.read(addr, 4) != struct.pack("=I", 1):
                self.fail(f"ABI_VERSION wrote {self.mem.read(addr, 4).hex()}")
            return
        if r < 0.65:
            addr = self.ro.addr + 4 * self.rng.randrange(PAGE // 4)
            self.ro.protect(self.ro.addr, PAGE, PROT_READ)
        else:
            addr = self.rng.choice(BAD_POINTERS + [self.mem.guard, self.mem.guard - 2])
        err = sys_ioctl(self.fd, IOC_ABI_VERSION, addr)
        self.check("ioctl", refuse(errno.EFAULT, "ABI_VERSION to a bad pointer"), err, None,
                   f"ABI_VERSION {addr:#x}")

    def rand_range(self, op: int) -> tuple[int, int, int, int, int]:
        r = self.rng
        if r.random() < 0.55:  # valid
            return (PAGE * r.randrange(1 << 36), PAGE * r.randrange(1, 1 << 10), r.randrange(33),
                    r.randrange(8), r.choice([1, 2]) if op == 1 else 0)
        g = self.gen
        return (r.choice([PAGE * r.randrange(1 << 20), r.getrandbits(64), MAX64 - PAGE + 1,
                          PAGE + r.randrange(1, PAGE)]),
                r.choice([PAGE, 0, r.randrange(1, PAGE), MAX64 - PAGE + 1, r.getrandbits(64)]),
                r.choice([0, 32, 33, g.u(32)]), r.choice([0, 7, 8, g.u(32)]),
                r.choice([0, 1, 2, 3, 4, g.u(32)]))

    def submit_ioctl(self) -> None:
        r = self.rng
        size = 40 if r.random() < 0.9 else r.choice([0, 32, 39, 41, 48, r.getrandbits(32)])
        op = r.choice([0, 1]) if r.random() < 0.93 else r.choice([2, 3, r.getrandbits(32)])
        flags = 0 if r.random() < 0.94 else r.choice([1, 2, 1 << 31, r.getrandbits(32)])
        x = r.random()
        nr = (r.randrange(1, 5) if x < 0.86 else 0 if x < 0.9 else
              MAX_RANGES if x < 0.905 else
              r.choice([MAX_RANGES + 1, MAX32, r.getrandbits(32), 17, 64]))
        as_id = r.getrandbits(64)
        ranges: list[tuple] = []
        if nr <= MAX_RANGES:
            ranges = ([self.rand_range(op) for _ in range(nr)] if nr < 64 else
                      [(PAGE * i, PAGE, 1, i % 8, 1 if op == 1 else 0) for i in range(nr)])
        # where the batch is: read-write, read-only (the batch id cannot be written back),
        # or unreadable; and the ranges: up to the guard page (all of them or the first
        # few only), read-only, or at a bad address
        bp, rp = r.random(), r.random()
        batch_where = "rw" if bp < 0.93 else "ro" if bp < 0.96 else "bad"
        ranges_where = ("rw" if rp < 0.78 else "partial" if rp < 0.82 else
                        "ro" if rp < 0.9 and batch_where != "ro" and nr * 32 <= PAGE else "bad")
        if nr == 0 or nr > MAX_RANGES:
            ranges_where = r.choice(["rw", "bad"])  # never read
        readable = ranges_where in ("rw", "ro") or nr == 0 or nr > MAX_RANGES
        if ranges_where in ("rw", "partial"):
            k = len(ranges) if ranges_where == "rw" else r.randrange(nr)
            raw = b"".join(RANGE_FMT.pack(*rg, r.randrange(-100, 100)) for rg in ranges[:k])
            ranges_ptr = self.mem.guard - len(raw)
            self.mem.write(ranges_ptr, raw)
        elif ranges_where == "ro":
            ranges_ptr = self.ro.addr
            self.ro_write(ranges_ptr, b"".join(RANGE_FMT.pack(*rg, 7) for rg in ranges))
        else:
            ranges_ptr = r.choice(BAD_POINTERS + [self.mem.guard])
        batch = BATCH_FMT.pack(size, op & MAX32, as_id, nr & MAX32, flags & MAX32, ranges_ptr,
                               0xABAB)
        if batch_where == "rw":
            batch_ptr = self.mem.addr + 8 * r.randrange(64)
            self.mem.write(batch_ptr, batch)
        elif batch_where == "ro":
            batch_ptr = self.ro.addr + PAGE - 40
            self.ro_write(batch_ptr, batch)
        else:
            batch_ptr = r.choice(BAD_POINTERS + [self.mem.guard - 20])
        exp, statuses = self.model.submit_ioctl(
            batch_where != "bad", (size, op & MAX32, as_id, nr & MAX32, flags & MAX32), readable,
            ranges if readable else [])
        write_back = ranges_where == "rw" and batch_where == "rw"
        if exp.ok == {0} and not write_back:
            # accepted, then writing the statuses or the id back faults: EFAULT, and the
            # batch is with the driver all the same
            exp.ok, exp.verify = {errno.EFAULT}, None
            exp.what += " (write-back faults)"
            exp.effect()
            exp.effect = None
        expected_id = self.model.next_id
        err = sys_ioctl(self.fd, IOC_SUBMIT, batch_ptr)
        what = (f"SUBMIT size={size} op={op} nr={nr} flags={flags:#x} batch={batch_where} "
                f"ranges={ranges_where}")
        self.check("ioctl", exp, err, None, what)
        if err not in exp.ok:
            return
        if err == 0:
            got = struct.unpack("=Q", self.mem.read(batch_ptr + 32, 8))[0]
            blk = self.mem.read(ranges_ptr, 32 * nr)
            st = [struct.unpack_from("=i", blk, 32 * i + 28)[0] for i in range(nr)]
            if expected_id is None:
                self.model.next_id = got + 1
            elif got != expected_id:
                self.fail(f"SUBMIT: batch id {got}, expected {expected_id}")
            if any(st):
                self.fail(f"SUBMIT accepted with statuses {st[:8]}")
        elif err == errno.EINVAL and statuses is not None and ranges_where == "rw":
            blk = self.mem.read(ranges_ptr, 32 * nr)
            st = [struct.unpack_from("=i", blk, 32 * i + 28)[0] for i in range(nr)]
            if st != statuses:
                self.fail(f"SUBMIT EINVAL statuses {st[:8]}, expected {statuses[:8]}; {what}")

    def ro_write(self, addr: int, data: bytes) -> None:
        """Write into the read-only page, which stays read-only."""
        self.ro.protect(self.ro.addr, PAGE, PROT_RW)
        self.ro.write(addr, data)
        self.ro.protect(self.ro.addr, PAGE, PROT_READ)

    # the whole run

    def set_driver(self, registered: bool | None = None, mode: str | None = None) -> None:
        """Changes the test driver's state (root only), in the model too."""
        if registered is not None and registered != self.model.registered:
            assert vmlib.dbg_write("register", "1\n" if registered else "0\n") == 0
            self.model.registered = registered
            if not registered:
                self.model.pending = 0  # completed with -ENODEV
        if mode is not None:
            assert vmlib.dbg_write("mode", mode + "\n") == 0
            self.model.mode = mode

    def run(self, messages: int, ioctls: int, schedule=None) -> dict:
        t0 = time.monotonic()
        total = max(messages, ioctls)
        plan = sorted(schedule or [])
        for i in range(total):
            while plan and plan[0][0] <= i / total:
                _, kw = plan.pop(0)
                self.set_driver(**kw)
            if i < messages:
                self.one_netlink()
            if i * ioctls // total != (i + 1) * ioctls // total:
                self.one_ioctl()
        # a last message: an answer to a message that should get none would show here
        try:
            err, bodies = self.nl.request(Cmd.GET_INFO)
            if err or len(bodies) != 1:
                self.fail(f"final GET_INFO: {err} {len(bodies)}")
        except (AssertionError, vmlib.NoReply) as exc:
            self.fail(f"final GET_INFO: {exc}")
        return self.summary(time.monotonic() - t0)

    def summary(self, seconds: float) -> dict:
        return {"seed": self.seed, "priv": self.priv, "netlink": self.n_netlink,
                "ioctls": self.n_ioctl, "seconds": round(seconds, 2), "outcomes": self.stats,
                "accepted": self.accepted, "failures": self.failures,
                "policies": sorted([k, c, p] for (k, c), p in self.model.policies.items())}


def main() -> int:
    ap = argparse.ArgumentParser(description="fuzz gpuos.ko (see the module docstring)")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--ioctls", type=int, default=1000)
    ap.add_argument("--unpriv", action="store_true", help="expect an unprivileged caller")
    args = ap.parse_args()
    if args.unpriv and os.geteuid() == 0:
        print("--unpriv as root: run it under setpriv", file=sys.stderr)
        return 2
    fz = Fuzzer(args.seed, priv=not args.unpriv)
    try:
        print(json.dumps(fz.run(args.messages, args.ioctls)))
    finally:
        fz.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
