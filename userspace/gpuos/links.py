"""Files that CRIU re-links at dump (``--link-remap``), kept in the image instead.

A process may hold a file whose name it opened by is gone while the file lives on under
another name. Every Python ``multiprocessing`` semaphore of the spawn start method is one:
glibc creates ``/dev/shm/sem.XXXXXX``, links it to its final name and unlinks the first.
CRIU saves such a file by hard-linking it as ``link_remap.<id>`` next to the old name and
deleting that link when a restore opens it; without ``--link-remap`` it refuses the tree
("Can't create link remap", measured on H100 with two GPU processes from
``multiprocessing``). Left there, the link would stay on the host for ever after a
``--leave-running`` checkpoint and let an image be restored only once. So gpuos moves
each new link into the image (``links/`` + its absolute path, covered by the image's
checksums) right after the dump, and puts a copy back before each restore.

A file that is open but has no name left at all is saved by CRIU as a ghost file, which
its restore recreates as ``<old name>.cr.<id>.ghost`` next to the old name, opens and
removes. A CRIU killed in between (gpuos kills it when a chunk it asked for is bad) leaves
that file behind, and every later restore of the image fails on it ("Can't create ghost
regfile: File exists"); so the checkpoint records the directories where the process held
deleted files, and a failed restore removes the ghost files it left there.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from . import procs
from .errors import GpuosError, NoSuchProcess

LINKS_DIR = "links"
DELETED = " (deleted)"


def _deleted_paths(pid: int) -> set[str]:
    try:
        named = [m.path for m in procs.mappings(pid)] + list(procs.open_files(pid).values())
    except NoSuchProcess:
        return set()  # exited: CRIU will say so
    return {p[: -len(DELETED)] for p in named if p.startswith("/") and p.endswith(DELETED)}


def candidate_dirs(tree: list[int]) -> set[Path]:
    """The directories where CRIU may create link remaps for this tree."""
    return {Path(p).parent for pid in tree for p in _deleted_paths(pid)}


def ghost_ids(paths: list[str]) -> set[int]:
    """CRIU's ids of the ghost files among an image's CRIU files (``ghost-file-<hex id>.img``)."""
    names = (Path(p).name for p in paths)
    return {int(n[len("ghost-file-"):-len(".img")], 16) for n in names
            if n.startswith("ghost-file-") and n.endswith(".img")}


def ghosts_in(dirs: list[str], ids: set[int]) -> set[Path]:
    """The ghost files of these ids that exist now in these directories."""
    return {p for d in dirs for i in ids for p in Path(d).glob(f"*.cr.{i:x}.ghost")}


def remaps_in(dirs: set[Path]) -> set[Path]:
    return {p for d in dirs if d.is_dir() for p in d.glob("link_remap.*")}


def keep(new: set[Path], image: Path) -> None:
    """Move the link remaps a dump created into the image."""
    for path in sorted(new):
        dest = image / LINKS_DIR / path.relative_to("/")
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
            st = path.stat()
            os.chown(dest, st.st_uid, st.st_gid)  # the owner a restore gives it back
            path.unlink()
        except OSError as exc:
            raise GpuosError(f"keeping CRIU's link {path} in the image: {exc}") from None


def put_back(image: Path) -> list[Path]:
    """Recreate the image's link remaps where CRIU's restore looks for them; returns those
    created (a restore deletes them as it opens them; remove() cleans up after a failure)."""
    root = image / LINKS_DIR
    created = []
    if not root.is_dir():
        return created
    for kept in sorted(p for p in root.rglob("*") if p.is_file()):
        target = Path("/") / kept.relative_to(root)
        if target.exists():
            continue  # another restore of this image is under way, or left it: CRIU opens it
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(kept, target)
        st = kept.stat()
        os.chown(target, st.st_uid, st.st_gid)
        created.append(target)
    return created


def remove(paths: list[Path]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)

