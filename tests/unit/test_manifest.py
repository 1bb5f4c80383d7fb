"""manifest.json: round trip, versioning, and refusing what is not a manifest."""

from __future__ import annotations

import json

import pytest

from gpuos.errors import ImageCorrupt, ImageFormatUnsupported
from gpuos.manifest import (FORMAT, FORMAT_VERSION, Chunk, DriverInfo, FileEntry, GpuInfo, Manifest,
                            ProcessInfo, TerminalInfo)

from fakes import gpu_uuid
from helpers import make_manifest


def full_manifest() -> Manifest:
    gpu = GpuInfo(uuid=gpu_uuid(1), name="NVIDIA H100 80GB HBM3", memory_total=80 << 30,
                  memory_used_by_image=3 << 30)
    m = make_manifest("job", pids=(100, 101), gpu=True, gpus=[gpu],
                      driver=DriverInfo("580.65.06", 13000), leave_running=True)
    m.processes[1].tids = [101, 105, 106]
    m.chunk_dir = "../.chunks"
    m.files = [FileEntry("criu/pages-1.img", 4096, [Chunk("ab" * 32, 4000), Chunk("ef" * 32, 96)], mode=0o600,
                         uid=0, gid=0),
               FileEntry("criu/dump.log", 10, [Chunk("cd" * 32, 10)])]
    m.timings = {"lock": 0.5, "criu-dump": 1.25}
    return m


def test_round_trip_preserves_every_field():
    m = full_manifest()
    text = m.to_json()
    back = Manifest.from_json(text)
    assert back == m
    assert isinstance(back.processes[0], ProcessInfo)
    assert isinstance(back.gpus[0], GpuInfo)
    assert isinstance(back.driver, DriverInfo)
    assert isinstance(back.files[0], FileEntry) and isinstance(back.files[0].chunks[0], Chunk)
    assert back.chunked and back.chunk_set() == {"ab" * 32: 4000, "ef" * 32: 96, "cd" * 32: 10}
    assert back.to_json() == text


def test_version_4_files_read_with_their_sha256_and_no_chunks():
    data = json.loads(full_manifest().to_json())
    data["format_version"] = 4
    del data["chunk_dir"]
    data["files"] = [{"path": "criu/pages-1.img", "size": 4096, "sha256": "ab" * 32, "pieces": []}]
    back = Manifest.from_json(json.dumps(data))
    assert not back.chunked and back.files[0].sha256 == "ab" * 32 and back.files[0].chunks == []
    assert back.chunk_set() == {}


def test_json_carries_format_and_total_size():
    data = json.loads(full_manifest().to_json())
    assert data["format"] == FORMAT == "gpuos-image"
    assert data["format_version"] == FORMAT_VERSION
    assert data["total_size"] == 4096 + 10


def test_round_trip_without_driver():
    m = make_manifest("cpu-only")
    assert m.driver is None
    assert Manifest.from_json(m.to_json()) == m


def test_total_size_is_recomputed_not_trusted():
    data = json.loads(full_manifest().to_json())
    data["total_size"] = 1
    assert Manifest.from_json(json.dumps(data)).total_size == 4106


@pytest.mark.parametrize("version", [0, 6, 99, "1", None])
def test_unknown_format_version_is_unsupported(version):
    data = json.loads(full_manifest().to_json())
    data["format_version"] = version
    with pytest.raises(ImageFormatUnsupported) as exc:
        Manifest.from_json(json.dumps(data), where="x/manifest.json")
    assert exc.value.exit_code == 11
    assert "x/manifest.json" in exc.value.message


def test_version_1_image_still_reads():
    """Version 1 (before terminals were recorded) reads as an image with none."""
    data = json.loads(full_manifest().to_json())
    data["format_version"] = 1
    del data["terminals"]
    m = Manifest.from_json(json.dumps(data))
    assert m.terminals == [] and m.format_version == 1
    assert m.processes == full_manifest().processes


def test_terminals_round_trip():
    m = full_manifest()
    m.terminals = [TerminalInfo(path="/dev/pts/3", rdev=(136 << 8) | 3, dev=25)]
    back = Manifest.from_json(m.to_json())
    assert back == m and back.terminals[0].criu_key == "tty[8803:19]"


