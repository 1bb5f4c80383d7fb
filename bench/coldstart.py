#!/usr/bin/env python3
"""Cold start against restore: the time from a command to an inference server's first
correct answer, and what the chunk store keeps.

For each model (gpuos.workloads.serve: `gpt2-large` 774M parameters, `resnet50`,
`big-NN` about NN GiB of weights), in the same run:

  cold start    `python -m gpuos.workloads.serve` from exec to its first answer (imports,
                building the model, the first forward); its second answer's own time is
                the request time of a process that never stopped, and its answer the
                reference
  restore       the server, started under `gpuos run` and having answered once, is
                checkpointed (`gpuos checkpoint`, which ends it); then `gpuos restore`
                with a request already waiting, timed until the answer: stop-the-world
                (`--eager`: the process goes on once all its GPU memory is back), on
                demand (the default: it goes on at once, each launch waiting for what it
                touches), on demand without the prefill (`--no-prefill`: all GPU memory
                streamed through the process after CRIU, the baseline of the prefill,
                which puts it on the GPU while CRIU restores), and on demand with host
                memory too (`--host-memory lazy`); with the store in the page cache
                (warm), in the hot tier (`gpuos images warm`), and out of memory (`gpuos
                images cool`: cold)

Reported per restore: time to the first answer from the start of `gpuos restore`, the
restore overhead (that minus the request's own time), gpuos's phases and the command's time
outside them, the bytes the restore read (logical, and from the disk), and whether the
answer is the reference's.  Per model, the disk's read rate measured on the image's own
chunk files out of the page cache, and so the cold floor: the bytes a cold restore read
from the disk at that rate.
Per model: image size; scale-out (`--scale 1,2,4,8`): `gpuos restore --replicas N` of
the image, timed until all N replicas answered a waiting request correctly; and with
`--replicas N`, N servers of the same model each checkpointed into the same store: the
store's bytes against one image's.

    python3 bench/coldstart.py [--models gpt2-large,resnet50] [--replicas 4] [--scale 1,2,4,8]
                               [--cases eager-warm,on-demand-warm,...] [--home /var/tmp]

Writes bench/results/coldstart-<gpu>-<date>.json after every model, prints a Markdown table.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cr_baseline import open_bench

from gpuos.store import ImageStore
from gpuos.workloads.run import served, start_served, wait_file

GPUOS = [sys.executable, "-m", "gpuos.cli"]
CASES = [("eager", "warm"), ("on-demand", "warm"), ("no-prefill", "warm"), ("lazy-host", "warm"), ("on-demand", "hot"),
         ("eager", "cold"), ("on-demand", "cold"), ("no-prefill", "cold"), ("lazy-host", "cold")]
MODE_ARGS = {"eager": ["--eager"], "on-demand": [], "no-prefill": ["--no-prefill"],
             "lazy-host": ["--host-memory", "lazy"]}
SERVE = [sys.executable, "-m", "gpuos.workloads.serve"]
READY_TIMEOUT = 900.0


def request(d: Path, n: int) -> None:
    (d / f"req-{n}").write_text("")


def answer(d: Path, n: int) -> dict:
    return json.loads((d / f"resp-{n}").read_text())


def kill(pid: int) -> None:
    """Kill a restored server and reap it: the bench is a subreaper (main), so restored
    processes, which CRIU detaches, end up its children; else a pid 1 that does not reap
    (a container's) would keep the pid that the next restore needs."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    try:
        os.waitpid(pid, 0)
        return
    except ChildProcessError:
        pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return
        time.sleep(0.01)


def cli(env: dict, *args: str, timeout: float = 900) -> dict:
    res = subprocess.run([*GPUOS, *args, "--json"], env=env, capture_output=True, text=True, timeout=timeout)
    try:
        out = json.loads(res.stdout)
    except ValueError:
        raise RuntimeError(f"gpuos {' '.join(args)}: {res.stderr[-2000:]}") from None
    if not out.get("ok"):
        raise RuntimeError(f"gpuos {' '.join(args)}: {out.get('message')}")
    return out


def cold_start(model: str, work: Path) -> dict:
    d = work / f"cold-{model}"
    d.mkdir()
    request(d, 0)
    t0 = time.time()
    proc = subprocess.Popen([*SERVE, "--model", model, "--requests", str(d)], stdin=subprocess.DEVNULL)
    try:
        wait_file(d / "resp-0", READY_TIMEOUT, proc)
        first = answer(d, 0)
        request(d, 1)
        wait_file(d / "resp-1", 120, proc)
        second = answer(d, 1)
    finally:
        proc.kill()
        proc.wait()
    return {"first_answer_s": first["answered"] - t0, "ready_s": (d / "ready").stat().st_mtime - t0,
            "request_s": second["answered"] - second["seen"], "reference": second["output"],
            "first_output": first["output"]}


def timed_restore(env: dict, image: str, d: Path, n: int, reference: str, request_s: float,
                  mode: str) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for stale in d.glob(f"resp-{n}*"):
        stale.unlink()
    request(d, n)
    t0 = time.time()
    res = cli(env, "restore", image, *MODE_ARGS[mode])
    after_restore = time.time()
    wait_file(d / f"resp-{n}", 120)
    got = answer(d, n)
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    kill(res["pid"])
    first = got["answered"] - t0
    timings = res.get("timings", {})
    return {"first_answer_s": first, "overhead_s": first - request_s, "restore_cmd_s": after_restore - t0,
            "outside_phases_s": after_restore - t0 - sum(timings.values()),
            "timings": timings, "fills": res.get("fills", {}), "criu_marks": res.get("criu_marks", {}),
            "criu_gaps": res.get("criu_gaps", []),
            "host_memory": res.get("host_memory", {}),
            "correct": got["output"] == reference,
            "disk_read_bytes": (used.ru_inblock - before.ru_inblock) * 512}


def disk_rate(store_root: Path, image: str, threads: int = 8) -> dict:
    """The disk's read rate: the image's chunk files, dropped from the page cache, read by
    `threads` readers as a restore's are (the cold floor of a restore is its disk bytes at
    this rate)."""
    chunks = ImageStore(store_root).chunks()
    paths = [p for cid in ImageStore.load(store_root / image).chunk_set() if (p := chunks.stored(cid))]

    def drop(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def read(path: Path) -> int:
        n = 0
        with open(path, "rb", buffering=0) as f:
            while block := f.read(8 << 20):
                n += len(block)
        return n

    for path in paths:
        drop(path)
    t0 = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, paths))
    seconds = time.monotonic() - t0  # and the image is in the page cache, as the first (warm) case needs
    return {"bytes": total, "seconds": seconds, "bytes_per_s": total / seconds, "threads": threads}


