"""A client's own checkpoint, as the supervisor sees it (`gpuos mps run --checkpoint`).

The application writes its checkpoints and resumes from the newest at its start; gpuos
only reads when that newest one was written, to say in each incident how much work a
fault cost (state.py: Victim.lost_s) and to start a standby again from a newer one.

What counts is the newest modification time among the files and directories a pattern
names, owned by the client's user: a file; a directory's entries, one level down (a new
checkpoint directory inside it counts by its own time); or a glob.  Only the user's own
files count, so that the supervisor, which may run as root, says nothing about anyone
else's.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path


def newest(pattern: str, uid: int) -> float | None:
    """The newest modification time among the user's files `pattern` names, or None."""
    if glob.has_magic(pattern):
        names = glob.glob(pattern)
    elif os.path.isdir(pattern):
        try:
            with os.scandir(pattern) as it:
                names = [e.path for e in it]
        except OSError:
            return None
    else:
        names = [pattern]
    best = None
    for name in names:
        try:
            st = os.stat(name, follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid == uid and (best is None or st.st_mtime > best):
            best = st.st_mtime
    return best


def absolute(pattern: str, cwd: str) -> str:
    """The pattern as the supervisor will look at it: relative to the client's directory."""
    return str(Path(cwd, os.path.expanduser(pattern)))
