"""The generic netlink family "gpuos": info, policies, migrations, events.

Built on pyroute2's generic netlink (0.7.x, the API of Debian bookworm's
python3-pyroute2).  Use it as a context manager::

    with GpuosNetlink() as nl:
        info = nl.get_info()
        nl.set_policy(Client(pid=1234), FaultPolicy.ISOLATE)
        with nl.subscribe() as events:
            ev = events.next(timeout=5)

Every reply and event must carry GPUOS_GENL_VERSION in its genlmsghdr; another
version raises KmodVersionMismatch.  Kernel errnos become GpuosErrors
(errnos.py).  The encoders and decoders (``request_msg``, ``parse_*``) are
plain functions over pyroute2 message objects, usable without a socket.
"""

from __future__ import annotations

import errno
import os
import select
import struct
import time
from collections import deque
from typing import Any, Iterable, Iterator, Sequence

from pyroute2.netlink import (CTRL_CMD_DELFAMILY, CTRL_CMD_DELMCAST_GRP, CTRL_CMD_GETFAMILY,
                              GENL_ID_CTRL, NETLINK_ADD_MEMBERSHIP, NLA_F_NESTED, NLM_F_ACK,
                              NLM_F_DUMP, NLM_F_REQUEST, SOL_NETLINK, ctrlmsg, genlmsg, nla)
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.generic import GenericNetlinkSocket

from ..errors import GpuosError, KmodNotLoaded, KmodVersionMismatch
from .errnos import kernel_error
from .model import (Client, Event, Fault, FaultBatch, GapDetector, KmodInfo, Policy, Range, as_enum,
                    counter_name)
from .uapi import (GENL_NAME, GENL_VERSION, MAX_NL_RANGES, MCGRP_EVENTS, Attr, Cmd, Counter, Decision,
                   EventType, FaultAccess, FaultPolicy, FaultType, Op)

# -- message classes ------------------------------------------------------------

_NESTED = {Attr.COUNTERS: "counters", Attr.POLICY: "N", Attr.RANGES: "N", Attr.RANGE: "N",
           Attr.FAULT: "N", Attr.FAULT_ADDRS: "N"}
_TYPES = {
    Attr.UNSPEC: "none", Attr.PAD: "none",
    Attr.GENL_VERSION: "uint32", Attr.ABI_VERSION: "uint32",
    Attr.MODULE_VERSION: "asciiz", Attr.DRIVER_NAME: "asciiz", Attr.DRIVER_CAPS: "uint32",
    Attr.CLIENT_PID: "uint32", Attr.CLIENT_CGROUP: "uint64", Attr.FAULT_POLICY: "uint32",
    Attr.AS_ID: "uint64", Attr.OP: "uint32",
    Attr.RANGE_BASE: "uint64", Attr.RANGE_LEN: "uint64", Attr.RANGE_DEST: "uint32",
    Attr.RANGE_PRIO: "uint32", Attr.RANGE_FLAGS: "uint32", Attr.RANGE_STATUS: "int32",
    Attr.BATCH_ID: "uint64", Attr.EVENT_TYPE: "uint32", Attr.EVENT_SEQ: "uint64",
    Attr.EVENT_TIME_NS: "uint64",
    Attr.FAULT_VEID: "uint32", Attr.FAULT_ADDR: "uint64", Attr.FAULT_ACCESS: "uint32",
    Attr.FAULT_TYPE: "uint32", Attr.FAULT_GPU: "uint32", Attr.DECISION: "uint32",
    Attr.FAULT_BATCH_ID: "uint64", Attr.FAULT_NR: "uint32", Attr.FAULT_NR_INSTANCES: "uint32",
    Attr.FAULT_NR_FATAL: "uint32", Attr.FAULT_NR_THROTTLED: "uint32",
    Attr.FAULT_NR_SKIPPED: "uint32", Attr.FAULT_NR_READ: "uint32",
    Attr.FAULT_NR_WRITE: "uint32", Attr.FAULT_NR_ATOMIC: "uint32",
    Attr.FAULT_NR_PREFETCH: "uint32", Attr.FAULT_ADDR_MIN: "uint64",
    Attr.FAULT_ADDR_MAX: "uint64",
}
# GPUOS_A_FAULT_NR_<access> of a FAULT_BATCH event, by enum gpuos_fault_access.
_NR_BY_ACCESS = {FaultAccess.READ: Attr.FAULT_NR_READ, FaultAccess.WRITE: Attr.FAULT_NR_WRITE,
                 FaultAccess.ATOMIC: Attr.FAULT_NR_ATOMIC,
                 FaultAccess.PREFETCH: Attr.FAULT_NR_PREFETCH}


