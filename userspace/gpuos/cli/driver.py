"""`gpuos driver status`: which GPU driver gpuos.ko has, and whether it is the patched one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from ..kernel import connect
from ..kernel.model import KmodInfo
from .output import emit_json, json_option

SYS_MODULE = Path("/sys/module")
# The name patches/0002-uvm-gpuos-attach.patch registers nvidia-uvm with.
PATCHED_UVM_NAME = "nvidia-uvm"
# The module parameters the patches add to nvidia-uvm (0002, 0003, 0004).
UVM_PARAMS = ("uvm_gpuos_attach", "uvm_gpuos_isolate", "uvm_gpuos_batch_notify_us")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _param(path: Path) -> int | str | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return text


def driver_status(info: KmodInfo, sys_module: Path = SYS_MODULE) -> dict[str, Any]:
    """What `driver status --json` prints (without "ok"), from GET_INFO and sysfs."""
    driver = None
    if info.driver_name is not None:
        driver = {"name": info.driver_name, "caps": info.caps, "caps_mask": info.driver_caps,
                  "patched_nvidia_uvm": info.driver_name == PATCHED_UVM_NAME}
    uvm = None
    uvm_dir = sys_module / "nvidia_uvm"
    if uvm_dir.is_dir():
        params = {p: _param(uvm_dir / "parameters" / p) for p in UVM_PARAMS}
        uvm = {"patched": (uvm_dir / "parameters" / "uvm_gpuos_attach").exists(),
               "parameters": params}
    return {"kmod": {"loaded": True, "module_version": info.module_version,
                     "genl_version": info.genl_version, "abi_version": info.abi_version},
            "driver": driver, "nvidia_uvm": uvm,
            "nvidia_version": _read(sys_module / "nvidia" / "version")}


def status_lines(st: dict[str, Any]) -> list[str]:
    """The status for people, one fact a line."""
    k = st["kmod"]
    lines = [f"gpuos.ko     loaded, version {k['module_version'] or '?'}"]
    d = st["driver"]
    if d is None:
        lines.append("driver       none registered")
    else:
        caps = ", ".join(d["caps"]) or "no capabilities"
        what = "the patched nvidia-uvm" if d["patched_nvidia_uvm"] else "not the patched nvidia-uvm"
        lines.append(f"driver       {d['name']} ({caps}): {what}")
    uvm = st["nvidia_uvm"]
    if uvm is None:
        lines.append("nvidia-uvm   not loaded")
    elif not uvm["patched"]:
        lines.append("nvidia-uvm   loaded, not patched for gpuos (no uvm_gpuos_attach parameter)")
    else:
        params = " ".join(f"{k}={'?' if v is None else v}" for k, v in uvm["parameters"].items())
        lines.append(f"nvidia-uvm   patched: {params}")
        if uvm["parameters"].get("uvm_gpuos_attach") == 0:
            lines.append("             not attached: echo 1 > "
                         "/sys/module/nvidia_uvm/parameters/uvm_gpuos_attach")
    version = st["nvidia_version"]
    lines.append(f"nvidia       {'version ' + version if version else 'not loaded'}")
    return lines


@click.group()
def driver() -> None:
    """The GPU driver behind gpuos.ko: registered or not, patched or not.

    Without gpuos.ko these commands exit 20.
    """


@driver.command("status")
@json_option
def status_cmd(as_json: bool) -> None:
    """Show whether a GPU driver is registered with gpuos.ko and whether it is the patched one.

    \b
    Reports: gpuos.ko's version; the registered driver's name and
    capabilities (fault-reports, migrate, hint, stop-client) and whether it
    is the patched nvidia-uvm (it registers as "nvidia-uvm"); if nvidia-uvm
    is loaded, whether it has the gpuos patches and their parameters
    (uvm_gpuos_attach: 1 while attached, uvm_gpuos_isolate,
    uvm_gpuos_batch_notify_us); the nvidia module's version. Anyone may run
    this; exits 20 when gpuos.ko is not loaded.
    """
    with connect() as nl:
        info = nl.get_info()
    st = driver_status(info, SYS_MODULE)
    if as_json:
        emit_json({"ok": True, **st})
        return
    for line in status_lines(st):
        click.echo(line)
