"""Files: checksums, and atomic writes — the one mechanism for files and directories: write next to the target, then
rename.

- ``file_sha256(path)``: the hex SHA-256 of a file, read in chunks (checkpoints and codebooks an index records).
- ``atomic_path(path)``: a file (checkpoints, configs, metrics) appears whole or not at all.
- ``StagedDir.next_to(target)``: a directory (a gallery index) is built in ``.NAME.building-<pid>-<random>``
  beside it; ``commit`` fsyncs every file and directory in it and swaps it in; ``discard`` removes it.

Replacing a directory: on Linux ``commit`` exchanges the staged directory and the target in one
``renameat2(RENAME_EXCHANGE)``, so the target always holds a complete directory (the old one, then the new one);
the old one, now at the staging path, is then removed and the parent directory fsynced. Where renameat2 is missing
(not Linux, old kernel or libc, a filesystem without exchange) it falls back to two renames, target ->
``.NAME.old-<pid>-<random>`` then staging -> target, with a window between them where the target is absent.

Leftovers are recognised by a lock, not by a PID: a building process holds an exclusive ``flock`` on
``.NAME.building-<pid>-<random>.lock`` (beside its staging directory) for its whole life, so a leftover whose lock
can be taken is one whose builder is dead (the kernel released its lock; across hosts too on filesystems whose
flock works between hosts, e.g. NFSv4). Without working flock (or without ``fcntl``) leftovers are left alone.
The next build of the same target (``remove_stale_staging``) removes them: a staging directory (half written, or
holding the complete old index when the build died between the exchange and the removal, the target being the new
index then) and an old directory whose target exists. An old directory whose target is missing (a build killed
between the two fallback renames) is renamed back onto the target: the previous index is restored, by the next
build and by ``mmgeo.search.store.Gallery`` before it loads (``restore_interrupted``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import hashlib
import os
import platform
import secrets
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no locks, leftovers are never judged stale
    fcntl = None

AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}  # renameat2 / the flag not available


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temp path next to ``path``; once the block has written it, fsync and rename it onto ``path``.
    A crash or kill mid-write leaves ``path`` as it was (never truncated); an error removes the temp file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file (the checkpoint an index records), read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _libc_renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _libc_renameat2()


def renameat2(src: str | os.PathLike, dst: str | os.PathLike, flags: int) -> None:
    """Linux ``renameat2(2)`` through libc; OSError (ENOSYS where libc or the OS lacks it) on failure."""
    if _RENAMEAT2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available here", str(src))
    if _RENAMEAT2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(src), None, str(dst))


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory (its entries: names created, renamed or removed in it)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every directory, ``root`` last."""
    dirs = []
    for parent, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(parent, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        dirs.append(parent)
    for d in reversed(dirs):  # os.walk is top-down: children before their parents, root last
        fsync_dir(d)


def _try_lock(fd: int) -> bool | None:
    """Take an exclusive flock without waiting: True, False (someone holds it) or None (no working flock here)."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        return False if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) else None


@dataclass
class StagedDir:
    """Temp directory next to the target, locked while its builder lives; ``commit`` swaps it in, ``discard``
    removes it."""

    target: Path
    tmp: Path
    lock: Path | None = None
    lock_fd: int | None = None

    @classmethod
    def next_to(cls, target: Path) -> StagedDir:
        target = Path(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(target)
        token = f"{os.getpid()}-{secrets.token_hex(4)}"
        tmp = target.with_name(f".{target.name}.building-{token}")
        lock = tmp.with_name(tmp.name + ".lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)  # first the lock, then the directory
        try:
            _try_lock(fd)
            os.write(fd, f"{os.getpid()} {platform.node()}\n".encode())  # for people; the lock is what counts
            os.mkdir(tmp)  # with the umask: the index reads like any directory
        except BaseException:
            os.close(fd)
            lock.unlink(missing_ok=True)
            raise
        return cls(target, tmp, lock, fd)

    def commit(self) -> None:
        """fsync the staged tree, swap it in (exchange, or two renames where that is missing), remove the old one."""
        fsync_tree(self.tmp)
        parent = self.target.parent
        if os.path.lexists(self.target):
            try:
                renameat2(self.tmp, self.target, RENAME_EXCHANGE)
            except OSError as err:
                if err.errno not in _UNSUPPORTED:
                    raise
                self._two_renames()
            else:
                fsync_dir(parent)
                if self.tmp.is_symlink():  # the target was a link: the link itself is what was replaced
                    self.tmp.unlink()
                else:
                    shutil.rmtree(self.tmp, ignore_errors=True)  # the old directory, now at the staging path
        else:
            os.replace(self.tmp, self.target)
            fsync_dir(parent)
        self._release()

    def _two_renames(self) -> None:
        """Fallback: target -> .NAME.old-*, staging -> target (no target between the two), remove the old one."""
        old = self.target.with_name(f".{self.target.name}.old-{self.tmp.name.rsplit('.building-', 1)[1]}")
        os.replace(self.target, old)
        try:
            os.replace(self.tmp, self.target)
        except BaseException:
            os.replace(old, self.target)
            raise
        fsync_dir(self.target.parent)
        shutil.rmtree(old, ignore_errors=True)

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._release()

    def _release(self) -> None:
        """Unlink the lock file (after the directory is gone), then drop the lock."""
        if self.lock_fd is not None:
            if self.lock is not None:
                self.lock.unlink(missing_ok=True)
            os.close(self.lock_fd)
            self.lock_fd = None


def _leftovers(target: Path) -> dict[str, dict[str, Path]]:
    """Dead-or-alive build leftovers of ``target`` by token: {"building", "old", "lock"} paths that exist."""
    out: dict[str, dict[str, Path]] = {}
    for kind in ("building", "old"):
        for p in target.parent.glob(f".{glob.escape(target.name)}.{kind}-*"):
            token = p.name.split(f".{kind}-", 1)[1]
            if kind == "building" and token.endswith(".lock"):
                out.setdefault(token[:-5], {})["lock"] = p
            else:
                out.setdefault(token, {})[kind] = p
    return out


@contextlib.contextmanager
def _dead(paths: dict[str, Path]):
    """Yield True while holding the lock of a dead build (or if its lock file is gone); False if it is alive or
    its liveness cannot be told. The lock file is removed once the block has cleaned up."""
    lock = paths.get("lock")
    try:
        fd = os.open(lock, os.O_RDWR) if lock is not None else None
    except FileNotFoundError:
        fd = None
    if fd is None:  # no lock file: it is created before the directory and removed after it, so a dead build
        yield True
        return
    try:
        dead = _try_lock(fd)
        yield bool(dead)
        if dead:
            lock.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _restore(old: Path, target: Path) -> bool:
    """Rename ``old`` back onto a missing ``target`` (never over one that appeared meanwhile)."""
    try:
        renameat2(old, target, RENAME_NOREPLACE)
    except OSError as err:
        if err.errno not in _UNSUPPORTED:
            return False
        if os.path.lexists(target):
            return False
        os.rename(old, target)
    fsync_dir(target.parent)
    return True


def restore_interrupted(target: str | os.PathLike) -> bool:
    """If ``target`` is missing and a dead build left it at ``.NAME.old-*`` (killed between the two renames of
    the fallback), rename it back. -> whether it did."""
    target = Path(target)
    if os.path.lexists(target):
        return False
    olds = [paths for paths in _leftovers(target).values() if "old" in paths]
    for paths in sorted(olds, key=lambda p: _mtime(p["old"]), reverse=True):  # newest first
        with _dead(paths) as dead:
            if dead and os.path.lexists(paths["old"]) and _restore(paths["old"], target):
                return True
    return False


def remove_stale_staging(target: Path) -> None:
    """Clean up after killed builds of ``target``: restore a missing target from ``.NAME.old-*``, then remove the
    staging and old directories (and lock files) of builds whose lock is free; live builds are left alone."""
    target = Path(target)
    restore_interrupted(target)
    for paths in _leftovers(target).values():
        with _dead(paths) as dead:
            if dead:
                for kind in ("building", "old"):
                    if kind in paths:
                        shutil.rmtree(paths[kind], ignore_errors=True)
