"""Where gpuos keeps its state, and how it finds its tools.

Everything is derived from one ``Paths`` value built from the command line and
the environment; nothing is global.

    GPUOS_HOME (default /var/lib/gpuos)
      images/       the default image store (``--store`` / GPUOS_STORE override);
                    its chunks in images/.chunks/
    GPUOS_HOT (default /dev/shm/gpuos: memory)
      hot-<id>/     a store's hot tier: chunks kept in memory (``gpuos images warm``)
      restore-<op>/ a restore's CRIU files, read out of the chunks for CRIU
      run/          journals of operations in flight, per-process lock files
      faults/       the fault journal (gpuos faults watch|log; faults/journal.py)
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import CriuUnavailable

DEFAULT_HOME = Path("/var/lib/gpuos")
DEFAULT_HOT = Path("/dev/shm/gpuos")
# Where tools/install-bundle.sh puts its private criu by default.
BUNDLED_CRIU = Path("/opt/gpuos/bin/criu")


@dataclass(frozen=True)
class Paths:
    home: Path
    store: Path
    hot: Path = DEFAULT_HOT

    @property
    def run(self) -> Path:
        return self.home / "run"

    @property
    def faults(self) -> Path:
        return self.home / "faults"

    @classmethod
    def from_env(cls, store: str | os.PathLike | None = None,
                 env: dict[str, str] | None = None) -> "Paths":
        env = os.environ if env is None else env
        home = Path(env.get("GPUOS_HOME") or DEFAULT_HOME)
        if store is None:
            store = env.get("GPUOS_STORE") or home / "images"
        return cls(home=home, store=Path(store), hot=Path(env.get("GPUOS_HOT") or DEFAULT_HOT))


def find_criu(explicit: str | None = None, env: dict[str, str] | None = None) -> Path:
    """The criu to run: --criu, then $GPUOS_CRIU, then PATH, then the bundle's."""
    env = os.environ if env is None else env
    for candidate, origin in ((explicit, "--criu"), (env.get("GPUOS_CRIU"), "GPUOS_CRIU")):
        if candidate:
            path = Path(candidate)
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise CriuUnavailable(f"criu not found at {path} (from {origin})")
            return path
    on_path = shutil.which("criu")
    if on_path:
        return Path(on_path)
    if BUNDLED_CRIU.is_file() and os.access(BUNDLED_CRIU, os.X_OK):
        return BUNDLED_CRIU
    raise CriuUnavailable(
        "criu not found: install it (tools/install.sh), or pass --criu PATH or set GPUOS_CRIU")
