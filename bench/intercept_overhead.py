#!/usr/bin/env python3
"""Interception overhead of libgpuos on the workload suite, and how well it predicts.

For each workload of `python3 -m gpuos.workloads.suite` (default: all), run it in rounds
of three short runs with the same seed, in an order that rotates from round to round:
plain; `gpuos run --paused` (passive: interposed, allocations tracked, operations not
recorded); `gpuos run` (recording).  Each run measures its own steps/s (process start and
warmup excluded); every run must be bit-identical.  Pairing the runs of a round takes out
the host's slow drift: the passive cost (passive vs plain), the recording cost
(recording vs passive) and the whole (recording vs plain) are mean differences of time
per step over the rounds, with 95% intervals (bench/paired.py, rounds_overhead).
noop-launch gives the latency libgpuos adds to one kernel launch.  Separate runs on a VM differ by more than the
overhead, so with --paired S each workload also runs once for about S seconds, pausing
and resuming its own recording every --paired-steps steps, and neighbouring windows are
compared (bench/paired.py).  Then run each workload once, shorter, under
`gpuos run --validate --report` and record what validation found: operations validated
and skipped, operations with misses and the kernels behind them, missed, changed,
predicted and over-predicted bytes.

    python3 bench/intercept_overhead.py [--workloads a,b] [--reps 3] [--quick] [--paired S]
                                        [--paired-steps 1] [--cpus LIST] [--ring-slots N]
                                        [--budget 900] [--out bench/results] [--update-readme]
    python3 bench/intercept_overhead.py --readme-from bench/results/intercept-H100-DATE.json [PART.json...]

Writes bench/results/intercept-<gpu>-<date>.json (after every workload, so what was
measured survives a failure) and prints a Markdown table; progress goes to stderr.
Exits 1 if a run failed or results differed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import paired
import readme_table
from gpuos import __version__
from gpuos.workloads.run import Finished, private_caches, run, suite_cmd, under_gpuos
from gpuos.workloads.suite import WORKLOADS

MIN_RUN_S = 20  # a run given less time than this would only time out: skip it instead
# Runs of these take 2-3 s: they get three times the repetitions, against the host's noise.
CHEAP = {"noop-launch", "cupy"}
# Blind spots validation found (README): the kernel-name substrings given to the fallback
# (`gpuos run --touch-all`); such a workload is validated once more with it.  CuPy's batched
# float32 matmul goes through a cuBLAS batched GEMM whose kernels take device arrays of
# A/B/C pointers: the output's address is in GPU memory, not in a parameter.  cuBLAS picks
# the kernel by size (seen on H100: the CUTLASS SIMT SGEMM at 1024, an xmma FFMA GEMM at 512).
BLIND_SPOTS = {"cupy": ["cutlass_80_simt_sgemm", "xmma_gemm_f32f32_f32f32"]}


def step_args(workload: str, quick: bool, steps: int = 0) -> list[str]:
    """Arguments of the timed runs: the suite's defaults, --steps, or a smoke run's."""
    if not quick:
        return ["--steps", str(steps)] if steps else []
    if workload == "noop-launch":
        return ["--steps", "20000", "--warmup", "1000"]
    return ["--steps", "3", "--warmup", "1"]


def validate_args(workload: str) -> list[str]:
    """Validation synchronizes and fingerprints all memory around every operation: keep it short."""
    if workload == "noop-launch":
        return ["--steps", "200", "--warmup", "10"]
    return ["--steps", "2", "--warmup", "1"]


def log(msg: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Budget:
    """The whole benchmark's time: every run's limit is the smaller of --run-timeout and
    what is left."""

    def __init__(self, total: float, per_run: float):
        self.deadline = time.monotonic() + total
        self.per_run = per_run

    def next_limit(self) -> float | None:
        left = self.deadline - time.monotonic()
        return min(self.per_run, left) if left >= MIN_RUN_S else None


class RunFailed(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.detail = detail


class OutOfTime(RunFailed):
    """Not a failure: the budget ran out before this run."""


def run_one(cmd: list[str], what: str, budget: Budget, env: dict[str, str]) -> Finished:
    limit = budget.next_limit()
    if limit is None:
        raise OutOfTime("skipped: the time budget was spent")
    fin = run(cmd, limit, env)
    if fin.returncode != 0:
        raise RunFailed(f"{what} run {fin.outcome()}", fin.describe())
    return fin


def gpu_process(report: dict, pid: int) -> dict | None:
    """The report's record of the workload's own process (others may be compile workers)."""
    return next((p for p in report["processes"] if p["pid"] == pid), None)


MODES = ("plain", "passive", "gpuos")  # a round: one run of each, the order rotating


def round_order(rep: int) -> tuple[str, ...]:
    k = rep % len(MODES)
    return MODES[k:] + MODES[:k]


def timed_run(workload: str, args: list[str], mode: str, budget: Budget, env: dict[str, str],
              workdir: Path, gpuos_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """One timed run: plain, passive (`gpuos run --paused`: interposed, allocations
    tracked, operations not recorded) or gpuos (`gpuos run`, recording): the workload's
    JSON line, and under gpuos run the report."""
    cmd = suite_cmd(workload, args)
    report = workdir / f"{workload}-{mode}-{time.monotonic_ns()}.json"
    if mode != "plain":
        cmd = under_gpuos(cmd, *(["--paused"] if mode == "passive" else []), "--report", str(report),
                          *gpuos_args)
    fin = run_one(cmd, mode, budget, env)
    row: dict[str, Any] = {"mode": mode, "wall_s": fin.wall_s, "result": fin.result()}
    if mode != "plain":
        row["report"] = json.loads(report.read_text())
        row["process"] = gpu_process(row["report"], row["result"]["pid"])
    return row


def across_processes(runs: list[dict]) -> dict[str, Any]:
    """The rounds' paired estimates (rounds_overhead) of the passive cost, the recording
    cost and the whole, from time per step; for noop-launch, from its best block's time
    per launch (ns_per_launch): its one-second runs' mean swings 20% with the host, while
    interference only ever adds time to a block."""
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        if "round" in r:
            res = r["result"]
            by_round.setdefault(r["round"], {})[r["mode"]] = res.get("ns_per_launch") or 1 / res["steps_per_s"]
    full = [t for t in by_round.values() if set(t) == set(MODES)]
    def est(base: str, other: str) -> dict[str, Any]:
        return paired.rounds_overhead([t[base] for t in full], [t[other] for t in full])
    return {"passive": est("plain", "passive"), "recording": est("passive", "gpuos"),
            "total": est("plain", "gpuos")}


def summarize(runs: list[dict]) -> dict[str, Any]:
    plain = [r["result"] for r in runs if r["mode"] == "plain"]
    gpuos = [r for r in runs if r["mode"] == "gpuos"]
    plain_sps = [r["steps_per_s"] for r in plain]
    gpuos_sps = [r["result"]["steps_per_s"] for r in gpuos]
    med_plain, med_gpuos = statistics.median(plain_sps), statistics.median(gpuos_sps)
    out = {
        "plain_steps_per_s": med_plain, "gpuos_steps_per_s": med_gpuos,
        # extra time per step, relative to plain: medians, and best runs (noise only adds time)
        "overhead_pct": (med_plain / med_gpuos - 1) * 100,
        "best_overhead_pct": (max(plain_sps) / max(gpuos_sps) - 1) * 100,
        # the noise floor: how far plain runs alone are apart
        "plain_spread_pct": (max(plain_sps) / min(plain_sps) - 1) * 100,
        "identical": len({r["checksum"] for r in plain} | {r["result"]["checksum"] for r in gpuos}
                         | {r["result"]["checksum"] for r in runs if r["mode"] == "passive"}) == 1,
        # tells a workload that is not deterministic by itself apart
        "plain_repeatable": len({r["checksum"] for r in plain}) == 1,
        "tracking_on": all(r["process"] and r["process"]["state"] == "on" for r in gpuos),
        "launches": [r["process"]["counters"]["launches"] for r in gpuos if r["process"]],
        "across_processes": across_processes(runs),
    }
    passive = [r["result"] for r in runs if r["mode"] == "passive"]
    if passive:
        out["passive_steps_per_s"] = statistics.median(r["steps_per_s"] for r in passive)
        out["passive_overhead_pct"] = (med_plain / out["passive_steps_per_s"] - 1) * 100
        if all(r.get("cpu_s") for r in plain + passive):
            out["passive_cpu_overhead_pct"] = (
                statistics.median(r["cpu_s"] / r["steps"] for r in passive)
                / statistics.median(r["cpu_s"] / r["steps"] for r in plain) - 1) * 100
    if all(r.get("cpu_s") for r in plain) and all(r["result"].get("cpu_s") for r in gpuos):
        # CPU time per step of the whole process: what libgpuos adds where the CPU is the bottleneck
        cpu_plain = statistics.median(r["cpu_s"] / r["steps"] for r in plain)
        cpu_gpuos = statistics.median(r["result"]["cpu_s"] / r["result"]["steps"] for r in gpuos)
        out["cpu_ms_per_step"] = {"plain": cpu_plain * 1e3, "gpuos": cpu_gpuos * 1e3}
        out["cpu_overhead_pct"] = (cpu_gpuos / cpu_plain - 1) * 100
    if "ns_per_launch" in plain[0]:
        out["added_ns_per_launch"] = (statistics.median(r["result"]["ns_per_launch"] for r in gpuos)
                                      - statistics.median(r["ns_per_launch"] for r in plain))
    return out


def validation_run(workload: str, budget: Budget, env: dict[str, str], workdir: Path,
                   touch_all: list[str] | None = None, memory: str = "movable") -> dict[str, Any]:
    args = validate_args(workload)
    report = workdir / f"{workload}-validate{'-fallback' if touch_all else ''}.json"
    fallback = [opt for pattern in touch_all or [] for opt in ("--touch-all", pattern)]
    fin = run_one(under_gpuos(suite_cmd(workload, args), "--validate", "--memory", memory, *fallback,
                              "--report", str(report)),
                  "validation", budget, env)
    result, rep = fin.result(), json.loads(report.read_text())
    v = rep["validation"]
    if v is None:
        raise RunFailed("no validation in the report", json.dumps(rep["processes"]))
    return {
        "args": args, "touch_all": touch_all or [], "wall_s": fin.wall_s, "result": result, "report": rep,
        "process": gpu_process(rep, result["pid"]),
        "over_prediction": (v["overpredicted_bytes"] / v["predicted_bytes"]
                            if v["predicted_bytes"] else None),
        "kernels_with_misses": sorted((k for k in v["kernels"] if k["with_misses"]),
                                      key=lambda k: -k["missed_bytes"]),
    }


def gpuos_options(a: argparse.Namespace) -> tuple[str, ...]:
    """What every `gpuos run` of the benchmark is given: the memory mode, the ring size."""
    return ("--memory", a.memory, *(("--ring-slots", str(a.ring_slots)) if a.ring_slots else ()))


def paired_run(name: str, a: argparse.Namespace, plain_sps: float, budget: Budget,
               env: dict[str, str], workdir: Path) -> dict[str, Any]:
    """One run of about a.paired seconds under `gpuos run` that pauses and resumes its
    own recording every a.paired_steps steps (bench/paired.py)."""
    steps = max(WORKLOADS[name].steps, round(a.paired * plain_sps))
    log_path = workdir / f"{name}-steps-{time.monotonic_ns()}.jsonl"
    cmd = under_gpuos(suite_cmd(name, ["--steps", str(steps), "--step-log", str(log_path),
                                       "--toggle-recording", str(a.paired_steps)]), *gpuos_options(a))
    fin = run_one(cmd, "paired", budget, env)
    marks = paired.read_marks(log_path)
    return {"steps": steps, "steps_per_window": a.paired_steps, "wall_s": fin.wall_s,
            "result": fin.result(), **paired.paired_overhead(paired.windows(marks)),
            # the raw data: the table is estimated from it again (reestimate)
            "step_times": paired.step_times(marks)}


def dumps(result: dict[str, Any]) -> str:
    """The result as indented JSON, but each paired run's step times (thousands of them)
    on one line."""
    raw: list[str] = []

    def lift(o: Any) -> Any:
        if isinstance(o, list):
            return [lift(v) for v in o]
        if not isinstance(o, dict):
            return o
        out = {}
        for k, v in o.items():
            if k in ("step_times", "step_ms"):
                raw.append(json.dumps(v, separators=(",", ":")))
                out[k] = f"@raw{len(raw) - 1}"
            else:
                out[k] = lift(v)
        return out

    text = json.dumps(lift(result), indent=2)
    for i, compact in enumerate(raw):
        text = text.replace(f'"@raw{i}"', compact, 1)
    return text + "\n"


def reestimate(result: dict[str, Any]) -> bool:
    """The paired estimates of result again, from the step times its paired runs kept,
    with this bench/paired.py: a table shows the current estimator on the raw data.
    (The first runs kept wall times only: their CPU estimate goes.)  True if any was
    estimated."""
    done = False
    for w in result["workloads"].values():
        p = w.get("paired") or {}
        marks = paired.marks_from(p)
        if marks is None:
            continue
        for k in ("wall", "wall_capped", "cpu"):
            p.pop(k, None)
        p.update(paired.paired_overhead(paired.windows(marks)))
        done = True
    return done


def bench_workload(name: str, a: argparse.Namespace, budget: Budget, env: dict[str, str],
                   workdir: Path) -> dict[str, Any]:
    args = step_args(name, a.quick, a.steps)
    reps = a.reps * 3 if name in CHEAP else a.reps
    entry: dict[str, Any] = {"args": args, "reps": reps, "runs": [],
                             "cpus": sorted(os.sched_getaffinity(0)) if a.cpus else None}
    try:
        for rep in range(reps):
            for mode in round_order(rep):
                log(f"{name}: round {rep + 1}/{reps}, {mode}")
                row = timed_run(name, args, mode, budget, env, workdir, gpuos_options(a))
                entry["runs"].append(dict(row, round=rep))
        entry.update(summarize(entry["runs"]))
        x = entry["across_processes"]
        log(f"{name}: " + ", ".join(f"{k} {x[k]['overhead_pct']:+.2f} ± {x[k]['ci95_pct']:.2f}%"
                                    for k in ("passive", "recording", "total") if "overhead_pct" in x[k])
            + f" over {x['total']['rounds']} rounds; identical: {entry['identical']}")
        if a.paired:
            log(f"{name}: paired run, recording paused and resumed every {a.paired_steps} steps")
            p = entry["paired"] = paired_run(name, a, entry["plain_steps_per_s"], budget, env, workdir)
            if p["triplets"]:
                log(f"{name}: paired over {p['triplets']} window triplets: "
                    + ", ".join(f"{k} {p[k]['overhead_pct']:+.2f} ± {p[k]['ci95_pct']:.2f}%"
                                for k in ("wall", "wall_capped", "cpu") if k in p))
        log(f"{name}: validating")
        entry["validate"] = validation_run(name, budget, env, workdir, memory=a.memory)
        if name in BLIND_SPOTS:
            log(f"{name}: validating with the fallback --touch-all {' '.join(BLIND_SPOTS[name])}")
            entry["validate_fallback"] = validation_run(name, budget, env, workdir, BLIND_SPOTS[name], a.memory)
    except OutOfTime as exc:
        entry["skipped"] = str(exc)
        log(f"{name}: {exc}")
    except RunFailed as exc:
        entry["error"], entry["error_detail"] = str(exc), exc.detail
        log(f"{name}: {exc}\n{exc.detail}")
    return entry


def host_info() -> dict[str, Any]:
    from gpuos.cudadrv import CudaDriver

    drv = CudaDriver()
    info, dev = drv.driver_info(), drv.devices()[0]
    return {"device": dev.name, "gpu_memory_total": dev.memory_total, "driver": info.version,
            "cuda_api": info.cuda_api, "gpuos": __version__,
            "host": {"hostname": socket.gethostname(), "kernel": platform.release(),
                     "cpus": os.cpu_count(), "python": platform.python_version()}}


def short_name(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100'."""
    return device.removeprefix("NVIDIA ").split()[0]


