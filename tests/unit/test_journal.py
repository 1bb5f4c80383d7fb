"""Operation journals and recover(): what a killed gpuos leaves is finished or undone.

A dead owner is a real process that created an Operation and exited; a live
one is a real process that still holds its operation's lock.  GPU processes
are real sleeping processes (recover() asks /proc whether they live) whose GPU
side is a FakeDriver.
"""

from __future__ import annotations

import json
import hashlib
import os
from dataclasses import asdict
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpuos.config import Paths
from gpuos.cudadrv import CHECKPOINTED, LOCKED, RUNNING
from gpuos.errors import Busy, GpuosError
from gpuos.journal import JournalRecord, Operation, pid_lock, recover
from gpuos.manifest import CRIU_DIR, MANIFEST_NAME
from gpuos.store import ImageStore
from gpuos.store.content import ingest, staged_files

from fakes import FakeDriver
from helpers import (Processes, build_image, dead_operation, draft_of, hidden_entries, journals,
                     live_operation, make_manifest, tree_digest, write_criu_files)


@pytest.fixture
def driver() -> FakeDriver:
    return FakeDriver()


def lock_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("op-*.lock"))


# -- the journal itself -----------------------------------------------------------------

def test_operation_journals_each_phase_and_finish_removes_it(home: Paths):
    op = Operation(home.run, "checkpoint")
    rec = json.loads(op.journal_path.read_text())
    assert rec["kind"] == "checkpoint" and rec["phase"] == "prepare" and rec["owner_pid"] == os.getpid()
    with op.phase("criu-dump"):
        assert json.loads(op.journal_path.read_text())["phase"] == "criu-dump"
    assert "criu-dump" in op.timings
    JournalRecord(**json.loads(op.journal_path.read_text()))  # readable back
    op.finish()
    assert journals(home.run) == [] and lock_files(home.run) == []


