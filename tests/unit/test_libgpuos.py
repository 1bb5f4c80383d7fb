"""libgpuos end to end on the host: the real library, `gpuos run`, and a fake driver.

libgpuos/fakecuda is a libcuda.so.1 whose "device memory" is host memory and whose
kernels are C functions, so launches really read and write buffers; the C programs in
libgpuos/tests reach it the three ways real stacks do (linked directly, dlsym, and
cuGetProcAddress like the CUDA 12/13 runtimes), check their own results, count every
driver call they made against the fake's own counts (an interposer that called
through twice, or not at all, fails them) and print one JSON line.  Here we check that
what libgpuos recorded matches what the programs did, that results are identical with
and without it, and that validation finds exactly the writes the speculation cannot
see.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpuos.intercept.log import read_log
from gpuos.intercept.runner import CTL_MAGIC, REPLY

REPO = Path(__file__).resolve().parents[2]
GPUOS = [sys.executable, "-m", "gpuos.cli"]
PROGS = ("t_direct", "t_dlsym", "t_procaddr", "t_graph", "t_validate", "t_fork", "t_scan")


@pytest.fixture(scope="module")
def build(libgpuos_build) -> Path:
    return libgpuos_build


@pytest.fixture
def env(libgpuos_env) -> dict[str, str]:
    return libgpuos_env


def prog_json(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"prog"')]


def plain(build: Path, env: dict, prog: str, *args: str, stderr: list | None = None,
          **extra: str) -> list[dict]:
    res = subprocess.run([str(build / "tests" / prog), *args], env=dict(env, **extra),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    if stderr is not None:
        stderr.append(res.stderr)
    return prog_json(res.stdout)


def traced(build: Path, env: dict, tmp_path: Path, prog: str, *args: str,
           gpuos_args: tuple[str, ...] = ()) -> tuple[list[dict], dict, list[dict]]:
    """Run a program under `gpuos run --log --report`: (its JSON, the report, the log)."""
    log, report = tmp_path / f"{prog}.jsonl", tmp_path / f"{prog}.report.json"
    res = subprocess.run([*GPUOS, "run", "-q", "--log", str(log), "--report", str(report),
                          *gpuos_args, "--", str(build / "tests" / prog), *args],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return prog_json(res.stdout), json.loads(report.read_text()), list(read_log(log))[1:]


def of_type(log: list[dict], t: str, pid: int | None = None) -> list[dict]:
    return [r for r in log if r["type"] == t and (pid is None or r["pid"] == pid)]


def names(log: list[dict]) -> dict[tuple[int, int], str]:
    return {(r["pid"], r["id"]): r["name"] for r in of_type(log, "function")}


@pytest.mark.parametrize("prog", ["t_direct", "t_dlsym", "t_procaddr"])
def test_every_path_to_the_driver_is_seen(build, env, tmp_path, prog):
    (out,), report, log = traced(build, env, tmp_path, prog, "11")
    assert out["ok"]
    (proc,) = report["processes"]
    c = proc["counters"]
    assert proc["state"] == "on", proc["reason"]
    assert c["unmatched_procs"] == 0 and c["records_lost"] == 0
    launches = of_type(log, "launch")
    assert c["launches"] == len(launches)
    run_now = [r for r in launches if not {"graph", "captured"} & set(r["flags"])]
    assert len(run_now) == out["launches"]
    assert len([r for r in launches if "graph" in r["flags"]]) == out["graph_kernels"]
    assert len(of_type(log, "graph")) == c["graph_launches"] == out["graph_launches"]
    allocs = sum(out["alloc_kinds"].values()) + out["vmm_reserve"] + out["vmm_create"]
    assert c["allocs"] == len(of_type(log, "alloc")) == allocs
    assert c["frees"] == len(of_type(log, "free")) == allocs
    copies = [r for r in of_type(log, "copy") if "graph" not in r["flags"]]
    assert len(copies) >= out["copies"] + out["memsets"] + out["write_values"]

    fn = names(log)
    by_name: dict[str, list[dict]] = {}
    for r in run_now:
        by_name.setdefault(fn[(r["pid"], r["func"])], []).append(r)
    # a by-value struct: both pointers found inside parameter 0, at their offsets
    (st,) = by_name["fake_struct"][:1]
    assert [(b["param"], b["offset"]) for b in st["bufs"]] == [(0, 8), (0, 16)]
    # an interior pointer: the allocation it points into
    interior = by_name["fake_interior"][0]["bufs"][0]
    assert interior["base"] < interior["ptr"] < interior["base"] + interior["size"]
    # saxpy(a, x, y, n): the two pointers, not the scalars
    assert [b["param"] for b in by_name["fake_saxpy"][0]["bufs"]] == [1, 2]
    flags = {f for r in run_now for b in r["bufs"] for f in b["flags"]}
    assert {"host", "managed"} <= flags
    kinds = {r["kind"] for r in of_type(log, "alloc")}
    assert {"device", "pitch", "async", "managed", "host", "host-registered", "vmm-reserve",
            "vmm-map", "vmm-create"} <= kinds
    vmm = [r for r in of_type(log, "alloc") if r["kind"] == "vmm-map"]
    assert any(b["base"] == vmm[0]["base"] for r in run_now for b in r["bufs"])
    assert {"ex", "extra", "cooperative"} <= {f for r in run_now for f in r["flags"]}


@pytest.mark.parametrize("prog", PROGS)
def test_results_identical_with_and_without_libgpuos(build, env, tmp_path, prog):
    ref = plain(build, env, prog, "5")
    got, report, _ = traced(build, env, tmp_path, prog, "5")
    strip = lambda outs: [{k: v for k, v in o.items() if k not in ("pid", "parent_pid", "child_pid", "buffers", "indirect_targets", "ops", "expect")}
                          for o in outs]
    assert strip(got) == strip(ref)
    assert all(p["state"] == "on" for p in report["processes"]), report["processes"]


@pytest.mark.parametrize("seed", ["3", "17"])
def test_scan_follows_a_changing_map(build, env, tmp_path, seed):
    """Launches between frees and new allocations (addresses reused, sizes changed), with
    more distinct buffers than the short list holds and repeats: each launch's buffers
    are exactly the live allocations its pointers point into, in order of appearance."""
    (out,), report, log = traced(build, env, tmp_path, "t_scan", seed)
    assert out["ok"]
    launches = [r for r in of_type(log, "launch")]
    assert len(launches) == len(out["expect"])
    for i, (rec, want) in enumerate(zip(launches, out["expect"])):
        assert [[b["base"], b["size"]] for b in rec["bufs"]] == want, f"launch {i}"
    assert any(len(w) > 8 for w in out["expect"])  # past the short list
    # arg_hash: the words that are no pointers (here n = 200 alone) and nothing else
    fn = names(log)
    gathers = {r["arg_hash"] for r in launches if fn[(r["pid"], r["func"])] == "fake_gather"}
    noops = {r["arg_hash"] for r in launches if fn[(r["pid"], r["func"])] == "fake_noop"}
    assert len(gathers) == 1 and not gathers & noops
    bases = [b for w in out["expect"] for b, _ in w]
    assert len(set(bases)) < len(bases)  # addresses came back


@pytest.mark.parametrize("inline", [False, True], ids=["queued", "inline"])
def test_threads_launching_while_the_map_changes(build, env, tmp_path, inline):
    """Four threads launch while each frees and reallocates buffers, then exit right
    after their last launches: every launch is recorded once, under its thread's tid,
    in that thread's order, with exactly the buffers live when it was issued; seq is
    one increasing order over the process.  Queued (the default: a recording thread
    makes the records) and inline (GPUOS_RECORD_INLINE=1) alike."""
    (out,), report, log = traced(build, dict(env, GPUOS_RECORD_INLINE="1" if inline else "0"), tmp_path,
                                 "t_threads", "5")
    assert out["ok"]
    launches = of_type(log, "launch")
    for t in out["threads"]:
        mine = [r for r in launches if r["tid"] == t["tid"]]
        assert [[[b["base"], b["size"]] for b in r["bufs"]] for r in mine] == t["expect"], t["tid"]
        assert len(of_type([r for r in log if r.get("tid") == t["tid"]], "copy")) == len(t["expect"]) // 2 * 3
        seqs = [r["seq"] for r in mine]
        assert seqs == sorted(seqs)
    # Times are the issuing thread's (the TSC converted by the recording thread): each
    # launch lies between the allocation records (stamped inline) before and after it.
    for t in out["threads"]:
        mine = [r for r in log if r.get("tid") == t["tid"] and r["type"] in ("launch", "alloc", "free")]
        last_inline = 0
        for i, r in enumerate(mine):
            if r["type"] != "launch":
                last_inline = r["ts_ns"]
                continue
            nxt = next((x["ts_ns"] for x in mine[i + 1:] if x["type"] != "launch"), None)
            assert r["ts_ns"] >= last_inline - 20_000, (i, r["ts_ns"], last_inline)
            assert nxt is None or r["ts_ns"] <= nxt + 20_000, (i, r["ts_ns"], nxt)
    assert [r["tid"] for r in launches].count(out["main_tid"]) == 1
    assert len(launches) == out["launches"] == sum(len(t["expect"]) for t in out["threads"]) + 1
    seqs = sorted(r["seq"] for r in launches + of_type(log, "copy"))
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def normalized_ops(log: list[dict]) -> list[dict]:
    """The launch, copy and graph records of a log with every address written as
    (n, offset): n numbers the allocations in the order they were made, so two runs
    whose allocations landed elsewhere compare equal; addresses in no allocation are
    "other".  Times, seq, tids and handles are left out."""
    live: dict[int, tuple[int, int]] = {}  # base -> (n, size)
    made = 0

    def where(addr: int) -> tuple[int, int] | str:
        for base, (n, size) in live.items():
            if base <= addr < base + size:
                return (n, addr - base)
        return "other"

    out = []
    for r in log:
        if r["type"] == "alloc":
            live[r["base"]] = (made, r["size"])
            made += 1
        elif r["type"] == "free":
            live.pop(r["base"], None)
        elif r["type"] in ("launch", "copy", "graph"):
            o = {k: v for k, v in r.items() if k not in ("ts_ns", "seq", "pid", "tid", "ctx", "stream", "graph_exec")}
            for k in ("dst", "src"):
                if k in o and o.get(f"{k}_len"):
                    o[k] = where(o[k])
            if "bufs" in o:
                o["bufs"] = [dict(b, base=where(b["base"]), ptr=where(b["ptr"])) for b in o["bufs"]]
            out.append(o)
    return out


def test_queued_and_inline_records_are_the_same(build, env, tmp_path):
    """The recording thread makes the records the launching thread would have made
    inline: the same operations, in the same order, with the same buffers, flags and
    argument hashes (only times, seq numbers and addresses may differ)."""
    runs = {}
    for mode in ("0", "1"):
        (tmp_path / mode).mkdir()
        (out,), _, log = traced(build, dict(env, GPUOS_RECORD_INLINE=mode), tmp_path / mode, "t_direct", "4242")
        assert out["ok"]
        runs[mode] = normalized_ops(log)
    assert len(runs["0"]) > 50 and any(r.get("bufs") for r in runs["0"])
    assert runs["0"] == runs["1"]


def test_passive_without_gpuos_run(build, env):
    """Preloaded by hand (no GPUOS_CTL), the library only calls through."""
    ref = plain(build, env, "t_direct", "3")
    got = plain(build, env, "t_direct", "3", LD_PRELOAD=str(build / "libgpuos.so"))
    assert [o["checksum"] for o in got] == [o["checksum"] for o in ref]


def release_standby(p: subprocess.Popen, fifo: Path) -> tuple[str, str]:
    """A standby program waiting in openat(2) at its FIFO, released: its stdout and stderr,
    once it ended well."""
    from gpuos.mps.standby import Releases
    try:
        stack = Path(f"/proc/{p.pid}/syscall").read_text().split()
        assert stack and stack[0] == "257", f"not waiting in openat: {stack}"  # x86-64 openat
        releases = Releases()
        releases.release(fifo)
        out, err = p.communicate(timeout=30)
        releases.close()
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert prog_json(out) and all(o["ok"] for o in prog_json(out))
    return out, err


@pytest.mark.parametrize("at", ["cuinit", "launch"])
@pytest.mark.parametrize("prog", ["t_direct", "t_dlsym", "t_procaddr"])
def test_a_standby_waits_at_its_first_cuinit_or_launch_until_released(build, env, tmp_path, prog, at):
    """GPUOS_MPS_STANDBY (gpuos mps --policy standby): the program runs up to its first
    cuInit (a cold standby) or its first kernel launch (GPUOS_MPS_STANDBY_AT=launch, a
    warm one), whichever way it reaches the driver, and waits there until the
    supervisor's release; a later start finds no FIFO and does not wait."""
    fifo = tmp_path / "standby"
    os.mkfifo(fifo, 0o600)
    run_env = dict(env, LD_PRELOAD=str(build / "libgpuos.so"), GPUOS_MPS_STANDBY=str(fifo),
                   GPUOS_LIB_DEBUG="1")
    if at == "launch":
        run_env["GPUOS_MPS_STANDBY_AT"] = "launch"
    p = subprocess.Popen([str(build / "tests" / prog), "3"], env=run_env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=1.5)
    out, err = release_standby(p, fifo)
    waits = [l for l in err.splitlines() if "standby: waiting at" in l]
    assert waits == [waits[0]] and waits[0].endswith(
        f"waiting at {'a kernel launch' if at == 'launch' else 'cuInit'} for {fifo}"), err
    assert not fifo.exists()
    again = plain(build, env, prog, "3", LD_PRELOAD=str(build / "libgpuos.so"),
                  GPUOS_MPS_STANDBY=str(fifo))
    assert again and all(o["ok"] for o in again)


