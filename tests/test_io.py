"""mmgeo.io.StagedDir: replacing a directory never leaves no target, fsyncs what it swaps in, and recognises the
leftovers of dead builds by their lock (not a PID)."""

import errno
import os
import subprocess
import sys

import pytest

import mmgeo.io as mio
from mmgeo.io import StagedDir, remove_stale_staging, restore_interrupted


def _tree(root):
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def _stage(target, files):
    s = StagedDir.next_to(target)
    for name, text in files.items():
        (s.tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (s.tmp / name).write_text(text)
    return s


def _leftovers(tmp_path, name="t"):
    return sorted(p.name for p in tmp_path.glob(f".{name}.*"))


@pytest.fixture(params=["exchange", "two renames"])
def mode(request, monkeypatch):
    if request.param == "two renames":
        def unavailable(src, dst, flags):
            raise OSError(errno.ENOSYS, "no renameat2")
        monkeypatch.setattr(mio, "renameat2", unavailable)
    elif mio._RENAMEAT2 is None:
        pytest.skip("renameat2 is not available here")
    return request.param


def test_commit_creates_and_replaces(tmp_path, mode):
    target = tmp_path / "t"
    _stage(target, {"a": "1", "sub/b": "2"}).commit()
    assert _tree(target) == {"a": "1", "sub/b": "2"} and _leftovers(tmp_path) == []
    _stage(target, {"c": "3"}).commit()
    assert _tree(target) == {"c": "3"} and _leftovers(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names open files through /proc")
def test_commit_fsyncs_every_file_and_directory_before_the_swap(tmp_path, monkeypatch):
    target = tmp_path / "t"
    _stage(target, {"old": "0"}).commit()
    s = _stage(target, {"a": "1", "sub/b": "2"})
    synced, real = [], os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    swapped = []
    monkeypatch.setattr(os, "fsync", fsync)
    real_swap = mio.renameat2
    monkeypatch.setattr(mio, "renameat2", lambda *a: (swapped.append(list(synced)), real_swap(*a))[1])
    s.commit()
    before = set(swapped[0]) if swapped else set(synced)
    assert {str(s.tmp / "a"), str(s.tmp / "sub" / "b"), str(s.tmp / "sub"), str(s.tmp)} <= before
    if swapped:  # exchange: the parent directory is fsynced after it
        assert synced[-1] == str(tmp_path) and str(tmp_path) not in before


def test_live_build_is_left_alone_and_dead_one_removed(tmp_path):
    target = tmp_path / "t"
    live = _stage(target, {"a": "1"})  # its lock is held by this open file description
    remove_stale_staging(target)
    assert live.tmp.is_dir() and live.lock.is_file()
    code = ("import sys, time; from pathlib import Path; from mmgeo.io import StagedDir; "
            "s = StagedDir.next_to(Path(sys.argv[1])); print(s.tmp, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(target)], stdout=subprocess.PIPE, text=True)
    try:
        other = proc.stdout.readline().strip()
        assert os.path.isdir(other)
        remove_stale_staging(target)
        assert os.path.isdir(other), "a running build (another process, alive) keeps its staging dir"
    finally:
        proc.kill()
        proc.wait()
    # its PID is dead now, but what counts is the lock: the kernel released it with the process
    remove_stale_staging(target)
    assert not os.path.exists(other) and not os.path.exists(other + ".lock")
    assert live.tmp.is_dir()
    live.discard()
    assert _leftovers(tmp_path) == []


def test_lock_not_pid_decides(tmp_path):
    """A leftover named after a live PID (this one, as another host's build could be) whose lock is free is
    stale; one whose lock is held is not, whatever its name."""
    target = tmp_path / "t"
    stale = tmp_path / f".t.building-{os.getpid()}-abcd"
    stale.mkdir()
    (stale / "x").write_text("half")
    (tmp_path / f"{stale.name}.lock").write_text("")
    remove_stale_staging(target)
    assert _leftovers(tmp_path) == []


def test_complete_old_index_left_after_exchange_is_removed(tmp_path):
    """Killed after the exchange, before removing the old directory: the target is the new one, the leftover
    (a complete old directory at the staging path) goes."""
    target = tmp_path / "t"
    target.mkdir()
    (target / "manifest.json").write_text("new")
    old = tmp_path / ".t.building-1-dead"
    old.mkdir()
    (old / "manifest.json").write_text("old")
    (tmp_path / ".t.building-1-dead.lock").write_text("")
    StagedDir.next_to(target).discard()
    assert _tree(target) == {"manifest.json": "new"} and _leftovers(tmp_path) == []


def test_killed_between_fallback_renames_restores_the_old_one(tmp_path):
    target = tmp_path / "t"
    (tmp_path / ".t.old-1-dead").mkdir()
    (tmp_path / ".t.old-1-dead" / "manifest.json").write_text("old")
    (tmp_path / ".t.building-1-dead").mkdir()
    (tmp_path / ".t.building-1-dead" / "manifest.json").write_text("new")
    (tmp_path / ".t.building-1-dead.lock").write_text("")
    assert restore_interrupted(target)  # what Gallery does before loading
    assert _tree(target) == {"manifest.json": "old"}
    s = StagedDir.next_to(target)  # the next build removes the rest
    assert _leftovers(tmp_path) == sorted([s.tmp.name, s.lock.name])
    s.discard()
    assert _leftovers(tmp_path) == [] and _tree(target) == {"manifest.json": "old"}


def test_old_dir_of_a_live_build_is_not_restored(tmp_path):
    target = tmp_path / "t"
    s = StagedDir.next_to(target)  # alive (lock held)
    old = s.tmp.with_name(s.tmp.name.replace(".building-", ".old-"))
    old.mkdir()
    assert not restore_interrupted(target) and not target.exists() and old.is_dir()
    old.rmdir()
    s.discard()


def test_exchange_swaps_two_directories(tmp_path):
    if mio._RENAMEAT2 is None:
        pytest.skip("renameat2 is not available here")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("a")
    (tmp_path / "b").mkdir()
    try:
        mio.renameat2(tmp_path / "a", tmp_path / "b", mio.RENAME_EXCHANGE)
    except OSError as err:
        pytest.skip(f"this filesystem has no RENAME_EXCHANGE: {err}")
    assert (tmp_path / "b" / "f").read_text() == "a" and not any((tmp_path / "a").iterdir())
    with pytest.raises(OSError) as err:
        mio.renameat2(tmp_path / "nope", tmp_path / "b", mio.RENAME_EXCHANGE)
    assert err.value.errno == errno.ENOENT
