"""gpuos's page server: the pages of a restored process that CRIU's lazy-pages daemon asks
for, read from the image's chunks (``python -m gpuos.hostmem.server``).

It speaks CRIU's page-server protocol for lazy restore (criu/page-xfer.c) on a socket the
daemon got with ``--ps-socket``: each request is a ``page_server_iov`` {u32 cmd, u64
nr_pages, u64 vaddr, u64 dst_id} (32 bytes, native layout); PS_IOV_GET asks for nr_pages
of task dst_id (its pid in the image) from vaddr, and is answered in order with the same
header (cmd PS_IOV_ADD_F with PE_PRESENT, nr_pages possibly fewer: up to the end of that
pagemap entry) followed by the pages; PS_IOV_CLOSE is answered with an s32 0 and ends it.

Every chunk is checked against its name as it is read. A corrupt or missing one is said on
the report descriptor (``error MESSAGE``) and the server then answers nothing more but
keeps the socket open: the process that wanted the page waits, it never gets a zero page
(which is what it would get if the daemon lost its page server), until gpuos ends it. At
the end the report gets ``done {json}``. A process of its own, in a session of its own,
holding the store's shared lock: a gpuos that dies mid-restore does not take the pages
away from a process that is running on them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import threading
import time
from bisect import bisect_right
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..errors import GpuosError
from ..manifest import CRIU_DIR, FileEntry
from . import pagemap as pm

IOV = struct.Struct("=I4xQQQ")  # struct page_server_iov on x86-64
PS_IOV_ADD_F, PS_IOV_GET = 6, 7
PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE = 0x1023, 0x1024
PS_CMD_BITS = 16
CACHED_CHUNKS = 64
READ_AHEAD = 4


class ChunkReader:
    """Byte ranges of one image file, read chunk by chunk (checked), the latest kept, the
    next few read ahead: the daemon's background transfer walks each file in order."""

    def __init__(self, content, entry: FileEntry, pool: ThreadPoolExecutor):
        self.content, self.entry, self.pool = content, entry, pool
        self.pieces = content.pieces(entry)
        self.starts = [p.offset for p in self.pieces]
        self.cache: OrderedDict[int, Future] = OrderedDict()
        self.lock = threading.Lock()

    def _load(self, k: int) -> bytes:
        p = self.pieces[k]
        buf = bytearray(p.size)
        self.content.read_piece(self.entry, p, memoryview(buf))
        return bytes(buf)

    def _chunk(self, k: int) -> Future:
        with self.lock:
            f = self.cache.get(k)
            if f is None:
                f = self.cache[k] = self.pool.submit(self._load, k)
            self.cache.move_to_end(k)
            while len(self.cache) > CACHED_CHUNKS:
                self.cache.popitem(last=False)
            return f

    def read(self, off: int, n: int) -> list[memoryview]:
        """The bytes [off, off + n) as views of the cached chunks (sent as they are)."""
        if off < 0 or off + n > self.entry.size:
            raise GpuosError(f"{self.entry.path}: bytes {off}-{off + n} are past its end ({self.entry.size})")
        out = []
        k = bisect_right(self.starts, off) - 1
        end = off + n
        while off < end:
            p = self.pieces[k]
            data = memoryview(self._chunk(k).result())
            take = min(end, p.offset + p.size) - off
            out.append(data[off - p.offset:off - p.offset + take])
            off += take
            k += 1
        for j in range(k, min(k + READ_AHEAD, len(self.pieces))):
            self._chunk(j)
        return out