def failed(result: dict) -> bool:
    """A run failed, results differed, or tracking was off (budget skips are not failures)."""
    return any("error" in w or not w.get("identical", True) or not w.get("tracking_on", True)
               for w in result["workloads"].values())


def result_path(outdir: Path, result: dict[str, Any]) -> Path:
    return outdir / f"intercept-{short_name(result['device'])}-{result['date'][:10]}.json"


def measure(a: argparse.Namespace, names: list[str]) -> tuple[dict[str, Any], Path]:
    budget = Budget(a.budget, a.run_timeout)
    result: dict[str, Any] = {
        "benchmark": "intercept_overhead",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **host_info(), "reps": a.reps, "quick": a.quick, "steps": a.steps or None, "budget_s": a.budget,
        "cpus": sorted(os.sched_getaffinity(0)) if a.cpus else None, "ring_slots": a.ring_slots,
        "memory": a.memory,  # gpuos run --memory: movable (libgpuos/src/memory.c) or driver
        "paired_s": a.paired or None, "paired_steps": a.paired_steps if a.paired else None,
        # how libgpuos records (docs/interception.md): on its recording thread unless inline
        "record_inline": os.environ.get("GPUOS_RECORD_INLINE") == "1",
        "record_cpus": os.environ.get("GPUOS_RECORD_CPUS") or None,
        "order": "plain, gpuos, plain, gpuos, ... per workload; then the paired run (--paired), "
                 "then one validation run",
        "workloads": {}, "notes": [],
    }
    path = result_path(Path(a.out).resolve(), result)
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpuos-intercept-") as tmp:
        workdir = Path(tmp)
        # One set of kernel caches for the whole benchmark: the first gpt-compile run compiles
        # (in its warmup, untimed), later runs reuse it; nothing stale comes from outside.
        env = dict(os.environ, **private_caches(workdir / "cache"))
        for name in names:
            if budget.next_limit() is None:
                note = f"{name}: skipped, the {a.budget:.0f} s budget was spent"
                result["notes"].append(note)
                log(note)
                continue
            result["workloads"][name] = bench_workload(name, a, budget, env, workdir)
            first = next((r["result"] for r in result["workloads"][name]["runs"]
                          if r["result"].get("torch")), None)
            if first and "torch" not in result:
                result["torch"], result["cuda_runtime"] = first["torch"], first["cuda"]
            result["elapsed_s"] = time.monotonic() - t0
            path.write_text(dumps(result))
    log(f"wrote {path}")
    return result, path


