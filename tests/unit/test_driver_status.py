"""`gpuos driver status`: what it reads (GET_INFO, /sys/module) and prints, without gpuos.ko.

A fake /sys/module tree and a KmodInfo stand in for the kernel; the CLI is run with
connect() replaced.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuos.cli import driver as driver_cli
from gpuos.cli.main import cli
from gpuos.errors import KmodNotLoaded
from gpuos.kernel.model import KmodInfo
from gpuos.kernel.uapi import DriverCaps

UVM_CAPS = int(DriverCaps.FAULT_REPORTS | DriverCaps.MIGRATE | DriverCaps.HINT)


def info(name: str | None, caps: int = 0) -> KmodInfo:
    return KmodInfo(genl_version=1, abi_version=1, module_version="0.1.0", driver_name=name,
                    driver_caps=caps, event_seq=0, counters={})


def sysfs(root: Path, uvm: dict[str, str] | None = None, patched: bool = True,
          nvidia: str | None = None) -> Path:
    """/sys/module with nvidia_uvm (its parameters) and nvidia (its version), as asked."""
    if uvm is not None:
        params = root / "nvidia_uvm" / "parameters"
        params.mkdir(parents=True)
        (params / "uvm_perf_fault_batch_count").write_text("256\n")
        for k, v in uvm.items() if patched else ():
            (params / k).write_text(v + "\n")
    if nvidia is not None:
        (root / "nvidia").mkdir(parents=True)
        (root / "nvidia" / "version").write_text(nvidia + "\n")
    return root


def test_patched_nvidia_uvm_attached(tmp_path):
    root = sysfs(tmp_path, {"uvm_gpuos_attach": "1", "uvm_gpuos_isolate": "1",
                            "uvm_gpuos_batch_notify_us": "1000"}, nvidia="550.163.01")
    st = driver_cli.driver_status(info("nvidia-uvm", UVM_CAPS), root)
    assert st == {
        "kmod": {"loaded": True, "module_version": "0.1.0", "genl_version": 1, "abi_version": 1},
        "driver": {"name": "nvidia-uvm", "caps": ["fault-reports", "migrate", "hint"],
                   "caps_mask": UVM_CAPS, "patched_nvidia_uvm": True},
        "nvidia_uvm": {"patched": True, "parameters": {
            "uvm_gpuos_attach": 1, "uvm_gpuos_isolate": 1, "uvm_gpuos_batch_notify_us": 1000}},
        "nvidia_version": "550.163.01"}
    assert driver_cli.status_lines(st) == [
        "gpuos.ko     loaded, version 0.1.0",
        "driver       nvidia-uvm (fault-reports, migrate, hint): the patched nvidia-uvm",
        "nvidia-uvm   patched: uvm_gpuos_attach=1 uvm_gpuos_isolate=1 "
        "uvm_gpuos_batch_notify_us=1000",
        "nvidia       version 550.163.01"]


def test_patched_nvidia_uvm_detached(tmp_path):
    root = sysfs(tmp_path, {"uvm_gpuos_attach": "0", "uvm_gpuos_isolate": "0"})
    st = driver_cli.driver_status(info(None), root)
    assert st["driver"] is None and st["nvidia_version"] is None
    assert st["nvidia_uvm"] == {"patched": True, "parameters": {
        "uvm_gpuos_attach": 0, "uvm_gpuos_isolate": 0, "uvm_gpuos_batch_notify_us": None}}
    lines = driver_cli.status_lines(st)
    assert lines[1] == "driver       none registered"
    assert lines[2] == ("nvidia-uvm   patched: uvm_gpuos_attach=0 uvm_gpuos_isolate=0 "
                        "uvm_gpuos_batch_notify_us=?")
    assert "echo 1 > /sys/module/nvidia_uvm/parameters/uvm_gpuos_attach" in lines[3]
    assert lines[4] == "nvidia       not loaded"


def test_stock_nvidia_uvm_and_another_driver(tmp_path):
    root = sysfs(tmp_path, {}, patched=False, nvidia="580.159.04")
    st = driver_cli.driver_status(info("gpuos-testdrv", 15 | (1 << 9)), root)
    assert st["driver"]["patched_nvidia_uvm"] is False
    assert st["driver"]["caps"] == ["fault-reports", "migrate", "hint", "stop-client", "bit-9"]
    assert st["nvidia_uvm"]["patched"] is False
    lines = driver_cli.status_lines(st)
    assert lines[1].endswith(": not the patched nvidia-uvm")
    assert lines[2] == ("nvidia-uvm   loaded, not patched for gpuos "
                        "(no uvm_gpuos_attach parameter)")


def test_no_nvidia_modules(tmp_path):
    st = driver_cli.driver_status(info("gpuos-testdrv", 0), tmp_path)
    assert st["nvidia_uvm"] is None and st["nvidia_version"] is None
    lines = driver_cli.status_lines(st)
    assert lines[1] == "driver       gpuos-testdrv (no capabilities): not the patched nvidia-uvm"
    assert lines[2:] == ["nvidia-uvm   not loaded", "nvidia       not loaded"]


class FakeNetlink:
    def __init__(self, reply: KmodInfo | Exception):
        self.reply = reply

    def __enter__(self):
        if isinstance(self.reply, Exception):
            raise self.reply
        return self

    def __exit__(self, *exc):
        pass

    def get_info(self) -> KmodInfo:
        return self.reply


def run(monkeypatch, tmp_path, reply, *args):
    monkeypatch.setattr(driver_cli, "connect", lambda: FakeNetlink(reply))
    monkeypatch.setattr(driver_cli, "SYS_MODULE", tmp_path)
    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        runner = CliRunner()
    return runner.invoke(cli, ["driver", "status", *args], catch_exceptions=False)


def test_cli_json_and_text(monkeypatch, tmp_path):
    sysfs(tmp_path, {"uvm_gpuos_attach": "1", "uvm_gpuos_isolate": "1",
                     "uvm_gpuos_batch_notify_us": "0"}, nvidia="550.163.01")
    res = run(monkeypatch, tmp_path, info("nvidia-uvm", UVM_CAPS), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["ok"] is True and data["driver"]["patched_nvidia_uvm"] is True
    assert data["nvidia_uvm"]["parameters"]["uvm_gpuos_batch_notify_us"] == 0
    res = run(monkeypatch, tmp_path, info("nvidia-uvm", UVM_CAPS))
    assert res.exit_code == 0 and res.stdout.splitlines()[0].startswith("gpuos.ko     loaded")


@pytest.mark.parametrize("as_json", [False, True])
def test_cli_without_the_module(monkeypatch, tmp_path, as_json):
    err = KmodNotLoaded('gpuos.ko is not loaded: no generic netlink family "gpuos" '
                        '(modprobe gpuos)')
    res = run(monkeypatch, tmp_path, err, *(["--json"] if as_json else []))
    assert res.exit_code == KmodNotLoaded.exit_code == 20
    if as_json:
        data = json.loads(res.stdout)
        assert (data["ok"], data["error"], data["exit_code"]) == (False, "kmod-not-loaded", 20)
    else:
        assert res.stdout == "" and res.stderr.startswith("gpuos: gpuos.ko is not loaded")
