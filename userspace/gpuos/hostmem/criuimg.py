"""The little of CRIU's image format gpuos reads and writes itself: an image is two u32
magics (IMG_COMMON_MAGIC, then the image's own), then entries, each a u32 length and a
protobuf message. Only what pagemap and mm images need: varint fields, and messages
nested in length-delimited ones."""

from __future__ import annotations

import struct

IMG_COMMON_MAGIC = 0x54564319


def varint(data: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[i]
        value |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            return value, i
        shift += 7


def fields(msg: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) of every field, in order: an int for a varint, bytes for a
    length-delimited field (a nested message, a string); fixed-width fields as bytes."""
    out: list[tuple[int, int | bytes]] = []
    i = 0
    while i < len(msg):
        key, i = varint(msg, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = varint(msg, i)
        elif wire == 2:
            n, i = varint(msg, i)
            value, i = msg[i:i + n], i + n
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
            value, i = msg[i:i + n], i + n
        else:
            raise ValueError(f"wire type {wire}")
        if i > len(msg):
            raise ValueError("truncated field")
        out.append((number, value))
    return out


def varints(msg: bytes) -> dict[int, int]:
    """The varint fields of a message (the last of a repeated one)."""
    return {n: v for n, v in fields(msg) if isinstance(v, int)}


def entries(data: bytes, magic: int) -> list[bytes]:
    """The messages of an image whose own magic is ``magic``."""
    if len(data) < 8 or struct.unpack_from("<II", data) != (IMG_COMMON_MAGIC, magic):
        raise ValueError("wrong magic" if len(data) >= 8 else "too short")
    out, i = [], 8
    while i < len(data):
        if i + 4 > len(data):
            raise ValueError("truncated entry")
        (n,) = struct.unpack_from("<I", data, i)
        if i + 4 + n > len(data):
            raise ValueError("truncated entry")
        out.append(data[i + 4:i + 4 + n])
        i += 4 + n
    return out


def put_varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(number: int, value: int) -> bytes:
    return put_varint(number << 3) + put_varint(value)


def frame(magic: int, messages: list[bytes]) -> bytes:
    return b"".join([struct.pack("<II", IMG_COMMON_MAGIC, magic)]
                    + [struct.pack("<I", len(m)) + m for m in messages])