def scale_out(env: dict, image: str, d: Path, n: int, reference: str, mode: str = "on-demand") -> dict:
    """`gpuos restore --replicas n` (warm store, `mode`) with a request waiting: the time
    until every replica answered it (each appends its answer to d/answers)."""
    request(d, 1)
    t0 = time.time()
    print(f"{image}: {n} replicas ({mode})", flush=True)
    try:
        res = cli(env, "restore", image, "--replicas", str(n), *MODE_ARGS[mode])
    except RuntimeError as exc:  # e.g. not enough GPU memory for n copies: refused, said
        (d / "req-1").unlink()
        return {"n": n, "error": str(exc)[-500:]}
    after_restore = time.time()
    try:
        deadline = time.monotonic() + 300
        while True:
            got = [a for a in map(json.loads, (d / "answers").read_text().splitlines())
                   if a["request"] == 1 and a["answered"] >= t0]
            if len(got) >= n or time.monotonic() > deadline:
                break
            time.sleep(0.002)
    finally:
        for r in res["replicas"]:
            kill(r["init"])  # a replica's pid 1: the whole replica ends with it
        (d / "req-1").unlink()
    out = {"n": n, "mode": mode, "answered": len(got), "restore_cmd_s": after_restore - t0,
           "first_answer_s": min(a["answered"] for a in got) - t0 if got else None,
           "all_answered_s": max(a["answered"] for a in got) - t0 if len(got) == n else None,
           "distinct_replicas": len({a["token"] for a in got}),
           "correct": len(got) == n and all(a["output"] == reference for a in got),
           "timings": res.get("timings", {})}
    print(f"{image}: {n} replicas: all answered after {out['all_answered_s']} s, correct={out['correct']}, "
          f"phases {json.dumps(out['timings'])}", flush=True)
    return out


