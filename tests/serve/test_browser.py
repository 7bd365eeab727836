"""The web page in headless Chromium: ``/?q=...`` runs the query and shows result images.

Needs the ``chromium`` binary (Debian: ``apt-get install -y chromium``); skipped without it.
The screenshot is kept under ``$MMGEO_TEST_ARTIFACTS`` (default: the test's tmp dir).
"""

import os
import shutil
import subprocess
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.serve.conftest import running_server

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--virtual-time-budget=10000", "--window-size=1200,900"]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")]


@pytest.fixture(scope="module")
def server(serve_env):
    with running_server(serve_env.idx) as url:
        yield url


def chromium(*args, timeout=60) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                              text=True, timeout=timeout)


def test_page_runs_the_query_from_the_url(server, tmp_path):
    page = f"{server}/?q={urllib.parse.quote('a big red circle in the center')}"
    dom = chromium("--dump-dom", page).stdout
    assert dom.count('class="result"') == 24, dom[-3000:]  # k=24 result <img> elements
    assert 'src="/images/' in dom
    artifacts = Path(os.environ.get("MMGEO_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "serve_page.png"
    chromium(f"--screenshot={shot}", page)
    assert shot.is_file() and shot.stat().st_size > 5_000
