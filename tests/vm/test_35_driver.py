"""`gpuos driver status` as a user runs it: with the test driver registered, without a
driver, and without gpuos.ko (exit 20). The guest has no NVIDIA modules, so nvidia-uvm
and the nvidia version read as absent (the host's unit tests cover the patched case)."""

from __future__ import annotations

import json

import pytest

import vmlib
from vmlib import gpuos_cli

pytestmark = pytest.mark.vm


def status(*args: str) -> tuple[int, dict]:
    p = gpuos_cli("driver", "status", "--json", *args)
    assert p.stderr == "", p.stderr
    return p.returncode, json.loads(p.stdout)


def test_driver_status_with_and_without_the_test_driver(testdrv):
    rc, st = status()
    assert rc == 0, st
    assert st["ok"] is True and st["kmod"]["loaded"] is True
    assert st["kmod"]["module_version"] == vmlib.header_defines(vmlib.VERSION_H)[
        "GPUOS_MODULE_VERSION"].strip('"')
    assert st["driver"] == {"name": "gpuos-testdrv",
                            "caps": ["fault-reports", "migrate", "hint", "stop-client"],
                            "caps_mask": 15, "patched_nvidia_uvm": False}
    assert st["nvidia_uvm"] is None and st["nvidia_version"] is None
    # unregistered (the module stays loaded): no driver
    assert vmlib.dbg_write("register", "0\n") == 0
    try:
        rc, st = status()
        assert rc == 0 and st["ok"] is True and st["driver"] is None
        text = gpuos_cli("driver", "status")
        assert text.returncode == 0, text
        assert text.stdout.splitlines()[1:] == ["driver       none registered",
                                                "nvidia-uvm   not loaded",
                                                "nvidia       not loaded"]
    finally:
        assert vmlib.dbg_write("register", "1\n") == 0


def test_driver_status_without_gpuos(kmod):
    kmod.unload_all()
    try:
        rc, st = status()
        assert rc == 20
        assert (st["ok"], st["error"], st["exit_code"]) == (False, "kmod-not-loaded", 20)
    finally:
        kmod.ensure_gpuos()