def fmt_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            break
    return f"{n:.1f} {unit}"


def markdown(r: dict[str, Any]) -> str:
    """Three tables: what libgpuos costs against plain runs (the figure that means
    something), how well it predicts, and, as an appendix, the separate runs' medians."""
    noop = r["workloads"].get("noop-launch", {})
    latency = (f"{noop['added_ns_per_launch']:.0f} ns added per kernel launch (noop-launch, medians of "
               "separate runs)" if "added_ns_per_launch" in noop else "noop-launch not measured")
    api = r["cuda_api"]
    stack = (f"CUDA {r['cuda_runtime']}, torch {r['torch']}" if "torch" in r
             else f"CUDA API {api // 1000}.{api % 1000 // 10}")
    cost = ("| workload | passive vs plain | recording vs passive | gpuos vs plain | rounds "
            "| recording vs paused, in one run | bit-identical |")
    predict = ("| workload | operations validated | skipped | ops with misses | missed | over-predicted "
               "| kernels with misses | ops with misses, with the fallback |")
    appendix = ("| workload | plain steps/s | gpuos steps/s | separate runs: gpuos vs plain (medians) "
                "| CPU time | plain spread | in one run: recording vs paused, time / capped / CPU "
                "| launches/run |")
    lines = [f"{r['device']}, driver {r['driver']}, {stack}, gpuos {r['gpuos']}, {r['date'][:10]}. "
             "What libgpuos costs, from rounds of three short runs of each workload (plain; "
             "`gpuos run --paused`: passive, interposed and tracking allocations, recording no "
             "operation; `gpuos run`: recording), in an order rotating by round: mean difference "
             "of time per step within a round over the mean of the cheaper mode, ± its 95% "
             f"interval over the rounds. {latency}."
             + (f" Under gpuos: `--memory {r['memory']}`." if r.get("memory") else "")
             + (f" Every run pinned to CPUs {r['cpus'][0]}-{r['cpus'][-1]}." if r.get("cpus") else "")
             + (" **Smoke run (--quick): 3 timed steps per run, too short to measure "
                "throughput overhead; the identity and validation columns stand.**"
                if r.get("quick") else ""),
             "", cost, "|" + "---|" * (cost.count("|") - 1)]
    lines += ["| " + " | ".join([name, *cost_cells(w)]) + " |" for name, w in r["workloads"].items()]
    lines += ["", "How well it predicts (`gpuos run --validate`: every operation fingerprinted before "
              "and after):", "", predict, "|" + "---|" * (predict.count("|") - 1)]
    lines += ["| " + " | ".join([name, *validation_cells(w)]) + " |" for name, w in r["workloads"].items()]
    lines += ["", "Appendix: separate runs' medians (on a shared host they differ by more than the "
              "overhead: the plain spread says how far plain runs alone were apart)."
              + paired_note(r), "", appendix, "|" + "---|" * (appendix.count("|") - 1)]
    lines += ["| " + " | ".join([name + (" (pinned)" if w.get("cpus") and not r.get("cpus") else ""),
                                 *timed_cells(w)]) + " |"
              for name, w in r["workloads"].items()]
    return "\n".join(lines + [f"\n{note}" for note in r["notes"]])


