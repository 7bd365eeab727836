"""Shared fixtures: ``serve_env`` (a tiny model, an index of synthetic images, an index of a folder with a corrupt
file: ``tests.search.conftest``); ``running_server`` starts ``python -m serve run`` in a subprocess."""

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.search.conftest import (  # noqa: F401 (fixtures: one autouse, the PostgreSQL ones)
    make_gallery_env,
    pg_server,
    pg_url,
    single_thread_faiss,
)


@pytest.fixture(scope="session")
def serve_env(tmp_path_factory):
    """The tiny model, its checkpoint and two built galleries (``tests.search.conftest.make_gallery_env``)."""
    return make_gallery_env(tmp_path_factory)


@contextlib.contextmanager
def running_server(index, *args: str, timeout: float = 60):
    """``python -m serve run --index INDEX *args`` (no ``--index`` when INDEX is None: ``--db URL`` in args) on a free
    loopback port -> its URL; stopped afterwards."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    where = [] if index is None else ["--index", str(index)]
    proc = subprocess.Popen([sys.executable, "-m", "serve", "run", *where, "--port", str(port), *args],
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
