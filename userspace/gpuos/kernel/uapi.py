"""kmod/uapi/gpuos.h mirrored by hand: constants, enums, structs, ioctl numbers.

Every name the header defines has a mirror here; ``c_names()`` maps each C
name to its Python value.  tests/unit/test_kernel_uapi.py compiles a C
program against the header and compares the two, so they cannot drift.
Change this file only together with the header.
"""

from __future__ import annotations

import ctypes
from enum import IntEnum, IntFlag

GENL_NAME = "gpuos"
GENL_VERSION = 1
MCGRP_EVENTS = "events"
ABI_VERSION = 1

MAX_RANGES = 4096  # per batch (ioctl)
MAX_NL_RANGES = 1024  # per GPUOS_CMD_MIGRATE (netlink)
MAX_PENDING = 1024  # batches not yet completed by the driver
MAX_POLICIES = 4096
MAX_GPUS = 32
MAX_PRIO = 7
PAGE_SIZE = 4096
FAULT_BATCH_ADDRS = 8  # addresses in one FAULT_BATCH event
FAULT_BATCH_MAX_FAULTS = 65536  # faults of one client in one fault batch
MAX_PREFETCH_AS = 256  # address spaces with prefetch ranges at once
PREFETCH_WINDOW = 2 << 20  # the window gpuos_prefetch_lookup searches around a fault


class Cmd(IntEnum):
    """enum gpuos_cmd (GPUOS_CMD_*)."""
    UNSPEC = 0
    GET_INFO = 1
    SET_POLICY = 2
    GET_POLICY = 3
    DEL_POLICY = 4
    LIST_POLICIES = 5
    MIGRATE = 6
    EVENT = 7
    SET_PREFETCH = 8


CMD_END = 9  # __GPUOS_CMD_MAX
CMD_MAX = 8  # GPUOS_CMD_MAX


class Attr(IntEnum):
    """enum gpuos_attr (GPUOS_A_*): the family's one attribute space."""
    UNSPEC = 0
    PAD = 1
    GENL_VERSION = 2
    ABI_VERSION = 3
    MODULE_VERSION = 4
    DRIVER_NAME = 5
    DRIVER_CAPS = 6
    COUNTERS = 7
    CLIENT_PID = 8
    CLIENT_CGROUP = 9
    FAULT_POLICY = 10
    POLICY = 11
    AS_ID = 12
    OP = 13
    RANGES = 14
    RANGE = 15
    RANGE_BASE = 16
    RANGE_LEN = 17
    RANGE_DEST = 18
    RANGE_PRIO = 19
    RANGE_FLAGS = 20
    RANGE_STATUS = 21
    BATCH_ID = 22
    EVENT_TYPE = 23
    EVENT_SEQ = 24
    EVENT_TIME_NS = 25
    FAULT = 26
    FAULT_VEID = 27
    FAULT_ADDR = 28
    FAULT_ACCESS = 29
    FAULT_TYPE = 30
    FAULT_GPU = 31
    DECISION = 32
    FAULT_BATCH_ID = 33
    FAULT_NR = 34
    FAULT_NR_INSTANCES = 35
    FAULT_NR_FATAL = 36
    FAULT_NR_THROTTLED = 37
    FAULT_NR_SKIPPED = 38
    FAULT_NR_READ = 39
    FAULT_NR_WRITE = 40
    FAULT_NR_ATOMIC = 41
    FAULT_NR_PREFETCH = 42
    FAULT_ADDR_MIN = 43
    FAULT_ADDR_MAX = 44
    FAULT_ADDRS = 45


ATTR_END = 46  # __GPUOS_A_MAX
ATTR_MAX = 45  # GPUOS_A_MAX


class Counter(IntEnum):
    """enum gpuos_counter (GPUOS_CTR_*): the u64s inside GPUOS_A_COUNTERS."""
    UNSPEC = 0
    PAD = 1
    FAULTS = 2
    DECISIONS_DEFAULT = 3
    DECISIONS_ISOLATE = 4
    DECISIONS_KILL = 5
    BATCHES = 6
    RANGES = 7
    BATCHES_DONE = 8
    REJECTED = 9
    EVENTS = 10
    EVENTS_UNSENT = 11
    POLICIES = 12
    OBJECTS = 13
    FAULT_BATCHES = 14


CTR_END = 15  # __GPUOS_CTR_MAX
CTR_MAX = 14  # GPUOS_CTR_MAX


class FaultPolicy(IntEnum):
    """enum gpuos_fault_policy (GPUOS_FAULT_*)."""
    DEFAULT = 0
    ISOLATE = 1
    KILL_CLIENT = 2


FAULT_POLICY_END = 3  # __GPUOS_FAULT_POLICY_MAX