def cost_cells(w: dict[str, Any]) -> list[str]:
    x = w.get("across_processes") or {}
    if "overhead_pct" not in (x.get("total") or {}):
        rounds = (x.get("total") or {}).get("rounds")
        why = (why_not(w) if "overhead_pct" not in w else
               f"{rounds} round: no interval" if rounds == 1 else "not measured (older results)")
        return [why, "", "", "", in_one_run(w), "yes" if w.get("identical") else ("**NO**" if "identical" in w else "")]
    ok = w["identical"]  # a number measured on a wrong result is not reported
    cells = [f"{x[k]['overhead_pct']:+.1f} ± {x[k]['ci95_pct']:.1f}%" if ok and "overhead_pct" in x[k]
             else "—" for k in ("passive", "recording", "total")]
    return [*cells, str(x["total"]["rounds"]), in_one_run(w) if ok else "—", "yes" if ok else "**NO**"]


def in_one_run(w: dict[str, Any]) -> str:
    """The paired run's wall-time figure (recording against paused, neighbouring windows)."""
    wall = (w.get("paired") or {}).get("wall") or {}
    return f"{wall['overhead_pct']:+.1f} ± {wall['ci95_pct']:.1f}%" if "overhead_pct" in wall else "—"


def why_not(w: dict[str, Any]) -> str:
    return w.get("error") or w.get("skipped") or "not run"


