"""`gpuos run`: run a command with libgpuos, the in-process CUDA interception library."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import click

from ..intercept.runner import RunOptions, RunResult, Supervisor
from ..movable.share import check_name, group_limit
from .output import human_bytes, parse_size, table


def _summary(res: RunResult) -> list[str]:
    lines = []
    if not res.processes:
        lines.append("no process made a CUDA driver call: nothing was tracked")
    for p in res.processes:
        c = p.counters
        state = {"on": "tracking", "incomplete": f"tracking INCOMPLETE ({', '.join(p.incomplete)})"
                 }.get(p.state, f"tracking OFF ({p.reason})")
        lines.append(f"pid {p.pid} {Path(p.exe).name}: {state}; {c['launches']} launches, "
                     f"{c['copies']} copies, {c['allocs']} allocations, "
                     f"{c['graph_launches']} graph launches"
                     + (f", {c['unknown_layout']} launches without a parameter layout"
                        if c["unknown_layout"] else "")
                     + (f", {c['records_lost']} records lost" if c["records_lost"] else "")
                     + (f"; memory {p.memory}" if p.memory != "driver" else "")
                     + (f" ({c['movable_fallbacks']} allocations left to the driver: a VMM step "
                        "failed)" if c.get("movable_fallbacks") else ""))
    v = res.validation
    if v is not None:
        did, didnt = ("touched", "untouched") if v.touched else ("written", "unchanged")
        lines.append(f"validation: {v.operations} operations validated, {v.skipped} skipped, "
                     f"{v.with_misses} with misses ({human_bytes(v.missed_bytes)} {did} "
                     f"unpredicted); predicted {human_bytes(v.predicted_bytes)}, of which "
                     f"{human_bytes(v.overpredicted_bytes)} {didnt}")
        missed = [k for k in v.kernels.values() if k.with_misses]
        if missed:
            lines.append(table(["KERNEL WITH MISSES", "VALIDATED", "WITH MISSES", "MISSED"],
                               [[k.name[:80], k.validated, k.with_misses, human_bytes(k.missed_bytes)]
                                for k in sorted(missed, key=lambda k: -k.missed_bytes)]))
    if res.managed_ahead is not None:
        a = res.managed_ahead
        if a["why_not"]:
            lines.append(f"managed memory ahead: off: {a['why_not']}")
        for pid, st in a["processes"].items():
            lines.append(f"managed memory ahead, pid {pid}: {st['managed_launches']} of {st['launches']} launches "
                         f"touched managed memory; period {st['period'] or 'none (the last launch)'}; "
                         + (f"address space {st['as_id']:#x}: {st['steps']} steps, "
                            f"{human_bytes(st['bytes_migrated'])} asked to move in {st['batches']} batches, "
                            f"{st['ranges_hinted']} ranges hinted evict-first, {st['dropped']} steps dropped"
                            if st["as_id"] is not None else "its address space never showed in a fault event")
                         + (f"; {'; '.join(st['errors'])}" if st["errors"] else ""))
    if res.log_lost:
        lines.append(f"launch log: {res.log_records} records written, {res.log_lost} ring slots "
                     "lost (the ring lapped the reader; raise --ring-slots)")
    return lines


def _size(text: str | None) -> int | None:
    """--gpu-memory: at least 1 MiB; None stays None."""
    if text is None:
        return None
    size = parse_size(text)
    if size is None or size < 1 << 20:
        raise click.BadParameter(f"{text!r} is not a size of at least 1M, such as 512M or 12G",
                                 param_hint="--gpu-memory")
    return size


def _group_limit(name: str, gpu_memory: int | None) -> int:
    """The pool of group `name`: the group's if it has members (--gpu-memory, if given, must
    agree), else --gpu-memory (a new group needs one)."""
    try:
        check_name(name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--share") from None
    limit = group_limit(name)
    if limit is None:
        if not gpu_memory:
            raise click.BadParameter(f"group {name!r} has no members: the first one needs --gpu-memory LIMIT",
                                     param_hint="--share")
        return gpu_memory
    if gpu_memory and gpu_memory != limit:
        raise click.BadParameter(f"group {name!r} shares {human_bytes(limit)} ({limit} bytes); give that "
                                 "or leave --gpu-memory out", param_hint="--gpu-memory")
    return limit


def _check_cpu_list(text: str) -> None:
    """A CPU list as the kernel writes them (12, 12-13,15), of CPUs this machine has."""
    ncpu = os.cpu_count() or 1
    for part in text.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m or int(m[2] or m[1]) < int(m[1]):
            raise click.BadParameter(f"{text!r} is not a CPU list such as 12 or 12-13,15",
                                     param_hint="--record-cpus")
        if int(m[2] or m[1]) >= ncpu:
            raise click.BadParameter(f"CPU {m[2] or m[1]}: this machine has CPUs 0-{ncpu - 1}",
                                     param_hint="--record-cpus")


@click.command("run", context_settings={"ignore_unknown_options": True,
                                        "allow_interspersed_args": False})
@click.option("--log", "log", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Write every allocation, launch, copy and validation outcome of the command's "
                   "processes to FILE as JSON lines (gzip if FILE ends in .gz); format in "
                   "docs/interception.md.")
@click.option("--validate", is_flag=True,
              help="Prove the buffer predictions: fingerprint all GPU memory on the GPU before and "
                   "after every operation and report buffers changed but not predicted (misses). "
                   "Serializes the command's GPU work: slow.")
@click.option("--record-touched", "touched", is_flag=True,
              help="With --log: measure what every kernel launch touches, read or written, and log it "
                   "(a `touched` record per launch): cuMemAlloc gives managed memory, moved to host "
                   "memory before each launch so that each page the launch touches faults, and the "
                   "faults are read from the driver's UVM tools interface. Ground truth for `gpuos mem "
                   "extents learn`. Implies --validate (its misses are touched bytes not predicted) and "
                   "--memory driver. Much slower; for a run whose memory fits on the GPU.")
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Write the run's report (processes, counters, validation) to FILE as JSON.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as JSON on stdout when the command has ended.")
@click.option("--touch-all", multiple=True, metavar="SUBSTRING",
              help="Treat kernels whose name contains SUBSTRING as touching every buffer (the "
                   "fallback for a kernel that validation shows writing through pointers kept in "
                   "GPU memory). Repeatable.")
@click.option("--dump-params", multiple=True, metavar="SUBSTRING",
              help="With --log: also write the raw parameter bytes of every launch of a kernel whose "
                   "name contains SUBSTRING (a `params` record), to study why its buffers were "
                   "mispredicted. Repeatable.")
@click.option("--ring-slots", type=click.IntRange(1024, 1 << 24), metavar="N",
              help="Ring size in 64-byte slots, a power of two [default: 1048576 = 64 MiB with --log "
                   "or --validate, else 65536 = 4 MiB].")
@click.option("--record-cpus", metavar="LIST",
              help="CPUs libgpuos's recording thread may run on, e.g. 12 or 12-13,15: a "
                   "housekeeping CPU away from the application's [default: the application's].")
@click.option("--paused", is_flag=True,
              help="Start with the recording of operations paused (launches, copies, memsets, "
                   "graph launches: allocations and objects are still tracked), as `gpuos trace "
                   "pause` would; `gpuos trace resume PID` starts it.")
@click.option("--memory", type=click.Choice(["movable", "driver"]), default="movable", show_default=True,
              help="movable: device allocations of 2 MiB and more are made by gpuos with the "
                   "driver's virtual-memory API, at addresses that stay, so that gpuos can move "
                   "them (checkpoint while running); driver: the driver's own, for programs "
                   "that share device memory through CUDA IPC.")
@click.option("--gpu-memory", "gpu_memory", metavar="LIMIT", callback=lambda c, p, v: _size(v),
              help="Oversubscribe GPU memory: at most LIMIT bytes (e.g. 12G, 512M) of the "
                   "application's movable memory are on the GPU at once, the rest in pinned host "
                   "memory; before each launch, copy or memset, what it will touch (predicted from "
                   "its arguments) is made resident, evicting what is needed farthest ahead (--evict). "
                   "Pointers never change. `gpuos mem stats PID` shows what moved. Needs --memory "
                   "movable; such a process cannot be checkpointed yet.")
@click.option("--evict", type=click.Choice(["future", "lru"]), default="future", show_default=True,
              help="With --gpu-memory, what to evict: future: the allocation whose next use is "
                   "farthest, from the call sequence learned as it repeats (training steps, decode "
                   "loops), least recently used until one is learned; lru: least recently used "
                   "always (the baseline the benchmark compares with).")
@click.option("--share", "share", metavar="NAME",
              help="Join group NAME: processes that share one pool of --gpu-memory LIMIT bytes. "
                   "They run side by side while their memory fits together, and take turns on the "
                   "GPU (--slice) when it does not, a turn taken by the members whose working sets fit "
                   "together; those whose turn it is make the others evict first. The first member sets "
                   "LIMIT; later ones may leave --gpu-memory out (or must give the same). A process that exits or dies gives its memory back. "
                   "`gpuos mem stats NAME` shows the group.")
@click.option("--slice", "slice_ms", type=click.IntRange(1, 3_600_000), metavar="MS",
              help="With --share, for a new group: how long a process keeps the GPU's turn while "
                   "others wait for it, in milliseconds [default: 200].")
@click.option("--managed-ahead", is_flag=True,
              help="For CUDA managed memory: learn the repeating sequence of the launches' "
                   "predicted working sets and have the patched driver (through gpuos.ko) migrate "
                   "the next launches' ranges to the GPU in batches, hint what leaves them as first "
                   "to evict, and prefetch the rest of their ranges with any fault in them. Needs "
                   "root, gpuos.ko and the patched nvidia-uvm (GPU 0 of its numbering); without them "
                   "the command runs as without it and the summary says why.")
@click.option("-q", "--quiet", is_flag=True, help="No summary on stderr.")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def run_cmd(log, validate, touched, report, as_json, touch_all, dump_params, ring_slots, record_cpus,
            paused, memory, gpu_memory, evict, share, slice_ms, managed_ahead, quiet, cmd) -> None:
    """Run CMD with libgpuos preloaded and report what it did on the GPU.

    \b
    gpuos run [OPTIONS] -- CMD [ARGS]...

    libgpuos intercepts the CUDA driver API inside every process of CMD's tree
    (the CUDA runtime, cuBLAS, cuDNN, NCCL, Triton and programs linked to libcuda
    directly are all seen), keeps a map of every allocation and, for each kernel
    launch, records the buffers the kernel may access, found in its arguments.
    The application runs unchanged; if anything in the library fails, tracking
    turns off for that process and it runs on untouched.

    A summary goes to stderr when CMD ends. `gpuos trace launches PID` follows a
    running process live. The exit status is CMD's (128+N if a signal N ended it);
    gpuos's own errors use the codes below (30: libgpuos.so missing).

    \b
    Examples:
      gpuos run -- python train.py
      gpuos run --log launches.jsonl.gz -- python infer.py
      gpuos run --validate --report val.json -- python train.py --steps 2
      gpuos run --record-touched --log touched.jsonl.gz -- python train.py --steps 2
    """
    if ring_slots and ring_slots & (ring_slots - 1):
        raise click.BadParameter("must be a power of two", param_hint="--ring-slots")
    if dump_params and not log:
        raise click.BadParameter("needs --log FILE (the dumps go there)", param_hint="--dump-params")
    if record_cpus is not None:
        _check_cpu_list(record_cpus)
    if touched:
        if not log:
            raise click.BadParameter("needs --log FILE (the touches go there)", param_hint="--record-touched")
        if gpu_memory or share or managed_ahead:
            raise click.BadParameter("cannot be combined with --gpu-memory, --share or --managed-ahead",
                                     param_hint="--record-touched")
        validate, memory = True, "driver"
    if paused and validate:
        raise click.BadParameter("validation cannot be paused", param_hint="--paused")
    if slice_ms and not share:
        raise click.BadParameter("only means something with --share", param_hint="--slice")
    if share is not None:
        gpu_memory = _group_limit(share, gpu_memory)
    if evict != "future" and not gpu_memory:
        raise click.BadParameter("only means something with --gpu-memory", param_hint="--evict")
    if gpu_memory and memory != "movable":
        raise click.BadParameter("needs --memory movable (gpuos moves only the memory it owns)",
                                 param_hint="--gpu-memory")
    res = Supervisor(RunOptions(cmd=list(cmd), log=log, validate=validate, touched=touched,
                                touch_all=list(touch_all), dump_params=list(dump_params),
                                ring_slots=ring_slots, record_cpus=record_cpus,
                                paused=paused, memory=memory, gpu_memory=gpu_memory,
                                evict=evict, share=share, slice_ms=slice_ms,
                                managed_ahead=managed_ahead)).run()
    doc = res.to_json()
    if report:
        report.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    if as_json:
        click.echo(json.dumps(doc, indent=2, sort_keys=True))
    if not quiet:
        for line in _summary(res):
            click.echo(f"gpuos run: {line}" if "\n" not in line else line, err=True)
    sys.exit(res.returncode)
