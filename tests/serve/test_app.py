"""HTTP level: every endpoint, and every bad input answered by a 4xx JSON error while the server stays up."""

import io
import struct
import zlib

import numpy as np
import pytest
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from PIL import Image

from serve.app import Limits, SearchResponse, create_app

LIMITS = Limits(max_text_chars=200, max_k=50, k_prime=10, max_upload_bytes=100_000, max_image_pixels=1_000_000)


@pytest.fixture(scope="module")
def client(serve_env):
    with TestClient(create_app(serve_env.idx, limits=LIMITS)) as c:
        yield c


def png_bytes(size=(40, 40), colour="red", noise=False) -> bytes:
    im = Image.fromarray(np.random.default_rng(0).integers(0, 255, (*size[::-1], 3), dtype=np.uint8)) if noise \
        else Image.new("RGB", size, colour)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def bomb_png(width=30_000, height=30_000) -> bytes:
    """A tiny PNG whose header claims width×height pixels (over PIL's decompression-bomb limit)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def assert_ok_after(client):
    r = client.post("/search", json={"text": "a red circle", "k": 3})
    assert r.status_code == 200 and len(r.json()["results"]) == 3


@pytest.mark.parametrize("rerank", [True, False])
def test_search_ranks_images(client, rerank):
    r = client.post("/search", json={"text": "a big red circle in the center", "k": 5, "rerank": rerank})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert len(res) == 5 and len({x["id"] for x in res}) == 5
    assert [x["score"] for x in res] == sorted((x["score"] for x in res), reverse=True)
    assert all(x["url"] == f"/images/{x['id']}" for x in res)
    # rendered in the batch's worker thread: the documented shape, the bytes FastAPI's JSONResponse would send
    assert r.headers["content-type"] == "application/json"
    answer = SearchResponse.model_validate_json(r.content)
    assert (answer.query, answer.rerank) == ("a big red circle in the center", rerank)
    assert r.content == JSONResponse(r.json()).body


def test_search_image_and_image_file(client, serve_env):
    first = (serve_env.idx / "images" / "0000000.png").read_bytes()
    r = client.post("/search/image", files={"file": ("q.png", first, "image/png")}, params={"k": 4})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert len(res) == 4 and res[0]["id"] == 0 and res[0]["score"] == pytest.approx(1.0, abs=1e-4)
    img = client.get(res[0]["url"])
    assert img.status_code == 200 and img.headers["content-type"] == "image/png" and img.content == first


def test_explain_returns_a_png_heatmap(client):
    r = client.get("/explain", params={"id": 2, "text": "a red circle on the left"})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    im = Image.open(io.BytesIO(r.content))
    assert im.format == "PNG" and im.width > 100


def test_health_metrics_docs_and_page(client):
    assert client.get("/health").json() == {"status": "ok", "auth": "none", "images": 24, "index_type": "flat",
                                            "skipped_at_build": 0, "codec": "fp16",
                                            "store_bytes_per_image": 2 * 16 * 16 * 2 + 16}
    client.get("/images/1")
    text = client.get("/metrics").text
    assert 'mmgeo_requests_total{method="GET",endpoint="/health",status="200"}' in text
    assert 'mmgeo_request_seconds_bucket{endpoint="/health",le="+Inf"}' in text
    assert "mmgeo_index_images 24" in text and "# TYPE mmgeo_request_seconds histogram" in text
    assert client.get("/metrics").headers["content-type"].startswith("text/plain")
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/search", "/search/image", "/explain", "/health", "/metrics"} <= set(paths)
    assert client.get("/docs").status_code == 200
    page = client.get("/")
    assert page.status_code == 200 and "<input id=\"q\"" in page.text and "/explain?id=" in page.text


BAD_SEARCH = [
    ({"text": "", "k": 5}, 422, "text is empty"),
    ({"text": "   \n\t", "k": 5}, 422, "text is empty"),
    ({"text": "red " * 100, "k": 5}, 422, "over the limit of 200"),
    ({"text": "a red circle", "k": 0}, 422, "k must be between 1 and 50"),
    ({"text": "a red circle", "k": -3}, 422, "k must be between 1 and 50"),
    ({"text": "a red circle", "k": 51}, 422, "k must be between 1 and 50"),
    ({"text": "a red circle", "k": "many"}, 422, "k:"),
    ({"k": 5}, 422, "text: Field required"),
    ({"text": 42}, 422, "text:"),
]


@pytest.mark.parametrize("body,status,message", BAD_SEARCH)
def test_bad_search_bodies(client, body, status, message):
    r = client.post("/search", json=body)
    assert r.status_code == status and message in r.json()["error"], r.text
    assert_ok_after(client)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2", b"\xff\xfe"])
def test_malformed_json(client, raw):
    r = client.post("/search", content=raw, headers={"content-type": "application/json"})
    assert r.status_code in (400, 422) and "error" in r.json(), r.text
    if raw:
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]
    assert_ok_after(client)


@pytest.mark.parametrize("name,data,status,message", [
    ("notes.txt", b"just some text", 400, "not a readable image"),
    ("empty.png", b"", 400, "upload is empty"),
    ("trunc.png", png_bytes()[:60], 400, "not a readable image"),
    ("big.png", png_bytes((300, 300), noise=True), 413, "request body is over the limit"),  # refused unread
    ("bigger.png", png_bytes((186, 186), noise=True), 413, "upload is over the limit of 100000 bytes"),
    ("wide.png", png_bytes((1100, 1000)), 413, "too many pixels"),  # over our 1M-pixel limit
    ("bomb.png", bomb_png(), 413, "decompression bomb"),  # over PIL's own bomb limit
])
def test_bad_uploads(client, name, data, status, message):
    r = client.post("/search/image", files={"file": (name, data, "image/png")})
    assert r.status_code == status and message in r.json()["error"], r.text
    assert_ok_after(client)


def test_oversized_json_body_is_refused_unread(client):
    r = client.post("/search", json={"text": "red " * 50_000, "k": 3})
    assert r.status_code == 413 and "request body is over the limit" in r.json()["error"]
    chunked = client.post("/search", content=iter([b"x" * 40_000] * 3), headers={"content-type": "application/json"})
    assert chunked.status_code == 413 and "request body is over the limit" in chunked.json()["error"]
    assert_ok_after(client)


def test_upload_needs_a_file_and_a_valid_k(client):
    r = client.post("/search/image")
    assert r.status_code == 422 and "file" in r.json()["error"]
    r = client.post("/search/image", files={"file": ("a.png", png_bytes(), "image/png")}, params={"k": 0})
    assert r.status_code == 422 and "k must be" in r.json()["error"]


@pytest.mark.parametrize("path,status,message", [
    ("/images/24", 404, "unknown image id 24"),
    ("/images/999999", 404, "unknown image id"),
    ("/images/abc", 400, "must be a non-negative integer"),
    ("/images/-1", 400, "must be a non-negative integer"),
    ("/images/1.5", 400, "must be a non-negative integer"),
    ("/images/..%2F..%2Fetc%2Fpasswd", 400, "must be a non-negative integer"),
    ("/images/%2e%2e%2fmanifest.json", 400, "must be a non-negative integer"),
    ("/images/0%2F..%2F..%2Fmanifest.json", 400, "must be a non-negative integer"),
    ("/images/", 400, "must be a non-negative integer"),
    ("/nowhere", 404, "no such endpoint"),
])
def test_bad_image_ids_and_traversal(client, path, status, message):
    r = client.get(path)
    assert r.status_code == status and message in r.json()["error"], r.text
    assert b"root:" not in r.content and b"mmgeo-gallery" not in r.content
    assert_ok_after(client)


@pytest.mark.parametrize("params,status,message", [
    ({"id": 99, "text": "a red circle"}, 404, "unknown image id"),
    ({"id": "x", "text": "a red circle"}, 400, "non-negative integer"),
    ({"id": 1, "text": "  "}, 422, "text is empty"),
    ({"id": 1, "text": "red " * 100}, 422, "over the limit"),
    ({"id": 1}, 422, "text: Field required"),
])
def test_bad_explain(client, params, status, message):
    r = client.get("/explain", params=params)
    assert r.status_code == status and message in r.json()["error"], r.text
    assert_ok_after(client)


def test_errors_are_counted_in_metrics(client):
    client.get("/images/abc")
    text = client.get("/metrics").text
    assert 'endpoint="/images/{raw_id:path}",status="400"' in text


def test_folder_index_serves_original_files(serve_env):
    with TestClient(create_app(serve_env.folder_idx)) as c:
        r = c.get("/images/0")
        assert r.status_code == 200 and r.content == (serve_env.folder / "img0.png").read_bytes()
        assert c.get("/images/1").headers["content-type"] == "image/jpeg"
        assert c.get("/health").json()["skipped_at_build"] == 1


def test_app_refuses_a_mismatched_model(serve_env):
    import mmgeo
    from mmgeo.search.store import GalleryError
    from tests.conftest import TINY

    with pytest.raises(GalleryError, match="does not match the index"):
        create_app(serve_env.idx, model=mmgeo.create_model("geo-tiny", **{**TINY, "d_global": 8}))


def test_an_answer_that_cannot_be_rendered_fails_its_query_alone(serve_env, monkeypatch):
    import serve.app as app_module

    real = app_module.search_texts

    def nan_for_bad(model, gallery, emb, ks, reranks, k_prime):  # the real search; NaN scores for the queries
        found = real(model, gallery, emb, ks, reranks, k_prime)  # of `texts` (the batch sent) that start "bad"
        return [(ids, scores * np.nan) if text.startswith("bad") else (ids, scores)
                for text, (ids, scores) in zip(texts, found)]

    monkeypatch.setattr(app_module, "search_texts", nan_for_bad)
    app = create_app(serve_env.idx, limits=LIMITS)
    texts = ["a red circle", "bad query", "a blue square"]
    answers = app.state.batcher.fn([(t, 3, True, True) for t in texts])  # one micro-batch of three queries
    assert isinstance(answers[1], ValueError) and "JSON" in str(answers[1])
    assert [SearchResponse.model_validate_json(answers[i]).query for i in (0, 2)] == ["a red circle", "a blue square"]
    with TestClient(app, raise_server_exceptions=False) as c:
        texts = ["bad query"]
        r = c.post("/search", json={"text": "bad query", "k": 3})
        assert r.status_code == 500 and r.json()["error"] == "internal error" and len(r.json()["request_id"]) == 32
        texts = ["a red circle"]
        assert c.post("/search", json={"text": "a red circle", "k": 3}).status_code == 200


def test_search_names_the_words_the_model_cannot_read_and_a_query_to_try(client):
    r = client.post("/search", json={"text": "two red circles!", "k": 3, "correct": False})
    assert r.status_code == 200, r.text
    answer = SearchResponse.model_validate_json(r.content)
    assert answer.unknown_words == ["circles"] and answer.did_you_mean == "two red circle!"
    assert answer.searched == "two red circles!" and len(answer.results) == 3  # as typed: "circles" ignored
    known = client.post("/search", json={"text": "a red circle", "k": 3}).json()
    assert known["unknown_words"] == [] and known["did_you_mean"] is None and known["searched"] == "a red circle"
    far = client.post("/search", json={"text": "a red zebra", "k": 3}).json()
    assert far["unknown_words"] == ["zebra"] and far["did_you_mean"] is None  # nothing close enough to suggest
    assert far["searched"] == "a red zebra"  # so nothing to correct: searched as typed


def test_search_corrects_a_query_to_its_did_you_mean_by_default(client):
    typed = client.post("/search", json={"text": "two red circles!", "k": 5}).json()
    meant = client.post("/search", json={"text": "two red circle!", "k": 5}).json()
    assert typed["query"] == "two red circles!" and typed["searched"] == "two red circle!"
    assert typed["unknown_words"] == ["circles"] and typed["did_you_mean"] == "two red circle!"
    scores = lambda answer: [r["score"] for r in answer["results"]]  # noqa: E731
    assert scores(typed) == pytest.approx(scores(meant), rel=1e-5, abs=1e-6)  # the corrected query's own answer
    assert {r["id"] for r in typed["results"]} == {r["id"] for r in meant["results"]}
    as_typed = client.post("/search", json={"text": "two red circles!", "k": 5, "correct": False}).json()
    assert scores(as_typed) != pytest.approx(scores(typed), rel=1e-3, abs=1e-4)  # a different search