class Decision(IntEnum):
    """enum gpuos_decision (GPUOS_DECISION_*)."""
    DEFAULT = 0
    ISOLATE = 1
    KILL_CLIENT = 2


class FaultAccess(IntEnum):
    """enum gpuos_fault_access (GPUOS_ACCESS_*)."""
    READ = 0
    WRITE = 1
    ATOMIC = 2
    PREFETCH = 3


ACCESS_END = 4  # __GPUOS_ACCESS_MAX


class FaultType(IntEnum):
    """enum gpuos_fault_type (GPUOS_FAULT_TYPE_*)."""
    INVALID_PDE = 0
    INVALID_PTE = 1
    WRITE = 2
    ATOMIC = 3
    OTHER = 4


FAULT_TYPE_END = 5  # __GPUOS_FAULT_TYPE_MAX


class Op(IntEnum):
    """enum gpuos_op (GPUOS_OP_*)."""
    MIGRATE = 0
    HINT = 1


OP_END = 2  # __GPUOS_OP_MAX


class EventType(IntEnum):
    """enum gpuos_event_type (GPUOS_EVENT_*)."""
    FAULT = 1
    CLIENT_ISOLATED = 2
    MIGRATION_DONE = 3
    DRIVER_REGISTERED = 4
    DRIVER_UNREGISTERED = 5
    POLICY_SET = 6
    POLICY_DELETED = 7
    FAULT_BATCH = 8


EVENT_END = 9  # __GPUOS_EVENT_MAX


class DriverCaps(IntFlag):
    """enum gpuos_driver_caps (GPUOS_CAP_*): bits of GPUOS_A_DRIVER_CAPS."""
    FAULT_REPORTS = 1 << 0
    MIGRATE = 1 << 1
    HINT = 1 << 2
    STOP_CLIENT = 1 << 3


DEST_CPU = 0


def DEST_GPU(i: int) -> int:  # noqa: N802 - the C macro's name
    """GPUOS_DEST_GPU(i): the destination naming GPU index i."""
    return i + 1


RANGE_EVICT_FIRST = 1 << 0
RANGE_EVICT_LAST = 1 << 1


