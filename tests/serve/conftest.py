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

from tests.pg import fresh_database, server_url
from tests.search.conftest import make_gallery_env, single_thread_faiss  # noqa: F401 (autouse fixture)


@pytest.fixture(scope="session")
def serve_env(tmp_path_factory):
    """The tiny model, its checkpoint and two built galleries (``tests.search.conftest.make_gallery_env``)."""
    return make_gallery_env(tmp_path_factory)


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory) -> str:
    """A real PostgreSQL + pgvector for the session (tests/pg.py; skipped without the pgserver wheel)."""
    return server_url(tmp_path_factory)


@pytest.fixture
def pg_url(pg_server) -> str:
    """A fresh empty database on it."""
    return fresh_database(pg_server)


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
