"""`gpuos kmod`: the state of gpuos.ko."""

from __future__ import annotations

import click

from ..kernel import connect
from .output import emit_json, json_option, table


@click.group()
def kmod() -> None:
    """The gpuos.ko kernel module: versions, GPU driver, counters.

    gpuos.ko is where a patched GPU driver reports faults and asks for
    decisions. It keeps fault policies (`gpuos policy`), takes batched migrations and
    sends events (`gpuos events`); its tracepoints are what `gpuos trace` reads.
    Without the module these commands exit 20.
    """


@kmod.command("info")
@json_option
def info_cmd(as_json: bool) -> None:
    """Show gpuos.ko's versions, its GPU driver, its counters and the last event.

    The driver is the GPU driver registered with gpuos.ko (a patched
    nvidia-uvm, or a test driver), with its capabilities: fault-reports
    (reports faults, obeys decisions), migrate, hint, stop-client. Counters
    count since the module was loaded. Anyone may run this.
    """
    with connect() as nl:
        info = nl.get_info()
    if as_json:
        emit_json({"ok": True, **info.to_json()})
        return
    click.echo(f"module      gpuos {info.module_version or '?'} (netlink family version "
               f"{info.genl_version}, ioctl ABI {info.abi_version})")
    if info.driver_name is None:
        click.echo("driver      none registered")
    else:
        caps = ", ".join(info.caps) or "no capabilities"
        click.echo(f"driver      {info.driver_name} ({caps})")
    click.echo(f"last event  seq {info.event_seq}")
    click.echo(table(["COUNTER", "VALUE"], [[k, v] for k, v in info.counters.items()]))
