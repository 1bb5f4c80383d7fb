"""What an unprivileged user (nobody, no groups, no capabilities) may do: read, list,
ask the ABI version; and what it may not: change policies, migrate, submit, listen to
events (they name other users' processes and addresses).  One rule for every change,
netlink or ioctl: CAP_SYS_ADMIN; CAP_NET_ADMIN alone is not enough."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import vmlib
from vmlib import UNPRIV, gpuos_cli
from gpuos.kernel.model import Client, Policy
from gpuos.kernel.uapi import FaultPolicy

pytestmark = pytest.mark.vm

AS_NOBODY = r"""
import ctypes, errno, json, os, sys
from gpuos.errors import NotPermitted
from gpuos.kernel.chardev import Chardev, build_batch
from gpuos.kernel.model import Client, Range
from gpuos.kernel.netlink import GpuosNetlink
from gpuos.kernel.uapi import IOC_SUBMIT, Attr, Cmd, FaultPolicy, Op
import fuzzlib, vmlib

pid = int(sys.argv[1])
status = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\t" in l)
out = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(),
       "capeff": status["CapEff"].strip()}

def refused(call):
    try:
        call()
    except NotPermitted as exc:
        return "not permitted: " + exc.message
    return "accepted"

with GpuosNetlink() as nl:
    out["info"] = nl.get_info().to_json()
    out["list"] = [p.to_json() for p in nl.list_policies()]
    out["get"] = nl.get_policy(Client(pid=pid)).to_json()
    out["set"] = refused(lambda: nl.set_policy(Client(pid=pid), FaultPolicy.DEFAULT))
    out["del"] = refused(lambda: nl.del_policy(Client(pid=pid)))
    out["migrate"] = refused(lambda: nl.migrate(1, Op.MIGRATE, [Range(0x1000, 0x1000)]))
    out["prefetch"] = refused(lambda: nl.set_prefetch(1, [(0x1000, 0x1000)]))
    out["subscribe"] = refused(lambda: nl.subscribe().close())
with vmlib.Genl() as raw:  # the errnos themselves
    ok = vmlib.migrate_payload(1, 0, [vmlib.range_nest(0x1000, 0x1000)])
    out["errno"] = {
        "get_info": raw.request(Cmd.GET_INFO)[0],
        "list": raw.request(Cmd.LIST_POLICIES, dump=True)[0],
        "set": raw.set_policy("pid", pid, 0),
        "del": raw.del_policy("pid", pid),
        "migrate": raw.request(Cmd.MIGRATE, ok)[0],
        "set_malformed": raw.request(Cmd.SET_POLICY, vmlib.u32(Attr.OP, 1))[0],
        "set_prefetch": raw.request(Cmd.SET_PREFETCH, vmlib.u64(Attr.AS_ID, 1))[0],
    }
with Chardev() as dev:
    out["abi"] = dev.abi_version()
    out["submit"] = refused(lambda: dev.submit(1, Op.MIGRATE, [Range(0x1000, 0x1000)]))
    batch, array = build_batch(1, Op.MIGRATE, [Range(0x1000, 0x1000)])
    out["errno"]["submit"] = fuzzlib.sys_ioctl(dev.fd, IOC_SUBMIT, ctypes.addressof(batch))
    out["errno"]["submit_bad_pointer"] = fuzzlib.sys_ioctl(dev.fd, IOC_SUBMIT, 8)
print(json.dumps(out))
"""


# nobody with CAP_NET_ADMIN, and only that, effective (ambient across the exec)
NET_ADMIN_ONLY = [*UNPRIV[:-1], "--inh-caps=-all,+net_admin", "--ambient-caps=+net_admin"]


@pytest.mark.parametrize("caps", ["none", "net_admin"])
def test_unprivileged_user(testdrv, nl, sleepers, caps):
    p = sleepers()
    nl.set_policy(Client(pid=p.pid), FaultPolicy.KILL_CLIENT)
    env = vmlib.unpriv_env()
    prefix = UNPRIV if caps == "none" else NET_ADMIN_ONLY
    # both at once: each starts a Python that imports pyroute2
    script = subprocess.Popen(prefix + [sys.executable, "-c", AS_NOBODY, str(p.pid)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    cli = gpuos_cli("policy", "set", "--pid", str(p.pid), "isolate", unpriv=True, env=env,
                    popen=True)
    out, err = script.communicate(timeout=120)
    cli_out, cli_err = cli.communicate(timeout=120)
    assert script.returncode == 0, (out, err)
    res = json.loads(out)
    assert (res["uid"], res["gid"], res["groups"]) == (65534, 65534, [])
    assert int(res["capeff"], 16) == (0 if caps == "none" else 1 << 12)  # CAP_NET_ADMIN is bit 12
    # what anyone may do
    assert res["info"]["module_version"] and res["info"]["driver"]["name"] == "gpuos-testdrv"
    assert res["list"] == [Policy(Client(pid=p.pid), FaultPolicy.KILL_CLIENT).to_json()]
    assert res["get"]["policy"] == "kill-client"
    assert res["abi"] == 1
    # what needs CAP_SYS_ADMIN, through netlink or the ioctl, listening included
    for what in ("set", "del", "migrate", "prefetch", "submit", "subscribe"):
        assert res[what].startswith("not permitted: ") and "CAP_SYS_ADMIN" in res[what], res
    # EPERM; a malformed request is refused for its form first (EINVAL), as for root
    assert res["errno"] == {"get_info": 0, "list": 0, "set": 1, "del": 1, "migrate": 1,
                            "set_malformed": 22, "set_prefetch": 1,
                            "submit": 1, "submit_bad_pointer": 1}
    # the CLI, as nobody runs it
    assert cli.returncode == 4, (cli.returncode, cli_out, cli_err)
    assert cli_out == ""
    assert cli_err.strip() == (f"gpuos: setting the policy of pid {p.pid}: not permitted "
                               f"(needs CAP_SYS_ADMIN)"), cli_err
    # nothing changed
    assert nl.list_policies() == [Policy(Client(pid=p.pid), FaultPolicy.KILL_CLIENT)]
    assert vmlib.pending() == []
    assert p.alive()
