"""`gpuos kmod|policy|events|trace` as a user and a script see them, without gpuos.ko.

This host has no gpuos.ko, so the commands that reach it must say so in one line
and exit 20 (kmod-not-loaded); argument errors exit 2 before anything is sent.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from click.testing import CliRunner

from gpuos.cli import events as events_cli
from gpuos.cli.main import cli
from gpuos.cli.policy import POLICIES
from gpuos.errors import BccUnavailable, KmodNotLoaded, Timeout
from gpuos.kernel.cgroups import cgroup_id
from gpuos.kernel.model import Client, Event, Fault, FaultBatch, Gap, Policy
from gpuos.kernel.uapi import Decision, EventType, FaultAccess, FaultPolicy, FaultType

from helpers import gpuos, gpuos_env


@pytest.fixture
def env(home):
    return gpuos_env(home.home)


@pytest.fixture(scope="module")
def no_module():
    """The family really is absent here (skip on a host that has gpuos.ko loaded)."""
    pytest.importorskip("pyroute2")
    from gpuos.kernel.netlink import GpuosNetlink
    try:
        GpuosNetlink().close()
    except KmodNotLoaded:
        return
    pytest.skip("gpuos.ko is loaded on this host")


def usage_error(res, *words: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert res.stdout == ""
    for w in words:
        assert w in res.stderr, res.stderr


def test_policy_names_are_the_headers():
    assert POLICIES == {"default": FaultPolicy.DEFAULT, "isolate": FaultPolicy.ISOLATE,
                        "kill-client": FaultPolicy.KILL_CLIENT}


def test_policy_set_bad_name(env):
    usage_error(gpuos(env, "policy", "set", "--pid", "5", "quarantine"),
                "'quarantine' is not one of 'default', 'isolate', 'kill-client'")


@pytest.mark.parametrize("args", [["isolate"], ["--pid", "5", "--cgroup", "7", "isolate"]])
def test_policy_set_needs_exactly_one_client(env, args):
    usage_error(gpuos(env, "policy", "set", *args), "give exactly one of --pid and --cgroup")


@pytest.mark.parametrize("cmd", ["get", "del"])
def test_policy_get_del_need_exactly_one_client(env, cmd):
    usage_error(gpuos(env, "policy", cmd), "give exactly one of --pid and --cgroup")
    usage_error(gpuos(env, "policy", cmd, "--pid", "1", "--cgroup", "1"), "exactly one")


def test_policy_set_bad_pid_and_cgroup(env, tmp_path):
    usage_error(gpuos(env, "policy", "set", "--pid", "0", "isolate"), "--pid")
    usage_error(gpuos(env, "policy", "set", "--cgroup", str(tmp_path / "none"), "isolate"),
                "no cgroup directory")
    usage_error(gpuos(env, "policy", "set", "--cgroup", str(tmp_path), "isolate"),
                "not a cgroup v2 directory")


def one_line(res, code: int) -> str:
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuos: "), res.stderr
    return lines[0]


@pytest.mark.parametrize("args", [["kmod", "info"], ["policy", "list"],
                                  ["policy", "set", "--pid", "1", "isolate"],
                                  ["policy", "get", "--cgroup", "12345"],
                                  ["policy", "del", "--pid", "1"], ["events", "--count", "1"],
                                  ["driver", "status"]])
def test_without_the_module(env, no_module, args):
    line = one_line(gpuos(env, *args), KmodNotLoaded.exit_code)
    assert line == 'gpuos: gpuos.ko is not loaded: no generic netlink family "gpuos" ' \
                   '(modprobe gpuos)'


def test_kmod_info_json_without_the_module(env, no_module):
    res = gpuos(env, "kmod", "info", "--json")
    assert res.returncode == 20 and res.stderr == ""
    data = json.loads(res.stdout)
    assert data["ok"] is False and data["error"] == "kmod-not-loaded" and data["exit_code"] == 20


def test_trace_without_bcc(env):
    if importlib.util.find_spec("bcc") is not None:
        pytest.skip("bcc is installed here")
    line = one_line(gpuos(env, "trace", "faults", "--duration", "1"), BccUnavailable.exit_code)
    assert "python3-bpfcc" in line


def test_cgroup_ids(tmp_path):
    cg = tmp_path / "job"
    cg.mkdir()
    (cg / "cgroup.controllers").write_text("")
    assert cgroup_id(str(cg)) == os.stat(cg).st_ino
    assert cgroup_id("job", root=tmp_path) == os.stat(cg).st_ino
    assert cgroup_id("4242") == 4242
    for bad in ("0", str(tmp_path / "nope"), str(tmp_path)):
        with pytest.raises(ValueError):
            cgroup_id(bad)


# -- `gpuos events` against a stand-in subscription ------------------------------------


class FakeSubscription:
    def __init__(self, events):
        self.events = list(events)

    def next(self, timeout=None):
        if self.events:
            ev = self.events.pop(0)
            if isinstance(ev, BaseException):
                raise ev
            return ev
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class FakeNetlink:
    def __init__(self, events):
        self.sub = FakeSubscription(events)

    def subscribe(self):
        return self.sub

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


FAULT = Fault(pid=77, cgroup=5, as_id=0x1000, veid=0, addr=0xDEAD000, access=FaultAccess.WRITE,
              type=FaultType.INVALID_PDE, gpu=0, decision=Decision.ISOLATE)


def run_events(monkeypatch, events, *args):
    monkeypatch.setattr(events_cli, "connect", lambda: FakeNetlink(events))
    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        runner = CliRunner()
    return runner.invoke(cli, ["events", *args], catch_exceptions=False)


def test_events_lines_and_gap_warning(monkeypatch):
    evs = [Event(seq=3, time_ns=1_500_000_000, type=EventType.FAULT, fault=FAULT),
           Event(seq=7, time_ns=2_000_000_000, type=EventType.POLICY_SET,
                 policy=Policy(Client(pid=77), FaultPolicy.KILL_CLIENT), gap=Gap(4, 6))]
    res = run_events(monkeypatch, evs, "--count", "2")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0] == ("3 1.500000 fault pid=77 cgroup=5 as_id=0x1000 veid=0 addr=0xdead000 "
                        "access=write type=invalid-pde gpu=0 decision=isolate")
    assert lines[1] == "7 2.000000 policy-set pid=77 policy=kill-client"
    assert res.stderr == "gpuos: missed 3 events (seq 4..6)\n"


def test_events_fault_batch_line(monkeypatch):
    fb = FaultBatch(pid=77, cgroup=None, as_id=0x10, gpu=1, batch_id=42, faults=3, instances=4,
                    fatal=0, throttled=1, skipped=2,
                    by_access={"read": 1, "write": 2, "atomic": 0, "prefetch": 0},
                    addr_min=0x1000, addr_max=0x5000, addrs=[0x1000, 0x5000])
    res = run_events(monkeypatch, [Event(seq=4, time_ns=0, type=EventType.FAULT_BATCH,
                                         fault_batch=fb)], "--count", "1")
    assert res.exit_code == 0, res.output
    assert res.stdout == ("4 0.000000 fault-batch pid=77 as_id=0x10 gpu=1 fault_batch=42 "
                          "faults=3 instances=4 fatal=0 throttled=1 skipped=2 read=1 write=2 "
                          "atomic=0 prefetch=0 addr_min=0x1000 addr_max=0x5000 "
                          "addrs=0x1000,0x5000\n")


def test_events_json_lines(monkeypatch):
    evs = [Event(seq=1, time_ns=5, type=EventType.MIGRATION_DONE, batch_id=9, as_id=2,
                 statuses=[0, -22]),
           Event(seq=2, time_ns=6, type=EventType.DRIVER_REGISTERED, driver_name="drv")]
    res = run_events(monkeypatch, evs, "--json", "--count", "2")
    assert res.exit_code == 0
    assert [json.loads(line) for line in res.stdout.splitlines()] == [
        {"seq": 1, "time_ns": 5, "type": "migration-done", "batch_id": 9, "as_id": 2,
         "statuses": [0, -22]},
        {"seq": 2, "time_ns": 6, "type": "driver-registered", "driver_name": "drv"}]


def test_events_timeout_short_of_count(monkeypatch):
    res = run_events(monkeypatch, [Event(seq=1, time_ns=0, type=EventType.FAULT, fault=FAULT)],
                     "--count", "2", "--timeout", "0.1")
    assert res.exit_code == Timeout.exit_code
    assert res.stderr == "gpuos: 1 of 2 event(s) within 0.1 s\n"


def test_events_timeout_alone_ends_cleanly(monkeypatch):
    res = run_events(monkeypatch, [], "--timeout", "0.1")
    assert res.exit_code == 0 and res.stdout == "" and res.stderr == ""


def test_events_ctrl_c_ends_cleanly(monkeypatch):
    res = run_events(monkeypatch, [Event(seq=1, time_ns=0, type=EventType.FAULT, fault=FAULT),
                                   KeyboardInterrupt()])
    assert res.exit_code == 0
    assert len(res.stdout.splitlines()) == 1 and res.stderr == ""


# -- `gpuos kmod info` and `gpuos policy` against a stand-in connection ------------------


class FakeKernel:
    """What GpuosNetlink answers, for the commands' output."""

    def __init__(self):
        from gpuos.kernel.model import KmodInfo
        self.info = KmodInfo(genl_version=1, abi_version=1, module_version="0.1.0",
                             driver_name="gpuos_testdrv", driver_caps=0b0111, event_seq=12,
                             counters={"faults": 3, "policies": 1})
        self.policies: dict[Client, FaultPolicy] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def get_info(self):
        return self.info

    def set_policy(self, client, policy):
        self.policies[client] = policy

    def get_policy(self, client):
        from gpuos.errors import NoSuchPolicy
        if client not in self.policies:
            raise NoSuchPolicy(f"reading the policy of {client.describe()}: no such policy")
        return Policy(client, self.policies[client])

    def del_policy(self, client):
        self.get_policy(client)
        del self.policies[client]

    def list_policies(self):
        return [Policy(c, p) for c, p in self.policies.items()]


