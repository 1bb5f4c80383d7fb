"""Paths from the environment, finding criu, and reading criu's answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuos.config import DEFAULT_HOME, Paths, find_criu
from gpuos.criu import MIN_VERSION, Criu, dump_completed, first_error
from gpuos.errors import CriuUnavailable, GpuosError


def test_paths_from_env():
    p = Paths.from_env(env={})
    assert p.home == DEFAULT_HOME and p.store == DEFAULT_HOME / "images" and p.run == DEFAULT_HOME / "run"
    p = Paths.from_env(env={"GPUOS_HOME": "/h"})
    assert (p.home, p.store, p.run) == (Path("/h"), Path("/h/images"), Path("/h/run"))
    assert Paths.from_env(env={"GPUOS_HOME": "/h", "GPUOS_STORE": "/s"}).store == Path("/s")
    assert Paths.from_env(store="/x", env={"GPUOS_HOME": "/h", "GPUOS_STORE": "/s"}).store == Path("/x")


def test_find_criu_explicit_and_env(tmp_path):
    exe = tmp_path / "criu"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert find_criu(str(exe), env={}) == exe
    assert find_criu(None, env={"GPUOS_CRIU": str(exe)}) == exe
    with pytest.raises(CriuUnavailable, match="--criu"):
        find_criu("/nonexistent/criu", env={"GPUOS_CRIU": str(exe)})
    with pytest.raises(CriuUnavailable, match="GPUOS_CRIU"):
        find_criu(None, env={"GPUOS_CRIU": "/nonexistent/criu"})
    exe.chmod(0o644)  # no execute bit: not even root may run it
    with pytest.raises(CriuUnavailable):
        find_criu(str(exe), env={})
    with pytest.raises(CriuUnavailable):
        find_criu(str(tmp_path), env={})  # a directory


def test_first_error_and_dump_completed(tmp_path):
    log = tmp_path / "dump.log"
    assert first_error(log) == "no log"
    assert dump_completed(tmp_path) is False
    log.write_text("(0.0) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: "
                   "Operation not permitted\n"  # noise criu logs as an error and carries on
                   "(0.1) a\n(0.2) Error (x.c:1): first\n(0.3) b\n(0.4) Error (y.c:2): second\n")
    assert first_error(log) == "(0.2) Error (x.c:1): first; (0.4) Error (y.c:2): second"
    assert dump_completed(tmp_path) is False
    log.write_text("one\ntwo\nthree\nfour\n")
    assert first_error(log) == "two; three; four"
    log.write_text("(0.9) Dumping finished successfully\n")
    assert dump_completed(tmp_path) is True


def _script(tmp_path: Path, output: str) -> Path:
    exe = tmp_path / "criu-version"
    exe.write_text(f"#!/bin/sh\necho '{output}'\n")
    exe.chmod(0o755)
    return exe


@pytest.mark.parametrize("output,ok", [("Version: 4.2.1", True), ("Version: 3.17", True),
                                       ("Version: 3.16.1", False), ("Version: 2.9", False),
                                       ("criu, no version here", False)])
def test_version_check(tmp_path, output, ok):
    criu = Criu(_script(tmp_path, output), tmp_path / "plugins")
    if ok:
        assert criu.check_version() == output.split()[1]
    else:
        with pytest.raises(CriuUnavailable):
            criu.check_version()


def test_unrunnable_criu(tmp_path):
    with pytest.raises(CriuUnavailable):
        Criu(tmp_path / "missing", tmp_path / "plugins").version()


@pytest.mark.criu
def test_real_criu_version_and_a_failing_dump(criu_bin, tmp_path):
    criu = Criu(criu_bin, tmp_path / "plugins")
    version = tuple(int(x) for x in criu.check_version().split("."))
    assert version[:2] >= MIN_VERSION
    images = tmp_path / "img"
    images.mkdir()
    with pytest.raises(GpuosError, match=r"criu dump failed \(exit \d+\): .*Error \("):
        criu.dump(999999 if not Path("/proc/999999").exists() else 2**22 + 1, images, False, [])
    assert not dump_completed(images)
    assert (tmp_path / "plugins").is_dir() and list((tmp_path / "plugins").iterdir()) == []


def test_restore_marks_are_read_from_criu_s_own_log(tmp_path):
    """Where a restore's time went, from CRIU's -v4 stamps: the first fork, the first task in
    the restorer, the last page read there, done; the last stamp as the end; nothing from a
    missing log or unstamped lines."""
    from gpuos.criu import restore_gaps, restore_marks, stamped_lines

    log = tmp_path / "restore.log"
    log.write_text("(00.000000) CRIU run id = x\n"
                   "(00.042282) Forking task with 17 pid (flags 0x0)\n"
                   "(00.043000) Forking task with 18 pid (flags 0x0)\n"
                   "task_args->pid: 17\n"
                   "(00.044276) pie: 17: Switched to the restorer 17\n"
                   "(00.100000) pie: 17: `- returned 4096\n"
                   "(00.044300) pie: 18: Switched to the restorer 18\n"
                   "(01.188831) pie: 18: `- returned 275509248\n"
                   "(01.190018) Restore finished successfully. Tasks resumed.\n"
                   "(01.190114) Running post-resume scripts\n")
    assert restore_marks(stamped_lines(log)) == {"fork": 0.042282, "restorer": 0.044276,
                                                 "pages_read": 1.188831, "finished": 1.190018, "end": 1.190114}
    assert stamped_lines(tmp_path / "none.log") == [] and restore_marks([]) == {}
    gaps = restore_gaps(stamped_lines(log), 2)
    # task 18's pages: from its line to the next later stamp, though task 17's came between
    assert gaps == [{"at": 0.0443, "seconds": 1.144531, "after": "pie: 18: Switched to the restorer 18"},
                    {"at": 0.044276, "seconds": 0.055724, "after": "pie: 17: Switched to the restorer 17"}]
    assert restore_gaps([]) == []
