"""Running a real criu: version check, dump, restore, and reading its logs."""

from __future__ import annotations

import ctypes
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import CriuUnavailable, GpuosError

MIN_VERSION = (3, 17)
DUMP_LOG = "dump.log"
DUMP_OK = "Dumping finished successfully"
RESTORE_LOG = "restore.log"
PIDFILE = "restored.pid"


def _die_with_parent() -> None:
    # criu must not outlive a killed gpuos: a dump that finished unsupervised
    # would kill the target with no one left to publish the image.
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def first_error(log: Path, limit: int = 3) -> str:
    """The first few 'Error' lines of a criu log, for a one-line message."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "no log"
    # criu logs this one as an error and carries on; it explains nothing.
    errors = [ln.strip() for ln in lines if "Error (" in ln and "RLIMIT_NOFILE for self" not in ln]
    picked = errors[:limit] or [ln.strip() for ln in lines[-limit:]]
    return "; ".join(picked)


def dump_completed(criu_dir: Path) -> bool:
    log = criu_dir / DUMP_LOG
    try:
        return DUMP_OK in log.read_text(errors="replace")
    except FileNotFoundError:
        return False


@dataclass
class Criu:
    binary: Path
    plugin_dir: Path  # an empty directory: keep distribution plugins (e.g. CRIU's CUDA plugin) out

    def version(self) -> tuple[int, ...]:
        try:
            out = subprocess.run([str(self.binary), "--version"], capture_output=True,
                                 text=True, timeout=30).stdout
        except OSError as exc:
            raise CriuUnavailable(f"cannot run {self.binary}: {exc}") from None
        m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", out)
        if not m:
            raise CriuUnavailable(f"{self.binary} --version printed no version: {out.strip()[:200]!r}")
        return tuple(int(x) for x in m.groups() if x is not None)

    def check_version(self) -> str:
        ver = self.version()
        text = ".".join(map(str, ver))
        if ver[:2] < MIN_VERSION:
            raise CriuUnavailable(
                f"criu {text} at {self.binary} is too old; gpuos needs {'.'.join(map(str, MIN_VERSION))} or newer")
        return text

    def command(self, args: list[str], verbosity: int = 4) -> list[str]:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        return [str(self.binary), *args, "--libdir", str(self.plugin_dir), f"-v{verbosity}"]

    def _run(self, args: list[str], log: Path, what: str, pass_fds: tuple[int, ...] = (),
             job_tty: int | None = None) -> float:
        cmd = self.command(args)
        t0 = time.monotonic()
        # Its own session: a tree restored with --shell-job joins criu's session and process
        # group, and must not join the terminal's (a ^C there would reach it). A shell's job
        # on a terminal is the exception: it must join that terminal's session, the one we
        # run in, with the terminal as criu's stdin (CRIU's shell-job terminal inheritance).
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL if job_tty is None else job_tty,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              preexec_fn=_die_with_parent, start_new_session=job_tty is None,
                              pass_fds=pass_fds)
        elapsed = time.monotonic() - t0
        if proc.returncode != 0:
            detail = first_error(log)
            if detail == "no log":
                detail = proc.stdout.decode(errors="replace").strip()[-300:]
            raise GpuosError(f"criu {what} failed (exit {proc.returncode}): {detail}")
        return elapsed

    def dump(self, pid: int, images: Path, leave_running: bool, options: list[str]) -> float:
        # --link-remap: files whose name is gone but that live on under another (see links.py)
        args = ["dump", "-t", str(pid), "-D", str(images), "-o", DUMP_LOG, "--link-remap", *options]
        if leave_running:
            args.append("--leave-running")
        return self._run(args, images / DUMP_LOG, "dump")

    def restore(self, images: Path, workdir: Path, options: list[str],
                inherit: dict[str, int] | None = None, job_tty: int | None = None
                ) -> tuple[int, float]:
        """Restore detached, every task left stopped; returns the restored root pid and the
        time taken. ``inherit`` maps CRIU's name of an external resource (``tty[rdev:dev]``)
        to an open fd of ours that stands for it; ``job_tty``: the terminal a shell's job
        comes back on (our controlling terminal; criu then runs in our session)."""
        args = self.restore_args(images, workdir, options)
        for key, fd in (inherit or {}).items():
            args += ["--inherit-fd", f"fd[{fd}]:{key}"]
        elapsed = self._run(args, workdir / RESTORE_LOG, "restore", tuple((inherit or {}).values()),
                            job_tty)
        return restored_root(workdir), elapsed

    @staticmethod
    def restore_args(images: Path, workdir: Path, options: list[str]) -> list[str]:
        """A detached restore that leaves every task stopped and writes the root's pid (as
        CRIU sees it) in ``workdir``."""
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / PIDFILE).unlink(missing_ok=True)
        return ["restore", "-D", str(images), "-W", str(workdir), "-o", RESTORE_LOG,
                "--restore-detached", "--leave-stopped", "--pidfile", PIDFILE, *options]


# Where a restore's time goes, from CRIU's own log (-v4 stamps every line with the seconds
# since its start): the first task forked, the first task in the restorer, the last page
# read there (CRIU reads the pages images into the premapped memory in the restorer), done.
RESTORE_MARKS = (("fork", "Forking task with", False), ("restorer", "Switched to the restorer", False),
                 ("pages_read", "`- returned", True), ("finished", "Restore finished successfully", False))
STAMP = re.compile(rb"^\((\d+)\.(\d+)\)")


def stamped_lines(log: Path) -> list[tuple[float, bytes]]:
    """CRIU's log as (seconds into the run, the rest of the line) for its stamped lines;
    [] without a log."""
    out = []
    try:
        lines = log.read_bytes().splitlines()
    except OSError:
        return out
    for line in lines:
        m = STAMP.match(line)
        if m:
            out.append((int(m.group(1)) + int(m.group(2)) / 1e6, line[m.end():]))
    return out


def restore_marks(stamped: list[tuple[float, bytes]]) -> dict[str, float]:
    """Seconds into CRIU's restore at each RESTORE_MARKS mark it reached (first time; the
    last for pages_read), and `end`, its last stamp; {} for no lines."""
    out: dict[str, float] = {}
    for t, line in stamped:
        out["end"] = t
        for name, text, last in RESTORE_MARKS:
            if (last or name not in out) and text.encode() in line:
                out[name] = t
    return out


def restore_gaps(stamped: list[tuple[float, bytes]], n: int = 8) -> list[dict]:
    """The n longest silences in CRIU's restore log, longest first: where the silence began
    (`at`, seconds into the restore), how long it lasted, and the line before it (what CRIU
    had begun, cut to 120 characters); [] for no lines. Marks say which stage took the
    time, gaps what in it did."""
    # lines of several tasks interleave out of order: a line's gap runs to the next line's
    # stamp (none where that one is earlier)
    gaps = [{"at": t, "seconds": round(max(0.0, nt - t), 6),
             "after": line.decode(errors="replace").strip()[:120]}
            for (t, line), (nt, _) in zip(stamped, stamped[1:])]
    return sorted(gaps, key=lambda g: -g["seconds"])[:n]


def restored_root(workdir: Path) -> int:
    return int((workdir / PIDFILE).read_text().strip())
