"""Restore: a process's movable memory put on its GPU while CRIU is still restoring it.

A restore spends about a second in CRIU and the driver before the process can take any
memory back; the filler alone then streams the image through the agent at the CPUs' rate
(6-7 GB/s on an H200's host: each chunk read from the page cache and checked).  So gpuos
fills memory of its own meanwhile (copier.py, "in"): one allocation per movable
allocation, on the GPU the process is restored onto, in the order the filler would use
(the image's profile), each chunk checked as it is read.  Its context and memory are
made at once, but it reads only once CRIU has its pages images (`go`): on an H200, reading
beside CRIU's own stream made CRIU's restore 0.5-0.7 s longer and the prefill itself run at
1.5 GB/s, worse than one after the other.  When the process is back,
`take()` stops it at a buffer's end; the filler hands the memory to the agent (MAP with
GPUOS_AGENT_SHADOWS) and fills what is done by device-to-device copies (FILL_PARTS from
the shadows: milliseconds), the rest through the agent as before.  Replicas of one image
share one prefill.

Only where it cannot hurt: the copier's context and the prefilled memory take GPU
memory beside what the restored processes need (their new memory, their contexts), so
it starts only if the GPU has room for both; without cuda-python or room, `why_not` says
so and the filler does all the work.  A corrupt or missing chunk stops it; the filler
raises that error (nothing of it reaches the process), and the restore fails (exit 10).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from ..errors import GpuosError
from ..manifest import MovableMemory
from ..store.content import ImageContent
from .copier import Copier, CopierError
from .filler import Part, parts

# GPU memory left for each restored process's context and what its driver restore brings back
CONTEXT_ROOM = 1 << 30


def room_beside(movable: list[MovableMemory], mem: MovableMemory, copies: int) -> int:
    """What the GPU must keep free beside the prefill of `mem`, one of an image's `movable`
    memories restored `copies` times: every restored process's new memory and context, and
    the image's other prefills."""
    total = sum(m.bytes for m in movable)
    return copies * (total + CONTEXT_ROOM * len(movable)) + total - mem.bytes


@dataclass(frozen=True)
class Taken:
    """What a prefill did by the time the process was back: `done` parts (a prefix of
    parts()) are in the memory that `fds` (one per allocation, the prefill's to close)
    hold."""

    done: list[Part]
    fds: list[int]
    seconds: float  # from its start until it was stopped


class Prefill:
    """The movable memory of one image process, filled on GPU `gpu_uuid` in the background
    from now until take().  `beside`: the bytes the GPU must still have free beside it
    (room_beside: what the restored processes will make, and the image's other
    prefills)."""

    def __init__(self, mem: MovableMemory, content: ImageContent, gpu_uuid: str | None, beside: int = 0,
                 go: threading.Event | None = None, threads: int | None = None,
                 open_copier: Callable[[str | None], Copier] = Copier):
        self.mem, self.content = mem, content
        self._go = go
        self.parts = parts(content, mem)
        self.why_not: str | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._copier: Copier | None = None
        self._done = 0
        self._taken: Taken | None = None
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(gpu_uuid, beside, open_copier,
                                                                threads or max(2, (os.cpu_count() or 2) - 2)),
                                        name="gpuos-prefill", daemon=True)
        self._thread.start()

    def _run(self, gpu_uuid: str | None, beside: int, open_copier, threads: int) -> None:
        sizes = [r.reserved for r in self.mem.ranges]
        try:
            self._copier = open_copier(gpu_uuid)
            need = sum(sizes) + beside
            free = self._copier.free_bytes()
            if free < need:
                self.why_not = (f"no room on the GPU for a second copy: {free >> 20} MiB free, "
                                f"{need >> 20} MiB needed")
                return
            self._copier.allocate(sizes)
            entry = self.content.entry(self.mem.file)
            while self._go is not None and not self._go.wait(0.01) and not self._stop.is_set():
                pass  # CRIU still reads its pages: reading beside it slowed both
            with ThreadPoolExecutor(threads) as pool:
                self._done = self._copier.load(
                    [(p.index, p.offset, p.piece.size) for p in self.parts],
                    lambda k, view: self.content.read_piece(entry, self.parts[k].piece, view),
                    pool, self._stop.is_set)
        except CopierError as exc:
            self.why_not = exc.message
        except GpuosError as exc:  # a bad chunk: the filler says so, nothing of it is used
            self._error = exc
        except Exception as exc:  # noqa: BLE001 - cuda-python's own kinds: no prefill, never a failed restore
            self.why_not = f"{type(exc).__name__}: {exc}"
        finally:
            if (self.why_not or self._error) and self._copier is not None:
                self._copier.close()  # its context and memory are the restored processes' room
                self._copier = None

    def take(self) -> Taken | None:
        """Stop (the buffers in flight finish) and return what is done, the same for every
        caller; None if nothing is (why_not says why, if anything went wrong).  Raises the
        error of a bad chunk."""
        with self._lock:
            if self._taken is None and not self.why_not:
                self._stop.set()
                self._thread.join()  # a bad chunk: raised below, its copier let go by _run
                if self._copier is not None and not self._done:  # its memory is room for the processes
                    self._copier.close()
                    self._copier = None
                elif self._copier is not None:  # (_run let it go with a why_not)
                    try:
                        self._taken = Taken(self.parts[:self._done], self._copier.export(),
                                            time.monotonic() - self._t0)
                    except CopierError as exc:
                        self.why_not = f"export: {exc.message}"
            if self._error is not None:
                raise self._error
            return self._taken

    def close(self) -> None:
        """Stop, and let go of everything (what an agent imported lives on in it)."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            if self._taken is not None:
                for fd in self._taken.fds:
                    os.close(fd)
                self._taken = Taken(self._taken.done, [], self._taken.seconds)
            if self._copier is not None:
                self._copier.close()
                self._copier = None