def test_pid_lock_is_exclusive_across_processes(home: Paths, processes: Processes):
    # Another gpuos (a live process) holds the pid lock: this one is Busy.
    code = ("import sys, time; from pathlib import Path; from gpuos.journal import pid_lock\n"
            "with pid_lock(Path(sys.argv[1]), 4242):\n    print('held', flush=True); time.sleep(1000)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(home.run)], stdout=subprocess.PIPE, text=True)
    processes.children.append(holder)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(Busy) as exc:
        with pid_lock(home.run, 4242):
            pass
    assert exc.value.exit_code == 18
    with pid_lock(home.run, 4243):  # other pids are free
        pass
    holder.kill()
    holder.wait()
    with pid_lock(home.run, 4242):  # and the lock goes with its holder
        pass


# -- putting GPU processes back -----------------------------------------------------------

@pytest.mark.parametrize("kind", ["checkpoint", "restore"])
def test_recover_restores_and_unlocks_a_checkpointed_process(home, store, driver, processes, kind):
    pid = processes.sleeper().pid
    driver.add(pid, state=CHECKPOINTED)
    dead_operation(home.run, kind, phase="criu-dump", gpu_pids=[pid])
    actions = recover(home.run, store, lambda: driver)
    assert driver.states[pid] == RUNNING
    assert driver.calls_for(pid) == ["state", "restore", "unlock"]
    assert driver.restore_pairs[pid] == {}
    assert all(a.ok for a in actions)
    assert any(f"restored and unlocked pid {pid}" in a.action for a in actions)
    assert journals(home.run) == [] and lock_files(home.run) == []


def test_recover_unlocks_a_locked_process(home, store, driver, processes):
    pid = processes.sleeper().pid
    driver.add(pid, state=LOCKED)
    dead_operation(home.run, "checkpoint", phase="gpu-checkpoint", gpu_pids=[pid])
    actions = recover(home.run, store, lambda: driver)
    assert driver.states[pid] == RUNNING
    assert driver.calls_for(pid) == ["state", "unlock"]
    assert [a.ok for a in actions] == [True, True]
    assert journals(home.run) == []


def test_recover_handles_every_pid_of_the_journal(home, store, driver, processes):
    a, b, c = (processes.sleeper().pid for _ in range(3))
    driver.add(a, state=CHECKPOINTED)
    driver.add(b, state=LOCKED)
    driver.add(c, state=RUNNING)
    dead_operation(home.run, "checkpoint", phase="gpu-checkpoint", gpu_pids=[a, b, c])
    recover(home.run, store, lambda: driver)
    assert [driver.states[p] for p in (a, b, c)] == [RUNNING] * 3
    assert driver.calls_for(c) == ["state"]
    assert journals(home.run) == []


def test_recover_skips_a_process_that_is_gone(home, store, driver, processes):
    gone = processes.start(["true"])
    gone.wait()
    driver.add(gone.pid, state=CHECKPOINTED)
    dead_operation(home.run, "checkpoint", phase="checksum", gpu_pids=[gone.pid])
    actions = recover(home.run, store, lambda: driver)
    assert driver.calls_for(gone.pid) == []
    assert any(f"pid {gone.pid} is gone" in a.action for a in actions)
    assert journals(home.run) == []


def test_failed_put_back_keeps_the_journal_for_a_retry(home, store, driver, processes):
    pid = processes.sleeper().pid
    driver.add(pid, state=CHECKPOINTED)
    driver.fail("restore", pid, GpuosError("cuCheckpointProcessRestore (pid x) failed: CUDA_ERROR_UNKNOWN"))
    dead_operation(home.run, "restore", phase="gpu-restore", gpu_pids=[pid])
    first = recover(home.run, store, lambda: driver)
    assert [a.ok for a in first] == [False]
    assert "CUDA_ERROR_UNKNOWN" in first[0].action
    assert driver.states[pid] == CHECKPOINTED
    assert len(journals(home.run)) == 1
    second = recover(home.run, store, lambda: driver)
    assert [a.ok for a in second] == [True]
    assert driver.states[pid] == RUNNING
    assert journals(home.run) == [] and lock_files(home.run) == []


def test_driver_is_not_needed_without_gpu_pids(home, store):
    def no_driver():
        raise AssertionError("driver opened for a journal without GPU processes")
    dead_operation(home.run, "restore", phase="criu-restore", gpu_pids=[])
    assert recover(home.run, store, no_driver) == []
    assert journals(home.run) == []


# -- finishing or dropping the staged image ----------------------------------------------

def _checkpoint_journal(home: Paths, store: ImageStore, name: str, phase: str, **extra) -> tuple[Path, Path]:
    final = store.resolve(name)
    staging_pattern = store.staging_for(final, "{op}")
    fields = dict(phase=phase, staging=str(staging_pattern), final=str(final),
                  draft=draft_of(make_manifest(name, pids=(4242, 4243))))
    fields.update(extra)
    op_id = dead_operation(home.run, "checkpoint", **fields)
    return store.staging_for(final, op_id), final


@pytest.mark.parametrize("manifest_written", [False, True], ids=["checksum", "publish"])
def test_recover_publishes_a_completed_dump(home, store, driver, manifest_written):
    old = build_image(store, "job", seed=b"old")
    old_digest = tree_digest(old)
    staging, final = _checkpoint_journal(home, store, "job", "publish" if manifest_written else "checksum")
    write_criu_files(staging / CRIU_DIR, seed=b"new")
    new_files = {k: v for k, v in tree_digest(staging).items() if k != MANIFEST_NAME}
    if manifest_written:  # killed in publish: chunks stored, the manifest written, files not yet dropped
        written = make_manifest("job", pids=(4242, 4243), chunk_dir="../.chunks")
        with store.chunks().shared():
            written.files, _ = ingest(staged_files(staging), store.chunks())
        written.timings = {"criu-dump": 0.5}
        ImageStore.write_manifest(staging, written)

    actions = recover(home.run, store, lambda: driver)

    assert all(a.ok for a in actions), actions
    assert any("published" in a.action for a in actions)
    m = ImageStore.load(final)
    store.verify(final, m)
    assert {f.path for f in m.files} == set(new_files)
    for f in m.files:
        got = b"".join(store.chunks().read(c) for c in f.chunks)
        assert hashlib.sha256(got).hexdigest() == new_files[f.path]
    assert sorted(p.name for p in final.iterdir()) == [MANIFEST_NAME]  # the files dropped
    assert new_files != {k: v for k, v in old_digest.items() if k != MANIFEST_NAME}
    assert [p.pid for p in m.processes] == [4242, 4243]  # the journal's draft, not a guess
    assert m.name == "job" and m.leave_running is False
    assert m.timings == ({"criu-dump": 0.5} if manifest_written else {"recovered": 1.0})
    assert sorted(os.listdir(store.root)) == [".chunks", "job"]
    assert journals(home.run) == [] and lock_files(home.run) == []
    assert driver.calls == []


@pytest.mark.parametrize("staging_state", ["no-log", "log-without-success", "no-draft", "empty"])
def test_recover_deletes_an_incomplete_image_and_keeps_the_previous(home, store, driver, staging_state):
    old = build_image(store, "job", seed=b"old")
    old_digest = tree_digest(old)
    extra = {"draft": None} if staging_state == "no-draft" else {}
    staging, final = _checkpoint_journal(home, store, "job", "criu-dump", **extra)
    if staging_state == "empty":
        (staging / CRIU_DIR).mkdir(parents=True)
    else:
        write_criu_files(staging / CRIU_DIR, seed=b"new", complete=staging_state == "no-draft")
        if staging_state == "no-log":
            (staging / CRIU_DIR / "dump.log").unlink()

    actions = recover(home.run, store, lambda: driver)

    assert all(a.ok for a in actions)
    assert any("deleted incomplete image" in a.action for a in actions)
    assert not staging.exists()
    assert tree_digest(final) == old_digest
    assert sorted(os.listdir(store.root)) == [".chunks", "job"]
    assert journals(home.run) == []


def test_recover_of_incomplete_first_image_leaves_no_image(home, store, driver):
    staging, final = _checkpoint_journal(home, store, "job", "criu-dump")
    write_criu_files(staging / CRIU_DIR, complete=False)
    recover(home.run, store, lambda: driver)
    assert not final.exists() and not staging.exists()
    assert list(store.entries()) == []


def test_recover_leaves_a_live_operation_alone(home, store, driver, processes):
    pid = processes.sleeper().pid
    driver.add(pid, state=CHECKPOINTED)
    final = store.resolve("job")
    op_id, owner = live_operation(processes, home.run, "checkpoint", phase="checksum", gpu_pids=[pid],
                                  staging=str(store.staging_for(final, "{op}")), final=str(final),
                                  draft=draft_of(make_manifest("job")))
    staging = store.staging_for(final, op_id)
    write_criu_files(staging / CRIU_DIR)
    staged = tree_digest(staging)

    assert recover(home.run, store, lambda: driver) == []
    assert driver.calls == [] and driver.states[pid] == CHECKPOINTED
    assert tree_digest(staging) == staged and not final.exists()
    assert len(journals(home.run)) == 1

    owner.send_signal(signal.SIGKILL)  # now its gpuos is dead: the same journal is recovered
    owner.wait()
    actions = recover(home.run, store, lambda: driver)
    assert all(a.ok for a in actions)
    assert driver.states[pid] == RUNNING
    store.verify(final, ImageStore.load(final))
    assert journals(home.run) == []


@pytest.mark.parametrize("run_dir_exists", [True, False], ids=["run-dir", "no-run-dir"])
def test_recover_deletes_stale_staging_without_journal(home, store, driver, run_dir_exists):
    if run_dir_exists:
        home.run.mkdir(parents=True)
    build_image(store, "job")
    digest = tree_digest(store.root / "job")
    stale = [store.staging_for(store.root / "job", "0123456789ab"),
             store.staging_for(store.root / "gone", "rm-12345")]
    for s in stale:
        write_criu_files(s / CRIU_DIR)
    (store.root / ".not-staging").mkdir()
    actions = recover(home.run, store, lambda: driver)
    assert all(a.ok for a in actions)
    assert sum("deleted stale" in a.action for a in actions) == 2
    assert not any(s.exists() for s in stale)
    assert hidden_entries(store.root) == [".not-staging"]
    assert tree_digest(store.root / "job") == digest


def test_recover_reports_an_unreadable_journal_and_goes_on(home, store, driver, processes):
    home.run.mkdir(parents=True)
    (home.run / "op-garbage.json").write_text("{not json")
    pid = processes.sleeper().pid
    driver.add(pid, state=LOCKED)
    dead_operation(home.run, "restore", phase="unlock", gpu_pids=[pid])
    actions = recover(home.run, store, lambda: driver)
    assert any(not a.ok and "unreadable journal" in a.action for a in actions)
    assert driver.states[pid] == RUNNING


def test_recover_without_run_dir(home, store, driver):
    assert recover(home.run, store, lambda: driver) == []


# -- races and crash windows --------------------------------------------------------------

def test_crash_after_publish_exchange_keeps_the_new_image(home, store, driver):
    """publish() swaps the new image in with RENAME_EXCHANGE and only then deletes the old
    one, now at the staging path.  A gpuos killed between the two leaves a journal in phase
    'publish' whose staging directory holds the *old* (complete) image.  Recovery must not
    publish that over the new one."""
    build_image(store, "job", seed=b"old")
    staging, final = _checkpoint_journal(home, store, "job", "publish")
    write_criu_files(staging / CRIU_DIR, seed=b"new")
    new = make_manifest("job", pids=(4242, 4243), chunk_dir="../.chunks")
    with store.chunks().shared():
        new.files, _ = ingest(staged_files(staging), store.chunks())
    ImageStore.write_manifest(staging, new)
    ImageStore.drop_files(staging)
    # The exchange happened; the kill came before the old image was deleted.
    os.rename(final, staging.with_name("swap"))
    os.rename(staging, final)
    os.rename(staging.with_name("swap"), staging)
    new_digest = tree_digest(final)

    recover(home.run, store, lambda: driver)

    assert tree_digest(final) == new_digest, "recovery replaced the new image by the old one's files"
    assert not staging.exists()
    assert journals(home.run) == []


def test_recover_spares_staging_of_an_operation_started_while_it_runs(home, store, processes):
    """recover() notes which staging directories live journals speak for, then works through
    the orphans (checksumming a large image can take minutes), then deletes every other
    staging directory.  A checkpoint that starts in between must keep its staging directory."""
    pid = processes.sleeper().pid
    driver = FakeDriver()
    driver.add(pid, state=LOCKED)
    dead_operation(home.run, "restore", phase="unlock", gpu_pids=[pid])
    final = store.resolve("job")
    started: list[Path] = []

    def factory():  # called while recover() handles the orphan: another checkpoint starts now
        op_id, _ = live_operation(processes, home.run, "checkpoint", phase="criu-dump",
                                  staging=str(store.staging_for(final, "{op}")), final=str(final))
        staging = store.staging_for(final, op_id)
        (staging / CRIU_DIR).mkdir(parents=True)
        started.append(staging)
        return driver

    recover(home.run, store, factory)
    assert started and started[0].is_dir(), "recover() deleted the staging dir of a live checkpoint"


def test_recover_spares_staging_created_before_the_journal_names_it(home, store, driver, processes):
    """checkpoint() journals its Operation, then creates the staging directory, and records
    it in the journal only at its first phase.  A recover() by another gpuos in that window
    must not delete the live operation's staging directory."""
    final = store.resolve("job")
    op_id, _ = live_operation(processes, home.run, "checkpoint")  # journal: staging None
    staging = store.staging_for(final, op_id)
    (staging / CRIU_DIR).mkdir(parents=True)
    recover(home.run, store, lambda: driver)
    assert staging.is_dir(), "recover() deleted the staging dir of a live checkpoint"


@pytest.mark.parametrize("kept", [True, False], ids=["chunks-kept", "chunks-gone"])
def test_recover_publishes_gpu_memory_the_copier_stored_unless_its_chunks_are_gone(home, store, driver, kept):
    """A gpuos killed after its copier put a process's GPU memory into the chunk store (the
    chunk list journaled) and after CRIU's dump: recovery publishes the image with those
    chunks; if they were collected meanwhile, it deletes the staged image rather than
    publish one without the memory."""
    from gpuos.manifest import MovableMemory, MovableRange
    from gpuos.store.content import Source, StreamIn

    data = os.urandom(4 << 20)
    mem = MovableMemory(pid=4242, file="gpu-memory-4242.bin", bytes=len(data),
                        ranges=[MovableRange(base=1 << 40, size=len(data), reserved=len(data), device=0)])
    with store.chunks().shared():
        into = StreamIn(store.chunks(), Source(mem.file, Path("/nonexistent"), len(data)))
        into.feed(data[: 2 << 20])
        into.feed(data[2 << 20:])
        entry = into.close()
    if not kept:
        for c in entry.chunks:
            store.chunks().stored(c.id).unlink()
    staging, final = _checkpoint_journal(
        home, store, "job", "store",
        movable=[{"pid": 4242, "staging": "/nonexistent", "memory": asdict(mem), "stored": asdict(entry)}])
    write_criu_files(staging / CRIU_DIR, seed=b"new")
    actions = recover(home.run, store, lambda: driver)
    said = " ".join(a.action for a in actions)
    if kept:
        assert "published image" in said, said
        m = ImageStore.load(final)
        assert m.movable == [mem] and next(f for f in m.files if f.path == mem.file).chunks == entry.chunks
        store.verify(final, m)
    else:
        assert "chunks of its GPU memory are gone" in said, said
        assert not final.exists() and not staging.exists()
