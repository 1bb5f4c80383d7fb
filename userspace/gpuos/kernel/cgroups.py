"""cgroup v2 paths and ids: a cgroup's id (cgroup_id() in the kernel) is its directory's inode."""

from __future__ import annotations

import os
from pathlib import Path

CGROUP2_ROOT = Path("/sys/fs/cgroup")


def cgroup_id(path_or_id: str, root: Path = CGROUP2_ROOT) -> int:
    """The cgroup v2 id named by a number, an absolute path, or a path relative to root.

    ValueError (with a one-line reason) if it names no cgroup v2 directory.
    """
    text = path_or_id.strip()
    if text.isdigit():
        value = int(text)
        if value <= 0:
            raise ValueError("a cgroup id is > 0")
        return value
    path = Path(text)
    if not path.is_absolute():
        path = root / path
    if not path.is_dir():
        raise ValueError(f"no cgroup directory {path}")
    if not (path / "cgroup.controllers").exists():
        raise ValueError(f"{path} is not a cgroup v2 directory (no cgroup.controllers)")
    return os.stat(path).st_ino
