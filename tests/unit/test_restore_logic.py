"""restore(): the checks made before anything is restored (GPU plan, pids, driver)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuos.criu import Criu
from gpuos.errors import GpuMismatch, GpuosError, ImageCorrupt, InsufficientGpuMemory, PidTaken
from gpuos.manifest import DriverInfo, GpuInfo
from gpuos.store import ImageStore
from gpuos.restore import check_pids_free, plan_gpus, resolve_onto, restore

from fakes import A100, GIB, H100, FakeDriver, device, gpu_uuid
from helpers import build_image, build_v4_image, journals, make_manifest, tree_digest, zombie


def wanted(n: int, name: str = H100, used: int = 10 * GIB) -> GpuInfo:
    return GpuInfo(uuid=gpu_uuid(n), name=name, memory_total=80 * GIB, memory_used_by_image=used)


# -- plan_gpus ----------------------------------------------------------------------------

def test_same_gpu_when_present():
    assert plan_gpus([wanted(1)], [device(0), device(1)]) == {gpu_uuid(1): gpu_uuid(1)}


def test_same_model_elsewhere_is_remapped():
    assert plan_gpus([wanted(7)], [device(0, A100), device(3, H100)]) == {gpu_uuid(7): gpu_uuid(3)}


def test_two_gpus_map_to_two_distinct_gpus():
    plan = plan_gpus([wanted(7), wanted(8)], [device(0), device(1)])
    assert sorted(plan) == [gpu_uuid(7), gpu_uuid(8)]
    assert sorted(plan.values()) == [gpu_uuid(0), gpu_uuid(1)]


def test_remap_does_not_take_a_gpu_the_image_uses_itself():
    # GPU 1 is here and is the image's second GPU: the first (absent) must go elsewhere.
    plan = plan_gpus([wanted(7), wanted(1)], [device(1), device(2)])
    assert plan == {gpu_uuid(7): gpu_uuid(2), gpu_uuid(1): gpu_uuid(1)}


def test_remap_picks_a_gpu_of_that_model_with_room():
    """docs/image-format.md: 'else onto another GPU of the same name with at least
    memory_used_by_image free'.  The first such GPU being full must not fail the restore."""
    devices = [device(2, free=1 * GIB), device(3, free=70 * GIB)]
    assert plan_gpus([wanted(7, used=10 * GIB)], devices) == {gpu_uuid(7): gpu_uuid(3)}


def test_gpu_option_moves_the_image_to_the_gpu_named():
    devices = [device(0), device(1)]
    for spec in ("1", gpu_uuid(1), f"{gpu_uuid(0)}=1"):
        onto = resolve_onto([spec], [wanted(0)], devices)
        assert plan_gpus([wanted(0)], devices, onto) == {gpu_uuid(0): gpu_uuid(1)}


def test_gpu_option_swaps_two_gpus():
    devices = [device(0), device(1)]
    onto = resolve_onto([f"{gpu_uuid(0)}=1", f"{gpu_uuid(1)}=0"], [wanted(0), wanted(1)], devices)
    assert plan_gpus([wanted(0), wanted(1)], devices, onto) == {gpu_uuid(0): gpu_uuid(1),
                                                                gpu_uuid(1): gpu_uuid(0)}


def test_gpu_option_moves_one_and_places_the_other():
    devices = [device(0), device(1), device(2)]
    onto = resolve_onto([f"{gpu_uuid(0)}=1"], [wanted(0), wanted(1)], devices)
    # The image's GPU 1 is taken by the move: it goes to the one left.
    assert plan_gpus([wanted(0), wanted(1)], devices, onto) == {gpu_uuid(0): gpu_uuid(1),
                                                                gpu_uuid(1): gpu_uuid(2)}


@pytest.mark.parametrize("specs, image, why", [
    (["5"], 1, "no GPU 5 here"),
    (["GPU-nope"], 1, "no GPU GPU-nope here"),
    (["1"], 2, "say which goes where"),
    (["GPU-other=1"], 1, "the image used no GPU GPU-other"),
    ([f"{gpu_uuid(0)}=1", f"{gpu_uuid(1)}=1"], 2, "two of the image's GPUs on one GPU"),
    ([f"{gpu_uuid(0)}=1", f"{gpu_uuid(0)}=0"], 2, "twice"),
])
def test_gpu_option_errors(specs, image, why):
    with pytest.raises(GpuMismatch, match=why) as exc:
        resolve_onto(specs, [wanted(i) for i in range(image)], [device(0), device(1)])
    assert exc.value.exit_code == 12


def test_gpu_option_still_checks_model_and_memory():
    onto = {gpu_uuid(0): gpu_uuid(1)}
    with pytest.raises(GpuMismatch):
        plan_gpus([wanted(0, H100)], [device(0, H100), device(1, A100)], onto)
    with pytest.raises(InsufficientGpuMemory):
        plan_gpus([wanted(0, used=20 * GIB)], [device(0), device(1, free=1 * GIB)], onto)


