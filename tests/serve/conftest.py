"""Shared fixtures: a tiny model, an index of synthetic images, an index of a folder with a corrupt file;
``running_server`` starts ``python -m serve run`` in a subprocess."""

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from tests.conftest import TINY


def write_folder(folder):
    """Five small PNG/JPEG images of different sizes, one corrupt .png, one non-image .txt."""
    folder.mkdir(parents=True, exist_ok=True)
    colours = ["red", "green", "blue", "yellow", "purple"]
    for i, c in enumerate(colours):
        im = Image.new("RGB", (40 + 8 * i, 32 + 4 * i), "white")
        im.paste(Image.new("RGB", (16, 16), c), (4 * i, 8))
        im.save(folder / (f"img{i}.png" if i % 2 == 0 else f"img{i}.jpg"))
    (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    (folder / "notes.txt").write_text("not an image, ignored by suffix")
    return folder


@pytest.fixture(scope="session")
def serve_env(tmp_path_factory):
    import mmgeo
    from serve.cli import main

    root = tmp_path_factory.mktemp("serve")
    torch.manual_seed(0)
    model = mmgeo.create_model("geo-tiny", **TINY).eval()
    ckpt = mmgeo.save_model(model, root / "tiny.pt")
    idx, folder_idx = root / "idx", root / "folder_idx"
    assert main(["build", "--ckpt", str(ckpt), "--data", "synthetic", "--split", "test", "--limit", "24",
                 "--out", str(idx), "--no-progress", "--batch-size", "8"]) == 0
    folder = write_folder(root / "photos")
    assert main(["build", "--ckpt", str(ckpt), "--images", str(folder), "--out", str(folder_idx), "--no-progress"]) == 0
    return SimpleNamespace(root=root, ckpt=ckpt, model=mmgeo.load_model(ckpt), idx=idx, folder_idx=folder_idx,
                           folder=folder)


@pytest.fixture(autouse=True, scope="session")
def _single_thread_faiss():
    """FAISS' OpenMP spin-waits badly on a busy 2-core machine (IVF training 0.15 s -> 10 s): use one thread."""
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


@contextlib.contextmanager
def running_server(index, *args: str, timeout: float = 60):
    """``python -m serve run --index INDEX *args`` on a free loopback port -> its URL; stopped afterwards."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "serve", "run", "--index", str(index), "--port", str(port), *args],
                            cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"server did not start: {proc.stderr.read().decode()[-2000:]}") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
