"""`gpuos images`: the image store."""

from __future__ import annotations

from dataclasses import asdict

import click

from ..errors import GpuosError, ImageNotFound
from ..runtime import Runtime
from .output import Reporter, emit_json, human_bytes, json_option, table


@click.group()
def images() -> None:
    """List, inspect, verify and delete checkpoint images.

    An image is a directory with manifest.json and CRIU's files under criu/;
    docs/image-format.md describes it. IMAGE is a name in the store or a path.
    """


@images.command("list")
@json_option
@click.pass_obj
def list_cmd(rt: Runtime, as_json: bool) -> None:
    """List the images in the store, newest first."""
    entries = sorted(rt.store.entries(), key=lambda e: e.manifest.created if e.manifest else "",
                     reverse=True)
    if as_json:
        emit_json({"ok": True, "store": rt.store.root, "images": [
            {"name": e.name, "path": e.path, "problem": e.problem,
             **({"created": e.manifest.created, "size": e.manifest.total_size,
                 "pids": [p.pid for p in e.manifest.processes], "gpu_pids": e.manifest.gpu_pids,
                 "command": e.manifest.processes[0].cmdline} if e.manifest else {})}
            for e in entries]})
        return
    rows = []
    for e in entries:
        if e.manifest:
            m = e.manifest
            gpus = ",".join(sorted({g.name for g in m.gpus})) or "-"
            rows.append([e.name, m.created, human_bytes(m.total_size), m.root_pid, gpus,
                         " ".join(m.processes[0].cmdline)[:50]])
        else:
            rows.append([e.name, "BROKEN", "-", "-", "-", e.problem])
    click.echo(f"store: {rt.store.root}", err=True)
    click.echo(table(["NAME", "CREATED", "SIZE", "PID", "GPU", "COMMAND"], rows))


@images.command("show")
@click.argument("image")
@json_option
@click.pass_obj
def show_cmd(rt: Runtime, image: str, as_json: bool) -> None:
    """Show an image's manifest: processes, GPUs, driver, files, phase times."""
    path = rt.store.resolve(image)
    m = rt.store.load(path)
    if as_json:
        emit_json({"ok": True, "path": path, "manifest": asdict(m), "size": m.total_size})
        return
    click.echo(f"image      {path}\ncreated    {m.created} on {m.hostname} (kernel {m.kernel})")
    click.echo(f"format     {m.format} v{m.format_version}, gpuos {m.gpuos_version}, criu {m.criu_version}")
    if m.driver:
        click.echo(f"driver     {m.driver.version} (CUDA API {m.driver.cuda_api})")
    for g in m.gpus:
        click.echo(f"gpu        {g.name} {g.uuid}: {human_bytes(g.memory_used_by_image)} used")
    click.echo(f"size       {human_bytes(m.total_size)} in {len(m.files)} files")
    click.echo(table(["PID", "GPU", "THREADS", "COMMAND"],
                     [[p.pid, "yes" if p.uses_gpu else "no", len(p.tids), " ".join(p.cmdline)[:70]]
                      for p in m.processes]))
    click.echo(table(["phase", "seconds"], [[k, f"{v:.3f}"] for k, v in m.timings.items()]))


@images.command("verify")
@click.argument("image")
@json_option
@click.pass_obj
def verify_cmd(rt: Runtime, image: str, as_json: bool) -> None:
    """Check that every file of an image is present with its size and sha256."""
    path = rt.store.resolve(image)
    m = rt.store.load(path)
    rep = Reporter(quiet=as_json)
    rt.store.verify(path, m, rep.bytes_progress("verify", m.total_size))
    rep.finish()
    if as_json:
        emit_json({"ok": True, "path": path, "files": len(m.files), "size": m.total_size})
    else:
        click.echo(f"{path}: OK, {len(m.files)} files, {human_bytes(m.total_size)}")


@images.command("rm")
@click.argument("names", nargs=-1, required=True)
@json_option
@click.pass_obj
def rm_cmd(rt: Runtime, names: tuple[str, ...], as_json: bool) -> None:
    """Delete images (broken ones too)."""
    rt.recover()
    removed = []
    for name in names:
        path = rt.store.resolve(name)
        if not path.is_dir():
            raise ImageNotFound(f"no image at {path}")
        if not ((path / "manifest.json").is_file() or (path / "criu").is_dir()):
            raise GpuosError(f"{path} is not a gpuos image; not deleting it")
        rt.store.remove(path)
        removed.append(str(path))
        if not as_json:
            click.echo(f"removed {path}")
    if as_json:
        emit_json({"ok": True, "removed": removed})
