"""flock with a bounded wait: gpuos's locks are held for good by their owner, or for an
instant by someone looking, and a taker waits out the latter only."""

from __future__ import annotations

import fcntl
import time


def flock_within(fd: int, wait: float, step: float) -> bool:
    """Take fd's exclusive flock, trying every `step` seconds for up to `wait`; whether it
    was taken."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(step)
