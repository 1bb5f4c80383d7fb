"""How commands speak: tables and one-line errors for people, JSON for scripts."""

from __future__ import annotations

import json
import re
import sys
import threading
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Callable

import click

from ..errors import GpuosError


def _plain(obj: Any) -> Any:
    if is_dataclass(obj) and not isinstance(obj, type):
        return _plain(asdict(obj))
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def _remember_json(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    ctx.meta["gpuos.json"] = value  # meta is shared by the whole context chain
    return value


def json_option(f=None, *, help: str = "Print one JSON object on stdout."):
    """The --json flag; ``@json_option`` or ``@json_option(help=...)``."""
    def decorate(f):
        return click.option("--json", "as_json", is_flag=True, callback=_remember_json,
                            help=help)(f)
    return decorate(f) if f is not None else decorate


def emit_json(data: Any) -> None:
    click.echo(json.dumps(_plain(data), indent=2, sort_keys=True))


def fail(exc: GpuosError, as_json: bool) -> None:
    """Report an error in one line (or one JSON object) and exit with its code."""
    if as_json:
        emit_json({"ok": False, "error": exc.kind, "exit_code": exc.exit_code, "message": exc.message})
    else:
        click.echo(f"gpuos: {exc.message}", err=True)
    sys.exit(exc.exit_code)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


class Reporter:
    """Phase lines and byte progress on stderr; silent under --json."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self._lock = threading.Lock()
        self._done = 0
        self._tty = sys.stderr.isatty()

    def phase(self, name: str) -> None:
        if not self.quiet:
            self._end_progress()
            click.echo(f"  {name}", err=True)

    def say(self, text: str) -> None:
        if not self.quiet:
            self._end_progress()
            click.echo(text, err=True)

    def bytes_progress(self, label: str, total: int) -> Callable[[int], None] | None:
        if self.quiet or not self._tty or total <= 0:
            return None
        self._done = 0

        def update(n: int) -> None:
            with self._lock:
                self._done += n
                pct = 100 * self._done / total
                sys.stderr.write(f"\r  {label}: {human_bytes(self._done)} / {human_bytes(total)}"
                                 f" ({pct:.0f}%)")
                sys.stderr.flush()
        return update

    def finish(self) -> None:
        self._end_progress()

    def _end_progress(self) -> None:
        if self._done:
            sys.stderr.write("\n")
            self._done = 0


SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int | None:
    """'12G', '512MiB', '1.5g', '65536' -> bytes (binary units); None if it is no size."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    return int(float(m[1]) * SIZE_UNITS[m[2].lower()]) if m else None
