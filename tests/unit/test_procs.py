"""What gpuos reads from /proc about real processes."""

from __future__ import annotations

import os
import sys

import pytest

from gpuos import procs
from gpuos.errors import NoSuchProcess, NotPermitted

from helpers import needs_root, wait_for, zombie


def test_stat_of_a_name_with_parentheses(processes, tmp_path):
    odd = tmp_path / "a) (b c"
    odd.symlink_to("/bin/sleep")
    proc = processes.start([str(odd), "1000"])
    # Right after exec the process may be briefly in D (paging in): wait until it sleeps.
    st = wait_for(lambda: (s := procs.stat(proc.pid)).comm == "a) (b c" and s.state == "S" and s,
                  what="the exec and the sleep")
    assert st.ppid == os.getpid() and st.session == proc.pid and st.tty_nr == 0
    assert st.state == "S" and st.starttime > 0


def test_tree_threads_and_cmdline(processes):
    shell, child = processes.tree()
    assert procs.tree(shell.pid) == [shell.pid, child]
    assert procs.cmdline(shell.pid) == ["sh", "-c", "sleep 1000 & wait"]
    code = ("import threading, time\n"
            "for _ in range(2): threading.Thread(target=time.sleep, args=(1000,), daemon=True).start()\n"
            "print('ok', flush=True); time.sleep(1000)")
    threaded = processes.start([sys.executable, "-c", code])
    wait_for(lambda: len(procs.tids(threaded.pid)) == 3, what="three threads")
    assert procs.tids(threaded.pid)[0] == threaded.pid
    assert procs.uses_cuda(threaded.pid) is False


def test_missing_process():
    pid = 999999 if not procs.exists(999999) else pytest.skip("pid 999999 exists")
    for fn in (procs.stat, procs.cmdline, procs.tids, procs.children, procs.uses_cuda):
        with pytest.raises(NoSuchProcess):
            fn(pid)
    assert procs.alive(pid) is False and procs.tree(pid) == []


def test_zombie_is_not_alive_and_not_a_target(processes):
    z = zombie(processes)
    assert procs.exists(z.pid) and not procs.alive(z.pid)
    with pytest.raises(NoSuchProcess, match="zombie"):
        procs.check_target(z.pid)


SYS_EXIT = {"x86_64": 60, "aarch64": 93}  # exit(2): the calling thread alone ends


def test_ending_means_every_thread_is_leaving(processes):
    """A leader thread that ended alone leaves a zombie leader and a live process: not
    ending (the supervisor would hand the process's role to its standby)."""
    if os.uname().machine not in SYS_EXIT:
        pytest.skip(f"exit(2)'s number on {os.uname().machine}")
    code = ("import ctypes, threading, time\n"
            "threading.Thread(target=time.sleep, args=(1000,)).start()\n"
            f"ctypes.CDLL(None).syscall({SYS_EXIT[os.uname().machine]}, 0)\n")
    p = processes.start([sys.executable, "-c", code])
    wait_for(lambda: procs.stat(p.pid).state == "Z" and len(procs.tids(p.pid)) == 2,
             what="the leader's exit alone")
    assert procs.ending(p.pid) is False
    p.kill()
    p.wait(timeout=10)
    assert procs.ending(p.pid) is True  # reaped: gone
    z = zombie(processes)
    assert procs.ending(z.pid) is True and procs.ending(os.getpid()) is False


@pytest.mark.parametrize("pid", [0, -1])
def test_invalid_pid_is_no_target(pid):
    with pytest.raises(NoSuchProcess):
        procs.check_target(pid)


@needs_root
def test_self_is_no_target():
    with pytest.raises(NotPermitted):
        procs.check_target(os.getpid())


@needs_root
def test_live_process_is_a_target(processes):
    proc = processes.sleeper()
    assert procs.check_target(proc.pid).pid == proc.pid


def test_comm_names_the_process_or_none():
    assert procs.comm(os.getpid()) == procs.stat(os.getpid()).comm
    assert procs.comm(2**22 + 12345) is None  # above pid_max's ceiling: never a process