def attr_name(attr: Attr) -> str:
    return "GPUOS_A_" + attr.name


def _attr_map(nested: str) -> tuple[tuple[int, str, str], ...]:
    """The nla_map of enum gpuos_attr; nested attributes decode with class ``nested``."""
    return tuple((int(a), attr_name(a),
                  _TYPES[a] if a not in _NESTED else
                  (nested if _NESTED[a] == "N" else _NESTED[a]))
                 for a in Attr)


class GpuosCounters(nla):
    """GPUOS_A_COUNTERS: GPUOS_CTR_* u64s."""
    nla_flags = NLA_F_NESTED
    nla_map = tuple((int(c), "GPUOS_CTR_" + c.name,
                     "none" if c in (Counter.UNSPEC, Counter.PAD) else "uint64")
                    for c in Counter)


class GpuosAttrs(nla):
    """A nested attribute: attributes of the same space (enum gpuos_attr)."""
    nla_flags = NLA_F_NESTED
    nla_map = _attr_map("recursive")
    counters = GpuosCounters


class GpuosMsg(genlmsg):
    """A message of the "gpuos" family: genlmsghdr + enum gpuos_attr attributes."""
    nla_map = _attr_map("gpuos_nest")  # not "nested": pyroute2 >= 0.7.3 reserves that name
    gpuos_nest = GpuosAttrs
    counters = GpuosCounters


# -- encoding ---------------------------------------------------------------------

def nested(*attrs: tuple[Attr, Any]) -> dict[str, list]:
    """The value of a nested attribute holding ``attrs`` ((Attr, value) pairs)."""
    return {"attrs": [[attr_name(a), v] for a, v in attrs]}


def client_attrs(client: Client) -> list[tuple[Attr, int]]:
    out = []
    if client.pid is not None:
        out.append((Attr.CLIENT_PID, client.pid))
    if client.cgroup is not None:
        out.append((Attr.CLIENT_CGROUP, client.cgroup))
    return out


def range_attrs(r: Range) -> dict[str, list]:
    return nested((Attr.RANGE_BASE, r.base), (Attr.RANGE_LEN, r.len), (Attr.RANGE_DEST, r.dest),
                  (Attr.RANGE_PRIO, r.prio), (Attr.RANGE_FLAGS, r.flags))


def migrate_attrs(as_id: int, op: Op | int, ranges: Sequence[Range]) -> list[tuple[Attr, Any]]:
    return [(Attr.AS_ID, as_id), (Attr.OP, int(op)),
            (Attr.RANGES, nested(*[(Attr.RANGE, range_attrs(r)) for r in ranges]))]


def prefetch_attrs(as_id: int, ranges: Sequence[Any]) -> list[tuple[Attr, Any]]:
    """GPUOS_CMD_SET_PREFETCH: ranges are (base, len) pairs or objects with .base and .len;
    none clears the address space's ranges."""
    pairs = [(r.base, r.len) if hasattr(r, "base") else (r[0], r[1]) for r in ranges]
    attrs: list[tuple[Attr, Any]] = [(Attr.AS_ID, as_id)]
    if pairs:
        attrs.append((Attr.RANGES, nested(*[
            (Attr.RANGE, nested((Attr.RANGE_BASE, b), (Attr.RANGE_LEN, n))) for b, n in pairs])))
    return attrs


def request_msg(cmd: Cmd | int, attrs: Iterable[tuple[Attr, Any]] = (),
                version: int = GENL_VERSION) -> GpuosMsg:
    """A request (not yet encoded): cmd, version and attrs ((Attr, value) pairs; a nested
    value is ``nested(...)``)."""
    msg = GpuosMsg()
    msg["cmd"] = int(cmd)
    msg["version"] = version
    msg["reserved"] = 0
    msg["attrs"] = [[attr_name(a), v] for a, v in attrs]
    return msg