def timed_cells(w: dict[str, Any]) -> list[str]:
    if "overhead_pct" not in w:
        return [why_not(w), "", "", "", "", "", ""]
    # A number measured on a wrong result is not reported.
    overhead = f"{w['overhead_pct']:+.1f}%" if w["identical"] else "—"
    if "passive_overhead_pct" in w and w["identical"]:
        overhead += f" (passive {w['passive_overhead_pct']:+.1f}%)"
    launches = f"{statistics.median(w['launches']):.0f}" if w["launches"] else "—"
    cpu = f"{w['cpu_overhead_pct']:+.1f}%" if "cpu_overhead_pct" in w and w["identical"] else "—"
    return [f"{w['plain_steps_per_s']:.4g}", f"{w['gpuos_steps_per_s']:.4g}", overhead, cpu,
            f"{w['plain_spread_pct']:.1f}%" if len(w["launches"]) > 1 else "—", paired_cell(w),
            launches]


def paired_note(r: dict[str, Any]) -> str:
    walls = [w["paired"]["wall_s"] for w in r["workloads"].values() if w.get("paired", {}).get("triplets")]
    if not walls:
        return ""
    return (f" In one run: one more run ({min(walls):.0f}-{max(walls):.0f} s) under `gpuos run` with its "
            f"recording paused and resumed {paired_period(r)}; mean over triplets of "
            "neighbouring windows of the difference in step time (recording - paused), over the "
            "mean paused step, ± its 95% confidence interval, for wall time per step, for it with "
            f"every step capped at the run's {paired.CAP_QUANTILE * 100:.0f}th percentile (the VM's random "
            "stalls, as frequent recording or not, bounded) and for CPU time per step.")


