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
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:  # a straggler may write late
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


def test_page_names_the_words_the_model_cannot_read_and_offers_the_query_to_try(server):
    dom = chromium("--dump-dom", f"{server}/?q={urllib.parse.quote('two red circles')}").stdout
    assert dom.count('class="result"') == 24, dom[-3000:]  # answered, for the corrected query
    assert "showing results for" in dom and "(not in the model's vocabulary: circles)" in dom, dom[-3000:]
    assert '<a href="#">two red circle</a>' in dom and '<a href="#">two red circles</a>' in dom  # and as typed


def devtools_eval(page_url: str, steps: list[str], timeout: float = 60) -> list:
    """Open ``page_url`` in headless Chromium and evaluate each JavaScript expression of ``steps`` in turn (promises
    awaited) over the DevTools protocol -> their values."""
    import asyncio
    import json
    import re
    import time

    import websockets

    async def run(ws_url):
        async with websockets.connect(ws_url, max_size=None) as ws:
            out, n = [], 0
            for expr in steps:
                for _attempt in range(50):  # the page may still be navigating: its first context goes away
                    n += 1
                    await ws.send(json.dumps({"id": n, "method": "Runtime.evaluate", "params": {
                        "expression": expr, "awaitPromise": True, "returnByValue": True}}))
                    msg = json.loads(await ws.recv())
                    while msg.get("id") != n:
                        msg = json.loads(await ws.recv())
                    if "context was destroyed" not in msg.get("error", {}).get("message", ""):
                        break
                    await asyncio.sleep(0.1)
                assert "result" in msg, msg
                out.append(msg["result"]["result"].get("value"))
            return out

    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:  # a straggler may write late
        proc = subprocess.Popen([CHROMIUM, *[f for f in FLAGS if not f.startswith("--virtual-time")],
                                 f"--user-data-dir={profile}", "--remote-debugging-port=0", page_url],
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            deadline, port = time.monotonic() + timeout, None
            while port is None and time.monotonic() < deadline:
                m = re.search(r"ws://127\.0\.0\.1:(\d+)/", proc.stderr.readline())
                port = m and m.group(1)
            targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=10).read())
            page = next(t for t in targets if t["type"] == "page")
            return asyncio.run(asyncio.wait_for(run(page["webSocketDebuggerUrl"]), timeout))
        finally:
            stop_process_group(proc)


def stop_process_group(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGKILL Chromium and every process it started (renderer, GPU, crashpad), and wait until all are gone: a
    child still writing would make the profile folder's removal fail."""
    import os
    import signal
    import time

    pgid = os.getpgid(proc.pid)
    os.killpg(pgid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)  # anyone left in the group?
        except ProcessLookupError:
            return
        time.sleep(0.05)


def test_page_sends_the_key_it_is_given(serve_env, tmp_path):
    """With keys, the page asks for one, sends it with the search, and shows the images it fetched with it."""
    from serve.auth import FileKeys, new_key

    token, rec = new_key("default", "read", rate=0)
    FileKeys(tmp_path / "keys.json", create=True).add(rec)
    wait = "new Promise(r => setTimeout(r, 3000))"
    with running_server(serve_env.idx, "--keys", str(tmp_path / "keys.json")) as url:
        got = devtools_eval(f"{url}/?q=a+red+circle", [
            wait, "document.getElementById('status').textContent",
            f"document.getElementById('key').value = {token!r}; document.getElementById('key').onchange(); "
            "document.getElementById('form').requestSubmit(); 1", wait,
            "[...document.querySelectorAll('img.result')].filter(i => i.src.startsWith('blob:') && "
            "i.naturalWidth > 0).length"])
    assert "needs an API key" in got[1]
    assert got[4] == 24
