"""`gpuos mem`: the GPU memory scheduler of processes under `gpuos run --gpu-memory`."""

from __future__ import annotations

from dataclasses import asdict

import click

from .. import procs
from ..errors import GpuosError, NoSuchProcess, NotTracked
from ..movable.agent import Agent, AgentError, agent_available
from ..movable.share import GroupStats, check_name, group_names, read_group
from .output import emit_json, human_bytes, json_option, table


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
        ["copied in", f"{human_bytes(st.bytes_in)} in {st.swap_ins} copies, {rate(st.bytes_in, st.in_ns)}"],
        ["copied out", f"{human_bytes(st.bytes_out)} in {st.evictions} evictions, {rate(st.bytes_out, st.out_ns)}"],
        ["not copied out (unchanged)", human_bytes(st.clean_bytes)],
        ["host memory pinned ahead", f"{human_bytes(st.host_prepared)} (before any eviction needed it)"
         + (f"; {st.pageable_hosts} allocations pageable (could not be pinned)" if st.pageable_hosts else "")],
        ["copied in ahead of use", f"{human_bytes(st.ahead_bytes)}; {st.ahead_hits} found by their call "
                                   f"({st.ahead_waits} waited for the copy), {st.ahead_unused} evicted unused"],
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
