"""GPU memory oversubscription on a real GPU (`gpuos run --gpu-memory`, libgpuos/src/resident.c).

A workload of the suite runs once as it is, which gives its checksum and the most memory
PyTorch's allocator reserved; then under a limit of two thirds of that (150%
oversubscription), its memory evicted to pinned host memory and brought back before the
launches that touch it.  The checksum must be the same, bit for bit, and never more
than the limit may have been resident.  The scheduler's figures (polled with `gpuos mem
stats` while it runs) and both runs' times are printed (pytest -s) and appended to
$GPUOS_RESIDENT_RESULTS if set.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from gpu_needs import torch_gpu_marks

from gpuos.movable import Agent, AgentError, agent_available
from gpuos.workloads.run import last_json_object, private_caches, run, suite_cmd, under_gpuos


WORKLOADS = {
    "gpt-train": ["--layers", "8", "--seq", "512", "--steps", "12", "--warmup", "2"],
    "resnet50-train": ["--batch", "32", "--steps", "12", "--warmup", "2"],
}
FRACTION = 2 / 3  # the limit against the plain run's peak: 150% oversubscription


pytestmark = torch_gpu_marks()


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def record(line: dict) -> None:
    print(json.dumps(line))
    path = os.environ.get("GPUOS_RESIDENT_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_oversubscribed_training_is_bit_identical(workload, tmp_path):
    env = dict(os.environ, **private_caches(tmp_path / "caches"))
    plain = run(suite_cmd(workload, WORKLOADS[workload]), timeout=900, env=env)
    assert plain.returncode == 0, plain.stderr[-2000:]
    ref = last_json_object(plain.stdout)
    peak = int(ref["peak_gib"] * 2**30)  # torch's max_memory_reserved
    limit = int(peak * FRACTION)

    proc = subprocess.Popen(under_gpuos(suite_cmd(workload, WORKLOADS[workload]), "-q", "--gpu-memory", str(limit)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    last = None
    app = None
    while proc.poll() is None:  # the figures, until the application ends
        time.sleep(0.2)
        app = app or next((c for c in children(proc.pid) if agent_available(c)), None)
        if app is None:
            continue
        try:
            with Agent(app, timeout=10) as agent:
                last = agent.mem_stats()
        except AgentError:
            pass
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    got = last_json_object(out)
    assert last is not None, "never reached the application's agent"
    record({"workload": workload, "peak_reserved": peak, "limit": limit, "plain_s": ref["seconds"],
            "limited_s": got["seconds"], "checksum_equal": got["checksum"] == ref["checksum"],
            "stats": asdict(last)})
    assert got["checksum"] == ref["checksum"]
    assert last.limit == limit and last.resident_bytes <= limit
    assert last.evictions > 0 and last.swap_ins > 0 and last.over_limit == 0
