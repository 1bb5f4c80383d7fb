"""`gpuos images`: the image store."""

from __future__ import annotations

from dataclasses import asdict

import click

from ..errors import GpuosError, ImageNotFound
from ..runtime import Runtime
from .output import Reporter, emit_json, human_bytes, json_option, table


@click.group()
def images() -> None:
    """List, inspect, verify and delete checkpoint images; manage the chunk store.

    An image is a directory with manifest.json; its files' contents are chunks named by
    their BLAKE3 hash, kept once in the store's .chunks/ however many images use them
    (docs/image-format.md). IMAGE is a name in the store or a path.
    """


@images.command("list")
@json_option
@click.pass_obj
def list_cmd(rt: Runtime, as_json: bool) -> None:
    """List the images in the store, newest first: SIZE is what a restore reads, OWN the
    bytes only this image uses (freed with it), SHARED the bytes it shares with others."""
    entries = sorted(rt.store.entries(), key=lambda e: e.manifest.created if e.manifest else "",
                     reverse=True)
    usage = rt.store.usage(entries)
    on_disk = rt.store.chunks().present()
    stored = sum(on_disk.values())
    hot = rt.store.chunks().hot_bytes()
    if as_json:
        emit_json({"ok": True, "store": rt.store.root, "chunk_bytes": stored, "chunks": len(on_disk),
                   "hot_bytes": hot, "images": [
            {"name": e.name, "path": e.path, "problem": e.problem,
             **({"created": e.manifest.created, "size": e.manifest.total_size,
                 "own_bytes": usage[e.name].own, "shared_bytes": usage[e.name].shared,
                 "format_version": e.manifest.format_version,
                 "pids": [p.pid for p in e.manifest.processes], "gpu_pids": e.manifest.gpu_pids,
                 "command": e.manifest.processes[0].cmdline} if e.manifest else {})}
            for e in entries]})
        return
    rows = []
    for e in entries:
        if e.manifest:
            m, u = e.manifest, usage[e.name]
            gpus = ",".join(sorted({g.name for g in m.gpus})) or "-"
            rows.append([e.name, m.created, human_bytes(m.total_size), human_bytes(u.own),
                         human_bytes(u.shared), m.root_pid, gpus, " ".join(m.processes[0].cmdline)[:50]])
        else:
            rows.append([e.name, "BROKEN", "-", "-", "-", "-", "-", e.problem])
    click.echo(f"store: {rt.store.root}: {human_bytes(stored)} in {len(on_disk)} chunks"
               + (f", {human_bytes(hot)} of them in memory" if hot else ""), err=True)
    click.echo(table(["NAME", "CREATED", "SIZE", "OWN", "SHARED", "PID", "GPU", "COMMAND"], rows))


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
    click.echo(f"size       {human_bytes(m.total_size)} in {len(m.files)} files"
               + (f", {len(m.chunk_set())} chunks ({human_bytes(sum(m.chunk_set().values()))} distinct)"
                  if m.chunked else ""))
    click.echo(table(["PID", "GPU", "THREADS", "COMMAND"],
                     [[p.pid, "yes" if p.uses_gpu else "no", len(p.tids), " ".join(p.cmdline)[:70]]
                      for p in m.processes]))
    click.echo(table(["phase", "seconds"], [[k, f"{v:.3f}"] for k, v in m.timings.items()]))


@images.command("verify")
@click.argument("image")
@json_option
@click.pass_obj
def verify_cmd(rt: Runtime, image: str, as_json: bool) -> None:
    """Check every chunk of an image (read, and hashed against its name); for an image of
    format 4 or older, every file's size and sha256."""
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
    """Delete images (broken ones too), then the store's chunks no image uses any more
    (unless a checkpoint or restore holds the store: then at the next `gpuos images gc`)."""
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
    try:
        gc = rt.store.gc()
        freed = {"chunks": gc.chunks, "bytes": gc.bytes}
        note = f"freed {human_bytes(gc.bytes)} ({gc.chunks} chunks no image uses)"
    except GpuosError as exc:  # busy, or a broken image: the images are gone all the same
        freed = None
        note = f"chunks not collected: {exc.message}"
    if as_json:
        emit_json({"ok": True, "removed": removed, "freed": freed})
    else:
        click.echo(note, err=True)


@images.command("gc")
@click.option("--wait", type=float, default=0.0, show_default=True, metavar="S",
              help="Wait up to S seconds for checkpoints and restores that hold the store.")
@json_option
@click.pass_obj
def gc_cmd(rt: Runtime, wait: float, as_json: bool) -> None:
    """Delete the chunks no image in the store uses (from disk and memory).  Exit 18 if a
    checkpoint, restore or verify holds the store; exit 10 if an image cannot be read
    (which chunks it uses is unknown: nothing is deleted)."""
    rt.recover()
    res = rt.store.gc(wait)
    if as_json:
        emit_json({"ok": True, **asdict(res)})
    else:
        click.echo(f"freed {human_bytes(res.bytes)} ({res.chunks} chunks); the store keeps "
                   f"{human_bytes(res.kept_bytes)} in {res.kept} chunks")


def _chunked(rt: Runtime, image: str):
    path = rt.store.resolve(image)
    m = rt.store.load(path)
    if not m.chunked:
        raise GpuosError(f"{path} is an image of format {m.format_version}, without chunks: "
                         "it is read from disk as it is")
    return path, m


@images.command("warm")
@click.argument("image")
@json_option
@click.pass_obj
def warm_cmd(rt: Runtime, image: str, as_json: bool) -> None:
    """Keep an image's chunks in memory (the hot tier, tmpfs under $GPUOS_HOT), so that a
    restore reads nothing from disk.  Undo with `gpuos images cool`."""
    path, m = _chunked(rt, image)
    chunks = rt.store.chunks_of(path, m)
    with chunks.shared():
        copied = chunks.warm(m.files and [c for f in m.files for c in f.chunks])
    total = sum(m.chunk_set().values())
    if as_json:
        emit_json({"ok": True, "path": path, "bytes": total, "copied": copied, "hot": chunks.hot})
    else:
        click.echo(f"{path}: {human_bytes(total)} in memory ({human_bytes(copied)} copied now) in {chunks.hot}")


@images.command("cool")
@click.argument("image")
@json_option
@click.pass_obj
def cool_cmd(rt: Runtime, image: str, as_json: bool) -> None:
    """Drop an image's chunks from memory: from the hot tier and from the page cache, so
    that the next restore reads them from disk (what a cold start measures)."""
    path, m = _chunked(rt, image)
    chunks = rt.store.chunks_of(path, m)
    dropped = chunks.cool([c for f in m.files for c in f.chunks])
    if as_json:
        emit_json({"ok": True, "path": path, "dropped": dropped})
    else:
        click.echo(f"{path}: its chunks dropped from memory ({human_bytes(dropped)} from the hot tier)")
