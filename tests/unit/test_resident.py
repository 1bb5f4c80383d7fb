"""GPU memory oversubscription (`gpuos run --gpu-memory`, libgpuos/src/resident.c) on the
host: libgpuos in a real process under `gpuos run`, the fake driver (whose kernels fail
with CUDA_ERROR_ILLEGAL_ADDRESS on memory that is not mapped), `gpuos mem stats`.

t_resident keeps a host copy of all its device memory, does random launches, copies and
memsets across allocations that add up to almost twice the limit, and compares every
byte it reads back: an eviction that loses contents, or a launch that runs before its
memory is back, fails the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuos.movable import Agent, AgentError
from helpers import ResidentApp

GPUOS = [sys.executable, "-m", "gpuos.cli"]
REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
RESERVED = (2 + 4 + 2 + 8 + 2 + 4) * MIB  # t_resident's movable allocations, rounded to 2 MiB


def App(build: Path, env: dict, tmp: Path, gpuos_args: list[str], rounds: int, seed: int, *mode: str) -> ResidentApp:
    """t_resident under `gpuos run`, its work done and checked, waiting for `stop`."""
    return ResidentApp(build, env, tmp, gpuos_args, rounds, seed, *mode).wait_ok()


@pytest.mark.parametrize("seed", [7, 1234])
def test_oversubscribed_work_is_exact_and_the_memory_moves(libgpuos_build, libgpuos_env, tmp_path, seed):
    """22 MiB of movable memory under a 12 MiB limit: every byte read back is what the
    host computed; evictions and copies back happened, and never more than the limit was
    resident."""
    app = App(libgpuos_build, libgpuos_env, tmp_path, ["--gpu-memory", "12M"], 400, seed)
    try:
        st = app.stats(libgpuos_env)
        assert st["limit"] == 12 * MIB
        assert st["reserved_bytes"] == RESERVED
        assert st["resident_bytes"] <= st["limit"]
        assert st["resident_bytes"] + st["evicted_bytes"] <= RESERVED
        assert st["evictions"] > 10 and st["swap_ins"] > 10
        # every eviction copies out what changed since its last one; some were unchanged
        assert st["bytes_out"] + st["clean_bytes"] >= st["evictions"] * 2 * MIB
        assert st["bytes_out"] > 0 and st["clean_bytes"] > 0
        assert st["launches"] > 0 and st["over_limit"] == 0 and st["need_all"] == 0
        assert st["stall_ns"] >= st["in_ns"] + st["out_ns"] > 0
        assert sum(st["stall_hist"]) == st["calls_swapped"] and st["stall_p99_us"] >= 1
        # host memory pinned ahead by its own thread (an eviction that came first makes its
        # own), until the allocations with host memory cover the excess over the limit
        # (10 MiB): allocations of 2-8 MiB get there with 16 MiB at most, not all 22
        assert 0 < st["host_prepared"] <= 16 * MIB and st["pageable_hosts"] == 0
    finally:
        rc = app.finish()[0]
    assert rc == 0


def test_with_tracking_paused_a_launch_needs_all_the_memory_and_says_so(libgpuos_build, libgpuos_env, tmp_path):
    """The predictions come from tracking the launches: with it paused (`gpuos run
    --paused`), a launch needs every allocation resident, and under a limit they do not
    all fit in, it fails with out-of-memory and says why, never silently.  (At 100%
    everything fits and nothing is checked: bench/oversub.py's passive system.)"""
    app = ResidentApp(libgpuos_build, libgpuos_env, tmp_path, ["--gpu-memory", "12M", "--paused"], 400, 7)
    out, err = app.proc.communicate(timeout=120)
    assert app.proc.returncode != 0, out
    assert "a launch while tracking is paused needs more movable memory resident than --gpu-memory" in err, err
    assert "CUDA_ERROR_OUT_OF_MEMORY" in err and "failed: 2" in err, err


def test_a_repeating_sequence_is_learned_and_evicts_by_the_future(libgpuos_build, libgpuos_env, tmp_path):
    """Rounds that fill the six large allocations in the same order: least recently used
    eviction brings every one back in every round; once the period (six calls) is learned,
    the allocation needed farthest ahead goes instead, and fewer come back; some come back
    ahead of the call that needs them, so fewer calls wait.  Both exact."""
    got = {}
    for evict in ("lru", "future"):
        (tmp_path / evict).mkdir()
        app = App(libgpuos_build, libgpuos_env, tmp_path / evict, ["--gpu-memory", "12M", "--evict", evict], 200, 1,
                  "cycle")
        try:
            got[evict] = app.stats(libgpuos_env)
            shown = subprocess.run([*GPUOS, "mem", "stats", str(got[evict]["pid"])], env=libgpuos_env,
                                   capture_output=True, text=True, timeout=60)
            assert shown.returncode == 0, shown.stderr
            # the batches ahead as the GPU ran them (none for LRU: nothing comes ahead)
            assert ("timed on the GPU" in shown.stdout) == (evict == "future"), shown.stdout
            assert "mappings" in shown.stdout and "unmapping and releasing" in shown.stdout, shown.stdout
        finally:
            assert app.finish()[0] == 0
    lru, future = got["lru"], got["future"]
    assert lru["lru_only"] == 1 and lru["period"] == 0 and lru["evictions_future"] == 0
    assert lru["swap_ins"] >= 6 * 199  # every allocation, every round
    assert future["lru_only"] == 0 and future["period"] == 6
    assert future["evictions_future"] > future["evictions"] * 0.9
    assert future["bytes_in"] < lru["bytes_in"] * 0.85
    # with the sequence known, allocations come in ahead of the call that uses them
    assert lru["ahead_bytes"] == 0 and future["ahead_bytes"] > 0
    # issuing them is timed apart, inside in_ns (the copies waited for are the rest)
    assert lru["ahead_ns"] == 0 and 0 < future["ahead_ns"] < future["in_ns"]
    # and their batches timed as they ran (the fake driver runs a copy at its issue: the
    # batch's time is within the time issuing it)
    assert lru["batch_bytes"] == 0 and 0 < future["batch_bytes"] <= future["ahead_bytes"]
    assert 0 < future["batch_ns"] < future["ahead_ns"], future
    # making and mapping memory for the copies waited for: a part of their time; for
    # those ahead, a part of issuing them (no group: no batch waits for room)
    for st in (lru, future):
        assert 0 < st["map_ns"] < st["in_ns"] - st["ahead_ns"], st
    assert lru["ahead_map_ns"] == 0 and 0 < future["ahead_map_ns"] < future["ahead_ns"], future
    assert lru["room_ns"] == future["room_ns"] == 0
    # that making and mapping, call by call: every copy in went to memory mapped for it;
    # cuMemCreate and cuMemSetAccess are parts of its time; releases part of evictions'
    for st in (lru, future):
        assert st["maps"] >= st["swap_ins"] > 0, st
        assert 0 < st["create_ns"] and 0 < st["access_ns"], st
        assert st["create_ns"] + st["access_ns"] < st["map_ns"] + st["ahead_map_ns"], st
        assert 0 < st["release_ns"] < st["out_ns"], st
    assert future["ahead_hits"] > 50 and future["calls_swapped"] < lru["calls_swapped"] * 0.75


def test_memory_only_read_is_copied_out_once(libgpuos_build, libgpuos_env, tmp_path):
    """Rounds that read the six large allocations in turn (an inference's weights): each
    is evicted and brought back every round, but copied out only at its first eviction;
    later ones find its fingerprints unchanged.  Exact all the same."""
    app = App(libgpuos_build, libgpuos_env, tmp_path, ["--gpu-memory", "12M", "--evict", "lru"], 50, 3, "read")
    try:
        st = app.stats(libgpuos_env)
    finally:
        assert app.finish()[0] == 0
    assert st["swap_ins"] >= 6 * 49 and st["evictions"] >= 6 * 49
    assert st["bytes_out"] <= RESERVED  # each at most once, whole
    assert st["clean_bytes"] >= (st["evictions"] - 6) * 2 * MIB


@pytest.mark.parametrize("lib", ["plain", "tsan"])
def test_threads_evict_each_others_memory_and_lose_nothing(libgpuos_build, libgpuos_env, tmp_path, lib):
    """Four threads launching at once on allocations of their own, 16 MiB in all under an
    8 MiB limit: each thread's memory is evicted by the others' calls and comes back
    intact; libgpuos built with ThreadSanitizer (and the program too) reports no race."""
    env = dict(libgpuos_env)
    prog = "t_resident"
    if lib == "tsan":
        res = subprocess.run(["make", "-s", "-C", str(REPO / "libgpuos"), f"O={libgpuos_build}", "tsan"],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        env["GPUOS_LIBGPUOS"] = str(libgpuos_build / "tsan" / "libgpuos.so")
        prog = "t_resident_tsan"
    (tmp_path / "stop").touch()  # it ends at once, having checked everything
    res = subprocess.run([*GPUOS, "run", "-q", "--gpu-memory", "8M", "--", str(libgpuos_build / "tests" / prog),
                          str(tmp_path / "stop"), "150", "4", "threads"], env=env, capture_output=True, text=True,
                         timeout=300, input="")
    assert res.returncode == 0 and "ThreadSanitizer" not in res.stderr, res.stderr[-3000:]
    assert res.stdout.split()[:2] == ["ok", "150"]


def test_while_everything_fits_nothing_is_checked(libgpuos_build, libgpuos_env, tmp_path):
    """A limit above what the process allocates costs nothing: memory is made at once and
    no call passes the scheduler."""
    app = App(libgpuos_build, libgpuos_env, tmp_path, ["--gpu-memory", "32M"], 200, 9)
    try:
        st = app.stats(libgpuos_env)
        assert st["resident_bytes"] == st["reserved_bytes"] == RESERVED
        assert st["launches"] == 0 and st["calls_swapped"] == 0 and st["evictions"] == 0
        assert st["host_prepared"] == 0  # no host memory pinned for evictions that cannot come
    finally:
        assert app.finish()[0] == 0


def test_without_a_limit_nothing_moves(libgpuos_build, libgpuos_env, tmp_path):
    app = App(libgpuos_build, libgpuos_env, tmp_path, [], 100, 3)
    try:
        st = app.stats(libgpuos_env)
        assert st["limit"] == 0 and st["evictions"] == 0 and st["bytes_in"] == 0
    finally:
        assert app.finish()[0] == 0


@pytest.mark.parametrize("mode,limit,expected", [
    ("big", "10M", "refused"),      # 8 + 4 MiB in one launch, 10 allowed
    ("big", "12M", "launched: 0"),
    ("opaque", "12M", "refused"),   # no layout: it needs all 22 MiB
    ("opaque", "24M", "ok opaque"),
])
def test_a_call_that_cannot_fit_fails_loudly(libgpuos_build, libgpuos_env, tmp_path, mode, limit, expected):
    """What a call needs and cannot have resident is never run against missing memory:
    the call fails with CUDA_ERROR_OUT_OF_MEMORY and stderr says why."""
    prog = str(libgpuos_build / "tests" / "t_resident")
    res = subprocess.run([*GPUOS, "run", "-q", "--gpu-memory", limit, "--", prog, str(tmp_path / "stop"), "0", "1",
                          mode], env=libgpuos_env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == expected
    assert ("--gpu-memory allows" in res.stderr) == (expected == "refused")


def test_a_process_under_a_limit_is_not_held(libgpuos_build, libgpuos_env, tmp_path):
    """The checkpoint's first step is refused (its memory may live in host memory only),
    and the process goes on."""
    app = App(libgpuos_build, libgpuos_env, tmp_path, ["--gpu-memory", "12M"], 50, 5)
    try:
        with Agent(app.pid) as agent, pytest.raises(AgentError, match="--gpu-memory"):
            agent.hold()
        assert app.stats(libgpuos_env)["limit"] == 12 * MIB
    finally:
        assert app.finish()[0] == 0


@pytest.mark.parametrize("args,message", [
    (["--gpu-memory", "lots"], "not a size"),
    (["--gpu-memory", "100k"], "at least 1M"),
    (["--gpu-memory", "4G", "--memory", "driver"], "needs --memory movable"),
    (["--evict", "lru"], "only means something with --gpu-memory"),
])
def test_bad_limits_are_refused(libgpuos_env, args, message):
    res = subprocess.run([*GPUOS, "run", *args, "--", "true"], env=libgpuos_env, capture_output=True, text=True)
    assert res.returncode == 2 and message in res.stderr


def test_mem_stats_errors(libgpuos_env):
    res = subprocess.run([*GPUOS, "mem", "stats", "999999999"], env=libgpuos_env, capture_output=True, text=True)
    assert res.returncode == 3 and "no process" in res.stderr
    res = subprocess.run([*GPUOS, "mem", "stats", str(os.getpid()), "--json"], env=libgpuos_env, capture_output=True,
                         text=True)
    assert res.returncode == 29 and json.loads(res.stdout)["error"] == "not-tracked"


def test_swaps_have_usdt_probes_a_tracer_can_find(libgpuos_build):
    """libgpuos/src/usdt.h: the built library carries a SystemTap note per probe (provider
    gpuos), each argument a register, each location a nop in the code: what bpftrace's
    usdt: probes and bcc's trace attach to."""
    lib = libgpuos_build / "libgpuos.so"
    notes = subprocess.run(["readelf", "-n", str(lib)], capture_output=True, text=True, check=True).stdout
    probes = {}
    for block in notes.split("Provider: ")[1:]:
        provider = block.split()[0]
        name = block.split("Name: ")[1].split()[0]
        location = int(block.split("Location: ")[1].split(",")[0], 16)
        args = block.split("Arguments: ")[1].splitlines()[0].split()
        probes[name] = (provider, location, args)
    assert {n: (p, len(a)) for n, (p, _, a) in probes.items()} == {
        "evict": ("gpuos", 3), "swap_in": ("gpuos", 2), "swap_ahead": ("gpuos", 2), "call_in": ("gpuos", 3)}
    for name, (_, location, args) in probes.items():
        assert all(a.startswith("8@%r") for a in args), (name, args)
        code = subprocess.run(["objdump", "-d", f"--start-address={location}", f"--stop-address={location + 1}",
                               str(lib)], capture_output=True, text=True, check=True).stdout
        assert code.rstrip().splitlines()[-1].split("\t")[-1].strip() == "nop", (name, code[-200:])
