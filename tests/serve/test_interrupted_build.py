"""A build killed midway (SIGKILL, no cleanup possible) never leaves a half index that loads."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmgeo.search.store import Gallery, GalleryError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sigkill_during_build_keeps_the_old_index(serve_env, tmp_path):
    target = tmp_path / "live"
    shutil.copytree(serve_env.folder_idx, target)
    before = (target / "manifest.json").read_text()
    cmd = [sys.executable, "-m", "serve", "build", "--ckpt", str(serve_env.ckpt), "--data", "synthetic",
           "--limit", "5000", "--batch-size", "4", "--out", str(target), "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            tmp = list(tmp_path.glob(".live.building-*"))
            if tmp and len(list((tmp[0] / "images").glob("*.png"))) >= 8:  # encoding is under way
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"build ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert list(tmp_path.glob(".live.building-*")), "the killed build's temp dir is where it was left"
    g = Gallery(target)  # the old index, untouched
    assert (target / "manifest.json").read_text() == before and len(g) == 5
    with pytest.raises(GalleryError, match="no manifest.json"):  # the leftover is not an index
        Gallery(next(tmp_path.glob(".live.building-*")))
    # the next build clears the dead build's leftovers
    from mmgeo.search.build import build_gallery, folder_items

    items, n = folder_items(serve_env.folder)
    build_gallery(serve_env.model, items, n, target, progress=False)
    assert not list(tmp_path.glob(".live.building-*")) and len(Gallery(target)) == 5