def encode(msg: GpuosMsg, family_id: int, flags: int = NLM_F_REQUEST, seq: int = 0,
           pid: int = 0) -> bytes:
    """The bytes of msg as sent to a family with id ``family_id``."""
    msg["header"]["type"] = family_id
    msg["header"]["flags"] = flags
    msg["header"]["sequence_number"] = seq
    msg["header"]["pid"] = pid
    msg.reset()
    msg.encode()
    return bytes(msg.data)


def decode(data: bytes) -> GpuosMsg:
    """One message of the family from its bytes (header included)."""
    msg = GpuosMsg(bytearray(data))
    msg.decode()
    return msg


# -- decoding -----------------------------------------------------------------------

def check_version(msg: Any) -> None:
    """Refuse a reply or event of another family version."""
    version = msg.get("version")
    if version != GENL_VERSION:
        raise KmodVersionMismatch(
            f"gpuos.ko speaks netlink family version {version}, this gpuos version "
            f"{GENL_VERSION}: install a matching gpuos")


def _get(node: Any, attr: Attr, default: Any = None) -> Any:
    return node.get_attr(attr_name(attr), default) if node is not None else default


def _all(node: Any, attr: Attr) -> list[Any]:
    return node.get_attrs(attr_name(attr)) if node is not None else []


def parse_client(node: Any) -> Client:
    return Client(pid=_get(node, Attr.CLIENT_PID), cgroup=_get(node, Attr.CLIENT_CGROUP))


def parse_policy(node: Any) -> Policy:
    """A GPUOS_A_POLICY nest: { client, GPUOS_A_FAULT_POLICY }."""
    return Policy(client=parse_client(node),
                  policy=as_enum(FaultPolicy, _get(node, Attr.FAULT_POLICY, 0)))


def parse_counters(node: Any) -> dict[str, int]:
    """GPUOS_A_COUNTERS: {"faults": n, ...}; a counter this version does not know (a newer
    module) is kept as "counter_N"."""
    counters: dict[str, int] = {}
    for name, value in (node["attrs"] if node is not None else []):
        if name in ("GPUOS_CTR_UNSPEC", "GPUOS_CTR_PAD"):
            continue
        if name.startswith("GPUOS_CTR_"):
            counters[name[len("GPUOS_CTR_"):].lower()] = int(value)
        elif name == "UNKNOWN" and value["header"]["length"] == 12:
            ctr = value["header"]["type"] & ~NLA_F_NESTED
            counters[counter_name(ctr)] = struct.unpack_from("Q", value.data, value.offset + 4)[0]
    return counters


def parse_info(msg: Any) -> KmodInfo:
    check_version(msg)
    return KmodInfo(genl_version=_get(msg, Attr.GENL_VERSION, 0),
                    abi_version=_get(msg, Attr.ABI_VERSION, 0),
                    module_version=_get(msg, Attr.MODULE_VERSION, "") or "",
                    driver_name=_get(msg, Attr.DRIVER_NAME),
                    driver_caps=_get(msg, Attr.DRIVER_CAPS, 0),
                    event_seq=_get(msg, Attr.EVENT_SEQ, 0),
                    counters=parse_counters(_get(msg, Attr.COUNTERS)))


def parse_fault(node: Any) -> Fault:
    def enum_or_none(enum: type, attr: Attr) -> Any:
        value = _get(node, attr)
        return None if value is None else as_enum(enum, value)
    return Fault(pid=_get(node, Attr.CLIENT_PID), cgroup=_get(node, Attr.CLIENT_CGROUP),
                 as_id=_get(node, Attr.AS_ID), veid=_get(node, Attr.FAULT_VEID),
                 addr=_get(node, Attr.FAULT_ADDR),
                 access=enum_or_none(FaultAccess, Attr.FAULT_ACCESS),
                 type=enum_or_none(FaultType, Attr.FAULT_TYPE), gpu=_get(node, Attr.FAULT_GPU),
                 decision=enum_or_none(Decision, Attr.DECISION))


