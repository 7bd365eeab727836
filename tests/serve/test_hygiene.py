"""Service hygiene (docs/serve.md): internal errors hide their detail, metrics labels stay bounded, /explain renders
safely from concurrent worker threads."""

import io
import logging
import random
import re
import string
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from PIL import Image

import serve.app as app_module
from serve.app import create_app
from tests.serve.test_app import LIMITS

SERVE = Path(app_module.__file__).parent


@pytest.fixture(scope="module")
def client(serve_env):
    """Like test_app's client, but a server error becomes a 500 response instead of a raised exception."""
    with TestClient(create_app(serve_env.idx, limits=LIMITS), raise_server_exceptions=False) as c:
        yield c


def _label_sets(client) -> set[frozenset]:
    """Distinct label sets in /metrics (a histogram's ``le`` dropped: its buckets are one series family)."""
    return {frozenset((k, v) for k, v in re.findall(r'(\w+)="([^"]*)"', line) if k != "le")
            for line in client.get("/metrics").text.splitlines() if line.startswith("mmgeo_") and "{" in line}


def test_internal_error_answers_an_id_and_logs_the_detail(client, monkeypatch, caplog):
    def boom(*args, **kwargs):
        raise RuntimeError("secret detail")

    monkeypatch.setattr(app_module, "search_texts", boom)  # what /search's worker thread calls
    with caplog.at_level(logging.ERROR, logger="serve.app"):
        r = client.post("/search", json={"text": "a red circle", "k": 3})
    assert r.status_code == 500
    body = r.json()
    assert set(body) == {"error", "request_id"} and body["error"] == "internal error"
    assert "secret" not in r.text and "RuntimeError" not in r.text and "Traceback" not in r.text
    rid = body["request_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid) and r.headers["x-request-id"] == rid
    logged = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert "secret detail" in caplog.text and "Traceback" in caplog.text  # the detail is in the log only
    monkeypatch.undo()
    assert client.post("/search", json={"text": "a red circle", "k": 3}).status_code == 200


def test_metrics_labels_stay_bounded_under_random_methods_and_paths(client):
    client.get("/health")
    _label_sets(client)
    before = _label_sets(client)  # /metrics itself counted
    rng = random.Random(0)
    word = lambda n: "".join(rng.choices(string.ascii_letters + string.digits, k=n))  # noqa: E731
    sent = []
    for round_ in range(2):
        for i in range(50):
            method = rng.choice(["GET", "POST", "HEAD", "OPTIONS", word(6).upper(), "PROPFIND", "BREW"])
            path = rng.choice([f"/{word(8)}/{word(5)}", f"/images/{word(7)}", "/search", f"/x{round_}-{i}"])
            sent.append((method, path))
            client.request(method, path)
        if round_ == 0:
            first = _label_sets(client)
    after = _label_sets(client)
    # at most 5 method labels × 3 endpoints hit (unmatched, /images/{raw_id:path}, /search; one status each
    # here) + their 3 histograms, while 50 distinct raw (method, path) pairs were sent
    assert len(first - before) <= 18 < len(set(sent[:50])), sorted(first - before)
    assert len(after - first) == 0, sorted(after - first)  # 50 more random requests: no new series
    text = client.get("/metrics").text
    methods = set(re.findall(r'method="([^"]*)"', text))
    endpoints = set(re.findall(r'endpoint="([^"]*)"', text))
    assert methods <= {"GET", "POST", "HEAD", "OPTIONS", "other"} and "other" in methods
    templates = {r.path for r in client.app.routes} | {"unmatched"}
    assert endpoints <= templates and {"unmatched", "/images/{raw_id:path}"} <= endpoints
    assert not any(p in text for _, p in sent if p != "/search")


def test_concurrent_explain_requests_all_render(client):
    asks = [{"id": i % 6, "text": t} for i, t in enumerate(["a red circle on the left", "a small blue square",
                                                              "two shapes", "a big green triangle above a circle"])]
    serial = [client.get("/explain", params=p).content for p in asks]  # one at a time: the expected bytes
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda i: client.get("/explain", params=asks[i % 4]), range(16)))
    for i, r in enumerate(responses):
        assert r.status_code == 200 and r.headers["content-type"] == "image/png", r.text[:200]
        im = Image.open(io.BytesIO(r.content))
        im.load()
        assert im.format == "PNG" and im.width > 100
        assert r.content == serial[i % 4]  # no cross-talk between figures drawn at once


def test_serve_never_imports_pyplot():
    for path in SERVE.glob("*.py"):
        code = path.read_text()
        assert not re.search(r"^\s*(import matplotlib\.pyplot|from matplotlib import pyplot)", code, re.M), path
