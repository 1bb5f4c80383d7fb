"""`gpuos mem`: the GPU memory scheduler of processes under `gpuos run --gpu-memory`."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import click

from .. import procs
from ..errors import GpuosError, NoSuchProcess, NotTracked
from ..movable import extents as ext
from ..movable.agent import Agent, AgentError, agent_available
from ..movable.share import GroupStats, check_name, group_names, read_group
from .output import emit_json, human_bytes, json_option, parse_size, table


def ms(ns: float) -> str:
    return f"{ns / 1e6:.1f} ms"


@click.group("mem")
def mem() -> None:
    """GPU memory oversubscription (`gpuos run --gpu-memory LIMIT [--share NAME]`)."""


@mem.command("stats")
@click.argument("target", metavar="PID|GROUP")
@json_option
def stats_cmd(target: str, as_json: bool) -> None:
    """Show how process PID's GPU memory is scheduled: the limit, what is resident and what
    lives in host memory, the bytes moved, how long its calls waited for memory to come
    in, and the calls that needed more than the prediction could name.

    The process must run under `gpuos run` (exit 29 otherwise); without --gpu-memory the
    limit is 0 and nothing is moved.

    With a GROUP name (`gpuos run --share GROUP`): the group's pool, its members, whose
    turn it is on the GPU, and the stall of each switch between members (exit 40 if the
    group has no members)."""
    if not target.isdigit():
        try:
            check_name(target)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="PID|GROUP") from None
        _group_stats(read_group(target), as_json)
        return
    pid = int(target)
    if not procs.exists(pid):
        raise NoSuchProcess(f"no process {pid}")
    if not agent_available(pid):
        raise NotTracked(f"pid {pid} is not under `gpuos run` (no agent): nothing schedules its GPU memory")
    try:
        with Agent(pid, timeout=10.0) as agent:
            st = agent.mem_stats()
    except AgentError as exc:
        raise NotTracked(exc.message) from None
    if as_json:
        emit_json({"ok": True, "pid": pid, **asdict(st), "stall_p99_us": st.stall_percentile_us(99)})
        return
    if not st.limit:
        click.echo(f"pid {pid}: no --gpu-memory limit; its movable memory stays resident")
        return
    rate = lambda b, ns: f"{b / ns:.2f} GB/s" if ns else "-"  # noqa: E731
    click.echo(table(["", ""], [
        ["limit", human_bytes(st.limit)],
        ["allocations", f"{st.allocations} ({human_bytes(st.reserved_bytes)}; "
                        f"at most {human_bytes(st.reserved_peak)})"],
        ["resident", human_bytes(st.resident_bytes)],
        ["in host memory only", human_bytes(st.evicted_bytes)],
        ["copied in", f"{human_bytes(st.bytes_in)} in {st.swap_ins} copies, {rate(st.bytes_in, st.in_ns)}"
                      + (f" ({ms(st.map_ns)} of the waited-for time making and mapping memory)" if st.map_ns else "")],
        ["memory made for copies in", f"{st.maps} mappings, {ms(st.map_ns + st.ahead_map_ns)}: cuMemCreate "
                                      f"{ms(st.create_ns)}, cuMemSetAccess {ms(st.access_ns)}" if st.maps else "none"],
        ["copied out", f"{human_bytes(st.bytes_out)} in {st.evictions} evictions, {rate(st.bytes_out, st.out_ns)}"
                       + (f" ({ms(st.release_ns)} unmapping and releasing)" if st.release_ns else "")],
        ["not copied out (unchanged)", human_bytes(st.clean_bytes)],
        ["host memory pinned ahead", f"{human_bytes(st.host_prepared)} (before any eviction needed it)"
         + (f"; {st.pageable_hosts} allocations pageable (could not be pinned)" if st.pageable_hosts else "")],
        ["copied in ahead of use", f"{human_bytes(st.ahead_bytes)}; {st.ahead_hits} found by their call "
                                   f"({st.ahead_waits} waited for the copy), {st.ahead_unused} evicted unused"
                                   + (f"; timed on the GPU: {human_bytes(st.batch_bytes)}, "
                                      f"{rate(st.batch_bytes, st.batch_ns)}" if st.batch_ns else "")
                                   + (f"; issuing them took {ms(st.ahead_map_ns)} making and mapping memory, "
                                      f"{ms(st.room_ns)} waiting for room" if st.ahead_ns else "")],
        ["launches checked", str(st.launches)],
        ["calls that waited", f"{st.calls_swapped}, {ms(st.stall_ns)} in all"
         + (f", {ms(st.stall_ns / st.calls_swapped)} each on average, p99 under "
            f"{st.stall_percentile_us(99) / 1000:.1f} ms" if st.calls_swapped else "")],
        ["calls needing everything", str(st.need_all)],
        ["calls refused (did not fit)", str(st.over_limit)],
        ["calls unchecked (stream capture)", str(st.capture_unchecked)],
        ["eviction", "least recently used (asked for: --evict lru)" if st.lru_only
         else f"by the learned call sequence (Belady; period {st.period} calls), {st.evictions_future} "
              f"of {st.evictions} evictions" if st.period
         else f"least recently used (no repeating call sequence found), {st.evictions_future} of "
              f"{st.evictions} evictions chosen by one found earlier"],
    ]).split("\n", 1)[1])


def _group_stats(g: GroupStats, as_json: bool) -> None:
    p99 = g.switch_percentile_us(99)
    if as_json:
        emit_json({"ok": True, "group": g.name, **{k: v for k, v in asdict(g).items() if k != "name"},
                   "switch_p99_us": p99})
        return
    waits = sum(g.switch_hist)
    click.echo(table(["", ""], [
        ["group", g.name],
        ["limit", f"{human_bytes(g.limit)}, {human_bytes(g.resident)} resident"],
        ["time slice", ms(g.slice_ns)],
        ["switches", f"{g.switches}" + (f"; the first call after each made its memory resident in "
                                         f"{ms(g.switch_ns / waits)} on average, p99 under {p99 / 1000:.1f} ms"
                                         if waits else "")],
        ["turns shared", f"{g.beside_turns} admissions beside a holder (members whose working sets fit "
                         f"together take their turns together)"],
        ["members that died", str(g.reaped)],
        ["asks timed out", f"{g.ask_timeouts} (a member asked to evict that did not within 10 s)"],
    ]).split("\n", 1)[1])
    click.echo(table(["PID", "GPU", "RESIDENT", "RESERVED", "WORKING SET", "SLICES", "BESIDE", "HELD", "WAITED",
                      "EVICTED FOR OTHERS"],
                     [[m.pid, "holds" if m.holder else "beside" if m.beside else "waits" if m.waiting else "-",
                       human_bytes(m.resident), human_bytes(m.reserved),
                       human_bytes(m.working_set) if m.working_set else "-", m.slices,
                       f"{m.beside_slices}" + (f" ({m.steps_aside} left)" if m.steps_aside else ""),
                       ms(m.held_ns), ms(m.wait_ns), human_bytes(m.released_bytes)] for m in g.members]))


@mem.command("groups")
@json_option
def groups_cmd(as_json: bool) -> None:
    """List this user's groups sharing a pool of GPU memory (`gpuos run --share NAME`):
    each one's limit, resident bytes, members and the member holding the GPU."""
    rows = []
    for name in group_names():
        try:
            g = read_group(name)
        except GpuosError:
            continue  # no members now (one died without leaving), or not readable
        holder = next((m.pid for m in g.members if m.holder), None)
        rows.append({"group": name, "limit": g.limit, "resident": g.resident, "members": [m.pid for m in g.members],
                     "holder": holder, "switches": g.switches})
    if as_json:
        emit_json({"ok": True, "groups": rows})
        return
    if not rows:
        click.echo("no groups with members (gpuos run --share NAME starts one)")
        return
    click.echo(table(["GROUP", "LIMIT", "RESIDENT", "MEMBERS", "HOLDS THE GPU", "SWITCHES"],
                     [[r["group"], human_bytes(r["limit"]), human_bytes(r["resident"]),
                       " ".join(map(str, r["members"])), r["holder"] or "-", r["switches"]] for r in rows]))


