"""A libgpuos ring writer in Python, from the protocol in gpuos_ring.h: for reader tests."""

from __future__ import annotations

import mmap
import os
import struct

from gpuos.intercept import ring as R

class Writer:
    """A single-threaded writer following gpuos_ring.h, for testing the reader."""

    def __init__(self, nslots: int = 16, func_cap: int = 4):
        self.nslots, self.func_cap = nslots, func_cap
        strtab_off = R.HDR_SIZE + nslots * R.SLOT_SIZE
        size = strtab_off + func_cap * R.FUNC_ENT.size + 256
        self.fd = os.memfd_create(R.MEMFD_NAME)
        os.ftruncate(self.fd, size)
        self.m = mmap.mmap(self.fd, size)
        struct.pack_into("<QIIII", self.m, 0, R.MAGIC, R.VERSION, R.HDR_SIZE, R.SLOT_SIZE, nslots)
        struct.pack_into("<I", self.m, 24, os.getpid())
        struct.pack_into("<I", self.m, 48, R.TRACK_ON)
        struct.pack_into("<QQIIQ", self.m, 328, strtab_off, size - strtab_off, func_cap, 0, 0)
        self.strtab_off = strtab_off
        self.names_used = 0

    @property
    def head(self) -> int:
        return struct.unpack_from("<Q", self.m, 32)[0]

    def _set_head(self, v: int) -> None:
        struct.pack_into("<Q", self.m, 32, v)

    def _slot(self, index: int) -> int:
        return R.HDR_SIZE + (index % self.nslots) * R.SLOT_SIZE

    def claim(self, nbytes: int) -> int:
        k = -(-nbytes // R.SLOT_PAYLOAD)
        n = self.head
        if n % self.nslots + k > self.nslots:  # pad to the end of the ring
            pad = self.nslots - n % self.nslots
            self._set_head(n + pad)
            self._commit(n, R.REC_HDR.pack(R.PAD, 0, pad * R.SLOT_PAYLOAD, 0, 0, 0))
            n += pad
        self._set_head(n + k)
        return n

    def _commit(self, n: int, data: bytes, skip_seq: bool = False) -> None:
        k = max(1, -(-len(data) // R.SLOT_PAYLOAD))
        data = data.ljust(k * R.SLOT_PAYLOAD, b"\0")
        for i in range(k):
            off = self._slot(n + i)
            self.m[off + 8:off + R.SLOT_SIZE] = data[i * R.SLOT_PAYLOAD:(i + 1) * R.SLOT_PAYLOAD]
            if i:
                struct.pack_into("<Q", self.m, off, n + i + 1)
        if not skip_seq:
            struct.pack_into("<Q", self.m, self._slot(n), (n + 1) | R.SLOT_START)

    def record(self, rtype: int, body: bytes, flags: int = 0, commit: bool = True) -> int:
        data = R.REC_HDR.pack(rtype, flags, R.REC_HDR.size + len(body), 123, 7, 0) + body
        n = self.claim(len(data))
        self._commit(n, data, skip_seq=not commit)
        return n

    def commit_later(self, n: int) -> None:
        struct.pack_into("<Q", self.m, self._slot(n), (n + 1) | R.SLOT_START)

    def function(self, handle: int, name: str, nparams: int) -> int:
        fid = struct.unpack_from("<I", self.m, 348)[0]
        names = self.strtab_off + self.func_cap * R.FUNC_ENT.size
        raw = name.encode()
        self.m[names + self.names_used:names + self.names_used + len(raw) + 1] = raw + b"\0"
        R.FUNC_ENT.pack_into(self.m, self.strtab_off + fid * R.FUNC_ENT.size, handle,
                             self.names_used, len(raw), nparams, 8 * nparams, 1)
        self.names_used += len(raw) + 1
        struct.pack_into("<I", self.m, 348, fid + 1)
        return fid


    def close(self) -> None:
        self.m.close()
        os.close(self.fd)


def launch_body(seq: int, func: int, bufs: list[tuple[int, int, int]]) -> bytes:
    body = R.LAUNCH_BODY.pack(seq, 0x10, 0x20, 0, 0xABC, func, 4, 1, 1, 128, 1, 1, 0, len(bufs), 0)
    for i, (base, size, ptr) in enumerate(bufs):
        body += R.BUF.pack(base, size, ptr, 0, i, 0, 0)
    return body
