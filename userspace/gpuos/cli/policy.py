"""`gpuos policy`: what gpuos.ko does when a client's GPU work faults."""

from __future__ import annotations

import click

from ..kernel import connect
from ..kernel.cgroups import cgroup_id
from ..kernel.model import Client, Policy
from ..kernel.uapi import FaultPolicy, policy_name
from .output import emit_json, json_option, table

POLICIES = {policy_name(p): p for p in FaultPolicy}  # default, isolate, kill-client


def _cgroup(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return cgroup_id(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def client_options(f):
    f = click.option("--cgroup", metavar="PATH|ID", callback=_cgroup,
                     help="A cgroup v2: its directory (absolute, or relative to /sys/fs/cgroup) "
                          "or its id (the directory's inode number).")(f)
    f = click.option("--pid", type=click.IntRange(min=1), metavar="PID", help="A process.")(f)
    return f


def _client(pid: int | None, cgroup: int | None) -> Client:
    if (pid is None) == (cgroup is None):
        raise click.UsageError("give exactly one of --pid and --cgroup")
    return Client(pid=pid, cgroup=cgroup)


def _line(p: Policy) -> str:
    return f"{p.client.describe()}: {policy_name(p.policy)}"


@click.group()
def policy() -> None:
    """Fault policies: default, isolate or kill-client, per pid or cgroup.

    What happens to a client whose GPU work faults.

    \b
    POLICY is one of:
      default      the driver does what it always did (with MPS: every client
                   sharing the GPU dies with the faulting one)
      isolate      stop only the faulting client; the others go on
      kill-client  isolate it, then kill the client process

    A client is a process (--pid) or a cgroup v2 (--cgroup). For a fault,
    gpuos.ko looks up the faulting process's policy, then its cgroup's and
    each ancestor cgroup's; without any, `default`. Needs a registered,
    patched GPU driver to have any effect; setting and deleting need
    CAP_SYS_ADMIN.
    """


@policy.command("set")
@client_options
@click.argument("policy_name", metavar="POLICY", type=click.Choice(list(POLICIES)))
@json_option
def set_cmd(pid: int | None, cgroup: int | None, policy_name: str, as_json: bool) -> None:
    """Set the fault policy of one client (replacing any it had)."""
    client = _client(pid, cgroup)
    with connect() as nl:
        nl.set_policy(client, POLICIES[policy_name])
    p = Policy(client, POLICIES[policy_name])
    if as_json:
        emit_json({"ok": True, **p.to_json()})
    else:
        click.echo(_line(p))


@policy.command("get")
@client_options
@json_option
def get_cmd(pid: int | None, cgroup: int | None, as_json: bool) -> None:
    """Show the fault policy a client has of its own (exit 25 if none)."""
    client = _client(pid, cgroup)
    with connect() as nl:
        p = nl.get_policy(client)
    if as_json:
        emit_json({"ok": True, **p.to_json()})
    else:
        click.echo(_line(p))


@policy.command("del")
@client_options
@json_option
def del_cmd(pid: int | None, cgroup: int | None, as_json: bool) -> None:
    """Delete a client's fault policy (exit 25 if it had none)."""
    client = _client(pid, cgroup)
    with connect() as nl:
        nl.del_policy(client)
    if as_json:
        emit_json({"ok": True, "client": client.to_json()})
    else:
        click.echo(f"{client.describe()}: policy deleted")


@policy.command("list")
@json_option
def list_cmd(as_json: bool) -> None:
    """List every fault policy that is set."""
    with connect() as nl:
        policies = nl.list_policies()
    if as_json:
        emit_json({"ok": True, "policies": [p.to_json() for p in policies]})
        return
    click.echo(table(["CLIENT", "POLICY"], [[p.client.describe(), policy_name(p.policy)]
                                            for p in policies]))