def test_other_model_is_a_mismatch():
    with pytest.raises(GpuMismatch) as exc:
        plan_gpus([wanted(7, H100)], [device(0, A100)])
    assert exc.value.exit_code == 12
    assert H100 in exc.value.message and A100 in exc.value.message


def test_no_gpu_at_all_is_a_mismatch():
    with pytest.raises(GpuMismatch, match="none"):
        plan_gpus([wanted(7)], [])


def test_same_uuid_but_another_model_is_a_mismatch():
    with pytest.raises(GpuMismatch):
        plan_gpus([wanted(1, H100)], [device(1, A100)])


def test_more_gpus_wanted_than_present_is_a_mismatch():
    with pytest.raises(GpuMismatch):
        plan_gpus([wanted(7), wanted(8)], [device(0)])


def test_not_enough_free_memory_on_the_same_gpu():
    with pytest.raises(InsufficientGpuMemory) as exc:
        plan_gpus([wanted(1, used=20 * GIB)], [device(1, free=19 * GIB)])
    assert exc.value.exit_code == 13
    assert "19456 MiB free" in exc.value.message and "20480 MiB" in exc.value.message


def test_not_enough_free_memory_on_any_gpu_of_the_model():
    with pytest.raises(InsufficientGpuMemory):
        plan_gpus([wanted(7, used=20 * GIB)], [device(0, free=1 * GIB), device(1, free=2 * GIB)])


def test_exactly_enough_memory_is_enough():
    assert plan_gpus([wanted(1, used=5 * GIB)], [device(1, free=5 * GIB)]) == {gpu_uuid(1): gpu_uuid(1)}


# -- check_pids_free ------------------------------------------------------------------------

def test_free_pids_pass(processes):
    gone = processes.start(["true"])
    gone.wait()
    check_pids_free(make_manifest(pids=(gone.pid,)))


def test_live_pid_is_taken(processes):
    pid = processes.sleeper().pid
    with pytest.raises(PidTaken) as exc:
        check_pids_free(make_manifest(pids=(pid,)))
    assert exc.value.exit_code == 14
    assert f"pid {pid}" in exc.value.message and "sleep" in exc.value.message


def test_taken_tid_counts(processes):
    gone = processes.start(["true"])
    gone.wait()
    taken = processes.sleeper().pid
    m = make_manifest(pids=(gone.pid,))
    m.processes[0].tids = [gone.pid, taken]
    with pytest.raises(PidTaken, match=f"pid {taken}"):
        check_pids_free(m)


def test_zombie_pid_is_taken_and_said_so(processes):
    z = zombie(processes)
    with pytest.raises(PidTaken) as exc:
        check_pids_free(make_manifest(pids=(z.pid,)))
    assert "zombie" in exc.value.message


# -- restore() refuses before touching anything ------------------------------------------------

NO_CRIU = Criu(binary=Path("/nonexistent/criu"), plugin_dir=Path("/nonexistent/plugins"))


def gpu_image(store, driver_version: str = "570.86.15", gpu: GpuInfo | None = None, pids=(31000,)):
    g = gpu or wanted(0, used=1 * GIB)
    m = make_manifest("gpujob", pids=pids, gpu=True, gpus=[g],
                      driver=DriverInfo(driver_version, 12080))
    return build_image(store, "gpujob", manifest=m)


def test_driver_version_mismatch_is_refused(home, store):
    img = gpu_image(store, driver_version="570.86.15")
    digest = tree_digest(img)
    driver = FakeDriver(version="580.65.06")
    with pytest.raises(GpuMismatch) as exc:
        restore("gpujob", home.run, store, lambda: driver, NO_CRIU)
    assert exc.value.exit_code == 12
    assert "570.86.15" in exc.value.message and "580.65.06" in exc.value.message
    assert driver.calls == []
    assert journals(home.run) == [] and tree_digest(img) == digest


def test_gpu_model_mismatch_is_refused(home, store):
    gpu_image(store, driver_version="580.65.06")
    driver = FakeDriver(devices=[device(5, A100)], version="580.65.06")
    with pytest.raises(GpuMismatch):
        restore("gpujob", home.run, store, lambda: driver, NO_CRIU)
    assert driver.calls == [] and journals(home.run) == []


def test_insufficient_memory_is_refused(home, store):
    gpu_image(store, driver_version="580.65.06", gpu=wanted(0, used=50 * GIB))
    driver = FakeDriver(devices=[device(0, free=10 * GIB)], version="580.65.06")
    with pytest.raises(InsufficientGpuMemory):
        restore("gpujob", home.run, store, lambda: driver, NO_CRIU)
    assert journals(home.run) == []


