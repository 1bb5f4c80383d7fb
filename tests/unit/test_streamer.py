"""gpuos as CRIU's image streamer (store/streamer.py), against a process that plays CRIU's
side of the protocol (tests/streaming_criu.py): files come through whole and checked; a
corrupt chunk never reaches the reader as a file that merely ends early."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpuos.manifest import CRIU_DIR
from gpuos.store import ImageStore
from gpuos.store.content import ImageContent
from gpuos.store.decoders import Decoders
from gpuos.store.streamer import ImageStreamer

from helpers import build_image

CLIENT = str(Path(__file__).parent.parent / "streaming_criu.py")


@pytest.fixture(params=["threads", "decoders"])
def decoders(request, store):
    """The chunks decoded in the streamer's threads, or by decoder processes (decoders.py)."""
    if request.param == "threads":
        yield None
        return
    d = Decoders(store.chunks().root, None, workers=2)
    try:
        assert d.up.wait(30)
        yield d
    finally:
        d.close()
    assert all(p.poll() is not None for p in d.procs)  # the workers end with the pool


def stream(img: Path, out: Path, *names: str, decoders: Decoders | None = None) -> tuple[subprocess.CompletedProcess, bool]:
    """The reader's result, and whether the streamer said every pages image was sent."""
    s = ImageStreamer(ImageContent(img, ImageStore.load(img)), CRIU_DIR, decoders=decoders)
    try:
        out.mkdir()
        assert not s.pages_sent.is_set()
        res = subprocess.run([sys.executable, CLIENT, str(s.directory), str(out), *names], timeout=60)
        return res, s.pages_sent.is_set()
    finally:
        s.close()
        assert not s.directory.exists()


def test_files_come_through_whole(store, tmp_path, decoders):
    img = build_image(store, "job")
    m = ImageStore.load(img)
    names = [f.path.split("/", 1)[1] for f in m.files if f.path.startswith(CRIU_DIR + "/")]
    assert stream(img, tmp_path / "got2", *[n for n in names if not n.startswith("pages-")],
                  decoders=decoders)[1] is False
    res, pages_sent = stream(img, tmp_path / "got", *names, decoders=decoders)
    assert res.returncode == 0 and pages_sent  # what a restore's prefill waits for
    if decoders is not None:
        assert decoders.answered > 0 and sorted(decoders.free) == list(range(decoders.slots))  # all given back
    whole = ImageContent(img, m).materialize((CRIU_DIR,), tmp_path / "whole") / CRIU_DIR
    for n in names:
        assert (tmp_path / "got" / n).read_bytes() == (whole / n).read_bytes(), n


def test_a_file_it_lacks_is_said_not_to_exist(store, tmp_path):
    assert stream(build_image(store, "job"), tmp_path / "got", "no-such.img")[0].returncode == 3


def test_a_corrupt_chunk_kills_the_reader_before_its_file_ends(store, tmp_path, decoders):
    img = build_image(store, "job")
    entry = next(f for f in ImageStore.load(img).files if f.path == f"{CRIU_DIR}/pages-1.img")
    chunk = store.chunks().stored(entry.chunks[-1].id)
    chunk.chmod(0o644)
    chunk.write_bytes(b"x" * chunk.stat().st_size)
    s = ImageStreamer(ImageContent(img, ImageStore.load(img)), CRIU_DIR, decoders=decoders)
    try:
        (tmp_path / "got").mkdir()
        res = subprocess.run([sys.executable, CLIENT, str(s.directory), str(tmp_path / "got"), "pages-1.img"],
                             timeout=60)
        assert res.returncode == -signal.SIGKILL
        assert not (tmp_path / "got" / "seen").exists()  # it never saw the end of the file
        assert any("is corrupt" in e for e in s.errors), s.errors
        assert decoders is None or decoders.answered > 0
    finally:
        s.close()


def test_a_chunk_its_decoder_died_on_is_read_by_the_streamer_itself(store, tmp_path, monkeypatch):
    """A decoder that dies fails its chunk with an error that is not the image's fault:
    the streamer reads that chunk itself, and CRIU gets every file whole."""
    from concurrent.futures import Future

    from gpuos.errors import GpuosError

    img = build_image(store, "job")
    m = ImageStore.load(img)
    names = [f.path.split("/", 1)[1] for f in m.files if f.path.startswith(CRIU_DIR + "/")]
    d = Decoders(store.chunks().root, None, workers=1)
    failed = []

    def dying(chunk, verify, where):
        fut: Future = Future()
        fut.set_exception(GpuosError("chunk decoder 1 died (exit -9)"))
        failed.append(chunk.id)
        return fut

    monkeypatch.setattr(d, "submit", dying)
    try:
        res, pages_sent = stream(img, tmp_path / "got", *names, decoders=d)
    finally:
        d.close()
    assert res.returncode == 0 and pages_sent and failed
    whole = ImageContent(img, m).materialize((CRIU_DIR,), tmp_path / "whole") / CRIU_DIR
    for n in names:
        assert (tmp_path / "got" / n).read_bytes() == (whole / n).read_bytes(), n