@pytest.fixture
def kernel(monkeypatch):
    from gpuos.cli import kmod, policy
    fake = FakeKernel()
    monkeypatch.setattr(kmod, "connect", lambda: fake)
    monkeypatch.setattr(policy, "connect", lambda: fake)
    return fake


def invoke(*args):
    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        runner = CliRunner()
    return runner.invoke(cli, list(args), catch_exceptions=False)


def test_kmod_info_output(kernel):
    res = invoke("kmod", "info")
    assert res.exit_code == 0
    lines = res.stdout.splitlines()
    assert lines[0] == "module      gpuos 0.1.0 (netlink family version 1, ioctl ABI 1)"
    assert lines[1] == "driver      gpuos_testdrv (fault-reports, migrate, hint)"
    assert lines[2] == "last event  seq 12"
    assert lines[3].split() == ["COUNTER", "VALUE"] and lines[4].split() == ["faults", "3"]
    data = json.loads(invoke("kmod", "info", "--json").stdout)
    assert data == {"ok": True, "genl_version": 1, "abi_version": 1, "module_version": "0.1.0",
                    "driver": {"name": "gpuos_testdrv", "caps": ["fault-reports", "migrate", "hint"],
                               "caps_mask": 7},
                    "event_seq": 12, "counters": {"faults": 3, "policies": 1}}
    kernel.info = type(kernel.info)(**{**kernel.info.__dict__, "driver_name": None,
                                       "driver_caps": 0})
    assert "driver      none registered" in invoke("kmod", "info").stdout
    assert json.loads(invoke("kmod", "info", "--json").stdout)["driver"] is None