def parse_fault_batch(node: Any) -> FaultBatch:
    """The GPUOS_A_FAULT nest of a FAULT_BATCH event."""
    by_access = {}
    for access, attr in _NR_BY_ACCESS.items():
        value = _get(node, attr)
        if value is not None:
            by_access[access.name.lower()] = value
    return FaultBatch(pid=_get(node, Attr.CLIENT_PID), cgroup=_get(node, Attr.CLIENT_CGROUP),
                      as_id=_get(node, Attr.AS_ID), gpu=_get(node, Attr.FAULT_GPU),
                      batch_id=_get(node, Attr.FAULT_BATCH_ID), faults=_get(node, Attr.FAULT_NR),
                      instances=_get(node, Attr.FAULT_NR_INSTANCES),
                      fatal=_get(node, Attr.FAULT_NR_FATAL),
                      throttled=_get(node, Attr.FAULT_NR_THROTTLED),
                      skipped=_get(node, Attr.FAULT_NR_SKIPPED), by_access=by_access,
                      addr_min=_get(node, Attr.FAULT_ADDR_MIN),
                      addr_max=_get(node, Attr.FAULT_ADDR_MAX),
                      addrs=[a for a in _all(_get(node, Attr.FAULT_ADDRS), Attr.FAULT_ADDR)])


def parse_event(msg: Any) -> Event:
    """A GPUOS_CMD_EVENT message as an Event (gap not set)."""
    check_version(msg)
    if msg.get("cmd") != Cmd.EVENT:
        raise GpuosError(f"expected an event from gpuos.ko, got command {msg.get('cmd')}")
    etype = as_enum(EventType, _get(msg, Attr.EVENT_TYPE, 0))
    ev = Event(seq=_get(msg, Attr.EVENT_SEQ, 0), time_ns=_get(msg, Attr.EVENT_TIME_NS, 0),
               type=etype)
    if etype in (EventType.FAULT, EventType.CLIENT_ISOLATED):
        ev.fault = parse_fault(_get(msg, Attr.FAULT))
    elif etype == EventType.FAULT_BATCH:
        ev.fault_batch = parse_fault_batch(_get(msg, Attr.FAULT))
    elif etype == EventType.MIGRATION_DONE:
        ev.batch_id = _get(msg, Attr.BATCH_ID)
        ev.as_id = _get(msg, Attr.AS_ID)
        ev.statuses = [_get(r, Attr.RANGE_STATUS, 0)
                       for r in _all(_get(msg, Attr.RANGES), Attr.RANGE)]
    elif etype in (EventType.DRIVER_REGISTERED, EventType.DRIVER_UNREGISTERED):
        ev.driver_name = _get(msg, Attr.DRIVER_NAME)
    elif etype in (EventType.POLICY_SET, EventType.POLICY_DELETED):
        ev.policy = parse_policy(_get(msg, Attr.POLICY))
    return ev


# -- sockets ----------------------------------------------------------------------------

class _GenlSocket(GenericNetlinkSocket):
    """pyroute2's socket, resolving the family without logging to the root logger."""

    def discovery(self, proto: str) -> Any:
        msg = ctrlmsg()
        msg["cmd"] = CTRL_CMD_GETFAMILY
        msg["version"] = 1
        msg["attrs"].append(["CTRL_ATTR_FAMILY_NAME", proto])
        msg["header"]["type"] = GENL_ID_CTRL
        msg["header"]["flags"] = NLM_F_REQUEST
        msg["header"]["pid"] = self.pid
        msg.encode()
        self.sendto(msg.data, (0, 0))
        reply = self.get()[0]
        err = reply["header"].get("error")
        if err is not None:
            raise err
        return reply


def _open_socket() -> _GenlSocket:
    """A socket bound to the family; KmodNotLoaded if there is none."""
    try:
        sock = _GenlSocket(ext_ack=True)
    except OSError as exc:
        raise GpuosError(f"cannot open a generic netlink socket: {exc.strerror}") from None
    try:
        sock.bind(GENL_NAME, GpuosMsg)
    except NetlinkError as exc:
        sock.close()
        if exc.code == errno.ENOENT:
            raise KmodNotLoaded(f'gpuos.ko is not loaded: no generic netlink family '
                                f'"{GENL_NAME}" (modprobe gpuos)') from None
        raise kernel_error(exc.code, f'resolving the netlink family "{GENL_NAME}"') from None
    except BaseException:
        sock.close()
        raise
    return sock


def _netlink_detail(exc: NetlinkError) -> str | None:
    msg = exc.args[1] if len(exc.args) > 1 else None
    if not msg or msg == os.strerror(exc.code):
        return None
    return str(msg)