def run_model(model: str, home: Path, replicas: int, scale: list[int], cases: list[tuple[str, str]],
              repeat: int = 1, scale_modes: tuple[str, ...] = ("on-demand",)) -> dict:
    work = home / "work"
    work.mkdir(exist_ok=True)
    env = dict(os.environ, GPUOS_HOME=str(home), GPUOS_HOT=str(home / "hot-tier"))
    env.pop("GPUOS_STORE", None)
    row: dict = {"model": model}
    print(f"{model}: cold start", flush=True)
    cold = cold_start(model, work)
    row["cold_start"] = cold
    print(f"{model}: {cold['first_answer_s']:.2f} s to the first answer from exec", flush=True)

    d = work / f"served-{model}"
    proc = start_served(model, d, env)
    pid = served(proc, d, READY_TIMEOUT)
    ck = cli(env, "checkpoint", str(pid), "--image", f"cs-{model}")
    proc.wait()
    image = f"cs-{model}"
    listing = cli(env, "images", "list")
    me = next(i for i in listing["images"] if i["name"] == image)
    row["checkpoint"] = {"timings": ck.get("timings", {}), "image_bytes": me["size"],
                         "stored_bytes": listing["chunk_bytes"]}
    print(f"{model}: image {me['size'] / 1e9:.2f} GB, checkpoint phases {json.dumps(row['checkpoint']['timings'])}",
          flush=True)
    row["disk"] = disk_rate(home / "images", image)
    print(f"{model}: disk reads the image at {row['disk']['bytes_per_s'] / 1e9:.2f} GB/s", flush=True)
    # Every restore answers the request the cold-started server answered second (its
    # reference): request 1, dropped in before each restore and removed after.
    runs: dict[str, list[dict]] = {}
    for mode, cache in [c for _ in range(repeat) for c in cases]:  # interleaved: A B A B ...
        case = f"{mode} {cache}"
        if cache == "hot":
            cli(env, "images", "warm", image)
        if cache == "cold":
            cli(env, "images", "cool", image)
        print(f"{model}: restore ({case})", flush=True)
        one = timed_restore(env, image, d, 1, cold["reference"], cold["request_s"], mode)
        (d / "req-1").unlink()
        one["read_bytes"] = me["size"]  # everything is read before the command returns
        one["disk_floor_s"] = one["disk_read_bytes"] / row["disk"]["bytes_per_s"]
        runs.setdefault(case, []).append(one)
        print(f"{model}: {case}: {one['first_answer_s']:.2f} s, correct={one['correct']}, "
              f"phases {json.dumps(one['timings'])}, fill {json.dumps(one['fills'])}", flush=True)
        if cache == "hot":
            cli(env, "images", "cool", image)
    # each case: its median run (by time to the first answer), with every run's time and correctness
    row["restore"] = {case: {**sorted(rs, key=lambda r: r["first_answer_s"])[(len(rs) - 1) // 2],
                             "runs_first_answer_s": [r["first_answer_s"] for r in rs],
                             "correct": all(r["correct"] for r in rs)} for case, rs in runs.items()}
    if scale:
        row["scale_out"] = [scale_out(env, image, d, n, cold["reference"], m) for n in scale for m in scale_modes]
    cli(env, "images", "cool", image)

    if replicas > 1:
        print(f"{model}: {replicas} replicas", flush=True)
        procs = []
        try:
            for k in range(replicas):
                procs.append(start_served(model, work / f"replica-{model}-{k}", env))
            for k, p in enumerate(procs):
                pid = served(p, work / f"replica-{model}-{k}", READY_TIMEOUT)
                cli(env, "checkpoint", str(pid), "--image", f"cs-{model}-r{k}")
                p.wait()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        listing = cli(env, "images", "list")
        mine = [i for i in listing["images"] if i["name"].startswith(f"cs-{model}-r")]
        cli(env, "images", "rm", image)  # then the store holds the replicas' chunks only
        stored = cli(env, "images", "list")["chunk_bytes"]
        own_by_kind = own_bytes_by_kind(home / "images", [i["name"] for i in mine])
        row["replicas"] = {"n": replicas, "image_bytes": [i["size"] for i in mine],
                           "own_bytes": [i["own_bytes"] for i in mine],
                           "shared_bytes": [i["shared_bytes"] for i in mine],
                           "store_bytes": stored, "ratio_to_one": stored / min(i["size"] for i in mine),
                           # the figure: the store holding N images against it holding one
                           "ratio_to_one_stored": stored / row["checkpoint"]["stored_bytes"],
                           "own_bytes_by_kind": own_by_kind}
        for i in mine:
            cli(env, "images", "rm", i["name"])
    else:
        cli(env, "images", "rm", image)
    shutil.rmtree(work, ignore_errors=True)
    return row


def kind_of(path: str) -> str:
    if path.startswith("gpu-memory-"):
        return "gpu memory"
    if path.startswith("criu/pages-"):
        return "host memory (CRIU pages)"
    return "other"


def own_bytes_by_kind(store_root: Path, names: list[str]) -> list[dict[str, int]]:
    """Per image, the bytes of chunks no other of `names` has, by what they hold: where
    replicas differ."""
    manifests = {n: ImageStore.load(store_root / n) for n in names}
    sets = {n: set(m.chunk_set()) for n, m in manifests.items()}
    out = []
    for n, m in manifests.items():
        others = set().union(*(sets[o] for o in names if o != n))
        kinds: dict[str, int] = {}
        seen: set[str] = set()
        for f in m.files:
            for c in f.chunks:
                if c.id not in others and c.id not in seen:
                    seen.add(c.id)
                    kinds[kind_of(f.path)] = kinds.get(kind_of(f.path), 0) + c.size
        out.append(kinds)
    return out


def markdown(results: list[dict]) -> str:
    """One row per model: seconds from the command to the first correct answer."""
    lines = ["| model | image | cold start | on demand, warm | on demand without prefill, warm "
             "| stop-the-world, warm | on demand + lazy host memory, warm | on demand, hot tier "
             "| on demand, cold | on demand without prefill, cold | stop-the-world, cold "
             "| on demand + lazy host memory, cold "
             "| restore overhead (best warm) | read from disk by the restore (on demand, cold) "
             "| disk rate: that read alone | answers identical "
             "| N replicas' store / one image's store |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for result in results:
        for r in result["rows"]:
            x = r["restore"]
            rep = r.get("replicas")
            cell = lambda k: f"{x[k]['first_answer_s']:.2f} s" if k in x else "-"  # noqa: E731
            lines.append(
                f"| {r['model']} ({result['device'].replace('NVIDIA ', '')}) | {r['checkpoint']['image_bytes'] / 1e9:.1f} GB "
                f"| {r['cold_start']['first_answer_s']:.1f} s | {cell('on-demand warm')} | {cell('no-prefill warm')} "
                f"| {cell('eager warm')} | {cell('lazy-host warm')} | {cell('on-demand hot')} | {cell('on-demand cold')} "
                f"| {cell('no-prefill cold')} | {cell('eager cold')} | {cell('lazy-host cold')} "
                f"| {min((v['overhead_s'] for k, v in x.items() if k.endswith('warm')), default=float('nan')):.2f} s "
                + (f"| {x['on-demand cold']['disk_read_bytes'] / 1e9:.2f} GB "
                   if 'on-demand cold' in x else "| - ")
                + (f"| {r['disk']['bytes_per_s'] / 1e9:.2f} GB/s: {x['on-demand cold']['disk_floor_s']:.2f} s "
                   if "disk" in r and 'on-demand cold' in x else "| - ")
                + f"| {all(v['correct'] for v in x.values())} | "
                + (f"{rep['ratio_to_one_stored']:.2f} (N = {rep['n']})" if rep else "-") + " |")
    return "\n".join(lines)


def scale_markdown(results: list[dict]) -> str:
    """Scale-out: seconds from `gpuos restore --replicas N` to every replica's first correct
    answer, and that per replica."""
    lines = ["| model | mode | N | all N answered | first answer | restore command | per replica | vs N = 1 | answers identical |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for result in results:
        for r in result["rows"]:
            for x in r.get("scale_out", []):
                mode = x.get("mode", "on-demand")
                base = next((y["all_answered_s"] for y in r["scale_out"] if y["n"] == 1 and y.get("all_answered_s")
                             and y.get("mode", "on-demand") == mode), None)
                name = f"{r['model']} ({result['device'].replace('NVIDIA ', '')})"
                if x.get("all_answered_s") is None:
                    lines.append(f"| {name} | {mode} | {x['n']} | - | - | - | - | - "
                                 f"| {x.get('error', 'not all answered')[:80]} |")
                    continue
                rel = f"{x['all_answered_s'] / base:.2f}x" if base else "-"
                lines.append(f"| {name} | {mode} | {x['n']} | {x['all_answered_s']:.2f} s | {x['first_answer_s']:.2f} s "
                             f"| {x['restore_cmd_s']:.2f} s | {x['all_answered_s'] / x['n']:.2f} s "
                             f"| {rel} | {x['correct']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt2-large,resnet50")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--scale", default="1,2,4,8",
                    help="Replica counts for `gpuos restore --replicas N` (empty: none)")
    ap.add_argument("--cases", default=",".join(f"{m}-{c}" for m, c in CASES),
                    help="Restores to time, MODE-CACHE each (modes: " + ", ".join(MODE_ARGS)
                    + "; caches: warm, hot, cold) [all]")
    ap.add_argument("--repeat", type=int, default=1,
                    help="Runs of each case, interleaved; the table shows each case's median [1]")
    ap.add_argument("--scale-modes", default="on-demand",
                    help="Modes of the scale-out restores (e.g. on-demand,no-prefill) [on-demand]")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--home", default="/var/tmp", help="Where the store goes: a disk, not a tmpfs")
    args = ap.parse_args()
    scale = [int(x) for x in args.scale.split(",") if x]
    cases = [tuple(c.rsplit("-", 1)) for c in args.cases.split(",") if c]
    if any(m not in MODE_ARGS for m in args.scale_modes.split(",")):
        ap.error(f"--scale-modes: one of {', '.join(MODE_ARGS)} each")
    bad = [c for c in cases if len(c) != 2 or c[0] not in MODE_ARGS or c[1] not in ("warm", "hot", "cold")]
    if bad:
        ap.error(f"--cases: unknown {', '.join('-'.join(c) for c in bad)}")
    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    _, home, result = open_bench("coldstart", args.home)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    tag = result["device"].replace("NVIDIA ", "").replace(" ", "_")
    path = outdir / f"coldstart-{tag}-{result['date'][:10]}.json"
    try:
        for model in args.models.split(","):
            result["rows"].append(run_model(model, home, args.replicas, scale, cases, args.repeat,
                                            tuple(args.scale_modes.split(","))))
            path.write_text(json.dumps(result, indent=2) + "\n")
            print(f"{model} done; wrote {path}", flush=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print(markdown([result]))
    print(scale_markdown([result]))


if __name__ == "__main__":
    main()
