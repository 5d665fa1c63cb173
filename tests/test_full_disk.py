"""A full disk, for real (issue 22): a SQLite store on a small tmpfs, and on a small ext4 on a
loop device (a block file system: delayed allocation, a journal), is staged into until the
file system is full; once space comes back, staging comes back by itself, and nothing
acknowledged is lost.  Needs root to mount the tmpfs (skipped otherwise).

The store keeps its own 4 MiB checkpoint threshold: when the disk fills, its -wal holds up to
that much of pages the database has not grown to take yet.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from factories import make_record

from store import StagedCallRecord, StorageError, open_store

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("mount") is None,
    reason="needs root to mount a small tmpfs",
)
DISK_BYTES = 12 * 1024 * 1024


def mount_tmpfs(where: Path, size: int) -> None:
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")


def mount_ext4(where: Path, image: Path, size: int) -> None:
    """A block file system (delayed allocation, a journal), on a loop device, no reserved blocks."""
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 is not installed")
    image.write_bytes(b"")
    os.truncate(image, size)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make an ext4 image here: {made.stderr.strip()}")
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(where)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a loop device here: {mounted.stderr.strip()}")


@contextlib.contextmanager
def mounted(tmp_path: Path, kind: str) -> Iterator[Path]:
    where = tmp_path / "disk"
    where.mkdir()
    if kind == "tmpfs":
        mount_tmpfs(where, DISK_BYTES)
    else:
        mount_ext4(where, tmp_path / "disk.img", 2 * DISK_BYTES)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture(params=["tmpfs", "ext4"])
def disk(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    with mounted(tmp_path, request.param) as where:
        yield where


@pytest.fixture
def tmpfs_disk(tmp_path: Path) -> Iterator[Path]:
    """Only a tmpfs: a full ext4 still opens a store (its -shm file finds room), which is fine."""
    with mounted(tmp_path, "tmpfs") as where:
        yield where


def free_bytes(where: Path) -> int:
    disk = os.statvfs(where)
    return disk.f_bfree * disk.f_frsize


def fill(where: Path, leave: int) -> Path:
    filler = where / "filler"
    with open(filler, "wb") as out, contextlib.suppress(OSError):  # OSError: full already
        out.write(b"\0" * max(0, free_bytes(where) - leave))
    return filler


def give_back(filler: Path, amount: int) -> None:
    os.truncate(filler, max(0, filler.stat().st_size - amount))


def record(index: int, tokens: int) -> StagedCallRecord:
    return make_record(rollout_id=f"r{index}", model_call_id="c0", prompt=list(range(tokens)), generated=[1, 2])


def test_staging_comes_back_by_itself_once_space_returns(disk: Path) -> None:
    acknowledged: list[str] = []
    with open_store(disk / "store.db") as store:
        filler = fill(disk, leave=6 * 1024 * 1024)
        index = 0
        with pytest.raises(StorageError, match="disk is full"):
            while index < 10_000:  # the disk fills well before
                key = store.stage(record(index, 2000)).staging_key
                acknowledged.append(key)
                index += 1
        assert len(acknowledged) > 10
        # A little space back: the next stages fit in it.  (A checkpoint that could not finish
        # took it before: the database grew, the -wal did not shrink, and the next stage failed.)
        give_back(filler, 256 * 1024)
        for extra in range(5):
            acknowledged.append(store.stage(record(100_000 + extra, 500)).staging_key)
            time.sleep(0.15)  # the checkpoint thread's retries run meanwhile
        # All of it back: the checkpoint finishes, the -wal restarts, and staging goes on.
        filler.unlink()
        deadline = time.monotonic() + 10
        staged = 0
        while time.monotonic() < deadline and staged < 40:
            acknowledged.append(store.stage(record(200_000 + staged, 2000)).staging_key)
            staged += 1
        assert staged == 40
        assert len(store.fetch(acknowledged)) == len(acknowledged)  # nothing acknowledged was lost
        report = store.audit()
        assert report.ok, report.summary()
    wal = disk / "store.db-wal"
    assert not wal.exists() or wal.stat().st_size < 2 * 1024 * 1024  # given back once checkpointed


def test_opening_a_store_on_a_full_disk_says_the_disk_is_full(tmpfs_disk: Path) -> None:
    """SQLite says "disk I/O error" (it cannot grow the -shm file): the store says why, and
    opens again once there is room, with what it held."""
    disk = tmpfs_disk
    with open_store(disk / "store.db") as store:
        key = store.stage(record(1, 500)).staging_key
    filler = fill(disk, leave=0)
    with pytest.raises(StorageError, match=r"the file system holding .*store\.db is full \(\d[\d,]* bytes free\)"):
        open_store(disk / "store.db").close()
    filler.unlink()
    with open_store(disk / "store.db") as store:
        assert len(store.fetch([key])) == 1


@pytest.mark.parametrize("durability", ["full", "normal"])
@pytest.mark.parametrize("threads", [1, 4])
def test_the_next_stage_after_space_returns_succeeds(disk: Path, durability: str, threads: int) -> None:
    """Issue 33 item 11's four scenarios (one thread and four, full and normal durability): stage
    until the disk is full, keep failing a while, give all the space back; the very next stage
    succeeds and nothing acknowledged is lost.  (Not reproduced failing here: see the issue's
    closing note; this pins the behaviour in every scenario it named.)"""
    import threading

    acknowledged: list[str] = []
    failures: list[str] = []
    lock = threading.Lock()
    with open_store(disk / "store.db", durability=durability) as store:
        filler = fill(disk, leave=6 * 1024 * 1024)

        def stage_until_full(thread: int) -> None:
            for index in range(10_000):
                try:
                    key = store.stage(record(thread * 100_000 + index, 2000)).staging_key
                except StorageError as exc:
                    with lock:
                        failures.append(str(exc))
                        if len(failures) >= 20 * threads:
                            return
                    time.sleep(0.01)
                    continue
                with lock:
                    acknowledged.append(key)

        workers = [threading.Thread(target=stage_until_full, args=(thread,)) for thread in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert acknowledged and all("disk is full" in failure for failure in failures), failures[:1]
        filler.unlink()
        acknowledged.append(store.stage(record(999_999, 500)).staging_key)  # the very next stage
        assert len(store.fetch(acknowledged)) == len(acknowledged)
        report = store.audit()
        assert report.ok, report.summary()


def test_a_store_that_filled_the_disk_itself_stages_once_another_file_goes(disk: Path) -> None:
    """The store's own -wal and database take the last of the space (no filler made after it);
    another file, there before the store, is deleted: the next stage succeeds, nothing lost."""
    spare = disk / "spare"
    spare.write_bytes(b"\0" * (2 * 1024 * 1024))
    acknowledged: list[str] = []
    failures = 0
    with open_store(disk / "store.db") as store:
        index = 0
        while failures < 20 and index < 100_000:
            try:
                acknowledged.append(store.stage(record(index, 2000)).staging_key)
            except StorageError as exc:
                assert "disk is full" in str(exc)
                failures += 1
            index += 1
        assert failures == 20 and len(acknowledged) > 10
        spare.unlink()
        acknowledged.append(store.stage(record(999_999, 500)).staging_key)  # the very next stage
        assert len(store.fetch(acknowledged)) == len(acknowledged)
        report = store.audit()
        assert report.ok, report.summary()