def paired_period(r: dict[str, Any]) -> str:
    """How often the paired runs of r switched (older results switched on a timer)."""
    if r.get("paired_steps"):
        k = r["paired_steps"]
        return "at every step" if k == 1 else f"every {k} steps"
    return f"every {r['paired_period_s']} s"


def paired_cell(w: dict[str, Any]) -> str:
    p = w.get("paired")
    if not p or not p.get("triplets"):
        return "—"
    cells = [f"{p[k]['overhead_pct']:+.1f} ± {p[k]['ci95_pct']:.1f}%" if k in p else "—"
             for k in ("wall", "wall_capped", "cpu")]
    return " / ".join(cells) + f" ({p['triplets']} triplets)"


def validation_cells(w: dict[str, Any]) -> list[str]:
    if "validate" not in w:
        return [why_not(w), "", "", "", "", "", ""]
    vr = w["validate"]
    v = vr["report"]["validation"]
    names = [f"`{k['name'][:60]}`" for k in vr["kernels_with_misses"]]
    kernels = ", ".join(names[:3]) + (f" (+{len(names) - 3})" if len(names) > 3 else "")
    over = "—" if vr["over_prediction"] is None else f"{vr['over_prediction']:.0%}"
    fb = w.get("validate_fallback")
    fallback = "—" if fb is None else (
        f"{fb['report']['validation']['with_misses']} of {fb['report']['validation']['operations']} "
        f"(`--touch-all {' '.join(fb['touch_all'])}`)")
    return [str(v["operations"]), str(v["skipped"]), str(v["with_misses"]),
            fmt_bytes(v["missed_bytes"]), over, kernels, fallback]


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from the results of runs over parts of the suite (a device session may
    limit one command's time): the first part's header, every part's workloads and notes.
    A workload in several parts is the later part's, with what only an earlier part
    measured (the in-one-run pairing, say) kept."""
    out = {**parts[0], "workloads": {}, "notes": []}
    for part in parts:
        for name, w in part["workloads"].items():
            out["workloads"][name] = {**out["workloads"].get(name, {}), **w}
        out["notes"] += part["notes"]
        for key in ("torch", "cuda_runtime"):
            if key in part:
                out.setdefault(key, part[key])
    return out


def update_readme(table: str, source: Path) -> None:
    log(f"updated {readme_table.update_readme('intercept', table, source)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--reps", type=int, default=3,
                    help="Rounds per workload (one run of each mode a round; noop-launch and cupy: "
                         "three times as many).")
    ap.add_argument("--quick", action="store_true", help="Smoke run: 1 rep of 3 steps.")
    ap.add_argument("--steps", type=int, default=0,
                    help="Timed steps of each separate run [the suite's default]: longer runs, less noise.")
    ap.add_argument("--budget", type=float, default=900, help="Seconds for the whole benchmark.")
    ap.add_argument("--run-timeout", type=float, default=300, help="Seconds for one run.")
    ap.add_argument("--paired", type=float, metavar="S", default=0,
                    help="Also measure each workload in one run of about S seconds under `gpuos run`, "
                         "pausing and resuming its recording (bench/paired.py): immune to the "
                         "run-to-run noise of the host [0: not].")
    ap.add_argument("--paired-steps", type=int, metavar="K", default=1,
                    help="Steps between pausing and resuming in the paired run [1] (noop-launch: "
                         "blocks of 1000 launches).")
    ap.add_argument("--ring-slots", type=int, metavar="N",
                    help="`gpuos run --ring-slots N` for the timed runs (how big a ring the "
                         "launch records stream through).")
    ap.add_argument("--cpus", metavar="LIST",
                    help="Pin every run to these CPUs (e.g. 4-11): on a shared VM the CPUs a run "
                         "lands on change its speed by more than the overhead being measured.")
    ap.add_argument("--memory", choices=("movable", "driver"), default="movable",
                    help="`gpuos run --memory` for every run under gpuos [movable, its default].")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--update-readme", action="store_true", help="Rewrite README.md's table.")
    ap.add_argument("--readme-from", metavar="JSON", nargs="+",
                    help="Only rewrite README.md's table from these results (no GPU needed); "
                         "several are merged into one JSON in --out first.")
    a = ap.parse_args()
    if a.readme_from:
        readme_from(a.readme_from, Path(a.out).resolve())
        return
    names = a.workloads.split(",")
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown workloads: {', '.join(sorted(unknown))} (have: {', '.join(WORKLOADS)})")
    if a.paired_steps < 1:
        ap.error("--paired-steps wants 1 or more")
    if a.quick:
        a.reps = 1
    if a.cpus:
        try:
            cpus = {c for part in a.cpus.split(",") for c in (
                range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))}
            os.sched_setaffinity(0, cpus)  # the runs, started from here, inherit it
        except (ValueError, OSError) as exc:
            ap.error(f"--cpus {a.cpus}: {exc}")
    result, path = measure(a, names)
    table = markdown(result)
    print(table)
    if a.update_readme:
        update_readme(table, path)
    sys.exit(1 if failed(result) else 0)


def readme_from(files: list[str], outdir: Path) -> None:
    source = Path(files[0]).resolve()
    result = json.loads(source.read_text())
    if len(files) > 1:
        result = merge([json.loads(Path(f).read_text()) for f in files])
        source = result_path(outdir, result)
    if reestimate(result) or len(files) > 1:
        source.parent.mkdir(parents=True, exist_ok=True)
        source.write_text(dumps(result))
        log(f"written to {source}")
    update_readme(markdown(result), source)


if __name__ == "__main__":
    main()