def test_pid_taken_is_refused(home, store, processes):
    pid = processes.sleeper().pid
    gpu_image(store, driver_version="580.65.06", pids=(pid,))
    driver = FakeDriver(version="580.65.06")
    with pytest.raises(PidTaken):
        restore("gpujob", home.run, store, lambda: driver, NO_CRIU)
    assert driver.calls == [] and journals(home.run) == []


def test_a_corrupt_format_4_image_is_refused_before_the_driver_is_opened(home, store):
    m = make_manifest("gpujob", pids=(31000,), gpu=True, gpus=[wanted(0, used=1 * GIB)],
                      driver=DriverInfo("570.86.15", 12080))
    img = build_v4_image(store, "gpujob", manifest=m)
    (img / "criu" / "pages-1.img").write_bytes(b"x" * (img / "criu" / "pages-1.img").stat().st_size)

    def no_driver():
        raise AssertionError("driver opened for a corrupt image")
    with pytest.raises(ImageCorrupt):
        restore("gpujob", home.run, store, no_driver, NO_CRIU)
    assert journals(home.run) == []


class CriuNotToRun(Criu):
    """A criu that passes the checks and must never restore."""

    def check_version(self) -> str:
        return "4.2.1"

    def restore(self, *args, **kwargs):
        raise AssertionError("criu ran on an image with a corrupt chunk")

    def command(self, args, verbosity: int = 4):
        raise AssertionError("criu ran on an image with a corrupt chunk")


class CriuThatStreams(Criu):
    """A criu whose restore asks the image streamer for the image's pages, as CRIU does
    (tests/streaming_criu.py, a process of its own), and fails if it cannot read them."""

    def check_version(self) -> str:
        return "4.2.1"

    def restore(self, images, workdir, options, inherit=None, job_tty=None):
        assert "--stream" in options
        workdir.mkdir(parents=True, exist_ok=True)
        res = subprocess.run([sys.executable, str(Path(__file__).parent.parent / "streaming_criu.py"),
                              str(images), str(workdir), "core-4242.img", "pages-1.img"], timeout=60)
        self.seen = (workdir / "seen").read_text() if (workdir / "seen").exists() else ""
        if res.returncode:
            raise GpuosError(f"criu restore failed (exit {res.returncode})")
        raise AssertionError("criu read a whole image with a corrupt chunk")


def corrupt_pages(store) -> Path:
    img = gpu_image(store, driver_version="580.65.06")
    entry = next(f for f in ImageStore.load(img).files if f.path == "criu/pages-1.img")
    chunk = store.chunks().stored(entry.chunks[0].id)
    chunk.chmod(0o644)
    chunk.write_bytes(b"x" * chunk.stat().st_size)
    return img


def test_a_corrupt_chunk_stops_criu_before_it_reads_a_whole_file(home, store):
    corrupt_pages(store)
    driver = FakeDriver(version="580.65.06")
    criu = CriuThatStreams(Path("/bin/false"), home.run)
    with pytest.raises(ImageCorrupt) as exc:
        restore("gpujob", home.run, store, lambda: driver, criu)
    assert exc.value.exit_code == 10
    assert "(criu/pages-1.img at byte 0) is corrupt" in exc.value.message
    assert "nothing was restored" in exc.value.message
    assert criu.seen == "core-4242.img EOF\n"  # killed inside pages-1.img, never at its end
    assert driver.calls == [] and journals(home.run) == []
    assert not list(home.hot.glob("restore-*")) and not list(home.run.glob("restore-*"))


def test_a_corrupt_chunk_is_refused_before_replicas_are_restored(home, store):
    corrupt_pages(store)  # replicas read the image out first: CRIU never starts
    driver = FakeDriver(version="580.65.06")
    with pytest.raises(ImageCorrupt) as exc:
        restore("gpujob", home.run, store, lambda: driver, CriuNotToRun(Path("/bin/false"), home.run), replicas=2)
    assert exc.value.exit_code == 10
    assert "(criu/pages-1.img at byte 0) is corrupt" in exc.value.message
    assert "nothing was restored" in exc.value.message
    assert driver.calls == [] and journals(home.run) == []
    assert not list(home.hot.glob("restore-*")) and not list(home.run.glob("restore-*"))


def test_restore_pairs_complete_a_move_into_a_permutation():
    from gpuos.restore import restore_pairs
    devices = [device(0), device(1), device(2, A100)]
    assert restore_pairs({gpu_uuid(0): gpu_uuid(0)}, devices) == {}
    assert restore_pairs({gpu_uuid(0): gpu_uuid(1)}, devices) == {gpu_uuid(0): gpu_uuid(1),
                                                                  gpu_uuid(1): gpu_uuid(0),
                                                                  gpu_uuid(2): gpu_uuid(2)}
    # From another host: only the image's GPUs are paired.
    assert restore_pairs({gpu_uuid(7): gpu_uuid(1)}, devices) == {gpu_uuid(7): gpu_uuid(1)}
