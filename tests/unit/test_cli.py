"""The gpuos command as a script sees it: output, --json, exit codes.

Runs the real command in a subprocess with a private GPUOS_HOME.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

from gpuos import procs
from gpuos.manifest import FORMAT_VERSION, MANIFEST_NAME
from gpuos.store import ImageStore

from helpers import build_image, gpuos, gpuos_env, gpuos_json, make_manifest, tree_digest, write_criu_files

# criu is looked up before a command looks at its pid or image; any executable file
# passes the lookup, and these commands fail before criu would be run.
ANY_EXECUTABLE = "/bin/true"


@pytest.fixture
def env(home):
    return gpuos_env(home.home)


def one_error_line(res, code: int, progress: bool = False) -> str:
    """The error: one line on stderr, the only one (or, for commands that report progress on
    stderr, the last one and the only one starting with 'gpuos:')."""
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.splitlines()
    if progress:
        assert [ln for ln in lines if ln.startswith("gpuos:")] == lines[-1:], res.stderr
    else:
        assert len(lines) == 1, res.stderr
    assert lines[-1].startswith("gpuos: ")
    assert res.stdout == ""
    return lines[-1]


def test_images_list_on_empty_store(env, home):
    res = gpuos(env, "images", "list")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["NAME", "CREATED", "SIZE", "OWN", "SHARED", "PID", "GPU", "COMMAND"]
    assert str(home.store) in res.stderr
    code, data = gpuos_json(env, "images", "list")
    assert code == 0 and data == {"ok": True, "store": str(home.store), "images": [], "chunk_bytes": 0,
                                  "chunks": 0, "hot_bytes": 0}


def test_images_list_shows_good_and_broken_images(env, store):
    build_image(store, "good", manifest=make_manifest("good", pids=(777,)))
    write_criu_files(store.root / "half" / "criu")
    code, data = gpuos_json(env, "images", "list")
    assert code == 0
    by_name = {i["name"]: i for i in data["images"]}
    assert sorted(by_name) == ["good", "half"]
    assert by_name["good"]["pids"] == [777] and by_name["good"]["problem"] is None
    assert by_name["good"]["size"] == ImageStore.load(store.root / "good").total_size
    assert "incomplete" in by_name["half"]["problem"]
    human = gpuos(env, "images", "list").stdout
    assert "BROKEN" in human and "good" in human


def test_store_option_overrides_home(env, tmp_path):
    other = ImageStore(tmp_path / "elsewhere")
    build_image(other, "there")
    code, data = gpuos_json(env, "--store", str(other.root), "images", "list")
    assert code == 0 and [i["name"] for i in data["images"]] == ["there"]


def test_images_show(env, store):
    img = build_image(store, "job")
    m = ImageStore.load(img)
    code, data = gpuos_json(env, "images", "show", "job")
    assert code == 0
    assert data["path"] == str(img) and data["size"] == m.total_size
    assert data["manifest"] == json.loads(json.dumps(asdict(m)))
    res = gpuos(env, "images", "show", str(img))  # by path too
    assert res.returncode == 0 and str(img) in res.stdout and "python3 job.py" in res.stdout


def test_images_verify_ok(env, store):
    img = build_image(store, "job")
    res = gpuos(env, "images", "verify", "job")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"{img}: OK, 3 files, {_human(ImageStore.load(img).total_size)}"
    code, data = gpuos_json(env, "images", "verify", "job")
    assert code == 0 and data["ok"] is True and data["files"] == 3


def _human(n: int) -> str:
    from gpuos.cli.output import human_bytes
    return human_bytes(n)


def _corrupt(store: ImageStore, img: Path) -> None:
    """Flip a byte of the chunk that holds the start of criu/pages-1.img."""
    entry = next(f for f in ImageStore.load(img).files if f.path == "criu/pages-1.img")
    chunk = store.chunks().stored(entry.chunks[0].id)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.chmod(0o644)
    chunk.write_bytes(bytes(data))


def test_images_verify_corrupt_exits_10_with_one_line(env, store):
    _corrupt(store, build_image(store, "job"))
    line = one_error_line(gpuos(env, "images", "verify", "job"), 10)
    assert "(criu/pages-1.img at byte 0) is corrupt" in line


def test_json_error_object(env, store):
    _corrupt(store, build_image(store, "job"))
    code, data = gpuos_json(env, "images", "verify", "job")
    assert code == 10
    assert data["ok"] is False and data["exit_code"] == 10 and data["error"] == "image-corrupt"
    assert "is corrupt" in data["message"]


def test_incomplete_and_unknown_format(env, store):
    write_criu_files(store.root / "half" / "criu")
    assert "incomplete" in one_error_line(gpuos(env, "images", "verify", "half"), 10)
    img = build_image(store, "future")
    text = (img / MANIFEST_NAME).read_text().replace(f'"format_version": {FORMAT_VERSION}', '"format_version": 99')
    (img / MANIFEST_NAME).write_text(text)
    one_error_line(gpuos(env, "images", "show", "future"), 11)


def test_checkpoint_missing_pid_exits_3(env):
    if procs.exists(999999):
        pytest.skip("pid 999999 exists here")
    line = one_error_line(gpuos(env, "--criu", ANY_EXECUTABLE, "checkpoint", "999999"), 3,
                          progress=True)
    assert "999999" in line
    code, data = gpuos_json(env, "--criu", ANY_EXECUTABLE, "checkpoint", "999999")
    assert code == 3 and data["error"] == "no-such-process" and data["exit_code"] == 3


def test_restore_missing_image_exits_9(env, home):
    line = one_error_line(gpuos(env, "--criu", ANY_EXECUTABLE, "restore", "nosuch"), 9)
    assert str(home.store / "nosuch") in line


@pytest.mark.parametrize("args", [["images", "show", "bad name"], ["images", "verify", ".hidden"],
                                  ["--criu", ANY_EXECUTABLE, "restore", "bad;name"]])
def test_bad_image_name_exits_1(env, args):
    assert "bad image name" in one_error_line(gpuos(env, *args), 1)


def test_missing_criu_exits_5_and_leaves_the_process(env, processes):
    proc = processes.sleeper()
    before = procs.stat(proc.pid)
    line = one_error_line(gpuos(env, "--criu", "/nonexistent", "checkpoint", str(proc.pid)), 5,
                          progress=True)
    assert "/nonexistent" in line
    after = procs.stat(proc.pid)
    assert (after.starttime, after.ppid) == (before.starttime, before.ppid) and after.state != "Z"
    assert proc.poll() is None


def test_missing_criu_from_environment_exits_5(home, processes):
    proc = processes.sleeper()
    env = gpuos_env(home.home, criu="/nonexistent/criu")
    line = one_error_line(gpuos(env, "checkpoint", str(proc.pid)), 5, progress=True)
    assert "/nonexistent/criu" in line
    assert proc.poll() is None


def test_usage_error_exits_2(env):
    assert gpuos(env, "checkpoint", "not-a-pid").returncode == 2
    assert gpuos(env, "no-such-command").returncode == 2


def test_help_lists_exit_codes(env):
    res = gpuos(env, "--help")
    assert res.returncode == 0 and "19 process left stopped" in res.stdout


def test_images_rm(env, store):
    build_image(store, "a")
    b = build_image(store, "b", seed=b"b")
    digest = tree_digest(b)
    res = gpuos(env, "images", "rm", "a")
    assert res.returncode == 0 and res.stdout.strip() == f"removed {store.root / 'a'}"
    assert sorted(os.listdir(store.root)) == [".chunks", "b"] and tree_digest(b) == digest
    # a's chunks (those b does not share) went with it; b's are all there
    assert set(store.chunks().present()) == set(ImageStore.load(b).chunk_set())
    assert "freed" in res.stderr
    store.verify(b, ImageStore.load(b))
    one_error_line(gpuos(env, "images", "rm", "a"), 9)


def test_recover_with_nothing_to_do(env):
    res = gpuos(env, "recover")
    assert res.returncode == 0 and res.stdout.strip() == "nothing to recover"
    code, data = gpuos_json(env, "recover")
    assert code == 0 and data == {"ok": True, "actions": []}


def test_images_rm_refuses_a_directory_that_is_not_an_image(env, tmp_path):
    """`images rm` deletes images, broken ones too (a criu/ without a manifest), but not any
    directory a path happens to name."""
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    res = gpuos(env, "images", "rm", str(precious))
    assert res.returncode != 0, res.stdout
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_images_rm_removes_a_broken_image(env, store):
    write_criu_files(store.root / "half" / "criu")
    res = gpuos(env, "images", "rm", "half")
    assert res.returncode == 0, res.stderr
    assert not (store.root / "half").exists()


def _host_has_gpu() -> bool:
    try:
        from gpuos.cudadrv import CudaDriver
        CudaDriver()
        return True
    except Exception:  # noqa: BLE001 - any failure means no usable GPU
        return False


@pytest.mark.skipif(_host_has_gpu(), reason="this host has a GPU: tests/gpu runs the demo")
def test_demo_without_a_gpu_says_so_in_one_line(env):
    res = gpuos(env, "demo")
    one_error_line(res, 16)


def test_checkpoint_as_non_root_exits_4(home, processes, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from gpuos.cli.main import cli
    target = processes.counter(tmp_path / "count.log")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # as an ordinary user sees it
    res = CliRunner().invoke(cli, ["--criu", ANY_EXECUTABLE, "checkpoint", str(target.pid), "--json"])
    assert res.exit_code == 4, res.output
    out = json.loads(res.output)
    assert out["error"] == "not-permitted" and "root" in out["message"]
    assert procs.alive(target.pid)


def test_images_warm_cool_and_gc(env, store, home):
    """warm copies an image's chunks into the hot tier ($GPUOS_HOT) and says how much;
    cool drops them; gc frees what no image uses, and says busy (exit 18) while a
    restore or checkpoint holds the store; list shows own and shared bytes."""
    from helpers import build_v4_image

    a = build_image(store, "a", seed=b"a")
    build_image(store, "b", seed=b"a")  # the same content: everything shared
    code, data = gpuos_json(env, "images", "warm", "a")
    total = sum(ImageStore.load(a).chunk_set().values())
    assert code == 0 and data["bytes"] == total and data["copied"] == total
    assert Path(data["hot"]).is_relative_to(home.hot)
    assert gpuos_json(env, "images", "warm", "a")[1]["copied"] == 0
    code, data = gpuos_json(env, "images", "list")
    assert data["hot_bytes"] == total
    rows = {i["name"]: i for i in data["images"]}
    assert rows["a"]["own_bytes"] == 0 and rows["a"]["shared_bytes"] == total
    code, data = gpuos_json(env, "images", "cool", "a")
    assert code == 0 and data["dropped"] == total
    assert gpuos_json(env, "images", "list")[1]["hot_bytes"] == 0
    build_v4_image(store, "old")
    assert "without chunks" in one_error_line(gpuos(env, "images", "warm", "old"), 1)
    with store.chunks().shared():
        assert "in use" in one_error_line(gpuos(env, "images", "gc"), 18)
    code, data = gpuos_json(env, "images", "gc")
    assert code == 0 and data["chunks"] == 0 and data["kept"] == len(store.chunks().present())
