"""A build killed midway (SIGKILL, no cleanup possible) never leaves a half index that loads, nor no index: at every
file operation of a replacing build, the target holds the old index or the new one, and the next build cleans up."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
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
            tmp = [p for p in tmp_path.glob(".live.building-*") if p.is_dir()]
            if tmp and len(list((tmp[0] / "images").glob("*.png"))) >= 8:  # encoding is under way
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"build ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = [p for p in tmp_path.glob(".live.building-*") if p.is_dir()]
    assert left, "the killed build's temp dir is where it was left"
    g = Gallery(target)  # the old index, untouched
    assert (target / "manifest.json").read_text() == before and len(g) == 5
    with pytest.raises(GalleryError, match="no manifest.json"):  # the leftover is not an index
        Gallery(left[0])
    # the next build clears the dead build's leftovers (its lock was released with the process)
    from mmgeo.search.build import build_gallery, folder_items

    items, n = folder_items(serve_env.folder)
    build_gallery(serve_env.model, items, n, target, progress=False)
    assert not list(tmp_path.glob(".live.*")) and len(Gallery(target)) == 5


# Loads the model once, then for each "N MODE CODEC" line on stdin forks a child that builds the new index (re-rank
# store CODEC) over the target with os/shutil/file-write calls counted, SIGKILLing itself at call N (0: never; it
# prints the calls). MODE "fallback" makes renameat2 unavailable (two renames). Answers one line per child: its wait
# status.
DRIVER = r'''
import errno, json, os, pathlib, shutil, signal, sys
import faiss
import torch
import mmgeo
import mmgeo.io
from mmgeo.search.build import build_gallery, folder_items

ckpt, images, target = sys.argv[1:4]
model = mmgeo.load_model(ckpt)
faiss.omp_set_num_threads(1)
torch.set_num_threads(1)
print("ready", flush=True)


def child(kill_at, mode, codec):
    calls = []

    def wrap(owner, name, label):
        real = getattr(owner, name)

        def counted(*a, **k):
            calls.append(label)
            if len(calls) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)
        setattr(owner, name, counted)

    if mode == "fallback":
        def renameat2(src, dst, flags):
            raise OSError(errno.ENOSYS, "renameat2 unavailable (test)")
        mmgeo.io.renameat2 = renameat2
    for owner, name in [(os, "fsync"), (os, "replace"), (os, "rename"), (os, "mkdir"), (os, "unlink"),
                        (os, "rmdir"), (shutil, "rmtree"), (mmgeo.io, "renameat2"), (faiss, "write_index"),
                        (pathlib.Path, "write_text")]:
        wrap(owner, name, name)
    items, n = folder_items(images)
    build_gallery(model, items, n, target, progress=False, codec=codec)
    print(json.dumps(calls), flush=True)


for line in sys.stdin:
    n, mode, codec = line.split()
    pid = os.fork()
    if pid == 0:
        try:
            child(int(n), mode, codec)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    print(f"status {status}", flush=True)
'''


def _state(target: Path, old_manifest: str) -> str:
    g = Gallery(target)  # must load: the old index or the new one, whatever the kill point
    text = (target / "manifest.json").read_text()
    if text == old_manifest:
        assert len(g) == 5
        return "old"
    assert len(g) == 3 and len(json.loads(text)["skipped"]["files"]) == 0, "neither the old nor the new index"
    return "new"


@pytest.mark.slow
def test_sigkill_at_every_step_of_a_replacing_build(serve_env, tmp_path):
    """Kill points: every fsync, rename/replace, renameat2, mkdir, unlink, rmdir, rmtree, write_text and FAISS
    write of a build that replaces an index (also inside the removal of the old one), with the exchange and with
    the two-rename fallback, and of a build with a compressed store (codebooks written, fp16 arrays removed)."""
    from mmgeo.search.build import build_gallery, folder_items

    new_images = tmp_path / "new_photos"  # the new index: 3 of the 5 images of the old one
    new_images.mkdir()
    for name in ("img0.png", "img1.jpg", "img2.png"):
        shutil.copy(serve_env.folder / name, new_images / name)
    target = tmp_path / "idx" / "live"
    target.parent.mkdir()
    old_manifest = (serve_env.folder_idx / "manifest.json").read_text()
    (tmp_path / "driver.py").write_text(DRIVER)
    # one thread everywhere: a child forked from a process whose OpenMP pool has threads can deadlock on its locks
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(serve_env.ckpt), str(new_images),
                             str(target)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    watchdog = threading.Timer(300, proc.kill)  # a hung child fails the test instead of hanging the suite
    watchdog.start()

    def run(n: int, mode: str, codec: str) -> list[str] | None:
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(serve_env.folder_idx, target)
        proc.stdin.write(f"{n} {mode} {codec}\n")
        proc.stdin.flush()
        calls = None
        line = proc.stdout.readline()
        if line.startswith("["):
            calls = json.loads(line)
            line = proc.stdout.readline()
        status = int(line.split()[1])
        assert (calls is None) == (n > 0)
        assert os.WIFSIGNALED(status) == (n > 0) and (n == 0 or os.WTERMSIG(status) == signal.SIGKILL), status
        return calls

    def cleanup_build():
        items, n = folder_items(new_images)
        build_gallery(serve_env.model, items, n, target, progress=False)
        assert sorted(os.listdir(target.parent)) == ["live"], "every leftover is removed by the next build"
        assert _state(target, old_manifest) == "new"

    try:
        assert proc.stdout.readline().strip() == "ready"
        killed = 0
        for mode, codec in (("exchange", "fp16"), ("fallback", "fp16"), ("exchange", "sq8")):
            calls = run(0, mode, codec)
            assert _state(target, old_manifest) == "new" and sorted(os.listdir(target.parent)) == ["live"]
            swap = "renameat2" if mode == "exchange" else "replace"
            first_swap = calls.index(swap) + 1
            # exchange: every call (27 with this gallery); fallback: every call from the commit's first fsync on
            points = list(range(1 if mode == "exchange" else calls.index("fsync") + 1, len(calls) + 1))
            states = []
            if codec != "fp16":  # the codebooks and the removal of the fp16 arrays are among the kill points
                assert calls.count("write_index") > 1 and "unlink" in calls[:first_swap]
            for n in points:
                run(n, mode, codec)
                states.append(_state(target, old_manifest))
                cleanup_build()
                killed += 1
            # old until the swap, new from the call after it (the kill happens before call n runs)
            want = ["old" if n <= first_swap else "new" for n in points]
            if mode == "fallback":  # killed between the two renames: the old index is restored
                want = ["old" if n <= first_swap + 1 else "new" for n in points]
            assert states == want, list(zip(points, [calls[n - 1] for n in points], states))
        assert killed >= 60
    finally:
        watchdog.cancel()
        proc.stdin.close()
        proc.wait(30)
