"""The launch log that `gpuos run --log FILE` writes: JSON lines (gzip if FILE ends in .gz).

Line 1 is a header: {"format": "gpuos-launch-log", "version": 1, "created": ISO-8601,
"cmd": [...], "validate": bool}.  Every later line is one record of one process with
"pid" added; the record types and fields are those of `ring.decode` (documented in
docs/interception.md).  A {"type": "function", "pid", "id", "handle", "name",
"nparams", "params_bytes"} line comes before the first record that names the function
by "func"; {"type": "proc", "event": "start" | "end", ...} lines open and close each
process.
"""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path
from typing import IO, Iterator

FORMAT = "gpuos-launch-log"
VERSION = 1


def _open(path: Path, mode: str) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


class LaunchLogWriter:
    def __init__(self, path: Path, cmd: list[str], validate: bool):
        self.path = path
        self.file = _open(path, "w")
        self.write({"format": FORMAT, "version": VERSION,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cmd": cmd,
                    "validate": validate})

    def write(self, obj: dict) -> None:
        self.file.write(json.dumps(obj, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self.file.close()


def read_log(path: Path) -> Iterator[dict]:
    """Yield the header, then every record of a launch log."""
    with _open(Path(path), "r") as f:
        first = json.loads(f.readline() or "{}")
        if first.get("format") != FORMAT:
            raise ValueError(f"{path}: not a gpuos launch log")
        if first.get("version") != VERSION:
            raise ValueError(f"{path}: launch log version {first.get('version')} "
                             f"(this gpuos reads {VERSION})")
        yield first
        for line in f:
            if line.strip():
                yield json.loads(line)