# -- gpuos mem extents ---------------------------------------------------------------------

def _bytes(ctx: click.Context, param: click.Parameter, text: str) -> int:
    size = parse_size(text)
    if size is None:
        raise click.BadParameter(f"{text!r} is not a size in bytes, such as 65536, 64K or 2M")
    return size


def _pct(n: int, total: int) -> str:
    return f"{n} ({100 * n / total:.0f}%)" if total else str(n)


def _by_rule(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    return ", ".join(f"{_pct(counts[r], total)} {r}" for r in ext.RULES)


def _left_out(c: ext.LogCounts, *extra: tuple[str, int]) -> str:
    reasons = [("without a touched record", c.unmeasured), ("touches incomplete", c.incomplete),
               ("captured, not run", c.captured), ("layout unknown", c.layout_unknown),
               ("graph kernel nodes", c.graph), ("no parameters recorded", c.no_params), *extra]
    said = [f"{n} {why}" for why, n in reasons if n]
    return ", ".join(said) if said else "none"


def _coarse(c: ext.LogCounts) -> list[list[str]]:
    if not c.coarse:
        return []
    return [["touched runs coarsened", f"{c.coarse} launches: too many runs, joined across untouched gaps "
                                       f"(their touches over-reported)"]]


def _unattributed(c: ext.LogCounts) -> str:
    if not c.unattributed_runs:
        return "none"
    return (f"{c.unattributed_runs} runs ({human_bytes(c.unattributed_bytes)}) in {c.unattributed_launches} "
            f"launches: memory no pointer argument names (pointers kept in device memory?)")


@mem.group("extents")
def extents() -> None:
    """Working sets finer than an allocation: predict, before a kernel launch, which bytes
    of its buffers it touches (each pointer argument's extent), from its arguments.

    Record the ground truth with `gpuos run --record-touched --log FILE -- CMD`, learn a
    model from it (`learn`), and measure the model on another recording (`check`).

    A measuring tool: `--gpu-memory` keeps making whole allocations resident, since over
    a training or inference step nearly every block of them is touched anyway and the
    models can miss on sizes they did not learn (docs/design.md, "Working sets finer than
    an allocation")."""


@extents.command("learn", short_help="Learn pointer extents from launch logs with touched records.")
@click.argument("logs", nargs=-1, required=True, metavar="LOG...", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", "model_path", required=True, metavar="MODEL",
              type=click.Path(dir_okay=False, path_type=Path),
              help="Write the model here (JSON, replaced atomically).")
@click.option("--tolerance", default="2M", show_default=True, metavar="BYTES", callback=_bytes,
              help="How far a pointer's extents may stray from a rule and still fit it (e.g. 64K, 2M); "
                   "measured touches can fall short within a 2 MiB block.")
@json_option
def learn_cmd(logs: tuple[Path, ...], model_path: Path, tolerance: int, as_json: bool) -> None:
    """Learn each kernel's pointer extents from launch logs with touched records
    (`gpuos run --record-touched --log LOG`) and write them to MODEL.

    For every named kernel and pointer argument, the bytes the launches touched around the
    pointer are fitted to the first rule that holds: fixed, linear in one integer argument
    or the grid (or a product of two), recorded per argument values, or else the whole
    allocation. Prints the kernels and pointer slots by rule and the launches left out.
    Launches whose touches were not all seen (a dropped event, remote mappings) are left out."""
    model, summary = ext.learn(logs, tolerance)
    ext.write_model(model, model_path)
    if as_json:
        emit_json({"ok": True, "model": str(model_path), **summary.to_dict()})
        return
    c = summary.counts
    click.echo(f"learnt the extents of {len(model.kernels)} kernels from {summary.launches_used} of "
               f"{c.launches} launches -> {model_path}")
    click.echo(table(["", ""], [
        ["pointer slots", _by_rule(summary.slots_by_rule)],
        ["kernels", _by_rule(summary.kernels_by_rule)],
        ["launches learnt from", _by_rule(summary.launches_by_rule)],
        ["launches left out", _left_out(c, ("of kernels without a name", summary.unnamed),
                                        ("with another parameter layout", summary.layout_changed))],
        ["touched, unattributed", _unattributed(c)],
        ["missed on a held-out log", f"{len(summary.held_out_misses)} kernels: whole allocations for them"
                                     if summary.held_out_misses else "none" if len(logs) > 1 else "- (one log)"],
        *_coarse(c),
    ]).split("\n", 1)[1])


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _misses(launches: int, units: int, nbytes: int) -> str:
    return f"{launches} launches, {units} units, {human_bytes(nbytes)}" if launches else "0"


@extents.command("check", short_help="Measure an extent model on a launch log with touched records.")
@click.argument("model_path", metavar="MODEL", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("log", metavar="LOG", type=click.Path(dir_okay=False, path_type=Path))
@json_option
def check_cmd(model_path: Path, log: Path, as_json: bool) -> None:
    """Measure MODEL on the launches of LOG (recorded with `gpuos run --record-touched`):
    for each launch, the bytes the model predicts against those it touched, and against
    today's prediction, the whole allocations its pointer arguments name.

    Compared in units of 4 KiB, 64 KiB and 2 MiB (address-aligned, clipped to their
    allocation); 2 MiB is the one that counts: the measurement is exact there, and it is
    what gpuos moves. A miss is a unit touched and not predicted; OVER is bytes predicted
    per byte touched. Misses do not change the exit status: this is a measurement."""
    model = ext.read_model(model_path)
    report = ext.check(model, log)
    if as_json:
        emit_json({"ok": True, "model": str(model_path), **report.to_dict()})
        return
    c = report.counts
    click.echo(f"{model_path} on {log}: {report.checked} of {c.launches} launches checked")
    click.echo(table(["", ""], [
        ["launches by rule applied", _by_rule(report.launches_by_rule)],
        ["kernels by rule", _by_rule(report.kernels_by_rule)],
        ["launches left out", _left_out(c)],
        ["touched, unattributed", _unattributed(c)],
        *_coarse(c),
    ]).split("\n", 1)[1])
    click.echo()
    click.echo(table(["UNIT", "TOUCHED", "MODEL", "OVER", "WHOLE ALLOCATIONS", "OVER", "MODEL MISSES",
                      "WHOLE-ALLOCATION MISSES"],
                     [[human_bytes(g.grain), human_bytes(g.touched_bytes), human_bytes(g.model_bytes),
                       _ratio(g.model_over), human_bytes(g.whole_bytes), _ratio(g.whole_over),
                       _misses(g.model_miss_launches, g.model_missed_units, g.model_missed_bytes),
                       _misses(g.whole_miss_launches, g.whole_missed_units, g.whole_missed_bytes)]
                      for g in report.grains]))
    blocks = report.grains[-1]
    if blocks.model_misses:
        click.echo(f"\nfirst misses at {human_bytes(blocks.grain)}:")
        for m in blocks.model_misses:
            click.echo(f"  pid {m.pid} seq {m.seq} {m.kernel or '(unnamed)'}: {human_bytes(m.missed_bytes)} of "
                       f"allocation {m.alloc_start:#x} ({human_bytes(m.alloc_size)}) from +{m.first_missed:#x}"
                       + ("" if m.pointed else ", which no pointer argument names"))
    rows = sorted(report.kernels.values(), key=lambda k: (-k.miss_launches, -k.whole_bytes, k.name))[:10]
    if rows:
        click.echo()
        click.echo(table(["KERNEL (2 MiB UNITS)", "RULE", "LAUNCHES", "WITH MISSES", "TOUCHED", "MODEL", "WHOLE"],
                         [[k.name if len(k.name) <= 60 else k.name[:57] + "...", k.rule, k.launches,
                           k.miss_launches, human_bytes(k.touched_bytes), human_bytes(k.model_bytes),
                           human_bytes(k.whole_bytes)] for k in rows]))