def test_policy_commands(kernel, tmp_path):
    assert invoke("policy", "set", "--pid", "42", "kill-client").stdout == "pid 42: kill-client\n"
    assert kernel.policies == {Client(pid=42): FaultPolicy.KILL_CLIENT}
    data = json.loads(invoke("policy", "set", "--cgroup", "99", "isolate", "--json").stdout)
    assert data == {"ok": True, "client": {"pid": None, "cgroup": 99}, "policy": "isolate"}
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "cgroup.controllers").write_text("")
    invoke("policy", "set", "--cgroup", str(cg), "default")
    assert kernel.policies[Client(cgroup=os.stat(cg).st_ino)] == FaultPolicy.DEFAULT
    assert invoke("policy", "get", "--pid", "42").stdout == "pid 42: kill-client\n"
    listed = json.loads(invoke("policy", "list", "--json").stdout)["policies"]
    assert {"client": {"pid": 42, "cgroup": None}, "policy": "kill-client"} in listed
    assert len(listed) == 3
    table_lines = invoke("policy", "list").stdout.splitlines()
    assert table_lines[0].split() == ["CLIENT", "POLICY"] and len(table_lines) == 4
    assert invoke("policy", "del", "--pid", "42").stdout == "pid 42: policy deleted\n"
    res = invoke("policy", "get", "--pid", "42")
    assert res.exit_code == 25
    assert res.stderr == "gpuos: reading the policy of pid 42: no such policy\n"
    res = invoke("policy", "del", "--pid", "42", "--json")
    assert res.exit_code == 25 and json.loads(res.stdout)["error"] == "no-such-policy"