class GpuosNetlink:
    """A connection to the "gpuos" family; a context manager.

    Raises KmodNotLoaded when the family does not exist.  Commands marked admin
    in the header, and listening to events, need CAP_SYS_ADMIN (NotPermitted otherwise).
    """

    def __init__(self) -> None:
        self._sock = _open_socket()

    @property
    def family_id(self) -> int:
        return self._sock.prid

    @property
    def mcast_groups(self) -> dict[str, int]:
        return dict(self._sock.mcast_groups)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> GpuosNetlink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- raw requests -----------------------------------------------------------------

    def request(self, cmd: Cmd | int, attrs: Iterable[tuple[Attr, Any]] = (), *,
                dump: bool = False, what: str | None = None, needs: str = "CAP_SYS_ADMIN",
                version: int = GENL_VERSION, reserved: int = 0) -> list[GpuosMsg]:
        """Send one request; return the family's reply messages (none for an ack alone).

        Kernel errors raise the GpuosError of errnos.kernel_error.  Replies are
        checked for GPUOS_GENL_VERSION.
        """
        msg = request_msg(cmd, attrs, version=version)
        msg["reserved"] = reserved
        flags = NLM_F_REQUEST | (NLM_F_DUMP if dump else NLM_F_ACK)
        try:
            replies = self._sock.nlm_request(msg, msg_type=self.family_id, msg_flags=flags)
        except NetlinkError as exc:
            raise kernel_error(exc.code, what or _cmd_text(cmd), needs=needs,
                               detail=_netlink_detail(exc), max_ranges=MAX_NL_RANGES) from None
        out = [r for r in replies if r["header"]["type"] == self.family_id]
        for r in out:
            err = r["header"].get("error")
            if err is not None:
                raise GpuosError(f"{what or _cmd_text(cmd)}: undecodable reply from gpuos.ko "
                                 f"({err})")
            check_version(r)
        return out

    def _one(self, replies: list[GpuosMsg], what: str) -> GpuosMsg:
        if len(replies) != 1:
            raise GpuosError(f"{what}: expected one reply from gpuos.ko, got {len(replies)}")
        return replies[0]

    # -- commands -------------------------------------------------------------------------

    def get_info(self) -> KmodInfo:
        return parse_info(self._one(self.request(Cmd.GET_INFO, what="reading gpuos.ko's info"),
                                    "reading gpuos.ko's info"))

    def set_policy(self, client: Client, policy: FaultPolicy | int) -> None:
        self.request(Cmd.SET_POLICY, [*client_attrs(client), (Attr.FAULT_POLICY, int(policy))],
                     what=f"setting the policy of {client.describe()}")

    def get_policy(self, client: Client) -> Policy:
        what = f"reading the policy of {client.describe()}"
        reply = self._one(self.request(Cmd.GET_POLICY, client_attrs(client), what=what), what)
        node = _get(reply, Attr.POLICY)
        if node is None:
            raise GpuosError(f"{what}: the reply from gpuos.ko has no GPUOS_A_POLICY")
        return parse_policy(node)

    def del_policy(self, client: Client) -> None:
        self.request(Cmd.DEL_POLICY, client_attrs(client),
                     what=f"deleting the policy of {client.describe()}")

    def list_policies(self) -> list[Policy]:
        replies = self.request(Cmd.LIST_POLICIES, dump=True, what="listing policies")
        return [parse_policy(_get(r, Attr.POLICY)) for r in replies
                if _get(r, Attr.POLICY) is not None]

    def migrate(self, as_id: int, op: Op | int, ranges: Sequence[Range]) -> int:
        """Submit a batch (at most GPUOS_MAX_NL_RANGES ranges; more: Chardev.submit); returns
        its batch id.  Completion is a MIGRATION_DONE event, which may arrive before the
        reply: subscribe first."""
        what = f"submitting a batch of {len(ranges)} range(s)"
        reply = self._one(self.request(Cmd.MIGRATE, migrate_attrs(as_id, op, ranges), what=what),
                          what)
        batch_id = _get(reply, Attr.BATCH_ID)
        if batch_id is None:
            raise GpuosError(f"{what}: the reply from gpuos.ko has no GPUOS_A_BATCH_ID")
        return batch_id

    def set_prefetch(self, as_id: int, ranges: Sequence[Any] = ()) -> None:
        """Replace address space ``as_id``'s prefetch ranges ((base, len) pairs or Range
        objects; at most GPUOS_MAX_NL_RANGES, page-aligned, disjoint); none clears them.
        The driver reads them while servicing that address space's faults."""
        what = f"setting {len(ranges)} prefetch range(s) of address space {as_id:#x}"
        self.request(Cmd.SET_PREFETCH, prefetch_attrs(as_id, ranges), what=what)

    def subscribe(self, baseline: bool = True) -> EventSubscription:
        """Join the "events" group.  With ``baseline``, the last event number is read
        after joining, so events missed from then on show as gaps."""
        sub = EventSubscription()
        try:
            if baseline:
                sub.detector.last = self.get_info().event_seq
        except BaseException:
            sub.close()
            raise
        return sub


