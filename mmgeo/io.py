"""Atomic writes, the one mechanism for files and directories: write next to the target, then rename.

- ``atomic_path(path)``: a file (checkpoints, configs, metrics) appears whole or not at all.
- ``StagedDir.next_to(target)``: a directory (a gallery index) is built in a temp directory beside it and
  swapped in by ``commit``; ``discard`` removes it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path


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


@dataclass
class StagedDir:
    """Temp directory next to the target; ``commit`` swaps it in, ``discard`` removes it."""

    target: Path
    tmp: Path

    @classmethod
    def next_to(cls, target: Path) -> StagedDir:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.building-{os.getpid()}-", dir=target.parent))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the index should read like any directory
        return cls(target, tmp)

    def commit(self) -> None:
        old = None
        if self.target.exists():
            old = self.target.with_name(f".{self.target.name}.old-{os.getpid()}")
            os.replace(self.target, old)
        os.replace(self.tmp, self.target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def remove_stale_staging(target: Path) -> None:
    """Remove temp dirs left by killed builds of ``target`` (their process is gone)."""
    for d in target.parent.glob(f".{target.name}.building-*"):
        try:
            pid = int(d.name.rsplit(".building-", 1)[1].split("-")[0])
            os.kill(pid, 0)  # still running: leave it
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, IndexError, PermissionError):
            pass