def test_missing_format_version_is_unsupported():
    data = json.loads(full_manifest().to_json())
    del data["format_version"]
    with pytest.raises(ImageFormatUnsupported):
        Manifest.from_json(json.dumps(data))


@pytest.mark.parametrize("text", ["", "{", "not json at all", "\x00\x01", "[1, 2]", "null", "42",
                                  '"gpuos-image"'])
def test_garbage_is_corrupt(text):
    with pytest.raises(ImageCorrupt) as exc:
        Manifest.from_json(text)
    assert exc.value.exit_code == 10


@pytest.mark.parametrize("fmt", ["criu-image", "", None, 1])
def test_wrong_format_is_corrupt(fmt):
    data = json.loads(full_manifest().to_json())
    data["format"] = fmt
    with pytest.raises(ImageCorrupt, match="not a gpuos image manifest"):
        Manifest.from_json(json.dumps(data))


def test_missing_format_is_corrupt():
    data = json.loads(full_manifest().to_json())
    del data["format"]
    with pytest.raises(ImageCorrupt):
        Manifest.from_json(json.dumps(data))


@pytest.mark.parametrize("key", ["name", "created", "root_pid", "processes", "gpus", "driver",
                                 "files", "timings", "criu_options", "leave_running"])
def test_missing_key_is_corrupt(key):
    data = json.loads(full_manifest().to_json())
    del data[key]
    with pytest.raises(ImageCorrupt, match="malformed"):
        Manifest.from_json(json.dumps(data))


@pytest.mark.parametrize("mangle", [
    lambda d: d["processes"][0].pop("tids"),
    lambda d: d["processes"].append(7),
    lambda d: d["files"][0].pop("size"),
    lambda d: d["files"][0]["chunks"].append("ab" * 32),
    lambda d: d["files"][0]["chunks"][0].pop("size"),
    lambda d: d["gpus"][0].update(extra=1),
    lambda d: d.update(processes=5),
    lambda d: d.update(driver={"version": "1"}),
    lambda d: d.update(unexpected_field=True),
], ids=["process-key", "process-not-object", "file-key", "chunk-not-object", "chunk-key", "gpu-extra-key", "processes-not-list",
        "driver-key", "top-level-extra"])
def test_malformed_entries_are_corrupt(mangle):
    data = json.loads(full_manifest().to_json())
    mangle(data)
    with pytest.raises(ImageCorrupt):
        Manifest.from_json(json.dumps(data))


def test_all_ids_includes_pids_and_tids_once_sorted():
    m = full_manifest()
    assert m.all_ids() == [100, 101, 105, 106]


def test_gpu_pids():
    m = make_manifest("x", pids=(10, 11))
    m.processes[1].uses_gpu = True
    assert m.gpu_pids == [11]


def test_version_2_terminals_read_as_not_a_shell_job():
    """Version 2 recorded terminals without session_outside: each reads as a terminal the
    image's own session leader held (restored with --inherit-fd, as then)."""
    m = full_manifest()
    m.terminals = [TerminalInfo(path="/dev/pts/3", rdev=(136 << 8) | 3, dev=25, session_outside=True)]
    data = json.loads(m.to_json())
    data["format_version"] = 2
    del data["terminals"][0]["session_outside"]
    back = Manifest.from_json(json.dumps(data))
    assert back.format_version == 2 and back.terminals[0].session_outside is False


def test_movable_memory_round_trips_and_version_3_reads_without_it():
    from gpuos.manifest import MovableMemory, MovableRange
    m = full_manifest()
    m.movable = [MovableMemory(pid=11, file="gpu-memory-11.bin", bytes=4 << 20,
                               ranges=[MovableRange(base=0x7F0000000000, size=3 << 20, reserved=4 << 20, device=0)])]
    back = Manifest.from_json(m.to_json())
    assert back.movable == m.movable and back.format_version == 5
    data = json.loads(full_manifest().to_json())
    data["format_version"] = 3
    del data["movable"]
    assert Manifest.from_json(json.dumps(data)).movable == []