class GpuosRange(ctypes.Structure):
    """struct gpuos_range (32 bytes)."""
    _fields_ = [
        ("base", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
        ("dest", ctypes.c_uint32),
        ("prio", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("status", ctypes.c_int32),
    ]


class GpuosBatch(ctypes.Structure):
    """struct gpuos_batch; ``ranges`` is a user pointer to GpuosRange[nr_ranges]."""
    _fields_ = [
        ("size", ctypes.c_uint32),
        ("op", ctypes.c_uint32),
        ("as_id", ctypes.c_uint64),
        ("nr_ranges", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("ranges", ctypes.c_uint64),
        ("batch_id", ctypes.c_uint64),
    ]


# <linux/ioctl.h>, the generic encoding (x86, arm64, riscv; not powerpc, mips,
# sparc or alpha, whose direction bits differ).
_IOC_NRBITS, _IOC_TYPEBITS, _IOC_SIZEBITS = 8, 8, 14
_IOC_NRSHIFT = 0
_IOC_TYPESHIFT = _IOC_NRSHIFT + _IOC_NRBITS
_IOC_SIZESHIFT = _IOC_TYPESHIFT + _IOC_TYPEBITS
_IOC_DIRSHIFT = _IOC_SIZESHIFT + _IOC_SIZEBITS
_IOC_WRITE, _IOC_READ = 1, 2


def _IOC(direction: int, type_: int, nr: int, size: int) -> int:  # noqa: N802
    assert size < (1 << _IOC_SIZEBITS)
    return ((direction << _IOC_DIRSHIFT) | (type_ << _IOC_TYPESHIFT)
            | (nr << _IOC_NRSHIFT) | (size << _IOC_SIZESHIFT))


def _IOR(type_: int, nr: int, size: int) -> int:  # noqa: N802
    return _IOC(_IOC_READ, type_, nr, size)


def _IOWR(type_: int, nr: int, size: int) -> int:  # noqa: N802
    return _IOC(_IOC_READ | _IOC_WRITE, type_, nr, size)


IOC_MAGIC = "G"
IOC_ABI_VERSION = _IOR(ord(IOC_MAGIC), 0x00, ctypes.sizeof(ctypes.c_uint32))
IOC_SUBMIT = _IOWR(ord(IOC_MAGIC), 0x01, ctypes.sizeof(GpuosBatch))

# Each enum with the prefix its members carry in C.
ENUM_PREFIXES: tuple[tuple[type, str, str], ...] = (
    (Cmd, "gpuos_cmd", "GPUOS_CMD_"),
    (Attr, "gpuos_attr", "GPUOS_A_"),
    (Counter, "gpuos_counter", "GPUOS_CTR_"),
    (FaultPolicy, "gpuos_fault_policy", "GPUOS_FAULT_"),
    (Decision, "gpuos_decision", "GPUOS_DECISION_"),
    (FaultAccess, "gpuos_fault_access", "GPUOS_ACCESS_"),
    (FaultType, "gpuos_fault_type", "GPUOS_FAULT_TYPE_"),
    (Op, "gpuos_op", "GPUOS_OP_"),
    (EventType, "gpuos_event_type", "GPUOS_EVENT_"),
    (DriverCaps, "gpuos_driver_caps", "GPUOS_CAP_"),
)

STRUCTS: dict[str, type[ctypes.Structure]] = {
    "gpuos_range": GpuosRange,
    "gpuos_batch": GpuosBatch,
}


def c_names() -> dict[str, int | str]:
    """Every enum member and object-like #define of the header: C name -> value here.

    (The function-like macro GPUOS_DEST_GPU(i) is DEST_GPU.)
    """
    names: dict[str, int | str] = {}
    for enum, _, prefix in ENUM_PREFIXES:
        for member in enum:
            names[prefix + member.name] = int(member)
    names.update({
        "__GPUOS_CMD_MAX": CMD_END, "GPUOS_CMD_MAX": CMD_MAX,
        "__GPUOS_A_MAX": ATTR_END, "GPUOS_A_MAX": ATTR_MAX,
        "__GPUOS_CTR_MAX": CTR_END, "GPUOS_CTR_MAX": CTR_MAX,
        "__GPUOS_FAULT_POLICY_MAX": FAULT_POLICY_END,
        "__GPUOS_ACCESS_MAX": ACCESS_END,
        "__GPUOS_FAULT_TYPE_MAX": FAULT_TYPE_END,
        "__GPUOS_OP_MAX": OP_END,
        "__GPUOS_EVENT_MAX": EVENT_END,
        "GPUOS_GENL_NAME": GENL_NAME,
        "GPUOS_GENL_VERSION": GENL_VERSION,
        "GPUOS_MCGRP_EVENTS": MCGRP_EVENTS,
        "GPUOS_ABI_VERSION": ABI_VERSION,
        "GPUOS_MAX_RANGES": MAX_RANGES,
        "GPUOS_MAX_NL_RANGES": MAX_NL_RANGES,
        "GPUOS_MAX_PENDING": MAX_PENDING,
        "GPUOS_MAX_POLICIES": MAX_POLICIES,
        "GPUOS_MAX_GPUS": MAX_GPUS,
        "GPUOS_MAX_PRIO": MAX_PRIO,
        "GPUOS_PAGE_SIZE": PAGE_SIZE,
        "GPUOS_FAULT_BATCH_ADDRS": FAULT_BATCH_ADDRS,
        "GPUOS_FAULT_BATCH_MAX_FAULTS": FAULT_BATCH_MAX_FAULTS,
        "GPUOS_MAX_PREFETCH_AS": MAX_PREFETCH_AS,
        "GPUOS_PREFETCH_WINDOW": PREFETCH_WINDOW,
        "GPUOS_DEST_CPU": DEST_CPU,
        "GPUOS_RANGE_EVICT_FIRST": RANGE_EVICT_FIRST,
        "GPUOS_RANGE_EVICT_LAST": RANGE_EVICT_LAST,
        "GPUOS_IOC_MAGIC": ord(IOC_MAGIC),  # a char constant: an int in C
        "GPUOS_IOC_ABI_VERSION": IOC_ABI_VERSION,
        "GPUOS_IOC_SUBMIT": IOC_SUBMIT,
    })
    return names


def policy_name(policy: FaultPolicy | Decision | int) -> str:
    """The CLI's name of a policy or decision: default, isolate, kill-client."""
    try:
        return FaultPolicy(int(policy)).name.lower().replace("_", "-")
    except ValueError:
        return f"unknown-{int(policy)}"


def enum_name(enum: type[IntEnum], value: int) -> str:
    """A member's name in lower case with dashes, or unknown-N for a value we don't know."""
    try:
        return enum(value).name.lower().replace("_", "-")
    except ValueError:
        return f"unknown-{value}"


def caps_names(caps: int) -> list[str]:
    """The names of the capability bits set in caps (unknown bits as bit-N)."""
    names = [c.name.lower().replace("_", "-") for c in DriverCaps if caps & c]
    known = sum(int(c) for c in DriverCaps)
    names += [f"bit-{i}" for i in range(32) if caps & ~known & (1 << i)]
    return names