_CMD_TEXT = {Cmd.GET_INFO: "reading gpuos.ko's info", Cmd.SET_POLICY: "setting a policy",
             Cmd.GET_POLICY: "reading a policy", Cmd.DEL_POLICY: "deleting a policy",
             Cmd.LIST_POLICIES: "listing policies", Cmd.MIGRATE: "submitting a batch",
             Cmd.SET_PREFETCH: "setting prefetch ranges"}


def _cmd_text(cmd: int) -> str:
    try:
        return _CMD_TEXT[Cmd(cmd)]
    except (ValueError, KeyError):
        return f"gpuos command {int(cmd)}"


class EventSubscription:
    """A socket joined to the multicast group "events"; a context manager and an iterator.

    ``next(timeout)`` returns the next Event (its ``gap`` set when events were
    missed just before it) or None on timeout.  Iterating yields events until
    gpuos.ko is unloaded.

    Unloading the module drops the socket from the group without a word (the
    kernel neither closes nor wakes it), so the subscription also listens to
    nlctrl's "notify" group: when the family goes away, ``next`` raises
    KmodNotLoaded instead of waiting forever.
    """

    def __init__(self) -> None:
        self._sock = _open_socket()
        try:
            group = self._sock.mcast_groups.get(MCGRP_EVENTS)
            if group is None:
                raise KmodVersionMismatch(f'gpuos.ko has no multicast group "{MCGRP_EVENTS}" '
                                          f'(another version of the module?)')
            try:
                self._sock.add_membership(MCGRP_EVENTS)
            except OSError as exc:  # events name other users' processes and addresses
                raise kernel_error(exc.errno or errno.EPERM, "listening to gpuos.ko's events") from None
            # nlctrl's "notify" group (its id is GENL_ID_CTRL): CTRL_CMD_DELFAMILY says the
            # family, and with it this subscription, is gone.  Anyone may join it.
            self._sock.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, GENL_ID_CTRL)
        except BaseException:
            self._sock.close()
            raise
        self.detector = GapDetector()
        self.overflows = 0  # times the socket's buffer overflowed (ENOBUFS)
        self._pending: deque[Any] = deque()

    def fileno(self) -> int:
        return self._sock.fileno()

    @property
    def missed(self) -> int:
        return self.detector.missed

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> EventSubscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Event]:
        while True:
            ev = self.next()
            if ev is not None:
                yield ev

    def next(self, timeout: float | None = None) -> Event | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        family = self._sock.prid
        while True:
            while self._pending:
                msg = self._pending.popleft()
                if msg["header"]["type"] == GENL_ID_CTRL:
                    if msg.get("cmd") in (CTRL_CMD_DELFAMILY, CTRL_CMD_DELMCAST_GRP) and \
                            msg.get_attr("CTRL_ATTR_FAMILY_ID") == family:
                        raise KmodNotLoaded("gpuos.ko was unloaded: no more events")
                    continue  # another family's news
                if msg["header"]["type"] != family:
                    continue
                err = msg["header"].get("error")
                if err is not None:
                    raise GpuosError(f"undecodable event from gpuos.ko ({err})")
                if msg.get("cmd") != Cmd.EVENT:
                    continue
                ev = parse_event(msg)
                ev.gap = self.detector.feed(ev.seq)
                return ev
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            ready, _, _ = select.select([self._sock.fileno()], [], [],
                                        None if left is None else max(left, 0))
            if not ready:
                return None
            try:
                self._pending.extend(self._sock.get())
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise GpuosError(f"reading events: {exc.strerror}") from None
                self.overflows += 1  # the next event's number shows what was lost