class Pages:
    """Where each lazy page of each task is: per pid, its pagemap's lazy entries by address."""

    def __init__(self, criu_dir: Path, content, pool: ThreadPoolExecutor):
        self.maps: dict[int, tuple[list[int], list[pm.Entry], ChunkReader]] = {}
        readers: dict[str, ChunkReader] = {}
        for f in sorted(criu_dir.glob("pagemap-*.img")):
            pid = f.stem.removeprefix("pagemap-")
            if not pid.isdigit():
                continue  # pagemap-shmem-*: never lazy
            m = pm.parse(f.read_bytes(), str(f))
            rel = f"{CRIU_DIR}/{m.pages_file}"
            if rel not in readers:
                readers[rel] = ChunkReader(content, content.entry(rel), pool)
            lazy = [e for e in m.entries if e.lazy]
            self.maps[int(pid)] = ([e.vaddr for e in lazy], lazy, readers[rel])

    def get(self, pid: int, vaddr: int, nr_pages: int) -> tuple[int, list[memoryview]]:
        """Up to nr_pages from vaddr, within one entry: (pages, their bytes)."""
        found = self.maps.get(pid)
        if found is None:
            raise GpuosError(f"the daemon asked for pages of pid {pid}, which the image has none of")
        starts, entries, reader = found
        k = bisect_right(starts, vaddr) - 1
        if k < 0 or not entries[k].vaddr <= vaddr < entries[k].end or vaddr % pm.PAGE:
            raise GpuosError(f"the daemon asked for page {vaddr:#x} of pid {pid}, which is not a lazy page of the image")
        e = entries[k]
        n = min(nr_pages, (e.end - vaddr) // pm.PAGE)
        return n, reader.read(e.offset + (vaddr - e.vaddr), n * pm.PAGE)


def _send_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    while bufs:
        sent = sock.sendmsg(bufs)
        while bufs and sent >= len(bufs[0]):
            sent -= len(bufs[0])
            bufs.pop(0)
        if bufs:
            bufs[0] = bufs[0][sent:]


def serve(sock: socket.socket, pages: Pages) -> dict:
    stats = {"requests": 0, "pages": 0, "seconds": 0.0}
    t0 = time.monotonic()
    while True:
        hdr = sock.recv(IOV.size, socket.MSG_WAITALL)
        if len(hdr) < IOV.size:
            break  # the daemon went away
        cmd, nr, vaddr, pid = IOV.unpack(hdr)
        op = cmd & ((1 << PS_CMD_BITS) - 1)
        if op == PS_IOV_GET:
            n, data = pages.get(pid, vaddr, nr)
            _send_all(sock, [memoryview(IOV.pack((pm.PE_PRESENT << PS_CMD_BITS) | PS_IOV_ADD_F, n, vaddr, pid)),
                             *data])
            stats["requests"] += 1
            stats["pages"] += n
        elif op in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
            sock.sendall(struct.pack("=i", 0))
            break
        else:
            raise GpuosError(f"the daemon sent command {cmd:#x}, which a lazy restore does not use")
    stats["seconds"] = time.monotonic() - t0
    return stats


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpuos.hostmem.server")
    ap.add_argument("image", type=Path)
    ap.add_argument("criu_dir", type=Path, help="the image's CRIU files, read out (the pagemaps)")
    ap.add_argument("--socket", type=int, required=True, help="descriptor of the daemon's --ps-socket peer")
    ap.add_argument("--report", type=int, required=True)
    ap.add_argument("--hot", type=Path, default=None, help="the store's hot tier base")
    ap.add_argument("--no-verify", action="store_true")
    args = ap.parse_args(argv)
    from ..store import ImageStore
    from ..store.content import ImageContent

    sock = socket.socket(fileno=args.socket)
    try:
        manifest = ImageStore.load(args.image)
        content = ImageContent(args.image, manifest, args.hot, not args.no_verify)
        with content.chunks.shared(), ThreadPoolExecutor(max_workers=4) as pool:
            pages = Pages(args.criu_dir, content, pool)
            os.write(args.report, b"ready\n")
            stats = serve(sock, pages)
    except GpuosError as exc:
        os.write(args.report, f"error {exc.message}\n".encode())
        # Answer nothing more, close nothing: the process waits for its page, never gets a
        # zero one; gpuos ends it (and us).
        while True:
            time.sleep(3600)
    os.write(args.report, f"done {json.dumps(stats)}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
