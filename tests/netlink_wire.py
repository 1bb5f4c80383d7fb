"""gpuos.ko's netlink messages built by hand, byte by byte, as the kernel lays them out
(independent of pyroute2), for the host tests of gpuos.kernel.netlink."""

from __future__ import annotations

import struct

from gpuos.kernel.uapi import GENL_VERSION, Attr, Cmd, Counter

FAMILY = 0x1E  # any dynamic genl id
NESTED = 0x8000

# -- building messages by hand, as the kernel lays them out -----------------------------


def nla(attr: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, attr) + payload + b"\0" * (-length % 4)


def u32(attr: int, v: int) -> bytes:
    return nla(attr, struct.pack("=I", v))


def s32(attr: int, v: int) -> bytes:
    return nla(attr, struct.pack("=i", v))


def u64(attr: int, v: int) -> bytes:
    return nla(attr, struct.pack("=Q", v))


def string(attr: int, s: str) -> bytes:
    return nla(attr, s.encode() + b"\0")


def nest(attr: int, *children: bytes) -> bytes:
    return nla(attr | NESTED, b"".join(children))


def message(cmd: int, *attrs: bytes, version: int = GENL_VERSION, flags: int = 0) -> bytes:
    body = struct.pack("=BBH", cmd, version, 0) + b"".join(attrs)
    return struct.pack("=IHHII", 16 + len(body), FAMILY, flags, 0, 0) + body


def walk(data: bytes, offset: int, end: int):
    """(type with flags, payload) of each attribute in data[offset:end]."""
    while offset + 4 <= end:
        length, atype = struct.unpack_from("=HH", data, offset)
        yield atype, data[offset + 4:offset + length]
        offset += (length + 3) & ~3


def event(etype: int, seq: int, *attrs: bytes, version: int = GENL_VERSION) -> bytes:
    return message(Cmd.EVENT, u32(Attr.EVENT_TYPE, etype), u64(Attr.EVENT_SEQ, seq),
                   u64(Attr.EVENT_TIME_NS, 123_456_789_000 + seq), *attrs, version=version)


def info_reply(driver: str | None = "nvidia-uvm", caps: int = 0b1011, version=GENL_VERSION,
               extra_counter: bytes = b"") -> bytes:
    counters = [u64(Counter.FAULTS, 12), u64(Counter.DECISIONS_ISOLATE, 10),
                u64(Counter.EVENTS_UNSENT, 3), u64(Counter.OBJECTS, 0)]
    attrs = [u32(Attr.GENL_VERSION, 1), u32(Attr.ABI_VERSION, 1),
             string(Attr.MODULE_VERSION, "0.1.0")]
    if driver:
        attrs.append(string(Attr.DRIVER_NAME, driver))
    attrs += [u32(Attr.DRIVER_CAPS, caps if driver else 0), nla(Attr.PAD, b""),
              u64(Attr.EVENT_SEQ, 41), nest(Attr.COUNTERS, *counters, extra_counter)]
    return message(Cmd.GET_INFO, *attrs, version=version)
