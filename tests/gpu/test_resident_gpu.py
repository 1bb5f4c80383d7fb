"""GPU memory oversubscription on a real GPU (`gpuos run --gpu-memory`, libgpuos/src/resident.c).

A workload of the suite (two training, one inference) runs once as it is, which gives its checksum and the most memory
PyTorch's allocator reserved.  Then it runs under a limit of two thirds of that (150%
oversubscription): its memory is evicted to pinned host memory and brought back before
the launches that touch it, once evicting by the learned call sequence and once least
recently used.  The checksum must be the same, bit for bit, and never more than the limit
may have been resident.  (PyTorch's caching allocator places a step's activations
differently from one step to the next, so a training step's sequence of allocations need
not repeat exactly: measured on gpt-train, 35% of its calls differ one step apart.)  The
scheduler's figures (polled with `gpuos mem stats` while it runs) and both runs' times
are printed (pytest -s) and appended to $GPUOS_RESIDENT_RESULTS if set.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict

import pytest
from gpu_needs import torch_gpu_marks

from gpuos.errors import GpuosError
from gpuos.movable.share import group_path, read_group
from gpuos.workloads.run import last_json_object, private_caches, run, run_polling_mem_stats, suite_cmd, under_gpuos


WORKLOADS = {
    "gpt-train": ["--layers", "8", "--seq", "512", "--steps", "12", "--warmup", "2"],
    "resnet50-train": ["--batch", "32", "--steps", "12", "--warmup", "2"],
    # a sequence that repeats exactly: its period is learned, so copies ahead run
    "gpt-infer": ["--layers", "24", "--seq", "1024", "--steps", "12", "--warmup", "2"],
}
FRACTION = 2 / 3  # the limit against the plain run's peak: 150% oversubscription


pytestmark = torch_gpu_marks()


def record(line: dict) -> None:
    print(json.dumps(line))
    path = os.environ.get("GPUOS_RESIDENT_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_oversubscribed_workload_is_bit_identical(workload, tmp_path):
    env = dict(os.environ, **private_caches(tmp_path / "caches"))
    plain = run(suite_cmd(workload, WORKLOADS[workload]), timeout=900, env=env)
    assert plain.returncode == 0, plain.stderr[-2000:]
    ref = last_json_object(plain.stdout)
    peak = int(ref["peak_gib"] * 2**30)  # torch's max_memory_reserved
    limit = int(peak * FRACTION)

    for evict in ("future", "lru"):
        limited, last = run_polling_mem_stats(
            under_gpuos(suite_cmd(workload, WORKLOADS[workload]), "-q", "--gpu-memory", str(limit), "--evict", evict),
            timeout=900, env=env)
        assert limited.returncode == 0, limited.describe()
        got = last_json_object(limited.stdout)
        assert last is not None, "never reached the application's agent"
        record({"workload": workload, "evict": evict, "peak_reserved": peak, "limit": limit,
                "plain_s": ref["seconds"], "limited_s": got["seconds"],
                "checksum_equal": got["checksum"] == ref["checksum"], "stats": asdict(last)})
        assert got["checksum"] == ref["checksum"]
        assert last.limit == limit and last.resident_bytes <= limit
        assert last.evictions > 0 and last.swap_ins > 0 and last.over_limit == 0
        if evict == "lru":
            assert last.period == 0 and last.evictions_future == 0


def test_a_group_of_processes_shares_one_pool_bit_identically(tmp_path):
    """The three workloads at once in one `--share` group whose pool is two thirds of the
    sum of their peaks: they take turns on the GPU (those whose working sets fit together,
    together), those whose turn it is make the others evict, and every checksum equals its
    plain run's.  The group's own figures (switches, admissions beside a holder) are
    recorded."""
    env = dict(os.environ, **private_caches(tmp_path / "caches"))
    refs, peaks = {}, 0
    for w, args in WORKLOADS.items():
        plain = run(suite_cmd(w, args), timeout=900, env=env)
        assert plain.returncode == 0, plain.stderr[-2000:]
        refs[w] = last_json_object(plain.stdout)
        peaks += int(refs[w]["peak_gib"] * 2**30)
    limit = int(peaks * FRACTION)
    group = f"gpu-test-{os.getpid()}"
    got: dict = {}

    def member(w: str) -> None:
        got[w] = run_polling_mem_stats(under_gpuos(suite_cmd(w, WORKLOADS[w]), "-q", "--share", group,
                                                   "--gpu-memory", str(limit), "--slice", "500"),
                                       timeout=900, env=env)

    seen: dict = {}
    done = threading.Event()

    def watch() -> None:  # the group's own figures (switches, admissions), while it has members
        while not done.is_set():
            try:
                seen["group"] = asdict(read_group(group))
            except GpuosError:
                pass
            time.sleep(0.2)

    threads = [threading.Thread(target=member, args=(w,)) for w in WORKLOADS]
    watcher = threading.Thread(target=watch)
    try:
        watcher.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        done.set()
        watcher.join()
        group_path(group).unlink(missing_ok=True)
    record({"group": group, "group_stats": seen.get("group")})
    for w, (fin, last) in got.items():
        assert fin.returncode == 0, fin.describe()
        res = last_json_object(fin.stdout)
        record({"group": group, "workload": w, "limit": limit, "plain_s": refs[w]["seconds"],
                "shared_s": res["seconds"], "checksum_equal": res["checksum"] == refs[w]["checksum"],
                "stats": asdict(last) if last else None})
        assert res["checksum"] == refs[w]["checksum"]
        assert last is not None and last.limit == limit and last.over_limit == 0