def test_a_warm_standby_loads_the_kernels_its_client_launched(build, env, tmp_path):
    """GPUOS_MPS_KERNELS (gpuos mps with a spare server): a client leaves the names of the
    kernels it launched; its warm standby, stopped at its first launch, loads each of
    them into its context (cuFuncLoad) while it waits and says so, launches nothing, and
    once released runs as usual."""
    lib = str(build / "libgpuos.so")
    kernels = tmp_path / "kernels.txt"
    client = plain(build, env, "t_direct", "3", LD_PRELOAD=lib, GPUOS_MPS_KERNELS=str(kernels))
    assert client and all(o["ok"] for o in client)
    records = kernels.read_text().splitlines()
    assert records == sorted(set(records)), records
    names = sorted({r.split("\t")[0] for r in records})
    assert len(names) >= 3 and all(n.startswith(("fake_", "gpuos_")) for n in names), names
    kernels.write_text("\n".join(records + ["not_a_kernel_of_this_program"]) + "\n")

    fifo = tmp_path / "standby"
    os.mkfifo(fifo, 0o600)
    p = subprocess.Popen([str(build / "tests" / "t_direct"), "3"], env=dict(
        env, LD_PRELOAD=lib, GPUOS_MPS_STANDBY=str(fifo), GPUOS_MPS_STANDBY_AT="launch",
        GPUOS_MPS_KERNELS=str(kernels), FAKECUDA_STATS=str(tmp_path / "stats.json")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    loaded = standby_report(p, kernels)
    assert loaded["names"] == len(names) + 1 and loaded["loaded"] == len(names), loaded
    assert loaded["not_found"] == 1 and loaded["refused"] == 0 and loaded["modules"] >= 1, loaded
    assert not loaded["released"]
    release_standby(p, fifo)
    stats = json.loads((tmp_path / "stats.json").read_text())
    # every fake module and library has every fake kernel: each name is loaded in each
    assert stats["per_call"].get("cuFuncLoad") == len(names) * (loaded["libraries"] + loaded["modules"]), \
        (stats["per_call"], loaded)
    # The standby, now the client, kept the list: the records it launched are still there.
    assert set(records) <= set(kernels.read_text().splitlines())


def test_a_warm_standby_loads_a_library_ahead_and_hands_it_over(build, env, tmp_path):
    """A library the program loads only after its first launch, from an image inside the
    program (as the CUDA runtime loads each fatbin when one of its kernels is first
    needed): the client's record says where the image lies; the standby loads it as a
    library while it waits, and when the program asks for that image (cuLibraryLoadData,
    binary preserved) it is handed that library: the driver loads the image once."""
    lib = str(build / "libgpuos.so")
    kernels = tmp_path / "kernels.txt"
    client = plain(build, env, "t_preload", LD_PRELOAD=lib, GPUOS_MPS_KERNELS=str(kernels))
    assert client and all(o["ok"] for o in client)
    records = [r.split("\t") for r in kernels.read_text().splitlines()]
    with_image = [r for r in records if len(r) > 1]
    # the main program's image: object "" (the executable), its offset, the load's options
    assert [(r[0], r[1], r[3]) for r in with_image] == [("fake_fill", "", "j0,1=0x1")], records
    assert int(with_image[0][2], 16) > 0

    fifo = tmp_path / "standby"
    os.mkfifo(fifo, 0o600)
    p = subprocess.Popen([str(build / "tests" / "t_preload")], env=dict(
        env, LD_PRELOAD=lib, GPUOS_MPS_STANDBY=str(fifo), GPUOS_MPS_STANDBY_AT="launch",
        GPUOS_MPS_KERNELS=str(kernels), FAKECUDA_STATS=str(tmp_path / "stats.json")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    loaded = standby_report(p, kernels)
    assert loaded["images_loaded_ahead"] == 1 and loaded["loaded"] == 1 and loaded["names"] == 1, loaded
    release_standby(p, fifo)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["per_call"].get("cuLibraryLoadData") == 1, stats["per_call"]  # ahead, not again


@pytest.mark.parametrize("warm_up", ["on", "off"])
def test_a_warm_standby_starts_cublas_while_it_waits(build, env, tmp_path, warm_up):
    """blaswarm.c: a warm standby whose program has loaded cuBLAS (here a stand-in,
    preloaded) makes GEMMs of every common kind on a thread of its own while the program
    waits at its first launch: their launches pass the wait (the program's do not), and
    the program runs as usual once released; the standby's report (`gpuos mps clients`)
    says what it did.  GPUOS_MPS_STANDBY_CUBLAS=0: none."""
    fifo, log, kernels = tmp_path / "standby", tmp_path / "cublas.log", tmp_path / "kernels.txt"
    os.mkfifo(fifo, 0o600)
    run_env = dict(env, LD_PRELOAD=f"{build / 'libgpuos.so'}:{build / 'tests' / 'fakecublas' / 'libcublas.so.13'}",
                   GPUOS_MPS_STANDBY=str(fifo), GPUOS_MPS_STANDBY_AT="launch", FAKE_CUBLAS_LOG=str(log),
                   GPUOS_MPS_KERNELS=str(kernels))
    if warm_up == "off":
        run_env["GPUOS_MPS_STANDBY_CUBLAS"] = "0"
    p = subprocess.Popen([str(build / "tests" / "t_direct"), "3"], env=run_env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    want = 3 * 2 * 4  # transpositions x shapes x kinds (fp32, TF32, fp16, bf16)
    deadline = time.monotonic() + (20 if warm_up == "on" else 1.5)
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < want):
        assert p.poll() is None, p.communicate()
        time.sleep(0.05)
    calls = [line.split() for line in log.read_text().splitlines()] if log.exists() else []
    report = None
    if warm_up == "on":
        report = standby_report(p, kernels)
        deadline = time.monotonic() + 10
        while not report.get("cublas_warm_up") and time.monotonic() < deadline:
            time.sleep(0.05)
            report = standby_report(p, kernels)
    release_standby(p, fifo)  # it was still waiting
    if warm_up == "off":
        assert calls == []
        return
    assert len(calls) == want, calls
    tids, pids, launches = {c[0] for c in calls}, {c[1] for c in calls}, {c[2] for c in calls}
    assert pids == {str(p.pid)} and tids.isdisjoint(pids)  # in the standby, not its main thread
    assert launches == {"400"}, launches  # CUDA_ERROR_INVALID_HANDLE from the fake: it launched
    assert {c[8] for c in calls} == {"68", "77"}  # fp32 and TF32 compute
    warm = report["cublas_warm_up"]
    assert warm["calls"] == want and warm["failed"] == 0 and warm["seconds"] > 0, report
    assert not report["released"]


@pytest.mark.parametrize("printf_ahead", ["default", "off"])
def test_a_warm_standby_makes_ahead_what_its_client_allocated_after_its_first_launch(build, env, tmp_path,
                                                                                     printf_ahead):
    """aheadmem.c: a client (GPUOS_MPS_KERNELS) writes down the sizes of its cuMemAllocs
    after its first launch; its warm standby makes them while it waits and, released, hands
    them out for the program's allocations of those sizes without asking the driver: the
    program's own check that the fake driver saw exactly its calls holds only if every
    one made ahead was handed out (else the fake saw more allocations than it made).
    preload.c: it has the printf buffer made too, unless GPUOS_MPS_PRINTF_AHEAD=0."""
    lib = str(build / "libgpuos.so")
    kernels = tmp_path / "kernels.txt"
    client = plain(build, env, "t_direct", "3", LD_PRELOAD=lib, GPUOS_MPS_KERNELS=str(kernels))
    assert client and all(o["ok"] for o in client)
    sizes = [int(x) for x in Path(f"{kernels}.allocs").read_text().split()]
    assert sizes and all(x > 0 for x in sizes), sizes

    fifo = tmp_path / "standby"
    os.mkfifo(fifo, 0o600)
    off = {"GPUOS_MPS_PRINTF_AHEAD": "0"} if printf_ahead == "off" else {}
    p = subprocess.Popen([str(build / "tests" / "t_direct"), "3"], env=dict(
        env, LD_PRELOAD=lib, GPUOS_MPS_STANDBY=str(fifo), GPUOS_MPS_STANDBY_AT="launch",
        GPUOS_MPS_KERNELS=str(kernels), **off), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    report = standby_report(p, kernels)
    deadline = time.monotonic() + 10
    while report.get("allocations_made_ahead") != len(sizes) and time.monotonic() < deadline:
        time.sleep(0.05)
        report = standby_report(p, kernels)
    assert report["allocations_made_ahead"] == len(sizes) and report["allocations_handed_out"] == 0, report
    # its kernel that can print ran (or, turned off, did not)
    assert report["printf_buffer_made"] is (None if off else True), report
    release_standby(p, fifo)  # its exact counts held: each one made ahead was handed out


@pytest.mark.parametrize("client_writes", ["never", "while-waiting", "before-release"])
def test_a_warm_standby_maps_its_clients_start_up_memory_instead_of_a_copy(build, env, tmp_path, client_writes):
    """sharemem.c (GPUOS_MPS_SHARE_MEMORY=1): a client's start-up allocations are served to
    its warm standby, which maps each one whose content equals its own in place of its own
    (three here; the fourth, written with each process's pid, differs and is kept).  Its
    program then reads what it wrote itself: also where the client wrote the shared memory
    after the standby mapped it (as a training client changes its weights).  The waiting
    standby's check (once a second) puts its own copy back (given back: shared no more);
    where the client wrote just before the release, the release's check does (restored;
    or the waiting check, if it came between: one of the two, once)."""
    lib = str(build / "libgpuos.so")
    kernels, fifo = tmp_path / "kernels.txt", tmp_path / "standby"
    os.mkfifo(fifo, 0o600)
    share = dict(env, LD_PRELOAD=lib, GPUOS_MPS_KERNELS=str(kernels), GPUOS_MPS_SHARE_MEMORY="1")
    client = subprocess.Popen([str(build / "tests" / "t_share"), "client"], env=share, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    standby = None
    try:
        assert json.loads(client.stdout.readline()) == {"ready": True}, client.stderr.read()
        assert Path(f"{kernels}.share").is_socket()
        standby = subprocess.Popen([str(build / "tests" / "t_share"), "standby"], env=dict(
            share, GPUOS_MPS_STANDBY=str(fifo), GPUOS_MPS_STANDBY_AT="launch",
            FAKECUDA_STATS=str(tmp_path / "standby-stats.json"), FAKECUDA_DEBUG="1"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        report = standby_report(standby, kernels)
        deadline = time.monotonic() + 20
        while not (report.get("memory_shared") or {}).get("asked") and time.monotonic() < deadline:
            time.sleep(0.05)
            report = standby_report(standby, kernels)
        shared = report["memory_shared"]
        assert (shared["allocations"], shared["bytes"], shared["restored"]) == (3, 3 * (4 << 20), 0), report
        assert shared["aside_bytes"] == shared["bytes"], report  # its own content, kept to put back
        if client_writes != "never":
            client.stdin.write("write\n")
            client.stdin.flush()
            assert json.loads(client.stdout.readline()) == {"written": True}
        if client_writes == "while-waiting":
            deadline = time.monotonic() + 20
            while not report["memory_shared"]["given_back"] and time.monotonic() < deadline:
                time.sleep(0.05)
                report = standby_report(standby, kernels)
            assert report["memory_shared"]["given_back_bytes"] == 4 << 20, report
        stack = Path(f"/proc/{standby.pid}/syscall").read_text().split()
        assert stack and stack[0] == "257", f"not waiting in openat: {stack}"
        from gpuos.mps.standby import Releases
        releases = Releases()
        releases.release(fifo)
        out, err = standby.communicate(timeout=30)
        releases.close()
        assert standby.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == {"ok": True, "bad": []}, (out, err)
        final = json.loads(Path(f"{kernels}.standby.{standby.pid}").read_text())["memory_shared"]
        put_back = {"never": (0, 0), "while-waiting": (1, 0)}.get(client_writes)
        assert (final["given_back"], final["restored"]) == put_back if put_back else \
            final["given_back"] + final["restored"] == 1, final
        assert final["given_back_bytes"] + final["restored_bytes"] == (0 if client_writes == "never" else 4 << 20)
        # the release on the wall clock, and the check's hashing part of it
        assert time.time() - 60 < final["released_at"] <= final["check_started_at"] <= time.time(), final
        assert 0 < final["check_hash_seconds"] <= final["check_seconds"], final
        # its own content aside while it waited (pinned), dropped a second after the
        # release, off the take-over's path: the report 2 s after it has none
        assert final["aside_bytes"] == 0, final
        stats = json.loads((tmp_path / "standby-stats.json").read_text())
        calls = stats["per_call"]
        assert calls.get("cuMemHostRegister_v2", 0) == calls.get("cuMemHostUnregister", 0) == 3, calls
        # ... and unpinned indeed (the driver wants a context current for it): no refusal,
        # and the fake keeps no 4 MiB registration at the standby's exit
        assert "cuMemHostUnregister ->" not in err and stats["live_bytes"] < 4 << 20, (stats, err)
    finally:
        for p in (standby, client):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    client.stdin.close()


def test_without_the_setting_a_standby_shares_nothing(build, env, tmp_path):
    lib = str(build / "libgpuos.so")
    kernels, fifo = tmp_path / "kernels.txt", tmp_path / "standby"
    os.mkfifo(fifo, 0o600)
    base = dict(env, LD_PRELOAD=lib, GPUOS_MPS_KERNELS=str(kernels))
    client = subprocess.Popen([str(build / "tests" / "t_share"), "client"], env=base, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert json.loads(client.stdout.readline()) == {"ready": True}
        assert not Path(f"{kernels}.share").exists()
        standby = subprocess.Popen([str(build / "tests" / "t_share"), "standby"], env=dict(
            base, GPUOS_MPS_STANDBY=str(fifo), GPUOS_MPS_STANDBY_AT="launch"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert standby_report(standby, kernels)["memory_shared"] is None
        from gpuos.mps.standby import Releases
        releases = Releases()
        releases.release(fifo)
        out, err = standby.communicate(timeout=30)
        releases.close()
        assert json.loads(out.strip().splitlines()[-1]) == {"ok": True, "bad": []}, (out, err)
    finally:
        client.kill()
        client.communicate()


def standby_report(p: subprocess.Popen, kernels: Path) -> dict:
    """A warm standby's first report of what it loaded ahead (preload.c)."""
    report = Path(f"{kernels}.standby.{p.pid}")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not report.exists():
        assert p.poll() is None, p.communicate()
        time.sleep(0.05)
    return json.loads(report.read_text())


def test_graphs_are_extracted_at_instantiate_and_replayed(build, env, tmp_path):
    (out,), report, log = traced(build, env, tmp_path, "t_graph", "9")
    graphs = of_type(log, "graph")
    assert len(graphs) == out["graph_launches"]
    gk = [r for r in of_type(log, "launch") if "graph" in r["flags"]]
    assert len(gk) == out["graph_kernels"] == sum(g["nkernels"] for g in graphs)
    gc = [r for r in of_type(log, "copy") if "graph" in r["flags"]]
    assert len(gc) == out["graph_copies"] + out["graph_memsets"] == sum(g["ncopies"] for g in graphs)
    assert all(r["graph_exec"] in {g["graph_exec"] for g in graphs} for r in gk + gc)
    assert all(r["bufs"] for r in gk)  # node parameters were scanned at instantiate
    captured = [r for r in of_type(log, "launch") if "captured" in r["flags"]]
    assert captured


def test_validation_finds_exactly_the_blind_spot(build, env, tmp_path):
    (out,), report, log = traced(build, env, tmp_path, "t_validate", "21",
                                 gpuos_args=("--validate",))
    v = report["validation"]
    assert v["skipped"] == 0 and v["operations"] == len(out["ops"])
    assert v["with_misses"] == 1
    rows = {k["name"]: k for k in v["kernels"]}
    assert rows["fake_indirect"]["with_misses"] == 1
    assert all(k["with_misses"] == 0 for n, k in rows.items() if n != "fake_indirect")
    targets = {int(a, 16) for a in out["indirect_targets"]}
    missed = {m["base"] for r in of_type(log, "validate") for m in r["misses"]}
    assert missed == targets
    fn = names(log)
    opaque = [r for r in of_type(log, "launch") if fn[(r["pid"], r["func"])] == "fake_opaque"]
    assert opaque and "layout-unknown" in opaque[0]["flags"]
    assert report["processes"][0]["counters"]["unknown_layout"] == 1
    # the buffer nobody wrote is never reported changed
    never = int(out["buffers"]["Q"], 16)
    assert all(m["base"] != never for r in of_type(log, "validate") for m in r["misses"])


def test_touch_all_is_the_fallback_for_the_blind_spot(build, env, tmp_path):
    _, report, log = traced(build, env, tmp_path, "t_validate", "21",
                            gpuos_args=("--validate", "--touch-all", "indirect"))
    assert report["validation"]["with_misses"] == 0
    assert any("touch-all" in r["flags"] for r in of_type(log, "launch"))


def test_a_forked_child_gets_its_own_ring(build, env, tmp_path):
    outs, report, log = traced(build, env, tmp_path, "t_fork", "4")
    pids = {o["pid"] for o in outs}
    assert len(pids) == 2 and {p["pid"] for p in report["processes"]} == pids
    for p in report["processes"]:
        assert p["state"] == "on" and p["counters"]["launches"] > 0
        assert of_type(log, "launch", p["pid"])


def test_exports_are_exactly_the_hook_table_and_the_untracked_writers(build):
    table = (REPO / "libgpuos" / "src" / "hooktable.h").read_text()
    hooked = set(re.findall(r"^\s*X\w*\((cu\w+)", table, re.M))
    assert "cuLaunchKernel_ptsz" in hooked and "cuGetProcAddress_v2" in hooked
    assert "cuGetExportTable" not in hooked
    nm = subprocess.run(["nm", "-D", "--defined-only", str(build / "libgpuos.so")],
                        capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in nm.splitlines() if " T " in line}
    unhooked = set(re.findall(r"^U\((cu\w+)\)", (REPO / "libgpuos" / "src" / "unhooked.h").read_text(), re.M))
    assert "cuStreamBatchMemOp_v2" in unhooked and not unhooked & hooked
    assert {s for s in exported if s.startswith("cu")} == hooked | unhooked
    assert exported - hooked - unhooked == {"dlsym"}


def _serve_once(path: Path, reply: bytes | None) -> threading.Thread:
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(1)

    def serve():
        conn, _ = srv.accept()
        socket.recv_fds(conn, 4096, 1)
        if reply is not None:
            conn.sendall(reply)
        conn.recv(1)  # until the client exits
        conn.close()
        srv.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("case, reason", [
    ("no-server", "cannot connect to the control socket"),
    ("refused", "gpuos run refused the process"),
    ("bad-magic", "bad reply from the control socket"),
])
def test_tracking_off_leaves_the_application_untouched(build, env, tmp_path, case, reason):
    ref = plain(build, env, "t_direct", "8")
    ctl = tmp_path / "ctl.sock"
    if case == "refused":
        _serve_once(ctl, REPLY.pack(CTL_MAGIC, 1))
    elif case == "bad-magic":
        _serve_once(ctl, struct.pack("<II", 0xDEAD, 0))
    err: list[str] = []
    got = plain(build, env, "t_direct", "8", stderr=err, LD_PRELOAD=str(build / "libgpuos.so"),
                GPUOS_CTL=str(ctl), GPUOS_LIB_DEBUG="1")
    assert [o["checksum"] for o in got] == [o["checksum"] for o in ref]
    assert f"tracking off: {reason}" in err[0]


def test_dump_params_writes_the_raw_parameters(build, env, tmp_path):
    _, _, log = traced(build, env, tmp_path, "t_direct", "2",
                       gpuos_args=("--dump-params", "fake_struct"))
    fn = names(log)
    dumps = of_type(log, "params")
    assert dumps and all(fn[(d["pid"], d["func"])] == "fake_struct" for d in dumps)
    launches = {(r["pid"], r["seq"]): r for r in of_type(log, "launch")}
    for d in dumps:
        (p,) = d["params"]
        raw = bytes.fromhex(p["hex"])
        assert (p["offset"], p["size"], len(raw)) == (0, 24, 24)
        words = struct.unpack("<3Q", raw)
        launch = launches[(d["pid"], d["seq"])]
        assert [b["ptr"] for b in launch["bufs"]] == [words[1], words[2]]


def test_a_full_function_table_turns_tracking_off_and_nothing_else(build, env, tmp_path):
    ref = plain(build, env, "t_direct", "6")
    got, report, log = traced(build, env | {"GPUOS_FUNC_TABLE": "4"}, tmp_path, "t_direct", "6")
    assert [o["checksum"] for o in got] == [o["checksum"] for o in ref]
    (proc,) = report["processes"]
    assert proc["state"] == "off" and proc["reason"] == "function table full (4 entries)"
    assert [r["reason"] for r in of_type(log, "status")] == ["function table full (4 entries)"]


def _phased(build, env, tmp_path, between: list[list[str]], gpuos_args: tuple[str, ...] = ()):
    """t_pause under `gpuos run`, running the gpuos commands between[i] after phase i+1:
    (the program's JSON, the log, the commands' results)."""
    log = tmp_path / "t_pause.jsonl"
    proc = subprocess.Popen([*GPUOS, "run", "-q", "--log", str(log), *gpuos_args, "--",
                             str(build / "tests" / "t_pause"), "5"],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    results = []
    try:
        for cmds in between:
            line = proc.stdout.readline()
            pid = re.fullmatch(r"phase \d done \(pid (\d+)\)\n", line)
            assert pid, line
            results.append(subprocess.run([*GPUOS, "trace", *cmds, pid[1]], env=env,
                                          capture_output=True, text=True, timeout=30))
            proc.stdin.write("\n")
            proc.stdin.flush()
        out, _ = proc.communicate("\n" * (2 - len(between)), timeout=60)  # the phases left
    finally:
        proc.kill()
    assert proc.returncode == 0
    return prog_json(out)[0], list(read_log(log))[1:], results


def test_paused_operations_are_not_recorded_and_resume_exact(build, env, tmp_path):
    out, log, (paused, resumed) = _phased(build, env, tmp_path, [["pause", "--json"], ["resume"]])
    assert paused.returncode == 0, paused.stderr
    assert json.loads(paused.stdout) == {"pid": out["pid"], "ops_paused": True, "was_paused": False}
    assert resumed.returncode == 0 and "operations are recorded" in resumed.stdout
    assert out["ok"] and out["launches"] == 5 and out["memsets"] == 1
    fn = names(log)
    launches = [r for r in of_type(log, "launch") if fn[(r["pid"], r["func"])] == "fake_noop"]
    # phase 1's launch on A and phase 3's on B; none of the three paused ones
    assert [[b["base"] for b in r["bufs"]] for r in launches] == [[out["a"]], [out["b"]]]
    # B, allocated while paused, is in the map: its launch after resume names it
    assert {r["base"] for r in of_type(log, "alloc")} >= {out["a"], out["b"]}
    assert not [r for r in of_type(log, "copy") if r["kind"] == "memset"]
    assert [r["dst"] for r in of_type(log, "copy") if r["kind"] == "htod"] == [out["a"]]


def test_the_recording_thread_runs_where_record_cpus_says(build, env):
    """Once a process has queued operations it has a recording thread, "gpuos-rec";
    `gpuos run --record-cpus` (GPUOS_RECORD_CPUS) pins that thread, and no other, to the
    CPUs it lists."""
    cpus = sorted(os.sched_getaffinity(0))
    want = str(cpus[-1])
    proc = subprocess.Popen([*GPUOS, "run", "-q", "--record-cpus", want, "--",
                             str(build / "tests" / "t_pause"), "5"],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    allowed: dict[str, list[str]] = {}
    try:
        pid = re.fullmatch(r"phase \d done \(pid (\d+)\)\n", proc.stdout.readline())
        assert pid
        for task in Path(f"/proc/{pid[1]}/task").iterdir():
            comm = (task / "comm").read_text().strip()
            status = (task / "status").read_text()
            allowed.setdefault(comm, []).append(re.search(r"Cpus_allowed_list:\s*(\S+)", status)[1])
        proc.communicate("\n\n", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert allowed.pop("gpuos-rec") == [want]
    assert allowed and all(a != want for lists in allowed.values() for a in lists) or len(cpus) == 1


def test_validation_cannot_be_paused(build, env, tmp_path):
    out, log, (paused,) = _phased(build, env, tmp_path, [["pause"]], gpuos_args=("--validate",))
    assert paused.returncode == 29 and "--validate" in paused.stderr
    fn = names(log)
    assert len([r for r in of_type(log, "launch") if fn[(r["pid"], r["func"])] == "fake_noop"]) == 5


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "queued"])
def test_selftime_build_times_each_launch(build, env, inline):
    """`make selftime`: the same library, timing its own part of every launch, whether
    the launching thread records it (GPUOS_RECORD_INLINE=1) or queues it to the
    recording thread."""
    res = subprocess.run(["make", "-s", "-C", str(REPO / "libgpuos"), f"O={build}", "selftime"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    run_env = dict(env, GPUOS_LIBGPUOS=str(build / "selftime" / "libgpuos.so"),
                   GPUOS_RECORD_INLINE="1" if inline else "0")
    got = subprocess.run([*GPUOS, "run", "-q", "--", str(build / "tests" / "t_bench"), "2000", "10", "strided"],
                         env=run_env, capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    (line,) = [ln for ln in got.stderr.splitlines() if ln.startswith("libgpuos selftime:")]
    # 1000 warmup launches and 2000 timed; fake_strided's 532 parameter bytes are 67 words
    assert ", 3000 launches," in line and "67.0 words per launch" in line, line
    queued = int(re.search(r"(\d+) queued", line).group(1))
    hits, misses = map(int, re.search(r"lookups (\d+) hits, (\d+) misses", line).groups())
    assert hits + misses == 3 * 3000, line
    if inline:
        assert queued == 0 and misses <= 3, line
    else:
        # A thread whose queue is full records it itself: each recording thread's cache
        # misses each of the 3 buffers once.
        assert queued > 0 and misses <= 3 * 2, line
    assert prog_json(got.stdout)[0]["ok"]


@pytest.mark.parametrize("driver_global", [False, True])
def test_dlsym_answers_as_it_would_without_libgpuos(build, env, driver_global):
    """libgpuos exports every name of its hook table; dlsym must still say "absent" for a
    name the driver lacks (the fake has no cuMemcpyBatchAsync_v2), through RTLD_DEFAULT,
    a handle and RTLD_NEXT, and set dlerror the same way."""
    names = ["cuInit", "cuMemAlloc_v2", "cuMemcpyBatchAsync_v2", "cuNoSuchEntryPoint", "malloc",
             "cuStreamBatchMemOp_v2", "cuMemcpyAtoD_v2"]  # untracked writers: the fake has one
    fake = str(build / "fakecuda" / "libcuda.so")

    def answers(preload: list[str]) -> list[str]:
        res = subprocess.run([str(build / "tests" / "t_dlsym_answers"), *names],
                             env=dict(env, LD_PRELOAD=":".join(preload)), capture_output=True,
                             text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        return res.stdout.splitlines()

    driver = [fake] if driver_global else []
    without = answers(driver)
    assert answers([str(build / "libgpuos.so"), *driver]) == without
    assert ("default cuMemcpyBatchAsync_v2 absent error" in without) and \
        ("handle cuMemcpyBatchAsync_v2 absent error" in without)
    assert (f"default cuInit {'found no-error' if driver_global else 'absent error'}") in without


@pytest.mark.parametrize("prog", ["t_threads_tsan", "t_dlsym_tsan", "t_direct_asan"])
def test_sanitizer_built_programs_run_under_libgpuos(build, env, tmp_path, prog):
    """A ThreadSanitizer or AddressSanitizer build of an application runs with libgpuos
    preloaded (TSan's runtime looks up its interceptors with dlsym before anything is
    initialised) and under `gpuos run`, with no sanitizer report."""
    (out,) = plain(build, env, prog, "5", LD_PRELOAD=str(build / "libgpuos.so"),
                   ASAN_OPTIONS="verify_asan_link_order=0")
    assert out["ok"]
    res = subprocess.run([*GPUOS, "run", "--", str(build / "tests" / prog), "5"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Sanitizer" not in res.stderr and prog_json(res.stdout)[0]["ok"]
    assert "tracking;" in res.stderr


def test_validation_never_touches_memory_of_a_destroyed_context(build, env):
    """A context destroyed with memory in it, a new one at the same handle: the map still
    lists the old memory, which the driver unmapped; hashing it would be an illegal
    address, and like a GPU the fake then fails every later call of the context."""
    res = subprocess.run([*GPUOS, "run", "--validate", "--", str(build / "tests" / "t_ctx_reuse")],
                         env=dict(env, FAKECUDA_STICKY_FAULTS="1"), capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split() == ["reused", "1", "ok"]  # the handle came back: the hazard is real


@pytest.fixture(scope="module")
def tsan_lib(build) -> Path:
    res = subprocess.run(["make", "-s", "-C", str(REPO / "libgpuos"), f"O={build}", "tsan"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return build / "tsan" / "libgpuos.so"


@pytest.mark.parametrize("prog, mode", [
    ("t_threads_tsan", "queued"), ("t_threads_tsan", "inline"), ("t_threads_tsan", "validate"),
    ("t_dlsym_tsan", "queued"),
])
def test_libgpuos_built_with_tsan_is_race_free(build, env, tsan_lib, prog, mode):
    """libgpuos itself built with ThreadSanitizer (its atomics visible to it), under a
    TSan-built program whose threads launch while the map changes: no report. (With
    worker_state and the queue list read plainly, as before, TSan reports both races.)"""
    extra = {"GPUOS_RECORD_INLINE": "1"} if mode == "inline" else {}
    res = subprocess.run([*GPUOS, "run", *(["--validate"] if mode == "validate" else []), "--",
                          str(build / "tests" / prog), "3"],
                         env=dict(env, GPUOS_LIBGPUOS=str(tsan_lib), **extra),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ThreadSanitizer" not in res.stderr, res.stderr[-4000:]
    assert prog_json(res.stdout)[0]["ok"]


NEWER_DRIVER = """
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
p, st = ctypes.c_void_p(), ctypes.c_int()
assert cuda.cuInit(0) == 0
assert cuda.cuGetProcAddress_v2(b"cuMemAlloc", ctypes.byref(p), 13000, ctypes.c_uint64(0),
                                ctypes.byref(st)) == 0 and p.value
"""


def test_an_entry_point_libgpuos_does_not_know_makes_tracking_incomplete(build, env, tmp_path):
    """A driver whose cuGetProcAddress answers a hooked name with a variant libgpuos does
    not hook (a newer driver): its calls would go unseen, so the record is incomplete,
    and the report, the summary, the log and the ring header say so."""
    script, report, log = tmp_path / "newer.py", tmp_path / "report.json", tmp_path / "log.jsonl"
    script.write_text(NEWER_DRIVER)
    res = subprocess.run([*GPUOS, "run", "--report", str(report), "--log", str(log), "--",
                          sys.executable, str(script)],
                         env=dict(env, FAKECUDA_NEW_VARIANT="cuMemAlloc"), capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    (proc,) = json.loads(report.read_text())["processes"]
    assert proc["state"] == "incomplete" and proc["incomplete"] == ["unknown-entry-point"]
    assert "tracking INCOMPLETE (unknown-entry-point)" in res.stderr
    records = list(read_log(log))[1:]  # after the header
    status = [r for r in records if r["type"] == "status"]
    assert [s["state"] for s in status] == ["incomplete"] and "cuMemAlloc" in status[0]["reason"]
    end = [r for r in records if r["type"] == "proc" and r.get("event") == "end"]
    assert end and end[-1]["state"] == "incomplete"


def test_a_complete_run_says_on(build, env, tmp_path):
    (out,), report, log = traced(build, env, tmp_path, "t_procaddr", "3")
    (proc,) = report["processes"]
    assert proc["state"] == "on" and proc["incomplete"] == []
    assert not [r for r in log if r["type"] == "status"]


@pytest.mark.parametrize("lib", ["plain", "tsan"])
def test_validation_held_too_long_is_skipped_not_waited_for(build, env, tmp_path, tsan_lib, lib):
    """Validation holds a lock from before an operation to after it has finished; an
    operation that waits for another thread's (a kernel spinning on a flag that thread's
    copy sets) would deadlock the two. Every operation here holds it 30 ms
    (GPUOS_TEST_VAL_HOLD_MS); the other threads wait 10 ms (GPUOS_VAL_WAIT_MS), then run
    theirs unvalidated ("busy"); a validation that such an operation overlapped is not
    trusted either (busy), so no miss is reported that the operation did not cause."""
    report = tmp_path / "report.json"
    extra = {"GPUOS_TEST_VAL_HOLD_MS": "30", "GPUOS_VAL_WAIT_MS": "10"}
    if lib == "tsan":
        extra["GPUOS_LIBGPUOS"] = str(tsan_lib)
    prog = "t_threads_tsan" if lib == "tsan" else "t_threads"
    res = subprocess.run([*GPUOS, "run", "--validate", "--report", str(report), "--",
                          str(build / "tests" / prog), "3"], env=dict(env, **extra),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ThreadSanitizer" not in res.stderr, res.stderr[-3000:]
    v = json.loads(report.read_text())["validation"]
    assert v["skipped"] > 0 and v["operations"] > 0 and v["with_misses"] == 0, v


def test_paused_from_the_start_tracks_allocations_and_records_no_operation(build, env, tmp_path):
    """`gpuos run --paused`: the benchmark's passive mode. Allocations are tracked, no
    launch or copy is recorded, the results are the plain run's."""
    (ref,) = plain(build, env, "t_direct", "9")
    report = tmp_path / "report.json"
    res = subprocess.run([*GPUOS, "run", "--paused", "--report", str(report), "--",
                          str(build / "tests" / "t_direct"), "9"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    (out,) = prog_json(res.stdout)
    assert out["ok"] and out["checksum"] == ref["checksum"]
    (proc,) = json.loads(report.read_text())["processes"]
    c = proc["counters"]
    # libgpuos counts VMM reservations and handles as allocations too
    assert proc["state"] == "on" and c["allocs"] == ref["allocs"] + ref["vmm_reserve"] + ref["vmm_create"]
    assert c["launches"] == c["copies"] == c["graph_launches"] == 0
    res = subprocess.run([*GPUOS, "run", "--paused", "--validate", "--", "true"], env=env,
                         capture_output=True, text=True)
    assert res.returncode == 2 and "validation cannot be paused" in res.stderr


@pytest.mark.parametrize("how", ["direct", "proc"])
def test_a_call_of_an_untracked_writer_makes_the_record_incomplete(build, env, tmp_path, how):
    """cuStreamBatchMemOp_v2 writes device memory and is not tracked: called directly or
    through cuGetProcAddress, it goes through libgpuos's trampoline to the driver (the
    values land) and the run says its record is incomplete."""
    report = tmp_path / "report.json"
    res = subprocess.run([*GPUOS, "run", "--report", str(report), "--",
                          str(build / "tests" / "t_unhooked"), *(["proc"] if how == "proc" else [])],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr
    (proc,) = json.loads(report.read_text())["processes"]
    assert proc["state"] == "incomplete" and proc["incomplete"] == ["unhooked-writer"]
    assert "tracking INCOMPLETE (unhooked-writer)" in res.stderr


def movable_run(build: Path, env: dict, tmp_path: Path, *gpuos_args: str, **extra_env: str):
    """t_movable under `gpuos run --log --report`: (its ALLOC lines, the report's process,
    the log's alloc records, stderr)."""
    log, report = tmp_path / "movable.jsonl", tmp_path / "movable.report.json"
    res = subprocess.run([*GPUOS, "run", "--log", str(log), "--report", str(report), *gpuos_args, "--",
                          str(build / "tests" / "t_movable")],
                         env={**env, **extra_env}, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.splitlines()[-1] == "ok", res.stdout + res.stderr
    allocs = [tuple(map(int, line.split()[1:])) for line in res.stdout.splitlines() if line.startswith("ALLOC")]
    (proc,) = json.loads(report.read_text())["processes"]
    records = [r for r in list(read_log(log))[1:] if r["type"] == "alloc"]
    return allocs, proc, records, res.stderr


def test_large_device_allocations_are_movable_and_behave_as_the_drivers(build, env, tmp_path):
    """Under `gpuos run` (movable memory by default) every cuMemAlloc of 2 MiB or more is
    served by libgpuos with the VMM API: the program's data survives host and
    device-to-device copies and memsets between movable and driver memory, address ranges
    contain the allocation, and the log marks exactly the large allocations movable."""
    allocs, proc, records, stderr = movable_run(build, env, tmp_path)
    assert proc["memory"] == "movable" and proc["counters"]["movable_fallbacks"] == 0
    assert "memory movable" in stderr
    by_base = {(r["base"], r["size"]): r for r in records}
    assert len(allocs) == 8 and all(a in by_base for a in allocs)
    for a in allocs:
        assert by_base[a].get("movable", False) == (a[1] >= 2 << 20), by_base[a]
        assert (by_base[a]["aux"] != 0) == (a[1] >= 2 << 20)  # the physical memory's handle
    frees = [r for r in list(read_log(tmp_path / "movable.jsonl"))[1:] if r["type"] == "free"]
    assert sorted((r["base"], r["size"]) for r in frees) == sorted(allocs)


def test_memory_driver_leaves_allocations_to_the_driver(build, env, tmp_path):
    allocs, proc, records, stderr = movable_run(build, env, tmp_path, "--memory", "driver")
    assert proc["memory"] == "driver" and not any(r.get("movable") for r in records)
    assert len(allocs) == 8 and "memory movable" not in stderr


def test_a_failed_vmm_step_gives_the_drivers_allocation(build, env, tmp_path):
    """cuMemCreate fails (the fake says out of memory): the program gets the driver's own
    allocation, runs as without gpuos, and the run counts and says the fallbacks."""
    allocs, proc, records, stderr = movable_run(build, env, tmp_path, FAKECUDA_VMM_CREATE_FAIL="1")
    assert not any(r.get("movable") for r in records)
    assert proc["counters"]["movable_fallbacks"] == 6  # three large allocations, twice
    assert "6 allocations left to the driver" in stderr


def test_validation_reads_movable_memory(build, env, tmp_path):
    """The validator fingerprints movable allocations like the driver's: every copy and
    memset of t_movable validated, none with a miss."""
    report = tmp_path / "v.json"
    res = subprocess.run([*GPUOS, "run", "--validate", "--report", str(report), "--",
                          str(build / "tests" / "t_movable")], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    v = json.loads(report.read_text())["validation"]
    assert v["operations"] >= 20 and v["with_misses"] == 0 and v["skipped"] == 0, v


def test_a_destroyed_context_frees_its_movable_memory(build, env, tmp_path):
    """cuCtxDestroy frees the driver's allocations of the context; movable memory is VMM
    memory, which outlives contexts, so libgpuos frees it then (without that, 8 MiB per
    round stayed allocated), and the context's entries leave the map (their FREE logged)."""
    log = tmp_path / "ctx.jsonl"
    res = subprocess.run([*GPUOS, "run", "-q", "--log", str(log), "--", str(build / "tests" / "t_movable"), "ctx"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr
    recs = list(read_log(log))[1:]
    allocs = [r for r in recs if r["type"] == "alloc" and r["kind"] == "device"]
    frees = [r for r in recs if r["type"] == "free" and r["kind"] == "device"]
    assert len(allocs) == 6 and sorted((r["base"], r["size"]) for r in frees) == sorted((r["base"], r["size"]) for r in allocs)
    assert sum(1 for r in allocs if r.get("movable")) == 3


@pytest.mark.parametrize("memory", ["movable", "driver"])
def test_cuda_ipc_of_movable_memory_fails_with_a_hint(build, env, memory):
    """CUDA IPC cannot share VMM memory (the driver refuses; the fake too): under movable
    memory the large allocation's handle fails, and libgpuos says once what to do; the
    driver's own memory still gives handles."""
    res = subprocess.run([*GPUOS, "run", "-q", "--memory", memory, "--", str(build / "tests" / "t_movable"), "ipc"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    big, small = (int(x.split("=")[1]) for x in res.stdout.split()[1:3])
    assert small == 0
    hint = "run the program with `gpuos run --memory driver`"
    if memory == "movable":
        assert big != 0 and res.stderr.count(hint) == 1
    else:
        assert big == 0 and hint not in res.stderr


def test_managed_ahead_without_gpuos_ko_runs_the_program_and_says_why(build, env, tmp_path):
    """`gpuos run --managed-ahead` on a host without gpuos.ko (this one): the program runs and
    ends as without the option, its launches that touch managed memory are still learnt from
    libgpuos's records, no address space is ever known, and the summary says why nothing
    was asked of the driver."""
    report = tmp_path / "report.json"
    res = subprocess.run([*GPUOS, "run", "--managed-ahead", "--report", str(report), "--",
                          str(build / "tests" / "t_direct")], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert prog_json(res.stdout)[0]["ok"] is True
    ahead = json.loads(report.read_text())["managed_ahead"]
    assert "gpuos" in ahead["why_not"], ahead
    (st,) = ahead["processes"].values()
    assert st["managed_launches"] >= 1 and st["launches"] > st["managed_launches"] and st["as_id"] is None
    assert st["steps"] == 0 and st["batches"] == 0
    assert f"managed memory ahead: off: {ahead['why_not']}" in res.stderr


def test_record_touched_without_uvm_tools_says_why_and_the_program_runs_unharmed(build, env, tmp_path):
    """`--record-touched` on a driver without UVM's tools interface (the fake): cuMemAlloc
    still gives managed memory (ALLOC records marked measured), every launch's parameters
    are logged for the learner, launches are skipped with one STATUS saying why, copies
    are not measured, and the program's own results check out."""
    if Path("/dev/nvidia-uvm-tools").exists():
        pytest.skip("this host has UVM's tools interface: the GPU test covers it")
    (out,), report, log = traced(build, env, tmp_path, "t_validate", "21",
                                 gpuos_args=("--record-touched",))
    assert out["ok"]
    v = report["validation"]
    assert v["touched"] and v["operations"] == 0 and v["skipped"] == len(out["ops"])
    status = [r for r in of_type(log, "status") if "validation unavailable" in r["reason"]]
    assert len(status) == 1 and "/dev/nvidia-uvm-tools" in status[0]["reason"]
    device = [r for r in of_type(log, "alloc") if r["kind"] == "device"]
    assert device and all(r.get("measured") for r in device)
    launches = [r for r in of_type(log, "launch") if "layout-unknown" not in r["flags"]]
    assert launches and {r["seq"] for r in of_type(log, "params")} == {r["seq"] for r in launches}
    reasons = {r["skip_reason"] for r in of_type(log, "validate")}
    assert reasons == {"error", "not-measured"}
    assert not of_type(log, "touched")


def test_record_touched_needs_a_log(build, env, tmp_path):
    res = subprocess.run([*GPUOS, "run", "--record-touched", "--", str(build / "tests" / "t_validate"), "1"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--log" in res.stderr
